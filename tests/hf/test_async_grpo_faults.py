"""AsyncGRPOTrainer's long fault runs (opt-in, tests/README.md): a Ray Train worker SIGKILLed mid-run, and the
rollout actors' node lost until a new node joins (the pool grows back; the wait is said)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.hf import async_grpo_jobs as jobs
from tests.hf.test_async_grpo import reference  # noqa: F401  (the local run)

pytest.importorskip("trl")
pytestmark = [pytest.mark.ray, pytest.mark.long, pytest.mark.xdist_group("async_grpo_on_ray")]


@pytest.mark.timeout(1200)
def test_a_trainer_worker_sigkilled_resumes_to_the_uninterrupted_run(ray_cluster, reference, tmp_path):  # noqa: F811
    """2 Ray Train workers (DDP) with 2 rollout actors; rank 1 SIGKILLed after step 6: Ray restarts the group
    (its actors die with rank 0), which resumes from checkpoint-4 with its saved groups and ends as the
    uninterrupted run, bit for bit (and one process's within 1e-5)."""
    runs = {}
    for name, callbacks in (("plain", []), ("killed", [jobs.KillOnce(1, 6, str(tmp_path / "killed.flag"))])):
        t = jobs.trainer(str(tmp_path / name), workers=2, per_device_train_batch_size=2, callbacks=callbacks,
                         scaling={"num_workers": 2, "max_failures": 1}, save_strategy="steps", save_steps=4)
        t.train()
        runs[name] = t
    assert os.path.exists(tmp_path / "killed.flag")
    assert jobs.steps(runs["killed"]) == jobs.steps(runs["plain"])
    a, b = jobs.weights(runs["killed"].model), jobs.weights(runs["plain"].model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for got, want in zip(jobs.steps(runs["killed"]), reference["steps"]):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)


@pytest.mark.timeout(1200)
def test_the_actors_node_lost_then_a_new_node_the_pool_grows_back(reference, tmp_path):  # noqa: F811
    """The rollout actors live on a `spot` node, lost after step 4: the trainer waits, saying how many actors are up
    and what the cluster has free; a new node joins, Ray restarts the actors there, the lost groups are generated
    again, and the run ends as the no-fault run, bit for bit."""
    from tests.driver.cluster import SimCluster

    sim = SimCluster()
    try:
        sim.start_head()
        sim.add_node("a")
        flag, go, result = tmp_path / "paused", tmp_path / "go", tmp_path / "result.pt"
        code = (f"from tests.hf.async_grpo_jobs import on_cluster_main; on_cluster_main({str(tmp_path / 'out')!r}, "
                f"{str(flag)!r}, {str(go)!r}, {str(result)!r})")
        log = open(tmp_path / "driver.log", "wb")
        proc = subprocess.Popen([sys.executable, "-c", code], env={**sim.env(), "OMP_NUM_THREADS": "1"},
                                stdout=log, stderr=subprocess.STDOUT, cwd=jobs.__file__.rsplit("/tests/", 1)[0])
        deadline = time.time() + 400
        while not flag.exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.5)
        sim.lose(sim.nodes["a"][1])
        go.touch()
        waited = time.time() + 25  # the trainer waits for step 5's groups, saying so every 10 s
        while time.time() < waited and b"of 2 rollout actors up" not in (tmp_path / "driver.log").read_bytes():
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(1)
        sim.add_node("b")
        assert proc.wait(600) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        sim.close()
    text = (tmp_path / "driver.log").read_text()
    assert "0 of 2 rollout actors up; Ray starts the others where there is room" in text, text[-3000:]
    assert "rollout actor raytrain-rollout-0 lost" in text or "rollout actor raytrain-rollout-1 lost" in text
    got = torch.load(io.BytesIO(result.read_bytes()), weights_only=True)
    assert got["restarts"] >= 1 and got["steps"] == reference["steps"]
    assert all(torch.equal(got["weights"][k], reference["weights"][k]) for k in reference["weights"])
