"""A distributed trial of a URI sweep whose node was lost after an evaluation's checkpoint reached the
trial's storage but before Ray's controller registered it: the restarted workers report that checkpoint
again where it lies (no upload), with its evaluation and objective read back from it, so Tune gets the
result it missed and Ray's CheckpointConfig (scored by the objective) rotates it. In-process, with Ray's
context and ray.train.report recorded."""

from __future__ import annotations

import types

import pyarrow.fs
import pytest
import ray.train
from ray.train import CheckpointUploadMode

from raytrain import Trainer
from raytrain.sweep.trial import CKPT_KEY, _WorkerReporter
from tests.tiny import TinyClassifier, args_for, columns


def _reporter_on_rank(rank: int, monkeypatch, reports: list) -> _WorkerReporter:
    storage = types.SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem())
    context = types.SimpleNamespace(get_storage=lambda: storage, get_world_rank=lambda: rank)
    monkeypatch.setattr(ray.train, "get_context", lambda: context)
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None, **kw: reports.append((metrics, checkpoint, kw)))
    return _WorkerReporter(lambda m: m["eval_loss"], 1, upload=True)


def test_an_unregistered_evaluation_checkpoint_is_reported_with_its_objective(tmp_path, monkeypatch):
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=3,
                                                 save_steps=3, per_device_train_batch_size=4),
                      train_dataset=columns(48), eval_dataset=columns(16, seed=1))
    trainer.train()
    evaluated = [h for h in trainer.state.log_history if "eval_loss" in h and h["step"] == 3]
    stored = tmp_path / "out" / "checkpoint-3"  # stands for its copy in the trial's storage

    for rank in (0, 1):
        reports: list = []
        reporter = _reporter_on_rank(rank, monkeypatch, reports)
        reporter.unregistered = (str(stored), 3)
        reporter.on_train_begin(trainer.args, trainer.state, trainer.control)
        (metrics, checkpoint, kw), = reports  # every rank reports once (Ray needs as many reports per rank)
        assert kw["checkpoint_upload_mode"] == CheckpointUploadMode.NO_UPLOAD
        assert metrics["objective"] == pytest.approx(evaluated[0]["eval_loss"]) and metrics["step"] == 3
        assert metrics[CKPT_KEY] == str(stored)
        assert (checkpoint.path if checkpoint else None) == (str(stored) if rank == 0 else None)  # rank 0 names it
        assert reporter.unregistered is None  # once

    # A checkpoint without an evaluation at its step is not reported (it has no objective to be scored by).
    reports = []
    reporter = _reporter_on_rank(0, monkeypatch, reports)
    reporter.unregistered = (str(stored), 6)
    reporter.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert reports == []
