"""DRIVER side of a multi-worker run: the Trainer's loop inside a Ray Train TorchTrainer.

The driver never touches torch.distributed: it starts or joins Ray, runs the TorchTrainer that
torch_trainer.py builds, draws rank 0's progress (progress.py) and turns rank 0's result back into
the same TrainOutput, TrainerState and weights an in-process train() would leave.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import re
import sys
import time

from ..config.sections import ConfigError
from ..data.build import blocks_for_workers
from ..callbacks.state import TrainerState, TrainOutput
from ..worker.ray_worker import keeps_best
from .capacity import check_capacity
from .progress import driver_progress
from .waiting import WaitTimeout, WaitWatch
from .torch_trainer import build_torch_trainer, fit, scaling_config

logger = logging.getLogger(__name__)

#: Ray Train's controller logs this ERROR line once per run about its own PreemptionWatcher actor, whose
#: worker handles Ray Core counts as "constructor arguments in the object store" (ray-project/ray#53727).
#: The watcher feeds ray.train.get_preemption_info (worker/preemption.py), so it stays on; the line goes.
PREEMPTION_WATCHER_LINE = r"'PreemptionWatcher' and ID: '\w+' has constructor arguments in the object store"


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster named by `address` or RAY_ADDRESS (set under `ray job submit`), or the one
    `ray start` recorded, or start a local one whose dashboard listens on 127.0.0.1 only. Workers of a
    local cluster import from the driver's cwd. A cluster that is gone is found within a second: a
    named one is a one-line ConfigError, a recorded one is warned about and a local one started. Ray's
    own INFO lines stay off the driver's console, and its colours off a console that is not a terminal."""
    import ray

    if ray.is_initialized():
        return
    named = address or os.environ.get("RAY_ADDRESS")
    if named and named not in ("local", "auto") and not _gcs_alive(named):
        source = "address" if address else "RAY_ADDRESS"
        raise ConfigError(f"no Ray cluster answers at {source}={named} (nothing listens there); start it, "
                              "or leave the address out to run on a local cluster")
    recorded = None
    if named in (None, "auto"):  # ray.init() would join the cluster `ray start` recorded, dead or alive
        record, recorded = _recorded_cluster()
        if recorded and not _gcs_alive(recorded):
            if named == "auto":
                raise ConfigError(f"no Ray cluster answers at {recorded}, the address {record} records "
                                      "(RAY_ADDRESS=auto); start it, or unset RAY_ADDRESS")
            logger.warning("the Ray cluster recorded in %s (%s) is gone: starting a local one", record, recorded)
            address, recorded = "local", None
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # read by Ray as it prints each worker line
    _skip_worker_line(PREEMPTION_WATCHER_LINE)
    with _sigterm_kept():
        _init(address, named, recorded)


@contextlib.contextmanager
def _sigterm_kept():
    """ray.init installs Ray's crash handler for SIGTERM in the driver, which prints a stack and aborts
    (exit 134): a `kill` or `ray job stop` would then skip graceful_stop's save. The driver's own Python
    handler (graceful_stop's, or Python's default) is put back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _init(address: str | None, named: str | None, recorded: str | None) -> None:
    import ray

    if named:
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
        return
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    for name in ("DS_ACCELERATOR", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
        if name in os.environ:
            env[name] = os.environ[name]
    if recorded:  # joins the recorded cluster
        ray.init(runtime_env={"env_vars": env}, logging_level=logging.WARNING)
        return
    with _gcs_port() as port, _quiet_token_default():
        # Ray Train's PlacementGroupCleaner actor finds its cluster by RAY_ADDRESS, else by looking for
        # GCS processes; with two clusters on one machine it fails with a traceback. Tell it ours.
        env.setdefault("RAY_ADDRESS", f"127.0.0.1:{port}")
        ray.init(address=address, dashboard_host="127.0.0.1", logging_level=logging.WARNING,
                 runtime_env={"env_vars": env,
                              "worker_process_setup_hook": "raytrain.driver.ray_setup.local_cluster_worker"})


def _skip_worker_line(pattern: str) -> None:
    """Add `pattern` to RAY_DEDUP_LOGS_SKIP_REGEX, Ray's filter of the worker lines its driver prints (the
    user's own pattern kept beside it). Ray compiles it when imported, which run.py's signal handling or the
    user may have done already: the compiled filters are brought up to date too."""
    skip = os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX") or ""
    if pattern not in skip:
        os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = f"{skip}|{pattern}" if skip else pattern
    try:
        from ray._private import ray_logging
    except ImportError:
        return
    for dedup in (ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator):
        if dedup.skip_re is None or pattern not in dedup.skip_re.pattern:
            dedup.skip_re = re.compile(os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"])


@contextlib.contextmanager
def _quiet_token_default():
    """A new local cluster gets token authentication, Ray's default (RAY_AUTH_MODE unset), without Ray's
    warning that it did: the one message its logger has on this path. RAY_AUTH_MODE=disabled opts out."""
    token_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = token_logger.level
    if "RAY_AUTH_MODE" not in os.environ:
        token_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        token_logger.setLevel(level)


@contextlib.contextmanager
def _gcs_port():
    """A free port for a new local cluster's GCS (RAY_GCS_SERVER_PORT, Ray's own choice of it where set)."""
    import socket

    chosen = os.environ.get("RAY_GCS_SERVER_PORT")
    if chosen:
        yield int(chosen)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)
    try:
        yield port
    finally:
        del os.environ["RAY_GCS_SERVER_PORT"]


def _recorded_cluster() -> tuple[str, str | None]:
    """The file where `ray start` records its GCS address, found as ray.init() finds it
    ($RAY_TMPDIR/ray, else $TMPDIR/ray, else /tmp/ray), and the address in it (None: no record)."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            return path, f.read().strip() or None
    except OSError:
        return path, None


def _gcs_alive(address: str) -> bool:
    """Whether something listens at a host:port address (1 s); other forms (ray://...) are left to Ray."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return True
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False


def run_distributed(trainer, resume_from_checkpoint=None) -> TrainOutput:
    """Train on args.scaling.num_workers Ray workers; return rank 0's TrainOutput. Afterwards the
    driver's trainer holds the run's final state (log_history included) and weights."""
    from ray.train import CheckpointConfig

    args = trainer.args
    ensure_ray()
    check_capacity(args.scaling)
    check_storage(args.scaling)
    worker_args = copy.deepcopy(args)
    # Ray Train moves workers into the run's directory: every path they get must be absolute.
    worker_args.output_dir = os.path.abspath(args.output_dir)
    if isinstance(resume_from_checkpoint, (str, os.PathLike)) and resume_from_checkpoint != "auto":
        resume_from_checkpoint = os.path.abspath(resume_from_checkpoint)
    name = f"{args.run_name or os.path.basename(worker_args.output_dir) or 'raytrain'}-{time.strftime('%Y%m%d-%H%M%S')}"
    # ray.data Datasets: Ray Data runs beside training where CPUs allow (else first); workers get the blocks.
    blocks = blocks_for_workers(trainer, scaling_config(args.scaling))
    view = copy.copy(trainer)
    for key in blocks:
        setattr(view, key, None)
    try:
        with driver_progress(trainer) as feed, WaitWatch(args.scaling, _status_line(trainer)) as watch:
            torch_trainer = build_torch_trainer(
                view, worker_args, name=name, storage_path=_abs_storage(args.scaling.storage_path),
                resume_from_checkpoint=resume_from_checkpoint,
                checkpoint_config=CheckpointConfig(num_to_keep=None if keeps_best(args) else args.save_total_limit),
                datasets=blocks, progress=feed)
            torch_trainer.on_controller = watch.controller
            try:
                result = fit(torch_trainer)
            except Exception:
                if watch.timed_out:
                    raise WaitTimeout(watch.timed_out) from None
                raise
            if watch.timed_out:
                raise WaitTimeout(watch.timed_out)
    finally:
        for stream in blocks.values():  # Ray Data stops if it still runs; the blocks are let go
            stream.close()
    return _apply_result(trainer, result.return_value)


def _status_line(trainer):
    """Where the driver's own lines go: the progress callbacks' line (a bar's or the log's), else the log."""
    from ..callbacks.progress import progress_callbacks

    shown = [cb for cb in progress_callbacks(trainer.callback_handler.callbacks) if hasattr(cb, "status")]

    def say(line: str) -> None:
        for cb in shown:
            cb.status(line)
        if not shown:
            logger.warning(line)
    return say


def check_storage(scaling) -> None:
    """Several nodes that can run workers need scaling.storage_path: each rank's share of a checkpoint
    stays on its own node's disk otherwise, out of reach of a worker restarted elsewhere."""
    import ray

    if scaling.storage_path is not None:
        return
    need = dict(scaling.resources_per_worker or {"CPU": 1})
    if scaling.use_gpu:
        need.setdefault("GPU", 1)
    nodes = [n for n in ray.nodes() if n.get("Alive")
             and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items() if v)]
    if len(nodes) > 1:
        raise ConfigError(f"scaling.storage_path is not set, but the Ray cluster has {len(nodes)} nodes that can run "
                          "workers: set it to storage every node reaches (a shared directory, or a URI such as "
                          "s3://bucket/runs), so that a worker restarted on another node finds every rank's checkpoint")


def _apply_result(trainer, value: dict) -> TrainOutput:
    """Rank 0's answer into the driver's trainer, which then evaluates and saves in-process."""
    import torch

    from ..hf import adapters
    from ..strategies.single import SingleProcessStrategy

    trainer.state = TrainerState(**_json(value["state"]))
    weights = torch.load(io.BytesIO(value["weights"]), map_location="cpu", weights_only=True)
    adapters.load_trained(trainer.model, weights)
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
