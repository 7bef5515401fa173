"""StreamSource: one streaming design for every input larger than memory (files, Ray Data blocks).

A stream is a list of *blocks* with row counts (Parquet row groups from file footers, CSV/JSON files
from one counting pass, Ray Data blocks as Ray Data publishes them, their total known up front), and
a reader that returns rows [lo, hi) of one block. An epoch of one rank:

- order: the blocks in a seeded permutation of (seed, epoch), concatenated into one stream of rows;
  for Ray Data (`reader.arrives_in_order`), epoch 0 takes the blocks in output order, so that it can
  be read while Ray Data still produces it (later epochs wait for all blocks and permute them);
- share: each rank takes as many rows as the sharding rule gives it (sharding.py:
  every rank the same number of batches, the same batch sizes as for in-memory data): files as one
  contiguous range of the stream (each rank reads only its own blocks, plus at most two it shares
  with a neighbour); Ray Data as interleaved windows (rank r the r-th window of each group of
  world_size), so that all ranks advance along the stream together;
- shuffle: a rank's rows are cut into windows of `window_rows` (a multiple of the batch size, from
  `buffer_bytes`), each permuted by its own seed (seed, epoch, rank, window).

So a rank's order depends only on (seed, epoch, rank, world size); the window of any batch is found
from row counts alone, and resuming reads that window only (at most one block partly skipped). One
window is batched while the next is loaded in the background: memory is about two windows. Data that
fits one window is converted once, shuffled in the loader thread, and its batches are slices.

Resume under another layout (world size, batch size, drop_last: `resume_at`, remap.py). The rest of the
interrupted epoch is rebuilt from the saved layout alone: for each old rank, the unread rows of the
window it was in (its window permutation is known) and the windows it had not begun. Those rows, in
ascending stream position, form a stream of their own that the new world cuts by the same rules
(its own window seeds); its batches end where the new layout's epoch ends, so the loop's epoch length
is unchanged, and later epochs are the new layout's. Each row left is read once, none is lost (with
drop_last, the rest's incomplete global batch is dropped, as drop_last does); reading it costs at most
one window per old rank beyond the rows themselves. A resume within such an epoch carries its chain
of layouts in the checkpoint (`state()["remap"]`), so it can be interrupted and resumed again.

Unknown length (a Ray stream of a dataset Ray cannot count without running it, trained for
max_steps: `reader.length_known` False). Only epoch 0's last windows depend on the count: a window
that is not the last for the rows published so far is not the last for any larger count either, and
its place in the stream does not depend on the count. So a rank reads a window once the rows
published prove it is not the last (about one group of windows behind Ray Data), and the last ones
once Ray Data has ended; the order is exactly that of a known count. Such a source has no len():
the loop ends the epoch when the batches do, as for an iterable dataset.
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from .columns import apply_preprocess, as_column, column_type, concat_columns, table_to_numpy
from .errors import DataError
from .prefetch import timed_batches
from .remap import Remap, TooFew
from .sharding import Layout, seeded_rng, window_perm

logger = logging.getLogger(__name__)

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


class StreamSource(Layout):
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
        # A Ray stream of a dataset Ray cannot count without running it (map_batches, filter), trained for
        # max_steps: epoch 0's length is learnt when Ray Data ends (_learn); the source then has no len().
        self.length_known = getattr(reader, "length_known", True)
        if self.length_known:
            self.num_samples = getattr(reader, "num_rows", None) or sum(b.num_rows for b in self.blocks)
            row_bytes = max(1, nbytes // max(1, self.num_samples))
        else:
            reader.wait_rows(batch_size)
            self.num_samples, row_bytes = (None if self.blocks else 0), max(1, reader.row_bytes or 1)
        if self.num_samples == 0:
            raise DataError(f"{name} ({self.where}): the dataset is empty (0 rows)")
        self.buffer_rows = max(1, buffer_bytes // row_bytes)  # from the data and settings: same on resume
        window_rows = max(1, self.buffer_rows // batch_size) * batch_size
        if self.length_known:
            Layout.__init__(self, self.num_samples, batch_size, world_size, rank, drop_last, window_rows,
                            self.in_order, name)
        else:  # what does not depend on the count; the rest once it is known (_learn)
            self.window_rows = window_rows
            self.num_batches = self.range_start = self.range_rows = self.num_windows = None
        # Data within one window is converted once and kept (two windows at most): the epochs of a small
        # dataset then cost a join, not a fetch and conversion each (a wait when steps take milliseconds).
        self.small, self._cache = self.length_known and self.num_samples <= self.buffer_rows, {}
        # malloc_trim walks the heap (milliseconds on the training thread): worth it for windows that matter
        self.trim = self.window_rows * row_bytes >= TRIM_BYTES
        self._remap: Remap | None = None  # the rest of an epoch interrupted under another layout (resume_at)
        self._ahead = None  # ((epoch, k), Future): the window being loaded next
        self._loader: ThreadPoolExecutor | None = None
        self.wait_s = 0.0
        self.all_columns: list[str] | None = None
        self._wait(0, batch_size)
        first = self.blocks[0]
        self._sample = self._read(first, 0, min(first.num_rows, batch_size))
        if self.small:  # its one window is what any batch of epoch 0 needs: loaded while the model is set up
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="raytrain-window")
            self._ahead = ((0, 0), self._loader.submit(self._load_window, 0, 0))

    @property
    def blocks(self) -> Sequence[Any]:
        return self.reader.blocks  # a Ray stream's list grows as Ray Data publishes blocks

    def __len__(self) -> int:
        if not self.length_known:  # fixed when built, so that a resumed run plans its steps alike
            raise TypeError(f"{self.name}: a Ray Data stream whose row count is learnt when it ends has no length")
        return self.num_batches

    def _learn(self) -> bool:
        """Whether the count is known: for a stream of unknown length, whether Ray Data has ended (its
        layout is then the sharding rule's, as if the count had been known up front)."""
        if self.num_batches is None:
            self.reader.refresh()
            if not self.reader.complete:
                return False
            Layout.__init__(self, self.reader.num_rows, self.batch_size, self.world_size, self.rank,
                            self.drop_last, self.window_rows, self.in_order, self.name)
            self.num_samples = self.reader.num_rows
        return True

    def _full_windows(self) -> int:
        """Windows of epoch 0 certainly whole and not the last, whatever the count turns out to be: those of
        the rows published so far but the last (a larger count never has fewer windows)."""
        try:
            return Layout(self.reader.published_rows, self.batch_size, self.world_size, self.rank,
                          self.drop_last, self.window_rows, True).num_windows - 1
        except DataError:  # fewer rows than one batch per rank so far
            return 0

    def _has_window(self, epoch: int, k: int) -> bool:
        """Whether `epoch` has window k. Unknown length: waits until Ray Data has published enough rows to
        prove it whole (its place and rows do not depend on the count) or has ended (count known)."""
        while not self._learn():
            if epoch == 0 and k < self._full_windows():
                return True
            if epoch > 0:
                self.reader.wait_all()
            else:
                self.reader.wait_rows(self.reader.published_rows + 1)
        return k < self._lay(epoch)[0].num_windows

    # -- order
    def block_order(self, epoch: int) -> np.ndarray:
        n = len(self.blocks)
        if self.in_order and epoch == 0:
            return np.arange(n)  # the blocks as they arrive: a rank need not wait for the whole dataset
        return seeded_rng(self.seed, epoch, 1).permutation(n) if self.shuffle else np.arange(n)

    def _wait(self, epoch: int, rows: int) -> None:
        """Until the blocks the first `rows` rows of `epoch`'s stream need exist (all of them, for a permuted
        epoch): a no-op for files; a Ray stream polls what Ray Data has published."""
        if hasattr(self.reader, "wait_rows"):
            self.reader.wait_rows(rows) if self.in_order and epoch == 0 else self.reader.wait_all()

    def _load_window(self, epoch: int, k: int):
        """Window k's rows as read, in parts (one per block it touches), and its permutation."""
        if self._remap is not None and self._remap.epoch == epoch:
            return self._remap.load(self, k)
        wlo, whi = self.window_range(k)
        glo, ghi = self.stream_span(k)  # positions in the epoch's stream
        self._wait(epoch, ghi)
        pieces = self._pieces(epoch, glo, ghi)
        many = getattr(self.reader, "read_many", None)  # Ray: one fetch, one Arrow table (converted by _window)
        joined = False  # small data is joined in this thread (a large window after the last one is let go)
        if self.small:  # all data fits one window: each block converted once, windows joined here from them
            self._fill([p[0] for p in pieces])
            parts, joined = [concat_columns([{c: v[lo:hi] for c, v in self._cached(blk).items()}
                                             for blk, lo, hi in pieces])], True
        elif many is not None:
            parts = many(pieces)
            if self.num_windows == 1 and whi - wlo < self.window_rows:  # small data: convert off the training thread
                parts, joined = [concat_columns([self._process(table_to_numpy(p, self.name, self.where), None)
                                                 for p in parts])], True
        else:
            parts = [self._process(self.reader.read(*piece), piece[0]) for piece in pieces]
        perm = window_perm(self, epoch, 0, self.world_size, self.rank, k, whi - wlo)
        if joined and perm is not None:  # shuffled here too: each batch is then a slice, no gather per step
            parts, perm = [{c: v[perm] for c, v in parts[0].items()}], False
        return wlo, parts, perm

    def _pieces(self, epoch: int, glo: int, ghi: int) -> list[tuple[Any, int, int]]:
        """(block, lo, hi) of each block holding positions [glo, ghi) of `epoch`'s stream."""
        order = self.block_order(epoch)
        starts = np.concatenate([[0], np.cumsum([self.blocks[i].num_rows for i in order])])
        j = int(np.searchsorted(starts, glo, side="right")) - 1
        pieces = []
        while j < len(order) and starts[j] < ghi:
            pieces.append((self.blocks[order[j]], max(glo, starts[j]) - starts[j], min(ghi, starts[j + 1]) - starts[j]))
            j += 1
        return pieces

    def read_positions(self, epoch: int, pos: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at ascending stream positions `pos` (a resumed epoch's rest): read in runs of nearby
        positions, so that a gap of consumed rows between them is never read."""
        self._wait(epoch, int(pos[-1]) + 1)
        out = []
        for run in np.split(pos, np.flatnonzero(np.diff(pos) > self.window_rows) + 1):
            pieces = self._pieces(epoch, int(run[0]), int(run[-1]) + 1)
            cols = concat_columns([self._read(*piece) for piece in pieces])
            out.append({c: v[run - run[0]] for c, v in cols.items()})
        return concat_columns(out)

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
        cols = concat_columns([p if isinstance(p, dict) else
                               self._process(table_to_numpy(p, self.name, self.where), None) for p in parts])
        del parts, fut
        nxt = self._next_window(epoch, k)
        if nxt is not None:
            self._ahead = (nxt, self._loader.submit(self._load_window, *nxt))
        return wlo, cols, perm

    def _next_window(self, epoch: int, k: int) -> tuple[int, int] | None:
        """The window after k (the next epoch's first after the last); None while a stream of unknown length
        cannot tell yet (it is then loaded when asked for)."""
        if not self._learn():
            return (epoch, k + 1) if epoch == 0 and k + 1 < self._full_windows() else None
        return (epoch, k + 1) if k + 1 < self._lay(epoch)[0].num_windows else (epoch + 1, 0)

    def _window_blocks(self, epoch: int, k: int) -> str:
        if not self.blocks:
            return f"no block published yet of {self.where}"
        order = self.block_order(epoch)
        starts = np.concatenate([[0], np.cumsum([self.blocks[i].num_rows for i in order])])
        j = int(np.searchsorted(starts, self.stream_span(k)[0], side="right")) - 1
        return self.reader.describe(self.blocks[order[min(j, len(order) - 1)]])

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `epoch` from `start`: the window holding `start` is found from row counts alone."""
        return timed_batches(self, self._batches(epoch, start), self.prefetch_batches)

    def _lay(self, epoch: int) -> tuple[Layout, int]:
        """The layout of `epoch` and the batch index it starts at: this source's (from 0), or for an epoch
        resumed from another layout, that of its rest (ending where this source's epoch ends)."""
        if self._remap is not None and self._remap.epoch == epoch:
            return self._remap.layout, self._remap.offset
        return self, 0

    def _batches(self, epoch: int, start: int):
        current, cur_k = None, -1
        lay, offset = self._lay(epoch)
        b = max(start, offset) - offset
        while lay.num_batches is None or b < lay.num_batches:  # None: epoch 0 of unknown length
            lo = b * self.batch_size
            k = lo // self.window_rows
            if k != cur_k:
                current = None  # free this window before the next is joined and the one after is loaded
                if not self._has_window(epoch, k):
                    return
                lay = self._lay(epoch)[0]  # a stream of unknown length may have learnt it
                if lay.num_batches is not None and b >= lay.num_batches:
                    return
                if self.trim:  # before the join: trimmed later, the freed window stays resident beside the new
                    _trim()
                current, cur_k = self._window(epoch, k), k
            last = lay.num_batches is not None and b == lay.num_batches - 1
            hi = lay.range_rows if last else lo + self.batch_size
            b += 1
            wlo, perm = current[0], current[2]  # no other name may hold the window past its switch
            if perm is False:  # the window is in batch order already (a fresh copy): slices, no gather
                yield self._assemble({name: v[lo - wlo:hi - wlo] for name, v in current[1].items()})
                continue
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
            cols = apply_preprocess(self.preprocess, cols, self.name, self.reader.describe(blk))
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
        return {k: column_type(as_column(v, k, self.name)) for k, v in self._sample.items()}

    def state(self) -> dict:
        return {"kind": self.kind, **({"num_samples": self.num_samples} if self.length_known else {}),
                "batch_size": self.batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "buffer_rows": self.buffer_rows, "window_rows": self.window_rows,
                **({} if self.in_order else {"num_blocks": len(self.blocks)}),  # a Ray stream's grows
                **({"remap": {"epoch": self._remap.epoch, "levels": self._remap.levels}} if self._remap else {})}

    def resume_at(self, saved: dict) -> int:
        """The batch at which to resume the epoch of `saved` (a checkpoint's data state: its layout and
        next_batch). Under the same layout, next_batch. Under another one (world size, batch size,
        drop_last), exactly the rows that epoch had left: rebuilt from the saved layout (each old rank's
        rest of its window begun and its windows not begun) and laid out for this world as an epoch of
        their own, ending where this source's epoch ends; later epochs are this layout's."""
        epoch, nb = int(saved["epoch"]), int(saved["next_batch"])
        remap = saved.get("remap") or {}
        levels = list(remap.get("levels", [])) if remap.get("epoch") == epoch else []
        bs = int(saved.get("batch_size") or self.batch_size)
        top = {"world_size": int(saved.get("world_size") or self.world_size), "batch_size": bs,
               "window_rows": int(saved.get("window_rows") or max(1, self.buffer_rows // bs) * bs),
               "drop_last": bool(saved.get("drop_last", self.drop_last)), "next_batch": nb}
        same = all(top[k] == v for k, v in (("world_size", self.world_size), ("batch_size", self.batch_size),
                                              ("window_rows", self.window_rows), ("drop_last", self.drop_last)))
        if self._remap is not None or levels or not same:  # windows loaded ahead were of another layout
            self._remap, self._ahead = None, None
        if not same and not self._learn():  # the rest needs the count: Ray Data's pass must end first
            self.reader.wait_all()
            self._learn()
        if not same:
            levels.append(top)
        if not levels:
            return nb
        try:
            self._remap = Remap(self, epoch, levels)
        except TooFew as e:
            if e.args[0]:
                logger.warning("%s: the %d samples left of epoch %d cannot give each of %d ranks a batch; they are "
                               "skipped and epoch %d starts", self.name, e.args[0], epoch, self.world_size, epoch + 1)
            return self.num_batches
        return nb if same else self._remap.offset
