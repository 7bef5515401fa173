"""The PNG curves of a run and of a sweep, drawn one way for the report CLI and for a finished sweep.

A curve that spans a decade or more of positive values is drawn on a log scale; the step of the best
checkpoint (TrainerState.best_global_step) is marked; the y axis is named after the metric.
matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import glob
import json
import math
import os

Curves = dict[str, tuple[list[int], list[float]]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spans_decades(curves: Curves) -> bool:
    """Every value positive and the largest at least 10x the smallest: a log scale shows them."""
    ys = [y for _, values in curves.values() for y in values]
    return bool(ys) and min(ys) > 0 and max(ys) >= 10 * min(ys)


def _decorate(ax, curves: Curves, best_step: int | None, ylabel: str) -> None:
    if spans_decades(curves):
        ax.set_yscale("log")
    if best_step is not None and any(best_step in xs for xs, _ in curves.values()):
        ax.axvline(best_step, color="tab:green", linestyle="--", linewidth=1, label=f"best checkpoint ({best_step})")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def draw(curves: Curves, title: str, ylabel: str | None = None, best_step: int | None = None):
    """The matplotlib Figure of every curve of `curves` against steps."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    _decorate(ax, curves, best_step, ylabel or title)
    ax.set_title(title)
    if len(curves) > 1 or best_step in {x for xs, _ in curves.values() for x in xs}:
        ax.legend(fontsize=7, ncol=2 if len(curves) > 6 else 1)
    fig.tight_layout()
    return fig


def figure(curves: Curves, title: str, path: str, ylabel: str | None = None, best_step: int | None = None) -> str:
    """One PNG: `draw`'s figure written to `path`."""
    fig = draw(curves, title, ylabel, best_step)
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def overview(curves: Curves, path: str, title: str, best_step: int | None = None) -> str:
    """One PNG with a panel per metric."""
    plt = _pyplot()
    cols = min(3, len(curves))
    rows = math.ceil(len(curves) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), dpi=80, squeeze=False)
    for ax, (name, (xs, ys)) in zip(axes.flat, curves.items()):
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3)
        _decorate(ax, {name: (xs, ys)}, best_step if name.startswith("eval_") else None, name)
        ax.set_title(name, fontsize=10)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def sweep_curves(directory: str) -> tuple[Curves, str]:
    """({trial directory name: (steps, objective)}, the objective's metric name) from each Ray Tune trial's
    result.json (JSON lines) below `directory`. The name is the eval metric the objective equals in every
    result (eval_accuracy for `metric: eval_accuracy`), else "objective"."""
    curves: Curves = {}
    same: set[str] | None = None
    for path in sorted(glob.glob(os.path.join(directory, "**", "result.json"), recursive=True)):
        xs, ys = [], []
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a trial killed mid-write leaves a partial last line
                if isinstance(row.get("objective"), (int, float)):
                    xs.append(int(row.get("step", row.get("training_iteration", len(xs) + 1))))
                    ys.append(float(row["objective"]))
                    equal = {k for k, v in row.items() if k.startswith("eval_") and v == row["objective"]}
                    same = equal if same is None else same & equal
        if xs:
            curves[os.path.basename(os.path.dirname(path)).removeprefix("trial_")] = (xs, ys)
    name = sorted(same)[0] if same and len(same) == 1 else "objective"
    return curves, name


def sweep_plot(directory: str, out: str | None = None) -> str | None:
    """DIRECTORY/plots/objective.png (or OUT/objective.png): every trial's objective over steps; None
    when no trial reported one."""
    curves, name = sweep_curves(directory)
    if not curves:
        return None
    out = out or os.path.join(directory, "plots")
    os.makedirs(out, exist_ok=True)
    return figure(curves, f"{name} of every trial", os.path.join(out, "objective.png"), name)
