"""Where an asynchronous GRPO trainer's samples come from, step by step (on the rank that holds the rollouts).

ScheduledRollouts follows the Schedule: groups are submitted to a pool of engines in their order as soon as the
policy version that generates them is published, and each step takes its own groups back in that order, so the
numbers never depend on the pool's speed or size. A checkpoint holds what the resumed run could not generate again
(every group of a version already published, finished first). LocalPool is a pool of one engine in the trainer's
process (rollout.num_workers 0); driver/rollout.py's pool runs engines on Ray actors."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .engine import GroupRequest, RolloutEngine, ScoredGroup
from .schedule import Schedule

logger = logging.getLogger(__name__)


class Pool(Protocol):
    """Engines that generate groups: weights published by version, groups submitted together (one engine call,
    all of one version), results taken by group."""

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None: ...

    def submit(self, requests: list[GroupRequest]) -> None: ...

    def result(self, group: int) -> ScoredGroup: ...

    def discard(self, groups: set[int]) -> None: ...

    def stop(self) -> None: ...


class LocalPool:
    """One engine in this process; a group is generated when it is submitted. The newest `keep` versions' weights
    are kept (the schedule submits no group of an older one)."""

    def __init__(self, engine: RolloutEngine, keep: int = 2):
        self.engine, self.keep, self.weights, self.done = engine, keep, {}, {}

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.weights[version] = weights
        for old in [v for v in self.weights if v <= version - self.keep]:
            del self.weights[old]

    def submit(self, requests: list[GroupRequest]) -> None:
        version = requests[0].version
        if getattr(self.engine, "version", None) != version:
            self.engine.set_weights(version, self.weights[version])
        for group in self.engine.rollout(requests):
            group.worker = "local"
            self.done[group.group] = group

    def result(self, group: int) -> ScoredGroup:
        return self.done.pop(group)

    def discard(self, groups: set[int]) -> None:
        for group in groups:
            self.done.pop(group, None)

    def stop(self) -> None:
        self.done.clear()


class ScheduledRollouts:
    """The schedule driven over a pool. `rows(i)`: the dataset's row i; `max_steps`: the run's length; flow control
    (`max_ahead_groups`: groups submitted and not yet trained on) only delays submissions beyond the next step."""

    def __init__(self, schedule: Schedule, pool: Pool, rows: Any, max_steps: int, max_ahead_groups: int,
                 per_call: int):
        self.schedule, self.pool, self.rows, self.max_steps = schedule, pool, rows, max_steps
        self.max_ahead_groups, self.per_call = max_ahead_groups, per_call
        self.published = -1
        self.submitted = 0  # every group of steps 1..submitted is submitted (or finished, in `ready`)
        self.taken = 0  # steps 1..taken were handed to the trainer
        self.ready: dict[int, ScoredGroup] = {}  # finished groups taken back from the pool or a checkpoint
        self.waited = 0.0
        self.timeline: list[tuple[int, int, str, float, float]] = []  # (step, group, worker, started, finished)

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.pool.publish(version, weights)
        self.published = version

    def request(self, group: int) -> GroupRequest:
        s = self.schedule
        step = s.step_of(group)
        index = s.prompt_index(group)
        return GroupRequest(group=group, step=step, prompt_index=index, version=s.version(step), seed=s.seed_of(group),
                            row=dict(self.rows[index]))

    def _submit(self, upto: int, force: bool = False) -> None:
        """Submit the steps the published versions can generate; beyond step `upto`, only while flow control
        allows (unless `force`)."""
        last = self.schedule.last_ready_step(self.published, self.max_steps)
        per_step = self.schedule.groups_per_step
        while self.submitted < last:
            step = self.submitted + 1
            ahead = max(0, self.submitted - upto + 1) * per_step  # submitted for steps upto.. (not trained yet)
            if step > upto and not force and ahead + per_step > self.max_ahead_groups:
                return
            groups = list(self.schedule.groups(step))
            for i in range(0, len(groups), self.per_call):  # fixed bundles of the step's groups
                bundle = groups[i:i + self.per_call]
                if any(g not in self.ready for g in bundle):
                    self.pool.submit([self.request(g) for g in bundle])
            self.submitted = step

    def take(self, step: int) -> list[ScoredGroup]:
        """Step `step`'s groups in order (waiting for them); the next steps' submitted where they can be."""
        if step != self.taken + 1:
            raise RuntimeError(f"step {step}: the rollouts hand out step {self.taken + 1} next")
        self._submit(step)
        if self.submitted < step:
            raise RuntimeError(f"step {step}: its groups need policy version {self.schedule.version(step)}, but "
                               f"version {self.published} is the newest published")
        start = time.perf_counter()
        out = [self.ready.pop(g) if g in self.ready else self.pool.result(g) for g in self.schedule.groups(step)]
        self.pool.discard(set(self.schedule.groups(step)))  # a bundle's groups that were ready already
        self.waited = time.perf_counter() - start
        self.timeline += [(step, g.group, g.worker, g.started, g.finished) for g in out]
        self.taken = step
        self._submit(step + 1)
        return out

    def state_dict(self, done_steps: int) -> dict:
        """After `done_steps` steps: every group a published version generates, finished (the resumed run cannot
        generate them again: it holds a newer policy)."""
        self._submit(done_steps + 1, force=True)
        for step in range(done_steps + 1, self.submitted + 1):
            for group in self.schedule.groups(step):
                if group not in self.ready:
                    self.ready[group] = self.pool.result(group)
        return {"published": self.published, "submitted": self.submitted, "taken": self.taken,
                "ready": {g: dataclasses.asdict(group) for g, group in self.ready.items()}}  # plain data

    def load_state_dict(self, state: dict) -> None:
        self.published, self.submitted, self.taken = state["published"], state["submitted"], state["taken"]
        self.ready = {g: ScoredGroup(**group) for g, group in state["ready"].items()}

    def restart_without_state(self, done_steps: int, publish_current: Callable[[int], None]) -> None:
        """A resume from a checkpoint without the rollouts' state (another layout's): the groups the saved run had
        in flight are generated again by the current policy, standing in for the published version (not exact)."""
        published = self.schedule.published(done_steps)
        logger.warning("the checkpoint holds no rollout groups for this layout: the groups of the next steps are "
                       "generated by the current policy in place of version %d", published)
        self.submitted = self.taken = done_steps
        publish_current(published)

    def stop(self) -> None:
        self.pool.stop()


def samples_of(groups: list[ScoredGroup], names: list[str], sample_cls: type) -> list:
    """The groups' completions as TRL's RolloutSamples (input_ids: prompt + completion; the behaviour log-probs at
    the completion's positions, 0 on the prompt's; the group's reward metrics, as TRL's AsyncGRPO stamps them)."""
    out = []
    for g in groups:
        totals = [g.reward(i) for i in range(len(g.completion_ids))]
        scored = np.array([t for t in totals if not math.isnan(t)], dtype=float)
        std = float(scored.std()) if scored.size else math.nan
        for i, (ids, logps) in enumerate(zip(g.completion_ids, g.logprobs)):
            metrics = {"reward": totals[i], "reward_std": std,
                       **{f"rewards/{name}": r[i] for name, r in zip(names, g.rewards)}}
            out.append(sample_cls(prompt=g.prompt, completion=g.completions[i],
                                  input_ids=np.asarray(g.prompt_ids + ids, dtype=np.int64),
                                  completion_mask=np.asarray([0] * len(g.prompt_ids) + [1] * len(ids), dtype=np.int64),
                                  old_log_probs=np.asarray([0.0] * len(g.prompt_ids) + logps, dtype=np.float32),
                                  advantage=float(g.advantages[i]), model_version=g.version, group_id=g.group,
                                  metrics=metrics, enqueued_at=g.finished))
    return out


def eval_metrics(groups: list[ScoredGroup], names: list[str], prefix: str) -> dict[str, float]:
    """An evaluation's numbers over its groups: the mean reward of the completions, the mean spread within a group,
    each function's mean over what it scored, the mean completion length."""
    rewards = [g.reward(i) for g in groups for i in range(len(g.completion_ids))]
    scored = [r for r in rewards if not math.isnan(r)]
    stds = []
    for g in groups:
        values = np.array([g.reward(i) for i in range(len(g.completion_ids))], dtype=float)
        values = values[~np.isnan(values)]
        if values.size:
            stds.append(float(values.std()))
    out = {f"{prefix}_reward": sum(scored) / len(scored) if scored else math.nan,
           f"{prefix}_reward_std": sum(stds) / len(stds) if stds else math.nan}
    for j, name in enumerate(names):
        values = [v for g in groups for v in g.rewards[j] if not math.isnan(v)]
        out[f"{prefix}_rewards/{name}/mean"] = sum(values) / len(values) if values else math.nan
    lengths = [len(ids) for g in groups for ids in g.completion_ids]
    out[f"{prefix}_completions/mean_length"] = sum(lengths) / len(lengths)
    return out
