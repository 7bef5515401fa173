"""StreamSource: one streaming design for every input larger than memory (files, Ray Data blocks).

A stream is a list of *blocks* with row counts (Parquet row groups from file footers, CSV/JSON files
from one counting pass, Ray Data blocks as Ray Data publishes them, their total known up front), and
a reader that returns rows [lo, hi) of one block. An epoch of one rank:

- order: the blocks in a seeded permutation of (seed, epoch), concatenated into one stream of rows;
  for Ray Data (`reader.arrives_in_order`), epoch 0 takes the blocks in output order, so that it can
  be read while Ray Data still produces it (later epochs wait for all blocks and permute them);
- share: each rank takes as many rows as the sharding rule gives it (data.plan_epoch / rank_span:
  every rank the same number of batches, the same batch sizes as for in-memory data): files as one
  contiguous range of the stream (each rank reads only its own blocks, plus at most two it shares
  with a neighbour); Ray Data as interleaved windows (rank r the r-th window of each group of
  world_size), so that all ranks advance along the stream together;
- shuffle: a rank's rows are cut into windows of `window_rows` (a multiple of the batch size, from
  `buffer_bytes`), each permuted by its own seed (seed, epoch, rank, window).

So a rank's order depends only on (seed, epoch, rank, world size); the window of any batch is found
from row counts alone, and resuming reads that window only (at most one block partly skipped). One
window is batched while the next is loaded in the background: memory is about two windows.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from .data import DataError, _as_column, _column_type, _rng, _timed, plan_epoch, rank_span
from .data_files import _apply, _concat, table_to_numpy

#: Seconds a window may take to load before the run fails naming what it was reading (not a silent hang).
DATA_TIMEOUT_ENV = "RAYTRAIN_DATA_TIMEOUT_S"


#: Windows from this size on are handed back to the OS when let go (smaller ones are noise in a process).
TRIM_BYTES = 4 << 20


def _trim() -> None:
    """Hand freed memory back to the OS at a window switch (allocators keep a freed window resident)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)
    import pyarrow as pa
    pa.default_memory_pool().release_unused()  # Arrow's allocator (mimalloc/jemalloc) keeps freed pages too


_malloc_trim: Any = None


def data_timeout_s(value: float | None = None) -> float:
    return float(value if value is not None else os.environ.get(DATA_TIMEOUT_ENV, 600))


class BlockReader(Protocol):
    """What a StreamSource reads from: blocks with known row counts, and rows [lo, hi) of one of them."""

    blocks: Sequence[Any]          # each has .num_rows; small and picklable
    where: str                     # for messages: the path or the dataset

    def read(self, block: Any, lo: int, hi: int) -> dict[str, np.ndarray]: ...

    def describe(self, block: Any) -> str: ...  # the file / row group / Ray block, for messages


class StreamSource:
    """Batches for one rank read from `reader`'s blocks: seeded block order, rank range, window shuffle."""

    kind = "stream"

    def __init__(self, reader: BlockReader, batch_size: int, *, nbytes: int, buffer_bytes: int, name: str,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 collate_fn: Callable | None = None, prefetch_batches: int = 0,
                 preprocess: Callable | None = None, timeout_s: float | None = None):
        self.reader, self.name, self.where = reader, name, reader.where
        # Ray Data blocks arrive while the source is read: epoch 0 in output order, ranks interleaved by window
        self.in_order = bool(getattr(reader, "arrives_in_order", False))
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.rank, self.world_size, self.collate_fn = rank, world_size, collate_fn
        self.prefetch_batches, self.preprocess, self.keep = prefetch_batches, preprocess, None
        self.timeout_s = data_timeout_s(timeout_s)
        self.num_samples = getattr(reader, "num_rows", None) or sum(b.num_rows for b in self.blocks)
        if self.num_samples == 0:
            raise DataError(f"{name} ({self.where}): the dataset is empty (0 rows)")
        self._num_batches, self._used = plan_epoch(self.num_samples, batch_size, world_size, drop_last, name)
        # This rank's range of the epoch's stream: the rows the sharding rule gives each rank before it.
        sizes = [self._rank_rows(r) for r in range(world_size)]
        self.range_start, self.range_rows = sum(sizes[:rank]), sizes[rank]
        row_bytes = max(1, nbytes // self.num_samples)
        self.buffer_rows = max(1, buffer_bytes // row_bytes)  # from the data and settings: same on resume
        self.window_rows = max(1, self.buffer_rows // batch_size) * batch_size
        # Data within one window is converted once and kept (two windows at most): the epochs of a small
        # dataset then cost a join, not a fetch and conversion each (a wait when steps take milliseconds).
        self.small, self._cache = self.num_samples <= self.buffer_rows, {}
        # malloc_trim walks the heap (milliseconds on the training thread): worth it for windows that matter
        self.trim = self.window_rows * row_bytes >= TRIM_BYTES
        # Windows by the batches' first rows (the last batch may be one row longer): the last may be short.
        self.num_windows = (self._num_batches - 1) * batch_size // self.window_rows + 1
        self._ahead = None  # ((epoch, k), Future): the window being loaded next
        self._loader: ThreadPoolExecutor | None = None
        self.wait_s = 0.0
        self.all_columns: list[str] | None = None
        self._wait(0, batch_size)
        first = self.blocks[0]
        self._sample = self._read(first, 0, min(first.num_rows, batch_size))

    @property
    def blocks(self) -> Sequence[Any]:
        return self.reader.blocks  # a Ray stream's list grows as Ray Data publishes blocks

    def __len__(self) -> int:
        return self._num_batches

    def _rank_rows(self, r: int) -> int:
        lo, hi = rank_span(self._num_batches - 1, self._num_batches, self._used, self.batch_size,
                           self.world_size, r)
        return (self._num_batches - 1) * self.batch_size + (hi - lo)

    # -- order
    def block_order(self, epoch: int) -> np.ndarray:
        n = len(self.blocks)
        if self.in_order and epoch == 0:
            return np.arange(n)  # the blocks as they arrive: a rank need not wait for the whole dataset
        return _rng(self.seed, epoch, 1).permutation(n) if self.shuffle else np.arange(n)

    def _wait(self, epoch: int, rows: int) -> None:
        """Until the blocks the first `rows` rows of `epoch`'s stream need exist (all of them, for a permuted
        epoch): a no-op for files; a Ray stream polls what Ray Data has published."""
        if hasattr(self.reader, "wait_rows"):
            self.reader.wait_rows(rows) if self.in_order and epoch == 0 else self.reader.wait_all()

    def _window_range(self, k: int) -> tuple[int, int]:
        """Window k's rows in this rank's local order: [lo, hi) from the start of the rank's range."""
        lo = k * self.window_rows
        return lo, self.range_rows if k == self.num_windows - 1 else lo + self.window_rows

    def _stream_span(self, k: int) -> tuple[int, int]:
        """Window k's rows as positions [lo, hi) in the epoch's stream. Contiguous: each rank one range of
        the stream. Interleaved (Ray): windows in groups of world_size, rank r the r-th of each group; the
        last (short) windows of all ranks follow each other, so the ranks' rows still tile the stream."""
        wlo, whi = self._window_range(k)
        if not self.in_order:
            return self.range_start + wlo, self.range_start + whi
        w, ws = self.window_rows, self.world_size
        if k < self.num_windows - 1:
            lo = (k * ws + self.rank) * w
            return lo, lo + w
        tail = (self.num_windows - 1) * w  # rows before the last window, the same on every rank
        lo = tail * ws + sum(self._rank_rows(r) - tail for r in range(self.rank))
        return lo, lo + whi - wlo

    def _load_window(self, epoch: int, k: int):
        """Window k's rows as read, in parts (one per block it touches), and its permutation."""
        wlo, whi = self._window_range(k)
        glo, ghi = self._stream_span(k)  # positions in the epoch's stream
        self._wait(epoch, ghi)
        order = self.block_order(epoch)
        starts = np.concatenate([[0], np.cumsum([self.blocks[i].num_rows for i in order])])
        j = int(np.searchsorted(starts, glo, side="right")) - 1
        pieces = []
        while j < len(order) and starts[j] < ghi:
            pieces.append((self.blocks[order[j]], max(glo, starts[j]) - starts[j], min(ghi, starts[j + 1]) - starts[j]))
            j += 1
        many = getattr(self.reader, "read_many", None)  # Ray: one fetch, one Arrow table (converted by _window)
        if self.small:  # all data fits one window: each block converted once, windows joined here from them
            self._fill([p[0] for p in pieces])
            parts = [_concat([{c: v[lo:hi] for c, v in self._cached(blk).items()} for blk, lo, hi in pieces])]
        elif many is not None:
            parts = many(pieces)
            if self.num_windows == 1 and whi - wlo < self.window_rows:  # small data: convert off the training thread
                parts = [self._process(table_to_numpy(p, self.name, self.where), None) for p in parts]
        else:
            parts = [self._process(self.reader.read(*piece), piece[0]) for piece in pieces]
        perm = _rng(self.seed, epoch, 2, self.world_size, self.rank, k).permutation(whi - wlo) \
            if self.shuffle else None
        return wlo, parts, perm

    def _window(self, epoch: int, k: int):
        """Window k of `epoch` as one set of columns (the one loaded ahead if it is that one); then start
        loading the next, which after an epoch's last window is the next epoch's first: a boundary never
        stalls. The parts are joined here, after the previous window was let go, and the next load starts
        after that: memory holds the window in use and the next one, about two windows."""
        key, fut = self._ahead if self._ahead is not None else (None, None)
        self._ahead = None
        if self._loader is None:  # one thread per source (one malloc arena); it ends with the source
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="raytrain-window")
        if key != (epoch, k):
            fut = self._loader.submit(self._load_window, epoch, k)
        try:
            wlo, parts, perm = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise DataError(f"{self.name} ({self.where}): no data for {self.timeout_s:.0f} s while reading window "
                            f"{k} of epoch {epoch} ({self._window_blocks(epoch, k)}); check that storage is "
                            f"reachable, or raise {DATA_TIMEOUT_ENV}") from None
        cols = _concat([p if isinstance(p, dict) else
                        self._process(table_to_numpy(p, self.name, self.where), None) for p in parts])
        del parts, fut
        nxt = (epoch, k + 1) if k + 1 < self.num_windows else (epoch + 1, 0)
        self._ahead = (nxt, self._loader.submit(self._load_window, *nxt))
        return wlo, cols, perm

    def _window_blocks(self, epoch: int, k: int) -> str:
        if not self.blocks:
            return f"no block published yet of {self.where}"
        order = self.block_order(epoch)
        starts = np.concatenate([[0], np.cumsum([self.blocks[i].num_rows for i in order])])
        j = int(np.searchsorted(starts, self._stream_span(k)[0], side="right")) - 1
        return self.reader.describe(self.blocks[order[min(j, len(order) - 1)]])

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `epoch` from `start`: the window holding `start` is found from row counts alone."""
        return _timed(self, self._batches(epoch, start), self.prefetch_batches)

    def _batches(self, epoch: int, start: int):
        current, cur_k = None, -1
        for b in range(start, self._num_batches):
            lo = b * self.batch_size
            hi = self.range_rows if b == self._num_batches - 1 else lo + self.batch_size
            k = lo // self.window_rows
            if k != cur_k:
                current = None  # free this window before the next is joined and the one after is loaded
                if self.trim:  # before the join: trimmed later, the freed window stays resident beside the new
                    _trim()
                current, cur_k = self._window(epoch, k), k
            wlo, perm = current[0], current[2]  # no other name may hold the window past its switch
            local = np.arange(lo - wlo, hi - wlo)
            idx = perm[local] if perm is not None else local
            yield self._assemble({name: v[idx] for name, v in current[1].items()})

    # -- reading
    def _cached(self, blk) -> dict[str, np.ndarray]:
        return self._cache[blk]

    def _fill(self, blocks: list) -> None:
        """Convert the blocks not yet kept (small data): Ray's in one fetch, not one round trip each."""
        missing = [b for b in dict.fromkeys(blocks) if b not in self._cache]
        tables = getattr(self.reader, "tables", None)
        if tables is not None and missing:
            for blk, table in zip(missing, tables(missing)):
                self._cache[blk] = self._process(table_to_numpy(table, self.name, self.reader.describe(blk)), blk)
        for blk in missing:
            if blk not in self._cache:
                self._cache[blk] = self._read(blk, 0, blk.num_rows)

    def _read(self, blk, lo: int, hi: int) -> dict[str, np.ndarray]:
        return self._process(self.reader.read(blk, lo, hi), blk)

    def _process(self, cols: dict[str, np.ndarray], blk) -> dict[str, np.ndarray]:
        if self.preprocess is not None:
            cols = _apply(self.preprocess, cols, self.name, self.reader.describe(blk))
        return {k: v for k, v in cols.items() if k in self.keep} if self.keep is not None else cols

    def _assemble(self, cols: dict[str, np.ndarray]):
        """A batch from gathered rows: tensors (numeric columns) or lists, or what collate_fn makes of them."""
        if self.collate_fn is not None:
            n = len(next(iter(cols.values())))
            return self.collate_fn([{k: v[i] for k, v in cols.items()} for i in range(n)])
        return {k: torch.from_numpy(v) if v.dtype != object and v.dtype.kind in "biuf" else list(v)
                for k, v in cols.items()}

    # -- the source interface
    def sample_batch(self):
        n = len(next(iter(self._sample.values())))
        return self._assemble({k: v[np.arange(n)] for k, v in self._sample.items()})

    def raw_columns(self) -> list[str]:
        return list(self.all_columns) if self.all_columns is not None else list(self._sample)

    def select(self, names: Sequence[str]) -> None:
        self.keep = list(names)
        self._sample = {k: v for k, v in self._sample.items() if k in self.keep}
        if self.preprocess is None and hasattr(self.reader, "project"):
            self.reader.project(self.keep)

    @property
    def schema(self) -> dict[str, tuple[str, tuple | None]]:
        return {k: _column_type(_as_column(v, k, self.name)) for k, v in self._sample.items()}

    def state(self) -> dict:
        return {"kind": self.kind, "num_samples": self.num_samples, "batch_size": self.batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "buffer_rows": self.buffer_rows, "window_rows": self.window_rows,
                **({} if self.in_order else {"num_blocks": len(self.blocks)})}  # a Ray stream's grows


