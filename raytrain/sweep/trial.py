"""TRIAL side of a sweep: the function Ray Tune runs once per trial.

Each trial trains in its own directory under the sweep directory and continues from its newest
raytrain checkpoint there when Tune restarts it (driver restore, PBT). Tune is told the
checkpoint's path in every result; under PBT it also gets a pointer checkpoint (one small JSON
file naming raytrain's checkpoint), so no second copy of the weights is made per evaluation.
One-worker trials train in this process; more workers run a Ray Train TorchTrainer from here. In a
URI sweep a one-worker trial reports raytrain's checkpoint to Tune, a distributed one to its
TorchTrainer's run at the URI (Ray Train persists it; Tune's result names it): one upload each.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable

from ..config.args import TrainingArguments, apply_overrides
from ..callbacks import TrainerCallback
from ..driver.torch_trainer import build_torch_trainer, fit
from ..worker.ray_worker import pickle_trainer, report_in_place
from .continued import first_start_since_restore, unreported

logger = logging.getLogger(__name__)

POINTER = "raytrain_checkpoint.json"
CKPT_KEY = "raytrain_checkpoint"


def driver_sys_path() -> list[str]:
    """This process's import path, absolute: what the trials need to import the user's code as the
    driver did (a directory added with sys.path.insert is in no worker's path otherwise)."""
    return [os.path.abspath(p or os.curdir) for p in sys.path]


def use_sys_path(paths: list[str]) -> None:
    """Put the driver's import directories this process lacks in front of sys.path, in the driver's order."""
    missing = [p for p in dict.fromkeys(paths) if p not in sys.path and os.path.exists(p)]
    sys.path[:0] = missing


def pack_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The trial's spec as bytes beside the driver's sys.path: Ray would unpickle a user's function in
    it (compute_objective, callbacks) before run_trial could extend the path."""
    import cloudpickle

    return {"sys_path": driver_sys_path(), "packed": cloudpickle.dumps(spec)}


def _unpack_spec(spec: dict[str, Any]) -> dict[str, Any]:
    import cloudpickle

    if "packed" not in spec:
        return spec
    use_sys_path(spec["sys_path"])
    return cloudpickle.loads(spec["packed"])


def _rebuild_reporter(sys_path: list[str], packed: bytes):
    import cloudpickle

    use_sys_path(sys_path)
    cls, state = cloudpickle.loads(packed)
    reporter = object.__new__(cls)
    reporter.__setstate__(state)
    return reporter


def trial_dirname(trial) -> str:
    return f"trial_{trial.trial_id}"


def trial_args(args: TrainingArguments, params: dict[str, Any], output_dir: str, metric: str | None,
               mode: str | None) -> TrainingArguments:
    """The trial's arguments: the base with the trial's (non model.*) parameters, its own output_dir,
    and, when the objective is one metric, rotation that keeps the best checkpoint by that metric."""
    sets = [f"{k}={v}" for k, v in params.items() if not k.startswith("model.")]
    d = apply_overrides(args.to_dict(), sets)
    d.update(output_dir=output_dir, overwrite_output_dir=True, disable_tqdm=True)
    if metric and mode in ("min", "max") and d.get("metric_for_best_model") is None:
        d.update(metric_for_best_model=metric, greater_is_better=mode == "max")
    return type(args).from_dict(d)  # a subclass (Seq2SeqTrainingArguments) keeps its fields


def objectives(compute_objective: Callable, metrics: dict, n: int) -> dict[str, float]:
    value = compute_objective(metrics)
    if n == 1:
        return {"objective": float(value)}
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"compute_objective must return {n} values (one per direction), got {value!r}")
    return {f"objective_{i}": float(v) for i, v in enumerate(value)}


def _plain(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, (int, float, str, bool)):
            out[k] = v
    return out


class _Reporter(TrainerCallback):
    """loop.py's `trial`: each evaluation becomes one Tune result (the worker never imports ray.tune).
    It is also a callback, to learn the run's max_steps (a result below it was stopped early)."""

    def __init__(self, compute_objective: Callable, n_objectives: int, pointer: bool = False,
                 upload: bool = False):
        self.compute_objective, self.n, self.pointer, self.upload = compute_objective, n_objectives, pointer, upload
        self.max_steps = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.max_steps = state.max_steps

    def result(self, metrics: dict, step: int, checkpoint_dir: str | None) -> dict:
        # reported_at: Tune's own timestamp has whole seconds; results of concurrent trials are ordered by this.
        return {**_plain(metrics), **objectives(self.compute_objective, metrics, self.n), "step": step,
                "max_steps": self.max_steps, CKPT_KEY: os.path.abspath(checkpoint_dir) if checkpoint_dir else "",
                "reported_at": time.time()}

    def report(self, metrics: dict, step: int, checkpoint_dir: str | None = None) -> None:
        from ray import tune

        result = self.result(metrics, step, checkpoint_dir)
        checkpoint = None
        if self.upload and checkpoint_dir:
            # A URI sweep: Ray persists raytrain's checkpoint there (restore and PBT fetch it back).
            checkpoint = tune.Checkpoint.from_directory(checkpoint_dir)
        elif self.pointer and checkpoint_dir:
            # PBT clones trials through Tune checkpoints: hand it a pointer, not the weights.
            where = os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), ".tune-pointer")
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, POINTER), "w") as f:
                json.dump({"path": result[CKPT_KEY], "step": step}, f)
            checkpoint = tune.Checkpoint.from_directory(where)
        tune.report(result, checkpoint=checkpoint)


class _WorkerReporter(_Reporter):
    """In a Ray Train worker of a distributed trial: every rank reports (Ray Train requires it);
    the trial's _ToTune callback forwards rank 0's result to Tune. In a URI sweep (upload) rank 0
    also reports the evaluation's raytrain checkpoint to Ray Train. It carries the trial's MLflow
    variables (its child run) to the workers, which do not inherit the trial's environment."""

    _ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.env = {k: os.environ[k] for k in self._ENV if k in os.environ}

    def __setstate__(self, state):
        self.__dict__.update(state)
        os.environ.update(self.env)  # unpickled on the worker before MLflowCallback starts its run

    def __reduce__(self):
        # The driver's sys.path first: the state holds the user's compute_objective.
        import cloudpickle

        return _rebuild_reporter, (driver_sys_path(), cloudpickle.dumps((type(self), self.__dict__)))

    unregistered: tuple[str, int] | None = None  # (directory in Ray's storage, step): see register

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.unregistered is not None:
            self.register(args, *self.unregistered)
            self.unregistered = None

    def register(self, args, directory: str, step: int) -> None:
        """A URI sweep's evaluation checkpoint that reached the trial's storage but that Ray never
        registered (the node was lost before its controller polled): reported again where it lies (no
        upload), with its evaluation read back from its trainer_state.json, so that Tune gets the result
        it missed and Ray rotates the checkpoint by its objective (which Ray's CheckpointConfig needs)."""
        import ray.train

        from ..checkpoint.store import TRAINER_STATE, checkpoint_dir

        fs = ray.train.get_context().get_storage().storage_filesystem
        with fs.open_input_stream(f"{directory}/{TRAINER_STATE}") as f:
            history = json.loads(f.read())["log_history"]
        metrics: dict = {}
        for entry in history:
            if entry.get("step") == step and any(key.startswith("eval_") for key in entry):
                metrics.update((key, value) for key, value in entry.items() if key != "step")
        if not metrics:  # (every ray_train checkpoint of a trial is an evaluation's; this one is not raytrain's)
            logger.warning("%s holds no evaluation at step %d: left unregistered", directory, step)
            return
        report_in_place(self.result(metrics, step, checkpoint_dir(args.output_dir, step)), directory,
                        ray.train.get_context().get_world_rank() == 0)

    def report(self, metrics: dict, step: int, checkpoint_dir: str | None = None) -> None:
        import ray.train

        checkpoint = name = None
        if self.upload and checkpoint_dir:
            # A URI sweep: rank 0's raytrain checkpoint is persisted by Ray Train into the trial's
            # storage at the URI (every rank writes the same directory; one upload is enough).
            name = os.path.basename(os.path.abspath(checkpoint_dir))  # Ray broadcasts rank 0's
            if ray.train.get_context().get_world_rank() == 0:
                checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
        ray.train.report(self.result(metrics, step, checkpoint_dir), checkpoint=checkpoint,
                         checkpoint_dir_name=name)


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


def _resume_point(trial_dir: str) -> tuple[str | None, bool]:
    """(checkpoint to continue, whether it is another trial's). Fetching what Tune restored is done
    here; resume.choose decides: PBT's exploit hands this trial a pointer into another trial's
    directory, which wins; otherwise this trial's newest complete checkpoint (after a driver
    restore it may be newer than the last one Tune heard of)."""
    from ray import tune

    from ..worker.resume import choose

    restored = tune.get_checkpoint()
    if restored is not None and _is_raytrain_checkpoint(restored):
        return _fetch_checkpoint(restored, trial_dir)
    clone = None
    if restored is not None:
        with restored.as_directory() as d:
            with open(os.path.join(d, POINTER)) as f:
                path = json.load(f)["path"]
        if os.path.dirname(path) != trial_dir:
            if not os.path.isdir(path):
                raise FileNotFoundError(f"PBT: the checkpoint to clone, {path}, was rotated away; "
                                        "raise save_total_limit")
            clone = path
    kind, path = choose(trial_dir, clone=clone)
    return path, kind == "clone"


def _is_raytrain_checkpoint(checkpoint) -> bool:
    """A URI sweep reports raytrain's checkpoint itself (no pointer file)."""
    import pyarrow.fs

    from ..checkpoint.store import TRAINER_STATE

    info = checkpoint.filesystem.get_file_info(f"{checkpoint.path}/{TRAINER_STATE}")
    return info.type == pyarrow.fs.FileType.File


def _fetch_checkpoint(checkpoint, trial_dir: str) -> tuple[str, bool]:
    """(local checkpoint to continue from, whether it is another trial's) for a checkpoint Tune
    persisted at the sweep's URI. This trial's own newest local checkpoint wins when it is at least
    as new (a driver restore on the same node); else the persisted one is downloaded into the trial
    directory as checkpoint-<step>, where raytrain's resume and rotation find it."""
    import shutil

    from ..checkpoint.store import TRAINER_STATE, checkpoint_dir, get_last_checkpoint, sorted_checkpoints

    own = os.path.basename(os.path.dirname(checkpoint.path)) == os.path.basename(trial_dir)
    with checkpoint.filesystem.open_input_file(f"{checkpoint.path}/{TRAINER_STATE}") as f:
        step = int(json.loads(f.read())["global_step"])
    last = get_last_checkpoint(trial_dir) if own else None
    if last is not None and dict((p, s) for s, p in sorted_checkpoints(trial_dir))[last] >= step:
        return last, False
    os.makedirs(trial_dir, exist_ok=True)
    staging = os.path.join(trial_dir, ".fetching")
    shutil.rmtree(staging, ignore_errors=True)
    checkpoint.to_directory(staging)
    target = checkpoint_dir(trial_dir, step)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target, not own


def run_trial(config: dict[str, Any], spec: dict[str, Any]) -> None:
    """The per-trial function (tune.with_parameters passes `spec` through the object store). Its
    output goes to <trial dir>/trial.log unless the sweep shows trial logs on the console."""
    from ray import tune

    spec = _unpack_spec(spec)
    trial_dir = os.path.join(spec["sweep_dir"], f"trial_{tune.get_context().get_trial_id()}")
    if spec["show_trial_logs"]:
        return _run_trial(config, spec, trial_dir)
    os.makedirs(trial_dir, exist_ok=True)
    with open(os.path.join(trial_dir, "trial.log"), "a", buffering=1) as log:
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package = logging.getLogger("raytrain")
        package.addHandler(handler)
        package.setLevel(logging.INFO)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                return _run_trial(config, spec, trial_dir)
        except BaseException:
            log.write(traceback.format_exc())
            raise
        finally:
            package.removeHandler(handler)


def pack_trainer(trainer) -> bytes:
    """The user's Trainer for the trials (its class and every argument, cloudpickled as for Ray workers),
    less what each trial makes anew: model, optimizer, callbacks (the sweep passes its own beside it)."""
    view = copy.copy(trainer)
    view.model = view.callback_handler = view.optimizer = view.lr_scheduler = None
    view.optimizers = (None, None)
    return pickle_trainer(view, trainer.args)


def _run_trial(config: dict[str, Any], spec: dict[str, Any], trial_dir: str) -> None:
    import cloudpickle
    from ray import tune

    from ..runtime.seeding import set_seed

    ctx = tune.get_context()
    trial_id = ctx.get_trial_id()
    trainer = cloudpickle.loads(spec["trainer"])  # this trial's own copy of the user's Trainer
    args = trial_args(trainer.args, config, trial_dir, spec["metric"], spec["mode"])
    set_seed(args.seed, args.full_determinism)  # a trial's initial weights follow the seed too
    if spec.get("mlflow"):
        from .tracking import start_child_run
        start_child_run(spec["mlflow"], trial_id, config, args)
    model = model_for_trial(trainer.model_init, config)
    trainer.hp_search_setup(args, model, callbacks=copy.deepcopy(spec["callbacks"]),
                            trial_name=ctx.get_trial_name(), trial_params=dict(config))
    resume, cloned = _resume_point(trial_dir)
    if cloned:
        logger.warning("PBT: continuing from %s with learning_rate=%r", resume, args.learning_rate)
        trainer.add_callback(_RestoreTrialParams(args))
    n = len(spec["directions"])
    remote = spec.get("remote", False)
    reporter = _Reporter(spec["compute_objective"], n, pointer=spec["scheduler"] == "pbt" and not remote,
                         upload=remote)
    if not cloned and trial_id in spec.get("recorded", {}) and first_start_since_restore(trial_dir, spec["restored"]):
        # After a driver restore: what this trial evaluated after Tune's last saved state, once, from the
        # trial's own process (a distributed trial's workers have not started yet).
        max_steps, lost = unreported(resume, spec["recorded"][trial_id])
        if lost:
            logger.warning("re-reporting %d evaluation(s) after step %d that the sweep's saved state lost",
                           len(lost), spec["recorded"][trial_id])
            reporter.max_steps = max_steps  # the run's, as on_train_begin sets it
        for metrics, step, saved in lost:
            reporter.report(metrics, step, saved)
    if args.scaling.num_workers > 1:
        storage = join_uri(spec["uri"], os.path.basename(trial_dir)) if remote else None
        _run_distributed(trainer, resume, _WorkerReporter(spec["compute_objective"], n, upload=remote), storage,
                         spec["mode"])
        return
    trainer.add_callback(reporter)
    trainer.train(resume_from_checkpoint=resume, trial=reporter)


def join_uri(uri: str, name: str) -> str:
    """<uri>/<name>, keeping pyarrow's query options (s3://b/p?endpoint_override=...) at the end."""
    base, sep, query = uri.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def _run_distributed(trainer, resume: str | None, reporter: _WorkerReporter, storage: str | None = None,
                     mode: str | None = None) -> None:
    """Ray Train v2's Tune integration: a TorchTrainer started from the trial function, its worker
    results forwarded to Tune by a callback; FailureConfig restarts workers from the trial's
    newest checkpoint (its output_dir, which the workers find after a restart).

    `storage`: the trial's directory at a URI sweep. The TorchTrainer's run lives there
    (`<uri>/<sweep>/trial_<id>/ray_train/`): Ray Train persists the raytrain checkpoints rank 0
    reports, rotates them (save_total_limit, the best by the objective kept) and keeps its
    checkpoint manager's snapshot, so the same run name and storage started again, on this node
    or another after a sweep restore, hands the workers the newest one (ray.train.get_checkpoint)."""
    from ray.train import CheckpointConfig

    args = trainer.args
    fit(build_torch_trainer(
        trainer, copy.deepcopy(args), name="ray_train", storage_path=storage or args.output_dir,
        resume_from_checkpoint=resume,
        checkpoint_config=kept_checkpoints(CheckpointConfig, args.save_total_limit, mode) if storage else None,
        callbacks=[_to_tune_callback()], trial=reporter))


def kept_checkpoints(checkpoint_config, keep: int | None, mode: str | None):
    """The checkpoints kept in Ray's storage: as the trial rotates its own (save_total_limit, the best
    by the objective kept when there is one objective; Ray always keeps the latest too)."""
    if not keep:
        return checkpoint_config()
    if mode not in ("min", "max"):
        return checkpoint_config(num_to_keep=keep)
    return checkpoint_config(num_to_keep=keep, checkpoint_score_attribute="objective", checkpoint_score_order=mode)


def _to_tune_callback():
    from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY, TuneReportCallback

    class _ToTune(TuneReportCallback):
        """Forward rank 0's evaluation results only (raytrain reports nothing else from a trial), with
        the path of the checkpoint Ray Train persisted, as Ray's callback does (not reported to Tune
        again: it is already in storage)."""

        def after_report(self, run_context, metrics, checkpoint):
            if metrics and any(k == "objective" or k.startswith("objective_") for k in metrics[0]):
                result = dict(metrics[0])
                if checkpoint is not None:
                    result[CHECKPOINT_PATH_KEY] = checkpoint.path
                self._training_actor_item_queue.put(result)

    return _ToTune()


def takes_model_params(model_init: Callable) -> bool:
    """Whether model_init takes **kwargs: then it gets the trial's model.* values (by both backends)."""
    import inspect

    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model_init).parameters.values())


def model_for_trial(model_init: Callable, config: dict[str, Any]):
    """model_init(**model.* params) if it takes keywords, model_init(config) (HF's Ray backend) if it
    takes one argument, else model_init()."""
    import inspect

    if takes_model_params(model_init):
        return model_init(**{k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("model.")})
    return model_init(config) if len(inspect.signature(model_init).parameters) == 1 else model_init()
