"""Helpers of tests/data/test_stream.py that Ray workers import by name (a test module is imported under
another name there), and, run as a script, the 2-CPU cluster check: 2 training workers on ray.data inputs
on a cluster of exactly 2 CPUs; it prints one JSON line (steps trained, the one-line error of a stage
that can never be scheduled).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raytrain import TrainerCallback
from tests.data.ray_stages import featurize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class Recorder(nn.Module):
    """Records the sample ids of every training batch it sees."""

    def __init__(self, features: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(features, 2)
        self.seen: list[list[int]] = []

    def forward(self, x, idx, labels=None):
        if self.training:
            self.seen.append(idx.tolist())
        logits = self.linear(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class IdLog(TrainerCallback):
    """Each rank appends (attempt start, step, ids) to ids-rank{R}.jsonl; rank 1, once step `pause_after`
    and its save are done (first attempt only), writes its pid and waits to be killed from outside."""

    def __init__(self, pause_after: int | None = None):
        self.pause_after, self.start = pause_after, 0

    def _path(self, args, name):
        return os.path.join(args.output_dir, f"{name}-rank{os.environ.get('RANK', '0')}")

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = state.global_step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        module = getattr(model, "module", model)
        with open(self._path(args, "ids") + ".jsonl", "a") as f:
            f.write(json.dumps({"start": self.start, "step": state.global_step, "ids": module.seen[-1]}) + "\n")

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.pause_after and os.environ.get("RANK") == "1" and self.start == 0:
            with open(self._path(args, "pid"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)  # killed from outside long before this ends


def main(out_dir: str) -> None:
    import ray
    import ray.data

    from raytrain import DataError, RayData, Trainer, TrainingArguments
    from raytrain.data import build_source

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    result = {"cpus": ray.cluster_resources().get("CPU")}
    items = [{"x": np.array([i, -i], dtype=np.float32), "labels": i % 2} for i in range(64)]
    inputs = {"from_items": ray.data.from_items(items),
              "range_map_batches": ray.data.range(64).map_batches(featurize, batch_format="numpy")}
    # One run reads both (a Ray Train start each would double this test's time): trains on one, evaluates on the other.
    args = TrainingArguments(output_dir=os.path.join(out_dir, "run"), max_steps=4, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=4, disable_tqdm=True,
                             report_to="none", save_strategy="no", scaling={"num_workers": 2})
    torch.manual_seed(0)
    trainer = Trainer(Tiny(), args, train_dataset=inputs["from_items"], eval_dataset=inputs["range_map_batches"])
    result["from_items"] = trainer.train().global_step
    result["range_map_batches"] = [{k: v for k, v in h.items() if k in ("step", "eval_samples", "eval_loss")}
                                   for h in trainer.state.log_history if "eval_loss" in h]
    stuck = ray.data.range(8).map_batches(featurize, batch_format="numpy", resources={"no_such_resource": 1})
    try:
        build_source(RayData(stuck, timeout_s=5), 4)
    except DataError as e:
        result["stalled"] = str(e)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
