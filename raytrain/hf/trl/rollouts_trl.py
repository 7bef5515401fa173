"""TRL's own rollout objects on raytrain's AsyncGRPOTrainer: a `rollout_worker` (TRL's RolloutWorkerProtocol: a
queue of scored RolloutSamples, start / stop / update_model_version / check_health, a metrics queue) and a
`weight_transfer` (TRL's WeightTransferProtocol: init / pause / send_weights / resume / destroy). The samples are
read as TRL reads them (its RolloutQueueDataset: stale ones dropped, its staleness metrics) and planned into
micro-batches by TRL's own planners (a fixed count, or token_budget tokens per row). Such a worker runs on its own
timing, so the run is TRL's, not raytrain's schedule: no exact resume of what was in flight."""

from __future__ import annotations

import logging
import queue
from typing import Any, Callable, Iterator

import numpy as np

logger = logging.getLogger(__name__)


class WorkerRollouts:
    def __init__(self, worker: Any, transfer: Any, ranks: int, per_rank: int, token_budget: int | None,
                 max_staleness: int, heartbeat_s: float, metrics: dict, report_to: list | None):
        from trl.experimental.async_grpo.async_grpo_trainer import (FixedCountBatcher, RolloutQueueDataset,
                                                                    TokenBudgetBatcher)

        self.worker, self.transfer, self.version, self.started = worker, transfer, 0, False
        self.dataset = RolloutQueueDataset(rollout_queue=worker.rollout_buffer, model_version_fn=lambda: self.version,
                                           check_health_fn=worker.check_health, stale_after_s=heartbeat_s,
                                           metrics=metrics, max_staleness=max_staleness, report_to=report_to or [])
        arrays = _Arrays(self.dataset)
        if token_budget is not None and token_budget > 0:
            planner = TokenBudgetBatcher(arrays, ranks, token_budget, metrics)
        else:
            planner = FixedCountBatcher(arrays, ranks, per_rank * ranks)
        self._micro = iter(planner)

    def sync(self, weights: Callable[[], Iterator]) -> int:
        """TRL's _sync_weight: the weights streamed through the transfer (paused around it; no transfer: none is
        sent), the version bumped and told to the worker; the first sync sets the transfer up, then starts the
        worker (TRL's train-begin order)."""
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

    def take_micro(self) -> list[list[dict]]:
        """The next micro-batch: one list of sample dicts per data-parallel rank."""
        return [list(row.samples) for row in next(self._micro)]

    @property
    def waited(self) -> float:
        return self.dataset.wait_s

    def drain_metrics(self, sink: dict) -> None:
        """The worker's own metrics (dicts shaped like the trainer's sink) appended to it; a worker may have none."""
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


class _Arrays:
    """The queue's samples with their token fields as numpy arrays (TRL's planners read arrays; a worker may push
    lists)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __iter__(self):
        for sample in self.dataset:
            yield {**sample, **{k: np.asarray(sample[k]) for k in ("input_ids", "completion_mask", "old_log_probs")}}
