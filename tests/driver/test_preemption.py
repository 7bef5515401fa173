"""Ray's preemption notice on a 2-worker run: the workers save a checkpoint at the step they hear of
it and stop; Ray's controller restarts the group at the deadline, charged to max_preemption_failures
(max_failures=0 here), and the restarted group resumes from that checkpoint and ends bit-exact.

The session cluster has one node: `ray drain-node` on it would take the test session down with it,
so the notice is simulated (tests/strategies/_helpers.py PreemptionNotice puts into the workers what
Ray's PreemptionWatcher puts there); the rest is Ray's own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from raytrain import Trainer
from tests.strategies._helpers import PreemptionNotice, digits_args, digits_model, state_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.ray
@pytest.mark.xdist_group("ddp_run")  # shares test_launch's ddp_run on one xdist worker
@pytest.mark.timeout(400)
def test_a_preemption_notice_saves_stops_and_restarts_bit_exact(ddp_run, digits, tmp_path):
    _, reference, _ = ddp_run
    out_dir = tmp_path / "out"
    args = digits_args(str(out_dir), str(tmp_path / "ray"),
                       scaling={"max_failures": 0, "max_preemption_failures": 1})
    trainer = Trainer(digits_model(), args, train_dataset=digits[0], callbacks=[PreemptionNotice(13)])
    out = trainer.train()
    assert out.global_step == 30
    with open(out_dir / "starts.txt") as f:
        assert [int(line) for line in f] == [0, 13]  # stopped at the notice; resumed from its checkpoint
    assert os.path.isdir(out_dir / "checkpoint-13")
    assert state_digest(trainer.model.state_dict()) == state_digest(reference.model.state_dict())


_IN_PROCESS = r"""
import os, signal, sys
from examples.digits import build_datasets
from raytrain import Trainer, TrainerCallback, TrainingArguments
from tests.strategies._helpers import digits_model

class Term(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

args = TrainingArguments(output_dir=sys.argv[1], max_steps=20, per_device_train_batch_size=32, save_steps=1000,
                         report_to="none", disable_tqdm=True, enable_jit_checkpoint=True)
trainer = Trainer(digits_model(), args, train_dataset=build_datasets()[0], callbacks=[Term()])
try:
    trainer.train()
finally:
    sys.stderr.write(f"@@ default handler back: {signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}\n")
"""


def test_enable_jit_checkpoint_makes_an_in_process_train_save_on_sigterm(tmp_path):
    """Trainer.train() from Python with enable_jit_checkpoint: SIGTERM saves at the step's end, names the
    checkpoint, and the process exits 143 as SIGTERM would have ended it."""
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _IN_PROCESS, str(out)], cwd=ROOT, env=env, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    assert re.search(rf"SIGTERM: stopped at step 3/20; saved {re.escape(str(out / 'checkpoint-3'))}; continue",
                     p.stderr), p.stderr[-3000:]
    assert "@@ default handler back: True" in p.stderr
    assert sorted(os.listdir(out)) == ["checkpoint-3"]
