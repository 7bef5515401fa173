"""Glue for objects that come from Hugging Face libraries: datasets, collators, tokenizers, models.

transformers and datasets are optional: nothing here imports them unless the user's objects come
from them (checked by module name), so `import raytrain` stays light.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

LABEL_ALIASES = ("label", "label_ids")


def _from(obj: Any, package: str) -> bool:
    return any(c.__module__.split(".")[0] == package for c in type(obj).__mro__)


def is_datasets_object(data: Any) -> bool:
    """Any object of the datasets package (a Dataset, a streaming IterableDataset, ...)."""
    return _from(data, "datasets")


def is_hf_dataset(data: Any) -> bool:
    """A `datasets.Dataset` (map-style, with column names)."""
    return _from(data, "datasets") and hasattr(data, "column_names") and hasattr(data, "__len__")


def is_pretrained_model(model: Any) -> bool:
    """A transformers PreTrainedModel: it has a config and save_pretrained."""
    return _from(model, "transformers") and hasattr(model, "config") and hasattr(model, "save_pretrained")


def register_output_capture(*objects: Any) -> None:
    """A transformers model unpickled in a fresh process (a Ray worker) is missing from transformers 5.23's
    registry of what each model class records (filled as a model is built): its router logits (a MoE model's
    router loss), hidden states and attentions would not be captured. Register the classes of the models in
    `objects` (modules, or lists of them) again."""
    modules = [m for o in objects for m in (o if isinstance(o, (list, tuple)) else [o])
               if isinstance(m, torch.nn.Module)]
    models = [m for o in modules for m in o.modules() if is_pretrained_model(m) and hasattr(m, "_can_record_outputs")]
    if not models:
        return
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # another transformers: it records outputs otherwise
        return
    for m in models:
        _CAN_RECORD_REGISTRY[m] = m._can_record_outputs


def is_peft_model(model: Any) -> bool:
    """A peft PeftModel (LoRA and the other adapters): its checkpoints hold the adapter alone."""
    return _from(model, "peft") and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def is_tokenizer_like(processing_class: Any) -> bool:
    """A tokenizer or feature extractor, for which HF's default collator pads."""
    if processing_class is None or not _from(processing_class, "transformers"):
        return False
    from transformers import PreTrainedTokenizerBase
    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor
    return isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor))


def default_collator(processing_class: Any):
    """HF's choice: DataCollatorWithPadding for a tokenizer; otherwise None (raytrain's stacking)."""
    if is_tokenizer_like(processing_class):
        from transformers import DataCollatorWithPadding
        return DataCollatorWithPadding(processing_class)
    return None


def forward_owner(model: Any) -> Any:
    """The module whose forward names the model's inputs: the user's inside wrappers, a PEFT model's base
    (a PeftModel without a task type takes *args, **kwargs), as HF inspects it."""
    from ..strategies.base import unwrap_model

    model = unwrap_model(model)
    return model.get_base_model() if is_peft_model(model) else model


def signature_columns(model: Any, label_names: list[str]) -> list[str]:
    """The names HF keeps when removing unused columns: forward's parameters, labels and their aliases."""
    try:
        names = list(inspect.signature(forward_owner(model).forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return []
    return list(dict.fromkeys(names + list(LABEL_ALIASES) + list(label_names)))


# ---------------------------------------------------------------- outputs


def loss_of(outputs: Any, required: bool = True):
    """The model's loss: `loss` (dict key or attribute), or the first element of a tuple output."""
    if isinstance(outputs, dict):  # HF ModelOutput is a dict too
        loss = outputs.get("loss")
    elif isinstance(outputs, (tuple, list)):
        loss = outputs[0] if outputs and isinstance(outputs[0], torch.Tensor) and outputs[0].dim() == 0 else None
    else:
        loss = getattr(outputs, "loss", None)
    if loss is None and required:
        raise ValueError("the model returned no loss (a 'loss' key or attribute, or a scalar first element of a "
                         "tuple); return one when labels are given, or pass compute_loss_func(outputs, labels, "
                         "num_items_in_batch)")
    return loss


def predictions_of(outputs: Any, has_loss: bool, ignore_keys: list[str]):
    """Every non-loss output, as HF's prediction_step: one tensor, or a tuple when there are several."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"] and v is not None)
    elif isinstance(outputs, (tuple, list)):
        logits = tuple(outputs[1:] if has_loss and loss_of(outputs, required=False) is not None else outputs)
    else:
        logits = (getattr(outputs, "logits", None),)
    logits = tuple(_detach(v) for v in logits)
    return logits[0] if len(logits) == 1 else logits


def _detach(v):
    if isinstance(v, (tuple, list)):
        return type(v)(_detach(x) for x in v)
    return v.detach() if isinstance(v, torch.Tensor) else v


def ignore_keys_for(model: Any) -> list[str]:
    """HF's default: the config's keys_to_ignore_at_inference (past_key_values for most LMs)."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    return list(getattr(config, "keys_to_ignore_at_inference", ["past_key_values"]))


class LabelSmoother:
    """HF's label smoothing (transformers 5.23's LabelSmoother): (1 - eps) * NLL + eps * mean over classes of
    -log p, over items whose label is not -100, divided by num_items_in_batch when given, else by the items."""

    def __init__(self, epsilon: float, ignore_index: int = -100):
        self.epsilon, self.ignore_index = epsilon, ignore_index

    def __call__(self, outputs: Any, labels: torch.Tensor, shift_labels: bool = False,
                 num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if shift_labels:
            logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)
        if labels.dim() == log_probs.dim() - 1:
            labels = labels.unsqueeze(-1)
        padding = labels.eq(self.ignore_index)
        nll = log_probs.gather(dim=-1, index=torch.clamp(labels, min=0)).masked_fill(padding, 0.0)
        smooth = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill(padding, 0.0)
        if num_items_in_batch is None:
            items = padding.numel() - padding.long().sum()
        else:
            items = num_items_in_batch.to(nll.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        return (1 - self.epsilon) * (nll.sum() / items) + self.epsilon * (smooth.sum() / (items * log_probs.shape[-1]))


def is_causal_lm(model: Any) -> bool:
    """HF shifts labels for label smoothing on causal LMs (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    return is_pretrained_model(model) and _causal_lm_class(type(model).__name__)


@functools.lru_cache(maxsize=None)
def _causal_lm_class(name: str) -> bool:  # asked every micro-batch when label smoothing is on
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


# ---------------------------------------------------------------- saving


def save_pretrained_files(model: Any, processing_class: Any, args: Any, directory: str) -> list[str]:
    """What from_pretrained needs beside the weights: config.json (+ generation_config.json), the
    processing class's files and training_args.bin. Returns the file names written."""
    before = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    from ..strategies.base import unwrap_model

    model = unwrap_model(model)  # a compiled model's config is its module's
    if is_pretrained_model(model) and not is_peft_model(model):  # a PEFT model's config is the base's
        model.config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(directory)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)
    if args is not None:
        torch.save(args, os.path.join(directory, "training_args.bin"))
    return sorted(set(os.listdir(directory)) - before)


def default_label_names(model) -> list[str]:
    """HF's default: the label arguments of a transformers model's forward (e.g. start_positions and
    end_positions for question answering); ["labels"] for any other model."""
    if is_pretrained_model(model):
        from transformers.utils import find_labels

        from ..strategies.base import unwrap_model
        names = find_labels(type(unwrap_model(model)))
        if names:
            return names
    return ["labels"]


def accepts_loss_kwargs(model) -> bool:
    """HF's model_accepts_loss_kwargs: the model's own accepts_loss_kwargs, else whether its forward takes
    **kwargs: HF then counts num_items_in_batch for every batch and passes it to the forward."""
    from ..strategies.base import unwrap_model

    inner = unwrap_model(model)
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def loss_shifts_labels(model) -> bool:
    """HF's rule for counting a batch's loss items over labels[..., 1:]: the model's loss_type maps to
    transformers' causal-LM loss, and it is not an encoder-decoder."""
    from ..strategies.base import unwrap_model

    inner = unwrap_model(model)
    if not is_pretrained_model(inner):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss and \
        not getattr(getattr(inner, "config", None), "is_encoder_decoder", False)


class _HFBestRun(NamedTuple):  # transformers' BestRun where it is not installed
    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any = None


def best_run_base() -> type:
    try:
        from transformers.trainer_utils import BestRun as hf_best_run
    except ImportError:
        return _HFBestRun
    return hf_best_run
