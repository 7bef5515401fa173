"""Run by tests/test_data_stream.py in its own process: a Ray cluster of exactly 2 CPUs, 2 training workers.

Prints one JSON line: the steps each ray.data input trained, and the one-line error a stage that can never
be scheduled gives. Not a test module itself (it starts its own cluster).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def featurize(batch):
    ids = batch["id"]
    return {"x": np.stack([ids * 1.0, -ids * 1.0], axis=1).astype(np.float32), "labels": ids % 2}


def main(out_dir: str) -> None:
    import ray
    import ray.data

    from raytrain import DataError, RayData, Trainer, TrainingArguments
    from raytrain.data import build_source

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    result = {"cpus": ray.cluster_resources().get("CPU")}
    inputs = {"from_items": ray.data.from_items([{"x": [float(i), -float(i)], "labels": i % 2} for i in range(64)]),
              "range_map_batches": ray.data.range(64).map_batches(featurize, batch_format="numpy")}
    for name, ds in inputs.items():
        args = TrainingArguments(output_dir=os.path.join(out_dir, name), max_steps=4, per_device_train_batch_size=4,
                                 disable_tqdm=True, report_to="none", save_strategy="no",
                                 scaling={"num_workers": 2})
        torch.manual_seed(0)
        result[name] = Trainer(Tiny(), args, train_dataset=ds).train().global_step
    stuck = ray.data.range(8).map_batches(featurize, batch_format="numpy", resources={"no_such_resource": 1})
    try:
        build_source(RayData(stuck, timeout_s=5), 4)
    except DataError as e:
        result["stalled"] = str(e)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
