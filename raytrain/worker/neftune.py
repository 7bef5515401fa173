"""WORKER side: NEFTune (neftune_noise_alpha), as transformers 5.23 adds it: a forward hook on the model's
input embeddings adds uniform noise of +-alpha/sqrt(length x hidden size) while the module trains, drawn
from torch's global generator (so a checkpoint's RNG state resumes it); the hook is removed after training."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _noise(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    if module.training:  # HF's neftune_post_forward_hook
        dims = torch.tensor(output.size(1) * output.size(2))
        mag_norm = module.neftune_noise_alpha / torch.sqrt(dims)
        output = output + torch.zeros_like(output).uniform_(-mag_norm, mag_norm)
    return output


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The embedding module HF hooks: a PEFT model's base model's, else get_input_embeddings()."""
    if type(model).__module__.startswith("peft.") and hasattr(model, "base_model"):
        model = model.base_model.model
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if not isinstance(embeddings, torch.nn.Module):
        raise ValueError(f"neftune_noise_alpha: {type(model).__name__} has no get_input_embeddings() returning a "
                         "module, where NEFTune adds its noise; unset neftune_noise_alpha")
    return embeddings


@contextlib.contextmanager
def noise(model: torch.nn.Module, alpha: float | None) -> Iterator[None]:
    """NEFTune's hook on `model`'s input embeddings for the duration (nothing when alpha is None)."""
    if alpha is None:
        yield
        return
    embeddings = input_embeddings(model)
    embeddings.neftune_noise_alpha = alpha
    handle = embeddings.register_forward_hook(_noise)
    try:
        yield
    finally:
        handle.remove()
        del embeddings.neftune_noise_alpha
