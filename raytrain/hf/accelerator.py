"""`trainer.accelerator`: the few members of accelerate's Accelerator that HF example scripts call,
answered from torch.distributed (a Ray worker's process group) or, without one, as one process.
No accelerate here: no prepare(), no mixed-precision plugin, no gradient accumulation context."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..strategies.base import unwrap_model


def _live() -> bool:
    return dist.is_available() and dist.is_initialized()


class Accelerator:
    """What a script asks of `trainer.accelerator`: this process's place among the training processes
    (1 process in-process; the process group's on Ray workers) and a few collectives."""

    # None: TRL's trainers read it and would take accelerate's paths (ALST's loss, CP's buffers); raytrain's
    # strategies split sequences (sp_size) themselves, below the same loss code
    parallelism_config = None

    def __init__(self, trainer: Any = None):
        self._trainer = trainer

    @property
    def num_processes(self) -> int:
        return dist.get_world_size() if _live() else 1

    @property
    def process_index(self) -> int:
        return dist.get_rank() if _live() else 0

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0)) if _live() else 0

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def device(self) -> torch.device:
        """This process's device, as the TrainingArguments name it."""
        return self._trainer.args.device if self._trainer is not None else torch.device("cpu")

    def autocast(self) -> Any:
        """The run's mixed precision (args.bf16 / fp16) as a context, as accelerate's autocast()."""
        args = getattr(self._trainer, "args", None)
        dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
            else None
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the local main process only (as accelerate)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if _live():
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first, the others after it (as accelerate)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def gather(self, tensor: Any) -> Any:
        """Tensors (nested in lists, tuples, dicts) from every process, concatenated along the first
        dimension (a scalar becomes one element per process); every process must give the same shapes."""
        if isinstance(tensor, (list, tuple)):
            return type(tensor)(self.gather(t) for t in tensor)
        if isinstance(tensor, dict):
            return type(tensor)({k: self.gather(v) for k, v in tensor.items()})
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gather: expected tensors (in lists, tuples or dicts), got {type(tensor).__name__}")
        if not _live():
            return tensor
        t = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=0)

    def gather_for_metrics(self, tensor: Any) -> Any:
        return self.gather(tensor)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """A tensor summed (or averaged: "mean") over the processes, as accelerate's reduce."""
        if not _live():
            return tensor
        out = tensor.clone()
        dist.all_reduce(out)
        return out / dist.get_world_size() if reduction == "mean" else out

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> torch.Tensor:
        """`tensor` padded along `dim` with pad_index to the longest of the processes' (accelerate's)."""
        if not _live():
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        longest = int(self.gather(size).max())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        filler = tensor.new_full(shape, pad_index)
        return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch's backward ends the accumulation window (a trainer that needs it, TRL's
        GRPO, says so in `_sync_gradients`)."""
        return bool(getattr(self._trainer, "_sync_gradients", True))

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        """The user's module inside DDP / DeepSpeed / torch.compile wrappers."""
        return unwrap_model(model)

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop the references given (returned as Nones, as accelerate), collect garbage, empty the GPU cache."""
        objects = [None] * len(objects)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return objects

    release_memory = free_memory
