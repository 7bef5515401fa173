"""MLflowCallback (report_to: mlflow): params, every log as metrics at its step, checkpoint tags, and
(when the callback owns the run) the final model as an artifact.

Which run it writes to, first match wins: `run_id` set by a driver (run.py opens the run and ends it
after its final evaluation; the attribute travels to Ray workers with the pickled Trainer), the run
id restored from the checkpoint being resumed (the same MLflow run goes on), MLFLOW_RUN_ID, the
caller's active `mlflow.start_run()`, else a new run. Only the world-process-zero rank writes.
"""

from __future__ import annotations

import logging
import os
import tempfile

from ..tracking import mlflow as tracking
from .base import ExportableState, TrainerCallback

logger = logging.getLogger(__name__)


class MLflowCallback(TrainerCallback, ExportableState):
    def __init__(self, tracking_uri: str | None = None):
        self.tracking_uri = tracking_uri or tracking.tracking_uri()
        self.run_id: str | None = None
        self.owns_run: bool | None = None  # None: not decided yet; a driver that opened the run sets False
        self._client = None

    def __getstate__(self):  # the client holds a DB connection: rebuilt in each process
        return {**self.__dict__, "_client": None}

    @property
    def client(self):
        if self._client is None:
            self._client = tracking.client(self.tracking_uri)
        return self._client

    def setup(self, args, state) -> None:
        if self.run_id is None:
            import mlflow

            active = mlflow.active_run()
            given = os.environ.get("MLFLOW_RUN_ID") or (active.info.run_id if active else None)
            if given:
                self.run_id, self.owns_run = given, False
            else:
                self.run_id = tracking.create_run(self.client, args, args.run_name or state.trial_name,
                                                  state.trial_params)
                self.owns_run = True
        elif self.owns_run is None:  # restored from a checkpoint: this run continues its MLflow run
            tracking.reopen_run(self.client, self.run_id, args, state.trial_params)
            self.owns_run = True

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.setup(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.run_id is None or self.owns_run is None:
            self.setup(args, state)
        tracking.log_metrics(self.client, self.run_id, logs, state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.run_id is not None:
            tags = {"last_checkpoint_step": state.global_step}
            if state.best_model_checkpoint:
                tags["best_model_checkpoint"] = state.best_model_checkpoint
            tracking.set_tags(self.client, self.run_id, tags)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not (state.is_world_process_zero and self.run_id is not None and self.owns_run):
            return
        if model is not None and args.scaling.num_workers <= 1:  # in-process: the weights are whole here
            from safetensors.torch import save_model  # drops tied duplicates, as checkpoints do

            with tempfile.TemporaryDirectory() as tmp:
                save_model(model, os.path.join(tmp, "model.safetensors"))
                self.client.log_artifacts(self.run_id, tmp, "model")
        self.client.set_terminated(self.run_id, "FINISHED")
        # Later logs (an evaluate() after train()) still land in this run: owns_run stays decided.

    def state(self) -> dict:
        return {"args": {}, "attributes": {"run_id": self.run_id}}
