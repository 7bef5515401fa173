"""The config's factories -> the Trainer's job: model, datasets, tokenizer, collator and metrics, each checked
before any training (a factory's missing extra named in one line)."""

from __future__ import annotations

from typing import Any

from ..config.args import ConfigError, TrainingArguments
from ..config.sections import import_string, missing_package


def build_job(args: TrainingArguments) -> dict[str, Any]:
    """Model, datasets, collator and metrics from the config's factories (all validated here)."""
    if args.model is None:
        raise ConfigError("model: missing section; add model: {factory: 'package.module:build_model'}")
    if args.data is None or args.data.factory is None:
        raise ConfigError("data.factory: missing; add data: {factory: 'package.module:build_datasets'}")
    model_factory = import_string(args.model.factory, "model.factory")
    data_factory = import_string(args.data.factory, "data.factory")
    rewards = reward_functions(args.reward_funcs) if hasattr(args, "reward_funcs") else None  # GRPO / RLOO's
    try:
        job: dict[str, Any] = {"model": model_factory(**args.model.kwargs)}
    except TypeError as e:
        raise ConfigError(f"model: {args.model.factory} rejected its arguments ({e})") from None
    except ModuleNotFoundError as e:
        raise missing_package(e, "model.factory", args.model.factory) or e from None
    try:
        datasets = data_factory(**args.data.kwargs)
    except TypeError as e:
        raise ConfigError(f"data: {args.data.factory} rejected its arguments ({e})") from None
    except ModuleNotFoundError as e:
        raise missing_package(e, "data.factory", args.data.factory) or e from None
    if isinstance(datasets, dict) and "train" in datasets:
        job["train_dataset"], job["eval_dataset"] = datasets["train"], datasets.get("eval")
        if datasets.get("processing_class") is not None:  # a tokenizer: final/ saves it beside the model
            job["processing_class"] = datasets["processing_class"]
    elif isinstance(datasets, (tuple, list)) and len(datasets) == 2:
        job["train_dataset"], job["eval_dataset"] = datasets
    else:
        raise ConfigError(f"data.factory: {args.data.factory} must return (train, eval) or "
                          "{'train': ..., 'eval': ..., 'processing_class': ... (optional)}")
    for split in ("train", "eval"):  # a data.collator may take any item; the default one takes dicts
        if not args.data.collator:
            check_items(job[f"{split}_dataset"], f"data.factory: {args.data.factory} returned a {split} dataset")
    if rewards is not None:
        job["reward_funcs"] = rewards
    if args.data.collator:
        job["data_collator"] = import_string(args.data.collator, "data.collator")
    if args.data.compute_metrics:
        job["compute_metrics"] = import_string(args.data.compute_metrics, "data.compute_metrics")
    return job


def reward_functions(paths: Any) -> list:
    """GRPOConfig / RLOOConfig's reward_funcs ('package.module:function' each) -> the functions, or one line naming
    the entry that does not resolve."""
    if not paths:
        raise ConfigError("reward_funcs: missing; name at least one reward function, e.g. "
                          "reward_funcs: ['package.module:function']")
    funcs = []
    for i, path in enumerate([paths] if isinstance(paths, str) else paths):
        field = f"reward_funcs[{i}]"
        if not isinstance(path, str) or not path.partition(":")[2]:
            raise ConfigError(f"{field}: expected an import string 'package.module:function', got {path!r}")
        func = import_string(path, field)
        if not callable(func):
            raise ConfigError(f"{field}: {path} is a {type(func).__name__}, not a function")
        funcs.append(func)
    return funcs


def check_items(dataset, what: str) -> None:
    """A map-style dataset must yield dicts (one tensor or array per column); said before training."""
    from collections.abc import Mapping

    if dataset is None or isinstance(dataset, (Mapping, str)) or not hasattr(dataset, "__getitem__") \
            or not hasattr(dataset, "__len__") or type(dataset).__module__.startswith(("pyarrow", "ray.")):
        return
    if isinstance(dataset, (list, tuple)) and dataset and all(isinstance(p, str) for p in dataset):
        return  # a list of file paths: data.py reads and checks the files
    try:
        first = dataset[0] if len(dataset) else None
    except Exception:
        return  # not indexable by position: data.py says what it accepts
    if first is not None and not isinstance(first, Mapping):
        raise ConfigError(f"{what} whose items are {type(first).__name__}; each item must be a dict of "
                          "tensors, one per model input and 'labels' (e.g. {'pixels': ..., 'labels': ...})")
