"""`trainer.accelerator`: the members of accelerate's Accelerator that HF's Trainer, its tests, example scripts and
TRL read, answered from torch.distributed (a Ray worker's process group) or, without one, as one process: its
`state` (num_processes, process_index, distributed_type ...; settable, as tests patch them, and compute_loss reads
num_processes from it as HF's does), `gradient_state`, and accelerator_config's settings. No accelerate here: no
prepare(), no mixed-precision plugin, no gradient accumulation context."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import accelerate_config
from ..strategies.base import unwrap_model


def _live() -> bool:
    return dist.is_available() and dist.is_initialized()


class _Live:
    """An attribute computed on each read unless set (unittest.mock's patch.object sets it, then deletes it)."""

    def __init__(self, fn: Any):
        self.fn, self.name = fn, fn.__name__

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__[self.name] if self.name in obj.__dict__ else self.fn(obj)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(self.name, None)


class AcceleratorState:
    """accelerate's AcceleratorState of this process, read from the process group and the Trainer's arguments."""

    deepspeed_plugin = fsdp_plugin = None  # raytrain's backends are its strategies

    def __init__(self, trainer: Any):
        self._trainer = trainer

    @_Live
    def num_processes(self) -> int:
        return dist.get_world_size() if _live() else 1

    @_Live
    def process_index(self) -> int:
        return dist.get_rank() if _live() else 0

    @_Live
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0)) if _live() else 0

    @_Live
    def parallelism_config(self) -> Any:
        # None: TRL's trainers read it and would take accelerate's paths (ALST's loss, CP's buffers); raytrain's
        # strategies split sequences (sp_size) themselves, below the same loss code; TP is the mesh's
        return None

    @_Live
    def device(self) -> torch.device:
        return self._trainer.args.device if self._trainer is not None else torch.device("cpu")

    @_Live
    def mixed_precision(self) -> str:
        return self._trainer.args.mixed_precision if self._trainer is not None else "no"

    @_Live
    def distributed_type(self) -> Any:
        """accelerate's DistributedType (its enum where installed): NO for one process, else the backend's."""
        name = "NO"
        if self.num_processes > 1 and self._trainer is not None:
            backend = self._trainer.get_strategy().name
            name = {"fsdp": "FSDP", "deepspeed": "DEEPSPEED"}.get(
                backend, "MULTI_GPU" if self.device.type == "cuda" else "MULTI_CPU")
        try:
            from accelerate.utils import DistributedType
        except ImportError:
            return name
        return DistributedType[name]

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0


class GradientState:
    """accelerate's GradientState as HF's Trainer configures it: plugin_kwargs from accelerator_config's
    gradient_accumulation_kwargs with num_steps 1 (the Trainer accumulates), sync_gradients per micro-batch."""

    num_steps = 1
    end_of_dataloader = in_dataloader = False
    remainder = -1

    def __init__(self, trainer: Any):
        self._trainer = trainer

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return accelerate_config.plugin_kwargs(getattr(self._trainer.args, "accelerator_config", None))

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)  # accelerate's GradientState reads it so

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin_kwargs.get("sync_each_batch", False)

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch's backward ends the accumulation window (the loop sets it; TRL's GRPO its own)."""
        return bool(getattr(self._trainer, "_sync_gradients", True))

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._trainer._sync_gradients = value

    def _set_sync_gradients(self, value: bool) -> None:  # accelerate's name, which HF's loop calls
        self.sync_gradients = value


class Accelerator:
    """What a script asks of `trainer.accelerator`: this process's place among the training processes
    (1 process in-process; the process group's on Ray workers), accelerate's settings and a few collectives."""

    def __init__(self, trainer: Any = None):
        self._trainer = trainer
        self.state = AcceleratorState(trainer)
        self.gradient_state = GradientState(trainer)

    def _setting(self, name: str) -> Any:
        return accelerate_config.settings(getattr(getattr(self._trainer, "args", None), "accelerator_config", None))[name]

    split_batches = property(lambda self: self._setting("split_batches"), doc="accelerator_config's (accelerate's)")
    dispatch_batches = property(lambda self: self._setting("dispatch_batches"), doc="accelerator_config's")
    even_batches = property(lambda self: self._setting("even_batches"), doc="accelerator_config's")
    use_seedable_sampler = property(lambda self: self._setting("use_seedable_sampler"), doc="accelerator_config's")
    non_blocking = property(lambda self: self._setting("non_blocking"), doc="accelerator_config's")

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def distributed_type(self) -> Any:
        return self.state.distributed_type

    @property
    def parallelism_config(self) -> Any:
        return self.state.parallelism_config

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

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
        return self.state.device

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
        """gradient_state's: whether this micro-batch's backward ends the accumulation window."""
        return self.gradient_state.sync_gradients

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
