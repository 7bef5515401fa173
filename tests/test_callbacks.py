"""Callback events in HF Trainer's order, what callbacks receive, and EarlyStoppingCallback."""

from __future__ import annotations

import ast
import os

import pytest
import torch

from tests.tiny import TinyClassifier, args_for, columns, rows
from raytrain import EarlyStoppingCallback, Trainer, TrainerCallback, TrainerState
from raytrain.callbacks import EVENTS


class Recorder(TrainerCallback):
    """Records (event, global_step) for every event, and the kwargs of each call."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.kwargs: list[tuple[str, dict]] = []


def _record(name):
    def method(self, args, state, control, **kwargs):
        self.events.append((name, state.global_step))
        self.kwargs.append((name, kwargs))
    return method


for _name in EVENTS:
    setattr(Recorder, _name, _record(_name))


# ---------------------------------------------------------------- event order


def test_event_sequence_matches_hugging_face(tmp_path):
    # 16 samples / batch 2 = 8 micro-batches per epoch; GA 2 -> 4 update steps per epoch, 8 in all.
    # log every 2 steps, evaluate every 3 (eval set of 5 at batch 2 = 3 prediction steps), save every 3
    # (and at the end). Steps 3 and 6 fall mid-epoch.
    args = args_for(tmp_path, num_train_epochs=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    per_device_eval_batch_size=2, logging_steps=2, eval_strategy="steps", eval_steps=3,
                    save_strategy="steps", save_steps=3, learning_rate=0.1)
    rec = Recorder()
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16), eval_dataset=columns(5, seed=1),
                      callbacks=[rec])
    trainer.train()
    trainer.predict(columns(5, seed=1))

    # (event, global_step when it fires); on_substep_end after every micro-batch but the last
    expected = [
        ("on_init_end", 0),
        ("on_train_begin", 0),
        ("on_epoch_begin", 0),
        ("on_step_begin", 0), ("on_substep_end", 0), ("on_pre_optimizer_step", 0), ("on_optimizer_step", 0),
        ("on_step_end", 1),
        ("on_step_begin", 1), ("on_substep_end", 1), ("on_pre_optimizer_step", 1), ("on_optimizer_step", 1),
        ("on_step_end", 2),
        ("on_log", 2),
        ("on_step_begin", 2), ("on_substep_end", 2), ("on_pre_optimizer_step", 2), ("on_optimizer_step", 2),
        ("on_step_end", 3),
        ("on_prediction_step", 3), ("on_prediction_step", 3), ("on_prediction_step", 3),
        ("on_log", 3), ("on_evaluate", 3),
        ("on_save", 3),
        ("on_step_begin", 3), ("on_substep_end", 3), ("on_pre_optimizer_step", 3), ("on_optimizer_step", 3),
        ("on_step_end", 4),
        ("on_log", 4),
        ("on_epoch_end", 4),
        ("on_epoch_begin", 4),
        ("on_step_begin", 4), ("on_substep_end", 4), ("on_pre_optimizer_step", 4), ("on_optimizer_step", 4),
        ("on_step_end", 5),
        ("on_step_begin", 5), ("on_substep_end", 5), ("on_pre_optimizer_step", 5), ("on_optimizer_step", 5),
        ("on_step_end", 6),
        ("on_log", 6),
        ("on_prediction_step", 6), ("on_prediction_step", 6), ("on_prediction_step", 6),
        ("on_log", 6), ("on_evaluate", 6),
        ("on_save", 6),
        ("on_step_begin", 6), ("on_substep_end", 6), ("on_pre_optimizer_step", 6), ("on_optimizer_step", 6),
        ("on_step_end", 7),
        ("on_step_begin", 7), ("on_substep_end", 7), ("on_pre_optimizer_step", 7), ("on_optimizer_step", 7),
        ("on_step_end", 8),
        ("on_log", 8),
        # the last step is always evaluated (HF 5) and saved when a strategy is set
        ("on_prediction_step", 8), ("on_prediction_step", 8), ("on_prediction_step", 8),
        ("on_log", 8), ("on_evaluate", 8),
        ("on_save", 8),
        ("on_epoch_end", 8),
        ("on_log", 8),  # train metrics
        ("on_train_end", 8),
        # trainer.predict
        ("on_prediction_step", 8), ("on_prediction_step", 8), ("on_prediction_step", 8),
        ("on_predict", 8),
    ]
    assert rec.events == expected
    assert {name for name, _ in rec.events} == set(EVENTS)
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-3", "checkpoint-6", "checkpoint-8"]


def test_callbacks_receive_objects_metrics_and_logs(tmp_path):
    args = args_for(tmp_path, max_steps=4, per_device_train_batch_size=4, logging_steps=2, eval_strategy="steps",
                    eval_steps=2, save_strategy="no", learning_rate=0.1)
    rec = Recorder()
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16), eval_dataset=columns(6, seed=1),
                      callbacks=[rec])
    trainer.train()
    assert rec.kwargs[0][0] == "on_init_end" and rec.kwargs[0][1]["model"] is trainer.model
    for name, kw in rec.kwargs[1:]:  # from on_train_begin on, everything is set up
        assert kw["model"] is trainer.model, name
        assert kw["optimizer"] is trainer.optimizer and isinstance(kw["optimizer"], torch.optim.Optimizer), name
        assert kw["lr_scheduler"] is trainer.lr_scheduler and kw["lr_scheduler"] is not None, name
        assert kw["train_dataloader"] is not None and len(kw["train_dataloader"]) == 4, name
    evals = [kw for name, kw in rec.kwargs if name == "on_evaluate"]
    assert len(evals) == 2
    for kw in evals:
        assert {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(kw["metrics"])
        assert kw["eval_dataloader"] is not None
    logs = [kw["logs"] for name, kw in rec.kwargs if name == "on_log"]
    # on_log gets what log_history records, less the "step" key (as in HF)
    assert logs == [{k: v for k, v in h.items() if k != "step"} for h in trainer.state.log_history]
    assert [set(entry) for entry in logs[:1]] == [{"loss", "grad_norm", "learning_rate", "epoch"}]


def test_callback_can_stop_training_and_returned_control_is_used(tmp_path):
    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True
            return control

    args = args_for(tmp_path, max_steps=10, per_device_train_batch_size=4, save_strategy="no")
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16), callbacks=[StopAt])
    out = trainer.train()
    assert out.global_step == 3 == trainer.state.global_step


def test_add_pop_remove_callback(tmp_path):
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, save_strategy="no"))
    names = lambda: [type(cb).__name__ for cb in trainer.callback_handler.callbacks]  # noqa: E731
    assert names() == ["DefaultFlowCallback", "PrinterCallback"]
    rec = Recorder()
    trainer.add_callback(rec)
    trainer.add_callback(EarlyStoppingCallback)
    assert names() == ["DefaultFlowCallback", "PrinterCallback", "Recorder", "EarlyStoppingCallback"]
    assert trainer.pop_callback(Recorder) is rec
    trainer.remove_callback(EarlyStoppingCallback)
    assert names() == ["DefaultFlowCallback", "PrinterCallback"]


# ---------------------------------------------------------------- early stopping


def scripted_metric(values: dict[int, float], holder: dict):
    """compute_metrics returning values[global_step] of the trainer in holder["trainer"]."""
    def compute_metrics(pred):
        return {"score": values[holder["trainer"].state.global_step]}
    return compute_metrics


SCORES = {2: 0.5, 4: 0.6, 6: 0.7, 8: 0.65, 10: 0.6, 12: 0.9, 14: 0.9, 16: 0.9, 18: 0.9, 20: 0.9}


def early_stopping_trainer(tmp_path, **kw):
    args = args_for(tmp_path, max_steps=20, per_device_train_batch_size=4, logging_steps=2, eval_strategy="steps",
                    eval_steps=2, save_strategy="steps", save_steps=2, metric_for_best_model="score",
                    learning_rate=0.05, **kw)
    holder: dict = {}
    es = EarlyStoppingCallback(early_stopping_patience=2)
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16), eval_dataset=columns(4, seed=1),
                      compute_metrics=scripted_metric(SCORES, holder), callbacks=[es])
    holder["trainer"] = trainer
    return trainer, es


def test_early_stopping_stops_after_patience_and_state_survives_resume(tmp_path):
    trainer, es = early_stopping_trainer(tmp_path)
    trainer.train()
    # best 0.7 at step 6; no improvement at 8 (counter 1) and 10 (counter 2 = patience): stop at 10.
    assert trainer.state.global_step == 10 < trainer.state.max_steps == 20
    assert es.early_stopping_patience_counter == 2
    assert trainer.state.best_global_step == 6 and trainer.state.best_metric == 0.7

    saved = TrainerState.load_from_json(os.path.join(tmp_path, "out", "checkpoint-8", "trainer_state.json"))
    assert saved.stateful_callbacks["EarlyStoppingCallback"] == {
        "args": {"early_stopping_patience": 2, "early_stopping_threshold": 0.0},
        "attributes": {"early_stopping_patience_counter": 1},
    }

    # Resume at step 8 with a fresh callback: the restored counter (1) and the run's best (0.7, in
    # trainer_state.json) make step 10's 0.6 the second miss, so it stops at 10 again.
    trainer2, es2 = early_stopping_trainer(tmp_path)
    trainer2.train(resume_from_checkpoint=os.path.join(tmp_path, "out", "checkpoint-8"))
    assert trainer2.state.global_step == 10
    assert es2.early_stopping_patience_counter == 2 and trainer2.state.best_metric == 0.7


def test_early_stopping_threshold_counts_small_gains_as_misses(tmp_path):
    # 0.6 at step 4 and 0.7 at step 6 are within the threshold 0.25 of the best 0.5: misses -> stop at 6
    trainer, _ = early_stopping_trainer(tmp_path)
    es = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.25)
    trainer.pop_callback(EarlyStoppingCallback)
    trainer.add_callback(es)
    trainer.train()
    assert trainer.state.global_step == 6
    assert es.early_stopping_patience_counter == 2


def test_early_stopping_requires_metric_for_best_model(tmp_path):
    args = args_for(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="no")
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(8), eval_dataset=columns(4),
                      callbacks=[EarlyStoppingCallback()])
    with pytest.raises(ValueError, match="metric_for_best_model"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_log_lines_from_printer_callback(tmp_path, capsys):
    args = args_for(tmp_path, max_steps=2, per_device_train_batch_size=4, logging_steps=1, save_strategy="no")
    Trainer(TinyClassifier(), args, train_dataset=columns(8)).train()
    logs = [ast.literal_eval(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(logs) == 3  # two step logs and the final train metrics
    assert [log["epoch"] for log in logs] == [0.5, 1.0, 1.0]
    assert set(logs[0]) == {"loss", "grad_norm", "learning_rate", "epoch"} and "train_loss" in logs[2]


def test_callback_kwargs_events_and_handler_signature_match_hugging_face(tmp_path):
    """The same callback under transformers 5.23's Trainer and raytrain's gets the same kwargs per event
    (processing_class among them); the base class has HF's events (on_push_begin too) and
    CallbackHandler HF's constructor signature."""
    import inspect

    import transformers

    class Keys:
        def __init__(self):
            self.seen: dict[str, set] = {}

        def __getattr__(self, event):
            if not event.startswith("on_"):
                raise AttributeError(event)

            def record(args, state, control, **kwargs):
                self.seen.setdefault(event, set()).update(kwargs)
            return record

    class HFKeys(Keys, transformers.TrainerCallback):
        pass

    class OurKeys(Keys, TrainerCallback):
        pass

    for cls in (HFKeys, OurKeys):  # the bases' no-ops would shadow __getattr__
        for event in EVENTS:
            setattr(cls, event, property(lambda self, e=event: Keys.__getattr__(self, e)))
    kw = dict(max_steps=2, per_device_train_batch_size=4, logging_steps=1, eval_strategy="steps", eval_steps=2,
              save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    hf_cb, ours_cb = HFKeys(), OurKeys()
    hf = transformers.Trainer(TinyClassifier(), transformers.TrainingArguments(str(tmp_path / "hf"), **kw),
                              train_dataset=rows(16), eval_dataset=rows(6, seed=1), callbacks=[hf_cb])
    hf.train()
    ours = Trainer(TinyClassifier(), args_for(tmp_path, **kw), train_dataset=columns(16),
                   eval_dataset=columns(6, seed=1), callbacks=[ours_cb])
    ours.train()
    assert set(ours_cb.seen) == set(hf_cb.seen) and len(hf_cb.seen) >= 10
    assert "processing_class" in hf_cb.seen["on_step_end"]
    for event, keys in hf_cb.seen.items():
        assert keys <= ours_cb.seen[event], (event, keys - ours_cb.seen[event])
    hf_events = {m for m in dir(transformers.TrainerCallback) if m.startswith("on_")}
    assert hf_events == {m for m in dir(TrainerCallback) if m.startswith("on_")}
    from raytrain.callbacks import CallbackHandler

    assert list(inspect.signature(CallbackHandler).parameters) == \
        list(inspect.signature(transformers.trainer_callback.CallbackHandler).parameters)

