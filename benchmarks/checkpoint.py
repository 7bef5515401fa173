"""Checkpoint cost: save throughput, step time with async checkpoints, load + verify, resume time.

    python benchmarks/checkpoint.py [--mb 64] [--steps 20] [--rounds 4] [--reps 7] [--resume-at 10000] [--parts a,b,c,e]

Prints, each against a reference measured in the same run, the order of the two alternated over rounds:
  (a) save throughput of raytrain's atomic, checksummed, fsynced checkpoint of the weights against a
      bare safetensors.torch.save_file of the same state dict (target >= 0.8x); with the limits beside
      it: writing the same bytes into the page cache, with and without fsync, and the checksums
      (xxh3_128, blake3, sha256) in memory; also a full checkpoint (weights + AdamW state + small files);
  (b) median (target <= 1.05x) and mean step time with an async checkpoint every 10 steps against
      none (sync for comparison), and the main thread's CPU time per step (what the step itself pays,
      whatever else loads the machine); runs of the three modes rotated over rounds;
  (c) load + verify: load_weights checksumming the bytes as it reads them + load_state_dict against a bare
      safetensors load_file + load_state_dict (load_file maps the file lazily: the copy into the
      model is where its bytes are read) (target >= 0.8x); also a whole checkpoint with AdamW state;
  (e) time from train(resume_from_checkpoint=...) to the first resumed step at step 10,000 against
      step 10 (target <= 1.1x), for a tiny model and the benchmark model (--resume-at 0 skips it).
Timings never decide a test; on a shared machine, rerun for stable figures.

On CPU, glibc returns large freed blocks to the kernel and the next step faults them in again (tens of
thousands of page faults per step for this model), which moves step times by 30% from run to run and
from one heap layout to the next. For (b), run it also with a steady heap, where what is left is the
checkpoint's own cost: MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 python ...
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
from safetensors.torch import load_file, save, save_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from raytrain.checkpoint import store as ckpt  # noqa: E402
from raytrain.checkpoint import io as checkpoint_io  # noqa: E402


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


# ---------------------------------------------------------------- (a) save throughput, (c) load + verify


def trained_state(mb: int):
    """The model, its weights and a stepped AdamW's state (exp_avg, exp_avg_sq: twice the weights)."""
    model = big_mlp(mb)
    opt = torch.optim.AdamW(model.parameters())
    model(**{k: v[:2] for k, v in data(2).items()})["loss"].backward()
    opt.step()
    return model, {k: v.detach() for k, v in model.state_dict().items()}, opt.state_dict()


def alternate(reps: int, fns: dict) -> dict[str, list[float]]:
    """Run every fn `reps` times, rotating their order each round; seconds per run."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            cleanup = fns[name]()
            times[name].append(time.perf_counter() - t)
            if callable(cleanup):  # deleting what was written is not part of the timing
                cleanup()
    return times


def bench_save(mb: int, reps: int, tmp: str) -> dict:
    model, state, opt_state = trained_state(mb)
    out = os.path.join(tmp, "w")
    os.makedirs(out)
    writer = ckpt.CheckpointWriter(out)
    steps = iter(range(10**6))
    raw = save(state)
    full_bytes = []

    def bare():
        path = os.path.join(tmp, "bare.safetensors")
        save_file(state, path, metadata={"format": "pt"})
        return lambda: os.remove(path)

    def ours():
        path = writer.save(next(steps), ckpt.CheckpointPayload(weights=state))
        return lambda: shutil.rmtree(path)

    def full():
        path = writer.save(next(steps), ckpt.CheckpointPayload(
            weights=state, pickles={"optimizer.pt": opt_state, "scheduler.pt": {"last_epoch": 1}},
            jsons={"trainer_state.json": {"global_step": 1}}))
        full_bytes.append(sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)))
        return lambda: shutil.rmtree(path)

    def page_cache(sync: bool):
        def write():
            path = os.path.join(tmp, "raw")
            with open(path, "wb") as f:
                f.write(raw)
                if sync:
                    os.fsync(f.fileno())
            return lambda: os.remove(path)
        return write

    t = alternate(reps, {"bare": bare, "ours": ours, "full": full, "write": page_cache(False),
                         "write_fsync": page_cache(True)})
    writer.close()
    hashes = alternate(reps, {"xxh3_128": lambda: checkpoint_io.ALGORITHMS["xxh3_128"](raw).digest(),
                              "sha256": lambda: hashlib.sha256(raw).digest(), **_blake3(raw)})
    size = nbytes(state)
    out = {"weights_mb": size / 2**20, "full_mb": full_bytes[0] / 2**20}
    for name, ts in {**t, **hashes}.items():
        n = full_bytes[0] if name == "full" else size
        out[name] = n / min(ts) / 2**20  # best of N: the run least disturbed by other load
        out[name + "_med"] = n / statistics.median(ts) / 2**20
    return out


def _blake3(raw: bytes) -> dict:
    try:
        import blake3
    except ImportError:
        return {}
    return {"blake3": lambda: blake3.blake3(raw).digest()}


def bench_load(mb: int, reps: int, tmp: str) -> dict:
    model, state, opt_state = trained_state(mb)
    opt = torch.optim.AdamW(model.parameters())
    out = os.path.join(tmp, "load")
    os.makedirs(out)
    path = ckpt.CheckpointWriter(out).save(1, ckpt.CheckpointPayload(
        weights=state, pickles={"optimizer.pt": opt_state}, jsons={"trainer_state.json": {"global_step": 1}}))
    weights_file, opt_file = os.path.join(path, ckpt.WEIGHTS), os.path.join(path, "optimizer.pt")

    # What resume does: the manifest, the other files' sizes and checksums, then the weights checksummed
    # as they are read (one pass over their bytes), all before anything is applied.
    fns = {
        "bare": lambda: model.load_state_dict(load_file(weights_file)),
        "ours": lambda: model.load_state_dict(ckpt.load_weights(path, ckpt.read_manifest(path))),
        "bare_full": lambda: (model.load_state_dict(load_file(weights_file)),
                              opt.load_state_dict(torch.load(opt_file, weights_only=True))),
        "ours_full": lambda: (model.load_state_dict(ckpt.load_weights(
                                  path, ckpt.verify_checkpoint(path, weights_on_load=True))),
                              opt.load_state_dict(ckpt.load_pickle(opt_file))),
    }
    t = alternate(reps, fns)
    shutil.rmtree(out)
    return {k: min(v) for k, v in t.items()} | {k + "_med": statistics.median(v) for k, v in t.items()}


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


def bench_steps(mb: int, steps: int, rounds: int, tmp: str) -> dict:
    """`rounds` runs per mode, the order of the three rotated each round, so drift hits all alike."""
    wall: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    cpu: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    modes = ["none", "async", "sync"]
    for i in range(rounds):
        for mode in modes[i % 3:] + modes[:i % 3]:
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
    p.add_argument("--steps", type=int, default=20, help="timed steps per run in (b)")
    p.add_argument("--rounds", type=int, default=4, help="runs per mode in (b)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--resume-at", type=int, default=10_000)
    p.add_argument("--parts", default="a,b,c,e", help="which measurements to run")
    p.add_argument("--page-cache", action="store_true",
                   help="write checkpoints through the page cache instead of O_DIRECT (for comparison)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 1 leaves the other cores to the background writer, as a GPU "
                        "job leaves its CPU cores, and keeps step times steady on a shared machine")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    torch.set_num_threads(a.threads)
    if a.page_cache:
        checkpoint_io._DIRECT_MIN = 1 << 62
    start = time.perf_counter()
    print(f"machine: {platform.platform()} cpus={os.cpu_count()} torch={torch.__version__} "
          f"python={platform.python_version()} torch_threads={a.threads} "
          f"writes={'page cache' if a.page_cache else 'O_DIRECT where allowed'} "
          f"malloc={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')} load_avg={os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("RAYTRAIN_BENCH_DIR")) as tmp:
        if "a" in parts:
            s = bench_save(a.mb, a.reps, tmp)
            ref = f"{s['bare']:.0f} MB/s bare save_file"
            rows.append(("(a) save: checkpoint (weights) vs bare save_file",
                         f"{s['ours']:.0f} vs {ref} ({s['weights_mb']:.0f} MB)", s["ours"] / s["bare"],
                         s["ours_med"] / s["bare_med"], ">= 0.8x"))
            rows.append(("(a) save: full checkpoint (+AdamW) vs bare",
                         f"{s['full']:.0f} vs {ref} ({s['full_mb']:.0f} MB)", s["full"] / s["bare"],
                         s["full_med"] / s["bare_med"], "(info)"))
            for name, what in (("write", "limit: write() into the page cache"),
                               ("write_fsync", "limit: write() + fsync"),
                               ("xxh3_128", "checksum xxh3_128 in memory (used)"),
                               ("blake3", "checksum blake3 in memory"), ("sha256", "checksum sha256 in memory")):
                if name in s:
                    rows.append((f"(a) {what}", f"{s[name]:.0f} vs {ref}", s[name] / s["bare"],
                                 s[name + "_med"] / s["bare_med"], "(info)"))
        if "b" in parts:
            st = bench_steps(a.mb, a.steps, a.rounds, tmp)
            none = st["none"]
            for mode in ("sync", "async"):
                m = st[mode]
                rows.append((f"(b) median step, ckpt/10 steps, {mode}",
                             f"{m['median'] * 1e3:.1f} vs {none['median'] * 1e3:.1f} ms (none)",
                             m["median"] / none["median"], None, "<= 1.05x" if mode == "async" else "(info)"))
                rows.append((f"(b) mean step, ckpt/10 steps, {mode}",
                             f"{m['mean'] * 1e3:.1f} vs {none['mean'] * 1e3:.1f} ms (none)",
                             m["mean"] / none["mean"], None, "(info)"))
                rows.append((f"(b) median main-thread CPU/step, {mode}",
                             f"{m['cpu_median'] * 1e3:.1f} vs {none['cpu_median'] * 1e3:.1f} ms (none)",
                             m["cpu_median"] / none["cpu_median"], None, "(info: the step's own cost)"))
        if "c" in parts:
            ld = bench_load(a.mb, a.reps, tmp)
            rows.append(("(c) load+verify weights vs bare load_file",
                         f"{ld['ours'] * 1e3:.1f} vs {ld['bare'] * 1e3:.1f} ms", ld["bare"] / ld["ours"],
                         ld["bare_med"] / ld["ours_med"], ">= 0.8x"))
            rows.append(("(c) load+verify with AdamW state vs bare",
                         f"{ld['ours_full'] * 1e3:.1f} vs {ld['bare_full'] * 1e3:.1f} ms",
                         ld["bare_full"] / ld["ours_full"], ld["bare_full_med"] / ld["ours_full_med"], "(info)"))
        if "e" in parts and a.resume_at:
            for make in (lambda: MLP(32, 2), lambda: big_mlp(a.mb)):
                r = bench_resume(a.resume_at, tmp, a.reps, make)
                label = f"{r['weights_mb']:.2f} MB" if r["weights_mb"] < 1 else f"{r['weights_mb']:.0f} MB"
                rows.append((f"(e) resume at {a.resume_at} vs 10, {label} model",
                             f"{r['late'] * 1e3:.1f} vs {r['early'] * 1e3:.1f} ms", r["late"] / r["early"],
                             r["late_med"] / r["early_med"], "<= 1.1x"))
    print(f"{'measure':<50} {'figures':<44} {'best':>6} {'median':>7}  target")
    for name, figures, ratio, med, target in rows:
        med_s = f"{med:.2f}x" if med is not None else ""
        print(f"{name:<50} {figures:<44} {ratio:>5.2f}x {med_s:>7}  {target}")
    print(f"ratios: throughput ours/reference ((a), (c): >1 is faster), time ours/reference ((b), (e)); "
          f"best and median of {a.reps} alternated rounds; (b): {a.steps} steps x {a.rounds} rotated runs per mode; "
          f"load_avg at end {os.getloadavg()[0]:.2f}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
