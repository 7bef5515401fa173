"""Shared by the distributed tests: the digits job, a probe of every rank's weights, fault injection.

Importable as `tests.strategies._helpers` on the driver and on Ray workers (PYTHONPATH is the repo root),
so the callbacks below travel to the workers by reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

from raytrain import TrainerCallback, TrainingArguments


def digits_args(output_dir: str, storage: str | None = None, **overrides) -> TrainingArguments:
    """A short digits run: 30 steps of a global batch of 32, logs every 5, checkpoints every 10."""
    base = dict(output_dir=output_dir, max_steps=30, per_device_train_batch_size=16, learning_rate=3e-3,
                logging_steps=5, save_steps=10, seed=7, disable_tqdm=True, report_to="none",
                scaling={"num_workers": 2, "storage_path": storage},
                distributed={"strategy": "ddp"})
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return TrainingArguments(**base)


def digits_model(seed: int = 0):
    """The digits MLP without dropout (so that runs on 1 and 2 workers do the same maths)."""
    from examples.digits import build_model

    torch.manual_seed(seed)
    return build_model(hidden_size=64, dropout=0.0)


def state_digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def full_weights(model) -> dict:
    """This rank's view of the full weights, gathered by hand whatever the backend (not through the
    strategy under test): DTensor shards (FSDP2), ZeRO-3 partitions, or plain replicas."""
    module = getattr(model, "module", model)
    params = dict(module.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: v.detach().clone().float().cpu() for k, v in module.state_dict().items()}
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().clone().float().cpu()
    return out


class WeightsProbe(TrainerCallback):
    """At train end, every rank writes a digest of its own full weights to probe-rank{R}.json."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        rank = int(os.environ.get("RANK", 0))
        digest = state_digest(full_weights(model))
        with open(os.path.join(args.output_dir, f"probe-rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "digest": digest, "step": state.global_step}, f)


class FaultInjector(TrainerCallback):
    """Sends `sig` to this process on `rank` after `step` (once: a marker file remembers), and appends
    the step every attempt starts from to starts.txt. `after`: a path under output_dir that must exist
    first (a background save's checkpoint committed, however slow the machine)."""

    def __init__(self, rank: int, step: int, sig: int = signal.SIGKILL, record_starts: bool = True,
                 after: str | None = None):
        self.rank, self.step, self.sig, self.record_starts, self.after = rank, step, sig, record_starts, after

    def on_train_begin(self, args, state, control, **kwargs):
        if self.record_starts and int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(args.output_dir, "starts.txt"), "a") as f:
                f.write(f"{state.global_step}\n")

    def on_step_end(self, args, state, control, **kwargs):
        marker = os.path.join(args.output_dir, f"fault-{self.sig}.done")
        if int(os.environ.get("RANK", 0)) == self.rank and state.global_step == self.step \
                and not os.path.exists(marker):
            deadline = time.time() + 120
            while self.after and not os.path.exists(os.path.join(args.output_dir, self.after)) \
                    and time.time() < deadline:
                time.sleep(0.1)
            open(marker, "w").close()
            os.kill(os.getpid(), self.sig)


def run_backends(config: dict) -> dict:
    """A Ray Train worker function: several short digits runs, one per backend, in one worker group
    (a TorchTrainer start costs ~25 s here, a run a few seconds). Rank 0 returns, per run, its logged
    losses, final step and the error message if it failed."""
    from examples.digits import build_datasets
    from raytrain import Trainer
    from raytrain.worker import loop

    train, _ = build_datasets()
    results = {}
    for run in config["runs"]:
        args = digits_args(run["output_dir"], **run.get("args", {}))
        trainer = Trainer(digits_model(), args, train_dataset=train, callbacks=[WeightsProbe()])
        try:
            out = loop.train(trainer, run.get("resume"))
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            results[run["name"]] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results[run["name"]] = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                                "global_step": out.global_step}
        if "deepspeed" in sys.modules:  # its communication backend, once a ZeRO run started it
            from deepspeed.comm import comm as ds_comm

            if ds_comm.cdb is not None:
                results[run["name"]]["shm_kernel"] = getattr(ds_comm.cdb, "shm_comm_op", None) is not None
    return results if int(os.environ.get("RANK", 0)) == 0 else None


class PreemptionNotice(TrainerCallback):
    """Simulates Ray's notice that rank 1's node is being drained, `seconds` ahead, after `step` (once:
    a marker file per rank): every rank's train context gets what Ray's PreemptionWatcher gives it
    through Worker.mark_preempt, and from there on everything is Ray's own (the workers' status
    polls, the controller's PreemptingState, its PreemptionError at the deadline). Rank 0 appends the
    step every attempt starts from to starts.txt. Notices are asked for at every step here."""

    def __init__(self, step: int, seconds: float = 10.0):
        self.step, self.seconds = step, seconds

    def on_train_begin(self, args, state, control, **kwargs):
        os.environ["RAYTRAIN_PREEMPTION_POLL_S"] = "0"  # read by preemption.PreemptionCallback after this
        if int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(args.output_dir, "starts.txt"), "a") as f:
                f.write(f"{state.global_step}\n")

    def on_step_end(self, args, state, control, **kwargs):
        import time

        import ray
        from ray.train import PreemptionInfo
        from ray.train.v2._internal.execution.context import get_train_context

        marker = os.path.join(args.output_dir, f"notice-rank{os.environ.get('RANK', 0)}.done")
        if state.global_step != self.step or os.path.exists(marker):
            return
        open(marker, "w").close()
        info = PreemptionInfo(deadline_ms=int((time.time() + self.seconds) * 1000),
                              preempted_node_to_ranks={ray.get_runtime_context().get_node_id(): [1]})
        get_train_context().preemption_context.preemption_info = info
