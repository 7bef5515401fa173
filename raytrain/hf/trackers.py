"""report_to's callbacks: MLflow is raytrain's own (callbacks/mlflow.py); every other name is
transformers' own callback (TensorBoardCallback, WandbCallback, ...) where transformers is installed,
and without it tensorboard is the small TensorBoardCallback below (torch's SummaryWriter).

transformers' callbacks take the events as raytrain fires them (args, state, control, model=...,
logs=...). Each is given the arguments with secrets redacted (to_dict, to_json_string and
to_sanitized_dict go through tracking.redact) and runs on rank 0 only, as MLflowCallback does
(state.is_world_process_zero); codecarbon, which measures each node, on each node's first rank.
Like every module that imports transformers, it lives in raytrain.hf and imports it only when installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from datetime import datetime
from typing import Any

from ..tracking import mlflow as tracking
from ..callbacks.base import EVENTS, TrainerCallback

#: transformers' integrations that report from each node's first rank rather than from rank 0 alone.
_PER_NODE = ("CodeCarbonCallback",)


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


def integration_callbacks(args) -> list:
    """The callbacks of args.report_to (already validated: known names whose libraries are installed)."""
    out: list = []
    use_transformers = transformers_installed()
    for name in args.report_to:
        if name == "mlflow":
            from ..callbacks.mlflow import MLflowCallback

            out.append(MLflowCallback)
        elif use_transformers:
            from transformers.integrations import get_reporting_integration_callbacks

            (cls,) = get_reporting_integration_callbacks([name])
            out.append(_adapt(cls(), args))
        elif name == "tensorboard":
            out.append(TensorBoardCallback(logging_dir(args)))
        else:  # validation names transformers as missing first; here if it was uninstalled since
            raise ValueError(f"report_to: {name} needs transformers, which is not installed; pip install transformers")
    return out


def logging_dir(args) -> str:
    """TensorBoard's directory: logging_dir, else transformers' TENSORBOARD_LOGGING_DIR, else its default
    OUTPUT_DIR/runs/DATE_HOST; absolute, so that Ray workers with another cwd write to the same place."""
    path = args.logging_dir or os.environ.get("TENSORBOARD_LOGGING_DIR") or \
        os.path.join(args.output_dir, default_logdir())
    return os.path.abspath(os.path.expanduser(path))


def default_logdir() -> str:
    """runs/DATE_HOST, as transformers and torch name a run's directory."""
    return os.path.join("runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def _adapt(callback, args):
    """transformers' callback set up for raytrain: its directory decided now (the same on the driver and
    on Ray's workers), each event it defines wrapped (an instance attribute: its class stays, so
    remove_callback(WandbCallback) still finds it)."""
    from transformers import TrainerCallback as HFCallback

    if type(callback).__name__ == "TensorBoardCallback" and callback.logging_dir is None:
        callback.logging_dir = logging_dir(args)
    per_node = type(callback).__name__ in _PER_NODE
    for event in EVENTS:
        if getattr(type(callback), event, None) is not getattr(HFCallback, event, None):
            setattr(callback, event, _Event(callback, event, per_node))
    return callback


class _Event:
    """One event of an integration: on the reporting rank only, with the arguments' secrets redacted."""

    def __init__(self, callback, event: str, per_node: bool):
        self.callback, self.event, self.per_node = callback, event, per_node

    def __call__(self, args, state, control, **kwargs):
        if not (state.is_local_process_zero if self.per_node else state.is_world_process_zero):
            return None
        return getattr(type(self.callback), self.event)(self.callback, RedactedArgs(args), state, control, **kwargs)


class RedactedArgs:
    """TrainingArguments as integrations see them: every field as it is, but the dumps they log
    (to_dict, to_json_string, to_sanitized_dict) with secrets redacted, as MLflow's params are."""

    def __init__(self, args):
        object.__setattr__(self, "_args", args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)  # wandb clears run_name for a sweep's trials: the real arguments change

    def to_dict(self) -> dict[str, Any]:
        return tracking.redact(self._args.to_dict())

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}


def _tags(logs: dict) -> dict:
    """transformers' rewrite_logs: eval_x -> eval/x, test_x -> test/x, the rest train/x."""
    out = {}
    for k, v in logs.items():
        for prefix in ("eval_", "test_"):
            if k.startswith(prefix):
                out[prefix[:-1] + "/" + k[len(prefix):]] = v
                break
        else:
            out["train/" + k] = v
    return out


class TensorBoardCallback(TrainerCallback):
    """report_to tensorboard without transformers: each log's numbers as scalars at the global step,
    under transformers' tags (train/loss, eval/accuracy, ...), on rank 0."""

    def __init__(self, logging_dir: str | None = None):
        self.logging_dir = logging_dir
        self.writer = None

    def __getstate__(self):  # the writer holds a file and a thread: opened in the process that logs
        return {**self.__dict__, "writer": None}

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_hyper_param_search and state.trial_name:  # as transformers: one directory per trial
            self.logging_dir = os.path.join(args.output_dir, default_logdir(), state.trial_name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.writer is None:
            self.writer = _summary_writer(self.logging_dir or logging_dir(args))
        for tag, value in _tags(logs).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _summary_writer(path: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's needs the tensorboard package; tensorboardX writes the same files
        from tensorboardX import SummaryWriter
    return SummaryWriter(log_dir=path)
