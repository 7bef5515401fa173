"""Data ingest: rows/s of Ray Data against a torch DataLoader over the same Parquet rows, and the share
of training step time spent waiting for data in a digits run and a char-GPT run.

    python benchmarks/ingest.py [--rows 1000000] [--steps 200] [--threads 1]

Part 1 writes `rows` rows (a 64-float32 tensor column in Ray's tensor type, and an int64 label) as
Parquet and reads them, in one process, through:
  ray_data        ray.data.read_parquet(...).iter_torch_batches(batch_size=256, prefetch_batches=4)
  torch_map       DataLoader(TensorDataset(rows in memory), batch_size=256, shuffle=True): the reference
  torch_iterable  DataLoader over an IterableDataset reading the same files with pyarrow
  raytrain_map    raytrain.data.build_source(files) (in memory, seeded global shuffle)
  raytrain_stream raytrain.data.build_source(Files(..., stream=True)) (windowed shuffle, prefetch)
and prints rows/s and the ratio to torch_map; Ray Data also with its start-up (time to first batch)
left out. Part 2 trains and prints wait_s / train_runtime from the source's own accounting (the time
the loop spent inside next(batches)). Timings never decide a test; they are printed here.
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
    from raytrain.data_files import table_to_numpy
    import pyarrow.parquet as pq
    parts = [table_to_numpy(pq.read_table(f), "bench", f) for f in sorted(glob.glob(f"{directory}/*.parquet"))]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class ParquetRows(torch.utils.data.IterableDataset):
    def __init__(self, directory: str):
        self.files = sorted(glob.glob(f"{directory}/*.parquet"))

    def __iter__(self):
        import pyarrow.parquet as pq
        from raytrain.data_files import column_to_numpy
        for f in self.files:
            for rb in pq.ParquetFile(f).iter_batches(batch_size=BATCH):
                yield {name: torch.from_numpy(column_to_numpy(rb.column(i), name, "bench", f))
                       for i, name in enumerate(rb.schema.names)}


def part1(rows: int) -> None:
    import ray
    import ray.data
    from raytrain.data import Files, build_source
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    with tempfile.TemporaryDirectory() as d:
        write_files(d, rows)
        mem = read_all(d)
        tensors = torch.utils.data.TensorDataset(torch.from_numpy(mem["x"]), torch.from_numpy(mem["labels"]))

        def torch_map():
            for x, y in torch.utils.data.DataLoader(tensors, batch_size=BATCH, shuffle=True):
                yield {"x": x, "labels": y}

        cases = {
            "torch_map": torch_map,
            "torch_iterable": lambda: torch.utils.data.DataLoader(ParquetRows(d), batch_size=None),
            "ray_data": lambda: ray.data.read_parquet(d).iter_torch_batches(batch_size=BATCH, prefetch_batches=4),
            "raytrain_map": lambda: build_source(d, BATCH, seed=0).iter_batches(0),
            "raytrain_stream": lambda: build_source(Files(d, stream=True, buffer_bytes=32 << 20), BATCH,
                                                    seed=0).iter_batches(0),
        }
        timed(cases["ray_data"])  # warm Ray's worker pool once, as a long-running job would have it
        results = {name: timed(fn) for name, fn in cases.items()}
    ref = results["torch_map"][0] / results["torch_map"][1]
    print(f"\n== ingest: {rows} rows of 64 float32 + int64 label, batch {BATCH}, reference torch_map")
    print(f"{'reader':<18}{'rows/s':>12}{'x torch_map':>13}{'first batch s':>15}")
    for name, (n, secs, first) in results.items():
        assert n == rows, (name, n)
        print(f"{name:<18}{n / secs:>12,.0f}{n / secs / ref:>13.2f}{first:>15.2f}")
    n, secs, first = results["ray_data"]
    print(f"{'ray_data steady':<18}{(n - BATCH) / (secs - first):>12,.0f}{(n - BATCH) / (secs - first) / ref:>13.2f}"
          "   (time to the first batch left out)")


def wait_fraction(name: str, trainer) -> None:
    out = trainer.train()
    source = trainer.callback_handler.train_dataloader
    runtime = out.metrics["train_runtime"]
    print(f"{name:<24}{type(source).__name__:<14}{out.global_step:>6}{1000 * runtime / out.global_step:>10.2f}"
          f"{1000 * source.wait_s / out.global_step:>10.3f}{100 * source.wait_s / runtime:>9.2f}%")


def part2(steps: int) -> None:
    from examples import chargpt
    from examples.digits import build_datasets as digits_data, build_model as digits_model
    from raytrain import Trainer, TrainingArguments
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
        print(f"{'run':<24}{'source':<14}{'steps':>6}{'step ms':>10}{'wait ms':>10}{'wait':>10}")
        gpt = lambda: chargpt.build_model(n_layer=3, n_embd=96)  # noqa: E731  (the YAML's model)
        runs = [
            ("digits arrays", digits_model, train, 5 * steps),
            ("digits parquet", digits_model, f"{d}/digits.parquet", 5 * steps),
            ("digits parquet stream", digits_model, Files(f"{d}/digits.parquet", stream=True), 5 * steps),
            ("chargpt arrays", gpt, carrays, steps),
            ("chargpt parquet stream", gpt, Files(ctrain.path, stream=True, buffer_bytes=256 << 10), steps),
        ]
        for name, model, data, n in runs:
            torch.manual_seed(0)
            wait_fraction(name, Trainer(model(), args(f"{d}/{name.replace(' ', '_')}", 32, n), train_dataset=data))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=200, help="char-GPT steps; digits runs 5x as many")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a busy 2-core machine)")
    p.add_argument("--part", choices=["all", "ingest", "wait"], default="all")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    logging.basicConfig(level=logging.WARNING)
    if ns.part in ("all", "ingest"):
        import ray
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        part1(ns.rows)
    if ns.part in ("all", "wait"):
        part2(ns.steps)


if __name__ == "__main__":
    main()
