"""The session's one Ray Train worker group (conftest.py's `worker_group`): the parts of several modules run one
after the other on the same 2 workers. Importable on the Ray workers (PYTHONPATH is the repo root)."""

from __future__ import annotations

import importlib
import os
import traceback


def run_parts(config: dict) -> dict | None:
    """A Ray Train worker function: each part's worker function ("module:name") with its config, in order. Rank 0
    returns each part's return value, or its error (the part's tests fail with it; the next part still runs)."""
    out = {}
    for name, (function, part) in config["parts"].items():
        module, attr = function.split(":")
        try:
            out[name] = getattr(importlib.import_module(module), attr)(part)
        except Exception:  # noqa: BLE001 - the part's tests report it
            out[name] = {"group_error": traceback.format_exc()}
        _forget_checkpoints()
    return out if int(os.environ.get("RANK", 0)) == 0 else None


def _forget_checkpoints() -> None:
    """The next part starts as a fresh run does: without the checkpoints this one reported to Ray, neither Ray's
    latest (ray.train.get_checkpoint) nor those in the run's storage (where a restarted worker looks for one that
    Ray has not registered: raytrain/worker/ray_worker.py)."""
    import shutil

    import ray.train
    import torch.distributed as dist
    from ray.train.v2._internal.execution.context import get_train_context

    context = get_train_context()
    with context.report_order_condition:
        context.checkpoint = None
    dist.barrier()
    if dist.get_rank() == 0:
        storage = ray.train.get_context().get_storage().experiment_fs_path
        for entry in os.listdir(storage):  # Ray's checkpoint_<time> folders, beside its checkpoint_manager_snapshot.json
            if entry.startswith("checkpoint_") and os.path.isdir(os.path.join(storage, entry)):
                shutil.rmtree(os.path.join(storage, entry))
    dist.barrier()


def key(path: str) -> str:
    """A test file's name in conftest's WORKER_GROUP: its path under tests/."""
    return os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.abspath(__file__)))


def part(worker_group: dict, path: str):
    """The part of conftest's `worker_group` of the test file at `path`: (its root, rank 0's return value); its
    error fails the test."""
    import pytest

    root, value = worker_group[key(path)]
    if isinstance(value, dict) and "group_error" in value:
        pytest.fail(f"{key(path)}'s part of the worker group failed:\n{value['group_error']}")
    return root, value


def ship(trainer, run: str) -> dict:
    """On the driver: `trainer` as Trainer.train ships it to Ray workers (driver/launch.run_distributed: a copy of its
    arguments with output_dir absolute), a case of run_cases."""
    import copy

    from raytrain.worker.ray_worker import pickle_trainer

    args = copy.deepcopy(trainer.args)
    args.output_dir = os.path.abspath(args.output_dir)
    return {"trainer": pickle_trainer(trainer, args), "resume_from_checkpoint": None, "run": run, "threads": None}


def run_cases(config: dict) -> dict | None:
    """A Ray Train worker function: each case of `ship` through the workers' own function
    (ray_worker.train_loop_per_worker), one after the other; rank 0 returns each one's value (its TrainOutput,
    TrainerState and weights)."""
    from raytrain.worker.ray_worker import train_loop_per_worker

    out = {name: train_loop_per_worker(case) for name, case in config["cases"].items()}
    return out if int(os.environ.get("RANK", 0)) == 0 else None


def land(trainer, value: dict):
    """On the driver: rank 0's value of a shipped trainer into `trainer`, as Trainer.train leaves a Ray run
    (driver/launch.py); its TrainOutput."""
    from raytrain.driver.launch import _apply_result

    return _apply_result(trainer, value)
