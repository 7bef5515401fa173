"""HF's switches that act on the model or the step, each against transformers' Trainer: use_liger_kernel (refused
where Liger cannot run; skip_logits in a loss-only evaluation), debug="underflow_overflow", fp16 / bf16_full_eval,
torch_empty_cache_steps."""

from __future__ import annotations

import pytest
import torch

from . import scripts
from .scripts import LIBS


class _SkipLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen = []

    def forward(self, x, labels=None, skip_logits=None, **kwargs):
        self.seen.append(skip_logits)
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


def test_liger_kernel_passes_skip_logits_as_hf_and_training_is_refused_without_liger(tmp_path):
    from raytrain.config.sections import ConfigError

    seen = {}
    for lib in ("hf", "rt"):
        Trainer, TrainingArguments = LIBS[lib][0]()
        args = TrainingArguments(str(tmp_path / lib), use_liger_kernel=True, prediction_loss_only=True,
                                 per_device_eval_batch_size=4, **scripts.COMMON)
        trainer = Trainer(model=_SkipLogits(), args=args, eval_dataset=scripts.regression_data(8),
                          train_dataset=scripts.regression_data(8))
        trainer.evaluate()
        seen[lib] = trainer.model.seen
        with pytest.raises(ImportError if lib == "hf" else ConfigError) as e:
            trainer.train()
    assert seen["rt"] == seen["hf"] == [True, True]
    assert str(e.value) == ("use_liger_kernel: liger-kernel is not installed (pip install liger-kernel; its Triton "
                            "kernels need a GPU); leave it false")


class _Overflows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        torch.nn.init.constant_(self.lin.weight, 3e38)

    def forward(self, x, labels=None):
        out = self.lin(x * 10).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_debug_underflow_overflow_stops_at_the_first_inf_as_hf(tmp_path, capsys):
    for lib in ("hf", "rt"):
        Trainer, TrainingArguments = LIBS[lib][0]()
        args = TrainingArguments(str(tmp_path / lib), debug="underflow_overflow", max_steps=2, **scripts.COMMON)
        trainer = Trainer(model=_Overflows(), args=args, train_dataset=scripts.regression_data(8))
        with pytest.raises(ValueError, match="^DebugUnderflowOverflow: inf/nan detected, aborting"):
            trainer.train()
        assert "Detected inf/nan during batch_number=0" in capsys.readouterr().out


class _Elementwise(torch.nn.Module):
    """x . w + b by elementwise ops, which mix a half-precision model with float inputs (as HF's test model)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w, self.b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, labels=None):
        out = (x * self.w).sum(-1) + self.b
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels), "logits": out}


@pytest.mark.parametrize("field, dtype", [("fp16_full_eval", torch.float16), ("bf16_full_eval", torch.bfloat16)])
def test_full_eval_casts_the_model_outside_training_as_hf(field, dtype, tmp_path):
    out = {}
    for lib in ("hf", "rt"):
        Trainer, TrainingArguments = LIBS[lib][0]()
        args = TrainingArguments(str(tmp_path / lib), max_steps=2, eval_strategy="steps", eval_steps=1,
                                 per_device_train_batch_size=4, **{field: True}, **scripts.COMMON)
        trainer = Trainer(model=_Elementwise(), args=args, train_dataset=scripts.regression_data(8),
                          eval_dataset=scripts.regression_data(8))
        trainer.train()
        during = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
        assert trainer.model.w.dtype == torch.float32, lib  # evaluations during training: as trained
        out[lib] = (during, trainer.evaluate()["eval_loss"], trainer.model.w.dtype)
    assert out["rt"][2] == out["hf"][2] == dtype
    assert out["rt"][0] == pytest.approx(out["hf"][0], rel=1e-5)
    assert out["rt"][1] == pytest.approx(out["hf"][1], rel=1e-2)  # a loss of half-precision outputs


def test_torch_empty_cache_steps_empties_at_hfs_steps(tmp_path, monkeypatch):
    import raytrain.hf.loss
    from raytrain import Trainer, TrainingArguments

    steps = []
    trainer = None
    monkeypatch.setattr(raytrain.hf.loss, "clear_device_cache", lambda: steps.append(trainer.state.global_step))
    args = TrainingArguments(str(tmp_path), max_steps=6, torch_empty_cache_steps=2, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, **scripts.COMMON)
    trainer = Trainer(model=scripts.TinyRegressor(), args=args, train_dataset=scripts.regression_data(48))
    trainer.train()
    assert steps == [0, 0, 2, 2, 4, 4]  # HF's: after each micro-batch's loss, at steps divisible by N


def test_ddp_backend_and_timeout_reach_the_workers_process_group(tmp_path):
    from raytrain import Trainer, TrainingArguments
    from raytrain.driver.torch_trainer import build_torch_trainer

    args = TrainingArguments(str(tmp_path), ddp_backend="gloo", ddp_timeout=77, scaling={"num_workers": 2},
                             report_to="none", disable_tqdm=True)
    built = build_torch_trainer(Trainer(model=torch.nn.Linear(2, 1), args=args), args, name="x",
                                storage_path=str(tmp_path))
    assert (built.backend_config.backend, built.backend_config.timeout_s) == ("gloo", 77)
