"""LoRA on 2 Ray Train workers: the script unchanged but for scaling (DDP), and DDP / FSDP2 / ZeRO-3 in one
worker group; each run's adapter is gathered on rank 0, saved as PEFT writes it and loads with
PeftModel.from_pretrained, reproducing the trained model; the losses are one process's."""

from __future__ import annotations

import os

import pytest
import torch

from tests.hf import peft_jobs  # by this name on the Ray workers too

pytest.importorskip("peft")
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("peft_on_ray")]
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


@pytest.mark.timeout(300)
def test_lora_script_on_two_ray_workers_saves_an_adapter_peft_loads(ray_cluster, tmp_path, one_process):
    from transformers import AutoModelForCausalLM

    from raytrain import Trainer

    rows = peft_jobs.lm_rows()
    trainer = Trainer(peft_jobs.lora_model(), peft_jobs.lora_args(str(tmp_path / "out"), 2, save_merged_model=True),
                      train_dataset=rows)
    trainer.train()
    assert losses(trainer) == pytest.approx(losses(one_process), rel=1e-4)
    for step in (3, 6):
        files = set(os.listdir(tmp_path / "out" / f"checkpoint-{step}"))
        assert ADAPTER <= files and "model.safetensors" not in files and "config.json" not in files
    final = trainer.save_model(str(tmp_path / "out" / "final"))
    want = logits(trainer.model, rows)
    torch.testing.assert_close(logits(from_pretrained(final), rows), want)
    merged, info = AutoModelForCausalLM.from_pretrained(os.path.join(final, "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(logits(merged, rows), want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(400)
def test_lora_under_ddp_fsdp2_and_zero3_gathers_the_adapter_on_rank_0(ray_cluster, tmp_path, one_process):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(peft_jobs.run_lora_backends, train_loop_config={"root": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="lora_backends", storage_path=str(tmp_path / "ray")))
    results = trainer.fit().return_value
    rows, want = peft_jobs.lm_rows(), logits(one_process.model, peft_jobs.lm_rows())
    for name in peft_jobs.BACKENDS:
        assert "error" not in results[name], (name, results[name])
        assert results[name]["losses"] == pytest.approx(losses(one_process), rel=1e-4), name
        for where in ("checkpoint-6", "final"):
            path = tmp_path / name / where
            assert ADAPTER <= set(os.listdir(path)) and "model.safetensors" not in os.listdir(path), (name, where)
            torch.testing.assert_close(logits(from_pretrained(path), rows), want, rtol=1e-4, atol=1e-5)
