"""accelerator_config as accelerate defines it, in process (the 2-worker run is tests/hf/test_moe_loss.py's: a batch
split, the last batch filled from the epoch's start, the seedable sampler's order, each rank's batches accelerate's):
transformers' tables, trainer.accelerator's settings, state and gradient_state against HF's Trainer's, training
against HF's Trainer with the same settings, and what cannot apply refused in one line."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from raytrain.config.sections import ConfigError
from raytrain.data.errors import DataError

from . import scripts
from .scripts import hf, rt


def test_the_tables_are_transformers_and_accelerates():
    from accelerate.utils import GradientAccumulationPlugin
    from transformers.trainer_pt_utils import AcceleratorConfig

    from raytrain.hf.accelerate_config import DEFAULTS, GRADIENT_ACCUMULATION

    assert DEFAULTS == {f.name: f.default for f in dataclasses.fields(AcceleratorConfig)}
    assert GRADIENT_ACCUMULATION == {f.name: f.default for f in dataclasses.fields(GradientAccumulationPlugin)
                                     if f.name in GRADIENT_ACCUMULATION}
    assert set(GRADIENT_ACCUMULATION) == {f.name for f in dataclasses.fields(GradientAccumulationPlugin)} - {
        "num_steps"} | {"num_steps"}


CONFIGS = [None, {"split_batches": True, "dispatch_batches": True, "even_batches": False, "non_blocking": True},
           {"use_seedable_sampler": False, "gradient_accumulation_kwargs": {"sync_each_batch": True}},
           {"gradient_accumulation_kwargs": {"adjust_scheduler": False, "sync_with_dataloader": False}},
           {"gradient_accumulation_kwargs": {"num_steps": 3}}]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_trainer_accelerator_reads_as_hfs(config, tmp_path):
    seen = {}
    for lib, make in (("hf", hf), ("rt", rt)):
        Trainer, TrainingArguments = make()
        args = TrainingArguments(str(tmp_path / lib), accelerator_config=copy.deepcopy(config), **scripts.COMMON)
        acc = Trainer(model=scripts.TinyRegressor(), args=args).accelerator
        g = acc.gradient_state
        seen[lib] = (acc.split_batches, acc.dispatch_batches, acc.even_batches, acc.use_seedable_sampler,
                     acc.non_blocking, g.plugin_kwargs, g.num_steps, g.adjust_scheduler, g.sync_with_dataloader,
                     g.sync_gradients, acc.num_processes, acc.process_index, acc.is_main_process,
                     acc.distributed_type, acc.state.num_processes, acc.state.distributed_type,
                     acc.gradient_accumulation_steps, args.gradient_accumulation_steps, acc.device)
    assert seen["rt"] == seen["hf"]


def test_num_steps_beside_an_accumulation_is_refused_as_hf(tmp_path):
    config = {"gradient_accumulation_kwargs": {"num_steps": 4}}
    for lib, make in (("hf", hf), ("rt", rt)):
        Trainer, TrainingArguments = make()
        args = TrainingArguments(str(tmp_path / lib), gradient_accumulation_steps=2, accelerator_config=config,
                                 **scripts.COMMON)
        with pytest.raises(ValueError, match="The `AcceleratorConfig`'s `num_steps` is set but"):
            Trainer(model=scripts.TinyRegressor(), args=args)


def _losses(lib, out, **kw):
    Trainer, TrainingArguments = scripts.LIBS[lib][0]()
    extra = {"data_order": "hf"} if lib == "rt" else {}
    args = TrainingArguments(str(out), num_train_epochs=2, per_device_train_batch_size=8, learning_rate=0.05,
                             logging_steps=1, save_strategy="no", **scripts.COMMON, **extra, **kw)
    trainer = Trainer(model=scripts.TinyRegressor(), args=args, train_dataset=scripts.regression_data(36))
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_one_process_trains_as_hf_with_accelerates_settings(tmp_path):
    """In one process accelerate splits nothing, dispatches to itself and has no uneven ranks: the same batches
    and losses as HF's Trainer with the same accelerator_config (36 rows: the last batch of 4)."""
    config = {"split_batches": True, "dispatch_batches": True, "even_batches": False, "non_blocking": True,
              "gradient_accumulation_kwargs": {"sync_each_batch": True, "num_steps": 2}}
    want = _losses("hf", tmp_path / "hf", accelerator_config=copy.deepcopy(config))  # HF sets its num_steps to 1
    got = _losses("rt", tmp_path / "rt", accelerator_config=config)
    assert len(got) == 6 and got == pytest.approx(want, rel=1e-6)


def test_sync_each_batch_reduces_every_micro_batchs_gradients(tmp_path, monkeypatch):
    from raytrain import Trainer, TrainingArguments
    from raytrain.strategies.base import Strategy

    entered = []
    original = Strategy.no_sync
    monkeypatch.setattr(Strategy, "no_sync", lambda self: entered.append(1) or original(self))
    for sync_each in (False, True):
        entered.clear()
        args = TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=3, save_strategy="no", **scripts.COMMON,
                                 accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each}})
        Trainer(model=scripts.TinyRegressor(), args=args, train_dataset=scripts.regression_data(36)).train()
        assert len(entered) == (0 if sync_each else 3 * 2)  # no_sync around all micro-batches but each step's last


class _Moved(torch.Tensor):
    calls: list = []

    def to(self, *args, **kwargs):
        _Moved.calls.append(kwargs.get("non_blocking"))
        return self


@pytest.mark.parametrize("config, non_blocking", [(None, False), ({"non_blocking": True}, True)])
def test_non_blocking_reaches_the_batchs_copy_to_the_device(config, non_blocking, tmp_path):
    from raytrain import Trainer, TrainingArguments

    trainer = Trainer(model=scripts.TinyRegressor(), args=TrainingArguments(
        str(tmp_path), accelerator_config=config, **scripts.COMMON))
    trainer.get_strategy().device = torch.device("meta")  # a device the batch is copied to
    _Moved.calls = []
    trainer._prepare_inputs({"x": torch.zeros(2).as_subclass(_Moved), "ids": [1, 2]})
    assert _Moved.calls == [non_blocking]


REFUSED = [({"dispatch_batches": True}, {"scaling": {"num_workers": 2}}, "accelerator_config.dispatch_batches"),
           ({"split_batches": True}, {"scaling": {"num_workers": 3}, "per_device_train_batch_size": 8},
            "accelerator_config.split_batches: per_device_train_batch_size \\(8\\)"),
           ({"split_batches": True}, {"scaling": {"num_workers": 2, "min_workers": 1}},
            "accelerator_config.split_batches: with an elastic")]


@pytest.mark.parametrize("config, kw, match", REFUSED, ids=["dispatch", "split_remainder", "split_elastic"])
def test_what_ray_workers_cannot_do_is_refused_with_the_arguments(config, kw, match, tmp_path):
    from raytrain import TrainingArguments

    with pytest.raises(ConfigError, match=f"^{match}"):
        TrainingArguments(str(tmp_path), accelerator_config=config, **scripts.COMMON, **kw)
    TrainingArguments(str(tmp_path), accelerator_config=config, **scripts.COMMON)  # one process: as accelerate


def test_unseeded_sampler_and_uneven_ranks_are_refused_when_training(tmp_path):
    from raytrain.config.args import TrainingArguments
    from raytrain.data.loaders import build_loader

    rows = {"x": torch.arange(38.0)}
    kw = dict(seed=0, shuffle=True, drop_last=False, rank=0, world_size=1, collate_fn=None, name="train_dataset")
    unseeded = TrainingArguments(str(tmp_path), accelerator_config={"use_seedable_sampler": False}, report_to="none")
    with pytest.raises(DataError, match="^accelerator_config.use_seedable_sampler: false .* leave it true$"):
        build_loader(rows, 4, unseeded, **kw)
    build_loader(rows, 4, unseeded, **{**kw, "shuffle": False, "name": "eval_dataset"})  # evaluation: no sampler
    uneven = TrainingArguments(str(tmp_path), accelerator_config={"even_batches": False}, report_to="none")
    for order in ("raytrain", "hf"):
        uneven.data_order = order
        with pytest.raises(DataError, match=r"^accelerator_config.even_batches: false leaves train_dataset's last "
                                            r"partial global batch \(6 of 8 samples\) to some ranks only"):
            build_loader(rows, 4, uneven, **{**kw, "world_size": 2})
        build_loader(rows, 4, uneven, **kw)  # one rank, or a drop_last run: nothing is uneven
        build_loader(rows, 4, uneven, **{**kw, "world_size": 2, "drop_last": True})
