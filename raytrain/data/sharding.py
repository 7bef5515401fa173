"""The sharding rule, shared by in-memory and streamed data: which rows each rank takes, and seeded orders.

Every rank takes the same number of batches, of the same sizes, and each epoch every sample is seen
exactly once across ranks. The tail: with drop_last the incomplete global batch is dropped (on every
rank alike); without it, a final global batch of `rest` samples becomes one more batch if
rest >= world_size, and otherwise (some rank would get an empty batch) joins the previous global
batch, so a rank's last batch may be one sample larger. Fewer samples than ranks is an error.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError


def plan_epoch(num_samples: int, batch_size: int, world_size: int, drop_last: bool, name: str = "dataset"):
    """(batches per rank, samples used per epoch) under the sharding rule (the module docstring)."""
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


def seeded_rng(*keys: int) -> np.random.Generator:
    """A generator seeded by a tuple of ints (seed, epoch, ...): distinct tuples, independent streams."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in keys])))


class Layout:
    """Where one rank's rows of an epoch lie in a stream of `n` rows (the sharding rule, cut into windows):
    each rank one contiguous range, or (`interleaved`, Ray) windows in groups of world_size. Depends only
    on these numbers; a resume on another world size rebuilds the interrupted run's layouts from them."""

    def __init__(self, n: int, batch_size: int, world_size: int, rank: int, drop_last: bool, window_rows: int,
                 interleaved: bool, name: str = "dataset"):
        self.batch_size, self.world_size, self.rank, self.window_rows = batch_size, world_size, rank, window_rows
        self.in_order = interleaved
        self.num_batches, self._used = plan_epoch(n, batch_size, world_size, drop_last, name)
        # This rank's range of the epoch's stream: the rows the sharding rule gives each rank before it.
        sizes = [self._rank_rows(r) for r in range(world_size)]
        self.range_start, self.range_rows = sum(sizes[:rank]), sizes[rank]
        # Windows by the batches' first rows (the last batch may be one row longer): the last may be short.
        self.num_windows = (self.num_batches - 1) * batch_size // window_rows + 1

    def _rank_rows(self, r: int) -> int:
        lo, hi = rank_span(self.num_batches - 1, self.num_batches, self._used, self.batch_size,
                           self.world_size, r)
        return (self.num_batches - 1) * self.batch_size + (hi - lo)

    def _last(self, k: int) -> bool:
        return self.num_windows is not None and k == self.num_windows - 1  # None: a count not known yet

    def window_range(self, k: int) -> tuple[int, int]:
        """Window k's rows in this rank's local order: [lo, hi) from the start of the rank's range."""
        lo = k * self.window_rows
        return lo, self.range_rows if self._last(k) else lo + self.window_rows

    def stream_span(self, k: int) -> tuple[int, int]:
        """Window k's rows as positions [lo, hi) in the epoch's stream. Contiguous: each rank one range of
        the stream. Interleaved (Ray): windows in groups of world_size, rank r the r-th of each group; the
        last (short) windows of all ranks follow each other, so the ranks' rows still tile the stream."""
        wlo, whi = self.window_range(k)
        if not self.in_order:
            return self.range_start + wlo, self.range_start + whi
        w, ws = self.window_rows, self.world_size
        if not self._last(k):
            lo = (k * ws + self.rank) * w
            return lo, lo + w
        tail = (self.num_windows - 1) * w  # rows before the last window, the same on every rank
        lo = tail * ws + sum(self._rank_rows(r) - tail for r in range(self.rank))
        return lo, lo + whi - wlo


def window_perm(src, epoch: int, level: int, world_size: int, rank: int, k: int, n: int) -> np.ndarray | None:
    """The shuffle of one window: seeded by (seed, epoch, world size, rank, window) and, for the layout of a
    resumed epoch's rest, its level (how many layouts that epoch was interrupted under)."""
    if not src.shuffle:
        return None
    keys = (2,) if level == 0 else (3, level)
    return seeded_rng(src.seed, epoch, *keys, world_size, rank, k).permutation(n)
