"""PEFT models: what a checkpoint and final/ hold for them (PEFT's own adapter files), the adapter read
back into a model by name, and the adapter merged into its base model as a full transformers model.

Only the adapter is trained, so only the adapter is saved: adapter_model.safetensors and
adapter_config.json, written by PEFT's own save_pretrained from the consolidated weights (any backend),
load with `PeftModel.from_pretrained(base, path)` as transformers' Trainer's do. peft is imported only
when the user's model is one.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..checkpoint import store as ckpt
from . import objects as hf
from ..strategies.base import frozen_names, unwrap_model
from ..strategies.pipeline import Absent

logger = logging.getLogger(__name__)

MERGED_DIR = "merged"  # save_merged_model: the full model beside the adapter, in final/merged/


def peft_of(model: Any) -> Any | None:
    """The PeftModel inside DDP / DeepSpeed / torch.compile wrappers (FSDP2 keeps its class), or None."""
    inner = unwrap_model(model)
    return inner if hf.is_peft_model(inner) else None


def save_adapter(peft: Any, state: dict[str, torch.Tensor], directory: str) -> list[str]:
    """PEFT's save_pretrained from `state`, the consolidated weights by the model's own names (what a
    strategy's model_state_dict returns): the adapter, its config and PEFT's README; the names written."""
    before = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    if any(isinstance(m, Absent) for m in peft.modules()):  # a pipeline stage: PEFT picks by the whole model's modules
        peft = _skeleton(peft)
    peft.save_pretrained(directory, state_dict=state, safe_serialization=True)
    return sorted(set(os.listdir(directory)) - before)


def to_model_names(peft: Any, adapter: dict[str, torch.Tensor], source: str,
                   stage: bool = False) -> dict[str, torch.Tensor]:
    """An adapter file's tensors under the model's own state_dict names (PEFT's names for it, computed by
    PEFT's get_peft_model_state_dict and inverted); every trainable parameter must be among them.
    `stage`: the model is a pipeline stage, which takes its own tensors and leaves the other stages'."""
    from peft import get_peft_model_state_dict

    own = peft.state_dict()
    by_id = {id(v): k for k, v in own.items()}
    names: dict[str, str] = {}
    for adapter_name in peft.peft_config:
        saved = get_peft_model_state_dict(peft, state_dict=own, adapter_name=adapter_name)
        names.update({k: by_id[id(v)] for k, v in saved.items() if id(v) in by_id})
    unknown = sorted(set(adapter) - set(names))
    if stage:
        adapter = {k: v for k, v in adapter.items() if k in names}
    elif unknown:
        raise ckpt.CheckpointError(f"{source}: {len(unknown)} tensors this model's adapter does not have "
                                   f"(e.g. {unknown[0]}): an adapter of another model or LoRA configuration")
    state = {names[k]: v for k, v in adapter.items()}
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    missing = sorted(n for n in trainable if n not in state)
    if missing:
        raise ckpt.CheckpointError(f"{source}: no weights for {len(missing)} trained parameters (e.g. {missing[0]})")
    return state


def load_weights(strategy: Any, weights: dict[str, torch.Tensor], directory: str) -> None:
    """Weights read from checkpoint `directory` (ckpt.load_weights) into the strategy's model: a full set
    by name, or a PEFT model's adapter file alone, the frozen base left as the model factory built it."""
    peft, source = peft_of(strategy.model), os.path.join(directory, ckpt.ADAPTER_WEIGHTS)
    if peft is None or not os.path.isfile(source):
        strategy.load_model_state_dict(weights)
        return
    state = to_model_names(peft, weights, source, stage=getattr(strategy, "pipeline", None) is not None)
    strategy.load_model_state_dict(state, strict=False)


def load_trained(model: Any, state: dict[str, torch.Tensor]) -> None:
    """The weights a run returns (rank 0's) into the driver's `model`: all of them, or a PEFT model's
    trained ones and buffers (its frozen base is the one the driver built)."""
    inner = unwrap_model(model)
    if peft_of(model) is None:
        inner.load_state_dict(state)
        return
    result = inner.load_state_dict(state, strict=False)
    bad = list(result.unexpected_keys) + sorted(set(result.missing_keys) - frozen_names(inner))
    if bad:
        raise RuntimeError(f"the run's weights do not fit the driver's model: {bad[:3]}")


def save_merged(peft: Any, state: dict[str, torch.Tensor], directory: str, processing_class: Any = None) -> str:
    """The adapter merged into its base (PEFT's merge_and_unload) as a transformers model that
    from_pretrained loads. Built on the meta device from the base's config and `state` (consolidated
    weights, copied: the merge writes into them), so it works alike for every backend, on rank 0."""
    base = peft.get_base_model()
    if not hf.is_pretrained_model(base):
        raise ValueError(f"save_merged_model: the base model is a {type(base).__name__}, not a transformers "
                         "model that from_pretrained could load; save the adapter alone")
    skeleton = _skeleton(peft)
    skeleton.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True, assign=True)
    merged = skeleton.merge_and_unload()
    os.makedirs(directory, exist_ok=True)
    with _no_progress_bars():
        merged.save_pretrained(directory)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)
    return directory


def _skeleton(peft: Any) -> Any:
    """The PEFT model rebuilt whole on the meta device from its base's config and its adapters' configs."""
    from peft import get_peft_model

    base = peft.get_base_model()
    first, *others = peft.peft_config
    with torch.device("meta"), warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated name
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        skeleton = get_peft_model(type(base)(copy.deepcopy(base.config)), copy.deepcopy(peft.peft_config[first]),
                                  adapter_name=first)
        for name in others:
            skeleton.add_adapter(name, copy.deepcopy(peft.peft_config[name]))
    skeleton.set_adapter(peft.active_adapter)
    return skeleton


def save_model_dir(model: Any, state: dict[str, torch.Tensor], processing_class: Any, args: Any,
                   directory: str) -> None:
    """A trained model as the tools users load it with read it (rank 0): the full weights, or a PEFT
    model's adapter (no config.json: the base's would load random weights where the adapter's keys are),
    with args.save_merged_model also the merged model in merged/; the processing class and the args."""
    os.makedirs(directory, exist_ok=True)
    peft = peft_of(model)
    if peft is None:
        ckpt.save_weights(state, directory)
    else:
        save_adapter(peft, state, directory)
    with open(os.path.join(directory, "training_args.json"), "w") as f:
        f.write(args.to_json_string())
    hf.save_pretrained_files(model, processing_class, args, directory)
    if peft is not None:
        logger.warning(describe(directory))
        if getattr(args, "save_merged_model", False):
            save_merged(peft, state, os.path.join(directory, MERGED_DIR), processing_class)
    elif getattr(args, "save_merged_model", False):
        logger.warning("save_merged_model: the model has no PEFT adapter to merge; %s holds the full model", directory)


def describe(directory: str) -> str:
    """The one line that says what a PEFT model's final directory holds and how to load it."""
    return (f"{directory}: the LoRA/PEFT adapter ({ckpt.ADAPTER_WEIGHTS}, {ckpt.ADAPTER_CONFIG}), not a full "
            f"model: load it with PeftModel.from_pretrained(base_model, {directory!r}), or set save_merged_model "
            f"for a full model in {os.path.join(directory, MERGED_DIR)}")


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' "Writing model shards" bar is noise in a run's log: off while raytrain saves."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
