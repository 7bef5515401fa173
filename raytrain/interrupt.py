"""Ctrl-C and SIGTERM for an in-process run: save at the next step boundary, then stop.

    with graceful_stop() as stop:                  # installs the SIGINT/SIGTERM handlers
        trainer.add_callback(StopOnSignal(stop))
        trainer.train(...)
    if stop.signum: ...                            # exit 128 + signum (130 for Ctrl-C, 143 for SIGTERM)

While a loop runs, the first signal only sets a flag that StopOnSignal turns into "save and stop"
at the next step end (the checkpoint is then exactly resumable). Outside a loop (model building,
the final evaluation) it raises Interrupted at once: there is no step boundary to wait for. A second
signal exits the process at once. Ray workers have their own SIGTERM handler (_ray_worker.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from .callbacks.base import TrainerCallback

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A signal arrived where no step boundary could be waited for."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """What the handler and the callback share: the first signal received and whether a loop runs."""

    def __init__(self):
        self.signum: int | None = None
        self.training = False
        self.stopped_at: int | None = None  # the step the loop stopped after, once it has

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
        if not stop.training:
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
