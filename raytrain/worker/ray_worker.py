"""WORKER side of a Ray Train run: with preemption.py, the modules that call Ray Train's worker API.

`train_loop_per_worker` is what TorchTrainer runs on every worker: it rebuilds the user's Trainer,
resumes from Ray's checkpoint after a restart, runs loop.train, and reports logs and checkpoints to
Ray. Everything else on the worker side (loop, strategies, checkpoint) runs without Ray, but for
preemption.py (Ray's preemption notice, SIGTERM).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from ..callbacks import TrainerCallback
from ..callbacks.progress import ProgressFeeder, plain_logs, progress_callbacks
from ..hf import adapters
from ..checkpoint import store as ckpt
from ..checkpoint.store import checkpoint_dir
from ..checkpoint.io import disk_leaders
from .preemption import PreemptionCallback, training_active
from .resume import complete_here, complete_in, restart_point

if TYPE_CHECKING:
    from .protocol import TrainerProtocol

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- reporting to Ray


class RayReportCallback(TrainerCallback):
    """Every save goes to ray.train.report on every rank (Ray requires all of them), with the last log's
    metrics, as a ray.train.Checkpoint from each disk's first rank (rank 0 alone on a shared disk; every
    rank on node-local ones), which Ray merges into one directory in storage. Logs alone are not
    reported: a worker holds one report until Ray's controller polls (every 2 s), so a report per log
    would hold training at one log per 2 s; the driver gets the run's logs from rank 0's state."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.reported_step = -1
        self.reports_dir: bool | None = None
        self.in_flight: int | None = None  # a background distributed save's step, not reported yet
        self.unregistered: tuple[str, int] | None = None  # (directory in Ray's storage, step): see register

    def on_train_begin(self, args, state, control, **kwargs):
        if self.unregistered is not None:
            self.register(*self.unregistered)
            self.unregistered = None

    def register(self, directory: str, step: int) -> None:
        """Hand Ray a complete checkpoint it never registered (its node was lost before the controller
        polled), where it lies in storage (no upload): Ray's num_to_keep then rotates it with the rest,
        instead of leaving it in storage for good."""
        report_in_place({"step": step, "checkpoint_step": step}, directory, self.strategy.is_main)

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.reported_step:
            return  # the loop skipped this save: the step's checkpoint exists and was reported
        self.reported_step = state.global_step
        if self.reports_dir is None:  # a collective, as the writer's: found at the first save
            rank, world = self.strategy.rank, self.strategy.world_size
            leaders = [0] if world == 1 else disk_leaders(args.output_dir, rank, self.strategy.all_gather_object)
            self.reports_dir = leaders[rank] == rank
        if not (args.save_async and self.strategy.world_size > 1):
            return self._report(args, state, state.global_step)
        # A background distributed save is still being written: Ray gets the previous one, complete on
        # every rank since this save waited for it, and this one at the next save or at the end.
        previous, self.in_flight = self.in_flight, state.global_step
        self._report(args, state, previous)

    def on_train_end(self, args, state, control, **kwargs):
        if self.in_flight is not None:  # the loop waited for the last background save before this event
            self._report(args, state, self.in_flight)
            self.in_flight = None

    def _report(self, args, state, step: int | None) -> None:
        import ray.train

        checkpoint = None
        if step is not None and self.reports_dir:
            checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir(args.output_dir, step))
        last = state.log_history[-1] if state.log_history else {}
        metrics = {**plain_logs(last), "step": state.global_step}
        if step is not None:
            metrics["checkpoint_step"] = step
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=upload_checkpoint)
        if checkpoint is not None and self.strategy.is_main and keeps_best(args):
            storage = ray.train.get_context().get_storage()
            best = state.best_model_checkpoint
            keep = {_step_of(best)} if best else set()
            prune_storage(storage.storage_filesystem, storage.experiment_fs_path, args.save_total_limit, keep | {step})


def report_in_place(metrics: dict, directory: str, names_it: bool) -> None:
    """ray.train.report of a checkpoint already in the run's storage, where it lies (no upload). Every
    rank reports (Ray needs as many reports from each); the one with `names_it` names the checkpoint."""
    import ray.train
    from ray.train import CheckpointUploadMode

    checkpoint = None
    if names_it:
        fs = ray.train.get_context().get_storage().storage_filesystem
        checkpoint = ray.train.Checkpoint(directory, filesystem=fs)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def upload_checkpoint(checkpoint, name: str):
    """Ray's upload of a reported checkpoint (report's checkpoint_upload_fn): into storage on the same
    filesystem (one machine, or one NFS mount), every file is hard-linked, not copied. A checkpoint's
    files never change once it is renamed into place (rotation and archiving unlink or move them), so
    storage holds the same bytes, written once. Elsewhere (S3, another disk) Ray copies them."""
    import pyarrow.fs
    import ray.train

    storage = ray.train.get_context().get_storage()
    if isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem) and \
            isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        dest = f"{storage.experiment_fs_path}/{name}"
        try:
            _link_tree(checkpoint.path, dest)
            return ray.train.Checkpoint(dest, filesystem=storage.storage_filesystem)
        except OSError as e:  # another device (EXDEV), or a filesystem without hard links
            logger.debug("checkpoint %s copied to storage, not linked: %s", checkpoint.path, e)
            # A copy over a file linked there would write into that checkpoint's own file: unlink first.
            _link_tree(checkpoint.path, dest, link=False)
    return storage.persist_current_checkpoint(checkpoint, name)


def _link_tree(src: str, dest: str, link: bool = True) -> None:
    """Hard-link every file of `src` into `dest` (replacing a file of the same name: Ray merges the ranks'
    directories, the last report winning, as a copy's would); with link=False only unlink those names."""
    for root, _, files in os.walk(src):
        into = os.path.join(dest, os.path.relpath(root, src))
        os.makedirs(into, exist_ok=True)
        for f in files:
            if os.path.lexists(target := os.path.join(into, f)):
                os.unlink(target)
            if link:
                os.link(os.path.join(root, f), target)


def keeps_best(args) -> bool:
    """Rotation that protects the best checkpoint (HF's, with metric_for_best_model): raytrain rotates
    Ray's storage itself then, instead of Ray's num_to_keep."""
    return bool(args.save_total_limit) and args.metric_for_best_model is not None


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
    from ..runtime.seeding import set_seed
    from ..runtime.threads import apply_threads

    ctx = ray.train.get_context()
    os.environ.setdefault("LOCAL_RANK", str(ctx.get_local_rank()))
    # On this (training) thread: the driver's OMP_NUM_THREADS, else the node's cores shared by its workers
    # (Ray sets the worker's own OMP_NUM_THREADS to its CPUs: 1 thread by default, however many cores).
    apply_threads(ctx.get_local_world_size(), config.get("threads"), read_env=False, pin=True)
    trainer: TrainerProtocol = cloudpickle.loads(config["trainer"])
    for key, blocks in config.get("datasets", {}).items():  # ray Datasets, executed once by the driver
        setattr(trainer, key, blocks)
    set_seed(trainer.args.seed, trainer.args.full_determinism)  # as Trainer.__init__ did on the driver
    strategy = trainer.get_strategy()  # rank and world from torch.distributed, set up by TorchTrainer
    # Ray's workers log INFO: raytrain's INFO lines (HF's "***** Running training *****") only where the
    # user asked for them (log_level on the main process, log_level_replica elsewhere), as HF.
    args = trainer.args
    level = logging.WARNING if args.log_level == "passive" and args.should_log else args.get_process_log_level()
    for name in ("raytrain", "transformers"):  # transformers: the Trainer's HF lines, as HF's set_verbosity
        logging.getLogger(name).setLevel(level)
    preemption = PreemptionCallback(strategy)
    trial = config.get("trial")  # a sweep trial's reporter (raytrain.sweep.search) reports evaluations instead
    reports = RayReportCallback(strategy) if trial is None else None
    trainer.add_callback(trial if trial is not None else reports)
    if config.get("progress") is not None:  # the driver draws the progress; the workers print none of it
        for cb in progress_callbacks(trainer.callback_handler.callbacks):
            trainer.remove_callback(cb)
        if strategy.is_main:
            trainer.add_callback(_progress_feeder(config["progress"]))
        _quiet_ray_reports()
    trainer.add_callback(preemption)

    reported = ray.train.get_checkpoint()
    trainer.start_memory_tracking()  # as Trainer.train does in-process (skip_memory_metrics)
    training_active.set()
    try:
        with reported.as_directory() if reported is not None else contextlib.nullcontext() as ray_path, \
                _newest_stored(strategy, ray_path) as (ray_path, unregistered):
            # For Ray to register (a trial's reporter with the evaluation, for its objective): see register
            (reports if reports is not None else trial).unregistered = unregistered
            resume = _resume_point(strategy, trainer.args.output_dir, config, ray_path)
            out = loop.train(trainer, resume, trial, locate=_checkpoint_here)
    finally:
        training_active.clear()
    preemption.finish(out.global_step, trainer.state.max_steps, trainer.args.save_strategy != "no")
    # a collective for sharded backends; a PEFT model's frozen base stays where the driver built it
    weights = strategy.model_state_dict(trainable_only=adapters.peft_of(strategy.model) is not None)
    strategy.barrier()
    if strategy.rank != 0:
        return None
    buf = io.BytesIO()
    torch.save(weights, buf)
    return {"global_step": out.global_step, "training_loss": out.training_loss, "metrics": dict(out.metrics),
            "state": trainer.state.to_json_string(), "weights": buf.getvalue()}


@contextlib.contextmanager
def _newest_stored(strategy, ray_path: str | None):
    """(Ray's checkpoint, None), or (a newer one complete in the run's storage that Ray has not registered,
    (its directory in storage, its step)): Ray's controller registers a report when it next polls the
    workers (every 2 s), so a node lost just after a save leaves every rank's files of that save in
    storage, unregistered. The run's storage holds this run's checkpoints alone (its name has the
    driver's start time)."""
    import pyarrow.fs
    import ray.train

    storage = ray.train.get_context().get_storage()
    fs, root = storage.storage_filesystem, storage.experiment_fs_path
    newest = None
    if strategy.is_main:
        try:
            registered = ckpt.read_manifest(ray_path)["global_step"] if ray_path else -1
        except ckpt.CheckpointError:  # not raytrain's (resume.restart_point says so)
            registered = float("inf")
        stored = {step: d for step, (d, manifest) in _stored_checkpoints(fs, root).items()
                  if step > registered and complete_in(d, manifest["files"], fs)}
        newest = (stored[max(stored)], max(stored)) if stored else None
    newest = strategy.all_gather_object(newest)[0]
    if newest is None:
        yield ray_path, None
        return
    logger.warning("%s in Ray's storage is newer than the checkpoint Ray registered; resuming from it", newest[0])
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        yield newest[0], newest
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="raytrain-checkpoint-") as local:
        pyarrow.fs.copy_files(newest[0], local, source_filesystem=fs)
        yield local, newest


def _resume_point(strategy, output_dir: str, config: dict, ray_path: str | None):
    """Where this attempt starts: resume.restart_point (every rank takes part) picks Ray's latest
    registered checkpoint or output_dir's newest after a restart, else the driver's resume_from_checkpoint."""
    kind, path = restart_point(output_dir, config["run"], ray_path, strategy.all_gather_object)
    if kind == "reported":
        return ray_path  # this rank's own copy of Ray's checkpoint
    return path if kind == "local" else config.get("resume_from_checkpoint")


@contextlib.contextmanager
def _checkpoint_here(path: str):
    """`path` where this rank's disk holds it complete; else its manifest and weights fetched from Ray's
    storage into a temporary directory (a node-local output_dir: another rank's disk, or a node that
    joined after the save, e.g. load_best_model_at_end once rank 0 has moved)."""
    if complete_here(path):
        yield path
        return
    import tempfile

    import pyarrow.fs
    import ray.train

    storage = ray.train.get_context().get_storage()
    fs, root = storage.storage_filesystem, storage.experiment_fs_path
    step = _step_of(path)
    stored = _stored_checkpoint(fs, root, step)
    if stored is None:
        raise ckpt.CheckpointError(f"{path}: not complete on this node's disk, and Ray's storage {root} holds no "
                                   f"checkpoint of step {step} (save_total_limit may have removed it)")
    source, manifest = stored
    with tempfile.TemporaryDirectory(prefix="raytrain-checkpoint-") as local:
        for name in [ckpt.MANIFEST] + [n for n in manifest["files"] if ckpt.is_weights_file(n)]:
            pyarrow.fs.copy_files(f"{source}/{name}", os.path.join(local, name), source_filesystem=fs)
        logger.info("%s fetched from Ray's storage (%s)", os.path.basename(path), source)
        yield local


def _step_of(path: str) -> int:
    """N of a checkpoint-N directory (checkpoint.checkpoint_dir's inverse)."""
    return int(os.path.basename(os.path.normpath(path)).rsplit("-", 1)[-1])


def _stored_checkpoint(fs, root: str, step: int) -> tuple[str, dict] | None:
    """The checkpoint directory of `step` in Ray's storage and its manifest (None: none there)."""
    return _stored_checkpoints(fs, root).get(step)


def _stored_checkpoints(fs, root: str) -> dict[int, tuple[str, dict]]:
    """{step: (directory, manifest)} of every complete checkpoint in Ray's storage."""
    import json

    import pyarrow.fs

    found = {}
    for info in fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True)):
        if info.type != pyarrow.fs.FileType.Directory:
            continue
        try:
            with fs.open_input_stream(f"{info.path}/{ckpt.MANIFEST}") as f:
                manifest = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if isinstance(manifest.get("global_step"), int):
            found[manifest["global_step"]] = info.path, manifest
    return found


def prune_storage(fs, root: str, save_total_limit: int | None, keep_steps: set[int]) -> list[str]:
    """Rotate Ray's copies by the rule of the node's disk (checkpoint.checkpoints_to_drop): the newest
    and `keep_steps` (the best) stay. Ray's own num_to_keep would keep the newest only."""
    stored = _stored_checkpoints(fs, root)
    steps = ckpt.checkpoints_to_drop(sorted(stored), save_total_limit, keep_steps)
    for step in steps:
        fs.delete_dir(stored[step][0])
    return [stored[step][0] for step in steps]


def pickle_trainer(trainer: TrainerProtocol, args) -> bytes:
    """The Trainer for the workers: everything but its process-local pieces (strategy, wrapped model)."""
    import copy

    import cloudpickle

    clone = copy.copy(trainer)
    clone.args = args
    clone.set_strategy(None)
    clone.model_wrapped = None
    clone.__dict__.pop("_accelerator", None)  # it points at `trainer`; the workers' clone builds its own
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
