"""hyperparameter_search as HF's: backend "optuna" (in-process, HF's default) against transformers'
own Trainer.hyperparameter_search, the backend choice and its one-line errors, HF's Optuna-style
hp_space on Ray Tune, HF's BestRun type, and a sweep whose model code is on the driver's sys.path only."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

optuna = pytest.importorskip("optuna")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MLP(nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def _rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"x": x[i], "labels": int(y[i])} for i in range(n)]


def model_init(trial):  # HF's style: the Optuna trial (None when the Trainer is built)
    return MLP(trial.suggest_int("hidden", 4, 16) if trial is not None else 8)


def hp_space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1)}


def _search(lib: str, out, **kw):
    """The same script on transformers' Trainer and on raytrain's: full batches (no order to differ),
    3 trials, TPE seeded, a pruner that stops some trials at an evaluation."""
    if lib == "hf":
        from transformers import Trainer, TrainingArguments
        extra = {"use_cpu": True}
    else:
        from raytrain import Trainer, TrainingArguments
        extra = {}
    args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=32,
                             per_device_eval_batch_size=16, eval_strategy="steps", eval_steps=2,
                             save_strategy="steps", save_steps=2, logging_steps=2, report_to="none",
                             disable_tqdm=True, seed=0, **extra)
    trainer = Trainer(model_init=model_init, args=args, train_dataset=_rows(32, 0), eval_dataset=_rows(16, 1))
    os.makedirs(out, exist_ok=True)
    best = trainer.hyperparameter_search(hp_space=hp_space, n_trials=3, direction="minimize", backend="optuna",
                                         sampler=optuna.samplers.TPESampler(seed=0),
                                         pruner=optuna.pruners.ThresholdPruner(upper=1.17), study_name="s",
                                         storage=f"sqlite:///{out}/study.db", **kw)
    return best, optuna.load_study(study_name="s", storage=f"sqlite:///{out}/study.db")


def _trials(study) -> list[tuple]:
    return [(t.number, t.state.name, t.params, t.value, dict(t.intermediate_values)) for t in study.trials]


def test_optuna_backend_samples_and_scores_each_trial_as_transformers(tmp_path):
    """Same hyperparameters per trial (model_init's suggestion first, then hp_space's, as HF), same
    evaluation losses reported at the same steps, the same trials pruned, the same objective (the last
    evaluation's) and best run; raytrain's BestRun is transformers' type with its checkpoint added."""
    from transformers.trainer_utils import BestRun as HFBestRun

    hf_best, hf_study = _search("hf", tmp_path / "hf")
    rt_best, rt_study = _search("rt", tmp_path / "rt")
    hf_trials, rt_trials = _trials(hf_study), _trials(rt_study)
    assert [t[:3] for t in rt_trials] == [t[:3] for t in hf_trials]  # number, state, params: exactly
    for (_, state, _, h_value, h_steps), (*_, r_value, r_steps) in zip(hf_trials, rt_trials):
        assert list(r_steps) == list(h_steps)
        assert list(r_steps.values()) == pytest.approx(list(h_steps.values()), rel=1e-5)
        if state == "COMPLETE":
            assert r_value == pytest.approx(h_value, rel=1e-5) and r_value == r_steps[6]  # the last evaluation
    states = [t[1] for t in rt_trials]
    assert "PRUNED" in states and "COMPLETE" in states
    for number, state, *_, steps in rt_trials:  # a pruned trial stopped training at its report
        saved = {lib: sorted(int(d.split("-")[1]) for d in os.listdir(tmp_path / lib / f"run-{number}")
                             if d.startswith("checkpoint-")) for lib in ("hf", "rt")}
        assert saved["rt"] == sorted(steps) and (state == "PRUNED" or saved["rt"] == [2, 4, 6])
        # HF reports before it saves, raytrain after: a pruned trial keeps its last checkpoint here.
        assert saved["hf"] == (saved["rt"] if state == "COMPLETE" else saved["rt"][:-1])
    assert isinstance(rt_best, HFBestRun) and isinstance(hf_best, HFBestRun)
    assert (rt_best.run_id, rt_best.hyperparameters) == (hf_best.run_id, hf_best.hyperparameters)
    assert rt_best.objective == pytest.approx(hf_best.objective, rel=1e-5)
    assert rt_best.checkpoint == str(tmp_path / "rt" / f"run-{rt_best.run_id}" / "checkpoint-6")
    assert list(rt_best.run_summary["state"]) == states  # run_summary: the study's trials table
    run_id, objective, hyperparameters, summary = rt_best  # HF's four fields
    assert pickle.loads(pickle.dumps(rt_best)).checkpoint == rt_best.checkpoint


def _rt_trainer(tmp_path, model_init_fn, **kw):
    from raytrain import Trainer, TrainingArguments, TrainerCallback

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **k):
            runs.append((args.output_dir, args.learning_rate, state.trial_name, state.trial_params))

    runs: list = []
    args = TrainingArguments(**{"output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": 8,
                                "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 0, **kw})
    trainer = Trainer(model_init=model_init_fn, args=args, train_dataset=_rows(16, 0), eval_dataset=_rows(8, 1),
                      callbacks=[Seen()])
    return trainer, runs


def test_optuna_backend_yaml_space_keyword_model_init_hp_name_and_final_evaluation(tmp_path, caplog):
    """A YAML-form space on backend="optuna": model.* values go to a **kwargs model_init; with no
    evaluation during training the objective is a final evaluate() (as HF); hp_name names the run
    directory; a key that is no TrainingArguments field is warned about and skipped (as HF); the
    user's Trainer keeps its own arguments."""
    sizes = []

    def init(**k):
        sizes.append(k)
        return MLP(**k)

    trainer, runs = _rt_trainer(tmp_path, init, eval_strategy="no")
    space = {"learning_rate": {"loguniform": [1e-3, 1e-1]}, "model.hidden": {"choice": [5, 7]}}
    best = trainer.hyperparameter_search(space, n_trials=2, backend="optuna", hp_name=lambda t: f"t{t.number}",
                                         sampler=optuna.samplers.RandomSampler(seed=1))
    assert [r[0] for r in runs] == [str(tmp_path / "t0"), str(tmp_path / "t1")]
    assert [r[2] for r in runs] == ["t0", "t1"] and [set(r[3]) for r in runs] == [set(space)] * 2
    assert [s["hidden"] for s in sizes[1:]] == [r[3]["model.hidden"] for r in runs]  # sizes[0]: the Trainer's
    assert [r[1] for r in runs] == [r[3]["learning_rate"] for r in runs]
    assert best.objective == min(best.run_summary["value"])
    assert trainer.args.learning_rate == 5e-5 and trainer.args.output_dir == str(tmp_path)

    trainer, runs = _rt_trainer(tmp_path / "b", lambda: MLP(), eval_strategy="steps", eval_steps=1)
    with caplog.at_level("WARNING"):
        trainer.hyperparameter_search(lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-2),
                                                 "hidden": t.suggest_int("hidden", 2, 3)}, n_trials=1)
    assert "Trying to set hidden in the hyperparameter search but there is no corresponding field" in caplog.text


def test_an_empty_hp_space_with_model_init_suggesting_searches_with_optuna_as_hf(tmp_path):
    """HF's TrainerHyperParameterOptunaIntegrationTestWithFullEval: hp_space returns {}, model_init
    suggests on the Optuna trial, no evaluation during training: Optuna runs the trials (backend None),
    each scored by a final evaluate()."""
    trainer, runs = _rt_trainer(tmp_path, model_init, eval_strategy="no")
    best = trainer.hyperparameter_search(hp_space=lambda trial: {}, n_trials=2, direction="minimize")
    assert len(runs) == 2 and list(best.run_summary["params_hidden"]) == [r[3]["hidden"] for r in runs]
    assert best.objective == min(best.run_summary["value"])


def test_several_directions_give_the_best_trials_as_a_list(tmp_path):
    trainer, _ = _rt_trainer(tmp_path, lambda: MLP(), eval_strategy="steps", eval_steps=2)
    front = trainer.hyperparameter_search(hp_space, lambda m: (m["eval_loss"], m["eval_loss"] * 2), n_trials=3,
                                          direction=["minimize", "minimize"],
                                          sampler=optuna.samplers.RandomSampler(seed=0))
    assert isinstance(front, list) and len(front) == 1  # one loss, two scales: one trial dominates
    assert front[0].objective[1] == pytest.approx(2 * front[0].objective[0])
    assert front[0].objective[0] == min(front[0].run_summary["values_0"])


def test_backend_choice_and_one_line_errors(tmp_path):
    from raytrain.sweep.optuna_backend import choose_backend

    assert choose_backend(None, hp_space, {}) == "optuna"  # HF's default with Optuna installed
    assert choose_backend(None, None, {"pruner": None}) == "optuna"
    assert choose_backend(None, hp_space, {"scheduler": "asha"}) == "ray"  # raytrain's Ray sweep keywords
    assert choose_backend(None, hp_space, {"sampler": "tpe"}) == "ray"
    assert choose_backend(None, {"learning_rate": {"uniform": [0.1, 0.2]}}, {}) == "ray"
    assert choose_backend(None, lambda trial: {"learning_rate": 0.1}, {}) == "ray"  # a function returning a space
    assert choose_backend(None, lambda trial: {}, {}) == "optuna"  # HF's: model_init suggests on the trial
    trainer, _ = _rt_trainer(tmp_path, lambda: MLP(), eval_strategy="steps", eval_steps=1)
    cases = [({"backend": "wandb"}, r"^backend: must be 'optuna' or 'ray' \(None: optuna when installed, as HF\), "
                                    r"got 'wandb'$"),
             ({"backend": "optuna", "metric": "loss"}, r"^metric: a backend='ray' argument; backend='optuna' takes "),
             ({"backend": "optuna", "timout": 3}, r"^timout: not an argument of hyperparameter_search; "),
             ({"backend": "optuna", "sampler": "tpe"}, r"^sampler: backend='optuna' takes an Optuna sampler"),
             ({"backend": "optuna", "n_jobs": 2}, r"^n_jobs: backend='optuna' runs trials one after another"),
             ({"direction": "up"}, r"^direction: must be 'minimize', 'maximize' or a list of them, got \['up'\]$")]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer.hyperparameter_search(hp_space, n_trials=1, **kw)
    assert not [d for d in os.listdir(tmp_path) if d.startswith("run-")]  # refused before any trial


def test_hf_style_hp_space_is_optuna_define_by_run_on_ray_tune():
    """On Ray Tune the function is OptunaSearch's define-by-run space: a trial's config is the dict it
    returns (a suggestion under another name is not a config key), and Tune's plain pickle of the
    searcher keeps a local function."""
    from ray.tune.search.optuna import OptunaSearch

    from raytrain.sweep.space import FunctionSpace, function_space

    def renamed(trial):
        return {"learning_rate": trial.suggest_float("lr", 1e-4, 1e-2, log=True), "warmup_steps": 3}

    space = function_space(renamed)
    assert isinstance(space, FunctionSpace) and space.names == ["learning_rate", "warmup_steps"]
    searcher = OptunaSearch(space=space, metric="objective", mode="min",
                            sampler=optuna.samplers.RandomSampler(seed=0))
    config = searcher.suggest("t1")
    assert set(config) == {"learning_rate", "warmup_steps"} and 1e-4 <= config["learning_rate"] <= 1e-2
    assert searcher._ot_study.trials[0].params == {"lr": config["learning_rate"]}
    again = pickle.loads(pickle.dumps(space))
    assert again.fn(optuna.trial.FixedTrial({"lr": 0.005})) == {"learning_rate": 0.005, "warmup_steps": 3}
    with pytest.raises(Exception, match="^hp_space: a function of an Optuna trial cannot give PBT its mutations"):
        space.to_tune()


LIB = '''
from raytrain import Trainer


class LibTrainer(Trainer):
    """The user's subclass, importable only through the driver's sys.path."""


def model_init():
    from examples.digits import build_model
    return build_model(hidden_size=16)


def hp_space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)}


def objective(metrics):
    return metrics["eval_accuracy"]
'''

SCRIPT = '''
import json, sys
sys.path.insert(0, {lib!r})
import userlib
from examples.digits import build_datasets, compute_metrics
from raytrain import TrainingArguments

train, val = build_datasets()
args = TrainingArguments(output_dir="out", max_steps=10, per_device_train_batch_size=32, eval_strategy="steps",
                         eval_steps=5, save_strategy="steps", save_steps=5, logging_steps=5, disable_tqdm=True,
                         report_to="none")
trainer = userlib.LibTrainer(args=args, model_init=userlib.model_init, train_dataset=train, eval_dataset=val,
                             compute_metrics=compute_metrics)
best = trainer.hyperparameter_search(userlib.hp_space, userlib.objective, n_trials=2, direction="maximize",
                                     backend="ray", seed=0, max_concurrent_trials=1, name="lib", plots=False)
import transformers.trainer_utils
print("BEST " + json.dumps({{"run_id": best.run_id, "objective": best.objective, "hp": best.hyperparameters,
                            "hf": isinstance(best, transformers.trainer_utils.BestRun)}}))
'''


@pytest.mark.ray
def test_ray_sweep_imports_user_code_from_the_drivers_sys_path(ray_cluster, tmp_path):
    """A script adds a directory to sys.path (neither its own nor the cwd) and takes its Trainer subclass,
    model_init, HF-style hp_space and compute_objective from there: every trial runs (no
    ModuleNotFoundError on the workers), with no scheduler, and a trial's objective is its last report."""
    import pandas as pd

    lib, run = tmp_path / "lib", tmp_path / "run"
    lib.mkdir()
    run.mkdir()
    (lib / "userlib.py").write_text(LIB)
    (run / "sweep.py").write_text(textwrap.dedent(SCRIPT.format(lib=str(lib))))
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "sweep.py"], cwd=run, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    best = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("BEST "))[5:])
    sweep = run / "out" / "sweeps" / "lib"
    table = pd.read_csv(sweep / "trials.csv", dtype={"trial_id": str})
    assert list(table["status"]) == ["finished", "finished"] and list(table["steps"]) == [10, 10]
    for row in table.itertuples():
        reports = [json.loads(ln) for ln in (sweep / f"trial_{row.trial_id}" / "result.json").read_text().splitlines()]
        assert [r["step"] for r in reports] == [5, 10]
        assert row.objective == reports[-1]["objective"] == reports[-1]["eval_accuracy"]  # the last evaluation
        assert 1e-3 <= row.learning_rate <= 1e-2
    assert best["hf"] and set(best["hp"]) == {"learning_rate"}
    assert best["objective"] == table["objective"].max()
