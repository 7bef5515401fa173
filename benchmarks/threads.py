"""torch's intra-op threads per process: raytrain's default (the node's cores // its training processes)
against torch's own count and the alternatives, for the digits MLP and a bigger one, in one process and on
2 Ray workers.

    python benchmarks/threads.py [--steps 200] [--big-steps 60]

Each variant is a fresh `python -m raytrain.run` (no evaluation, no saves); steps/s is max_steps over the
run's train_runtime (the loop alone: Ray's start-up is not in it). OMP_NUM_THREADS unset: raytrain's default;
set: that count (OMP_NUM_THREADS wins). In one process torch's own default is its physical-core count, which
raytrain's default equals; in a Ray worker torch's count is Ray's (the worker's CPUs: 1). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"digits MLP (26.6k)": [], "MLP 1024x3 (2.2M)": ["--set", "model.hidden_size=1024",
                                                         "--set", "model.num_layers=3"]}


def run(steps: int, workers: int, omp: str | None, model: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RAY_ADDRESS")}
    env["PYTHONPATH"] = ROOT
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = f"/tmp/raytrain-threads-bench-{os.getpid()}"
    cmd = [sys.executable, "-m", "raytrain.run", "--config", "examples/digits.yaml", "--set", f"max_steps={steps}",
           "--set", "eval_strategy=no", "--set", "save_strategy=no", "--set", "load_best_model_at_end=false",
           "--set", "logging_steps=1000", "--set", f"scaling.num_workers={workers}", "--set", f"output_dir={out}",
           "--set", "overwrite_output_dir=true", "--no-report", *model]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in p.stdout.splitlines() + p.stderr.splitlines() if ln.startswith("summary: ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{(p.stdout + p.stderr)[-3000:]}")
    summary = json.loads(line[len("summary: "):])
    return summary["global_step"] / summary["train_runtime"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of the digits MLP per run")
    ap.add_argument("--big-steps", type=int, default=60, help="steps of the bigger MLP per run")
    a = ap.parse_args()
    cores = os.cpu_count()
    print(f"{time.strftime('%Y-%m-%d')} cores={cores} load_avg={os.getloadavg()[0]:.2f}")
    # (workers, OMP_NUM_THREADS, label): None is raytrain's default.
    variants = [(1, None, "raytrain default (= torch's: cores)"), (1, "1", "OMP_NUM_THREADS=1"),
                (2, None, "raytrain default (cores // 2)"), (2, "2", "OMP_NUM_THREADS=2 (torch's per-process count)")]
    for name, model in MODELS.items():
        steps = a.steps if not model else a.big_steps
        for workers, omp, label in variants:
            rate = run(steps, workers, omp, model)
            print(f"{name:20s} workers={workers} {label:48s} {rate:7.1f} steps/s", flush=True)


if __name__ == "__main__":
    main()
