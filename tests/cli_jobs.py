"""Factories for CLI tests: runs that fail the way users' runs do, and a slow digits model to interrupt."""

from __future__ import annotations

import time

import torch
from torch import nn

from examples.digits import DigitsMLP


class NoLoss(DigitsMLP):
    """Returns logits only, even with labels."""

    def forward(self, pixels, labels=None):
        return {"logits": super().forward(pixels)["logits"]}


def model_without_loss(**kwargs) -> nn.Module:
    return NoLoss(**kwargs)


class Ints(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i


def int_datasets(**kwargs):
    return Ints(), None


class Slow(DigitsMLP):
    """The digits MLP, sleeping `delay` seconds per forward: gives a test time to send a signal."""

    def __init__(self, delay: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay

    def forward(self, pixels, labels=None):
        time.sleep(self.delay)
        return super().forward(pixels, labels)


def slow_model(delay: float = 0.02, **kwargs) -> nn.Module:
    return Slow(delay, **kwargs)


def waiting_model(marker: str = "", delay=None, **kwargs) -> nn.Module:
    """Touches `marker`, then takes its time building: a signal sent now lands before training."""
    open(marker, "w").close()
    time.sleep(30)
    return DigitsMLP(**kwargs)


def digits_with_key(api_key: str | None = None, **kwargs):
    """The digits datasets, from a factory that takes a credential (which must never be logged)."""
    from examples.digits import build_datasets

    return build_datasets(**kwargs)
