"""data.py / data_files.py: deterministic order, exact sharding, O(1) resume, bounded streaming,
every accepted input, every bad-input message, and the char-GPT example against its baseline."""

from __future__ import annotations

import gc
import json
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.data.data_helpers import Recorder
from tests.tiny import StopAt
from raytrain import Trainer, TrainingArguments
from raytrain.data import (DataError, DataFileNotFoundError, Files, MapSource, StreamSource, build_source,
    model_inputs, plan_epoch, trainer_datasets)
from raytrain.data.files import ParquetReader

N = 103


def columns(n: int = N, k: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"idx": np.arange(n), "x": rng.standard_normal((n, k)).astype(np.float32),
            "labels": rng.integers(0, 2, n)}


def write_parquet(directory, cols: dict, files: int = 3, row_group: int = 7) -> str:
    """`cols` as `files` Parquet files with small row groups; tensor columns as fixed_size_list."""
    os.makedirs(directory, exist_ok=True)
    arrays = {k: pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(len(v), -1).ravel()), v[0].size)
              if v.ndim > 1 else pa.array(v) for k, v in cols.items()}
    table = pa.table(arrays)
    n = table.num_rows
    for i in range(files):
        lo, hi = i * n // files, (i + 1) * n // files
        pq.write_table(table.slice(lo, hi - lo), os.path.join(directory, f"part-{i:03d}.parquet"),
                       row_group_size=row_group)
    return str(directory)


def ids(batches) -> list[list[int]]:
    return [b["idx"].tolist() for b in batches]


def write_text(directory, cols: dict, fmt: str, files: int = 8) -> str:
    """`cols` as `files` CSV or JSON-lines files (CSV: the first element of a tensor column only)."""
    os.makedirs(directory, exist_ok=True)
    n = len(cols["idx"])
    for i in range(files):
        rows = range(i * n // files, (i + 1) * n // files)
        if fmt == "csv":
            text = "idx,x0,labels\n" + "".join(f"{j},{cols['x'][j][0]!r},{cols['labels'][j]}\n" for j in rows)
        else:
            text = "".join(json.dumps({"idx": j, "x": cols["x"][j].tolist(), "labels": int(cols["labels"][j])}) + "\n"
                           for j in rows)
        with open(os.path.join(directory, f"part-{i:03d}.{'csv' if fmt == 'csv' else 'jsonl'}"), "w") as f:
            f.write(text)
    return str(directory)


_RAY_BLOCKS: dict = {}


def ray_blocks(n: int = N):
    """columns(n) as a ray Dataset with a map_batches stage, executed once per session (RayBlocks)."""
    if n not in _RAY_BLOCKS:
        import ray.data

        from raytrain.data.ray_data import execute
        items = [{"idx": i} for i in range(n)]
        cols = columns(n)

        def featurize(batch):  # runs in a Ray Data task: looks the rows up by id
            return {"idx": batch["idx"], "x": cols["x"][batch["idx"]], "labels": cols["labels"][batch["idx"]]}
        ds = ray.data.from_items(items, override_num_blocks=9).map_batches(featurize, batch_format="numpy")
        _RAY_BLOCKS[n] = execute(ds)
    return _RAY_BLOCKS[n]


@pytest.fixture
def parquet_dir(tmp_path, request):
    kind = getattr(getattr(request.node, "callspec", None), "params", {}).get("kind")
    if kind == "ray":
        request.getfixturevalue("ray_cluster")
    if kind in ("csv", "json"):
        write_text(tmp_path / kind, columns(), kind)
    return write_parquet(tmp_path / "pq", columns())


SOURCES = ["map", "stream", "csv", "json", "ray"]


def make(kind: str, parquet_dir: str, batch_size: int = 4, **kw):
    if kind == "map":
        return build_source(columns(), batch_size, **kw)
    if kind in ("csv", "json"):
        return build_source(Files(os.path.join(os.path.dirname(parquet_dir), kind), stream=True,
                                  buffer_bytes=300), batch_size, **kw)
    if kind == "ray":
        blocks = ray_blocks()
        blocks.buffer_bytes = 600
        return build_source(blocks, batch_size, **kw)
    return build_source(Files(parquet_dir, stream=True, buffer_bytes=600), batch_size, **kw)


# ---------------------------------------------------------------- order


@pytest.mark.parametrize("kind", SOURCES)
def test_order_depends_only_on_seed_and_epoch(kind, parquet_dir):
    a = ids(make(kind, parquet_dir, seed=7).iter_batches(0))
    assert a == ids(make(kind, parquet_dir, seed=7).iter_batches(0))
    assert a != ids(make(kind, parquet_dir, seed=8).iter_batches(0))
    assert a != ids(make(kind, parquet_dir, seed=7).iter_batches(1))
    flat = [i for b in a for i in b]
    assert flat != sorted(flat) and sorted(flat) == list(range(N))


@pytest.mark.parametrize("kind", SOURCES)
def test_resume_at_any_batch_continues_the_same_order(kind, parquet_dir):
    source = make(kind, parquet_dir, seed=3)
    full = ids(source.iter_batches(2))
    for k in (0, 1, 9, 13, len(full) - 1):
        assert ids(make(kind, parquet_dir, seed=3).iter_batches(2, k)) == full[k:]


def test_stream_prefetch_does_not_change_the_batches(parquet_dir):
    spec = dict(stream=True, buffer_bytes=600)
    eager = ids(build_source(Files(parquet_dir, prefetch_batches=0, **spec), 4, seed=1).iter_batches(0))
    ahead = ids(build_source(Files(parquet_dir, prefetch_batches=3, **spec), 4, seed=1).iter_batches(0))
    assert eager == ahead


def test_stream_shuffle_mixes_blocks_and_windows(parquet_dir):
    source = make("stream", parquet_dir, seed=0)
    assert source.num_windows > 3 and source.window_rows % 4 == 0
    assert len(source.blocks) == 15  # 3 files x row groups of 7 rows
    first = ids(source.iter_batches(0))[0]
    assert len({i // 7 for i in first}) >= 1 and first != sorted(first)


# ---------------------------------------------------------------- sharding


def shards(kind, parquet_dir, ws, drop_last, epoch=1, batch_size=4):
    per_rank = [ids(make(kind, parquet_dir, batch_size, seed=5, rank=r, world_size=ws, drop_last=drop_last)
                    .iter_batches(epoch)) for r in range(ws)]
    return per_rank


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_disjoint_and_cover_each_sample_once(kind, parquet_dir, ws, drop_last):
    per_rank = shards(kind, parquet_dir, ws, drop_last)
    assert len({len(r) for r in per_rank}) == 1  # every rank takes the same number of batches
    assert all(len(b) > 0 for r in per_rank for b in r)  # and never an empty one
    seen = [i for r in per_rank for b in r for i in b]
    assert len(seen) == len(set(seen))
    gb = 4 * ws
    if drop_last:
        assert len(seen) == N // gb * gb and all(len(b) == 4 for r in per_rank for b in r)
    else:
        assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("kind", SOURCES)
def test_a_tail_smaller_than_the_world_joins_the_last_batch(kind, parquet_dir):
    # 103 = 8 x 12 + 7 (7 >= 3: one more batch); with batch 5: 103 = 6 x 15 + 13; with 17: 2 x 51 + 1
    assert plan_epoch(103, 4, 3, False) == (9, 103)
    assert plan_epoch(103, 17, 3, False) == (2, 103)
    per_rank = shards(kind, parquet_dir, 3, False, batch_size=17)
    assert [len(r) for r in per_rank] == [2, 2, 2]
    assert [len(r[-1]) for r in per_rank] == [18, 17, 17]  # the 1 leftover sample goes to rank 0
    assert sorted(i for r in per_rank for b in r for i in b) == list(range(N))
    with pytest.raises(DataError, match="2 samples are fewer than the 3 ranks"):
        build_source({"x": np.zeros((2, 1))}, 4, world_size=3)


def test_mapsource_interface_is_kept():
    source = MapSource(columns(), 4, seed=1, rank=1, world_size=2)
    assert (len(source), source.num_samples, source.batch_size, source.seed, source.world_size) == (13, N, 4, 1, 2)
    assert source.state() == {"kind": "map", "num_samples": N, "batch_size": 4, "world_size": 2, "seed": 1,
                              "shuffle": True, "drop_last": False}
    assert source.batch_indices(0, 3).tolist() == [b["idx"].tolist() for b in source.iter_batches(0)][3]


# ---------------------------------------------------------------- resume through the Trainer


def run(out, data, stop=None, resume=None, **kw) -> Recorder:
    model = Recorder(features=4)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=30, learning_rate=0.1,
                             disable_tqdm=True, report_to="none", logging_steps=100, seed=0, **kw)
    Trainer(model, args, train_dataset=data, callbacks=[StopAt(stop)] if stop else []).train(resume)
    return model


@pytest.mark.parametrize("kind", ["map", "stream", "ray"])
def test_a_run_resumed_at_step_k_reads_what_the_uninterrupted_run_reads_from_k(kind, parquet_dir, tmp_path):
    data = {"map": columns(), "stream": Files(parquet_dir, stream=True, buffer_bytes=600), "ray": ray_blocks()}[kind]
    full = run(tmp_path / "full", data, save_strategy="no").seen
    assert len(full) == 30 and len(set(map(tuple, full[:26]))) == 26  # 26 batches per epoch: crosses into epoch 2
    for k in (5, 26, 27):
        out = tmp_path / f"stop{k}"
        run(out, data, stop=k, save_steps=k)
        saved = json.loads((out / f"checkpoint-{k}" / "data_state.json").read_text())
        assert saved["epoch"] * 26 + saved["next_batch"] == k and saved["kind"] == {"ray": "stream"}.get(kind, kind)
        assert run(out, data, resume=True, save_strategy="no").seen == full[k:]


def test_stream_resume_reads_one_window_not_the_consumed_data(parquet_dir, monkeypatch):
    reads = []
    original = ParquetReader.read
    monkeypatch.setattr(ParquetReader, "read", lambda self, blk, lo, hi: reads.append(hi - lo) or
                        original(self, blk, lo, hi))
    source = make("stream", parquet_dir, prefetch_batches=0, seed=2)
    reads.clear()
    next(source.iter_batches(0, len(source) - 1))
    source._ahead[1].result()  # the next epoch's first window, loaded in the background meanwhile
    last_lo = (source.num_windows - 1) * source.window_rows
    assert source._ahead[0] == (1, 0)
    assert sum(reads) == (N - last_lo) + source.window_rows  # the last window and the next one, nothing else


def test_early_stop_leaves_no_prefetch_thread_behind(parquet_dir):
    source = build_source(Files(parquet_dir, stream=True, buffer_bytes=600, prefetch_batches=2), 4)
    it = source.iter_batches(0)
    next(it), next(it)
    assert any(t.name.startswith("raytrain-") for t in threading.enumerate())
    it.close()
    del it, source  # the window loader thread ends with its source
    gc.collect()
    for t in threading.enumerate():
        if t.name.startswith("raytrain-"):
            t.join(timeout=5)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("raytrain-")]


# ---------------------------------------------------------------- streaming memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_streaming_keeps_memory_bounded(tmp_path):
    """160 MiB of Parquet (20x the 8 MiB shuffle window) read in a full shuffled epoch: resident memory
    and Arrow's allocations stay within a few windows, and every row comes once."""
    rows, width, per_file = 640_000, 64, 80_000
    directory = tmp_path / "big"
    directory.mkdir()
    rng = np.random.default_rng(0)
    for i in range(rows // per_file):
        x = rng.standard_normal((per_file, width), dtype=np.float32)
        table = pa.table({"idx": np.arange(i * per_file, (i + 1) * per_file),
                          "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width)})
        pq.write_table(table, directory / f"part-{i}.parquet", row_group_size=8192, compression="none")
        del x, table
    gc.collect()
    budget = 8 << 20
    source = build_source(Files(str(directory), buffer_bytes=budget, in_memory_bytes=budget), 256, seed=0)
    assert isinstance(source, StreamSource) and source.num_samples * width * 4 > 19 * budget
    base_rss, base_arrow = _rss(), pa.total_allocated_bytes()
    peak_rss = peak_arrow = 0
    total = count = 0
    for batch in source.iter_batches(0):
        assert batch["x"].shape[1:] == (width,) and batch["x"].dtype == torch.float32
        total += int(batch["idx"].sum())
        count += len(batch["idx"])
        peak_rss = max(peak_rss, _rss() - base_rss)
        peak_arrow = max(peak_arrow, pa.total_allocated_bytes() - base_arrow)
    assert count == rows and total == rows * (rows - 1) // 2
    assert peak_arrow < 4 * budget, peak_arrow
    assert peak_rss < 6 * budget, peak_rss  # the data is 20 budgets; a full read would be >= 160 MiB


# ---------------------------------------------------------------- inputs


def test_tensor_columns_arrive_as_tensors_from_every_columnar_input(tmp_path):
    cols = columns(12, k=3)
    image = np.arange(12 * 2 * 3, dtype=np.float32).reshape(12, 2, 3)
    tensor_type = pa.fixed_shape_tensor(pa.float32(), (2, 3))
    table = pa.table({"idx": cols["idx"], "x": pa.FixedSizeListArray.from_arrays(pa.array(cols["x"].ravel()), 3),
                      "image": pa.ExtensionArray.from_storage(tensor_type, pa.FixedSizeListArray.from_arrays(
                          pa.array(image.ravel()), 6)),
                      "ragged": pa.array([[1] * (i % 3 + 1) for i in range(12)])})
    pq.write_table(table, tmp_path / "t.parquet")
    for data in (table, str(tmp_path / "t.parquet"), Files(str(tmp_path / "t.parquet"), stream=True)):
        batch = next(iter(build_source(data, 4, shuffle=False).iter_batches(0)))
        assert batch["x"].shape == (4, 3) and batch["x"].dtype == torch.float32
        torch.testing.assert_close(batch["image"], torch.from_numpy(image[:4]))
        assert [len(r) for r in batch["ragged"]] == [1, 2, 3, 1]  # ragged rows stay rows, for a collator


def test_csv_and_json_lines_files(tmp_path):
    (tmp_path / "a.csv").write_text("idx,x\n" + "".join(f"{i},{i / 2}\n" for i in range(10)))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"idx": i, "x": [i, i]}) + "\n" for i in range(10)))
    csv = next(iter(build_source(str(tmp_path / "a.csv"), 10, shuffle=False).iter_batches(0)))
    assert csv["idx"].tolist() == list(range(10)) and csv["x"].dtype == torch.float64
    js = next(iter(build_source(str(tmp_path / "*.jsonl"), 10, shuffle=False).iter_batches(0)))
    assert js["x"].shape == (10, 2)


def test_preprocess_runs_on_each_block_in_both_modes(parquet_dir):
    def scale(batch):
        return {**batch, "x": batch["x"] * 2, "double": batch["idx"] * 2}
    for stream in (False, True):
        source = build_source(Files(parquet_dir, preprocess=scale, stream=stream), 8, shuffle=False)
        b = next(iter(source.iter_batches(0)))
        np.testing.assert_allclose(b["x"].numpy(), columns()["x"][:8] * 2)
        assert b["double"].tolist() == [2 * i for i in range(8)]


def test_torch_dataset_and_collator():
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"idx": i, "tokens": list(range(i % 4 + 1))}

    def pad(items):
        width = max(len(it["tokens"]) for it in items)
        return {"idx": torch.tensor([it["idx"] for it in items]),
                "input_ids": torch.tensor([it["tokens"] + [0] * (width - len(it["tokens"])) for it in items])}

    source = build_source(Items(), 4, seed=0, collate_fn=pad, columns=["input_ids"])
    seen = [i for b in source.iter_batches(0) for i in b["idx"].tolist()]
    assert sorted(seen) == list(range(10))


def test_ray_dataset_and_data_iterator_with_map_batches(ray_cluster):
    import ray.data

    def featurize(batch):
        return {"idx": batch["id"], "x": np.stack([batch["id"] * 1.0, -batch["id"] * 1.0], axis=1)}
    ds = ray.data.range(60, override_num_blocks=6).map_batches(featurize, batch_format="numpy")
    source = build_source(ds, 8, seed=1, rank=1, world_size=2)
    assert isinstance(source, StreamSource) and source.num_samples == 60 and len(source.blocks) == 6
    other = build_source(ds, 8, seed=1, rank=0, world_size=2)
    assert sorted(i for r in (source, other) for b in ids(r.iter_batches(0)) for i in b) == list(range(60))
    batch = next(iter(source.iter_batches(0)))
    torch.testing.assert_close(batch["x"][:, 0], batch["idx"].double())
    from_iterator = build_source(ds.iterator(), 8, seed=1, rank=1, world_size=2)  # get_dataset_shard's type
    assert ids(from_iterator.iter_batches(0)) == ids(source.iter_batches(0))
    with pytest.raises(DataError, match="one worker.s split"):
        build_source(ds.streaming_split(2)[0], 8)
    datasets, config = trainer_datasets({"train": ds, "eval": None, "other": columns()})
    assert list(datasets) == ["train"] and config._datasets_to_split == []
    with pytest.raises(DataError, match="the dataset is empty"):
        build_source(ds.filter(lambda row: False), 8)


# ---------------------------------------------------------------- bad input


def test_missing_paths_name_the_path(tmp_path):
    with pytest.raises(DataFileNotFoundError, match=r"train_dataset: no such file or directory: '.*nope.parquet'"):
        build_source(str(tmp_path / "nope.parquet"), 4, name="train_dataset")
    with pytest.raises(DataFileNotFoundError, match=r"no files match '.*\*.parquet'"):
        build_source(str(tmp_path / "*.parquet"), 4)
    with pytest.raises(DataFileNotFoundError, match="holds no Parquet, CSV or JSON-lines files"):
        build_source(str(tmp_path), 4)


def test_empty_datasets(tmp_path):
    with pytest.raises(DataError, match=r"dataset \(dict of arrays\): the dataset is empty \(0 samples\)"):
        build_source({"x": np.zeros((0, 3))}, 4)
    pq.write_table(pa.table({"x": pa.array([], pa.float32())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet\): the dataset is empty \(0 rows in 1 file"):
        build_source(str(tmp_path / "empty.parquet"), 4)


def test_unreadable_or_inconsistent_files(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet: not a readable Parquet file"):
        build_source(str(tmp_path / "bad.parquet"), 4)
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(pa.table({"x": [1.0], "y": [1]}), d / "a.parquet")
    pq.write_table(pa.table({"x": [1], "y": [1]}), d / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: column 'x' is int64, not double \(unlike .*a.parquet\)"):
        build_source(str(d), 4)
    pq.write_table(pa.table({"x": [1.0, None]}), tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match="column 'x' has 1 null values"):
        build_source(str(tmp_path / "nulls.parquet"), 4)
    with pytest.raises(DataError, match="preprocess must keep one row per input row"):
        build_source(Files(str(d / "a.parquet"), preprocess=lambda b: {"x": b["x"][:0]}), 4)
    (tmp_path / "data.txt").write_text("x\n1\n")
    with pytest.raises(DataError, match="data.txt: unknown format"):
        build_source(str(tmp_path / "data.txt"), 4)
    with pytest.raises(DataError, match="expected a dict of arrays, a pyarrow Table"):
        build_source(42, 4)


class Digits(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, pixels, labels=None):
        self.calls += 1
        logits = self.linear(pixels)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def digits_data(n=16, dtype=np.float32, label="labels"):
    rng = np.random.default_rng(0)
    return {"pixels": rng.standard_normal((n, 4)).astype(dtype), label: rng.integers(0, 2, n), "id": np.arange(n)}


def test_a_column_the_model_needs_is_named_before_training(tmp_path):
    write_parquet(tmp_path / "train", digits_data(label="label"), files=1)
    model = Digits()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, disable_tqdm=True, report_to="none")
    with pytest.raises(DataError, match=r"train_dataset \(.*train\): column 'labels' is missing from the data; "
                                        r"Digits.forward\(pixels, labels\) needs it; the data has \['id', "
                                        r"'label', 'pixels'\]"):
        Trainer(model, args, train_dataset=str(tmp_path / "train")).train()
    assert model.calls == 0
    with pytest.raises(DataError, match="column 'pixels' is missing from the data; the columns list needs it"):
        build_source({"x": np.zeros(4)}, 2, columns=["pixels"])
    with pytest.raises(DataError, match="column 'pixels' needed by the data_collator is missing"):
        build_source({"x": np.zeros(4)}, 2, collate_fn=lambda rows: {"pixels": [r["pixels"] for r in rows]},
                     columns=model_inputs(model))
    # Columns the model does not take are dropped, as HF's remove_unused_columns does.
    source = build_source(digits_data(), 4, columns=model_inputs(model))
    assert sorted(next(iter(source.iter_batches(0)))) == ["labels", "pixels"]


def test_an_eval_set_whose_schema_differs_fails_before_training(tmp_path):
    model = Digits()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, disable_tqdm=True, report_to="none")
    bad = digits_data(8, dtype=np.float64)
    with pytest.raises(DataError, match=r"eval_dataset \(dict of arrays\): column 'pixels' is float64 \[4\] here "
                                        r"but float32 \[4\] in train_dataset"):
        Trainer(model, args, train_dataset=digits_data(), eval_dataset=bad).train()
    missing = {k: v for k, v in digits_data(8).items() if k != "labels"}
    with pytest.raises(DataError, match="eval_dataset .*: column 'labels' is missing; train_dataset has it"):
        Trainer(model, args, train_dataset=digits_data(), eval_dataset=missing).train()
    assert model.calls == 0


def test_the_cli_prints_one_line_for_bad_data(tmp_path, capsys):
    from raytrain.run import main
    config = tmp_path / "c.yaml"
    config.write_text("model: {factory: 'examples.digits:build_model'}\n"
                      "data: {factory: 'tests.data.test_sources:bad_paths', where: '" + str(tmp_path / "x") + "'}\n"
                      f"output_dir: {tmp_path / 'out'}\nmax_steps: 1\n")
    assert main(["--config", str(config), "--resume", "never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    log = tmp_path / "out" / "raytrain.log"
    assert err == [f"error: train_dataset: no such file or directory: '{tmp_path / 'x' / 'train.parquet'}' "
                   f"(traceback in {log}; --debug prints it)"]


def bad_paths(where: str):
    return os.path.join(where, "train.parquet"), None


# ---------------------------------------------------------------- the char-GPT example


def test_chargpt_short_run_beats_the_unigram_baseline(tmp_path, capsys):
    from raytrain.run import main
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    overrides = ["max_steps=600", "model.n_layer=1", "model.n_embd=64", "data.block_size=32",
                 "per_device_train_batch_size=16", "eval_strategy='no'", "save_strategy='no'", "warmup_steps=10",
                 "learning_rate=0.006", f"output_dir={tmp_path / 'out'}", "disable_tqdm=true"]
    argv = ["--config", os.path.join(root, "examples", "chargpt.yaml"), "--resume", "never"]
    assert main(argv + [a for o in overrides for a in ("--set", o)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.split("summary: ")[-1])
    baseline = summary["eval_unigram_baseline"]
    assert 3.0 < baseline < 3.3  # nats per character of the validation text
    assert summary["eval_loss"] < baseline - 0.7, summary  # about 2.2 against 3.15
