"""Elastic workers (scaling.num_workers: [min, max]): the batch arithmetic that keeps the global batch at
every world size, its refusals, and one Ray run whose group shrinks 2 -> 1 and grows back 1 -> 2.

How the Ray run is resized on one node: Ray's elastic policy counts the workers that fit in what Ray's
autoscaling coordinator reserves for the run, and the coordinator counts nodes' total resources, not
what is free, so an actor holding CPUs changes nothing. A request of 3 CPUs to that coordinator,
registered before the run's own (same priority: the earlier is served first), leaves the run room for
one worker: Ray's policy resizes the group 2 -> 1 at its next check (scaling.resize_interval_s=1), and
back to 2 once the request is emptied. No worker is killed: a resize is Ray's own restart."""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

from raytrain import ConfigError, Trainer, TrainerCallback, TrainingArguments
from raytrain.config.sections import ScalingConfig
from tests.driver.cluster import IdDigits

# ---------------------------------------------------------------- the batch arithmetic (in-process)


@pytest.mark.parametrize("workers, per_device, accum, world, expected", [
    ((1, 2), 32, 1, 1, (32, 2)),      # the accumulation takes up the missing worker
    ((1, 2), 32, 1, 2, (32, 1)),      # the largest group: as configured
    ((1, 4), 8, 1, 2, (8, 2)),
    ((2, 3), 4, 1, 2, (6, 1)),        # 12 = 4 x 2 x ? does not divide: the per-device batch does (6 x 2 x 1)
    ((2, 3), 3, 2, 2, (3, 3)),        # 18 = 3 x 2 x 3
    ((2, 4), 8, 1, 3, None),          # 32 over 3 workers: neither divides
])
def test_batch_at_keeps_the_global_batch(workers, per_device, accum, world, expected):
    scaling = ScalingConfig(num_workers=list(workers))
    fit = scaling.batch_at(world, per_device, accum)
    assert fit == expected
    if fit is not None:
        assert fit[0] * world * fit[1] == per_device * workers[1] * accum


def test_num_workers_takes_an_int_or_a_range():
    args = TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": [1, 2]}, per_device_train_batch_size=32)
    scaling = args.scaling
    assert (scaling.min_workers, scaling.num_workers, scaling.elastic) == (1, 2, True)
    # What every `num_workers > 1` check reads is the largest group; the range survives a round trip.
    assert TrainingArguments.from_dict({"output_dir": "/tmp/x", "scaling": args.to_dict()["scaling"]}).scaling == scaling
    fixed = TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": 2}).scaling
    assert (fixed.min_workers, fixed.num_workers, fixed.elastic) == (None, 2, False)
    assert not TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": [2, 2]}).scaling.elastic


def test_cli_set_takes_a_range(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("output_dir: out\nper_device_train_batch_size: 16\n")
    args = TrainingArguments.from_yaml(config, ["scaling.num_workers=[1,2]", "scaling.resize_interval_s=5"])
    assert (args.scaling.min_workers, args.scaling.num_workers, args.scaling.resize_interval_s) == (1, 2, 5.0)


@pytest.mark.parametrize("value", [[2, 1], [0, 2], [1, 2, 3], [1.5, 2], "two", True])
def test_bad_ranges_are_one_line_naming_the_field(value):
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": value})
    assert str(e.value) == ("scaling.num_workers: expected an integer >= 1 or [min, max] with 1 <= min <= max, "
                            f"got {value!r}")
    with pytest.raises(ConfigError, match=r"^scaling.num_workers: \[min, max\] needs 1 <= min <= max, got \[3, 2\]$"):
        TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": 2, "min_workers": 3})


def test_a_range_that_cannot_keep_the_global_batch_is_refused_at_start():
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": [2, 4]}, per_device_train_batch_size=8)
    msg = str(e.value)
    assert msg.startswith("scaling.num_workers: [2, 4] cannot keep the global batch of 32") and "\n" not in msg
    assert "at 3 worker(s)" in msg
    # The same range with a global batch that 2, 3 and 4 workers all divide is accepted.
    TrainingArguments(output_dir="/tmp/x", scaling={"num_workers": [2, 4]}, per_device_train_batch_size=6)


def test_scaling_config_for_ray():
    from raytrain.driver.torch_trainer import scaling_config

    elastic = scaling_config(ScalingConfig(num_workers=[1, 2], resize_interval_s=3))
    assert elastic.num_workers == (1, 2) and elastic.elasticity_enabled
    assert elastic.elastic_resize_monitor_interval_s == 3
    fixed = scaling_config(ScalingConfig(num_workers=2))
    assert fixed.num_workers == 2 and not fixed.elasticity_enabled


def test_one_worker_of_two_accumulates_the_same_global_batch(tmp_path, caplog):
    """A [1, 2] group started with 1 worker: per-device 32 with accumulation 2, the same weights as one
    process on batches of 64 (equal up to float summation order), and the one log line."""
    from examples.digits import DigitsMLP, build_datasets
    from raytrain.strategies import SingleProcessStrategy
    from raytrain.worker import elastic, loop

    train = {k: v[:640] for k, v in build_datasets()[0].items()}
    torch.manual_seed(0)
    init = DigitsMLP(hidden_size=32, dropout=0.0)
    base = dict(max_steps=10, optim="sgd", learning_rate=0.2, save_strategy="no", disable_tqdm=True, report_to="none", seed=0)
    one = TrainingArguments(output_dir=str(tmp_path / "one"), per_device_train_batch_size=64,
                            scaling={"num_workers": 1}, **base)
    ref = Trainer(copy.deepcopy(init), one, train_dataset=train)
    ref.train()
    args = TrainingArguments(output_dir=str(tmp_path / "el"), per_device_train_batch_size=32,
                             scaling={"num_workers": [1, 2]}, **base)
    trainer = Trainer(copy.deepcopy(init), args, train_dataset=train)
    trainer.set_strategy(SingleProcessStrategy(args))  # the one worker of the group (no Ray here)
    with caplog.at_level(logging.WARNING, logger="raytrain"):
        out = loop.train(trainer)
    assert out.global_step == 10
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (32, 2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("world size")]
    assert lines == ["world size 2 -> 1: gradient_accumulation_steps 1 -> 2 (global batch 64 kept)"]
    assert elastic.fit_batch(args, 1)["gradient_accumulation_steps"] == 1  # from the configured values again
    assert args.gradient_accumulation_steps == 2
    for name, value in ref.model.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(trainer.model.state_dict()["head.weight"], init.state_dict()["head.weight"])


# ---------------------------------------------------------------- one Ray run: 2 -> 1 -> 2

N, STEPS_PER_EPOCH, MAX_STEPS = 256, 8, 24  # a global batch of 32: 8 steps an epoch, 3 epochs
PAUSES = {(12, 2): "paused-12", (20, 1): "paused-20"}  # (global_step, world size): the marker written


class ElasticProbe(TrainerCallback):
    """Each rank appends (world size, step, its micro-batches' ids) to ids-rank{R}.jsonl; at a step of
    PAUSES it writes the marker and waits for Ray to end the group (the test's resize). Unpickled on a
    worker, it sends raytrain's warnings to output_dir/worker.log (the workers' logs stay on the workers)."""

    def __init__(self, output_dir: str, pauses: dict | None = None):
        self.output_dir, self.pauses = output_dir, pauses or {}

    def __setstate__(self, state):
        self.__dict__.update(state)
        os.makedirs(self.output_dir, exist_ok=True)
        handler = logging.FileHandler(os.path.join(self.output_dir, "worker.log"))
        handler.setLevel(logging.WARNING)
        logging.getLogger("raytrain").addHandler(handler)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.done = 0
        if _rank() == 0:
            with open(os.path.join(args.output_dir, "starts.jsonl"), "a") as f:
                f.write(json.dumps({"step": state.global_step, "world": _world(), "t": time.time()}) + "\n")

    def on_step_begin(self, args, state, control, **kwargs):
        marker = self.pauses.get((state.global_step, _world()))
        path = os.path.join(args.output_dir, marker or "")
        if marker and not os.path.exists(path + f"-rank{_rank()}"):
            open(path + f"-rank{_rank()}", "w").close()
            if _rank() == 0:
                open(path, "w").close()
            time.sleep(240)  # the resize ends this group before (on a loaded 2-core machine it once took over 90 s)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        module = getattr(model, "module", model)
        record = {"world": _world(), "step": state.global_step, "ids": module.seen[self.done:]}
        self.done = len(module.seen)
        with open(os.path.join(args.output_dir, f"ids-rank{_rank()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def _wait_for(path, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def _resizer(out_dir, errors: list):
    """Takes 3 of the cluster's 4 CPUs from the training run once it pauses at step 12 (a request to Ray's
    autoscaling coordinator that came before the run's own, so it is served first: the run is left room for
    one worker, and the group is resized to 1), and gives them back at step 20 (resized to 2)."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        ResourceRequestPriority, get_or_create_autoscaling_coordinator)

    coordinator = get_or_create_autoscaling_coordinator()

    def request(bundles):
        ray.get(coordinator.request_resources.remote(requester_id="raytrain-test-elastic", resources=bundles,
                                                     expire_after_s=300, priority=ResourceRequestPriority.HIGH))

    request([])  # registered before the run's request: this one's bundles are reserved first

    def run():
        try:
            for marker, bundles in (("paused-12", [{"CPU": 1}] * 3), ("paused-20", [])):
                if not _wait_for(out_dir / marker, 300):
                    errors.append(f"no {marker}")
                    return
                request(bundles)
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(repr(e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return coordinator, thread


def _steps(out_dir) -> dict[int, dict]:
    """step -> {"world": w, "batches": [ids of each micro-batch of every rank]}"""
    steps: dict[int, dict] = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("ids-rank"):
            for line in open(out_dir / name):
                rec = json.loads(line)
                step = steps.setdefault(rec["step"], {"world": rec["world"], "batches": []})
                assert step["world"] == rec["world"], f"step {rec['step']} trained twice"
                step["batches"] += rec["ids"]
    return steps


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_group_shrinks_to_one_and_grows_back(ray_cluster, tmp_path):
    import cloudpickle

    from examples.digits import build_datasets
    from tests.strategies._helpers import digits_args

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this module is no importable name on workers
    train = {k: v[:N] for k, v in build_datasets()[0].items()}
    train["idx"] = np.arange(N)
    # SGD: Adam's update of a near-zero gradient turns float summation order into visible differences.
    common = dict(max_steps=MAX_STEPS, save_steps=4, logging_steps=4, optim="sgd", learning_rate=0.2)

    # The uninterrupted run: in-process on the global batch, the same maths as 2 workers of 16 each
    # (test_launch.py) without a second TorchTrainer start (30 s to minutes on a busy 2-core machine).
    ref_dir = tmp_path / "ref"
    reference = Trainer(IdDigits(), digits_args(str(ref_dir), per_device_train_batch_size=32,
                                                scaling={"num_workers": 1}, **common),
                        train_dataset=train, callbacks=[ElasticProbe(str(ref_dir))])
    reference.train()

    out_dir = tmp_path / "el"
    out_dir.mkdir()
    args = digits_args(str(out_dir), str(tmp_path / "ray"), scaling={"num_workers": [1, 2], "resize_interval_s": 1},
                       **common)
    errors: list = []
    t0 = time.time()
    coordinator, thread = _resizer(out_dir, errors)
    try:
        trainer = Trainer(IdDigits(), args, train_dataset=train, callbacks=[ElasticProbe(str(out_dir), PAUSES)])
        out = trainer.train()
    finally:
        import ray

        ray.get(coordinator.cancel_request.remote("raytrain-test-elastic"))
    thread.join(5)
    starts = [json.loads(line) for line in open(out_dir / "starts.jsonl")]
    timeline = [(t["step"], t["world"], round(t["t"] - t0, 1)) for t in starts]  # shown if it fails
    assert not errors, (errors, timeline)
    assert [(t["step"], t["world"]) for t in starts] == [(0, 2), (12, 1), (20, 2)], timeline
    assert out.global_step == MAX_STEPS and trainer.state.global_step == MAX_STEPS

    # 12 steps on 2 workers, 8 on 1 (accumulating 2 micro-batches of 16), the last 4 on 2 again.
    steps = _steps(out_dir)
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert [steps[s]["world"] for s in sorted(steps)] == [2] * 12 + [1] * 8 + [2] * 4
    assert all(len(steps[s]["batches"]) == 2 and all(len(b) == 16 for b in steps[s]["batches"]) for s in steps)
    log = (out_dir / "worker.log").read_text()
    assert "world size 2 -> 1: gradient_accumulation_steps 1 -> 2 (global batch 32 kept)" in log
    assert "world size 1 -> 2: gradient_accumulation_steps 2 -> 1 (global batch 32 kept)" in log

    # Every sample of each epoch exactly once, the interrupted ones included, and each step the same
    # samples as the uninterrupted run's.
    for epoch in range(MAX_STEPS // STEPS_PER_EPOCH):
        ids = [i for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
               for b in steps[s]["batches"] for i in b]
        assert sorted(ids) == list(range(N)), f"epoch {epoch}"
    ref_steps = _steps(ref_dir)
    for s in steps:
        assert sorted(i for b in steps[s]["batches"] for i in b) == sorted(i for b in ref_steps[s]["batches"]
                                                                           for i in b), s
    # The same weights as the uninterrupted run, up to float summation order.
    ref_w = reference.model.state_dict()
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------- the restart after a node loss (the policy)


@pytest.fixture
def actors(ray_cluster):
    """Three actors on this node: one that answers, one killed, one busy for 120 s (silent)."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Worker:
        def busy(self, seconds):
            time.sleep(seconds)

    up, killed, busy = Worker.remote(), Worker.remote(), Worker.remote()
    ray.get([a.__ray_ready__.remote() for a in (up, killed, busy)])
    ray.kill(killed)
    busy.busy.remote(120)  # its liveness calls queue behind it
    yield up, killed, busy
    for actor in (up, busy):
        ray.kill(actor)


class _Unavailable:
    """An actor handle whose liveness call fails as one on a lost node does (connection refused)."""

    def __init__(self, ray):
        @ray.remote(num_cpus=0)
        def refused():
            raise ray.exceptions.ActorUnavailableError("RpcError: Connection refused", None)

        self.ref = refused.remote()
        ray.wait([self.ref], timeout=60)  # failed already: the ping's answer is there at once
        self.__ray_ready__ = types.SimpleNamespace(remote=lambda: self.ref)


def _policy(monkeypatch, reserved: dict):
    """The policy of a [1, 2] group of {CPU: 1} workers, Ray's coordinator replaced by `reserved`."""
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    from raytrain.driver.elastic import FreshViewElasticPolicy
    from raytrain.driver.torch_trainer import scaling_config

    monkeypatch.setattr(ElasticScalingPolicy, "_maybe_send_resource_request", lambda self: None)
    monkeypatch.setattr(ElasticScalingPolicy, "_get_reserved_resources", lambda self: dict(reserved))
    policy = FreshViewElasticPolicy(scaling_config(ScalingConfig(num_workers=[1, 2])))
    monkeypatch.setattr(policy, "_fresh_reserved", lambda: dict(reserved))
    return policy


@pytest.mark.ray
def test_nodes_whose_workers_do_not_answer_are_the_ones_left_out(ray_cluster, actors):
    """A node is left out when none of its workers answers Ray's liveness call and one is unreachable or
    silent; a worker that died on a node that is up (ActorDiedError) does not leave its node out."""
    from raytrain.driver.elastic import unreachable_nodes

    up, killed, busy = actors
    workers = [(up, "answers"), (killed, "died"), (busy, "silent"), (_Unavailable(ray_cluster), "unreachable"),
               (busy, "one answers"), (up, "one answers")]
    assert unreachable_nodes(workers, timeout_s=1.0) == {"silent", "unreachable"}
    assert unreachable_nodes([]) == set()


@pytest.mark.ray
def test_a_restart_is_sized_without_the_nodes_left_out_until_the_gcs_or_a_task_says(ray_cluster, actors,
                                                                                     monkeypatch, caplog):
    """The group that ran on this node and a lost one fails; its worker here is silent: the restart counts
    neither node (no decision: below min_workers), kills that worker, and would place the group off this
    node; a task run here brings the node back (a [1, 2] group of 2 then); the lost node, dead to the
    GCS, is never counted again, whatever the coordinator's older view says."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.util.placement_group import placement_group, remove_placement_group

    ray = ray_cluster
    here, lost = ray.get_runtime_context().get_node_id(), "ab" * 28  # a node the GCS does not list
    up, _, busy = actors
    policy = _policy(monkeypatch, {here: {"CPU": 2}, lost: {"CPU": 1}})

    class Group:  # what Ray Train passes: the workers with their nodes (started now: no resize check)
        workers = [types.SimpleNamespace(actor=busy, metadata=types.SimpleNamespace(node_id=here))]
        start_time = time.monotonic()

    policy.make_decision_for_running_worker_group(Group, None)  # a healthy poll records the workers
    policy.suspects[lost] = None  # left out earlier; the GCS does not list it
    with caplog.at_level(logging.WARNING, logger="raytrain.driver.elastic"):
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    assert set(policy.suspects) == {here} and policy.gone == {lost}
    assert [r.getMessage() for r in caplog.records] == [
        f"node {here[:8]}: the workers it ran do not answer; the restart does not count it (the GCS lists it "
        "alive until its health checks fail)"]
    with pytest.raises(ray.exceptions.RayActorError):  # killed: Ray Train's shutdown does not wait on it
        ray.get(busy.__ray_ready__.remote(), timeout=30)

    # The next group's placement leaves this node out: Ray cannot place it on the one node there is.
    selector = policy.on_controller_start_worker_group(scaling_config=None, num_workers=1)
    assert selector == {"ray.io/node-id": f"!{here}"}
    off, on = placement_group([{"CPU": 1}], bundle_label_selector=[selector]), placement_group([{"CPU": 1}])
    try:
        assert on.wait(30) and not off.wait(1)
    finally:
        remove_placement_group(off)
        remove_placement_group(on)

    # The probe task sent to this node runs: counted again, the lost node not.
    deadline = time.monotonic() + 60
    decision = policy.make_decision_for_non_running_worker_group()
    while isinstance(decision, NoopDecision) and time.monotonic() < deadline:
        time.sleep(0.5)
        decision = policy.make_decision_for_non_running_worker_group()
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 2
    assert not policy.suspects and policy.gone == {lost}
    assert policy.on_controller_start_worker_group(scaling_config=None, num_workers=2) is None
    assert policy._get_reserved_resources() == {here: {"CPU": 2}}
    policy.leave_out({"cd" * 28})  # a node the GCS does not list alive is not left out: it is gone already
    assert not policy.suspects
