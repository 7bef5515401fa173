"""hyperparameter_search: Ray Tune + Optuna TPE with ASHA, and PBT restoring checkpoints; the CLI's --search."""

from __future__ import annotations

import pytest

from raytrain import Trainer, TrainingArguments
from raytrain.args import ConfigError
from raytrain.tune import load_search_spec, space_from_spec

pytestmark = pytest.mark.ray


def _trainer(tmp_path, digits, **kw):
    from examples.digits import build_model, compute_metrics

    train, val = digits
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=32,
                             eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=10,
                             logging_steps=10, disable_tqdm=True, **kw)
    return Trainer(args=args, model_init=lambda **k: build_model(**k), train_dataset=train, eval_dataset=val,
                   compute_metrics=compute_metrics)


def test_asha_with_optuna_finds_a_good_trial(ray_cluster, tmp_path, digits):
    space = space_from_spec({"learning_rate": {"loguniform": [1e-3, 1e-2]},
                             "model.hidden_size": {"choice": [32, 64]}})
    best = _trainer(tmp_path, digits).hyperparameter_search(
        space, n_trials=4, direction="maximize", metric="accuracy", scheduler="asha", seed=0,
        max_concurrent_trials=2, storage_path=str(tmp_path / "tune"))
    grid = best.run_summary
    assert len(grid) == 4 and not [r for r in grid if r.error]
    configs = [r.config for r in grid]
    assert all(1e-3 <= c["learning_rate"] <= 1e-2 and c["model.hidden_size"] in (32, 64) for c in configs)
    assert len({c["learning_rate"] for c in configs}) == 4  # TPE's start-up samples differ
    # The objective is the reported eval_accuracy; the best trial is the max over all trials' reports.
    assert best.objective == max(r.metrics_dataframe["eval_accuracy"].max() for r in grid)
    assert best.objective > 0.8
    assert set(best.hyperparameters) == {"learning_rate", "model.hidden_size"}


def test_search_spec_errors(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("metric: eval_loss\nspace:\n  learning_rate: {lognormal: [1, 2]}\n")
    with pytest.raises(ConfigError, match=r"space.learning_rate: expected one of"):
        space_from_spec(load_search_spec(str(bad))["space"])
    bad.write_text("metrc: eval_loss\nspace: {learning_rate: {uniform: [0, 1]}}\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['metrc'\]"):
        load_search_spec(str(bad))
    with pytest.raises(ConfigError, match="file not found"):
        load_search_spec(str(tmp_path / "missing.yaml"))


def test_pbt_exploits_by_restoring_checkpoints(ray_cluster, tmp_path, digits):
    from ray import tune

    trainer = _trainer(tmp_path, digits, lr_scheduler_type="constant")
    best = trainer.hyperparameter_search(
        {"learning_rate": tune.loguniform(1e-4, 1e-2)}, n_trials=2, direction="maximize", metric="accuracy",
        scheduler="pbt", scheduler_kwargs={"perturbation_interval": 1, "quantile_fraction": 0.5},
        storage_path=str(tmp_path / "tune"))
    grid = best.run_summary
    assert not [r for r in grid if r.error]
    # Every trial reached the last evaluation (step 40), restored or not, and reported checkpoints.
    assert all(r.metrics["step"] == 40 for r in grid)
    assert all(r.checkpoint is not None for r in grid)
    assert 0.0 < best.objective <= 1.0


def test_cli_search_runs_on_an_existing_cluster(ray_cluster, tmp_path):

    import os
    import subprocess
    import sys

    spec = tmp_path / "space.yaml"
    spec.write_text("metric: eval_accuracy\nmode: max\nnum_samples: 2\nscheduler: asha\nseed: 1\n"
                    "space:\n  learning_rate: {loguniform: [1.0e-3, 1.0e-2]}\n")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain.run", "--config", "examples/digits.yaml", "--search", str(spec),
         "--set", f"output_dir={tmp_path / 'out'}", "--set", "num_train_epochs=2"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("best trial:"))
    assert "learning_rate" in line
    assert float(line.split("objective=")[1].split()[0]) > 0.8
    assert os.path.isdir(tmp_path / "out" / "tune")

