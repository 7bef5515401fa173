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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2 * 45


def _job(out, delay: float, *more: str) -> list[str]:
    # The digits example with a model that sleeps `delay` s per forward, so a signal lands mid-run.
    return ["--config", "examples/digits.yaml", "--set", "num_train_epochs=2", "--set", "logging_steps=5",
            "--set", "model.factory=tests.cli_jobs:slow_model", "--set", f"model.delay={delay}",
            "--set", f"output_dir={out}", "--no-report", *more]


def _popen(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "raytrain.run", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _signal_at_step(p: subprocess.Popen, step: int, *signums: int, gap: float = 0.0) -> str:
    """Read stderr until the progress line of `step`, send the signals, return all of stderr."""
    seen = []
    deadline = time.monotonic() + 240
    for line in p.stderr:
        seen.append(line)
        if re.search(rf"(^|\s)step {step}/", line):  # Ray prefixes a worker's lines with its name
            for s in signums:
                p.send_signal(s)
                time.sleep(gap)
            break
        assert time.monotonic() < deadline, "".join(seen)
    rest = p.communicate(timeout=240)[1]
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
    p = _popen(_job(tmp_path / "o", 0.5))
    err = _signal_at_step(p, 5, signal.SIGINT, signal.SIGINT, gap=0.05)
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
def test_ctrl_c_on_the_driver_of_a_ray_run_makes_the_workers_save(tmp_path):
    # Ray's own SIGINT handler would abort the workers at once; raytrain's sends them SIGTERM instead,
    # so they save at the next step boundary (as for a spot preemption), then ends the run.
    out = tmp_path / "o"
    p = _popen(_job(out, 0.05, "--set", "scaling.num_workers=2"))
    err = _signal_at_step(p, 5, signal.SIGINT)  # rank 0's progress lines reach the driver through Ray
    assert p.returncode == 130, err[-3000:]
    assert "sent SIGTERM to 2 Ray Train worker(s): each saves and stops" in err
    assert len([ln for ln in err.splitlines() if " step 5/46 loss=" in ln]) == 1  # rank 0 only, once
    (line,) = [ln for ln in err.splitlines() if ln.startswith("SIGINT: the workers stopped")]
    m = re.fullmatch(r"SIGINT: the workers stopped; saved (\S+/checkpoint-(\d+)); continue with: python -m "
                     r"raytrain\.run .*", line)
    assert m and m.group(1).startswith(str(out)), line
    assert 5 <= int(m.group(2)) < 46 and verify_checkpoint(m.group(1))["global_step"] == int(m.group(2))
