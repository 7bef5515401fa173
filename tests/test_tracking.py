"""MLflow tracking through report_to: params, metrics per log step, tags, artifacts, one run per CLI call
(resumes included), no secrets; read back with MlflowClient from a local SQLite store."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

mlflow = pytest.importorskip("mlflow")

from raytrain import Trainer, TrainingArguments  # noqa: E402
from raytrain.tracking.mlflow import REDACTED, looks_secret, redact  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY, ENV_SECRET = "abc-123-secret-xyz", "hunter2-very-secret"


def test_mlflow_records_params_metrics_and_checkpoint_tag(tmp_path, monkeypatch, digits):
    from examples.digits import build_model, compute_metrics

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raytrain-test")
    train, val = digits
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=20, logging_steps=5, learning_rate=2e-3,
                             eval_strategy="steps", eval_steps=10, save_steps=10, report_to="mlflow",
                             run_name="digits-test", disable_tqdm=True)
    trainer = Trainer(build_model(), args, train_dataset=train, eval_dataset=val, compute_metrics=compute_metrics)
    trainer.train()
    trainer.evaluate()  # after train(): still the same MLflow run

    client = mlflow.tracking.MlflowClient()
    exp = client.get_experiment_by_name("raytrain-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "digits-test"
    assert run.info.status == "FINISHED"
    assert float(run.data.params["learning_rate"]) == 2e-3
    assert run.data.params["scaling.num_workers"] == "1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5, 10, 15, 20]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [10, 20, 20]
    assert {"train_loss", "train_runtime", "grad_norm", "learning_rate"} <= set(run.data.metrics)
    assert run.data.tags["last_checkpoint_step"] == "20"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    assert os.path.isfile(tmp_path / "mlartifacts" / run.info.run_id / "artifacts" / "model"
                          / "model.safetensors")  # beside mlflow.db, not in the working directory


def _cli(tmp_path, epochs: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "MLFLOW_EXPERIMENT_NAME": "cli",
           "RAYTRAIN_TEST_PASSWORD": ENV_SECRET}
    argv = ["--config", "examples/digits.yaml", "--set", f"num_train_epochs={epochs}", "--set", "logging_steps=15",
            "--set", "report_to=mlflow", "--set", f"output_dir={tmp_path / 'out'}", "--no-report",
            "--set", "data.factory=tests.cli_jobs:digits_with_key", "--set", f"data.api_key={KEY}",
            "--set", f"run_name=digits-{ENV_SECRET}"]
    proc = subprocess.run([sys.executable, "-m", "raytrain.run", *argv], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_cli_one_run_spans_evaluation_resume_and_artifacts(tmp_path):
    first = _cli(tmp_path, 1)    # 45 steps, then the final evaluation
    second = _cli(tmp_path, 2)   # --resume auto: continues checkpoint-45 to step 90 in the same MLflow run
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    run_id = run.info.run_id
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for proc in (first, second):
        assert f"mlflow: run {run_id}; see it with: mlflow ui --backend-store-uri {uri}" in proc.stdout
    assert run.info.status == "FINISHED"
    history = lambda key: [m.step for m in client.get_metric_history(run_id, key)]  # noqa: E731
    assert history("loss") == [15, 30, 45, 60, 75, 90]
    assert history("eval_accuracy") == [45, 90]  # each epoch's evaluation; each call's summary reuses the last
    assert history("train_loss") == [45, 90]

    tags, params = run.data.tags, run.data.params
    assert tags["raytrain.strategy"] == "single" and tags["raytrain.world_size"] == "1"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head
    assert params["data.api_key"] == REDACTED and params["model.hidden_size"] == "128"
    assert params["num_train_epochs"] == "1.0"  # MLflow keeps a param's first value
    logged = list(params.values()) + list(tags.values()) + [run.info.run_name]
    assert not [v for v in logged if KEY in v or ENV_SECRET in v]

    names = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"config.yaml", "model", "model/model.safetensors", "model/training_args.json"} <= names
    local = client.download_artifacts(run_id, "", str(tmp_path / "artifacts"))
    for name in ("config.yaml", "model/training_args.json"):
        text = open(os.path.join(local, name)).read()
        assert REDACTED in text and KEY not in text and ENV_SECRET not in text
    from safetensors.torch import load_file

    from examples.digits import build_model
    build_model().load_state_dict(load_file(os.path.join(local, "model", "model.safetensors")))


def test_secret_names_and_values_are_redacted(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-0123456789")
    assert [n for n in ("hub_token", "data.api_key", "password", "aws_secret_access_key", "MLFLOW_TRACKING_PASSWORD",
                        "num_input_tokens_seen", "keyword", "monkey", "max_tokens") if looks_secret(n)] \
        == ["hub_token", "data.api_key", "password", "aws_secret_access_key", "MLFLOW_TRACKING_PASSWORD"]
    config = {"hub_token": "x", "model": {"api_key": "y", "url": "https://u:tok-0123456789@host"}, "empty_key": None,
              "lr": 0.1}
    assert redact(config) == {"hub_token": REDACTED, "model": {"api_key": REDACTED, "url": REDACTED},
                              "empty_key": None, "lr": 0.1}


def test_artifacts_go_beside_the_sqlite_file():
    from raytrain.tracking.mlflow import _artifact_location

    assert _artifact_location("sqlite:////data/runs/mlflow.db") == "file:///data/runs/mlartifacts"
    assert _artifact_location("http://mlflow:5000") is None


def test_a_run_without_run_name_is_named_after_its_output_dir(tmp_path, monkeypatch):
    from raytrain.tracking import mlflow as tracking

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "names")
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = tracking.create_run(client, TrainingArguments(output_dir=str(tmp_path / "digits-small"), use_cpu=True))
    assert client.get_run(run_id).info.run_name == "digits-small"
