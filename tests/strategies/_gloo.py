"""Spawned gloo process groups for the TP and pipeline tests. Each process imports torch, transformers and peft
(about 7 CPU-seconds each), so test_tp.py's and test_pp.py's runs on 4 processes share one launch (conftest.py's
`gloo4`), one module's runs after the other's in the same process group."""

from __future__ import annotations

import importlib
import json
import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, root: str, jobs: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for name, (target, kwargs) in jobs.items():
        module, function = target.split(":")
        out[name] = getattr(importlib.import_module(module), function)(**kwargs)
    dist.destroy_process_group()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def launch(root, world: int, jobs: dict) -> list[dict]:
    """Run `jobs` ({name: ("module:function", kwargs)}), one after the other, on `world` spawned processes in one
    gloo group; per rank, {name: what the function returned there}."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, _free_port(), str(root), jobs), nprocs=world, join=True)
    return [json.loads(open(os.path.join(str(root), f"rank{r}.json")).read()) for r in range(world)]
