"""In-memory data: MapSource, and Files, the spec of files as a dataset.

MapSource: an epoch's order is a seeded permutation of all rows (seed, epoch); it is cut into global
batches of `batch_size * world_size` and rank r takes the r-th of `world_size` near-equal contiguous
parts of each (sharding.py). Resume jumps to (epoch, batch index) by slicing the permutation; on
another world size or batch size it continues at the same sample position of the same order (the
partial global batch is seen again, as HF).

data_order "hf" (TrainingArguments.data_order, set by hf_order): the epoch's order is HF's instead,
torch.randperm under a generator seeded with seed + epoch (accelerate's SeedableRandomSampler); it is
cut and resumed as above. As torch's DataLoader, each epoch's start draws one number from torch's global
generator, so that dropout and NEFTune noise draw HF's random numbers too.

A sampler's order (sampler_order: a Trainer's own `_get_train_sampler`, e.g. TRL's RepeatSampler): the epoch's
order is the sampler's pass for that epoch (pass e + 1 of the sampler as built, as one DataLoader iterated once per
epoch gives it; indices may repeat), cut and resumed as above; each epoch's start draws torch's DataLoader seed.

group_by_length (group_by_length): the epoch's order (either one) is then grouped as HF's LengthGroupedSampler
groups its permutation: megabatches sorted by length, longest first; cut, sharded and resumed as above.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .columns import Columns, default_collate, table_to_numpy
from .errors import DataError
from .prefetch import timed_batches
from .sharding import plan_epoch, rank_span, seeded_rng


def as_dataset(data: Any, name: str = "dataset"):
    """A dict of arrays or a pyarrow Table as Columns; a torch map-style Dataset as it is."""
    if isinstance(data, Columns):
        return data
    if isinstance(data, Mapping):
        return Columns(data, name)
    if _is_arrow_table(data):
        return Columns(table_to_numpy(data, name, "pyarrow Table"), name, "pyarrow Table")
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return data
    raise DataError(f"{name}: expected a dict of arrays, a pyarrow Table, a torch map-style Dataset, a ray.data "
                    f"Dataset or a path/glob of Parquet, CSV or JSON-lines files; got {type(data).__name__}")


class MapSource:
    """Batches of an in-memory dataset for one rank: a seeded global shuffle per epoch, seekable."""

    kind = "map"

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 collate_fn: Callable | None = None, prefetch_batches: int = 0, name: str = "dataset"):
        self.dataset = as_dataset(dataset, name)
        self.num_samples = len(self.dataset)
        self.name = name
        where = getattr(self.dataset, "where", type(self.dataset).__name__)
        if self.num_samples == 0:
            raise DataError(f"{name} ({where}): the dataset is empty (0 samples)")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.collate_fn, self.prefetch_batches = collate_fn, prefetch_batches
        self._num_batches, self._used = plan_epoch(self.num_samples, batch_size, world_size, drop_last, name)
        self.wait_s = 0.0
        self.all_columns: list[str] | None = None  # the file's columns, when it was read projected
        self.first_batch_check: Callable | None = None  # items of a torch Dataset are checked as first read
        self.data_order = "raytrain"  # "hf": HF's sampler order (hf_order)
        self.lengths: np.ndarray | None = None  # each sample's length, when grouped by it (group_by_length)
        self.length_batch = 0  # HF's batch_size of LengthGroupedSampler: a megabatch is 50 (at most) of them
        self.sampler: Any = None  # a torch Sampler giving the order (sampler_order)
        self._sampled: tuple[int, torch.Tensor] | None = None  # (epoch, its order): a pass is replayed once
        self._positions: list[torch.Tensor] | None = None  # accelerate's even batches: each batch's order positions

    def __len__(self) -> int:
        return self._num_batches

    def order(self, epoch: int) -> torch.Tensor:
        if self.sampler is not None:
            return self._sampler_pass(epoch)
        if not self.shuffle:
            return torch.arange(self.num_samples)
        if self.data_order == "hf":  # RandomSampler.__iter__ under SeedableRandomSampler's seeding
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.from_numpy(seeded_rng(self.seed, epoch).permutation(self.num_samples))
        return order if self.lengths is None else length_grouped(order, self.lengths, self.length_batch)

    def _sampler_pass(self, epoch: int) -> torch.Tensor:
        if self._sampled is None or self._sampled[0] != epoch:
            sampler = copy.copy(self.sampler)  # its generator as it was built: passes 0..epoch replayed
            if isinstance(getattr(sampler, "generator", None), torch.Generator):
                sampler.generator = torch.Generator().set_state(self.sampler.generator.get_state())
            for _ in range(epoch):
                for _ in sampler:
                    pass
            self._sampled = (epoch, torch.tensor(list(sampler), dtype=torch.long))
        return self._sampled[1]

    def batch_indices(self, epoch: int, batch: int, order: torch.Tensor | None = None) -> torch.Tensor:
        order = self.order(epoch) if order is None else order
        if self._positions is not None:
            return order[self._positions[batch]]
        lo, hi = rank_span(batch, self._num_batches, self._used, self.batch_size, self.world_size, self.rank)
        return order[lo:hi]

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `epoch` from batch index `start` on: the skip is an index, not a replay."""
        if self.data_order in ("hf", "sampler") and start == 0:  # as torch's DataLoader draws its base seed from the global
            torch.empty((), dtype=torch.int64).random_()  # generator: HF's random stream (dropout, NEFTune)
        order = self.order(epoch)
        gen = (self.fetch(self.batch_indices(epoch, b, order)) for b in range(start, self._num_batches))
        return timed_batches(self, gen, self.prefetch_batches)

    def fetch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch of rows `idx`, collated (also what DataLoader workers call: loaders.WorkerPool)."""
        if isinstance(self.dataset, Columns):
            return self.dataset.take(idx) if self.collate_fn is None else self.collate_fn(self.dataset.rows(idx))
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(idx.tolist()) if getitems is not None else [self.dataset[i] for i in idx.tolist()]
        batch = (self.collate_fn or default_collate)(items)
        check, self.first_batch_check = self.first_batch_check, None
        if check is not None:
            check(batch if self.collate_fn is not None else items[0])
        return batch

    def sample_batch(self) -> dict[str, Any]:
        """The first rows, collated: what the model would see (for checks before training)."""
        return self.fetch(torch.arange(min(self.batch_size, self.num_samples)))

    def raw_columns(self) -> list[str] | None:
        """The data's column names; None for a torch Dataset (known only once an item is read)."""
        if self.all_columns is not None:
            return list(self.all_columns)
        return list(self.dataset.columns) if isinstance(self.dataset, Columns) else None

    def select(self, names: Sequence[str]) -> None:
        if isinstance(self.dataset, Columns):
            self.dataset = self.dataset.select(names)

    @property
    def where(self) -> str:
        return getattr(self.dataset, "where", type(self.dataset).__name__)

    @property
    def schema(self) -> dict[str, tuple[str, tuple | None]] | None:
        """{column: (dtype, row shape)}; None for a torch Dataset, whose items are never read ahead."""
        return self.dataset.schema if isinstance(self.dataset, Columns) else None

    def state(self) -> dict:
        state = {"kind": self.kind, "num_samples": self.num_samples, "batch_size": self.batch_size,
                 "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                 "drop_last": self.drop_last}
        if self.data_order != "raytrain":  # the default's data_state.json stays as it was
            state["data_order"] = self.data_order
        if self.lengths is not None:
            state["group_by_length"] = self.length_batch
        if self.sampler is not None:
            state["sampler"] = type(self.sampler).__name__
        return state


def hf_order(source: Any, even_batches: bool = True, split_batches: bool = False) -> None:
    """Give a shuffled map-style source HF's order (data_order "hf"), split between several ranks as accelerate's
    BatchSamplerShard splits it: an epoch ending in a partial global batch is filled with samples from the start
    of its order (even_batches; false, the ranks would take different numbers of batches: refused). A stream has
    no index order to permute."""
    if not isinstance(source, MapSource):
        raise DataError(f"data_order='hf': {source.name} ({source.where}) is streamed, and HF's sampler permutes "
                        "the rows of an in-memory dataset; pass the data in memory (Files(..., stream=False)) "
                        "or set data_order='raytrain'")
    source.data_order = "hf"
    gb = source.batch_size * source.world_size
    if source.world_size == 1 or source.drop_last or source.num_samples % gb == 0:
        return
    if not even_batches:
        raise DataError(uneven_message(source))
    from accelerate.data_loader import BatchSamplerShard  # accelerate's own split, on the order's positions
    from torch.utils.data import BatchSampler

    batches = BatchSampler(range(source.num_samples), gb if split_batches else source.batch_size, False)
    source._positions = [torch.tensor(b) for b in BatchSamplerShard(
        batches, source.world_size, source.rank, split_batches=split_batches, even_batches=True)]
    source._num_batches = len(source._positions)


def uneven_message(source: Any) -> str:
    gb = source.batch_size * source.world_size
    return (f"accelerator_config.even_batches: false leaves {source.name}'s last partial global batch "
            f"({source.num_samples % gb} of {gb} samples) to some ranks only, which would then take more steps "
            "than the others; leave it true, or set dataloader_drop_last")


def sampler_order(source: Any, sampler: Any) -> None:
    """Give a map-style source `sampler`'s order (its passes, one per epoch), and HF's DataLoader seed draws. The
    sampler is replayed from its state now: its randomness must be a `generator` attribute (torch.Generator)."""
    if not isinstance(source, MapSource):
        raise DataError(f"{source.name} ({source.where}): a sampler orders the rows of an in-memory dataset; this one "
                        "is streamed; pass the data in memory (a datasets.Dataset, or Files(..., stream=False))")
    source.sampler = copy.copy(sampler)
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        source.sampler.generator = torch.Generator().set_state(sampler.generator.get_state())
    source.num_samples = len(sampler)
    source._num_batches, source._used = plan_epoch(source.num_samples, source.batch_size, source.world_size,
                                                   source.drop_last, source.name)
    source.data_order = "sampler"


def group_by_length(source: Any, batch_size: int, length_column: str = "length",
                    input_name: str = "input_ids") -> None:
    """Group a shuffled map-style source's order by sample length, as HF's LengthGroupedSampler(batch_size)
    does: lengths from the `length_column` column if the data has one, else len(item[input_name])."""
    if not isinstance(source, MapSource):
        raise DataError(f"group_by_length: {source.name} ({source.where}) is streamed, and grouping by length "
                        "sorts samples across the whole dataset; pass the data in memory (Files(..., stream=False)) "
                        "or set group_by_length=False")
    source.lengths = sample_lengths(source.dataset, length_column, input_name, source.name)
    source.length_batch = batch_size


def sample_lengths(dataset: Any, length_column: str, input_name: str, name: str = "dataset") -> np.ndarray:
    """Each sample's length: its `length_column` value, else len(item[input_name]) (HF's rule)."""
    columns = dataset.columns if isinstance(dataset, Columns) else {}
    names = list(columns) or list(getattr(dataset, "column_names", None) or [])
    if length_column in names:
        values = columns[length_column] if columns else dataset[length_column]
        return np.asarray(values.tolist() if hasattr(values, "tolist") else list(values))
    if input_name in columns:
        col = columns[input_name]
        return np.full(len(col), col.shape[1]) if isinstance(col, torch.Tensor) else np.array([len(r) for r in col])
    if input_name in names:  # a datasets.Dataset: its column, without decoding every row
        return np.array([len(r) for r in dataset[input_name]])
    first = dataset[0] if len(dataset) else None
    if not isinstance(first, Mapping) or input_name not in first:
        raise DataError(f"group_by_length: {name}'s samples have no {input_name!r} to measure and no {length_column!r} "
                        "column (length_column_name); add a length column or set group_by_length=False")
    return np.array([len(dataset[i][input_name]) for i in range(len(dataset))])


def length_grouped(order: torch.Tensor, lengths: np.ndarray, batch_size: int) -> torch.Tensor:
    """HF's get_length_grouped_indices applied to the permutation `order`: megabatches of
    min(n // (4 * batch_size), 50) (at least 1) batches, each sorted by length, longest first (stable);
    the longest sample of all is swapped to the front of the first megabatch."""
    n = len(order)
    size = max(min(n // (batch_size * 4), 50), 1) * batch_size
    perm = order.numpy()
    key = -lengths.astype(np.float64 if lengths.dtype.kind == "f" else np.int64)
    megabatches = [mb[np.argsort(key[mb], kind="stable")] for mb in (perm[i:i + size] for i in range(0, n, size))]
    k = int(np.argmax([lengths[mb[0]] for mb in megabatches]))  # the first maximum, as torch.argmax
    megabatches[0][0], megabatches[k][0] = megabatches[k][0], megabatches[0][0]
    return torch.from_numpy(np.concatenate(megabatches))


@dataclass
class Files:
    """Files as a dataset: Parquet, CSV or JSON lines, with how to read them.

    path: a file, directory, glob, or a list of them (sorted, so the file order is fixed).
    preprocess: fn(dict of numpy arrays) -> dict of numpy arrays, one output row per input row (the
      contract of Ray Data's map_batches(fn, batch_format="numpy")), applied to each block as read.
    stream: None picks by size: in memory (global shuffle) when the uncompressed size in the file
      metadata is at most in_memory_bytes, else streamed. The choice depends only on
      the data and these settings, so a resumed run picks the same.
    buffer_bytes: a stream's shuffle window, in bytes of uncompressed rows (memory ~ 2 windows).
    prefetch_batches: windows are always loaded one ahead in a background thread (reading, decoding
      and preprocess); > 0 also assembles (and collates) that many batches ahead in another thread,
      which pays only for a slow collate_fn: a thread hand-off costs more than gathering a batch.
    """

    path: str | Sequence[str]
    format: str | None = None
    preprocess: Callable[[dict], dict] | None = None
    stream: bool | None = None
    in_memory_bytes: int = 1 << 30
    buffer_bytes: int = 64 << 20
    prefetch_batches: int = 0

    def __post_init__(self):
        # Absolute at creation (on the driver): Ray Train runs workers in another working directory.
        absolute = lambda p: os.path.abspath(os.path.expanduser(p)) if "://" not in p else p  # noqa: E731
        self.path = absolute(self.path) if isinstance(self.path, str) else [absolute(p) for p in self.path]


def _is_arrow_table(data) -> bool:
    return type(data).__module__.startswith("pyarrow") and hasattr(data, "schema") and hasattr(data, "num_rows")
