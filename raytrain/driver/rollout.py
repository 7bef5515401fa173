"""A run's rollout workers on Ray: actors named raytrain-rollout-<i> (in `ray list actors`), each holding one
engine (hf/trl/engine.py: generate and score prompt groups), fed by a dispatcher thread in the process that trains
(rank 0). Bundles of groups (fixed by the schedule) go out in submission order to the free actor used least
recently (an idle one that died is found when its turn comes), with the object-store reference of the policy
version that must generate them; an actor loads those weights when it holds another version. A group whose actor
dies (or stays silent past heartbeat_stale_after_s, then restarted) is generated again on another actor, from the
same seed; Ray restarts a dead actor (max_restarts=-1) wherever there is room, so a pool on spot or autoscaling
nodes grows back when capacity returns. None of this changes a group's content, only when it is ready."""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("raytrain")

_DEPTH = 2  # groups queued on an actor: the next one starts as soon as one ends


class RolloutActor:
    """One rollout worker: an engine made from the pool's factory (by reference: an actor Ray restarts builds it
    again), the policy version it holds."""

    def __init__(self, name: str):
        self.name, self.engine = name, None

    def ready(self, factory: list) -> int:
        """The engine built (the pool's ping: an actor counts as up, and its heartbeat runs, from then on)."""
        import ray

        if self.engine is None:
            self.engine = ray.get(factory[0])()
            if ray.get_gpu_ids():
                self.engine.model.to("cuda")
        return os.getpid()

    def rollout(self, requests: list, weights: list, factory: list) -> list:
        import ray

        self.ready(factory)
        if self.engine.version != requests[0].version:
            self.engine.set_weights(requests[0].version, ray.get(weights[0]))
        groups = self.engine.rollout(requests)
        for group in groups:
            group.worker = self.name
        return groups

    def pid(self) -> int:
        return os.getpid()


class RayRolloutPool:
    """`config`: the rollout section (num_workers, CPUs, GPUs, resources per actor); `keep`: how many of the newest
    versions' weights stay in the object store (the schedule submits no group of an older one)."""

    def __init__(self, engine_factory: Callable[[], Any], config: Any, heartbeat_s: float, name: str | None = None,
                 keep: int = 2, poll_s: float = 0.2):
        import ray

        from .launch import ensure_ray

        ensure_ray()
        self.heartbeat_s, self.keep, self.poll_s = heartbeat_s, keep, poll_s
        self._factory = ray.put(engine_factory)
        self.names = [_name(name, i) for i in range(config.num_workers)]
        self.actors = [self._start(n, config) for n in self.names]
        self.versions: dict[int, Any] = {}
        self.queue: list[tuple[int, list]] = []  # (first group, requests generated together), in group order
        self.inflight: dict[Any, tuple[int, list]] = {}  # ref -> (actor, requests)
        self.busy_since: dict[int, float] = {}
        self.used: dict[int, float] = {}  # actor -> when it was last given a bundle (the work goes round)
        self.down: dict[int, Any] = dict.fromkeys(range(len(self.actors)))  # actor -> its ping; up once it answers
        self.results: dict[int, Any] = {}
        self.error: BaseException | None = None
        self.restarts = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="raytrain-rollout-dispatch", daemon=True)
        self._thread.start()

    def _start(self, name: str, config: Any):
        import ray

        options = {"name": name, "num_cpus": config.num_cpus_per_worker, "num_gpus": config.num_gpus_per_worker,
                   "max_restarts": -1, "max_task_retries": 0}
        if config.resources_per_worker:
            options["resources"] = dict(config.resources_per_worker)
        try:
            return ray.remote(RolloutActor).options(**options).remote(name)
        except ValueError:  # the name is another run's (in this Ray namespace): this run's actor gets a suffix
            unique = f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
            logger.warning("a Ray actor named %s exists already: this run's is %s", name, unique)
            self.names[self.names.index(name)] = unique
            return ray.remote(RolloutActor).options(**{**options, "name": unique}).remote(unique)

    # ------------------------------------------------------------ the trainer's side
    def publish(self, version: int, weights: dict) -> None:
        import ray

        ref = ray.put(weights)
        with self._cond:
            self.versions[version] = ref
            for old in [v for v in self.versions if v <= version - self.keep]:
                del self.versions[old]

    def submit(self, requests: list) -> None:
        """Queued in group order and sent at once to a free actor (from the caller's thread: no poll delay)."""
        with self._cond:
            bisect.insort(self.queue, (requests[0].group, requests), key=lambda item: item[0])
            self._dispatch()
            self._cond.notify_all()

    def result(self, group: int) -> Any:
        """Group `group`, once generated; the wait is logged every 10 s (which actor has it, for how long)."""
        start = last = time.monotonic()
        with self._cond:
            while group not in self.results:
                if self.error is not None:
                    raise self.error
                if self._stopped:
                    raise RuntimeError("the rollout pool was stopped")
                self._cond.wait(1.0)
                now = time.monotonic()
                if now - last >= 10:  # a warning when no actor is up: capacity, not speed
                    last = now
                    level = logging.WARNING if len(self.down) == len(self.actors) else logging.INFO
                    logger.log(level, "waiting %.0f s for rollout group %d (%s)", now - start, group,
                               self._where(group))
            return self.results.pop(group)

    def discard(self, groups: set[int]) -> None:
        with self._cond:
            for group in groups:
                self.results.pop(group, None)

    def _where(self, group: int) -> str:
        import ray

        for actor, requests in self.inflight.values():
            if any(r.group == group for r in requests):
                return f"on {self.names[actor]}"
        alive = len(self.actors) - len(self.down)
        where = f"queued; {alive} of {len(self.actors)} rollout actors up"
        if alive < len(self.actors):
            free = ray.available_resources()
            where += (f"; Ray starts the others where there is room (free now: {free.get('CPU', 0):g} CPUs, "
                      f"{free.get('GPU', 0):g} GPUs)")
        return where

    def stop(self) -> None:
        import ray

        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 30  # their names free for the next pool (a next train() or trial)
        for name in self.names:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name)
                except ValueError:
                    break
                time.sleep(0.1)

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    # ------------------------------------------------------------ the dispatcher thread
    def _run(self) -> None:
        import ray

        while True:
            with self._cond:
                if self._stopped:
                    return
                self._dispatch()
                refs = list(self.inflight) + [p for p in self.down.values() if p is not None]
            if not refs:
                with self._cond:
                    self._cond.wait(self.poll_s)
                self._check_down()
                continue
            self._check_down()  # pings not sent yet (an actor just lost) go out now
            ready, _ = ray.wait(refs, num_returns=1, timeout=self.poll_s, fetch_local=False)
            with self._cond:
                for ref in ready:
                    if ref in self.inflight:
                        self._finished(ref)
                self._check_heartbeats()
            self._check_down(ready)

    def _dispatch(self) -> None:
        load = {i: 0 for i in range(len(self.actors)) if i not in self.down}
        for actor, _ in self.inflight.values():
            if actor in load:
                load[actor] += 1
        while self.queue:
            free = [i for i, n in load.items() if n < _DEPTH]
            _, requests = self.queue[0]
            version = requests[0].version
            if not free or version not in self.versions:
                return
            actor = min(free, key=lambda i: (load[i], self.used.get(i, 0.0), i))  # the least recently used
            self.used[actor] = time.monotonic()
            self.queue.pop(0)
            ref = self.actors[actor].rollout.remote(requests, [self.versions[version]], [self._factory])
            self.inflight[ref] = (actor, requests)
            if load[actor] == 0:
                self.busy_since[actor] = time.monotonic()
            load[actor] += 1

    def _finished(self, ref: Any) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        actor, requests = self.inflight.pop(ref)
        try:
            groups = ray.get(ref)
        except (RayActorError, ActorUnavailableError) as e:
            self._lost(actor, f"{type(e).__name__}")
            bisect.insort(self.queue, (requests[0].group, requests), key=lambda item: item[0])
            return
        except Exception as e:  # the engine's own error (a reward function that raised): the run's
            self.error = getattr(e, "cause", None) or e
            self._cond.notify_all()
            return
        for group in groups:
            self.results[group.group] = group
        self.busy_since[actor] = time.monotonic()
        self._cond.notify_all()

    def _lost(self, actor: int, why: str) -> None:
        """Actor `actor` is gone (or silenced): its queued groups go back to the pool, in order; it is used again
        once it answers a ping (Ray restarts it)."""
        if actor not in self.down:
            again = sorted(r.group for a, rs in self.inflight.values() if a == actor for r in rs)
            logger.warning("rollout actor %s lost (%s): Ray restarts it; its groups are generated again elsewhere",
                           self.names[actor], why)
            self.restarts += 1
            self.down[actor] = None
            for ref in [r for r, (a, _) in self.inflight.items() if a == actor]:
                _, requests = self.inflight.pop(ref)
                bisect.insort(self.queue, (requests[0].group, requests), key=lambda item: item[0])
            if again:
                logger.info("groups %s of %s queued again", again, self.names[actor])

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for actor in {a for a, _ in self.inflight.values()}:
            silent = now - self.busy_since.get(actor, now)
            if silent > self.heartbeat_s and actor not in self.down:
                import ray

                logger.warning("rollout actor %s silent for %.0f s (heartbeat_stale_after_s=%g): restarting it",
                               self.names[actor], silent, self.heartbeat_s)
                ray.kill(self.actors[actor], no_restart=False)
                self._lost(actor, f"silent {silent:.0f} s")

    def _check_down(self, ready: list | None = None) -> None:
        """Ping the lost actors; one that answers is back in the pool."""
        import ray
        from ray.exceptions import RayError

        with self._cond:
            for actor, ping in list(self.down.items()):
                if ping is None:
                    self.down[actor] = self.actors[actor].ready.remote([self._factory])
                elif ready is not None and ping in ready:
                    try:
                        ray.get(ping)
                        del self.down[actor]
                        self.busy_since[actor] = time.monotonic()
                        logger.info("rollout actor %s is up", self.names[actor])
                        self._cond.notify_all()
                    except RayError:
                        self.down[actor] = None


def _name(run: str | None, i: int) -> str:
    return f"raytrain-rollout-{i}" if not run else f"raytrain-rollout-{run}-{i}"
