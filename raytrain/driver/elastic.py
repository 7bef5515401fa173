"""Ray Train's elastic scaling policy, deciding a restart's size on the cluster as it is now.

Why Ray's own retries the old size after a node is lost: its ElasticScalingPolicy sizes a restart from
the resources the AutoscalingCoordinator actor reserved for the run, and that actor refreshes its view
of the nodes every 20 s (TICK_INTERVAL_S). A restart decided within 20 s of the loss still counts the
lost node, asks for the old size, and waits out the 60 s group-start timeout before deciding again
(72 s on a 2-core machine). The coordinator can recompute against a fresh view on request
(get_reserved_resources(recompute=True)); this policy asks for that while the group is not running,
at most once a second. A running group's growth checks are Ray's own (resize_interval_s).
"""

from __future__ import annotations

import logging

from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

logger = logging.getLogger(__name__)


class FreshViewElasticPolicy(ElasticScalingPolicy):
    """ElasticScalingPolicy whose (re)start decisions read the nodes alive now."""

    _fresh = False

    def make_decision_for_non_running_worker_group(self):
        self._fresh = True
        try:
            return super().make_decision_for_non_running_worker_group()
        finally:
            self._fresh = False

    def _get_reserved_resources(self):
        if not self._fresh:
            return super()._get_reserved_resources()
        import ray
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
