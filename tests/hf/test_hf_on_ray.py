"""An HF-style script, unchanged but for its import, on 2 Ray Train workers (DDP on CPU): its trainer shipped as
Trainer.train ships it, in the session's worker group (conftest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from . import corpus

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("worker_group")]

_SHIPPED: dict = {}


def group_part(root):
    """The script's run in the session's worker group (conftest.py), shipped as Trainer.train ships it."""
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    from raytrain import Trainer, TrainingArguments
    from tests.group import ship

    tok = corpus.tokenizer()
    ds = corpus.classification_dataset(64).train_test_split(test_size=0.25, seed=0)
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=32), batched=True)
    torch.manual_seed(0)
    model = BertForSequenceClassification(corpus.bert_config(len(tok)))

    def compute_metrics(p):  # defined here: pickled by value for the workers, as a script's own function is
        return {"accuracy": float((np.argmax(p.predictions, axis=-1) == p.label_ids).mean())}

    args = TrainingArguments(str(root / "out"), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-3,
                             eval_strategy="steps", eval_steps=2, save_steps=2, report_to="none", use_cpu=True,
                             disable_tqdm=True, scaling={"num_workers": 2})
    trainer = Trainer(model=model, args=args, train_dataset=ds["train"], eval_dataset=ds["test"],
                      data_collator=DataCollatorWithPadding(tok), processing_class=tok,
                      compute_metrics=compute_metrics)
    _SHIPPED["classification"] = trainer, tok, ds
    return "tests.group:run_cases", {"cases": {"classification": ship(trainer, "classification")}}


@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
def test_hf_classification_script_on_two_ray_workers(worker_group, tmp_path):
    """On 2 Ray workers (the session's worker group), then in the driver's trainer as Trainer.train leaves it."""
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification, DataCollatorWithPadding

    from tests.group import land, part

    _, values = part(worker_group, __file__)
    trainer, tok, ds = _SHIPPED["classification"]
    args, compute_metrics = trainer.args, trainer.compute_metrics
    out = land(trainer, values["classification"])
    assert out.global_step == 4
    evals = [h for h in trainer.state.log_history if "eval_accuracy" in h]
    assert [h["step"] for h in evals] == [2, 4]
    ck = os.path.join(args.output_dir, "checkpoint-4")
    assert {"config.json", "tokenizer.json", "training_args.bin", "rng_state_0.pth", "rng_state_1.pth"} <= \
        set(os.listdir(ck))
    reloaded = AutoModelForSequenceClassification.from_pretrained(ck).eval()
    trainer.model.eval()
    batch = tok(["a short sentence, with a comma"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, trainer.model(**batch).logits)

    # evaluate() / predict() on the driver after the workers trained: HF's keys, without
    # {prefix}_model_preparation_time (HF adds it only for a model prepared for evaluation alone)
    import transformers

    ours = (set(trainer.evaluate()), set(trainer.predict(ds["test"]).metrics))
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), per_device_train_batch_size=8, max_steps=4,
                                             learning_rate=1e-3, save_strategy="no", report_to="none", use_cpu=True,
                                             disable_tqdm=True)
    hf = transformers.Trainer(model=BertForSequenceClassification(corpus.bert_config(len(tok))), args=hf_args,
                              train_dataset=ds["train"], eval_dataset=ds["test"], data_collator=DataCollatorWithPadding(tok),
                              processing_class=tok, compute_metrics=compute_metrics)
    hf.train()
    assert ours == (set(hf.evaluate()), set(hf.predict(ds["test"]).metrics))
    assert "eval_model_preparation_time" not in ours[0] and "test_model_preparation_time" not in ours[1]
