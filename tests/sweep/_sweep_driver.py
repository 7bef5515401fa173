"""A sweep driver for test_tune_restore.py: run as a subprocess so that the test can SIGKILL it. Also the
fault injectors of test_tune.py's distributed trial (importable on Ray workers: PYTHONPATH is the repo root)."""

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


class HoldLastSave(TrainerCallback):
    """Once two trials have finished, a trial that saves its last checkpoint stops there, before reporting
    that evaluation to Tune (marker `.holding-<trial>`), until the test SIGKILLs the sweep's driver: its
    checkpoint runs past what Tune's saved state holds, the window a continued sweep must not lose."""

    def on_train_end(self, args, state, control, **kwargs):
        sweep, trial = os.path.split(os.path.abspath(args.output_dir))
        open(os.path.join(sweep, f".done-{trial}"), "w").close()

    def on_save(self, args, state, control, **kwargs):
        sweep, trial = os.path.split(os.path.abspath(args.output_dir))
        if state.global_step == state.max_steps and len([n for n in os.listdir(sweep) if n.startswith(".done-")]) >= 2:
            open(os.path.join(sweep, f".holding-{trial}"), "w").close()
            time.sleep(600)


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


class KillDriverOnce(TrainerCallback):
    """Rank 0 of a distributed trial, at the end of `step`, waits until Ray Train has committed the checkpoint
    reported before, then SIGKILLs the sweep's driver (pid): the trial is left unfinished in Tune's saved state.
    The ranks wait to be stopped (the driver's job ends, and with it the trial), so no later checkpoint."""

    def __init__(self, pid: int, step: int, wait_s: float = 1.0):
        self.pid, self.step, self.wait_s = pid, step, wait_s

    def on_train_begin(self, args, state, control, **kwargs):
        KillWorkerOnce.on_train_begin(self, args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if int(os.environ.get("RANK", 0)) == 0:
                import ray.train

                ray.train.get_all_reported_checkpoints(ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=60)
                time.sleep(self.wait_s)  # Tune saves its state at most once a second
                os.kill(self.pid, signal.SIGKILL)
            time.sleep(120)


def ddp_trainer(out: str, callback) -> Trainer:
    """test_tune's 2-worker trial: one process's maths (no dropout), 10 steps, a checkpoint every 5."""
    train, val = build_datasets()
    args = TrainingArguments(output_dir=out, max_steps=10, per_device_train_batch_size=32, eval_strategy="steps",
                             eval_steps=5, save_strategy="steps", save_steps=5, logging_steps=5, save_total_limit=1,
                             disable_tqdm=True, scaling={"num_workers": 2, "max_failures": 1})
    return Trainer(args=args, model_init=lambda **k: build_model(dropout=0.0, **k), train_dataset=train,
                   eval_dataset=val, compute_metrics=compute_metrics, callbacks=[callback])


def ddp_search(trainer, uri: str, resume):
    return trainer.hyperparameter_search({"learning_rate": {"choice": [3e-3]}}, n_trials=1, direction="maximize",
                                         metric="accuracy", scheduler="none", seed=0, name="ddp", storage_path=uri,
                                         resume=resume, plots=False)


def main(out: str, resume: str) -> None:
    torch.set_num_threads(1)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    train, val = build_datasets()
    args = TrainingArguments(output_dir=out, max_steps=40, per_device_train_batch_size=32, eval_strategy="steps",
                             eval_steps=10, save_steps=10, logging_steps=10, save_total_limit=1)
    trainer = Trainer(args=args, model_init=lambda **k: build_model(**k), train_dataset=train, eval_dataset=val,
                      compute_metrics=compute_metrics,
                      callbacks=[SlowAfterFirstEvaluation()] + ([HoldLastSave()] if resume == "fresh" else []))
    trainer.hyperparameter_search({"learning_rate": {"loguniform": [1e-3, 1e-2]}}, n_trials=4, direction="maximize",
                                  metric="accuracy", scheduler="none", seed=3, max_concurrent_trials=2, name="restore",
                                  resume=resume == "resume" and "auto", plots=False)


if __name__ == "__main__":
    if sys.argv[2] == "ddp":  # a 2-worker trial at a URI whose driver (this process) is SIGKILLed after step 7
        torch.set_num_threads(1)
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        ddp_search(ddp_trainer(sys.argv[1], KillDriverOnce(os.getpid(), step=7)), sys.argv[3], False)
    else:
        main(sys.argv[1], sys.argv[2])
