"""The user's facade, with HF Trainer's names: runs loop.py in-process, or hands it to launch.py."""

from __future__ import annotations

import inspect
import logging
import os
import random
import resource
from typing import Callable

import numpy as np
import torch

from . import loop
from .args import TrainingArguments
from .callbacks import CallbackHandler, DefaultFlowCallback, PrinterCallback, ProgressCallback
from .checkpoint import save_weights
from .data import count_items
from .optim import get_lr
from .state import PredictionOutput, TrainerControl, TrainerState, TrainOutput

logger = logging.getLogger(__name__)


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and CUDA); full determinism also pins the algorithms."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


class Trainer:
    """Train, evaluate and predict with a PyTorch model, as HF's Trainer does.

    The model is any nn.Module taking a batch (a dict of tensors) as keyword arguments; its loss is
    the output's `loss` (dict key or attribute), or `compute_loss_func(outputs, labels,
    num_items_in_batch)` when given.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: TrainingArguments | None = None,
                 train_dataset=None, eval_dataset=None, data_collator: Callable | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers=(None, None), model_init: Callable | None = None,
                 compute_loss_func: Callable | None = None):
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        set_seed(self.args.seed, self.args.full_determinism)
        if model is None and model_init is None:
            raise ValueError("Trainer needs a model or a model_init function")
        self.model_init = model_init
        self.model = model if model is not None else self.call_model_init()
        self.model_wrapped = None
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator
        self.compute_metrics = compute_metrics
        self.compute_loss_func = compute_loss_func
        self.optimizers = optimizers
        self.optimizer, self.lr_scheduler = optimizers
        self._strategy = None
        self._trial_name: str | None = None
        self._trial_params: dict | None = None
        self._memory_start: dict[str, float] = {}
        defaults = [DefaultFlowCallback, PrinterCallback if self.args.disable_tqdm else ProgressCallback]
        self.callback_handler = CallbackHandler(defaults + _integration_callbacks(self.args) + list(callbacks or []),
                                                self.model, self.optimizer, self.lr_scheduler)
        self.state = TrainerState()
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    # ------------------------------------------------------------ public API
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs) -> TrainOutput:
        """Train from scratch, or continue a checkpoint (True: the newest valid one in output_dir)."""
        if kwargs:
            raise TypeError(f"train() got unexpected arguments {sorted(kwargs)}")
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        if self.args.should_use_distributed:
            from .launch import run_distributed
            return run_distributed(self, resume_from_checkpoint)
        if self.model_init is not None and trial is not None:
            set_seed(self.args.seed, self.args.full_determinism)
            self.model = self.call_model_init(trial)
        self._start_memory_tracking()
        if not self.args.auto_find_batch_size:
            return loop.train(self, resume_from_checkpoint, trial)
        return self._train_finding_batch_size(resume_from_checkpoint, trial)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (given to Trainer or to evaluate)")
        out = loop.prediction_loop(self, dataset, "evaluate", metric_key_prefix)
        metrics = out.metrics
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, metric_key_prefix: str = "test") -> PredictionOutput:
        out = loop.prediction_loop(self, test_dataset, "predict", metric_key_prefix)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, out.metrics)
        return out

    def save_model(self, output_dir: str | None = None) -> str:
        """Write the full weights as model.safetensors (rank 0) plus training_args.json."""
        output_dir = output_dir or self.args.output_dir
        strategy = self._get_strategy()
        state = strategy.model_state_dict() if strategy.model is not None else \
            {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if strategy.is_main:
            os.makedirs(output_dir, exist_ok=True)
            save_weights(state, output_dir)
            with open(os.path.join(output_dir, "training_args.json"), "w") as f:
                f.write(self.args.to_json_string())
        strategy.barrier()
        return output_dir

    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction: str = "minimize", backend: str = "ray", hp_name=None, **kwargs):
        """Search hyperparameters with Ray Tune + Optuna TPE and ASHA/PBT; returns a BestRun.
        Needs model_init; see raytrain.tune.hyperparameter_search for the keyword arguments."""
        if backend != "ray":
            raise ValueError(f"backend: only 'ray' is supported, got {backend!r}")
        from .tune import hyperparameter_search
        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, **kwargs)

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def log(self, logs: dict[str, float]) -> None:
        """Append to log_history (with epoch and step, as HF) and fire on_log."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # ------------------------------------------------------------ overridable maths
    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """The micro-batch's share of the update step's loss: sum over its items / items in the step,
        so that accumulated micro-batches equal one large batch exactly."""
        labels = inputs.get("labels")
        if self.compute_loss_func is not None:
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch)
        elif num_items_in_batch is not None and self._wants_num_items():
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            loss = _get_loss(outputs)
        else:
            outputs = model(**inputs)
            loss = _get_loss(outputs)
            if num_items_in_batch is not None:
                # The model's loss is a mean over its items: weight it by their share of the step.
                loss = loss * (count_items(inputs) / num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward and backward for one micro-batch; returns the detached loss (no host sync)."""
        strategy = self._strategy
        if not model.training:  # model.train() walks every module: only after an evaluation
            model.train()
        with strategy.autocast():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scale = strategy.world_size if strategy.averages_gradients else 1
        strategy.backward(loss * scale if scale != 1 else loss)
        return loss.detach()

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool):
        """(loss, logits, labels) for one evaluation batch; loss is the batch's mean."""
        labels = inputs.get("labels")
        with torch.no_grad(), self._get_strategy().autocast():
            if self.compute_loss_func is not None and labels is not None:
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
                loss = self.compute_loss_func(outputs, labels, count_items(inputs))
            else:
                outputs = model(**inputs)
                loss = _get_loss(outputs, required=False)
        if prediction_loss_only:
            return loss, None, None
        return loss, _get_logits(outputs), labels

    def _wants_num_items(self) -> bool:
        """Whether the loss needs num_items_in_batch even for a single micro-batch on one rank."""
        if not hasattr(self, "_wants_items"):
            self._wants_items = self.compute_loss_func is not None or _accepts_num_items(self.model)
        return self._wants_items

    def floating_point_ops(self, inputs: dict) -> float:
        """HF's estimate: 6 x parameters x tokens (or samples) per training step."""
        model = self.model
        if hasattr(model, "floating_point_ops"):
            return model.floating_point_ops(inputs)
        if not hasattr(self, "_num_params"):
            self._num_params = sum(p.numel() for p in model.parameters())
        ids = inputs.get("input_ids")
        n = ids.numel() if ids is not None else next(iter(inputs.values())).shape[0]
        return 6.0 * self._num_params * n

    def call_model_init(self, trial=None) -> torch.nn.Module:
        positional = [p for p in inspect.signature(self.model_init).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        model = self.model_init(trial) if len(positional) == 1 else self.model_init()
        if model is None:
            raise ValueError("model_init returned None; it must return an nn.Module")
        return model

    # ------------------------------------------------------------ internals
    def _get_strategy(self):
        if self._strategy is None:
            from .strategies import create_strategy
            self._strategy = create_strategy(self.args)
        return self._strategy

    def strategy_is_main(self) -> bool:
        return self._get_strategy().is_main

    def _get_learning_rate(self) -> float:
        if hasattr(self.lr_scheduler, "get_last_lr"):
            return float(self.lr_scheduler.get_last_lr()[0])
        return get_lr(self.optimizer)

    def _report_to_trial(self, trial, metrics: dict, checkpoint_dir: str | None = None) -> None:
        report = getattr(trial, "report", None)
        if callable(report):
            report(metrics, self.state.global_step, checkpoint_dir)

    def _start_memory_tracking(self) -> None:
        if self.args.skip_memory_metrics:
            return
        self._memory_start = {"cpu": _rss_bytes()}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._memory_start["gpu"] = torch.cuda.memory_allocated()

    def _memory_metrics(self, stage: str) -> dict[str, int]:
        if self.args.skip_memory_metrics or not self._memory_start:
            return {}
        cpu0 = self._memory_start["cpu"]
        out = {f"{stage}_mem_cpu_alloc_delta": _rss_bytes() - cpu0,
               f"{stage}_mem_cpu_peaked_delta": max(0, _peak_rss_bytes() - cpu0)}
        if "gpu" in self._memory_start:
            gpu0 = self._memory_start["gpu"]
            out[f"{stage}_mem_gpu_alloc_delta"] = torch.cuda.memory_allocated() - gpu0
            out[f"{stage}_mem_gpu_peaked_delta"] = torch.cuda.max_memory_allocated() - gpu0
        return out

    def _train_finding_batch_size(self, resume_from_checkpoint, trial) -> TrainOutput:
        """auto_find_batch_size: halve the per-device batch on out-of-memory and start again."""
        initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        while True:
            try:
                return loop.train(self, resume_from_checkpoint, trial)
            except (torch.OutOfMemoryError, MemoryError) as e:
                bs = self.args.per_device_train_batch_size
                if bs <= 1:
                    raise
                logger.warning("out of memory at per_device_train_batch_size=%d (%s); retrying with %d",
                               bs, str(e).splitlines()[0][:200], bs // 2)
                self.args.per_device_train_batch_size = bs // 2
                self.model.load_state_dict(initial)
                self.optimizer = self.lr_scheduler = None
                self.optimizers = (None, None)
                self._strategy = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()


def _integration_callbacks(args) -> list:
    out = []
    if "mlflow" in args.report_to:
        from .callbacks.mlflow import MLflowCallback
        out.append(MLflowCallback)
    return out


def _get_loss(outputs, required: bool = True):
    if isinstance(outputs, dict):
        loss = outputs.get("loss")
    else:
        loss = getattr(outputs, "loss", None)
    if loss is None and required:
        raise ValueError("the model returned no 'loss' (as a dict key or attribute); return one when "
                         "labels are given, or pass compute_loss_func(outputs, labels, num_items_in_batch)")
    return loss


def _get_logits(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        return outputs.get("logits", next((v for k, v in outputs.items() if k != "loss"), None))
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)):
        return outputs[1] if len(outputs) > 1 else outputs[0]
    return None


def _accepts_num_items(model) -> bool:
    fwd = getattr(model, "module", model)
    fwd = getattr(fwd, "_orig_mod", fwd).forward
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False
    return "num_items_in_batch" in params


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
