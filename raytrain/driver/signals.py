"""DRIVER side of Ctrl-C / SIGTERM in a Ray run: the first signal makes every worker save at its next
step boundary (SIGTERM to each, handled in worker/preemption.py), then the run is aborted so that
FailureConfig(max_failures) does not restart them. In-process runs are handled in worker/signals.py."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from ..worker.signals import StopRequest


@contextlib.contextmanager
def ray_train_signals(stop: StopRequest):
    """While this process drives a Ray Train run, a signal makes the workers save and stop, then ends
    the run. Ray's TorchTrainer.fit() installs its own SIGINT handler, which aborts the run at once
    and saves nothing; Ray has no hook for this, so its registration is replaced for the duration."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    original = DataParallelTrainer._register_sigint_handler

    def register(trainer, controller):  # keeps graceful_stop's handler in place
        stop.forward = lambda: _stop_workers_then_abort(controller)

    DataParallelTrainer._register_sigint_handler = register
    try:
        yield stop
    finally:
        DataParallelTrainer._register_sigint_handler = original
        stop.forward = None


def _stop_workers_then_abort(controller, grace_s: float = 300.0) -> None:
    """SIGTERM the workers (they save at the next step boundary and stop); once they are gone, abort
    the controller so that FailureConfig(max_failures) does not start them again."""
    import ray

    try:
        pids = stop_ray_workers()
    except Exception as e:  # noqa: BLE001 - e.g. no dashboard for the state API: say so, Ctrl-C still works
        sys.stderr.write(f"could not reach the Ray Train workers ({type(e).__name__}: {e}); "
                         "press Ctrl-C again to exit without saving\n")
        return
    sys.stderr.write(f"sent SIGTERM to {len(pids)} Ray Train worker(s): each saves and stops\n")
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and set(pids) & set(_alive_worker_pids()):
        time.sleep(0.5)
    try:
        ray.get(controller.abort.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - the controller may have ended by itself (max_failures=0)
        pass


def _alive_worker_pids() -> list[int]:
    return [pid for pids in _workers_by_node().values() for pid in pids]


def _workers_by_node() -> dict[str, list[int]]:
    """{node id: pids} of this job's alive Ray Train workers, from the GCS's actor table. (The public
    ray.util.state API goes through the dashboard, which a job may run without, and which resolves
    to another cluster's when several share a machine.)"""
    import ray
    from ray._private.state import actors

    job, by_node = ray.get_runtime_context().get_job_id(), {}
    for actor in actors().values():
        if actor["ActorClassName"] == "RayTrainWorker" and actor["State"] == "ALIVE" and actor["JobID"] == job \
                and actor["Pid"]:
            by_node.setdefault(actor["Address"]["NodeID"], []).append(actor["Pid"])
    return by_node


def stop_ray_workers() -> list[int]:
    """SIGTERM this job's Ray Train workers, on every node: their handler (worker/preemption.py) saves a
    checkpoint at the next step boundary and stops them. Returns the pids signalled."""
    import ray
    from ray.util import client
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    by_node = _workers_by_node()
    signalled = [pid for pids in by_node.values() for pid in pids]
    if not client.ray.is_connected():  # this process runs on a node of the cluster
        # Its own node's workers directly: a task may wait seconds for a worker process to start, and
        # a short run can end meanwhile, its Ctrl-C lost.
        _sigterm(by_node.pop(ray.get_runtime_context().get_node_id(), []))
    kill = ray.remote(num_cpus=0)(_sigterm)
    ray.get([kill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pids)
             for node, pids in by_node.items()], timeout=60)
    return signalled


def _sigterm(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # already gone
