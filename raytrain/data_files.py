"""Files in: listing, Arrow -> numpy columns, and StreamSource for Parquet larger than memory.

A stream's epoch: the Parquet row groups (blocks) in a seeded order, read as one stream of rows cut
into windows of `window_rows` (a multiple of the global batch; the last window also takes the rest),
each window permuted by its own seed. Row counts come from the file metadata, so the window of any
position is found without reading data, and memory holds at most two windows (the one being batched
and the next, loaded in the background) plus the prefetched batches.
"""

from __future__ import annotations

import glob
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .data import (Columns, DataError, DataFileNotFoundError, Files, MapSource, _as_column, _column_type, _rng,
                   _timed, plan_epoch, rank_span)

_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json",
            ".jsonl": "json", ".ndjson": "json"}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")


# ---------------------------------------------------------------- listing


def list_files(spec: Files, name: str) -> tuple[list[str], str]:
    """The files of `spec.path`, sorted, and their one format; a missing path is a one-line error."""
    paths = [spec.path] if isinstance(spec.path, str) else list(spec.path)
    files: list[str] = []
    for p in map(os.path.expanduser, paths):
        if glob.has_magic(p):
            found = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
            if not found:
                raise DataFileNotFoundError(f"{name}: no files match {p!r}")
        elif os.path.isdir(p):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs
                           if not f.startswith((".", "_")) and _format_of(f))
            if not found:
                raise DataFileNotFoundError(f"{name}: directory {p!r} holds no Parquet, CSV or JSON-lines files")
        elif os.path.isfile(p):
            found = [p]
        else:
            raise DataFileNotFoundError(f"{name}: no such file or directory: {p!r}")
        files += found
    fmt = spec.format
    if fmt is None:
        for f in files:
            this = _format_of(f)
            if this is None:
                raise DataError(f"{name}: {f}: unknown format; name it *.parquet, *.csv or *.jsonl, or set "
                                "Files(format='parquet'|'csv'|'json')")
            if fmt is not None and this != fmt:
                raise DataError(f"{name}: {f} is {this} but {files[0]} is {fmt}; use one format")
            fmt = this
    if fmt not in ("parquet", "csv", "json"):
        raise DataError(f"{name}: format {fmt!r} is not one of parquet, csv, json")
    return files, fmt


def _format_of(path: str) -> str | None:
    base = path.lower()
    for c in _COMPRESSED:
        base = base.removesuffix(c)
    return _FORMATS.get(os.path.splitext(base)[1])


# ---------------------------------------------------------------- Arrow -> numpy


def table_to_numpy(table, name: str, where: str) -> dict[str, np.ndarray]:
    """Each column as a numpy array; fixed-shape list/tensor columns as one (rows, *shape) array."""
    return {f.name: column_to_numpy(table.column(i), f.name, name, where) for i, f in enumerate(table.schema)}


def column_to_numpy(col, key: str, name: str, where: str) -> np.ndarray:
    import pyarrow as pa
    if col.null_count:
        raise DataError(f"{name} ({where}): column {key!r} has {col.null_count} null values; fill or drop them "
                        "(e.g. in preprocess)")
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            col = col.chunk(0)
        elif isinstance(col.type, pa.BaseExtensionType):
            parts = [_array_to_numpy(c) for c in col.chunks]
            return np.concatenate(parts) if parts else np.empty(0)
        else:
            col = col.combine_chunks()
    return _array_to_numpy(col)


def _array_to_numpy(arr) -> np.ndarray:
    import pyarrow as pa
    t = arr.type
    if isinstance(t, pa.BaseExtensionType):
        if hasattr(arr, "to_numpy_ndarray"):  # pyarrow's fixed_shape_tensor, Ray's ArrowTensorType
            return np.asarray(arr.to_numpy_ndarray())
        return arr.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(t):
        n, size = len(arr), t.list_size
        inner = _array_to_numpy(arr.values.slice(arr.offset * size, n * size))
        return inner.reshape((n, size) + inner.shape[1:])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = np.asarray(arr.offsets)
        lens = np.diff(offsets)
        inner = _array_to_numpy(arr.values.slice(offsets[0], offsets[-1] - offsets[0]))
        if len(lens) and (lens == lens[0]).all():
            return inner.reshape((len(lens), int(lens[0])) + inner.shape[1:])
        out = np.empty(len(lens), dtype=object)
        for i, part in enumerate(np.split(inner, np.cumsum(lens)[:-1]) if len(lens) else []):
            out[i] = part
        return out
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
    return arr.to_numpy(zero_copy_only=False)


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k in parts[0]:
        arrays = [p[k] for p in parts]
        try:
            out[k] = np.concatenate(arrays)
        except ValueError:  # row shapes differ between parts: rows as objects
            out[k] = np.empty(sum(len(a) for a in arrays), dtype=object)
            out[k][:] = [row for a in arrays for row in a]
    return out


def _apply(preprocess: Callable | None, cols: dict[str, np.ndarray], name: str, where: str) -> dict:
    if preprocess is None:
        return cols
    n = len(next(iter(cols.values()))) if cols else 0
    out = preprocess(dict(cols))
    if not isinstance(out, dict) or not out:
        raise DataError(f"{name} ({where}): preprocess must return a non-empty dict of arrays, got "
                        f"{type(out).__name__}")
    out = {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in out.items()}
    bad = {k: len(v) for k, v in out.items() if len(v) != n}
    if bad:
        raise DataError(f"{name} ({where}): preprocess must keep one row per input row ({n} in), but returned "
                        f"{bad}; filter or split rows in a ray.data pipeline instead")
    return out


# ---------------------------------------------------------------- reading


def _read_table(path: str, fmt: str, columns: list[str] | None, name: str):
    import pyarrow as pa
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path, columns=columns)
        if fmt == "csv":
            import pyarrow.csv as pcsv
            parse = pcsv.ParseOptions(delimiter="\t") if path.lower().endswith(".tsv") else None
            table = pcsv.read_csv(path, parse_options=parse)
        else:
            import pyarrow.json as pjson
            table = pjson.read_json(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{name}: {path}: not readable as {fmt} ({str(e).splitlines()[0]})") from None
    return table.select([c for c in table.column_names if c in columns]) if columns is not None else table


@dataclass(frozen=True)
class Block:
    """One Parquet row group: the unit of the stream's seeded order."""

    path: str
    row_group: int
    num_rows: int


def parquet_blocks(files: list[str], name: str, columns: list[str] | None):
    """(blocks, column names, uncompressed bytes of the read columns), from the file footers only."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    blocks, names, first, nbytes = [], None, None, 0
    for f in files:
        try:
            meta, schema = pq.read_metadata(f), pq.read_schema(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{name}: {f}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
        _register_extension_types(schema)
        if names is None:
            names, first, first_schema = schema.names, f, schema
        elif not schema.equals(first_schema, check_metadata=False):
            raise DataError(f"{name}: {f}: {_schema_diff(first_schema, schema)} (unlike {first}); all files need "
                            "the same columns and types")
        keep = set(columns if columns is not None else schema.names)
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            if rg.num_rows:
                blocks.append(Block(f, g, rg.num_rows))
                nbytes += sum(rg.column(i).total_uncompressed_size for i in range(rg.num_columns)
                              if rg.column(i).path_in_schema.split(".")[0] in keep)
    return blocks, names, nbytes


def _schema_diff(a, b) -> str:
    for field in a:
        if field.name not in b.names:
            return f"column {field.name!r} is missing"
        other = b.field(field.name)
        if other.type != field.type:
            return f"column {field.name!r} is {other.type}, not {field.type}"
    extra = [n for n in b.names if n not in a.names]
    return f"column {extra[0]!r} is extra" if extra else "the schema differs"


def _register_extension_types(schema) -> None:
    """Parquet written from Ray Data stores tensor columns as Ray's extension type: register it first."""
    if any(f.metadata and b"ray.data" in b"".join(f.metadata.values()) for f in schema) or \
            b"ray.data" in str(schema).encode():
        try:
            import ray.data._internal.tensor_extensions.arrow  # noqa: F401  (registers the types)
        except ImportError:
            pass


# ---------------------------------------------------------------- the entry for files


def files_source(spec: Files, batch_size: int, *, columns: list[str] | None, prefetch_batches: int | None,
                 name: str, **kw):
    """MapSource when the files fit in memory (`spec.stream` None or False), else StreamSource (Parquet)."""
    files, fmt = list_files(spec, name)
    where = spec.path if isinstance(spec.path, str) else (files[0] if len(files) == 1 else
                                                          f"{files[0]} and {len(files) - 1} more")
    read_cols = None if spec.preprocess is not None else columns
    if fmt != "parquet":
        size = sum(os.path.getsize(f) for f in files)
        if spec.stream or size > spec.in_memory_bytes:
            raise DataError(f"{name} ({where}): {fmt} files ({size / 2**20:.0f} MiB) are read into memory; to "
                            f"stream data larger than in_memory_bytes ({spec.in_memory_bytes / 2**20:.0f} MiB), "
                            "convert it to Parquet")
        tables = [_read_table(f, fmt, None, name) for f in files]
        return _in_memory(tables, files, spec, batch_size, prefetch_batches, name, where, **kw)
    blocks, names, nbytes = parquet_blocks(files, name, read_cols)
    if not blocks:
        raise DataError(f"{name} ({where}): the dataset is empty (0 rows in {len(files)} file(s))")
    stream = spec.stream if spec.stream is not None else nbytes > spec.in_memory_bytes
    if read_cols is not None:
        read_cols = [c for c in names if c in read_cols] or None
    if not stream:
        tables = [_read_table(f, "parquet", read_cols, name) for f in files]
        source = _in_memory(tables, files, spec, batch_size, prefetch_batches, name, where, **kw)
    else:
        source = StreamSource(blocks, spec, batch_size, read_columns=read_cols, nbytes=nbytes, name=name,
                              where=where, prefetch_batches=prefetch_batches, **kw)
    if spec.preprocess is None:
        source.all_columns = names
    return source


def _in_memory(tables, files, spec, batch_size, prefetch_batches, name, where, **kw) -> MapSource:
    parts = [_apply(spec.preprocess, table_to_numpy(t, name, f), name, f) for t, f in zip(tables, files)
             if t.num_rows]
    if not parts:
        raise DataError(f"{name} ({where}): the dataset is empty (0 rows in {len(files)} file(s))")
    cols = _concat(parts)
    pf = spec.prefetch_batches if prefetch_batches is None else prefetch_batches
    return MapSource(Columns(cols, name, where), batch_size, prefetch_batches=pf, name=name, **kw)


class StreamSource:
    """Batches of Parquet files larger than memory for one rank: seeded block order + windowed shuffle."""

    kind = "stream"

    def __init__(self, blocks: list[Block], spec: Files, batch_size: int, *, read_columns: list[str] | None,
                 nbytes: int, name: str, where: str, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1, collate_fn: Callable | None = None,
                 prefetch_batches: int | None = None):
        self.blocks, self.spec, self.name, self.where = blocks, spec, name, where
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.rank, self.world_size, self.collate_fn = rank, world_size, collate_fn
        self.prefetch_batches = spec.prefetch_batches if prefetch_batches is None else prefetch_batches
        self.read_columns, self.keep = read_columns, None
        self.num_samples = sum(b.num_rows for b in blocks)
        self._num_batches, self._used = plan_epoch(self.num_samples, batch_size, world_size, drop_last, name)
        row_bytes = max(1, nbytes // self.num_samples)
        gb = batch_size * world_size
        self.buffer_rows = max(1, spec.buffer_bytes // row_bytes)  # from the data and spec: same on resume
        self.window_rows = max(1, self.buffer_rows // gb) * gb
        self.num_windows = max(1, self.num_samples // self.window_rows)
        self._chunk_rows = int(max(1, min(65536, spec.buffer_bytes // 8 // row_bytes)))
        self._files: dict[str, Any] = {}
        self._ahead: tuple[tuple[int, int], Future] | None = None  # the window being loaded next
        self._loader: ThreadPoolExecutor | None = None
        self.wait_s = 0.0
        self.all_columns: list[str] | None = None
        first = blocks[0]
        self._sample = self._read(first, 0, min(first.num_rows, batch_size))

    def __len__(self) -> int:
        return self._num_batches

    # -- order
    def block_order(self, epoch: int) -> np.ndarray:
        n = len(self.blocks)
        return _rng(self.seed, epoch, 1).permutation(n) if self.shuffle else np.arange(n)

    def _window_range(self, k: int) -> tuple[int, int]:
        lo = k * self.window_rows
        return lo, self.num_samples if k == self.num_windows - 1 else lo + self.window_rows

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's block order and each block's first position in the epoch's stream."""
        order = self.block_order(epoch)
        return order, np.concatenate([[0], np.cumsum([self.blocks[i].num_rows for i in order])])

    def _load_window(self, epoch: int, k: int):
        order, starts = self._layout(epoch)
        wlo, whi = self._window_range(k)
        j = int(np.searchsorted(starts, wlo, side="right")) - 1
        parts = []
        while j < len(order) and starts[j] < whi:
            blk = self.blocks[order[j]]
            parts.append(self._read(blk, max(wlo, starts[j]) - starts[j], min(whi, starts[j + 1]) - starts[j]))
            j += 1
        perm = _rng(self.seed, epoch, 2, k).permutation(whi - wlo) if self.shuffle else None
        return wlo, _concat(parts), perm

    def _window(self, epoch: int, k: int):
        """Window k of `epoch` (the one loaded ahead if it is that one), and start loading the next,
        which after an epoch's last window is the next epoch's first: a boundary never stalls."""
        key, fut = self._ahead if self._ahead is not None else (None, None)
        self._ahead = None
        if self._loader is None:  # one thread per source (one malloc arena); it ends with the source
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="raytrain-window")
        if key != (epoch, k):
            fut = self._loader.submit(self._load_window, epoch, k)
        nxt = (epoch, k + 1) if k + 1 < self.num_windows else (epoch + 1, 0)
        self._ahead = (nxt, self._loader.submit(self._load_window, *nxt))
        return fut.result()

    def iter_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `epoch` from `start`: the window holding `start` is found from row counts alone."""
        return _timed(self, self._batches(epoch, start), self.prefetch_batches)

    def _batches(self, epoch: int, start: int):
        current, cur_k = None, -1
        for b in range(start, self._num_batches):
            lo, hi = rank_span(b, self._num_batches, self._used, self.batch_size, self.world_size, self.rank)
            k = min(lo // self.window_rows, self.num_windows - 1)
            if k != cur_k:
                current = None  # free this window before the one after next is loaded
                current, cur_k = self._window(epoch, k), k
            wlo, cols, perm = current
            local = np.arange(lo - wlo, hi - wlo)
            yield self._assemble(cols, perm[local] if perm is not None else local)

    # -- reading
    def _parquet(self, path: str):
        import pyarrow.parquet as pq
        pf = self._files.get(path)
        if pf is None:
            if len(self._files) >= 8:
                self._files.pop(next(iter(self._files)))
            pf = self._files[path] = pq.ParquetFile(path, pre_buffer=False)
        return pf

    def _read(self, blk: Block, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows [lo, hi) of one row group, decoded in bounded chunks, preprocessed, projected."""
        import pyarrow as pa
        pf, pos, pieces = self._parquet(blk.path), 0, []
        for rb in pf.iter_batches(batch_size=self._chunk_rows, row_groups=[blk.row_group],
                                  columns=self.read_columns, use_threads=False):
            n = rb.num_rows
            if pos + n > lo:
                s = max(lo - pos, 0)
                pieces.append(rb.slice(s, min(hi - pos, n) - s))
            pos += n
            if pos >= hi:
                break
        table = pa.Table.from_batches(pieces) if pieces else pf.schema_arrow.empty_table()
        if self.read_columns is not None and not pieces:
            table = table.select(self.read_columns)
        cols = _apply(self.spec.preprocess, table_to_numpy(table, self.name, blk.path), self.name, blk.path)
        return {k: v for k, v in cols.items() if k in self.keep} if self.keep is not None else cols

    def _assemble(self, cols: dict[str, np.ndarray], idx: np.ndarray):
        if self.collate_fn is not None:
            return self.collate_fn([{k: v[i] for k, v in cols.items()} for i in idx])
        return {k: torch.from_numpy(v[idx]) if v.dtype != object and v.dtype.kind in "biuf" else list(v[idx])
                for k, v in cols.items()}

    # -- the source interface
    def sample_batch(self):
        n = len(next(iter(self._sample.values())))
        return self._assemble(self._sample, np.arange(n))

    def raw_columns(self) -> list[str]:
        return list(self.all_columns) if self.all_columns is not None else list(self._sample)

    def select(self, names: Sequence[str]) -> None:
        self.keep = list(names)
        self._sample = {k: v for k, v in self._sample.items() if k in self.keep}
        if self.spec.preprocess is None:
            self.read_columns = self.keep

    @property
    def schema(self) -> dict[str, tuple[str, tuple | None]]:
        return {k: _column_type(_as_column(v, k, self.name)) for k, v in self._sample.items()}

    def state(self) -> dict:
        return {"kind": self.kind, "num_samples": self.num_samples, "batch_size": self.batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "buffer_rows": self.buffer_rows, "window_rows": self.window_rows,
                "num_blocks": len(self.blocks)}
