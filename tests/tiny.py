"""Small models and data shared by the tests (no downloads, a few hundred parameters)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

import torch
from torch import nn

from raytrain import TrainerCallback, TrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


class TinyClassifier(nn.Module):
    """features -> classes; returns {"loss", "logits"} as HF models do."""

    def __init__(self, features: int = 4, classes: int = 3):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def columns(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, generator=g), "labels": torch.randint(0, 3, (n,), generator=g)}


def rows(n: int, seed: int = 0) -> list[dict]:
    """columns() as the list of dicts transformers' default collator takes (for HF's own Trainer)."""
    data = columns(n, seed)
    return [{"x": data["x"][i], "labels": data["labels"][i]} for i in range(n)]


def args_for(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), disable_tqdm=True, report_to="none", seed=0)
    return TrainingArguments(**{**base, **kw})


class StopAt(TrainerCallback):
    """Simulates a preemption right after step `step` (and its checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def kill_at_save(code: str, flag, step: int, seconds: float = 120, path: str | None = None) -> None:
    """Run `code` in a fresh Python (from the repository, `path` its PYTHONPATH: the repository by default)
    whose save of `step` pauses (checkpoint_io.PAUSE_ENV), and SIGKILL it there."""
    from raytrain.checkpoint import io as checkpoint_io

    env = {**os.environ, checkpoint_io.PAUSE_ENV: f"{flag}@{step}", "PYTHONPATH": path or ROOT}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    kill_when_paused(proc, flag, f"the save of step {step}", seconds)


def kill_when_paused(proc, flag, what: str, seconds: float = 120) -> None:
    """SIGKILL `proc` once `flag` exists (a save paused by checkpoint_io.PAUSE_ENV); its stderr if it exits first."""
    try:
        deadline = time.monotonic() + seconds
        while not flag.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"the training process never reached {what}"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@contextlib.contextmanager
def logged(name: str, level: int = logging.INFO):
    """The records logger `name` (or a child) emits meanwhile, whatever its propagation: transformers'
    loggers, where the Trainer's HF messages go, do not propagate to pytest's caplog outside CI."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    log = logging.getLogger(name)
    old = log.level
    log.setLevel(level)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """raytrain.run.main in this process (the CLI without a second import of torch and the rest): (exit code,
    stdout, stderr)."""
    from raytrain.run import main

    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse exits on its own errors and on --help
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
