"""raytrain.trl's AsyncGRPOTrainer on the arithmetic prompts of examples/grpo.py and the tiny Llama of
examples/sft.py, rewarded for completion tokens below 128 (a signal a tiny model learns within a few steps).
Importable on Ray workers too (PYTHONPATH is the repository's root)."""

from __future__ import annotations

import time

from raytrain import TrainerCallback

# 8 samples a step (2 prompt groups of 4), 10 steps, the policy one version stale
RUN = dict(max_steps=10, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
           max_completion_length=8, learning_rate=1e-2, logging_steps=1, max_staleness=1, seed=7, bf16=False,
           gradient_checkpointing=False, report_to=[], disable_tqdm=True, save_strategy="no")


def low_ids(completion_ids, slow_once: str | None = None, **kwargs) -> list[float]:
    """The fraction of a completion's tokens below 128 (the byte tokenizer's ASCII). `slow_once`: a flag file; the
    first call that finds it missing makes it, then hangs for 2 minutes (a rollout actor gone silent)."""
    import os

    if slow_once is not None and not os.path.exists(slow_once):
        open(slow_once, "w").close()
        time.sleep(120)
    return [sum(1 for t in ids if t < 128) / max(len(ids), 1) for ids in completion_ids]


class Timed(TrainerCallback):
    """Each training step's wall-clock interval [begin, end] (to set against the rollouts' timeline)."""

    def __init__(self):
        self.steps: dict[int, list[float]] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps[state.global_step + 1] = [time.time(), None]

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step][1] = time.time()


class KillActor(TrainerCallback):
    """SIGKILLs rollout actor `index` (its process) at the end of step `step` (the work goes round the actors: its
    next turn finds it dead, or it dies holding groups)."""

    def __init__(self, trainer, step: int, index: int = 1):
        self.trainer, self.step, self.index, self.killed = trainer, step, index, None

    def on_step_end(self, args, state, control, **kwargs):
        import os
        import signal

        if state.global_step == self.step:
            self.killed = self.trainer._rollouts.pool.pids()[self.index]
            os.kill(self.killed, signal.SIGKILL)


def trainer(out: str, workers: int = 0, callbacks=(), model=None, reward=None, **kw):
    from examples.grpo import build_datasets
    from examples.sft import build_model
    from raytrain.trl import AsyncGRPOConfig, AsyncGRPOTrainer

    data = build_datasets(16, 4)
    args = AsyncGRPOConfig(output_dir=out, rollout={"num_workers": workers, "num_cpus_per_worker": 0.5},
                           **{**RUN, **kw})
    return AsyncGRPOTrainer(model if model is not None else build_model(), reward_funcs=[reward or low_ids], args=args,
                            train_dataset=data["train"], processing_class=data["processing_class"],
                            eval_dataset=data["eval"], callbacks=list(callbacks))


def steps(trainer_or_log) -> list[dict]:
    """The logged training steps without the timings (perf/...) that differ run to run, and the epoch (TRL's
    ignore_data_skip: a resumed run counts its epoch from the resume, as HF's Trainer does)."""
    log = trainer_or_log if isinstance(trainer_or_log, list) else trainer_or_log.state.log_history
    return [{k: v for k, v in e.items() if not k.startswith("perf/") and k not in ("step_time", "epoch")}
            for e in log if "loss" in e]


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def killed_main(out: str, workers: int) -> None:
    """The run the driver-SIGKILL test kills at a save: checkpoints every 4 steps, on `workers` rollout actors of
    the cluster RAY_ADDRESS names."""
    trainer(out, workers=workers, save_strategy="steps", save_steps=4).train()


BACKENDS = {"ddp": {"strategy": "ddp"},
            "fsdp2": {"strategy": "fsdp", "fsdp": {"wrap_classes": ["LlamaDecoderLayer"]}},
            "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 3}}}}


#: rollout actors per backend's run: the two-actor pool once (an actor's start costs several CPU-seconds here)
ACTORS = {"ddp": 2, "fsdp2": 1, "zero3": 1}


def worker_cases(root: str) -> dict:
    """On the driver: each backend's trainer (2 workers, half the per-device batch; ACTORS rollout actors) shipped
    as a Ray run ships it (tests/group.py)."""
    import os

    from tests.group import ship

    return {name: ship(trainer(os.path.join(root, name), workers=ACTORS[name], per_device_train_batch_size=2,
                               scaling={"num_workers": 2}, distributed=backend), name)
            for name, backend in BACKENDS.items()}


class KillOnce(TrainerCallback):
    """SIGKILLs this process at the end of step `step` on rank `rank`, once (a flag file marks it done)."""

    def __init__(self, rank: int, step: int, flag: str):
        self.rank, self.step, self.flag = rank, step, flag

    def on_step_end(self, args, state, control, **kwargs):
        import os
        import signal

        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        if state.global_step == self.step and rank == self.rank and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


class PauseAt(TrainerCallback):
    """At the end of step `step`: writes `flag`, then waits until `go` exists (the test acts on the cluster)."""

    def __init__(self, step: int, flag: str, go: str):
        self.step, self.flag, self.go = step, flag, go

    def on_step_end(self, args, state, control, **kwargs):
        import os

        if state.global_step == self.step:
            open(self.flag, "w").close()
            while not os.path.exists(self.go):
                time.sleep(0.2)


def on_cluster_main(out: str, flag: str, go: str, result: str) -> None:
    """The driver of the node-loss run: 2 rollout actors on the cluster's `spot` nodes, a pause after step 4 (the
    test loses their node, then adds another); the logged steps and final weights to `result`."""
    import torch

    t = trainer(out, workers=2, callbacks=[PauseAt(4, flag, go)])
    t.args.rollout.resources_per_worker = {"spot": 0.5}
    t.train()
    torch.save({"steps": steps(t), "weights": weights(t.model), "restarts": t.rollout_restarts}, result)
