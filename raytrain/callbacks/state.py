"""Run state in Hugging Face's shapes: TrainerState (trainer_state.json), TrainerControl and results."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass
class TrainerState:
    """Everything about the run's progress that trainer_state.json records (HF's field names)."""

    epoch: float | None = 0  # as HF: 0 before training
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def to_json_string(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def compute_steps(self, args, max_steps: int) -> None:
        """logging/eval/save steps as counts: a ratio (< 1) becomes ceil(max_steps * ratio), as HF."""
        for kind in ("logging", "eval", "save"):
            n = getattr(args, f"{kind}_steps")
            if n is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * n) if n < 1 else int(n))

    def save_to_json(self, json_path: str) -> None:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def load_from_json(cls, json_path: str) -> "TrainerState":
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the loop resets them once acted on."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def state(self) -> dict:
        """As HF: TrainerControl rides in trainer_state.json's stateful_callbacks."""
        return {"args": dataclasses.asdict(self), "attributes": {}}

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class EvalPrediction:
    """What compute_metrics receives: predictions and label_ids as numpy arrays (tensors per batch under
    batch_eval_metrics, as HF)."""

    def __init__(self, predictions: np.ndarray | tuple, label_ids: np.ndarray | tuple | None):
        self.predictions = predictions
        self.label_ids = label_ids

    def __iter__(self):
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, idx: int):
        return (self.predictions, self.label_ids)[idx]


class PredictionOutput(NamedTuple):
    predictions: np.ndarray | tuple
    label_ids: np.ndarray | tuple | None
    metrics: dict[str, float]
