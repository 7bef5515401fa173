"""A checkpoint's weights as safetensors, as save_pretrained writes them (model.safetensors, or shards and their
index), tied weights kept once with their aliases; read back checked against the manifest's checksums in the same
pass. Everything else pickled is loaded with `weights_only=True` (load_pickle), so a checkpoint cannot run code.
The checkpoint's errors live here, the first code to raise them (store.py imports them)."""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

import torch
from safetensors import SafetensorError

from .io import ALGORITHMS, ChecksumMismatch, file_checksum, read_safetensors, write_json, write_safetensors

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a PEFT model's, by PEFT
MAX_SHARD_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size ("50GB"), which Trainer._save uses


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or unsafe; the message names the file."""


class ChecksumError(CheckpointError):
    """A file's bytes differ from its manifest entry (found while loading it)."""


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


def write_weights(state: dict[str, torch.Tensor], directory: str, max_shard_bytes: int | None = None) -> dict:
    """Write weights as model.safetensors, or as model-0000i-of-0000n.safetensors shards plus
    model.safetensors.index.json split as save_pretrained splits them (in order, a new shard when the
    next tensor would pass max_shard_bytes, a larger tensor alone); return {file name: manifest entry}."""
    limit = MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    tensors, aliases = _dedupe_shared(state)
    meta = {"format": "pt", "aliases": json.dumps(aliases, sort_keys=True)}
    shards: list[dict[str, torch.Tensor]] = []
    current, size = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes > limit:
            shards.append({name: t})
            continue
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    shards += [current] if current else []
    if len(shards) <= 1:
        return {WEIGHTS: write_safetensors(tensors, os.path.join(directory, WEIGHTS), meta)}
    entries, weight_map = {}, {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        entries[fname] = write_safetensors(shard, os.path.join(directory, fname), meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, "aliases": aliases}, "weight_map": weight_map}
    entries[WEIGHTS_INDEX] = write_json(index, os.path.join(directory, WEIGHTS_INDEX))
    return entries


def save_weights(state: dict[str, torch.Tensor], directory: str, max_shard_bytes: int | None = None) -> list[str]:
    """Write weights as model.safetensors, or as shards plus an index above max_shard_bytes;
    return the file names written."""
    return list(write_weights(state, directory, max_shard_bytes))


def load_weights(directory: str, manifest: dict | None = None) -> dict[str, torch.Tensor]:
    """Load model.safetensors or its shards (with tied-weight aliases restored), on CPU: the manifest's
    own, each checked against its checksum as it is read (one pass over the bytes; verify_checkpoint(...,
    weights_on_load=True) leaves them to this); without one, model.safetensors first, as from_pretrained."""
    single = os.path.join(directory, WEIGHTS)
    index_path = os.path.join(directory, WEIGHTS_INDEX)
    entries = (manifest or {}).get("files", {})
    adapter = os.path.join(directory, ADAPTER_WEIGHTS)
    if ADAPTER_WEIGHTS in entries or (manifest is None and os.path.exists(adapter) and not os.path.exists(single)):
        files = [adapter]  # a PEFT model's checkpoint: the adapter alone (adapters.load_weights)
    elif os.path.exists(single) and (manifest is None or WEIGHTS in entries or WEIGHTS_INDEX not in entries):
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
        entry = entries.get(os.path.relpath(path, directory))
        expected = next(((a, entry[a]) for a in ALGORITHMS if a in entry), None) if entry else None
        if manifest is not None and expected is None:
            raise CheckpointError(f"{path}: not in the manifest {os.path.join(directory, 'manifest.json')} (the index names "
                                  "a file the checkpoint was not written with): put its own files back or resume from "
                                  "another checkpoint")
        try:
            tensors, meta = _read_weights_file(path, expected)
        except ChecksumMismatch as e:
            raise ChecksumError(f"{path}: {e}") from e
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
        state.update(tensors)
        aliases.update(json.loads(meta.get("aliases", "{}")))
    for alias, target in aliases.items():
        state[alias] = state[target]
    return state


def _read_weights_file(path: str, expected: tuple[str, str] | None) -> tuple[dict[str, torch.Tensor], dict]:
    if sys.byteorder == "little":
        return read_safetensors(path, expected)
    from safetensors import safe_open  # safetensors is little-endian: its reader converts

    if expected is not None and file_checksum(path, expected[0]) != expected[1]:
        raise ChecksumMismatch(f"{expected[0]} checksum mismatch with the manifest (corrupted)")
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


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
