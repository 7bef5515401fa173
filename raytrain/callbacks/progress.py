"""Progress output: a tqdm bar on a terminal, one line per log otherwise; PrinterCallback."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from .base import TrainerCallback


def _fmt(logs: dict) -> str:
    parts = []
    for k, v in logs.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


class ProgressCallback(TrainerCallback):
    """tqdm progress bar for training and evaluation on rank 0; in a non-TTY (logs, CI,
    Ray workers) no bar is drawn and each log becomes one plain line."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.training_bar = None
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.tty:
            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step,
                                     dynamic_ncols=True, file=self.stream)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.training_bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        line = _fmt(logs)
        if self.training_bar is not None:
            self.training_bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


class PrinterCallback(TrainerCallback):
    """Prints every log dict on rank 0 (what HF uses when tqdm is disabled)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(logs, flush=True)
