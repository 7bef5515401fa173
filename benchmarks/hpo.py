"""Search efficiency and sweep overhead on digits, measured in one invocation.

    python benchmarks/hpo.py [--seeds 3] [--trials 12] [--target 0.97]

For each seed, two sweeps of the same space and budget: the reference (random search, no scheduler)
and raytrain's default (TPE + ASHA). Reported:
  * steps to target: total training steps, over all trials in the order their evaluations arrived,
    until any trial first reaches the target validation accuracy; the ratio TPE+ASHA / random.
  * overhead: the sweep's wall time against the sum of its trials' training time (train_runtime
    from each trial's checkpoint), and per trial (wall x concurrency - training) / trials.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPACE = {
    "learning_rate": {"loguniform": [1.0e-4, 3.0e-2]},
    "weight_decay": {"uniform": [0.0, 0.1]},
    "model.hidden_size": {"choice": [16, 32, 64, 128, 256]},
    "model.dropout": {"uniform": [0.0, 0.5]},
}


def _sweep(root: str, name: str, seed: int, sampler: str, scheduler: str, trials: int, concurrency: int,
           max_steps: int, eval_steps: int):
    from examples.digits import build_datasets, build_model, compute_metrics
    from raytrain import Trainer, TrainingArguments

    train, val = build_datasets()
    args = TrainingArguments(output_dir=root, max_steps=max_steps, per_device_train_batch_size=32,
                             per_device_eval_batch_size=512, eval_strategy="steps", eval_steps=eval_steps,
                             save_steps=eval_steps, logging_steps=eval_steps, save_total_limit=1,
                             lr_scheduler_type="constant", seed=seed)
    trainer = Trainer(args=args, model_init=lambda **k: build_model(**k), train_dataset=train, eval_dataset=val,
                      compute_metrics=compute_metrics)
    start = time.perf_counter()
    best = trainer.hyperparameter_search(SPACE, n_trials=trials, direction="maximize", metric="accuracy",
                                         scheduler=scheduler, sampler=sampler, seed=seed,
                                         max_concurrent_trials=concurrency, name=name, plots=False)
    wall = time.perf_counter() - start
    return best, wall, os.path.join(root, "sweeps", name)


def _reports(sweep_dir: str) -> list[dict]:
    rows = []
    for d in os.listdir(sweep_dir):
        path = os.path.join(sweep_dir, d, "result.json")
        if d.startswith("trial_") and os.path.isfile(path):
            with open(path) as f:
                rows += [dict(json.loads(line), trial=d) for line in f if line.strip()]
    return sorted(rows, key=lambda r: (r["timestamp"], r.get("time_total_s", 0)))


def steps_to_target(sweep_dir: str, target: float) -> float:
    """Training steps spent by all trials, in arrival order, until one first reaches `target`."""
    last: dict[str, int] = {}
    total = 0
    for r in _reports(sweep_dir):
        total += r["step"] - last.get(r["trial"], 0)
        last[r["trial"]] = r["step"]
        if r["eval_accuracy"] >= target:
            return float(total)
    return float("inf")


def training_seconds(sweep_dir: str) -> float:
    """Each trial's own training time: train_runtime is not in the eval reports, so take the
    time between its first and last report plus the first interval (time_total_s of the last)."""
    total = 0.0
    by_trial: dict[str, float] = {}
    for r in _reports(sweep_dir):
        by_trial[r["trial"]] = max(by_trial.get(r["trial"], 0.0), r.get("time_total_s", 0.0))
    for v in by_trial.values():
        total += v
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=180)
    p.add_argument("--eval-steps", type=int, default=15)
    p.add_argument("--target", type=float, default=0.97)
    ns = p.parse_args()

    import ray
    import torch

    torch.set_num_threads(1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(num_cpus=max(ns.concurrency, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}})
    out = tempfile.mkdtemp(prefix="hpo-bench-", dir=os.getcwd())
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; sweeps in {out}")
    results = {"random": [], "tpe+asha": []}
    for seed in range(ns.seeds):
        for label, sampler, scheduler in (("random", "random", "none"), ("tpe+asha", "tpe", "asha")):
            best, wall, sweep_dir = _sweep(out, f"{label.replace('+', '-')}-{seed}", seed, sampler, scheduler,
                                           ns.trials, ns.concurrency, ns.max_steps, ns.eval_steps)
            steps = steps_to_target(sweep_dir, ns.target)
            train_s = training_seconds(sweep_dir)
            table = best.run_summary
            results[label].append({"steps": steps, "total_steps": int(table["steps"].sum()), "wall": wall,
                                   "train": train_s, "best": best.objective, "trials": len(table)})
            print(f"seed {seed} {label:9s} steps-to-{ns.target}: {steps:>6.0f}  total steps {table['steps'].sum():>5d}"
                  f"  best {best.objective:.4f}  wall {wall:6.1f}s  trial time {train_s:6.1f}s", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    med = {k: statistics.median(r["steps"] for r in v) for k, v in results.items()}
    ratio = med["tpe+asha"] / med["random"] if med["random"] not in (0, float("inf")) else float("nan")
    print(f"\nsteps until a trial first reaches val accuracy {ns.target} (median of {ns.seeds} seeds): "
          f"random {med['random']:.0f}, TPE+ASHA {med['tpe+asha']:.0f}, ratio {ratio:.2f}x (target <= 0.5x)")
    for label, runs in results.items():
        wall = sum(r["wall"] for r in runs)
        train = sum(r["train"] for r in runs)
        trials = sum(r["trials"] for r in runs)
        per_trial = (wall * ns.concurrency - train) / trials
        print(f"{label:9s} overhead: wall {wall:.1f}s vs trials' own time {train:.1f}s "
              f"(x{wall / train * ns.concurrency:.2f} at concurrency {ns.concurrency}); "
              f"{per_trial:.2f}s per trial outside its training")


if __name__ == "__main__":
    main()
