"""Checkpoints as a contract: layout, atomic write, manifest + checksums, verification, rotation, loading.

A checkpoint `output_dir/checkpoint-N/` is written into `.tmp-checkpoint-N/` and renamed into place
only after every file is fsynced and, last, `manifest.json` (size and checksum of every file, with
the algorithm's name) is written. So a crash at any instant leaves at most one complete new
checkpoint, never a half-written one. Files are written concurrently (weights, optimizer, small
files), each checksummed while it is written (no second read; io.py), and verified against
the manifest before anything is loaded from it. Weights are safetensors (weights.py); everything pickled is
loaded with `weights_only=True`, so a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .io import (ALGORITHMS, CHECKSUM, HostStaging, describe_files, disk_leaders, file_checksum,
    lower_thread_priority, maybe_pause, rename_into_place, save_pickle, write_json)
from .weights import (ADAPTER_WEIGHTS, WEIGHTS, WEIGHTS_INDEX, CheckpointError, ChecksumError, write_weights,
    load_pickle, load_weights, save_weights)  # the last two: the store's API too (ckpt.load_pickle)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: per-file checksum named by its algorithm (1: always sha256; still read)
PREFIX = "checkpoint"
MANIFEST = "manifest.json"
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT model's, by PEFT
TRAINER_STATE = "trainer_state.json"
PRETRAINED_CONFIGS = ("config.json", "generation_config.json")  # save_pretrained rewrites them with the weights
ASYNC_POLICIES = ("wait", "skip")
_CKPT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_TMP_RE = re.compile(rf"^\.tmp-{PREFIX}-\d+$|^{PREFIX}-\d+\.replaced$")


# ---------------------------------------------------------------- the payload and its writer


@dataclass
class CheckpointPayload:
    """What one rank writes: weights (rank 0, already consolidated and on CPU), pickled state
    (optimizer, scheduler, RNG...), JSON documents, and a hook for backend-sharded state."""

    weights: dict[str, torch.Tensor] | None = None
    pickles: dict[str, Any] = field(default_factory=dict)
    jsons: dict[str, Any] = field(default_factory=dict)
    sharded_writer: Callable[[str, Any], Future | None] | None = None  # every rank: Strategy.save_sharded
    extra_files: Callable[[str], None] | None = None     # rank 0's small files (HF config, tokenizer), synchronously


def _to_host(obj: Any) -> Any:
    """A host copy of `obj` with sharing kept (see HostStaging), in fresh buffers."""
    return HostStaging().copy(obj)


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


class CheckpointWriter:
    """Writes checkpoints atomically, optionally in the background (save_async).

    An asynchronous save copies the state into reused host buffers at the step boundary (the only
    part the step waits for) and writes from them, file after file, on a background thread at lower
    CPU priority; a synchronous save writes its files concurrently. A save that arrives while one is
    still being written waits for it (async_policy "wait"), or, when the caller asks `should_skip()`
    first (async_policy "skip"), is dropped. In distributed runs every
    rank writes its own files into the temporary directory on its own disk (shared or node-local, detected);
    rank 0 gathers every rank's manifest entries (`all_gather`) and writes the one manifest once all are written.
    """

    def __init__(self, output_dir: str, *, rank: int = 0, world_size: int = 1, strategy: str = "single",
                 barrier: Callable[[], None] = lambda: None, save_async: bool = False,
                 max_shard_bytes: int | None = None, async_policy: str = "wait",
                 all_gather: Callable[[Any], list] | None = None, side_channel: Any = None,
                 layout: dict | None = None):
        if async_policy not in ASYNC_POLICIES:
            raise ValueError(f"save_async_policy: {async_policy!r} is not one of {', '.join(map(repr, ASYNC_POLICIES))}")
        self.output_dir = output_dir
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.layout = layout  # the device mesh's sizes (parallelism_config), recorded in the manifest
        self.barrier, self.all_gather = barrier, all_gather
        self._leaders: list[int] | None = None
        self.max_shard_bytes, self.async_policy = max_shard_bytes, async_policy
        # A background distributed save commits through collectives of its own (strategies.base.SideChannel).
        self.side_channel = side_channel
        background = save_async and (world_size == 1 or side_channel is not None)
        init = lower_thread_priority if background else None
        self._pool = ThreadPoolExecutor(1, "raytrain-ckpt", initializer=init) if background else None
        # A synchronous save writes weights, optimizer and small files at once (the step waits for the
        # slowest); a background one writes them one after another, so it takes at most one core from training.
        self._io = ThreadPoolExecutor(1 if background else 3, "raytrain-ckpt-io", initializer=init)
        self._staging = HostStaging()
        self._pending: Future | None = None

    def in_flight(self) -> bool:
        """A background save is still being written."""
        return self._pending is not None and not self._pending.done()

    def should_skip(self, must_save: bool = False) -> bool:
        """async_policy "skip": True while a background save is in flight, unless `must_save` (the
        run's last checkpoint, or its best)."""
        return self.async_policy == "skip" and not must_save and self.in_flight()

    def save(self, step: int, payload: CheckpointPayload, after: Callable[[str], None] | None = None) -> str:
        """Write checkpoint-{step}; with save_async, return once the state is copied to host memory
        (the write and `after` then run in the background). `after(path)` runs on rank 0 once the
        checkpoint is complete (rotation)."""
        self.wait()  # one save at a time: its temporary directory and host buffers are the next one's
        final = checkpoint_dir(self.output_dir, step)
        tmp = os.path.join(self.output_dir, f".tmp-{PREFIX}-{step}")
        if self._disk_leaders()[self.rank] == self.rank:  # rank 0, and each other disk's first rank
            _remove_stale_temporaries(self.output_dir)  # leftovers of crashed saves
            os.makedirs(tmp)
        self.barrier()
        group = getattr(self.side_channel, "group", None) if self._pool is not None else None  # DCP's in the background
        sharded = payload.sharded_writer(tmp, group) if payload.sharded_writer is not None else None
        if payload.extra_files is not None and self.rank == 0:
            payload.extra_files(tmp)  # checksummed into the manifest when the checkpoint is sealed
        if self._pool is None:
            self._write(step, tmp, final, payload, after, sharded=sharded)
        else:
            copy = self._staging.copy  # one pass, so tensors shared between the parts stay shared
            weights, pickles, jsons = copy((payload.weights, payload.pickles, payload.jsons))
            host = CheckpointPayload(weights, pickles, jsons)
            self._pending = self._pool.submit(self._write, step, tmp, final, host, after, self._staging.ready,
                                              self.side_channel, sharded)
        return final

    def wait(self) -> None:
        """Block until a background save finishes; re-raise its error (never swallowed), DCP's
        CheckpointException (a BaseException) included; an interrupt while waiting stays itself."""
        pending, self._pending = self._pending, None
        e = pending.exception() if pending is not None else None
        if e is not None:
            raise CheckpointError(f"background checkpoint write failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._io.shutdown()

    def _write(self, step: int, tmp: str, final: str, payload: CheckpointPayload, after=None, ready=None,
               channel=None, sharded: Future | None = None) -> None:
        """Write this rank's files, then commit: rank 0 writes the manifest once every rank's files are durable;
        `sharded`, DCP's background write on `channel`'s group, is awaited before the commit's collectives."""
        try:
            if sharded is not None:
                sharded.result()  # its files written, its collectives done
            if ready is not None:
                ready()  # device-to-host copies have landed
            entries, failure = self._write_files(tmp, payload), None
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            entries, failure = None, e
        maybe_pause(tmp, step)
        leaders = self._disk_leaders()  # found on the training thread, at the save's start
        gather = channel.all_gather if channel else self._gather
        barrier = channel.barrier if channel else self.barrier
        # Every rank's files are written and fsynced, or a rank's error, which fails the save on every rank.
        written = gather(entries if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [(r, w) for r, w in enumerate(written) if isinstance(w, str)]
        if failed:
            raise CheckpointError(f"rank {failed[0][0]} could not write its files: {failed[0][1]}")
        lead = leaders[self.rank] == self.rank
        mine = {k: v for r, e in enumerate(written) if leaders[r] == self.rank for k, v in e.items()}
        files = describe_files(tmp, mine) if lead else None  # this disk's files, checksummed by their writers
        if lead and self.rank != 0:  # no manifest on another disk: rank 0's lists every rank's files
            rename_into_place(tmp, final)
        described = gather(files)
        if self.rank == 0:
            self._seal(step, tmp, final, {k: v for f in described if f for k, v in f.items()})
        if lead and after is not None:
            after(final)
        barrier()

    def _gather(self, obj: Any) -> list:
        """Every rank's `obj` (a barrier); without all_gather, this rank's alone after a barrier."""
        if self.all_gather is not None and self.world_size > 1:
            return self.all_gather(obj)
        self.barrier()
        return [obj]

    def _disk_leaders(self) -> list[int]:
        """Each rank's disk leader (io.disk_leaders), found once; without all_gather, rank 0."""
        if self._leaders is None:
            one = self.all_gather is None or self.world_size == 1
            self._leaders = [0] * self.world_size if one else disk_leaders(self.output_dir, self.rank, self.all_gather)
        return self._leaders

    def _write_files(self, tmp: str, payload: CheckpointPayload) -> dict[str, dict]:
        """Every file of this rank, concurrently, largest first; {file: manifest entry}. Waits for all
        of them even when one fails, so that nothing still writes into `tmp` when the error surfaces."""
        join = os.path.join
        jobs: list[Callable[[], dict]] = []
        for name, obj in sorted(payload.pickles.items(), key=lambda kv: kv[0] != "optimizer.pt"):
            jobs.append(lambda name=name, obj=obj: {name: save_pickle(obj, join(tmp, name))})
        if payload.weights is not None:
            jobs.insert(1, lambda: write_weights(payload.weights, tmp, self.max_shard_bytes))
        if payload.jsons:
            jobs.append(lambda: {name: write_json(obj, join(tmp, name)) for name, obj in payload.jsons.items()})
        futures = [self._io.submit(job) for job in jobs]
        wait(futures)
        entries: dict[str, dict] = {}
        for f in futures:
            entries.update(f.result())
        return entries

    def _seal(self, step: int, tmp: str, final: str, files: dict[str, dict]) -> None:
        """Write the manifest of every rank's files (none read again), then rename into place."""
        manifest = {"format_version": FORMAT_VERSION, "checksum": CHECKSUM, "global_step": step,
                    "world_size": self.world_size, "strategy": self.strategy, "files": dict(sorted(files.items()))}
        if self.layout:
            manifest["parallelism"] = self.layout
        write_json(manifest, os.path.join(tmp, MANIFEST))
        rename_into_place(tmp, final)


def _remove_stale_temporaries(output_dir: str) -> None:
    """A writer saves one checkpoint at a time, so any temporary directory left in output_dir when
    a save starts belongs to a save that crashed: remove it."""
    for name in os.listdir(output_dir):
        if _TMP_RE.match(name):
            logger.info("removing %s, left by an interrupted save", os.path.join(output_dir, name))
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


# ---------------------------------------------------------------- verify, find, rotate


def is_weights_file(rel: str) -> bool:
    return rel in (WEIGHTS, WEIGHTS_INDEX, ADAPTER_WEIGHTS) or bool(re.fullmatch(r"model-\d+-of-\d+\.safetensors", rel))


def read_manifest(path: str) -> dict:
    """A checkpoint's parsed manifest, or a CheckpointError naming what is wrong with it."""
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
            raise TypeError("'files' is not a mapping of file -> {size, checksum}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{mpath}: unparsable manifest ({type(e).__name__}: {e})") from e
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {version!r} is newer than this raytrain reads "
                              f"({FORMAT_VERSION}); upgrade raytrain")
    return manifest


def verify_checkpoint(path: str, ignore_weights: bool = False, weights_on_load: bool = False) -> dict:
    """Check a checkpoint against its manifest (every file present, same size, same checksum, json
    parsable; weights and trainer_state.json included); return the manifest or raise a
    CheckpointError naming the bad file and the reason. Each entry names its algorithm (xxh3_128;
    sha256 in checkpoints of format 1). ignore_weights skips the weights files and the configs
    save_pretrained rewrites with them (weights re-saved by another tool, checked otherwise). weights_on_load
    checks the weights files' names and sizes only: load_weights(path, manifest) checks their checksums
    as it reads them, before anything is applied."""
    manifest = read_manifest(path)
    files, mpath = manifest["files"], os.path.join(path, MANIFEST)
    skipped = lambda rel: ignore_weights and (is_weights_file(rel) or rel in PRETRAINED_CONFIGS)  # noqa: E731
    weights = next((n for n in (WEIGHTS_INDEX, ADAPTER_WEIGHTS) if n in files), WEIGHTS)
    for required in (weights, TRAINER_STATE):
        if required not in files and not skipped(required):
            raise CheckpointError(f"{os.path.join(path, required)}: missing (not in the manifest)")
    checks = []
    for rel, meta in files.items():  # every name and size first: cheap, and names the obvious damage
        if skipped(rel):
            continue
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (listed in the manifest)")
        size = os.path.getsize(fpath)
        if size != meta.get("size"):
            raise CheckpointError(f"{fpath}: size {size} bytes, the manifest says {meta.get('size')} (truncated?)")
        algorithm = next((a for a in ALGORITHMS if a in meta), None)
        if algorithm is None:
            raise CheckpointError(f"{mpath}: the entry of {rel} has no checksum this raytrain knows "
                                  f"(expected one of {', '.join(ALGORITHMS)})")
        if not (weights_on_load and is_weights_file(rel) and rel != WEIGHTS_INDEX):
            checks.append((rel, fpath, algorithm, meta[algorithm]))
    # Files are checksummed concurrently (the hash releases the GIL); the first bad one in manifest order is named.
    with ThreadPoolExecutor(min(4, len(checks) or 1), "raytrain-verify") as pool:
        sums = list(pool.map(lambda c: file_checksum(c[1], c[2]), checks))
    for (rel, fpath, algorithm, expected), actual in zip(checks, sums):
        if actual != expected:
            raise CheckpointError(f"{fpath}: {algorithm} checksum mismatch with the manifest (corrupted)")
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


def get_last_checkpoint(output_dir: str, weights_on_load: bool = False, before_step: int | None = None) -> str | None:
    """The newest complete, verified checkpoint (of a step below `before_step`, if given); corrupt ones
    are skipped with a warning that names the bad file and the reason. weights_on_load: as
    verify_checkpoint's (the caller loads the weights with the manifest next)."""
    for step, path in reversed(sorted_checkpoints(output_dir)):
        if before_step is not None and step >= before_step:
            continue
        try:
            verify_checkpoint(path, weights_on_load=weights_on_load)
            return path
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s; trying the next older one", path, e)
    return None


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None,
                       protect: str | tuple[str, ...] | None = None) -> list[str]:
    """Keep at most `save_total_limit` checkpoints in total, as HF: the oldest go first, never the
    newest (`protect`: the one just written, which resume would use, or several) nor the best; return
    what was deleted."""
    protect = (protect,) if isinstance(protect, str) else tuple(protect or ())
    keep = {os.path.abspath(p) for p in (best_model_checkpoint, *protect) if p}
    doomed = checkpoints_to_drop([os.path.abspath(p) for _, p in sorted_checkpoints(output_dir)], save_total_limit, keep)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def checkpoints_to_drop(oldest_first: list, save_total_limit: int | None, keep: set) -> list:
    """The rotation rule alone (for a node's disk and for Ray's storage alike): the oldest beyond
    `save_total_limit` go, never the newest nor any in `keep` (the best, the one being written)."""
    if not save_total_limit or save_total_limit <= 0 or not oldest_first:
        return []
    keep = (set(keep) | {oldest_first[-1]}) & set(oldest_first)
    excess = len(oldest_first) - max(save_total_limit, len(keep))
    return [p for p in oldest_first if p not in keep][:max(excess, 0)]
