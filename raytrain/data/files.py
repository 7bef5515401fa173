"""Files in: listing, reading, and the block readers StreamSource streams them with (files_source).

Parquet: a block is a row group, counted from the file footers without reading data. CSV and JSON
lines: a block is a file, counted in one streaming pass when the source is built. Either way the
stream's order, sharding, windows and resume are stream.StreamSource's (one design for all).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .columns import Columns, apply_preprocess, concat_columns, table_to_numpy
from .errors import DataError, DataFileNotFoundError
from .sources import Files, MapSource
from .stream import StreamSource

_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json",
            ".jsonl": "json", ".ndjson": "json"}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")


# ---------------------------------------------------------------- listing


def _fs(uri: str):
    """(pyarrow filesystem, its path) of a URI (s3://, gs://, hdfs://, file://): what pyarrow accepts."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise DataFileNotFoundError(f"{uri}: pyarrow cannot open this URI ({str(e).splitlines()[0]})") from None


def _source(path: str, random_access: bool = True):
    """What pyarrow's readers take: a local path as it is, a URI as a file opened through pyarrow.fs."""
    if "://" not in path:
        return path
    fs, inner = _fs(path)
    return fs.open_input_file(inner) if random_access else fs.open_input_stream(inner, compression="detect")


def _size(path: str) -> int:
    if "://" not in path:
        return os.path.getsize(path)
    fs, inner = _fs(path)
    return fs.get_file_info(inner).size or 0


def _list_uri(uri: str, name: str) -> list[str]:
    """A URI's files: the file, a directory's data files (recursively), or a glob's matches in its folder."""
    import fnmatch

    import pyarrow.fs as pafs
    fs, inner = _fs(uri)
    scheme = uri[:uri.index("://") + 3]
    if glob.has_magic(inner):
        folder = inner[:inner.rfind("/", 0, min(inner.find(c) for c in "*?[" if c in inner))]
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive="**" in inner, allow_not_found=True))
        found = sorted(scheme + i.path for i in infos
                       if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, inner))
        if not found:
            raise DataFileNotFoundError(f"{name}: no files match {uri!r}")
        return found
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.File:
        return [uri]
    if info.type != pafs.FileType.Directory:
        raise DataFileNotFoundError(f"{name}: no such file or directory: {uri!r}")
    found = sorted(scheme + i.path for i in fs.get_file_info(pafs.FileSelector(inner, recursive=True))
                   if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_")) and _format_of(i.path))
    if not found:
        raise DataFileNotFoundError(f"{name}: directory {uri!r} holds no Parquet, CSV or JSON-lines files")
    return found


def list_files(spec: Files, name: str) -> tuple[list[str], str]:
    """The files of `spec.path`, sorted, and their one format; a missing path is a one-line error. URIs
    (s3://, gs://, file://, ...) are listed and read through pyarrow.fs."""
    paths = [spec.path] if isinstance(spec.path, str) else list(spec.path)
    files: list[str] = []
    for p in map(os.path.expanduser, paths):
        if "://" in p:
            found = _list_uri(p, name)
        elif glob.has_magic(p):
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


# ---------------------------------------------------------------- reading


def _read_table(path: str, fmt: str, columns: list[str] | None, name: str):
    import pyarrow as pa
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq
            return pq.read_table(_source(path), columns=columns)
        if fmt == "csv":
            import pyarrow.csv as pcsv
            parse = pcsv.ParseOptions(delimiter="\t") if path.lower().endswith(".tsv") else None
            table = pcsv.read_csv(_source(path, False), parse_options=parse)
        else:
            import pyarrow.json as pjson
            table = pjson.read_json(_source(path, False))
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
            footer = pq.ParquetFile(_source(f))  # one open and one footer read, local or remote
            meta, schema = footer.metadata, footer.schema_arrow
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


# ---------------------------------------------------------------- stream readers


class ParquetReader:
    """Blocks = Parquet row groups (from the footers); reads rows of one in bounded chunks, projected."""

    def __init__(self, blocks: list[Block], columns: list[str] | None, chunk_rows: int, name: str, where: str):
        self.blocks, self.read_columns, self.chunk_rows = blocks, columns, chunk_rows
        self.name, self.where = name, where
        self._files: dict[str, Any] = {}

    def project(self, columns: list[str]) -> None:
        self.read_columns = list(columns)

    def describe(self, blk: Block) -> str:
        return f"{blk.path} row group {blk.row_group}"

    def _parquet(self, path: str):
        import pyarrow.parquet as pq
        pf = self._files.get(path)
        if pf is None:
            if len(self._files) >= 8:
                self._files.pop(next(iter(self._files)))
            pf = self._files[path] = pq.ParquetFile(_source(path), pre_buffer=False)
        return pf

    def read(self, blk: Block, lo: int, hi: int) -> dict[str, np.ndarray]:
        import pyarrow as pa
        pf = self._parquet(blk.path)
        pieces = _rows(pf.iter_batches(batch_size=self.chunk_rows, row_groups=[blk.row_group],
                                       columns=self.read_columns, use_threads=False), lo, hi)
        table = pa.Table.from_batches(pieces) if pieces else pf.schema_arrow.empty_table()
        if self.read_columns is not None and not pieces:
            table = table.select(self.read_columns)
        return table_to_numpy(table, self.name, blk.path)


@dataclass(frozen=True)
class FileBlock:
    """One CSV or JSON-lines file: the unit of the stream's order (text has no row groups)."""

    path: str
    num_rows: int


class TextReader:
    """Blocks = CSV / JSON-lines files, row counts from one streaming pass; rows [lo, hi) of a file are read
    with Arrow's streaming reader, so memory holds the rows asked for, not the file."""

    def __init__(self, files: list[str], fmt: str, name: str, where: str):
        self.fmt, self.name, self.where = fmt, name, where
        self.blocks: list[FileBlock] = []
        first = None
        for f in files:
            reader = self._open(f)
            if first is None:
                first, first_path = reader.schema, f
            elif not reader.schema.equals(first):
                raise DataError(f"{name}: {f}: {_schema_diff(first, reader.schema)} (unlike {first_path}); all files "
                                "need the same columns and types")
            n = sum(b.num_rows for b in self._batches(reader, f))
            if n:
                self.blocks.append(FileBlock(f, n))
        self.schema = first
        self.nbytes = sum(_size(b.path) for b in self.blocks)

    def describe(self, blk: FileBlock) -> str:
        return blk.path

    def _open(self, path: str):
        import pyarrow as pa
        try:
            if self.fmt == "csv":
                import pyarrow.csv as pcsv
                parse = pcsv.ParseOptions(delimiter="\t") if path.lower().endswith(".tsv") else None
                convert = pcsv.ConvertOptions(column_types=self.schema) if getattr(self, "schema", None) else None
                return pcsv.open_csv(_source(path, False), parse_options=parse, convert_options=convert)
            import pyarrow.json as pjson
            explicit = getattr(self, "schema", None)
            return pjson.open_json(_source(path, False), parse_options=pjson.ParseOptions(explicit_schema=explicit)
                                   if explicit is not None else None)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{self.name}: {path}: not readable as {self.fmt} ({str(e).splitlines()[0]})") from None

    def _batches(self, reader, path: str):
        import pyarrow as pa
        try:
            yield from reader
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{self.name}: {path}: not readable as {self.fmt} ({str(e).splitlines()[0]})") from None

    def read(self, blk: FileBlock, lo: int, hi: int) -> dict[str, np.ndarray]:
        import pyarrow as pa
        reader = self._open(blk.path)
        pieces = _rows(self._batches(reader, blk.path), lo, hi)
        table = pa.Table.from_batches(pieces, schema=reader.schema)
        return table_to_numpy(table, self.name, blk.path)


# ---------------------------------------------------------------- the entry for files


def files_source(spec: Files, batch_size: int, *, columns: list[str] | None, prefetch_batches: int | None,
                 name: str, **kw):
    """MapSource when the files fit in memory (`spec.stream` None or False), else a StreamSource: Parquet
    row groups or CSV/JSON files as its blocks."""
    files, fmt = list_files(spec, name)
    where = spec.path if isinstance(spec.path, str) else (files[0] if len(files) == 1 else
                                                          f"{files[0]} and {len(files) - 1} more")
    read_cols = None if spec.preprocess is not None else columns
    pf = spec.prefetch_batches if prefetch_batches is None else prefetch_batches
    if fmt != "parquet":
        size = sum(_size(f) for f in files)
        if not (spec.stream or (spec.stream is None and size > spec.in_memory_bytes)):
            tables = [_read_table(f, fmt, None, name) for f in files]
            return _in_memory(tables, files, spec, batch_size, prefetch_batches, name, where, **kw)
        reader = TextReader(files, fmt, name, where)
        if not reader.blocks:
            raise DataError(f"{name} ({where}): the dataset is empty (0 rows in {len(files)} file(s))")
        return StreamSource(reader, batch_size, nbytes=reader.nbytes, buffer_bytes=spec.buffer_bytes, name=name,
                            prefetch_batches=pf, preprocess=spec.preprocess, **kw)
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
        row_bytes = max(1, nbytes // sum(b.num_rows for b in blocks))
        chunk = int(max(1, min(65536, spec.buffer_bytes // 8 // row_bytes)))
        reader = ParquetReader(blocks, read_cols, chunk, name, where)
        source = StreamSource(reader, batch_size, nbytes=nbytes, buffer_bytes=spec.buffer_bytes, name=name,
                              prefetch_batches=pf, preprocess=spec.preprocess, **kw)
    if spec.preprocess is None:
        source.all_columns = names
    return source


def _in_memory(tables, files, spec, batch_size, prefetch_batches, name, where, **kw) -> MapSource:
    parts = [apply_preprocess(spec.preprocess, table_to_numpy(t, name, f), name, f) for t, f in zip(tables, files)
             if t.num_rows]
    if not parts:
        raise DataError(f"{name} ({where}): the dataset is empty (0 rows in {len(files)} file(s))")
    cols = concat_columns(parts)
    pf = spec.prefetch_batches if prefetch_batches is None else prefetch_batches
    return MapSource(Columns(cols, name, where), batch_size, prefetch_batches=pf, name=name, **kw)


def _rows(batches, lo: int, hi: int) -> list:
    """Rows [lo, hi) of a block read as record batches: slices of those batches, reading no further."""
    pos, pieces = 0, []
    for rb in batches:
        n = rb.num_rows
        if pos + n > lo:
            s = max(lo - pos, 0)
            pieces.append(rb.slice(s, min(hi - pos, n) - s))
        pos += n
        if pos >= hi:
            break
    return pieces
