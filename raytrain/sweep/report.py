"""What a sweep shows: one status line per trial event while it runs; at the end the trials table
(printed, trials.csv, BestRun.run_summary), Optuna's HTML plots and a PNG of every trial's objective."""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.tune import Callback

from .trial import CKPT_KEY

logger = logging.getLogger(__name__)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _params(config: dict) -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in sorted(config.items()))


def error_line(text: str | None) -> str:
    """The last non-empty line of a traceback: the exception and its message."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "unknown error"


def read_trial_error(trial) -> str:
    path = getattr(trial, "error_file", None) or ""
    local = os.path.join(trial.local_path, os.path.basename(path)) if path else ""
    for p in (path, local):
        if p and os.path.isfile(p):
            with open(p) as f:
                return error_line(f.read())
    return "unknown error"


class StatusLines(Callback):
    """One line on the driver per trial event: started / reported / stopped early / finished / failed."""

    def __init__(self, objective_keys: list[str], tracker=None):
        self.keys = objective_keys
        self.tracker = tracker

    def _say(self, trial, text: str) -> None:
        print(f"[sweep] trial {trial.trial_id} {text}", flush=True)

    def _objective(self, result: dict | None) -> str:
        result = result or {}
        return " ".join(f"{k}={_fmt(result[k])}" for k in self.keys if k in result)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._say(trial, f"started {_params(trial.config)}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._say(trial, f"reported step {result.get('step')}: {self._objective(result)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        step, max_steps = last.get("step"), last.get("max_steps")
        early = step is not None and max_steps and step < max_steps
        what = f"stopped early at step {step}/{max_steps}" if early else f"finished at step {step}"
        self._say(trial, f"{what}: {self._objective(last)}")
        if self.tracker is not None:
            self.tracker.end_child(trial.trial_id, "KILLED" if early else "FINISHED",
                                   "stopped_early" if early else "finished")

    def on_trial_error(self, iteration, trials, trial, **info):
        error = read_trial_error(trial)
        self._say(trial, f"failed: {error}")
        if self.tracker is not None:
            self.tracker.end_child(trial.trial_id, "FAILED", "failed", error)


def trials_table(grid, param_names: list[str], objective_keys: list[str], modes: list[str], scope: str = "last"):
    """One row per trial: id, parameters, objective(s) (each trial's last report, as HF; scope="best":
    its best), status, steps, wall time, that report's checkpoint and the error line of a failed trial."""
    import pandas as pd

    rows = []
    for r in grid:
        trial_id = os.path.basename(r.path).removeprefix("trial_")
        df = r.metrics_dataframe
        row: dict[str, Any] = {"trial_id": trial_id}
        row.update({name: (r.config or {}).get(name) for name in param_names})
        last = r.metrics or {}
        best = None
        if df is not None and len(df) and objective_keys[0] in df:
            scored = df.dropna(subset=[objective_keys[0]])
            if len(scored):
                key = objective_keys[0]
                best = scored.iloc[-1] if scope == "last" else \
                    scored.loc[scored[key].idxmax() if modes[0] == "max" else scored[key].idxmin()]
        for k in objective_keys:
            row[k] = float(best[k]) if best is not None and k in best else float("nan")
        if r.error:
            status = "failed"
        else:
            early = last.get("step") is not None and last.get("max_steps") and last["step"] < last["max_steps"]
            status = "stopped early" if early else "finished"
        row["status"] = status
        row["steps"] = int(last.get("step") or 0)
        row["wall_time_s"] = round(float(last.get("time_total_s") or 0.0), 2)
        ckpt = best.get(CKPT_KEY) if best is not None else None
        row["checkpoint"] = ckpt if isinstance(ckpt, str) and ckpt and os.path.isdir(ckpt) else ""
        row["error"] = error_line(str(r.error)) if r.error else ""
        rows.append(row)
    return pd.DataFrame(rows).sort_values("trial_id", ignore_index=True) if rows else pd.DataFrame(rows)


def print_table(df) -> None:
    show = df.drop(columns=["checkpoint"]).copy()
    with __import__("pandas").option_context("display.max_columns", None, "display.width", 200,
                                             "display.max_colwidth", 60):
        print(show.to_string(index=False, float_format=lambda v: f"{v:.4g}"), flush=True)


def write_plots(sweep_dir: str, grid, objective_keys: list[str], study=None) -> list[str]:
    """Optuna's HTML plots (when a study exists) and plots/objective.png (the same plot
    `python -m raytrain.report SWEEP_DIR` draws); returns the files."""
    from ..tracking.plots import sweep_curves, sweep_plot

    written = []
    if study is not None:
        # The axis named as the PNG's: the metric the objective is (eval_accuracy), else "objective".
        written += _optuna_plots(sweep_dir, study, objective_keys, sweep_curves(sweep_dir)[1])
    try:
        path = sweep_plot(sweep_dir)
        written += [path] if path else []
    except Exception as e:  # a plot must never fail a finished sweep
        logger.warning("plots/objective.png: %s", e)
    return written


def _optuna_plots(sweep_dir: str, study, objective_keys: list[str], name: str = "objective") -> list[str]:
    from optuna import visualization as vis
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not complete:
        return []
    multi = len(study.directions) > 1
    target = {"target": (lambda t: t.values[0]), "target_name": objective_keys[0]} if multi else \
        {"target_name": name}
    plots = {"optimization_history": lambda: vis.plot_optimization_history(study, **target),
             "param_importances": lambda: vis.plot_param_importances(study, **target),
             "parallel_coordinate": lambda: vis.plot_parallel_coordinate(study, **target)}
    if multi:
        plots["pareto_front"] = lambda: vis.plot_pareto_front(study, target_names=objective_keys)
    written = []
    for name, make in plots.items():
        path = os.path.join(sweep_dir, f"{name}.html")
        try:
            # plotly.js is written once next to the plots: they open offline.
            make().write_html(path, include_plotlyjs="directory")
            written.append(path)
        except Exception as e:  # e.g. importances need two finished trials that differ
            logger.warning("%s.html not written: %s", name, error_line(str(e)))
    return written
