"""What the cluster can ever hold, and the refusal at start of a `scaling` request beyond it.

The cluster is its alive nodes plus the nodes its autoscaler may launch. The autoscaler's node types
come from the GCS's cluster config (platforms that report one) or from the --autoscaling-config file
of this cluster's monitor process on this node (the head: `ray up`, `ray job submit`, a local
cluster). A monitor without that file runs Ray's read-only autoscaler: the nodes are all there is.
Where neither answers, raytrain does not guess: nothing is refused and the run waits, visibly.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from ..config.sections import ConfigError

logger = logging.getLogger(__name__)

UNKNOWN = None  # the autoscaler's node types when raytrain cannot read them


@dataclasses.dataclass
class NodeType:
    """A node type the autoscaler can launch: its resources and how many (None: no limit known)."""

    name: str
    resources: dict
    max_count: int | None


@dataclasses.dataclass
class Cluster:
    """Alive nodes' total resources; the autoscaler's node types ([]: no autoscaler; None: unknown);
    the most worker nodes it may run at once (None: no limit but the types')."""

    nodes: list[dict]
    types: list[NodeType] | None
    max_worker_nodes: int | None = None
    source: str = ""


def worker_need(scaling) -> dict:
    """The resources one worker asks for, as Ray's ScalingConfig reads the section."""
    need = dict(scaling.resources_per_worker or {"CPU": 1})
    if scaling.use_gpu:
        need.setdefault("GPU", 1)
    return {k: v for k, v in need.items() if v}


def fits(resources: dict, need: dict) -> int:
    """How many workers needing `need` fit in `resources`."""
    if not need:
        return 1 << 30
    return int(min(resources.get(k, 0) // v for k, v in need.items()))


def show_resources(resources: dict) -> str:
    """{CPU: 2, memory: 8.0 GiB}: resources as the one-line messages show them."""
    shown = {k: (f"{v / 2**30:.1f} GiB" if k in ("memory", "object_store_memory") else f"{v:g}")
             for k, v in sorted(resources.items()) if not k.startswith("node:") and k != "object_store_memory"}
    return "{" + ", ".join(f"{k}: {v}" for k, v in shown.items()) + "}"


def refusal(scaling, cluster: Cluster) -> str | None:
    """The one line that refuses `scaling` on `cluster`, or None when it can be satisfied (or when the
    autoscaler's limits are unknown: then the run waits)."""
    if cluster.types is UNKNOWN:
        return None
    need, types = worker_need(scaling), cluster.types
    offers = cluster.nodes + [t.resources for t in types]
    where = (f"{len(cluster.nodes)} node(s) up" + (f", autoscaler node types {', '.join(t.name for t in types)}"
                                                   if types else ", no autoscaler"))
    if need.get("GPU") and not any(r.get("GPU", 0) > 0 for r in offers):
        field = "scaling.use_gpu" if scaling.use_gpu and "GPU" not in (scaling.resources_per_worker or {}) \
            else "scaling.resources_per_worker"
        return (f"{field}: asks {need['GPU']:g} GPU per worker, but the cluster has no GPU node"
                f"{' and its autoscaler no GPU node type' if types else ' and no autoscaler'} ({where})")
    if not any(fits(r, need) for r in offers):
        short = [k for k in need if not any(r.get(k, 0) >= need[k] for r in offers)] or list(need)
        best = max(offers, key=lambda r: [r.get(k, 0) for k in short], default={})
        field = "scaling.resources_per_worker" if scaling.resources_per_worker else "scaling.num_workers"
        return (f"{field}: each worker asks {show_resources({k: need[k] for k in short})}, but no node "
                f"{'or node type ' if types else ''}offers that: the most is {show_resources({k: best.get(k, 0) for k in short})} "
                f"({where})")
    wanted = scaling.min_workers if scaling.elastic else scaling.num_workers
    per = (lambda r: min(fits(r, need), 1)) if scaling.placement_strategy == "STRICT_SPREAD" \
        else (lambda r: fits(r, need))
    if scaling.placement_strategy == "STRICT_PACK":
        most = max(per(r) for r in offers)
    else:
        most = sum(per(r) for r in cluster.nodes) + _launchable(cluster, per)
    if most >= wanted:
        return None
    asks = (f"[{scaling.min_workers}, {scaling.num_workers}] needs at least {wanted} workers" if scaling.elastic
            else f"asks {wanted} workers")
    pack = " on one node (STRICT_PACK)" if scaling.placement_strategy == "STRICT_PACK" else \
        " on distinct nodes (STRICT_SPREAD)" if scaling.placement_strategy == "STRICT_SPREAD" else ""
    limit = f", at most {cluster.max_worker_nodes} worker nodes" if types and cluster.max_worker_nodes is not None else ""
    return (f"scaling.num_workers: {asks} of {show_resources(need)}{pack}, but the cluster holds at most {most} "
            f"({where}{limit})")


def _launchable(cluster: Cluster, per) -> int:
    """Workers the autoscaler's new nodes could hold: the best node types first, within each type's and
    the cluster's limits (alive worker nodes counted against the latter). Unbounded: a large number."""
    budget = None
    if cluster.max_worker_nodes is not None:
        workers_up = sum(1 for r in cluster.nodes if not any(k.startswith("node:__internal_head__") for k in r))
        budget = max(cluster.max_worker_nodes - workers_up, 0)
    total = 0
    for t in sorted(cluster.types, key=lambda t: per(t.resources), reverse=True):
        each = per(t.resources)
        if each == 0:
            continue
        count = t.max_count if t.max_count is not None else budget
        if count is None:
            return 1 << 30
        if budget is not None:
            count = min(count, budget)
            budget -= count
        total += count * each
    return total


def read_cluster() -> Cluster:
    """The cluster this driver is connected to (ray.init() done)."""
    import ray

    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    types = _gcs_cluster_config()
    if types is not None:
        return Cluster(nodes, types, None, "the GCS's cluster config")
    found = _monitor_config()
    if found is None:
        return Cluster(nodes, UNKNOWN, None, "no autoscaler config readable from this node")
    path, config = found
    if config is None:
        return Cluster(nodes, [], None, "no autoscaler (read-only monitor)")
    return _from_autoscaler_yaml(nodes, config, path)


def _gcs_cluster_config() -> list[NodeType] | None:
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception as e:  # noqa: BLE001 - an older or a client connection: no answer
        logger.debug("cluster config: %s", e)
        return None
    if config is None or not config.node_group_configs:
        return None
    return [NodeType(g.name, dict(g.resources), None if g.max_count < 0 else g.max_count)
            for g in config.node_group_configs if g.max_count != 0]


def _gcs_port() -> str | None:
    import ray

    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001
        return None
    return address.rsplit(":", 1)[-1] if address else None


def _monitor_config() -> tuple[str, dict | None] | None:
    """(path, YAML) of the --autoscaling-config of this cluster's autoscaler monitor on this node, (path,
    None) for a monitor without one, None when no monitor of this cluster runs here."""
    port = _gcs_port()
    if port is None or not os.path.isdir("/proc"):
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not any(a.endswith(("autoscaler/_private/monitor.py", "autoscaler/v2/monitor.py")) for a in argv):
            continue
        if not any(a.startswith("--gcs-address=") and a.rsplit(":", 1)[-1] == port for a in argv):
            continue
        path = next((a.split("=", 1)[1] for a in argv if a.startswith("--autoscaling-config=")), None)
        if not path:
            return "", None
        return path, _read_yaml(os.path.expanduser(path))
    return None


def _read_yaml(path: str) -> dict | None:
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        logger.debug("autoscaling config %s: %s", path, e)
        return {"unreadable": True}


def _from_autoscaler_yaml(nodes: list[dict], config: dict, path: str) -> Cluster:
    if config.get("unreadable"):
        return Cluster(nodes, UNKNOWN, None, f"{path} unreadable")
    head = config.get("head_node_type")
    types = []
    for name, spec in (config.get("available_node_types") or {}).items():
        if name == head:
            continue
        resources = dict(spec.get("resources") or {})
        if not resources:  # detected at launch (a provider that did not fill it in): not known here
            return Cluster(nodes, UNKNOWN, None, f"{path}: node type {name} has no resources listed")
        count = spec.get("max_workers")
        types.append(NodeType(name, resources, None if count is None else int(count)))
    top = config.get("max_workers")
    return Cluster(nodes, types, None if top is None else int(top), path)


def check_capacity(scaling) -> None:
    """Refuse at start, in one line, a `scaling` request the cluster can never satisfy."""
    line = refusal(scaling, read_cluster())
    if line:
        raise ConfigError(line)
