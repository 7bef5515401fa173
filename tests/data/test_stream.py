"""Streaming Ray Data and files (data_stream.py, data_ray.py): never hangs, per-rank shares that cover each
epoch exactly once, map_batches on the cluster, bounded worker memory, one-line errors, and a worker
SIGKILLed from outside that ends bit-exact with the uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from raytrain import Files, RayData, Trainer, TrainingArguments
from raytrain.data import DataError, StreamSource, build_source
from tests.strategies._helpers import state_digest
from tests.data.data_helpers import IdLog, Recorder
from tests.data.ray_stages import featurize_ids as _featurize
from tests.data.ray_stages import featurize_range as _featurize_ids
from tests.data.test_sources import columns, ids, write_parquet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd: list[str], timeout: int) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:]


# ---------------------------------------------------------------- never hangs


# Long (1 minute, its own cluster): by default Ray Data streams into training on the session's cluster in the
# tests below, and a stage that cannot run fails in one line (test_bad_input_is_one_line_naming_...).
@pytest.mark.long
@pytest.mark.timeout(600)
def test_two_workers_on_a_two_cpu_cluster_train_from_ray_datasets(tmp_path):
    """Its own cluster of exactly 2 CPUs (tests/data/data_helpers.py): 2 workers holding both CPUs train on
    from_items and evaluate on range + map_batches, and finish; a stage that can never run fails in one
    line, naming it."""
    result = json.loads(_run([sys.executable, os.path.join(ROOT, "tests", "data", "data_helpers.py"), str(tmp_path)], 540))
    assert result["cpus"] == 2 and result["from_items"] == 4
    [evaluated] = result["range_map_batches"]
    assert evaluated["step"] == 4 and math.isfinite(evaluated["eval_loss"])
    stalled = result["stalled"]
    assert "\n" not in stalled and "Ray Data produced no block for 5 s (0 so far)" in stalled
    assert "stage MapBatches(featurize) waits with" in stalled and "of 2 cluster CPUs free" in stalled


# ---------------------------------------------------------------- coverage, determinism, the stage's process


def _ray_items(n: int):
    import ray.data
    return ray.data.from_items([{"idx": i} for i in range(n)], override_num_blocks=10).map_batches(
        _featurize, batch_format="numpy")


def _epochs(data, seed: int, world_size: int = 2, epochs: int = 2, batch_size: int = 4):
    """Per epoch, per rank: the ids of each batch."""
    sources = [build_source(data, batch_size, seed=seed, rank=r, world_size=world_size) for r in range(world_size)]
    return [[ids(s.iter_batches(e)) for s in sources] for e in range(epochs)]


def test_two_ranks_cover_each_epoch_once_in_a_seeded_order(ray_cluster, tmp_path):
    parquet = Files(write_parquet(tmp_path / "pq", columns(), files=8, row_group=5), stream=True, buffer_bytes=400)
    assert len(os.listdir(tmp_path / "pq")) == 8
    from raytrain.data.ray_data import start
    # map_batches: Ray cannot count it, so it is executed first; with num_rows, streamed while it is read.
    # Each runs once here; the sources of every rank and run below share its blocks, as workers do.
    first = start(RayData(_ray_items(90), buffer_bytes=400))
    beside = start(RayData(_ray_items(90), buffer_bytes=400, num_rows=90))
    # a train set with max_steps needs no count: streamed too, its epoch 0 ends when Ray Data does
    unknown = start(RayData(_ray_items(90), buffer_bytes=400), length_optional=True)
    assert first.complete and not beside.complete and not unknown.length_known
    # the same order whichever way Ray Data ran: a resumed run may take the other way
    assert _epochs(beside, seed=3, world_size=3) == _epochs(first, seed=3, world_size=3) == \
        _epochs(unknown, seed=3, world_size=3)
    for data, n in ((parquet, 103), (first, 90)):
        runs = _epochs(data, seed=3)
        for per_rank in runs:
            assert len(per_rank[0]) == len(per_rank[1])  # equal step counts
            seen = [i for rank in per_rank for b in rank for i in b]
            assert sorted(seen) == list(range(n))  # every id exactly once per epoch
            assert not set(i for b in per_rank[0] for i in b) & set(i for b in per_rank[1] for i in b)
        assert runs[0] != runs[1]  # a new order each epoch
        assert _epochs(data, seed=3) == runs  # identical on a re-run
        assert _epochs(data, seed=4) != runs  # and different with another seed
    # resumed on another world size: exactly the rest of the epoch (Ray's interleaved layout, its blocks)
    _resumed_elsewhere(lambda world, bs, r: build_source(first, bs, seed=3, rank=r, world_size=world), 90,
                       worlds=((3, 4),))


def test_read_parquet_is_counted_from_its_footers_and_streams_with_a_footer_pool_the_cluster_fits(ray_cluster,
                                                                                                  tmp_path):
    """ray.data.read_parquet of 8 files: its count comes from the footers (no execution), so it streams beside
    the readers; Ray's pool of 32 footer-reading actors is capped at one per two cluster CPUs (4 here: 2);
    two ranks read every id once per epoch, with equal steps."""
    import ray
    import ray.data

    from raytrain.data.ray_data import _ops, start
    d = write_parquet(tmp_path / "pq", columns(), files=8, row_group=5)
    ds = ray.data.read_parquet(d)
    indexers = [getattr(op, "file_indexer", None) for op in _ops(ds._logical_plan.dag)]
    pools = [i._num_actors for i in indexers if hasattr(i, "_num_actors")]
    blocks = start(RayData(ds, buffer_bytes=400))
    assert blocks.length_known and blocks.num_rows == 103
    if pools:  # Ray versions before the footer pool (2.60) have nothing to cap
        assert pools == [32] and [i._num_actors for i in indexers if hasattr(i, "_num_actors")] == \
            [int(ray.cluster_resources()["CPU"]) // 2] == [2]
    per_rank = [ids(build_source(blocks, 4, seed=1, rank=r, world_size=2).iter_batches(0)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 13
    assert sorted(i for rank in per_rank for b in rank for i in b) == list(range(103))


def test_ray_data_streams_beside_the_reader_and_falls_back_in_one_line(ray_cluster, tmp_path, caplog):
    """Blocks after the first are held back by the stage until a file exists: batches of the first block
    arrive before Ray Data has produced the rest (it runs beside, not before), and the epoch completes once
    they come. A known count with too few spare CPUs, or an unknown count, executes first, said in one line."""
    import logging

    import ray.data

    from raytrain.data.ray_data import start
    gate = tmp_path / "go"

    def held(batch):
        while batch["id"][0] >= 20 and not gate.exists():
            time.sleep(0.05)
        return batch
    ds = ray.data.range(100, override_num_blocks=5).map_batches(held, batch_format="numpy")
    source = build_source(RayData(ds, buffer_bytes=160, num_rows=100), 4, seed=0, shuffle=False)
    assert source.window_rows == 20  # 8-byte rows: the first window is the first block
    batches = source.iter_batches(0)
    head = [next(batches)["id"].tolist() for _ in range(5)]
    assert head == [[i, i + 1, i + 2, i + 3] for i in range(0, 20, 4)] and not source.reader.complete
    gate.write_text("")
    assert [i for b in head for i in b] + [i for b in batches for i in b["id"].tolist()] == list(range(100))
    assert len(next(source.iter_batches(1))["id"]) == 4  # epoch 1 permutes all blocks: it waits for the end
    assert source.reader.complete and len(source.blocks) == 5
    # No count (map_batches may change it) and training for max_steps: streamed beside as well. A window is
    # read once the rows published prove it is not the last (whose place needs the count): here the first
    # of 20 rows once 40 exist. The epoch ends when Ray Data's does, with the sharding rule's tail.
    gate.unlink()

    def held_later(batch):
        while batch["id"][0] >= 40 and not gate.exists():
            time.sleep(0.05)
        return batch
    ds = ray.data.range(100, override_num_blocks=5).map_batches(held_later, batch_format="numpy")
    alone = build_source(RayData(ds, buffer_bytes=160), 4, seed=0, shuffle=False, length_optional=True)
    with pytest.raises(TypeError, match="has no length"):
        len(alone)
    assert next(alone.iter_batches(0))["id"].tolist() == [0, 1, 2, 3] and not alone.reader.complete
    gate.write_text("")
    ranks = [build_source(alone.reader, 4, seed=0, rank=r, world_size=3) for r in range(3)]
    epochs = [[[b["id"].tolist() for b in s.iter_batches(e)] for s in ranks] for e in (0, 1)]
    for per_rank in epochs:
        assert {len(r) for r in per_rank} == {9}
        assert sorted(i for r in per_rank for b in r for i in b) == list(range(100))
    with caplog.at_level(logging.INFO, logger="raytrain.data.ray_data"):
        assert start(ray.data.range(10).map_batches(_featurize_ids), "train_dataset", spare_cpus=8).complete
        assert start(ray.data.range(10), "train_dataset", spare_cpus=0.5).complete
        assert not start(ray.data.from_items([{"idx": 1}]), "train_dataset", spare_cpus=0).complete  # no task
    lines = [r.getMessage() for r in caplog.records if r.name == "raytrain.data.ray_data"]
    assert len(lines) == 2 and all("\n" not in ln for ln in lines)
    assert lines[0].startswith("train_dataset: Ray Data executes it in full before training: Ray cannot count "
                               "its rows without running it (MapBatches(featurize_range) may change the row count)")
    assert "its stage ReadRange needs 1 CPU(s) and the cluster has 0.5 beside the training workers; give it 0.5 " \
           "more CPU(s)" in lines[1]


def test_a_trainer_streams_a_dataset_ray_cannot_count_when_max_steps_is_set(ray_cluster, tmp_path, caplog):
    """In-process: map_batches with no num_rows and max_steps 30 streams beside training (no info line of an
    execution first); the steps, their ids and the weights are those of the counted run (23 batches of 4
    per epoch: the epoch ends when Ray Data's does), and a resume at step 10 reads what it read from there."""
    import logging

    def run(out, data, **kw):
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=30, per_device_train_batch_size=4,
                                 learning_rate=0.1, save_steps=10, seed=0, disable_tqdm=True, report_to="none")
        trainer = Trainer(Recorder(), args, train_dataset=data)
        trainer.train(**kw)
        return trainer
    counted = run("counted", RayData(_ray_items(90), buffer_bytes=400, num_rows=90))
    with caplog.at_level(logging.INFO, logger="raytrain.data.ray_data"):
        unknown = run("unknown", RayData(_ray_items(90), buffer_bytes=400))
    assert not [r for r in caplog.records if "executes it in full" in r.getMessage()]
    assert unknown.model.seen == counted.model.seen
    assert state_digest(unknown.model.state_dict()) == state_digest(counted.model.state_dict())
    assert sorted(i for b in unknown.model.seen[:23] for i in b) == list(range(90))
    resumed = run("unknown", RayData(_ray_items(90), buffer_bytes=400),
                  resume_from_checkpoint=str(tmp_path / "unknown" / "checkpoint-10"))
    assert resumed.model.seen == counted.model.seen[10:]


def test_map_batches_runs_in_a_ray_process_not_the_trainers(ray_cluster):
    source = build_source(_ray_items(40), 8, seed=0)
    pids = {int(p) for b in source.iter_batches(0) for p in b["pid"]}
    assert pids and os.getpid() not in pids


# ---------------------------------------------------------------- memory


MEMORY_PROBE = """
import gc, json, os, sys
import numpy as np, ray, ray.data
from raytrain.data import RayData, build_source
from raytrain.data.stream import _trim

def private():  # resident anonymous memory: what this process holds itself (object-store pages are shared)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

ray.init(address=sys.argv[1], log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
window, width, world_size = int(sys.argv[2]), 64, int(sys.argv[3])
rows = 10 * window // (width * 4)
def feat(b):
    return {"idx": b["id"], "x": np.repeat(b["id"][:, None].astype(np.float32), width, 1)}
ds = ray.data.range(rows, override_num_blocks=20).map_batches(feat, batch_format="numpy")
source = build_source(RayData(ds, buffer_bytes=window), 256, seed=0, rank=0, world_size=world_size)
peaks, counts, totals = [], [], []
for epoch in range(4):  # epoch 0 warms up (thread arenas, Arrow's pool, Ray's buffers); 1-3 are measured
    gc.collect(); _trim()
    base, peak, total, count = private(), 0, 0, 0
    for batch in source.iter_batches(epoch):
        total += int(batch["idx"].sum()); count += len(batch["idx"])
        peak = max(peak, private() - base)
    peaks.append(peak); counts.append(count); totals.append(total)
print("RESULT " + json.dumps({"peaks": peaks, "counts": counts, "totals": totals, "rows": rows,
                              "nbytes": source.reader.nbytes}))
"""


@pytest.mark.timeout(300)
def test_worker_memory_stays_within_two_windows_whatever_the_workers(ray_cluster):
    """A Ray dataset 10x the 4 MiB window, read by rank 0 of 1 and of 2 workers, each in a fresh process: the
    private resident memory that streaming adds (after a warm-up epoch, from a collected start; the median
    of 3 epochs, so that a busy machine's one late free does not decide) stays under 2 windows, and it
    reads exactly its share each epoch."""
    import ray
    window = 4 << 20
    address = ray.get_runtime_context().gcs_address
    growth = {}
    for world_size in (1, 2):
        r = json.loads(_run([sys.executable, "-c", MEMORY_PROBE, address, str(window), str(world_size)], 240))
        assert r["nbytes"] > 10 * window and set(r["counts"]) == {r["rows"] // world_size}
        if world_size == 1:
            assert set(r["totals"]) == {r["rows"] * (r["rows"] - 1) // 2}
        growth[world_size] = sorted(r["peaks"][1:])[1]
        assert growth[world_size] < 2 * window, r
    assert abs(growth[1] - growth[2]) < window, growth  # independent of the number of workers


# ---------------------------------------------------------------- bad input


def test_bad_input_is_one_line_naming_the_stage_file_or_column(ray_cluster, tmp_path):
    import ray.data

    def explode(batch):
        if (batch["id"] >= 5).any():
            raise ValueError(f"cannot tokenize row {int(batch['id'][-1])}")
        return batch
    with pytest.raises(DataError) as e:
        build_source(ray.data.range(10, override_num_blocks=2).map_batches(explode), 4, name="train_dataset")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train_dataset (ray Dataset MapBatches(explode)): stage ")
    assert "MapBatches(explode) raised ValueError: cannot tokenize row 9" in msg
    with pytest.raises(DataError, match=r"\(ray Dataset .*\): the dataset is empty \(0 rows\)"):
        build_source(ray.data.range(10).filter(lambda row: False), 4)
    with pytest.raises(DataError, match=r"train_dataset \(.*\): column 'labels' is missing from the data"):
        build_source(ray.data.range(10), 4, columns=["labels"], name="train_dataset")

    (tmp_path / "a.csv").write_text("idx,x\n1,0.5\n")
    (tmp_path / "b.csv").write_text("idx,y\n2,0.5\n")
    with pytest.raises(DataError, match=r"b.csv: column 'x' is missing \(unlike .*a.csv\)"):
        build_source(Files(str(tmp_path / "*.csv"), stream=True), 1)

    def broken(batch):
        raise KeyError("text")
    d = write_parquet(tmp_path / "pq", columns(), files=2)
    with pytest.raises(DataError, match=r"dataset \(.*part-000.parquet row group 0\): preprocess broken raised "
                                        r"KeyError: 'text'"):
        build_source(Files(d, stream=True, preprocess=broken), 4)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_csv_and_json_stream_in_bounded_windows_and_resume_exactly(tmp_path, fmt):
    def write(name, rows):
        lines = [f"{i},{i / 2}" if fmt == "csv" else json.dumps({"idx": i, "x": i / 2}) for i in rows]
        (tmp_path / f"{name}.{fmt}").write_text(("idx,x\n" if fmt == "csv" else "") + "\n".join(lines) + "\n")
    write("a", range(50))
    write("b", range(50, 77))
    spec = Files(str(tmp_path / f"*.{fmt}"), stream=True, buffer_bytes=160)
    source = build_source(spec, 5, seed=1)
    assert isinstance(source, StreamSource) and source.num_samples == 77 and len(source.blocks) == 2
    assert source.num_windows >= 3 and source.window_rows % 5 == 0  # a window is a few batches, not a file
    full = ids(source.iter_batches(0))
    flat = [i for b in full for i in b]
    assert sorted(flat) == list(range(77)) and flat != sorted(flat)
    assert ids(build_source(spec, 5, seed=1).iter_batches(0, 9)) == full[9:]
    assert next(iter(source.iter_batches(0)))["x"].dtype == torch.float64


def _resumed_elsewhere(make, n: int, stop: int = 5, worlds=((1, 4), (3, 4), (4, 2))):
    """Ranks of world 2 (batch 4) read `stop` batches of epoch 0; each other (world, batch size) resumes
    from that state: its ranks take equal step counts, the epoch's ids are each seen once (none lost, none
    repeated), a second interruption of the resumed epoch (then world 2 again) keeps that, and epoch 1 is
    the new world's own whole pass."""
    old = [make(2, 4, r) for r in range(2)]
    head = [i for s in old for b in ids(s.iter_batches(0))[:stop] for i in b]
    saved = {"epoch": 0, "next_batch": stop, **old[0].state()}
    for world, bs in worlds:
        new = [make(world, bs, r) for r in range(world)]
        starts = {s.resume_at(dict(saved)) for s in new}
        rest = [ids(s.iter_batches(0, *starts)) for s in new]
        assert len(starts) == 1 and len({len(r) for r in rest}) == 1 and starts.pop() + len(rest[0]) == len(new[0])
        assert sorted(head + [i for r in rest for b in r for i in b]) == list(range(n))
        second = {"epoch": 0, "next_batch": len(new[0]) - len(rest[0]) + 1, **new[0].state()}
        again = [make(2, 4, r) for r in range(2)]
        tail = [ids(s.iter_batches(0, s.resume_at(dict(second)))) for s in again]
        assert sorted(head + [i for r in rest for i in r[0]] + [i for r in tail for b in r for i in b]) == \
            list(range(n))
        assert [ids(s.iter_batches(1)) for s in new] == [ids(make(world, bs, r).iter_batches(1))
                                                        for r in range(world)]
    # the same layout resumes at the saved batch, as the uninterrupted run reads it
    assert ids(make(2, 4, 1).iter_batches(0, make(2, 4, 1).resume_at(dict(saved)))) == \
        ids(old[1].iter_batches(0))[stop:]


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_stream_resumed_on_another_world_size_reads_exactly_the_rest_of_the_epoch(tmp_path, interleaved):
    """In-process (sources for each rank, no Ray): files read as one range per rank, and (interleaved) with
    Ray Data's layout, windows of the ranks interleaved along the stream."""
    from raytrain.data.sharding import Layout
    spec = Files(write_parquet(tmp_path / "pq", columns(), files=4, row_group=7), stream=True, buffer_bytes=1500)

    def make(world, bs, rank):
        s = build_source(spec, bs, seed=3, rank=rank, world_size=world)
        if interleaved:  # Ray Data's reader says so (arrives_in_order); the layout is the same code
            s.in_order = True
            Layout.__init__(s, s.num_samples, bs, world, rank, False, s.window_rows, True)
        assert s.window_rows < s.range_rows  # windows begun and not begun at the interruption
        return s
    _resumed_elsewhere(make, 103)


def test_a_trainer_resumed_with_another_batch_size_reads_exactly_the_rest_of_the_epoch(tmp_path, caplog):
    """The Trainer's resume goes through the same layout (in-process: a changed batch size; a changed world
    size enters it the same way): 5 steps of 4, then the 83 ids left in batches of 2 from batch 10 to the
    epoch's end, each once; then epoch 1 as a fresh run of batch size 2 reads it."""
    import logging

    spec = Files(write_parquet(tmp_path / "pq", columns(), files=2, row_group=10), stream=True, buffer_bytes=400)

    def args(bs, steps):
        return TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=bs,
                                 save_steps=5, seed=0, disable_tqdm=True, report_to="none")
    first = Trainer(Recorder(4), args(4, 5), train_dataset=spec)
    first.train()
    resumed = Trainer(Recorder(4), args(2, 49), train_dataset=spec)
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        resumed.train(resume_from_checkpoint=True)
    msg = next(r.getMessage() for r in caplog.records if "the rest of epoch" in r.getMessage())
    assert "batch_size 4 -> 2" in msg and "each once) is split between this run's ranks from batch 10" in msg
    seen = [i for b in first.model.seen + resumed.model.seen[:42] for i in b]
    assert sorted(seen) == list(range(103)) and len(resumed.model.seen) == 44
    assert resumed.model.seen[42:] == ids(build_source(spec, 2, seed=0).iter_batches(1))[:2]


def test_file_uris_read_through_pyarrow_fs_as_local_paths_do(tmp_path):
    """A URI (here file://; s3:// and gs:// alike) of a directory, a glob and a file: listed and read through
    pyarrow.fs, streamed or in memory, the same batches as the local path; a missing one is one line."""
    from raytrain.data import DataFileNotFoundError
    d = write_parquet(tmp_path / "pq", columns(), files=3, row_group=10)
    uri = "file://" + d
    for local, remote in ((d, uri), (os.path.join(d, "*.parquet"), uri + "/*.parquet")):
        for stream in (True, False):
            a, b = (build_source(Files(p, stream=stream, buffer_bytes=400), 4, seed=2) for p in (local, remote))
            assert ids(a.iter_batches(0)) == ids(b.iter_batches(0)) and b.num_samples == 103
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"idx": i, "x": i / 2}) + "\n" for i in range(9)))
    got = build_source(Files("file://" + str(tmp_path / "a.jsonl"), stream=True, buffer_bytes=64), 3, seed=0)
    assert sorted(i for b in ids(got.iter_batches(0)) for i in b) == list(range(9))
    with pytest.raises(DataFileNotFoundError, match=r"^train_dataset: no such file or directory: 'file:///nowhere/x'$"):
        build_source(Files("file:///nowhere/x"), 4, name="train_dataset")


# ---------------------------------------------------------------- SIGKILL from outside


def _consumed(out_dir, rank: int) -> dict[int, list[int]]:
    """step -> ids for one rank, the steps a restart replayed taken from the attempt that kept them."""
    steps: dict[int, list[int]] = {}
    with open(os.path.join(out_dir, f"ids-rank{rank}.jsonl")) as f:
        for rec in map(json.loads, f):
            steps = {s: v for s, v in steps.items() if s <= rec["start"]} if rec["step"] == rec["start"] + 1 \
                else steps
            steps[rec["step"]] = rec["ids"]
    return steps


# Long (2-3 minutes): by default a SIGKILLed Ray worker resumes bit-exact in driver/test_launch.py and a stream
# resumes exactly the rest of its epoch (another world size, another batch size) in the tests above.
@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_worker_sigkilled_mid_epoch_resumes_bit_exact_with_exact_passes(ray_cluster, tmp_path):
    """2 workers on a ray Dataset (90 ids, 2 x 4 per step: 12 steps per epoch, 30 steps): rank 1 is
    SIGKILLed from this process as step 16 begins, just after checkpoint-15 was handed to Ray (whose
    controller registers it when it next polls, every 0.5 s in these tests, 2 s by Ray's default: maybe
    never); the group restarts from checkpoint-15, which raytrain registers with Ray where it lies in
    storage if Ray did not, so that Ray's num_to_keep (save_total_limit=1) leaves checkpoint-30 alone
    there at the end."""
    def args(out, limit=None, **kw):
        return TrainingArguments(output_dir=str(out), max_steps=30, per_device_train_batch_size=4, learning_rate=0.1,
                                 save_steps=5, logging_steps=5, seed=0, disable_tqdm=True, report_to="none",
                                 save_total_limit=limit,
                                 scaling={"num_workers": 2, "storage_path": str(tmp_path / "ray"), **kw},
                                 distributed={"strategy": "ddp"})
    # streamed beside training (4 CPUs, 2 workers); no count (map_batches): max_steps bounds training and
    # epoch 0 ends when Ray Data's pass does
    data = RayData(_ray_items(90), buffer_bytes=400)
    reference = Trainer(Recorder(), args(tmp_path / "ref"), train_dataset=data, callbacks=[IdLog()])
    reference.train()
    # the 2 workers' checkpoint-5 resumed by one process (another world size): exactly the 50 ids left of
    # epoch 0, in 13 steps
    alone = Trainer(Recorder(), TrainingArguments(output_dir=str(tmp_path / "alone"), max_steps=18,
                                                  per_device_train_batch_size=4, learning_rate=0.1, seed=0,
                                                  disable_tqdm=True, report_to="none", save_strategy="no"),
                    train_dataset=data)
    alone.train(resume_from_checkpoint=str(tmp_path / "ref" / "checkpoint-5"))
    head = [i for r in (0, 1) for s, batch in _consumed(tmp_path / "ref", r).items() if s <= 5 for i in batch]
    assert len(alone.model.seen) == 13 and sorted(head + [i for b in alone.model.seen for i in b]) == list(range(90))

    out = tmp_path / "killed"
    killed: list[int] = []

    def killer():
        path = out / "pid-rank1"
        deadline = time.time() + 400
        while not path.exists() and time.time() < deadline:
            time.sleep(0.2)
        if path.exists():
            time.sleep(0.2)
            pid = int(path.read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    trainer = Trainer(Recorder(), args(out, 1, max_failures=1), train_dataset=data, callbacks=[IdLog(pause_after=15)])
    result = trainer.train()
    thread.join(timeout=5)
    assert killed and result.global_step == 30
    stored = [json.load(open(m))["global_step"] for m in (tmp_path / "ray").glob("killed-*/*/manifest.json")]
    assert stored == [30]
    # on this one disk Ray's copy is the output_dir's files, hard-linked (written once)
    (manifest,) = (tmp_path / "ray").glob("killed-*/*/manifest.json")
    assert os.stat(manifest.parent / "model.safetensors").st_ino == os.stat(out / "checkpoint-30" / "model.safetensors").st_ino
    assert state_digest(trainer.model.state_dict()) == state_digest(reference.model.state_dict())
    for run in (tmp_path / "ref", out):
        per_rank = [_consumed(run, r) for r in (0, 1)]
        assert sorted(per_rank[0]) == list(range(1, 31))
        for epoch in (0, 1):
            steps = range(12 * epoch + 1, 12 * epoch + 13)
            seen = [i for ranks in per_rank for s in steps for i in ranks[s]]
            assert sorted(seen) == list(range(90))  # exactly one pass
    assert [_consumed(out, r) for r in (0, 1)] == [_consumed(tmp_path / "ref", r) for r in (0, 1)]
