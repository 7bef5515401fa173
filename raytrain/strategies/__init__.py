"""Backends behind one interface; `create_strategy(args)` picks one from args.distributed."""

from __future__ import annotations

from .base import Strategy
from .single import SingleProcessStrategy


def create_strategy(args) -> Strategy:
    """The strategy for this worker. Multi-worker backends are imported lazily."""
    name = args.distributed.strategy
    if args.scaling.num_workers <= 1 and name in ("auto", "ddp"):
        return SingleProcessStrategy(args)
    if name in ("auto", "ddp"):
        from .ddp import DDPStrategy
        return DDPStrategy(args)
    if name == "fsdp":
        from .fsdp import FSDPStrategy
        return FSDPStrategy(args)
    if name == "deepspeed":
        from .deepspeed import DeepSpeedStrategy
        return DeepSpeedStrategy(args)
    raise ValueError(f"distributed.strategy: unknown backend {name!r}")


__all__ = ["Strategy", "SingleProcessStrategy", "create_strategy"]
