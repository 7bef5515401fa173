"""MLflowCallback (report_to: mlflow): parameters, every log as metrics, the final model as an artifact.

The tracking store comes from MLFLOW_TRACKING_URI; unset, a local SQLite store `mlflow.db` in the
working directory is used. A run id in MLFLOW_RUN_ID (set by a driver for its workers) is resumed
rather than a new run started; only the world-process-zero rank writes.
"""

from __future__ import annotations

import os

from .base import TrainerCallback

_MAX_PARAM_LEN = 6000


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = str(v)[:_MAX_PARAM_LEN]
    return out


class MLflowCallback(TrainerCallback):
    def __init__(self):
        import mlflow

        self._mlflow = mlflow
        self._run = None
        self._started_here = False

    def setup(self, args, state) -> None:
        mlflow = self._mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri("sqlite:///" + os.path.abspath("mlflow.db"))
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if mlflow.active_run() is None:
            if run_id:
                self._run = mlflow.start_run(run_id=run_id)
            else:
                mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "raytrain"))
                self._run = mlflow.start_run(run_name=args.run_name or state.trial_name)
            self._started_here = True
        else:
            self._run = mlflow.active_run()
        params = _flatten(args.to_dict())
        if state.trial_params:
            params.update(_flatten(state.trial_params, "trial."))
        items = list(params.items())
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            mlflow.log_params(dict(items[i:i + 100]))

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self._run is None:
            self.setup(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self._run is None:
            self.setup(args, state)
        metrics = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._mlflow.log_metrics(metrics, step=state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self._run is not None:
            self._mlflow.set_tag("last_checkpoint_step", state.global_step)
            if state.best_model_checkpoint:
                self._mlflow.set_tag("best_model_checkpoint", state.best_model_checkpoint)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self._run is not None and self._started_here:
            self._mlflow.end_run()
            self._run = None
            self._started_here = False
