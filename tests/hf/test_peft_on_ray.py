"""LoRA on 2 Ray Train workers: DDP / FSDP2 / ZeRO-3 in the session's worker group, and the script unchanged but for
scaling, its rank 1 SIGKILLed; each run's adapter is gathered on rank 0, saved as PEFT writes it and loads
with PeftModel.from_pretrained, reproducing the trained model; the losses are one process's."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.group import part
from tests.hf import peft_jobs  # by this name on the Ray workers too

pytest.importorskip("peft")
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("worker_group")]
ADAPTER = {"adapter_config.json", "adapter_model.safetensors"}


def logits(model, rows):
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.stack([r["input_ids"] for r in rows[:4]])).logits


def from_pretrained(path):
    from peft import PeftModel

    return PeftModel.from_pretrained(peft_jobs.lora_model().get_base_model(), str(path))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from raytrain import Trainer

    out = tmp_path_factory.mktemp("lora_single")
    trainer = Trainer(peft_jobs.lora_model(), peft_jobs.lora_args(str(out), 1, scaling={"num_workers": 1}),
                      train_dataset=peft_jobs.lm_rows())
    trainer.train()
    return trainer


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def group_part(root):
    """This module's runs in the session's worker group (conftest.py)."""
    return "tests.hf.peft_jobs:run_lora_backends", {"root": str(root)}


@pytest.fixture(scope="module")
def backends(worker_group):
    return part(worker_group, __file__)


@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
def test_lora_under_ddp_fsdp2_and_zero3_gathers_the_adapter_on_rank_0(backends, one_process):
    root, results = backends
    rows, want = peft_jobs.lm_rows(), logits(one_process.model, peft_jobs.lm_rows())
    for name in peft_jobs.BACKENDS:
        assert "error" not in results[name], (name, results[name])
        assert results[name]["losses"] == pytest.approx(losses(one_process), rel=1e-4), name
        for where in ("checkpoint-6", "final"):
            path = root / name / where
            assert ADAPTER <= set(os.listdir(path)) and "model.safetensors" not in os.listdir(path), (name, where)
            torch.testing.assert_close(logits(from_pretrained(path), rows), want, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(900)
def test_a_full_model_saved_by_ddp_fsdp2_and_zero3_loads_with_from_pretrained(backends):
    """Unwrapped from each backend, final/ is what from_pretrained loads: no key missing or unexpected, the
    weights of the run's last checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, results = backends
    for name in peft_jobs.FULL:
        assert "error" not in results[name], (name, results[name])
        final = root / name / "final"
        assert "config.json" in os.listdir(final)
        model, info = AutoModelForCausalLM.from_pretrained(str(final), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], name
        saved = load_file(root / name / "checkpoint-6" / "model.safetensors")
        for key, value in model.state_dict().items():
            assert torch.equal(value, saved[key]), (name, key)


# The same restore path runs by default in-process (test_peft.py's SIGKILL) and for digits on Ray (test_launch.py).
@pytest.mark.long
@pytest.mark.timeout(400)
def test_lora_script_on_two_ray_workers_resumes_a_killed_rank_bit_exact(backends, tmp_path):
    """Rank 1 is SIGKILLed after step 4: Ray restarts the group, which resumes from checkpoint-3's adapter and
    ends with the uninterrupted DDP run's adapter bit for bit; final/ loads with PEFT, merged/ with
    from_pretrained."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from raytrain import Trainer
    from tests.strategies._helpers import FaultInjector

    root, _ = backends
    rows, out = peft_jobs.lm_rows(), tmp_path / "out"
    args = peft_jobs.lora_args(str(out), 2, save_merged_model=True,
                               scaling={"num_workers": 2, "max_failures": 1, "storage_path": str(tmp_path / "ray")})
    trainer = Trainer(peft_jobs.lora_model(), args, train_dataset=rows, callbacks=[FaultInjector(1, 4, signal.SIGKILL)])
    trainer.train()
    assert [int(s) for s in (out / "starts.txt").read_text().split()] == [0, 3]
    for step in (3, 6):
        files = set(os.listdir(out / f"checkpoint-{step}"))
        assert ADAPTER <= files and "model.safetensors" not in files and "config.json" not in files
    final = trainer.save_model(str(out / "final"))
    uninterrupted = load_file(root / "ddp" / "final" / "adapter_model.safetensors")
    mine = load_file(os.path.join(final, "adapter_model.safetensors"))
    assert mine.keys() == uninterrupted.keys() and all(torch.equal(mine[k], uninterrupted[k]) for k in mine)
    want = logits(trainer.model, rows)
    torch.testing.assert_close(logits(from_pretrained(final), rows), want)
    merged, info = AutoModelForCausalLM.from_pretrained(os.path.join(final, "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(logits(merged, rows), want, rtol=1e-5, atol=1e-5)
