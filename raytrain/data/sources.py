"""Data in: deterministic, sharded, resumable batches for one rank.

`build_source(data, batch_size, ...)` takes any accepted input and returns a *source*: `len()` (batches
per rank per epoch), `iter_batches(epoch, start)`, `state()`, `schema`, `num_samples`, `batch_size`,
`seed`, `world_size`, `wait_s` (seconds the consumer waited for data). Inputs:

- a dict of equal-length arrays / tensors, a `pyarrow.Table`, a torch map-style Dataset   -> MapSource
- a path, directory, glob or list of them (Parquet, CSV, JSON lines), or `Files(...)`      -> MapSource
  when the data fits `Files.in_memory_bytes` (from file metadata / file sizes), else StreamSource
- a `ray.data.Dataset` (its `map_batches` stages run as Ray tasks/actors), `RayData(ds, ...)`, or a
  `ray.data.DataIterator` over a whole dataset: run once, in order, by Ray Data, beside
  training when its row count (or max_steps) and spare CPUs allow, else before it (data_ray.py) -> StreamSource

MapSource (data in memory): an epoch's order is a seeded permutation of all rows (seed, epoch); it is
cut into global batches of `batch_size * world_size` and rank r takes the r-th of `world_size`
near-equal contiguous parts of each. StreamSource (data_stream.py, larger than memory): blocks (Parquet
row groups, CSV/JSON files, Ray Data blocks) in a seeded order, each rank a contiguous range of that
stream, shuffled within windows; each rank reads only its own range.

Sharding rule, both sources: every rank takes the same number of batches, of the same sizes, and each
epoch every sample is seen exactly once across ranks. The tail: with drop_last the incomplete global
batch is dropped (on every rank alike); without it, a final global batch of `rest` samples becomes one
more batch if rest >= world_size, and otherwise (some rank would get an empty batch) joins the previous
global batch, so a rank's last batch may be one sample larger. Fewer samples than ranks is an error.

Resume. The position is (epoch, batch index); `iter_batches(epoch, start)` jumps there by arithmetic:
MapSource slices the permutation, StreamSource finds the window from block row counts and reads that
window only. Nothing consumed is read again. On another world size or batch size, MapSource continues
at the same sample position of the same order (the partial global batch is seen again, as HF);
StreamSource.resume_at lays out exactly the rows the saved epoch had left for the new ranks.

Ray Train. launch.py starts Ray Data on the trainer's ray Datasets on the driver (data_ray.blocks_for_workers)
and hands every worker the stream (block references as Ray Data publishes them); each worker then
reads its share from the object store.
Users who run TorchTrainer themselves pass Ray Datasets unsplit, in order::

    datasets, data_config = trainer_datasets({"train": train_ds, "eval": eval_ds})
    TorchTrainer(loop_fn, datasets=datasets, dataset_config=data_config, ...)
    # in the worker: trainer.train_dataset = ray.train.get_dataset_shard("train")

(each worker then executes the whole dataset itself: prefer the Trainer's launch). Ray's own split
(streaming_split) hands blocks to whichever worker asks first and cannot resume mid-epoch (ray#48224):
a split shard is refused with an error naming the fix. Other inputs travel in the train-loop config as
they are (each worker calls build_source on it; files are read by each worker from shared storage).
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..args import ConfigError


class DataError(ConfigError):
    """Unusable data (missing, empty, lacking a column, mismatched): one line naming file or column."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data path that does not exist or matches no file."""


# ---------------------------------------------------------------- collation and loss items


def default_collate(items: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack a list of dict items (tensors, arrays or numbers) into a dict of batched tensors."""
    first = items[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"dataset items must be dicts of tensors (as in HF), got {type(first).__name__}")
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in first}


def count_items(batch: Mapping[str, torch.Tensor], ignore_index: int = -100) -> torch.Tensor | None:
    """The number of loss items in a batch: labels that are not ignore_index (kept on device)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if labels is None:
        return None
    if labels.is_floating_point():
        return torch.tensor(labels.shape[0], device=labels.device)
    return (labels != ignore_index).sum()


# ---------------------------------------------------------------- the sharding rule


def plan_epoch(num_samples: int, batch_size: int, world_size: int, drop_last: bool, name: str = "dataset"):
    """(batches per rank, samples used per epoch) under the sharding rule in the module docstring."""
    gb = batch_size * world_size
    full, rest = divmod(num_samples, gb)
    if drop_last:
        if full == 0:
            raise DataError(f"{name}: {num_samples} samples are fewer than one global batch ({batch_size} per "
                            f"rank x {world_size} ranks) with dataloader_drop_last; lower the batch size")
        return full, full * gb
    if rest == 0 or rest >= world_size:
        return full + (rest > 0), num_samples
    if full == 0:
        raise DataError(f"{name}: {num_samples} samples are fewer than the {world_size} ranks; every rank "
                        "needs at least one sample per step")
    return full, num_samples  # the rest (< world_size samples) joins the last full global batch


def rank_span(batch: int, num_batches: int, used: int, batch_size: int, world_size: int, rank: int):
    """[lo, hi): the positions in the epoch's order that `rank` takes for `batch`."""
    start = batch * batch_size * world_size
    end = used if batch == num_batches - 1 else start + batch_size * world_size
    q, r = divmod(end - start, world_size)
    lo = start + rank * q + min(rank, r)
    return lo, lo + q + (rank < r)


def _rng(*keys: int) -> np.random.Generator:
    """A generator seeded by a tuple of ints (seed, epoch, ...): distinct tuples, independent streams."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in keys])))


# ---------------------------------------------------------------- columns in memory


class Columns:
    """Equal-length columns in memory: numeric ones as tensors (gathered by index), others as numpy."""

    def __init__(self, columns: Mapping[str, Any], name: str = "dataset", where: str = "dict of arrays"):
        if not columns:
            raise DataError(f"{name} ({where}): it has no columns")
        self.where = where
        self.columns = {k: _as_column(v, k, name) for k, v in columns.items()}
        lengths = {k: len(v) for k, v in self.columns.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"{name} ({where}): columns have different lengths {lengths}")
        self.n = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in self.columns.items()}

    def take(self, idx: torch.Tensor) -> dict[str, Any]:
        return {k: v[idx] if isinstance(v, torch.Tensor) else list(v[idx.numpy()]) for k, v in self.columns.items()}

    def rows(self, idx: torch.Tensor) -> list[dict[str, Any]]:
        cols = self.take(idx)
        return [{k: v[j] for k, v in cols.items()} for j in range(len(idx))]

    def select(self, names: Sequence[str]) -> Columns:
        out = object.__new__(Columns)
        out.where, out.n = self.where, self.n
        out.columns = {k: v for k, v in self.columns.items() if k in names}
        return out

    @property
    def schema(self) -> dict[str, tuple[str, tuple | None]]:
        return {k: _column_type(v) for k, v in self.columns.items()}


def _as_column(v: Any, key: str, name: str):
    if isinstance(v, torch.Tensor):
        return v
    arr = v if isinstance(v, np.ndarray) else _asarray(v)
    if arr.dtype.kind in "biuf" or arr.dtype == np.bool_:
        return torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr))
    if arr.dtype.kind == "c":
        raise DataError(f"{name}: column {key!r} is complex ({arr.dtype}); not supported")
    return arr  # strings and ragged rows stay numpy objects: a data_collator turns them into tensors


def _asarray(v) -> np.ndarray:
    try:
        return np.asarray(v)
    except ValueError:  # ragged rows: an object array of rows
        out = np.empty(len(v), dtype=object)
        out[:] = [np.asarray(x) for x in v]
        return out


def _column_type(v) -> tuple[str, tuple | None]:
    if isinstance(v, torch.Tensor):
        return str(v.dtype).replace("torch.", ""), tuple(v.shape[1:])
    return "object", None


# ---------------------------------------------------------------- prefetching and wait accounting


def _timed(source, batches: Iterator, prefetch: int) -> Iterator:
    """Yield from `batches`, `prefetch` ahead in a background thread; add the consumer's wait to wait_s."""
    if prefetch <= 0:
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(batches)
                except StopIteration:
                    return
                finally:
                    _waited(source, time.perf_counter() - t0)
                yield item
        finally:
            _close(batches)
    q: queue.Queue = queue.Queue(prefetch)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in batches:
                if not put(("batch", item)):
                    return
            put(("end", None))
        except BaseException as e:  # handed to the consumer, raised in its thread
            put(("error", e))
        finally:
            _close(batches)

    thread = threading.Thread(target=work, name="raytrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            kind, item = q.get()
            _waited(source, time.perf_counter() - t0)
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _waited(source, seconds: float) -> None:
    """Add to the source's wait; the first batch's (start-up: files opened, Ray Data started) also apart."""
    source.wait_s += seconds
    if getattr(source, "first_wait_s", None) is None:
        source.first_wait_s = seconds


def _close(gen) -> None:
    close = getattr(gen, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------- in-memory source


def as_dataset(data: Any, name: str = "dataset"):
    """A dict of arrays or a pyarrow Table as Columns; a torch map-style Dataset as it is."""
    if isinstance(data, Columns):
        return data
    if isinstance(data, Mapping):
        return Columns(data, name)
    if _is_arrow_table(data):
        from .files import table_to_numpy
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

    def __len__(self) -> int:
        return self._num_batches

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.from_numpy(_rng(self.seed, epoch).permutation(self.num_samples))

    def batch_indices(self, epoch: int, batch: int, order: torch.Tensor | None = None) -> torch.Tensor:
        order = self.order(epoch) if order is None else order
        lo, hi = rank_span(batch, self._num_batches, self._used, self.batch_size, self.world_size, self.rank)
        return order[lo:hi]

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `epoch` from batch index `start` on: the skip is an index, not a replay."""
        order = self.order(epoch)
        gen = (self._fetch(self.batch_indices(epoch, b, order)) for b in range(start, self._num_batches))
        return _timed(self, gen, self.prefetch_batches)

    def _fetch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
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
        return self._fetch(torch.arange(min(self.batch_size, self.num_samples)))

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
        return {"kind": self.kind, "num_samples": self.num_samples, "batch_size": self.batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last}


# ---------------------------------------------------------------- inputs and the one entry point


@dataclass
class Files:
    """Files as a dataset: Parquet, CSV or JSON lines, with how to read them.

    path: a file, directory, glob, or a list of them (sorted, so the file order is fixed).
    preprocess: fn(dict of numpy arrays) -> dict of numpy arrays, one output row per input row (the
      contract of Ray Data's map_batches(fn, batch_format="numpy")), applied to each block as read.
    stream: None picks by size: in memory (global shuffle) when the uncompressed size in the file
      metadata is at most in_memory_bytes, else streamed (Parquet only). The choice depends only on
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


def build_source(data: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1, collate_fn: Callable | None = None,
                 columns: Sequence[str] | ModelInputs | None = None, prefetch_batches: int | None = None,
                 name: str = "dataset", length_optional: bool = False):
    """A source for `data` (any accepted input), checked against `columns` before any training.

    length_optional: the caller needs no epoch length (training with max_steps, as HF requires for data
    without one): a ray Dataset Ray cannot count without running it then streams beside training.

    columns: the names the model (or collator) needs: a list (all required), or `model_inputs(model)`
    (required arguments must be present; without a collate_fn, columns forward() does not take are
    dropped, as HF's remove_unused_columns does).
    """
    kw = dict(seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank, world_size=world_size,
              collate_fn=collate_fn, name=name)
    if isinstance(data, (str, Files)) or _is_path_list(data):
        from .files import files_source
        spec = data if isinstance(data, Files) else Files(data)
        wanted = _projection(columns) if collate_fn is None else None
        source = files_source(spec, batch_size, columns=wanted, prefetch_batches=prefetch_batches, **kw)
    elif _is_ray(data) or type(data).__name__ in ("RayData", "RayBlocks"):
        from .ray_data import ray_source
        source = ray_source(data, batch_size, prefetch_batches=prefetch_batches, length_optional=length_optional,
                            **kw)
    else:
        source = MapSource(data, batch_size, prefetch_batches=prefetch_batches or 0, **kw)
    check_columns(source, columns, collate_fn)
    return source


def _is_path_list(data) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(p, str) for p in data)


def _is_arrow_table(data) -> bool:
    return type(data).__module__.startswith("pyarrow") and hasattr(data, "schema") and hasattr(data, "num_rows")


def _is_ray(data) -> bool:
    return type(data).__module__.startswith("ray.data")


def trainer_datasets(datasets: Mapping[str, Any]):
    """Driver side, for TorchTrainer: (datasets, DataConfig) that hand every worker all rows, in order.

    Only ray.data Datasets go through `datasets=`; other inputs travel in the train-loop config.
    """
    from ray.data import ExecutionOptions
    from ray.train import DataConfig
    ray_ds = {k: v for k, v in datasets.items() if v is not None and _is_ray(v)}
    return ray_ds, DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))


# ---------------------------------------------------------------- checks at the edge


@dataclass(frozen=True)
class ModelInputs:
    """What a model's forward takes: required names, and all accepted names (None: it takes **kwargs)."""

    required: tuple[str, ...]
    accepted: tuple[str, ...] | None
    owner: str


_NOT_DATA = {"self", "num_items_in_batch", "return_dict", "output_attentions", "output_hidden_states"}


def model_inputs(model: Any, training: bool = True) -> ModelInputs | None:
    """The batch keys `model.forward` needs; with `training` and a `labels` argument, labels too."""
    from ..strategies.base import unwrap_model

    fwd = unwrap_model(model)
    try:
        params = inspect.signature(fwd.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return None
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in _NOT_DATA]
    required = [p.name for p in named if p.default is p.empty]
    if training and "labels" in params and "labels" not in required:
        required.append("labels")
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    owner = f"{type(fwd).__name__}.forward({', '.join(p.name for p in named)})"
    accepted = tuple(dict.fromkeys([p.name for p in named] + ["labels"]))  # compute_loss_func takes labels
    return ModelInputs(tuple(required), None if var_kw else accepted, owner)


def _projection(columns) -> list[str] | None:
    if isinstance(columns, ModelInputs):
        return list(columns.accepted) if columns.accepted is not None else None
    return None


def check_columns(source, columns, collate_fn) -> None:
    """Required columns present (in the raw data, or in the collator's batch); unused ones dropped."""
    if columns is None:
        return
    inputs = columns if isinstance(columns, ModelInputs) else ModelInputs(tuple(columns), None, "the columns list")
    raw = source.raw_columns()
    if raw is None:  # a torch Dataset: its first item (or collated batch) is checked as it is first read
        what = "the collated batch" if collate_fn is not None else "its items"
        source.first_batch_check = lambda got: _require(source, inputs, list(got) if isinstance(got, Mapping)
                                                        else [], what)
        return
    if collate_fn is None and raw is not None:
        _require(source, inputs, raw, "the data")
        if inputs.accepted is not None:
            keep = [c for c in raw if c in inputs.accepted]
            if not keep:
                raise DataError(f"{source.name} ({source.where}): none of its columns {raw} is an argument of "
                                f"{inputs.owner}")
            source.select(keep)
        return
    if not isinstance(columns, ModelInputs) and raw is not None:
        _require(source, inputs, raw, "the data")  # an explicit list names what the collator reads
    try:
        sample = source.sample_batch()
    except KeyError as e:
        key = e.args[0] if e.args else "?"
        raise DataError(f"{source.name} ({source.where}): column {key!r} needed by the data_collator is missing; "
                        f"the data has {raw}") from None
    if isinstance(sample, Mapping) and isinstance(columns, ModelInputs):
        _require(source, inputs, list(sample), "the collated batch")


def _require(source, inputs: ModelInputs, have: list[str], what: str) -> None:
    for c in inputs.required:
        if c not in have:
            raise DataError(f"{source.name} ({source.where}): column {c!r} is missing from {what}; {inputs.owner} "
                            f"needs it; {what} has {sorted(have)}")


def check_same_schema(train, other, other_name: str = "eval_dataset") -> None:
    """`other`'s columns, dtypes and row shapes must match train's (the model sees both)."""
    a, b = train.schema, other.schema
    if a is None or b is None:  # a torch Dataset: items are not read ahead to learn their schema
        return
    where = f"{other_name} ({other.where})"
    for col, (dtype, shape) in a.items():
        if col not in b:
            raise DataError(f"{where}: column {col!r} is missing; {train.name} has it ({dtype})")
        dtype2, shape2 = b[col]
        if dtype2 != dtype or (shape is not None and shape2 is not None and shape2 != shape):
            raise DataError(f"{where}: column {col!r} is {dtype2} {list(shape2 or [])} here but {dtype} "
                            f"{list(shape or [])} in {train.name}")
    extra = [c for c in b if c not in a]
    if extra:
        raise DataError(f"{where}: column {extra[0]!r} is not in {train.name} (which has {sorted(a)})")


def cached_source(cache: dict, data: Any, batch_size: int, **kw):
    """build_source, once per (dataset, settings): evaluation reuses the source it built before."""
    key = (id(data), batch_size, tuple(sorted((k, v if _hashable(v) else id(v)) for k, v in kw.items())))
    hit = cache.get(key)
    if hit is None or hit[0] is not data:
        hit = cache[key] = (data, build_source(data, batch_size, **kw))
    return hit[1]


def _hashable(v) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


def is_named_datasets(data) -> bool:
    """A dict of named datasets (HF's multiple eval sets), not a dict of columns: no value is array-like."""
    return isinstance(data, dict) and bool(data) and not any(
        isinstance(v, (np.ndarray, torch.Tensor, list, tuple)) or type(v).__module__.startswith("pyarrow")
        for v in data.values())
