"""The sweep's MLflow parent run, in-process (no Ray): its settings as params, the sweep's table and
plots as artifacts, the best trial as tags; SweepTracker driven on a sweep directory laid out as a
finished single-objective sweep leaves it."""

from __future__ import annotations

import pandas as pd
import pytest


def test_the_parent_run_carries_the_settings_the_table_and_the_plots(tmp_path, monkeypatch, capsys):
    mlflow = pytest.importorskip("mlflow")
    from raytrain.sweep import BestRun
    from raytrain.sweep.tracking import SweepTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sweep-inproc")
    sweep = tmp_path / "out" / "sweeps" / "digits"
    (sweep / "plots").mkdir(parents=True)
    table = pd.DataFrame({"trial_id": ["a1", "b2"], "learning_rate": [1e-3, 1e-2], "objective": [0.9, 0.95],
                          "checkpoint": ["", ""]})
    table.to_csv(sweep / "trials.csv", index=False)
    (sweep / "optimization_history.html").write_text("<html></html>")
    (sweep / "plots" / "objective.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    (sweep / "optuna.db").write_bytes(b"")  # not an artifact

    tracker = SweepTracker.start(str(sweep), "digits", {"n_trials": 2, "sampler": "tpe"})
    parent = tracker.info["parent_id"]
    assert capsys.readouterr().out == (f"[sweep] MLflow: parent run 'digits' ({parent}), one child run per trial; "
                                       f"see them with: mlflow ui --backend-store-uri {uri}\n")
    tracker.end(BestRun("b2", 0.95, {"learning_rate": 1e-2}, table, None), str(sweep), table)

    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.info.run_name == "digits"
    assert run.data.params == {"sweep.n_trials": "2", "sweep.sampler": "tpe"}
    assert run.data.tags["best_trial_id"] == "b2" and run.data.tags["best.learning_rate"] == "0.01"
    assert run.data.metrics == {"best_objective": 0.95}
    top = {a.path for a in client.list_artifacts(parent)}
    assert top == {"trials.csv", "optimization_history.html", "plots"}
    assert [a.path for a in client.list_artifacts(parent, "plots")] == ["plots/objective.png"]
    png = client.download_artifacts(parent, "plots/objective.png", str(tmp_path / "back"))
    assert open(png, "rb").read() == (sweep / "plots" / "objective.png").read_bytes()
