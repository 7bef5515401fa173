"""raytrain.trl's GRPOTrainer on 2 Ray Train workers (DDP) against trl's on 2 torchrun processes (gloo): each rank
samples the same completions from its own seed (TRL's per-process seed), the rewards of both ranks are normalised
together, and the per-step losses and TRL's metrics are trl's. (One process cannot be the reference: each rank's
completions come from its own generator.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.hf import grpo_jobs as jobs  # by this name on the Ray workers too

pytest.importorskip("trl")
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("trl_on_ray")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.long  # two launches (torchrun, Ray) of a minute each; by default test_grpo.py's in-process parity
@pytest.mark.timeout(600)
def test_grpo_on_two_ray_workers_matches_trl_on_two_processes(ray_cluster, tmp_path):
    tiny = jobs.save_tiny_model(str(tmp_path / "tiny"))
    theirs = tmp_path / "trl"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "tests.hf.grpo_jobs", str(theirs), tiny], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    recorder = jobs.Recorder(str(tmp_path / "rt" / "calls"))
    ours = jobs.trainer("rt", str(tmp_path / "rt"), tiny, recorder=recorder, scaling={"num_workers": 2},
                        distributed={"strategy": "ddp"}, **jobs.ON_TWO)
    ours.train()
    their_calls = jobs.Recorder(str(theirs / "calls"))
    for rank in (0, 1):
        mine, want = recorder.read(rank), their_calls.read(rank)
        assert [c["step"] for c in mine] == [c["step"] for c in want] == [0]
        assert mine == want  # the rank's prompts, completions and rewards
    assert recorder.read(0)[0]["completion_ids"] != recorder.read(1)[0]["completion_ids"]
    with open(theirs / "steps.json") as f:
        want = json.load(f)
    got = jobs.steps(ours)
    assert len(got) == len(want) == 4
    for x, y in zip(got, want):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            assert x[k] == pytest.approx(y[k], abs=1e-5, rel=1e-5), (k, x, y)
    assert {"reward", "kl", "rewards/digits/mean"} <= set(got[0])
