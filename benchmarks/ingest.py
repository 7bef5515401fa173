"""Data ingest: raytrain's streams (Ray Data and Parquet files) against a torch DataLoader over the same
Parquet files; resume cost; data wait share of step time; worker memory against dataset size.

    python benchmarks/ingest.py [--rows 2000000] [--steps 200] [--threads 1]
                                [--part all|ingest|beside|resume|memory|wait]

ingest: `rows` rows (a 64-float32 tensor column in Ray's tensor type, and an int64 label) as 8 Parquet
files, read in one process through:
  torch_files     DataLoader over an IterableDataset reading the files with pyarrow: the reference
  torch_map       DataLoader(TensorDataset(rows in memory), shuffle=True)
  ray_data        ray.data.read_parquet(...).iter_torch_batches(batch_size=256, prefetch_batches=4)
  raytrain_ray    build_source(ray.data.read_parquet(...)): Ray Data runs beside the reader (row count from the
                  footers), the rank reads each window once its blocks exist
  raytrain_ray_1st  the same executed in full first (the path when the count or the CPUs are missing)
  raytrain_files  build_source(Files(..., stream=True)): row groups, windowed shuffle
rows/s start to finish and after the first batch, as ratios to torch_files; the time to the first batch
(Ray Data's start-up) is printed on its own, and the start-to-finish ratio with it taken out. The default
size (2M rows, ~0.5 GB) has the DataLoader take seconds, so that a fixed start-up does not decide alone.
beside: a range + map_batches dataset read by one rank, executed in full first vs streamed beside the reader
(with num_rows, and with no count as a train set with max_steps gets it).
resume: time to the first batch at 90% of an epoch against at its start (raytrain_files, raytrain_ray).
memory: each in a fresh process, the private resident memory (RssAnon) a rank gains streaming a Ray dataset
of 1x, 4x and 16x the window, and its whole RSS (which also counts object-store pages it read).
wait: trains digits and char-GPT and prints wait_s / train_runtime from the source's own accounting.
Timings never decide a test; they are printed here.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 256


def write_files(directory: str, rows: int, width: int = 64, files: int = 8) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data._internal.tensor_extensions.arrow import ArrowTensorArray
    rng = np.random.default_rng(0)
    per = rows // files
    for i in range(files):
        x = rng.standard_normal((per, width), dtype=np.float32)
        table = pa.table({"x": ArrowTensorArray.from_numpy(x), "labels": rng.integers(0, 10, per)})
        pq.write_table(table, os.path.join(directory, f"part-{i:03d}.parquet"), row_group_size=16384)


def timed(fn) -> tuple[int, float, float]:
    """(rows, seconds, seconds to the first batch)."""
    t0 = time.perf_counter()
    rows, first = 0, None
    for batch in fn():
        if first is None:
            first = time.perf_counter() - t0
        rows += len(batch["labels"])
    return rows, time.perf_counter() - t0, first or 0.0


def read_all(directory: str) -> dict[str, np.ndarray]:
    from raytrain.data.columns import table_to_numpy
    import pyarrow.parquet as pq
    parts = [table_to_numpy(pq.read_table(f), "bench", f) for f in sorted(glob.glob(f"{directory}/*.parquet"))]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class ParquetRows(torch.utils.data.IterableDataset):
    def __init__(self, directory: str):
        self.files = sorted(glob.glob(f"{directory}/*.parquet"))

    def __iter__(self):
        import pyarrow.parquet as pq
        from raytrain.data.columns import column_to_numpy
        for f in self.files:
            for rb in pq.ParquetFile(f).iter_batches(batch_size=BATCH):
                yield {name: torch.from_numpy(column_to_numpy(rb.column(i), name, "bench", f))
                       for i, name in enumerate(rb.schema.names)}


def part1(rows: int) -> None:
    import ray.data
    from raytrain.data import Files, build_source
    from raytrain.data.ray_data import execute
    with tempfile.TemporaryDirectory() as d:
        write_files(d, rows)
        mem = read_all(d)
        tensors = torch.utils.data.TensorDataset(torch.from_numpy(mem["x"]), torch.from_numpy(mem["labels"]))

        def torch_map():
            for x, y in torch.utils.data.DataLoader(tensors, batch_size=BATCH, shuffle=True):
                yield {"x": x, "labels": y}

        cases = {
            "torch_files": lambda: torch.utils.data.DataLoader(ParquetRows(d), batch_size=None),
            "torch_map": torch_map,
            "ray_data": lambda: ray.data.read_parquet(d).iter_torch_batches(batch_size=BATCH, prefetch_batches=4),
            "raytrain_ray": lambda: build_source(ray.data.read_parquet(d), BATCH, seed=0).iter_batches(0),
            "raytrain_ray_1st": lambda: build_source(execute(ray.data.read_parquet(d)), BATCH,
                                                     seed=0).iter_batches(0),
            "raytrain_files": lambda: build_source(Files(d, stream=True, buffer_bytes=32 << 20), BATCH,
                                                   seed=0).iter_batches(0),
        }
        timed(cases["ray_data"])  # warm Ray's worker pool once, as a long-running job would have it
        results = {name: timed(fn) for name, fn in cases.items()}
    n0, s0, f0 = results["torch_files"]
    ref, ref_after = n0 / s0, (n0 - BATCH) / (s0 - f0)
    print(f"\ntorch_files took {s0:.1f} s")
    print(f"\n== ingest: {rows} rows of 64 float32 + int64 label, batch {BATCH}, reference torch_files")
    print(f"{'reader':<16}{'rows/s':>12}{'x ref':>8}{'after 1st':>12}{'x ref':>8}{'first batch s':>15}")
    for name, (n, secs, first) in results.items():
        assert n == rows, (name, n)
        after = (n - BATCH) / (secs - first)
        print(f"{name:<16}{n / secs:>12,.0f}{n / secs / ref:>8.2f}{after:>12,.0f}{after / ref_after:>8.2f}"
              f"{first:>15.2f}")
    for name in ("ray_data", "raytrain_ray", "raytrain_ray_1st"):
        n, secs, first = results[name]
        print(f"{name}: start-up (to the first batch) {first:.2f} s; start to finish without it "
              f"{(n / (secs - first + f0)) / ref:.2f}x torch_files")


def _features(batch):
    """A map_batches stage with some work per row (64 features from the id), as tokenising would have."""
    ids = batch["id"]
    x = np.sin(ids[:, None] * np.arange(1, 65, dtype=np.float64)[None, :]).astype(np.float32)
    return {"x": x, "labels": ids % 10}


def part_beside(rows: int) -> None:
    """ray.data.range(rows, 40 blocks).map_batches(features) read by one rank: executed in full first
    (what a map_batches stage gets without num_rows) against beside the reader (RayData(num_rows=rows))."""
    import ray.data
    from raytrain.data import build_source
    from raytrain.data.ray_data import RayData
    make = lambda: ray.data.range(rows, override_num_blocks=40).map_batches(_features)  # noqa: E731
    cases = {"executed first": lambda: build_source(RayData(make()), BATCH, seed=0).iter_batches(0),
             "beside": lambda: build_source(RayData(make(), num_rows=rows), BATCH, seed=0).iter_batches(0),
             "beside, no count": lambda: build_source(RayData(make()), BATCH, seed=0,
                                                      length_optional=True).iter_batches(0)}
    ray.data.range(1000, override_num_blocks=4).map_batches(_features).materialize()  # warm Ray's workers
    print(f"\n== Ray Data with a map_batches stage, {rows} rows in 40 blocks, one rank: executed first vs beside")
    print(f"{'path':<18}{'first batch s':>15}{'total s':>10}{'rows/s':>12}")
    for name, fn in cases.items():
        n, secs, first = timed(fn)
        print(f"{name:<18}{first:>15.2f}{secs:>10.2f}{n / secs:>12,.0f}")


def part_resume(rows: int) -> None:
    """Time to the first batch when resuming at 90% of an epoch, against at its start (median of 5)."""
    import ray.data
    from raytrain.data import Files, build_source
    from raytrain.data.ray_data import execute
    with tempfile.TemporaryDirectory() as d:
        write_files(d, rows)
        ray_blocks = execute(ray.data.read_parquet(d))  # Ray Data runs once, as on the driver; not timed here
        make = {"raytrain_files": lambda: build_source(Files(d, stream=True, buffer_bytes=32 << 20), BATCH, seed=0),
                "raytrain_ray": lambda: build_source(ray_blocks, BATCH, seed=0)}
        print(f"\n== resume: first batch at 90% of the epoch vs at its start, {rows} rows, median of 5")
        print(f"{'source':<16}{'start s':>10}{'90% s':>10}{'ratio':>8}")
        for name, build in make.items():
            def first(fraction):
                times = []
                for _ in range(5):
                    source = build()  # a fresh source, as a resumed process has: nothing loaded ahead
                    t0 = time.perf_counter()
                    it = source.iter_batches(0, int(fraction * len(source)))
                    next(it)
                    times.append(time.perf_counter() - t0)
                    it.close()
                return sorted(times)[2]
            start, late = first(0.0), first(0.9)
            print(f"{name:<16}{start:>10.3f}{late:>10.3f}{late / start:>8.2f}")


MEMORY_PROBE = """
import gc, json, sys
import numpy as np, ray, ray.data
from raytrain.data import build_source
from raytrain.data.ray_data import RayData
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
ray.init(address=sys.argv[1], log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
window, times, width = int(sys.argv[2]), int(sys.argv[3]), 64
rows = times * window // (width * 4)
feat = lambda b: {"idx": b["id"], "x": np.repeat(b["id"][:, None].astype(np.float32), width, 1)}
ds = ray.data.range(rows, override_num_blocks=max(4, 2 * times)).map_batches(feat, batch_format="numpy")
source = build_source(RayData(ds, buffer_bytes=window), 256, seed=0)
gc.collect()
anon0, rss0, anon, rss = status("RssAnon:"), status("VmRSS:"), 0, 0
for batch in source.iter_batches(0):
    anon, rss = max(anon, status("RssAnon:") - anon0), max(rss, status("VmRSS:") - rss0)
print("RESULT " + json.dumps({"anon": anon, "rss": rss, "nbytes": source.reader.nbytes}))
"""


def part_memory(window: int = 8 << 20) -> None:
    import json
    import subprocess

    import ray
    address = ray.get_runtime_context().gcs_address
    print(f"\n== memory: one rank streaming a Ray dataset of k windows ({window >> 20} MiB each), fresh process each")
    print(f"{'k':>4}{'data MiB':>10}{'private MiB':>13}{'x window':>10}{'RSS MiB':>10}")
    env = {**os.environ, "PYTHONPATH": ROOT}
    for k in (1, 4, 16):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, address, str(window), str(k)], env=env,
                             capture_output=True, text=True, timeout=600)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{k:>4} failed: {out.stderr[-500:]}")
            continue
        r = json.loads(line[0][7:])
        print(f"{k:>4}{r['nbytes'] / 2**20:>10.1f}{r['anon'] / 2**20:>13.1f}{r['anon'] / window:>10.2f}"
              f"{r['rss'] / 2**20:>10.1f}")


def wait_fraction(name: str, trainer) -> None:
    out = trainer.train()
    source = trainer.callback_handler.train_dataloader
    runtime = out.metrics["train_runtime"]
    later = source.wait_s - (getattr(source, "first_wait_s", None) or 0.0)
    print(f"{name:<24}{type(source).__name__:<14}{out.global_step:>6}{1000 * runtime / out.global_step:>10.2f}"
          f"{1000 * source.wait_s / out.global_step:>10.3f}{100 * source.wait_s / runtime:>9.2f}%"
          f"{100 * later / runtime:>11.2f}%")


def part2(steps: int) -> None:
    from examples import chargpt
    from examples.digits import build_datasets as digits_data, build_model as digits_model
    from raytrain import Trainer, TrainingArguments
    import ray.data
    from raytrain.data import Files

    def args(out, bs, max_steps):
        return TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=bs,
                                 learning_rate=1e-3, save_strategy="no", logging_steps=10**6, disable_tqdm=True,
                                 report_to="none", overwrite_output_dir=True)
    with tempfile.TemporaryDirectory() as d:
        train, _ = digits_data()
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"pixels": pa.FixedSizeListArray.from_arrays(pa.array(train["pixels"].ravel()), 64),
                                 "labels": train["labels"]}), f"{d}/digits.parquet", row_group_size=128)
        ctrain, _ = chargpt.build_datasets(block_size=64, format="parquet", cache_dir=d)
        carrays, _ = chargpt.build_datasets(block_size=64)
        print(f"\n== data wait: share of step time inside next(batches), {torch.get_num_threads()} torch thread(s)")
        print(f"{'run':<24}{'source':<14}{'steps':>6}{'step ms':>10}{'wait ms':>10}{'wait':>10}{'after 1st':>12}")
        gpt = lambda: chargpt.build_model(n_layer=3, n_embd=96)  # noqa: E731  (the YAML's model)
        runs = [
            ("digits arrays", digits_model, train, 5 * steps),
            ("digits parquet", digits_model, f"{d}/digits.parquet", 5 * steps),
            ("digits parquet stream", digits_model, Files(f"{d}/digits.parquet", stream=True), 5 * steps),
            ("chargpt arrays", gpt, carrays, steps),
            ("chargpt parquet stream", gpt, Files(ctrain.path, stream=True, buffer_bytes=256 << 10), steps),
            ("digits ray data", digits_model, ray.data.from_items([{"pixels": p, "labels": int(y)} for p, y in
                                                                zip(train["pixels"], train["labels"])]), 5 * steps),
            ("chargpt ray data", gpt, ray.data.read_parquet(ctrain.path), steps),
        ]
        for name, model, data, n in runs:
            torch.manual_seed(0)
            wait_fraction(name, Trainer(model(), args(f"{d}/{name.replace(' ', '_')}", 32, n), train_dataset=data))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--steps", type=int, default=200, help="char-GPT steps; digits runs 5x as many")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a busy 2-core machine)")
    p.add_argument("--part", choices=["all", "ingest", "beside", "resume", "memory", "wait"], default="all")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    logging.basicConfig(level=logging.WARNING)
    import ray
    import ray.data
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    if ns.part in ("all", "ingest"):
        part1(ns.rows)
    if ns.part in ("all", "beside"):
        part_beside(ns.rows)
    if ns.part in ("all", "resume"):
        part_resume(ns.rows)
    if ns.part in ("all", "memory"):
        part_memory()
    if ns.part in ("all", "wait"):
        part2(ns.steps)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
