"""Sources beyond build_source's inputs, and the Trainer's one entry point for data (build_loader).

- IterableSource: a torch IterableDataset (or a streaming `datasets.IterableDataset`). Items are cut
  into global batches of batch_size * world_size in stream order; rank r takes the r-th part of
  each, so ranks never see the same item and all take the same number of steps (a final global batch
  with fewer items than ranks is dropped). The length is unknown: training needs max_steps, and an
  epoch ends when the stream does. Resume replays the stream up to the saved batch (cost grows with
  the position, unlike map-style data whose resume is O(1)).
- LoaderSource: any iterable of ready batches, e.g. a torch DataLoader from an overridden
  get_train_dataloader; resume replays it likewise.
- WorkerPool: dataloader_num_workers > 0 for map-style data: batches are read and collated by
  torch DataLoader worker processes, in order, from the same (seed, epoch, rank) index plan, so
  the batches and the resume position are the same as with no workers.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterator

import torch

from ..hf import accelerate_config, objects as hf
from .build import build_source
from .columns import default_collate
from .errors import DataError
from .prefetch import timed_batches
from .sources import MapSource, group_by_length, hf_order, sampler_order, uneven_message

logger = logging.getLogger(__name__)


def build_loader(data: Any, batch_size: int, args: Any, **kw) -> Any:
    """The source of `data` for this rank: IterableSource for iterable datasets, else build_source
    (wrapped in a WorkerPool when args.dataloader_num_workers > 0). args.data_order "hf" gives shuffled
    map-style data HF's order; an iterable dataset is read in stream order either way, as HF reads it.
    grouped_by_length(args) groups shuffled map-style data by `input_name`'s length (HF's LengthGroupedSampler).
    `sampler` (a Trainer's own torch Sampler, e.g. TRL's RepeatSampler) gives the order instead."""
    input_name = kw.pop("input_name", "input_ids")
    sampler = kw.pop("sampler", None)
    if isinstance(data, torch.utils.data.IterableDataset):
        if kw.get("shuffle", True) and grouped_by_length(args):
            logger.warning("group_by_length is ignored for %s: an iterable dataset is read in its own order (as HF)",
                           kw["name"])
        return IterableSource(data, batch_size, rank=kw["rank"], world_size=kw["world_size"],
                              collate_fn=kw["collate_fn"], drop_last=kw["drop_last"], seed=kw["seed"],
                              name=kw["name"])
    # training for max_steps needs no epoch length: a ray Dataset of unknown count streams beside (ray_data.py)
    length_optional = kw.get("name") == "train_dataset" and getattr(args, "max_steps", 0) > 0
    source = build_source(data, batch_size, length_optional=length_optional, **kw)
    accel = accelerate_config.settings(getattr(args, "accelerator_config", None))
    if kw.get("shuffle", True):
        _check_sampler(source, accel, getattr(args, "data_order", "raytrain"), sampler is not None)
    if sampler is not None:
        sampler_order(source, sampler)
    elif kw.get("shuffle", True) and getattr(args, "data_order", "raytrain") == "hf":
        hf_order(source, accel["even_batches"], accel["split_batches"])
    elif getattr(args, "data_order", "raytrain") == "hf" and isinstance(source, MapSource):
        source.data_order = "hf"  # in order, but each pass draws torch's DataLoader seed as HF's evaluation does
    if kw.get("shuffle", True) and grouped_by_length(args) and sampler is None:
        group_by_length(source, batch_size * args.gradient_accumulation_steps, args.length_column_name, input_name)
    workers = getattr(args, "dataloader_num_workers", 0)
    if workers and hasattr(source, "batch_indices") and hasattr(source, "fetch"):
        return WorkerPool(source, workers, pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
                          prefetch_factor=args.dataloader_prefetch_factor,
                          persistent_workers=args.dataloader_persistent_workers,
                          multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None))
    return source


def _check_sampler(source: Any, accel: dict, data_order: str, own_sampler: bool) -> None:
    """accelerator_config's sampler settings that a training source cannot follow, refused in one line."""
    if not accel["use_seedable_sampler"] and not own_sampler:  # accelerate replaces only the RandomSampler
        raise DataError("accelerator_config.use_seedable_sampler: false (torch's RandomSampler drawing from the "
                        "global RNG) is not supported; raytrain's orders are seeded (data_seed, else seed, and the "
                        "epoch) so that a resume continues them; leave it true")
    n, world = getattr(source, "num_samples", None), getattr(source, "world_size", 1)
    if not accel["even_batches"] and data_order != "hf" and world > 1 and n is not None and not source.drop_last \
            and n % (source.batch_size * world):
        raise DataError(uneven_message(source))


def grouped_by_length(args: Any) -> bool:
    """HF 5.23's train_sampling_strategy="group_by_length", or HF 4's group_by_length=True."""
    return getattr(args, "train_sampling_strategy", "random") == "group_by_length" or \
        bool(getattr(args, "group_by_length", False))


def prepare_dataset(data: Any, model: Any, args: Any, name: str, signature: list[str] | None = None,
                    rename_labels: bool = True) -> Any:
    """A datasets.Dataset (or streaming IterableDataset) as HF's Trainer prepares it: unused columns
    dropped (remove_unused_columns; `signature`: the Trainer's own _signature_columns, as HF's), `label` /
    `label_ids` renamed to `labels` (HF's collator does; rows handed to a trainer's own code keep them, as HF's
    identity collator does). Other inputs are returned unchanged."""
    if not (hf.is_datasets_object(data) and hasattr(data, "remove_columns")):
        return data
    columns = list(getattr(data, "column_names", None) or [])  # None for a stream without features
    if args.remove_unused_columns and columns:
        keep = (list(signature) + list(hf.LABEL_ALIASES) + args.label_keys if signature
                else hf.signature_columns(model, args.label_keys))
        unused = [c for c in columns if c not in keep]
        if len(unused) == len(columns):
            raise DataError(f"{name} ({type(data).__name__}): none of its columns {columns} is an argument of "
                            f"{type(model).__name__}.forward; set remove_unused_columns=False if a "
                            "data_collator builds the inputs")
        if unused:
            logger.info("%s: columns %s are not arguments of %s.forward and are dropped", name, unused,
                        type(model).__name__)
            data = data.remove_columns(unused)
            columns = [c for c in columns if c not in unused]
    if rename_labels and "labels" not in columns:
        alias = next((a for a in hf.LABEL_ALIASES if a in columns), None)
        if alias is not None:
            data = data.rename_column(alias, "labels")
    return data


def num_batches(source: Any) -> int | None:
    """Batches per epoch, or None when the source cannot know (a stream)."""
    try:
        return len(source)
    except TypeError:
        return None


class IterableSource:
    """This rank's batches of an iterable dataset, in stream order (see the module docstring)."""

    kind = "iterable"

    def __init__(self, dataset: Any, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 collate_fn: Callable | None = None, drop_last: bool = False, seed: int = 0,
                 name: str = "dataset"):
        self.dataset, self.batch_size, self.rank, self.world_size = dataset, batch_size, rank, world_size
        self.collate_fn, self.drop_last, self.seed, self.name = collate_fn, drop_last, seed, name
        self.num_samples = None
        self.wait_s = 0.0
        self.schema = None
        self.where = type(dataset).__name__

    def __len__(self) -> int:
        raise TypeError(f"{self.name}: an iterable dataset has no length")

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)  # datasets' streaming shuffle is reseeded per epoch
        return timed_batches(self, itertools.islice(self._batches(), start, None), 0)

    def _batches(self) -> Iterator[dict]:
        gb, ws = self.batch_size * self.world_size, self.world_size
        items = iter(self.dataset)
        collate = self.collate_fn or default_collate
        while True:
            chunk = list(itertools.islice(items, gb))
            if len(chunk) < gb and (self.drop_last or len(chunk) < ws):
                return
            q, r = divmod(len(chunk), ws)
            lo = self.rank * q + min(self.rank, r)
            yield collate(chunk[lo:lo + q + (self.rank < r)])
            if len(chunk) < gb:
                return

    def sample_batch(self) -> dict:
        return next(self._batches())

    def raw_columns(self) -> list[str] | None:
        return None

    def state(self) -> dict:
        return {"kind": self.kind, "batch_size": self.batch_size, "world_size": self.world_size,
                "seed": self.seed, "drop_last": self.drop_last}


class LoaderSource:
    """Any iterable of ready batches (a user's DataLoader); position by replay."""

    kind = "loader"

    def __init__(self, loader: Any, name: str = "train_dataloader", rank: int = 0, world_size: int = 1):
        self.loader, self.name, self.rank, self.world_size = loader, name, rank, world_size
        self.batch_size = getattr(loader, "batch_size", None)
        self.num_samples = None
        self.seed = None
        self.drop_last = getattr(loader, "drop_last", False)
        self.wait_s = 0.0
        self.schema = None
        self.where = type(loader).__name__

    def __len__(self) -> int:
        return len(self.loader)

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        for obj in (self.loader, getattr(self.loader, "sampler", None), getattr(self.loader, "dataset", None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
        return timed_batches(self, itertools.islice(iter(self.loader), start, None), 0)

    def state(self) -> dict:
        return {"kind": self.kind, "batch_size": self.batch_size, "world_size": self.world_size}


class RankLoader(torch.utils.data.DataLoader):
    """What get_train_dataloader / get_eval_dataloader return: a torch DataLoader, as HF's (dataset,
    batch_size, drop_last, num_workers, persistent_workers, sampler, len(), iteration), whose batches
    are this rank's of a raytrain source; torch's samplers and workers are never run. Any other
    attribute (iter_batches, num_samples, state ...) is the source's, so the loop resumes it exactly."""

    def __init__(self, source: Any, dataset: Any, num_workers: int = 0, persistent_workers: bool = False):
        pool = getattr(source, "loader_kwargs", None) or {}  # a WorkerPool's DataLoader settings
        workers = {} if not num_workers else {k: pool[k] for k in ("multiprocessing_context", "prefetch_factor")
                                              if pool.get(k) is not None}
        super().__init__(dataset, batch_size=getattr(source, "batch_size", None) or 1,
                         drop_last=bool(getattr(source, "drop_last", False)), pin_memory=pool.get("pin_memory", False),
                         num_workers=num_workers, persistent_workers=persistent_workers and num_workers > 0, **workers)
        self.__dict__["source"] = source
        self.epoch = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["source"], name)

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.source.iter_batches(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def total_batch_size(self) -> int:
        """The batch of all ranks together (accelerate's name)."""
        return self.source.batch_size * self.source.world_size


class _Batches(torch.utils.data.Dataset):
    """Batch i of an epoch from position `start`: what a DataLoader worker reads and collates."""

    def __init__(self, source: Any, epoch: int, start: int):
        self.source, self.epoch, self.start = source, epoch, start
        self.order = source.order(epoch)

    def __len__(self) -> int:
        return len(self.source) - self.start

    def __getitem__(self, i: int) -> dict:
        return self.source.fetch(self.source.batch_indices(self.epoch, self.start + i, self.order))


class WorkerPool:
    """A map-style source whose batches are fetched and collated by DataLoader worker processes, in
    order; every other attribute is the wrapped source's."""

    def __init__(self, source: Any, num_workers: int, pin_memory: bool = False, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, multiprocessing_context: str | None = None):
        self.source, self.num_workers = source, num_workers
        self.loader_kwargs = dict(num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                                  multiprocessing_context=multiprocessing_context)
        # Each epoch (and each resume position) is a new index plan, so workers are not kept across it.
        self.persistent_workers = persistent_workers

    def __len__(self) -> int:
        return len(self.source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["source"], name)

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        if start >= len(self.source):
            return iter(())
        loader = torch.utils.data.DataLoader(_Batches(self.source, epoch, start), batch_size=None, shuffle=False,
                                             **self.loader_kwargs)
        if start == 0:  # torch's DataLoader draws its base seed from the global generator, as HF's once an epoch
            return timed_batches(self.source, iter(loader), 0)
        kept = torch.get_rng_state()  # a resumed epoch draws nothing: the restored RNG goes on as it would have
        batches = iter(loader)
        torch.set_rng_state(kept)
        return timed_batches(self.source, batches, 0)


def check_iterable_training(source: Any, max_steps: int) -> None:
    """A stream has no length: the number of steps must be given."""
    if num_batches(source) is None and max_steps <= 0:
        raise DataError(f"{source.name} ({source.where}): an iterable dataset has no length; set max_steps > 0 "
                        "(num_train_epochs cannot be turned into steps)")
