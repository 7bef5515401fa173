"""hyperparameter_search's backend choice, and backend "optuna" (HF's default when Optuna is installed):
Optuna's study.optimize runs the trials one after another in this process, as transformers'
run_hp_search_optuna does. Each trial is a copy of the user's Trainer set up by Trainer.hp_search_setup
(the Ray backend's per-trial setup), trained with the Optuna trial's reporter as `trial`.

As HF: hp_space(trial) suggests and returns the trial's TrainingArguments values (a key that is no
field is warned about and skipped; `model.*` keys go to a model_init taking **kwargs); model_init(trial)
gets the Optuna trial; the objective is the last evaluation's compute_objective (default:
default_compute_objective), or a final evaluate() when none ran; each evaluation is reported to a
single-objective study and a trial its pruner stops ends as PRUNED; the other keywords are
optuna.create_study's (study_name, storage, sampler, pruner, load_if_exists) and study.optimize's
(timeout, gc_after_trial, catch). Unlike HF, each trial starts from the search's own arguments (a value
one trial sampled does not leak into the next) and the user's Trainer is left as it was.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
import logging
import os
from typing import Any, Callable

from ..config.args import TrainingArguments
from ..callbacks import TrainerCallback
from .search import BestRun, hyperparameter_search as ray_search, user_callbacks
from .space import (FunctionSpace, SearchSpace, default_compute_objective, default_hp_space_optuna,
    function_space, objective_defaults, space_from_spec)

logger = logging.getLogger(__name__)

__all__ = ["BACKENDS", "choose_backend", "run_hp_search", "run_hp_search_optuna"]

BACKENDS = ("optuna", "ray")
_STUDY_KEYS = ("study_name", "storage", "sampler", "pruner", "load_if_exists")
_OPTIMIZE_KEYS = ("timeout", "n_jobs", "gc_after_trial", "catch")


def _ray_only_keys() -> list[str]:
    shared = ("trainer", "hp_space", "compute_objective", "n_trials", "direction", "sampler")
    return [k for k in inspect.signature(ray_search).parameters if k not in shared]


def choose_backend(backend, hp_space, kwargs: dict[str, Any]) -> str:
    """backend=None is HF's default, optuna when installed, unless the call is a Ray sweep's: one of
    search.hyperparameter_search's own keywords, a sampler given by name, or a space that is no
    function of an Optuna trial (YAML form, Ray Tune sample objects)."""
    if backend is not None:
        name = str(getattr(backend, "value", backend)).lower()  # transformers' HPSearchBackend too
        if name not in BACKENDS:
            raise ValueError("backend: must be 'optuna' or 'ray' (None: optuna when installed, as HF), "
                             f"got {backend!r}")
        return name
    if importlib.util.find_spec("optuna") is None:
        return "ray"
    if set(kwargs) & set(_ray_only_keys()) or isinstance(kwargs.get("sampler"), str):
        return "ray"
    if hp_space is not None and (isinstance(hp_space, SearchSpace) or not callable(hp_space)
                                 or function_space(hp_space, empty_ok=True) is None):
        return "ray"
    return "optuna"


def run_hp_search(trainer, hp_space=None, compute_objective: Callable | None = None, n_trials: int = 20,
                  direction: str | list[str] | None = None, backend=None, hp_name: Callable | None = None, **kwargs):
    """Trainer.hyperparameter_search: the chosen backend's search."""
    if choose_backend(backend, hp_space, kwargs) == "ray":
        return ray_search(trainer, hp_space, compute_objective, n_trials, direction, **kwargs)
    return run_hp_search_optuna(trainer, hp_space, compute_objective, n_trials, direction, hp_name, **kwargs)


def _metric(name: str) -> Callable:
    return lambda metrics: metrics[name]


def _optuna_space(hp_space) -> Callable:
    if hp_space is None:
        return default_hp_space_optuna
    if isinstance(hp_space, dict) and hp_space and all(isinstance(v, dict) for v in hp_space.values()):
        hp_space = space_from_spec(hp_space)  # the YAML form
    if isinstance(hp_space, SearchSpace) and not isinstance(hp_space, FunctionSpace):
        return lambda trial: hp_space(trial) or dict(trial.params)
    if not callable(hp_space):
        raise ValueError("hp_space: backend='optuna' takes a function of an optuna.Trial returning a dict (HF's "
                         f"style) or a YAML-form dict, got {type(hp_space).__name__}; Ray Tune spaces need "
                         "backend='ray'")
    return hp_space


def _check(trainer, directions: list[str], kwargs: dict[str, Any]) -> None:
    ray_only = _ray_only_keys()
    for key in kwargs:
        if key not in _STUDY_KEYS + _OPTIMIZE_KEYS:
            whose = "a backend='ray' argument" if key in ray_only else "not an argument of hyperparameter_search"
            raise ValueError(f"{key}: {whose}; backend='optuna' takes optuna.create_study's and study.optimize's "
                             f"({', '.join(_STUDY_KEYS + _OPTIMIZE_KEYS)})")
    if isinstance(kwargs.get("sampler"), str):
        raise ValueError("sampler: backend='optuna' takes an Optuna sampler (e.g. "
                         f"optuna.samplers.TPESampler(seed=0)), got {kwargs['sampler']!r}; sampler names are for "
                         "backend='ray'")
    if kwargs.get("n_jobs", 1) != 1:
        raise ValueError(f"n_jobs: backend='optuna' runs trials one after another in this process, got "
                         f"{kwargs['n_jobs']}; use backend='ray' for concurrent trials")
    if trainer.model_init is None:
        raise ValueError("hyperparameter_search needs a Trainer built with model_init (one model per trial)")
    if trainer.args.should_use_distributed:
        raise ValueError(f"scaling.num_workers: backend='optuna' trains each trial in this process, got "
                         f"{trainer.args.scaling.num_workers} workers; use backend='ray' for distributed trials")
    bad = [d for d in directions if d not in ("minimize", "maximize")]
    if bad or not directions:
        raise ValueError(f"direction: must be 'minimize', 'maximize' or a list of them, got {bad or directions!r}")


def run_hp_search_optuna(trainer, hp_space=None, compute_objective: Callable | None = None, n_trials: int = 20,
                         direction: str | list[str] | None = None, hp_name: Callable | None = None, **kwargs):
    """HF's run_hp_search_optuna on raytrain: a BestRun (for several directions, the best trials' list),
    hyperparameters as Optuna's trial.params, run_summary the study's trials_dataframe(), checkpoint the
    best trial's checkpoint saved with its objective."""
    import optuna

    metric, direction = objective_defaults(trainer, None, direction, compute_objective)
    if metric is not None:  # the trainer's own objective (GRPO / RLOO: eval_reward)
        compute_objective = _metric(metric)
    several = isinstance(direction, (list, tuple))
    directions = list(direction) if several else [direction]
    _check(trainer, directions, kwargs)
    optimize = {k: kwargs.pop(k) for k in _OPTIMIZE_KEYS if k in kwargs}
    optimize.pop("n_jobs", None)
    study = optuna.create_study(direction=None if several else direction, directions=directions if several else None,
                                **kwargs)
    objective = _Objective(trainer, _optuna_space(hp_space), compute_objective or default_compute_objective,
                           hp_name, len(directions) if several else 0)
    study.optimize(objective, n_trials=n_trials, n_jobs=1, **optimize)
    table = study.trials_dataframe()
    if not several:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params, table, best.user_attrs.get("checkpoint"))
    return [BestRun(str(t.number), t.values, t.params, table, t.user_attrs.get("checkpoint"))
            for t in study.best_trials]


class _Reporter(TrainerCallback):
    """loop.py's `trial`: each evaluation's objective; reported to a single-objective study, whose
    pruner may stop the trial (HF's _report_to_hp_search)."""

    def __init__(self, trial, trainer, compute_objective: Callable, n_objectives: int):
        self.trial, self.trainer, self.compute_objective, self.n = trial, trainer, compute_objective, n_objectives
        self.objective = self.checkpoint = None

    def report(self, metrics: dict, step: int, checkpoint_dir: str | None = None) -> None:
        import optuna

        self.objective = _value(self.compute_objective(dict(metrics)), self.n)
        self.checkpoint = os.path.abspath(checkpoint_dir) if checkpoint_dir else None
        if self.n == 0:
            self.trial.report(self.objective, step)
            if self.trial.should_prune():
                t = self.trainer
                t.callback_handler.on_train_end(t.args, t.state, t.control)
                raise optuna.TrialPruned()


def _value(value, n: int):
    if n == 0:
        return float(value)
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"compute_objective must return {n} values (one per direction), got {value!r}")
    return [float(v) for v in value]


class _Objective:
    """One Optuna trial: the trial's arguments and model, a copy of the user's Trainer set up with them
    (hp_search_setup), trained with a _Reporter; returns the last evaluation's objective."""

    def __init__(self, trainer, hp_space: Callable, compute_objective: Callable, hp_name: Callable | None, n: int):
        self.trainer, self.hp_space, self.compute_objective, self.hp_name, self.n = \
            trainer, hp_space, compute_objective, hp_name, n
        self.callbacks = user_callbacks(trainer)

    def params(self, trial) -> dict[str, Any]:
        params = self.hp_space(trial)
        if not isinstance(params, dict):
            raise ValueError(f"hp_space must return a dict of parameters, got {type(params).__name__}")
        fields = TrainingArguments.__dataclass_fields__
        for key in [k for k in params if k.split(".")[0] not in fields and not k.startswith("model.")]:
            logger.warning("Trying to set %s in the hyperparameter search but there is no corresponding field in "
                           "`TrainingArguments`.", key)  # HF's warning; the key is skipped
            params.pop(key)
        return params

    def model(self, trial, params: dict[str, Any] | None):
        """HF's order: model_init(trial) before hp_space(trial) (both may suggest); a model_init taking
        **kwargs gets the trial's model.* values, so hp_space runs first. Seeded as a trial of the Ray backend."""
        from ..runtime.seeding import set_seed

        init, base = self.trainer.model_init, self.trainer.args
        seed = int(params.get("seed", base.seed)) if params is not None else base.seed
        set_seed(seed, base.full_determinism)
        if params is not None:
            from .trial import model_for_trial

            return model_for_trial(init, params)
        return self.trainer.call_model_init(trial)

    def __call__(self, trial):
        from .trial import takes_model_params, trial_args  # Ray Tune's trial module: loaded when a trial runs

        params = self.params(trial) if takes_model_params(self.trainer.model_init) else None
        model = self.model(trial, params)
        if params is None:
            params = self.params(trial)
        logger.info("Trial: %s", trial.params)
        name = self.hp_name(trial) if self.hp_name is not None else f"run-{trial.number}"
        args = trial_args(self.trainer.args, params, os.path.join(self.trainer.args.output_dir, name), None, None)
        run = copy.copy(self.trainer)  # the user's Trainer stays as it was
        run.hp_search_setup(args, model, callbacks=copy.deepcopy(self.callbacks), trial_name=name,
                            trial_params=dict(trial.params))
        reporter = _Reporter(trial, run, self.compute_objective, self.n)
        try:
            run.train(trial=reporter)
            if reporter.objective is None:  # no evaluation ran during training
                reporter.objective = _value(self.compute_objective(run.evaluate()), self.n)
            checkpoint = reporter.checkpoint or _newest_checkpoint(args.output_dir)
            if checkpoint and os.path.isdir(checkpoint):
                trial.set_user_attr("checkpoint", checkpoint)
            return reporter.objective
        finally:
            run.model = run.model_wrapped = run.optimizer = run.lr_scheduler = None
            del run, model
            gc.collect()
            _empty_device_cache()


def _newest_checkpoint(output_dir: str) -> str | None:
    from ..checkpoint.store import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
