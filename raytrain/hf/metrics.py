"""The Trainer's own metrics in HF's shapes: memory deltas per stage ({stage}_mem_*), and how
log_metrics prints and save_metrics writes a run's metrics."""

from __future__ import annotations

import json
import os
import resource
from typing import Any

import torch


class MemoryTracker:
    """HF's memory metrics for init, train, eval and test: CPU (and GPU) memory allocated and peaked
    between start(stage) and stop(stage)."""

    def __init__(self):
        self.started: dict[str, dict[str, int]] = {}
        self.init_metrics: dict[str, int] = {}

    def start(self, stage: str) -> None:
        start = {"cpu": _rss_bytes(), "peak": _peak_rss_bytes()}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            start["gpu"] = torch.cuda.memory_allocated()
        self.started[stage] = start

    def stop(self, stage: str) -> dict[str, int]:
        """The stage's metrics; init's are kept and reported with the first train/eval/test, as HF."""
        if stage not in self.started:
            return {}
        start = self.started.pop(stage)
        out = {f"{stage}_mem_cpu_alloc_delta": _rss_bytes() - start["cpu"],
               f"{stage}_mem_cpu_peaked_delta": max(0, _peak_rss_bytes() - max(start["peak"], _rss_bytes()))}
        if "gpu" in start:
            out[f"{stage}_mem_gpu_alloc_delta"] = torch.cuda.memory_allocated() - start["gpu"]
            out[f"{stage}_mem_gpu_peaked_delta"] = max(0, torch.cuda.max_memory_allocated()
                                                       - torch.cuda.memory_allocated())
        if stage == "init":
            self.init_metrics = out
            return out
        out = {**self.init_metrics, **out}
        self.init_metrics = {}
        return out


def format_metrics(metrics: dict[str, float]) -> dict[str, Any]:
    """HF's formatting for log_metrics: memory deltas in MB, runtimes as h:mm:ss, floats to 4 digits."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if "_mem_" in k:
            out[k] = f"{v >> 20}MB"
        elif "_runtime" in k:
            h, rem = divmod(int(v), 3600)
            m, s = divmod(rem, 60)
            out[k] = f"{h}:{m:02d}:{s:02d}.{int(100 * (v - int(v))):02d}"
        elif k == "total_flos":
            out[k] = f"{int(v) >> 30}GF"
        elif isinstance(v, float):
            out[k] = round(v, 4)
        else:
            out[k] = v
    return out


def print_metrics(split: str, metrics: dict[str, float]) -> None:
    """A header, then one aligned `key = value` line each (HF's log_metrics)."""
    print(f"***** {split} metrics *****")
    shown = format_metrics(metrics)
    width = max((len(k) for k in shown), default=0)
    for key in sorted(shown):
        print(f"  {key: <{width}} = {shown[key]}")


def write_metrics(output_dir: str, split: str, metrics: dict[str, float], combined: bool = True) -> None:
    """`{split}_results.json`, merged into all_results.json when `combined` (HF's save_metrics)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{split}_results.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=4, sort_keys=True)
    if combined:
        path = os.path.join(output_dir, "all_results.json")
        merged = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                merged = json.load(f)
        merged.update(metrics)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(merged, f, indent=4, sort_keys=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
