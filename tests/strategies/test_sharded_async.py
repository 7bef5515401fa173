"""Sharded state with save_async on 2 ranks (processes, gloo, no Ray), for FSDP2 and ZeRO-3: the optimizer
state (FSDP2's DCP files, DeepSpeed's engine checkpoint) is staged to host memory at the step boundary and
written in the background (DCP's thread, its collectives on the side channel's group; the DeepSpeed
strategy's writer thread), the checkpoint commits only once every rank's files are written, verifies, and
resumes bit for bit; a write that fails on one rank fails the save on both."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch

import raytrain.checkpoint.store as ckpt
from raytrain import TrainerCallback
from tests.strategies._gloo import free_port, start

STEPS, SAVE_AT = 8, 4
BACKENDS = {  # the strategy's config, its folder in the checkpoint, and files of both ranks there
    "fsdp": ({"strategy": "fsdp", "fsdp": {"min_num_params": 2000}}, "dcp", {"dcp/.metadata", "dcp/__0_0.distcp",
                                                                           "dcp/__1_0.distcp"}),
    "zero3": ({"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 3}}}, "deepspeed",
              {f"deepspeed/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")}),
}


class _GateWrites(TrainerCallback):
    """The backend's file writes wait until the step after the save has changed the optimizer state; at the
    save (save() has returned) this rank records what is on disk."""

    def __init__(self, gate: threading.Event, seen: dict, folder: str):
        self.gate, self.seen, self.folder = gate, seen, folder

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == SAVE_AT:
            tmp = os.path.join(args.output_dir, f".tmp-checkpoint-{SAVE_AT}")
            folder = os.path.join(tmp, self.folder)
            files = [n for _, _, names in os.walk(folder) for n in names if n.endswith((".pt", ".distcp", ".metadata"))]
            self.seen["files_at_return"] = sorted(files)
            self.seen["committed_at_return"] = os.path.exists(os.path.join(args.output_dir, f"checkpoint-{SAVE_AT}"))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == SAVE_AT + 1:  # the optimizer has stepped once more: now DCP may write
            self.gate.set()


def _rank(rank: int, root: str, port: int, backend: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    import raytrain.strategies.deepspeed as zero
    from raytrain import Trainer
    from raytrain.worker import loop
    from tests.strategies._helpers import digits_args, digits_model, full_weights, state_digest

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gate, failing, seen, write_threads = threading.Event(), threading.Event(), {}, []
    distributed, folder, _ = BACKENDS[backend]
    owner, name = (FileSystemWriter, "write_data") if backend == "fsdp" else (zero, "_write_deferred")
    real_write = getattr(owner, name)

    def gated_write(*args):
        write_threads.append(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("the backend writes on the training thread")
        if failing.is_set() and rank == 1:
            raise OSError(28, "No space left on device (injected)")
        if not gate.wait(60):
            raise TimeoutError("the step after the save never came")
        return real_write(*args)

    setattr(owner, name, gated_write)
    rng = np.random.default_rng(0)  # digits-shaped rows (sklearn's loader would cost each process seconds)
    train = {"pixels": rng.random((640, 64), dtype=np.float32), "labels": rng.integers(0, 10, 640)}
    digests = {}
    first = os.path.join(root, "uninterrupted", f"checkpoint-{SAVE_AT}")
    for name, resume in (("uninterrupted", None), ("resumed", first)):
        gate.clear()
        if resume is not None:
            gate.set()
        args = digits_args(os.path.join(root, name), max_steps=STEPS, save_steps=SAVE_AT, save_async=True,
                           distributed=distributed)
        trainer = Trainer(digits_model(), args, train_dataset=train, callbacks=[_GateWrites(gate, seen, folder)])
        loop.train(trainer, resume)
        digests[name] = state_digest(full_weights(trainer.model_wrapped))
    failing.set()  # rank 1's write fails: every rank's save fails with it, none hangs or commits
    args = digits_args(os.path.join(root, "failing"), max_steps=SAVE_AT, save_steps=SAVE_AT, save_async=True,
                       distributed=distributed)
    try:
        loop.train(Trainer(digits_model(), args, train_dataset=train), None)
        error = None
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        error = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "digests": digests, "write_threads": write_threads, "error": error}, f)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_background_save_of_sharded_state_writes_after_save_returns_and_resumes_bit_exactly(backend, tmp_path):
    start(_rank, (str(tmp_path), free_port(), backend), 2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    _, _, files = BACKENDS[backend]
    for r in results:
        # save() returned with none of the backend's files on disk, the checkpoint not committed
        assert r["seen"] == {"files_at_return": [], "committed_at_return": False}
        assert r["write_threads"] and "MainThread" not in r["write_threads"]
        # the state staged at the save was written (a later one would change the resumed run's maths)
        assert r["digests"]["resumed"] == r["digests"]["uninterrupted"]
    assert results[0]["digests"] == results[1]["digests"]
    first = tmp_path / "uninterrupted" / f"checkpoint-{SAVE_AT}"
    manifest = ckpt.verify_checkpoint(str(first))
    assert files <= set(manifest["files"]), sorted(manifest["files"])
    assert manifest["strategy"] == BACKENDS[backend][0]["strategy"] and manifest["world_size"] == 2
    last = [ckpt.load_weights(str(tmp_path / run / f"checkpoint-{STEPS}")) for run in ("uninterrupted", "resumed")]
    assert last[0].keys() == last[1].keys() and all(torch.equal(last[0][k], last[1][k]) for k in last[0])
    assert not [p for p in (tmp_path / "uninterrupted").iterdir() if p.name.startswith(".tmp")]
    for r in results:  # surfaced by the writer on every rank, naming the failing rank's error
        assert r["error"].startswith("CheckpointError: background checkpoint write failed: ")
        assert "No space left on device (injected)" in r["error"]
    if backend == "fsdp":  # DCP's own collectives carry rank 1's error to rank 0
        assert all("CheckpointException" in r["error"] for r in results)
    else:  # the commit's gather carries it
        assert "CheckpointError: rank 1 could not write its files: OSError: " in results[0]["error"]
    assert not (tmp_path / "failing" / f"checkpoint-{SAVE_AT}").exists()
