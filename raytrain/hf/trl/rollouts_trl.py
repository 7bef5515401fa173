"""TRL's own rollout objects on raytrain's AsyncGRPOTrainer: a `rollout_worker` (TRL's RolloutWorkerProtocol: a
queue of scored RolloutSamples, start / stop / update_model_version / check_health, a metrics queue) and a
`weight_transfer` (TRL's WeightTransferProtocol: init / pause / send_weights / resume / destroy). Samples are taken
as they come and the stale ones dropped, as TRL does: such a worker runs on its own timing, so the run is TRL's,
not raytrain's schedule (no exact resume of what was in flight)."""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)


class WorkerRollouts:
    def __init__(self, worker: Any, transfer: Any, per_step: int, max_staleness: int, heartbeat_s: float,
                 poll_s: float = 5.0):
        self.worker, self.transfer, self.per_step = worker, transfer, per_step
        self.max_staleness, self.heartbeat_s, self.poll_s = max_staleness, heartbeat_s, poll_s
        self.version, self.dropped, self.waited, self.started = 0, 0, 0.0, False

    def sync(self, weights: Callable[[], Iterator]) -> int:
        """TRL's _sync_weight: the weights streamed through the transfer (paused around it), the version bumped and
        told to the worker; the first sync sets the transfer up and then starts the worker."""
        if not self.started and self.transfer is not None:
            self.transfer.init_weight_transfer()
        if self.transfer is not None:
            self.transfer.pause()
            self.transfer.send_weights(weights())
            self.transfer.resume()
        self.version += 1
        self.worker.update_model_version(self.version)
        if not self.started:
            self.worker.start()
            self.started = True
        return self.version

    def take(self, step: int) -> list:
        """The next samples_per_step samples from the worker's queue, those more than max_staleness versions old
        dropped (TRL's RolloutQueueDataset); the worker's health checked while the queue is empty."""
        start, out, dropped = time.perf_counter(), [], 0
        while len(out) < self.per_step:
            try:
                sample = self.worker.rollout_buffer.get(timeout=self.poll_s)
            except queue.Empty:
                self.worker.check_health(self.heartbeat_s)
                continue
            if self.version - sample.model_version > self.max_staleness:
                dropped += 1
                continue
            out.append(sample)
        self.dropped, self.waited = dropped, time.perf_counter() - start
        return out

    def drain_metrics(self, sink: dict) -> None:
        """The worker's own metrics (dicts shaped like the trainer's sink) appended to it."""
        metrics = getattr(self.worker, "metrics_queue", None)
        while metrics is not None:
            try:
                item = metrics.get_nowait()
            except queue.Empty:
                return
            for key, value in item.items():
                sink[key].append(value)

    def state_dict(self, done_steps: int) -> dict:
        return {"model_version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.version = state.get("model_version", 0)

    def stop(self) -> None:
        if self.started:
            self.worker.stop()
            if self.transfer is not None:
                self.transfer.destroy()
        self.started = False
