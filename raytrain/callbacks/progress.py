"""Progress output on rank 0: a line saying what runs where, then a tqdm bar (step/total, ETA, latest
loss and learning rate) and an evaluation bar on a terminal; one compact line per log elsewhere."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from .base import TrainerCallback

_QUIET = ("_runtime", "_per_second")  # timing keys: in the logs and trackers, not in the progress line


def _fmt(logs: dict) -> str:
    parts = []
    for k, v in logs.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 \
        else str(n)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


def describe_run(args, state, model=None, train_dataloader=None) -> str:
    """One line: model and parameters, data, steps, processes, output_dir, where it starts."""
    parts = []
    if model is not None:
        n = sum(p.numel() for p in model.parameters())
        parts.append(f"{type(getattr(model, 'module', model)).__name__} ({_count(n)} parameters)")
    if train_dataloader is not None and hasattr(train_dataloader, "num_samples"):
        parts.append(f"{train_dataloader.num_samples} training samples, {len(train_dataloader)} batches per "
                     "epoch" + (" per process" if args.scaling.num_workers > 1 else ""))
    epochs = state.num_train_epochs
    parts.append(f"{state.max_steps} steps ({epochs} epoch{'' if epochs == 1 else 's'})")
    workers = args.scaling.num_workers
    strategy = "ddp" if args.distributed.strategy == "auto" else args.distributed.strategy
    parts.append(f"{workers} processes ({strategy})" if workers > 1 else "1 process")
    parts.append(f"output_dir {args.output_dir}")
    parts.append(f"resuming at step {state.global_step}" if state.global_step else "from step 0")
    return "training " + " | ".join(parts)


class ProgressCallback(TrainerCallback):
    """tqdm progress bars for training and evaluation on rank 0; in a non-TTY (logs, CI, Ray workers)
    no bar is drawn and each log becomes one line: `step 50/180 loss=0.41 learning_rate=0.0029 ...`."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.training_bar = None
        self.eval_bar = None
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._write(describe_run(args, state, model, train_dataloader))
        self._start = (time.perf_counter(), state.global_step)
        if self.tty:
            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True,
                                     file=self.stream, unit="step")

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.training_bar.n)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not (state.is_world_process_zero and self.tty):
            return
        if self.eval_bar is None:
            total = len(eval_dataloader) if eval_dataloader is not None else None
            self.eval_bar = tqdm(total=total, desc="evaluating", leave=False, dynamic_ncols=True,
                                 file=self.stream, position=1 if self.training_bar is not None else 0)
        self.eval_bar.update(1)

    def _close_eval_bar(self):
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_eval_bar()

    def on_predict(self, args, state, control, **kwargs):
        self._close_eval_bar()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.training_bar is not None and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4g}", lr=f"{logs.get('learning_rate', 0):.3g}",
                                          refresh=False)
        shown = {k: v for k, v in logs.items() if not k.endswith(_QUIET) or k == "train_runtime"}
        line = f"step {state.global_step}/{state.max_steps} {_fmt(shown)}{self._eta(state)}"
        if self.training_bar is not None:
            self.training_bar.write(line, file=self.stream)
        else:
            self._write(line)

    def _write(self, line: str) -> None:
        # Not print(): in a Ray Train worker, print is patched to go to the logger as well as to the
        # stream, and Ray shows each line twice.
        self.stream.write(line + "\n")
        self.stream.flush()

    def _eta(self, state) -> str:
        if self._start is None or state.global_step >= state.max_steps:
            return ""
        t0, s0 = self._start
        done = state.global_step - s0
        if done <= 0:
            return ""
        left = (time.perf_counter() - t0) / done * (state.max_steps - state.global_step)
        return f" eta={_duration(left)}"

    def on_train_end(self, args, state, control, **kwargs):
        self._close_eval_bar()
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None
        self._start = None


class PrinterCallback(TrainerCallback):
    """Prints every log dict on rank 0 (what HF uses when tqdm is disabled)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(logs, flush=True)
