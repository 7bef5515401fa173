"""MLflow for a sweep (report_to: mlflow): one parent run, one child run per trial, in one store.

The store is MLFLOW_TRACKING_URI, else the `mlflow.db` in the driver's working directory (the
store MLflowCallback uses for a plain run). The driver opens the parent; each trial opens its child
(tagged with the parent and its trial id) and hands it to MLflowCallback through MLFLOW_RUN_ID;
the driver sets each child's final status and tags the best trial on the parent.
"""

from __future__ import annotations

import json
import os

PARENT_FILE = "mlflow_parent.json"


def _uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath("mlflow.db")


class SweepTracker:
    def __init__(self, uri: str, experiment_id: str, parent_id: str):
        self.info = {"uri": uri, "experiment_id": experiment_id, "parent_id": parent_id}

    @classmethod
    def start(cls, sweep_dir: str, name: str, settings: dict | None = None) -> SweepTracker:
        """The sweep's parent run: the one recorded in the sweep directory (a restored sweep), else new,
        with the sweep's settings as params. Says where the runs are."""
        tracker = cls._open(sweep_dir, name, settings or {})
        from ..tracking import mlflow as tracking

        print(f"[sweep] MLflow: parent run {name!r} ({tracker.info['parent_id']}), one child run per trial; "
              f"see them with: {tracking.ui_command(tracker.info['uri'])}", flush=True)
        return tracker

    @classmethod
    def _open(cls, sweep_dir: str, name: str, settings: dict) -> SweepTracker:
        from mlflow.tracking import MlflowClient

        uri = _uri()
        client = MlflowClient(uri)
        path = os.path.join(sweep_dir, PARENT_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                saved = json.load(f)
            client.update_run(saved["parent_id"], status="RUNNING")
            return cls(saved["uri"], saved["experiment_id"], saved["parent_id"])
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "raytrain")
        exp = client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp else client.create_experiment(exp_name)
        run = client.create_run(exp_id, run_name=name, tags={"raytrain.sweep_dir": sweep_dir})
        from ..tracking import mlflow as tracking

        tracking.log_params(client, run.info.run_id, {f"sweep.{k}": str(v) for k, v in settings.items()})
        tracker = cls(uri, exp_id, run.info.run_id)
        with open(path, "w") as f:
            json.dump(tracker.info, f)
        return tracker

    def _child(self, trial_id: str):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.info["uri"])
        runs = client.search_runs([self.info["experiment_id"]],
                                  f"tags.`mlflow.parentRunId` = '{self.info['parent_id']}' and "
                                  f"tags.`raytrain.trial_id` = '{trial_id}'")
        return client, (runs[0] if runs else None)

    def end_child(self, trial_id: str, status: str, label: str, error: str | None = None) -> None:
        client, run = self._child(trial_id)
        if run is None:
            return
        client.set_tag(run.info.run_id, "raytrain.status", label)
        if error:
            client.set_tag(run.info.run_id, "raytrain.error", error[:5000])
        client.set_terminated(run.info.run_id, status)

    def end(self, best, sweep_dir: str | None = None, table=None) -> None:
        """The parent's outcome (best trial, its objective and parameters), the sweep's table and plots
        as its artifacts, and each trial's best checkpoint as a tag of its child run."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.info["uri"])
        parent = self.info["parent_id"]
        if table is not None:
            for trial_id, checkpoint in zip(table["trial_id"], table["checkpoint"]):
                _, run = self._child(str(trial_id))
                if run is not None and checkpoint:
                    client.set_tag(run.info.run_id, "checkpoint", checkpoint)
        if sweep_dir is not None:
            for entry in sorted(os.listdir(sweep_dir)):
                if entry == "trials.csv" or entry.endswith((".png", ".html")):
                    client.log_artifact(parent, os.path.join(sweep_dir, entry))
            plots = os.path.join(sweep_dir, "plots")  # objective.png, as report.write_plots draws it
            for entry in sorted(os.listdir(plots)) if os.path.isdir(plots) else []:
                if entry.endswith(".png"):
                    client.log_artifact(parent, os.path.join(plots, entry), "plots")
        if best is not None:
            client.set_tag(parent, "best_trial_id", best.run_id)
            client.set_tag(parent, "best_checkpoint", best.checkpoint or "")
            if not isinstance(best.objective, list):
                client.log_metric(parent, "best_objective", best.objective)
            for k, v in best.hyperparameters.items():
                client.set_tag(parent, f"best.{k}", str(v))
        client.set_terminated(parent, "FINISHED" if best is not None else "FAILED")


def start_child_run(info: dict, trial_id: str, params: dict, args=None) -> str:
    """In the trial: open (or, after a restore, reopen) its child run and point MLflowCallback at it.
    The child's params (the trial's arguments and sampled values) are logged here: MLflowCallback
    only logs metrics into a run it did not open."""
    tracker = SweepTracker(info["uri"], info["experiment_id"], info["parent_id"])
    client, run = tracker._child(trial_id)
    if run is None:
        run = client.create_run(info["experiment_id"], run_name=f"trial_{trial_id}",
                                tags={"mlflow.parentRunId": info["parent_id"], "raytrain.trial_id": trial_id})
        if args is not None:
            from ..tracking import mlflow as tracking
            tracking.log_params(client, run.info.run_id, tracking.params_of(args, params))
    run_id = run.info.run_id
    os.environ["MLFLOW_TRACKING_URI"] = info["uri"]
    os.environ["MLFLOW_RUN_ID"] = run_id
    return run_id
