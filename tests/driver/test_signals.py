"""Ctrl-C and SIGTERM in a CLI run: save at the next step boundary, one line, exit 130 / 143, and a
resume that ends bit-exactly where an uninterrupted run ends."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from raytrain import verify_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2 * 45


def _job(out, delay: float, *more: str) -> list[str]:
    # The digits example with a model that sleeps `delay` s per forward, so a signal lands mid-run.
    return ["--config", "examples/digits.yaml", "--set", "num_train_epochs=2", "--set", "logging_steps=5",
            "--set", "model.factory=tests.cli_jobs:slow_model", "--set", f"model.delay={delay}",
            "--set", f"output_dir={out}", "--no-report", *more]


def _popen(argv: list[str], **more_env: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **more_env}
    return subprocess.Popen([sys.executable, "-m", "raytrain.run", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _signal_at_step(p: subprocess.Popen, step: int, *signums: int) -> str:
    """Read stderr until the progress line of `step`, send the signals, return all of stderr. Each signal
    after the first waits for the line of the handler before it: two signals close together can reach
    Python's handler as one."""
    seen = []
    deadline = time.monotonic() + 240
    pending = list(signums)
    for line in p.stderr:
        seen.append(line)
        if len(pending) == len(signums) and re.search(rf"(^|\s)step {step}/", line):  # Ray prefixes worker lines
            p.send_signal(pending.pop(0))
        elif len(pending) < len(signums) and "saving a checkpoint at the end of this step" in line:
            p.send_signal(pending.pop(0))
        if not pending:
            break
        assert time.monotonic() < deadline, "".join(seen)
    p.stdout_text, rest = p.communicate(timeout=240)
    return "".join(seen) + rest


def _weights(d: str) -> dict:
    return load_file(os.path.join(d, "model.safetensors"))


def test_sigint_saves_at_the_next_step_and_the_resume_is_bit_exact(tmp_path):
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    reference = _popen(_job(straight, 0.02))
    p = _popen(_job(stopped, 0.02))
    err = _signal_at_step(p, 10, signal.SIGINT)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"SIGINT: stopped at step (\d+)/90; saved (\S+); continue with: (.+)", last)
    assert m, last
    step, path, command = int(m.group(1)), m.group(2), m.group(3)
    assert 10 <= step < 45 and path == str(stopped / f"checkpoint-{step}")
    assert verify_checkpoint(path)["global_step"] == step
    assert sorted(os.listdir(stopped)) == [f"checkpoint-{step}", "raytrain.log"]  # epoch saves: none yet
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "raytrain.run"] and "--resume" not in argv

    resumed = _popen(argv[3:])
    out, err2 = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err2[-3000:]
    assert f"resuming at step {step}" in err2
    ref_out, ref_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_err[-3000:]
    a, b = _weights(stopped / "final"), _weights(straight / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [ln.split(" eta=")[0] for ln in err2.splitlines() if " loss=" in ln]
    assert losses and all(ln in ref_err for ln in losses)  # every logged loss of the resumed part, to the digit


def test_a_second_ctrl_c_exits_at_once_without_saving(tmp_path):
    p = _popen(_job(tmp_path / "o", 1.0))  # a long step: the second Ctrl-C lands before the step ends
    err = _signal_at_step(p, 5, signal.SIGINT, signal.SIGINT)
    assert p.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "SIGINT again: exiting now without saving"
    assert "Traceback" not in err
    assert not [n for n in os.listdir(tmp_path / "o") if "checkpoint" in n]


def test_sigterm_exits_143_and_says_what_was_saved(tmp_path):
    p = _popen(_job(tmp_path / "o", 0.05, "--set", "save_strategy=no",
                    "--set", "load_best_model_at_end=false"))
    err = _signal_at_step(p, 5, signal.SIGTERM)
    assert p.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"SIGTERM: stopped at step \d+/90; nothing saved \(save_strategy is 'no'\); "
                        r"continue with: python -m raytrain\.run .*", last), last
    step = last.split("step ")[1].split("/")[0]
    log = open(tmp_path / "o" / "raytrain.log").read()
    assert f"ended: stopped by SIGTERM at step {step}; nothing saved (save_strategy is 'no')" in log


def test_ctrl_c_before_training_is_one_line(tmp_path):
    # While the model is being built there is no step boundary: stop at once and say so.
    marker = tmp_path / "building"
    p = _popen(_job(tmp_path / "o", 0.0, "--set", "model.factory=tests.cli_jobs:waiting_model",
                    "--set", "model.delay=null", "--set", f"model.marker={marker}"))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "SIGINT: interrupted before training started (while building the model and the data); nothing new was "
        "saved; continue with: " + shlex.join(["python", "-m", "raytrain.run", *_job(
            tmp_path / "o", 0.0, "--set", "model.factory=tests.cli_jobs:waiting_model", "--set", "model.delay=null",
            "--set", f"model.marker={marker}")])]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ctrl_c_on_the_driver_of_a_ray_run_makes_the_workers_save(ray_cluster, tmp_path):
    # Ray's own SIGINT handler would abort the workers at once; raytrain's sends them SIGTERM instead,
    # so they save at the next step boundary (as for a spot preemption), then ends the run. The run joins the
    # session's cluster (test_quiet.py runs the CLI on a cluster it starts).
    out = tmp_path / "o"
    p = _popen(_job(out, 0.05, "--set", "scaling.num_workers=2"),
               RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    err = _signal_at_step(p, 5, signal.SIGINT)  # rank 0's progress, drawn by the driver
    assert p.returncode == 130, err[-3000:]
    assert "sent SIGTERM to 2 Ray Train worker(s): each saves and stops" in err
    # The driver prints rank 0's run line and progress lines, once each; no worker prints any.
    lines = err.splitlines() + p.stdout_text.splitlines()
    (intro,) = [ln for ln in lines if ln.startswith("training ")]
    assert "| 46 steps (2 epochs) | 2 processes (ddp) |" in intro
    (step5,) = [ln for ln in lines if "step 5/46 " in ln]
    assert re.fullmatch(r"step 5/46 loss=\S+ grad_norm=\S+ learning_rate=\S+ epoch=\S+ eta=\S+", step5), step5
    workers = [ln for ln in lines if "RayTrainWorker" in ln]
    quiet = r"step \d+/|loss|Reporting training result|Checkpoint successfully"  # Ray's own lines included
    assert not [ln for ln in workers if re.search(quiet, ln)], workers
    (line,) = [ln for ln in err.splitlines() if ln.startswith("SIGINT: the workers stopped")]
    m = re.fullmatch(r"SIGINT: the workers stopped; saved (\S+/checkpoint-(\d+)); continue with: python -m "
                     r"raytrain\.run .*", line)
    assert m and m.group(1).startswith(str(out)), line
    assert 5 <= int(m.group(2)) < 46 and verify_checkpoint(m.group(1))["global_step"] == int(m.group(2))
    # Output to pipes (not a tty): no colour codes, no PreemptionWatcher or token-authentication lines, no HF
    # info blocks (test_quiet.py: a clean run's lines).
    raw = err + p.stdout_text
    assert "\x1b" not in raw and "PreemptionWatcher" not in raw and "Token authentication" not in raw, raw[-3000:]
    assert "***** Running" not in raw, raw[-3000:]  # HF's info blocks need log_level info


# ---------------------------------------------------------------- Trainer.train() called from Python

_PYTHON_API = r"""
import signal, sys
from examples.digits import build_datasets
from raytrain import Trainer, TrainingArguments
from tests.cli_jobs import slow_model

out = sys.argv[1]
model = slow_model(0.05)
args = TrainingArguments(output_dir=out, max_steps=90, logging_steps=5, per_device_train_batch_size=32,
                         save_strategy="steps", save_steps=1000, report_to="none", seed=42)
trainer = Trainer(model, args, train_dataset=build_datasets()[0])
try:
    trainer.train()
except KeyboardInterrupt as e:
    sys.stderr.write(f"@@ caught: {e}\n")
sys.stderr.write(f"@@ default handler back: {signal.getsignal(signal.SIGINT) is signal.default_int_handler}\n")
model.delay = 0.5
sys.stderr.write("@@ resuming\n")
sys.stderr.flush()
try:
    trainer.train(resume_from_checkpoint=sys.argv[2] if len(sys.argv) > 2 else True)
except KeyboardInterrupt as e:
    sys.stderr.write(f"@@ caught again: {e!r}\n")
sys.stderr.write(f"@@ default handler back: {signal.getsignal(signal.SIGINT) is signal.default_int_handler}\n")
"""


def test_python_api_ctrl_c_saves_then_raises_keyboard_interrupt(tmp_path):
    """From Python, the first Ctrl-C saves at the next step and raises KeyboardInterrupt naming the
    checkpoint and resume_from_checkpoint=...; the run then resumes from it; a second Ctrl-C raises at
    once without saving; Python's default handler is back after each train()."""
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", _PYTHON_API, str(out)], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen, phase, deadline = [], 0, time.monotonic() + 240
    for line in p.stderr:
        seen.append(line)
        if phase == 0 and line.startswith("step 5/90 "):
            p.send_signal(signal.SIGINT)
            phase = 1
        elif phase == 1 and line.startswith("@@ resuming"):
            phase = 2
        elif phase == 2 and re.match(r"step \d+/90 loss=", line):
            p.send_signal(signal.SIGINT)
            phase = 3
        elif phase == 3 and line.startswith("SIGINT: saving a checkpoint"):
            # The second signal only once the first was handled: two signals before Python runs its
            # handler arrive as one.
            p.send_signal(signal.SIGINT)
            phase = 4
        assert time.monotonic() < deadline, "".join(seen)
    p.wait(timeout=60)
    err = "".join(seen)
    assert p.returncode == 0 and phase == 4, err[-3000:]
    (caught,) = [ln for ln in seen if ln.startswith("@@ caught: ")]
    m = re.fullmatch(r"@@ caught: SIGINT: stopped at step (\d+)/90; saved (\S+); continue with "
                     r"trainer\.train\(resume_from_checkpoint='(\S+)'\)\n", caught)
    assert m, caught
    step = int(m.group(1))
    assert 5 <= step < 15 and m.group(2) == m.group(3) == str(out / f"checkpoint-{step}")
    assert verify_checkpoint(m.group(2))["global_step"] == step
    assert f"resuming at step {step}" in err
    assert [ln for ln in seen if ln.startswith("@@ caught again: ")] == ["@@ caught again: KeyboardInterrupt()\n"]
    assert [ln for ln in seen if ln.startswith("@@ default handler back: ")] == ["@@ default handler back: True\n"] * 2
    assert sorted(os.listdir(out)) == [f"checkpoint-{step}"]  # the second interrupt saved nothing


_SIGTERM_AFTER_RAY_INIT = r"""
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
from raytrain.driver.launch import ensure_ray
ensure_ray(sys.argv[1])
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("handled", got)
"""


@pytest.mark.ray
def test_the_drivers_sigterm_handler_outlives_ray_init(ray_cluster):
    # ray.init installs Ray's crash handler for SIGTERM (a stack dump, then abort: exit 134), which
    # would skip graceful_stop's save on `kill` or `ray job stop`; ensure_ray puts the driver's back.
    address = ray_cluster.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-c", _SIGTERM_AFTER_RAY_INIT, address], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and out.stdout.strip() == f"handled [{int(signal.SIGTERM)}]", out.stderr[-2000:]
    assert "SIGTERM received" not in out.stderr, out.stderr[-2000:]
