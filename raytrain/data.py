"""Data in: deterministic, sharded, resumable batches.

The batches a rank sees in an epoch are a function of (seed, epoch, rank, world size) only: each
epoch's order is a seeded permutation, cut into global batches of `batch_size * world_size`, each
split across ranks. A position (epoch, batches consumed) is therefore enough to continue the
stream, and jumping there costs nothing: no consumed batch is read again.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch


def default_collate(items: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack a list of dict items (tensors, arrays or numbers) into a dict of batched tensors."""
    first = items[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"dataset items must be dicts of tensors (as in HF), got {type(first).__name__}")
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in first}


class _ColumnDataset:
    """A dict of equal-length arrays or tensors; batches are gathered with one index per column."""

    def __init__(self, columns: Mapping[str, Any]):
        if not columns:
            raise ValueError("dataset: the dict of columns is empty")
        self.columns = {k: torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v
                        for k, v in columns.items()}
        lengths = {k: len(v) for k, v in self.columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"dataset: columns have different lengths {lengths}")
        self.n = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self.n

    def take(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[idx] for k, v in self.columns.items()}


def as_dataset(data: Any):
    """Accept a torch map-style Dataset or a dict of arrays; anything else is an error."""
    if isinstance(data, Mapping):
        return _ColumnDataset(data)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return data
    raise TypeError(f"dataset: expected a map-style torch Dataset or a dict of arrays, got {type(data).__name__}")


class MapSource:
    """Batches of a map-style dataset for one rank, deterministic and seekable."""

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 collate_fn: Callable | None = None):
        self.dataset = as_dataset(dataset)
        self.num_samples = len(self.dataset)
        if self.num_samples == 0:
            raise ValueError("dataset: it is empty")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.collate_fn = collate_fn
        global_batch = batch_size * world_size
        full, rest = divmod(self.num_samples, global_batch)
        self._num_batches = full if drop_last or rest == 0 else full + 1
        if self._num_batches == 0:
            raise ValueError(f"dataset: {self.num_samples} samples are fewer than one global batch "
                             f"({global_batch}) with dataloader_drop_last")

    def __len__(self) -> int:
        return self._num_batches

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def batch_indices(self, epoch: int, batch: int, order: torch.Tensor | None = None) -> torch.Tensor:
        order = self.order(epoch) if order is None else order
        gb = self.batch_size * self.world_size
        chunk = order[batch * gb:(batch + 1) * gb]
        return torch.tensor_split(chunk, self.world_size)[self.rank]

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `epoch` from batch index `start` on: the skip is an index, not a replay."""
        order = self.order(epoch)
        for b in range(start, self._num_batches):
            yield self._fetch(self.batch_indices(epoch, b, order))

    def _fetch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        if isinstance(self.dataset, _ColumnDataset) and self.collate_fn is None:
            return self.dataset.take(idx)
        items = [self.dataset[i] for i in idx.tolist()]
        return (self.collate_fn or default_collate)(items)

    def state(self) -> dict:
        return {"num_samples": self.num_samples, "batch_size": self.batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last}


def count_items(batch: Mapping[str, torch.Tensor], ignore_index: int = -100) -> torch.Tensor | None:
    """The number of loss items in a batch: labels that are not ignore_index (kept on device)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if labels is None:
        return None
    if labels.is_floating_point():
        return torch.tensor(labels.shape[0], device=labels.device)
    return (labels != ignore_index).sum()
