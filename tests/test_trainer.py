"""Trainer facade: log_history and trainer_state.json shapes, load_best_model_at_end, auto_find_batch_size,
dataset kinds, predict and save_model. The maths of a step (accumulation, clipping, non-finite) is in
test_trainer_maths.py."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from examples.digits import DigitsMLP, compute_metrics
from tests.tiny import TinyClassifier, args_for, columns, rows
from raytrain import Trainer, TrainerState


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# HF TrainerState's fields (transformers >= 4.46; best_global_step in recent releases)
HF_STATE_FIELDS = {
    "epoch", "global_step", "max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size",
    "num_train_epochs", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
    "best_global_step", "best_model_checkpoint", "is_local_process_zero", "is_world_process_zero",
    "is_hyper_param_search", "trial_name", "trial_params", "stateful_callbacks",
}


# ---------------------------------------------------------------- log_history and trainer_state.json


def test_log_history_shape_and_values(tmp_path, digits):
    train, val = digits
    train = {k: v[:256] for k, v in train.items()}  # 8 batches of 32 per epoch
    args = args_for(tmp_path, max_steps=12, per_device_train_batch_size=32, per_device_eval_batch_size=128,
                    learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=4, eval_strategy="steps",
                    eval_steps=6, save_strategy="steps", save_steps=6)
    trainer = Trainer(DigitsMLP(hidden_size=16, dropout=0.0), args, train_dataset=train, eval_dataset=val,
                      compute_metrics=compute_metrics)
    out = trainer.train()
    history = trainer.state.log_history

    train_logs = [h for h in history if "loss" in h]
    eval_logs = [h for h in history if "eval_loss" in h]
    final = history[-1]
    assert len(history) == len(train_logs) + len(eval_logs) + 1
    assert [h["step"] for h in train_logs] == [4, 8, 12]
    assert [h["step"] for h in eval_logs] == [6, 12]
    for h in train_logs:
        assert set(h) == {"loss", "grad_norm", "learning_rate", "epoch", "step"}
        assert h["epoch"] == h["step"] / 8 and h["learning_rate"] == 1e-3
        assert math.isfinite(h["loss"]) and h["loss"] > 0 and h["grad_norm"] > 0
    for h in eval_logs:
        assert set(h) == {"eval_loss", "eval_accuracy", "eval_runtime", "eval_samples_per_second",
                          "eval_steps_per_second", "epoch", "step"}
        assert 0 <= h["eval_accuracy"] <= 1 and h["epoch"] == h["step"] / 8
    assert set(final) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                          "train_loss", "epoch", "step"}
    assert final["step"] == 12 and final["epoch"] == 1.5
    # equal-length logging intervals: the run's train_loss is the mean of the logged losses
    assert final["train_loss"] == pytest.approx(np.mean([h["loss"] for h in train_logs]), rel=1e-6)
    assert out.training_loss == final["train_loss"] and out.metrics == {k: final[k] for k in out.metrics}
    assert final["total_flos"] == 0  # as HF: a model that does not count its parameters has no estimate

    path = os.path.join(args.output_dir, "checkpoint-6", "trainer_state.json")
    with open(path) as f:
        raw = json.load(f)
    assert set(raw) == HF_STATE_FIELDS
    state = TrainerState.load_from_json(path)
    assert (state.global_step, state.max_steps, state.epoch) == (6, 12, 0.75)
    assert (state.logging_steps, state.eval_steps, state.save_steps, state.train_batch_size) == (4, 6, 6, 32)
    assert state.log_history == history[:2]  # the train log at step 4 and the eval log at step 6
    # only TrainerControl (as HF) as of the save at step 6: no stateful callback was given
    assert state.stateful_callbacks == {"TrainerControl": {"args": {
        "should_training_stop": False, "should_epoch_stop": False, "should_save": True, "should_evaluate": False,
        "should_log": False}, "attributes": {}}}


def test_trainer_state_json_round_trip(tmp_path):
    state = TrainerState(epoch=1.5, global_step=3, max_steps=10, log_history=[{"loss": 1.0, "step": 3}],
                         best_metric=0.5, best_global_step=2, best_model_checkpoint="out/checkpoint-2",
                         stateful_callbacks={"X": {"args": {}, "attributes": {"n": 1}}})
    path = str(tmp_path / "trainer_state.json")
    state.save_to_json(path)
    assert TrainerState.load_from_json(path) == state
    with open(path) as f:  # a file written by HF with fields we do not know still loads
        raw = json.load(f)
    raw["some_future_field"] = 1
    with open(path, "w") as f:
        json.dump(raw, f)
    assert TrainerState.load_from_json(path) == state


# ---------------------------------------------------------------- load_best_model_at_end


def test_load_best_model_at_end_restores_best_checkpoint(tmp_path):
    scores = {2: 0.1, 4: 0.9, 6: 0.3, 8: 0.2}
    holder: dict = {}
    args = args_for(tmp_path, max_steps=8, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd",
                    eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                    load_best_model_at_end=True, metric_for_best_model="score", save_total_limit=1)
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16), eval_dataset=columns(4, seed=1),
                      compute_metrics=lambda p: {"score": scores[holder["t"].state.global_step]})
    holder["t"] = trainer
    trainer.train()
    best = os.path.join(args.output_dir, "checkpoint-4")
    assert trainer.state.best_model_checkpoint == best
    assert (trainer.state.best_metric, trainer.state.best_global_step) == (0.9, 4)
    # as HF: with save_total_limit 1 the run ends with the best checkpoint alone
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-4"]
    assert same_weights(weights(trainer.model), load_file(os.path.join(best, "model.safetensors")))
    assert trainer.state.log_history[-2]["step"] == 8  # training moved on after step 4


# ---------------------------------------------------------------- auto_find_batch_size


class OOMAbove(TinyClassifier):
    """Raises torch.OutOfMemoryError for training batches of more than `limit` items, from the
    `after + 1`-th batch of a size on (as when memory runs out a few steps in)."""

    def __init__(self, limit: int = 4, after: int = 0):
        super().__init__()
        self.limit, self.after, self.seen = limit, after, []

    def forward(self, x, labels=None):
        if self.training:
            n = x.shape[0]
            self.seen.append(n)
            if n > self.limit and self.seen.count(n) > self.after:
                raise torch.OutOfMemoryError(f"CUDA out of memory (batch of {n})")
        return super().forward(x, labels)


def test_auto_find_batch_size_shrinks_by_a_tenth_until_it_fits(tmp_path):
    # Each too-large size trains one step before running out of memory: the retry must start over
    # from the initial weights, so the result equals a run at batch size 4 from the start.
    torch.manual_seed(0)
    model = OOMAbove(limit=4, after=1)
    args = args_for(tmp_path / "auto", num_train_epochs=1, per_device_train_batch_size=16, learning_rate=0.1,
                    auto_find_batch_size=True, save_strategy="no")
    trainer = Trainer(model, args, train_dataset=columns(32))
    out = trainer.train()
    assert trainer._train_batch_size == 4 and trainer.state.train_batch_size == 4
    assert trainer.args.per_device_train_batch_size == 16  # as HF: the arguments stay as given
    assert model.seen == [16, 16, 14, 14, 12, 12, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5] + [4] * 8  # HF's sizes
    assert out.global_step == 8 and trainer.state.max_steps == 8

    torch.manual_seed(0)
    ref = OOMAbove(limit=4)
    ref_args = args_for(tmp_path / "ref", num_train_epochs=1, per_device_train_batch_size=4, learning_rate=0.1,
                        save_strategy="no")
    Trainer(ref, ref_args, train_dataset=columns(32)).train()
    assert ref.seen == [4] * 8
    assert same_weights(weights(model), weights(ref))


def test_out_of_memory_without_auto_find_batch_size_propagates(tmp_path):
    args = args_for(tmp_path, max_steps=1, per_device_train_batch_size=8, save_strategy="no")
    with pytest.raises(torch.OutOfMemoryError, match="batch of 8"):
        Trainer(OOMAbove(limit=4), args, train_dataset=columns(16)).train()


# ---------------------------------------------------------------- datasets, predict, save_model


class DictItems(torch.utils.data.Dataset):
    """A torch map-style Dataset whose items are dicts (HF's shape)."""

    def __init__(self, cols: dict):
        self.cols = cols

    def __len__(self):
        return len(self.cols["labels"])

    def __getitem__(self, i):
        return {"pixels": self.cols["pixels"][i], "labels": int(self.cols["labels"][i])}


def test_map_style_dataset_and_dict_of_arrays_train_identically(tmp_path, digits):
    train, val = digits
    train = {k: v[:200] for k, v in train.items()}
    results = {}
    for kind, data in (("arrays", train), ("dataset", DictItems(train))):
        torch.manual_seed(0)
        args = args_for(tmp_path / kind, num_train_epochs=2, per_device_train_batch_size=32, learning_rate=3e-3,
                        save_strategy="no")
        trainer = Trainer(DigitsMLP(hidden_size=16, dropout=0.0), args, train_dataset=data)
        out = trainer.train()
        assert out.global_step == 14  # ceil(200 / 32) = 7 steps per epoch
        results[kind] = weights(trainer.model)
    assert not same_weights(results["arrays"], weights(_fresh_digits_model()))
    for k in results["arrays"]:
        torch.testing.assert_close(results["arrays"][k], results["dataset"][k])


def _fresh_digits_model():
    torch.manual_seed(0)
    return DigitsMLP(hidden_size=16, dropout=0.0)


def test_predict_and_save_model_round_trip(tmp_path, digits):
    train, val = digits
    args = args_for(tmp_path, max_steps=30, per_device_train_batch_size=32, per_device_eval_batch_size=100,
                    learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no")
    trainer = Trainer(DigitsMLP(hidden_size=32, dropout=0.0), args, train_dataset=train, eval_dataset=val,
                      compute_metrics=compute_metrics)
    trainer.train()
    n = len(val["labels"])
    pred = trainer.predict(val)
    assert pred.predictions.shape == (n, 10) and pred.predictions.dtype == np.float32
    np.testing.assert_array_equal(pred.label_ids, val["labels"])  # evaluation keeps the dataset order
    with torch.no_grad():
        direct = trainer.model(torch.as_tensor(val["pixels"]))["logits"].numpy()
    np.testing.assert_allclose(pred.predictions, direct, rtol=1e-5, atol=1e-6)
    accuracy = float((direct.argmax(-1) == val["labels"]).mean())
    assert pred.metrics["test_accuracy"] == pytest.approx(accuracy) and accuracy > 0.8
    assert {"test_loss", "test_runtime", "test_samples_per_second", "test_steps_per_second"} <= set(pred.metrics)
    # predict without labels: predictions only
    unlabeled = trainer.predict({"pixels": val["pixels"][:7]})
    assert unlabeled.predictions.shape == (7, 10) and unlabeled.label_ids is None

    saved = trainer.save_model(str(tmp_path / "final"))
    state = load_file(os.path.join(saved, "model.safetensors"))
    fresh = DigitsMLP(hidden_size=32, dropout=0.0)
    fresh.load_state_dict(state)  # strict: every key present, no extras
    fresh.eval()
    with torch.no_grad():
        np.testing.assert_array_equal(fresh(torch.as_tensor(val["pixels"]))["logits"].numpy(), direct)
    with open(os.path.join(saved, "training_args.json")) as f:
        assert json.load(f)["max_steps"] == 30


def test_evaluate_metrics_and_errors(tmp_path, digits):
    train, val = digits
    trainer = Trainer(DigitsMLP(hidden_size=16, dropout=0.0), args_for(tmp_path, save_strategy="no"),
                      compute_metrics=compute_metrics)
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        trainer.evaluate()
    with pytest.raises(ValueError, match=r"^Trainer: training requires a train_dataset\.$"):
        trainer.train()
    metrics = trainer.evaluate(val)
    with torch.no_grad():
        out = trainer.model(torch.as_tensor(val["pixels"]), torch.as_tensor(val["labels"]))
    assert metrics["eval_loss"] == pytest.approx(float(out["loss"]), rel=1e-5)  # mean over every sample
    assert metrics["eval_accuracy"] == pytest.approx(
        float((out["logits"].argmax(-1).numpy() == val["labels"]).mean()))
    with pytest.raises(ValueError, match="needs a model or a model_init"):
        Trainer(None, args_for(tmp_path))


def test_last_epoch_can_be_the_best_checkpoint(tmp_path):
    # The final save with save_strategy "epoch" follows the epoch-end evaluation, so it is the best.
    scores = iter([0.1, 0.2, 0.9])
    args = args_for(tmp_path, num_train_epochs=3, per_device_train_batch_size=4, eval_strategy="epoch",
                    save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="score")
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(8), eval_dataset=columns(4),
                      compute_metrics=lambda p: {"score": next(scores)})
    trainer.train()
    assert trainer.state.best_global_step == 6
    assert trainer.state.best_model_checkpoint == os.path.join(args.output_dir, "checkpoint-6")
    saved = TrainerState.load_from_json(os.path.join(args.output_dir, "checkpoint-6", "trainer_state.json"))
    assert saved.best_model_checkpoint == trainer.state.best_model_checkpoint


def test_model_init_runs_after_seeding(tmp_path):
    """Trainer(model_init=...) seeds before building the model: the initial weights follow `seed` alone,
    whatever the global RNG did before."""
    torch.manual_seed(123)
    a = Trainer(model_init=TinyClassifier, args=args_for(tmp_path, seed=7))
    torch.rand(1000)
    b = Trainer(model_init=TinyClassifier, args=args_for(tmp_path, seed=7))
    c = Trainer(model_init=TinyClassifier, args=args_for(tmp_path, seed=8))
    assert torch.equal(a.model.linear.weight, b.model.linear.weight)
    assert not torch.equal(a.model.linear.weight, c.model.linear.weight)


def test_total_flos_is_counted_as_hf_counts_it(tmp_path):
    """6 x the main input's elements x num_parameters(exclude_embeddings=True), per step, as
    transformers 5.23's Trainer counts it for a model that has those (PreTrainedModel's names)."""
    import transformers


    class Counted(TinyClassifier):
        main_input_name = "x"

        def num_parameters(self, exclude_embeddings=False):
            return sum(p.numel() for p in self.parameters()) - 3  # a stand-in for embeddings left out

    kw = dict(max_steps=3, per_device_train_batch_size=4, save_strategy="no", report_to="none", disable_tqdm=True)
    hf = transformers.Trainer(Counted(), transformers.TrainingArguments(str(tmp_path / "hf"), **kw),
                              train_dataset=rows(16))
    hf.train()
    ours = Trainer(Counted(), args_for(tmp_path, **kw), train_dataset=columns(16))
    ours.train()
    assert ours.state.total_flos == hf.state.total_flos == 6 * (4 * 4) * 12 * 3
