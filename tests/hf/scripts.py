"""HF-style training scripts, each written once as a function of (Trainer, TrainingArguments[, ...]).

A test runs a script with `from transformers import Trainer, TrainingArguments` (the oracle) and with
`from raytrain import Trainer, TrainingArguments` and compares what they produce.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from . import corpus

COMMON = dict(use_cpu=True, report_to="none", disable_tqdm=True, seed=0)


def hf():
    import transformers

    return transformers.Trainer, transformers.TrainingArguments


def rt():
    import raytrain

    return raytrain.Trainer, raytrain.TrainingArguments


def hf_callback_base():
    import transformers

    return transformers.TrainerCallback


def rt_callback_base():
    import raytrain

    return raytrain.TrainerCallback


LIBS = {"hf": (hf, hf_callback_base), "rt": (rt, rt_callback_base)}


# ---------------------------------------------------------------- data and models
def tokenized_classification(n: int = 64, max_length: int = 32):
    """(tokenizer, train, eval): a datasets.Dataset mapped through the tokenizer (text column kept, as
    scripts do; remove_unused_columns drops it)."""
    tok = corpus.tokenizer()
    ds = corpus.classification_dataset(n)
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=max_length), batched=True)
    split = ds.train_test_split(test_size=16, seed=0)
    return tok, split["train"], split["test"]


def bert(tok, seed: int = 0, dropout: float = 0.0):
    from transformers import BertForSequenceClassification

    cfg = corpus.bert_config(len(tok))
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
    torch.manual_seed(seed)
    return BertForSequenceClassification(cfg)


def accuracy(p) -> dict:
    preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
    if preds.ndim > 1:
        preds = preds.argmax(-1)
    return {"accuracy": float((preds == p.label_ids).mean())}


class TinyRegressor(torch.nn.Module):
    """A plain nn.Module returning a dict (loss, logits)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.lin(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


def regression_data(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    ds = Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()})
    ds.set_format("torch")
    return ds


def checkpoints(out) -> list[str]:
    return sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))


# ---------------------------------------------------------------- 1. classification
def classification(Trainer, TrainingArguments, out, **kw):
    from transformers import DataCollatorWithPadding

    tok, train, test = tokenized_classification()
    args = TrainingArguments(str(out), eval_strategy="epoch", save_strategy="epoch", num_train_epochs=2,
                             per_device_train_batch_size=16, per_device_eval_batch_size=16, learning_rate=1e-3,
                             logging_steps=1, **COMMON, **kw)
    trainer = Trainer(model=bert(tok), args=args, train_dataset=train, eval_dataset=test, processing_class=tok,
                      data_collator=DataCollatorWithPadding(tok), compute_metrics=accuracy)
    trainer.train()
    trainer.save_model(os.path.join(str(out), "final"))
    return trainer, tok, test


# ---------------------------------------------------------------- 2. causal LM
def causal_lm(Trainer, TrainingArguments, out):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, GPT2LMHeadModel

    tok = corpus.tokenizer()
    ds = Dataset.from_dict({"text": corpus.sentences()[:48]})
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=24), batched=True, remove_columns=["text"])
    train, test = ds.select(range(40)), ds.select(range(40, 48))
    cfg = corpus.gpt2_config(len(tok))
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(str(out), max_steps=4, per_device_train_batch_size=8, per_device_eval_batch_size=4,
                             learning_rate=1e-3, save_strategy="no", logging_steps=1, **COMMON)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=test, processing_class=tok,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(test)
    trainer.save_model(os.path.join(str(out), "final"))
    return trainer, metrics, pred


# ---------------------------------------------------------------- 4. tuple outputs
class TupleModel(torch.nn.Module):
    """Token tagging returning (loss, logits) or (loss, logits, hidden)."""

    def __init__(self, hidden_out: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 3)
        self.hidden_out = hidden_out

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1), ignore_index=-100)
        return (loss, logits, h) if self.hidden_out else (loss, logits)


def tagging_data():
    """12 sequences: the first 4 of length 3, the next 4 of length 5, the last 4 of length 2 (batch 4)."""
    rows = []
    for i in range(12):
        n = (3, 5, 2)[i // 4]
        ids = [(i + j) % 20 for j in range(n)]
        rows.append({"input_ids": ids, "labels": [t % 3 for t in ids]})
    return rows


class TaggingData(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = tagging_data()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def pad_collate(rows):
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows])
    return {"input_ids": ids, "labels": labels}


def tuple_outputs(Trainer, TrainingArguments, out, hidden_out: bool):
    args = TrainingArguments(str(out), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             save_strategy="no", learning_rate=1e-2, **COMMON)
    trainer = Trainer(model=TupleModel(hidden_out), args=args, train_dataset=TaggingData(),
                      data_collator=pad_collate)
    before = trainer.predict(TaggingData())  # untrained: comparable with HF whatever the shuffle order
    result = trainer.train()
    after = trainer.predict(TaggingData())
    return trainer, result, before, after


# ---------------------------------------------------------------- 5. preprocess_logits_for_metrics
def preprocess_logits(Trainer, TrainingArguments, out):
    from transformers import DataCollatorWithPadding

    tok, train, test = tokenized_classification()
    seen = []

    def argmax(logits, labels):
        seen.append(tuple(logits.shape))
        return logits.argmax(-1)

    received = []

    def metrics(p):
        received.append((p.predictions.shape, p.predictions.dtype.kind))
        return accuracy(p)

    args = TrainingArguments(str(out), per_device_eval_batch_size=4, **COMMON)
    trainer = Trainer(model=bert(tok), args=args, eval_dataset=test, processing_class=tok,
                      data_collator=DataCollatorWithPadding(tok), compute_metrics=metrics,
                      preprocess_logits_for_metrics=argmax)
    result = trainer.evaluate()
    return result, seen, received


# ---------------------------------------------------------------- 6. train() twice
def train_twice(Trainer, TrainingArguments, out):
    args = TrainingArguments(str(out), max_steps=4, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=8, learning_rate=1e-2, **COMMON)
    trainer = Trainer(model=TinyRegressor(), args=args, train_dataset=regression_data())
    first = trainer.train()
    second = trainer.train()
    return trainer, first, second


# ---------------------------------------------------------------- 8. event order
EVENTS = ["on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate",
          "on_predict", "on_save", "on_log", "on_prediction_step"]


def recorder_class(base):
    """The same callback body, subclassing one library's TrainerCallback."""

    class Recorder(base):
        def __init__(self):
            self.events = []

    for name in EVENTS:
        def record(self, args, state, control, _name=name, **kw):
            self.events.append((_name, state.global_step))
        setattr(Recorder, name, record)
    return Recorder


def event_order(Trainer, TrainingArguments, callback_base, out, **kw):
    rec = recorder_class(callback_base)()
    kw = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 16, **kw}
    args = TrainingArguments(str(out), max_steps=5, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                             save_steps=2, logging_steps=2, learning_rate=1e-2, **COMMON, **kw)
    trainer = Trainer(model=TinyRegressor(), args=args, train_dataset=regression_data(),
                      eval_dataset=regression_data(16), callbacks=[rec])
    trainer.train()
    return trainer, rec.events


# ---------------------------------------------------------------- 9. rotation with a best checkpoint
def rotation(Trainer, TrainingArguments, out, scores=(0.5, 0.9, 0.3, 0.2, 0.1)):
    calls = iter(scores)

    def scripted(p):
        return {"score": next(calls)}

    args = TrainingArguments(str(out), max_steps=len(scores), eval_strategy="steps", eval_steps=1,
                             save_strategy="steps", save_steps=1, save_total_limit=2, load_best_model_at_end=True,
                             metric_for_best_model="score", greater_is_better=True, per_device_train_batch_size=8,
                             per_device_eval_batch_size=16, learning_rate=1e-2, **COMMON)
    trainer = Trainer(model=TinyRegressor(), args=args, train_dataset=regression_data(),
                      eval_dataset=regression_data(16), compute_metrics=scripted)
    trainer.train()
    return trainer, checkpoints(out)


# ---------------------------------------------------------------- 10. IterableDataset
class Stream(torch.utils.data.IterableDataset):
    """n items with ids 0..n-1, in order."""

    def __init__(self, n: int = 24):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(self.n):
            x = torch.randn(4, generator=g)
            yield {"x": x, "labels": x.sum(), "idx": torch.tensor(i)}


class IdRecorder(TinyRegressor):
    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x, labels=None, idx=None):
        if self.training and idx is not None:
            self.seen.extend(idx.tolist())
        return super().forward(x, labels)


def iterable(Trainer, TrainingArguments, out, n=24, batch=4, max_steps=12):
    model = IdRecorder()
    args = TrainingArguments(str(out), max_steps=max_steps, per_device_train_batch_size=batch,
                             save_strategy="no", learning_rate=1e-2, **COMMON)
    trainer = Trainer(model=model, args=args, train_dataset=Stream(n))
    trainer.train()
    return trainer, model.seen


# ---------------------------------------------------------------- 12. label smoothing + eval_on_start
def label_smoothing(Trainer, TrainingArguments, out):
    from transformers import DataCollatorWithPadding

    tok, train, test = tokenized_classification()
    args = TrainingArguments(str(out), max_steps=1, per_device_train_batch_size=len(train),
                             per_device_eval_batch_size=16, label_smoothing_factor=0.1, eval_on_start=True,
                             eval_strategy="steps", eval_steps=1, save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, **COMMON)
    trainer = Trainer(model=bert(tok), args=args, train_dataset=train, eval_dataset=test, processing_class=tok,
                      data_collator=DataCollatorWithPadding(tok))
    trainer.train()
    return trainer


# ---------------------------------------------------------------- 13. dict of eval datasets
def eval_dict(Trainer, TrainingArguments, out):
    from transformers import DataCollatorWithPadding

    tok, train, test = tokenized_classification()
    args = TrainingArguments(str(out), per_device_eval_batch_size=8, **COMMON)
    trainer = Trainer(model=bert(tok), args=args, processing_class=tok, data_collator=DataCollatorWithPadding(tok),
                      compute_metrics=accuracy)
    return trainer.evaluate({"a": test, "b": train.select(range(8))})


# accelerate's timing of model preparation (HF only) and the epoch HF's log() adds into evaluate()'s dict
NOT_COMPARED = ("model_preparation_time", "epoch")


def metric_keys(metrics: dict) -> list[str]:
    return sorted(k for k in metrics if not k.endswith(NOT_COMPARED))


def eval_dict_periodic(Trainer, TrainingArguments, out):
    """eval_dataset= a dict for periodic evaluation; metric_for_best_model names one of its metrics. The
    whole train set is one batch, so the data order does not matter and metrics compare exactly."""
    args = TrainingArguments(str(out), max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                             save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_b_loss",
                             per_device_train_batch_size=32, per_device_eval_batch_size=8, learning_rate=1e-2,
                             logging_steps=2, **COMMON)
    trainer = Trainer(model=TinyRegressor(), args=args, train_dataset=regression_data(),
                      eval_dataset={"a": regression_data(16), "b": regression_data(8)})
    trainer.train()
    return trainer


def predict_and_save_metrics(Trainer, TrainingArguments, out):
    """predict() on a mapped datasets.Dataset as plain lists and with set_format("torch"); then
    log_metrics / save_metrics / save_state as HF's example scripts do."""
    from transformers import DataCollatorWithPadding

    tok, _, test = tokenized_classification()
    args = TrainingArguments(str(out), per_device_eval_batch_size=8, **COMMON)
    trainer = Trainer(model=bert(tok), args=args, processing_class=tok, data_collator=DataCollatorWithPadding(tok),
                      compute_metrics=accuracy)
    lists = trainer.predict(test)
    torch_format = trainer.predict(test.with_format("torch"))
    trainer.log_metrics("test", lists.metrics)
    trainer.save_metrics("test", lists.metrics)
    trainer.save_state()
    return lists, torch_format, sorted(os.listdir(out))


def np_close(a, b):
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(np_close(x, y) for x, y in zip(a, b))
    return np.asarray(a).shape == np.asarray(b).shape and np.allclose(a, b, atol=1e-5)
