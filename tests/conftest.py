"""Shared fixtures. One local Ray cluster serves every Ray test of the session (start-up dominates)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # examples/ is imported by import strings ("examples.digits:build_model")
    sys.path.insert(0, ROOT)

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every Ray cluster the tests start (this process's and the CLI runs'): Ray's log monitor globs the logs
# folder every 0.5 s instead of every 0.1 s, and the dashboard agent samples its processes once a
# minute instead of every 5 s. Nothing reads either here; on 2 cores they cost 1-2% of a core per cluster.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# Ray Train's controller polls its workers every 0.5 s instead of every 2 s (every cluster the tests start:
# raylets pass it to the controllers they run). A worker's report waits in a queue of one until the next
# poll, and the end of a run or a worker's failure is seen at one: 2 s polls cost a digits run on 2 workers
# 5-6 s here (its three saves' reports held, its end seen late), 0.5 s polls about 1 s.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the whole session: 4 logical CPUs on this 2-core machine so that
    a 2-worker TorchTrainer and its controller fit. Off, to spare CPU on 2 cores (together 8% of a Ray
    Train run's CPU here): the dashboard; Ray's idle-worker prestart; Ray Train's preemption watcher
    actor (no test drains a node of this cluster: a notice is simulated, PreemptionNotice)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 _system_config={"enable_worker_prestart": False},
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu",
                                           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": os.environ.get(
                                               "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")}})
    yield ray
    ray.shutdown()


#: MULTIPROCESS: the xdist group "worker_group" also holds the 4-process gloo launches (test_tp/test_pp's gloo4,
#: test_sp's): one pytest process runs them and the worker group one after the other. Side by side on 2 cores they
#: cost more than in turn (the worker group's tests beside test_pp/test_tp: 224 s; one after the other: 204 s; 2-core VM, quiet, 3 Dec).
#:
#: The test files whose trainers run in the session's one Ray Train worker group (`worker_group`), in this order
#: (each part starts without the checkpoints the one before reported: tests/group.py). They share the xdist group
#: "worker_group".
WORKER_GROUP = ["strategies/test_backends.py", "hf/test_peft_on_ray.py", "hf/test_trl_on_ray.py", "hf/test_moe_loss.py",
                "hf/test_seq2seq.py", "hf/test_hf_on_ray.py", "hf/test_async_grpo_on_ray.py",
                "hf/test_grpo_backends_on_ray.py"]


@pytest.fixture(scope="session")
def worker_group(request, ray_cluster, tmp_path_factory):
    """One TorchTrainer of 2 workers for the session (a group start costs ~30 s here): each collected file of
    WORKER_GROUP whose tests use it gives `group_part(root) -> (worker function "module:name", its config)`; the
    parts run one after the other on the same workers. {file: (its root, rank 0's return value)}: tests/group.part."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tests.group import key, run_parts

    modules = {key(item.module.__file__): item.module for item in request.session.items
               if "worker_group" in item.fixturenames}
    unlisted = sorted(set(modules) - set(WORKER_GROUP))
    assert not unlisted, f"add {unlisted} to WORKER_GROUP in tests/conftest.py (the parts' order)"
    root = tmp_path_factory.mktemp("worker_group")
    roots = {name: root / os.path.basename(name)[:-3] for name in WORKER_GROUP if name in modules}
    parts = {name: modules[name].group_part(where) for name, where in roots.items()}
    group = TorchTrainer(run_parts, train_loop_config={"parts": parts}, scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="worker_group", storage_path=str(root / "ray")))
    values = group.fit().return_value
    return {name: (where, values[name]) for name, where in roots.items()}


@pytest.fixture
def digits():
    from examples.digits import build_datasets
    return build_datasets()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run fastest on one intra-op thread (no spinning on a busy 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: The long fault runs (marked `long`) run only when asked: tests/README.md lists them and the default test
#: that covers the same path more cheaply.
LONG = bool(os.environ.get("RAYTRAIN_LONG_TESTS") or os.environ.get("RAYTRAIN_MULTINODE_TESTS"))


def pytest_collection_modifyitems(config, items):
    if not LONG:
        skip = pytest.mark.skip(reason="a long fault run (minutes), its path covered by a default test: "
                                       "set RAYTRAIN_LONG_TESTS=1")
        for item in items:
            if item.get_closest_marker("long"):
                item.add_marker(skip)
    _ray_first(items)


def _ray_first(items):
    """Ray tests first (a stable sort): under pytest-xdist the long ones start early and the quick
    in-process tests fill both workers at the end, instead of one Ray test running on alone."""
    def slow(item) -> bool:
        return item.get_closest_marker("ray") is not None or "ray_cluster" in getattr(item, "fixturenames", ())

    def budget(item) -> float:  # a test's own timeout marks it as one of the longest
        marker = item.get_closest_marker("timeout")
        return float(marker.args[0]) if marker and marker.args else 0.0

    items.sort(key=lambda item: (not (slow(item) or budget(item)), -budget(item)))
