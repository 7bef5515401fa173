"""A sweep driver for test_tune_restore.py: run as a subprocess so that the test can SIGKILL it. Also the
fault injector of test_tune.py's distributed trial (importable on Ray workers: PYTHONPATH is the repo root)."""

from __future__ import annotations

import os
import signal
import sys
import time

import ray
import torch

from examples.digits import build_datasets, build_model, compute_metrics
from raytrain import Trainer, TrainerCallback, TrainingArguments


class SlowAfterFirstEvaluation(TrainerCallback):
    """Gives the test a wide window in which a trial has a checkpoint but has not finished."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 10:
            time.sleep(0.5)


class KillWorkerOnce(TrainerCallback):
    """SIGKILLs the Ray Train worker of `rank` at the end of `step`, once per sweep (the marker file is
    shared by its trials); rank 0 appends the step each attempt starts from to its trial's starts.txt."""

    def __init__(self, marker: str, rank: int = 1, step: int = 7):
        self.marker, self.rank, self.step = marker, rank, step

    def on_train_begin(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(args.output_dir, "starts.txt"), "a") as f:
                f.write(f"{state.global_step}\n")

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", 0)) == self.rank and state.global_step == self.step \
                and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, resume: str) -> None:
    torch.set_num_threads(1)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    train, val = build_datasets()
    args = TrainingArguments(output_dir=out, max_steps=40, per_device_train_batch_size=32, eval_strategy="steps",
                             eval_steps=10, save_steps=10, logging_steps=10, save_total_limit=1)
    trainer = Trainer(args=args, model_init=lambda **k: build_model(**k), train_dataset=train, eval_dataset=val,
                      compute_metrics=compute_metrics, callbacks=[SlowAfterFirstEvaluation()])
    trainer.hyperparameter_search({"learning_rate": {"loguniform": [1e-3, 1e-2]}}, n_trials=4, direction="maximize",
                                  metric="accuracy", scheduler="none", seed=3, max_concurrent_trials=2, name="restore",
                                  resume=resume == "resume" and "auto", plots=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
