"""raytrain.report: PNG curves from trainer_state.json and from a search's trial results."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from raytrain.report import main, training_curves, write_report


def _image(path: str) -> np.ndarray:
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path)


def _not_blank(path: str) -> None:
    pixels = _image(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels[..., :3].var() > 1e-3  # axes, curve and labels, not one flat colour


def _history(steps: int = 40) -> list[dict]:
    history = []
    for s in range(5, steps + 1, 5):
        history.append({"loss": 2.0 / s, "grad_norm": 1.0 + (s % 3), "learning_rate": 1e-3 * (1 - s / steps),
                        "epoch": s / 20, "step": s})
        if s % 20 == 0:
            history.append({"eval_loss": 1.5 / s, "eval_accuracy": 1 - 1 / s, "eval_runtime": 0.1,
                            "eval_samples_per_second": 1e4, "epoch": s / 20, "step": s})
    history.append({"train_runtime": 3.0, "train_loss": 0.3, "epoch": 2.0, "step": steps})
    history.append({"eval_loss": 0.01, "eval_accuracy": 0.5, "epoch": 2.0, "step": steps})  # a final evaluation
    return history


def test_training_curves_are_per_metric_with_their_steps():
    curves = training_curves(_history())
    assert list(curves) == ["loss", "learning_rate", "grad_norm", "eval_accuracy", "eval_loss"]
    assert curves["loss"][0] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert curves["eval_accuracy"] == ([20, 40], [1 - 1 / 20, 1 - 1 / 40])


def test_report_of_a_run_writes_valid_non_blank_pngs(tmp_path, capsys):
    with open(tmp_path / "trainer_state.json", "w") as f:
        json.dump({"log_history": _history(), "global_step": 40}, f)
    assert main([str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    names = ["loss", "learning_rate", "grad_norm", "eval_accuracy", "eval_loss", "overview"]
    assert written == [str(tmp_path / "plots" / f"{n}.png") for n in names]
    for path in written:
        _not_blank(path)


def test_report_falls_back_to_the_newest_checkpoint(tmp_path):
    for step, n in ((10, 10), (40, 40)):
        os.makedirs(tmp_path / f"checkpoint-{step}")
        with open(tmp_path / f"checkpoint-{step}" / "trainer_state.json", "w") as f:
            json.dump({"log_history": _history(n)}, f)
    written = write_report(str(tmp_path), str(tmp_path / "png"))
    assert len(written) == 6 and all(p.startswith(str(tmp_path / "png")) for p in written)
    assert _image(str(tmp_path / "png" / "eval_loss.png")) is not None  # eval exists only in checkpoint-40


def test_report_of_a_search_plots_every_trials_objective(tmp_path):
    for t in range(3):
        trial = tmp_path / "tune" / "exp" / f"trainable_{t:05d}"
        os.makedirs(trial)
        with open(trial / "result.json", "w") as f:
            for step in (45, 90, 135):
                f.write(json.dumps({"objective": 0.5 + 0.1 * t + step / 1000, "step": step}) + "\n")
            f.write('{"objective": 0.9, "st')  # a trial killed mid-write
    (path,) = write_report(str(tmp_path / "tune"))
    assert path == str(tmp_path / "tune" / "plots" / "objective.png")
    _not_blank(path)


def test_nothing_to_plot_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no trainer_state.json (in it or a checkpoint-N) and no "
                                       "trial result.json below it; nothing to plot\n")
    assert main([str(tmp_path / "missing")]) == 2
    with pytest.raises(ValueError, match="log_history has no loss"):
        (tmp_path / "trainer_state.json").write_text('{"log_history": [{"train_runtime": 1.0, "step": 0}]}')
        write_report(str(tmp_path))


def test_plots_use_a_log_scale_across_decades_mark_the_best_checkpoint_and_name_the_metric():
    from raytrain.tracking import plots

    loss = {"loss": ([5, 10, 15], [2.0, 0.2, 0.02])}
    fig = plots.draw(loss, "loss")
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_ylabel() == "loss"
    flat = plots.draw({"eval_accuracy": ([20, 40], [0.9, 0.95])}, "eval_accuracy", best_step=40)
    ax = flat.axes[0]
    assert ax.get_yscale() == "linear"  # less than a decade apart
    marks = [line for line in ax.get_lines() if list(line.get_xdata()) == [40, 40]]
    assert len(marks) == 1 and marks[0].get_label() == "best checkpoint (40)"
    assert not plots.spans_decades({"x": ([1, 2], [-1.0, 100.0])})  # not all positive: linear


def test_a_sweeps_objective_axis_is_named_after_its_metric(tmp_path):
    from raytrain.tracking import plots

    trial = tmp_path / "trial_a1"
    os.makedirs(trial)
    with open(trial / "result.json", "w") as f:
        for step, acc in ((10, 0.8), (20, 0.9)):
            f.write(json.dumps({"objective": acc, "eval_accuracy": acc, "eval_loss": 1 - acc, "step": step}) + "\n")
    curves, name = plots.sweep_curves(str(tmp_path))
    assert curves == {"a1": ([10, 20], [0.8, 0.9])} and name == "eval_accuracy"
    assert plots.sweep_plot(str(tmp_path)) == str(tmp_path / "plots" / "objective.png")


def test_a_sweeps_optuna_plots_name_the_objective_after_its_metric(tmp_path):
    """The HTML plots a finished sweep writes beside objective.png call the objective what it is."""
    optuna = pytest.importorskip("optuna")
    from raytrain.sweep.report import write_plots

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    space = {"learning_rate": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
    for i, (lr, acc) in enumerate([(1e-3, 0.8), (1e-2, 0.9), (3e-3, 0.85)]):
        study.add_trial(optuna.trial.create_trial(params={"learning_rate": lr}, distributions=space, value=acc))
        os.makedirs(tmp_path / f"trial_{i}")
        (tmp_path / f"trial_{i}" / "result.json").write_text(
            json.dumps({"objective": acc, "eval_accuracy": acc, "eval_loss": 1 - acc, "step": 10}) + "\n")
    written = write_plots(str(tmp_path), None, ["objective"], study)
    assert sorted(os.path.relpath(p, tmp_path) for p in written) == [
        "optimization_history.html", "parallel_coordinate.html", "param_importances.html",
        os.path.join("plots", "objective.png")]
    history = (tmp_path / "optimization_history.html").read_text()
    assert '"yaxis":{"title":{"text":"eval_accuracy"}' in history
    assert '"ticktext":["eval_accuracy","learning_rate"]' in (tmp_path / "parallel_coordinate.html").read_text()
    for page in ("optimization_history", "parallel_coordinate", "param_importances"):
        assert "objective" not in (tmp_path / f"{page}.html").read_text().lower(), page


def test_help_sends_sweeps_to_where_they_live(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "a sweep's directory (OUTPUT_DIR/sweeps/NAME)" in text and "For a sweep (OUTPUT_DIR/sweeps/NAME," in text
    assert "OUTPUT_DIR/tune" not in text


# ---------------------------------------------------------------- an RL run's overview


def _rl_history(steps: int = 8, async_: bool = False) -> list[dict]:
    """A log_history as GRPO / RLOO write it (two reward functions, clip ratios at 0), an evaluation every 4
    steps; with `async_`, the async trainer's keys too."""
    history = []
    for s in range(1, steps + 1):
        entry = {"loss": 0.01 * (s % 3), "grad_norm": 0.5 + 0.1 * (s % 2), "learning_rate": 5e-3 * (1 - s / steps),
                 "reward": 0.3 + 0.05 * s, "reward_std": 0.3 - 0.01 * s, "rewards/correct_sum/mean": 0.05 * s,
                 "rewards/correct_sum/std": 0.3, "rewards/brevity/mean": 0.3, "rewards/brevity/std": 0.05 * (s % 2),
                 "kl": 0.004 * (s - 1), "entropy": 5.4 - 0.01 * s, "completions/mean_length": 8 - 0.25 * s,
                 "completions/min_length": 4.0 + s % 2, "completions/clipped_ratio": 1 - 0.1 * s,
                 "frac_reward_zero_std": 0.5 * (s % 2), "num_tokens": 376.0 * s, "step_time": 1.5,
                 "clip_ratio/low_mean": 0.0, "clip_ratio/low_min": 0.0, "clip_ratio/high_mean": 0.0,
                 "clip_ratio/high_max": 0.0, "clip_ratio/region_mean": 0.0, "epoch": s / 16, "step": s}
        if async_:
            entry.update({"sample/staleness_mean": 0.5 * (s > 1), "sample/staleness_max": float(s > 1),
                          "sample/dropped_stale_total": 0.0, "perf/weight_sync_s": 0.1 + 0.01 * s,
                          "perf/rollout_wait_s": 0.2 / s, "ratio": 1.0})
        history.append(entry)
        if s % 4 == 0:
            history.append({"eval_loss": 0.002 * s, "eval_reward": 0.3 + 0.02 * s, "eval_reward_std": 0.1,
                            "eval_rewards/correct_sum/mean": 0.01 * s, "eval_rewards/brevity/mean": 0.3,
                            "eval_kl": 0.005 * s, "eval_entropy": 5.4, "eval_completions/mean_length": 8.0 - 0.1 * s,
                            "eval_completions/min_length": 6.0, "eval_clip_ratio/low_mean": 0.0,
                            "eval_num_tokens": 376.0 * s, "eval_runtime": 2.0, "eval_samples_per_second": 4.0,
                            "epoch": s / 16, "step": s})
    history.append({"train_runtime": 20.0, "train_loss": 0.006, "train_samples_per_second": 1.9, "total_flos": 0.0,
                    "epoch": steps / 16, "step": steps})
    return history


_RL_PANELS = ["reward", "rewards/brevity/mean", "rewards/correct_sum/mean", "reward_std", "kl", "entropy",
              "completions/mean_length"]
_RL_DETAILS = ["completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/high_max", "clip_ratio/high_mean",
               "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/region_mean"]


@pytest.fixture
def figures():
    """Closes the figures a test drew."""
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.axison]


def _note(fig) -> str:
    (note,) = [ax for ax in fig.axes if not ax.axison]
    assert note.get_title(loc="left") == "constant over the run"
    (text,) = note.texts
    return text.get_text()


def test_an_rl_overview_opens_with_reward_kl_entropy_and_length_each_with_its_eval_twin(figures):
    from raytrain.report import overview_panels
    from raytrain.tracking import plots

    curves = training_curves(_rl_history())
    assert list(curves)[:10] == _RL_PANELS + ["loss", "learning_rate", "grad_norm"]
    assert {"completions/min_length", "rewards/brevity/std", "num_tokens", "step_time"} < set(curves)  # a PNG each
    assert not {"epoch", "train_loss", "train_runtime", "total_flos", "eval_runtime"} & set(curves)
    panels = overview_panels(curves)
    assert list(panels) == _RL_PANELS + ["loss", "learning_rate", "grad_norm"] + _RL_DETAILS
    assert list(panels["reward"]) == ["reward", "eval_reward"] and panels["reward"]["reward"] == curves["reward"]
    assert panels["reward"]["eval_reward"] == ([4, 8], pytest.approx([0.38, 0.46]))
    assert list(panels["loss"]) == ["loss", "eval_loss"] and list(panels["grad_norm"]) == ["grad_norm"]
    fig = plots.draw_overview(panels, "grpo")
    # rewards/brevity/mean (0.3 in train and eval) and the clip ratios never move: one note, no panel
    assert _titles(fig) == ([t for t in _RL_PANELS if t != "rewards/brevity/mean"] + ["loss", "learning_rate",
                            "grad_norm", "completions/clipped_ratio", "frac_reward_zero_std"])
    assert _note(fig) == ("rewards/brevity/mean = 0.3\n"  # wrapped to the one free cell's width
                          "clip_ratio/{high_max, high_mean, low_mean, low_min,\n  region_mean} = 0")
    reward = fig.axes[0]
    assert [line.get_label() for line in reward.get_lines()] == ["train", "eval"]
    assert [line.get_linestyle() for line in reward.get_lines()] == ["-", "--"]


def test_the_async_trainers_overview_adds_staleness_after_completion_length(figures):
    from raytrain.report import overview_panels
    from raytrain.tracking import plots

    panels = overview_panels(training_curves(_rl_history(async_=True)))
    assert list(panels) == (_RL_PANELS + ["sample/staleness_mean", "sample/staleness_max", "loss", "learning_rate",
                            "grad_norm"] + _RL_DETAILS + ["ratio", "sample/dropped_stale_total",
                            "perf/rollout_wait_s", "perf/weight_sync_s"])
    fig = plots.draw_overview(panels, "async grpo")
    titles = _titles(fig)
    assert titles[titles.index("completions/mean_length") + 1:][:2] == ["sample/staleness_mean", "sample/staleness_max"]
    assert "perf/weight_sync_s" in titles and "ratio" not in titles and "sample/dropped_stale_total" not in titles
    assert "ratio = 1" in _note(fig) and "sample/dropped_stale_total = 0" in _note(fig)


def test_a_plain_runs_overview_is_a_panel_per_curve_in_its_order(figures):
    from raytrain.report import overview_panels
    from raytrain.tracking import plots

    curves = training_curves(_history())
    panels = overview_panels(curves)
    assert panels == {k: {k: v} for k, v in curves.items()}
    fig = plots.draw_overview(panels, "digits", best_step=20)
    assert _titles(fig) == ["loss", "learning_rate", "grad_norm", "eval_accuracy", "eval_loss"]
    assert all(ax.axison for ax in fig.axes)  # nothing constant: no note
    # a constant learning rate is a note; a metric logged once is a point, not a constant
    history = [{**e, "learning_rate": 1e-3} if "loss" in e else e for e in _history()]
    history.append({"eval_f1": 0.7, "step": 40})
    fig = plots.draw_overview(overview_panels(training_curves(history)), "digits")
    assert _titles(fig) == ["loss", "grad_norm", "eval_accuracy", "eval_f1", "eval_loss"]
    assert _note(fig) == "learning_rate = 0.001"


@pytest.mark.parametrize("history", [_rl_history(async_=True), _history()], ids=["rl", "plain"])
def test_the_overviews_title_is_above_every_panel(history, figures):
    from raytrain.report import overview_panels
    from raytrain.tracking import plots

    fig = plots.draw_overview(overview_panels(training_curves(history)), "a-run-name")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (title,) = [t for t in fig.texts if t.get_text() == "a-run-name"]
    top = title.get_window_extent(renderer)
    assert top.y1 <= fig.bbox.y1
    for ax in fig.axes:
        assert top.y0 >= ax.get_tightbbox(renderer).y1, ax.get_title()
        for text in ax.texts:  # the note stays inside the figure
            box = text.get_window_extent(renderer)
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y0 >= fig.bbox.y0


def test_report_of_an_rl_run_draws_its_reward(tmp_path):
    history = [{"reward": 0.1 * s, "rewards/f/mean": 0.1 * s, "loss": 0.01 * s, "clip_ratio/low_mean": 0.0,
                "step": s} for s in range(1, 5)] + [{"eval_reward": 0.2, "eval_clip_ratio/low_mean": 0.0, "step": 4}]
    with open(tmp_path / "trainer_state.json", "w") as f:
        json.dump({"log_history": history, "global_step": 4}, f)
    written = write_report(str(tmp_path))
    assert [os.path.basename(p) for p in written] == [
        "reward.png", "rewards_f_mean.png", "loss.png", "clip_ratio_low_mean.png", "eval_clip_ratio_low_mean.png",
        "eval_reward.png", "overview.png"]
    _not_blank(written[-1])
