"""The CLI, run as users run it: `python -m raytrain.run` in a subprocess from the repository root."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from raytrain import TrainingArguments, verify_checkpoint
from raytrain.config.args import SECTIONS
from tests.tiny import run_main

# One xdist worker runs the module, so that its module fixtures (the CLI runs started at once) run once.
pytestmark = pytest.mark.xdist_group("cli_runs")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The example's config, shortened from 20 epochs to 4 to keep the suite fast (still > 0.95 accuracy).
DIGITS = ["--config", "examples/digits.yaml", "--set", "num_train_epochs=4"]
STEPS = 4 * 45  # 1438 training samples / batch 32 = 45 steps per epoch


def _popen(*argv: str) -> subprocess.Popen:
    # One intra-op thread: several CLI runs share this machine's cores, and a tiny MLP gains nothing
    # from more (with 2 threads on 2 busy cores, the digits run is ten times slower).
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "raytrain.run", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every independent CLI run of this module, started at once: each pays torch's import (seconds),
    so running them side by side keeps the module fast. Tests wait for the one they check."""
    base = tmp_path_factory.mktemp("cli")
    out = str(base / "digits")
    procs = {
        "digits": _popen(*DIGITS, "--set", f"output_dir={out}"),
        "twin": _popen(*DIGITS, "--set", f"output_dir={base / 'twin'}", "--no-report"),
        "help": _popen("--help"),
        "unknown_field": _popen(*DIGITS, "--set", f"output_dir={base / 'unknown'}", "--set", "learnin_rate=0.1"),
        "missing_config": _popen("--config", str(base / "nope.yaml")),
        "bad_factory": _popen(*DIGITS, "--set", f"output_dir={base / 'factory'}",
                              "--set", "model.factory=examples.digits:no_such_function"),
    }
    yield base, procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _field_names(cls) -> list[str]:
    """Field names of TrainingArguments (a dataclass) or of a section (a pydantic model)."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls.model_fields)


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("summary: ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0][len("summary: "):])


def assert_config_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [message]
    assert "summary:" not in proc.stdout


def logged(message: str, output_dir) -> str:
    """An error found once the configuration is valid: its traceback is in OUTPUT_DIR/raytrain.log."""
    return f"{message} (traceback in {os.path.join(str(output_dir), 'raytrain.log')}; --debug prints it)"


# ---------------------------------------------------------------- configuration errors: exit 2, one line


def test_unknown_field_exits_2_with_suggestion(launched):
    base, procs = launched
    proc = _wait(procs["unknown_field"])
    assert_config_error(proc, "error: unknown field 'learnin_rate': did you mean 'learning_rate'?")
    assert not os.path.exists(base / "unknown")  # nothing was trained or written


def test_a_bad_config_is_refused_before_torch_or_transformers_is_imported(tmp_path):
    """The one-line refusal comes in well under a second: neither torch nor transformers (through the
    search space's module) is imported on the way to it."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['raytrain.run', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('raytrain.run', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print(e.code, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}",
                           "--set", "learnin_rate=0.1"], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)
    assert done.stderr.strip() == "error: unknown field 'learnin_rate': did you mean 'learning_rate'?"
    assert done.stdout.split("\n")[0] == "2 []"


def test_missing_config_file_exits_2(launched):
    base, procs = launched
    missing = str(base / "nope.yaml")
    assert_config_error(_wait(procs["missing_config"]), f"error: config file not found: {missing!r}")


def test_bad_factory_import_string_exits_2(launched):
    base, procs = launched
    assert_config_error(_wait(procs["bad_factory"]), logged(
        "error: model.factory: module 'examples.digits' has no attribute 'no_such_function'", base / "factory"))
    assert "Traceback (most recent call last)" in open(base / "factory" / "raytrain.log").read()


def test_help_lists_every_field_and_exits_0(launched):
    proc = _wait(launched[1]["help"])
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout
    assert out.startswith("usage: python -m raytrain.run")
    for name in _field_names(TrainingArguments):
        if name in SECTIONS:
            for leaf in _field_names(SECTIONS[name]):
                assert f"--set {name}.{leaf}=VALUE" in out, f"{name}.{leaf}"
        else:
            assert f"--set {name}=VALUE" in out, name
    assert "--resume" in out and "--search" in out
    # help text and defaults ride along
    line = next(ln for ln in out.splitlines() if "--set learning_rate=VALUE" in ln)
    assert "peak learning rate" in line and "(default: 5e-05)" in line


# The same error paths in this process (no interpreter start-up per case).


def test_unknown_field_in_the_yaml_file(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(open(os.path.join(ROOT, "examples", "digits.yaml")).read() + "learnin_rate: 0.1\n")
    code, out, err = run_main(capsys, "--config", str(cfg))
    assert (code, out, err) == (2, "", "error: unknown field 'learnin_rate': did you mean 'learning_rate'?\n")


def test_missing_config_argument_exits_2(capsys):
    code, _, err = run_main(capsys)
    assert code == 2 and err == "error: the following arguments are required: --config\n"


@pytest.mark.parametrize("factory, message, found", [
    ("examples.no_such_module:build_model",
     "model.factory: cannot import module 'examples.no_such_module' (No module named 'examples.no_such_module')",
     "importing"),
    ("not an import string",
     "model.factory: expected an import string 'package.module:function', got 'not an import string'",
     "validating"),
])
def test_bad_factory_variants_exit_2(tmp_path, capsys, factory, message, found):
    code, out, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}",
                              "--set", f"model.factory={factory}")
    # found while validating the configuration: nothing is written; once it is valid, the log has the traceback
    expected = logged(f"error: {message}", tmp_path / "o") if found == "importing" else f"error: {message}"
    assert (code, out, err) == (2, "", expected + "\n")
    assert os.path.exists(tmp_path / "o" / "raytrain.log") == (found == "importing")


def test_bad_model_kwargs_exit_2(tmp_path, capsys):
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}", "--set", "model.widht=3")
    assert code == 2
    assert err.startswith("error: model: examples.digits:build_model rejected its arguments (")
    assert "widht" in err and len(err.splitlines()) == 1


def test_resume_from_a_path_that_is_not_a_checkpoint_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "checkpoint-9")
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path}", "--resume", missing)
    assert (code, err) == (2, logged(f"error: --resume: {missing!r} is not a checkpoint directory (or use auto / never)",
                                     tmp_path) + "\n")


# ---------------------------------------------------------------- the digits example end to end


@pytest.fixture(scope="module")
def digits_run(launched):
    base, procs = launched
    return str(base / "digits"), _wait(procs["digits"])


@pytest.fixture(scope="module")
def reruns(digits_run):
    """After the first run: again with --resume auto, and with --resume never (side by side)."""
    out, first = digits_run
    assert first.returncode == 0, first.stderr[-3000:]
    before = _checkpoint_mtimes(out)
    auto = _popen(*DIGITS, "--set", f"output_dir={out}", "--resume", "auto")
    never = _popen(*DIGITS, "--set", f"output_dir={out}", "--resume", "never")
    return before, _wait(auto), _wait(never)


def _checkpoint_mtimes(out: str) -> dict:
    return {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out) if n.startswith("checkpoint-")}


def test_digits_example_end_to_end(digits_run):
    out, proc = digits_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = summary_of(proc)
    assert summary["global_step"] == STEPS
    assert summary["eval_accuracy"] >= 0.95
    assert summary["model"] == os.path.join(out, "final", "model.safetensors")
    log = open(os.path.join(out, "raytrain.log")).read()  # the run's start, its end and where its files went
    assert f"started: output_dir {out}, checkpoints in {out}/checkpoint-N" in log
    assert f"ended: finished at step {STEPS}; checkpoints in {out}; final model {summary['model']}" in log

    # save_total_limit 2 keeps the two newest checkpoints, plus the best one if older
    steps = sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert steps[-2:] == [STEPS - 45, STEPS] and 2 <= len(steps) <= 3 and all(s % 45 == 0 for s in steps)
    for s in steps:
        manifest = verify_checkpoint(os.path.join(out, f"checkpoint-{s}"))
        assert manifest["global_step"] == s and "model.safetensors" in manifest["files"]

    # load_best_model_at_end: the final model is the best checkpoint's
    best = summary["best_model_checkpoint"]
    assert os.path.dirname(best) == out and int(best.rsplit("-", 1)[1]) in steps
    final = load_file(summary["model"])
    best_weights = load_file(os.path.join(best, "model.safetensors"))
    assert final.keys() == best_weights.keys() and all(torch.equal(final[k], best_weights[k]) for k in final)
    from examples.digits import build_model
    build_model().load_state_dict(final)  # the factory's model loads the file strictly


def test_resume_auto_on_a_finished_run_does_no_more_steps(digits_run, reruns):
    out, first = digits_run
    before, proc, _ = reruns
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(proc)
    assert summary["global_step"] == STEPS
    assert summary["eval_accuracy"] == summary_of(first)["eval_accuracy"]
    assert f"resumed from {out}/checkpoint-{STEPS} at step {STEPS}" in proc.stderr
    assert " loss=" not in proc.stderr  # no training step logged
    assert f"| resuming at step {STEPS}" in proc.stderr
    assert f"already complete at step {STEPS} (max_steps {STEPS}): nothing left to train; raise max_steps " \
           "(--set max_steps=N) to train on, or start over with --resume never --set overwrite_output_dir=true" \
           in proc.stderr and "already complete" not in first.stderr
    assert _checkpoint_mtimes(out) == before  # no checkpoint written or rotated


def test_resume_never_on_a_dir_with_checkpoints_exits_2(digits_run, reruns):
    out, _ = digits_run
    proc = reruns[2]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert lines == [logged(f"error: output_dir {out} already holds checkpoint-{STEPS}; use --resume auto to continue "
                            "it, or --set overwrite_output_dir=true to start over (its checkpoints are then deleted)",
                            out)]
    assert "summary:" not in proc.stdout


# ---------------------------------------------------------------- reproducible, visible


def _weights(path: str) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def _untimed(log_history: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in log_history]


def test_two_identical_runs_give_identical_logs_and_weights(launched, digits_run):
    base, procs = launched
    out, first = digits_run
    twin = _wait(procs["twin"])
    assert twin.returncode == 0, twin.stderr[-3000:]
    states = [json.load(open(os.path.join(d, "trainer_state.json"))) for d in (out, str(base / "twin"))]
    assert _untimed(states[0]["log_history"]) == _untimed(states[1]["log_history"])
    assert len([e for e in states[0]["log_history"] if "loss" in e]) == STEPS // 50
    a, b = _weights(os.path.join(out, "final")), _weights(str(base / "twin" / "final"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the initial weights too: the first logged loss depends on them (it differed before seeding)
    assert summary_of(first)["train_loss"] == summary_of(twin)["train_loss"]


def test_non_tty_progress_is_one_line_per_logging_step(digits_run):
    _, proc = digits_run
    lines = proc.stderr.splitlines()
    (intro,) = [ln for ln in lines if ln.startswith("training ")]
    assert "DigitsMLP (26.6k parameters)" in intro and "1438 training samples" in intro
    assert f"{STEPS} steps (4 epochs)" in intro and "1 process" in intro and intro.endswith("from step 0")
    train_lines = [ln for ln in lines if " loss=" in ln]
    assert [ln.split()[1] for ln in train_lines] == [f"{s}/{STEPS}" for s in (50, 100, 150)]
    assert all("learning_rate=" in ln and "grad_norm=" in ln and " eta=" in ln for ln in train_lines)
    assert len([ln for ln in lines if " eval_accuracy=" in ln]) == 4  # every epoch; the summary reuses the last
    assert "\r" not in proc.stderr  # no bar redrawn into a log


def test_run_writes_report_plots(digits_run):
    out, proc = digits_run
    assert summary_of(proc)["plots"] == os.path.join(out, "plots")
    names = sorted(os.listdir(os.path.join(out, "plots")))
    assert names == ["eval_accuracy.png", "eval_loss.png", "grad_norm.png", "learning_rate.png", "loss.png",
                     "overview.png"]


# ---------------------------------------------------------------- runtime errors: one line, traceback in the log


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_model_without_loss_is_one_line_with_the_traceback_in_the_log(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={out}",
                            "--set", "model.factory=tests.cli_jobs:model_without_loss")
    assert code == 1
    log = str(out / "raytrain.log")
    assert _one_error(err) == (
        "error: the model (model.factory) returned no loss (a 'loss' key or attribute, or a scalar first element "
        f"of a tuple); return one when labels are given (traceback in {log}; --debug prints it)")
    text = open(log).read()
    assert "Traceback (most recent call last)" in text and "ValueError: the model returned no loss" in text
    assert "model.factory=tests.cli_jobs:model_without_loss" in text  # the command heads the log
    assert text.splitlines()[-1].startswith("=== ended: failed (ValueError: the model returned no loss")


def test_debug_prints_the_traceback(tmp_path, capsys):
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path}", "--debug",
                            "--set", "model.factory=tests.cli_jobs:model_without_loss")
    assert code == 1 and "Traceback (most recent call last)" in err and "in loss_of" in err


def test_a_crash_raytrain_cannot_explain_prints_its_traceback(tmp_path, capsys):
    # torch refuses the model the factory builds: not an error raytrain can explain in one line.
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}", "--set", "model.hidden_size=-1")
    assert code == 1
    assert "Traceback (most recent call last)" in err and "negative dimension -1" in err
    assert not [ln for ln in err.splitlines() if ln.startswith("error: ")]


def test_dataset_of_ints_exits_2_naming_the_factory(tmp_path, capsys):
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path}",
                            "--set", "data.factory=tests.cli_jobs:int_datasets")
    assert code == 2
    assert _one_error(err) == logged(
        "error: data.factory: tests.cli_jobs:int_datasets returned a train dataset whose items are int; each item "
        "must be a dict of tensors, one per model input and 'labels' (e.g. {'pixels': ..., 'labels': ...})", tmp_path)
    assert "Traceback (most recent call last)" in open(tmp_path / "raytrain.log").read()


def test_resume_from_an_output_dir_names_its_checkpoint(digits_run, capsys):
    out, _ = digits_run
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={out}-other", "--resume", out)
    assert code == 2
    assert _one_error(err) == logged(
        f"error: --resume: {out!r} is an output directory, not a checkpoint; pass one of its checkpoints "
        f"(--resume {out}/checkpoint-{STEPS}) or --resume auto with --set output_dir={out}", f"{out}-other")
    assert "Traceback (most recent call last)" in open(f"{out}-other/raytrain.log").read()


def test_truncated_checkpoint_is_one_line_naming_the_file(digits_run, tmp_path, capsys):
    import shutil

    out, _ = digits_run
    bad = tmp_path / "checkpoint-45"
    shutil.copytree(os.path.join(out, f"checkpoint-{STEPS}"), bad)
    size = os.path.getsize(bad / "model.safetensors")
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100)
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}", "--resume", str(bad))
    assert code == 1
    assert _one_error(err).startswith(
        f"error: {bad}/model.safetensors: size 100 bytes, the manifest says {size} (truncated?) (traceback in ")
    assert "CheckpointError" in open(tmp_path / "o" / "raytrain.log").read()


def test_set_with_a_space_for_the_equals_sign_says_how_to_write_it(tmp_path, capsys):
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}", "--set", "learning_rate", "1e-3")
    assert code == 2
    assert err == ("error: unrecognized arguments: 1e-3 (--set takes KEY=VALUE: write --set learning_rate=1e-3)\n")
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={tmp_path / 'o'}", "--set", "learning_rate")
    assert code == 2 and err == "error: --set expects KEY=VALUE, got 'learning_rate' (write --set learning_rate=VALUE)\n"
    assert not os.path.exists(tmp_path / "o")  # a configuration error before any work writes nothing


def test_search_settings_are_set_as_search_keys_and_say_where_they_belong(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_main(capsys, *DIGITS, "--set", f"output_dir={out}", "--set", "num_samples=5")
    assert code == 2 and err == ("error: num_samples is a search setting, not a training field: put it in the "
                                 "--search YAML or write --set search.num_samples=VALUE\n")
    code, _, err = run_main(capsys, *DIGITS, "--set", "search.num_samples=5")
    assert code == 2 and err == ("error: --set search.num_samples=5: search settings need --search FILE "
                                 "(the search YAML they change)\n")
    code, _, err = run_main(capsys, *DIGITS, "--search", "search_spaces/digits.yaml", "--set", f"output_dir={out}",
                            "--set", "search.num_smaples=5")
    assert code == 2 and err.startswith("error: --set search.num_smaples: not a search setting (valid: ")
    assert not out.exists()  # checked before any work
    code, help_text, _ = run_main(capsys, "--help")
    assert code == 0 and "search YAML (--search FILE; each key can be overridden with --set search.KEY=VALUE)" \
        in help_text and "num_samples            trials to run" in help_text
