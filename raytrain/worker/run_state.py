"""WORKER side: one rank's run state, and how each piece of it is saved into a checkpoint and read
back, side by side (as torchtitan's checkpointer and Composer's State keep them).

A checkpoint, piece by piece (file: what it holds; who writes it):
    model.safetensors[.index.json]       the weights (rank 0, from the strategy)
    optimizer.pt | dcp/ | deepspeed/     the optimizer (rank 0, or every rank for sharded backends)
    scheduler.pt, scaler.pt              the learning-rate schedule, fp16's loss scale (rank 0)
    trainer_state.json                   TrainerState, the callbacks' states and TrainerControl (rank 0)
    data_state.json                      the data position and the order's identity (rank 0)
    loop_state.json                      the loop's accumulators: unlogged loss (and each rank's share), grad
                                         norm ... (rank 0)
    rng_state.pth | rng_state_{rank}.pth Python, NumPy, torch CPU and CUDA generators (every rank)
    trainer_rank_state[_{rank}].pth      what the Trainer keeps between steps (rank_state(): GRPO's rollout
                                         buffer and its position), when it keeps anything (every rank)
    training_args.json, HF's files       for people and from_pretrained; never read back
Saving builds them all at one step boundary; restoring reads them all (read_states, read_files)
before it changes anything (apply). Which checkpoint, and what is checked, is resume.py's business.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..hf import adapters, objects as hf
from ..checkpoint import store as ckpt
from ..callbacks.state import TrainerState

if TYPE_CHECKING:
    from .protocol import TrainerProtocol

DATA_STATE = "data_state.json"
LOOP_STATE = "loop_state.json"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"


@dataclass
class RunState:
    """What one rank's training run holds; every piece that must survive a restart is saved."""

    trainer: TrainerProtocol
    strategy: Any
    data: Any                             # a source: iter_batches(epoch, start), state(); len() unless a stream
    steps_per_epoch: int
    num_batches: int | None = None        # batches per epoch; None for a stream (ends when it does)
    exhausted: bool = False               # the current epoch's batches have all been taken
    writer: ckpt.CheckpointWriter | None = None
    epoch: int = 0
    next_batch: int = 0
    tr_loss: torch.Tensor | None = None  # sum of step losses since the last log, on device
    total_loss: float = 0.0               # sum of step losses of logged intervals, for train_loss
    last_logged: int = 0
    last_saved: int = -1
    grad_norm: torch.Tensor | None = None
    last_lr: float = 0.0
    nonfinite: list[int] = field(default_factory=list)
    skipped_steps: int = 0
    count_tokens: Any = None              # a micro-batch's input tokens (worker/tokens.py); None: not counted
    tokens_pending: torch.Tensor | None = None  # the ranks' tokens not yet in TrainerState (on device)
    start_time: float = 0.0               # this session's start and tokens then: train_tokens_per_second
    start_tokens: int = 0
    sync_each_batch: bool = False         # accelerator_config: every micro-batch's gradients reduced (no no_sync)


# ---------------------------------------------------------------- trainer_state.json


def trainer_state(run: RunState) -> TrainerState:
    """TrainerState with every callback's state and TrainerControl in it (HF's stateful_callbacks)."""
    trainer = run.trainer
    trainer.state.stateful_callbacks = {**trainer.callback_handler.export_states(),
                                        "TrainerControl": trainer.control.state()}
    return trainer.state


def load_trainer_state(run: RunState, saved: TrainerState) -> None:
    """The saved progress, with this run's plan (max_steps, intervals, trial ...) kept; callbacks'
    attributes always come back, so a resumed run decides as the uninterrupted one would."""
    trainer, fresh = run.trainer, run.trainer.state
    if trainer.is_world_process_zero():
        trainer.compare_trainer_and_checkpoint_args(trainer.args, saved)  # HF's warning
    for name in ("max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size",
                 "num_train_epochs", "is_local_process_zero", "is_world_process_zero",
                 "is_hyper_param_search", "trial_name", "trial_params"):
        setattr(saved, name, getattr(fresh, name))
    trainer.state = saved
    trainer._load_callback_state()  # HF's override point: callbacks and TrainerControl from the state
    run.last_saved = saved.global_step


def read_trainer_state(path: str) -> TrainerState:
    try:
        return TrainerState.load_from_json(path)
    except (OSError, ValueError, TypeError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e})") from e


# ---------------------------------------------------------------- data_state.json


def data_state(run: RunState, epoch_finished: bool) -> dict:
    """Where the next batch comes from, and the source's identity (resume.py checks it)."""
    args, strategy = run.trainer.args, run.strategy
    epoch, nxt = (run.epoch + 1, 0) if epoch_finished else (run.epoch, run.next_batch)
    return {"epoch": epoch, "next_batch": nxt, "global_step": run.trainer.state.global_step,
            "samples_consumed": nxt * args.per_device_train_batch_size * strategy.dp_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            **run.data.state()}


def load_data_state(run: RunState, saved: dict) -> None:
    run.epoch, run.next_batch = saved["epoch"], saved["next_batch"]


# ---------------------------------------------------------------- loop_state.json


def loop_state(run: RunState, pending_loss: float, shares: list[float] | None = None) -> dict:
    """The loop's accumulators; `pending_loss`: the unlogged loss summed over ranks, `shares`: each rank's."""
    return {"tr_loss": pending_loss, "tr_loss_by_rank": shares, "tr_loss_layout": run.strategy.layout,
            "total_loss": run.total_loss,
            "last_logged": run.last_logged, "nonfinite": list(run.nonfinite),
            "skipped_steps": run.skipped_steps,
            "grad_norm": None if run.grad_norm is None else float(run.grad_norm),
            "last_lr": run.last_lr}


def load_loop_state(run: RunState, saved: dict) -> None:
    strategy = run.strategy
    # Each rank's share back on the same ranks and layout (the next log sums them in the same order: bit-exact);
    # else the saved sum on rank 0: the next log sums over ranks again, whatever their number and layout (under
    # TP or PP a log sums over some ranks only, so shares on another layout could count twice or not at all).
    shares = saved.get("tr_loss_by_rank")
    if shares is not None and len(shares) == strategy.world_size and saved.get("tr_loss_layout") == strategy.layout:
        mine = shares[strategy.rank]
    else:
        mine = saved["tr_loss"] if strategy.is_main else 0.0
    run.tr_loss = torch.tensor(mine, dtype=run.tr_loss.dtype, device=strategy.device)
    run.total_loss, run.last_logged = saved["total_loss"], saved["last_logged"]
    run.nonfinite, run.skipped_steps = list(saved["nonfinite"]), saved["skipped_steps"]
    if saved.get("grad_norm") is not None:  # logged again by an epoch-end log right after resuming
        run.grad_norm = torch.tensor(saved["grad_norm"], device=strategy.device)
    run.last_lr = saved.get("last_lr", run.last_lr)


# ---------------------------------------------------------------- rng_state[_RANK].pth


def rng_file(strategy) -> str:
    return "rng_state.pth" if strategy.world_size == 1 else f"rng_state_{strategy.rank}.pth"


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        # One state per GPU the saving process saw; resumed where fewer are visible (another machine),
        # those that exist are restored (set_rng_state_all would fail on the first missing device).
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def rank_state_file(strategy) -> str:
    return "trainer_rank_state.pth" if strategy.world_size == 1 else f"trainer_rank_state_{strategy.rank}.pth"


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- the checkpoint: every piece


def save(run: RunState, epoch_finished: bool) -> str | None:
    """Write this step's checkpoint (in the background with save_async); its path, or None when this
    step's checkpoint exists already (a step-end save followed by an epoch-end save)."""
    trainer, strategy, state, args = run.trainer, run.strategy, run.trainer.state, run.trainer.args
    if run.writer is None or run.last_saved == state.global_step:
        return None
    path = ckpt.checkpoint_dir(args.output_dir, state.global_step)
    if state.best_global_step == state.global_step:
        state.best_model_checkpoint = path
    elif state.best_global_step:  # evaluated after its step's save (HF: the best step's checkpoint on disk)
        best = ckpt.checkpoint_dir(args.output_dir, state.best_global_step)
        if os.path.isdir(best):
            state.best_model_checkpoint = best
    saved_state = trainer_state(run)
    peft = adapters.peft_of(strategy.model)  # its checkpoint holds the adapter alone, written by PEFT

    def extra_files(tmp: str) -> None:  # rank 0's, synchronously
        hf.save_pretrained_files(trainer.model, trainer.processing_class, args, tmp)
        if peft is not None:
            adapters.save_adapter(peft, weights, tmp)

    pickles = {rng_file(strategy): rng_state()}
    kept = trainer.rank_state()
    if kept is not None:
        pickles[rank_state_file(strategy)] = kept
    payload = ckpt.CheckpointPayload(pickles=pickles,
                                     sharded_writer=strategy.save_sharded if strategy.has_sharded_state else None,
                                     extra_files=extra_files)
    weights = strategy.model_state_dict(trainable_only=peft is not None)  # a collective for sharded backends
    # Each rank holds its share of the unlogged loss; the checkpoint keeps their sum and the shares (collectives).
    pending_loss = strategy.reduce_loss(run.tr_loss.detach().clone()).item()
    shares = strategy.all_gather_object(run.tr_loss.item()) if strategy.world_size > 1 else None
    if strategy.is_main:
        payload.weights = weights if peft is None else None
        if not args.save_only_model:
            opt_state = strategy.optimizer_state_dict()
            if opt_state is not None:
                payload.pickles["optimizer.pt"] = opt_state
            payload.pickles[SCHEDULER] = trainer.lr_scheduler.state_dict()
            if strategy.scaler is not None:
                payload.pickles[SCALER] = strategy.scaler.state_dict()
        payload.jsons = {
            ckpt.TRAINER_STATE: saved_state.to_json_string(),
            "training_args.json": args.to_dict(),
            DATA_STATE: data_state(run, epoch_finished),
            LOOP_STATE: loop_state(run, pending_loss, shares),
        }
    best = state.best_model_checkpoint  # as of this save: a background rotation must not see a later one
    # A background distributed save reports the previous checkpoint to Ray while this one is written
    # (ray_worker.RayReportCallback): this save's rotation keeps it.
    previous = ckpt.checkpoint_dir(args.output_dir, run.last_saved) \
        if run.writer.side_channel is not None and run.last_saved >= 0 else None

    def rotate(final: str) -> None:
        ckpt.rotate_checkpoints(args.output_dir, args.save_total_limit, best, protect=(final, previous or final))

    run.writer.save(state.global_step, payload, after=rotate)
    run.last_saved = state.global_step
    return path


@dataclass
class SavedState:
    """One checkpoint's pieces for this rank, read (and checked as read), none applied yet."""

    path: str
    trainer_state: TrainerState
    data: dict
    loop: dict
    weights: Any = None
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None                    # None: not saved (the run did not use fp16) or not needed
    rng: Any = None                       # None: no file for this rank (the run had another world size)
    rank_state: Any = None                # the Trainer's own (rank_state()); None: not saved for this rank

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


def read_states(path: str) -> SavedState:
    """The small JSON pieces first: the data check needs them before any weights are read."""
    file = lambda name: os.path.join(path, name)  # noqa: E731
    data, loop = _read_json(file(DATA_STATE)), _read_json(file(LOOP_STATE))
    return SavedState(path, read_trainer_state(file(ckpt.TRAINER_STATE)), data, loop)


def read_files(run: RunState, saved: SavedState, manifest: dict | None) -> None:
    """The weights (checked against `manifest` as they are read), optimizer, scheduler, scaler, RNG."""
    strategy, file = run.strategy, saved.file
    saved.weights = ckpt.load_weights(saved.path, manifest)
    # optimizer.pt, a dcp/ or a deepspeed/ directory, whichever backend wrote it; the strategy re-shards
    # what it can read and refuses, naming the file, what it cannot (CheckpointError).
    saved.optimizer = strategy.read_optimizer_state(saved.path)
    saved.scheduler = ckpt.load_pickle(file(SCHEDULER))
    if strategy.scaler is not None and os.path.exists(file(SCALER)):
        saved.scaler = ckpt.load_pickle(file(SCALER))
    rng = file(rng_file(strategy))
    saved.rng = ckpt.load_pickle(rng) if os.path.exists(rng) else None
    kept = file(rank_state_file(strategy))
    saved.rank_state = ckpt.load_pickle(kept) if os.path.exists(kept) else None


def apply(run: RunState, saved: SavedState) -> None:
    """Put every piece back; a model or optimizer that does not fit is reported against its file."""
    trainer, strategy, file = run.trainer, run.strategy, saved.file
    weights_file = file(next((n for n in (ckpt.ADAPTER_WEIGHTS, ckpt.WEIGHTS) if os.path.exists(file(n))),
                             ckpt.WEIGHTS_INDEX))
    _apply(weights_file, lambda w: adapters.load_weights(strategy, w, saved.path), saved.weights)
    _apply(saved.path, strategy.load_optimizer_state, saved.optimizer)
    _apply(file(SCHEDULER), trainer.lr_scheduler.load_state_dict, saved.scheduler)
    if saved.scaler is not None:
        _apply(file(SCALER), strategy.scaler.load_state_dict, saved.scaler)
    load_trainer_state(run, saved.trainer_state)
    load_loop_state(run, saved.loop)
    load_data_state(run, saved.data)
    if saved.rng is not None:
        load_rng_state(saved.rng)
    run.trainer.load_rank_state(saved.rank_state)


def _apply(path: str, load: Any, state: Any) -> None:
    """load(state), with a mismatch (another model or optimizer) reported against the file."""
    try:
        load(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"{path}: does not fit this run ({str(e).strip().splitlines()[0]})") from e


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e})") from e
