"""DRIVER side: hyperparameter_search with Ray Tune + Optuna; one trial = one raytrain run.

A sweep lives in one directory, `<output_dir>/sweeps/<name>/` (or `<storage_path>/<name>/`; for a
URI storage_path, Tune's state and the reported checkpoints go to `<uri>/<name>/` through Ray's
storage, a distributed trial's through its TorchTrainer's run at `<uri>/<name>/trial_<id>/ray_train/`;
the rest stays in `<output_dir>/sweeps/<name>/` and mirror.py copies it up)::

    experiment_state-*.json, searcher-state-*.pkl, tuner.pkl   Ray Tune's state (Tuner.restore)
    optuna.db                                                  the Optuna study (SQLite)
    trial_<id>/                                                one trial: raytrain checkpoints, Tune's
                                                               result.json, its stdout/stderr logs
    trials.csv, *.html, plots/objective.png                    the results

A search space is a YAML-style spec (raytrain.sweep.space) or Ray Tune sample objects; the YAML
file for the CLI (search_spaces/*.yaml) adds metric, mode, num_samples, scheduler, sampler, seed.
Restore glue (what Ray + Optuna did not do alone): `_Search` hands out Optuna trials asked before the
driver died but after Tune's last state save, so the study ends with exactly n_trials trials; the
sampler is rebuilt per trial with a seed from (seed, trial number) (sampler.py), because the
sampler restored from Tune's pickle would restart its random stream from the last save.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import uuid
from typing import Callable

from ..config.args import ConfigError, TrainingArguments
from ..callbacks import DefaultFlowCallback, PrinterCallback, ProgressCallback
from ..hf.objects import best_run_base
from .space import SearchSpace, default_compute_objective, load_search_spec, objective_defaults, space_from_spec

logger = logging.getLogger(__name__)

__all__ = ["BestRun", "hyperparameter_search", "load_search_spec", "space_from_spec"]

_DRIVER_CPU = 0.01  # a distributed trial's function only waits on its TorchTrainer
_NO_MAX_T = 10**6  # evaluations: ASHA/HyperBand never cut a trial only for its length
SCHEDULERS = ("asha", "hyperband", "median", "pbt", "none")
SAMPLERS = ("tpe", "random", "cmaes", "qmc")  # sampler.py builds them


class BestRun(best_run_base()):
    """HF's BestRun (transformers.trainer_utils.BestRun when installed: isinstance holds and it unpacks
    to HF's four fields): the best trial's id, objective and hyperparameters; run_summary is the
    trials table (a DataFrame). `checkpoint` is the trial's raytrain checkpoint of that objective."""

    checkpoint: str | None = None

    def __new__(cls, run_id, objective, hyperparameters, run_summary=None, checkpoint=None):
        self = super().__new__(cls, run_id, objective, hyperparameters, run_summary)
        self.checkpoint = checkpoint
        return self

    def __repr__(self) -> str:
        return (f"BestRun(run_id={self.run_id!r}, objective={self.objective!r}, "
                f"hyperparameters={self.hyperparameters!r}, checkpoint={self.checkpoint!r})")


def _metric_objective(metric: str) -> Callable:
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    return lambda m: m[key]


def user_callbacks(trainer) -> list:
    """The callbacks the user gave the Trainer (each trial's Trainer adds the built-in ones itself)."""
    from ..callbacks.mlflow import MLflowCallback

    built_in = (DefaultFlowCallback, PrinterCallback, ProgressCallback, MLflowCallback)
    return [cb for cb in trainer.callback_handler.callbacks if not isinstance(cb, built_in)]


def _search_class():
    from optuna.trial import Trial, TrialState
    from ray.tune.search.optuna import OptunaSearch

    class _Search(OptunaSearch):
        """OptunaSearch whose new trials first take over the study's orphans: trials Optuna handed
        out after Tune's last state save, before the driver died (same parameters, same count).
        With a URI, each save of Tune's searcher state first copies the SQLite study there, so the
        study at the URI is never older than the searcher state Tune syncs after it."""

        mirror = None

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
            # A trial the scheduler stopped early is PRUNED for Optuna, as with Optuna's own pruners:
            # TPE then ranks it below the trials that ran to the end (by how far it got), instead
            # of taking its accuracy after a few steps for a final result.
            step, max_steps = (result or {}).get("step"), (result or {}).get("max_steps")
            value = (result or {}).get(self.metric) if isinstance(self.metric, str) else None
            if error or value is None or not step or not max_steps or step >= max_steps \
                    or trial_id in self._completed_trials or trial_id not in self._ot_trials:
                return super().on_trial_complete(trial_id, result, error)
            trial = self._ot_trials[trial_id]
            try:
                trial.report(value, result.get("training_iteration", step))
                self._ot_study.tell(trial, state=TrialState.PRUNED)
            except Exception as exc:  # e.g. NaN, as OptunaSearch does
                logger.warning(exc)
            self._completed_trials.add(trial_id)

        def save(self, checkpoint_path: str):
            super().save(checkpoint_path)
            if self.mirror is not None:
                self.mirror.push_study()

        def suggest(self, trial_id: str):
            if trial_id not in self._ot_trials and self._ot_study is not None:
                owned = {t._trial_id for t in self._ot_trials.values()}
                orphans = [t for t in self._ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                           if t._trial_id not in owned]
                if orphans:
                    self._ot_trials[trial_id] = Trial(self._ot_study, orphans[0]._trial_id)
            return super().suggest(trial_id)

    return _Search


def _pbt_class():
    from ray.tune.schedulers import PopulationBasedTraining

    class PBT(PopulationBasedTraining):
        """Ray's PBT, less a race: a trial exploited while its last result's checkpoint is still being
        saved keeps a cached STOP in Tune's controller (pause_trial drops the cached decision, then its
        stop re-caches one because the trial is saving), and Tune applies it to the first result after the
        restart: the trial ended at its next evaluation instead of its max_steps. The clone starts
        anew, so no decision of its former run applies."""

        def _exploit(self, tune_controller, trial, trial_to_clone):
            super()._exploit(tune_controller, trial, trial_to_clone)
            getattr(tune_controller, "_cached_trial_decisions", {}).pop(trial.trial_id, None)

    return PBT


def _scheduler(name: str | None, mutations: dict | None, kwargs: dict):
    from ray.tune import schedulers as s

    if name in (None, "none", "fifo"):
        return None
    # Trials report once per evaluation: training_iteration counts evaluations. Ray's max_t (100)
    # would stop every trial at its 100th evaluation; a trial ends at its own max_steps instead
    # (the rungs are grace_period * reduction_factor**k whatever max_t is).
    if name == "asha":
        return s.ASHAScheduler(**{"grace_period": 1, "reduction_factor": 2, "max_t": _NO_MAX_T, **kwargs})
    if name == "hyperband":
        return s.AsyncHyperBandScheduler(**{"grace_period": 1, "reduction_factor": 3, "brackets": 3,
                                            "max_t": _NO_MAX_T, **kwargs})
    if name == "median":
        return s.MedianStoppingRule(**{"grace_period": 1, "min_samples_required": 2, "time_attr": "training_iteration",
                                       **kwargs})
    if name == "pbt":
        return _pbt_class()(hyperparam_mutations=mutations,
                            **{"time_attr": "training_iteration", "perturbation_interval": 2, **kwargs})
    raise ConfigError(f"scheduler: must be one of {', '.join(SCHEDULERS)}, got {name!r}")


def _check(trainer, space, directions: list[str], scheduler: str | None, sampler: str) -> None:
    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler: must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    if sampler == "cmaes" and importlib.util.find_spec("cmaes") is None:
        raise ConfigError("sampler: 'cmaes' needs the cmaes package (Optuna's CmaEsSampler uses it): "
                          "pip install cmaes, or choose tpe, random or qmc")
    if trainer.model_init is None:
        raise ValueError("hyperparameter_search needs a Trainer built with model_init (one model per trial)")
    bad = [d for d in directions if d not in ("minimize", "maximize")]
    if bad or not directions:
        raise ValueError(f"direction: must be 'minimize', 'maximize' or a list of them, got {bad or directions!r}")
    if trainer.args.eval_strategy == "no":
        raise ValueError("hyperparameter_search: eval_strategy is 'no', so trials report nothing; "
                         "set eval_strategy to 'steps' or 'epoch'")
    if not space:
        raise ValueError("hyperparameter_search: hp_space is empty")
    names = space.names if isinstance(space, SearchSpace) else list(space)
    data = [k for k in names if k.startswith("data.")]
    if data:
        raise ValueError(f"hp_space: {data[0]}: data parameters cannot vary per trial (the datasets are built once)")
    if scheduler not in (None, *SCHEDULERS, "fifo"):
        raise ConfigError(f"scheduler: must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
    if len(directions) > 1 and scheduler not in (None, "none", "fifo"):
        raise ValueError(f"scheduler {scheduler!r} needs one objective; a multi-objective sweep takes scheduler='none'")
    if scheduler == "pbt":
        arch = [k for k in names if k.startswith("model.")]
        if arch:
            raise ValueError(f"hp_space: {arch[0]}: PBT clones checkpoints between trials, so the architecture "
                             "must not vary; drop model.* keys or use asha")
        if trainer.args.scaling.num_workers > 1:
            raise ValueError("scheduler 'pbt' needs one-worker trials (scaling.num_workers=1): distributed "
                             "trials report no Tune checkpoints to clone")
        if trainer.args.save_strategy == "no":
            raise ValueError("scheduler 'pbt' clones checkpoints: set save_strategy (it is 'no')")


def _space(hp_space) -> SearchSpace | dict:
    from .space import FunctionSpace, default_hp_space_optuna, function_space

    if hp_space is None:  # HF's default space
        return FunctionSpace(default_hp_space_optuna, ["learning_rate", "num_train_epochs", "seed",
                                                       "per_device_train_batch_size"])
    if callable(hp_space) and not isinstance(hp_space, SearchSpace):
        # HF's Optuna style (suggests on the trial): Optuna's define-by-run on Ray Tune; else it returns a space.
        space = function_space(hp_space)
        if space is not None:
            return space
    space = hp_space(None) if callable(hp_space) and not isinstance(hp_space, SearchSpace) else hp_space
    if isinstance(space, dict) and space and all(isinstance(v, dict) for v in space.values()):
        return space_from_spec(space)  # the YAML form, from Python
    return space if isinstance(space, SearchSpace) else dict(space or {})


def _resources(args: TrainingArguments, resources_per_trial: dict | None, max_concurrent: int | None,
               bundles: list[dict] = ()):
    """Per-trial resources and concurrency from the scaling section when not given. A distributed
    trial's function only drives its TorchTrainer, whose workers reserve their own resources
    (Ray Train v2 with Tune), so concurrency is what the cluster holds of those workers. `bundles`: the
    actors a trial's trainer starts beside it (AsyncGRPO's rollout actors), reserved in its placement group."""
    import ray

    scaling = args.scaling
    if scaling.num_workers <= 1:
        per = resources_per_trial or scaling.resources_per_worker or {"CPU": 1, "GPU": int(scaling.use_gpu)}
        if bundles:
            from ray import tune

            return tune.PlacementGroupFactory([{k.upper(): v for k, v in per.items() if v}, *bundles]), max_concurrent
        return {k.lower(): v for k, v in per.items() if v}, max_concurrent
    per_worker = scaling.resources_per_worker or {"CPU": 1, "GPU": int(scaling.use_gpu)}
    driver = resources_per_trial or {"cpu": _DRIVER_CPU}  # Tune refuses an empty request
    if max_concurrent is None:
        total = ray.cluster_resources()
        need = {k.upper(): v * scaling.num_workers for k, v in per_worker.items() if v}
        for k, v in driver.items():
            need[k.upper()] = need.get(k.upper(), 0) + v
        fits = [int(total.get(k, 0) // v) for k, v in need.items() if v]
        max_concurrent = max(1, min(fits)) if fits else 1
    return driver, max_concurrent


def hyperparameter_search(trainer, hp_space=None, compute_objective: Callable | None = None, n_trials: int = 20,
                          direction: str | list[str] | None = None, scheduler: str | None = None,
                          scheduler_kwargs: dict | None = None, max_concurrent_trials: int | None = None,
                          seed: int | None = None, metric: str | None = None, resources_per_trial: dict | None = None,
                          storage_path: str | None = None, name: str | None = None, sampler: str = "tpe",
                          resume: bool | str = False, show_trial_logs: bool = False, plots: bool = True,
                          scope: str = "last"):
    """Search hyperparameters of `trainer` (built with model_init) on Ray Tune. Returns a BestRun, or for
    several directions the Pareto front as a list of BestRun. A trial's objective is its last evaluation's
    (HF's default; scope="best": its best), minimized unless `direction` says otherwise; a trainer naming its own
    objective (Trainer.hp_objective: GRPO / RLOO's mean reward, maximized) has it when neither metric nor
    compute_objective is given. No scheduler unless one is named (HF's default). resume=True
    continues the sweep of the same name (an error if there is none), "auto" continues it if it exists;
    False refuses to overwrite one."""
    if scope not in ("last", "best"):
        raise ValueError(f"scope: must be 'last' (a trial's last evaluation) or 'best', got {scope!r}")
    from ray import tune

    from ..driver.launch import ensure_ray
    from .continued import name_orphans, recorded_steps
    from .mirror import Mirror, display, restoring_into
    from .report import StatusLines
    from .trial import join_uri, pack_spec, pack_trainer, run_trial, trial_dirname

    metric, direction = objective_defaults(trainer, metric, direction, compute_objective)
    directions = list(direction) if isinstance(direction, (list, tuple)) else [direction]
    space = _space(hp_space)
    _check(trainer, space, directions, scheduler, sampler)
    modes = ["min" if d == "minimize" else "max" for d in directions]
    keys = ["objective"] if len(modes) == 1 else [f"objective_{i}" for i in range(len(modes))]
    if compute_objective is None:
        compute_objective = _metric_objective(metric) if metric else default_compute_objective

    name = name or trainer.args.run_name or "sweep"
    root = storage_path or os.path.join(trainer.args.output_dir, "sweeps")
    remote = _is_uri(root)
    if remote:
        # Ray's storage holds Tune's state and the checkpoints trials report; each trial trains in
        # <output_dir>/sweeps/<name>/trial_<id> on its node's disk (sweep_dir, as without a URI).
        _check_uri(root)
        state_path = join_uri(root, name)
        sweep_dir = os.path.abspath(os.path.join(trainer.args.output_dir, "sweeps", name))
    else:
        root = os.path.abspath(os.path.expanduser(root))
        sweep_dir = state_path = os.path.join(root, name)
    restoring = _restoring(state_path, resume)
    os.makedirs(sweep_dir, exist_ok=True)
    mirror = Mirror(sweep_dir, state_path) if remote else None
    if restoring and mirror is not None:
        mirror.fetch_study()  # the searcher restored below reads it
    # Tune saves its state (trials, searcher) at most this often; a small period keeps a restore
    # close to where the driver died.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    # With a URI and save_total_limit, Tune syncs its state whenever it deletes a trial's old checkpoint
    # there (so a restore never names a deleted one), and warns about it on every frequent save.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Our status lines replace Tune's progress tables (the legacy reporter is silent at verbose=0).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    ensure_ray()

    tracker = None
    if "mlflow" in trainer.args.report_to:
        from .tracking import SweepTracker
        tracker = SweepTracker.start(sweep_dir, name, {
            "n_trials": n_trials, "direction": direction, "scheduler": scheduler, "sampler": sampler, "seed": seed,
            "metric": metric, "max_concurrent_trials": max_concurrent_trials,
            **{f"space.{k}": str(v) for k, v in
               (space.describe() if isinstance(space, SearchSpace) else space).items()}})
    spec = {
        # Each trial trains its own copy of the user's Trainer (subclass, overrides and all arguments).
        "trainer": pack_trainer(trainer), "sweep_dir": sweep_dir,
        "callbacks": user_callbacks(trainer),
        "compute_objective": compute_objective, "metric": metric, "mode": modes[0] if len(modes) == 1 else None,
        "directions": directions, "scheduler": scheduler, "mlflow": tracker.info if tracker else None,
        "show_trial_logs": show_trial_logs, "remote": remote, "uri": state_path if remote else None,
        # the step of each trial's last result in Tune's saved state: a trial re-reports what came after
        "recorded": recorded_steps(state_path) if restoring and not remote else {}, "restored": uuid.uuid4().hex,
    }
    name_orphans(sweep_dir, spec["recorded"])
    bundles = getattr(trainer, "actor_bundles", lambda: [])()
    resources, max_concurrent = _resources(trainer.args, resources_per_trial, max_concurrent_trials, bundles)
    # Packed: the trial puts the driver's sys.path in place before it unpickles the user's code.
    trainable = tune.with_resources(tune.with_parameters(run_trial, spec=pack_spec(spec)), resources)
    callbacks = [StatusLines(keys, tracker)]

    quiet = logging.getLogger("ray.tune")
    level = quiet.level
    # Tune unpickles the searcher (its study storage, its Mirror) in restore() and in fit(): they open
    # the current local directory, wherever the sweep ran before.
    with restoring_into(sweep_dir, state_path) if restoring and remote else contextlib.nullcontext():
        if restoring:
            print(f"[sweep] resuming {display(state_path) if remote else state_path}", flush=True)
            tuner = tune.Tuner.restore(state_path, trainable, resume_unfinished=True, resume_errored=False)
        else:
            tuner = _new_tuner(trainable, space, modes, keys, n_trials, scheduler, scheduler_kwargs, max_concurrent,
                               seed, sampler, root, name, sweep_dir, callbacks, trial_dirname, mirror,
                               trainer.args.save_total_limit)
        quiet.setLevel(logging.WARNING)  # "Wrote the latest version of all result files ..."
        try:
            grid = tuner.fit()  # restores the searcher's state first
        finally:
            quiet.setLevel(level)
    return _finish(grid, space, keys, modes, sweep_dir, name, tracker, plots, mirror, scope)


def _is_uri(path: str) -> bool:
    return "://" in path


def _check_uri(uri: str) -> None:
    import pyarrow.fs

    from .mirror import display

    try:
        pyarrow.fs.FileSystem.from_uri(uri)
    except Exception as e:  # unknown scheme, missing filesystem support
        raise ValueError(f"storage_path: {display(uri)!r}: pyarrow cannot open it ({str(e).splitlines()[0]}); "
                         "give an s3://, gs://, abfs:// or hdfs:// URI it reaches, or a local path") from None


def _restoring(sweep_dir: str, resume: bool | str) -> bool:
    from ray import tune

    exists = tune.Tuner.can_restore(sweep_dir)
    if resume is True and not exists:
        raise FileNotFoundError(f"resume=True: no sweep to continue in {sweep_dir}; run it without resume first")
    if resume is False and exists:
        raise FileExistsError(f"{sweep_dir} already holds a sweep; pass resume=True (CLI: --resume auto) to "
                              "continue it, or choose another name")
    return exists


def _new_tuner(trainable, space, modes, keys, n_trials, scheduler, scheduler_kwargs, max_concurrent, seed,
               sampler, root, name, sweep_dir, callbacks, trial_dirname, mirror=None, keep=None):
    import optuna
    from ray import tune

    from .mirror import StudyStorage
    from .sampler import make_sampler

    single = len(modes) == 1
    if scheduler == "pbt":
        mutations = space.to_tune() if isinstance(space, SearchSpace) else space
        param_space, search_alg = mutations, None
    else:
        mutations, param_space = None, (None if isinstance(space, SearchSpace) else space)
        storage = StudyStorage(sweep_dir) if mirror is not None else \
            optuna.storages.RDBStorage(f"sqlite:///{os.path.join(sweep_dir, 'optuna.db')}")
        search_alg = _search_class()(space=space if isinstance(space, SearchSpace) else None,
                                     metric=keys[0] if single else keys, mode=modes[0] if single else modes,
                                     sampler=make_sampler(sampler, seed, n_trials), study_name=name, storage=storage)
        search_alg.mirror = mirror
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric="objective" if single else None, mode=modes[0] if single else None, num_samples=n_trials,
            search_alg=search_alg, scheduler=_scheduler(scheduler, mutations, scheduler_kwargs or {}),
            max_concurrent_trials=max_concurrent, trial_dirname_creator=trial_dirname,
            reuse_actors=True),  # a warm process per trial slot: no Ray worker start-up per trial
        run_config=tune.RunConfig(name=name, storage_path=root, verbose=0, callbacks=callbacks,
                                  checkpoint_config=_checkpoint_config(mirror, keep, modes)),
    )


def _checkpoint_config(mirror, keep: int | None, modes: list[str]):
    """With a URI, Tune holds the trials' raytrain checkpoints: rotated there as the trial rotates its own."""
    from ray import tune

    from .trial import kept_checkpoints

    return kept_checkpoints(tune.CheckpointConfig, keep, modes[0] if len(modes) == 1 else None) if mirror else None


def _finish(grid, space, keys, modes, sweep_dir, name, tracker, plots, mirror=None, scope="last"):
    from .mirror import display
    from .report import print_table, trials_table, write_plots

    names = space.names if isinstance(space, SearchSpace) else list(space)
    table = trials_table(grid, names, keys, modes, scope)
    if mirror is not None:  # the best report's checkpoint as Tune persisted it at the URI
        table["checkpoint"] = [mirror.best_checkpoint(r, keys[0], modes[0], scope == "last")
                               for r in _by_trial_id(grid, table)]
    table.to_csv(os.path.join(sweep_dir, "trials.csv"), index=False)
    print(f"[sweep] {len(table)} trials ({display(mirror.uri) if mirror else sweep_dir}):", flush=True)
    print_table(table)
    ok = table.dropna(subset=keys)
    if ok.empty:
        errors = [e for e in table["error"] if e]
        if tracker:
            tracker.end(None, sweep_dir, table)
        if mirror is not None:
            mirror.push_results()
        raise RuntimeError(f"every trial failed; the first error: {errors[0] if errors else 'no trial reported'}")
    study = _load_study(sweep_dir, name)
    if plots:
        write_plots(sweep_dir, grid, keys, study)
    if mirror is not None:
        mirror.push_results()

    def best_run(row) -> BestRun:
        params = {k: _py(row[k]) for k in names if k in row and row[k] == row[k]}  # NaN: not sampled
        objective = float(row[keys[0]]) if len(keys) == 1 else [float(row[k]) for k in keys]
        return BestRun(row["trial_id"], objective, params, table, row["checkpoint"] or None)

    if len(keys) == 1:
        best = best_run(ok.sort_values(keys[0], ascending=modes[0] == "min").iloc[0])
        print(f"[sweep] best trial {best.run_id}: objective={best.objective:.6g} {best.hyperparameters} "
              f"checkpoint={best.checkpoint}", flush=True)
        if tracker:
            tracker.end(best, sweep_dir, table)
        return best
    front = _pareto(ok, keys, modes)
    print(f"[sweep] Pareto front: {[r['trial_id'] for _, r in front.iterrows()]}", flush=True)
    runs = [best_run(r) for _, r in front.iterrows()]
    if tracker:
        tracker.end(runs[0] if runs else None, sweep_dir, table)
    return runs


def _by_trial_id(grid, table) -> list:
    results = {os.path.basename(r.path).removeprefix("trial_"): r for r in grid}
    return [results[t] for t in table["trial_id"]]


def _py(v):
    return v.item() if hasattr(v, "item") else v


def _pareto(df, keys, modes):
    """Rows no other row dominates (each trial's best-per-objective reports, as in the table)."""
    signs = [1 if m == "min" else -1 for m in modes]
    vals = [[s * r[k] for k, s in zip(keys, signs)] for _, r in df.iterrows()]
    keep = [i for i, a in enumerate(vals)
            if not any(all(b[j] <= a[j] for j in range(len(a))) and b != a for b in vals)]
    return df.iloc[keep]


def _load_study(sweep_dir: str, name: str):
    path = os.path.join(sweep_dir, "optuna.db")
    if not os.path.isfile(path):
        return None
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{path}")
