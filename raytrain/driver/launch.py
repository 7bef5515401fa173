"""DRIVER side of a multi-worker run: the Trainer's loop inside a Ray Train TorchTrainer.

The driver never touches torch.distributed: it starts or joins Ray, pickles the Trainer, runs
TorchTrainer(ScalingConfig, RunConfig(FailureConfig, CheckpointConfig)) and turns rank 0's result
back into the same TrainOutput, TrainerState and weights an in-process train() would leave.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import signal
import threading
import time

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from ..worker import ray_worker as _ray_worker
from ..data.ray_data import blocks_for_workers
from ..state import TrainerState, TrainOutput

logger = logging.getLogger(__name__)


def ensure_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set under `ray job submit`), or start a local one whose
    dashboard listens on 127.0.0.1 only. Workers of a local cluster import from the driver's cwd."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    for name in ("DS_ACCELERATOR", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
        if name in os.environ:
            env[name] = os.environ[name]
    ray.init(dashboard_host="127.0.0.1", runtime_env={"env_vars": env})


def run_distributed(trainer, resume_from_checkpoint=None) -> TrainOutput:
    """Train on args.scaling.num_workers Ray workers; return rank 0's TrainOutput. Afterwards the
    driver's trainer holds the run's final state (log_history included) and weights."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    args = trainer.args
    ensure_ray()
    worker_args = copy.deepcopy(args)
    # Ray Train moves workers into the run's directory: every path they get must be absolute.
    worker_args.output_dir = os.path.abspath(args.output_dir)
    if isinstance(resume_from_checkpoint, (str, os.PathLike)) and resume_from_checkpoint != "auto":
        resume_from_checkpoint = os.path.abspath(resume_from_checkpoint)
    scaling = args.scaling
    name = f"{args.run_name or os.path.basename(worker_args.output_dir) or 'raytrain'}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_config = RunConfig(
        name=name,
        storage_path=_abs_storage(scaling.storage_path),
        failure_config=FailureConfig(max_failures=scaling.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=args.save_total_limit),
    )
    scaling_config = ScalingConfig(num_workers=scaling.num_workers, use_gpu=scaling.use_gpu,
                                   resources_per_worker=scaling.resources_per_worker,
                                   placement_strategy=scaling.placement_strategy)
    # ray.data Datasets: Ray Data runs beside training where CPUs allow (else first); workers get the blocks.
    blocks = blocks_for_workers(trainer, scaling_config)
    view = copy.copy(trainer)
    for key in blocks:
        setattr(view, key, None)
    try:
        with _driver_progress(trainer) as feed:
            torch_trainer = TorchTrainer(
                _ray_worker.train_loop_per_worker,
                train_loop_config={"trainer": _ray_worker.pickle_trainer(view, worker_args), "datasets": blocks,
                                   "resume_from_checkpoint": resume_from_checkpoint,
                                   "run": f"{name}-{os.urandom(4).hex()}", "progress": feed},
                scaling_config=scaling_config,
                run_config=run_config,
                torch_config=_RaytrainTorchConfig(),
            )
            try:
                with _sigint_restored():
                    result = torch_trainer.fit()
            except Exception as e:
                raise _worker_error(e) from e
    finally:
        for stream in blocks.values():  # Ray Data stops if it still runs; the blocks are let go
            stream.close()
    return _apply_result(trainer, result.return_value)


@contextlib.contextmanager
def _sigint_restored():
    """fit() installs Ray's SIGINT handler (abort the run) and leaves it in place: a later Ctrl-C in the
    same Python session would call a finished run's controller. Put the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _driver_progress(trainer, poll_s: float = 0.2):
    """The driver draws rank 0's progress with its own progress callbacks: rank 0 pushes events into a
    ProgressFeed actor (callbacks/progress.py); a thread here drains it every `poll_s` and replays them.
    Yields the actor's handle for the workers (None when the trainer shows no progress)."""
    import ray

    from ..callbacks.progress import ProgressFeed, ProgressReplay, progress_callbacks

    callbacks = progress_callbacks(trainer.callback_handler.callbacks)
    if not callbacks:
        yield None
        return
    feed = ray.remote(num_cpus=0)(ProgressFeed).remote()
    replay = ProgressReplay(callbacks, trainer.args, trainer.model)
    done = threading.Event()

    def drain():
        while not done.wait(poll_s):
            try:
                replay(ray.get(feed.drain.remote(), timeout=10))
            except Exception as e:  # noqa: BLE001 - progress is a view: never fail the run over it
                logger.debug("progress: %s", e)

    thread = threading.Thread(target=drain, daemon=True, name="raytrain-progress")
    thread.start()
    try:
        yield feed
    finally:
        done.set()
        thread.join(timeout=15)
        with contextlib.suppress(Exception):  # what rank 0 sent last (its flush waited for delivery)
            replay(ray.get(feed.drain.remote(), timeout=10))
        replay.close()
        with contextlib.suppress(Exception):  # Ray may be gone already (a second Ctrl-C)
            ray.kill(feed)


def _apply_result(trainer, value: dict) -> TrainOutput:
    """Rank 0's answer into the driver's trainer, which then evaluates and saves in-process."""
    import torch

    from ..strategies.single import SingleProcessStrategy

    trainer.state = TrainerState(**_json(value["state"]))
    weights = torch.load(io.BytesIO(value["weights"]), map_location="cpu", weights_only=True)
    trainer.model.load_state_dict(weights)
    trainer.model_wrapped = None
    trainer.set_strategy(SingleProcessStrategy(trainer.args))  # the driver has no process group
    return TrainOutput(value["global_step"], value["training_loss"], value["metrics"])


def _json(text: str) -> dict:
    import dataclasses
    import json

    known = {f.name for f in dataclasses.fields(TrainerState)}
    return {k: v for k, v in json.loads(text).items() if k in known}


def _abs_storage(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def _worker_error(error: Exception) -> Exception:
    """The user's exception from the worker (rank 0's when it failed), so that the driver raises what
    an in-process run would (ConfigError, FileExistsError, CheckpointError ...); else Ray's error."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures, key=lambda r: (r != 0, r)):
        base = getattr(failures[rank], "_base_exc", None)
        if isinstance(base, Exception):
            return base
    return error


class _RaytrainTorchBackend(_TorchBackend):
    """Ray's torch backend, plus raytrain's SIGTERM handler on every worker: signal handlers can only be
    set on a process's main thread, which is where Ray runs the worker group's `execute`."""

    def on_training_start(self, worker_group, backend_config):
        super().on_training_start(worker_group, backend_config)
        worker_group.execute(_ray_worker.install_sigterm_handler)


class _RaytrainTorchConfig(TorchConfig):
    @property
    def backend_cls(self):
        return _RaytrainTorchBackend
