"""WORKER side of a Ray Train run: the one module that calls Ray Train's worker API.

`train_loop_per_worker` is what TorchTrainer runs on every worker: it rebuilds the user's Trainer,
resumes from Ray's checkpoint after a restart, runs loop.train, and reports logs and checkpoints to
Ray. Everything else on the worker side (loop, strategies, checkpoint) runs without Ray.

Preemption: a SIGTERM (what a spot node's processes receive before it goes) sets a flag; at the next
step boundary every rank agrees to save a checkpoint and stop, and the worker then fails with
`Preempted`, so FailureConfig(max_failures) restarts the group from that checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import torch

from ..callbacks import TrainerCallback
from ..callbacks.progress import ProgressFeeder, plain_logs, progress_callbacks
from ..checkpoint import checkpoint_dir
from ..checkpoint_io import disk_leaders
from .resume import restart_point

if TYPE_CHECKING:
    from .protocol import TrainerProtocol

logger = logging.getLogger(__name__)

#: Seconds a worker may take to save and stop after SIGTERM before it exits regardless.
PREEMPT_GRACE_ENV = "RAYTRAIN_PREEMPT_GRACE_S"

_preempt_requested = threading.Event()
_training_active = threading.Event()


class Preempted(RuntimeError):
    """The worker saved a checkpoint after SIGTERM and stopped; Ray restarts the group from it."""


# ---------------------------------------------------------------- SIGTERM (runs on the actor's main thread)


def install_sigterm_handler() -> None:
    """Turn SIGTERM into a save-and-stop request while a training loop runs. Signal handlers can only
    be set from the main thread, so driver/torch_trainer.py's backend runs this through the worker group's execute."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if not _training_active.is_set() or _preempt_requested.is_set():
            # No loop to stop, or a second notice: exit as the process would have.
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)
        _preempt_requested.set()
        logger.warning("SIGTERM: saving a checkpoint at the next step boundary, then stopping")
        grace = float(os.environ.get(PREEMPT_GRACE_ENV, "120"))
        timer = threading.Timer(grace, lambda: os._exit(128 + signum))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


class PreemptionCallback(TrainerCallback):
    """At each step end, all ranks agree whether any got SIGTERM; if so: save now, then stop."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.triggered_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor(int(_preempt_requested.is_set()), device=self.strategy.device)
        if int(self.strategy.all_reduce(flag, "max")):
            self.triggered_at = state.global_step
            control.should_save = args.save_strategy != "no"
            control.should_training_stop = True
        return control


# ---------------------------------------------------------------- reporting to Ray


class RayReportCallback(TrainerCallback):
    """Every log goes to ray.train.report on every rank (Ray requires it; rank 0's metrics are the
    run's); every save is reported as a ray.train.Checkpoint by each disk's first rank (rank 0 alone
    on a shared disk; every rank on node-local ones), which Ray merges into one directory in storage."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.reported_step = -1
        self.reports_dir: bool | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        import ray.train

        ray.train.report({**plain_logs(logs or {}), "step": state.global_step})

    def on_save(self, args, state, control, **kwargs):
        import ray.train

        if state.global_step == self.reported_step:
            return  # the loop skipped this save: the step's checkpoint exists and was reported
        self.reported_step = state.global_step
        if self.reports_dir is None:  # a collective, as the writer's: found at the first save
            rank, world = self.strategy.rank, self.strategy.world_size
            leaders = [0] if world == 1 else disk_leaders(args.output_dir, rank, self.strategy.all_gather_object)
            self.reports_dir = leaders[rank] == rank
        path = checkpoint_dir(args.output_dir, state.global_step)
        checkpoint = ray.train.Checkpoint.from_directory(path) if self.reports_dir else None
        last = state.log_history[-1] if state.log_history else {}
        ray.train.report({**plain_logs(last), "step": state.global_step, "checkpoint_step": state.global_step},
                         checkpoint=checkpoint)


def _quiet_ray_reports() -> None:
    """Ray Train logs each ray.train.report of every rank at INFO ("Reporting training result N: ...")
    and each checkpoint it registers ("Checkpoint successfully created at: ..."); the driver would
    print them through its progress bar. The first logger is named after its file (RunConfig's
    LoggingConfig does not reach it), so both are quietened here, on the workers only."""
    from ray.train.v2._internal.execution import context, storage

    context.logger.setLevel(logging.WARNING)
    storage.logger.setLevel(logging.WARNING)


def _progress_feeder(feed) -> ProgressFeeder:
    """Rank 0's progress events to the driver's ProgressFeed actor: fire-and-forget calls (in order:
    one caller, one actor), a blocking one for the last events."""
    import ray

    def send(events):
        try:
            feed.push.remote(events)
        except Exception as e:  # noqa: BLE001 - progress is a view: never fail training over it
            logger.debug("progress not sent to the driver: %s", e)

    def flush(events):
        try:
            ray.get(feed.push.remote(events), timeout=30)
        except Exception as e:  # noqa: BLE001
            logger.debug("progress not sent to the driver: %s", e)

    return ProgressFeeder(send, flush)


# ---------------------------------------------------------------- the worker function


def train_loop_per_worker(config: dict) -> dict | None:
    """Rebuild the Trainer, resume (Ray's checkpoint after a restart, else the driver's choice), train.
    Rank 0 returns the run's TrainOutput, TrainerState and final weights to the driver."""
    import cloudpickle
    import ray.train

    from . import loop
    from ..seeding import set_seed

    ctx = ray.train.get_context()
    os.environ.setdefault("LOCAL_RANK", str(ctx.get_local_rank()))
    trainer: TrainerProtocol = cloudpickle.loads(config["trainer"])
    for key, blocks in config.get("datasets", {}).items():  # ray Datasets, executed once by the driver
        setattr(trainer, key, blocks)
    set_seed(trainer.args.seed, trainer.args.full_determinism)  # as Trainer.__init__ did on the driver
    strategy = trainer.get_strategy()  # rank and world from torch.distributed, set up by TorchTrainer
    preemption = PreemptionCallback(strategy)
    trial = config.get("trial")  # a sweep trial's reporter (raytrain.sweep.search) reports evaluations instead
    trainer.add_callback(trial if trial is not None else RayReportCallback(strategy))
    if config.get("progress") is not None:  # the driver draws the progress; the workers print none of it
        for cb in progress_callbacks(trainer.callback_handler.callbacks):
            trainer.remove_callback(cb)
        if strategy.is_main:
            trainer.add_callback(_progress_feeder(config["progress"]))
        _quiet_ray_reports()
    trainer.add_callback(preemption)

    reported = ray.train.get_checkpoint()
    trainer.start_memory_tracking()  # as Trainer.train does in-process (skip_memory_metrics)
    _training_active.set()
    try:
        with reported.as_directory() if reported is not None else contextlib.nullcontext() as ray_path:
            resume = _resume_point(strategy, trainer.args.output_dir, config, ray_path)
            out = loop.train(trainer, resume, trial)
    finally:
        _training_active.clear()
    if preemption.triggered_at is not None and out.global_step < trainer.state.max_steps:
        saved = f"saved checkpoint-{preemption.triggered_at} and " if trainer.args.save_strategy != "no" else ""
        raise Preempted(f"SIGTERM: {saved}stopped at step {preemption.triggered_at}; Ray restarts the worker "
                        "group from the last checkpoint (FailureConfig.max_failures)")
    weights = strategy.model_state_dict()  # a collective for sharded backends
    strategy.barrier()
    if strategy.rank != 0:
        return None
    buf = io.BytesIO()
    torch.save(weights, buf)
    return {"global_step": out.global_step, "training_loss": out.training_loss, "metrics": dict(out.metrics),
            "state": trainer.state.to_json_string(), "weights": buf.getvalue()}


def _resume_point(strategy, output_dir: str, config: dict, ray_path: str | None):
    """Where this attempt starts: resume.restart_point (every rank takes part) picks Ray's latest
    registered checkpoint or output_dir's newest after a restart, else the driver's resume_from_checkpoint."""
    kind, path = restart_point(output_dir, config["run"], ray_path, strategy.all_gather_object)
    if kind == "reported":
        return ray_path  # this rank's own copy of Ray's checkpoint
    return path if kind == "local" else config.get("resume_from_checkpoint")


def pickle_trainer(trainer: TrainerProtocol, args) -> bytes:
    """The Trainer for the workers: everything but its process-local pieces (strategy, wrapped model)."""
    import copy

    import cloudpickle

    clone = copy.copy(trainer)
    clone.args = args
    clone.set_strategy(None)
    clone.model_wrapped = None
    try:
        return cloudpickle.dumps(clone)
    except Exception as e:
        bad = [name for name, value in vars(clone).items() if not _picklable(value)]
        raise TypeError(f"Trainer attribute(s) {bad or '?'} cannot be pickled for the Ray workers ({e}); "
                        "build them inside model_init / the data factory, or drop them") from e


def _picklable(value: Any) -> bool:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
        return True
    except Exception:
        return False
