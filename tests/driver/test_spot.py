"""Spot clusters without a shared filesystem: every node has its own disk (a node-local output_dir),
scaling.storage_path is storage every node reaches, and a node can be lost with its disk.

One simulated cluster (tests/driver/cluster.py: a head and worker nodes in their own mount namespaces,
each with a private tmpfs at the output_dir's parent) serves the module; each run's driver is a
subprocess. Runs: 20 DDP steps of the digits job on 2 workers (one per node), a checkpoint every 5; the
uninterrupted run, without Ray, on 2 gloo processes.
"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from raytrain.checkpoint import store as ckpt
from tests.driver.cluster import SimCluster, local_run

# One cluster for the module (one xdist worker). By default the refusal and the loss of rank 1's node run, in one
# driver (about 60 s on a quiet machine, the cluster's start included; the uninterrupted run they compare with runs
# on 2 gloo processes, no Ray); the other runs take minutes more: opt-in.
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("spot"),
              pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")]
MORE = pytest.mark.long  # a longer simulated multi-node run (minutes): RAYTRAIN_LONG_TESTS=1


@pytest.fixture(scope="module")
def cluster():
    sim = SimCluster()
    try:
        sim.start_head()
        sim.add_node("a")  # one at a time: nodes joining together race for the head's session
        sim.add_node("b")
        yield sim
    finally:
        sim.close()


def _storage_checkpoints(storage: str) -> list[str]:
    found = glob.glob(os.path.join(storage, "*", "*"))
    return sorted(p for p in found if os.path.isfile(os.path.join(p, ckpt.MANIFEST)))


def _every_rank_in_storage(storage: str, weights: str = ckpt.WEIGHTS) -> None:
    """Each checkpoint in Ray's storage holds every rank's files and verifies against its manifest."""
    found = _storage_checkpoints(storage)
    assert found, os.listdir(storage)
    for path in found:
        manifest = ckpt.verify_checkpoint(path)
        assert {"rng_state_0.pth", "rng_state_1.pth", weights, ckpt.TRAINER_STATE} <= set(manifest["files"])


def _lose_node_at(flag: str, replacement: str | None):
    """Once the paused rank has written `flag` (its mount namespace), lose its node, add another (unless None)."""

    def during(sim, proc):
        sim.lose(sim.paused(flag, proc))
        if replacement is not None:
            sim.add_node(replacement)

    return during


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, on 2 gloo processes of this machine (tests/driver/cluster.py local_run)."""
    return local_run(str(tmp_path_factory.mktemp("spot-reference")))


def _lose_rank(cluster, rank: int, replacement: str, **spec) -> tuple[dict, str]:
    """DDP: the node of `rank` (and its disk) lost after step 12, a new node `replacement` joining; the run, its
    storage."""
    flag = os.path.join(cluster.storage, f"lose-rank{rank}")
    storage = os.path.join(cluster.storage, f"lost{rank}")
    return cluster.run(f"lost{rank}", os.path.join(cluster.local, f"lost{rank}"), storage,
                       during=_lose_node_at(flag, replacement), max_failures=1,
                       pause={"rank": rank, "step": 12, "flag": flag}, **spec), storage


@pytest.fixture(scope="module")
def rank1_lost(cluster):
    """Rank 1's node lost; before that run, in the same driver (a driver's start costs 10-20 s here), the same
    job without storage_path into a node-local output_dir."""
    return _lose_rank(cluster, 1, "c", refused=os.path.join(cluster.local, "refused"))


@pytest.mark.timeout(600)  # the module's cluster starts first
def test_several_nodes_without_storage_path_are_refused_before_any_work(cluster, rank1_lost):
    error = rank1_lost[0]["refused"]
    assert error.startswith("ConfigError: scaling.storage_path is not set") and "\n" not in error
    assert "2 nodes" in error and not os.path.exists(os.path.join(cluster.local, "refused"))  # before any work


@MORE
@pytest.mark.timeout(900)
def test_node_local_output_dir_trains_as_on_a_shared_disk(cluster, reference):
    """Rank 1 writes into a temporary directory on its own node (old code: FileNotFoundError at the
    second checkpoint); Ray merges both ranks' directories in storage; the driver ends with the
    weights, trainer_state.json and final/ in its own output_dir."""
    out_dir = os.path.join(cluster.local, "out")
    storage = os.path.join(cluster.storage, "local")
    run = cluster.run("local", out_dir, storage)
    assert run["global_step"] == 20 and run["digest"] == reference["digest"]
    assert run["logs"] == reference["logs"] and len(run["logs"]) == 20
    assert {"final", "trainer_state.json"} <= set(run["output_dir"])
    _every_rank_in_storage(storage)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("rank", [1, pytest.param(0, marks=MORE)])
def test_losing_a_ranks_node_resumes_from_storage_bit_exact(cluster, reference, rank, request):
    """DDP: the node of `rank` (and its disk) is lost after step 12; a new node with an empty disk joins;
    the restarted group (max_failures) resumes from Ray's checkpoint-10, which holds rank 1's files too
    (old code: "not a checkpoint directory"), and ends bit for bit as the uninterrupted run, with
    trainer_state.json and final/ on the driver's output_dir whichever node rank 0 ran on."""
    run, storage = request.getfixturevalue("rank1_lost") if rank == 1 else _lose_rank(cluster, 0, "h")
    assert run["global_step"] == 20 and run["digest"] == reference["digest"]
    assert run["logs"] == reference["logs"]
    assert {"final", "trainer_state.json"} <= set(run["output_dir"])
    _every_rank_in_storage(storage)


@MORE
@pytest.mark.timeout(1200)
def test_lora_losing_rank_1s_node_resumes_its_adapter_from_storage_bit_exact(cluster):
    """The LoRA job (LoRA dropout on): rank 1's node and disk are lost after step 12; the restarted group
    resumes from the adapter checkpoint in storage and ends bit for bit as the uninterrupted run."""
    shared = os.path.join(cluster.base, "shared", "lora")
    reference = cluster.run("lora_ref", shared, os.path.join(cluster.storage, "lora_ref"), lora=True)
    flag, storage = os.path.join(cluster.storage, "lose-lora"), os.path.join(cluster.storage, "lora_lost")
    run = cluster.run("lora_lost", os.path.join(cluster.local, "lora_lost"), storage, lora=True,
               during=_lose_node_at(flag, "d"), max_failures=1, pause={"rank": 1, "step": 12, "flag": flag})
    assert run["global_step"] == 20 and run["digest"] == reference["digest"]
    assert run["logs"] == reference["logs"]
    _every_rank_in_storage(storage, weights=ckpt.ADAPTER_WEIGHTS)
    assert not any(ckpt.WEIGHTS in os.listdir(p) for p in _storage_checkpoints(storage))


@pytest.fixture(scope="module")
def fsdp_reference(cluster):
    """FSDP2, uninterrupted, its output_dir on a disk every node shares."""
    return cluster.run("fsdp-reference", os.path.join(cluster.base, "shared", "fsdp"),
                os.path.join(cluster.storage, "fsdp-ref"), strategy="fsdp")


@MORE
@pytest.mark.timeout(1200)
def test_fsdp_losing_rank_0s_node_resumes_from_storage(cluster, reference, fsdp_reference):
    """FSDP2: each rank's optimizer shard (dcp/) is on its own node; rank 0's node is lost after step
    12; the restarted group reads both shards from Ray's checkpoint and ends bit for bit as the
    uninterrupted FSDP2 run (and, to float rounding, where the DDP run does: FSDP reduces gradients
    in another order)."""
    flag = os.path.join(cluster.storage, "lose-rank0")
    storage = os.path.join(cluster.storage, "fsdp")
    out_dir = os.path.join(cluster.local, "fsdp")
    run = cluster.run("fsdp", out_dir, storage, during=_lose_node_at(flag, "d"), max_failures=1,
               strategy="fsdp", pause={"rank": 0, "step": 12, "flag": flag})
    assert run["global_step"] == 20
    assert run["digest"] == fsdp_reference["digest"] and run["logs"] == fsdp_reference["logs"]
    assert [h["loss"] for h in run["logs"]] == pytest.approx([h["loss"] for h in reference["logs"]], rel=1e-5)
    _every_rank_in_storage(storage)
    shards = set(os.listdir(os.path.join(_storage_checkpoints(storage)[-1], "dcp")))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= shards


@MORE
@pytest.mark.timeout(1200)
def test_fsdp_losing_rank_1s_node_during_a_background_save(cluster, fsdp_reference):
    """FSDP2 with save_async: each rank's optimizer shard is staged at the step and written by DCP in the
    background; rank 1's node is lost while checkpoint-15 is being written; the group resumes from the
    last checkpoint every rank completed and ends bit for bit as the uninterrupted (synchronous) run."""
    flag = os.path.join(cluster.storage, "lose-rank1-fsdp-saving")
    storage = os.path.join(cluster.storage, "fsdp-saving")
    run = cluster.run("fsdp-saving", os.path.join(cluster.local, "fsdp-saving"), storage,
               during=_lose_node_at(flag, "g"), max_failures=1, strategy="fsdp", save_async=True,
               pause={"rank": 1, "step": 15, "flag": flag, "at": "save"})
    assert run["global_step"] == 20
    assert run["digest"] == fsdp_reference["digest"] and run["logs"] == fsdp_reference["logs"]
    _every_rank_in_storage(storage)


@MORE
@pytest.mark.timeout(900)
def test_losing_rank_1s_node_during_a_save_resumes_from_the_last_complete_checkpoint(cluster, reference):
    """Checkpoints written in the background (save_async): rank 1's node is lost while checkpoint-15 is
    being written and before Ray has checkpoint-10 (Ray gets each checkpoint once every rank's files are
    durable, at the next save); rank 0's disk holds checkpoints the new node's disk cannot complete, so
    the group resumes from Ray's checkpoint-5 and ends bit for bit as the uninterrupted run."""
    flag = os.path.join(cluster.storage, "lose-rank1-saving")
    storage = os.path.join(cluster.storage, "saving")
    run = cluster.run("saving", os.path.join(cluster.local, "saving"), storage, during=_lose_node_at(flag, "e"),
               max_failures=1, save_async=True, pause={"rank": 1, "step": 15, "flag": flag, "at": "save"})
    assert run["global_step"] == 20 and run["digest"] == reference["digest"]
    assert run["logs"] == reference["logs"]
    _every_rank_in_storage(storage)


ZERO3 = {"strategy": "deepspeed", "deepspeed": {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}}


@pytest.fixture(scope="module")
def zero3_reference(cluster):
    """ZeRO-3, uninterrupted, evaluating at every save with the first checkpoint the best."""
    return cluster.run("zero3-reference", os.path.join(cluster.base, "shared", "zero3"),
                os.path.join(cluster.storage, "zero3-ref"), distributed=ZERO3, best=True)


@MORE
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("save_async", [False, True], ids=["synchronous", "background"])
def test_zero3_losing_rank_0s_node_during_a_save_ends_with_the_best_model(cluster, zero3_reference, save_async):
    """ZeRO-3 with load_best_model_at_end: rank 0's node is lost while saving checkpoint-15 (DeepSpeed's
    files written on the training thread, or staged and written by the strategy's thread); rank 0
    restarts on a new node whose disk never held checkpoint-5, the best; the run ends with the same
    logs and the same (best) weights as the uninterrupted ZeRO-3 run. save_total_limit 2 keeps the
    best in Ray's storage too (Ray's num_to_keep alone would keep 15 and 20, and rank 0 could not load it)."""
    assert zero3_reference["best_model_checkpoint"].endswith("checkpoint-5")
    name = "zero3-background" if save_async else "zero3"
    flag = os.path.join(cluster.storage, f"lose-rank0-{name}")
    storage = os.path.join(cluster.storage, name)
    run = cluster.run(name, os.path.join(cluster.local, name), storage,
               during=_lose_node_at(flag, "j" if save_async else "f"), save_async=save_async,
               max_failures=1, distributed=ZERO3, best=True, keep=2,
               pause={"rank": 0, "step": 15, "flag": flag, "at": "save"})
    assert run["global_step"] == 20 and run["logs"] == zero3_reference["logs"]
    assert run["best_model_checkpoint"].endswith("checkpoint-5")
    assert run["digest"] == zero3_reference["digest"]
    _every_rank_in_storage(storage)
    stored = {os.path.relpath(p, storage): ckpt.verify_checkpoint(p)["global_step"] for p in _storage_checkpoints(storage)}
    assert sorted(stored.values()) == [5, 20], stored


@MORE
@pytest.mark.timeout(1200)
def test_elastic_group_shrinks_when_a_node_is_lost_and_grows_when_one_joins(cluster, reference):
    """scaling.num_workers [1, 2]: rank 1's node is lost after step 12 with no replacement; the group
    restarts on the one node left from checkpoint-10, accumulating 2 micro-batches (the global batch of
    32 kept); once it has saved checkpoint-15 a node joins and Ray's resize restarts the group on 2
    workers from it. The run ends at step 20 with the uninterrupted run's losses (to float rounding:
    one rank sums the two micro-batches where two ranks all-reduce them)."""
    flag = os.path.join(cluster.storage, "lose-rank1-elastic")
    worlds = os.path.join(cluster.storage, "elastic-worlds.jsonl")

    def during(sim, proc):
        _lose_node_at(flag, replacement=None)(sim, proc)
        deadline = time.time() + 400
        while not any(json.loads(line)[:2] == [16, 1] for line in _lines(worlds)):
            assert proc.poll() is None and time.time() < deadline, "the group never ran on one worker"
            time.sleep(0.5)
        sim.add_node("i")

    run = cluster.run("elastic", os.path.join(cluster.local, "elastic"), os.path.join(cluster.storage, "elastic"),
               during=during, max_failures=1, elastic=True, worlds=worlds, hold={"world": 1, "step": 16},
               pause={"rank": 1, "step": 12, "flag": flag})
    assert run["global_step"] == 20
    segments = []  # (first step, world size, accumulation) of each group
    for step, world, accumulation in (json.loads(line) for line in _lines(worlds)):
        if not segments or segments[-1][1:] != (world, accumulation):
            segments.append((step, world, accumulation))
    assert segments == [(1, 2, 1), (11, 1, 2), (16, 2, 1)], segments
    ours, theirs = [h["loss"] for h in run["logs"]], [h["loss"] for h in reference["logs"]]
    assert [h["step"] for h in run["logs"]] == list(range(1, 21))
    assert ours[:10] == theirs[:10] and ours == pytest.approx(theirs, rel=1e-4)


def _lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip()]
