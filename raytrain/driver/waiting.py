"""While a Ray run waits for its workers, the driver says so on its progress line, and past
scaling.max_wait_s it ends the run in one line.

Waiting: a placement group of this job that Ray cannot place yet, or no group at all while the nodes up
cannot hold the smallest one (an elastic group below min_workers). Read from the GCS every second; the first
line at once while the autoscaler launches nodes, else after 5 s of waiting (a normal start places its group
at once), then one every 10 s and one whenever what it waits for changes. The wait is ended by aborting Ray
Train's controller, as Ray's own Ctrl-C does (killing it where it blocks): no worker runs then, so nothing is
lost; the run's checkpoints stay for --resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from ..config.sections import ConfigError
from .capacity import fits, show_resources, worker_need

logger = logging.getLogger(__name__)


class WaitTimeout(ConfigError):
    """The run waited scaling.max_wait_s for its workers and ended (one line, no traceback)."""


@dataclasses.dataclass
class Waiting:
    wanted: int
    room: int  # workers the nodes up could hold
    nodes: int
    pending: int | None  # nodes the autoscaler is launching (None: not known)
    failing: str = ""  # node types whose launches fail now, with the provider's reason

    def where(self) -> str:
        return f"room for {min(self.room, self.wanted)} on the {self.nodes} node(s) up"

    def line(self, need: dict, waited: float, bound: float | None) -> str:
        pending = "" if self.pending is None else f", {self.pending} node(s) pending"
        if self.failing:
            pending += f", launches failing: {self.failing}"
        of = f" of scaling.max_wait_s={bound:g}" if bound else ""
        return (f"waiting for workers: {self.wanted} wanted of {show_resources(need)}, {self.where()}{pending} "
                f"(waited {waited:.0f} s{of})")


def observe(scaling, failures_after: float | None = None) -> Waiting | None:
    """What this job's run waits for now, or None when it does not wait; launch failures recorded before
    `failures_after` (time.time()) are not this wait's."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    need = worker_need(scaling)
    job = ray.get_runtime_context().get_job_id()
    groups = [gcs_pb2.PlacementGroupTableData.FromString(raw)
              for raw in state._connect_and_get_accessor().get_placement_group_table()]
    ours = [g for g in groups if g.creator_job_id.hex() == job and g.state != gcs_pb2.PlacementGroupTableData.REMOVED]
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    try:  # room now: what the nodes have free
        room = sum(fits(r, need) for r in state.available_resources_per_node().values())
    except Exception:  # noqa: BLE001
        room = sum(fits(r, need) for r in nodes)
    waiting = [g for g in ours if g.state in (gcs_pb2.PlacementGroupTableData.PENDING,
                                              gcs_pb2.PlacementGroupTableData.RESCHEDULING)]
    if waiting:
        wanted = len(waiting[0].bundles)
    elif ours:
        return None
    else:
        wanted = scaling.min_workers if scaling.elastic else scaling.num_workers
        if sum(fits(r, need) for r in nodes) >= wanted:  # the nodes up hold it: Ray Train is starting it
            return None
    return Waiting(wanted, room, len(nodes), *_autoscaler_view(failures_after))


def _autoscaler_view(failures_after: float | None = None) -> tuple[int | None, str]:
    """Nodes the autoscaler is launching, and the node types whose launches fail (with the provider's
    category, e.g. a cloud's InsufficientInstanceCapacity), from the status it publishes (None, "": no
    autoscaler status)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get("__autoscaling_status")
        report = json.loads(raw).get("autoscaler_report") if raw else None
    except Exception:  # noqa: BLE001 - a view: no figure rather than an error
        return None, ""
    if not report:
        return None, ""
    pending = len(report.get("pending_nodes") or []) + sum((report.get("pending_launches") or {}).values())
    records = ((report.get("node_availability_summary") or {}).get("node_availabilities") or {}).items()
    # Current failures only: while the demand lasts, the autoscaler retries every update (1-5 s).
    after = max(time.time() - 15, (failures_after or 0) - 1)  # Ray records whole seconds
    failing = [f"{name}: {(record.get('unavailable_node_information') or {}).get('category', 'unavailable')}"
               for name, record in sorted(records) if isinstance(record, dict) and not record.get("is_available", True)
               and float(record.get("last_checked_timestamp") or 0) >= after]
    return pending, ", ".join(failing)


class WaitWatch:
    """The driver's thread that watches a run's wait (see the module's docstring)."""

    def __init__(self, scaling, say, every_s: float = 10.0, poll_s: float = 1.0, grace_s: float = 5.0):
        self.scaling, self.say = scaling, say
        self.every_s, self.poll_s, self.grace_s = every_s, poll_s, grace_s
        self.timed_out: str | None = None
        self._controller = self._requester_id = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="raytrain-wait")

    def controller(self, handle, requester_id: str | None = None) -> None:
        self._controller, self._requester_id = handle, requester_id

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        since = said = shown = None
        began = time.time()  # since when launch failures are this wait's (the watch's start, or the last wait's end)
        bound = self.scaling.max_wait_s
        while not self._done.wait(self.poll_s):
            try:
                waiting = observe(self.scaling, began)
            except Exception as e:  # noqa: BLE001 - the watch is a view: never fail the run over it
                logger.debug("wait watch: %s", e)
                continue
            now = time.monotonic()
            if waiting is None:
                since = said = shown = None
                began = time.time()
                continue
            since = since if since is not None else now
            waited = now - since
            line = waiting.line(worker_need(self.scaling), waited, bound)
            if bound is not None and waited >= bound:
                self.timed_out = (f"scaling.max_wait_s: waited {waited:.0f} s for {waiting.wanted} workers of "
                                  f"{show_resources(worker_need(self.scaling))} ({waiting.where()}"
                                  f"{'; launches failing: ' + waiting.failing if waiting.failing else ''}"
                                  "); the run stopped, nothing lost: run it again "
                                  "when the cluster has room (--resume auto continues from its last checkpoint)")
                self._abort()
                return
            # Nodes pending make a real wait, said at once (a normal start places its group within grace_s);
            # then a line every every_s, and one whenever the room or the autoscaler's launches change.
            state = (waiting.wanted, waiting.room, waiting.nodes, waiting.pending, waiting.failing)
            if (waited >= self.grace_s or waiting.pending) and \
                    (said is None or state != shown or now - said >= self.every_s - self.poll_s / 2):
                said, shown = now, state
                self.say(line)

    def _abort(self) -> None:
        """Abort the controller as Ray's Ctrl-C does; one blocked in its group's start (it waits there for
        a fixed-size group's placement, torch_trainer._start_timeout_env) cannot answer: it is killed, the
        GCS removes the placement group it created, and its request for nodes is withdrawn here."""
        import ray

        if self._controller is None:
            logger.warning("%s (no handle on Ray Train's controller: it waits on)", self.timed_out)
            return
        try:
            ray.get(self._controller.abort.remote(), timeout=5)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self._controller, no_restart=True)
            self._cancel_node_request()
        except Exception as e:  # noqa: BLE001 - the controller exits as it aborts
            logger.debug("abort: %s", e)

    def _cancel_node_request(self) -> None:
        """Withdraw the run's request for nodes, as an aborted controller does itself: a killed one leaves
        it to the autoscaler for 3 minutes, which would keep (or launch) nodes for a run that has ended."""
        import ray
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        if self._requester_id is None:
            return
        try:
            ray.get(get_or_create_autoscaling_coordinator().cancel_request.remote(requester_id=self._requester_id),
                    timeout=5)
        except Exception as e:  # noqa: BLE001 - Ray's own request expires in 3 minutes anyway
            logger.debug("cancel the node request of %s: %s", self._requester_id, e)
