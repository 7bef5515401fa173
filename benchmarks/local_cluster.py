"""The laptop twin of cluster.yaml (python -m raytrain.cli.local_cluster): what a user watching it sees,
timed. The digits job on 2 workers of {CPU: 1}, checkpoints every 5 steps, max_failures 1.

    python benchmarks/local_cluster.py [--idle-timeout-s 15] [--health-checks cluster.yaml,default]

  request -> first step:  the driver's start to the run's first step, no worker node up (the autoscaler
                          launches them); against the same run on the nodes already up.
  loss -> resumed step:   rank 1's node SIGKILLed after step 8 (every process of it, as a spot termination
                          leaves it) to the first step after it; the autoscaler launches the replacement.
  idle -> released:       the last run's end to the last worker node gone (--idle-timeout-s).
Once per --health-checks setting, in one invocation: cluster.yaml's (its head's RAY_health_check_*, which
the twin's head takes) and Ray's default (5 checks 3 s apart, each given 10 s).
Timings never decide a test; on a shared machine, rerun for stable figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.distributed import _marks  # noqa: E402
from raytrain.cli.local_cluster import LocalCluster  # noqa: E402
from tests.driver.cluster import ROOT, drive  # noqa: E402


def _spec(twin: LocalCluster, name: str, **spec) -> dict:
    """The digits job's spec for tests/driver/cluster.py's driver; its step marks go to spec["marks"]."""
    return {"result": os.path.join(twin.base, f"{name}.json"), "output_dir": os.path.join(twin.base, name),
            "storage": os.path.join(twin.base, "storage", name), "resources": {"CPU": 1},
            "marks": os.path.join(twin.base, f"{name}.marks"), **spec}


def _finish(proc, spec: dict) -> dict:
    proc.wait(600)
    with open(spec["result"]) as f:
        result = json.load(f)
    if "error" in result:
        raise RuntimeError(f"{result['error']} (console: {spec['result']}.log)")
    return result


# Ray's own values, set explicitly: the twin's head would take cluster.yaml's otherwise
RAY_DEFAULT_CHECKS = {"RAY_health_check_period_ms": "3000", "RAY_health_check_timeout_ms": "10000",
                      "RAY_health_check_failure_threshold": "5"}


def bench(idle_timeout_s: float, health_checks: str = "cluster.yaml") -> dict:
    twin = LocalCluster(os.path.join(ROOT, "cluster.yaml"), idle_timeout_s=idle_timeout_s,
                        env=RAY_DEFAULT_CHECKS if health_checks == "default" else None)
    try:
        twin.start()
        assert not twin.worker_nodes()
        flag = os.path.join(twin.base, "lose")
        spec = _spec(twin, "scaled", max_failures=1, max_steps=40, pause={"rank": 1, "step": 8, "flag": flag})
        start = time.time()
        proc = drive(spec, twin.address, twin.env())
        while not os.path.exists(flag):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before its pause; see {spec['result']}.log")
            time.sleep(0.2)
        with open(flag + ".node") as f:
            node = f.read().strip()
        lost_at = time.time()
        twin.terminate(node)
        result = _finish(proc, spec)
        steps = _marks(spec["marks"])
        after = [m for m in steps if m[0] > lost_at]
        fresh_spec = _spec(twin, "fresh", max_steps=10)
        fresh_start = time.time()
        fresh = _finish(drive(fresh_spec, twin.address, twin.env()), fresh_spec)
        ended = time.time()
        while twin.worker_nodes() and time.time() - ended < idle_timeout_s + 120:
            time.sleep(0.5)
        released = time.time() - ended
        with open(spec["result"] + ".log") as f:
            waits = [line.strip() for line in f if line.startswith("waiting for workers")]
        return {"request_to_first_step_s": steps[0][0] - start,
                "fresh_to_first_step_s": _marks(fresh_spec["marks"])[0][0] - fresh_start,
                "loss_to_first_step_s": after[0][0] - lost_at, "resumed_at_step": after[0][2] - 1,
                "idle_to_released_s": released, "released": not twin.worker_nodes(), "waits": waits,
                "steps": (result["global_step"], fresh["global_step"])}
    finally:
        twin.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--idle-timeout-s", type=float, default=15)
    p.add_argument("--health-checks", default="cluster.yaml,default",
                   help="each measured in turn: cluster.yaml (its head's settings), default (Ray's)")
    a = p.parse_args()
    settings = a.health_checks.split(",")
    if set(settings) - {"cluster.yaml", "default"}:
        p.error(f"--health-checks: cluster.yaml or default, got {a.health_checks}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores")
    for checks in settings:
        load = os.getloadavg()[0]
        r = bench(a.idle_timeout_s, checks)
        print(f"{checks} health checks (load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end):")
        for line in r["waits"]:
            print(f"  driver: {line}")
        print(f"  request -> first step: {r['request_to_first_step_s']:.1f} s from zero worker nodes, against "
              f"{r['fresh_to_first_step_s']:.1f} s on nodes already up")
        print(f"  loss -> resumed step: {r['loss_to_first_step_s']:.1f} s (rank 1's node killed after step 8, "
              f"resumed at step {r['resumed_at_step']}, a new node launched)")
        print(f"  idle -> released: {r['idle_to_released_s']:.1f} s with idle_timeout {a.idle_timeout_s:g} s "
              f"({'all released' if r['released'] else 'NOT all released'})", flush=True)


if __name__ == "__main__":
    main()
