"""Checkpoint cost: save throughput, step time with checkpoints (sync / async), resume time vs step.

    python benchmarks/checkpoint.py [--mb 64] [--steps 30] [--reps 7] [--resume-at 10000] [--threads 1]

Prints, each against a reference measured in the same run:
  (a) save throughput of raytrain's atomic, hashed, fsynced checkpoint against a bare
      safetensors.torch.save_file of the same state dict (target >= 0.8x); also the throughput
      of a full checkpoint (weights + AdamW state + the small files) in bytes per second; best of N;
  (b) median (the target: <= 1.05x with async) and mean step time with a checkpoint every 10 steps
      against none, synchronous and save_async; runs interleaved A B C C B A;
  (c) time from train(resume_from_checkpoint=...) to the start of the first resumed step (verified,
      restored, data stream positioned, first batch read), at step 10
      against step 10,000 (target <= 1.1x), for a tiny model (where only fixed costs remain) and the
      benchmark model. The step-10,000 checkpoint is written directly from the step-10 one (counters,
      data position, schedule, a log_history of 1,000 entries), not trained.
Timings never decide a test; on a shared machine, rerun for stable figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import save, save_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from raytrain import checkpoint as ckpt  # noqa: E402


class MLP(nn.Module):
    def __init__(self, width: int, layers: int, d_in: int = 64, classes: int = 10):
        super().__init__()
        dims = [d_in] + [width] * layers
        self.body = nn.Sequential(*[m for a, b in zip(dims, dims[1:]) for m in (nn.Linear(a, b), nn.GELU())])
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def big_mlp(mb: int) -> MLP:
    """An MLP of width 2048 with about `mb` MiB of float32 weights (16 MiB per hidden layer)."""
    return MLP(2048, max(1, round(mb * 2**20 / (4 * 2048 * 2048))) + 1)


def data(n: int, d_in: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, d_in, generator=g), "labels": torch.randint(0, 10, (n,), generator=g)}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def quiet(trainer: Trainer) -> Trainer:
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ not in ("PrinterCallback", "ProgressCallback")]
    return trainer


# ---------------------------------------------------------------- (a) save throughput


def bench_save(mb: int, reps: int, tmp: str) -> dict:
    model = big_mlp(mb)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters())
    model(**{k: v[:2] for k, v in data(2).items()})["loss"].backward()
    opt.step()
    opt_state = opt.state_dict()
    bare, ours, full = [], [], []
    for i in range(reps):  # interleaved, so drift on a shared machine hits every side alike
        path = os.path.join(tmp, "bare.safetensors")
        t = time.perf_counter()
        save_file(state, path, metadata={"format": "pt"})
        bare.append(time.perf_counter() - t)
        os.remove(path)

        writer = ckpt.CheckpointWriter(os.path.join(tmp, "w"))
        os.makedirs(writer.output_dir, exist_ok=True)
        t = time.perf_counter()
        writer.save(i, ckpt.CheckpointPayload(weights=state))
        ours.append(time.perf_counter() - t)

        t = time.perf_counter()
        writer.save(100 + i, ckpt.CheckpointPayload(weights=state, pickles={"optimizer.pt": opt_state,
                                                                            "scheduler.pt": {"last_epoch": i}},
                                                    jsons={"trainer_state.json": {"global_step": i}}))
        full.append(time.perf_counter() - t)
        full_bytes = sum(os.path.getsize(os.path.join(writer.output_dir, f"checkpoint-{100 + i}", f))
                         for f in os.listdir(os.path.join(writer.output_dir, f"checkpoint-{100 + i}")))
        shutil.rmtree(writer.output_dir)
    raw = save(state)
    sha = []
    for _ in range(reps):
        t = time.perf_counter()
        hashlib.sha256(raw).hexdigest()
        sha.append(time.perf_counter() - t)
    size = nbytes(state)
    b, o, f = min(bare), min(ours), min(full)  # best of N: the run least disturbed by other load
    return {"weights_mb": size / 2**20, "bare_mb_s": size / b / 2**20, "ours_mb_s": size / o / 2**20,
            "full_mb": full_bytes / 2**20, "full_mb_s": full_bytes / f / 2**20,
            "sha_mb_s": len(raw) / min(sha) / 2**20}


# ---------------------------------------------------------------- (b) step time with checkpoints


class StepTimer(TrainerCallback):
    """Wall and main-thread CPU time between consecutive step ends: the step itself plus any save
    that follows it. CPU time is what the training thread spent, whatever else loads the machine."""

    def __init__(self):
        self.marks: list[tuple[float, float]] = []

    def on_step_end(self, args, state, control, **kw):
        self.marks.append((time.perf_counter(), time.thread_time()))

    def intervals(self, skip: int) -> tuple[list[float], list[float]]:
        pairs = list(zip(self.marks, self.marks[1:]))[skip:]
        return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def run_steps(mb: int, steps: int, tmp: str, mode: str) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    timer = StepTimer()
    out = os.path.join(tmp, f"steps-{mode}")
    args = TrainingArguments(output_dir=out, max_steps=steps + 1, per_device_train_batch_size=8,
                             learning_rate=1e-4, logging_steps=10**9, disable_tqdm=True,
                             save_strategy="no" if mode == "none" else "steps", save_steps=10,
                             save_async=mode == "async", overwrite_output_dir=True)
    trainer = quiet(Trainer(big_mlp(mb), args, train_dataset=data(8 * (steps + 1)), callbacks=[timer]))
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)
    # the final step's save (and the wait for it) comes after its step end: not an interval; the first
    # interval (warm-up) is dropped; the rest hold saves after steps 10, 20, ...
    return timer.intervals(skip=1)


def bench_steps(mb: int, steps: int, tmp: str) -> dict:
    wall: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    cpu: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    for mode in ("none", "sync", "async", "async", "sync", "none"):  # A B C C B A
        w, c = run_steps(mb, steps, tmp, mode)
        wall[mode] += w
        cpu[mode] += c
    return {m: {"median": statistics.median(wall[m]), "mean": statistics.fmean(wall[m]),
                "cpu_median": statistics.median(cpu[m]), "cpu_mean": statistics.fmean(cpu[m])} for m in wall}


# ---------------------------------------------------------------- (c) resume time


class FirstStep(TrainerCallback):
    """Stops the run `after` steps of this run; keeps when the first step began (its batch fetched)."""

    def __init__(self):
        self.at, self.after, self.seen = None, 1, 0

    def on_step_begin(self, args, state, control, **kw):
        if self.at is None:
            self.at = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.seen += 1
        if self.seen >= self.after:
            control.should_training_stop = True


def forge_late_checkpoint(early: str, late: int, steps_per_epoch: int, logging_steps: int) -> str:
    """checkpoint-{late} written directly from checkpoint-10 (training 10,000 steps would dominate the
    run): the same weights and RNG streams, with the step counters, data position, optimizer step
    count, schedule position and a log_history of one entry per logging step that a run of `late`
    steps holds. It goes through CheckpointWriter, so its manifest and checksums are genuine."""
    load_json = lambda name: json.load(open(os.path.join(early, name)))  # noqa: E731
    trainer_state, data_state, loop_state = (load_json(n) for n in ("trainer_state.json", "data_state.json",
                                                                     "loop_state.json"))
    entry = trainer_state["log_history"][-1]
    trainer_state["log_history"] = [{**entry, "step": s, "epoch": s / steps_per_epoch}
                                    for s in range(logging_steps, late + 1, logging_steps)]
    trainer_state.update(global_step=late, epoch=late / steps_per_epoch)
    data_state.update(global_step=late, epoch=late // steps_per_epoch, next_batch=late % steps_per_epoch)
    loop_state.update(last_logged=late)
    optim = ckpt.load_pickle(os.path.join(early, "optimizer.pt"))
    for st in optim["state"].values():
        st["step"] = torch.tensor(float(late))
    sched = ckpt.load_pickle(os.path.join(early, "scheduler.pt"))
    sched.update(last_epoch=late, _step_count=late + 1)
    payload = ckpt.CheckpointPayload(
        weights=ckpt.load_weights(early),
        pickles={"optimizer.pt": optim, "scheduler.pt": sched,
                 "rng_state.pth": ckpt.load_pickle(os.path.join(early, "rng_state.pth"))},
        jsons={"trainer_state.json": trainer_state, "data_state.json": data_state, "loop_state.json": loop_state,
               "training_args.json": load_json("training_args.json")})
    return ckpt.CheckpointWriter(os.path.dirname(early)).save(late, payload)


def bench_resume(late: int, tmp: str, reps: int, make_model) -> dict:
    out = os.path.join(tmp, "resume")
    kw = dict(output_dir=out, max_steps=late + 10, per_device_train_batch_size=8, learning_rate=1e-3,
              logging_steps=10, disable_tqdm=True, save_strategy="steps", save_steps=10)
    torch.manual_seed(0)
    train_set = data(400)  # 50 batches an epoch: step 10,000 is in epoch 200
    stop = FirstStep()
    stop.after = 10
    quiet(Trainer(make_model(), TrainingArguments(**kw), train_dataset=train_set, callbacks=[stop])).train()
    forge_late_checkpoint(os.path.join(out, "checkpoint-10"), late, steps_per_epoch=50, logging_steps=10)
    times: dict[int, list[float]] = {10: [], late: []}
    for step in [10, late] * reps:  # alternating
        first = FirstStep()
        trainer = quiet(Trainer(make_model(), TrainingArguments(**{**kw, "save_strategy": "no"}),
                                train_dataset=train_set, callbacks=[first]))
        t = time.perf_counter()
        trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{step}"))
        assert trainer.state.global_step == step + 1
        times[step].append(first.at - t)
    size = os.path.getsize(os.path.join(out, "checkpoint-10", "model.safetensors"))
    shutil.rmtree(out)
    return {"early": min(times[10]), "late": min(times[late]), "weights_mb": size / 2**20,
            "early_med": statistics.median(times[10]), "late_med": statistics.median(times[late])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64, help="model size in MiB of float32 weights")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run in (b)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--resume-at", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 1 leaves the other cores to the background writer, as a GPU "
                        "job leaves its CPU cores, and keeps step times steady on a shared machine")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    start = time.perf_counter()
    print(f"machine: {platform.platform()} cpus={os.cpu_count()} torch={torch.__version__} "
          f"python={platform.python_version()} torch_threads={a.threads}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("RAYTRAIN_BENCH_DIR")) as tmp:
        s = bench_save(a.mb, a.reps, tmp)
        st = bench_steps(a.mb, a.steps, tmp)
        resumes = [bench_resume(a.resume_at, tmp, a.reps, lambda: MLP(32, 2)),
                   bench_resume(a.resume_at, tmp, a.reps, lambda: big_mlp(a.mb))]
    rows = [
        ("(a) save: checkpoint vs bare save_file",
         f"{s['ours_mb_s']:.0f} vs {s['bare_mb_s']:.0f} MB/s ({s['weights_mb']:.0f} MB weights)",
         s["ours_mb_s"] / s["bare_mb_s"], ">= 0.8x"),
        ("(a) save: full checkpoint vs bare save_file",
         f"{s['full_mb_s']:.0f} vs {s['bare_mb_s']:.0f} MB/s ({s['full_mb']:.0f} MB with AdamW)",
         s["full_mb_s"] / s["bare_mb_s"], "(info)"),
        ("(a) sha256 alone (in memory) vs bare save_file", f"{s['sha_mb_s']:.0f} vs {s['bare_mb_s']:.0f} MB/s",
         s["sha_mb_s"] / s["bare_mb_s"], "(the ceiling of a hashed save on 1 core)"),
    ]
    none = st["none"]
    for mode in ("sync", "async"):
        m = st[mode]
        rows.append((f"(b) median step, ckpt/10 steps, {mode}", f"{m['median'] * 1e3:.1f} vs {none['median'] * 1e3:.1f} ms",
                     m["median"] / none["median"], "<= 1.05x" if mode == "async" else "(info)"))
        rows.append((f"(b) mean step, ckpt/10 steps, {mode}", f"{m['mean'] * 1e3:.1f} vs {none['mean'] * 1e3:.1f} ms",
                     m["mean"] / none["mean"], "(info)"))
        rows.append((f"(b) mean main-thread CPU/step, {mode}",
                     f"{m['cpu_mean'] * 1e3:.1f} vs {none['cpu_mean'] * 1e3:.1f} ms", m["cpu_mean"] / none["cpu_mean"],
                     "(info)"))
    for r in resumes:
        label = f"{r['weights_mb']:.2f} MB" if r["weights_mb"] < 1 else f"{r['weights_mb']:.0f} MB"
        rows.append((f"(c) resume at {a.resume_at} vs 10, {label} model",
                     f"{r['late'] * 1e3:.1f} vs {r['early'] * 1e3:.1f} ms (median {r['late_med'] * 1e3:.1f} vs "
                     f"{r['early_med'] * 1e3:.1f})", r["late"] / r["early"], "<= 1.1x"))
    print(f"{'measure':<48} {'figures':<46} {'ratio':>7}  target")
    for name, figures, ratio, target in rows:
        print(f"{name:<48} {figures:<46} {ratio:>6.2f}x  {target}")
    print(f"(a): best of {a.reps}; (b): {a.steps} steps x 2 runs per mode, interleaved; (c): best of {a.reps} resumes each, "
          f"alternating; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
