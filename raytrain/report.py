"""Plots of a run: python -m raytrain.report OUTPUT_DIR [--out DIR]

For a training run (OUTPUT_DIR/trainer_state.json, else its newest checkpoint's): train loss,
learning rate, grad norm and each eval metric against steps, one PNG each, plus overview.png with
all of them; an RL run's (GRPO, RLOO, async GRPO) also every metric it logs per step, its overview
opening with reward, each reward function's mean, reward std, kl, entropy, completion length and
staleness, each with its eval twin. Curves that never move are one note in the overview. For a sweep
(OUTPUT_DIR/sweeps/NAME, or any directory holding Ray Tune trials' result.json): every trial's
objective against steps in objective.png, the plot the sweep itself writes. PNGs go to
DIRECTORY/plots unless --out says otherwise. Drawn by plots.py: log scale where a curve spans
decades, the best checkpoint marked, axes named after the metric.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys

from .tracking import plots

_TRAIN_KEYS = ("loss", "learning_rate", "grad_norm")
_NOT_CURVES = ("_runtime", "_per_second")
# An RL run (GRPO, RLOO, the async trainer: a log with a reward) draws every metric it logs at each step; its
# overview opens with what an RL user watches, then the optimizer's curves, then these details, each with
# its eval twin. Its other step metrics (min / max lengths, each reward's std, ...) have their own PNG only.
_RL_FIRST = ("reward", "rewards/*/mean", "reward_std", "kl", "entropy", "completions/mean_length",
             "sample/staleness_mean", "sample/staleness_max")
_RL_THEN = ("completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/*", "cispo_clip_ratio", "entropy_coef",
            "ratio", "sample/dropped_stale_total", "perf/*")
_RL_ORDER = _RL_FIRST + _TRAIN_KEYS + _RL_THEN
_NOT_RL_CURVES = ("epoch", "step", "total_flos", "train_loss")  # the step itself and the run's summary


class ReportError(ValueError):
    """Nothing to plot at the given path."""


def _is_rl(keys) -> bool:
    """A log (its keys, or its curves' names) of an RL trainer: it has a reward."""
    return any(k in ("reward", "eval_reward") for k in keys)


def _rank(key: str) -> int:
    """Where a curve goes: RL's first metrics, the optimizer's, RL's details, other train metrics, eval metrics."""
    order = next((i for i, pattern in enumerate(_RL_ORDER) if fnmatch.fnmatchcase(key, pattern)), None)
    return order if order is not None else len(_RL_ORDER) + key.startswith("eval_")


def training_curves(log_history: list[dict]) -> plots.Curves:
    """{metric: (steps, values)} for the train keys (an RL run's: every metric it logs per step) and every
    eval_* metric in a log history; a metric logged twice at one step keeps its first value, so each curve is
    a function of the step."""
    rl = _is_rl(k for entry in log_history for k in entry)
    curves: plots.Curves = {}
    for entry in log_history:
        step = entry.get("step")
        for key, value in entry.items():
            wanted = key in _TRAIN_KEYS or (rl and key not in _NOT_RL_CURVES) or key.startswith("eval_")
            if (wanted and not key.endswith(_NOT_CURVES) and isinstance(value, (int, float))
                    and not isinstance(value, bool) and step is not None):
                xs, ys = curves.setdefault(key, ([], []))
                if xs and xs[-1] == int(step):
                    continue  # a second evaluation at one step (the CLI's final one, of the best model)
                xs.append(int(step))
                ys.append(float(value))
    return dict(sorted(curves.items(), key=lambda kv: (_rank(kv[0]), kv[0])))


def overview_panels(curves: plots.Curves) -> plots.Panels:
    """overview.png's panels, {title: the curves drawn on it}: one per curve; an RL run's: the curves of
    _RL_ORDER present, each with its eval twin (eval_reward on reward's panel), then the eval metrics that
    have no train twin."""
    if not _is_rl(curves):
        return {k: {k: v} for k, v in curves.items()}
    panels: plots.Panels = {}
    for key, curve in curves.items():
        if key.startswith("eval_"):
            if key.removeprefix("eval_") not in curves:
                panels[key] = {key: curve}
        elif _rank(key) < len(_RL_ORDER):
            panels[key] = {key: curve, **{k: curves[k] for k in (f"eval_{key}",) if k in curves}}
    return panels


def _trainer_state(output_dir: str) -> str | None:
    path = os.path.join(output_dir, "trainer_state.json")
    if os.path.isfile(path):
        return path
    from .checkpoint.store import sorted_checkpoints  # no torch import unless a checkpoint is needed

    for _, ckpt in reversed(sorted_checkpoints(output_dir)):
        if os.path.isfile(os.path.join(ckpt, "trainer_state.json")):
            return os.path.join(ckpt, "trainer_state.json")
    return None


def write_report(directory: str, out: str | None = None) -> list[str]:
    """Write the PNGs for a training run or a search directory; return their paths."""
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: not a directory (give a run's output_dir or a search directory)")
    out = out or os.path.join(directory, "plots")
    state = _trainer_state(directory)
    if state is not None:
        with open(state) as f:
            saved = json.load(f)
        curves = training_curves(saved.get("log_history", []))
        if not curves:
            raise ReportError(f"{state}: log_history has no loss, learning_rate, grad_norm or eval metric yet")
        os.makedirs(out, exist_ok=True)
        best = saved.get("best_global_step")
        # TRL's metric names hold '/' (rewards/chosen): one file each all the same
        written = [plots.figure({k: v}, k, os.path.join(out, k.replace("/", "_") + ".png"),
                                best_step=best if k.startswith("eval_") else None) for k, v in curves.items()]
        written.append(plots.overview(overview_panels(curves), os.path.join(out, "overview.png"), os.path.basename(
            os.path.abspath(directory)), best_step=best))
        return written
    sweep = plots.sweep_plot(directory, out)
    if sweep is not None:
        return [sweep]
    raise ReportError(f"{directory}: no trainer_state.json (in it or a checkpoint-N) and no trial result.json "
                      "below it; nothing to plot")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raytrain.report", description=__doc__.split("\n\n")[1])
    p.add_argument("directory", help="a run's output_dir, or a sweep's directory (OUTPUT_DIR/sweeps/NAME)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: DIRECTORY/plots)")
    ns = p.parse_args(argv)
    try:
        written = write_report(ns.directory, ns.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
