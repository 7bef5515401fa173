"""Sequence parallelism (parallelism_config.sp_size, HF's ALST with sp_backend "deepspeed"): the ranks of a
sequence group (consecutive ranks, DeepSpeed's parallel_state_sp layout) read the same batch and each trains on
its slice of every sequence; attention runs through DeepSpeed's UlyssesSPAttentionHF, which trades the slices
for whole sequences of sp_size-th of the heads (all-to-all) around the model's own attention.

What of DeepSpeed runs as it is: UlyssesSPAttentionHF (its all-to-all and position-id gather, over gloo on CPU);
one instance per micro-batch size, as it checks shapes against the size it was built with. What is written here
instead, and why:
- the batch's slice (`shard`): UlyssesSPDataLoaderAdapter's per-batch work (global position ids, labels shifted
  before the cut, each tensor cut along the sequence), without its gather of the peers' batches: those are the
  same batch here (data is sharded by data-parallel rank, so the loop's sample-counted position resumes on any
  layout), and its all_gather of batches of unequal lengths fails on gloo ("invalid tensor size");
- the groups: torch process groups, not DeepSpeed's parallel_state_sp (module-global, initialised once per
  process), and the DeepSpeed engine is not given it as its mpu (deepspeed.utils.groups.mpu outlives the engine):
  every backend reduces gradients over all ranks, which the loss scale accounts for (Strategy.gradient_scale).
register_with_transformers (process-wide override of the model's attention key, eager refused, masks dropped)
is replaced by hf/sequence.py.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch


class SequenceParallel:
    """This rank's place in its sequence group, the batch slicing, and the Ulysses attention for a model."""

    kind = "sp"

    def __init__(self, dims: Any, rank: int, device: torch.device):
        self.size, self.rank = dims.sp, dims.seq_rank(rank)
        self.group = dims.seq_group(rank)
        self.device = device
        self._attention: dict[tuple, torch.nn.Module] = {}
        init_comm(device)  # deepspeed.comm over the existing process group: Ulysses' collectives go through it

    def shards(self, source: Any) -> Any:
        """The training source whose batches are this rank's slices."""
        return Shards(source, self.shard)

    def shard(self, batch: dict) -> dict:
        return cut(batch, self.rank, self.size)

    def step(self, inputs: dict):
        """Around a training step: nothing (Ulysses is in the model's attention)."""
        return contextlib.nullcontext()

    def attention(self, core: Callable, batch_size: int, heads: int, kv_heads: int, head_dim: int,
                  layers: int) -> torch.nn.Module:
        """DeepSpeed's UlyssesSPAttentionHF around `core` (the model's attention) for this micro-batch size; in eval
        mode it calls `core` on the rank's whole sequences (disable_in_eval, as accelerate sets it)."""
        key = (id(core), batch_size, heads, kv_heads, head_dim)
        if key not in self._attention:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            self._attention[key] = UlyssesSPAttentionHF(
                attn=core, batch_size=batch_size, attn_head_count=heads, attn_head_size=head_dim,
                kv_head_count=kv_heads, num_hidden_layers=layers, process_group=self.group,
                seq_length_is_variable=True, disable_in_eval=True)
        return self._attention[key]


class ContextParallel:
    """cp_size > 1 (CUDA, FSDP2 over the data-parallel and context ranks): torch's context_parallel, as transformers'
    Trainer (accelerate's maybe_context_parallel) and torchtitan run it. A context group reads the same batch;
    each training step shards the batch's sequence tensors in place (torch's load balancer) inside the context,
    where SDPA is ring attention; the model's attention is causal SDPA without a mask (hf/sequence.py, as
    accelerate's hooks). Loss items and tokens are counted on the whole batch, over the data-parallel ranks."""

    kind = "cp"

    def __init__(self, mesh: Any, size: int):
        self.mesh, self.size = mesh, size

    def shards(self, source: Any) -> Any:
        return Shards(source, self.shard)

    def shard(self, batch: dict) -> dict:
        """The whole batch, ready to be split: global position ids, labels shifted before the split, no padding
        mask (ring attention is causal only: pad on the right, labels -100); packed rows refused."""
        out = cut(batch, 0, 1, multiple=2 * self.size)  # the load balancer splits each sequence in 2 x cp_size
        out.pop("attention_mask", None)
        if (out["position_ids"].diff(dim=1) != 1).any():
            raise ValueError("parallelism_config.cp_size: ring attention cannot keep packed sequences apart (the "
                             "position ids restart inside a row); use sp_size, or unpacked rows")
        return out

    @contextlib.contextmanager
    def step(self, inputs: dict):
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        length = inputs["input_ids"].shape[1]
        tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length]
        buffers = list({id(v): v for v in tensors}.values())  # each split once (labels may be shift_labels itself)
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        with sdpa_kernel(kernels), context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
            yield


class Shards:
    """A training source whose batches go through `cut`; every other attribute (length, state, position) is the
    source's, so the loop counts and resumes it as the source."""

    def __init__(self, source: Any, cut: Callable[[dict], dict]):
        self.__dict__.update(source=source, cut=cut)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["source"], name)

    def __len__(self) -> int:
        return len(self.source)

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        return map(self.cut, self.source.iter_batches(epoch, start))


def cut(batch: dict, rank: int, size: int, multiple: int | None = None) -> dict:
    """Rank `rank`'s slice of a batch, as UlyssesSPDataLoaderAdapter cuts it: position ids of the whole sequence
    (made when missing: 0..L-1 per row), labels shifted before the cut (shift_labels, and labels the same, as HF's
    deepspeed_sp_compute_loss passes them), then every [batch, L, ...] tensor cut into `size` parts. `multiple`:
    what the length must be a multiple of (default `size`; context parallelism's is 2 x cp_size)."""
    field, multiple = ("sp_size", size) if multiple is None else ("cp_size", multiple)
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"parallelism_config.{field}: splitting sequences needs batches with 2-D input_ids "
                         f"(rows x tokens); got {sorted(batch)}")
    length = ids.shape[1]
    if length % multiple:
        raise ValueError(f"parallelism_config.{field}: {multiple} must divide every batch's sequence length, got "
                         f"{length}; pad batches to a multiple of it (the collator's pad_to_multiple_of, as HF)")
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape[1:2] == (length,) and "shift_labels" not in out:
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    if "shift_labels" in out:
        out["labels"] = out["shift_labels"]
    chunk = length // size
    part = slice(chunk * rank, chunk * (rank + 1))
    return {k: v[:, part].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length
            else v for k, v in out.items()}


def init_comm(device: torch.device) -> None:
    """deepspeed.comm over the process group already initialised (gloo on CPU, nccl on GPU)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed

    with _no_shm_kernel() if device.type == "cpu" else contextlib.nullcontext():
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl")


@contextlib.contextmanager
def _no_shm_kernel():
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce kernel the first
    time a node starts it (about a minute of C++ on 2 cores, both ranks waiting). Only its
    inference_all_reduce uses that kernel; training's collectives go through gloo, so it is skipped."""
    import importlib

    ds_comm = importlib.import_module("deepspeed.comm.torch")  # the package's `torch` attribute is torch itself
    build = ds_comm.build_shm_op
    ds_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm.build_shm_op = build
