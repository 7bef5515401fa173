"""enable_jit_checkpoint in-process: SIGTERM saves, then exits 143. (Ray's preemption notice on a 2-worker
run is one of the three faults of test_launch.py's fault test: the session cluster has one node, and
`ray drain-node` on it would take the session down with it, so the notice is simulated there.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
