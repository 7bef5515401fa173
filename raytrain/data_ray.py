"""Ray Data in: a ray.data Dataset executed once by Ray Data, then streamed per rank by StreamSource.

Ray Data's streaming executor runs the dataset's plan (reads, `map_batches` as Ray tasks or actors on
the cluster's CPUs, with the concurrency and resources given to map_batches) with `preserve_order`, so
its output blocks arrive in a fixed order. They stay in Ray's object store, one copy for all workers
(spilled to disk beyond the store's memory); raytrain keeps their references and row counts
(`RayBlocks`). Each rank then reads only its own blocks, a window at a time (data_stream.py): worker
memory is about two windows whatever the dataset's size, and a resume fetches one window.

Why not stream straight into the workers: Ray's streaming_split hands blocks to whichever worker asks
first and cannot start mid-epoch (ray#37633, ray#48224), so neither the order nor a resume would be
exact. Executing on the driver (launch.py) also runs it before the training workers hold the CPUs:
a 2-worker run on 2 CPUs cannot starve Ray Data. Where Ray Data still gets no CPU (other work holds
them), no block for RAYTRAIN_DATA_TIMEOUT_S fails with one line naming the stage and the free CPUs.
"""

from __future__ import annotations

import queue
import re
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import DataError, _is_ray
from .data_stream import DATA_TIMEOUT_ENV, StreamSource, data_timeout_s


@dataclass
class RayData:
    """A ray.data Dataset with how to stream it (a bare Dataset gets these defaults).

    buffer_bytes: each rank's shuffle window in bytes of rows (worker memory ~ 2 windows).
    prefetch_batches: batches assembled ahead in a thread (pays only for a slow collate_fn).
    timeout_s: seconds without a block before the run fails naming the stage (RAYTRAIN_DATA_TIMEOUT_S, 600).
    """

    dataset: Any
    buffer_bytes: int = 64 << 20
    prefetch_batches: int = 0
    timeout_s: float | None = None


@dataclass(frozen=True)
class RayBlock:
    """Rows [start, start + num_rows) of one block in Ray's object store."""

    ref: Any
    start: int
    num_rows: int
    index: int


class RayBlocks:
    """A Ray Dataset's output blocks in order (references, row counts, bytes): what workers are handed.
    The driver that executed the dataset owns the blocks; they live as long as a reference does."""

    def __init__(self, blocks: list[RayBlock], nbytes: int, where: str, spec: RayData):
        self.blocks, self.nbytes, self.where = blocks, nbytes, where
        self.buffer_bytes, self.prefetch_batches, self.timeout_s = \
            spec.buffer_bytes, spec.prefetch_batches, spec.timeout_s
        self.name = "dataset"

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self.blocks)

    def describe(self, blk: RayBlock) -> str:
        return f"{self.where}, block {blk.index}"

    def read(self, blk: RayBlock, lo: int, hi: int) -> dict[str, np.ndarray]:
        from .data_files import table_to_numpy
        return table_to_numpy(self.read_many([(blk, lo, hi)])[0], self.name, self.describe(blk))

    def read_many(self, pieces: list[tuple[RayBlock, int, int]]) -> list:
        """Rows [lo, hi) of each block, fetched in one ray.get, as one Arrow table of zero-copy views of the
        object store: StreamSource converts it once, after the previous window was let go."""
        import pyarrow as pa
        import ray
        tables = []
        for (blk, lo, hi), block in zip(pieces, ray.get([p[0].ref for p in pieces])):
            table = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block, preserve_index=False)
            tables.append(table.slice(blk.start + lo, hi - lo))
        try:
            return [pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]]
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DataError(f"{self.name} ({self.where}): blocks {pieces[0][0].index}-{pieces[-1][0].index} have "
                            f"different schemas ({str(e).splitlines()[0]})") from None


def ray_source(data: Any, batch_size: int, *, name: str, prefetch_batches: int | None = None, **kw) -> StreamSource:
    """A StreamSource over a ray Dataset / DataIterator / RayData (executed here) or RayBlocks (as handed)."""
    blocks = data if isinstance(data, RayBlocks) else execute(data, name)
    blocks.name = name
    pf = blocks.prefetch_batches if prefetch_batches is None else prefetch_batches
    return StreamSource(blocks, batch_size, nbytes=blocks.nbytes, buffer_bytes=blocks.buffer_bytes, name=name,
                        prefetch_batches=pf, timeout_s=blocks.timeout_s, **kw)


def execute(data: Any, name: str = "dataset") -> RayBlocks:
    """Run a ray Dataset's plan in order with Ray Data and keep its output blocks' references."""
    import ray.data

    spec = data if isinstance(data, RayData) else RayData(data)
    data, what = spec.dataset, "ray Dataset"
    if isinstance(data, ray.data.DataIterator):
        base = getattr(data, "_base_dataset", None)  # a whole dataset's iterator; a split has none
        if base is None:
            raise DataError(f"{name}: this ray DataIterator is one worker's split ({type(data).__name__}), whose "
                            "rows depend on timing; give TorchTrainer dataset_config=trainer_datasets(...)[1] so "
                            "every worker gets all rows and raytrain shards them deterministically")
        data, what = base, "ray DataIterator"
    if not isinstance(data, ray.data.Dataset):
        raise DataError(f"{name}: a {type(data).__name__} is not accepted; pass a ray.data.Dataset")
    ds = ray.data.Dataset.copy(data, _deep_copy=True)
    ds.context.execution_options.preserve_order = True  # the blocks' order is the data's, not the timing's
    stage = str(ds).splitlines()[0].strip()
    where = f"{what} {stage}"
    timeout = data_timeout_s(spec.timeout_s)
    blocks, nbytes = [], 0
    for bundle in _bundles(ds, name, where, stage, timeout):
        slices = bundle.slices or [None] * len(bundle.blocks)
        for entry, piece in zip(bundle.blocks, slices):
            start = piece.start_offset if piece is not None else 0
            n = piece.num_rows if piece is not None else entry.metadata.num_rows
            if n:
                blocks.append(RayBlock(entry.ref, start, int(n), len(blocks)))
                nbytes += int(entry.metadata.size_bytes or 0) * n // max(1, entry.metadata.num_rows or n)
    if not blocks:
        raise DataError(f"{name} ({where}): the dataset is empty (0 rows)")
    return RayBlocks(blocks, max(nbytes, 1), where, spec)


def _bundles(ds, name: str, where: str, stage: str, timeout: float):
    """Ray Data's output bundles, from a thread: no bundle for `timeout` s is a one-line error, not a hang."""
    q: queue.Queue = queue.Queue(64)
    stop = threading.Event()

    def run():
        try:
            for bundle in ds.iter_internal_ref_bundles():
                q.put(("bundle", bundle))
                if stop.is_set():
                    return
            q.put(("end", None))
        except BaseException as e:  # handed to the consumer
            q.put(("error", e))

    threading.Thread(target=run, name="raytrain-ray-data", daemon=True).start()
    count = 0
    try:
        while True:
            try:
                kind, item = q.get(timeout=timeout)
            except queue.Empty:
                raise DataError(_stalled(name, where, stage, timeout, count)) from None
            if kind == "end":
                return
            if kind == "error":
                raise DataError(_failed(name, where, item, count)) from item
            count += 1
            yield item
    finally:
        stop.set()


def _stalled(name: str, where: str, stage: str, timeout: float, count: int) -> str:
    import ray
    total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
    return (f"{name} ({where}): Ray Data produced no block for {timeout:.0f} s ({count} so far); stage {stage} "
            f"waits with {free:g} of {total:g} cluster CPUs free: free CPUs for it (ray.init(num_cpus=...), fewer "
            f"or smaller training workers, a lower num_cpus in map_batches) or raise {DATA_TIMEOUT_ENV}")


def _failed(name: str, where: str, error: BaseException, count: int) -> str:
    """Ray's error (a multi-line task traceback) as one line: the stage, the user's exception, where."""
    text = str(error)
    stage = re.search(r"ray::([^\s(]+(?:\([^)]*\))?)", text)
    user = [ln.strip() for ln in text.splitlines() if re.match(r"^\s*[\w.]*(Error|Exception|Exit|Interrupt)\b.*:", ln)
            and not ln.strip().startswith(("ray.exceptions.", "The above"))]
    what = user[0] if user else f"{type(error).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
    at = f"stage {stage.group(1)}" if stage else "Ray Data"
    return f"{name} ({where}): {at} raised {what} (on block {count} of the stream or a later one in flight)"


def blocks_for_workers(trainer) -> dict[str, RayBlocks]:
    """Driver side: execute the trainer's ray Datasets once, before the training workers take the CPUs,
    and hand every worker the same block references (launch.py passes them in the train-loop config)."""
    out = {}
    for key in ("train_dataset", "eval_dataset"):
        value = getattr(trainer, key, None)
        if value is not None and (_is_ray(value) or isinstance(value, RayData)):
            out[key] = execute(value, key)
    return out
