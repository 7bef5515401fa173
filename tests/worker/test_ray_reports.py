"""What a Ray worker reports to Ray Train: each save, with the last log's metrics, and nothing per log.
Ray's controller takes one report per worker each time it polls (every 2 s): a report per log held
training at one log per 2 s. In-process, with ray.train.report recorded."""

from __future__ import annotations

import os

import ray.train

from raytrain import Trainer
from raytrain.worker.ray_worker import RayReportCallback
from tests.tiny import TinyClassifier, args_for, columns


def test_saves_are_reported_with_the_last_logs_metrics_and_logs_are_not(tmp_path, monkeypatch):
    reports = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None, **kw: reports.append((metrics, checkpoint)))
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=6, logging_steps=1, save_steps=3,
                                                 per_device_train_batch_size=4), train_dataset=columns(48))
    trainer.add_callback(RayReportCallback(trainer.get_strategy()))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 6  # six logs, two saves: two reports
    assert [m["checkpoint_step"] for m, _ in reports] == [3, 6]
    assert [c.path for _, c in reports] == [str(tmp_path / "out" / f"checkpoint-{s}") for s in (3, 6)]
    first, _ = reports[0]
    assert first["step"] == 3 and first["loss"] == logged[2]["loss"]


def test_a_checkpoint_reaches_storage_on_its_own_filesystem_as_hard_links(tmp_path, monkeypatch):
    """Ray's upload of a reported checkpoint (upload_checkpoint): hard links into storage on the same
    filesystem, the ranks' directories merged as Ray merges them; Ray's own copy elsewhere."""
    import errno
    import types

    import pyarrow.fs

    from raytrain.worker.ray_worker import upload_checkpoint

    copies = []
    storage = types.SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem(),
                                    experiment_fs_path=str(tmp_path / "storage" / "run"),
                                    persist_current_checkpoint=lambda c, name: copies.append((c.path, name)) or "copied")
    monkeypatch.setattr(ray.train, "get_context", lambda: types.SimpleNamespace(get_storage=lambda: storage))
    ranks = []
    for rank, files in enumerate([{"model.safetensors": b"w" * 64, "rng_state_0.pth": b"r0", "dcp/0.distcp": b"s0"},
                                  {"rng_state_1.pth": b"r1", "dcp/1.distcp": b"s1"}]):
        d = tmp_path / f"disk{rank}" / "checkpoint-5"
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
        ranks.append(d)
        got = upload_checkpoint(ray.train.Checkpoint.from_directory(str(d)), "checkpoint_x")
        assert got.path == storage.experiment_fs_path + "/checkpoint_x"
    stored = tmp_path / "storage" / "run" / "checkpoint_x"
    assert sorted(str(p.relative_to(stored)) for p in stored.rglob("*") if p.is_file()) == \
        ["dcp/0.distcp", "dcp/1.distcp", "model.safetensors", "rng_state_0.pth", "rng_state_1.pth"]
    assert os.stat(stored / "dcp" / "1.distcp").st_ino == os.stat(ranks[1] / "dcp" / "1.distcp").st_ino
    assert os.stat(stored / "model.safetensors").st_ino == os.stat(ranks[0] / "model.safetensors").st_ino
    assert copies == []

    # A file that cannot be linked: Ray copies the directory, after the names already linked there are
    # unlinked (a copy over a link would write into the checkpoint's own file).
    real_link = os.link

    def link_then_fail(src, dst):
        if src.endswith(".distcp"):  # in dcp/, walked after the files beside it are linked
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_link(src, dst)
    monkeypatch.setattr(os, "link", link_then_fail)
    storage.persist_current_checkpoint = lambda c, name: copies.append(
        (c.path, name, sorted(p.name for p in (tmp_path / "storage" / "run" / name).rglob("*") if p.is_file()))) or "copied"
    assert upload_checkpoint(ray.train.Checkpoint.from_directory(str(ranks[0])), "checkpoint_y") == "copied"
    assert copies == [(str(ranks[0]), "checkpoint_y", [])]
    assert (ranks[0] / "model.safetensors").read_bytes() == b"w" * 64
