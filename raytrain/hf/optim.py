"""Every `optim` name of transformers 5.23, resolved by transformers' own Trainer.get_optimizer_cls_and_kwargs
(the names of bitsandbytes, torchao, GaLore, APOLLO, LOMO, schedule-free, ...); torch's names by raytrain.optim,
so that they need no transformers. transformers is imported only for a name that needs it."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ..optim.optimizers import build_optimizer, check_keys, init_keys, merge_optim_args, torch_optimizer_cls_and_kwargs
from ..optim.schedules import create_scheduler as _own_schedule
from .names import TORCH_NAMES, check_optim, installed


class _HFArgs:
    """raytrain's TrainingArguments as transformers' resolution reads them: optim_args as HF's 'k=v,...' string."""

    def __init__(self, args: Any):
        self._args = args
        given = args.optim_args
        self.optim_args = (",".join(f"{k}={v}" for k, v in given.items()) or None) if isinstance(given, dict) else given

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def optimizer_cls_and_kwargs(args: Any, model: nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
    """The class and keyword arguments HF's Trainer builds for ``args.optim`` (its resolution where it is
    transformers'); refused in one line when the name's library is missing."""
    name = getattr(args.optim, "value", args.optim)
    try:
        check_optim(name)
    except ValueError as err:
        raise ValueError(f"optim: {err}") from None
    if name == "adafactor" and installed("transformers"):
        from transformers.optimization import Adafactor  # HF's adafactor is transformers' own class

        kwargs = {"lr": args.learning_rate, "scale_parameter": False, "relative_step": False}
        return Adafactor, merge_optim_args(Adafactor, args, kwargs)
    if name in TORCH_NAMES:
        return torch_optimizer_cls_and_kwargs(args)
    from transformers import Trainer

    return Trainer.get_optimizer_cls_and_kwargs(_HFArgs(args), model)


#: Classes in an optimizer's state (plain data and tensors) that checkpoint.load_pickle's weights_only must accept.
_STATE_CLASSES = {"galore_torch": ("galore_torch.galore_projector", "GaLoreProjector"),
                  "apollo_torch": ("apollo_torch.random_projector", "GradientProjector")}


def create_optimizer(model: nn.Module, args: Any) -> torch.optim.Optimizer:
    """The optimizer ``args.optim`` names over `model`'s parameters, built as HF's Trainer builds it."""
    cls, kwargs = optimizer_cls_and_kwargs(args, model)
    optimizer = build_optimizer(cls, kwargs, model, args.weight_decay)
    state_class = _STATE_CLASSES.get(cls.__module__.split(".")[0])
    if state_class is not None:  # GaLore / APOLLO keep their projectors in the state: resumable
        module, name = state_class
        torch.serialization.add_safe_globals([getattr(importlib.import_module(module), name)])
    return optimizer


def _torch_schedule(optimizer: torch.optim.Optimizer, args: Any, num_training_steps: int) -> Any:
    if args.lr_scheduler_type != "greedy":
        return _own_schedule(optimizer, args, num_training_steps)
    greedy = _greedy_class()
    given = dict(args.lr_scheduler_kwargs or {})
    check_keys("lr_scheduler_kwargs", "greedy", given, init_keys(greedy) - {"optimizer"})
    return greedy(optimizer, **given)


def _greedy_class():
    """transformers' GreedyLR, which HF's "greedy" schedule is (stepped with the evaluation metric)."""
    try:
        from transformers.optimization import GreedyLR
    except ImportError:
        raise ValueError("lr_scheduler_type: 'greedy' is transformers' GreedyLR; install transformers "
                         "(pip install transformers) or pick another schedule") from None
    return GreedyLR


def create_scheduler(optimizer: torch.optim.Optimizer, args: Any, num_training_steps: int) -> Any:
    """raytrain.optim's schedule, or transformers' GreedyLR for "greedy"; for a layer-wise optimizer (GaLore / APOLLO) one per parameter's optimizer,
    stepped in the parameter's gradient hook as HF's get_scheduler does."""
    inner = getattr(optimizer, "optimizer_dict", None)
    if inner is None:
        return _torch_schedule(optimizer, args, num_training_steps)
    schedules = {param: _torch_schedule(opt, args, num_training_steps) for param, opt in inner.items()}
    for param in inner:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: schedules[p].step())
    return _LayerWiseSchedule(optimizer, schedules)


class _LayerWiseSchedule(LRScheduler):
    """HF's LayerWiseDummyScheduler, which torch 2.13 refuses (it gives one rate per parameter to an
    optimizer of one group): the rate of the first parameter's schedule, the one logged."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedules: dict):
        self.schedules = schedules
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        rate = next(iter(self.schedules.values())).get_last_lr()[0]
        return [rate for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedules")}
