"""raytrain.checkpoint.store: the layout, atomic writes (even under SIGKILL), the manifest and its checks,
safe loading, rotation with the best kept, and asynchronous saving that writes the same bytes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import pickle
import shutil

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load_file

from examples.digits import build_model
from raytrain import CheckpointError, Trainer, TrainingArguments, get_last_checkpoint
from raytrain.checkpoint import store as ckpt, weights as ckpt_weights
from raytrain.checkpoint import io as checkpoint_io
from tests.tiny import ROOT, kill_at_save

TESTS = os.path.dirname(os.path.abspath(__file__))
FILES = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
         "training_args.json", "training_args.bin", "data_state.json", "loop_state.json", "manifest.json"}


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def make_data(n: int = 40, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"pixels": rng.random((n, 64), dtype=np.float32), "labels": rng.integers(0, 10, n)}


def make_trainer(out, *, init_seed: int = 0, callbacks=(), hidden: int = 16, **kw) -> Trainer:
    args = dict(output_dir=str(out), per_device_train_batch_size=4, learning_rate=0.05, logging_steps=1,
                save_steps=2, max_steps=6, full_determinism=True, seed=0, disable_tqdm=True, report_to="none")
    args.update(kw)
    torch.manual_seed(init_seed)
    return Trainer(build_model(hidden_size=hidden, dropout=0.3), TrainingArguments(**args),
                   train_dataset=make_data(), callbacks=list(callbacks))


def weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def xxh3(path) -> str:
    return xxhash.xxh3_128(open(path, "rb").read()).hexdigest()


def rewrite_manifest(path) -> None:
    """Make the manifest agree with the files again (as an attacker or a careless copy would), in
    the sha256 entries of format 1."""
    mpath = os.path.join(path, "manifest.json")
    manifest = json.load(open(mpath))
    manifest["files"] = {rel: {"size": os.path.getsize(os.path.join(path, rel)), "sha256": sha256(os.path.join(path, rel))}
                         for rel in manifest["files"] if os.path.exists(os.path.join(path, rel))}
    json.dump(manifest, open(mpath, "w"))


# ---------------------------------------------------------------- layout


def test_layout_manifest_and_contents(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=2)
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    path = tmp_path / "checkpoint-4"
    assert set(os.listdir(path)) == FILES  # no scaler.pt without fp16

    manifest = json.load(open(path / "manifest.json"))
    assert {k: manifest[k] for k in ("format_version", "global_step", "world_size", "strategy")} == \
        {"format_version": 2, "global_step": 4, "world_size": 1, "strategy": "single"}
    assert manifest["checksum"] == "xxh3_128"  # the algorithm is named, and each entry is keyed by it
    assert set(manifest["files"]) == FILES - {"manifest.json"}
    for rel, meta in manifest["files"].items():
        assert meta == {"size": os.path.getsize(path / rel), "xxh3_128": xxh3(path / rel)}, rel
    newest_other = max(os.stat(path / rel).st_mtime_ns for rel in manifest["files"])
    assert os.stat(path / "manifest.json").st_mtime_ns >= newest_other  # written last

    # weights: safetensors alone reads them, and they are the model's at step 4
    assert_same(load_file(str(path / "model.safetensors")), weights(trainer))
    data_state = json.load(open(path / "data_state.json"))
    assert {k: data_state[k] for k in ("epoch", "next_batch", "global_step", "samples_consumed", "seed",
                                       "batch_size", "num_samples", "gradient_accumulation_steps")} == \
        {"epoch": 0, "next_batch": 4, "global_step": 4, "samples_consumed": 16, "seed": 0, "batch_size": 4,
         "num_samples": 40, "gradient_accumulation_steps": 1}
    state = json.load(open(path / "trainer_state.json"))
    assert state["global_step"] == 4 and [h["step"] for h in state["log_history"]] == [1, 2, 3, 4]
    assert json.load(open(path / "training_args.json"))["output_dir"] == str(tmp_path)
    rng = ckpt.load_pickle(str(path / "rng_state.pth"))
    assert {"python", "numpy", "cpu"} <= set(rng)
    optim = ckpt.load_pickle(str(path / "optimizer.pt"))
    assert_same({str(k): v["exp_avg"] for k, v in optim["state"].items()},
                {str(k): v["exp_avg"] for k, v in trainer.optimizer.state_dict()["state"].items()})
    assert get_last_checkpoint(str(tmp_path)) == str(path)


def test_sharded_weights_above_the_threshold(tmp_path):
    model = build_model(hidden_size=32, dropout=0.0)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    names = ckpt.save_weights(state, str(tmp_path), max_shard_bytes=4096)
    shards = sorted(n for n in names if n != "model.safetensors.index.json")
    assert len(shards) > 1 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(1, len(shards) + 1)]
    assert not os.path.exists(tmp_path / "model.safetensors")
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # each shard is within the limit, or a single larger tensor
        tensors = load_file(str(tmp_path / shard))
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 4096
    assert_same(ckpt.load_weights(str(tmp_path)), state)


def test_sharded_checkpoint_from_training_verifies_and_lists_every_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_weights, "MAX_SHARD_BYTES", 4096)
    make_trainer(tmp_path, max_steps=2, hidden=32).train()
    path = tmp_path / "checkpoint-2"
    files = set(json.load(open(path / "manifest.json"))["files"])
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert any(f.startswith("model-00001-of-") for f in files)
    assert get_last_checkpoint(str(tmp_path)) == str(path)


def test_tied_weights_round_trip_and_host_copy_keeps_them_tied(tmp_path):
    emb = torch.randn(5, 3)
    state = {"embed.weight": emb, "lm_head.weight": emb, "bias": torch.zeros(5, dtype=torch.bfloat16)}
    os.makedirs(tmp_path / "a")
    ckpt.save_weights(state, str(tmp_path / "a"))
    loaded = ckpt.load_weights(str(tmp_path / "a"))
    assert_same(loaded, state)
    assert set(load_file(str(tmp_path / "a" / "model.safetensors"))) == {"embed.weight", "bias"}
    host = ckpt._to_host(state)
    assert host["embed.weight"].untyped_storage().data_ptr() == host["lm_head.weight"].untyped_storage().data_ptr()
    assert host["embed.weight"].untyped_storage().data_ptr() != emb.untyped_storage().data_ptr()
    os.makedirs(tmp_path / "b")
    ckpt.save_weights(host, str(tmp_path / "b"))
    assert open(tmp_path / "a" / "model.safetensors", "rb").read() == open(tmp_path / "b" / "model.safetensors", "rb").read()


# ---------------------------------------------------------------- atomic, even under SIGKILL


def _subprocess_main(out: str, threads: int, save_async: bool = False) -> None:
    """Entry point of the process the SIGKILL test kills (imported by a fresh interpreter). CPU
    reductions split over another number of threads round differently: use the test's count."""
    torch.set_num_threads(threads)
    make_trainer(out, max_steps=9, save_steps=3, save_async=save_async).train()


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_sigkill_during_save_leaves_previous_checkpoint_and_resume_is_bit_exact(tmp_path, save_async):
    """async: the kill lands while the background thread writes step 6 (the training thread has gone
    on, and waits for that write at the save of step 9)."""
    out, flag = tmp_path / "run", tmp_path / "paused"
    # paused inside the writer of step 6: every file but the manifest written
    kill_at_save(f"from test_checkpoint import _subprocess_main; "
                 f"_subprocess_main({str(out)!r}, {torch.get_num_threads()}, {save_async})", flag, 6,
                 path=os.pathsep.join([ROOT, TESTS]))
    tmp = out / ".tmp-checkpoint-6"
    assert sorted(os.listdir(out)) == [".tmp-checkpoint-6", "checkpoint-3"]
    assert "model.safetensors" in os.listdir(tmp) and "manifest.json" not in os.listdir(tmp)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")

    reference = make_trainer(tmp_path / "ref", max_steps=9, save_strategy="no")
    reference.train()
    resumed = make_trainer(out, init_seed=99, max_steps=9, save_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]  # the .tmp is gone
    ckpt.verify_checkpoint(str(out / "checkpoint-6"))


def test_a_complete_temporary_directory_is_never_used_and_is_cleaned_by_the_next_save(tmp_path):
    make_trainer(tmp_path, max_steps=4, save_steps=2, callbacks=[]).train()
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / ".tmp-checkpoint-6")  # even with a valid manifest
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / ".tmp-checkpoint-8")
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    make_trainer(tmp_path, max_steps=6, save_steps=2).train(resume_from_checkpoint=True)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_pause_hook_parses_flag_and_step(tmp_path, monkeypatch):
    monkeypatch.setenv(checkpoint_io.PAUSE_ENV, f"{tmp_path}/fl@g@7")
    checkpoint_io.maybe_pause(str(tmp_path), 6)  # another step: returns at once
    assert not os.path.exists(f"{tmp_path}/fl@g")
    monkeypatch.delenv(checkpoint_io.PAUSE_ENV)
    checkpoint_io.maybe_pause(str(tmp_path), 7)


# ---------------------------------------------------------------- safe to load


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fmt", ["torch_zip", "raw_pickle"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, fmt):
    make_trainer(tmp_path / "run", max_steps=2, save_steps=2).train()
    path = tmp_path / "run" / "checkpoint-2"
    marker = tmp_path / "pwned"
    evil = {"state": {}, "param_groups": [], "x": _Payload(marker)}
    if fmt == "torch_zip":
        torch.save(evil, path / "optimizer.pt")
    else:
        with open(path / "optimizer.pt", "wb") as f:
            pickle.dump(evil, f)
    rewrite_manifest(path)
    ckpt.verify_checkpoint(str(path))  # checksums agree: only loading can catch it

    with pytest.raises(CheckpointError, match=r"optimizer\.pt: refused to load") as err:
        ckpt.load_pickle(str(path / "optimizer.pt"))
    assert "could run code" in str(err.value)
    trainer = make_trainer(tmp_path / "run", max_steps=4, init_seed=3)
    before = weights(trainer)
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: refused to load"):
        trainer.train(resume_from_checkpoint=True)
    assert not marker.exists()
    assert_same(weights(trainer), before)  # a refused checkpoint changes nothing
    assert trainer.state.global_step == 0


# ---------------------------------------------------------------- verified


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _flip(path):
    f = path / "optimizer.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _flip_weights(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # a tensor's byte: same size, still a valid safetensors file
    f.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated_weights": (_truncate, "model.safetensors", "truncated"),
    "flipped_weights_byte": (_flip_weights, "model.safetensors", "xxh3_128 checksum mismatch"),
    "flipped_optimizer_byte": (_flip, "optimizer.pt", "xxh3_128 checksum mismatch"),
    "deleted_trainer_state": (lambda p: os.remove(p / "trainer_state.json"), "trainer_state.json", "missing"),
    "deleted_manifest": (lambda p: os.remove(p / "manifest.json"), "manifest.json", "never completed"),
    "garbage_manifest": (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json", "unparsable"),
}


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("three")
    make_trainer(root / "run", max_steps=6, save_steps=2).train()
    return root / "run"


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_checkpoint_is_skipped_with_its_reason_or_refused_by_name(tmp_path, three_checkpoints, kind, caplog):
    corrupt, bad_file, reason = CORRUPTIONS[kind]
    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    corrupt(out / "checkpoint-6")

    with caplog.at_level(logging.WARNING, logger="raytrain.checkpoint.store"):
        assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    [warning] = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert str(out / "checkpoint-6" / bad_file) in warning and reason in warning

    with pytest.raises(CheckpointError, match=reason) as err:
        make_trainer(out, init_seed=1).train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert str(out / "checkpoint-6" / bad_file) in str(err.value)

    trainer = make_trainer(out, init_seed=1, max_steps=6)  # resume=True takes the next older one
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.log_history[0]["step"] == 1 and trainer.state.global_step == 6
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    ckpt.verify_checkpoint(str(out / "checkpoint-6"))  # rewritten, whole again


def test_unparsable_json_with_a_matching_manifest_is_refused(tmp_path, three_checkpoints):
    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    (out / "checkpoint-6" / "data_state.json").write_text('{"epoch": 0,')
    rewrite_manifest(out / "checkpoint-6")
    with pytest.raises(CheckpointError, match=r"data_state\.json: unparsable json"):
        ckpt.verify_checkpoint(str(out / "checkpoint-6"))


def test_resume_never_silently_starts_from_scratch(tmp_path, three_checkpoints, caplog):
    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    for step in (2, 4, 6):
        _flip(out / f"checkpoint-{step}")
    for resume in (True, "auto"):
        with pytest.raises(CheckpointError, match="none of the 3 checkpoint"):
            make_trainer(out).train(resume_from_checkpoint=resume)
    # HF's ValueError texts first, as scripts written against transformers catch and match them.
    nope = tmp_path / "nope" / "checkpoint-3"
    with pytest.raises(ValueError, match=re.escape(f"Can't find a valid checkpoint at {nope} (no such directory)")):
        make_trainer(tmp_path / "other").train(resume_from_checkpoint=str(nope))
    with pytest.raises(ValueError, match=re.escape(f"No valid checkpoint found in output directory "
                                                   f"({tmp_path / 'empty'}): resume_from_checkpoint=True")):
        make_trainer(tmp_path / "empty").train(resume_from_checkpoint=True)


def test_model_only_or_mismatched_checkpoints_are_refused_by_name(tmp_path):
    make_trainer(tmp_path / "a", max_steps=2, save_only_model=True).train()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: missing: .*save_only_model"):
        make_trainer(tmp_path / "a", max_steps=4).train(resume_from_checkpoint=True)
    make_trainer(tmp_path / "b", max_steps=2).train()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: does not fit this run"):
        make_trainer(tmp_path / "b", max_steps=4, hidden=8).train(resume_from_checkpoint=True)


def test_newer_format_version_is_refused(tmp_path, three_checkpoints):
    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    mpath = out / "checkpoint-6" / "manifest.json"
    manifest = json.load(open(mpath))
    manifest["format_version"] = ckpt.FORMAT_VERSION + 1
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(CheckpointError, match="format_version 3 is newer"):
        ckpt.verify_checkpoint(str(out / "checkpoint-6"))


# ---------------------------------------------------------------- rotation


class Scripted:
    """compute_metrics returning a scripted score per evaluation."""

    def __init__(self, scores):
        self.scores = list(scores)

    def __call__(self, pred):
        return {"score": self.scores.pop(0)}


@pytest.mark.parametrize("save_async", [False, True])
def test_rotation_keeps_at_most_the_limit_newest_and_best_and_best_stays_valid(tmp_path, save_async):
    trainer = make_trainer(tmp_path, max_steps=10, save_steps=2, eval_strategy="steps", eval_steps=2,
                           save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="score",
                           greater_is_better=True, save_async=save_async)
    trainer.eval_dataset, trainer.compute_metrics = make_data(8), Scripted([0.3, 0.9, 0.1, 0.2, 0.4])
    trainer.train()
    # As HF: save_total_limit counts the best one; the newest is kept for resuming.
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-4"]
    best = str(tmp_path / "checkpoint-4")
    assert trainer.state.best_model_checkpoint == best and trainer.state.best_global_step == 4
    ckpt.verify_checkpoint(best)
    assert json.load(open(tmp_path / "checkpoint-10" / "trainer_state.json"))["best_model_checkpoint"] == best
    assert_same(weights(trainer), ckpt.load_weights(best))  # load_best_model_at_end loaded it


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (1, 2, 3):
        os.makedirs(tmp_path / f"checkpoint-{step}")
    deleted = ckpt.rotate_checkpoints(str(tmp_path), 1, str(tmp_path / "checkpoint-1"),
                                      protect=str(tmp_path / "checkpoint-2"))
    assert deleted == [] and sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


# ---------------------------------------------------------------- asynchronous saving


def _all_files(out) -> dict:
    return {os.path.relpath(os.path.join(root, n), out): open(os.path.join(root, n), "rb").read()
            for root, _, names in os.walk(out) for n in names}


def test_async_saving_writes_the_same_bytes_as_sync(tmp_path):
    out = tmp_path / "run"
    make_trainer(out, max_steps=6, save_steps=2).train()
    sync = _all_files(out)
    shutil.rmtree(out)
    trainer = make_trainer(out, max_steps=6, save_steps=2, save_async=True)
    trainer.train()  # returns only after the last background write
    asyn = _all_files(out)
    assert set(sync) == set(asyn) and len(sync) == 3 * len(FILES)
    differing = sorted(rel for rel in sync if sync[rel] != asyn[rel])
    # training_args.json (and HF's pickled training_args.bin) record save_async itself, and each
    # manifest lists those files' hashes
    assert differing == [f"checkpoint-{s}/{n}" for s in (2, 4, 6)
                         for n in ("manifest.json", "training_args.bin", "training_args.json")]
    for step in (2, 4, 6):
        a, b = (json.loads(d[f"checkpoint-{step}/training_args.json"]) for d in (sync, asyn))
        assert (a.pop("save_async"), b.pop("save_async")) == (False, True) and a == b
        a, b = (json.loads(d[f"checkpoint-{step}/manifest.json"]) for d in (sync, asyn))
        for name in ("training_args.json", "training_args.bin"):
            a["files"].pop(name), b["files"].pop(name)
        assert a == b
        ckpt.verify_checkpoint(str(out / f"checkpoint-{step}"))


def test_torch_save_is_byte_deterministic_through_the_writer(tmp_path):
    betas = (0.9, 0.999)  # torch.optim shares one tuple between groups; pickle memoizes it by identity
    exp_avg = torch.randn(4, 4)
    opt_state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg, "view": exp_avg[1:]}},
                 "param_groups": [{"lr": 0.1, "betas": betas, "params": [0]}, {"betas": betas, "params": []}]}
    a = checkpoint_io.save_pickle(opt_state, str(tmp_path / "a.pt"))
    b = checkpoint_io.save_pickle(ckpt._to_host(opt_state), str(tmp_path / "b.pt"))
    assert a == b and open(tmp_path / "a.pt", "rb").read() == open(tmp_path / "b.pt", "rb").read()
    assert a["xxh3_128"] == xxh3(tmp_path / "a.pt")


def test_async_write_failure_surfaces_from_train(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt, "write_weights", fail)
    trainer = make_trainer(tmp_path, max_steps=6, save_steps=2, save_async=True)
    with pytest.raises(CheckpointError, match="background checkpoint write failed: OSError: No space left"):
        trainer.train()
    assert get_last_checkpoint(str(tmp_path)) is None
    assert not any(n.startswith("checkpoint-") for n in os.listdir(tmp_path))


def test_async_failure_in_the_final_save_is_not_swallowed(tmp_path, monkeypatch):
    real = ckpt.write_weights

    def fail_at_step_4(state, directory, *a, **kw):
        if directory.endswith("-4"):
            raise OSError("disk went away")
        return real(state, directory, *a, **kw)

    monkeypatch.setattr(ckpt, "write_weights", fail_at_step_4)
    with pytest.raises(CheckpointError, match="disk went away"):
        make_trainer(tmp_path, max_steps=4, save_steps=2, save_async=True).train()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_weights_read_in_one_pass_equal_safetensors_own_reader(tmp_path):
    """load_weights parses safetensors itself (checksumming the bytes as it reads them): every dtype,
    a scalar, an empty tensor and tied weights come back equal to safetensors' load_file."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    emb = torch.randn(5, 3, generator=g)
    state = {"f32": torch.randn(4, 3, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
             "f16": torch.randn(3, generator=g).half(), "i64": torch.arange(5), "i8": torch.arange(-3, 4).to(torch.int8),
             "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
             "emb": emb, "head": emb}
    ckpt.save_weights(state, str(tmp_path))
    loaded = ckpt.load_weights(str(tmp_path))
    reference = load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == set(state) and set(reference) == set(state) - {"head"}
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape and torch.equal(loaded[name], t), name
    for name, t in reference.items():
        assert torch.equal(loaded[name], t), name
    assert loaded["head"].data_ptr() == loaded["emb"].data_ptr()  # tied again


@pytest.mark.parametrize("size", [0, 100, 4096, 4097, (1 << 20) + 5, 3 << 20])
def test_direct_io_writes_the_same_bytes_and_checksum_as_the_page_cache(tmp_path, size):
    from raytrain.checkpoint import io as checkpoint_io

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    pieces = [data[:7], data[7:size // 2], data[size // 2:]]  # writes that straddle the aligned blocks
    direct = checkpoint_io.write_bytes(str(tmp_path / "direct"), pieces, direct=True)
    cached = checkpoint_io.write_bytes(str(tmp_path / "cached"), pieces, direct=False)
    assert (tmp_path / "direct").read_bytes() == data == (tmp_path / "cached").read_bytes()
    assert direct == cached == {"size": size, "xxh3_128": checkpoint_io.file_checksum(str(tmp_path / "cached"))}


def test_direct_io_is_used_where_the_filesystem_allows_it(tmp_path):
    from raytrain.checkpoint import io as checkpoint_io

    fd = checkpoint_io._open_direct(str(tmp_path / "probe"))
    if fd is None:
        pytest.skip("this filesystem has no O_DIRECT")
    os.close(fd)
    f = checkpoint_io.ChecksumFile(str(tmp_path / "w"), direct=True)
    assert f._fd is not None  # the direct path, not the fallback
    f.write(b"x" * 5000)
    assert f.close()["size"] == 5000 and (tmp_path / "w").read_bytes() == b"x" * 5000


def test_a_filesystem_that_refuses_direct_writes_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    import errno

    from raytrain.checkpoint import io as checkpoint_io

    if checkpoint_io._open_direct(str(tmp_path / "probe")) is None:
        pytest.skip("this filesystem has no O_DIRECT")
    real_write, calls = os.write, []

    def refuse_second(fd, data):  # the first block goes through, the next is refused mid-file
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(checkpoint_io.os, "write", refuse_second)
    data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 11, dtype=np.uint8).tobytes()
    entry = checkpoint_io.write_bytes(str(tmp_path / "w"), [data], direct=True)
    monkeypatch.undo()
    assert len(calls) == 2 and (tmp_path / "w").read_bytes() == data
    assert entry == {"size": len(data), "xxh3_128": checkpoint_io.file_checksum(str(tmp_path / "w"))}
