"""Every learning-rate schedule of HF's lr_scheduler_type.

The schedules reproduce the closed forms of transformers' ``get_scheduler`` so that a
config ported from Hugging Face trains with the same learning rates. Each schedule is a
module-level function bound with ``functools.partial``: LambdaLR's state_dict then stays
picklable and loads into a freshly built scheduler on resume.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from .optimizers import check_keys, init_keys

def _warmup(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1, num_warmup_steps))


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _progress(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    return float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _cosine_with_min_lr(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float,
                        min_lr_rate: float) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_warmup_with_min_lr(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float,
                               min_lr_rate: float, warmup_lr_rate: float | None) -> float:
    # transformers' variant: warmup starts at warmup_lr_rate (else 1/warmup) and decay is one step ahead.
    if step < num_warmup_steps:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, num_warmup_steps)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1.0) / max(1.0, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init  # LambdaLR multiplies by lr_init
    # max(1, ...) only guards T == w, where transformers divides by zero.
    remaining = 1 - (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _constant(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    return 1.0  # transformers' "constant" ignores warmup too


def _constant_with_warmup(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    return _warmup(step, num_warmup_steps) if step < num_warmup_steps else 1.0


def _inverse_sqrt(step: int, *, num_warmup_steps: int, num_training_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    shift = timescale - num_warmup_steps  # makes the multiplier exactly 1 at the end of warmup
    return 1.0 / math.sqrt((step + shift) / timescale)


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _warmup_stable_decay(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        progress = _warmup(step, num_warmup_steps)
        if warmup_type == "linear":
            factor = progress
        elif warmup_type == "cosine":
            factor = 0.5 * (1.0 - math.cos(math.pi * progress))
        else:  # 1-sqrt
            factor = 1.0 - math.sqrt(1.0 - progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        if decay_type == "linear":
            factor = 1.0 - progress
        elif decay_type == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        else:  # 1-sqrt
            factor = 1.0 - math.sqrt(progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


# name -> (multiplier, the lr_scheduler_kwargs it accepts with their defaults)
_SCHEDULES: dict[str, tuple[Any, dict[str, Any]]] = {
    "linear": (_linear, {}),
    "cosine": (_cosine, {"num_cycles": 0.5}),
    "cosine_with_restarts": (_cosine_with_restarts, {"num_cycles": 1}),
    "cosine_with_min_lr": (_cosine_with_min_lr, {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None}),
    "cosine_warmup_with_min_lr": (_cosine_warmup_with_min_lr, {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None,
                                                               "warmup_lr_rate": None}),
    "polynomial": (_polynomial, {"lr_end": 1e-7, "power": 1.0}),
    "constant": (_constant, {}),
    "constant_with_warmup": (_constant_with_warmup, {}),
    "inverse_sqrt": (_inverse_sqrt, {"timescale": None}),
    "warmup_stable_decay": (
        _warmup_stable_decay,
        {"num_stable_steps": None, "num_decay_steps": None, "warmup_type": "linear",
         "decay_type": "cosine", "min_lr_ratio": 0.0, "num_cycles": 0.5},
    ),
}


def create_scheduler(
    optimizer: torch.optim.Optimizer, args: Any, num_training_steps: int
) -> LRScheduler | ReduceLROnPlateau:
    """Build the schedule named by ``args.lr_scheduler_type`` with ``args.lr_scheduler_kwargs``."""
    name = args.lr_scheduler_type
    given = dict(args.lr_scheduler_kwargs or {})
    if name == "reduce_lr_on_plateau":
        check_keys("lr_scheduler_kwargs", name, given, init_keys(ReduceLROnPlateau) - {"optimizer"})
        return ReduceLROnPlateau(optimizer, **given)
    if name not in _SCHEDULES:
        valid = ", ".join([*_SCHEDULES, "reduce_lr_on_plateau", "greedy"])
        raise ValueError(f"lr_scheduler_type: unknown schedule {name!r} (valid: {valid})")
    fn, defaults = _SCHEDULES[name]
    check_keys("lr_scheduler_kwargs", name, given, set(defaults))
    kwargs = {**defaults, **given}
    warmup = args.get_warmup_steps(num_training_steps)
    if name == "polynomial":
        kwargs["lr_init"] = optimizer.defaults["lr"]
        if not kwargs["lr_init"] > kwargs["lr_end"]:
            raise ValueError(f"lr_scheduler_kwargs: lr_end ({kwargs['lr_end']}) must be below the learning rate "
                             f"({kwargs['lr_init']})")
    elif name == "inverse_sqrt" and kwargs["timescale"] is None:
        kwargs["timescale"] = warmup or 10_000
    elif name == "warmup_stable_decay":
        _resolve_wsd(kwargs, warmup, num_training_steps)
    elif name.endswith("with_min_lr"):
        _resolve_min_lr(kwargs, optimizer.defaults["lr"])
    lr_lambda = partial(fn, num_warmup_steps=warmup, num_training_steps=num_training_steps, **kwargs)
    return LambdaLR(optimizer, lr_lambda)


def scheduler_needs_metric(scheduler: LRScheduler | ReduceLROnPlateau) -> bool:
    """True when ``scheduler.step`` must be given an evaluation metric, not called every step."""
    return isinstance(scheduler, ReduceLROnPlateau) or type(scheduler).__name__ == "GreedyLR"


def _resolve_wsd(kwargs: dict[str, Any], warmup: int, total: int) -> None:
    """Fill in the phase lengths transformers makes the caller give: decay defaults to the
    rest after a given stable phase, else to the last 10% of training."""
    for key in ("warmup_type", "decay_type"):
        if kwargs[key] not in _WSD_SHAPES:
            raise ValueError(f"lr_scheduler_kwargs: {key} {kwargs[key]!r} is not one of {', '.join(_WSD_SHAPES)}")
    if kwargs["num_decay_steps"] is None:
        stable = kwargs["num_stable_steps"]
        kwargs["num_decay_steps"] = total // 10 if stable is None else total - warmup - stable
    if kwargs["num_stable_steps"] is None:
        kwargs["num_stable_steps"] = total - warmup - kwargs["num_decay_steps"]
    if kwargs["num_stable_steps"] < 0 or kwargs["num_decay_steps"] < 0:
        raise ValueError(f"lr_scheduler_kwargs: warmup ({warmup}) + num_stable_steps + num_decay_steps "
                         f"do not fit in {total} training steps")


def _resolve_min_lr(kwargs: dict[str, Any], lr: float) -> None:
    """min_lr (absolute) or min_lr_rate (a ratio of the learning rate): exactly one, as transformers."""
    min_lr, rate = kwargs.pop("min_lr"), kwargs["min_lr_rate"]
    if (min_lr is None) == (rate is None):
        raise ValueError("lr_scheduler_kwargs: set exactly one of min_lr or min_lr_rate "
                         f"(got min_lr={min_lr}, min_lr_rate={rate})")
    if min_lr is not None:
        kwargs["min_lr_rate"] = min_lr / lr
