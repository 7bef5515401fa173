"""DRIVER side of a multi-worker run: the Trainer's loop inside a Ray Train TorchTrainer.

The driver never touches torch.distributed: it starts or joins Ray, runs the TorchTrainer that
torch_trainer.py builds, draws rank 0's progress (progress.py) and turns rank 0's result back into
the same TrainOutput, TrainerState and weights an in-process train() would leave.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import time

from ..config import ConfigError
from ..data.build import blocks_for_workers
from ..state import TrainerState, TrainOutput
from .progress import driver_progress
from .torch_trainer import build_torch_trainer, fit, scaling_config

logger = logging.getLogger(__name__)


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster named by `address` or RAY_ADDRESS (set under `ray job submit`), or the one
    `ray start` recorded, or start a local one whose dashboard listens on 127.0.0.1 only. Workers of a
    local cluster import from the driver's cwd. A cluster that is gone is found within a second: a
    named one is a one-line ConfigError, a recorded one is warned about and a local one started."""
    import ray

    if ray.is_initialized():
        return
    named = address or os.environ.get("RAY_ADDRESS")
    if named and named not in ("local", "auto") and not _gcs_alive(named):
        source = "address" if address else "RAY_ADDRESS"
        raise ConfigError(f"no Ray cluster answers at {source}={named} (nothing listens there); start it, "
                              "or leave the address out to run on a local cluster")
    if named in (None, "auto"):  # ray.init() would join the cluster `ray start` recorded, dead or alive
        record, recorded = _recorded_cluster()
        if recorded and not _gcs_alive(recorded):
            if named == "auto":
                raise ConfigError(f"no Ray cluster answers at {recorded}, the address {record} records "
                                      "(RAY_ADDRESS=auto); start it, or unset RAY_ADDRESS")
            logger.warning("the Ray cluster recorded in %s (%s) is gone: starting a local one", record, recorded)
            address = "local"
    if named:
        ray.init(address=address, log_to_driver=True)
        return
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    for name in ("DS_ACCELERATOR", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
        if name in os.environ:
            env[name] = os.environ[name]
    ray.init(address=address, dashboard_host="127.0.0.1", runtime_env={"env_vars": env})


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
        with driver_progress(trainer) as feed:
            result = fit(build_torch_trainer(
                view, worker_args, name=name, storage_path=_abs_storage(args.scaling.storage_path),
                resume_from_checkpoint=resume_from_checkpoint,
                checkpoint_config=CheckpointConfig(num_to_keep=args.save_total_limit),
                datasets=blocks, progress=feed))
    finally:
        for stream in blocks.values():  # Ray Data stops if it still runs; the blocks are let go
            stream.close()
    return _apply_result(trainer, result.return_value)


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
