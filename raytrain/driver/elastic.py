"""Ray Train's elastic scaling policy, sizing a (re)start on the nodes that can hold the workers now.

Why Ray's own policy retries the old size after a node is lost, twice over:
- it sizes a restart from what the AutoscalingCoordinator actor reserved for the run, and that actor
  rereads the nodes every 20 s (TICK_INTERVAL_S). Here a (re)start asks it to recompute against a fresh
  view (get_reserved_resources(recompute=True)), at most once a second; a running group's growth checks
  are Ray's own (resize_interval_s), on the coordinator's view less the nodes below.
- the fresh view is the GCS's, which lists a lost node alive until its health checks fail (Ray's default:
  5 checks 3 s apart, ~15 s), while the workers left notice the loss in a second or two (their collective's
  connection breaks) and fail the group. A restart decided then counts the lost node, asks for the old
  size, and waits out Ray Train's 60 s group-start timeout (74 s from the loss to the next step).
  Here the restart after a failure first asks the failed group's workers if they are there (Ray's
  liveness call on any actor, `__ray_ready__`): a node none of whose workers answers, one of them
  unreachable (ActorUnavailableError: its process refuses connections) or silent for PING_S, is left out:
  not counted, the new group not placed on it (a `ray.io/node-id` label selector), its workers killed at
  once (Ray Train's shutdown of the group would wait ~2 s on each call to them), until the GCS lists it
  dead (then never counted again: the coordinator's view may list it for 20 s more) or a task placed on
  it runs (it was up after all: counted again). A worker whose process died on a node that is up is
  reported dead by that node (ActorDiedError): the node counts.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

logger = logging.getLogger(__name__)

PING_S = 1.0  # how long a failed group's worker has to answer (one that is up: milliseconds)
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id


def unreachable_nodes(workers: list[tuple], timeout_s: float = PING_S) -> set[str]:
    """Of `workers` ((actor handle, node id) pairs), the nodes where none answers Ray's liveness call and
    one at least is unreachable or silent for timeout_s."""
    if not workers:
        return set()
    pings = {actor.__ray_ready__.remote(): node for actor, node in workers}
    ready, silent = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
    answered, lost = set(), {pings[ref] for ref in silent}
    for ref in ready:
        try:
            ray.get(ref)
            answered.add(pings[ref])
        except ray.exceptions.ActorUnavailableError:
            lost.add(pings[ref])
        except ray.exceptions.RayError:  # dead, as its node reported it: the node is up
            answered.add(pings[ref])
    return lost - answered


@ray.remote(num_cpus=0, max_retries=0)
def _up() -> bool:
    """Placed on a node left out: it runs only if the node is up."""
    return True


class FreshViewElasticPolicy(ElasticScalingPolicy):
    """ElasticScalingPolicy whose (re)start decisions read the nodes alive now, leaving out the nodes
    whose workers stopped answering (see the module's docstring)."""

    _fresh = False
    SUSPECTS_INTERVAL_S = 1.0  # the GCS is asked about the nodes left out at most this often

    def __init__(self, scaling_config):
        super().__init__(scaling_config)
        self._workers: list[tuple] = []  # (actor, node id) of the running group at its last healthy poll
        self.suspects: dict[str, object] = {}  # node id -> the probe task sent there (None: not yet)
        self.gone: set[str] = set()  # nodes left out that the GCS then listed dead
        self._suspects_checked = float("-inf")

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._workers = [(w.actor, w.metadata.node_id) for w in worker_group_state.workers]
        return super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)

    def make_decision_for_non_running_worker_group(self):
        if self._workers:  # the group that ran has failed: which of its nodes are still there?
            workers, self._workers = self._workers, []
            lost = unreachable_nodes(workers)
            self.leave_out(lost)
            for actor, node in workers:
                if node in lost:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception as e:  # noqa: BLE001 - Ray Train kills the group's workers next anyway
                        logger.debug("kill a worker on node %s: %s", node[:8], e)
        self._fresh = True
        try:
            return super().make_decision_for_non_running_worker_group()
        finally:
            self._fresh = False

    def leave_out(self, nodes: set[str]) -> None:
        """Count `nodes` no more until the GCS lists them dead or a task placed on them runs."""
        alive = _alive_nodes() if nodes else set()
        for node in sorted(nodes & alive - set(self.suspects)):
            logger.warning("node %s: the workers it ran do not answer; the restart does not count it (the GCS "
                           "lists it alive until its health checks fail)", node[:8])
            self.suspects[node] = None
        self._suspects_checked = float("-inf")

    def on_controller_start_worker_group(self, *, scaling_config, num_workers):
        """The new group's placement: not on a node left out (Ray would still place bundles there)."""
        self._check_suspects()
        if not self.suspects:
            return None
        nodes = sorted(self.suspects)
        return {NODE_ID_LABEL: f"!{nodes[0]}" if len(nodes) == 1 else f"!in({','.join(nodes)})"}

    def _get_reserved_resources(self):
        reserved = self._fresh_reserved() if self._fresh else super()._get_reserved_resources()
        self._check_suspects()
        if not reserved or not (self.suspects or self.gone):
            return reserved
        return {node: resources for node, resources in reserved.items()
                if node not in self.suspects and node not in self.gone}

    def _check_suspects(self) -> None:
        """Forget the nodes left out that the GCS lists dead, or where a probe task ran; send the probes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        now = time.monotonic()
        if not self.suspects or now - self._suspects_checked < self.SUSPECTS_INTERVAL_S:
            return
        self._suspects_checked = now
        try:
            alive = _alive_nodes()
        except Exception as e:  # noqa: BLE001 - no answer this time: the next check asks again
            logger.debug("nodes: %s", e)
            return
        for node, probe in list(self.suspects.items()):
            if node not in alive:
                del self.suspects[node]
                self.gone.add(node)
                continue
            if probe is None:
                self.suspects[node] = _up.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                continue
            if ray.wait([probe], timeout=0)[0]:
                try:
                    ray.get(probe)
                except ray.exceptions.RayError:
                    self.suspects[node] = None  # sent again at the next check
                    continue
                logger.warning("node %s: a task ran on it; counted again", node[:8])
                del self.suspects[node]

    def _fresh_reserved(self):
        from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
            AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
        )
        from ray.train.v2._internal.util import time_monotonic

        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        reserved = None
        try:
            reserved = ray.get(self._autoscaling_coordinator.get_reserved_resources.remote(
                self._requester_id, recompute=True), timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - as Ray's own: no decision this time, the next one retries
            logger.debug("reserved resources for %s: %s", self._requester_id, e)
        finally:
            self._latest_reserved_resources_query_time = time_monotonic()
            self._latest_reserved_resources = reserved
        return reserved


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
