"""HF Trainer behaviours without transformers: eval_delay, batch_eval_metrics, memory metrics per stage,
auto_find_batch_size on a CUDA out-of-memory RuntimeError, re-saved weights, optimizer_cls_and_kwargs,
overridden get_train_dataloader, metrics files and restore_callback_states_from_checkpoint."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from raytrain import EarlyStoppingCallback, Trainer, TrainerCallback
from raytrain.checkpoint.store import CheckpointError
from tests.tiny import StopAt, TinyClassifier, args_for, columns, logged, rows


class Events(TrainerCallback):
    def __init__(self):
        self.evaluated: list[int] = []

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluated.append(state.global_step)


def test_eval_delay_and_eval_on_start(tmp_path):
    ev = Events()
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=10, per_device_train_batch_size=4,
                                                 eval_strategy="steps", eval_steps=2, eval_delay=5,
                                                 eval_on_start=True, save_strategy="no"),
                      train_dataset=columns(16), eval_dataset=columns(4, seed=1), callbacks=[ev])
    trainer.train()
    assert ev.evaluated == [0, 6, 8, 10]  # the sanity check at 0, then none before step 5


def test_batch_eval_metrics_calls_compute_metrics_per_batch(tmp_path):
    calls = []

    def metrics(pred, compute_result):
        calls.append((pred.predictions.shape[0], compute_result))
        return {"seen": float(sum(n for n, _ in calls))} if compute_result else {}

    trainer = Trainer(TinyClassifier(), args_for(tmp_path, per_device_eval_batch_size=4, batch_eval_metrics=True),
                      compute_metrics=metrics)
    out = trainer.evaluate(columns(10, seed=1))
    assert calls == [(4, False), (4, False), (2, True)]
    assert out["eval_seen"] == 10.0 and "eval_loss" in out


def test_an_iterable_dataset_with_no_length_evaluates_and_predicts_as_hf(tmp_path):
    """evaluate() and predict() on an IterableDataset with no __len__: the same loss and metric keys as on the
    map-style dataset (and as transformers' Trainer), the predictions of every sample, and batch_eval_metrics'
    compute_result=True on the last batch only."""
    import transformers
    from torch.utils.data import IterableDataset


    class Stream(IterableDataset):
        def __iter__(self):
            return iter(rows(10, seed=1))

    calls = []

    def metrics(pred, compute_result=None):
        if compute_result is None:
            return {"n": float(len(pred.predictions))}
        calls.append((len(pred.predictions), compute_result))
        return {"n": float(sum(n for n, _ in calls))} if compute_result else {}

    trainer = Trainer(TinyClassifier(), args_for(tmp_path, per_device_eval_batch_size=4), compute_metrics=metrics)
    plain = trainer.evaluate(rows(10, seed=1))
    streamed = trainer.evaluate(Stream())
    assert streamed["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6) and streamed["eval_n"] == 10.0
    hf = transformers.Trainer(trainer.model, transformers.TrainingArguments(str(tmp_path / "hf"), report_to="none",
                              per_device_eval_batch_size=4), compute_metrics=metrics)
    theirs = hf.evaluate(Stream())
    assert set(streamed) == set(theirs) and streamed["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)
    out = trainer.predict(Stream())
    assert out.predictions.shape == (10, 3) and out.label_ids.shape == (10,)
    assert out.metrics["test_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
    trainer.args.batch_eval_metrics = True
    trainer.evaluate(Stream())
    assert calls == [(4, False), (4, False), (2, True)]


def test_memory_metrics_for_each_stage(tmp_path):
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=2, skip_memory_metrics=False,
                                                 save_strategy="no"), train_dataset=columns(16))
    metrics = trainer.train().metrics
    for stage in ("init", "train"):  # init's are reported with the first stage run, as HF
        assert isinstance(metrics[f"{stage}_mem_cpu_alloc_delta"], int)
        assert metrics[f"{stage}_mem_cpu_peaked_delta"] >= 0
    ev = trainer.evaluate(columns(8))
    assert "eval_mem_cpu_alloc_delta" in ev and "init_mem_cpu_alloc_delta" not in ev
    assert "test_mem_cpu_alloc_delta" in trainer.predict(columns(8)).metrics


class OomAbove(TinyClassifier):
    """Raises what CUDA raises when a batch is larger than `limit`."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def forward(self, x, labels=None):
        if x.shape[0] > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x, labels)


def test_auto_find_batch_size_retries_on_a_cuda_oom_runtime_error(tmp_path, caplog):
    trainer = Trainer(OomAbove(4), args_for(tmp_path, max_steps=2, per_device_train_batch_size=16,
                                            auto_find_batch_size=True, save_strategy="no"),
                      train_dataset=columns(32))
    with logged("transformers.trainer", logging.WARNING) as records:
        assert trainer.train().global_step == 2
    said = "".join(r.getMessage() for r in records)
    assert trainer._train_batch_size == 4 and trainer.state.train_batch_size == 4
    assert trainer.args.per_device_train_batch_size == 16  # as HF: the arguments stay as given
    assert [int(m) for m in re.findall(r"retrying with (\d+)", said)] == [14, 12, 10, 9, 8, 7, 6, 5, 4]
    with pytest.raises(RuntimeError, match="something else"):  # other errors are not retried
        class Broken(TinyClassifier):
            def forward(self, x, labels=None):
                raise RuntimeError("something else")
        Trainer(Broken(), args_for(tmp_path / "b", max_steps=1, auto_find_batch_size=True, save_strategy="no"),
                train_dataset=columns(8)).train()


def test_weights_resaved_by_another_tool_load_with_a_warning_only_when_named(tmp_path, caplog):
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=4, save_steps=2), train_dataset=columns(16))
    trainer.train()
    ck = os.path.join(trainer.args.output_dir, "checkpoint-2")
    weights = load_file(os.path.join(ck, "model.safetensors"))
    save_file(weights, os.path.join(ck, "model.safetensors"), metadata={"format": "pt"})  # as save_pretrained
    again = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=4, save_steps=2), train_dataset=columns(16))
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        assert again.train(resume_from_checkpoint=ck).global_step == 4
    assert "do not match the manifest" in caplog.text
    # raytrain's own weights that fail the manifest are corruption: refused, naming the file
    ck4 = os.path.join(trainer.args.output_dir, "checkpoint-4")
    raw = bytearray(open(os.path.join(ck4, "model.safetensors"), "rb").read())
    raw[-1] ^= 0xFF
    open(os.path.join(ck4, "model.safetensors"), "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=r"checkpoint-4/model\.safetensors: .*mismatch"):
        Trainer(TinyClassifier(), args_for(tmp_path, max_steps=6), train_dataset=columns(16)).train(
            resume_from_checkpoint=ck4)


def test_optimizer_cls_and_kwargs_and_learning_rates(tmp_path):
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=1, save_strategy="no", weight_decay=0.1),
                      train_dataset=columns(8), optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.3}))
    trainer.train()
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]  # biases not decayed
    assert len(trainer.get_learning_rates()) == 2
    with pytest.raises(ValueError, match="either optimizers or optimizer_cls_and_kwargs"):
        model = TinyClassifier()
        Trainer(model, args_for(tmp_path), optimizers=(torch.optim.SGD(model.parameters(), lr=1), None),
                optimizer_cls_and_kwargs=(torch.optim.SGD, {}))


def test_overridden_get_train_dataloader_is_used_and_resumes_by_replay(tmp_path):
    data = columns(24)
    batches = [{k: v[i:i + 4] for k, v in data.items()} for i in range(0, 24, 4)]

    class Custom(Trainer):
        def get_train_dataloader(self):
            return batches  # any iterable of batches, as a DataLoader would be

    class Recording(TinyClassifier):
        trained: list[int] = []

        def forward(self, x, labels=None):
            if self.training:
                self.trained.append(next(i for i, b in enumerate(batches) if torch.equal(b["x"], x)))
            return super().forward(x, labels)

    Custom(Recording(), args_for(tmp_path, max_steps=6, save_steps=3), train_dataset=data,
           callbacks=[StopAt(3)]).train()
    assert Recording.trained == [0, 1, 2]
    Recording.trained.clear()
    resumed = Custom(Recording(), args_for(tmp_path, max_steps=6, save_steps=3), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6 and Recording.trained == [3, 4, 5]


def test_log_metrics_save_metrics_and_save_state(tmp_path, capsys):
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=2, save_strategy="no"), train_dataset=columns(8))
    metrics = trainer.train().metrics
    capsys.readouterr()  # the PrinterCallback's log lines
    trainer.log_metrics("train", metrics)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "***** train metrics *****" and "train_loss" in out
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 1.5})
    out_dir = trainer.args.output_dir
    assert json.load(open(os.path.join(out_dir, "train_results.json")))["train_loss"] == metrics["train_loss"]
    assert json.load(open(os.path.join(out_dir, "all_results.json")))["eval_loss"] == 1.5
    trainer.save_state()
    assert json.load(open(os.path.join(out_dir, "trainer_state.json")))["global_step"] == 2
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    assert trainer.get_num_trainable_parameters() == 4 * 3 + 3


def test_restore_callback_states_from_checkpoint_brings_back_constructor_arguments(tmp_path):
    scores = iter([0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    kw = dict(max_steps=12, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=2, save_steps=2,
              metric_for_best_model="score", greater_is_better=True)
    t = Trainer(TinyClassifier(), args_for(tmp_path, **kw), train_dataset=columns(16),
                eval_dataset=columns(4, seed=1), compute_metrics=lambda p: {"score": next(scores)},
                callbacks=[EarlyStoppingCallback(early_stopping_patience=5), StopAt(4)])
    t.train()
    ck = os.path.join(t.args.output_dir, "checkpoint-4")
    for restore, patience in ((False, 1), (True, 5)):
        r = Trainer(TinyClassifier(), args_for(tmp_path, restore_callback_states_from_checkpoint=restore, **kw),
                    train_dataset=columns(16), eval_dataset=columns(4, seed=1),
                    compute_metrics=lambda p: {"score": 0.0}, callbacks=[EarlyStoppingCallback(1), StopAt(4)])
        r.train(resume_from_checkpoint=ck)
        early = next(cb for cb in r.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback))
        assert early.early_stopping_patience == patience
        assert early.early_stopping_patience_counter == 1  # the attributes come back either way


def test_overridden_create_optimizer_and_scheduler_is_called_with_the_step_count(tmp_path):
    class Custom(Trainer):
        steps_seen: list[int] = []

        def create_optimizer_and_scheduler(self, num_training_steps):
            self.steps_seen.append(num_training_steps)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2)
            self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=100)

    t = Custom(TinyClassifier(), args_for(tmp_path, num_train_epochs=2, per_device_train_batch_size=4,
                                          save_strategy="no"), train_dataset=columns(16))
    t.train()
    assert Custom.steps_seen == [8] and isinstance(t.optimizer, torch.optim.SGD)
    assert t.get_learning_rates() == [0.2]
