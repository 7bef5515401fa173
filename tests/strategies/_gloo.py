"""Gloo process groups for the tests that run ranks without Ray. A fresh process imports torch, transformers and
peft (about 7 CPU-seconds each on 2 cores), so the ranks fork from one server per pytest process that imported
them once (`start`); and test_tp.py's and test_pp.py's runs on 4 processes share one launch (conftest.py's
`gloo4`), one module's runs after the other's in the same process group."""

from __future__ import annotations

import importlib
import json
import os
import socket

import torch


#: imported once by the forkserver that every rank forks from (the first `start` of a pytest process sets it)
PRELOAD = ["torch.distributed.fsdp", "torch.distributed.pipelining", "transformers.models.llama.modeling_llama",
           "peft", "trl", "deepspeed", "raytrain.worker.loop", "tests.strategies._gloo", "tests.strategies._helpers"]


def start(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) on `nprocs` processes forked from the server, joined; a rank's exception is raised here."""
    import multiprocessing

    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the server's environment, before it imports deepspeed
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def free_port() -> int:
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
    """Run `jobs` ({name: ("module:function", kwargs)}), one after the other, on `world` processes in one gloo
    group; per rank, {name: what the function returned there}."""
    start(_rank, (world, free_port(), str(root), jobs), world)
    return [json.loads(open(os.path.join(str(root), f"rank{r}.json")).read()) for r in range(world)]
