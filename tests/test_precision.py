"""Mixed precision and memory metrics: bf16 autocast on CPU; fp16 GradScaler only on CUDA."""

from __future__ import annotations

import pytest
import torch

from raytrain import Trainer, TrainingArguments


def _args(tmp_path, **kw):
    kw.setdefault("save_strategy", "no")
    return TrainingArguments(output_dir=str(tmp_path), max_steps=60, per_device_train_batch_size=32,
                             learning_rate=3e-3, logging_steps=20, disable_tqdm=True, **kw)


class _Probe(torch.nn.Module):
    """Records the dtype the first layer computes in, to prove autocast is active."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen = set()

    def forward(self, pixels, labels=None):
        self.seen.add(torch.nn.functional.linear(pixels, self.inner.body[0].weight).dtype)
        return self.inner(pixels, labels)


def test_bf16_autocast_on_cpu_trains(tmp_path, digits):
    from examples.digits import build_model

    train, _ = digits
    model = _Probe(build_model())
    trainer = Trainer(model, _args(tmp_path, bf16=True), train_dataset=train)
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert model.seen == {torch.bfloat16}
    assert losses[-1] < losses[0] * 0.5
    # Weights stay float32: autocast changes the compute dtype, not the parameters.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert out.metrics["train_loss"] > 0


def test_memory_metrics_reported_when_asked(tmp_path, digits):
    from examples.digits import build_model

    train, _ = digits
    out = Trainer(build_model(), _args(tmp_path, skip_memory_metrics=False), train_dataset=train).train()
    assert isinstance(out.metrics["train_mem_cpu_alloc_delta"], int)
    assert out.metrics["train_mem_cpu_peaked_delta"] >= 0
    quiet = Trainer(build_model(), _args(tmp_path / "q"), train_dataset=train).train()
    assert not any(k.startswith("train_mem_") for k in quiet.metrics)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 with a GradScaler needs a CUDA device")
def test_fp16_grad_scaler_on_cuda(tmp_path, digits):
    from examples.digits import build_model

    train, _ = digits
    trainer = Trainer(build_model(), _args(tmp_path, fp16=True, save_strategy="steps", save_steps=60),
                      train_dataset=train)
    trainer.train()
    strategy = trainer.get_strategy()
    assert strategy.device.type == "cuda" and strategy.scaler is not None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    assert (tmp_path / "checkpoint-60" / "scaler.pt").is_file()
