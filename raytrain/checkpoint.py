"""Checkpoints as a contract: layout, atomic write, manifest + sha256, verification, rotation, loading.

A checkpoint `output_dir/checkpoint-N/` is written into `.tmp-checkpoint-N/` and renamed into place
only after every file and, last, `manifest.json` (sizes and sha256 of every file) are on disk. So a
crash at any instant leaves at most one complete new checkpoint, never a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
PREFIX = "checkpoint"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024**3
_CKPT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
# Test hook: a path whose existence makes the writer pause mid-save (so a test can kill it there).
PAUSE_ENV = "RAYTRAIN_TEST_PAUSE_IN_SAVE"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or unsafe; the message names the file."""


# ---------------------------------------------------------------- files


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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


def save_weights(state: dict[str, torch.Tensor], directory: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write weights as model.safetensors, or as shards plus an index above max_shard_bytes."""
    tensors, aliases = _dedupe_shared(state)
    meta = {"format": "pt", "aliases": json.dumps(aliases)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        save_file(tensors, os.path.join(directory, WEIGHTS), metadata=meta)
        return [WEIGHTS]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata=meta)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": total, "aliases": aliases}, "weight_map": weight_map}
    with open(os.path.join(directory, WEIGHTS_INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return names + [WEIGHTS_INDEX]


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """Load model.safetensors or its shards (with tied-weight aliases restored), on CPU."""
    from safetensors import safe_open

    single = os.path.join(directory, WEIGHTS)
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(os.path.join(directory, WEIGHTS_INDEX)):
        with open(os.path.join(directory, WEIGHTS_INDEX)) as f:
            index = json.load(f)
        files = [os.path.join(directory, n) for n in sorted(set(index["weight_map"].values()))]
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
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e).splitlines()[0]})") from e


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- the payload and its writer


@dataclass
class CheckpointPayload:
    """What one rank writes: weights (rank 0, already consolidated and on CPU), pickled state
    (optimizer, scheduler, RNG...), JSON documents, and a hook for backend-sharded state."""

    weights: dict[str, torch.Tensor] | None = None
    pickles: dict[str, Any] = field(default_factory=dict)
    jsons: dict[str, Any] = field(default_factory=dict)
    sharded_writer: Callable[[str], None] | None = None  # runs synchronously, on every rank


def _to_host(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory, so training may go on mutating."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_to_host(v) for v in obj]
        return type(obj)(items) if isinstance(obj, list) or not hasattr(obj, "_fields") else type(obj)(*items)
    return obj


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


class CheckpointWriter:
    """Writes checkpoints atomically, optionally in a background thread (save_async).

    In distributed runs every rank writes its own files into the shared temporary directory; after
    a barrier rank 0 writes the manifest and renames. `barrier` is the strategy's barrier.
    """

    def __init__(self, output_dir: str, *, rank: int = 0, world_size: int = 1, strategy: str = "single",
                 barrier: Callable[[], None] = lambda: None, save_async: bool = False,
                 max_shard_bytes: int = MAX_SHARD_BYTES):
        self.output_dir = output_dir
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.barrier = barrier
        self.max_shard_bytes = max_shard_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-ckpt") if save_async else None
        self._pending: Future | None = None

    def save(self, step: int, payload: CheckpointPayload, after: Callable[[str], None] | None = None) -> str:
        """Write checkpoint-{step}; with save_async, return once the state is copied to host memory.
        `after(path)` runs on rank 0 once the checkpoint is complete (rotation)."""
        self.wait()
        final = checkpoint_dir(self.output_dir, step)
        tmp = os.path.join(self.output_dir, f".tmp-{PREFIX}-{step}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            os.makedirs(tmp)
        self.barrier()
        if payload.sharded_writer is not None:
            payload.sharded_writer(tmp)
        if self._pool is None or self.world_size > 1:
            # Distributed saves stay synchronous: the rename needs a barrier on the main thread.
            self._write(step, tmp, final, payload, after)
        else:
            host = CheckpointPayload(_to_host(payload.weights), _to_host(payload.pickles),
                                     _to_host(payload.jsons))
            self._pending = self._pool.submit(self._write, step, tmp, final, host, after)
        return final

    def wait(self) -> None:
        """Block until a background save finishes; re-raise its error (never swallowed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as e:
                raise CheckpointError(f"background checkpoint write failed: {e}") from e

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()

    def _write(self, step: int, tmp: str, final: str, payload: CheckpointPayload, after=None) -> None:
        if payload.weights is not None:
            save_weights(payload.weights, tmp, self.max_shard_bytes)
        for name, obj in payload.pickles.items():
            torch.save(obj, os.path.join(tmp, name))
        for name, obj in payload.jsons.items():
            _write_json(obj, os.path.join(tmp, name))
        _maybe_pause(tmp)
        self.barrier()
        if self.rank == 0:
            self._seal(step, tmp, final)
            if after is not None:
                after(final)
        self.barrier()

    def _seal(self, step: int, tmp: str, final: str) -> None:
        files = {}
        for root, _, names in os.walk(tmp):
            for name in sorted(names):
                path = os.path.join(root, name)
                _fsync_file(path)
                files[os.path.relpath(path, tmp)] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        manifest = {"format_version": FORMAT_VERSION, "global_step": step, "world_size": self.world_size,
                    "strategy": self.strategy, "files": dict(sorted(files.items()))}
        _write_json(manifest, os.path.join(tmp, MANIFEST))
        _fsync_file(os.path.join(tmp, MANIFEST))
        _fsync_dir(tmp)
        if os.path.exists(final):
            # Only reached with overwrite_output_dir or a re-run of the same step: move the old one
            # aside first so that some complete checkpoint-N exists at every instant.
            old = final + ".replaced"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.output_dir)


def _maybe_pause(tmp: str) -> None:
    flag = os.environ.get(PAUSE_ENV)
    if flag:
        with open(flag, "w") as f:
            f.write(tmp)
        threading.Event().wait()  # the test kills the process here


# ---------------------------------------------------------------- verify, find, rotate


def verify_checkpoint(path: str) -> dict:
    """Check a checkpoint against its manifest; return the manifest or raise naming the bad file."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{mpath}: missing (the checkpoint was never completed)")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{mpath}: unparsable manifest ({e})") from e
    for rel, meta in files.items():
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (listed in the manifest)")
        size = os.path.getsize(fpath)
        if size != meta["size"]:
            raise CheckpointError(f"{fpath}: size {size} bytes, the manifest says {meta['size']} (truncated?)")
        if sha256_file(fpath) != meta["sha256"]:
            raise CheckpointError(f"{fpath}: sha256 mismatch with the manifest (corrupted)")
        if rel.endswith(".json"):
            try:
                with open(fpath) as f:
                    json.load(f)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{fpath}: unparsable json ({e})") from e
    return manifest


def sorted_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-N directory, oldest first (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def get_last_checkpoint(output_dir: str) -> str | None:
    """The newest complete, verified checkpoint; corrupt ones are skipped with a warning."""
    for _, path in reversed(sorted_checkpoints(output_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", path, e)
    return None


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None,
                       protect: str | None = None) -> list[str]:
    """Keep the newest `save_total_limit` checkpoints plus the best one and `protect` (the one just
    written, which resume would use); return what was deleted."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    ckpts = [os.path.abspath(p) for _, p in sorted_checkpoints(output_dir)]
    keep = set(ckpts[-save_total_limit:])
    keep.update(os.path.abspath(p) for p in (best_model_checkpoint, protect) if p)
    deleted = []
    for p in ckpts:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted
