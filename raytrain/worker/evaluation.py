"""WORKER side: evaluate / predict for one rank, then gather across ranks (HF's evaluation_loop).

Predictions may be one tensor or nested tuples of them (every non-loss output of the model);
batches of different sequence lengths are padded with -100 before concatenation, as HF does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..data.columns import count_items
from ..data.loaders import LoaderSource
from ..callbacks.state import EvalPrediction

if TYPE_CHECKING:
    from .protocol import TrainerProtocol


class EvalLoopOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int


def evaluation_loop(trainer: TrainerProtocol, source, description: str, prediction_loss_only: bool | None = None,
                    ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
    """Run the model over `source` (a data source of this rank's batches), gather, compute metrics."""
    args, strategy = trainer.args, trainer.get_strategy()
    if trainer.model_wrapped is not None:
        model = trainer.model_wrapped
    else:  # not prepared by train(): HF times the preparation once and reports it with every evaluation
        prep = time.perf_counter()
        model = trainer.model.to(strategy.device)
        # A driver whose workers trained (global_step > 0) did not prepare the model for evaluation alone.
        if trainer.model_preparation_time is None and trainer.state.global_step == 0:
            trainer.model_preparation_time = round(time.perf_counter() - prep, 4)
    if not trainer.is_in_train and (args.fp16_full_eval or args.bf16_full_eval):  # HF's cast, which stays
        model = model.to(dtype=torch.float16 if args.fp16_full_eval else torch.bfloat16)
    cb = trainer.callback_handler
    cb.eval_dataloader = source
    if prediction_loss_only is None:
        prediction_loss_only = args.prediction_loss_only
    want_preds = not prediction_loss_only and (trainer.compute_metrics is not None or description == "predict")
    batch_metrics = args.batch_eval_metrics and trainer.compute_metrics is not None and want_preds
    loss_sum, items, preds, labels = 0.0, 0, [], []
    metrics: dict[str, Any] = {}
    start = time.perf_counter()
    model.eval()
    if hasattr(trainer.optimizer, "eval"):  # schedule-free: evaluate its averaged weights (as HF)
        trainer.optimizer.eval()
    n_batches, n_seen = 0, 0
    batches = source if hasattr(source, "iter_batches") else LoaderSource(source, "eval_dataloader")
    for batch, last in _flag_last(batches.iter_batches(0)):  # an iterable dataset's length is unknown
        n_batches += 1
        n_seen += _batch_size(batch) or 0
        batch = trainer.prepare_inputs(batch)
        loss, logits, label = trainer.prediction_step(model, batch, prediction_loss_only=not want_preds,
                                                      ignore_keys=ignore_keys)
        n = count_items(batch) if loss is not None else None
        if loss is not None and n is None:  # labels under other names (label_names): weigh by samples
            n = _batch_size(batch)
        if loss is not None and n is not None:
            loss_sum += float(loss) * int(n)
            items += int(n)
        if want_preds and logits is not None:
            if trainer.preprocess_logits_for_metrics is not None:
                logits = trainer.preprocess_logits_for_metrics(logits, label)
            if batch_metrics and label is not None:  # as HF: this batch's tensors, where the model left them
                metrics = trainer.compute_metrics(EvalPrediction(logits, label), compute_result=last)
            if not batch_metrics or description == "predict":  # HF keeps predict()'s predictions
                logits, label = _to_cpu(logits, float_=True), _to_cpu(label)
                preds.append(logits)
                if label is not None:
                    labels.append(label)
        trainer.control = cb.on_prediction_step(args, trainer.state, trainer.control)
    runtime = time.perf_counter() - start
    gathered = strategy.data_parallel_view(  # a TP group's ranks evaluated the same rows: counted once
        strategy.all_gather_object((loss_sum, items, nested_concat(preds), nested_concat(labels), n_seen,
                                    metrics if batch_metrics else None)))
    if batch_metrics:  # the first data-parallel rank's (under PP a last-stage rank: the others have no logits)
        metrics = gathered[0][5]
    loss_sum = sum(g[0] for g in gathered)
    items = sum(g[1] for g in gathered)
    predictions = _numpy(nested_concat([g[2] for g in gathered if g[2] is not None]))
    label_ids = _numpy(nested_concat([g[3] for g in gathered if g[3] is not None]))
    if items:
        metrics = {**metrics, "loss": loss_sum / items}
    if trainer.model_preparation_time is not None:
        metrics["model_preparation_time"] = trainer.model_preparation_time
    if trainer.compute_metrics is not None and not batch_metrics and predictions is not None \
            and label_ids is not None:
        metrics.update(trainer.compute_metrics(EvalPrediction(predictions, label_ids)))
    n_samples = batches.num_samples if batches.num_samples is not None else sum(g[4] for g in gathered)
    metrics.update({"runtime": round(runtime, 4),
                    "samples_per_second": round(n_samples / runtime, 3) if runtime else 0.0,
                    "steps_per_second": round(n_batches / runtime, 3) if runtime else 0.0})
    metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": _py(v)
               for k, v in metrics.items()}
    return EvalLoopOutput(predictions, label_ids, metrics, n_samples)


def nested_concat(parts: list) -> Any:
    """Concatenate a list of (nested tuples of) tensors along the batch, padding with -100."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(nested_concat([p[i] for p in parts]) for i in range(len(parts[0])))
    tensors = [t if t.dim() else t.reshape(1) for t in parts]
    if tensors[0].dim() >= 2 and len({t.shape[1] for t in tensors}) > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=-100)
                   for t in tensors]
    return torch.cat(tensors)


def _flag_last(batches):
    """(batch, is_last) with one batch of lookahead: batch_eval_metrics' compute_result on a stream."""
    it = iter(batches)
    prev = next(it, None)
    for batch in it:
        yield prev, False
        prev = batch
    if prev is not None:
        yield prev, True


def _batch_size(batch) -> int | None:
    if isinstance(batch, list):  # rows a trainer's own code prepares (GRPO's prompts)
        return len(batch)
    first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    return None if first is None else first.shape[0]


def _to_cpu(x: Any, float_: bool = False) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(v, float_) for v in x)
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x.float() if float_ and x.is_floating_point() else x).cpu()
    return x


def _numpy(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_numpy(v) for v in x)
    return x.numpy() if isinstance(x, torch.Tensor) else x


def _py(v):
    return v.item() if isinstance(v, (np.generic, torch.Tensor)) else v
