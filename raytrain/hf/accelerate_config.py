"""`accelerator_config` in HF's forms: a mapping, transformers' AcceleratorConfig, a JSON file or string; the class
itself refused as HF refuses it. Light until a value is given: None stays None (accelerate's defaults apply), so
that building TrainingArguments imports no transformers."""

from __future__ import annotations

import json
import os
from typing import Any

#: transformers 5.23's AcceleratorConfig fields and defaults (tests/hf/test_accelerator_config.py compares them).
DEFAULTS: dict[str, Any] = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                            "use_seedable_sampler": True, "non_blocking": False,
                            "gradient_accumulation_kwargs": None, "use_configured_state": False}
#: accelerate's GradientAccumulationPlugin fields (its to_kwargs() keeps those set to other than their default).
GRADIENT_ACCUMULATION = {"num_steps": None, "adjust_scheduler": True, "sync_with_dataloader": True,
                         "sync_each_batch": False}


def parse(value: Any) -> Any:
    """The value TrainingArguments keeps: transformers' AcceleratorConfig where installed (as HF's), else a dict of
    the fields given; None stays None. Raises HF's NotImplementedError for the class, else one-line ValueErrors."""
    if value is None:
        return None
    if isinstance(value, type):
        raise NotImplementedError("Tried passing in a callable to `accelerator_config`, but this is not supported. "
                                  "Please pass in a fully constructed `AcceleratorConfig` object instead.")
    if isinstance(value, str) and value.strip().startswith("{"):
        value = _json(value, "a JSON object")
    elif isinstance(value, (str, os.PathLike)):
        value = _read(value)
    elif hasattr(value, "to_dict") and hasattr(value, "__dataclass_fields__"):
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, an AcceleratorConfig or a JSON file path, got {type(value).__name__}")
    unknown = sorted(set(value) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; valid: {', '.join(DEFAULTS)}")
    grad = value.get("gradient_accumulation_kwargs") or {}
    if not isinstance(grad, dict) or set(grad) - set(GRADIENT_ACCUMULATION):
        raise ValueError(f"gradient_accumulation_kwargs: expected a mapping of {', '.join(GRADIENT_ACCUMULATION)}, "
                         f"got {grad!r}")
    if value.get("use_configured_state"):
        _check_configured_state()
    try:
        from transformers.trainer_pt_utils import AcceleratorConfig
    except ImportError:
        return dict(value)
    return AcceleratorConfig(**value)


def settings(value: Any) -> dict[str, Any]:
    """Every field's value (accelerate's defaults for those not given)."""
    given = value if isinstance(value, dict) else {} if value is None else value.to_dict()
    return {**DEFAULTS, **given}


def plugin_kwargs(value: Any) -> dict[str, Any]:
    """accelerate's GradientState.plugin_kwargs as HF's Trainer makes it: the given gradient_accumulation_kwargs
    with num_steps 1 (the Trainer accumulates itself), the fields left at accelerate's default dropped."""
    given = dict(settings(value)["gradient_accumulation_kwargs"] or {}, num_steps=1)
    return {k: v for k, v in given.items() if v != GRADIENT_ACCUMULATION[k]}


def sync_each_batch(value: Any) -> bool:
    """gradient_accumulation_kwargs' sync_each_batch: gradients reduced after every micro-batch (no no_sync)."""
    return bool((settings(value)["gradient_accumulation_kwargs"] or {}).get("sync_each_batch"))


def check_run(args: Any) -> None:
    """What accelerate's settings mean for this run's workers, checked with the arguments (one-line ValueErrors):
    rank 0 cannot dispatch batches to Ray workers (each reads its own shard); split_batches needs batch sizes the
    workers divide, and a fixed worker count."""
    s, n = settings(args.accelerator_config), args.scaling.num_workers
    if s["dispatch_batches"] and n > 1:
        raise ValueError("accelerator_config.dispatch_batches: each Ray worker reads its own shard of the data (Ray "
                         "Data streams it there); rank 0 cannot dispatch batches to the others; leave it unset")
    if s["split_batches"] and n > 1:
        if args.scaling.elastic:
            raise ValueError("accelerator_config.split_batches: with an elastic scaling.num_workers range the split "
                             "would change with the group's size; fix num_workers or leave it false")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(args, name) % n:
                raise ValueError(f"accelerator_config.split_batches: {name} ({getattr(args, name)}) is the batch "
                                 f"split across the {n} workers and needs to be a round multiple of it")


def split_batches(args: Any, dp_size: int) -> None:
    """split_batches on a worker: the per-device batch sizes are the global batch, each rank takes its 1/dp_size
    (accelerate's split); set on this worker's args, once, without revalidation."""
    if dp_size == 1 or "_split_from" in args.__dict__ or not settings(args.accelerator_config)["split_batches"]:
        return
    args._split_from = (args.per_device_train_batch_size, args.per_device_eval_batch_size)
    for name, size in zip(("per_device_train_batch_size", "per_device_eval_batch_size"), args._split_from):
        if size % dp_size:
            raise ValueError(f"accelerator_config.split_batches: {name} ({size}) needs to be a round multiple of "
                             f"the {dp_size} data-parallel ranks")
        object.__setattr__(args, name, size // dp_size)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"expected {what}, got {text!r} ({e.msg})") from None


def _read(path: str | os.PathLike) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return _json(f.read(), f"a JSON object in {os.fspath(path)}")
    except FileNotFoundError:
        raise ValueError(f"file not found: {os.fspath(path)!r} (a mapping, an AcceleratorConfig or a JSON "
                         "file path)") from None


def _check_configured_state() -> None:
    """use_configured_state: accelerate's state must exist before the arguments (HF's check)."""
    try:
        from accelerate.state import PartialState
    except ImportError:
        raise ValueError("use_configured_state: needs accelerate's PartialState, and accelerate is not "
                         "installed") from None
    if PartialState._shared_state == {}:
        raise ValueError("use_configured_state: Passing `'use_configured_state':True` to the AcceleratorConfig "
                         "requires a pre-configured `AcceleratorState` or `PartialState` to be defined before "
                         "calling `TrainingArguments`.")


def configured_processes() -> int:
    """The process count of the accelerate state a script configured (use_configured_state)."""
    from accelerate.state import PartialState

    return PartialState().num_processes
