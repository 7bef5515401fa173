"""Ray Data in: a ray.data Dataset executed by Ray Data, its output blocks streamed per rank by StreamSource.

Ray Data's streaming executor runs the dataset's plan (reads, `map_batches` as Ray tasks or actors on
the cluster's CPUs, with the concurrency and resources given to map_batches) with `preserve_order`, so
its output blocks arrive in a fixed order. A thread of the process that owns the dataset (the driver
under driver/launch.py, or the training process itself) keeps that executor running and *publishes* each
block's reference and row count as it arrives (`_Board`: an object in-process, a CPU-less actor for Ray
Train workers). The blocks stay in Ray's object store, one copy for all workers, executed once: later
epochs reuse them. Ranks read their windows (stream.py) as soon as the blocks they need exist.

Beside training, what cannot be known before the data exists, and how raytrain decides:

- Row count. Epoch length, equal steps per rank and the LR schedule need it up front, unless training
  runs for max_steps (as HF requires of data without a length). It is taken from Ray without executing
  (`Dataset._meta_count`: a read whose size Ray knows, e.g. `range`, `from_items`, then stages Ray
  declares row-preserving, e.g. `map`, `select_columns`), from `ds.count()` when the plan is only a
  Parquet read (Ray counts it from the file footers), or from the user (`RayData(ds, num_rows=N)`; the
  stream checks it and fails in one line if the data disagrees). Ray declares `map_batches`, `filter`
  and `flat_map` may change the row count. Such a train set with max_steps > 0 streams beside
  training all the same: its count is learnt when Ray Data ends, the epoch ends when its batches do,
  and until then each rank reads only windows the rows published prove whole (stream.py), so
  order, equal steps and coverage are those of a known count. Otherwise (no max_steps, an eval set)
  it is executed in full before training, said in one info line. Ray 2.60 has no public count that
  never executes (`count()` runs the plan when the metadata lacks it), so `_meta_count` and the plan
  are read through one guard (`_private`): if another Ray changes them, the count is "not known".
- Order. Epoch 0 reads the blocks in output order (fixed by preserve_order), later epochs a seeded
  permutation of the then-known blocks; within a rank, windows are shuffled by (seed, epoch, rank,
  window). Ranks take windows interleaved along the stream (rank r the r-th window of each group of
  world_size), so every rank starts as soon as the first blocks exist and all advance together. The
  layout depends only on row counts, so the order depends only on (seed, epoch, rank, world size),
  whichever way the dataset was executed.
- CPUs. Executing beside training needs CPUs the training workers do not hold: driver/launch.py streams beside
  only when the cluster's CPUs cover the training workers (ScalingConfig.total_resources) plus what the
  largest stage asks for (its num_cpus, times an actor pool's minimum size); otherwise it executes the
  dataset before the workers start (they then hold the CPUs), with one info line saying what to give.

Resume on another world size or batch size reads exactly the rest of the interrupted epoch
(StreamSource.resume_at); for a count not known yet, after Ray Data's pass has ended.

Why not Ray's streaming_split into the workers: it hands blocks to whichever worker asks first and cannot
start mid-epoch (ray#37633, ray#48224), so neither the order nor a resume would be exact. No block for
RAYTRAIN_DATA_TIMEOUT_S fails with one line naming the stage and the free CPUs.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .columns import table_to_numpy
from .errors import DataError
from .stream import DATA_TIMEOUT_ENV, StreamSource, data_timeout_s

logger = logging.getLogger(__name__)


def is_ray_dataset(data) -> bool:
    """A ray.data object (Dataset, DataIterator), told by its module: ray is not imported to ask."""
    return type(data).__module__.startswith("ray.data")


@dataclass
class RayData:
    """A ray.data Dataset with how to stream it (a bare Dataset gets these defaults).

    buffer_bytes: each rank's shuffle window in bytes of rows (worker memory ~ 2 windows).
    prefetch_batches: batches assembled ahead in a thread (pays only for a slow collate_fn).
    timeout_s: seconds without a block before the run fails naming the stage (RAYTRAIN_DATA_TIMEOUT_S, 600).
    num_rows: the dataset's row count when Ray cannot say it without executing (map_batches): the dataset
      then streams beside training; the stream fails in one line if the data has another count.
    """

    dataset: Any
    buffer_bytes: int = 64 << 20
    prefetch_batches: int = 0
    timeout_s: float | None = None
    num_rows: int | None = None


@dataclass(frozen=True)
class RayBlock:
    """Rows [start, start + num_rows) of one block in Ray's object store."""

    ref: Any
    start: int
    num_rows: int
    index: int


class _Board:
    """The published blocks of one stream: (ref, start, rows, bytes per row) entries, then the end or an
    error. In-process as it is; for Ray Train workers as a CPU-less actor (ray.remote(_Board))."""

    def __init__(self):
        self.entries: list = []
        self.done, self.error = False, None
        self._lock = threading.Lock()

    def add(self, entries: list) -> None:
        with self._lock:
            self.entries.extend(entries)

    def end(self, error: str | None = None) -> None:
        with self._lock:
            self.done, self.error = True, error

    def get(self, since: int):
        with self._lock:
            return self.entries[since:], self.done, self.error


class RayBlocks:
    """A Ray Dataset's output blocks in order: references, row counts, bytes. Either complete (executed
    before reading) or growing while Ray Data runs (published on a _Board; `wait_rows` / `wait_all`)."""

    arrives_in_order = True  # StreamSource: epoch 0 in output order, ranks interleaved by window

    def __init__(self, spec: RayData, where: str, num_rows: int, blocks: list[RayBlock] | None = None,
                 row_bytes: int | None = None, board: Any = None, remote: bool = False):
        self.where, self.total_rows, self.board, self.remote = where, num_rows, board, remote
        self.length_known = num_rows is not None  # else learnt when Ray Data ends (a train set with max_steps)
        self.blocks: list[RayBlock] = list(blocks or [])
        self.row_bytes = row_bytes
        self.complete = board is None
        self.buffer_bytes, self.prefetch_batches, self.timeout_s = \
            spec.buffer_bytes, spec.prefetch_batches, spec.timeout_s
        self.name = "dataset"
        self._rows = sum(b.num_rows for b in self.blocks)
        self._keep: list = []  # the owner's references while Ray Data publishes (not pickled)
        self.closed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # sources of one process (loader threads) may share these blocks

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_keep"], state["_thread"], state["_lock"] = [], None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def num_rows(self) -> int:
        return self.total_rows

    @property
    def nbytes(self) -> int:
        self.wait_rows(1)
        return max(1, (self.row_bytes or 1) * (self.total_rows or self._rows))

    @property
    def published_rows(self) -> int:
        return self._rows

    def refresh(self) -> None:
        """Take what Ray Data has published since the last look (no wait)."""
        if not self.complete:
            self._poll()

    def describe(self, blk: RayBlock) -> str:
        return f"{self.where}, block {blk.index}"

    # -- blocks as they arrive
    def _poll(self) -> None:
        import ray
        with self._lock:
            got = self.board.get.remote(len(self.blocks)) if self.remote else self.board.get(len(self.blocks))
            entries, done, error = ray.get(got) if self.remote else got
            for ref, start, n, row_bytes in entries:
                if self.row_bytes is None:
                    self.row_bytes = row_bytes
                self.blocks.append(RayBlock(ref, start, n, len(self.blocks)))
                self._rows += n
            if error:
                raise DataError(error)
            if done and self.total_rows is None:
                self.total_rows = self._rows  # the count of a stream of unknown length, now that it ended
            self.complete = done  # every entry published is taken above

    def wait_rows(self, rows: int) -> None:
        """Until the published blocks hold at least `rows` rows (in output order), or the stream ended."""
        pause = 0.005
        while not self.complete and self._rows < rows:
            self._poll()
            if self.complete or self._rows >= rows:
                break
            if not threading.main_thread().is_alive():  # the process is exiting: a loader must not hold it
                raise DataError(f"{self.name} ({self.where}): the process exits while waiting for Ray Data")
            time.sleep(pause)
            pause = min(0.1, pause * 2)

    def wait_all(self) -> None:
        """Until Ray Data has published every block (later epochs permute the whole list)."""
        self.wait_rows(self.total_rows + 1 if self.total_rows is not None else float("inf"))

    def close(self) -> None:
        """The owner lets the blocks go (after the run); an actor board ends with it."""
        self._keep, self.closed = [], True
        if self.remote and self.board is not None:
            import ray
            try:
                ray.kill(self.board)
            except Exception:  # already gone with the cluster
                pass

    # -- reading
    def read(self, blk: RayBlock, lo: int, hi: int) -> dict[str, np.ndarray]:
        return table_to_numpy(self.read_many([(blk, lo, hi)])[0], self.name, self.describe(blk))

    def tables(self, blocks: list[RayBlock]) -> list:
        """Each block's rows as an Arrow table (zero-copy views of the object store), in one ray.get."""
        import pyarrow as pa
        import ray
        return [(t if isinstance(t, pa.Table) else pa.Table.from_pandas(t, preserve_index=False)).slice(b.start,
                                                                                                    b.num_rows)
                for b, t in zip(blocks, ray.get([b.ref for b in blocks]))]

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


def ray_source(data: Any, batch_size: int, *, name: str, prefetch_batches: int | None = None,
               length_optional: bool = False, **kw) -> StreamSource:
    """A StreamSource over a ray Dataset / DataIterator / RayData (started here, streaming beside this
    process when its row count is known or need not be) or RayBlocks (as handed by the driver)."""
    blocks = data if isinstance(data, RayBlocks) else start(data, name, length_optional=length_optional)
    blocks.name = name
    blocks.wait_rows(1)  # the first block: bytes per row (window size) and the columns
    pf = blocks.prefetch_batches if prefetch_batches is None else prefetch_batches
    return StreamSource(blocks, batch_size, nbytes=blocks.nbytes, buffer_bytes=blocks.buffer_bytes, name=name,
                        prefetch_batches=pf, timeout_s=blocks.timeout_s, **kw)


def _prepare(data: Any, name: str):
    """(spec, a copy of the dataset set to preserve order, where, first stage) of any accepted Ray input."""
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
    # Blocks of at most a quarter window (Ray's default is 128 MiB): a rank's first window exists after a
    # few small blocks, not after whole files (2M Parquet rows: first block 4.3 s instead of 7.7 s)
    limit = max(1 << 20, spec.buffer_bytes // 4)
    if (ds.context.target_max_block_size or limit + 1) > limit:
        ds.context.target_max_block_size = limit
    _private(lambda: _fewer_footer_readers(ds._logical_plan.dag))
    stage = str(ds).splitlines()[0].strip()
    return spec, ds, f"{what} {stage}", stage


def _fewer_footer_readers(dag) -> None:
    """Ray 2.60 reads Parquet footers on a pool of 32 new actor processes whatever the cluster and the file
    count: on 2 CPUs their start-up is most of read_parquet's (first block 4-5.6 s, 2.1-2.6 s with one).
    One per two cluster CPUs (Ray's 32 from 64 CPUs up). The plan is shared with the caller's dataset, which
    gets the same cap."""
    import ray
    cap = max(1, int(ray.cluster_resources().get("CPU", 2)) // 2)
    for op in _ops(dag):
        indexer = getattr(op, "file_indexer", None)
        if isinstance(getattr(indexer, "_num_actors", None), int) and indexer._num_actors > cap:
            indexer._num_actors = cap


def start(data: Any, name: str = "dataset", *, spare_cpus: float | None = None, remote: bool = False,
          length_optional: bool = False) -> RayBlocks:
    """Start Ray Data on the dataset: streaming beside the reader when its row count is known without
    executing, or need not be (`length_optional`: a train set with max_steps; the count is learnt when
    Ray Data ends), and (spare_cpus given: the CPUs training leaves free) its stages fit beside
    training; else executed in full first, with one info line saying why."""
    spec, ds, where, stage = _prepare(data, name)
    count, why = _row_count(spec, ds, stage)
    beside = count is not None or length_optional
    if beside and spare_cpus is not None:
        need, op = _data_cpus(ds)
        if need > spare_cpus:
            beside, why = False, (f"its stage {op} needs {need:g} CPU(s) and the cluster has {spare_cpus:g} beside "
                                  f"the training workers; give it {need - spare_cpus:g} more CPU(s) (ray.init("
                                  "num_cpus=...), fewer workers, or a lower num_cpus in map_batches)")
    if not beside:
        logger.info("%s: Ray Data executes it in full before training: %s", name, why)
        return execute(spec, name)
    if count == 0:
        raise DataError(f"{name} ({where}): the dataset is empty (0 rows)")
    import ray
    board = ray.remote(num_cpus=0)(_Board).remote() if remote else _Board()
    blocks = RayBlocks(spec, where, count, board=board, remote=remote)
    blocks._thread = threading.Thread(target=_publish, name="raytrain-ray-publish", daemon=True,
                                      args=(ds, blocks, name, stage, data_timeout_s(spec.timeout_s)))
    blocks._thread.start()
    return blocks


def _row_count(spec: RayData, ds, stage: str) -> tuple[int | None, str]:
    """The row count Ray can give without executing the plan (or the user's), else None and why not."""
    if spec.num_rows is not None:
        return int(spec.num_rows), ""
    count = _private(lambda: ds._meta_count())  # a read of known size through row-preserving stages; never runs
    if count is not None:
        return int(count), ""
    if _private(lambda: _bare_parquet(ds._logical_plan.dag)):
        return int(ds.count()), ""  # a bare Parquet read: Ray counts it reading no column (file footers)
    return None, (f"Ray cannot count its rows without running it ({stage} may change the row count); "
                  "RayData(ds, num_rows=N) streams it beside training")


def _bare_parquet(dag) -> bool:
    """A plan that only reads Parquet: one read op (Ray 2.60: ListFiles -> ReadFilesParquetV2; before: one
    Read op), nothing after it."""
    inputs = list(dag.input_dependencies)
    return "parquet" in dag.name.lower() and all(op.name == "ListFiles" and not op.input_dependencies
                                                 for op in inputs)


def _private(get):
    """What Ray gives only through private attributes (Ray 2.60 has no public row count that never executes:
    Dataset.count() runs the plan when the metadata lacks it), or None if this Ray version differs."""
    try:
        return get()
    except Exception:  # renamed or changed in another Ray: treated as not known, never an error
        return None


def _data_cpus(ds) -> tuple[float, str]:
    """The most CPUs one stage needs to make progress (its num_cpus, times an actor pool's minimum size)."""
    need = _private(lambda: _stage_cpus(ds._logical_plan.dag))
    return need if need is not None else (1.0, "of the dataset")  # unknown: one CPU, as Ray Data's default


def _ops(dag):
    """Every operator of a Ray Data logical plan."""
    todo = [dag]
    while todo:
        op = todo.pop()
        todo += list(op.input_dependencies)
        yield op


def _stage_cpus(dag) -> tuple[float, str]:
    need, what = 0.0, ""
    for op in _ops(dag):
        args = getattr(op, "ray_remote_args", None)
        if args is None:  # data already in the object store (from_items, from_numpy): no task
            continue
        cpus = float(args.get("num_cpus", 1))
        cpus *= getattr(getattr(op, "compute", None), "min_size", None) or 1
        if cpus > need:
            need, what = cpus, op.name
    return need, what


def _publish(ds, blocks: RayBlocks, name: str, stage: str, timeout: float) -> None:
    """Driver thread: run Ray Data and publish each output block as it arrives; the end, or the error in
    one line (a raising stage, a stall, a row count other than announced)."""
    board, where, expected = blocks.board, blocks.where, blocks.total_rows
    call = (lambda m, *a: getattr(board, m).remote(*a)) if blocks.remote else (lambda m, *a: getattr(board, m)(*a))
    rows = 0
    try:
        for bundle in _bundles(ds, name, where, stage, timeout):
            entries = list(_entries(bundle))
            rows += sum(e[2] for e in entries)
            if expected is not None and rows > expected:
                raise DataError(_miscount(name, where, expected, f"more than {expected}"))
            if blocks.closed:  # the run ended before the data did: stop Ray Data
                return
            blocks._keep.extend(e[0] for e in entries)
            call("add", entries)
        if expected is not None and rows != expected:
            raise DataError(_miscount(name, where, expected, str(rows)))
        call("end", None)
    except DataError as e:
        call("end", str(e))
    except BaseException as e:  # handed to the readers as one line
        call("end", f"{name} ({where}): Ray Data failed: {type(e).__name__}: {str(e).strip().splitlines()[:1]}")


def _miscount(name: str, where: str, expected: int, got: str) -> str:
    return (f"{name} ({where}): Ray Data produced {got} rows, not the {expected} announced (num_rows, or Ray's "
            "metadata); give the right num_rows, or none to execute it before training")


def _entries(bundle):
    """(reference, first row, rows, bytes per row) of each block of a Ray Data output bundle."""
    slices = bundle.slices or [None] * len(bundle.blocks)
    for entry, piece in zip(bundle.blocks, slices):
        start = piece.start_offset if piece is not None else 0
        n = piece.num_rows if piece is not None else entry.metadata.num_rows
        if n:
            row_bytes = int(entry.metadata.size_bytes or 0) // max(1, entry.metadata.num_rows or n)
            yield entry.ref, start, int(n), max(1, row_bytes)


def execute(data: Any, name: str = "dataset") -> RayBlocks:
    """Run a ray Dataset's plan in order with Ray Data to its end and keep its output blocks' references."""
    spec, ds, where, stage = _prepare(data, name)
    blocks, row_bytes = [], None
    for bundle in _bundles(ds, name, where, stage, data_timeout_s(spec.timeout_s)):
        for ref, start, n, rb in _entries(bundle):
            row_bytes = row_bytes or rb
            blocks.append(RayBlock(ref, start, n, len(blocks)))
    if not blocks:
        raise DataError(f"{name} ({where}): the dataset is empty (0 rows)")
    return RayBlocks(spec, where, sum(b.num_rows for b in blocks), blocks, row_bytes)


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
