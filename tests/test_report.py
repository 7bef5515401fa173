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
