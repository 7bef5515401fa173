"""WORKER side: train for one rank, whatever the backend. Which checkpoint it continues is resume.py's
choice; how each piece of the run is saved and restored, run_state.py's.

The loop, with every callback event in the order it fires (HF Trainer's order)::

    Trainer.__init__                               -> on_init_end
    train():                                         NEFTune's hook on the input embeddings till the end
      log_training_start                             HF's "***** Running training *****" info lines
      restore(checkpoint)                            model, optimizer, scheduler, scaler, RNG,
                                                     data position, loop accumulators, callbacks
      on_train_begin
      for epoch from the restored one:
        on_epoch_begin
        for each update step (gradient_accumulation_steps micro-batches):
          on_step_begin
          for each micro-batch:
            training_step: forward, HF's loss (a mean: x items/items_in_step), backward (no_sync but the last,
                           unless accelerator_config's sync_each_batch)
            on_substep_end                           (after every micro-batch but the last)
          clip -> on_pre_optimizer_step -> optimizer.step -> on_optimizer_step
          scheduler.step; global_step += 1
          on_step_end
          log_evaluate_save:  log -> on_log
                              evaluate -> on_prediction_step (per batch) -> on_log -> on_evaluate
                              save -> on_save
        on_epoch_end
        log_evaluate_save                            (as above)
      wait for a background save; load best model (load_best_model_at_end)
      final metrics -> on_log
      on_train_end
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..hf import accelerate_config, adapters, instrument
from ..checkpoint import store as ckpt
from . import elastic, neftune, resume, run_state, tokens
from ..data.columns import check_same_schema, is_named_datasets
from ..data.loaders import LoaderSource, check_iterable_training, num_batches
from ..optim.schedules import scheduler_needs_metric
from .run_state import RunState
from ..callbacks.state import TrainerState, TrainOutput

if TYPE_CHECKING:
    from .protocol import TrainerProtocol

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had non-finite gradients."""


# ---------------------------------------------------------------- train


def train(trainer: TrainerProtocol, resume_from_checkpoint=None, trial=None, locate=None) -> TrainOutput:
    """The training loop. `locate(path)`, a context manager, gives a directory holding that checkpoint's
    weights on this rank (Ray runs: fetched from Ray's storage where this node's disk lacks them)."""
    args = trainer.args
    instrument.apply_liger(trainer.model, args)  # as HF's train(): Liger's kernels, the underflow watch
    instrument.watch_underflow_overflow(trainer.model, args.debug)
    if args.tf32 is not None:  # HF sets it with the arguments, in their process: here in the training one
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    trainer.is_in_train = True  # evaluations during training keep the training precision (full_eval)
    try:
        with neftune.noise(trainer.model, args.neftune_noise_alpha):  # removed after training, as HF
            return _train(trainer, resume_from_checkpoint, trial, locate)
    finally:
        trainer.is_in_train = False


def _train(trainer: TrainerProtocol, resume_from_checkpoint, trial, locate) -> TrainOutput:
    configured = elastic.fit_batch(trainer.args, trainer.get_strategy().world_size)  # before the data is cut
    accelerate_config.split_batches(trainer.args, trainer.get_strategy().dp_size)  # split_batches: this rank's part
    run = _setup(trainer)
    trainer.log_training_start(run.data, run.steps_per_epoch)  # HF's "***** Running training *****" lines
    path = resume.resolve(trainer, resume_from_checkpoint)
    saved = None
    if path:
        saved = resume.restore(run, path, auto=resume_from_checkpoint is True or resume_from_checkpoint == "auto")
    if configured is not None and run.strategy.is_main:
        elastic.announce(trainer.args, run.strategy.world_size, saved or configured)
    args, state, cb = trainer.args, trainer.state, trainer.callback_handler
    start, start_step = time.perf_counter(), state.global_step
    run.start_time, run.start_tokens = start, state.num_input_tokens_seen
    trainer.control = cb.on_train_begin(args, state, trainer.control)
    if args.eval_on_start and state.global_step == 0:
        trainer.evaluate(ignore_keys=trainer.ignore_keys_for_eval)  # a sanity check, as HF; not a best candidate
    while state.global_step < state.max_steps and not trainer.control.should_training_stop:
        trainer.control = cb.on_epoch_begin(args, state, trainer.control)
        for window in _windows(run):
            _train_step(run, window)
            trainer.control = cb.on_step_end(args, state, trainer.control)
            _log_evaluate_save(run, trial)
            if trainer.control.should_epoch_stop or trainer.control.should_training_stop:
                break
        finished = run.exhausted
        trainer.control = cb.on_epoch_end(args, state, trainer.control)
        _log_evaluate_save(run, trial, epoch_finished=finished)
        if finished:
            run.epoch, run.next_batch, run.exhausted = run.epoch + 1, 0, False
    if run.writer is not None:
        run.writer.close()
        _keep_only_best(trainer)
    if args.load_best_model_at_end and state.best_model_checkpoint:
        with (locate or contextlib.nullcontext)(state.best_model_checkpoint) as best:
            adapters.load_weights(run.strategy, ckpt.load_weights(best, ckpt.read_manifest(best)), best)
    tokens.flush(run)
    metrics = _train_metrics(run, start, start_step)
    trainer.log(metrics)
    trainer.control = cb.on_train_end(args, state, trainer.control)
    return TrainOutput(state.global_step, metrics["train_loss"], metrics)


def _keep_only_best(trainer: TrainerProtocol) -> None:
    """As HF: with save_total_limit 1 and a best checkpoint, the run ends with the best one alone."""
    args, state = trainer.args, trainer.state
    if args.save_total_limit != 1 or not state.best_model_checkpoint or not trainer.is_world_process_zero():
        return
    best = os.path.abspath(state.best_model_checkpoint)
    for _, p in ckpt.sorted_checkpoints(args.output_dir):
        if os.path.abspath(p) != best:
            shutil.rmtree(p, ignore_errors=True)


def _setup(trainer: TrainerProtocol) -> RunState:
    """Strategy, data, model, optimizer, scheduler and a fresh TrainerState for this rank."""
    args = trainer.args
    strategy = trainer.get_strategy()
    data = _train_source(trainer, strategy)
    n_batches, steps_per_epoch, max_steps, epochs = plan_steps(args, data)
    opt, sched = trainer.optimizers
    if trainer.lr_scheduler is not None and trainer.lr_scheduler is not sched:
        trainer.lr_scheduler = None  # a schedule created by an earlier train() starts over, as HF
    model, optimizer = strategy.setup(trainer.model, trainer.optimizer_factory(max_steps), opt)
    trainer.model_wrapped, trainer.optimizer = model, optimizer
    # HF's training_step sets train mode on every step; the loop's, only after an evaluation: here, the whole model
    # once (a wrapper, DDP or PeftModel, may train while the model inside came in from_pretrained's eval mode)
    model.train()
    trainer.create_scheduler(max_steps, optimizer)
    cb = trainer.callback_handler
    cb.model, cb.optimizer, cb.lr_scheduler, cb.train_dataloader = model, optimizer, trainer.lr_scheduler, data
    log_s, eval_s, save_s = args.resolve_steps(max_steps)
    trainer.state = TrainerState(
        max_steps=max_steps, logging_steps=log_s, eval_steps=eval_s, save_steps=save_s,
        train_batch_size=trainer._train_batch_size, num_train_epochs=epochs,
        is_local_process_zero=strategy.local_rank == 0, is_world_process_zero=strategy.is_main,
        is_hyper_param_search=trainer.trial_name is not None, trial_name=trainer.trial_name,
        trial_params=trainer.trial_params,
    )
    writer = None
    if args.save_strategy != "no":
        if strategy.is_main:
            os.makedirs(args.output_dir, exist_ok=True)
        writer = ckpt.CheckpointWriter(args.output_dir, rank=strategy.rank, world_size=strategy.world_size,
                                       strategy=strategy.name, barrier=strategy.barrier, layout=strategy.layout,
                                       save_async=args.save_async, async_policy=args.save_async_policy,
                                       all_gather=strategy.all_gather_object,
                                       side_channel=strategy.side_channel() if args.save_async and
                                       strategy.world_size > 1 else None)
    return RunState(trainer, strategy, data, steps_per_epoch, n_batches, writer=writer,
                    tr_loss=torch.zeros((), device=strategy.device), count_tokens=tokens.counter(trainer),
                    sync_each_batch=accelerate_config.sync_each_batch(args.accelerator_config))


def _train_source(trainer: TrainerProtocol, strategy):
    """get_train_dataloader's source (a plain iterable of batches is wrapped); eval sets checked against it."""
    data = trainer.get_train_dataloader()
    if not hasattr(data, "iter_batches"):  # an overridden get_train_dataloader returned a plain iterable
        data = LoaderSource(data, rank=strategy.dp_rank, world_size=strategy.dp_size)
    data = strategy.split_sequences(data)  # sp_size: each batch's slice of its sequences, this rank's
    check_iterable_training(data, trainer.args.max_steps)
    if trainer.eval_dataset is not None:  # a mismatched eval set fails now, not at the first evaluation
        evals = trainer.eval_dataset if is_named_datasets(trainer.eval_dataset) else {None: trainer.eval_dataset}
        for name in evals:
            check_same_schema(data, trainer.get_eval_dataloader(name))
    return data


def plan_steps(args, data) -> tuple[int | None, int, int, int]:
    """(batches per epoch, update steps per epoch, max_steps, epochs); a stream's epoch is max_steps long."""
    n_batches = num_batches(data)
    if n_batches is None:
        return None, args.max_steps, args.max_steps, 1
    steps_per_epoch = max(1, math.ceil(n_batches / args.gradient_accumulation_steps))
    if args.max_steps > 0:
        return n_batches, steps_per_epoch, args.max_steps, math.ceil(args.max_steps / steps_per_epoch)
    return (n_batches, steps_per_epoch, math.ceil(args.num_train_epochs * steps_per_epoch),
            math.ceil(args.num_train_epochs))


def _windows(run: RunState):
    """The micro-batches of each update step from the current data position to the epoch's end."""
    ga = run.trainer.args.gradient_accumulation_steps
    if run.num_batches is not None and run.next_batch >= run.num_batches:
        run.exhausted = True
        return
    batches = run.data.iter_batches(run.epoch, run.next_batch)
    while True:
        window = list(itertools.islice(batches, ga))
        run.next_batch += len(window)
        run.exhausted = len(window) < ga or run.next_batch == run.num_batches
        if window:
            yield window
        if run.exhausted:
            return


def _train_step(run: RunState, window: list[dict]) -> None:
    trainer, strategy = run.trainer, run.strategy
    args, state, cb = trainer.args, trainer.state, trainer.callback_handler
    trainer.control = cb.on_step_begin(args, state, trainer.control)
    count = run.count_tokens
    seen = sum(map(count, window)) if count is not None else 0  # on the host, before the device
    window = [trainer.prepare_inputs(b) for b in window]
    trainer.current_gradient_accumulation_steps = len(window)  # HF's, for a loss scaled by the accumulation
    num_items = None
    if len(window) > 1 or strategy.world_size > 1 or trainer.loss_needs_num_items():
        # Normalise by the items of the whole update step (all micro-batches, all ranks unless
        # average_tokens_across_devices is off); with one micro-batch on one rank the count is skipped.
        counts = [trainer.count_loss_items(b) for b in window]
        items = sum(counts) if all(c is not None for c in counts) else None  # None: the model's own loss
        across = items is not None and args.average_tokens_across_devices and strategy.world_size > 1
        if count is not None and strategy.world_size > 1:  # the ranks' tokens ride in the same all_reduce
            reduced, seen = tokens.reduce_counts(strategy, items if across else None, seen)
            num_items = reduced if across else items
            run.tokens_pending = seen if run.tokens_pending is None else run.tokens_pending + seen
        else:
            num_items = strategy.all_reduce(items) if across else items
    if count is not None and strategy.world_size == 1:
        state.num_input_tokens_seen += seen
    step_loss = None
    gradient_state = trainer.accelerator.gradient_state
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        gradient_state.sync_gradients = last  # as HF sets accelerate's flag for each micro-batch
        with (strategy.no_sync() if not last and not run.sync_each_batch else _null()):
            loss = trainer.training_step(trainer.model_wrapped, batch, num_items)
        step_loss = loss if step_loss is None else step_loss + loss
        if not last:
            trainer.control = cb.on_substep_end(args, state, trainer.control)
        state.total_flos += trainer.floating_point_ops(batch)
    if strategy.gradient_scale > 1:  # HF's loss is each rank's x the ranks the backend averages over (sp_size's
        step_loss = step_loss / strategy.gradient_scale  # too): this rank's share of the mean
    run.grad_norm = strategy.clip_grad_norm(args.max_grad_norm)
    trainer.control = cb.on_pre_optimizer_step(args, state, trainer.control)
    stepped = strategy.optimizer_step(run.grad_norm)
    trainer.control = cb.on_optimizer_step(args, state, trainer.control)
    run.last_lr = trainer.current_learning_rate()  # the rate this step used is the one logged, as HF
    if not scheduler_needs_metric(trainer.lr_scheduler):
        trainer.lr_scheduler.step()
    strategy.zero_grad()
    state.global_step += 1
    state.epoch = run.epoch + run.next_batch / (run.num_batches or run.steps_per_epoch * args.gradient_accumulation_steps)
    _account_nonfinite(run, stepped)
    # A non-finite loss must not poison the logged average (logging_nan_inf_filter, as HF). Such a
    # loss always comes with non-finite gradients, so only skipped steps need the on-device check.
    if args.logging_nan_inf_filter and not stepped:
        fallback = run.tr_loss / (1 + state.global_step - 1 - run.last_logged)
        step_loss = torch.where(torch.isfinite(step_loss), step_loss, fallback)
    run.tr_loss = run.tr_loss + step_loss


def _account_nonfinite(run: RunState, stepped: bool) -> None:
    step = run.trainer.state.global_step
    if stepped:
        run.nonfinite.clear()
        return
    run.skipped_steps += 1
    if run.strategy.scaler is not None:
        return  # fp16 loss scaling skips overflowing steps by design and recovers by itself
    run.nonfinite.append(step)
    limit = run.trainer.args.max_nonfinite_steps
    logger.warning("step %d: non-finite gradients (grad_norm=%s); optimizer step skipped", step,
                   float(run.grad_norm))
    if limit is not None and len(run.nonfinite) >= limit:
        raise NonFiniteError(
            f"non-finite gradients at steps {', '.join(map(str, run.nonfinite))} ({limit} in a row); "
            "lower learning_rate, set max_grad_norm, or use bf16; the last checkpoint is unaffected")


def _log_evaluate_save(run: RunState, trial, epoch_finished: bool = False) -> None:
    trainer = run.trainer
    control, state = trainer.control, trainer.state
    if run.tokens_pending is not None and (control.should_log or control.should_evaluate or control.should_save):
        tokens.flush(run)
    if control.should_log and state.global_step > run.last_logged:
        # Each rank's loss is its share of the step's loss (items / items of all ranks): sum them.
        loss = run.strategy.reduce_loss(run.tr_loss.detach().clone()).item()
        steps = state.global_step - run.last_logged
        logs = {"loss": loss / steps}
        if run.grad_norm is not None:
            logs["grad_norm"] = float(run.grad_norm)
        logs["learning_rate"] = run.last_lr
        if run.count_tokens is not None:  # HF's speed_metrics: trainer.log adds num_input_tokens_seen
            logs.update(tokens.speed(run, time.perf_counter()))
        run.total_loss += loss
        run.tr_loss.zero_()
        run.last_logged = state.global_step
        trainer.log(logs)
    metrics = None
    if control.should_evaluate:
        metrics = trainer._evaluate(trial, trainer.ignore_keys_for_eval)  # HF's override point
        _update_best(trainer, metrics)
        if trainer.args.save_strategy == "best":
            control.should_save = state.best_global_step == state.global_step
    saved = None
    if trainer.control.should_save and _skip_save(run):
        trainer.control.should_save = False
    if trainer.control.should_save:
        saved = run_state.save(run, epoch_finished)
        trainer.control = trainer.callback_handler.on_save(trainer.args, state, trainer.control)
    if trial is not None and metrics is not None:
        if saved and run.writer is not None:
            run.writer.wait()  # a search scheduler (PBT) may restore this checkpoint at once
        trainer.report_to_trial(trial, metrics, saved)


def _skip_save(run: RunState) -> bool:
    """save_async_policy "skip": drop this save while the previous one is still being written; the
    run's last save and a new best are always written (after waiting)."""
    state, control = run.trainer.state, run.trainer.control
    must = control.should_training_stop or state.best_global_step == state.global_step
    if run.writer is None or run.writer.async_policy != "skip" or must:
        return False
    skip = run.writer.should_skip()
    if run.writer.side_channel is not None:  # skipped by every rank or none: any rank still writing skips
        skip = bool(run.strategy.all_reduce(torch.tensor(float(skip)), op="max").item())
    return skip


def _update_best(trainer: TrainerProtocol, metrics: dict) -> None:
    args, state = trainer.args, trainer.state
    if not args.metric_for_best_model:
        return
    key = _metric_key(args.metric_for_best_model)
    if key not in metrics:
        raise KeyError(f"metric_for_best_model: {key!r} is not among the evaluation metrics "
                       f"{sorted(metrics)}; pick one of them")
    value = metrics[key]
    better = np.greater if args.greater_is_better else np.less
    if state.best_metric is None or better(value, state.best_metric):
        state.best_metric, state.best_global_step = float(value), state.global_step


def _metric_key(name: str) -> str:
    return name if name.startswith("eval_") else f"eval_{name}"


def _train_metrics(run: RunState, start: float, start_step: int) -> dict:
    trainer, state = run.trainer, run.trainer.state
    runtime = time.perf_counter() - start
    steps = state.global_step - start_step
    pending = run.strategy.reduce_loss(run.tr_loss.detach().clone()).item()  # shares: summed
    samples = steps * trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps \
        * run.strategy.dp_size
    metrics = {
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(samples / runtime, 3) if runtime > 0 else 0.0,
        "train_steps_per_second": round(steps / runtime, 3) if runtime > 0 else 0.0,
        "total_flos": state.total_flos,
        "train_loss": (run.total_loss + pending) / max(state.global_step, 1),
    }
    if run.skipped_steps:
        metrics["train_skipped_steps"] = run.skipped_steps
    metrics.update(trainer.stop_memory_tracking("train"))
    return metrics


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
