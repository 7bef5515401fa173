"""HF Trainer's underscore override points that subclasses (and HF's own tests) use: _evaluate,
_load_callback_state, _get_learning_rate, _train_batch_size and the batch-size finder, as a mixin of
trainer.Trainer (the worker reaches them only through worker/protocol.py); and HF's sort_checkpoints."""

from __future__ import annotations

import logging
import os
import re
import sys

import torch

from ..checkpoint import store as ckpt
from ..optim.schedules import scheduler_needs_metric
from ..callbacks.state import TrainerControl, TrainerState, TrainOutput

# HF's name: transformers.logging settings (and HF's tests) govern the Trainer's HF messages.
logger = logging.getLogger("transformers.trainer")

_COMPARED = ("logging_steps", "eval_steps", "save_steps")  # HF compares these with trainer_state.json


class HFOverridePoints:
    """HF's underscore methods as override points; the Trainer provides args, state, control,
    callback_handler, model, optimizer, lr_scheduler and evaluate."""

    # ------------------------------------------------------------ evaluation
    def _evaluate(self, trial, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        """An evaluation during training (HF's): evaluate(), then a metric-driven schedule (ReduceLROnPlateau)
        steps on it. The trial hears of it from the loop, once the checkpoint saved with it is written."""
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        if not skip_scheduler and scheduler_needs_metric(self.lr_scheduler):
            name = self.args.metric_for_best_model or "loss"
            self.lr_scheduler.step(metrics[name if name.startswith("eval_") else f"eval_{name}"])
        return metrics

    # ------------------------------------------------------------ callbacks and learning rate
    def _load_callback_state(self) -> None:
        """Callbacks and TrainerControl from state.stateful_callbacks (HF's): with
        restore_callback_states_from_checkpoint they are rebuilt from their saved arguments and the
        control flags come back; without it raytrain still restores the callbacks' attributes."""
        stateful = dict(self.state.stateful_callbacks)
        control = stateful.pop("TrainerControl", None)
        if self.args.restore_callback_states_from_checkpoint:
            self.callback_handler.rebuild_from_states(stateful)
            if control is not None:
                self.control = TrainerControl(**control.get("args", {}))
        else:
            self.callback_handler.restore_states(stateful)

    def _get_learning_rate(self) -> float:
        """The first group's current rate (HF's): the schedule's last one, or the optimizer's under a
        metric-driven schedule."""
        if self.lr_scheduler is None or scheduler_needs_metric(self.lr_scheduler) \
                or not hasattr(self.lr_scheduler, "get_last_lr"):
            return float(self.optimizer.param_groups[0]["lr"])
        lr = self.lr_scheduler.get_last_lr()[0]
        return float(lr.item() if torch.is_tensor(lr) else lr)

    def current_learning_rate(self) -> float:
        """The rate the last optimizer step used (logged as learning_rate): _get_learning_rate."""
        return self._get_learning_rate()

    # ------------------------------------------------------------ the run's plan
    def set_initial_training_values(self, args, dataloader) -> tuple[int, int, int, int, int, int, int]:
        """HF's (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
        total_train_batch_size, steps_in_epoch, max_steps) of a run over `dataloader`, by the plan the
        loop makes; a dataloader without a length runs max_steps, as HF. Nothing is set, despite the name."""
        n_batches, per_epoch, max_steps, epochs = self._plan_steps(args, dataloader)
        total = self.get_total_train_batch_size(args)
        if n_batches is None:
            if args.max_steps <= 0:
                raise ValueError("args.max_steps must be set to a positive value if dataloader does not have a "
                                 f"length, was {args.max_steps}")
            return (sys.maxsize, max_steps, total * max_steps, total * max_steps, total,
                    max_steps * args.gradient_accumulation_steps, max_steps)
        examples = self.num_examples(dataloader)
        samples = max_steps * total if args.max_steps > 0 else examples * args.num_train_epochs
        return epochs, per_epoch, examples, samples, total, n_batches, max_steps

    def _get_output_dir(self, trial) -> str:
        """Where checkpoints go (HF's override point): a sweep's trial already runs with its own args,
        whose output_dir is the trial's run directory."""
        return self.args.output_dir

    # ------------------------------------------------------------ checkpoints
    def compare_trainer_and_checkpoint_args(self, training_args, trainer_state: TrainerState) -> None:
        """HF's warning when a resumed checkpoint's trainer_state.json had other logging / eval / save
        steps or another per-device batch size."""
        lines = [f"\n\t{name}: {getattr(training_args, name)} (from args) != {getattr(trainer_state, name)} "
                 "(from trainer_state.json)" for name in _COMPARED
                 if getattr(training_args, name, None) is not None and getattr(trainer_state, name, None)
                 is not None and getattr(training_args, name) != getattr(trainer_state, name)]
        saved_bs = trainer_state.train_batch_size
        if saved_bs is not None and saved_bs != training_args.per_device_train_batch_size:
            lines.append(f"\n\tper_device_train_batch_size: {training_args.per_device_train_batch_size} "
                         f"(from args) != {saved_bs} (from trainer_state.json)")
        if lines:
            logger.warning("Warning: The following arguments do not match the ones in the `trainer_state.json` "
                           f"within the checkpoint directory: {''.join(lines)}")

    # ------------------------------------------------------------ auto_find_batch_size
    @property
    def _train_batch_size(self) -> int:
        """HF's per-device batch size of training: args' until auto_find_batch_size lowers it (or a resume
        of such a run takes the checkpoint's); args themselves are left as given."""
        return self.__dict__.get("_found_batch_size") or self.args.per_device_train_batch_size

    @_train_batch_size.setter
    def _train_batch_size(self, value: int) -> None:
        self.__dict__["_found_batch_size"] = int(value)

    def _train_finding_batch_size(self, resume_from_checkpoint, trial) -> TrainOutput:
        """auto_find_batch_size: on out-of-memory, start again with a per-device batch 10% smaller (rounded
        down, as HF); a resume starts at the batch size its checkpoint ran with (as HF)."""
        saved = _saved_batch_size(self.args.output_dir, resume_from_checkpoint)
        if saved:
            self._train_batch_size = saved
        initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        given = self.args.per_device_train_batch_size
        try:
            while True:
                object.__setattr__(self.args, "per_device_train_batch_size", self._train_batch_size)
                try:
                    return self._run_loop(resume_from_checkpoint, trial)
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                    bs = self._train_batch_size
                    smaller = int(bs * 0.9)  # HF's step (accelerate's find_executable_batch_size)
                    if not _is_out_of_memory(e) or smaller < 1:
                        raise
                    logger.warning("out of memory at per_device_train_batch_size=%d (%s); retrying with %d",
                                   bs, str(e).splitlines()[0][:200], smaller)
                    self._train_batch_size = smaller
                    self.model.load_state_dict(initial)
                    self.optimizer = self.lr_scheduler = None
                    self.optimizers = (None, None)
                    self.set_strategy(None)
                    self.__dict__.pop("_data_sources", None)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
        finally:
            object.__setattr__(self.args, "per_device_train_batch_size", given)


def sort_checkpoints(output_dir: str, checkpoint_prefix: str = "checkpoint", use_mtime: bool = False,
                     best_model_checkpoint: str | None = None) -> list[str]:
    """HF's order of the `{checkpoint_prefix}-N` directories, oldest first: by N (by modification time with
    use_mtime, unless all were written within a second), the best moved just before the newest so that
    a rotation deleting from the front keeps both."""
    pattern = re.compile(rf"^{re.escape(checkpoint_prefix)}-([0-9]+)$")
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in sorted(os.listdir(output_dir))
             if (m := pattern.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    if use_mtime and len(found) > 1:
        times = sorted((os.path.getmtime(p), p) for _, p in found)
        if times[-1][0] - times[0][0] >= 1.0:  # coarser stamps (some network filesystems) say nothing
            found = [(i, p) for i, (_, p) in enumerate(times)]
    paths = [p for _, p in sorted(found)]
    if best_model_checkpoint is not None:
        best = next((p for p in paths if os.path.abspath(p) == os.path.abspath(best_model_checkpoint)), None)
        if best is not None and paths[-1] != best:
            paths.remove(best)
            paths.insert(len(paths) - 1, best)
    return paths


def _saved_batch_size(output_dir: str, resume) -> int | None:
    """train_batch_size in the trainer_state.json of the checkpoint a resume will continue."""
    if resume is None or resume is False or resume == "never":
        return None
    path = resume if isinstance(resume, str) and resume != "auto" else ckpt.get_last_checkpoint(output_dir)
    state_file = os.path.join(path, "trainer_state.json") if path else None
    if not state_file or not os.path.exists(state_file):
        return None
    return TrainerState.load_from_json(state_file).train_batch_size


def _is_out_of_memory(e: BaseException) -> bool:
    """torch's OOM error, a MemoryError, or a RuntimeError saying CUDA ran out of memory (as HF retries)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA out of memory" in text or "CUDNN_STATUS_NOT_SUPPORTED" in text
                                            or "DefaultCPUAllocator: can't allocate memory" in text)
