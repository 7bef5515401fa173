"""The driver draws rank 0's progress with the trainer's own progress callbacks: rank 0 pushes events
into a ProgressFeed actor (callbacks/progress.py); a thread here drains it and replays them."""

from __future__ import annotations

import contextlib
import logging
import threading

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def driver_progress(trainer, poll_s: float = 0.2):
    """Drain the feed every `poll_s` while the run lasts, then once more. Yields the actor's handle for
    the workers (None when the trainer shows no progress)."""
    import ray

    from ..callbacks.progress import ProgressFeed, ProgressReplay, progress_callbacks

    callbacks = progress_callbacks(trainer.callback_handler.callbacks)
    if not callbacks:
        yield None
        return
    feed = ray.remote(num_cpus=0)(ProgressFeed).remote()
    replay = ProgressReplay(callbacks, trainer.args, trainer.model)
    done = threading.Event()

    def drain():
        while not done.wait(poll_s):
            try:
                replay(ray.get(feed.drain.remote(), timeout=10))
            except Exception as e:  # noqa: BLE001 - progress is a view: never fail the run over it
                logger.debug("progress: %s", e)

    thread = threading.Thread(target=drain, daemon=True, name="raytrain-progress")
    thread.start()
    try:
        yield feed
    finally:
        done.set()
        thread.join(timeout=15)
        with contextlib.suppress(Exception):  # what rank 0 sent last (its flush waited for delivery)
            replay(ray.get(feed.drain.remote(), timeout=10))
        replay.close()
        with contextlib.suppress(Exception):  # Ray may be gone already (a second Ctrl-C)
            ray.kill(feed)
