"""raytrain: a Hugging Face-style Trainer that runs in one process or on Ray Train workers.

Names are imported on first use (PEP 562), so `python -m raytrain.run` can reject a bad config
before torch is even imported.
"""

from __future__ import annotations

from .lazy import lazy_exports

_EXPORTS = {
    "args": ["ConfigError", "TrainingArguments"],
    "callbacks": ["CallbackHandler", "DefaultFlowCallback", "EarlyStoppingCallback", "ExportableState",
                  "PrinterCallback", "ProgressCallback", "TrainerCallback"],
    "checkpoint": ["CheckpointError", "get_last_checkpoint", "load_weights", "verify_checkpoint"],
    "data": ["DataError", "Files", "RayData", "build_source", "default_collate"],
    "worker.loop": ["NonFiniteError"],
    "hf_optim": ["create_optimizer", "create_scheduler"],
    "optim": ["get_parameter_groups"],
    "state": ["EvalPrediction", "PredictionOutput", "TrainerControl", "TrainerState", "TrainOutput"],
    "trainer": ["Trainer", "set_seed"],
    "trainer_hf": ["sort_checkpoints"],
    "seq2seq": ["Seq2SeqTrainer"],
    "seq2seq_args": ["Seq2SeqTrainingArguments"],
    "sweep": ["BestRun", "hyperparameter_search"],
}
__version__ = "0.1.0"
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
