"""EarlyStoppingCallback: stop when the tracked metric stops improving (state survives restarts)."""

from __future__ import annotations

import logging

import numpy as np

from .base import ExportableState, TrainerCallback

logger = logging.getLogger(__name__)


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stops training after `early_stopping_patience` evaluations without an improvement of more
    than `early_stopping_threshold` in args.metric_for_best_model."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def check_metric_value(self, args, state, control, metric_value) -> None:
        """As HF: compare with the run's best so far (state.best_metric, updated after this event)."""
        better = np.greater if args.greater_is_better else np.less
        best = state.best_metric
        if best is None or (better(metric_value, best) and abs(metric_value - best) > self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.metric_for_best_model:
            raise ValueError("EarlyStoppingCallback requires metric_for_best_model "
                             "(e.g. metric_for_best_model: eval_loss)")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback requires eval_strategy 'steps' or 'epoch', got 'no'")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None:
            logger.warning("early stopping: metric %s not in the evaluation metrics %s; not counting",
                           key, sorted(metrics or {}))
            return
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict:
        return {
            "args": {"early_stopping_patience": self.early_stopping_patience,
                     "early_stopping_threshold": self.early_stopping_threshold},
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }
