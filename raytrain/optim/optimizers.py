"""The optimizer: HF's two weight-decay parameter groups, torch's optim names, the build HF's create_optimizer does."""

from __future__ import annotations

import inspect
import re
import warnings
from types import MethodType
from typing import Any

import torch
from torch import nn

# As HF's get_decay_parameter_names: parameters of a LayerNorm, or named like a bias or a norm, are not decayed.
_NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of the parameters weight decay applies to, by HF's rule (module type and name)."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            continue
        for name, _ in module.named_parameters(prefix=prefix, recurse=False):
            if not _NO_DECAY_NAMES.search(name.lower()):
                names.append(name)
    return names


def get_parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """HF's two parameter groups: decayed (decay_parameter_names) and not, both kept even when empty or
    when weight_decay is 0, so that per-group learning rates and optimizer states line up with HF's.
    Tied weights appear once, frozen ones not at all."""
    decayed = set(decay_parameter_names(model))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if name in decayed else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def torch_optimizer_cls_and_kwargs(args: Any) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and keyword arguments of a torch-only ``args.optim`` name, as HF's Trainer resolves it
    (adafactor here is torch's: transformers' own is used where transformers is installed).

    ``args.optim_args`` is merged over them: any argument of the class, where HF reads a few or none.
    """
    lr = {"lr": args.learning_rate}
    adam = {**lr, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    choices = {
        "adamw_torch": (torch.optim.AdamW, adam),
        "adamw_torch_fused": (torch.optim.AdamW, {**adam, "fused": True}),
        "sgd": (torch.optim.SGD, lr),
        "adagrad": (torch.optim.Adagrad, lr),
        "rmsprop": (torch.optim.RMSprop, lr),
        "adafactor": (torch.optim.Adafactor, lr),
    }
    if args.optim not in choices:
        raise ValueError(f"optim: {args.optim!r} is not one of torch's optimizers ({', '.join(choices)})")
    cls, kwargs = choices[args.optim]
    return cls, merge_optim_args(cls, args, kwargs)


def merge_optim_args(cls: type, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``args.optim_args`` (a mapping) over `kwargs`, each key checked against `cls`'s constructor."""
    extra = dict(args.optim_args or {})
    check_keys("optim_args", args.optim, extra, init_keys(cls))
    return {**kwargs, **extra}


def build_optimizer(cls: Any, kwargs: dict[str, Any], model: nn.Module, weight_decay: float) -> torch.optim.Optimizer:
    """`cls` over ``get_parameter_groups`` with `kwargs`, as HF's create_optimizer builds it: the groups a
    resolution made itself (GaLore's ``params``, LOMO's ``model``, a layer-wise ``optimizer_dict``) replace
    raytrain's; bitsandbytes' 8-bit optimizers keep embeddings in 32 bits."""
    kwargs = dict(kwargs)
    groups: Any = get_parameter_groups(model, weight_decay)
    for key in ("params", "model", "optimizer_dict"):  # HF's order: the last one present wins
        if key in kwargs:
            groups = kwargs.pop(key)
    try:
        optimizer = cls(groups, **kwargs)
    except RuntimeError as err:
        if not kwargs.get("fused"):
            raise
        # Fused kernels are missing for some devices and combinations; the foreach path is
        # numerically the same update, only slower.
        warnings.warn(f"fused AdamW unavailable ({err}); falling back to the default AdamW", stacklevel=2)
        kwargs.pop("fused")
        optimizer = cls(groups, **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    if hasattr(optimizer, "fused_backward"):  # LOMO updates the weights in its backward; step is a no-op
        optimizer.step = MethodType(_no_step, optimizer)  # bound: LR schedulers wrap step.__func__
    return optimizer


def _no_step(self: torch.optim.Optimizer, closure: Any = None) -> None:
    return None


def create_optimizer(model: nn.Module, args: Any) -> torch.optim.Optimizer:
    """Build the torch optimizer named by ``args.optim`` over ``get_parameter_groups``
    (every other name of HF's: raytrain.hf.optim.create_optimizer)."""
    cls, kwargs = torch_optimizer_cls_and_kwargs(args)
    return build_optimizer(cls, kwargs, model, args.weight_decay)


def get_lr(optimizer: torch.optim.Optimizer) -> float:
    """The current learning rate of the first parameter group."""
    return float(optimizer.param_groups[0]["lr"])


# ---- schedules: lr multiplier at `step`, the same closed forms as transformers ----


def init_keys(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters) - {"params"}


def check_keys(field: str, name: str, given: dict[str, Any], valid: set[str]) -> None:
    for key in given:
        if key not in valid:
            allowed = ", ".join(sorted(valid)) or "none"
            raise ValueError(f"{field}: unknown key {key!r} for {name} (valid: {allowed})")
