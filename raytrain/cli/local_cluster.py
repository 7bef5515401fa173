"""A laptop twin of cluster.yaml: its head (no CPUs) and its worker node types, launched and released by
Ray's own autoscaler as processes on this machine (Ray's fake multi-node provider), so a run can be
watched scaling from zero, surviving a terminated node and releasing the nodes before it goes to a cloud.

    python -m raytrain.cli.local_cluster up cluster.yaml     # blocks; Ctrl-C ends the cluster and its nodes
    python -m raytrain.cli.local_cluster terminate           # one worker node dies, as a spot node does
    python -m raytrain.cli.local_cluster capacity off|on     # launches fail, as with no spot capacity left

Each worker node type keeps its min/max_workers and custom resources; its CPUs become --worker-cpus and
its GPUs none (a laptop has none to give). The cluster's max_workers and upscaling_speed are kept; the
idle timeout is --idle-timeout-s (cluster.yaml's minutes would outlast a laptop session). The head takes
the RAY_health_check_* settings of cluster.yaml's head start (how soon a lost node is noticed). Nothing here
runs `ray stop`: the cluster is one process group, ended by signal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import yaml

from ..config.sections import ConfigError

HEAD_TYPE = "ray.head.default"  # the fake provider names its head's type so
NODE_ID_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"  # the fake provider's id of a node, in its processes' environ
STATE = "local_cluster.json"


def twin_config(cluster: dict, *, gcs_address: str, worker_cpus: int = 1, idle_timeout_s: float = 30,
                object_store_mb: int = 100, no_capacity_file: str | None = None) -> dict:
    """The fake multi-node autoscaler config shaped like `cluster` (a cluster.yaml, loaded)."""
    types = cluster.get("available_node_types") or {}
    head = cluster.get("head_node_type")
    if head not in types:
        raise ConfigError(f"head_node_type: {head!r} is not one of available_node_types ({', '.join(types)})")
    workers = {}
    for name, spec in types.items():
        if name == head:
            continue
        custom = {k: v for k, v in (spec.get("resources") or {}).items()
                  if k not in ("CPU", "GPU", "memory", "object_store_memory")}
        workers[name] = {"resources": {**custom, "CPU": worker_cpus, "object_store_memory": object_store_mb << 20},
                         "node_config": {}, "min_workers": int(spec.get("min_workers", 0)),
                         "max_workers": int(spec.get("max_workers", cluster.get("max_workers", 2)))}
    if not workers:
        raise ConfigError("available_node_types: no worker node type besides the head; nothing to scale")
    return {
        "cluster_name": f"{cluster.get('cluster_name', 'raytrain')}-local",
        "max_workers": int(cluster.get("max_workers", sum(w["max_workers"] for w in workers.values()))),
        "upscaling_speed": float(cluster.get("upscaling_speed", 1.0)),
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {"type": "external", "module": "raytrain.cli.twin_provider.TwinProvider",
                     "gcs_address": gcs_address, "no_capacity_file": no_capacity_file, "use_node_id_as_ip": True,
                     "launch_multiple": True,  # else a launch of n nodes starts one
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {}, "docker": {},
        "available_node_types": {HEAD_TYPE: {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
                                 **workers},
        "head_node_type": HEAD_TYPE,
        **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                               "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands",
                               "cluster_synced_files", "rsync_exclude", "rsync_filter")},
        "file_mounts": {}, "file_mounts_sync_continuously": False,
    }


def health_checks(cluster: dict) -> dict:
    """The RAY_health_check_* settings the head of `cluster` (a cluster.yaml, loaded) starts with: the GCS
    reads them, so the twin's head takes them too."""
    found = {}
    for command in cluster.get("head_start_ray_commands") or []:
        found.update(re.findall(r"\b(RAY_health_check_[a-z_]+)=(\d+)\b", str(command)))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LocalCluster:
    """The twin: `start()` runs the head (`ray start --head --block` in a process group of its own, with
    the autoscaler's monitor, which launches every worker node as its child); `stop()` kills that group."""

    def __init__(self, cluster_yaml: str, *, base: str | None = None, worker_cpus: int = 1,
                 idle_timeout_s: float = 30, port: int | None = None, env: dict | None = None):
        try:
            with open(cluster_yaml) as f:
                self.cluster = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"{cluster_yaml}: cannot read it ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{cluster_yaml}: not YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(self.cluster, dict):
            raise ConfigError(f"{cluster_yaml}: a Ray cluster config is a mapping (available_node_types, ...)")
        # short: Ray's socket paths must stay under 107 bytes
        self.base = base or tempfile.mkdtemp(prefix="rtlc", dir="/tmp")
        os.makedirs(self.base, exist_ok=True)
        # the IP Ray gives its nodes: an address of another form would look like a second cluster to Ray
        from ray._private.services import get_node_ip_address

        self.address = f"{get_node_ip_address()}:{port or _free_port()}"
        self.no_capacity_file = os.path.join(self.base, "no_capacity")
        try:
            self.config = twin_config(self.cluster, gcs_address=self.address, worker_cpus=worker_cpus,
                                      idle_timeout_s=idle_timeout_s, no_capacity_file=self.no_capacity_file)
        except ConfigError as e:
            raise ConfigError(f"{cluster_yaml}: {e}") from None
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict:
        """For the head and for a driver of this cluster: its address, and token authentication as
        cluster.yaml has it (RAY_AUTH_MODE=disabled in the caller's environment opts out)."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_FAKE_CLUSTER")}
        env.setdefault("RAY_AUTH_MODE", "token")
        env.update(RAY_ADDRESS=self.address, RAY_USAGE_STATS_ENABLED="0", **self.extra_env)
        return env

    def head_env(self) -> dict:
        """The head's environment: env()'s, the fake provider's switches, and cluster.yaml's health checks."""
        env = self.env()
        # AUTOSCALER_UPDATE_INTERVAL_S: the monitor decides every second, not every 5 s; its metrics port
        # its own, not Ray's fixed default (another cluster's monitor on this machine may hold that one)
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", AUTOSCALER_METRIC_PORT=str(_free_port()))
        env.pop("RAY_ADDRESS")
        for name, value in health_checks(self.cluster).items():  # the caller's own setting wins
            env.setdefault(name, value)
        # the monitor imports the provider from this raytrain, installed or not
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [package_root, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def start(self, timeout: float = 120) -> None:
        path = os.path.join(self.base, "autoscaling.json")
        with open(path, "w") as f:
            json.dump(self.config, f)
        if self.env()["RAY_AUTH_MODE"] == "token":
            _ensure_token(self.env())
        env = self.head_env()
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray, "start", "--head", "--block", f"--port={self.address.rsplit(':', 1)[1]}", "--num-cpus=0",
               f"--autoscaling-config={path}", f"--temp-dir={os.path.join(self.base, 't')}",
               # the dashboard serves Ray's state API, which Ray Train's placement-group cleaner polls
               "--dashboard-host=127.0.0.1", f"--dashboard-port={_free_port()}", "--disable-usage-stats",
               f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}"]
        log = open(os.path.join(self.base, "head.log"), "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        with open(os.path.join(self.base, STATE), "w") as f:
            json.dump({"address": self.address, "pgid": self.proc.pid}, f)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the head exited ({self.proc.returncode}); {self.base}/head.log says why")
            if _listening(self.address) and self.monitor_up():
                return
            time.sleep(0.5)
        raise TimeoutError(f"the head did not come up in {timeout:.0f} s; see {self.base}/head.log")

    def monitor_up(self) -> bool:
        return any("autoscaler/_private/monitor.py" in cmd for _, cmd, _ in _group_processes(self.proc.pid))

    def worker_nodes(self) -> list[str]:
        """The fake provider's ids of the worker nodes whose raylet runs now (oldest first)."""
        return worker_nodes(self.proc.pid)

    def terminate(self, node_id: str | None = None) -> str:
        return terminate(self.proc.pid, node_id)

    def capacity(self, available: bool) -> None:
        capacity(self.base, available)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(30)
        self.proc = None


def _ensure_token(env: dict) -> None:
    """Token authentication needs a token: ~/.ray/auth_token (or RAY_AUTH_TOKEN), made as
    `ray get-auth-token --generate` makes it where there is none."""
    if env.get("RAY_AUTH_TOKEN") or os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        return
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def _group_processes(pgid: int) -> list[tuple[int, str, str | None]]:
    """(pid, command line, fake node id) of every process in process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] in ("Z", "X"):  # a killed node's processes stay zombies
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        node = env.get(NODE_ID_ENV.encode())
        found.append((int(entry), cmd, node.decode() if node else None))
    return found


def worker_nodes(pgid: int) -> list[str]:
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

    return sorted({node for _, cmd, node in _group_processes(pgid)
                   if node and node != FAKE_HEAD_NODE_ID and "/raylet " in cmd})


def terminate(pgid: int, node_id: str | None = None) -> str:
    """SIGKILL every process of one worker node (`node_id`, else the oldest): its raylet, its Ray workers
    and agents, as a spot termination leaves them. The autoscaler replaces it if the demand is still there."""
    nodes = worker_nodes(pgid)
    if not nodes:
        raise ConfigError("terminate: the local cluster has no worker node up")
    node_id = node_id or nodes[0]
    if node_id not in nodes:
        raise ConfigError(f"terminate: no worker node {node_id!r}; up: {', '.join(nodes)}")
    for pid, _, node in _group_processes(pgid):
        if node == node_id:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return node_id


def capacity(base: str, available: bool) -> None:
    """Whether new nodes can be launched (off: every launch fails, as on a cloud out of spot capacity)."""
    path = os.path.join(base, "no_capacity")
    if available:
        if os.path.exists(path):
            os.remove(path)
    else:
        open(path, "w").close()


def _state(base: str) -> dict:
    try:
        with open(os.path.join(base, STATE)) as f:
            return json.load(f)
    except OSError:
        raise ConfigError(f"--base: no local cluster recorded in {base} (start one with `up`)") from None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raytrain.cli.local_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the twin of a cluster.yaml and block until Ctrl-C")
    up.add_argument("cluster_yaml", nargs="?", default="cluster.yaml")
    up.add_argument("--worker-cpus", type=int, default=1, help="CPUs of every worker node (default 1)")
    up.add_argument("--idle-timeout-s", type=float, default=30, help="idle worker nodes released after (30)")
    up.add_argument("--port", type=int, default=None, help="the head's GCS port (default: a free one)")
    up.add_argument("--base", default="/tmp/raytrain-local-cluster", help="its logs and state")
    kill = sub.add_parser("terminate", help="kill one worker node's processes, as a spot termination does")
    kill.add_argument("node_id", nargs="?", default=None, help="default: the oldest worker node")
    kill.add_argument("--base", default="/tmp/raytrain-local-cluster")
    room = sub.add_parser("capacity", help="off: every launch fails, as on a cloud out of spot capacity")
    room.add_argument("state", choices=["on", "off"])
    room.add_argument("--base", default="/tmp/raytrain-local-cluster")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "terminate":
            node = terminate(_state(args.base)["pgid"], args.node_id)
            print(f"terminated worker node {node}")
            return 0
        if args.command == "capacity":
            _state(args.base)
            capacity(args.base, args.state == "on")
            print(f"capacity {args.state}: new nodes {'can' if args.state == 'on' else 'cannot'} be launched")
            return 0
        twin = LocalCluster(args.cluster_yaml, base=args.base, worker_cpus=args.worker_cpus,
                            idle_timeout_s=args.idle_timeout_s, port=args.port)
        twin.start()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    types = ", ".join(f"{name} {t['min_workers']}..{t['max_workers']}" for name, t in
                      twin.config["available_node_types"].items() if name != HEAD_TYPE)
    auth = "RAY_AUTH_MODE=token " if twin.env()["RAY_AUTH_MODE"] == "token" else ""
    print(f"local twin of {args.cluster_yaml} at {twin.address}: head with 0 CPUs; {types} "
          f"(max_workers {twin.config['max_workers']}) of {args.worker_cpus} CPU each; idle nodes released "
          f"after {args.idle_timeout_s:g} s; logs in {args.base}\n"
          f"  run:       {auth}RAY_ADDRESS={twin.address} python -m raytrain.run --config examples/digits.yaml "
          "--set scaling.num_workers=2\n"
          f"  watch:     {auth}ray status --address {twin.address}\n"
          f"  terminate: python -m raytrain.cli.local_cluster terminate --base {args.base}\n"
          f"  capacity:  python -m raytrain.cli.local_cluster capacity off --base {args.base}\n"
          "Ctrl-C stops the cluster.", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` ends it as Ctrl-C does
    try:
        while twin.proc.poll() is None:
            time.sleep(1)
        print(f"error: the head exited ({twin.proc.returncode}); see {args.base}/head.log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        twin.stop()


if __name__ == "__main__":
    sys.exit(main())
