"""DRIVER side: hyperparameter_search with Ray Tune (Optuna TPE; ASHA or PBT), one trial = one run.

A search space maps dotted config keys (`learning_rate`, `model.hidden_size`) to distributions,
either Ray Tune sample objects or, from YAML (search_spaces/*.yaml)::

    metric: eval_accuracy          # what evaluation reports and the search optimises
    mode: max                      # max | min
    num_samples: 8
    scheduler: asha                # asha | pbt | none
    space:
      learning_rate: {loguniform: [1.0e-4, 1.0e-2]}
      model.hidden_size: {choice: [64, 128, 256]}
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from typing import Any, Callable, NamedTuple

import yaml

from .args import ConfigError, TrainingArguments, apply_overrides
from .callbacks import DefaultFlowCallback, PrinterCallback, ProgressCallback, TrainerCallback

logger = logging.getLogger(__name__)

_DISTRIBUTIONS = {"uniform", "loguniform", "quniform", "randint", "choice", "grid"}


class BestRun(NamedTuple):
    """HF's BestRun: the best trial's id, objective and hyperparameters (plus Ray's ResultGrid)."""

    run_id: str
    objective: float
    hyperparameters: dict[str, Any]
    run_summary: Any = None


def default_compute_objective(metrics: dict[str, float]) -> float:
    """HF's default: eval_loss when it is the only metric, else the sum of the other eval metrics."""
    metrics = {k: v for k, v in metrics.items()
               if not k.endswith(("_runtime", "_per_second")) and k not in ("epoch", "step")}
    loss = metrics.pop("eval_loss", None)
    return loss if not metrics else sum(metrics.values())


def space_from_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """{"learning_rate": {"loguniform": [1e-4, 1e-2]}, ...} -> Ray Tune sample objects."""
    from ray import tune

    out = {}
    for key, dist in spec.items():
        if not isinstance(dist, dict) or len(dist) != 1 or next(iter(dist)) not in _DISTRIBUTIONS:
            raise ConfigError(f"space.{key}: expected one of {{{', '.join(sorted(_DISTRIBUTIONS))}}}: "
                              f"[values], got {dist!r}")
        kind, values = next(iter(dist.items()))
        out[key] = tune.grid_search(values) if kind == "grid" else getattr(tune, kind)(*values) \
            if kind != "choice" else tune.choice(values)
    return out


def load_search_spec(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"--search: file not found: {path!r}")
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    unknown = set(spec) - {"metric", "mode", "num_samples", "scheduler", "space", "max_concurrent_trials",
                           "seed", "scheduler_kwargs"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)} (valid: metric, mode, num_samples, "
                          "scheduler, scheduler_kwargs, space, max_concurrent_trials, seed)")
    if spec.get("mode", "min") not in ("min", "max"):
        raise ConfigError(f"{path}: mode must be min or max, got {spec['mode']!r}")
    if not spec.get("space"):
        raise ConfigError(f"{path}: 'space' is missing or empty")
    return spec


def _apply_params(args: TrainingArguments, params: dict[str, Any], output_dir: str) -> TrainingArguments:
    # model.* parameters go to model_init, not into the arguments.
    sets = [f"{k}={v}" for k, v in params.items() if not k.startswith("model.")]
    d = apply_overrides(args.to_dict(), sets)
    d["output_dir"] = output_dir
    d["overwrite_output_dir"] = True
    return TrainingArguments.from_dict(d)


class _TuneTrial:
    """What loop.py reports evaluations to inside a Tune trial (the worker never imports ray.tune)."""

    def __init__(self, compute_objective: Callable, metric: str):
        self.compute_objective, self.metric = compute_objective, metric

    def report(self, metrics: dict, step: int, checkpoint_dir: str | None = None) -> None:
        from ray import tune

        out = {**metrics, "step": step, "objective": self.compute_objective(metrics)}
        ckpt = tune.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        tune.report(out, checkpoint=ckpt)


def _make_trainable(spec: dict[str, Any]):
    """The per-trial function: rebuild the trainer with the trial's parameters and train."""

    def trainable(config: dict[str, Any]) -> None:
        from ray import tune

        from .trainer import Trainer, set_seed

        trial_dir = tempfile.mkdtemp(prefix="raytrain-trial-")
        args = _apply_params(spec["args"], config, trial_dir)
        set_seed(args.seed, args.full_determinism)  # a trial's initial weights follow the seed too
        trainer = Trainer(model=_call_model_init(spec["model_init"], config), args=args,
                          callbacks=copy.deepcopy(spec["callbacks"]), **spec["trainer_kwargs"])
        trainer._trial_name = tune.get_context().get_trial_name()
        trainer._trial_params = dict(config)
        resume = None
        restored = tune.get_checkpoint()
        if restored is not None:
            resume = restored.to_directory(os.path.join(trial_dir, "restored"))
            trainer.add_callback(_RestoreTrialParams(args))
        trainer.train(resume_from_checkpoint=resume, trial=_TuneTrial(spec["compute_objective"], spec["metric"]))

    return trainable


class _RestoreTrialParams(TrainerCallback):
    """After PBT restores a checkpoint of another trial, the mutated learning rate must win over
    the restored optimizer/scheduler state."""

    def __init__(self, args):
        self.lr = args.learning_rate

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
            factor = [g["lr"] / b if b else 1.0 for g, b in zip(optimizer.param_groups, lr_scheduler.base_lrs)]
            lr_scheduler.base_lrs = [self.lr] * len(lr_scheduler.base_lrs)
            for g, f in zip(optimizer.param_groups, factor):
                g["lr"] = self.lr * f
                g["initial_lr"] = self.lr


def _built_in():
    from .callbacks.mlflow import MLflowCallback
    return (DefaultFlowCallback, PrinterCallback, ProgressCallback, MLflowCallback)


def _scheduler(name: str | None, space: dict, mode: str, kwargs: dict):
    from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

    if name in (None, "none", "fifo"):
        return None
    if name == "asha":
        return ASHAScheduler(**{"grace_period": 1, "reduction_factor": 2, **kwargs})
    if name == "pbt":
        return PopulationBasedTraining(hyperparam_mutations=space,
                                       **{"time_attr": "training_iteration", "perturbation_interval": 2, **kwargs})
    raise ConfigError(f"scheduler: must be asha, pbt or none, got {name!r}")


def hyperparameter_search(trainer, hp_space: dict | Callable | None = None, compute_objective: Callable | None = None,
                          n_trials: int = 20, direction: str = "minimize", scheduler: str | None = "asha",
                          scheduler_kwargs: dict | None = None, max_concurrent_trials: int | None = None,
                          seed: int | None = None, metric: str | None = None, resources_per_trial: dict | None = None,
                          storage_path: str | None = None, name: str | None = None) -> BestRun:
    """Search hyperparameters of `trainer` (built with model_init) with Ray Tune + Optuna TPE."""
    import ray
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    if trainer.model_init is None:
        raise ValueError("hyperparameter_search needs a Trainer built with model_init (one model per trial)")
    if direction not in ("minimize", "maximize"):
        raise ValueError(f"direction: must be 'minimize' or 'maximize', got {direction!r}")
    if trainer.args.eval_strategy == "no":
        raise ValueError("hyperparameter_search: eval_strategy is 'no', so trials report nothing; "
                         "set eval_strategy to 'steps' or 'epoch'")
    space = hp_space(None) if callable(hp_space) else dict(hp_space or {})
    if not space:
        raise ValueError("hyperparameter_search: hp_space is empty")
    bad = [k for k in space if k.startswith("data.")]
    if bad:
        raise ValueError(f"hp_space: {bad[0]}: data parameters cannot vary per trial (the datasets are built once)")
    mode = "min" if direction == "minimize" else "max"
    if compute_objective is None:
        compute_objective = (lambda m, key=f"eval_{metric}".replace("eval_eval_", "eval_"): m[key]) \
            if metric else default_compute_objective
    spec = {
        "args": trainer.args, "model_init": trainer.model_init,
        "callbacks": [cb for cb in trainer.callback_handler.callbacks if not isinstance(cb, _built_in())],
        "trainer_kwargs": {"train_dataset": trainer.train_dataset, "eval_dataset": trainer.eval_dataset,
                           "data_collator": trainer.data_collator, "compute_metrics": trainer.compute_metrics,
                           "compute_loss_func": trainer.compute_loss_func},
        "compute_objective": compute_objective, "metric": metric,
    }
    if not ray.is_initialized():
        # Trials import the user's factories (examples.digits...) from the working directory.
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    sched = _scheduler(scheduler, space, mode, scheduler_kwargs or {})
    search_alg = None if scheduler == "pbt" else OptunaSearch(seed=seed)
    trainable = tune.with_resources(_make_trainable(spec), resources_per_trial or {"cpu": 1})
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric="objective", mode=mode, num_samples=n_trials, search_alg=search_alg,
                                    scheduler=sched, max_concurrent_trials=max_concurrent_trials),
        run_config=tune.RunConfig(name=name, storage_path=os.path.abspath(storage_path) if storage_path else None,
                                  verbose=0),
    )
    grid = tuner.fit()
    errors = [r.error for r in grid if r.error]
    if len(errors) == len(grid):
        raise RuntimeError(f"every trial failed; the first error: {errors[0]}")
    best = grid.get_best_result(metric="objective", mode=mode, scope="all")
    objective = best.metrics_dataframe["objective"].max() if mode == "max" else best.metrics_dataframe["objective"].min()
    return BestRun(best.metrics.get("trial_id", ""), float(objective), dict(best.config), grid)


def _call_model_init(model_init: Callable, config: dict[str, Any]):
    """model_init(**model.* params) if it takes keywords, model_init(config) (HF's Ray backend) if it
    takes one argument, else model_init()."""
    import inspect

    params = inspect.signature(model_init).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return model_init(**{k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("model.")})
    return model_init(config) if len(params) == 1 else model_init()


def run_search_cli(args: TrainingArguments, job: dict, path: str) -> int:
    """python -m raytrain.run --config X.yaml --search S.yaml"""
    from .run import import_string
    from .trainer import Trainer

    spec = load_search_spec(path)
    space = space_from_spec(spec["space"])
    factory = import_string(args.model.factory, "model.factory")
    base_kwargs = args.model.kwargs

    def model_init(**kw):
        return factory(**{**base_kwargs, **kw})

    job = {k: v for k, v in job.items() if k != "model"}
    trainer = Trainer(args=args, model_init=model_init, **job)
    mode = spec.get("mode", "min")
    best = hyperparameter_search(trainer, space, n_trials=spec.get("num_samples", 8),
                                 direction="maximize" if mode == "max" else "minimize",
                                 scheduler=spec.get("scheduler", "asha"), scheduler_kwargs=spec.get("scheduler_kwargs"),
                                 max_concurrent_trials=spec.get("max_concurrent_trials"), seed=spec.get("seed"),
                                 metric=spec.get("metric"), storage_path=os.path.join(args.output_dir, "tune"))
    print(f"best trial: objective={best.objective:.6g} hyperparameters={best.hyperparameters}")
    return 0
