"""Columns and batches: collation, loss items, columns in memory, Arrow -> numpy, checks on schemas."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .errors import DataError

# ---------------------------------------------------------------- collation and loss items


def default_collate(items: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack a list of dict items (tensors, arrays or numbers) into a dict of batched tensors."""
    first = items[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"dataset items must be dicts of tensors (as in HF), got {type(first).__name__}")
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in first}


def count_items(batch: Mapping[str, torch.Tensor], ignore_index: int = -100) -> torch.Tensor | None:
    """The number of loss items in a batch: labels that are not ignore_index (kept on device)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if labels is None:
        return None
    if labels.is_floating_point():
        return torch.tensor(labels.shape[0], device=labels.device)
    return (labels != ignore_index).sum()


# ---------------------------------------------------------------- columns in memory


class Columns:
    """Equal-length columns in memory: numeric ones as tensors (gathered by index), others as numpy."""

    def __init__(self, columns: Mapping[str, Any], name: str = "dataset", where: str = "dict of arrays"):
        if not columns:
            raise DataError(f"{name} ({where}): it has no columns")
        self.where = where
        self.columns = {k: as_column(v, k, name) for k, v in columns.items()}
        lengths = {k: len(v) for k, v in self.columns.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"{name} ({where}): columns have different lengths {lengths}")
        self.n = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in self.columns.items()}

    def take(self, idx: torch.Tensor) -> dict[str, Any]:
        return {k: v[idx] if isinstance(v, torch.Tensor) else list(v[idx.numpy()]) for k, v in self.columns.items()}

    def rows(self, idx: torch.Tensor) -> list[dict[str, Any]]:
        cols = self.take(idx)
        return [{k: v[j] for k, v in cols.items()} for j in range(len(idx))]

    def select(self, names: Sequence[str]) -> Columns:
        out = object.__new__(Columns)
        out.where, out.n = self.where, self.n
        out.columns = {k: v for k, v in self.columns.items() if k in names}
        return out

    @property
    def schema(self) -> dict[str, tuple[str, tuple | None]]:
        return {k: column_type(v) for k, v in self.columns.items()}


def as_column(v: Any, key: str, name: str):
    """A column as kept in memory: numeric as a tensor, strings and ragged rows as a numpy array."""
    if isinstance(v, torch.Tensor):
        return v
    arr = v if isinstance(v, np.ndarray) else _asarray(v)
    if arr.dtype.kind in "biuf" or arr.dtype == np.bool_:
        return torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr))
    if arr.dtype.kind == "c":
        raise DataError(f"{name}: column {key!r} is complex ({arr.dtype}); not supported")
    return arr  # strings and ragged rows stay numpy objects: a data_collator turns them into tensors


def _asarray(v) -> np.ndarray:
    try:
        return np.asarray(v)
    except ValueError:  # ragged rows: an object array of rows
        out = np.empty(len(v), dtype=object)
        out[:] = [np.asarray(x) for x in v]
        return out


def column_type(v) -> tuple[str, tuple | None]:
    """(dtype, row shape) of a column from as_column; ("object", None) for a numpy one."""
    if isinstance(v, torch.Tensor):
        return str(v.dtype).replace("torch.", ""), tuple(v.shape[1:])
    return "object", None


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
            try:  # one conversion of the joined storage, not one per chunk (Ray Data blocks: many chunks)
                return _array_to_numpy(pa.ExtensionArray.from_storage(col.type, pa.concat_arrays(
                    [c.storage for c in col.chunks])))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError):
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


# ---------------------------------------------------------------- blocks of columns


def concat_columns(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Parts of one set of columns, joined row-wise (row shapes that differ: rows as objects)."""
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


def apply_preprocess(preprocess: Callable | None, cols: dict[str, np.ndarray], name: str, where: str) -> dict:
    """The user's preprocess on one block's columns, checked: a dict of arrays, one row per input row."""
    if preprocess is None:
        return cols
    n = len(next(iter(cols.values()))) if cols else 0
    try:
        out = preprocess(dict(cols))
    except Exception as e:  # the user's function: its message and the block it failed on, in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{name} ({where}): preprocess {getattr(preprocess, '__name__', '')} raised "
                        f"{type(e).__name__}: {msg}") from e
    if not isinstance(out, dict) or not out:
        raise DataError(f"{name} ({where}): preprocess must return a non-empty dict of arrays, got "
                        f"{type(out).__name__}")
    out = {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in out.items()}
    bad = {k: len(v) for k, v in out.items() if len(v) != n}
    if bad:
        raise DataError(f"{name} ({where}): preprocess must keep one row per input row ({n} in), but returned "
                        f"{bad}; filter or split rows in a ray.data pipeline instead")
    return out


# ---------------------------------------------------------------- checks on columns


def is_named_datasets(data) -> bool:
    """A dict of named datasets (HF's multiple eval sets), not a dict of columns: no value is array-like."""
    return isinstance(data, dict) and bool(data) and not any(
        isinstance(v, (np.ndarray, torch.Tensor, list, tuple)) or type(v).__module__.startswith("pyarrow")
        for v in data.values())


def check_same_schema(train, other, other_name: str = "eval_dataset") -> None:
    """`other`'s columns, dtypes and row shapes must match train's (the model sees both)."""
    a, b = getattr(train, "schema", None), getattr(other, "schema", None)
    if a is None or b is None:  # a torch Dataset (items not read ahead) or a loader of ready batches
        return
    where = f"{other_name} ({other.where})"
    for col, (dtype, shape) in a.items():
        if col not in b:
            raise DataError(f"{where}: column {col!r} is missing; {train.name} has it ({dtype})")
        dtype2, shape2 = b[col]
        if dtype2 != dtype or (shape is not None and shape2 is not None and shape2 != shape):
            raise DataError(f"{where}: column {col!r} is {dtype2} {list(shape2 or [])} here but {dtype} "
                            f"{list(shape or [])} in {train.name}")
    extra = [c for c in b if c not in a]
    if extra:
        raise DataError(f"{where}: column {extra[0]!r} is not in {train.name} (which has {sorted(a)})")
