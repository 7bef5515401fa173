"""An HF-style script, unchanged but for its import, on 2 Ray Train workers (DDP on CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from . import corpus

pytestmark = pytest.mark.ray


@pytest.mark.timeout(300)
def test_hf_classification_script_on_two_ray_workers(ray_cluster, tmp_path):
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification, DataCollatorWithPadding

    from raytrain import Trainer, TrainingArguments

    tok = corpus.tokenizer()
    ds = corpus.classification_dataset(64).train_test_split(test_size=0.25, seed=0)
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=32), batched=True)
    torch.manual_seed(0)
    model = BertForSequenceClassification(corpus.bert_config(len(tok)))

    def compute_metrics(p):
        return {"accuracy": float((np.argmax(p.predictions, axis=-1) == p.label_ids).mean())}

    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-3,
                             eval_strategy="steps", eval_steps=2, save_steps=2, report_to="none", use_cpu=True,
                             disable_tqdm=True, scaling={"num_workers": 2})
    trainer = Trainer(model=model, args=args, train_dataset=ds["train"], eval_dataset=ds["test"],
                      data_collator=DataCollatorWithPadding(tok), processing_class=tok,
                      compute_metrics=compute_metrics)
    out = trainer.train()
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
