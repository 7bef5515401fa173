"""raytrain.trl's SFT and DPO scripts on 2 Ray Train workers (DDP, FSDP2, DeepSpeed ZeRO-3), only scaling and the
backend added: every rank gets the data prepared where the trainer was built (no rank-0 barrier), TRL's metrics are
reduced over the ranks, and the per-step losses and metrics are trl 1.16's in one process on the same global
batches."""

from __future__ import annotations

import functools
import os

import pytest

from tests.group import part
from tests.hf import trl_jobs as jobs  # by this name on the Ray workers too

pytest.importorskip("trl")
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("worker_group")]


def _close(a, b, tol=1e-5):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            assert x[k] == pytest.approx(y[k], abs=tol, rel=tol), (k, x, y)


BACKENDS = {"ddp": {"strategy": "ddp"},
            "fsdp2": {"strategy": "fsdp", "fsdp": {"wrap_classes": ["LlamaDecoderLayer"]}},
            "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 3}}}}


def _make(kind: str):
    """The script and the keys compared, for `kind`: sft, dpo (LoRA: the reference is the adapter disabled) or
    dpo-ref (full fine-tuning with a separate ref_model, which the workers shard as the policy: Strategy.place_frozen,
    TRL's prepare_fsdp)."""
    if kind == "sft":
        return jobs.sft_trainer, jobs.STEP_KEYS
    if kind == "dpo-ref":
        return functools.partial(jobs.dpo_trainer, peft=False, ref=True), jobs.DPO_KEYS
    return jobs.dpo_trainer, jobs.DPO_KEYS


def _ours(kind: str, backend: str, out):
    make, _ = _make(kind)
    return make("rt", str(out / "rt"), max_steps=3, per_device_train_batch_size=2, scaling={"num_workers": 2},
                distributed=BACKENDS[backend], callbacks=[jobs.RankMarker(str(out / "ranks"))])


def _theirs(kind: str, out) -> list[dict]:
    make, keys = _make(kind)
    theirs = make("trl", str(out / "trl"), max_steps=3)
    theirs.train()
    return jobs.steps(theirs, keys)


#: the scripts and backends, in the session's worker group (conftest.py; a TorchTrainer start costs ~30 s here):
#: ZeRO-3 first, as in test_grpo_backends_on_ray.py
SHARED = {"dpo-zero3": ("dpo", "zero3"), "sft-ddp": ("sft", "ddp"), "sft-fsdp2": ("sft", "fsdp2"),
          "dpo-ref-fsdp2": ("dpo-ref", "fsdp2")}


def group_part(root):
    """Each case's trainer built on the driver and shipped as a Ray run ships it (tests/group.py), run by the
    workers' own function one after the other."""
    from tests.group import ship

    return "tests.group:run_cases", {"cases": {name: ship(_ours(kind, backend, root / name), name)
                                               for name, (kind, backend) in SHARED.items()}}


@pytest.fixture(scope="module")
def one_group(worker_group):
    """The group's root and rank 0's log history of each case."""
    import json

    root, values = part(worker_group, __file__)
    return root, {name: json.loads(value["state"])["log_history"] for name, value in values.items()}


@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
@pytest.mark.parametrize("case", list(SHARED))
def test_trl_scripts_on_two_workers_match_trl_in_one_process(one_group, tmp_path, case):
    root, logs = one_group
    kind, _ = SHARED[case]
    assert sorted(os.listdir(root / case / "ranks")) == ["rank-0-of-2", "rank-1-of-2"]
    _close(jobs.log_steps(logs[case], _make(kind)[1]), _theirs(kind, tmp_path))


@pytest.mark.long  # two Ray runs: by default test_trl.py's in-process SIGKILL, driver/test_launch.py's Ray SIGKILL
@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_on_two_workers_resumes_a_killed_rank_bit_exact(ray_cluster, tmp_path, kind):
    """Rank 1 is SIGKILLed after step 3: Ray restarts the group, which resumes from checkpoint-2 and ends with the
    uninterrupted run's losses, TRL metrics (num_tokens too) and adapter, bit for bit."""
    import signal

    import torch
    from safetensors.torch import load_file

    from tests.strategies._helpers import FaultInjector

    runs = {}
    for name, faults in (("whole", []), ("killed", [FaultInjector(1, 3, signal.SIGKILL)])):
        out = tmp_path / name
        make = jobs.sft_trainer if kind == "sft" else jobs.dpo_trainer
        trainer = make("rt", str(out), max_steps=6, save_strategy="steps", save_steps=2,
                       per_device_train_batch_size=2, callbacks=faults,
                       scaling={"num_workers": 2, "max_failures": 1, "storage_path": str(tmp_path / f"ray_{name}")})
        trainer.train()
        runs[name] = (trainer, load_file(os.path.join(trainer.save_model(str(out / "final")),
                                                      "adapter_model.safetensors")))
    assert [int(s) for s in (tmp_path / "killed" / "starts.txt").read_text().split()] == [0, 2]
    keys = jobs.STEP_KEYS if kind == "sft" else jobs.DPO_KEYS
    killed, whole = jobs.steps(runs["killed"][0], keys), jobs.steps(runs["whole"][0], keys)
    assert killed == whole, [(a, b) for a, b in zip(killed, whole) if a != b]
    want, got = runs["whole"][1], runs["killed"][1]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
