"""Checkpoints as a contract: layout, atomic write, manifest + sha256, verification, rotation, loading.

A checkpoint `output_dir/checkpoint-N/` is written into `.tmp-checkpoint-N/` and renamed into place
only after every file and, last, `manifest.json` (sizes and sha256 of every file) are on disk. So a
crash at any instant leaves at most one complete new checkpoint, never a half-written one. Every
file is hashed while it is written (no second read), fsynced, and verified against the manifest
before anything is loaded from it. Weights are safetensors; everything pickled is loaded with
`weights_only=True`, so a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import struct
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
PREFIX = "checkpoint"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TRAINER_STATE = "trainer_state.json"
MAX_SHARD_BYTES = 5 * 1024**3
_CKPT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_TMP_RE = re.compile(rf"^\.tmp-{PREFIX}-\d+$|^{PREFIX}-\d+\.replaced$")
_CHUNK = 16 << 20  # bytes handed to write() / the hasher at a time
# Test hook: "FLAGFILE" or "FLAGFILE@STEP". The writer creates FLAGFILE and blocks forever once every
# file of the checkpoint (of step STEP, or of any step) is in the temporary directory but before the
# manifest is written, so that a test can kill the process mid-save.
PAUSE_ENV = "RAYTRAIN_TEST_PAUSE_IN_SAVE"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or unsafe; the message names the file."""


# ---------------------------------------------------------------- files, each hashed as it is written


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _start_writeback(f, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range to disk now (it stays cached), so that the fsync
    at the end of the file waits for little: disk I/O overlaps the writing and hashing that follow."""
    if nbytes >= 1 << 20 and hasattr(os, "posix_fadvise"):
        f.flush()
        try:
            os.posix_fadvise(f.fileno(), offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class _HashingFile:
    """A binary file opened for writing whose bytes are hashed on the way through; close() fsyncs and
    returns the manifest entry {"size", "sha256"}. torch.save writes into it like any file.

    parallel: a helper thread hashes while the next bytes are written (the buffers are copied, since
    they may be reused once write returns; at most `_PENDING` wait). Otherwise the hash runs inline,
    with no copy and no extra thread: the choice of a background save, which should take as little
    CPU from training as it can."""

    _PENDING = 4

    def __init__(self, path: str, parallel: bool = True):
        self._f = open(path, "wb")
        self._h = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="raytrain-sha256") if parallel else None
        self._pending: deque[Future] = deque()
        self.size = 0

    def write(self, data) -> int:
        if self._hasher is None:
            self._h.update(data)  # releases the GIL on large buffers
        else:
            if len(self._pending) >= self._PENDING:
                self._pending.popleft().result()
            self._pending.append(self._hasher.submit(self._h.update, bytes(data)))
        n = self._f.write(data)
        _start_writeback(self._f, self.size, n)
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> dict:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"size": self.size, "sha256": self._h.hexdigest()}


def _write_chunks(path: str, chunks: Iterable, parallel: bool = True) -> dict:
    """Write byte chunks (which must stay alive and unchanged until return) and hash the same memory,
    in a helper thread when `parallel`, so the sha256 costs no second pass; fsync; return the
    manifest entry."""
    h, size = hashlib.sha256(), 0
    hasher = ThreadPoolExecutor(1, thread_name_prefix="raytrain-sha256") if parallel else None
    try:
        with open(path, "wb") as f:
            for chunk in chunks:
                if hasher is None:
                    h.update(chunk)
                else:
                    hasher.submit(h.update, chunk)  # one worker: updates run in order
                f.write(chunk)
                _start_writeback(f, size, len(chunk))
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if hasher is not None:
            hasher.shutdown(wait=True)
    return {"size": size, "sha256": h.hexdigest()}


def _save_pickle(obj: Any, path: str, parallel: bool = True) -> dict:
    f = _HashingFile(path, parallel)
    try:
        torch.save(obj, f)
    finally:
        entry = f.close()
    return entry


def _write_json(obj: Any, path: str) -> dict:
    text = obj if isinstance(obj, str) else json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return _write_chunks(path, [text.encode("utf-8")])


# ---------------------------------------------------------------- weights (safetensors)

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2"}


def _dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share storage (tied weights): keep one, record aliases."""
    seen: dict[tuple, str] = {}
    out, aliases = {}, {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t.detach().contiguous()
    return out, aliases


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str],
                       parallel: bool = True) -> dict:
    """The safetensors format (8-byte header length, JSON header, raw little-endian data, largest
    dtypes first so every tensor is aligned), streamed from the tensors' memory and hashed in
    parallel. Anything unusual (a dtype outside the common set) goes through save_file instead."""
    if sys.byteorder != "little" or any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        save_file(tensors, path, metadata=metadata)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        return {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    flat = [tensors[n].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for n in names]

    def chunks():
        yield struct.pack("<Q", len(head)) + head
        for arr in flat:
            for start in range(0, len(arr), _CHUNK):
                yield memoryview(arr[start:start + _CHUNK])

    return _write_chunks(path, chunks(), parallel)


def _write_weights(state: dict[str, torch.Tensor], directory: str, max_shard_bytes: int | None = None,
                   parallel: bool = True) -> dict:
    """Write weights as model.safetensors, or above max_shard_bytes as model-0000i-of-0000n.safetensors
    shards plus model.safetensors.index.json; return {file name: manifest entry}."""
    max_shard_bytes = MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    tensors, aliases = _dedupe_shared(state)
    meta = {"format": "pt", "aliases": json.dumps(aliases, sort_keys=True)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        return {WEIGHTS: _write_safetensors(tensors, os.path.join(directory, WEIGHTS), meta, parallel)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    entries, weight_map = {}, {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        entries[fname] = _write_safetensors(shard, os.path.join(directory, fname), meta, parallel)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": total, "aliases": aliases}, "weight_map": weight_map}
    entries[WEIGHTS_INDEX] = _write_json(index, os.path.join(directory, WEIGHTS_INDEX))
    return entries


def save_weights(state: dict[str, torch.Tensor], directory: str, max_shard_bytes: int | None = None) -> list[str]:
    """Write weights as model.safetensors, or as shards plus an index above max_shard_bytes;
    return the file names written."""
    return list(_write_weights(state, directory, max_shard_bytes))


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """Load model.safetensors or its shards (with tied-weight aliases restored), on CPU."""
    from safetensors import safe_open

    single = os.path.join(directory, WEIGHTS)
    index_path = os.path.join(directory, WEIGHTS_INDEX)
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
            files = [os.path.join(directory, n) for n in sorted(set(index["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index_path}: not a valid weights index ({e})") from e
    else:
        raise CheckpointError(f"{single}: missing (no {WEIGHTS} and no {WEIGHTS_INDEX})")
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for path in files:
        try:
            state.update(load_file(path))
            with safe_open(path, "pt") as f:
                aliases.update(json.loads((f.metadata() or {}).get("aliases", "{}")))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    for alias, target in aliases.items():
        state[alias] = state[target]
    return state


def load_pickle(path: str) -> Any:
    """torch.load with weights_only=True: tensors and plain containers only, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it contains pickled objects other than tensors and plain "
            f"data, which could run code ({str(e).splitlines()[0]})") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e


# ---------------------------------------------------------------- the payload and its writer


@dataclass
class CheckpointPayload:
    """What one rank writes: weights (rank 0, already consolidated and on CPU), pickled state
    (optimizer, scheduler, RNG...), JSON documents, and a hook for backend-sharded state."""

    weights: dict[str, torch.Tensor] | None = None
    pickles: dict[str, Any] = field(default_factory=dict)
    jsons: dict[str, Any] = field(default_factory=dict)
    sharded_writer: Callable[[str], None] | None = None  # runs synchronously, on every rank
    extra_files: Callable[[str], None] | None = None     # rank 0's small files (HF config, tokenizer), synchronously


def _to_host(obj: Any, memo: dict | None = None) -> Any:
    """A deep copy with every tensor copied to CPU memory, so training may go on mutating the
    originals. Sharing is kept: tensors that shared storage share it (tied weights, views), and an
    object met twice is copied once (pickle memoizes by identity: optimizer param_groups share one
    `betas` tuple), so what is written from the copy is byte-identical to the originals."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)][1]
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            copy = t.to("cpu", copy=True)
        else:
            key = ("storage", t.device, storage.data_ptr())
            if key not in memo:
                memo[key] = (None, storage.cpu() if t.device.type != "cpu" else storage.clone())
            copy = torch.empty(0, dtype=t.dtype).set_(memo[key][1], t.storage_offset(), t.size(), t.stride())
    elif isinstance(obj, dict):
        copy = type(obj)((k, _to_host(v, memo)) for k, v in obj.items())
    elif isinstance(obj, list):
        copy = [_to_host(v, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [_to_host(v, memo) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            copy = obj  # immutable and holds no tensor: the object itself
        else:
            copy = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        return obj
    memo[id(obj)] = (obj, copy)  # keeps obj alive so that its id is not reused
    return copy


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


class CheckpointWriter:
    """Writes checkpoints atomically, optionally in a background thread (save_async).

    In distributed runs every rank writes its own files into the shared temporary directory; after
    a barrier rank 0 writes the manifest and renames. `barrier` is the strategy's barrier.
    """

    def __init__(self, output_dir: str, *, rank: int = 0, world_size: int = 1, strategy: str = "single",
                 barrier: Callable[[], None] = lambda: None, save_async: bool = False,
                 max_shard_bytes: int | None = None):
        self.output_dir = output_dir
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.barrier = barrier
        self.max_shard_bytes = max_shard_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-ckpt") if save_async else None
        self._pending: Future | None = None

    def save(self, step: int, payload: CheckpointPayload, after: Callable[[str], None] | None = None) -> str:
        """Write checkpoint-{step}; with save_async, return once the state is copied to host memory
        (the write and `after` then run in the background). `after(path)` runs on rank 0 once the
        checkpoint is complete (rotation)."""
        self.wait()
        final = checkpoint_dir(self.output_dir, step)
        tmp = os.path.join(self.output_dir, f".tmp-{PREFIX}-{step}")
        if self.rank == 0:
            _remove_stale_temporaries(self.output_dir)  # leftovers of crashed saves
            os.makedirs(tmp)
        self.barrier()
        if payload.sharded_writer is not None:
            payload.sharded_writer(tmp)
        if payload.extra_files is not None and self.rank == 0:
            payload.extra_files(tmp)  # hashed into the manifest when the checkpoint is sealed
        if self._pool is None or self.world_size > 1:
            # Distributed saves stay synchronous: the rename needs a barrier on the main thread.
            self._write(step, tmp, final, payload, after)
        else:
            memo: dict = {}
            host = CheckpointPayload(_to_host(payload.weights, memo), _to_host(payload.pickles, memo),
                                     _to_host(payload.jsons, memo))
            self._pending = self._pool.submit(self._write, step, tmp, final, host, after)
        return final

    def wait(self) -> None:
        """Block until a background save finishes; re-raise its error (never swallowed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as e:
                raise CheckpointError(f"background checkpoint write failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()

    def _write(self, step: int, tmp: str, final: str, payload: CheckpointPayload, after=None) -> None:
        entries: dict[str, dict] = {}
        parallel = self._pool is None  # a background save hashes inline: fewer threads taking CPU
        if payload.weights is not None:
            entries.update(_write_weights(payload.weights, tmp, self.max_shard_bytes, parallel=parallel))
        for name, obj in payload.pickles.items():
            entries[name] = _save_pickle(obj, os.path.join(tmp, name), parallel)
        for name, obj in payload.jsons.items():
            entries[name] = _write_json(obj, os.path.join(tmp, name))
        _maybe_pause(tmp, step)
        self.barrier()
        if self.rank == 0:
            self._seal(step, tmp, final, entries)
            if after is not None:
                after(final)
        self.barrier()

    def _seal(self, step: int, tmp: str, final: str, entries: dict[str, dict]) -> None:
        """Write the manifest (files hashed while written are not read again), then rename."""
        files = {}
        for root, _, names in os.walk(tmp):
            for name in names:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, tmp)
                entry = entries.get(rel)
                if entry is None or entry["size"] != os.path.getsize(path):
                    with open(path, "rb+") as f:  # written by another rank or a backend
                        os.fsync(f.fileno())
                    entry = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
                files[rel] = entry
        manifest = {"format_version": FORMAT_VERSION, "global_step": step, "world_size": self.world_size,
                    "strategy": self.strategy, "files": dict(sorted(files.items()))}
        _write_json(manifest, os.path.join(tmp, MANIFEST))
        _fsync_dir(tmp)
        if os.path.exists(final):
            # Only reached when a step is saved again (a re-run over an old output_dir): move the old
            # one aside first, so that a crash between the renames leaves a complete copy behind.
            old = final + ".replaced"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.output_dir)


def _remove_stale_temporaries(output_dir: str) -> None:
    """A writer saves one checkpoint at a time, so any temporary directory left in output_dir when
    a save starts belongs to a save that crashed: remove it."""
    for name in os.listdir(output_dir):
        if _TMP_RE.match(name):
            logger.info("removing %s, left by an interrupted save", os.path.join(output_dir, name))
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def _maybe_pause(tmp: str, step: int) -> None:
    value = os.environ.get(PAUSE_ENV)
    if not value:
        return
    flag, sep, at = value.rpartition("@")
    if not (sep and at.isdigit()):
        flag, at = value, ""
    if at and int(at) != step:
        return
    with open(flag, "w") as f:
        f.write(tmp)
    threading.Event().wait()  # the test kills the process here


# ---------------------------------------------------------------- verify, find, rotate


def is_weights_file(rel: str) -> bool:
    return rel in (WEIGHTS, WEIGHTS_INDEX) or bool(re.fullmatch(r"model-\d+-of-\d+\.safetensors", rel))


def weights_resaved_elsewhere(path: str) -> bool:
    """Whether the weights in `path` load and were written by another tool (save_pretrained): raytrain
    records tied-weight aliases in every weights file's metadata, others do not."""
    from safetensors import safe_open

    names = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    try:
        load_weights(path)
        for name in names:
            with safe_open(os.path.join(path, name), "pt") as f:
                if "aliases" in (f.metadata() or {}):
                    return False
    except (CheckpointError, SafetensorError, OSError):
        return False
    return bool(names)


def verify_checkpoint(path: str, ignore_weights: bool = False) -> dict:
    """Check a checkpoint against its manifest (every file present, same size, same sha256, json
    parsable; weights and trainer_state.json included); return the manifest or raise a
    CheckpointError naming the bad file and the reason. ignore_weights skips the weights files (for
    a checkpoint whose weights were re-saved, e.g. by save_pretrained, and are checked by loading)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory (it does not exist or is a file)")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{mpath}: missing (the checkpoint was never completed)")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
        version = manifest["format_version"]
        if not isinstance(files, dict) or not all(isinstance(m, dict) for m in files.values()):
            raise TypeError("'files' is not a mapping of file -> {size, sha256}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{mpath}: unparsable manifest ({type(e).__name__}: {e})") from e
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {version!r} is newer than this raytrain reads "
                              f"({FORMAT_VERSION}); upgrade raytrain")
    for required in (WEIGHTS if WEIGHTS_INDEX not in files else WEIGHTS_INDEX, TRAINER_STATE):
        if required not in files and not (ignore_weights and is_weights_file(required)):
            raise CheckpointError(f"{os.path.join(path, required)}: missing (not in the manifest)")
    for rel, meta in files.items():
        if ignore_weights and is_weights_file(rel):
            continue
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (listed in the manifest)")
        size = os.path.getsize(fpath)
        if size != meta.get("size"):
            raise CheckpointError(f"{fpath}: size {size} bytes, the manifest says {meta.get('size')} (truncated?)")
        if sha256_file(fpath) != meta.get("sha256"):
            raise CheckpointError(f"{fpath}: sha256 mismatch with the manifest (corrupted)")
        if rel.endswith(".json"):
            try:
                with open(fpath) as f:
                    json.load(f)
            except ValueError as e:
                raise CheckpointError(f"{fpath}: unparsable json ({e})") from e
    return manifest


def sorted_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-N directory, oldest first (complete or not); temporary
    directories of saves in progress (.tmp-checkpoint-N) are never listed."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def get_last_checkpoint(output_dir: str) -> str | None:
    """The newest complete, verified checkpoint; corrupt ones are skipped with a warning that names
    the bad file and the reason."""
    for _, path in reversed(sorted_checkpoints(output_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s; trying the next older one", path, e)
    return None


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None,
                       protect: str | None = None) -> list[str]:
    """Keep at most `save_total_limit` checkpoints in total, as HF: the oldest go first, never the
    newest (`protect`, the one just written, which resume would use) nor the best; return what was
    deleted."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    ckpts = [os.path.abspath(p) for _, p in sorted_checkpoints(output_dir)]
    keep = {os.path.abspath(p) for p in (best_model_checkpoint, protect) if p}
    if ckpts:
        keep.add(ckpts[-1])
    remaining, limit = len(ckpts), max(save_total_limit, len(keep & set(ckpts)))
    deleted = []
    for p in ckpts:
        if remaining <= limit:
            break
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
            remaining -= 1
    return deleted
