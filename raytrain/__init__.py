"""raytrain: a Hugging Face-style Trainer that runs in one process or on Ray Train workers.

Names are imported on first use (PEP 562), so `python -m raytrain.run` can reject a bad config
before torch is even imported.
"""

from __future__ import annotations

from .runtime.lazy import lazy_exports

_EXPORTS = {
    "config.args": ["ConfigError", "TrainingArguments"],
    "callbacks": ["CallbackHandler", "DefaultFlowCallback", "EarlyStoppingCallback", "ExportableState",
                  "PrinterCallback", "ProgressCallback", "TrainerCallback"],
    "checkpoint": ["CheckpointError", "get_last_checkpoint", "load_weights", "verify_checkpoint"],
    "data": ["DataError", "Files", "RayData", "build_source", "default_collate"],
    "worker.loop": ["NonFiniteError"],
    "hf.optim": ["create_optimizer", "create_scheduler"],
    "optim.optimizers": ["get_parameter_groups"],
    "callbacks.state": ["EvalPrediction", "PredictionOutput", "TrainerControl", "TrainerState", "TrainOutput"],
    "trainer": ["Seq2SeqTrainer", "Trainer", "set_seed"],
    "hf.trainer_api": ["sort_checkpoints"],
    "config.seq2seq": ["Seq2SeqTrainingArguments"],
    "sweep": ["BestRun", "hyperparameter_search"],
}
__version__ = "0.1.0"
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
