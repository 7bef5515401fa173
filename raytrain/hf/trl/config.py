"""TRL 1.16's SFTConfig / DPOConfig fields, read from the installed trl: raytrain.trl adds them to TrainingArguments
with TRL's names, defaults and help, so a config keeps its meaning."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

try:
    import trl
    from trl import DPOConfig as _DPOConfig, SFTConfig as _SFTConfig
except ImportError as e:  # one line naming the package to install
    raise ImportError(f"raytrain.trl needs trl>=1.16 ({e.name} is missing): pip install 'raytrain[trl]'") from None

TRL_VERSION = trl.__version__

# Fields of transformers' TrainingArguments whose default TRL changes (its _BaseConfig and each config).
_CHANGED = ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "lr_scheduler_kwargs", "disable_tqdm")


def trl_fields(kind: str, base_names: set[str]) -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) for make_dataclass: TRL's own fields (not in `base_names`) and the changed defaults."""
    cls = {"sft": _SFTConfig, "dpo": _DPOConfig}[kind]
    out = []
    for f in dataclasses.fields(cls):
        if f.name in base_names and f.name not in _CHANGED:
            continue
        help_text = str(f.metadata.get("help", "")).replace("%%", "%")
        meta = {"help": help_text, **({"choices": f.metadata["choices"]} if "choices" in f.metadata else {})}
        if f.default_factory is not dataclasses.MISSING:
            new = dataclasses.field(default_factory=f.default_factory, metadata=meta)
        else:
            new = dataclasses.field(default=f.default, metadata=meta)
        out.append((f.name, Any, new))
    return out


def trl_field_names(kind: str, base_names: set[str]) -> tuple[str, ...]:
    return tuple(name for name, _, _ in trl_fields(kind, base_names) if name not in base_names)


def check_choices(args: Any, names: tuple[str, ...]) -> None:
    """TRL's `choices` metadata as raytrain's one-line ValueError naming the field."""
    for f in dataclasses.fields(args):
        if f.name in names and "choices" in f.metadata:
            value = getattr(args, f.name)
            if value not in f.metadata["choices"]:
                raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(map(repr, f.metadata['choices']))}")


def normalize_sft(args: Any) -> None:
    """What SFTConfig.__post_init__ does to its own fields (deprecated names, 'auto' padding)."""
    s = object.__setattr__
    if args.packing_strategy == "bfd-requeue":
        warnings.warn("packing_strategy 'bfd-requeue' is now 'bfd_split'", FutureWarning, stacklevel=4)
        s(args, "packing_strategy", "bfd_split")
    _normalize_common(args)
    if args.loss_type == "chunked_nll":
        warnings.warn("loss_type='chunked_nll' is deprecated: 'nll' computes the loss the same way",
                      FutureWarning, stacklevel=4)
        s(args, "loss_type", "nll")


def _normalize_common(args: Any) -> None:
    s = object.__setattr__
    pad = args.pad_to_multiple_of
    if isinstance(pad, str) and pad != "auto":
        s(args, "pad_to_multiple_of", None if pad.lower() in ("none", "null") else int(pad))
    if args.pad_to_multiple_of == "auto":  # 128 on Neuron only (it compiles per shape); raytrain runs no Neuron
        s(args, "pad_to_multiple_of", None)
    if args.pad_token is not None:
        warnings.warn("pad_token is deprecated: set tokenizer.pad_token", FutureWarning, stacklevel=4)
    if args.truncation_mode == "keep_end":
        warnings.warn("truncation_mode='keep_end' is deprecated", FutureWarning, stacklevel=4)


def normalize_dpo(args: Any) -> None:
    """What DPOConfig.__post_init__ does to its own fields (loss_type as a list, loss_weights matching it)."""
    if isinstance(args.loss_type, str):
        object.__setattr__(args, "loss_type", [args.loss_type])
    if args.loss_weights is not None and len(args.loss_weights) != len(args.loss_type):
        raise ValueError(f"loss_weights: {len(args.loss_weights)} weights for {len(args.loss_type)} loss types; "
                         "give one weight per loss_type")
    _normalize_common(args)
