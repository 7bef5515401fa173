import dataclasses
import json
import re

import pytest

from raytrain.config.args import (ConfigError, DataConfig, DistributedConfig, ModelConfig, ScalingConfig,
    TrainingArguments, apply_overrides, cli_help)


def config_error(match: str, **kwargs) -> str:
    """Construct TrainingArguments, expect a one-line ConfigError matching `match`."""
    with pytest.raises(ConfigError, match=match) as info:
        TrainingArguments(**kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_defaults_match_hugging_face():
    a = TrainingArguments()
    assert a.output_dir == "trainer_output"
    assert (a.num_train_epochs, a.max_steps) == (3.0, -1)
    assert (a.per_device_train_batch_size, a.per_device_eval_batch_size) == (8, 8)
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm) == (5e-5, 0.0, 1.0)
    assert (a.adam_beta1, a.adam_beta2, a.adam_epsilon) == (0.9, 0.999, 1e-8)
    assert (a.optim, a.lr_scheduler_type) == ("adamw_torch_fused", "linear")  # HF 5.23's with torch >= 2.8
    assert (a.logging_strategy, a.logging_steps, a.eval_strategy, a.eval_steps) == ("steps", 500, "no", None)
    assert (a.save_strategy, a.save_steps, a.save_total_limit) == ("steps", 500, None)
    assert (a.seed, a.data_seed, a.warmup_steps, a.warmup_ratio) == (42, None, 0, 0.0)
    assert a.logging_nan_inf_filter and a.skip_memory_metrics and not a.fp16 and not a.bf16
    assert a.report_to == [] and a.lr_scheduler_kwargs == {} and a.max_nonfinite_steps is None
    assert a.model is None and a.data is None
    assert (a.scaling.num_workers, a.scaling.placement_strategy, a.distributed.strategy) == (1, "PACK", "auto")


def test_properties():
    a = TrainingArguments(per_device_train_batch_size=4, scaling={"num_workers": 3})
    assert (a.train_batch_size, a.world_size, a.should_use_distributed) == (4, 3, True)
    assert not TrainingArguments().should_use_distributed


def test_unknown_field_suggests_close_match():
    assert config_error("^unknown field 'learnin_rate': did you mean 'learning_rate'\\?$", learnin_rate=1e-3)
    config_error(r"^unknown field 'zzz' \(see --help for valid fields\)$", zzz=1)
    config_error("^unknown field 'scaling.num_wokers': did you mean 'scaling.num_workers'\\?$",
                 scaling={"num_wokers": 2})
    config_error("did you mean 'scaling.num_workers'", num_workers=2)


def test_type_range_and_choice_errors():
    config_error(r"^learning_rate: must be >= 0, got -1.0$", learning_rate=-1.0)
    config_error(r"^per_device_train_batch_size: expected an integer, got 'abc'$", per_device_train_batch_size="abc")
    msg = config_error(r"^lr_scheduler_type: must be one of linear, cosine, .*, got 'cosin'$", lr_scheduler_type="cosin")
    assert "warmup_stable_decay" in msg
    config_error(r"^gradient_accumulation_steps: must be >= 1, got 0$", gradient_accumulation_steps=0)
    config_error(r"^scaling.num_workers: must be >= 1, got 0$", scaling={"num_workers": 0})
    config_error(r"^scaling.placement_strategy: must be one of PACK, ", scaling={"placement_strategy": "x"})
    config_error(r"^warmup_steps: expected a number, got 'abc'$", warmup_steps="abc")
    config_error(r"^logging_steps: must be a whole step count when above 1 \(a ratio is below 1\), got 1.5$",
                 logging_steps=1.5)
    config_error(r"^model.factory: must be set$", model={"hidden_size": 4})
    config_error(r"^model.factory: expected an import string 'package.module:function', got 'x'$",
                 model={"factory": "x"})


def test_sections_constructed_directly_raise_config_error():
    with pytest.raises(ConfigError, match=r"^num_workers: must be >= 1, got 0$"):
        ScalingConfig(num_workers=0)
    assert ModelConfig(factory="m.models:build", depth=2).kwargs == {"depth": 2}


def test_assignment_is_validated_and_rolled_back():
    a = TrainingArguments()
    with pytest.raises(ConfigError, match=r"^learning_rate: must be >= 0, got -3$"):
        a.learning_rate = -3
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        a.learnin_rate = 1.0
    a.eval_strategy = "epoch"
    with pytest.raises(ConfigError, match="load_best_model_at_end requires save_strategy"):
        a.load_best_model_at_end = True
    assert a.learning_rate == 5e-5 and a.load_best_model_at_end is False


def test_load_best_model_combinations():
    config_error(r"^load_best_model_at_end requires save_strategy to match eval_strategy "
                 r"\(got save_strategy='steps', eval_strategy='epoch'\)$",
                 load_best_model_at_end=True, eval_strategy="epoch")
    config_error(r"^load_best_model_at_end requires eval_strategy 'steps' or 'epoch' \(got eval_strategy='no'\)$",
                 load_best_model_at_end=True)
    config_error(r"^load_best_model_at_end requires save_steps \(250\) to be a multiple of eval_steps \(100\)$",
                 load_best_model_at_end=True, eval_strategy="steps", eval_steps=100, save_steps=250)
    config_error("both step counts or both ratios", load_best_model_at_end=True, eval_strategy="steps",
                 eval_steps=0.1, save_steps=100)
    a = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=100, save_steps=300)
    assert (a.metric_for_best_model, a.greater_is_better) == ("loss", False)
    b = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="best",
                          metric_for_best_model="accuracy")
    assert b.greater_is_better is True
    assert TrainingArguments(eval_strategy="steps", logging_steps=50).eval_steps == 50


def test_save_best_needs_metric():
    config_error(r"^save_strategy='best': `args.metric_for_best_model` must be provided when using 'best' "
                 r"save_strategy or if `args.load_best_model_at_end` is set to `True`$", save_strategy="best")


def test_precision_checks(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config_error(r"^fp16 requires a CUDA GPU \(none found and scaling.use_gpu is false\); use bf16 on CPU$", fp16=True)
    assert TrainingArguments(fp16=True, scaling={"use_gpu": True}).fp16
    config_error(r"^fp16 and bf16: set only one of them$", fp16=True, bf16=True)


def test_training_length_needed():
    config_error(r"^max_steps and num_train_epochs: set max_steps > 0 or num_train_epochs > 0$",
                 max_steps=0, num_train_epochs=0)
    assert TrainingArguments(max_steps=10, num_train_epochs=0).max_steps == 10


def test_warmup():
    config_error(r"^warmup_steps: a float must be a ratio in \(0, 1\), got 1.5$", warmup_steps=1.5)
    config_error(r"^warmup_ratio: a float must be a ratio in \(0, 1\), got 1.5$", warmup_ratio=1.5)
    config_error(r"^warmup_steps: must be >= 0, got -1$", warmup_steps=-1)
    msg = config_error(r"^warmup_steps and warmup_ratio: ", warmup_steps=10, warmup_ratio=0.1)
    assert "warmup_steps=10" in msg and "warmup_ratio=0.1" in msg
    assert TrainingArguments(warmup_steps=10).get_warmup_steps(1000) == 10
    assert TrainingArguments(warmup_steps=0.1).get_warmup_steps(1001) == 101
    assert TrainingArguments(warmup_ratio=0.05).get_warmup_steps(30) == 2
    a = TrainingArguments(warmup_steps=20.0)
    assert a.warmup_steps == 20 and isinstance(a.warmup_steps, int)
    assert TrainingArguments().get_warmup_steps(100) == 0


def test_resolve_steps_ratios_and_counts():
    a = TrainingArguments(logging_steps=0.1, eval_strategy="steps", eval_steps=0.25, save_steps=200)
    assert a.resolve_steps(1001) == (101, 251, 200)
    b = TrainingArguments(logging_steps=10, eval_strategy="steps")
    assert b.resolve_steps(50) == (10, 10, 500)
    assert all(isinstance(n, int) for n in b.resolve_steps(50))


def test_report_to_normalization():
    assert TrainingArguments(report_to="none").report_to == []
    assert "mlflow" in TrainingArguments(report_to="all").report_to  # and every other installed (test_trackers)
    assert TrainingArguments(report_to="mlflow").report_to == ["mlflow"]
    assert TrainingArguments(report_to=["mlflow", "none"]).report_to == ["mlflow"]
    config_error(r"^report_to: must be one of none, all, azure_ml, .*, wandb, got 'wandbb'$", report_to="wandbb")


def test_optim_args_string_is_parsed():
    a = TrainingArguments(optim_args="eps=1e-6, foo=bar,n=3")
    assert a.optim_args == {"eps": 1e-6, "foo": "bar", "n": 3}
    config_error(r"^optim_args: expected 'key=value,key2=value2', got 'oops'$", optim_args="oops")


def test_apply_overrides():
    d = {"learning_rate": 1e-3, "model": None}
    out = apply_overrides(d, ["learning_rate=3e-4", "model.hidden_size=128", "scaling.num_workers=2",
                              "run_name=abc", "report_to=[mlflow]", "max_grad_norm="])
    assert out == {"learning_rate": 3e-4, "model": {"hidden_size": 128}, "scaling": {"num_workers": 2},
                   "run_name": "abc", "report_to": ["mlflow"], "max_grad_norm": None}
    assert isinstance(out["learning_rate"], float) and d["model"] is None
    with pytest.raises(ConfigError, match=r"^--set expects KEY=VALUE, got 'foo' \(write --set foo=VALUE\)$"):
        apply_overrides({}, ["foo"])
    with pytest.raises(ConfigError, match="'learning_rate' is not a section"):
        apply_overrides(d, ["learning_rate.x=1"])


def test_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-3\nmodel:\n  factory: pkg.models:build\n  depth: 2\nscaling:\n  num_workers: 2\n")
    a = TrainingArguments.from_yaml(path, overrides=["model.hidden_size=128", "learning_rate=3e-4"])
    assert a.model.factory == "pkg.models:build"
    assert a.model.kwargs == {"depth": 2, "hidden_size": 128}
    assert a.learning_rate == 3e-4 and isinstance(a.learning_rate, float)
    assert a.world_size == 2
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert TrainingArguments.from_yaml(empty) == TrainingArguments()


def test_from_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: '{tmp_path / 'nope.yaml'}'")):
        TrainingArguments.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nlearning_rate: [1, 2\noutput_dir: x\n")
    with pytest.raises(ConfigError, match=re.escape(str(bad)) + " line 3") as info:
        TrainingArguments.from_yaml(bad)
    assert "\n" not in str(info.value)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        TrainingArguments.from_yaml(listing)
    typo = tmp_path / "typo.yaml"
    typo.write_text("learnin_rate: 0.1\n")
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        TrainingArguments.from_yaml(typo)


def test_round_trip():
    a = TrainingArguments(
        learning_rate=3e-4, warmup_steps=0.1, eval_strategy="steps", report_to="all",
        optim_args="eps=1e-6", load_best_model_at_end=True, save_steps=1000, eval_steps=250,
        model={"factory": "pkg.models:build", "hidden_size": 64},
        data={"factory": "pkg.data:load", "compute_metrics": "pkg.metrics:acc", "n": 10},
        scaling={"num_workers": 2, "resources_per_worker": {"CPU": 2}},
        distributed={"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    )
    d = a.to_dict()
    assert json.loads(a.to_json_string()) == d
    assert d["model"] == {"factory": "pkg.models:build", "hidden_size": 64}
    assert TrainingArguments.from_dict(d) == a
    assert TrainingArguments.from_dict(TrainingArguments().to_dict()) == TrainingArguments()
    with pytest.raises(ConfigError, match="^seed: expected an integer, got 'x'$"):
        TrainingArguments.from_dict({"seed": "x"})


def test_cli_help_lists_every_field():
    text = cli_help()
    names = set(re.findall(r"^  --set (\S+)=VALUE ", text, flags=re.M))
    sections = {"model": ModelConfig, "data": DataConfig, "scaling": ScalingConfig, "distributed": DistributedConfig}
    expected = {f.name for f in dataclasses.fields(TrainingArguments) if f.name not in sections}
    for section, cls in sections.items():
        expected |= {f"{section}.{n}" for n in cls.model_fields}
    assert expected <= names
    assert "learning_rate=VALUE" in text and "peak learning rate (default: 5e-05)" in text
    assert next(line for line in text.splitlines() if "--set model.factory=" in line).endswith("(required)")


def test_bare_yaml_no_means_the_no_strategy(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("save_strategy: no\neval_strategy: no\n")
    args = TrainingArguments.from_yaml(cfg, ["logging_strategy=no"])
    assert (args.save_strategy, args.eval_strategy, args.logging_strategy) == ("no", "no", "no")


def test_hf_deepspeed_and_fsdp_fields_select_the_backend_through_a_validated_section(tmp_path):
    from raytrain.config.sections import DistributedConfig

    ds = TrainingArguments(str(tmp_path), deepspeed={"zero_optimization": {"stage": 2}})
    assert isinstance(ds.distributed, DistributedConfig)
    assert ds.distributed.strategy == "deepspeed" and ds.distributed.deepspeed == {"zero_optimization": {"stage": 2}}
    assert TrainingArguments(str(tmp_path), fsdp="full_shard").distributed.strategy == "fsdp"
    explicit = TrainingArguments(str(tmp_path), fsdp="full_shard", distributed={"strategy": "ddp"})
    assert explicit.distributed.strategy == "ddp"  # an explicit section wins over HF's switch
