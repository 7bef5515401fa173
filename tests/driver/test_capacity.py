"""A `scaling` request the cluster can never satisfy is refused at start, in one line naming the field, what
it asks and what the cluster offers; no TorchTrainer is started. Where the autoscaler's limits are unknown
nothing is refused (the run waits)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raytrain.config.sections import ConfigError, ScalingConfig
from raytrain.driver.capacity import Cluster, NodeType, _from_autoscaler_yaml, check_capacity, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAD = {"CPU": 0, "memory": 8 * 2**30, "node:__internal_head__": 1}
CPU2 = {"CPU": 2, "memory": 8 * 2**30}
GPU_TYPE = NodeType("gpu_spot", {"CPU": 8, "GPU": 1, "memory": 32 * 2**30}, 8)


def _refusal(cluster, **scaling):
    return refusal(ScalingConfig(**scaling), cluster)


def test_more_workers_than_a_cluster_without_autoscaler_holds():
    line = _refusal(Cluster([CPU2], []), num_workers=6)
    assert line == ("scaling.num_workers: asks 6 workers of {CPU: 1}, but the cluster holds at most 2 "
                    "(1 node(s) up, no autoscaler)")
    assert _refusal(Cluster([CPU2], []), num_workers=2) is None


def test_an_elastic_range_needs_only_its_minimum():
    assert _refusal(Cluster([CPU2], []), num_workers=[1, 6]) is None
    assert _refusal(Cluster([CPU2], []), num_workers=[3, 6]).startswith(
        "scaling.num_workers: [3, 6] needs at least 3 workers of {CPU: 1}, but the cluster holds at most 2")


def test_a_gpu_run_without_gpu_nodes_or_gpu_node_types():
    line = _refusal(Cluster([HEAD, CPU2], [NodeType("cpu", {"CPU": 4}, 4)], 8), use_gpu=True)
    assert line.startswith("scaling.use_gpu: asks 1 GPU per worker, but the cluster has no GPU node and its "
                           "autoscaler no GPU node type")
    assert _refusal(Cluster([HEAD], [GPU_TYPE], 8), use_gpu=True) is None


def test_a_worker_bigger_than_any_node_or_node_type():
    line = _refusal(Cluster([HEAD], [GPU_TYPE], 8), resources_per_worker={"CPU": 16, "GPU": 1})
    assert line == ("scaling.resources_per_worker: each worker asks {CPU: 16}, but no node or node type offers "
                    "that: the most is {CPU: 8} (1 node(s) up, autoscaler node types gpu_spot)")
    line = _refusal(Cluster([HEAD, CPU2], []), resources_per_worker={"CPU": 1, "memory": 16 * 2**30})
    assert line.startswith("scaling.resources_per_worker: each worker asks {memory: 16.0 GiB}, but no node offers")


def test_the_autoscalers_limits_count():
    cluster = Cluster([HEAD], [GPU_TYPE, NodeType("gpu_spot_4x", {"CPU": 48, "GPU": 4}, 2)], 8)
    assert _refusal(cluster, num_workers=14, use_gpu=True) is None  # 2 x 4 GPUs + 6 x 1
    line = _refusal(cluster, num_workers=15, use_gpu=True)
    assert "asks 15 workers of {CPU: 1, GPU: 1}, but the cluster holds at most 14" in line
    assert line.endswith("at most 8 worker nodes)")
    assert "STRICT_SPREAD" in _refusal(cluster, num_workers=9, use_gpu=True, placement_strategy="STRICT_SPREAD")
    assert _refusal(cluster, num_workers=5, use_gpu=True, placement_strategy="STRICT_PACK").endswith(
        "at most 8 worker nodes)")


def test_unknown_autoscaler_limits_refuse_nothing():
    assert _refusal(Cluster([HEAD], None), num_workers=1000, use_gpu=True) is None
    yaml_types = {"head_node_type": "head", "max_workers": 8, "available_node_types": {
        "head": {"resources": {"CPU": 0}}, "gpu": {"resources": {}, "max_workers": 8}}}
    assert _from_autoscaler_yaml([HEAD], yaml_types, "x.yaml").types is None  # resources detected at launch


def test_cluster_yaml_shape_read_from_an_autoscaling_config():
    config = {"head_node_type": "ray.head.default", "max_workers": 3, "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 0}, "max_workers": 0},
        "ray.worker.cpu": {"resources": {"CPU": 1}, "min_workers": 0, "max_workers": 3}}}
    cluster = _from_autoscaler_yaml([HEAD], config, "fake.yaml")
    assert _refusal(cluster, num_workers=3) is None
    assert "holds at most 3" in _refusal(cluster, num_workers=4)


@pytest.mark.ray
def test_the_session_cluster_is_read_from_its_monitor(ray_cluster):
    with pytest.raises(ConfigError, match=r"^scaling.num_workers: asks 6 workers of \{CPU: 1\}, but the cluster "
                                          r"holds at most 4 \(1 node\(s\) up, no autoscaler\)$"):
        check_capacity(ScalingConfig(num_workers=6))
    check_capacity(ScalingConfig(num_workers=2))


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_the_cli_refuses_in_one_line_before_any_work(ray_cluster, tmp_path):
    # on the session's cluster (RAY_ADDRESS, as under `ray job submit`): the refusal needs no cluster of its own
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run([sys.executable, "-m", "raytrain.run", "--config", "examples/digits.yaml",
                          "--set", "scaling.num_workers=64", "--set", f"output_dir={tmp_path}/out"],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 2, out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: scaling.num_workers: asks 64 workers of {CPU: 1}, "
                                                   "but the cluster holds at most "), lines
    assert "Traceback" not in out.stderr
