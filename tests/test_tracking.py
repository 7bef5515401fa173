"""MLflow tracking through report_to: params, metrics per log step, tags, in a local SQLite store."""

from __future__ import annotations

import pytest

mlflow = pytest.importorskip("mlflow")

from raytrain import Trainer, TrainingArguments  # noqa: E402


def test_mlflow_records_params_metrics_and_checkpoint_tag(tmp_path, monkeypatch, digits):
    from examples.digits import build_model, compute_metrics

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raytrain-test")
    train, val = digits
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=20, logging_steps=5, learning_rate=2e-3,
                             eval_strategy="steps", eval_steps=10, save_steps=10, report_to="mlflow",
                             run_name="digits-test", disable_tqdm=True)
    Trainer(build_model(), args, train_dataset=train, eval_dataset=val, compute_metrics=compute_metrics).train()

    client = mlflow.tracking.MlflowClient()
    exp = client.get_experiment_by_name("raytrain-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "digits-test"
    assert run.info.status == "FINISHED"
    assert float(run.data.params["learning_rate"]) == 2e-3
    assert run.data.params["scaling.num_workers"] == "1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5, 10, 15, 20]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [10, 20]
    assert {"train_loss", "train_runtime", "grad_norm", "learning_rate"} <= set(run.data.metrics)
    assert run.data.tags["last_checkpoint_step"] == "20"
