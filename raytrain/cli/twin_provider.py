"""The node provider of the laptop twin (local_cluster.py), loaded by Ray's autoscaler monitor as its
`external` provider: Ray's fake multi-node provider, with a cloud's view of a node killed from outside."""

from __future__ import annotations

import os

from ray._private import ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.node_launch_exception import NodeLaunchException


class TwinProvider(FakeMultiNodeProvider):
    """Two things a cloud does. While the file `no_capacity_file` exists (`local_cluster capacity off`), a
    launch fails, as a cloud's does with no spot capacity left; the autoscaler retries it. And a node whose
    raylet has exited (a spot termination: `local_cluster terminate`) is no longer listed, as a cloud stops
    listing a terminated instance, so the autoscaler may replace it. Ray's fake provider keeps listing such
    a node, never heartbeating: pending forever, holding its place under max_workers."""

    def non_terminated_nodes(self, tag_filters):
        with self.lock:
            for node_id, entry in list(self._nodes.items()):
                node = entry.get("node")
                raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET) if node is not None else None
                if raylets and all(info.process.poll() is not None for info in raylets):
                    del self._nodes[node_id]
                    node.kill_all_processes(check_alive=False, allow_graceful=False)  # its agents, reaped
        return super().non_terminated_nodes(tag_filters)

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        if os.path.exists(self.provider_config.get("no_capacity_file") or ""):
            # the structured error a cloud provider raises: Ray records the node type as unavailable
            raise NodeLaunchException("no capacity", "the local cluster's capacity is off", None)
        return super().create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
