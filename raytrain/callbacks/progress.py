"""Progress output on rank 0: a line saying what runs where, then a tqdm bar (step/total, ETA, latest
loss and learning rate) and an evaluation bar on a terminal; one compact line per log elsewhere.

In a Ray run the same callbacks draw on the driver: rank 0's ProgressFeeder sends its events (a few
times a second at most) to a ProgressFeed actor, and the driver replays them (ProgressReplay)."""

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
    if _len(train_dataloader) is not None and hasattr(train_dataloader, "num_samples"):  # a stream has no length
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
        if state.is_world_process_zero and self.tty:
            done = self.eval_bar.n + 1 if self.eval_bar is not None else 1
            self.eval_progress(done, _len(eval_dataloader))

    def eval_progress(self, done: int, total: int | None) -> None:
        """The evaluation bar at `done` batches of `total` (a terminal only)."""
        if not self.tty:
            return
        if self.eval_bar is None:
            self.eval_bar = tqdm(total=total, desc="evaluating", leave=False, dynamic_ncols=True,
                                 file=self.stream, position=1 if self.training_bar is not None else 0)
        self.eval_bar.update(done - self.eval_bar.n)

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
        final = "train_loss" in logs  # the end of training; a step's logs carry train_runtime when counting tokens
        shown = {k: v for k, v in logs.items() if not k.endswith(_QUIET) or (k == "train_runtime" and final)}
        if "train_tokens_per_second" in logs:
            shown["tokens/s"] = _count(round(logs["train_tokens_per_second"]))
        # A stopping run (a signal, early stopping) has no time left to estimate.
        eta = "" if control.should_training_stop or final else self._eta(state)
        line = f"step {state.global_step}/{state.max_steps} {_fmt(shown)}{eta}"
        if self.training_bar is not None:
            self.training_bar.write(line, file=self.stream)
        else:
            self._write(line)

    def status(self, line: str) -> None:
        """A line about the run, not from its loop (the driver's: waiting for workers)."""
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


def _len(loader) -> int | None:
    try:
        return len(loader) if loader is not None else None
    except TypeError:  # a stream has no length
        return None


class PrinterCallback(TrainerCallback):
    """Prints every log dict on rank 0 (what HF uses when tqdm is disabled)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(logs, flush=True)


# ---------------------------------------------------------------- Ray runs: rank 0 -> the driver

_SHOWN = (ProgressCallback, PrinterCallback)


def progress_callbacks(callbacks) -> list:
    """The callbacks that print progress (drawn by the driver in a Ray run, silent on the workers)."""
    return [cb for cb in callbacks if isinstance(cb, _SHOWN)]


def _state(state) -> dict:
    return {"global_step": state.global_step, "max_steps": state.max_steps, "epoch": state.epoch,
            "num_train_epochs": state.num_train_epochs}


class ProgressFeeder(TrainerCallback):
    """Rank 0 of a Ray run: progress events for the driver, handed to `send` (a fire-and-forget call
    to the ProgressFeed actor) at most every `interval` seconds; step and evaluation counts in between
    are coalesced. `flush` (blocking) delivers what is left when training ends."""

    def __init__(self, send, flush, interval: float = 0.25):
        self.send, self.flush, self.interval = send, flush, interval
        self.pending: list[tuple] = []
        self.sent = 0.0
        self.eval_done = 0

    def _push(self, event: tuple, now: bool = False) -> None:
        if event[0] in ("step", "eval") and self.pending and self.pending[-1][0] == event[0]:
            self.pending[-1] = event  # only the latest count matters
        else:
            self.pending.append(event)
        t = time.monotonic()
        if now or t - self.sent >= self.interval:
            events, self.pending, self.sent = self.pending, [], t
            self.send(events)

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        data = None
        if _len(train_dataloader) is not None and hasattr(train_dataloader, "num_samples"):  # a stream has none
            data = (train_dataloader.num_samples, len(train_dataloader))
        self._push(("begin", _state(state), data), now=True)

    def on_step_end(self, args, state, control, **kwargs):
        self._push(("step", _state(state)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self._push(("log", _state(state), plain_logs(logs)))

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        self.eval_done += 1
        self._push(("eval", self.eval_done, _len(eval_dataloader)))

    def on_evaluate(self, args, state, control, **kwargs):
        self.eval_done = 0
        self._push(("eval_end",))

    on_predict = on_evaluate

    def on_train_end(self, args, state, control, **kwargs):
        events, self.pending = self.pending + [("end", _state(state))], []
        self.flush(events)


def plain_logs(logs: dict) -> dict:
    """Log values as Python numbers (a tensor's .item()), to send across processes."""
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in logs.items()}


class ProgressFeed:
    """The mailbox between rank 0 and the driver (a Ray actor, driver/progress.py starts it): rank 0 pushes
    lists of events, the driver drains them in order."""

    def __init__(self):
        self.events: list[tuple] = []

    def push(self, events: list) -> None:
        self.events.extend(events)

    def drain(self) -> list:
        events, self.events = self.events, []
        return events


class _Loader:
    """What describe_run reads from a training DataLoader, as rank 0 saw it."""

    def __init__(self, num_samples: int, batches: int):
        self.num_samples, self._batches = num_samples, batches

    def __len__(self) -> int:
        return self._batches


class ProgressReplay:
    """The driver's side: rank 0's events, replayed into the driver's own progress callbacks (the same
    bars and lines as an in-process run; the model for the run line is the driver's copy)."""

    def __init__(self, callbacks: list, args, model=None):
        from .state import TrainerControl, TrainerState

        self.callbacks, self.args, self.model = callbacks, args, model
        self.state, self.control = TrainerState(), TrainerControl()
        self.running = False

    def __call__(self, events: list) -> None:
        for event in events:
            kind = event[0]
            if kind in ("begin", "step", "log", "end"):
                for k, v in event[1].items():
                    setattr(self.state, k, v)
            if kind == "begin":
                if self.running:  # a restarted worker group: the old attempt's bar ends here
                    self._each("on_train_end")
                self.running = True
                loader = _Loader(*event[2]) if event[2] else None
                self._each("on_train_begin", model=self.model, train_dataloader=loader)
            elif kind == "step":
                self._each("on_step_end")
            elif kind == "log":
                self._each("on_log", logs=event[2])
            elif kind == "eval":
                for cb in self.callbacks:
                    if hasattr(cb, "eval_progress"):
                        cb.eval_progress(event[1], event[2])
            elif kind == "eval_end":
                self._each("on_evaluate", metrics={})
            elif kind == "end":
                self.close()

    def close(self) -> None:
        if self.running:
            self.running = False
            self._each("on_train_end")

    def _each(self, event: str, **kwargs) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(self.args, self.state, self.control, **kwargs)
