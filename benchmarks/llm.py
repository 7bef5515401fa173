"""LLM fine-tuning: raytrain's Trainer against transformers' Trainer and a hand-written loop, LoRA + checkpointing.

    python benchmarks/llm.py [--hidden 384] [--layers 4] [--batch 4] [--seq 256] [--warmup 3] [--steps 12]
                             [--rounds 3] [--threads 1] [--parts loops,memory] [--json results.json]
    python benchmarks/llm.py --quick    # a 2-layer model, a few steps: the code path only, no figures to report

A Llama built from its config (no download; random token ids over a 256-token vocabulary), LoRA on q_proj /
v_proj (peft), activation (gradient) checkpointing, AdamW (optim "adamw_torch" on the CPU, "adamw_torch_fused"
on CUDA, named for all three), fp32 on the CPU and bf16 autocast on CUDA, the same batches, the loss read
every --logging-steps steps by all three. Prints, against references measured in the run:
  (a) tokens/s of each loop over --steps steps after --warmup, by wall time and by the process's CPU time
      (on a machine shared with other jobs the CPU figure counts this run's work alone), over --rounds
      rounds in rotated order; raytrain / HF (target >= 1) and raytrain / hand (target >= 0.97), with the
      range of the per-round ratios. The loops are benchmarks/gpu_train.py's, with LoRA and checkpointing on.
  (b) peak memory of LoRA vs full fine-tuning, one fresh subprocess per (configuration, loop): on the CPU
      the peak RSS (getrusage) and its rise over the RSS before the model was built, on CUDA
      torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_train import (build_model, compare_loops, hand_loop, llama_config, raytrain_loop,  # noqa: E402
                       release, report_loops, versions)

MEMORY_LOOPS = {"hand": hand_loop, "raytrain": raytrain_loop}


def options(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 2-layer model, a few steps: the code path in seconds")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--memory-steps", type=int, default=3, help="steps of each memory subprocess")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    p.add_argument("--parts", default="loops,memory")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)  # "lora:raytrain": one measurement
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.heads, a.intermediate, a.batch, a.seq = 64, 2, 4, 128, 2, 32
        a.warmup, a.steps, a.rounds, a.memory_steps, a.logging_steps = 1, 2, 1, 1, 1
    cuda = torch.cuda.is_available()
    # what gpu_train.py's loops read from `a` beyond the sizes
    a.bf16, a.ckpt, a.sync_steps, a.peak_tflops = cuda, True, 1, None
    a.optim = "adamw_torch_fused" if cuda else "adamw_torch"
    a.lora = {"r": a.lora_r, "lora_alpha": 2 * a.lora_r, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    return a


def config_of(a):
    return llama_config(seq=a.seq, tie_word_embeddings=False, vocab_size=256, hidden_size=a.hidden,
                        intermediate_size=a.intermediate, num_hidden_layers=a.layers, num_attention_heads=a.heads)


def token_ids(a, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (a.batch * (a.warmup + a.steps + a.sync_steps + 2), a.seq), generator=g)


def status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak) of this process, from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS (the imports' transient peak forgotten)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- (b) memory, one subprocess each


def memory_child(a) -> None:
    """Runs one (configuration, loop) for --memory-steps steps and prints its peaks as one JSON line."""
    kind, loop = a.memory_child.split(":")
    a.warmup, a.steps = 1, a.memory_steps
    a.lora = a.lora if kind == "lora" else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = config_of(a)
    ids = token_ids(a, config.vocab_size)
    import peft, transformers.trainer  # noqa: E401, F401  (imported before the baseline, as the loops need them)
    from raytrain.worker import loop as _  # noqa: F401
    reset = reset_peak_rss()
    before = status_mb("VmRSS")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        MEMORY_LOOPS[loop](a, config, ids, device, tmp)
    peak = status_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    print("MEMORY " + json.dumps({"peak_rss_mb": peak, "rss_before_mb": before, "cuda_peak_mb": cuda_peak}))


def measure_memory(argv: list[str]) -> dict:
    out: dict = {}
    for kind in ("lora", "full"):
        for loop in MEMORY_LOOPS:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory-child", f"{kind}:{loop}"],
                                  capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")), None)
            if line is None:
                raise RuntimeError(f"memory {kind}:{loop} failed:\n{proc.stderr[-3000:]}")
            out[f"{kind}:{loop}"] = json.loads(line[len("MEMORY "):])
    return out


def report_memory(m: dict) -> None:
    cuda = m["lora:raytrain"]["cuda_peak_mb"] is not None
    print(f"{'memory':<14} {'peak RSS MiB':>13} {'rise MiB':>9}" + (f" {'CUDA peak MiB':>14}" if cuda else ""))
    for key, r in m.items():
        line = f"{key:<14} {r['peak_rss_mb']:>13.0f} {r['peak_rss_mb'] - r['rss_before_mb']:>9.0f}"
        print(line + (f" {r['cuda_peak_mb']:>14.0f}" if cuda else ""))
    key = "cuda_peak_mb" if cuda else None
    for loop in MEMORY_LOOPS:
        lora, full = m[f"lora:{loop}"], m[f"full:{loop}"]
        if key:
            ratio = full[key] / lora[key]
        else:
            ratio = (full["peak_rss_mb"] - full["rss_before_mb"]) / (lora["peak_rss_mb"] - lora["rss_before_mb"])
        print(f"{loop}: full fine-tuning / LoRA, peak {'CUDA memory' if key else 'RSS rise'}: {ratio:.2f}x")
    for kind in ("lora", "full"):
        ours, hand = m[f"{kind}:raytrain"], m[f"{kind}:hand"]
        if key:
            ratio = ours[key] / hand[key]
        else:
            ratio = (ours["peak_rss_mb"] - ours["rss_before_mb"]) / (hand["peak_rss_mb"] - hand["rss_before_mb"])
        print(f"{kind}: raytrain / hand, peak {'CUDA memory' if key else 'RSS rise'}: {ratio:.2f}x")


# ---------------------------------------------------------------- main


def main() -> None:
    a = options()
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_num_threads(a.threads)
    if a.memory_child:
        return memory_child(a)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = config_of(a)
    model = build_model(config, a.lora)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    ids = token_ids(a, config.vocab_size)
    result = {"versions": versions(), "machine": f"{platform.machine()} cpus={os.cpu_count()}", "quick": a.quick,
              "params": params, "trainable": trainable, "batch": a.batch, "seq": a.seq, "warmup": a.warmup,
              "steps": a.steps, "rounds": a.rounds, "threads": a.threads, "load_avg_start": os.getloadavg()[0]}
    print(f"{result['versions']} {result['machine']} torch_threads={torch.get_num_threads()} "
          f"load_avg={result['load_avg_start']:.2f}")
    print(f"Llama {a.layers}x{a.hidden} params={params / 1e6:.2f}M LoRA r={a.lora_r} trainable={trainable / 1e6:.3f}M "
          f"batch={a.batch} seq={a.seq} tokens/step={a.batch * a.seq} {'bf16' if a.bf16 else 'fp32'} {a.optim} "
          f"activation checkpointing; {a.steps} timed steps after {a.warmup}, {a.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        if "loops" in a.parts:
            result["loops"] = compare_loops(a, config, ids, device, tmp)
            report_loops(result["loops"])
            write(a.json, result)
            release(device)
    if "memory" in a.parts:
        result["memory"] = measure_memory(sys.argv[1:])
        report_memory(result["memory"])
    result["load_avg_end"] = os.getloadavg()[0]
    print(f"load_avg at end {result['load_avg_end']:.2f} ({os.cpu_count()} cpus)")
    write(a.json, result)
    if a.quick:
        print("quick run: the code path ran; its numbers are not figures to report")


def write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
