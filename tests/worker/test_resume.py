"""Exact resume: a run stopped at any step and continued from its checkpoint ends bit-identical to the
run that never stopped (weights, logged losses, grad norms, learning rates), with O(1) data skipping,
callback state restored, and loud failures when a resumed run would differ."""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import pytest
import torch

from examples.digits import build_model
from tests.tiny import StopAt
from raytrain import EarlyStoppingCallback, Trainer, TrainingArguments
from raytrain.data import MapSource

N, BATCH = 40, 4  # 10 batches per epoch
LOGGED = ("loss", "grad_norm", "learning_rate", "epoch", "step")


@pytest.fixture(autouse=True)
def _restore_determinism():
    """full_determinism switches torch's deterministic algorithms on globally: switch them back."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def make_data(n: int = N) -> dict:
    rng = np.random.default_rng(0)
    return {"pixels": rng.random((n, 64), dtype=np.float32), "labels": rng.integers(0, 10, n)}


class CountingDataset:
    """A map-style dataset that records every index it is asked for."""

    def __init__(self, n: int = N):
        self.columns = make_data(n)
        self.fetched: list[int] = []

    def __len__(self):
        return len(self.columns["labels"])

    def __getitem__(self, i):
        self.fetched.append(i)
        return {k: v[i] for k, v in self.columns.items()}


def make_trainer(out, *, init_seed: int = 0, data=None, callbacks=(), **kw) -> Trainer:
    args = dict(output_dir=str(out), per_device_train_batch_size=BATCH, learning_rate=0.05, warmup_steps=2,
                lr_scheduler_type="cosine", logging_steps=1, save_steps=1, full_determinism=True, seed=0,
                disable_tqdm=True, report_to="none")
    args.update(kw)
    torch.manual_seed(init_seed)  # a different init proves that the weights come from the checkpoint
    return Trainer(build_model(hidden_size=16, dropout=0.3), TrainingArguments(**args),
                   train_dataset=data if data is not None else make_data(), callbacks=list(callbacks))


def logged(trainer) -> list[dict]:
    return [{k: h.get(k) for k in LOGGED} for h in trainer.state.log_history if "loss" in h]


def assert_same_weights(a: Trainer, b: Trainer) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs"


@functools.lru_cache(maxsize=None)
def _reference(tmp_root: str, ga: int, steps: int):
    """The uninterrupted run (no checkpoints at all): final weights, log, train_loss."""
    t = make_trainer(os.path.join(tmp_root, f"ref-{ga}"), gradient_accumulation_steps=ga, max_steps=steps,
                     save_strategy="no")
    out = t.train()
    return t, logged(t), out.training_loss


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory):
    _reference.cache_clear()
    return str(tmp_path_factory.mktemp("reference"))


# steps per epoch: 10 with ga=1, 3 with ga=4 (windows of 4, 4, 2 micro-batches)
SCHEDULES = {1: dict(steps=25, spe=10), 4: dict(steps=8, spe=3)}
POINTS = {"first": lambda s, e: 1, "mid_epoch": lambda s, e: e + e // 2 + 1, "epoch_boundary": lambda s, e: e,
          "last": lambda s, e: s - 1, "end": lambda s, e: s}


@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("point", list(POINTS))
def test_resume_is_bit_exact(tmp_path, ref_root, ga, point):
    steps, spe = SCHEDULES[ga]["steps"], SCHEDULES[ga]["spe"]
    k = POINTS[point](steps, spe)
    ref, ref_log, ref_loss = _reference(ref_root, ga, steps)

    interrupted = make_trainer(tmp_path, gradient_accumulation_steps=ga, max_steps=steps, callbacks=[StopAt(k)])
    interrupted.train()
    assert interrupted.state.global_step == k
    assert os.path.isdir(tmp_path / f"checkpoint-{k}")

    resumed = make_trainer(tmp_path, init_seed=123, gradient_accumulation_steps=ga, max_steps=steps)
    out = resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == steps
    assert_same_weights(ref, resumed)
    assert logged(resumed) == ref_log  # losses, grad norms, learning rates, epochs: bitwise equal floats
    assert len(ref_log) == steps
    assert out.training_loss == ref_loss


def test_resume_at_epoch_end_with_epoch_logging_is_bit_exact(tmp_path, ref_root):
    """The step-end checkpoint of an epoch's last step comes before its epoch-end log: the resumed run
    logs it, grad_norm included (the loop state carries it)."""
    kw = dict(max_steps=20, logging_strategy="epoch", save_strategy="steps", save_steps=10)
    ref = make_trainer(tmp_path / "ref", **{**kw, "save_strategy": "no"})
    ref.train()
    make_trainer(tmp_path / "run", callbacks=[StopAt(10)], **kw).train()
    resumed = make_trainer(tmp_path / "run", init_seed=7, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    assert_same_weights(ref, resumed)
    assert logged(resumed) == logged(ref) and len(logged(ref)) == 2
    assert all(h["grad_norm"] is not None for h in logged(resumed))


def test_resume_from_sharded_weights_is_bit_exact(tmp_path, ref_root, monkeypatch):
    from raytrain.checkpoint import weights as ckpt_weights
    monkeypatch.setattr(ckpt_weights, "MAX_SHARD_BYTES", 2048)
    ref, ref_log, _ = _reference(ref_root, 1, 25)
    make_trainer(tmp_path, max_steps=25, callbacks=[StopAt(13)]).train()
    assert os.path.exists(tmp_path / "checkpoint-13" / "model.safetensors.index.json")
    resumed = make_trainer(tmp_path, init_seed=5, max_steps=25)
    resumed.train(resume_from_checkpoint=True)
    assert_same_weights(ref, resumed)
    assert logged(resumed) == ref_log


class ConstantScore:
    """compute_metrics whose score never improves after the first evaluation."""

    def __call__(self, pred):
        return {"score": 1.0}


def test_early_stopping_counter_survives_resume_bit_exact(tmp_path):
    kw = dict(max_steps=30, eval_strategy="steps", eval_steps=2, metric_for_best_model="score",
              greater_is_better=True)

    def trainer(out, stop=None, **extra):
        t = make_trainer(out, **kw, **extra, callbacks=[EarlyStoppingCallback(early_stopping_patience=3)]
                         + ([StopAt(stop)] if stop else []))
        t.eval_dataset, t.compute_metrics = make_data(8), ConstantScore()
        return t

    ref = trainer(tmp_path / "ref", save_strategy="no")
    ref.train()
    assert ref.state.global_step == 8  # best at 2, misses at 4, 6, 8 -> patience 3 reached
    trainer(tmp_path / "run", stop=6).train()
    resumed = trainer(tmp_path / "run")
    es = next(c for c in resumed.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
    resumed.train(resume_from_checkpoint=True)
    # Restored counter 2 at step 6: one more miss at 8 stops it there (a fresh counter would run to 12).
    assert resumed.state.global_step == 8
    assert es.early_stopping_patience_counter == 3
    assert_same_weights(ref, resumed)
    assert logged(resumed) == logged(ref)


def test_resume_skips_consumed_batches_without_reading_them(tmp_path):
    """O(1) skip: after resuming at step k the dataset is asked for exactly the remaining batches,
    starting with batch k's items; nothing consumed before is fetched again."""
    steps, k = 25, 17  # epoch 1, batch 7
    make_trainer(tmp_path, data=CountingDataset(), max_steps=steps, callbacks=[StopAt(k)]).train()
    data = CountingDataset()
    resumed = make_trainer(tmp_path, data=data, max_steps=steps)
    resumed.train(resume_from_checkpoint=True)
    source = MapSource(make_data(), BATCH, seed=0)
    expected = [i for step in range(k, steps)
                for i in source.batch_indices(step // 10, step % 10).tolist()]
    assert data.fetched[:BATCH] == source.batch_indices(1, 7).tolist()
    assert data.fetched == expected
    assert len(data.fetched) == (steps - k) * BATCH


@pytest.mark.parametrize("change, expected", [
    (dict(data=make_data(44)), "num_samples 40 -> 44"),
    (dict(data_seed=3), "seed 0 -> 3"),
])
def test_resume_with_changed_data_fails_naming_the_change(tmp_path, change, expected):
    make_trainer(tmp_path, max_steps=10, callbacks=[StopAt(5)]).train()
    resumed = make_trainer(tmp_path, max_steps=10, **change)
    with pytest.raises(ValueError, match="resuming would change the data order") as err:
        resumed.train(resume_from_checkpoint=True)
    assert expected in str(err.value)
    assert "checkpoint-5" in str(err.value) and "ignore_data_skip" in str(err.value)
    assert resumed.state.global_step == 0


@pytest.mark.parametrize("change, expected, next_batch", [
    (dict(per_device_train_batch_size=8), "batch_size 4 -> 8", 2),        # 20 samples -> 2.5 batches of 8
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps 1 -> 2", 5),
])
def test_resume_with_changed_batch_size_or_accumulation_continues_at_the_same_sample(
        tmp_path, caplog, change, expected, next_batch):
    """As HF: a changed batch size or accumulation resumes (with a warning) at the sample position
    reached, in the same order; the partial batch's samples are seen again, never skipped."""
    make_trainer(tmp_path, max_steps=10, callbacks=[StopAt(5)]).train()
    data = CountingDataset()
    resumed = make_trainer(tmp_path, data=data, max_steps=7, **change)
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        resumed.train(resume_from_checkpoint=True)
    assert expected in caplog.text and "epoch 0 continues at sample 20 of the same order" in caplog.text
    bs = change.get("per_device_train_batch_size", BATCH)
    order = MapSource(make_data(), bs, seed=0).order(0).tolist()
    assert data.fetched[:bs] == order[next_batch * bs:(next_batch + 1) * bs]
    assert resumed.state.global_step == 7


def test_resume_with_ignore_data_skip_restarts_the_epoch(tmp_path, caplog):
    make_trainer(tmp_path, max_steps=10, callbacks=[StopAt(5)]).train()
    data = CountingDataset()
    resumed = make_trainer(tmp_path, data=data, max_steps=8, ignore_data_skip=True)
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        resumed.train(resume_from_checkpoint=True)
    assert "max_steps 10 -> 8" in caplog.text  # the schedule change is named
    assert data.fetched[:BATCH] == MapSource(make_data(), BATCH, seed=0).batch_indices(0, 0).tolist()
    assert resumed.state.global_step == 8


def test_every_loop_field_is_saved_or_deliberately_not(tmp_path):
    """A guard: a new field of the loop's run state must be saved in loop_state.json (and restored),
    or be listed here as rebuilt on resume; otherwise resume silently drifts (as last_lr once did)."""
    import dataclasses
    import json

    from raytrain.worker.run_state import RunState
    rebuilt = {"trainer", "strategy", "data", "steps_per_epoch", "num_batches", "exhausted", "writer",
               "last_saved", "epoch", "next_batch",  # these two travel in data_state.json
               "count_tokens", "start_time", "start_tokens",  # this session's (tokens/s, as HF's)
               "tokens_pending",  # flushed into TrainerState before every save
               "sync_each_batch"}  # read from the arguments (accelerator_config) at each start
    make_trainer(tmp_path, max_steps=1).train()
    saved = json.load(open(tmp_path / "checkpoint-1" / "loop_state.json"))
    # tr_loss's shares and the layout they were held on
    assert {f.name for f in dataclasses.fields(RunState)} - rebuilt == set(saved) - {"tr_loss_by_rank", "tr_loss_layout"}
    assert saved["tr_loss_by_rank"] is None  # one process: tr_loss is its only share


def _with_cpu_scaler(trainer: Trainer) -> Trainer:
    """fp16 needs CUDA, but torch's GradScaler also runs on CPU: give the strategy one, so that the
    scaler.pt path (saved, restored) is exercised here. Growth every 2 steps makes its state move."""
    strategy = trainer.get_strategy()
    strategy.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return trainer


def test_loss_scaler_state_is_saved_and_restored(tmp_path):
    ref = _with_cpu_scaler(make_trainer(tmp_path / "ref", max_steps=8, save_strategy="no"))
    ref.train()
    _with_cpu_scaler(make_trainer(tmp_path / "run", max_steps=8, callbacks=[StopAt(5)])).train()
    assert os.path.exists(tmp_path / "run" / "checkpoint-5" / "scaler.pt")
    resumed = _with_cpu_scaler(make_trainer(tmp_path / "run", init_seed=9, max_steps=8))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.get_strategy().scaler.state_dict() == ref.get_strategy().scaler.state_dict()
    assert ref.get_strategy().scaler.get_scale() == 2.0**12  # grew 4 times: the state did move
    assert_same_weights(ref, resumed)
    assert logged(resumed) == logged(ref)


def test_unlogged_loss_shares_come_back_only_on_the_layout_that_held_them():
    """Each rank's share of the unlogged loss returns to it on the same layout (bit-exact logs); on another layout of
    the same world size (dp4 -> pp2 x tp2, whose log sums a TP index's ranks only) the sum goes to rank 0."""
    from types import SimpleNamespace

    from raytrain.worker.run_state import load_loop_state

    saved = {"tr_loss": 10.0, "tr_loss_by_rank": [1.0, 2.0, 3.0, 4.0], "tr_loss_layout": {"dp_shard_size": 4},
             "total_loss": 0.0, "last_logged": 0, "nonfinite": [], "skipped_steps": 0}

    def restored(layout: dict, rank: int) -> float:
        strategy = SimpleNamespace(world_size=4, rank=rank, is_main=rank == 0, layout=layout, device="cpu")
        run = SimpleNamespace(strategy=strategy, tr_loss=torch.tensor(0.0), last_lr=None)
        load_loop_state(run, saved)
        return float(run.tr_loss)

    assert [restored({"dp_shard_size": 4}, r) for r in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert [restored({"pp_size": 2, "tp_size": 2}, r) for r in range(4)] == [10.0, 0.0, 0.0, 0.0]
