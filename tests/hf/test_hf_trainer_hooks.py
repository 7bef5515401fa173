"""The surface people who subclass or drive HF's Trainer rely on, with transformers' own Trainer as the
oracle, run side by side: evaluation's num_items_in_batch and batch_eval_metrics, the _evaluate,
_load_callback_state and _train_batch_size override points, get_*_dataloader's DataLoaders, the
refusals and warnings, resume with another batch size, sort_checkpoints, model_init and optimizer
groups."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

from raytrain import sort_checkpoints

from . import scripts
from tests.tiny import logged


NONE = object()  # a Trainer given no train_dataset


def make(lib, out, model=None, train=None, eval_data=None, cls=None, callbacks=None, **kw):
    """A Trainer of `lib` on the tiny regression; raytrain's in HF's data order, so that numbers compare."""
    Trainer, TrainingArguments = scripts.LIBS[lib][0]()
    defaults = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=0.05,
                    save_strategy="no", **scripts.COMMON, **({"data_order": "hf"} if lib == "rt" else {}))
    args = TrainingArguments(str(out), **{**defaults, **kw})
    return (cls or Trainer)(model=model or scripts.TinyRegressor(), args=args, callbacks=callbacks,
                            train_dataset=scripts.regression_data(16) if train is None else
                            None if train is NONE else train,
                            eval_dataset=scripts.regression_data(10) if eval_data is None else eval_data)


def subclass(lib, **methods):
    return type(f"{lib}Sub", (scripts.LIBS[lib][0]()[0],), methods)


# ---------------------------------------------------------------- evaluation


def test_compute_loss_override_gets_hfs_num_items_in_batch_in_training_and_evaluation(tmp_path):
    """A custom compute_loss sees HF's num_items_in_batch: a tensor counting the batch's labels, in evaluation
    (each batch's) as in training (the step's), the same numbers as transformers passes."""
    seen = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen.setdefault(self.tag, []).append((model.training, num_items_in_batch))
        return super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def mse_sum(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.mse_loss(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    losses = {}
    for lib in ("hf", "rt"):
        trainer = make(lib, tmp_path / lib, cls=subclass(lib, compute_loss=compute_loss, tag=lib), max_steps=2,
                       gradient_accumulation_steps=2)
        trainer.compute_loss_func = mse_sum
        trainer.train()
        losses[lib] = trainer.evaluate()["eval_loss"]
    for lib in ("hf", "rt"):
        assert all(torch.is_tensor(n) for _, n in seen[lib]), lib
    as_ints = {lib: [(training, int(n)) for training, n in seen[lib]] for lib in seen}
    assert as_ints["rt"] == as_ints["hf"] == [(True, 8)] * 4 + [(False, 4), (False, 4), (False, 2)]
    assert losses["rt"] == pytest.approx(losses["hf"], rel=1e-5)


def test_a_causal_lms_compute_loss_gets_hfs_token_counts_in_training_and_evaluation(tmp_path):
    """GPT-2 (a model taking loss keywords): compute_loss gets HF's num_items_in_batch for every batch, without
    compute_loss_func, counted by HF's rule."""
    import functools

    seen, losses = {}, {}
    for lib in ("hf", "rt"):
        Trainer, TrainingArguments = scripts.LIBS[lib][0]()

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, lib=lib):
            seen.setdefault(lib, []).append((model.training, int(num_items_in_batch)))
            return super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)

        if lib == "rt":
            TrainingArguments = functools.partial(TrainingArguments, data_order="hf")
        trainer, metrics, _ = scripts.causal_lm(subclass(lib, compute_loss=compute_loss), TrainingArguments,
                                                tmp_path / lib)
        losses[lib] = [e["loss"] for e in trainer.state.log_history if "loss" in e] + [metrics["eval_loss"]]
    assert seen["rt"] == seen["hf"]
    assert len(seen["rt"]) == 8 and seen["rt"][-1][0] is False
    # GPT-2's forward takes **kwargs: both pass it num_items_in_batch, which counts every label (its loss_type is
    # None, so HF does not shift the count) while the loss sums over labels[..., 1:]: the same training losses (the
    # evaluation's is raytrain's mean over items, HF's over samples: docs/huggingface.md)
    assert losses["rt"][:-1] == pytest.approx(losses["hf"][:-1], rel=1e-5)
    assert losses["rt"][-1] == pytest.approx(losses["hf"][-1], rel=1e-2)


def test_batch_eval_metrics_gets_tensors_as_hf(tmp_path):
    """batch_eval_metrics=True: the metric function gets each batch's tensors (HF's), and the metrics agree."""
    types, results = {}, {}

    def metrics(pred, compute_result):
        types.setdefault(tag[0], set()).add((type(pred.predictions), type(pred.label_ids)))
        batch = torch.abs(pred.predictions - pred.label_ids).sum()  # a tensor op, as users write them
        total[0] += float(batch)
        return {"abs_err": total[0]} if compute_result else {}

    for lib in ("hf", "rt"):
        tag, total = [lib], [0.0]
        trainer = make(lib, tmp_path / lib, batch_eval_metrics=True)
        trainer.compute_metrics = metrics
        results[lib] = trainer.evaluate()
        predicted = trainer.predict(scripts.regression_data(10))
        assert predicted.predictions.shape == (10,), lib  # predict() still returns every prediction
    assert types["rt"] == types["hf"] == {(torch.Tensor, torch.Tensor)}
    assert results["rt"]["eval_abs_err"] == pytest.approx(results["hf"]["eval_abs_err"], rel=1e-5)


def test_evaluate_override_point_runs_each_evaluation_during_training_as_hf(tmp_path):
    """_evaluate(trial, ignore_keys_for_eval, skip_scheduler) is what training calls for each evaluation; an
    override's metrics are the ones the best-model choice uses."""
    calls = {}

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=False):
        metrics = super(type(self), self)._evaluate(trial, ignore_keys_for_eval, skip_scheduler)
        calls.setdefault(self.tag, []).append(self.state.global_step)
        metrics["eval_loss"] = float(self.state.global_step == 4)  # makes step 4 the worst, 2 the best
        return metrics

    best = {}
    for lib in ("hf", "rt"):
        trainer = make(lib, tmp_path / lib, cls=subclass(lib, _evaluate=_evaluate, tag=lib), max_steps=6,
                       eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                       metric_for_best_model="loss")
        trainer.train()
        best[lib] = (trainer.state.best_global_step, os.path.basename(trainer.state.best_model_checkpoint))
    assert calls["rt"] == calls["hf"] == [2, 4, 6]
    assert best["rt"] == best["hf"] == (2, "checkpoint-2")


def test_model_preparation_time_only_for_a_model_prepared_for_evaluation_alone(tmp_path):
    """HF reports {prefix}_model_preparation_time when evaluate() prepared the model itself, not after training."""
    for lib in ("hf", "rt"):
        fresh = make(lib, tmp_path / lib)
        assert "eval_model_preparation_time" in fresh.evaluate(), lib
        trained = make(lib, tmp_path / f"{lib}2", max_steps=2)
        trained.train()
        assert "eval_model_preparation_time" not in trained.evaluate(), lib
        assert "test_model_preparation_time" not in trained.predict(scripts.regression_data(4)).metrics, lib


# ---------------------------------------------------------------- data loaders


def test_get_dataloaders_return_torch_dataloaders_as_hf(tmp_path):
    """get_train_dataloader / get_eval_dataloader return torch DataLoaders with HF's batch_size, length,
    dataset, drop_last and total_batch_size; a new one each call, but one kept per eval dataset with
    dataloader_persistent_workers; iterating one gives the batches."""
    loaders = {}
    for lib in ("hf", "rt"):
        trainer = make(lib, tmp_path / lib, train=scripts.regression_data(18), eval_data=scripts.regression_data(10),
                       dataloader_drop_last=True)
        train, evald = trainer.get_train_dataloader(), trainer.get_eval_dataloader()
        assert isinstance(train, torch.utils.data.DataLoader) and isinstance(evald, torch.utils.data.DataLoader)
        assert len(evald.dataset) == 10 and evald.dataset.column_names == ["x", "labels"]
        assert evald is not trainer.get_eval_dataloader()
        loaders[lib] = [(len(dl), dl.total_batch_size, dl.persistent_workers, [len(b["labels"]) for b in dl])
                        for dl in (train, evald)]
        if lib == "rt":  # accelerate's loaders keep these in their batch sampler
            assert (train.batch_size, train.drop_last, evald.batch_size, evald.drop_last) == (4, True, 4, True)
        persistent = make(lib, tmp_path / f"{lib}p", dataloader_persistent_workers=True, dataloader_num_workers=1)
        first = persistent.get_eval_dataloader()
        assert first.persistent_workers and first is persistent.get_eval_dataloader(), lib
    assert loaders["rt"] == loaders["hf"] == [(4, 4, False, [4, 4, 4, 4]), (2, 4, False, [4, 4])]  # drop_last


def test_a_missing_train_dataset_is_refused_with_hfs_message(tmp_path):
    for lib in ("hf", "rt"):
        trainer = make(lib, tmp_path / lib, train=NONE)
        with pytest.raises(ValueError, match=r"^Trainer: training requires a train_dataset\.$"):
            trainer.train()
        with pytest.raises(ValueError, match=r"^Trainer: training requires a train_dataset\.$"):
            trainer.get_train_dataloader()


def test_training_on_an_iterable_dataset_as_hf(tmp_path):
    """A torch IterableDataset trains for max_steps; its loader has torch's infinite sampler, as HF's."""
    out = {}
    for lib in ("hf", "rt"):
        trainer = make(lib, tmp_path / lib, model=scripts.IdRecorder(), train=scripts.Stream(16), max_steps=4,
                       logging_steps=1)
        trainer.train()
        loader = trainer.get_train_dataloader()
        assert isinstance(loader.sampler, torch.utils.data.dataloader._InfiniteConstantSampler), lib
        out[lib] = (trainer.state.global_step, [e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert out["rt"][0] == out["hf"][0] == 4
    assert out["rt"][1] == pytest.approx(out["hf"][1], rel=1e-5)


def test_label_smoothing_with_multi_label_targets_warns_and_is_disabled_as_hf(tmp_path):
    class MultiLabel(scripts.TinyRegressor):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"problem_type": "multi_label_classification"})()

    for lib in ("hf", "rt"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = make(lib, tmp_path / lib, model=MultiLabel(), label_smoothing_factor=0.1)
        texts = [str(w.message) for w in caught if "Label smoothing" in str(w.message)]
        assert texts == ["Label smoothing is not compatible with multi-label classification. "
                         "Disabling label smoothing for this training run."], lib
        assert trainer.label_smoother is None


# ---------------------------------------------------------------- callbacks and resume


def test_load_callback_state_restores_trainer_control_flags_as_hf(tmp_path):
    """HF's test_stateful_control: the control flags saved at the last step come back by _load_callback_state."""
    for lib in ("hf", "rt"):
        make(lib, tmp_path / lib, max_steps=2, save_strategy="steps", save_steps=2).train()
        trainer = make(lib, tmp_path / lib, max_steps=2, restore_callback_states_from_checkpoint=True)
        state_cls = type(trainer.state)
        trainer.state = state_cls.load_from_json(str(tmp_path / lib / "checkpoint-2" / "trainer_state.json"))
        assert not trainer.control.should_training_stop
        trainer._load_callback_state()
        assert trainer.control.should_training_stop, lib


def test_removing_default_flow_callback_warns(tmp_path):
    from raytrain import DefaultFlowCallback

    trainer = make("rt", tmp_path)
    with logged("transformers.trainer_callback", logging.WARNING) as records:  # HF's logger
        trainer.remove_callback(DefaultFlowCallback)
    text = "".join(r.getMessage() for r in records)
    assert "The Trainer will not work properly if you don't have a `DefaultFlowCallback`" in text
    assert "PrinterCallback" in text  # the list it has


def test_callback_warnings_on_hfs_loggers_with_hfs_words(tmp_path):
    """A second callback of a class, and a checkpoint's callback state the resuming trainer lacks: HF's
    warnings on HF's loggers (transformers.trainer_callback, transformers.trainer), as HF's tests patch them."""
    said = {}
    for lib in ("hf", "rt"):
        callback_base = scripts.LIBS[lib][1]()
        early = __import__("raytrain" if lib == "rt" else "transformers").EarlyStoppingCallback
        Recorder = type("Recorder", (callback_base,), {})
        with logged("transformers.trainer_callback", logging.WARNING) as added:
            make(lib, tmp_path / lib / "dup", callbacks=[Recorder, Recorder])
        kw = dict(max_steps=2, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2)
        make(lib, tmp_path / lib, callbacks=[early()], load_best_model_at_end=True, **kw).train()
        again = make(lib, tmp_path / lib, restore_callback_states_from_checkpoint=True, **kw)
        with logged("transformers.trainer", logging.WARNING) as resumed:
            again.train(resume_from_checkpoint=str(tmp_path / lib / "checkpoint-2"))
        said[lib] = [[r.getMessage().split(" to the")[0].split(".")[-1] for r in added],
                     [r.getMessage() for r in resumed if "EarlyStoppingCallback" in r.getMessage()]]
    assert said["rt"] == said["hf"] == [
        ["Recorder'>"],
        ["Checkpoint included callbacks not included in current configuration. Ignoring. (EarlyStoppingCallback)"]]


def test_resume_with_another_per_device_batch_size_continues_by_samples(tmp_path):
    """As HF: a checkpoint of batch 4 resumes at batch 8 (HF's test_resume_training_with_different_batch_size),
    the arguments' difference logged in HF's words."""
    for lib in ("hf", "rt"):
        first = make(lib, tmp_path / lib, train=scripts.regression_data(64), max_steps=2, save_strategy="steps",
                     save_steps=1)
        first.train()
        assert first._train_batch_size == 4
        again = make(lib, tmp_path / lib, train=scripts.regression_data(64), max_steps=4, save_strategy="steps",
                     save_steps=1, per_device_train_batch_size=8)
        with logged("transformers", logging.WARNING) as records:  # transformers' loggers, for both
            assert again.train(resume_from_checkpoint=True).global_step == 4
        assert again._train_batch_size == 8, lib
        said = [r.getMessage() for r in records]
        assert sum("per_device_train_batch_size: 8 (from args) != 4 (from trainer_state.json)" in m
                   for m in said) == 1, lib
        assert any("do not match the ones in the `trainer_state.json`" in m for m in said), lib


def test_auto_find_batch_size_resume_takes_the_checkpoints_batch_size_as_hf(tmp_path):
    """HF's test_auto_batch_size_with_resume_from_checkpoint: an out-of-memory at 16 trains at 14; a new
    Trainer on the same arguments starts at 16 and, resuming, at the checkpoint's 14."""
    sizes = {}
    for lib in ("hf", "rt"):
        base = scripts.LIBS[lib][1]()

        class OomAt16(base):
            def on_step_end(self, args, state, control, **kwargs):
                if state.train_batch_size >= 16:
                    raise RuntimeError("CUDA out of memory.")

        kw = dict(train=scripts.regression_data(64), max_steps=2, save_strategy="steps", save_steps=1,
                  auto_find_batch_size=True, per_device_train_batch_size=16)
        trainer = make(lib, tmp_path / lib, callbacks=[OomAt16()], **kw)
        trainer.train()
        again = make(lib, tmp_path / lib, **kw)
        before = again._train_batch_size
        again.train(resume_from_checkpoint=True)
        sizes[lib] = (trainer._train_batch_size, before, again._train_batch_size, again.args.per_device_train_batch_size)
    assert sizes["rt"] == sizes["hf"] == (14, 16, 14, 16)  # accelerate's step: 10% smaller


# ---------------------------------------------------------------- checkpoints, models, optimizer


def test_sort_checkpoints_numeric_order_with_the_best_kept_before_the_newest_as_hf(tmp_path):
    from transformers.trainer_utils import sort_checkpoints as hf_sort

    for step in (1, 10, 100, 5, 50):
        os.makedirs(tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-7").write_text("a file, not a checkpoint")
    names = [os.path.basename(p) for p in sort_checkpoints(str(tmp_path))]
    assert names == ["checkpoint-1", "checkpoint-5", "checkpoint-10", "checkpoint-50", "checkpoint-100"]
    for best in ("checkpoint-5", "checkpoint-100"):
        ours = sort_checkpoints(str(tmp_path), best_model_checkpoint=str(tmp_path / best))
        assert ours == hf_sort(str(tmp_path), best_model_checkpoint=str(tmp_path / best))
    assert os.path.basename(ours[-1]) == "checkpoint-100"
    assert [os.path.basename(p) for p in sort_checkpoints(str(tmp_path), best_model_checkpoint=str(
        tmp_path / "checkpoint-5"))][-2:] == ["checkpoint-5", "checkpoint-100"]
    assert sort_checkpoints(str(tmp_path), use_mtime=True) == hf_sort(str(tmp_path), use_mtime=True)  # same second


def test_save_strategy_best_without_a_metric_is_refused_with_hfs_text(tmp_path):
    for lib in ("hf", "rt"):
        with pytest.raises(ValueError, match="`args.metric_for_best_model` must be provided when using 'best' "
                                             "save_strategy"):
            make(lib, tmp_path / lib, save_strategy="best", eval_strategy="steps")


class Unseeded(scripts.TinyRegressor):
    """Initialised from the global RNG, which train() seeds before calling model_init."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.lin = torch.nn.Linear(4, 1)


def test_a_second_train_with_model_init_starts_from_hfs_fresh_model(tmp_path):
    """As HF's test_model_init: each train() calls model_init after seeding from args.seed, so a second run is
    the first again, and another seed another model; the same weights as HF's (in HF's data order)."""
    weights = {}
    for lib in ("hf", "rt"):
        Trainer, TrainingArguments = scripts.LIBS[lib][0]()
        args = TrainingArguments(str(tmp_path / lib), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=0.05, save_strategy="no", **scripts.COMMON,
                                 **({"data_order": "hf"} if lib == "rt" else {}))
        trainer = Trainer(model_init=Unseeded, args=args,
                          train_dataset=scripts.regression_data(16))
        trainer.train()
        once = trainer.model.lin.weight.detach().clone()
        trainer.train()
        weights[lib] = (once, trainer.model.lin.weight.detach().clone())
        assert torch.equal(*weights[lib]), lib  # the second run is the first again
        trainer.args.seed = 314  # as HF: train() seeds from the arguments, the data order too
        trainer.train()
        assert not torch.equal(trainer.model.lin.weight, once), lib
    torch.testing.assert_close(weights["rt"][1], weights["hf"][1])


def test_two_optimizer_groups_and_per_group_learning_rates_as_hf(tmp_path):
    """HF's decayed / not decayed groups (both kept, even empty or without decay); get_learning_rates reports
    each, _get_learning_rate the first, as the schedule moves them."""
    got = {}
    for lib in ("hf", "rt"):
        for wd in (0.0, 0.1):
            trainer = make(lib, tmp_path / lib, max_steps=4, weight_decay=wd, lr_scheduler_type="linear")
            trainer.create_optimizer()
            groups = [([id(p) for p in g["params"]], g["weight_decay"]) for g in trainer.optimizer.param_groups]
            names = trainer.get_decay_parameter_names(trainer.model)
            rates = trainer.get_learning_rates()
            trainer.optimizer = None
            trainer.train()
            got[(lib, wd)] = (groups, names, rates, trainer.get_learning_rates(), trainer._get_learning_rate())
    assert [len(g) for g, _ in got[("rt", 0.1)][0]] == [1, 1]
    for wd in (0.0, 0.1):
        ours, theirs = got[("rt", wd)], got[("hf", wd)]
        assert [d for _, d in ours[0]] == [d for _, d in theirs[0]] == [wd, 0.0]
        assert ours[1] == theirs[1] == ["lin.weight"]
        assert ours[2] == theirs[2] == [0.05, 0.05]
        assert ours[3] == pytest.approx(theirs[3]) and ours[4] == pytest.approx(theirs[4])


# ---------------------------------------------------------------- the run's plan and user loaders


def test_set_initial_training_values_gives_hfs_plan(tmp_path):
    """HF's set_initial_training_values (the tuple HF's testing_utils.get_steps_per_epoch reads) for
    epochs, max_steps and gradient accumulation; _get_output_dir is args.output_dir outside a sweep."""
    for kw in ({"num_train_epochs": 2}, {"max_steps": 7, "gradient_accumulation_steps": 3},
               {"num_train_epochs": 1.5, "gradient_accumulation_steps": 2}):
        plans = {}
        for lib in ("hf", "rt"):
            trainer = make(lib, tmp_path / lib, train=scripts.regression_data(22), **kw)
            plans[lib] = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())
            assert trainer._get_output_dir(trial=None) == str(tmp_path / lib)
        assert plans["rt"] == plans["hf"], kw


def test_best_checkpoint_when_the_evaluation_follows_the_steps_save_as_hf(tmp_path):
    """Evaluating each epoch and saving each step: the epoch's last step is saved before it is evaluated,
    and HF names that checkpoint best at the next save (HF's test_best_model_checkpoint_behavior)."""
    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=False):
        self.log(metrics := {"eval_accuracy": self.accuracies.pop(0)})
        return metrics

    best = {}
    for lib in ("hf", "rt"):
        trainer = make(lib, tmp_path / lib, cls=subclass(lib, _evaluate=_evaluate), num_train_epochs=3,
                       eval_strategy="epoch", save_strategy="steps", save_steps=1,
                       metric_for_best_model="accuracy", greater_is_better=True)
        trainer.accuracies = [0.59, 0.57, 0.55]
        trainer.train()
        state = trainer.state
        best[lib] = (state.best_metric, state.best_global_step, os.path.basename(state.best_model_checkpoint))
    assert best["rt"] == best["hf"] == (0.59, 4, "checkpoint-4")


class _Chained:
    """A user's loader of ready batches: two DataLoaders one after the other, no .dataset (HF's MultiLoader)."""

    def __init__(self, loaders):
        self.loaders = loaders

    def __len__(self):
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self):
        for loader in self.loaders:
            yield from loader


def test_dataloaders_of_a_users_own_class_train_and_evaluate_as_hf(tmp_path):
    """get_train_dataloader / get_eval_dataloader overridden to return a plain iterable with a length
    (HF's test_dataloader_without_dataset): training and evaluation run over it, with HF's numbers."""
    def get_train_dataloader(self):
        base = super(type(self), self).get_train_dataloader
        return _Chained([base(), base()])

    def get_eval_dataloader(self, eval_dataset=None):
        base = super(type(self), self).get_eval_dataloader
        return _Chained([base(eval_dataset), base(eval_dataset)])

    out = {}
    for lib in ("hf", "rt"):
        cls = subclass(lib, get_train_dataloader=get_train_dataloader, get_eval_dataloader=get_eval_dataloader)
        trainer = make(lib, tmp_path / lib, cls=cls, num_train_epochs=1, logging_steps=1)
        trainer.train()
        metrics = trainer.evaluate()
        out[lib] = (trainer.state.global_step, metrics["eval_loss"])
    assert out["rt"][0] == out["hf"][0] == 8  # two passes of 16 samples at batch 4
    assert out["rt"][1] == pytest.approx(out["hf"][1], rel=1e-5)
