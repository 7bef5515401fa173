"""Search spaces from YAML: every bad space gets one line naming space.<key>; conditional and integer/log
parameters sample as written (checked with Optuna directly, no Ray)."""

from __future__ import annotations

import optuna
import pytest

from raytrain.config.args import ConfigError
from raytrain.sweep.space import load_search_spec, space_from_spec


@pytest.mark.parametrize("space, message", [
    ({"lr": {"lognormal": [1, 2]}}, "space.lr: unknown distribution 'lognormal' (valid: choice, int, logint, "
                                    "loguniform, quniform, randint, uniform)"),
    ({"lr": {"uniform": [0, 1], "lgo": True}}, "space.lr: unknown key 'lgo' (valid: one distribution and 'when')"),
    ({"lr": {"uniform": [0.5, 0.1]}}, "space.lr: low (0.5) must be <= high (0.1)"),
    ({"lr": {"loguniform": [0, 0.1]}}, "space.lr: loguniform needs low > 0 (a log scale), got low=0"),
    ({"n": {"logint": [-1, 8]}}, "space.n: logint needs low > 0 (a log scale), got low=-1"),
    ({"model.hidden_size": {"choice": []}}, "space.model.hidden_size: choice needs a non-empty list of values, got []"),
    ({"n": {"int": [1.5, 4]}}, "space.n: int expects integer bounds, got [1.5, 4]"),
    ({"lr": {"uniform": [1]}}, "space.lr: uniform expects [low, high] numbers, got [1]"),
    ({"lr": 0.1}, "space.lr: expected {distribution: [values]} with one of choice, int, logint, loguniform, "
                  "quniform, randint, uniform, got 0.1"),
    ({"m": {"uniform": [0, 1], "when": {"optim": "sgd"}}},
     "space.m.when: 'optim' must be a choice parameter listed before space.m"),
    ({"optim": {"choice": ["sgd", "adamw_torch"]}, "m": {"uniform": [0, 1], "when": {"optim": "adam"}}},
     "space.m.when: 'adam' is not one of space.optim's choices ['sgd', 'adamw_torch']"),
])
def test_bad_spaces_get_one_line(space, message):
    with pytest.raises(ConfigError) as e:
        space_from_spec(space)
    assert str(e.value) == message


def test_search_file_errors(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("metrc: eval_loss\nspace: {learning_rate: {uniform: [0, 1]}}\n")
    with pytest.raises(ConfigError, match=r"s.yaml: unknown key\(s\) \['metrc'\] \(valid: max_concurrent_trials, metric, mode, "):
        load_search_spec(str(bad))
    bad.write_text("mode: maximize\nspace: {learning_rate: {uniform: [0, 1]}}\n")
    with pytest.raises(ConfigError, match="mode must be min or max"):
        load_search_spec(str(bad))
    bad.write_text("space:\n  learning_rate: {loguniform: [0, 1]}\n")  # the space is checked with the file
    with pytest.raises(ConfigError, match="space.learning_rate: loguniform needs low > 0"):
        load_search_spec(str(bad))
    with pytest.raises(ConfigError, match="file not found"):
        load_search_spec(str(tmp_path / "missing.yaml"))


def test_conditional_integer_and_log_parameters_sample_as_written():
    space = space_from_spec({
        "optim": {"choice": ["sgd", "adamw_torch"]},
        "optim_args": {"choice": ["momentum=0.9", "momentum=0.0"], "when": {"optim": "sgd"}},
        "model.num_layers": {"int": [1, 3]},
        "per_device_train_batch_size": {"logint": [16, 128]},
        "learning_rate": {"loguniform": [1e-4, 1e-2]},
        "warmup_ratio": {"quniform": [0.0, 0.2, 0.05]},
        "seed": {"randint": [0, 2]},
    })
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        trial = study.ask()
        space(trial)
        study.tell(trial, 0.0)
    trials = study.trials
    assert {t.params["optim"] for t in trials} == {"sgd", "adamw_torch"}
    assert all(("optim_args" in t.params) == (t.params["optim"] == "sgd") for t in trials)
    assert {t.params["model.num_layers"] for t in trials} == {1, 2, 3}
    assert all(16 <= t.params["per_device_train_batch_size"] <= 128 for t in trials)
    assert all(round(t.params["warmup_ratio"] / 0.05, 9).is_integer() for t in trials)
    assert {t.params["seed"] for t in trials} == {0, 1}  # randint's high is exclusive, as in Ray Tune
    assert trials[0].distributions["learning_rate"].log
    assert space.to_tune is not None and not space_from_spec({"lr": {"uniform": [0, 1]}}).conditional
    with pytest.raises(ConfigError, match="space.optim_args.when: conditional parameters need Optuna's sampler"):
        space.to_tune()


def test_pbt_refuses_architecture_keys_before_the_sweep(tmp_path, monkeypatch):
    from examples.digits import build_datasets, build_model
    from raytrain import Trainer, TrainingArguments

    train, val = build_datasets()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, eval_strategy="steps", eval_steps=2)
    trainer = Trainer(args=args, model_init=lambda **k: build_model(**k), train_dataset=train, eval_dataset=val)
    with pytest.raises(ValueError, match=r"^hp_space: model.hidden_size: PBT clones checkpoints between trials"):
        trainer.hyperparameter_search({"model.hidden_size": {"choice": [32, 64]}}, scheduler="pbt")
    with pytest.raises(ValueError, match="scheduler 'asha' needs one objective"):
        trainer.hyperparameter_search({"learning_rate": {"uniform": [0.001, 0.01]}},
                                      direction=["minimize", "maximize"], scheduler="asha")
    with pytest.raises(ConfigError, match="sampler: must be one of tpe, random, cmaes, qmc, got 'grid'"):
        trainer.hyperparameter_search({"learning_rate": {"uniform": [0.001, 0.01]}}, sampler="grid")
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as without the cmaes package
    with pytest.raises(ConfigError, match="^sampler: 'cmaes' needs the cmaes package .*: pip install cmaes"):
        trainer.hyperparameter_search({"learning_rate": {"uniform": [0.001, 0.01]}}, sampler="cmaes")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="^storage_path: 'nofs://bucket/sweeps': pyarrow cannot open it "):
        trainer.hyperparameter_search({"learning_rate": {"uniform": [0.001, 0.01]}},
                                      storage_path="nofs://bucket/sweeps")
    assert not (tmp_path / "sweeps").exists()  # refused before anything was written


def test_schedulers_and_samplers_by_name():
    import optuna
    from ray.tune import schedulers as s

    from raytrain.sweep.sampler import TrialSeededSampler, make_sampler
    from raytrain.sweep.search import _scheduler

    assert _scheduler("none", None, {}) is None
    assert isinstance(_scheduler("asha", None, {}), s.AsyncHyperBandScheduler)
    assert isinstance(_scheduler("hyperband", None, {"brackets": 2}), s.AsyncHyperBandScheduler)
    assert isinstance(_scheduler("median", None, {}), s.MedianStoppingRule)
    assert isinstance(_scheduler("pbt", {"learning_rate": [1e-3, 1e-2]}, {}), s.PopulationBasedTraining)
    kinds = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
             "cmaes": optuna.samplers.CmaEsSampler, "qmc": optuna.samplers.QMCSampler}
    for name, cls in kinds.items():
        assert isinstance(make_sampler(name, None, 12), cls)
        seeded = make_sampler(name, 0, 12)
        assert isinstance(seeded, TrialSeededSampler) and isinstance(seeded._inner, cls)
    # Seeded: the same seed gives the same first suggestions.
    space = space_from_spec({"learning_rate": {"loguniform": [1e-4, 1e-2]}})
    firsts = []
    for _ in range(2):
        study = optuna.create_study(sampler=make_sampler("tpe", 7, 12))
        trial = study.ask()
        space(trial)
        firsts.append(trial.params["learning_rate"])
    assert firsts[0] == firsts[1]


def test_asha_and_hyperband_cut_at_rungs_not_at_rays_max_t_of_100():
    """Ray's max_t=100 default stopped every trial at its 100th evaluation (a trial evaluating every
    10 steps for 2000 steps ended at step 1000, "stopped early"); raytrain's trials end on their own."""
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from raytrain.sweep.search import _scheduler

    for name in ("asha", "hyperband"):
        sched = _scheduler(name, None, {})
        sched.set_search_properties("objective", "max")
        good, bad = SimpleNamespace(trial_id="good"), SimpleNamespace(trial_id="bad")
        sched.on_trial_add(None, good)
        sched.on_trial_add(None, bad)
        decisions = [sched.on_trial_result(None, good, {"training_iteration": i, "objective": 0.9})
                     for i in range(1, 201)]
        assert set(decisions) == {TrialScheduler.CONTINUE}, name
    # The rungs still cut: a trial below the others at ASHA's first rung (one evaluation) stops there.
    sched = _scheduler("asha", None, {})
    sched.set_search_properties("objective", "max")
    sched.on_trial_add(None, good)
    sched.on_trial_add(None, bad)
    sched.on_trial_result(None, good, {"training_iteration": 1, "objective": 0.9})
    assert sched.on_trial_result(None, bad, {"training_iteration": 1, "objective": 0.1}) == TrialScheduler.STOP


def test_search_yaml_overrides_apply_and_unknown_keys_are_named(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("num_samples: 8\nspace:\n  learning_rate: {loguniform: [1.0e-4, 1.0e-2]}\n")
    spec = load_search_spec(str(path), ["num_samples=3", "scheduler=none"])
    assert spec["num_samples"] == 3 and spec["scheduler"] == "none"
    with pytest.raises(ConfigError, match=r"^--set search.samples: not a search setting \(valid: "):
        load_search_spec(str(path), ["samples=3"])
