"""Runs in every Ray worker process of a local cluster raytrain starts (runtime_env's
worker_process_setup_hook): imports nothing heavy, since Ray Data's workers run it too."""

from __future__ import annotations

import logging

# Ray Train's controller asks an autoscaling coordinator for the workers' resources; a local cluster has
# no autoscaler, and on a busy machine the coordinator's first answer takes longer than Ray's 5 s wait,
# which Ray logs as a warning with a traceback that "it's safe to ignore".
_LOCAL_CLUSTER_NOISE = ("ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client",)


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def local_cluster_worker() -> None:
    # A filter, not a level: Ray Train's controller configures the "ray.train" logger with dictConfig,
    # which resets the level of every logger below it (filters stay).
    for name in _LOCAL_CLUSTER_NOISE:
        logging.getLogger(name).addFilter(_Drop())
