"""The rest of a stream's epoch interrupted under another layout (world size, batch size, drop_last).

StreamSource.resume_at rebuilds, from the saved layouts alone, the rows each old rank had left (the
unread rows of the window it was in, and the windows it had not begun); `Remap` lays them out for the
new world as a stream of their own (stream.py's docstring says how).
"""

from __future__ import annotations

import numpy as np

from .sharding import Layout, plan_epoch, window_perm


class TooFew(Exception):
    """A resumed epoch's rest has fewer samples than the new world needs for one batch on every rank."""


def _plen(piece) -> int:
    return piece[1] - piece[0] if isinstance(piece, tuple) else len(piece)


class _Rest:
    """Positions of an epoch's stream in ascending order, as pieces: spans (lo, hi) (windows no rank had
    begun) and arrays of positions (the unread rows of a window begun: at most one window each)."""

    def __init__(self, pieces: list):
        merged: list = []
        for p in sorted((p for p in pieces if _plen(p)), key=lambda p: int(p[0])):
            if merged and isinstance(p, tuple) and isinstance(merged[-1], tuple) and merged[-1][1] == p[0]:
                merged[-1] = (merged[-1][0], p[1])
            else:
                merged.append(p)
        self.pieces = merged
        self.cum = np.concatenate([[0], np.cumsum([_plen(p) for p in merged], dtype=np.int64)])
        self.n = int(self.cum[-1])

    def slice(self, a: int, b: int) -> list:
        """The pieces of rest rows [a, b)."""
        out, i = [], int(np.searchsorted(self.cum, a, side="right")) - 1
        while i < len(self.pieces) and self.cum[i] < b:
            p, lo, hi = self.pieces[i], max(a, self.cum[i]) - self.cum[i], min(b, self.cum[i + 1]) - self.cum[i]
            out.append((p[0] + int(lo), p[0] + int(hi)) if isinstance(p, tuple) else p[lo:hi])
            i += 1
        return out

    def positions(self, a: int, b: int) -> np.ndarray:
        return np.concatenate([np.arange(*p, dtype=np.int64) if isinstance(p, tuple) else p
                               for p in self.slice(a, b)])

    def take(self, v: np.ndarray) -> np.ndarray:
        """The stream positions of ascending rest rows `v`."""
        if not len(v):
            return v.astype(np.int64)
        return self.positions(int(v[0]), int(v[-1]) + 1)[v - v[0]]


def _rest_after(src, epoch: int, level: int, base: _Rest, lv: dict) -> _Rest:
    """What `base` (an epoch's rows) had left when its layout `lv` was interrupted at lv["next_batch"]:
    for each of its ranks, the unread rows of the window it was in and the windows it had not begun."""
    full = plan_epoch(src.num_samples, lv["batch_size"], lv["world_size"], lv["drop_last"], src.name)[0]
    pieces: list = []
    for r in range(lv["world_size"]):
        lay = Layout(base.n, lv["batch_size"], lv["world_size"], r, lv["drop_last"], lv["window_rows"],
                     src.in_order, src.name)
        done = lv["next_batch"] - (full - lay.num_batches)  # the batches this layout's epoch had given
        rows = lay.range_rows if done >= lay.num_batches else max(0, done) * lay.batch_size
        if rows >= lay.range_rows:
            continue
        k = rows // lay.window_rows
        (wlo, whi), (glo, _) = lay.window_range(k), lay.stream_span(k)
        perm = window_perm(src, epoch, level, lay.world_size, r, k, whi - wlo)
        left = perm[rows - wlo:] if perm is not None else np.arange(rows - wlo, whi - wlo)
        pieces.append(base.take(np.sort(left) + glo))
        for j in range(k + 1, lay.num_windows):
            pieces += base.slice(*lay.stream_span(j))
    return _Rest(pieces)


class Remap:
    """The layout of an epoch resumed under another layout: the rows its interrupted layouts (`levels`,
    oldest first) had left, as a stream of their own in ascending order, cut by the sharding rule for this
    source's world and batch size; its batches end where the source's epoch ends (offset)."""

    def __init__(self, src, epoch: int, levels: list[dict]):
        rest = _Rest([(0, src.num_samples)])
        for i, lv in enumerate(levels):
            rest = _rest_after(src, epoch, i, rest, lv)
        need = src.batch_size * src.world_size if src.drop_last else src.world_size
        if rest.n < need:
            raise TooFew(rest.n)
        self.epoch, self.levels, self.rest, self.level = epoch, levels, rest, len(levels)
        self.layout = Layout(rest.n, src.batch_size, src.world_size, src.rank, src.drop_last, src.window_rows,
                             src.in_order, src.name)
        self.offset = src.num_batches - self.layout.num_batches

    def load(self, src, k: int):
        """Window k of the rest, as StreamSource loads a window: (first local row, [columns], its shuffle)."""
        lay = self.layout
        wlo, whi = lay.window_range(k)
        cols = src.read_positions(self.epoch, self.rest.positions(*lay.stream_span(k)))
        return wlo, [cols], window_perm(src, self.epoch, self.level, lay.world_size, lay.rank, k, whi - wlo)
