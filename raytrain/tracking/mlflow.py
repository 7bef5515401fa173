"""MLflow runs: where they are stored, what they are told (params, tags, config, artifacts), and
which run a resumed training run continues. Used by the driver (run.py) and by MLflowCallback.

The store is MLFLOW_TRACKING_URI; unset, an embedded SQLite file `mlflow.db` in the working
directory (made absolute, so Ray workers with another cwd write to the same file). Secrets never
leave the process: a field whose name looks like a secret (token, key, password, secret) and any
value containing the value of such an environment variable are redacted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from typing import Any

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
_SECRET_PART = re.compile(r"(^|[._\-])(token|key|apikey|password|passwd|secret|credentials?)($|[._\-])", re.I)
_MAX_PARAM_LEN = 6000
_BATCH = 100  # MLflow's cap on params per log_batch call


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath("mlflow.db")


def ui_command(uri: str) -> str:
    """The command (or address) that shows the runs stored at `uri`."""
    if uri.startswith(("http://", "https://", "databricks")):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {uri}"


def client(uri: str | None = None):
    from mlflow import MlflowClient

    return MlflowClient(uri or tracking_uri())


# ---------------------------------------------------------------- secrets


def looks_secret(name: str) -> bool:
    return bool(_SECRET_PART.search(name))


def _secret_values() -> list[str]:
    return [v for k, v in os.environ.items() if looks_secret(k) and len(v) >= 6]


def redact(d: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a nested config with secret-looking fields, and values holding a secret, replaced."""
    secrets = _secret_values() if secrets is None else secrets
    if isinstance(d, dict):
        return {k: REDACTED if looks_secret(str(k)) and v not in (None, "") else redact(v, secrets)
                for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [redact(v, secrets) for v in d]
    if isinstance(d, str) and any(s in d for s in secrets):
        return REDACTED
    return d


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """{"model": {"hidden_size": 128}} -> {"model.hidden_size": "128"} (MLflow params are strings)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:_MAX_PARAM_LEN]
    return out


def params_of(args, trial_params: dict | None = None) -> dict[str, str]:
    params = flatten(redact(args.to_dict()))
    if trial_params:
        params.update(flatten(redact(dict(trial_params)), "trial."))
    return params


# ---------------------------------------------------------------- tags


def run_tags(args) -> dict[str, str]:
    """strategy, world size, the Ray job (under `ray job submit`) and the git commit of the cwd."""
    workers, strategy = args.scaling.num_workers, args.distributed.strategy
    if strategy == "auto" or (workers <= 1 and strategy == "ddp"):  # as strategies.create_strategy picks
        strategy = "ddp" if workers > 1 else "single"
    tags = {"raytrain.strategy": strategy, "raytrain.world_size": str(workers)}
    job = _ray_job_id()
    if job:
        tags["ray.job_id"] = job
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return redact(tags)


def _ray_job_id() -> str | None:
    # The job supervisor hands its driver the job's metadata (submission id) in this variable.
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return json.loads(raw).get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# ---------------------------------------------------------------- runs


def create_run(mlflow_client, args, run_name: str | None = None, trial_params: dict | None = None) -> str:
    """A new run in MLFLOW_EXPERIMENT_NAME (default 'raytrain') with params and tags; its id."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "raytrain")
    exp = mlflow_client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp is not None else \
        mlflow_client.create_experiment(name, artifact_location=_artifact_location(mlflow_client.tracking_uri))
    # Named after the run (run_name, else output_dir's folder), not MLflow's random words.
    default = os.path.basename(os.path.normpath(args.output_dir)) if args.output_dir else None
    run = mlflow_client.create_run(exp_id, run_name=redact(run_name or args.run_name or default), tags=run_tags(args))
    log_params(mlflow_client, run.info.run_id, params_of(args, trial_params))
    return run.info.run_id


def _artifact_location(uri: str) -> str | None:
    """Artifacts of an SQLite store go beside its file (mlartifacts/), not into the cwd's ./mlruns."""
    if not uri.startswith("sqlite:///"):
        return None  # a server decides
    from pathlib import Path

    return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()


def reopen_run(mlflow_client, run_id: str, args, trial_params: dict | None = None) -> None:
    """A resumed training run goes on in its MLflow run: RUNNING again, params it did not have added
    (a param's value cannot change in MLflow; a changed one is kept and named in a warning)."""
    mlflow_client.update_run(run_id, status="RUNNING")
    have = mlflow_client.get_run(run_id).data.params
    new = params_of(args, trial_params)
    changed = sorted(k for k, v in new.items() if k in have and have[k] != v)
    if changed:
        logger.warning("MLflow run %s: %s changed on resume; MLflow keeps the first value", run_id,
                       ", ".join(f"{k} {have[k]} -> {new[k]}" for k in changed[:5]))
    log_params(mlflow_client, run_id, {k: v for k, v in new.items() if k not in have})
    mlflow_client.log_batch(run_id, tags=_tags(run_tags(args)))


def log_params(mlflow_client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = list(params.items())
    for i in range(0, len(items), _BATCH):
        mlflow_client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + _BATCH]])


def _tags(tags: dict[str, str]) -> list:
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in tags.items()]


def log_metrics(mlflow_client, run_id: str, logs: dict, step: int) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, step) for k, v in logs.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if metrics:
        mlflow_client.log_batch(run_id, metrics=metrics)


def set_tags(mlflow_client, run_id: str, tags: dict) -> None:
    mlflow_client.log_batch(run_id, tags=_tags(redact({k: str(v) for k, v in tags.items()})))


def run_id_in_checkpoint(path: str | None) -> str | None:
    """The MLflow run a checkpoint's training run logged to (kept in trainer_state.json)."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            saved = json.load(f).get("stateful_callbacks", {}).get("MLflowCallback")
    except (OSError, ValueError):
        return None
    saved = saved[0] if isinstance(saved, list) and saved else saved
    return (saved or {}).get("attributes", {}).get("run_id") if isinstance(saved, dict) else None


def log_final(mlflow_client, run_id: str, args, model_dir: str | None, best_checkpoint: str | None = None) -> None:
    """The resolved config (config.yaml, secrets redacted), the final model directory (model/) and,
    when args.mlflow_log_best_checkpoint is set, the best checkpoint (best_checkpoint/)."""
    import yaml

    mlflow_client.log_text(run_id, yaml.safe_dump(redact(args.to_dict()), sort_keys=False), "config.yaml")
    if model_dir:
        _log_dir(mlflow_client, run_id, model_dir, "model")
    if best_checkpoint and args.mlflow_log_best_checkpoint:
        _log_dir(mlflow_client, run_id, best_checkpoint, "best_checkpoint")


def _log_dir(mlflow_client, run_id: str, directory: str, artifact_path: str) -> None:
    """Every file of `directory`; training_args.json goes up redacted (it may hold a secret field)."""
    for root, _, files in os.walk(directory):
        rel = os.path.relpath(root, directory)
        dest = artifact_path if rel == "." else f"{artifact_path}/{rel}"
        for name in sorted(files):
            path = os.path.join(root, name)
            if name == "training_args.json":
                with open(path) as f:
                    text = json.dumps(redact(json.load(f)), indent=2)
                mlflow_client.log_text(run_id, text, f"{dest}/{name}")
            else:
                mlflow_client.log_artifact(run_id, path, dest)
