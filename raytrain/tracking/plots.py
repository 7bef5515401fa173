"""The PNG curves of a run and of a sweep, drawn one way for the report CLI and for a finished sweep.

A curve that spans a decade or more of positive values is drawn on a log scale; the step of the best
checkpoint (TrainerState.best_global_step) is marked; the y axis is named after the metric. The
overview holds a panel per metric, or several curves on one panel (a train metric and its eval twin), and
folds the panels that never move into one note of their values. matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import glob
import json
import math
import os
import textwrap

Curves = dict[str, tuple[list[int], list[float]]]
Panels = dict[str, Curves]  # a panel's title -> the curves drawn on it


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
    from matplotlib.ticker import MaxNLocator

    if spans_decades(curves):
        ax.set_yscale("log")
    if best_step is not None and any(best_step in xs for xs, _ in curves.values()):
        ax.axvline(best_step, color="tab:green", linestyle="--", linewidth=1, label=f"best checkpoint ({best_step})")
    # AutoLocator's ticks, whole steps only: none at 2.5 on a short run
    ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))
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


def is_flat(curves: Curves) -> bool:
    """Two points or more, every one the same value: a panel that would be a level line (a clip ratio at 0)."""
    ys = [y for _, values in curves.values() for y in values if y == y]  # NaN, a metric with nothing to average
    return len(ys) >= 2 and max(ys) == min(ys)


def constants_note(values: dict[str, float], width: int) -> str:
    """'name = value' lines, wrapped at `width` characters; names of one value in one folder are joined:
    clip_ratio/{high_max, low_min} = 0."""
    by_value: dict[str, dict[str, list[str]]] = {}
    for name, value in values.items():
        folder, _, leaf = name.rpartition("/")
        by_value.setdefault(f"{value:.4g}", {}).setdefault(folder, []).append(leaf)
    lines = []
    for value, folders in by_value.items():
        names = [f"{folder}/{{{', '.join(leaves)}}}" if folder and len(leaves) > 1
                 else ", ".join(f"{folder}/{leaf}" if folder else leaf for leaf in leaves)
                 for folder, leaves in folders.items()]
        lines += textwrap.wrap(f"{', '.join(names)} = {value}", width, subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines)


_PANEL_W, _PANEL_H, _NOTE_CHARS, _NOTE_LINE_H = 4.0, 2.8, 60, 0.16  # inches; monospace 8 pt characters per panel


def draw_overview(panels: Panels, title: str, best_step: int | None = None):
    """The Figure of overview.png: a panel per entry of `panels` (its title -> the curves drawn on it, an
    eval curve dashed), three to a row; the panels that never move are folded into one note of their
    values, in the last row's free cells or a row of its own. Constrained layout keeps the title above
    every panel."""
    plt = _pyplot()
    drawn = {name: curves for name, curves in panels.items() if not is_flat(curves)}
    flat = {name: next(y for _, ys in curves.values() for y in ys if y == y) for name, curves in panels.items()
            if is_flat(curves)}
    cols = min(3, max(1, len(drawn)))
    rows = math.ceil(len(drawn) / cols)
    free = rows * cols - len(drawn)
    note = constants_note(flat, _NOTE_CHARS * free) if flat and free else ""
    if flat and (not free or note.count("\n") + 1 > (_PANEL_H - 0.4) / _NOTE_LINE_H):
        free, note = 0, constants_note(flat, _NOTE_CHARS * cols)  # a row of its own below the panels
    heights = [_PANEL_H] * rows + ([0.45 + _NOTE_LINE_H * (note.count("\n") + 1)] if note and not free else [])
    fig = plt.figure(figsize=(_PANEL_W * cols, sum(heights) + 0.4), dpi=80, layout="constrained")
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights)
    for i, (name, curves) in enumerate(drawn.items()):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        for label, (xs, ys) in curves.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3,
                    label={name: "train", f"eval_{name}": "eval"}.get(label, label),
                    linestyle="--" if label.startswith("eval_") and len(curves) > 1 else "-")
        evaluated = any(label.startswith("eval_") for label in curves)
        _decorate(ax, curves, best_step if evaluated else None, name)
        ax.set_title(name, fontsize=10)
        ax.tick_params(labelsize=7)
        if len(curves) > 1:
            ax.legend(fontsize=7)
    if note:
        ax = fig.add_subplot(grid[len(heights) - 1, cols - free if free else 0:])
        ax.axis("off")
        ax.set_title("constant over the run", fontsize=9, loc="left")
        ax.text(0, 1, note, transform=ax.transAxes, va="top", ha="left", fontsize=8, family="monospace",
                in_layout=False)
    fig.suptitle(title, fontsize=11)
    return fig


def overview(panels: Panels, path: str, title: str, best_step: int | None = None) -> str:
    """overview.png: `draw_overview`'s figure written to `path`."""
    fig = draw_overview(panels, title, best_step)
    fig.savefig(path)
    _pyplot().close(fig)
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
