"""Mixture-of-experts losses as transformers 5.23 computes them: compute_loss returns HF's value (num_items_in_batch
given to the forward, which adds router_aux_loss_coef x its router loss; HF's process count factor), and a tiny
Qwen3-MoE and Mixtral train to HF's per-step losses, in process and on 2 Ray workers (against HF's Trainer
compute_loss on each rank's batch with 2 processes, accelerate's batches for each rank)."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from tests.hf import moe_jobs as jobs  # by this name on the Ray workers too

from .scripts import LIBS

KINDS = ["qwen3_moe", "mixtral"]


def _compute_loss(lib, kind, tmp_path, processes, num_items, forward=None, **kw):
    Trainer, TrainingArguments = LIBS[lib][0]()
    loss_func = kw.pop("compute_loss_func", None)
    trainer = Trainer(model=jobs.model(kind), args=TrainingArguments(str(tmp_path / lib), **{**jobs.COMMON, **kw}),
                      compute_loss_func=loss_func)
    rows = jobs.Rows(8)
    batch = torch.utils.data.default_collate([rows[i] for i in range(0, 8, 2)])
    with mock.patch.object(trainer.accelerator.state, "num_processes", processes):
        loss = trainer.compute_loss(trainer.model, {**batch, **(forward or {})}, num_items_in_batch=num_items)
    loss.backward()
    grad = next(p for n, p in trainer.model.named_parameters() if "gate" in n).grad
    return float(loss), grad.clone()


def _ce(outputs, labels, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, vocab_size=jobs.VOCAB, num_items_in_batch=num_items_in_batch)


#: (case, processes, num_items_in_batch, the forward's extra inputs, arguments)
CASES = [("model_loss", 2, torch.tensor(40), None, {}),
         ("tuple_output", 2, torch.tensor(40), {"return_dict": False}, {}),
         ("router_off", 2, torch.tensor(40), {"output_router_logits": False}, {}),
         ("no_count", 2, None, None, {}),
         ("averaging_off", 2, torch.tensor(40), None, {"average_tokens_across_devices": False}),
         ("label_smoothing", 2, torch.tensor(40), None, {"label_smoothing_factor": 0.1}),
         ("compute_loss_func", 3, torch.tensor(40), None, {"compute_loss_func": _ce})]


@pytest.mark.parametrize("processes, num_items, forward, kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_compute_loss_is_hfs(processes, num_items, forward, kw, tmp_path):
    want = _compute_loss("hf", "qwen3_moe", tmp_path, processes, num_items, forward, **dict(kw))
    got = _compute_loss("rt", "qwen3_moe", tmp_path, processes, num_items, forward, **dict(kw))
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)  # the router's gradient: the aux loss's


def _train(lib, kind, out, **kw):
    Trainer, TrainingArguments = LIBS[lib][0]()
    extra = {"data_order": "hf"} if lib == "rt" else {}  # HF's sampler order
    args = TrainingArguments(str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             num_train_epochs=1, **jobs.COMMON, **extra)
    trainer = Trainer(model=jobs.model(kind, **kw), args=args, train_dataset=jobs.Rows(22))
    trainer.train()
    return jobs.losses(trainer)


@pytest.mark.parametrize("kind", KINDS)
def test_moe_trains_to_hfs_losses_in_process(kind, tmp_path):
    """22 rows in batches of 4, 2 micro-batches a step: 3 steps, the last of one batch of 2 rows."""
    want = _train("hf", kind, tmp_path / "hf")
    got = _train("rt", kind, tmp_path / "rt")
    assert len(got) == 3 and got == pytest.approx(want, abs=1e-5)
    without = _train("rt", kind, tmp_path / "no_router_loss", coef=0.0)
    assert min(g - w for g, w in zip(got, without)) > 1e-3  # the router loss is in HF's (and raytrain's) loss


def _rows_seen(directory, rows) -> dict[int, list[list[int]]]:
    """Each rank's micro-batches as dataset indices, from the rows its model saw."""
    index = {json.dumps(r["input_ids"].tolist()): i for i, r in enumerate(rows)}
    return {rank: [[index[json.dumps(x)] for x in json.loads(line)]
                   for line in (directory / f"rank{rank}.jsonl").read_text().splitlines()] for rank in (0, 1)}


def _accelerate_batches(n, batch_size, rank, seed) -> list[list[int]]:
    """Rank `rank`'s batches of epoch 0 as transformers' Trainer's loader gives them on 2 processes with
    accelerator_config split_batches (accelerate's split of each global batch, the last one filled)."""
    from accelerate.data_loader import prepare_data_loader

    loader = torch.utils.data.DataLoader(list(range(n)), batch_size=batch_size,
                                         sampler=torch.utils.data.RandomSampler(list(range(n))))
    loader = prepare_data_loader(loader, num_processes=2, process_index=rank, split_batches=True, even_batches=True,
                                 use_seedable_sampler=True, data_seed=seed)
    loader.set_epoch(0)
    return [b.tolist() for b in loader]


def _two_workers(kind: str, out) -> tuple:
    """accelerator_config split_batches on 2 Ray workers, each training forward's rows recorded."""
    from raytrain import Trainer, TrainingArguments

    record = out / "rows"
    record.mkdir(parents=True)
    net = jobs.model(kind)
    net.register_forward_pre_hook(jobs.RecordRows(str(record)), with_kwargs=True)
    args = TrainingArguments(str(out / "rt"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             num_train_epochs=1, data_order="hf", accelerator_config={"split_batches": True},
                             scaling={"num_workers": 2}, **jobs.COMMON)
    rows = jobs.Rows(19)
    return Trainer(model=net, args=args, train_dataset=rows), record, rows


def _check_two_workers(kind: str, trainer, record, rows, out) -> None:
    """Each rank took half of each global batch of 4 that accelerate gives it (19 rows: the last batch filled from
    the epoch's start, even_batches; the seedable sampler's order), and the losses are those HF's compute_loss gives
    on 2 processes (router loss included)."""
    seen = _rows_seen(record, rows)
    assert seen == {rank: _accelerate_batches(19, 4, rank, seed=0) for rank in (0, 1)}
    assert [len(b) for b in seen[0]] == [2] * 5
    want = jobs.two_process_oracle(kind, rows, seen, 2, str(out / "oracle"))
    got = jobs.losses(trainer)
    assert len(got) == 3 and got == pytest.approx(want, abs=1e-5)


_SHIPPED: dict = {}


def group_part(root):
    """The Qwen3-MoE run in the session's worker group (conftest.py), shipped as Trainer.train ships it."""
    from tests.group import ship

    _SHIPPED["qwen3_moe"] = _two_workers("qwen3_moe", root)
    return "tests.group:run_cases", {"cases": {"qwen3_moe": ship(_SHIPPED["qwen3_moe"][0], "qwen3_moe")}}


@pytest.mark.ray
@pytest.mark.xdist_group("worker_group")
@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
def test_two_workers_train_moe_as_hf_on_two_processes(worker_group):
    """Qwen3-MoE on 2 Ray workers (the session's worker group), then in the driver's trainer as Trainer.train
    leaves it."""
    from tests.group import land, part

    root, values = part(worker_group, __file__)
    trainer, record, rows = _SHIPPED["qwen3_moe"]
    assert land(trainer, values["qwen3_moe"]).global_step == 3
    _check_two_workers("qwen3_moe", trainer, record, rows, root)


@pytest.mark.ray
@pytest.mark.long  # a second architecture's router loss on workers: test_two_workers_train_moe_as_hf_on_two_processes
@pytest.mark.timeout(600)
def test_two_workers_train_mixtral_as_hf_on_two_processes(ray_cluster, tmp_path):
    trainer, record, rows = _two_workers("mixtral", tmp_path)
    trainer.train()
    _check_two_workers("mixtral", trainer, record, rows, tmp_path)
