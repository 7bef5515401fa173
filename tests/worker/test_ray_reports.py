"""What a Ray worker reports to Ray Train: each save, with the last log's metrics, and nothing per log.
Ray's controller takes one report per worker each time it polls (every 2 s): a report per log held
training at one log per 2 s. In-process, with ray.train.report recorded."""

from __future__ import annotations

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
