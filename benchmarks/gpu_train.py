"""GPU training: raytrain's Trainer against transformers' Trainer and a hand-written loop on one GPU.

    python benchmarks/gpu_train.py [--batch 16] [--seq 1024] [--warmup 10] [--steps 40] [--rounds 2]
                                   [--json results.json]
    python benchmarks/gpu_train.py --tiny    # CPU, seconds: the code path only, no figures to report

A Llama-style decoder of 124M parameters built from its config (GPT-2 small's shape: 12 layers, width
768, vocabulary 50304, tied embeddings; SDPA attention), bf16 autocast over fp32 weights, fused AdamW,
random tokens of sequence 1024, the same for all three. Prints, against references measured in the run:
  (a) tokens/s and MFU of each loop over --steps steps after --warmup, the GPU synchronised at both ends
      of the window; ratios to the hand-written loop (targets: raytrain >= HF, >= 0.97x hand); the loops'
      order rotated over --rounds;
  (b) host-device synchronisations per step (torch.cuda.set_sync_debug_mode over --sync-steps steps after
      the window), each loop, with the lines that asked for them (target: none beyond logging's);
  (c) raytrain's step stalled by a checkpoint of the model and AdamW state (weights, optimizer.pt, ...):
      synchronous and background (save_async), the first save (pinned buffers allocated) and the later
      ones, against a bare torch.save of the same state from the GPU and torchtitan's published anchor
      for an asynchronous DCP save (under 1 s blocked); with each mode's mean step against no saves.
FLOPs per token for MFU: 6 x parameters + 12 x layers x width x sequence (attention), as PaLM counts;
peak from the device's name (H100/H200 SXM: 989 TFLOP/s dense bf16) or --peak-tflops.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from raytrain import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from checkpoint import StepTimer, quiet  # noqa: E402  (benchmarks/checkpoint.py's harness)

TITAN_ASYNC_ANCHOR_S = 1.0  # torchtitan: an async DCP save blocks training for under 1 s
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def model_config(tiny: bool, seq: int):
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4) if tiny else \
        dict(vocab_size=50304, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12)
    return llama_config(seq=seq, **shape)


def llama_config(seq: int, tie_word_embeddings: bool = True, **shape):
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=seq,
                         tie_word_embeddings=tie_word_embeddings)
    config._attn_implementation = "sdpa"
    return config


def build_model(config, lora: dict | None = None):
    """The Llama (seed 0); with `lora` (peft's LoraConfig arguments), wrapped by get_peft_model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    return model


def flops_per_token(config, params: int, seq: int) -> float:
    return 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq


def peak_flops(name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyncCounter:
    """Host-device synchronisations while on: torch warns at each one (set_sync_debug_mode), the warnings
    are counted and grouped by the Python line that asked. None on CPU (nothing to count)."""

    def __init__(self, device: torch.device):
        self.device, self.sites, self.count, self._cm, self._log = device, collections.Counter(), 0, None, None

    def start(self) -> None:
        if self.device.type != "cuda":
            return
        self._cm = warnings.catch_warnings(record=True)
        self._log = self._cm.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._cm is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._cm.__exit__(None, None, None)
        for w in self._log:
            if "synchroniz" in str(w.message):
                self.count += 1
                self.sites[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
        self._cm = None


class Window:
    """Marks the timed window (the GPU synchronised at both ends) and the sync-counting steps after it,
    by the number of finished steps; shared by the three loops (each calls `step_end(n)`). Beside wall
    time, the process's CPU time: on a CPU shared with other jobs it counts this run's work alone."""

    def __init__(self, a, device: torch.device):
        self.a, self.device, self.counter = a, device, SyncCounter(device)
        self.t0 = self.t1 = self.c0 = self.c1 = None

    def step_end(self, n: int) -> None:
        a = self.a
        if n == a.warmup:
            sync(self.device)
            self.t0, self.c0 = time.perf_counter(), time.process_time()
        elif n == a.warmup + a.steps:
            sync(self.device)
            self.t1, self.c1 = time.perf_counter(), time.process_time()
            self.counter.start()
        elif n == a.warmup + a.steps + a.sync_steps:
            self.counter.stop()

    def result(self, tokens_per_step: int) -> dict:
        seconds = self.t1 - self.t0
        on = self.device.type == "cuda"
        return {"tokens_per_s": tokens_per_step * self.a.steps / seconds, "step_ms": seconds / self.a.steps * 1e3,
                "tokens_per_cpu_s": tokens_per_step * self.a.steps / (self.c1 - self.c0),
                "syncs_per_step": self.counter.count / self.a.sync_steps if on else None,
                "sync_sites": dict(self.counter.sites.most_common(6)) if on else None}


def total_steps(a) -> int:
    return a.warmup + a.steps + a.sync_steps + 1  # +1: the counting ends at a step end, not the run's end


# ---------------------------------------------------------------- the three loops


# What the three share beyond `a`'s sizes: a.bf16 (autocast over fp32 weights), a.optim ("adamw_torch" or
# "adamw_torch_fused"), a.lora (None or LoraConfig's arguments), a.ckpt (activation checkpointing), and
# a.logging_steps (the Trainers log the loss, the hand loop reads it, that often).


def hand_loop(a, config, ids, device, out) -> dict:
    model = build_model(config, a.lora).to(device)
    if a.ckpt:
        model.activation_checkpointing_enable()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0, fused=a.optim == "adamw_torch_fused" or None)
    n = total_steps(a)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / n)
    window = Window(a, device)
    host = ids.pin_memory() if device.type == "cuda" else ids
    model.train()
    for step in range(n):
        x = host[step * a.batch:(step + 1) * a.batch].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % a.logging_steps == 0:
            loss.item()
        window.step_end(step + 1)
    return window.result(a.batch * a.seq)


class _Window(TrainerCallback):
    def __init__(self, window: Window):
        self.window = window

    def on_step_end(self, args, state, control, **kw):
        self.window.step_end(state.global_step)


def raytrain_loop(a, config, ids, device, out) -> dict:
    window = Window(a, device)
    args = TrainingArguments(output_dir=out, max_steps=total_steps(a), per_device_train_batch_size=a.batch,
                             learning_rate=a.lr, weight_decay=0.0, bf16=a.bf16, optim=a.optim,
                             activation_checkpointing=a.ckpt, logging_steps=a.logging_steps, save_strategy="no",
                             disable_tqdm=True, report_to="none", use_cpu=device.type != "cuda", seed=0)
    quiet(Trainer(build_model(config, a.lora), args, train_dataset={"input_ids": ids, "labels": ids},
                  callbacks=[_Window(window)])).train()
    return window.result(a.batch * a.seq)


def hf_loop(a, config, ids, device, out) -> dict:
    import transformers

    window = Window(a, device)

    class HFWindow(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            window.step_end(state.global_step)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = transformers.TrainingArguments(
        output_dir=out, max_steps=total_steps(a), per_device_train_batch_size=a.batch, learning_rate=a.lr,
        weight_decay=0.0, bf16=a.bf16, optim=a.optim, activation_checkpointing=a.ckpt, logging_steps=a.logging_steps,
        save_strategy="no", disable_tqdm=True, report_to="none", use_cpu=device.type != "cuda", seed=0)
    hf_quiet(transformers.Trainer(build_model(config, a.lora), args, train_dataset=Rows(), callbacks=[HFWindow()])).train()
    return window.result(a.batch * a.seq)


def hf_quiet(trainer):
    """transformers' Trainer without its printer (raytrain's runs without it too: `quiet`)."""
    import transformers

    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def compare_loops(a, config, ids, device, tmp) -> dict:
    """The hand loop, raytrain and HF --rounds times, their order rotated each round so that drift on a
    shared machine hits all alike; per loop the median tokens/s (wall and CPU) and each round's."""
    loops = {"hand": hand_loop, "raytrain": raytrain_loop, "hf": hf_loop}
    runs: dict[str, list[dict]] = {k: [] for k in loops}
    names = list(loops)
    for i in range(a.rounds):
        for name in names[i % 3:] + names[:i % 3]:
            runs[name].append(loops[name](a, config, ids, device, os.path.join(tmp, name)))
            release(device)
    fpt = flops_per_token(config, sum(p.numel() for p in build_model(config).parameters()), a.seq)
    peak = peak_flops(torch.cuda.get_device_name(), a.peak_tflops) if device.type == "cuda" else None
    result = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        result[name] = {"tokens_per_s": tps, "mfu": tps * fpt / peak if peak else None,
                        "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in rs),
                        "tokens_per_s_rounds": [r["tokens_per_s"] for r in rs],
                        "tokens_per_cpu_s_rounds": [r["tokens_per_cpu_s"] for r in rs],
                        "syncs_per_step": rs[-1]["syncs_per_step"], "sync_sites": rs[-1]["sync_sites"]}
    return result


def fused(device: torch.device) -> str:
    return "adamw_torch_fused" if device.type == "cuda" else "adamw_torch"


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- (c) checkpoint stalls


def checkpoint_stalls(a, config, ids, device, tmp) -> dict:
    """raytrain runs of 3 x --save-every + 2 steps, saving every --save-every steps (none / sync / async);
    the interval after a saving step's end holds its save. Then a bare torch.save of the same state."""
    every, steps = a.save_every, 3 * a.save_every + 2
    out: dict = {}
    for mode in ("none", "sync", "async"):
        timer, run_dir = StepTimer(), os.path.join(tmp, f"ckpt-{mode}")
        args = TrainingArguments(output_dir=run_dir, max_steps=steps, per_device_train_batch_size=a.batch,
                                 learning_rate=a.lr, weight_decay=0.0, bf16=True, optim=fused(device),
                                 logging_steps=10**9, disable_tqdm=True, report_to="none", seed=0,
                                 save_strategy="no" if mode == "none" else "steps", save_steps=every,
                                 save_async=mode == "async", save_total_limit=1, use_cpu=device.type != "cuda")
        trainer = quiet(Trainer(build_model(config), args, train_dataset={"input_ids": ids, "labels": ids},
                                callbacks=[timer]))
        trainer.train()
        wall, _ = timer.intervals(skip=0)  # wall[i]: from step i+1's end to step i+2's end
        saving = [s - 1 for s in range(every, steps, every)]  # intervals that hold the saves of steps 8, 16, ...
        plain = [w for i, w in enumerate(wall) if i not in saving and i >= 1]
        base = statistics.median(plain)
        out[mode] = {"median_step_s": base, "mean_step_s": statistics.fmean(wall[1:]),
                     "stall_first_s": wall[saving[0]] - base if mode != "none" else None,
                     "stall_later_s": statistics.fmean(wall[i] - base for i in saving[1:]) if mode != "none" else None}
        if mode == "none":
            model, opt = trainer.model, trainer.optimizer
            path = os.path.join(tmp, "bare.pt")
            sync(device)
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            out["bare_torch_save_s"] = time.perf_counter() - t
            out["checkpoint_mb"] = os.path.getsize(path) / 2**20
            os.remove(path)
            del model, opt
        del trainer
        shutil.rmtree(run_dir, ignore_errors=True)
        release(device)
    return out


# ---------------------------------------------------------------- main


def versions() -> dict:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        v["device"] = torch.cuda.get_device_name()
    return v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: the code path in seconds")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sync-steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, if not known")
    p.add_argument("--parts", default="loops,checkpoint")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args()
    if not a.tiny and not torch.cuda.is_available():
        print("no CUDA device: GPU figures need one; running --tiny (the code path on the CPU, no figures)")
        a.tiny = True
    if a.tiny:
        a.batch, a.seq, a.warmup, a.steps, a.sync_steps, a.rounds, a.save_every = 2, 64, 2, 3, 2, 1, 3
    device = torch.device("cpu" if a.tiny else "cuda")
    a.bf16, a.optim, a.lora, a.ckpt, a.logging_steps = True, fused(device), None, False, 10**9
    torch.set_float32_matmul_precision("high")
    config = model_config(a.tiny, a.seq)
    params = sum(p.numel() for p in build_model(config).parameters())
    fpt = flops_per_token(config, params, a.seq)
    peak = None if a.tiny else peak_flops(torch.cuda.get_device_name(), a.peak_tflops)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (a.batch * (a.warmup + a.steps + a.sync_steps + 2), a.seq), generator=g)
    result = {"versions": versions(), "tiny": a.tiny, "params": params, "flops_per_token": fpt, "peak_flops": peak,
              "batch": a.batch, "seq": a.seq, "warmup": a.warmup, "steps": a.steps, "rounds": a.rounds}
    print(f"{result['versions']} params={params / 1e6:.1f}M batch={a.batch} seq={a.seq} "
          f"tokens/step={a.batch * a.seq} GFLOP/token={fpt / 1e9:.3f} peak={peak and peak / 1e12} TFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        if "loops" in a.parts:
            result["loops"] = compare_loops(a, config, ids, device, tmp)
            report_loops(result["loops"])
            write(a.json, result)  # each part as it ends: a run stopped at its time limit keeps what it has
        if "checkpoint" in a.parts:
            result["checkpoint"] = checkpoint_stalls(a, config, ids, device, tmp)
            report_checkpoint(result["checkpoint"])
            write(a.json, result)
    if a.tiny:
        print("tiny CPU run: the code path ran; its numbers are not figures to report")


def write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def report_loops(loops: dict) -> None:
    hand = loops["hand"]["tokens_per_s"]
    print(f"{'loop':<10} {'tokens/s':>11} {'MFU':>7} {'vs hand':>8} {'tokens/CPU-s':>13} {'syncs/step':>11}  sync sites")
    for name, r in loops.items():
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "n/a"
        syncs = f"{r['syncs_per_step']:.1f}" if r["syncs_per_step"] is not None else "n/a"
        print(f"{name:<10} {r['tokens_per_s']:>11.0f} {mfu:>7} {r['tokens_per_s'] / hand:>7.3f}x "
              f"{r['tokens_per_cpu_s']:>13.0f} {syncs:>11}  {r['sync_sites'] or ''}")
    for ref, target in (("hf", 1.0), ("hand", 0.97)):
        print(f"raytrain / {ref}: {ratio_line(loops, ref, 'tokens_per_s')} wall, "
              f"{ratio_line(loops, ref, 'tokens_per_cpu_s')} CPU (target >= {target})")


def ratio_line(loops: dict, ref: str, key: str) -> str:
    """The ratio of the medians, and the range of the ratios round by round (each round's runs back to back)."""
    per_round = [o / r for o, r in zip(loops["raytrain"][f"{key}_rounds"], loops[ref][f"{key}_rounds"])]
    return f"{loops['raytrain'][key] / loops[ref][key]:.3f}x [rounds {min(per_round):.3f}-{max(per_round):.3f}]"


def report_checkpoint(c: dict) -> None:
    print(f"checkpoint of {c['checkpoint_mb']:.0f} MiB; a bare torch.save of it from the device: {c['bare_torch_save_s']:.3f} s")
    for mode in ("none", "sync", "async"):
        r = c[mode]
        line = f"{mode:<6} median step {r['median_step_s'] * 1e3:8.1f} ms, mean {r['mean_step_s'] * 1e3:8.1f} ms " \
               f"({r['mean_step_s'] / c['none']['mean_step_s']:.3f}x none)"
        if r["stall_first_s"] is not None:
            line += (f"; stall: first save {r['stall_first_s']:.3f} s, later {r['stall_later_s']:.3f} s "
                     f"({r['stall_later_s'] / c['bare_torch_save_s']:.2f}x bare torch.save, "
                     f"{r['stall_later_s'] / TITAN_ASYNC_ANCHOR_S:.2f}x torchtitan's 1 s async anchor)")
        print(line)


if __name__ == "__main__":
    main()
