"""Data in: deterministic, sharded, resumable batches for one rank.

`build_source(data, batch_size, ...)` takes any accepted input and returns a *source*: `len()` (batches
per rank per epoch), `iter_batches(epoch, start)`, `state()`, `schema`, `num_samples`, `batch_size`,
`seed`, `world_size`, `wait_s` (seconds the consumer waited for data). Inputs:

- a dict of equal-length arrays / tensors, a `pyarrow.Table`, a torch map-style Dataset   -> MapSource
- a path, directory, glob or list of them (Parquet, CSV, JSON lines), or `Files(...)`      -> MapSource
  when the data fits `Files.in_memory_bytes` (from file metadata / file sizes), else StreamSource
- a `ray.data.Dataset` (its `map_batches` stages run as Ray tasks/actors), `RayData(ds, ...)`, or a
  `ray.data.DataIterator` over a whole dataset: run once, in order, by Ray Data, beside
  training when its row count (or max_steps) and spare CPUs allow, else before it (ray_data.py) -> StreamSource

MapSource (sources.py, data in memory): an epoch's order is a seeded permutation of all rows (seed, epoch);
it is cut into global batches of `batch_size * world_size` and rank r takes the r-th of `world_size`
near-equal contiguous parts of each. StreamSource (stream.py, larger than memory): blocks (Parquet
row groups, CSV/JSON files, Ray Data blocks) in a seeded order, each rank a contiguous range of that
stream, shuffled within windows; each rank reads only its own range.

Both follow one sharding rule (sharding.py): every rank takes the same number of batches, of the
same sizes, and each epoch every sample is seen exactly once across ranks.

Resume. The position is (epoch, batch index); `iter_batches(epoch, start)` jumps there by arithmetic:
MapSource slices the permutation, StreamSource finds the window from block row counts and reads that
window only. Nothing consumed is read again. On another world size or batch size, MapSource continues
at the same sample position of the same order (the partial global batch is seen again, as HF);
StreamSource.resume_at lays out exactly the rows the saved epoch had left for the new ranks.

Ray Train. launch.py starts Ray Data on the trainer's ray Datasets on the driver (blocks_for_workers)
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
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .errors import DataError
from .files import files_source
from .ray_data import RayBlocks, RayData, is_ray_dataset, ray_source, start
from .sources import Files, MapSource


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
        spec = data if isinstance(data, Files) else Files(data)
        wanted = _projection(columns) if collate_fn is None else None
        source = files_source(spec, batch_size, columns=wanted, prefetch_batches=prefetch_batches, **kw)
    elif is_ray_dataset(data) or isinstance(data, (RayData, RayBlocks)):
        source = ray_source(data, batch_size, prefetch_batches=prefetch_batches, length_optional=length_optional,
                            **kw)
    else:
        source = MapSource(data, batch_size, prefetch_batches=prefetch_batches or 0, **kw)
    check_columns(source, columns, collate_fn)
    return source


def _is_path_list(data) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(p, str) for p in data)


def trainer_datasets(datasets: Mapping[str, Any]):
    """Driver side, for TorchTrainer: (datasets, DataConfig) that hand every worker all rows, in order.

    Only ray.data Datasets go through `datasets=`; other inputs travel in the train-loop config.
    """
    from ray.data import ExecutionOptions
    from ray.train import DataConfig
    ray_ds = {k: v for k, v in datasets.items() if v is not None and is_ray_dataset(v)}
    return ray_ds, DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))


def blocks_for_workers(trainer, scaling=None) -> dict[str, RayBlocks]:
    """Driver side: start Ray Data on the trainer's ray Datasets and hand every worker the same blocks
    (launch.py passes them in the train-loop config). Beside training when the cluster's CPUs cover the
    training workers (`scaling`, a ScalingConfig) and the data's stages, and the row count is known
    without executing or (the train set, max_steps set) need not be; else executed first."""
    import ray
    spare = None
    if scaling is not None:
        spare = ray.cluster_resources().get("CPU", 0) - scaling.total_resources.get("CPU", 0)
    out = {}
    for key in ("train_dataset", "eval_dataset"):
        value = getattr(trainer, key, None)
        if value is not None and (is_ray_dataset(value) or isinstance(value, RayData)):
            out[key] = start(value, key, spare_cpus=spare, remote=True,
                             length_optional=key == "train_dataset" and trainer.args.max_steps > 0)
    return out


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
    from ..hf.objects import forward_owner

    fwd = forward_owner(model)
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
