"""Ray's copies of the checkpoints rotate as the node's disk does (HF's rule: the newest and the best
stay), not by Ray's num_to_keep, which keeps the newest only: a worker restarted on a new node must
still find the best checkpoint in storage for load_best_model_at_end."""

from __future__ import annotations

import json

import pyarrow.fs

from raytrain import TrainingArguments
from raytrain.checkpoint.store import checkpoints_to_drop
from raytrain.worker.ray_worker import keeps_best, prune_storage


def _store(root, steps):
    for i, step in enumerate(steps):
        d = root / f"checkpoint_2026-11-24_00-00-{i:02d}"  # Ray's names: the step is in the manifest only
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({"global_step": step, "files": {}}))
    (root / "checkpoint_torn").mkdir()  # an upload without a manifest is not counted, nor removed


def _left(root):
    return sorted(json.loads((d / "manifest.json").read_text())["global_step"]
                  for d in root.iterdir() if (d / "manifest.json").exists())


def test_storage_keeps_the_newest_and_the_best(tmp_path):
    _store(tmp_path, [5, 10, 15, 20])
    deleted = prune_storage(pyarrow.fs.LocalFileSystem(), str(tmp_path), 2, {5})
    assert _left(tmp_path) == [5, 20] and len(deleted) == 2
    assert (tmp_path / "checkpoint_torn").is_dir()
    # no limit: nothing goes
    assert prune_storage(pyarrow.fs.LocalFileSystem(), str(tmp_path), None, set()) == [] and _left(tmp_path) == [5, 20]


def test_the_rule_is_the_disks_rule():
    assert checkpoints_to_drop([1, 2, 3, 4], 2, {1}) == [2, 3]   # best (1) and newest (4) stay
    assert checkpoints_to_drop([1, 2, 3, 4], 1, {2}) == [1, 3]   # the limit grows to hold both
    assert checkpoints_to_drop([1, 2, 3, 4], 3, set()) == [1]
    assert checkpoints_to_drop([], 2, {1}) == [] and checkpoints_to_drop([1, 2], 0, set()) == []


def test_raytrain_rotates_storage_only_where_a_best_checkpoint_is_kept(tmp_path):
    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)
    assert keeps_best(args(save_total_limit=2, metric_for_best_model="eval_loss"))
    assert keeps_best(args(save_total_limit=2, load_best_model_at_end=True, eval_strategy="steps", save_steps=5,
                           eval_steps=5))  # metric_for_best_model defaults to loss, as HF
    assert not keeps_best(args(save_total_limit=2)) and not keeps_best(args(metric_for_best_model="eval_loss"))


def _stored(root, name, step, files, missing=()):
    d = root / name
    d.mkdir()
    for rel, data in files.items():
        if rel not in missing:
            (d / rel).write_bytes(data)
    entries = {rel: {"size": len(data)} for rel, data in files.items()}
    (d / "manifest.json").write_text(json.dumps({"format_version": 2, "global_step": step, "files": entries}))
    return d


def test_a_restart_takes_a_newer_complete_checkpoint_that_ray_never_registered(tmp_path, monkeypatch):
    """Ray registers a report when its controller next polls; a node lost in between leaves the save in
    storage (every rank's files) unregistered. The restarted workers take it, not Ray's older one; an
    upload missing a rank's file is not taken."""
    import types

    import ray.train

    from raytrain.worker.ray_worker import _newest_stored

    files = {"model.safetensors": b"w" * 8, "rng_state_0.pth": b"r0", "rng_state_1.pth": b"r1"}
    registered = _stored(tmp_path, "checkpoint_a", 5, files)
    newer = _stored(tmp_path, "checkpoint_b", 10, files)
    _stored(tmp_path, "checkpoint_c", 15, files, missing={"rng_state_1.pth"})  # rank 1's upload never came
    storage = types.SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem(), experiment_fs_path=str(tmp_path))
    monkeypatch.setattr(ray.train, "get_context", lambda: types.SimpleNamespace(get_storage=lambda: storage))
    rank0 = types.SimpleNamespace(is_main=True, all_gather_object=lambda obj: [obj])
    with _newest_stored(rank0, str(registered)) as (path, unregistered):
        assert path == str(newer) and unregistered == (str(newer), 10)  # for Ray to register (test_stream.py)
    with _newest_stored(rank0, str(newer)) as (path, unregistered):  # Ray's is the newest complete one: kept
        assert path == str(newer) and unregistered is None
    with _newest_stored(rank0, None) as (path, unregistered):  # nothing registered at all
        assert path == str(newer) and unregistered == (str(newer), 10)
