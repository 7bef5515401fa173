"""The maths of one update step: gradient accumulation equals one large batch, clipping is
torch's clip_grad_norm_ on the pre-clip norm, non-finite steps are skipped and then fail the run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from examples.digits import DigitsMLP
from tests import tiny
from raytrain import NonFiniteError, Trainer, TrainerCallback, TrainingArguments


def args_for(tmp_path, **kw) -> TrainingArguments:
    """Plain SGD at a constant rate, so that updates can be computed by hand."""
    return tiny.args_for(tmp_path, **{"save_strategy": "no", "optim": "sgd", "lr_scheduler_type": "constant", **kw})


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------- gradient accumulation


def test_accumulation_equals_one_large_batch(tmp_path, digits):
    train, _ = digits  # 1438 samples: the epoch's last step holds 30 (8 + 8 + 8 + 6 with accumulation)
    torch.manual_seed(0)
    init = DigitsMLP(hidden_size=32, dropout=0.0)
    runs = {}
    for name, bs, ga in (("ga", 8, 4), ("big", 32, 1)):
        model = copy.deepcopy(init)
        trainer = Trainer(model, args_for(tmp_path / name, num_train_epochs=1, per_device_train_batch_size=bs,
                                          gradient_accumulation_steps=ga, learning_rate=0.2),
                          train_dataset=train)
        assert trainer.train().global_step == 45
        runs[name] = model
    assert_same_weights(runs["ga"], runs["big"])
    assert not torch.allclose(runs["big"].head.weight, init.head.weight, atol=1e-2)  # it did train


class TokenModel(nn.Module):
    """Tokens -> per-token class logits; its loss is the mean cross-entropy over non-ignored tokens."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.out = nn.Linear(8, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.out(torch.tanh(self.embed(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def token_data(n: int = 32, length: int = 12) -> dict:
    """Sequences whose label counts range from 1 to 12 tokens (the rest is -100 padding)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (n, length), generator=g)
    labels = (ids * 3 + 1) % 11
    counts = [1 + (i * 5) % length for i in range(n)]
    for i, c in enumerate(counts):
        labels[i, c:] = -100
    assert len(set(counts)) == length
    return {"input_ids": ids, "labels": labels}


def _token_runs(tmp_path, compute_loss_func=None, record=None):
    torch.manual_seed(0)
    init = TokenModel()
    data = token_data()
    models = {}
    for name, bs, ga in (("ga", 2, 4), ("big", 8, 1)):
        model = copy.deepcopy(init)
        if record is not None:
            record[name] = []
        fn = None
        if compute_loss_func is not None:
            fn = (lambda out, labels, num_items_in_batch, _name=name:  # a keyword, as HF passes it
                  compute_loss_func(out, labels, num_items_in_batch, record[_name]))
        trainer = Trainer(model, args_for(tmp_path / name, num_train_epochs=2, per_device_train_batch_size=bs,
                                          gradient_accumulation_steps=ga, learning_rate=0.5),
                          train_dataset=data, compute_loss_func=fn)
        assert trainer.train().global_step == 8
        models[name] = model
    assert not torch.allclose(models["big"].out.weight, init.out.weight, atol=1e-2)
    return models


def test_accumulation_with_uneven_token_counts_model_mean_loss(tmp_path):
    # The model returns a mean over its micro-batch's tokens; the trainer reweights it by the
    # micro-batch's share of the step's tokens, so 4 x 2 sequences equal 8 sequences at once.
    models = _token_runs(tmp_path)
    assert_same_weights(models["ga"], models["big"])


def sum_over_items(outputs, labels, num_items_in_batch, calls):
    calls.append(int(num_items_in_batch))
    logits = outputs["logits"]
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


def test_accumulation_with_compute_loss_func_gets_items_of_the_whole_step(tmp_path):
    calls: dict[str, list[int]] = {}
    models = _token_runs(tmp_path, compute_loss_func=sum_over_items, record=calls)
    assert_same_weights(models["ga"], models["big"])
    # num_items_in_batch is the step's token count, the same for each of its 4 micro-batches
    assert len(calls["ga"]) == 32 and len(calls["big"]) == 8
    assert calls["ga"] == [n for n in calls["big"] for _ in range(4)]
    assert sum(calls["big"]) == 2 * int((token_data()["labels"] != -100).sum())


# ---------------------------------------------------------------- clipping


class Dot(nn.Module):
    """loss = mean over the batch of (w . x + b): the gradient is the batch mean of (x, 1)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.b = nn.Parameter(torch.tensor([0.25]))

    def forward(self, x, labels=None):
        return {"loss": (x @ self.w + self.b).mean()}


def test_clipping_uses_pre_clip_norm_and_matches_torch(tmp_path):
    x = torch.tensor([[300.0, -400.0, 120.0], [100.0, -200.0, 0.0]])
    data = {"x": x, "labels": torch.zeros(2)}
    model = Dot()
    reference = copy.deepcopy(model)
    trainer = Trainer(model, args_for(tmp_path, max_steps=1, per_device_train_batch_size=2, learning_rate=0.1,
                                      max_grad_norm=0.5, logging_steps=1), train_dataset=data)
    trainer.train()

    # by hand: the same step with torch's clipping and plain SGD
    reference(x)["loss"].backward()
    grad = torch.cat([reference.w.grad, reference.b.grad])
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    expected_norm = math.sqrt(200**2 + 300**2 + 60**2 + 1)
    assert float(norm) == pytest.approx(expected_norm) and float(torch.linalg.norm(grad)) == pytest.approx(expected_norm)
    logged = trainer.state.log_history[0]
    assert logged["grad_norm"] == pytest.approx(expected_norm, rel=1e-6)  # the norm before clipping
    assert_same_weights(model, reference)
    step = torch.cat([Dot().w - model.w, Dot().b - model.b]).detach()
    assert float(torch.linalg.norm(step)) == pytest.approx(0.1 * 0.5, rel=1e-4)  # lr x max_grad_norm


def test_no_clipping_when_max_grad_norm_is_off(tmp_path):
    x = torch.tensor([[3.0, -4.0, 0.0]])
    model = Dot()
    Trainer(model, args_for(tmp_path, max_steps=1, per_device_train_batch_size=1, learning_rate=0.1,
                            max_grad_norm=None), train_dataset={"x": x, "labels": torch.zeros(1)}).train()
    torch.testing.assert_close(model.w.detach(), torch.tensor([0.5 - 0.3, -1.0 + 0.4, 2.0]))
    torch.testing.assert_close(model.b.detach(), torch.tensor([0.25 - 0.1]))


# ---------------------------------------------------------------- non-finite losses


class NanAt(nn.Module):
    """A linear classifier whose training loss is nan at the chosen (1-based) training forward calls."""

    def __init__(self, nan_calls: set[int]):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.nan_calls, self.calls = nan_calls, 0

    def forward(self, x, labels=None):
        logits = self.linear(x)
        loss = nn.functional.cross_entropy(logits, labels)
        if self.training:
            self.calls += 1
            if self.calls in self.nan_calls:
                loss = loss * float("nan")
        return {"loss": loss, "logits": logits}


class Snapshots(TrainerCallback):
    """Weights before and after every update step."""

    def __init__(self):
        self.before, self.after = {}, {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before[state.global_step + 1] = weights(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = weights(model)


def nan_data() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(24, 4, generator=g), "labels": torch.randint(0, 3, (24,), generator=g)}


def test_single_nan_step_is_skipped_and_filtered_from_logs(tmp_path):
    snaps = Snapshots()
    model = NanAt({3})
    trainer = Trainer(model, args_for(tmp_path, max_steps=6, per_device_train_batch_size=4, learning_rate=0.1,
                                      logging_steps=2), train_dataset=nan_data(), callbacks=[snaps])
    out = trainer.train()
    assert out.global_step == 6 and out.metrics["train_skipped_steps"] == 1
    for step in range(1, 7):
        unchanged = all(torch.equal(snaps.before[step][k], snaps.after[step][k]) for k in snaps.before[step])
        assert unchanged == (step == 3), step
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert math.isfinite(out.training_loss)

    # without the filter the interval holding step 3 logs nan
    plain = Trainer(NanAt({3}), args_for(tmp_path / "plain", max_steps=6, per_device_train_batch_size=4,
                                         learning_rate=0.1, logging_steps=2, logging_nan_inf_filter=False),
                    train_dataset=nan_data())
    plain.train()
    losses = [h["loss"] for h in plain.state.log_history if "loss" in h]
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isfinite(losses[2])


def test_consecutive_nan_steps_raise_naming_the_steps_when_limited(tmp_path):
    trainer = Trainer(NanAt({3, 4, 5}), args_for(tmp_path, max_steps=6, per_device_train_batch_size=4,
                                                 learning_rate=0.1, max_nonfinite_steps=3), train_dataset=nan_data())
    with pytest.raises(NonFiniteError, match=r"non-finite gradients at steps 3, 4, 5 \(3 in a row\)"):
        trainer.train()
    assert trainer.state.global_step == 5


def test_nan_steps_by_default_are_skipped_and_the_run_continues_as_hf(tmp_path):
    snaps = Snapshots()
    trainer = Trainer(NanAt({3, 4, 5}), args_for(tmp_path, max_steps=6, per_device_train_batch_size=4,
                                                 learning_rate=0.1), train_dataset=nan_data(), callbacks=[snaps])
    out = trainer.train()
    assert out.global_step == 6 and out.metrics["train_skipped_steps"] == 3
    for step in (3, 4, 5):  # never an optimizer step on non-finite gradients
        assert all(torch.equal(snaps.before[step][k], snaps.after[step][k]) for k in snaps.before[step])


def test_nan_steps_not_in_a_row_do_not_raise(tmp_path):
    trainer = Trainer(NanAt({2, 3, 5, 6}), args_for(tmp_path, max_steps=6, per_device_train_batch_size=4,
                                                    learning_rate=0.1, max_nonfinite_steps=3), train_dataset=nan_data())
    out = trainer.train()
    assert out.global_step == 6 and out.metrics["train_skipped_steps"] == 4
