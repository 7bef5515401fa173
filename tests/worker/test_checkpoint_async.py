"""Checkpoint format 2 and asynchronous saves: manifests of format 1 (sha256) still verify and resume
bit-exactly; the xxh3_128 manifest names every damaged file; a background save writes what the state
was at the step boundary; saves that meet one in flight wait or are skipped, never corrupt."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from raytrain import CheckpointError, TrainerCallback, get_last_checkpoint
from raytrain.checkpoint import store as ckpt
from raytrain.strategies.base import SideChannel
from test_checkpoint import assert_same, make_trainer, weights
from tiny import StopAt


def as_format_1(path) -> None:
    """Rewrite a checkpoint's manifest as raytrain wrote it before format 2: sha256 of every file."""
    mpath = os.path.join(path, "manifest.json")
    manifest = json.load(open(mpath))
    files = {rel: {"size": os.path.getsize(os.path.join(path, rel)),
                   "sha256": hashlib.sha256(open(os.path.join(path, rel), "rb").read()).hexdigest()}
             for rel in manifest["files"]}
    old = {"format_version": 1, "global_step": manifest["global_step"], "world_size": manifest["world_size"],
           "strategy": manifest["strategy"], "files": files}
    with open(mpath, "w") as f:
        json.dump(old, f, indent=2, sort_keys=True)


def test_a_sha256_checkpoint_of_format_1_verifies_detects_damage_and_resumes_bit_exact(tmp_path):
    out = tmp_path / "run"
    make_trainer(out, max_steps=6, save_steps=3, callbacks=[StopAt(3)]).train()  # preempted at step 3
    as_format_1(out / "checkpoint-3")
    manifest = ckpt.verify_checkpoint(str(out / "checkpoint-3"))
    assert manifest["format_version"] == 1 and "checksum" not in manifest

    damaged = tmp_path / "damaged"
    shutil.copytree(out / "checkpoint-3", damaged)
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (damaged / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 checksum mismatch") as err:
        ckpt.verify_checkpoint(str(damaged))
    assert str(damaged / "model.safetensors") in str(err.value)

    reference = make_trainer(tmp_path / "ref", max_steps=6, save_strategy="no")
    reference.train()
    resumed = make_trainer(out, init_seed=7, max_steps=6, save_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))
    assert json.load(open(out / "checkpoint-6" / "manifest.json"))["format_version"] == ckpt.FORMAT_VERSION


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("written") / "run"
    make_trainer(out, max_steps=2, save_steps=2).train()
    return out / "checkpoint-2"


def _flip_last_byte(p):
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x80
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, reason", [
    (_flip_last_byte, "model.safetensors", "xxh3_128 checksum mismatch with the manifest (corrupted)"),
    (_flip_last_byte, "rng_state.pth", "xxh3_128 checksum mismatch with the manifest (corrupted)"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), "optimizer.pt", "the manifest says"),
    (os.remove, "scheduler.pt", "missing (listed in the manifest)"),
], ids=["flipped_weights", "flipped_rng", "truncated_optimizer", "missing_scheduler"])
def test_the_new_checksum_names_each_damaged_file(tmp_path, written, damage, file, reason):
    path = tmp_path / "ckpt"
    shutil.copytree(written, path)
    ckpt.verify_checkpoint(str(path))
    damage(path / file)
    with pytest.raises(CheckpointError) as err:
        ckpt.verify_checkpoint(str(path))
    assert str(err.value).startswith(f"{path / file}: ") and reason in str(err.value)


def test_an_unknown_checksum_algorithm_is_refused_by_name(tmp_path, written):
    path = tmp_path / "ckpt"
    shutil.copytree(written, path)
    manifest = json.load(open(path / "manifest.json"))
    entry = manifest["files"]["scheduler.pt"]
    entry["md5"] = entry.pop("xxh3_128")
    json.dump(manifest, open(path / "manifest.json", "w"))
    with pytest.raises(CheckpointError, match=r"manifest\.json: the entry of scheduler\.pt has no checksum "
                                              r"this raytrain knows \(expected one of xxh3_128, sha256\)"):
        ckpt.verify_checkpoint(str(path))


# ---------------------------------------------------------------- the writer, directly


def _gate(monkeypatch) -> threading.Event:
    """Pickled files are written only once the returned event is set (a slow disk, held by the test)."""
    gate, real = threading.Event(), ckpt.save_pickle

    def gated(obj, path):
        assert gate.wait(60), "the test never opened the gate"
        return real(obj, path)

    monkeypatch.setattr(ckpt, "save_pickle", gated)
    return gate


def _payload(w: torch.Tensor, step: int) -> ckpt.CheckpointPayload:
    return ckpt.CheckpointPayload(weights={"w": w, "tied": w}, pickles={"optimizer.pt": {"exp_avg": w[1:]}},
                                  jsons={"trainer_state.json": {"global_step": step}})


def test_async_save_writes_the_state_of_the_step_boundary_and_reuses_its_buffers(tmp_path, monkeypatch):
    gate = _gate(monkeypatch)
    writer = ckpt.CheckpointWriter(str(tmp_path), save_async=True)
    w = torch.arange(1000, dtype=torch.float32)
    writer.save(1, _payload(w, 1))
    assert writer.in_flight()
    w += 0.5  # the next optimizer step, while checkpoint-1 is still being written
    buffers = [b.data_ptr() for b in writer._staging._buffers]
    gate.set()
    writer.save(2, _payload(w, 2))  # waits for checkpoint-1, then copies into the same host buffers
    writer.close()
    assert [b.data_ptr() for b in writer._staging._buffers] == buffers and len(buffers) == 1  # w, tied, view: one
    for step, expected in ((1, torch.arange(1000.0)), (2, torch.arange(1000.0) + 0.5)):
        path = str(tmp_path / f"checkpoint-{step}")
        ckpt.verify_checkpoint(path)
        loaded = ckpt.load_weights(path)
        assert torch.equal(loaded["w"], expected) and torch.equal(loaded["tied"], expected)
        assert torch.equal(ckpt.load_pickle(os.path.join(path, "optimizer.pt"))["exp_avg"], expected[1:])


def test_skip_policy_drops_a_save_while_one_is_in_flight_but_never_a_must_save(tmp_path, monkeypatch):
    gate = _gate(monkeypatch)
    writer = ckpt.CheckpointWriter(str(tmp_path), save_async=True, async_policy="skip")
    writer.save(1, _payload(torch.ones(10), 1))
    assert writer.should_skip() and not writer.should_skip(must_save=True)
    gate.set()
    writer.wait()
    assert not writer.should_skip()
    writer.close()
    with pytest.raises(ValueError, match="save_async_policy: 'sometimes' is not one of 'wait', 'skip'"):
        ckpt.CheckpointWriter(str(tmp_path), async_policy="sometimes")


# ---------------------------------------------------------------- the loop: saves meeting one in flight


class _OpenAt(TrainerCallback):
    """Opens the gate at the end of step `step`."""

    def __init__(self, gate: threading.Event, step: int):
        self.gate, self.step = gate, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            self.gate.set()


def _model_bytes(out) -> dict:
    return {n: open(os.path.join(out, n, "model.safetensors"), "rb").read()
            for n in os.listdir(out) if n.startswith("checkpoint-")}


def test_saves_meeting_one_in_flight_wait_and_write_what_a_sync_run_writes(tmp_path, monkeypatch):
    make_trainer(tmp_path / "sync", max_steps=6, save_steps=1).train()
    gate = _gate(monkeypatch)
    timer = threading.Timer(0.5, gate.set)  # the training thread is blocked in the wait: open from outside
    timer.start()
    make_trainer(tmp_path / "wait", max_steps=6, save_steps=1, save_async=True).train()
    timer.cancel()
    assert _model_bytes(tmp_path / "wait") == _model_bytes(tmp_path / "sync")  # all six, same bytes
    for step in range(1, 7):
        ckpt.verify_checkpoint(str(tmp_path / "wait" / f"checkpoint-{step}"))


def test_saves_meeting_one_in_flight_are_skipped_and_the_last_is_written(tmp_path, monkeypatch):
    gate = _gate(monkeypatch)
    trainer = make_trainer(tmp_path / "skip", max_steps=8, save_steps=1, save_async=True,
                           callbacks=[_OpenAt(gate, 5)])
    trainer.args.save_async_policy = "skip"
    trainer.train()
    names = set(os.listdir(tmp_path / "skip"))
    assert {"checkpoint-1", "checkpoint-8"} <= names  # the first, and the last: always written
    assert not names & {"checkpoint-2", "checkpoint-3", "checkpoint-4"}  # in flight: skipped
    assert not any(n.startswith(".tmp") for n in names)
    for name in names:
        ckpt.verify_checkpoint(str(tmp_path / "skip" / name))
    assert_same(ckpt.load_weights(str(tmp_path / "skip" / "checkpoint-8")), weights(trainer))
    assert get_last_checkpoint(str(tmp_path / "skip")) == str(tmp_path / "skip" / "checkpoint-8")


def test_two_ranks_write_one_checkpoint_that_rank_0_seals(tmp_path):
    """Distributed saves (ranks as threads, a real barrier): each rank writes its own files, a backend
    writes sharded ones; rank 0 checksums what it did not write itself and seals one manifest.
    save_async stays synchronous here: the rename needs the barrier on the main thread."""
    barrier = threading.Barrier(2, timeout=60)
    errors = []

    def shard(rank):
        def write(directory, group):
            assert group is None  # no side channel: written synchronously
            os.makedirs(os.path.join(directory, "dcp"), exist_ok=True)
            with open(os.path.join(directory, "dcp", f"__{rank}_0.distcp"), "wb") as f:
                f.write(bytes([rank]) * 1000)
        return write

    def rank(r):
        try:
            writer = ckpt.CheckpointWriter(str(tmp_path), rank=r, world_size=2, strategy="ddp",
                                           barrier=barrier.wait, save_async=True)
            payload = ckpt.CheckpointPayload(pickles={f"rng_state_{r}.pth": {"cpu": torch.tensor([r])}},
                                             sharded_writer=shard(r))
            if r == 0:
                payload.weights = {"w": torch.arange(6.0)}
                payload.jsons = {"trainer_state.json": {"global_step": 5}}
            writer.save(5, payload)
            assert not writer.in_flight()
            writer.close()
        except Exception as e:  # surfaced below, with the rank
            errors.append((r, e))
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    manifest = ckpt.verify_checkpoint(str(tmp_path / "checkpoint-5"))
    assert set(manifest["files"]) == {"model.safetensors", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
                                      "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    assert manifest["world_size"] == 2 and manifest["strategy"] == "ddp"
    assert all(set(e) == {"size", "xxh3_128"} for e in manifest["files"].values())
    assert ckpt.load_pickle(str(tmp_path / "checkpoint-5" / "rng_state_1.pth"))["cpu"].tolist() == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_staging_from_cuda_uses_pinned_buffers_and_waits_for_the_copies():
    staging = ckpt.HostStaging()
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    host = staging.copy({"w": w, "view": w[10:]})
    w.add_(1)  # the next step, queued behind the copy on the same stream
    staging.ready()
    assert host["w"].device.type == "cpu" and host["w"].is_pinned()
    assert torch.equal(host["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert host["view"].untyped_storage().data_ptr() == host["w"].untyped_storage().data_ptr()


class _ThreadGather:
    """all_gather_object for ranks that are threads."""

    def __init__(self, n: int):
        self.barrier, self.slots = threading.Barrier(n, timeout=60), [None] * n

    def __call__(self, rank: int, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def test_two_ranks_save_in_the_background_and_commit_through_the_side_channel(tmp_path, monkeypatch):
    """save_async on two ranks (threads) with a side channel: save returns once the state is staged; the
    commit (gather, manifest, rename, barrier) runs on the background threads through the side channel
    alone, never the training thread's collectives, and only once both ranks' files are written, the
    backend's background write (DCP's, on the side channel's group) included."""
    main_barrier, side_gather, main_gather = threading.Barrier(2, timeout=60), _ThreadGather(2), _ThreadGather(2)
    side_barrier = threading.Barrier(2, timeout=60)
    on_training_threads, release = [], threading.Event()
    real_save_pickle = ckpt.save_pickle

    def slow_save_pickle(obj, path):  # rank 1's file waits until both ranks' save() has returned
        if path.endswith("rng_state_1.pth"):
            assert release.wait(60)
        return real_save_pickle(obj, path)

    monkeypatch.setattr(ckpt, "save_pickle", slow_save_pickle)
    errors, returned, sharded_done_at_commit = [], [], []

    def background_shard(r, futures):
        def write(directory, group):  # DCP's async_save: a future, its files written once released
            assert group == "side-group"
            future = Future()

            def finish():
                assert release.wait(60)
                time.sleep(0.2)  # later than this rank's own files
                os.makedirs(os.path.join(directory, "dcp"), exist_ok=True)
                with open(os.path.join(directory, "dcp", f"__{r}_0.distcp"), "wb") as f:
                    f.write(bytes([r]) * 1000)
                future.set_result(None)

            threading.Thread(target=finish).start()
            futures.append(future)
            return future
        return write

    def rank(r):
        futures = []

        def side_all_gather(obj):
            sharded_done_at_commit.append(all(f.done() for f in futures))
            return side_gather(r, obj)

        def barrier():
            on_training_threads.append(threading.current_thread().name)
            main_barrier.wait()

        try:
            writer = ckpt.CheckpointWriter(str(tmp_path), rank=r, world_size=2, strategy="ddp", barrier=barrier,
                                           save_async=True, all_gather=lambda obj: main_gather(r, obj),
                                           side_channel=SideChannel(side_all_gather, side_barrier.wait, "side-group"))
            payload = ckpt.CheckpointPayload(pickles={f"rng_state_{r}.pth": {"cpu": torch.tensor([r])}},
                                             sharded_writer=background_shard(r, futures))
            if r == 0:
                payload.weights = {"w": torch.arange(6.0)}
                payload.jsons = {"trainer_state.json": {"global_step": 5}}
            writer._leaders = [0, 0]  # one shared disk (found by a collective on the training thread)
            writer.save(5, payload)
            returned.append((r, writer.in_flight(), os.path.exists(tmp_path / "checkpoint-5")))
            main_barrier.wait()
            release.set()
            writer.close()
        except Exception as e:  # surfaced below, with the rank
            errors.append((r, e))
            main_barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    assert sorted(returned) == [(0, True, False), (1, True, False)]  # in flight, not committed, on both ranks
    assert set(on_training_threads) == {"rank0", "rank1"}  # the main barrier: training threads only
    assert sharded_done_at_commit == [True] * 4  # two gathers per rank, each after the backend's write
    manifest = ckpt.verify_checkpoint(str(tmp_path / "checkpoint-5"))
    assert set(manifest["files"]) == {"model.safetensors", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
                                      "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    assert ckpt.load_pickle(str(tmp_path / "checkpoint-5" / "rng_state_1.pth"))["cpu"].tolist() == [1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]
