"""raytrain: a Hugging Face-style Trainer that runs in one process or on Ray Train workers."""

from .args import ConfigError, TrainingArguments
from .callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
)
from .checkpoint import CheckpointError, get_last_checkpoint, load_weights, verify_checkpoint
from .data import default_collate
from .loop import NonFiniteError
from .optim import create_optimizer, create_scheduler, get_parameter_groups
from .state import EvalPrediction, PredictionOutput, TrainerControl, TrainerState, TrainOutput
from .trainer import Trainer, set_seed

__version__ = "0.1.0"

__all__ = [
    "CallbackHandler", "CheckpointError", "ConfigError", "DefaultFlowCallback", "EarlyStoppingCallback",
    "EvalPrediction", "ExportableState", "NonFiniteError", "PredictionOutput", "PrinterCallback",
    "ProgressCallback", "Trainer", "TrainerCallback", "TrainerControl", "TrainerState", "TrainOutput",
    "TrainingArguments", "create_optimizer", "create_scheduler", "default_collate", "get_last_checkpoint",
    "get_parameter_groups", "load_weights", "set_seed", "verify_checkpoint",
]
