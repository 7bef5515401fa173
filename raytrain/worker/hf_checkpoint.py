"""WORKER side: checkpoints whose weights raytrain did not write: a checkpoint-N of transformers'
Trainer (no manifest.json), and a raytrain checkpoint whose weights a user re-saved with save_pretrained
(e.g. sharded with max_shard_size). resume.py asks; the rules are here.

Weights that are not the manifest's load only as a complete set written by another tool: the file
from_pretrained would read (model.safetensors, else the index and every shard it lists, each holding
exactly the tensors the index gives it), none carrying raytrain's own metadata: a raytrain file that
differs from its checksum is damage, never a re-save.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..checkpoint import store as ckpt
from . import run_state

if TYPE_CHECKING:
    from .run_state import RunState, SavedState

_SHARD_RE = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")
ADVICE = ("put the checkpoint's own files back, re-save the whole model into it (model.save_pretrained(path)), "
          "or resume from another checkpoint")


# ---------------------------------------------------------------- the weights on disk


def _header(path: str) -> tuple[set[str], dict]:
    """A safetensors file's tensor names and metadata (its header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            return set(f.keys()), f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def weight_set(path: str) -> tuple[list[str], bool]:
    """(the weights files from_pretrained would read in `path`, whether raytrain wrote any of them),
    checked to be complete: a CheckpointError names the first file that is not."""
    join = os.path.join
    if os.path.isfile(join(path, ckpt.WEIGHTS)):
        return [ckpt.WEIGHTS], "aliases" in _header(join(path, ckpt.WEIGHTS))[1]
    if os.path.isfile(join(path, ckpt.ADAPTER_WEIGHTS)):  # a PEFT model's, written by PEFT
        _header(join(path, ckpt.ADAPTER_WEIGHTS))
        return [ckpt.ADAPTER_WEIGHTS], False
    index_path = join(path, ckpt.WEIGHTS_INDEX)
    if not os.path.isfile(index_path):
        raise ckpt.CheckpointError(f"{join(path, ckpt.WEIGHTS)}: missing (no {ckpt.WEIGHTS} and no "
                                   f"{ckpt.WEIGHTS_INDEX})")
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ckpt.CheckpointError(f"{index_path}: not a weights index (no weight_map of tensor -> shard file)")
    shards = sorted(set(weight_map.values()))
    on_disk = sorted(n for n in os.listdir(path) if _SHARD_RE.fullmatch(n))
    for name in on_disk + shards:  # every shard of the save it names: model-i-of-N for i in 1..N
        m = _SHARD_RE.fullmatch(name)
        if name not in shards or not m or int(m.group(2)) != len(shards) or not 1 <= int(m.group(1)) <= len(shards):
            raise ckpt.CheckpointError(f"{join(path, name)}: not a shard of the {len(shards)} that "
                                       f"{ckpt.WEIGHTS_INDEX} lists (a shard of another save, or an index of another)")
    ours = "aliases" in (index.get("metadata") or {})
    for name in shards:
        if not os.path.isfile(join(path, name)):
            raise ckpt.CheckpointError(f"{join(path, name)}: missing (listed in {ckpt.WEIGHTS_INDEX})")
        names, meta = _header(join(path, name))
        expected = {k for k, v in weight_map.items() if v == name}
        if names != expected:
            raise ckpt.CheckpointError(f"{join(path, name)}: not the tensors {ckpt.WEIGHTS_INDEX} assigns to it "
                                       f"({len(names - expected)} others, {len(expected - names)} missing: a shard of "
                                       "another save)")
        ours |= "aliases" in meta
    return [ckpt.WEIGHTS_INDEX, *shards], ours


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e})") from e


# ---------------------------------------------------------------- a raytrain checkpoint whose weights were re-saved


def resave_note(path: str, manifest: dict, error: ckpt.CheckpointError | None = None) -> str | None:
    """What loads from a raytrain checkpoint whose weights files are not all the manifest's (`error`:
    verify_checkpoint's on a weights file or a config save_pretrained rewrites). The manifest's own
    weights when they are all there (other weights files ignored); else a complete set written by
    another tool. Returns the warning to give (None: nothing differs); raises a one-line
    CheckpointError naming the file and what to do otherwise."""
    files, mpath = manifest["files"], os.path.join(path, ckpt.MANIFEST)

    def intact(rel: str) -> bool:
        return _intact(path, rel, files[rel])

    listed = [rel for rel in files if ckpt.is_weights_file(rel)]
    unlisted = sorted(n for n in os.listdir(path) if ckpt.is_weights_file(n) and n not in files)
    changed = [rel for rel in (*listed, *ckpt.PRETRAINED_CONFIGS) if rel in files and not intact(rel)]
    bad = None if error is None else os.path.relpath(str(error).split(":", 1)[0], path)
    if listed and all(intact(rel) for rel in listed):  # the manifest's weights load, checksummed as read
        if error is not None and not (unlisted and bad in ckpt.PRETRAINED_CONFIGS):
            raise error
        if not unlisted:
            return None
        return (f"{path}: {', '.join(unlisted)} not in the manifest (re-saved beside its weights by another tool?): "
                f"ignored, the manifest's own weights load{_changes(path, [], changed)}")
    # verify_checkpoint's own words name damaged weights first (a rewritten config is save_pretrained's doing)
    first = f"{error}; " if error is not None and ckpt.is_weights_file(bad) else ""
    try:
        loaded, ours = weight_set(path)
    except ckpt.CheckpointError as e:
        if first:  # a damaged weights file of the manifest, not a re-save: its own words say it
            raise error from None
        raise ckpt.CheckpointError(f"{e}; the weights no longer match {mpath} and are not a complete "
                                   f"re-save: {ADVICE}") from None
    if ours:
        rel = next((r for r in changed if r in loaded), loaded[0])
        raise ckpt.CheckpointError(f"{first}{os.path.join(path, rel)}: differs from {mpath} and was written by "
                                   f"raytrain, so it is damaged, not re-saved: {ADVICE}")
    return (f"{path}: its weights do not match the manifest: re-saved by another tool (save_pretrained?) as a "
            f"complete set of {len(loaded)} file(s){_changes(path, [r for r in loaded if r not in files], changed)}: "
            "resuming with them as they are now, every other file verified")


def _changes(path: str, new: list[str], changed: list[str]) -> str:
    """'; new: ..., changed: ..., removed: ...' for a warning."""
    parts = {"new": new, "changed": [r for r in changed if os.path.exists(os.path.join(path, r))],
             "removed": [r for r in changed if not os.path.exists(os.path.join(path, r))]}
    return "".join(f"; {k}: {', '.join(v)}" for k, v in parts.items() if v)


def resaved_in_place(path: str, manifest: dict) -> bool:
    """Whether the weights files of the manifest (same names) now hold a complete set that another tool
    wrote: its bytes replaced in place, not damaged."""
    try:
        loaded, ours = weight_set(path)
    except ckpt.CheckpointError:
        return False
    return not ours and sorted(loaded) == sorted(rel for rel in manifest["files"] if ckpt.is_weights_file(rel))


def manifest_weights_intact(path: str, manifest: dict) -> bool:
    """Every weights file of the manifest present with its size (its checksum is checked as it is read)."""
    files = manifest["files"]
    listed = [rel for rel in files if ckpt.is_weights_file(rel)]
    return bool(listed) and all(_intact(path, rel, files[rel]) for rel in listed)


def _intact(path: str, rel: str, entry: dict) -> bool:
    return os.path.isfile(p := os.path.join(path, rel)) and os.path.getsize(p) == entry.get("size")


def tie_missing(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Weights that save_pretrained leaves out because they are tied to another (lm_head.weight to the
    input embeddings) are taken from that one, as from_pretrained ties them."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for names in groups.values():
        have = next((n for n in names if n in state), None)
        for name in names if have else ():
            state.setdefault(name, state[have])
    return state


# ---------------------------------------------------------------- a checkpoint of transformers' Trainer


def written_by_transformers(path: str) -> bool:
    """A checkpoint-N of transformers' Trainer: no manifest, trainer_state.json and safetensors weights,
    none of raytrain's own files (a raytrain checkpoint that lost its manifest is not one)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return (os.path.isdir(path) and not has(ckpt.MANIFEST) and has(ckpt.TRAINER_STATE)
            and not has(run_state.DATA_STATE) and any(map(has, (ckpt.WEIGHTS, ckpt.WEIGHTS_INDEX, ckpt.ADAPTER_WEIGHTS))))


def verify_transformers(path: str) -> str:
    """Check what can be checked without a manifest (the weights are complete, trainer_state.json
    reads); the warning to give."""
    try:
        weight_set(path)
        run_state.read_trainer_state(os.path.join(path, ckpt.TRAINER_STATE))
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"{e}; {path} is a checkpoint of transformers' Trainer (no {ckpt.MANIFEST}) "
                                   "that cannot be resumed: resume from another checkpoint") from None
    return (f"{path}: written by transformers' Trainer (no {ckpt.MANIFEST}, so nothing is checksummed): its weights, "
            "optimizer, scheduler, RNG and trainer_state.json are restored; the data continues at the same step "
            "of raytrain's own order (HF's sampler order is not reproduced)")


def read_states(run: RunState, path: str) -> SavedState:
    """trainer_state.json, and the data position HF's Trainer would resume at (global_step's batch of
    its epoch, in this run's order); the loop's accumulators start empty, as HF's do."""
    saved_state = run_state.read_trainer_state(os.path.join(path, ckpt.TRAINER_STATE))
    step, ga = saved_state.global_step, run.trainer.args.gradient_accumulation_steps
    epoch, steps_in = (0, step) if run.num_batches is None else divmod(step, run.steps_per_epoch)
    data = {**run.data.state(), "epoch": epoch, "next_batch": steps_in * ga, "global_step": step,
            "gradient_accumulation_steps": ga}
    loop = {"tr_loss": 0.0, "total_loss": 0.0, "last_logged": step, "nonfinite": [], "skipped_steps": 0}
    return run_state.SavedState(path, saved_state, data, loop)


def read_files(run: RunState, saved: SavedState) -> None:
    """HF's weights (tied ones filled in), optimizer.pt, scheduler.pt and rng_state[_R].pth."""
    strategy, file = run.strategy, saved.file
    saved.weights = tie_missing(ckpt.load_weights(saved.path), run.trainer.model)
    saved.optimizer = strategy.read_optimizer_state(saved.path)
    saved.scheduler = ckpt.load_pickle(file(run_state.SCHEDULER))
    rng = file(run_state.rng_file(strategy))
    saved.rng = _read_rng(rng) if os.path.exists(rng) else None


def _read_rng(path: str) -> dict:
    """HF's RNG file (NumPy's state as an array, allowed as transformers allows it) in raytrain's form."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True)
        kind, keys, *rest = state["numpy"]
        state["numpy"] = (kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), *rest)
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported against its name
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ckpt.CheckpointError(f"{path}: unreadable ({why})") from e
    if isinstance(state.get("cuda"), torch.Tensor):  # one device's state when HF's run was not distributed
        state["cuda"] = [state["cuda"]]
    return state
