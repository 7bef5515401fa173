"""HF scripts run unchanged but for the import line; transformers' own Trainer is the oracle."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from . import scripts
from .scripts import hf, rt

CHECKPOINT_RUNTIME = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"}


def _keys(log_history):
    return [sorted(k for k in e if k not in ("total_flos",)) for e in log_history]


# ---------------------------------------------------------------- 1. classification
def test_classification_log_history_steps_and_checkpoints_match_hf(tmp_path):
    (h, _, _), (r, _, _) = (scripts.classification(*hf(), tmp_path / "hf"),
                            scripts.classification(*rt(), tmp_path / "rt"))
    assert r.state.global_step == h.state.global_step
    assert _keys(r.state.log_history) == _keys(h.state.log_history)
    assert scripts.checkpoints(tmp_path / "rt") == scripts.checkpoints(tmp_path / "hf")
    for name in scripts.checkpoints(tmp_path / "hf"):
        must = set(os.listdir(tmp_path / "hf" / name)) - CHECKPOINT_RUNTIME
        assert must <= set(os.listdir(tmp_path / "rt" / name)), name
    must = set(os.listdir(tmp_path / "hf" / "final"))
    assert must <= set(os.listdir(tmp_path / "rt" / "final"))
    assert {"config.json", "model.safetensors", "training_args.bin", "tokenizer.json"} <= must


def test_classification_from_pretrained_on_checkpoint_and_save_model(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    trainer, tok, test = scripts.classification(*rt(), tmp_path)
    model = trainer.model.eval()
    batch = tok(test["text"][:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**batch).logits
    last = scripts.checkpoints(tmp_path)[-1]
    for d in (tmp_path / last, tmp_path / "final"):
        loaded = AutoModelForSequenceClassification.from_pretrained(str(d)).eval()
        AutoTokenizer.from_pretrained(str(d))
        with torch.no_grad():
            got = loaded(**batch).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- 2. causal LM
def test_causal_lm_trains_evaluates_predicts_and_reloads_tied(tmp_path):
    from transformers import GPT2LMHeadModel

    h, h_metrics, h_pred = scripts.causal_lm(*hf(), tmp_path / "hf")
    r, r_metrics, r_pred = scripts.causal_lm(*rt(), tmp_path / "rt")
    assert np.isfinite(r_metrics["eval_loss"])
    assert scripts.metric_keys(r_metrics) == scripts.metric_keys(h_metrics)
    assert r.state.global_step == h.state.global_step == 4
    assert type(r_pred.predictions) is type(h_pred.predictions)
    assert isinstance(r_pred.predictions, np.ndarray)
    assert r_pred.predictions.shape == h_pred.predictions.shape
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "rt" / "final"))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, r.model.lm_head.weight.detach())
    torch.testing.assert_close(loaded.transformer.wte.weight, r.model.transformer.wte.weight.detach())


# ---------------------------------------------------------------- 4. tuple outputs
def test_tuple_loss_logits_trains_and_predicts_logits(tmp_path):
    h, h_res, h_pred, _ = scripts.tuple_outputs(*hf(), tmp_path / "hf", hidden_out=False)
    r, r_res, r_pred, r_after = scripts.tuple_outputs(*rt(), tmp_path / "rt", hidden_out=False)
    assert r.state.global_step == 3 and np.isfinite(r_res.training_loss)
    assert isinstance(r_pred.predictions, np.ndarray) and isinstance(r_after.predictions, np.ndarray)
    assert r_after.predictions.shape == r_pred.predictions.shape
    assert scripts.np_close(r_pred.predictions, h_pred.predictions)
    assert scripts.np_close(r_pred.label_ids, h_pred.label_ids)


def test_tuple_of_three_predicts_two_arrays_padded_like_hf(tmp_path):
    h, _, h_pred, _ = scripts.tuple_outputs(*hf(), tmp_path / "hf", hidden_out=True)
    r, _, r_pred, _ = scripts.tuple_outputs(*rt(), tmp_path / "rt", hidden_out=True)
    assert isinstance(r_pred.predictions, tuple) and len(r_pred.predictions) == 2
    logits, hidden = r_pred.predictions
    assert logits.shape == (12, 5, 3) and hidden.shape == (12, 5, 8)
    assert (logits[:4, 3:] == -100).all() and (logits[8:, 2:] == -100).all()
    assert scripts.np_close(r_pred.predictions, h_pred.predictions)
    assert scripts.np_close(r_pred.label_ids, h_pred.label_ids)


# ---------------------------------------------------------------- 5. preprocess_logits_for_metrics
def test_preprocess_logits_for_metrics_per_batch_like_hf(tmp_path):
    h, h_seen, h_received = scripts.preprocess_logits(*hf(), tmp_path / "hf")
    r, r_seen, r_received = scripts.preprocess_logits(*rt(), tmp_path / "rt")
    assert r_seen == h_seen == [(4, 2)] * 4  # per batch, raw logits
    assert r_received == h_received == [((16,), "i")]
    assert r["eval_accuracy"] == h["eval_accuracy"]
    assert r["eval_loss"] == pytest.approx(h["eval_loss"], rel=1e-5)


# ---------------------------------------------------------------- 6. train() twice
def test_train_twice_works_and_archives_first_run(tmp_path, caplog):
    h, h1, h2 = scripts.train_twice(*hf(), tmp_path / "hf")
    with caplog.at_level(logging.WARNING):
        r, r1, r2 = scripts.train_twice(*rt(), tmp_path / "rt")
    assert r1.global_step == h1.global_step and r2.global_step == h2.global_step == 4
    assert r.state.global_step == h.state.global_step
    assert scripts.checkpoints(tmp_path / "rt") == scripts.checkpoints(tmp_path / "hf")
    archive = tmp_path / "rt" / "previous-run-1"
    assert sorted(os.listdir(archive)) == ["checkpoint-2", "checkpoint-4"]
    assert any("previous-run-1" in rec.getMessage() and "checkpoint-2" in rec.getMessage()
               for rec in caplog.records if rec.levelno == logging.WARNING)


# ---------------------------------------------------------------- 7. resume with a changed batch size
def test_resume_with_changed_batch_size_warns_and_reaches_max_steps(tmp_path, caplog):
    Trainer, TrainingArguments = rt()

    def args(bs, max_steps):
        return TrainingArguments(str(tmp_path), max_steps=max_steps, per_device_train_batch_size=bs,
                                 save_strategy="steps", save_steps=2, learning_rate=1e-2, **scripts.COMMON)

    Trainer(model=scripts.TinyRegressor(), args=args(8, 2), train_dataset=scripts.regression_data()).train()
    trainer = Trainer(model=scripts.TinyRegressor(), args=args(4, 6), train_dataset=scripts.regression_data())
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        out = trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert out.global_step == 6 and trainer.state.global_step == 6
    assert any(rec.name == "raytrain.worker.resume" and rec.levelno == logging.WARNING and "checkpoint-2" in rec.getMessage()
               and "batch_size 8 -> 4" in rec.getMessage()
               for rec in caplog.records), [rec.getMessage() for rec in caplog.records]


# ---------------------------------------------------------------- 8. final-step evaluation event order
@pytest.mark.parametrize("kw", [{}, {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
                                      "per_device_eval_batch_size": 8}], ids=["plain", "accumulation"])
def test_event_order_matches_hf_with_final_step_evaluation(tmp_path, kw):
    _, h_events = scripts.event_order(*hf(), scripts.hf_callback_base(), tmp_path / "hf", **kw)
    _, r_events = scripts.event_order(*rt(), scripts.rt_callback_base(), tmp_path / "rt", **kw)
    assert ("on_evaluate", 5) in h_events  # the final step (5, not a multiple of 2) is evaluated
    assert r_events == h_events


# ---------------------------------------------------------------- 9. rotation
def test_rotation_with_best_checkpoint_keeps_what_hf_keeps(tmp_path):
    h, h_kept = scripts.rotation(*hf(), tmp_path / "hf")
    r, r_kept = scripts.rotation(*rt(), tmp_path / "rt")
    assert len(h_kept) <= 2
    assert r_kept == h_kept
    assert "checkpoint-2" in r_kept  # the best (score 0.9) survives rotation
    assert os.path.basename(r.state.best_model_checkpoint) == os.path.basename(h.state.best_model_checkpoint)


# ---------------------------------------------------------------- 10. IterableDataset
def test_iterable_dataset_max_steps_sees_every_id_once_per_pass_in_order(tmp_path):
    h, h_seen = scripts.iterable(*hf(), tmp_path / "hf")
    r, r_seen = scripts.iterable(*rt(), tmp_path / "rt")
    assert r.state.global_step == 12
    assert r_seen == list(range(24)) * 2
    assert r_seen == h_seen


def test_iterable_source_shards_disjoint_and_complete_for_two_ranks():
    from raytrain.data.loaders import IterableSource

    n, batch = 24, 3
    ranks = []
    for rank in range(2):
        src = IterableSource(scripts.Stream(n), batch, rank=rank, world_size=2)
        ids = [i for b in src.iter_batches(0) for i in b["idx"].tolist()]
        assert all(len(b["idx"]) == batch for b in src.iter_batches(0))
        ranks.append(ids)
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(n))
    assert len(ranks[0]) == len(ranks[1]) == n // 2


# ---------------------------------------------------------------- 12. label smoothing and eval_on_start
def test_label_smoothing_first_loss_and_eval_on_start_match_hf(tmp_path):
    h = scripts.label_smoothing(*hf(), tmp_path / "hf")
    r = scripts.label_smoothing(*rt(), tmp_path / "rt")
    first = lambda t: next(e for e in t.state.log_history if "loss" in e)  # noqa: E731
    assert first(r)["step"] == first(h)["step"] == 1
    assert first(r)["loss"] == pytest.approx(first(h)["loss"], rel=1e-4)
    start = lambda t: [e for e in t.state.log_history if "eval_loss" in e and e["step"] == 0]  # noqa: E731
    assert len(start(h)) == 1 and len(start(r)) == 1
    assert start(r)[0]["eval_loss"] == pytest.approx(start(h)[0]["eval_loss"], rel=1e-4)


# ---------------------------------------------------------------- 13. dict of eval datasets
def test_evaluate_dict_of_datasets_prefixes_like_hf(tmp_path):
    h = scripts.eval_dict(*hf(), tmp_path / "hf")
    r = scripts.eval_dict(*rt(), tmp_path / "rt")
    assert scripts.metric_keys(r) == scripts.metric_keys(h)
    assert {"eval_a_loss", "eval_a_accuracy", "eval_b_loss", "eval_b_accuracy"} <= set(r)
    for k in ("eval_a_loss", "eval_b_loss", "eval_a_accuracy", "eval_b_accuracy"):
        assert r[k] == pytest.approx(h[k], rel=1e-5)


def test_periodic_evaluation_on_a_dict_with_best_metric_naming_one_like_hf(tmp_path):
    h = scripts.eval_dict_periodic(*hf(), tmp_path / "hf")
    r = scripts.eval_dict_periodic(*rt(), tmp_path / "rt")
    assert _keys(r.state.log_history) == _keys(h.state.log_history)
    assert any("eval_b_loss" in e for e in r.state.log_history)
    assert r.state.best_metric == pytest.approx(h.state.best_metric, rel=1e-5)
    assert os.path.basename(r.state.best_model_checkpoint) == os.path.basename(h.state.best_model_checkpoint)


def test_evaluate_returns_epoch_like_hf(tmp_path):
    h = scripts.eval_dict(*hf(), tmp_path / "hf")
    r = scripts.eval_dict(*rt(), tmp_path / "rt")
    assert "epoch" in h
    assert r.get("epoch") == h["epoch"]


def test_predict_lists_and_torch_format_and_metrics_files_like_hf(tmp_path):
    h_lists, h_torch, h_files = scripts.predict_and_save_metrics(*hf(), tmp_path / "hf")
    r_lists, r_torch, r_files = scripts.predict_and_save_metrics(*rt(), tmp_path / "rt")
    for h, r in ((h_lists, r_lists), (h_torch, r_torch)):
        assert scripts.np_close(r.predictions, h.predictions)
        assert (r.label_ids == h.label_ids).all()
        assert scripts.metric_keys(r.metrics) == scripts.metric_keys(h.metrics)
    assert r_files == h_files == ["all_results.json", "test_results.json", "trainer_state.json"]


# ---------------------------------------------------------------- 14. dataloader workers
def test_dataloader_workers_give_the_same_losses(tmp_path):
    from transformers import DataCollatorWithPadding

    Trainer, TrainingArguments = rt()
    tok, train, _ = scripts.tokenized_classification()
    losses = []
    for workers in (0, 2):
        args = TrainingArguments(str(tmp_path / str(workers)), max_steps=4, per_device_train_batch_size=8,
                                 dataloader_num_workers=workers, logging_steps=1, save_strategy="no",
                                 learning_rate=1e-3, **scripts.COMMON)
        trainer = Trainer(model=scripts.bert(tok), args=args, train_dataset=train, processing_class=tok,
                          data_collator=DataCollatorWithPadding(tok))
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(losses[0]) == 4
    assert losses[1] == losses[0]
