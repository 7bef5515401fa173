"""DDP's siblings on 2 Ray workers (gloo): FSDP2 and DeepSpeed ZeRO-1/2/3 train the digits model, their
consolidated model.safetensors equals every rank's weights and loads into plain PyTorch, each does the
maths of one process with the same global batch, and checkpoints cross backends where state can."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raytrain import Trainer, load_weights
from tests.group import part
from tests.strategies._helpers import digits_args, digits_model, state_digest

# The runs share the session's worker group (conftest.py): one pytest process computes it (--dist loadgroup).
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("worker_group")]

BACKENDS = {
    "fsdp": {"distributed": {"strategy": "fsdp", "fsdp": {"min_num_params": 2000}}},
    "zero1": {"distributed": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 1}}}},
    "zero2": {"distributed": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 2}}},
              "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2},
    "zero3": {"distributed": {"strategy": "deepspeed", "deepspeed": {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}}},
}


def group_part(root):
    """This module's runs in the session's worker group (conftest.py)."""
    runs = [{"name": name, "output_dir": str(root / name), "args": args} for name, args in BACKENDS.items()]
    runs += [
        # FSDP's sharded (DCP) optimizer state, resumed by DDP; DeepSpeed refuses it with a clear error.
        {"name": "fsdp_to_ddp", "output_dir": str(root / "fsdp_to_ddp"), "resume": str(root / "fsdp" / "checkpoint-10")},
        {"name": "fsdp_to_zero2", "output_dir": str(root / "fsdp_to_zero2"),
         "args": {"distributed": BACKENDS["zero2"]["distributed"]},
         "resume": str(root / "fsdp" / "checkpoint-10")},
    ]
    return "tests.strategies._helpers:run_backends", {"runs": runs}


@pytest.fixture(scope="module")
def backend_runs(worker_group):
    return part(worker_group, __file__)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, the same global batch of 32."""
    from examples.digits import build_datasets

    train, _ = build_datasets()
    out = tmp_path_factory.mktemp("single")
    trainer = Trainer(digits_model(), digits_args(str(out), per_device_train_batch_size=32,
                                                  scaling={"num_workers": 1}), train_dataset=train)
    trainer.train()
    return trainer


@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_trains_and_consolidates(backend_runs, single_process, name):
    root, results = backend_runs
    result = results[name]
    assert "error" not in result, result.get("error")
    assert result["global_step"] == 30
    losses = result["losses"]
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0]
    ref_losses = [h["loss"] for h in single_process.state.log_history if "loss" in h]
    assert losses == pytest.approx(ref_losses, rel=1e-4)

    ckpt = root / name / "checkpoint-30"
    saved = load_weights(str(ckpt))
    probes = [json.load(open(root / name / f"probe-rank{r}.json")) for r in (0, 1)]
    assert probes[0]["digest"] == probes[1]["digest"] == state_digest(saved)
    plain = digits_model(seed=1)
    plain.load_state_dict(saved)  # plain PyTorch, strict: every name and shape
    for key, value in single_process.model.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-4, atol=1e-5)
    sharded = {"fsdp": "dcp", "zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}[name]
    assert os.path.isdir(ckpt / sharded) and not os.path.exists(ckpt / "optimizer.pt")
    if sharded == "deepspeed":  # DeepSpeed's shared-memory inference kernel is not built on CPU (a minute of C++)
        assert result["shm_kernel"] is False


@pytest.mark.timeout(900)
def test_cross_backend_resume(backend_runs):
    root, results = backend_runs
    resumed = results["fsdp_to_ddp"]
    assert "error" not in resumed, resumed.get("error")
    assert resumed["global_step"] == 30
    # Resumed from FSDP's step 10 with its re-sharded optimizer state: DDP ends where FSDP ended.
    ddp, fsdp = load_weights(str(root / "fsdp_to_ddp" / "checkpoint-30")), load_weights(str(root / "fsdp" / "checkpoint-30"))
    for key in fsdp:
        torch.testing.assert_close(ddp[key], fsdp[key], rtol=1e-5, atol=1e-6)
    error = results["fsdp_to_zero2"]["error"]
    assert error.startswith("CheckpointError") and "deepspeed: missing" in error and "model.safetensors" in error
