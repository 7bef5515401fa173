"""The one builder of raytrain's Ray Train TorchTrainer, for training (launch.py) and for a sweep's
distributed trials: raytrain's worker loop on args.scaling's workers, restarted by FailureConfig, with
raytrain's SIGTERM handler on every worker; a failed worker's own exception comes back to the caller.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from ..deps import require

require("ray", "raytrain")  # before Ray Train's internals below: another Ray is refused in one line

from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from ray.train.torch.config import _TorchBackend  # noqa: E402
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy  # noqa: E402

from ..runtime.threads import explicit_threads  # noqa: E402
from ..worker import ray_worker  # noqa: E402
from ..worker.preemption import install_sigterm_handler  # noqa: E402
from .elastic import FreshViewElasticPolicy  # noqa: E402

__all__ = ["build_torch_trainer", "fit", "scaling_config", "worker_error"]


def scaling_config(scaling):
    """Ray's ScalingConfig for the `scaling` section of TrainingArguments; an elastic range becomes
    Ray's (min, max), whose every resize restarts the group from the latest checkpoint."""
    from ray.train import ScalingConfig

    workers = (scaling.min_workers, scaling.num_workers) if scaling.elastic else scaling.num_workers
    return ScalingConfig(num_workers=workers, use_gpu=scaling.use_gpu,
                         resources_per_worker=scaling.resources_per_worker,
                         placement_strategy=scaling.placement_strategy,
                         elastic_resize_monitor_interval_s=scaling.resize_interval_s)


def build_torch_trainer(trainer, args, *, name: str, storage_path: str | None, resume_from_checkpoint=None,
                        checkpoint_config=None, callbacks: list | None = None, **worker_config):
    """A TorchTrainer that runs `trainer` (pickled with `args`) on args.scaling.num_workers workers as
    run `name` under `storage_path`. `worker_config` travels to every worker beside the trainer
    (ray_worker.train_loop_per_worker reads `datasets`, `progress` and `trial`)."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig

    config = {"trainer": ray_worker.pickle_trainer(trainer, args), "resume_from_checkpoint": resume_from_checkpoint,
              # Workers tell a restart within this fit (same id) from a new run in the same output_dir.
              "run": f"{name}-{os.urandom(4).hex()}",
              # The driver's OMP_NUM_THREADS: the workers' own is Ray's (their CPU count).
              "threads": explicit_threads(), **worker_config}
    return _RaytrainTorchTrainer(
        ray_worker.train_loop_per_worker,
        train_loop_config=config,
        scaling_config=scaling_config(args.scaling),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(
                                 max_failures=args.scaling.max_failures,
                                 max_preemption_failures=args.scaling.max_preemption_failures),
                             checkpoint_config=checkpoint_config, callbacks=callbacks,
                             # Ray Train's INFO lines (resources requested, worker group started, process
                             # group set up) stay in its log files; its warnings still print.
                             logging_config=LoggingConfig(log_level="WARNING")),
        torch_config=_RaytrainTorchConfig(backend=args.ddp_backend, timeout_s=args.ddp_timeout),  # HF's ddp_*
        scaling=args.scaling,
    )


def fit(torch_trainer):
    """torch_trainer.fit(), raising what the failed worker raised (as an in-process run would)."""
    try:
        with _sigint_restored():
            return torch_trainer.fit()
    except Exception as e:
        raise worker_error(e) from e


def worker_error(error: Exception) -> Exception:
    """The user's exception from the worker (rank 0's when it failed), so that the driver raises what
    an in-process run would (ConfigError, FileExistsError, CheckpointError ...); else Ray's error."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures, key=lambda r: (r != 0, r)):
        base = getattr(failures[rank], "_base_exc", None)
        if isinstance(base, Exception):
            return base
    return error


@contextlib.contextmanager
def _sigint_restored():
    """fit() installs Ray's SIGINT handler (abort the run) and leaves it in place: a later Ctrl-C in the
    same Python session would call a finished run's controller. Put the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        yield  # a sweep trial's thread: only the main thread has signal handlers
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _RaytrainTorchBackend(_TorchBackend):
    """Ray's torch backend, plus raytrain's SIGTERM handler on every worker: signal handlers can only be
    set on a process's main thread, which is where Ray runs the worker group's `execute`."""

    def on_training_start(self, worker_group, backend_config):
        super().on_training_start(worker_group, backend_config)
        worker_group.execute(install_sigterm_handler)


class _RaytrainTorchConfig(TorchConfig):
    @property
    def backend_cls(self):
        return _RaytrainTorchBackend


def _start_timeout_env(scaling) -> dict:
    """Ray Train's group-start timeout for this run. A fixed-size group retried after the timeout asks for
    the same workers again, only with a traceback on the console every 60 s: it waits instead (the
    driver bounds the wait, scaling.max_wait_s). An elastic group keeps Ray's timeout (a retry re-decides
    its size). The user's own RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S wins."""
    name = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
    if name in os.environ or scaling.elastic:
        return {}
    return {name: str(10 ** 9)}


class _RaytrainTorchTrainer(TorchTrainer):
    """Ray's TorchTrainer with raytrain's elastic policy (elastic.py), the group-start timeout above, the
    controller's handle passed to on_controller (the driver's wait bound aborts the run through it), and no
    dataset actor for a run without Ray Datasets."""

    def __init__(self, *args, scaling=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.raytrain_scaling, self.on_controller = scaling, None

    def _initialize_and_run_controller(self, **kwargs):
        if isinstance(kwargs.get("scaling_policy"), ElasticScalingPolicy):
            kwargs["scaling_policy"] = FreshViewElasticPolicy(self.scaling_config)
        env = _start_timeout_env(self.raytrain_scaling) if self.raytrain_scaling is not None else {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # Ray propagates it to the controller as it starts
        try:
            return super()._initialize_and_run_controller(**kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _create_default_callbacks(self):
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        # Without Ray Datasets nothing asks for a shard: no DatasetManager actor (a process importing Ray Data,
        # started again at every group start and restart)
        return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    def _register_sigint_handler(self, controller):  # called with the controller's handle (main thread)
        super()._register_sigint_handler(controller)
        if self.on_controller is not None:  # with the id under which Ray Train asks the autoscaler for nodes
            self.on_controller(controller, f"train-{self.train_run_context.run_id}")
