"""Recovery on a cluster as Ray starts it: Ray's default health checks (no RAY_health_check_* set), so the
GCS lists a lost node alive for ~15 s after the workers left have noticed the loss.

The simulated cluster of tests/driver/cluster.py (a head and two worker nodes, each its own disk), started
with Ray's defaults, serves one elastic run: num_workers [1, 2], rank 1's node lost after step 12 and
none replacing it. The default suite covers the same path on its own Ray cluster, more cheaply
(test_elastic.py: the nodes whose workers do not answer are left out of the restart and of its placement).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.driver.cluster import IdDigits, IdLog, SimCluster, trained_ids

pytestmark = [pytest.mark.ray, pytest.mark.long, pytest.mark.xdist_group("spot"),
              pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")]
N, STEPS_PER_EPOCH, MAX_STEPS = 256, 8, 20


def _reference(tmp_path) -> tuple[dict, list[float]]:
    """The uninterrupted run, in-process on the global batch (the maths of 2 workers of 16 each)."""
    import numpy as np

    from examples.digits import build_datasets
    from raytrain import Trainer
    from tests.strategies._helpers import digits_args

    train = {**{k: v[:N] for k, v in build_datasets()[0].items()}, "idx": np.arange(N)}
    ids = tmp_path / "ref-ids"
    ids.mkdir()
    trainer = Trainer(IdDigits(), digits_args(str(tmp_path / "ref"), max_steps=MAX_STEPS, logging_steps=1, save_steps=5,
                                              per_device_train_batch_size=32, scaling={"num_workers": 1}),
                      train_dataset=train, callbacks=[IdLog(str(ids))])
    trainer.train()
    return trained_ids(str(ids)), [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.timeout(900)
def test_elastic_run_goes_on_at_once_after_a_node_loss_on_rays_default_health_checks(tmp_path, record_property):
    """The first restart is sized on the node left (the lost node's worker does not answer; the GCS still
    lists the node), so its one-worker group is placed at once: no group waits for a placement that
    never comes (Ray Train's 60 s group-start timeout; 74 s from the loss before). Every sample of each
    epoch is trained once, each step on the uninterrupted run's samples; the seconds from the loss to the
    first step on the worker left are recorded (timings decide nothing here)."""
    reference, reference_losses = _reference(tmp_path)
    sim = SimCluster(health_checks="default")
    assert not any(k.startswith("RAY_health_check") for k in sim.env())
    try:
        sim.start_head()
        sim.add_node("a")
        sim.add_node("b")
        flag, ids, marks = (os.path.join(sim.storage, name) for name in ("lose", "ids", "marks"))
        os.makedirs(ids)
        loss = {}  # when the node was lost; when the GCS listed it dead (Ray's default: ~15 s)

        def during(sim, proc):
            ns = sim.paused(flag, proc)
            loss["at"] = time.time()
            sim.lose(ns, wait=False)
            while proc.poll() is None and time.time() < loss["at"] + 600:
                if "dead" not in loss and sim.alive_nodes() == 2:
                    loss["dead"] = time.time() - loss["at"]
                time.sleep(2)

        run = sim.run("elastic", os.path.join(sim.local, "elastic"), os.path.join(sim.storage, "elastic"),
                      during=during, max_steps=MAX_STEPS, max_failures=1, elastic=True, ids=ids, marks=marks,
                      pause={"rank": 1, "step": 12, "flag": flag})
        lost_at, listed_dead = loss["at"], loss.get("dead")
        with open(marks) as f:
            after = [m for m in map(json.loads, f) if m[0] > lost_at]
        steps = trained_ids(ids)
    finally:
        sim.close()

    seconds = after[0][0] - lost_at
    record_property("loss_to_first_step_s", round(seconds, 1))
    record_property("gcs_listed_dead_s", listed_dead and round(listed_dead, 1))
    print(f"loss -> first step on the worker left: {seconds:.1f} s (the GCS listed the node dead after "
          f"{listed_dead and round(listed_dead, 1)} s)")
    # Two groups: 2 workers, then 1 from checkpoint-10 (the first restart sized on the node left), each
    # placed at once: no start waited for a placement that never came.
    assert sorted(run["placement_groups"], key=lambda g: -g["bundles"]) == [
        {"bundles": 2, "placed": True}, {"bundles": 1, "placed": True}], run["placement_groups"]
    assert after[0][2] == 11 and run["global_step"] == MAX_STEPS

    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert [(steps[s]["start"], steps[s]["world"]) for s in sorted(steps)] == [(0, 2)] * 10 + [(10, 1)] * 10
    assert all(len(steps[s]["batches"]) == 2 and all(len(b) == 16 for b in steps[s]["batches"]) for s in steps)
    for epoch in range(MAX_STEPS // STEPS_PER_EPOCH):  # every sample once, the interrupted epoch included
        ids_of = [i for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
                  for b in steps[s]["batches"] for i in b]
        assert sorted(ids_of) == list(range(N)), f"epoch {epoch}"
    for s in steps:
        assert sorted(i for b in steps[s]["batches"] for i in b) == sorted(
            i for b in reference[s]["batches"] for i in b), s
    losses = [h["loss"] for h in run["logs"]]
    assert losses[:10] == pytest.approx(reference_losses[:10], rel=1e-5)
    assert losses == pytest.approx(reference_losses, rel=1e-4)
