"""The CLI's hyperparameter search: python -m raytrain.run --config X.yaml --search S.yaml, the search
YAML's keys (for --help), and the run of the sweep from the config's factories."""

from __future__ import annotations

import inspect
import os
from typing import Any

from ..config.args import ConfigError, TrainingArguments
from ..config.sections import import_string

SEARCH_HELP = """\
search YAML (--search FILE; each key can be overridden with --set search.KEY=VALUE):
  space                  the hyperparameters: NAME: {uniform|loguniform: [low, high]}, {int|logint: [low, high]},
                         {quniform: [low, high, step]}, {choice: [a, b, ...]}; model.NAME goes to the model factory
  metric, mode           the objective (e.g. eval_accuracy, max); mode may be a list for several objectives;
                         without metric: HF's (eval_loss, min), GRPO / RLOO's mean reward (eval_reward, max)
  num_samples            trials to run (default 8)
  scheduler              asha (default), hyperband, median, pbt or none; scheduler_kwargs: its arguments
  sampler                tpe (default), random, cmaes or qmc; seed: the sampler's seed
  max_concurrent_trials  trials at once (default: what the cluster holds)
  name, storage_path     the sweep's name (default: the file's) and where it lives (default OUTPUT_DIR/sweeps)
  show_trial_logs        print the trials' output instead of writing trial_<id>/trial.log"""


def run_search_cli(args: TrainingArguments, job: dict, path: str, resume: Any = "auto",
                   spec: dict | None = None) -> int:
    """python -m raytrain.run --config X.yaml --search S.yaml [--set search.KEY=VALUE] [--resume auto|never]"""
    from ..sweep import hyperparameter_search, load_search_spec, space_from_spec
    from .trl import trainer_for

    spec = spec if spec is not None else load_search_spec(path)
    space = space_from_spec(spec["space"])
    factory = import_string(args.model.factory, "model.factory")
    base_kwargs = args.model.kwargs

    def model_init(**kw):
        return factory(**{**base_kwargs, **kw})

    job = {k: v for k, v in job.items() if k != "model"}
    cls = trainer_for(args)
    if "model_init" not in inspect.signature(cls.__init__).parameters:
        raise ConfigError(f"--search: {cls.__name__} takes no model_init (a fresh model per trial); the CLI sweeps "
                          "raytrain's Trainer, Seq2SeqTrainer, GRPOTrainer and RLOOTrainer")
    trainer = cls(args=args, model_init=model_init, **job)
    mode = spec.get("mode")  # None: the trainer's objective's (Trainer.hp_objective), else min
    direction = [("maximize" if m == "max" else "minimize") for m in mode] if isinstance(mode, list) else \
        None if mode is None else ("maximize" if mode == "max" else "minimize")
    name = spec.get("name") or os.path.splitext(os.path.basename(path))[0]
    best = hyperparameter_search(trainer, space, n_trials=spec.get("num_samples", 8), direction=direction,
                                 scheduler=spec.get("scheduler", "asha"), scheduler_kwargs=spec.get("scheduler_kwargs"),
                                 max_concurrent_trials=spec.get("max_concurrent_trials"), seed=spec.get("seed"),
                                 metric=spec.get("metric"), sampler=spec.get("sampler", "tpe"), name=name,
                                 show_trial_logs=bool(spec.get("show_trial_logs", False)),
                                 storage_path=spec.get("storage_path"),
                                 resume="auto" if resume == "auto" else False)
    for b in best if isinstance(best, list) else []:  # the search printed the best of one objective
        print(f"Pareto trial {b.run_id}: objective={b.objective} hyperparameters={b.hyperparameters} "
              f"checkpoint={b.checkpoint}")
    return 0
