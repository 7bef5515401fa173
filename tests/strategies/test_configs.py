"""Backend options are checked before anything is set up, with messages that name the field."""

from __future__ import annotations

import json

import pytest

from raytrain import TrainingArguments
from raytrain.strategies.deepspeed import build_config
from raytrain.strategies.fsdp import FSDPStrategy


def _args(**kw):
    return TrainingArguments(output_dir="unused", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             learning_rate=2e-4, weight_decay=0.1, max_grad_norm=0.5, **kw)


def test_deepspeed_auto_values_come_from_the_training_arguments(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}}))
    config = build_config(_args(distributed={"strategy": "deepspeed", "deepspeed": str(path)}), world_size=4, on_cpu=True)
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 8 * 2 * 4 and config["gradient_clipping"] == 0.5
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1,
                                             "torch_adam": True}
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}
    # One engine step per update step, whatever the number of micro-batches (the loop owns accumulation).
    assert config["managed_gradient_accumulation"] is False
    assert config["zero_optimization"]["overlap_comm"] is False and config["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize("section, message", [
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu=4 contradicts per_device_train_batch_size"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "optimizer.params.lr=0.001 contradicts learning_rate"),
    ({"scheduler": {"type": "WarmupLR"}}, "distributed.deepspeed.scheduler: remove it"),
])
def test_deepspeed_config_contradicting_the_arguments_is_refused(section, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_config(_args(distributed={"strategy": "deepspeed", "deepspeed": section}), world_size=2, on_cpu=True)


def test_deepspeed_unreadable_json_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read the JSON config"):
        build_config(_args(distributed={"strategy": "deepspeed", "deepspeed": str(tmp_path / "nope.json")}), 2, True)


@pytest.mark.parametrize("options, message", [
    ({"reshard_after_foward": False}, r"unknown option\(s\) \['reshard_after_foward'\]"),
    ({"mixed_precision": {"param_dtype": "bf17"}}, "mixed_precision.param_dtype"),
])
def test_fsdp_options_are_checked_before_set_up(options, message):
    args = _args(scaling={"num_workers": 2}, distributed={"strategy": "fsdp", "fsdp": options})
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(args)
