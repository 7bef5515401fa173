"""WORKER side: which checkpoint a train() continues from, and putting the run back exactly where it
stood (model, optimizer, scheduler, scaler, RNG, data position, loop accumulators, callbacks).

Everything is read, and checked against the manifest, before anything is applied: a checkpoint that
fails changes nothing. The weights are checksummed while they are read (one pass over their bytes),
the other files by verify_checkpoint before that.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import checkpoint as ckpt
from ..state import TrainerControl, TrainerState

if TYPE_CHECKING:
    from .loop import _Run

logger = logging.getLogger(__name__)

DATA_STATE = "data_state.json"
LOOP_STATE = "loop_state.json"


def resolve(trainer, resume) -> str | None:
    """The checkpoint to continue from, verified; or None for a fresh start (never a silent one)."""
    args = trainer.args
    if resume is None or resume is False or resume == "never":
        existing = ckpt.sorted_checkpoints(args.output_dir)
        if existing and trainer.strategy_is_main():
            if args.overwrite_output_dir:
                logger.warning("overwrite_output_dir: deleting %d old checkpoint(s) in %s", len(existing),
                               args.output_dir)
                for _, p in existing:
                    shutil.rmtree(p)
            elif resume == "never":  # the CLI's --resume never: refuse rather than move anything
                raise FileExistsError(
                    f"output_dir {args.output_dir} already holds {os.path.basename(existing[-1][1])}; "
                    "use --resume auto to continue it, or --set overwrite_output_dir=true to start over "
                    "(its checkpoints are then deleted)")
            else:
                _archive_previous_run(args.output_dir, [p for _, p in existing])
        return None
    if resume is True or resume == "auto":
        path = ckpt.get_last_checkpoint(args.output_dir, weights_on_load=True)
        found = ckpt.sorted_checkpoints(args.output_dir)
        if path is None and found:  # every one is corrupt: starting over would silently lose them
            raise ckpt.CheckpointError(
                f"resume_from_checkpoint={resume!r}: none of the {len(found)} checkpoint(s) in {args.output_dir} "
                "is complete and intact (the warnings above name each bad file); repair one, pass its path, "
                "or move them away to start over")
        if path is None and resume is True:
            raise FileNotFoundError(f"resume_from_checkpoint=True: no complete checkpoint in {args.output_dir}")
        return path
    _verify_named_checkpoint(str(resume))
    return str(resume)


def _verify_named_checkpoint(path: str) -> None:
    """A checkpoint named explicitly is verified; if only its weights differ from the manifest (re-saved
    by save_pretrained, e.g. sharded), it is used with a warning once the weights load."""
    try:
        ckpt.verify_checkpoint(path, weights_on_load=True)
    except ckpt.CheckpointError as e:
        bad = str(e).split(":", 1)[0]
        if not (bad.startswith(path) and ckpt.is_weights_file(os.path.relpath(bad, path))
                and ckpt.weights_resaved_elsewhere(path)):
            raise  # raytrain's own weights that fail their manifest are corrupt
        ckpt.verify_checkpoint(path, ignore_weights=True)
        logger.warning("%s; its weights do not match the manifest (re-saved, e.g. by save_pretrained?): "
                       "resuming with them as they are now, every other file verified", e)


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


def restore(run: _Run, path: str, auto: bool) -> None:
    """_restore, whose weights are checked against the manifest as they are read. Weights that fail
    are treated as verify_checkpoint would have: skipped for the next older checkpoint (auto resume),
    used with a warning if re-saved by another tool (a named checkpoint), otherwise refused."""
    while True:
        try:
            return _restore(run, path, ckpt.read_manifest(path))
        except ckpt.ChecksumError as e:
            if not auto and ckpt.weights_resaved_elsewhere(path):
                logger.warning("%s; its weights do not match the manifest (re-saved, e.g. by save_pretrained?): "
                               "resuming with them as they are now, every other file verified", e)
                return _restore(run, path, None)
            if not auto:
                raise
            logger.warning("skipping checkpoint %s: %s; trying the next older one", path, e)
            step = next(s for s, p in ckpt.sorted_checkpoints(run.trainer.args.output_dir) if p == path)
            path = ckpt.get_last_checkpoint(run.trainer.args.output_dir, weights_on_load=True, before_step=step)
            if path is None:
                raise ckpt.CheckpointError(f"resume: no intact checkpoint left in {run.trainer.args.output_dir} "
                                           "(the warnings above name each bad file)") from None


def _restore(run: _Run, path: str, manifest: dict | None) -> None:
    """Put the run back exactly where checkpoint `path` stood. Every file is read first (a bad one is
    refused with a CheckpointError naming it), so nothing is changed by a checkpoint that fails."""
    trainer, strategy = run.trainer, run.strategy
    file = lambda name: os.path.join(path, name)  # noqa: E731
    data_state, loop = _read_json(file(DATA_STATE)), _read_json(file(LOOP_STATE))
    saved = _read_trainer_state(file("trainer_state.json"))
    _check_data_compat(run, data_state, path)
    weights = ckpt.load_weights(path, manifest)
    # optimizer.pt, a dcp/ or a deepspeed/ directory, whichever backend wrote it; the strategy re-shards
    # what it can read and refuses, naming the file, what it cannot (CheckpointError).
    optim = strategy.read_optimizer_state(path)
    sched = ckpt.load_pickle(file("scheduler.pt"))
    scaler = None
    if strategy.scaler is not None:
        if os.path.exists(file("scaler.pt")):
            scaler = ckpt.load_pickle(file("scaler.pt"))
        else:
            logger.warning("%s: no scaler.pt (the run did not use fp16); the fp16 loss scale starts fresh", path)
    rng_file = "rng_state.pth" if strategy.world_size == 1 else f"rng_state_{strategy.rank}.pth"
    rng = ckpt.load_pickle(file(rng_file)) if os.path.exists(file(rng_file)) else None

    weights_file = file(ckpt.WEIGHTS if os.path.exists(file(ckpt.WEIGHTS)) else ckpt.WEIGHTS_INDEX)
    _apply(weights_file, strategy.load_model_state_dict, weights)
    _apply(path, strategy.load_optimizer_state, optim)
    _apply(file("scheduler.pt"), trainer.lr_scheduler.load_state_dict, sched)
    if scaler is not None:
        _apply(file("scaler.pt"), strategy.scaler.load_state_dict, scaler)
    fresh = trainer.state
    if saved.max_steps != fresh.max_steps:
        logger.warning("%s: max_steps %d -> %d: the learning-rate schedule continues as one of %d steps",
                       path, saved.max_steps, fresh.max_steps, fresh.max_steps)
    for name in ("max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size",
                 "num_train_epochs", "is_local_process_zero", "is_world_process_zero",
                 "is_hyper_param_search", "trial_name", "trial_params"):
        setattr(saved, name, getattr(fresh, name))
    trainer.state = saved
    _restore_callbacks(trainer, saved.stateful_callbacks)
    # The saved sum goes back on rank 0 only: the next log sums over ranks again, whatever their number.
    run.tr_loss = torch.tensor(loop["tr_loss"] if strategy.is_main else 0.0, dtype=run.tr_loss.dtype,
                               device=strategy.device)
    run.total_loss, run.last_logged = loop["total_loss"], loop["last_logged"]
    run.nonfinite, run.skipped_steps = list(loop["nonfinite"]), loop["skipped_steps"]
    if loop.get("grad_norm") is not None:  # logged again by an epoch-end log right after resuming
        run.grad_norm = torch.tensor(loop["grad_norm"], device=strategy.device)
    run.last_lr = loop.get("last_lr", run.last_lr)
    run.epoch, run.next_batch = data_state["epoch"], data_state["next_batch"]
    run.last_saved = saved.global_step
    if rng is not None:
        _set_rng_state(rng)
    else:
        logger.warning("%s: no %s (the run had another world size); RNG streams start fresh", path, rng_file)
    logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, saved.global_step, run.epoch, run.next_batch)


def _restore_callbacks(trainer, stateful: dict) -> None:
    """Callback attributes (e.g. early stopping's patience counter) always come back, so a resumed
    run decides as the uninterrupted one would; with restore_callback_states_from_checkpoint, as in
    HF, the callbacks are also rebuilt with the checkpoint's constructor arguments, TrainerControl too."""
    stateful = dict(stateful)
    control = stateful.pop("TrainerControl", None)
    if trainer.args.restore_callback_states_from_checkpoint:
        trainer.callback_handler.rebuild_from_states(stateful)
        if control is not None:
            trainer.control = TrainerControl(**control.get("args", {}))
    else:
        trainer.callback_handler.restore_states(stateful)


def _apply(path: str, load: Any, state: Any) -> None:
    """load(state), with a mismatch (another model or optimizer) reported against the file."""
    try:
        load(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"{path}: does not fit this run ({str(e).strip().splitlines()[0]})") from e


def _read_trainer_state(path: str) -> TrainerState:
    try:
        return TrainerState.load_from_json(path)
    except (OSError, ValueError, TypeError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e})") from e


def _check_data_compat(run: _Run, saved: dict, path: str) -> None:
    """What cannot be mapped (another dataset or order) is refused; a changed batch size, accumulation
    or world size continues at the same sample position of the same order, with a warning (as HF)."""
    args, data = run.trainer.args, run.data
    fixed = {"num_samples": data.num_samples, "seed": data.seed}
    fixed.update({k: v for k, v in data.state().items() if k in ("kind", "shuffle", "buffer_rows", "num_blocks")})
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in fixed.items() if k in saved and saved[k] != v]
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
    if resume_at is not None:  # a stream lays out exactly the rows the saved epoch had left (data_stream.py)
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


def _read_json(path: str) -> dict:
    import json
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e})") from e


def _set_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


