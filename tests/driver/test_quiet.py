"""A clean run's output: a 2-worker CLI run written to a file holds raytrain's lines and nothing of Ray's
(no colour codes, no PreemptionWatcher or token-authentication lines, no Ray Train INFO lines); torch's
thread count: the node's cores shared by its training processes, unless OMP_NUM_THREADS or
torch.set_num_threads chose."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from raytrain.runtime import threads
from raytrain.config.sections import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every line a clean 2-worker digits run prints (stdout and stderr into one file).
_RAYTRAIN_LINES = [
    r"training DigitsMLP \(26\.6k parameters\) \| 1438 training samples, 23 batches per epoch per process \| "
    r"10 steps \(1 epoch\) \| 2 processes \(fsdp\) \| output_dir \S+ \| from step 0",
    r"step (5|10)/10( \w+=\S+)+",
    r"summary: \{.*\}",
]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_two_worker_cli_run_prints_raytrains_lines_only(tmp_path):
    # Its own local cluster, as `python -m raytrain.run` starts one; the session's cluster runs beside it,
    # which is what made Ray Train's PlacementGroupCleaner fail with a traceback (two clusters on one machine).
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_COLOR_PREFIX",
                                                            "RAY_DEDUP_LOGS_SKIP_REGEX", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = ROOT
    log = tmp_path / "run.log"
    # The docs' 2-worker command (docs/snippets/distributed.sh: FSDP2), 10 steps of it.
    with open(os.path.join(ROOT, "docs", "snippets", "distributed.sh")) as f:
        [shown] = [line for line in f.read().splitlines() if line.startswith("python -m raytrain.run")]
    with open(log, "wb") as f:
        p = subprocess.run([sys.executable] + shlex.split(shown)[1:] + [
                            "--set", f"output_dir={tmp_path / 'out'}",
                            "--set", "max_steps=10", "--set", "logging_steps=5", "--no-report"],
                           cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=280)
    raw = log.read_bytes()
    text = raw.decode()
    assert p.returncode == 0, text[-3000:]
    assert b"\x1b" not in raw, text[-3000:]
    assert "PreemptionWatcher" not in text
    assert "Token authentication" not in text and "RAY_AUTH_MODE" not in text
    lines = text.splitlines()
    others = [ln for ln in lines if not any(re.fullmatch(shape, ln) for shape in _RAYTRAIN_LINES)]
    assert others == [], text[-3000:]
    assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == ["5/10", "10/10", "10/10", "10/10"]
    assert sum(ln.startswith("training ") for ln in lines) == 1 and lines[-1].startswith("summary: ")


# ---------------------------------------------------------------- torch's thread count (in-process)


@pytest.fixture
def torch_threads(monkeypatch):
    """torch's count and threads.py's memory of it, both put back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.setattr(threads, "_seen", before)
    monkeypatch.setattr(threads, "_pinned", False)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores, local, expected", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 2, 8), (16, 3, 5),
                                                    (1, 1, 1), (64, 8, 8), (8, 0, 8)])
def test_the_default_shares_the_nodes_cores_among_its_processes(cores, local, expected):
    assert threads.default_threads(cores, local) == expected


def test_the_default_is_applied_when_nobody_chose(torch_threads):
    assert threads.apply_threads(2, cores=4) == 2 and torch.get_num_threads() == 2
    assert threads.apply_threads(4, cores=4) == 1 and torch.get_num_threads() == 1


def test_omp_num_threads_wins(torch_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.apply_threads(2, cores=4) == 3 and torch.get_num_threads() == 3
    # In a Ray worker, the driver's choice is passed and the worker's own (Ray's) is not read.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.apply_threads(2, 2, read_env=False, cores=16, pin=True) == 2 and torch.get_num_threads() == 2
    assert threads.apply_threads(2, cores=16) == 2  # pinned: set_seed's later call leaves the driver's choice


def test_the_users_own_set_num_threads_stays(torch_threads):
    threads.apply_threads(1, cores=4)
    torch.set_num_threads(3)
    assert threads.apply_threads(1, cores=4) == 3 and torch.get_num_threads() == 3


def test_set_seed_applies_the_default_for_the_local_processes(torch_threads, monkeypatch):
    from raytrain.runtime.seeding import set_seed

    monkeypatch.setattr(threads, "node_cores", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # as torchrun sets it, OMP_NUM_THREADS left unset
    set_seed(0)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_omp_num_threads_is_a_one_line_error(torch_threads, monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ConfigError, match=rf"OMP_NUM_THREADS='{value}': expected a positive integer"):
        threads.apply_threads(1)
