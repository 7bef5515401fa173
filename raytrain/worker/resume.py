"""WORKER side: where a run resumes from (the one place that decides it), and putting the run back
exactly where that checkpoint stood: verify -> read -> apply, piece by piece as run_state.py keeps them.

Who asks: Trainer.train's resume_from_checkpoint (resolve), the CLI's --resume never
(fresh_start_refusal) and its MLflow run (likely_checkpoint), a restarted Ray Train run
(restart_point), a restarted sweep trial (choose: PBT's clone or the trial's own newest).

Checkpoints whose weights raytrain did not write (transformers' Trainer's, weights re-saved by
save_pretrained) follow hf_checkpoint.py's rules. Everything is read, and checked against the
manifest, before anything is applied: a checkpoint that fails changes nothing. The weights are
checksummed while they are read (one pass over their bytes), the other files by verify_checkpoint
before that.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

from ..checkpoint import store as ckpt
from . import hf_checkpoint, run_state

if TYPE_CHECKING:
    from .protocol import TrainerProtocol
    from .run_state import RunState

logger = logging.getLogger(__name__)

RUN_MARKER = ".raytrain-run"  # in output_dir: the Ray Train run that last started there


# ---------------------------------------------------------------- which checkpoint


class MissingCheckpointError(ckpt.CheckpointError, FileNotFoundError, ValueError):
    """No checkpoint where one was asked for: a ValueError with HF's text first, as transformers raises."""


def resolve(trainer: TrainerProtocol, resume) -> str | None:
    """The checkpoint to continue from, verified; or None for a fresh start (never a silent one)."""
    args = trainer.args
    if resume is None or resume is False or resume == "never":
        existing = ckpt.sorted_checkpoints(args.output_dir)
        if existing and trainer.is_world_process_zero():
            if args.overwrite_output_dir:
                logger.warning("overwrite_output_dir: deleting %d old checkpoint(s) in %s", len(existing),
                               args.output_dir)
                for _, p in existing:
                    shutil.rmtree(p)
            elif resume == "never":  # the CLI's --resume never: refuse rather than move anything
                raise FileExistsError(fresh_start_refusal(args.output_dir, existing))
            else:
                _archive_previous_run(args.output_dir, [p for _, p in existing])
        return None
    if resume is True or resume == "auto":
        path = _newest_transformers(args.output_dir) or ckpt.get_last_checkpoint(args.output_dir, weights_on_load=True)
        found = ckpt.sorted_checkpoints(args.output_dir)
        if path is None and found:  # every one is corrupt: starting over would silently lose them
            raise ckpt.CheckpointError(
                f"resume_from_checkpoint={resume!r}: none of the {len(found)} checkpoint(s) in {args.output_dir} "
                "is complete and intact (the warnings above name each bad file); repair one, pass its path, "
                "or move them away to start over")
        if path is None and resume is True:
            raise MissingCheckpointError(f"No valid checkpoint found in output directory ({args.output_dir}): "
                                              "resume_from_checkpoint=True needs a complete checkpoint-N there")
        if path is not None and not hf_checkpoint.written_by_transformers(path):
            _warn(hf_checkpoint.resave_note(path, ckpt.read_manifest(path)))  # weights files it does not list
        return path
    _verify_named_checkpoint(str(resume))
    return str(resume)


def _newest_transformers(output_dir: str) -> str | None:
    """The newest checkpoints of output_dir that transformers' Trainer wrote (no manifest), newest first,
    until one of raytrain's: the first that is complete."""
    for _, path in reversed(ckpt.sorted_checkpoints(output_dir)):
        if not hf_checkpoint.written_by_transformers(path):
            return None
        try:
            _warn(hf_checkpoint.verify_transformers(path))
            return path
        except ckpt.CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", path, e)
    return None


def _warn(note: str | None) -> None:
    if note:
        logger.warning("%s", note)


def fresh_start_refusal(output_dir: str, existing: list[tuple[int, str]] | None = None) -> str | None:
    """Why a fresh start that moves nothing (--resume never) refuses output_dir: it holds checkpoints
    (`existing`, else listed here); None when it holds none. overwrite_output_dir lifts it."""
    existing = ckpt.sorted_checkpoints(output_dir) if existing is None else existing
    if not existing:
        return None
    return (f"output_dir {output_dir} already holds {os.path.basename(existing[-1][1])}; "
            "use --resume auto to continue it, or --set overwrite_output_dir=true to start over "
            "(its checkpoints are then deleted)")


def _verify_named_checkpoint(path: str) -> None:
    """A checkpoint named explicitly is verified. If weights files differ from the manifest (re-saved by
    save_pretrained, e.g. sharded), it is used with a warning when the manifest's own weights are all
    there or the re-save is a complete set (hf_checkpoint.resave_note), else refused. One without a
    manifest is used, with a warning, if transformers' Trainer wrote it."""
    if not os.path.isfile(os.path.join(path, ckpt.MANIFEST)):
        if hf_checkpoint.written_by_transformers(path):
            return _warn(hf_checkpoint.verify_transformers(path))
        why = "no such directory" if not os.path.isdir(path) else \
            f"{os.path.join(path, ckpt.MANIFEST)} is missing: the checkpoint was never completed"
        raise MissingCheckpointError(f"Can't find a valid checkpoint at {path} ({why})")
    error = None
    try:
        ckpt.verify_checkpoint(path, weights_on_load=True)
    except ckpt.CheckpointError as e:
        bad = os.path.relpath(str(e).split(":", 1)[0], path)
        if not (ckpt.is_weights_file(bad) or bad in ckpt.PRETRAINED_CONFIGS):
            raise  # raytrain's own files that fail their manifest are corrupt
        error = e
    _warn(hf_checkpoint.resave_note(path, ckpt.read_manifest(path), error))
    if error is not None:
        ckpt.verify_checkpoint(path, ignore_weights=True)


def _archive_previous_run(output_dir: str, paths: list[str]) -> str:
    """A fresh train() into an output_dir holding checkpoints starts over, as HF does; the earlier
    run's checkpoints are moved (never overwritten, rotated or deleted) into previous-run-K/."""
    k = 1
    while os.path.exists(os.path.join(output_dir, f"previous-run-{k}")):
        k += 1
    archive = os.path.join(output_dir, f"previous-run-{k}")
    os.makedirs(archive)
    for p in paths:
        os.rename(p, os.path.join(archive, os.path.basename(p)))
    logger.warning("output_dir %s held checkpoints of an earlier run (%s); this run starts fresh (as HF) and "
                   "they were moved to %s; pass resume_from_checkpoint=True to continue a run instead",
                   output_dir, ", ".join(os.path.basename(p) for p in paths), archive)
    return archive


def likely_checkpoint(output_dir: str, resume) -> str | None:
    """The checkpoint `resume` will most likely continue (the newest with a readable trainer_state.json),
    found without verifying checksums: for what must be known before training (the CLI's MLflow run)."""
    if resume is None:
        return None
    if resume != "auto":
        return resume
    for _, path in reversed(ckpt.sorted_checkpoints(output_dir)):
        if os.path.isfile(os.path.join(path, ckpt.TRAINER_STATE)):
            return path
    return None


# ---------------------------------------------------------------- after a restart


def choose(own_dir: str | None, clone: str | None = None, reported: str | None = None) -> tuple[str, str | None]:
    """Where a restarted run continues: `clone`, another run's checkpoint handed over (PBT's exploit),
    first; else the newer of `reported` (the scheduler's latest registered checkpoint; it wins a tie)
    and own_dir's newest complete one (a save not yet registered when the run stopped); else
    ("asked", None): what the caller asked for. Kinds: clone, reported, local, asked."""
    if clone is not None:
        return "clone", clone
    found = [("reported", reported)] if reported else []
    local = ckpt.get_last_checkpoint(own_dir) if own_dir is not None and os.path.isdir(own_dir) else None
    if local:
        found.append(("local", local))
    if not found:
        return "asked", None
    return found[0] if len(found) == 1 else max(found, key=lambda c: _step(c[1]))


def restart_point(output_dir: str, run_id: str, reported: str | None, all_gather=None) -> tuple[str, str | None]:
    """Where an attempt of Ray Train run `run_id` starts; every rank calls it (`all_gather`: the
    strategy's). After a restart (rank 0's marker says so), the newer of Ray's checkpoint (`reported`;
    it wins a tie) and rank 0's newest local one, which counts only if every rank verifies it on its
    own disk (a node-local one holds that rank's files alone); on the first attempt, Ray's checkpoint if
    any, else ("asked", None): the driver's resume_from_checkpoint. Every rank gets rank 0's answer."""
    gather = all_gather or (lambda obj: [obj])
    marker = os.path.join(output_dir, RUN_MARKER)
    restarted = gather(_read_marker(marker) == run_id)[0]  # every rank reads before any rank writes
    os.makedirs(output_dir, exist_ok=True)
    tmp = f"{marker}.{os.urandom(4).hex()}"  # every rank writes it (its own disk, or a shared one: atomically)
    with open(tmp, "w") as f:
        json.dump({"run": run_id}, f)
    os.replace(tmp, marker)
    local = gather(ckpt.get_last_checkpoint(output_dir) if restarted else None)[0]
    if local is not None and not all(gather(complete_here(local))):
        logger.warning("restart: %s is not complete on every rank's disk (node-local output_dir): "
                       "resuming from Ray's checkpoint instead", local)
        local = None
    found = [(kind, path) for kind, path in (("reported", reported), ("local", local)) if path]
    kind, path = max(found, key=lambda c: _step(c[1])) if found else ("asked", None)
    kind, path = gather((kind, path))[0]
    if kind != "asked":
        own = reported if kind == "reported" else path
        logger.warning("restart: resuming from %s (step %d)", own, _step(own))
    return kind, path


def complete_here(path: str) -> bool:
    """A checkpoint on this disk whose manifest's files are all present (see complete_in)."""
    try:
        files = ckpt.read_manifest(path)["files"]
    except ckpt.CheckpointError:
        return False
    return complete_in(path, files)


def complete_in(directory: str, files: dict, fs=None) -> bool:
    """Every file of a manifest in `directory` with its size, on this disk or on a pyarrow filesystem
    (Ray's storage). Rank 0 checksummed them; each rank checks the checksums again when it resumes."""
    paths = [f"{directory}/{rel}" for rel in files]
    if fs is None:
        sizes = [os.path.getsize(p) if os.path.isfile(p) else None for p in paths]
    else:
        import pyarrow.fs

        sizes = [i.size if i.type == pyarrow.fs.FileType.File else None for i in fs.get_file_info(paths)]
    return all(size == meta.get("size") for size, meta in zip(sizes, files.values()))


def _read_marker(path: str) -> str | None:
    try:
        with open(path) as f:
            return json.load(f).get("run")
    except (OSError, ValueError):
        return None


def _step(path: str) -> int:
    with open(os.path.join(path, ckpt.MANIFEST)) as f:
        return int(json.load(f)["global_step"])


# ---------------------------------------------------------------- putting the run back


def restore(run: RunState, path: str, auto: bool) -> dict:
    """_restore (which returns the checkpoint's data state), whose weights are checked against the
    manifest as they are read: the manifest's own when they are all there, else (a checkpoint named
    explicitly, resolve checked the set) the re-saved ones. Weights that fail are treated as
    verify_checkpoint would have: skipped for the next older checkpoint (auto resume), used with a
    warning if re-saved in place by another tool (a named checkpoint), otherwise refused."""
    if hf_checkpoint.written_by_transformers(path):
        return _restore(run, path, None, transformers=True)
    while True:
        manifest = ckpt.read_manifest(path)
        try:
            return _restore(run, path, manifest if hf_checkpoint.manifest_weights_intact(path, manifest) else None)
        except ckpt.ChecksumError as e:
            if not auto and hf_checkpoint.resaved_in_place(path, manifest):
                logger.warning("%s; its weights do not match the manifest (re-saved in place by another tool, e.g. "
                               "save_pretrained?): resuming with them as they are now, every other file verified", e)
                return _restore(run, path, None)
            if not auto:
                raise ckpt.ChecksumError(f"{e}: {hf_checkpoint.ADVICE}") from None
            logger.warning("skipping checkpoint %s: %s; trying the next older one", path, e)
            step = next(s for s, p in ckpt.sorted_checkpoints(run.trainer.args.output_dir) if p == path)
            path = ckpt.get_last_checkpoint(run.trainer.args.output_dir, weights_on_load=True, before_step=step)
            if path is None:
                raise ckpt.CheckpointError(f"resume: no intact checkpoint left in {run.trainer.args.output_dir} "
                                           "(the warnings above name each bad file)") from None


def _restore(run: RunState, path: str, manifest: dict | None, transformers: bool = False) -> dict:
    """Put the run back exactly where checkpoint `path` stood (one of transformers' Trainer: as HF
    resumes it). The data order is checked before any weights are read, and every file is read (a
    bad one is refused with a CheckpointError naming it) before anything is applied, so nothing is
    changed by a checkpoint that fails."""
    strategy = run.strategy
    saved = hf_checkpoint.read_states(run, path) if transformers else run_state.read_states(path)
    _check_data_compat(run, saved.data, path)
    if transformers:
        hf_checkpoint.read_files(run, saved)
    else:
        run_state.read_files(run, saved, manifest)
        if manifest is None:  # re-saved by save_pretrained, which leaves tied weights out
            saved.weights = hf_checkpoint.tie_missing(saved.weights, run.trainer.model)
    if strategy.scaler is not None and saved.scaler is None:
        logger.warning("%s: no scaler.pt (the run did not use fp16); the fp16 loss scale starts fresh", path)
    before, now = saved.trainer_state.max_steps, run.trainer.state.max_steps
    run_state.apply(run, saved)
    if before != now:
        logger.warning("%s: max_steps %d -> %d: the learning-rate schedule continues as one of %d steps",
                       path, before, now, now)
    if saved.rng is None:
        logger.warning("%s: no %s (the run had another world size); RNG streams start fresh", path,
                       run_state.rng_file(strategy))
    logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, saved.trainer_state.global_step, run.epoch,
                run.next_batch)
    return saved.data


def _check_data_compat(run: RunState, saved: dict, path: str) -> None:
    """What cannot be mapped (another dataset or order) is refused; a changed batch size, accumulation
    or world size continues at the same sample position of the same order, with a warning (as HF)."""
    args, data = run.trainer.args, run.data
    fixed = {"num_samples": data.num_samples, "seed": data.seed}
    fixed.update({k: v for k, v in data.state().items() if k in ("kind", "shuffle", "buffer_rows", "num_blocks")})
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in fixed.items() if k in saved and saved[k] != v]
    order = (saved.get("data_order", "raytrain"), data.state().get("data_order", "raytrain"))
    if data.state().get("kind") == "map" and order[0] != order[1]:  # the default's state leaves it out
        changed.append(f"data_order {order[0]} -> {order[1]}")
    grouped = (saved.get("group_by_length"), data.state().get("group_by_length"))
    if (grouped[0] is None) != (grouped[1] is None):
        changed.append(f"group_by_length {grouped[0] is not None} -> {grouped[1] is not None}")
    elif grouped[0] != grouped[1]:  # another batch (an elastic resize): the saved run's megabatches go on
        getattr(data, "source", data).length_batch = grouped[0]
    if changed:
        msg = f"{path}: resuming would change the data order ({'; '.join(changed)})"
        if not args.ignore_data_skip:
            raise ValueError(msg + "; restore the original settings or set ignore_data_skip to "
                             "resume anyway at the start of the saved epoch")
        logger.warning("%s; ignore_data_skip is set: continuing from the start of epoch %d", msg, saved["epoch"])
    if args.ignore_data_skip:
        saved["next_batch"] = 0
        return
    now = {"batch_size": data.batch_size, "world_size": data.world_size, "drop_last": data.drop_last,
           "gradient_accumulation_steps": args.gradient_accumulation_steps}
    mapped = [f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
    resume_at = getattr(data, "resume_at", None)
    if resume_at is not None:  # a stream lays out exactly the rows the saved epoch had left (data/stream.py)
        saved["next_batch"] = resume_at(saved)
        if mapped:
            logger.warning("%s: resuming with %s: the rest of epoch %d (the samples the saved run had not read, "
                           "each once) is split between this run's ranks from batch %d", path, "; ".join(mapped),
                           saved["epoch"], saved["next_batch"])
        return
    if mapped and saved.get("batch_size") and saved.get("world_size"):
        consumed = saved["next_batch"] * saved["batch_size"] * saved["world_size"]
        global_now = data.batch_size * data.world_size
        saved["next_batch"] = consumed // global_now
        again = consumed - saved["next_batch"] * global_now
        logger.warning("%s: resuming with %s: epoch %d continues at sample %d of the same order%s", path,
                       "; ".join(mapped), saved["epoch"], consumed,
                       f" ({again} samples of the last partial global batch are seen again)" if again else "")

