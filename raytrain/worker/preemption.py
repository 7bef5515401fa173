"""A Ray Train worker's preemption, two ways in: Ray's notice that a node of the group is being drained
(ray.train.get_preemption_info, asked every RAYTRAIN_PREEMPTION_POLL_S seconds), or a SIGTERM (what a
spot node's processes receive before it goes). Either way every rank agrees at a step boundary to save a
checkpoint and stop. After a notice the workers wait for Ray's controller to end the group at the
deadline (a PreemptionError, retried under FailureConfig.max_preemption_failures); after a SIGTERM alone
the worker fails with `Preempted` (retried under max_failures)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from ..callbacks import TrainerCallback

logger = logging.getLogger(__name__)

#: Seconds a worker may take to save and stop after SIGTERM before it exits regardless.
PREEMPT_GRACE_ENV = "RAYTRAIN_PREEMPT_GRACE_S"
#: Seconds between two asks for Ray's preemption notice: a collective through Ray's synchronization
#: actor (~15 ms with 2 CPU workers), too dear for every step.
PREEMPTION_POLL_ENV = "RAYTRAIN_PREEMPTION_POLL_S"
#: How long past a notice's deadline a worker waits for Ray's controller before failing by itself.
_CONTROLLER_MARGIN_S = 300.0

_preempt_requested = threading.Event()
training_active = threading.Event()


class Preempted(RuntimeError):
    """The worker saved a checkpoint after SIGTERM and stopped; Ray restarts the group from it."""


# ---------------------------------------------------------------- SIGTERM (runs on the actor's main thread)


def install_sigterm_handler() -> None:
    """Turn SIGTERM into a save-and-stop request while a training loop runs. Signal handlers can only
    be set from the main thread, so driver/torch_trainer.py's backend runs this through the worker group's execute."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if not training_active.is_set() or _preempt_requested.is_set():
            # No loop to stop, or a second notice: exit as the process would have.
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)
        _preempt_requested.set()
        logger.warning("SIGTERM: saving a checkpoint at the next step boundary, then stopping")
        grace = float(os.environ.get(PREEMPT_GRACE_ENV, "120"))
        timer = threading.Timer(grace, lambda: os._exit(128 + signum))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


class PreemptionCallback(TrainerCallback):
    """At each step end, all ranks agree whether any got SIGTERM or Ray's preemption notice; if so:
    save now, then stop. The notice is asked for on the steps where rank 0's clock says a poll is due:
    ray.train.get_preemption_info is a collective (an actor round trip), so every rank must call it
    equally often, and the agreement rides on the SIGTERM flag's all_reduce that runs anyway."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.triggered_at: int | None = None
        self.notice = None  # Ray's PreemptionInfo, once seen
        self.poll_s = 5.0
        self._next_poll = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.poll_s = float(os.environ.get(PREEMPTION_POLL_ENV, "5"))  # Ray's watcher polls every 5 s
        self._next_poll = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        due = self.strategy.is_main and self.notice is None and time.monotonic() >= self._next_poll
        flags = torch.tensor([int(_preempt_requested.is_set()), int(due)], device=self.strategy.device)
        sigterm, poll = (int(v) for v in self.strategy.all_reduce(flags, "max").tolist())
        if poll:
            self._next_poll = time.monotonic() + self.poll_s
            try:
                self.notice = _preemption_info()
            except Exception as e:  # noqa: BLE001 - raised alike on every rank (no train worker): stop asking
                logger.warning("Ray's preemption notices are not available here (%s); SIGTERM still saves", e)
                self._next_poll = float("inf")
            if self.notice is not None:
                logger.warning("Ray's preemption notice (ranks %s, deadline %s): saving a checkpoint now, "
                               "then stopping", self.notice.preempted_ranks, self.notice.deadline_ms)
        if sigterm or self.notice is not None:
            self.triggered_at = state.global_step
            control.should_save = args.save_strategy != "no"
            control.should_training_stop = True
        return control

    def finish(self, global_step: int, max_steps: int, saved: bool) -> None:
        """After the loop: nothing if it ran to the end; after Ray's notice, wait for the controller to
        end the group (it counts a preemption); after SIGTERM, fail so that Ray restarts the group."""
        if self.triggered_at is None or global_step >= max_steps:
            return
        if self.notice is None and self._next_poll != float("inf"):
            # Every rank stopped at the same step: ask once more, so that a SIGTERM during a drain whose
            # notice the last poll missed still counts as the preemption it is.
            self.notice = _preemption_info()
        what = f"saved checkpoint-{self.triggered_at} and " if saved else ""
        if self.notice is not None:
            deadline = self.notice.deadline_ms / 1000 if self.notice.deadline_ms else time.time() + 120
            logger.warning("preemption notice: %sstopped at step %d; waiting for Ray to restart the group",
                           what, self.triggered_at)
            # Ray's controller ends this worker at the deadline (plus FailureConfig.preemption_grace_s);
            # a worker that returned would end the run, one that failed would count against max_failures.
            time.sleep(max(0.0, deadline - time.time()) + _CONTROLLER_MARGIN_S)
        raise Preempted(f"{'preemption notice' if self.notice is not None else 'SIGTERM'}: {what}stopped at "
                        f"step {self.triggered_at}; Ray restarts the worker group from the last checkpoint")


def _preemption_info():
    """Ray's notice for this worker group (None when no node of it is being drained); a collective."""
    import ray.train

    return ray.train.get_preemption_info()
