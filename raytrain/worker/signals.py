"""Ctrl-C and SIGTERM for an in-process run: save at the next step boundary, then stop.

    with graceful_stop() as stop:                  # installs the SIGINT/SIGTERM handlers
        trainer.add_callback(StopOnSignal(stop))
        trainer.train(...)
    if stop.signum: ...                            # exit 128 + signum (130 for Ctrl-C, 143 for SIGTERM)

While a loop runs, the first signal only sets a flag that StopOnSignal turns into "save and stop"
at the next step end (the checkpoint is then exactly resumable). Outside a loop (model building,
the final evaluation) it raises Interrupted at once: there is no step boundary to wait for. A second
signal exits the process at once. When the loop runs in Ray workers instead (driver/signals.py),
the first signal is forwarded to them as SIGTERM: their handler (preemption.py) saves at the next
step boundary, then the run is aborted so that Ray does not restart them.

Trainer.train() called from Python (python_interrupts) behaves alike for Ctrl-C, in Python's terms:
the first saves at the next step boundary, then KeyboardInterrupt is raised naming the checkpoint and
`resume_from_checkpoint=...`; a second raises KeyboardInterrupt at once. With enable_jit_checkpoint,
SIGTERM does the same and then raises SystemExit(143).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from ..callbacks.base import TrainerCallback

if TYPE_CHECKING:
    from .protocol import TrainerProtocol

_SIGNALS = (signal.SIGINT, signal.SIGTERM)

logger = logging.getLogger(__name__)


class Interrupted(Exception):
    """A signal arrived where no step boundary could be waited for."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """What the handler and the callback share: the first signal received and whether a loop runs.
    `forward`, set while Ray workers train, is called (in a thread) instead: the workers stop."""

    def __init__(self):
        self.signum: int | None = None
        self.training = False
        self.stopped_at: int | None = None  # the step the loop stopped after, once it has
        self.forward = None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@contextlib.contextmanager
def graceful_stop():
    """SIGINT/SIGTERM handlers for the duration of the block (main thread only; elsewhere a no-op)."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.signum is not None:  # the second signal: no more waiting
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting now without saving\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        stop.signum = signum
        if stop.forward is not None:
            threading.Thread(target=stop.forward, daemon=True, name="raytrain-stop-workers").start()
        elif not stop.training:
            raise Interrupted(signum)
        sys.stderr.write(f"\n{stop.name}: saving a checkpoint at the end of this step, then stopping "
                         "(press Ctrl-C again to exit at once)\n")
        sys.stderr.flush()

    previous = {s: signal.getsignal(s) for s in _SIGNALS}
    for s in _SIGNALS:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class StopOnSignal(TrainerCallback):
    """Turns a StopRequest into "save now and stop" at the next step end (save_strategy permitting)."""

    def __init__(self, stop: StopRequest):
        self.stop = stop
        self._epoch_save = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.stop.training = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.signum is not None and self.stop.stopped_at is None:
            self.stop.stopped_at = state.global_step
            control.should_training_stop = True
            # At an epoch's last step with epoch saves, the epoch-end evaluation and save run as usual
            # (the checkpoint then records the finished epoch, as an uninterrupted run's does).
            self._epoch_save = args.save_strategy == "epoch" and float(state.epoch or 0).is_integer()
            if not self._epoch_save:
                control.should_save = args.save_strategy != "no"
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stop.stopped_at is not None and not self._epoch_save:
            control.should_evaluate = control.should_save = False  # on the way out; the save is done
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.stop.training = False


@contextlib.contextmanager
def python_interrupts(trainer: TrainerProtocol):
    """Ctrl-C during an in-process Trainer.train() called from Python: save at the next step boundary
    (save_strategy permitting), then raise KeyboardInterrupt saying what was saved and how to continue;
    a second Ctrl-C, or one outside the loop, raises KeyboardInterrupt at once. With
    args.enable_jit_checkpoint, SIGTERM alike, then SystemExit(143). Only in the main thread and over
    Python's default handlers (the CLI, a sweep trial or an application keep theirs); they are back
    when train() returns or raises."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    ours = [signal.SIGINT] + ([signal.SIGTERM] if getattr(trainer.args, "enable_jit_checkpoint", False) else [])
    ours = [s for s in ours if signal.getsignal(s) is defaults[s]]
    if threading.current_thread() is not threading.main_thread() or not ours:
        yield None
        return
    stop = StopRequest()

    def handler(signum, frame):
        if stop.signum is not None or not stop.training:
            _raise_for(signum)
        stop.signum = signum
        then = "raising KeyboardInterrupt (press Ctrl-C again to interrupt at once)" if signum == signal.SIGINT \
            else "exiting with 143"
        sys.stderr.write(f"\n{stop.name}: saving a checkpoint at the end of this step, then {then}\n")
        sys.stderr.flush()

    callback = StopOnSignal(stop)
    trainer.add_callback(callback)
    for s in ours:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s in ours:
            signal.signal(s, defaults[s])
        trainer.remove_callback(callback)
    if stop.signum is not None:
        message = _stopped_message(trainer, stop)
        logger.warning(message)
        _raise_for(stop.signum, message)


def _raise_for(signum: int, message: str = ""):
    """What Python does by default: KeyboardInterrupt for SIGINT; for SIGTERM the process ends (143)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt(message) if message else KeyboardInterrupt
    raise SystemExit(128 + signum)


def _stopped_message(trainer: TrainerProtocol, stop: StopRequest) -> str:
    from ..checkpoint.store import checkpoint_dir

    args, state = trainer.args, trainer.state
    step = stop.stopped_at if stop.stopped_at is not None else state.global_step
    path = checkpoint_dir(args.output_dir, step)
    if not os.path.isdir(path):
        why = " (save_strategy is 'no')" if args.save_strategy == "no" else ""
        return f"{stop.name}: stopped at step {step}/{state.max_steps}; nothing saved{why}"
    return (f"{stop.name}: stopped at step {step}/{state.max_steps}; saved {path}; continue with "
            f"trainer.train(resume_from_checkpoint={path!r})")
