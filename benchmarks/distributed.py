"""Distributed checkpoints and recovery on Ray: what a save costs the step, what a lost node costs the run.

    python benchmarks/distributed.py [--mb 32] [--steps 40] [--rounds 2] [--parts saves,recovery,elastic,layouts]
                                     [--strategies ddp,fsdp,deepspeed] [--hidden 256] [--layouts dp4,2x2,...,sp1,sp4]
                                     [--seq 2048] [--sp-strategy deepspeed] [--health-checks default,fast]

  saves:    2 Ray workers (DDP, FSDP2, ZeRO-2), a checkpoint every 10 steps, synchronous and in the
            background (save_async), against none: median and mean step time (rank 0, step end to step
            end; a step that saves carries its save), the order of the three modes rotated over
            rounds, on one local Ray cluster (target: median <= 1.05x).
  recovery: the simulated cluster of tests/driver/cluster.py (a head and two worker nodes with their
            own disks, needs root): rank 1's node is lost after step 12 of the digits job and a new
            node joins once the GCS has noticed; prints the seconds from the loss to the first step the
            restarted group ends, against the seconds from the driver's start to the first step of a
            fresh run. Once per --health-checks setting, in one invocation: Ray's default (the GCS
            notices a lost node in ~15 s) and fast (tests/driver/cluster.py's, ~2 s).
  layouts:  4 gloo processes (no Ray), a Llama from a config (--hidden): dp4 (FSDP2), 2x2 (FSDP2 x TP),
            tp4, pp2 x dp2, pp2 x tp2 and pp4 (pipeline stages, 1F1B), and 2x2x2 (pp x dp x tp on 8
            processes) at the same global batch: median step time (rank 0; the best of --rounds rounds,
            the layouts' order rotated, on a shared machine) and, per rank (the largest), the bytes of
            its parameters, gradients and AdamW state (local shards) and its peak RSS. sp1, sp2 and sp4 (4
            processes, --sp-strategy, ZeRO-2 by default: HF's ALST) train one --seq-token sequence per
            sequence group and step (sp1: plain data parallel, a sequence per rank; sp4: one sequence split
            4 ways), measured against sp1: the same, and the peak RSS over the start of training.
  elastic:  the same with num_workers [1, 2] and no node replacing the lost one: the seconds from the
            loss to the first step of the one worker left (target: <= 20 s on Ray's default health
            checks), against a fresh run's.
Timings never decide a test; on a shared machine, rerun for stable figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.driver.cluster import SimCluster, StepMarks  # noqa: E402


def _marks(path: str) -> list[list[float]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------- saves


def _saves_run(tmp: str, strategy: str, mode: str, mb: int, steps: int) -> list[float]:
    from benchmarks.checkpoint import big_mlp, data
    from raytrain import Trainer, TrainingArguments

    marks = os.path.join(tmp, f"{strategy}-{mode}.marks")
    if os.path.exists(marks):
        os.remove(marks)
    out = os.path.join(tmp, f"{strategy}-{mode}")
    args = TrainingArguments(output_dir=out, max_steps=steps + 1, per_device_train_batch_size=8, learning_rate=1e-4,
                             logging_steps=10**6, disable_tqdm=True, report_to="none", overwrite_output_dir=True,
                             save_strategy="no" if mode == "none" else "steps", save_steps=10,
                             save_async=mode == "async",
                             scaling={"num_workers": 2, "storage_path": os.path.join(tmp, "ray")},
                             distributed={"strategy": strategy})
    torch.manual_seed(0)
    Trainer(big_mlp(mb), args, train_dataset=data(16 * (steps + 1)), callbacks=[StepMarks(marks)]).train()
    shutil.rmtree(out, ignore_errors=True)
    times = [m[1] for m in _marks(marks)]
    return [b - a for a, b in zip(times, times[1:])][1:]  # the first interval is warm-up


def bench_saves(tmp: str, mb: int, steps: int, rounds: int, strategies: list[str]) -> dict:
    out = {}
    for strategy in strategies:
        got: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        modes = list(got)
        for i in range(rounds):  # the order of the three rotated each round
            for mode in modes[i % 3:] + modes[:i % 3]:
                got[mode] += _saves_run(tmp, strategy, mode, mb, steps)
        out[strategy] = {m: {"median": statistics.median(v), "mean": statistics.fmean(v)} for m, v in got.items()}
    return out


# ---------------------------------------------------------------- layouts

LAYOUTS = {"dp4": {"dp_shard_size": 4}, "2x2": {"dp_shard_size": 2, "tp_size": 2}, "tp4": {"tp_size": 4},
           "pp2xdp2": {"pp_size": 2, "dp_shard_size": 2}, "pp2xtp2": {"pp_size": 2, "tp_size": 2},
           "pp4": {"pp_size": 4}, "2x2x2": {"pp_size": 2, "dp_shard_size": 2, "tp_size": 2}}


SEQ_LAYOUTS = {"sp1": {"dp_shard_size": 4}, "sp2": {"dp_shard_size": 2, "sp_size": 2, "sp_backend": "deepspeed"},
               "sp4": {"dp_shard_size": 1, "sp_size": 4, "sp_backend": "deepspeed"}}  # a --seq sequence per group
LAYOUTS.update(SEQ_LAYOUTS)


def _world(layout: dict) -> int:
    return layout.get("pp_size", 1) * layout.get("tp_size", 1) * layout.get("dp_shard_size", 1) * \
        layout.get("sp_size", 1)


def _rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _layouts_rank(rank: int, port: int, hidden: int, steps: int, result: str, name: str, seq: int = 128,
                  sp_strategy: str = "deepspeed") -> None:
    import resource

    import numpy as np
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain import Trainer, TrainerCallback, TrainingArguments
    from raytrain.worker import loop

    world = _world(LAYOUTS[name])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    class Marks(TrainerCallback):
        def __init__(self):
            self.times, self.state_bytes, self.start_rss = [], 0, 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) from here on
                f.write("5")
            self.start_rss = _rss_mb("VmRSS")

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.times.append(time.perf_counter())
            if state.global_step == 1:  # the optimizer state exists from the first step
                local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
                tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters()
                                                                     if p.grad is not None]
                tensors += [local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
                self.state_bytes = sum(t.numel() * t.element_size() for t in tensors)

    long = name in SEQ_LAYOUTS
    ids = np.random.default_rng(0).integers(0, 2048, (8 * steps, seq if long else 128))
    out = {}
    for name, layout in [(name, LAYOUTS[name])]:  # one layout per process group: its own peak RSS
        dp = world // (layout.get("tp_size", 1) * layout.get("pp_size", 1) * layout.get("sp_size", 1))
        strategy = ({"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 2}}}
                    if sp_strategy == "deepspeed" else {"strategy": sp_strategy}) if long else {"strategy": "fsdp"}
        args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="rtlayout"), max_steps=steps,
                                 per_device_train_batch_size=1 if long else 8 // dp, learning_rate=1e-4,
                                 logging_steps=10**6, save_strategy="no", disable_tqdm=True, report_to="none",
                                 scaling={"num_workers": world}, parallelism_config=layout, distributed=strategy)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                                             num_attention_heads=8, num_key_value_heads=8, vocab_size=2048,
                                             max_position_embeddings=max(2048, seq), attn_implementation="sdpa"))
        marks = Marks()
        loop.train(Trainer(model, args, train_dataset={"input_ids": ids, "labels": ids}, callbacks=[marks]), None)
        step = statistics.median([b - a for a, b in zip(marks.times[1:], marks.times[2:])])
        out[name] = {"step_s": step, "state_mb": marks.state_bytes / 2**20,
                     "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "train_rise_mb": _rss_mb("VmHWM") - marks.start_rss,
                     "tokens": (seq if long else 128) * args.per_device_train_batch_size // layout.get("sp_size", 1)}
    all_ranks = [None] * world
    dist.all_gather_object(all_ranks, out)
    dist.destroy_process_group()
    if rank == 0:
        with open(result, "w") as f:
            json.dump(all_ranks, f)


def bench_layouts(hidden: int, steps: int, names: list[str], rounds: int = 1, seq: int = 2048,
                  sp_strategy: str = "deepspeed") -> dict:
    """Each layout `rounds` times, their order rotated; a layout's best round (the least disturbed)."""
    out: dict = {}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            got = _layout_once(name, hidden, steps, seq, sp_strategy)
            if name not in out or got["step_s"] < out[name]["step_s"]:
                out[name] = got
    return {name: out[name] for name in names}


def _layout_once(name: str, hidden: int, steps: int, seq: int = 2048, sp_strategy: str = "deepspeed") -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = os.path.join(tempfile.mkdtemp(prefix="rtlayouts"), "r.json")
    mp.spawn(_layouts_rank, args=(port, hidden, steps, result, name, seq, sp_strategy), nprocs=_world(LAYOUTS[name]),
             join=True)
    with open(result) as f:
        ranks = [r[name] for r in json.load(f)]
    return {"step_s": ranks[0]["step_s"], "state_mb": max(r["state_mb"] for r in ranks),
            "max_rss_mb": max(r["max_rss_mb"] for r in ranks), "train_rise_mb": max(r["train_rise_mb"] for r in ranks),
            "tokens": ranks[0]["tokens"], "world": len(ranks)}


# ---------------------------------------------------------------- recovery


HEALTH_CHECKS = {"default": "Ray's default health checks (a lost node listed dead after ~15 s)",
                 "fast": "fast health checks (RAY_health_check_*: listed dead after ~2 s)"}


def bench_recovery(elastic: bool = False, health_checks: str = "default") -> dict:
    """elastic: num_workers [1, 2], and no node replaces the lost one (the group goes on with one worker)."""
    sim = SimCluster(health_checks=health_checks)
    try:
        sim.start_head()
        sim.add_node("a")
        sim.add_node("b")
        fresh_marks = os.path.join(sim.storage, "fresh.marks")
        start = time.time()
        proc = sim.drive({"result": os.path.join(sim.base, "fresh.json"), "output_dir": os.path.join(sim.local, "f"),
                          "storage": os.path.join(sim.storage, "f"), "marks": fresh_marks, "elastic": elastic})
        proc.wait(600)
        cold = _marks(fresh_marks)[0][0] - start
        flag = os.path.join(sim.storage, "lose")
        lost_marks = os.path.join(sim.storage, "lost.marks")
        proc = sim.drive({"result": os.path.join(sim.base, "lost.json"), "output_dir": os.path.join(sim.local, "l"),
                          "storage": os.path.join(sim.storage, "l"), "max_failures": 1, "marks": lost_marks,
                          "pause": {"rank": 1, "step": 12, "flag": flag}, "elastic": elastic})
        while not os.path.exists(flag):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before its pause; see {sim.base}")
            time.sleep(0.2)
        with open(flag) as f:
            ns = f.read()
        lost_at = time.time()
        load = os.getloadavg()[0]
        sim.lose(ns, wait=not elastic)  # a replacement joins once the GCS has noticed (as an autoscaler's)
        if not elastic:
            sim.add_node("c")
        proc.wait(600)
        with open(os.path.join(sim.base, "lost.json")) as f:
            result = json.load(f)
        if "error" in result:
            raise RuntimeError(result["error"])
        after = [m for m in _marks(lost_marks) if m[0] > lost_at]
        return {"cold_start_to_first_step_s": cold, "loss_to_first_step_s": after[0][0] - lost_at,
                "resumed_at_step": after[0][2] - 1, "load": (load, os.getloadavg()[0])}
    finally:
        sim.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parts", default="saves,recovery", help="of saves, recovery, elastic, layouts")
    p.add_argument("--hidden", type=int, default=256, help="for layouts: the Llama's hidden size")
    p.add_argument("--layouts", default=",".join(n for n in LAYOUTS if n not in SEQ_LAYOUTS),
                   help=f"for layouts: which (dp4 first, the reference; {', '.join(SEQ_LAYOUTS)} against sp1)")
    p.add_argument("--seq", type=int, default=2048, help="for the sp layouts: the sequence length")
    p.add_argument("--sp-strategy", default="deepspeed", help="for the sp layouts: deepspeed (ZeRO-2), fsdp or ddp")
    p.add_argument("--strategies", default="ddp,fsdp,deepspeed", help="for saves (deepspeed: ZeRO-2)")
    p.add_argument("--health-checks", default="default,fast",
                   help="for recovery and elastic, each measured in turn: default (Ray's), fast (~2 s)")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    bad = [c for c in a.health_checks.split(",") if c not in HEALTH_CHECKS]
    if bad:
        p.error(f"--health-checks: default or fast, got {', '.join(bad)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    if "saves" in parts:
        import ray

        tmp = tempfile.mkdtemp(prefix="rtdist")
        try:
            from raytrain.driver.launch import ensure_ray

            ensure_ray(None)
            r = bench_saves(tmp, a.mb, a.steps, a.rounds, a.strategies.split(","))
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
        for strategy, m in r.items():
            for mode in ("sync", "async"):
                print(f"saves {strategy} {mode}: a {a.mb} MiB model, a checkpoint every 10 steps vs none: median "
                      f"step {m[mode]['median'] * 1e3:.1f} vs {m['none']['median'] * 1e3:.1f} ms "
                      f"({m[mode]['median'] / m['none']['median']:.2f}x), mean {m[mode]['mean'] * 1e3:.1f} vs "
                      f"{m['none']['mean'] * 1e3:.1f} ms ({m[mode]['mean'] / m['none']['mean']:.2f}x)")
    if "layouts" in parts:
        asked = a.layouts.split(",")
        seq_names = [n for n in SEQ_LAYOUTS if n in asked]
        names = ["dp4"] + [n for n in asked if n != "dp4" and n not in SEQ_LAYOUTS] if len(seq_names) < len(asked) else []
        if seq_names:
            seq_names = ["sp1"] + [n for n in seq_names if n != "sp1"]
            r = bench_layouts(a.hidden, a.steps, seq_names, a.rounds, a.seq, a.sp_strategy)
            base = r["sp1"]
            for name, m in r.items():
                speed = m["tokens"] * m["world"] / m["step_s"]
                print(f"layouts {name} ({a.sp_strategy}, {m['world']} processes, {a.seq}-token sequences, "
                      f"{m['tokens']} tokens per rank): median step {m['step_s'] * 1e3:.0f} ms "
                      f"({m['step_s'] / base['step_s']:.2f}x sp1), {speed:.0f} tokens/s "
                      f"({speed / (base['tokens'] * base['world'] / base['step_s']):.2f}x sp1), "
                      f"peak RSS per rank {m['max_rss_mb']:.0f} MiB "
                      f"({m['max_rss_mb'] / base['max_rss_mb']:.2f}x sp1), its rise in training "
                      f"{m['train_rise_mb']:.0f} MiB ({m['train_rise_mb'] / base['train_rise_mb']:.2f}x sp1)")
        r = bench_layouts(a.hidden, a.steps, names, a.rounds) if names else {}
        for name, m in r.items():
            print(f"layouts {name} ({m['world']} processes): median step {m['step_s'] * 1e3:.0f} ms "
                  f"({m['step_s'] / r['dp4']['step_s']:.2f}x dp4), "
                  f"params+grads+AdamW per rank {m['state_mb']:.1f} MiB ({m['state_mb'] / r['dp4']['state_mb']:.2f}x "
                  f"dp4), peak RSS per rank {m['max_rss_mb']:.0f} MiB ({m['max_rss_mb'] / r['dp4']['max_rss_mb']:.2f}x dp4)")
    for part in ("recovery", "elastic"):
        if part not in parts:
            continue
        for checks in a.health_checks.split(","):
            r = bench_recovery(elastic=part == "elastic", health_checks=checks)
            lost = "lost, none replaces it, one worker goes on" if part == "elastic" else "lost"
            print(f"{part}, {HEALTH_CHECKS[checks]}: rank 1's node {lost} after step 12, resumed at step "
                  f"{r['resumed_at_step']}: {r['loss_to_first_step_s']:.1f} s from the loss to the first step after "
                  f"it, against {r['cold_start_to_first_step_s']:.1f} s from a fresh run's start to its first step "
                  f"({r['loss_to_first_step_s'] / r['cold_start_to_first_step_s']:.2f}x; load {r['load'][0]:.1f} at "
                  f"the loss, {r['load'][1]:.1f} at the end)", flush=True)


if __name__ == "__main__":
    main()
