"""TrainingArguments against transformers 5.23's __post_init__, case by case: every refusal of HF's is raytrain's
(one line naming the field), every value HF derives is raytrain's; where raytrain differs on purpose, the table
says why and the test holds raytrain to it."""

from __future__ import annotations

import json
import os

import pytest

from .scripts import hf, rt

BASE = dict(use_cpu=True, report_to="none")

#: (case, kwargs, the field the refusal names): both raise.
REFUSED = [
    ("empty_cache_float", dict(torch_empty_cache_steps=1.0), "torch_empty_cache_steps"),
    ("empty_cache_str", dict(torch_empty_cache_steps="none"), "torch_empty_cache_steps"),
    ("empty_cache_negative", dict(torch_empty_cache_steps=-1), "torch_empty_cache_steps"),
    ("empty_cache_zero", dict(torch_empty_cache_steps=0), "torch_empty_cache_steps"),
    ("fp16_and_bf16_full_eval", dict(fp16_full_eval=True, bf16_full_eval=True), "fp16_full_eval and bf16_full_eval"),
    ("fp16_and_bf16", dict(fp16=True, bf16=True), "fp16 and bf16"),
    ("plateau_without_eval", dict(lr_scheduler_type="reduce_lr_on_plateau"), "lr_scheduler_type"),
    ("greedy_without_eval", dict(lr_scheduler_type="greedy"), "lr_scheduler_type"),
    ("prefetch_without_workers", dict(dataloader_prefetch_factor=2), "dataloader_prefetch_factor"),
    ("eval_steps_without_any", dict(eval_strategy="steps", logging_steps=0), "eval_steps"),
    ("logging_steps_zero", dict(logging_strategy="steps", logging_steps=0), "logging_steps"),
    ("logging_steps_fraction", dict(logging_steps=10.5), "logging_steps"),
    ("eval_steps_fraction", dict(eval_strategy="steps", eval_steps=10.5), "eval_steps"),
    ("save_steps_fraction", dict(save_steps=10.5), "save_steps"),
    ("best_strategies_differ", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10,
                                    save_strategy="epoch"), "load_best_model_at_end"),
    ("best_steps_not_multiple", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10,
                                     save_steps=15), "load_best_model_at_end"),
    ("best_ratio_and_count", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1,
                                  save_steps=100), "load_best_model_at_end"),
    ("best_ratios_not_multiple", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.2,
                                      save_steps=0.3), "load_best_model_at_end"),
    ("warmup_negative", dict(warmup_steps=-1), "warmup_steps"),
    ("bad_eval_strategy", dict(eval_strategy="sometimes"), "eval_strategy"),
    ("bad_hub_strategy", dict(hub_strategy="never"), "hub_strategy"),
    ("bad_optim", dict(optim="adamw_nope"), "optim"),
    ("bad_schedule", dict(lr_scheduler_type="cosin"), "lr_scheduler_type"),
    ("bad_debug", dict(debug="underflow"), "debug"),
    ("tf32_without_ampere", dict(tf32=True), "tf32"),
    ("accelerator_unknown_key", dict(accelerator_config={"split_batch": True}), "accelerator_config"),
    ("accelerator_configured_state", dict(accelerator_config={"use_configured_state": True}), "accelerator_config"),
    ("fsdp_fsdp1_strategy", dict(fsdp="hybrid_shard"), "fsdp"),
    ("fsdp_unknown_option", dict(fsdp="full_shard sideways"), "fsdp"),
    ("fsdp_bad_wrap_policy", dict(fsdp=True, fsdp_config={"auto_wrap_policy": "EVERYTHING"}), "fsdp"),
]

#: (case, kwargs, the fields compared): both construct, and agree on these.
DERIVED = [
    ("output_dir_home", dict(output_dir="~/foo"), ["output_dir"]),
    ("output_dir_none", dict(output_dir=None), ["output_dir"]),
    ("eval_steps_from_logging", dict(eval_strategy="steps", logging_steps=10), ["do_eval", "eval_steps"]),
    ("eval_steps_zero", dict(eval_strategy="steps", eval_steps=0, logging_steps=7), ["eval_steps"]),
    ("do_eval_epoch", dict(eval_strategy="epoch"), ["do_eval", "eval_steps"]),
    ("whole_steps_are_ints", dict(logging_steps=10.0, eval_strategy="steps", eval_steps=20.0, save_steps=40.0),
     ["logging_steps", "eval_steps", "save_steps"]),
    ("ratio_steps_stay", dict(logging_steps=0.5, save_steps=1.0), ["logging_steps", "save_steps"]),
    ("steps_fraction_other_strategy", dict(logging_strategy="epoch", logging_steps=10.5), ["logging_steps"]),
    ("logging_zero_other_strategy", dict(logging_strategy="no", logging_steps=0, save_strategy="no",
                                         save_steps=0), ["logging_steps", "save_steps"]),
    ("best_metric_default", dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch"),
     ["metric_for_best_model", "greater_is_better"]),
    ("best_metric_accuracy", dict(metric_for_best_model="accuracy"), ["greater_is_better"]),
    ("plateau_metric", dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch"),
     ["metric_for_best_model", "greater_is_better"]),
    ("report_to_none_list", dict(report_to=["none"]), ["report_to"]),
    ("report_to_one", dict(report_to="tensorboard"), ["report_to"]),
    ("debug_option", dict(debug="underflow_overflow"), ["debug"]),
    ("debug_two", dict(debug="underflow_overflow tpu_metrics_debug"), ["debug"]),
    ("debug_none", dict(debug=None), ["debug"]),
    ("debug_empty", dict(), ["debug"]),
    ("compile_backend", dict(torch_compile=True), ["torch_compile", "torch_compile_backend"]),
    ("compile_mode", dict(torch_compile_mode="reduce-overhead"), ["torch_compile", "torch_compile_backend"]),
    ("use_cpu_pin_memory", dict(), ["dataloader_pin_memory"]),
    ("pin_memory_kept", dict(use_cpu=False), ["dataloader_pin_memory"]),
    ("tokens_seen_bool", dict(include_num_input_tokens_seen=True), ["include_num_input_tokens_seen"]),
    ("disable_tqdm_none", dict(disable_tqdm=None), ["disable_tqdm"]),
    ("mixed_precision_bf16", dict(bf16=True), ["mixed_precision"]),
    ("mixed_precision_no", dict(), ["mixed_precision"]),
    ("tf32_off", dict(tf32=False), ["tf32"]),
    ("scheduler_kwargs_json", dict(lr_scheduler_kwargs='{"factor": 0.5}'), ["lr_scheduler_kwargs"]),
    ("empty_cache_steps", dict(torch_empty_cache_steps=3), ["torch_empty_cache_steps"]),
    ("prefetch_with_workers", dict(dataloader_prefetch_factor=2, dataloader_num_workers=2),
     ["dataloader_prefetch_factor"]),
    ("warmup_ratio_steps", dict(warmup_steps=0.5), ["warmup_steps"]),
    ("accelerator_dict", dict(accelerator_config={"split_batches": True, "even_batches": False}),
     ["accelerator_config"]),
    ("accelerator_json", dict(accelerator_config='{"use_seedable_sampler": false}'), ["accelerator_config"]),
    ("accelerator_grad_kwargs", dict(accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}}),
     ["accelerator_config"]),
    ("fsdp_legacy_options", dict(fsdp="full_shard offload auto_wrap"), ["fsdp", "fsdp_config"]),
    ("fsdp_config_prefixed", dict(fsdp=True, fsdp_config={"fsdp_transformer_layer_cls_to_wrap": "Block",
                                                           "reshard_after_forward": False}), ["fsdp", "fsdp_config"]),
]

#: Where raytrain differs on purpose: (case, kwargs, what HF does, what raytrain does).
DIFFERS = [
    ("bf16_on_cpu_without_use_cpu", dict(use_cpu=False, bf16=True), "refused: no bf16 GPU",
     "bf16 autocast on the CPU (raytrain trains on the CPU where there is no GPU, bf16 included)"),
    ("best_without_evaluation", dict(load_best_model_at_end=True, save_strategy="no"),
     "accepted; nothing is ever evaluated",
     "refused: load_best_model_at_end requires eval_strategy 'steps' or 'epoch'"),
    ("save_steps_zero", dict(save_steps=0), "accepted, then a ZeroDivisionError at the first step",
     "refused: save_steps: save_strategy 'steps' needs save_steps > 0"),
    ("accelerator_default", dict(), "AcceleratorConfig()", "None (accelerate's defaults; no transformers import)"),
    ("kubeflow_outside_a_trainjob", dict(report_to="kubeflow"), "accepted", "refused: report_to: kubeflow needs"),
]


def _value(v):
    if hasattr(v, "to_dict") and hasattr(v, "__dataclass_fields__"):
        return v.to_dict()
    if isinstance(v, list):
        return [getattr(x, "value", x) for x in v]
    return getattr(v, "value", v)


@pytest.fixture(autouse=True)
def _no_accelerate_state(monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)  # use_configured_state: no state configured
    yield


@pytest.mark.parametrize("kwargs, field", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_hf_refusals_are_raytrains(kwargs, field, tmp_path):
    from raytrain.config.sections import ConfigError

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    kwargs = {**BASE, "output_dir": str(tmp_path), **kwargs}
    with pytest.raises((ValueError, TypeError)):
        HFArgs(**kwargs)
    with pytest.raises(ConfigError) as e:
        TrainingArguments(**kwargs)
    assert str(e.value).startswith(field) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs, names", [c[1:] for c in DERIVED], ids=[c[0] for c in DERIVED])
def test_hf_derived_values_are_raytrains(kwargs, names, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output_dir None -> trainer_output, here
    _, HFArgs = hf()
    _, TrainingArguments = rt()
    kwargs = {**BASE, "output_dir": str(tmp_path), **kwargs}
    h, r = HFArgs(**kwargs), TrainingArguments(**kwargs)
    for name in names:
        assert _value(getattr(r, name)) == _value(getattr(h, name)), name
        if type(getattr(h, name)) is int and getattr(h, name) > 1:  # HF's int() of a whole step count above 1
            assert type(getattr(r, name)) is int, name


def test_class_as_accelerator_config_is_refused_as_hf_refuses_it(tmp_path):
    from transformers.trainer_pt_utils import AcceleratorConfig

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    for cls in (HFArgs, TrainingArguments):
        with pytest.raises(NotImplementedError, match="Tried passing in a callable to `accelerator_config`"):
            cls(str(tmp_path), accelerator_config=AcceleratorConfig, **BASE)


def test_accelerator_config_file_instance_and_configured_state_as_hf(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers.trainer_pt_utils import AcceleratorConfig

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    path = tmp_path / "accelerator.json"
    path.write_text(json.dumps({"split_batches": True, "dispatch_batches": False}))
    for value in (path, str(path), AcceleratorConfig(even_batches=False, non_blocking=True)):
        h = HFArgs(str(tmp_path), accelerator_config=value, **BASE)
        r = TrainingArguments(str(tmp_path), accelerator_config=value, **BASE)
        assert r.accelerator_config.to_dict() == h.accelerator_config.to_dict()
        assert json.loads(r.to_json_string())["accelerator_config"] == h.accelerator_config.to_dict()
    Accelerator()  # a configured state: use_configured_state is then accepted, as HF (which then pops it)
    try:
        h = HFArgs(str(tmp_path), accelerator_config={"use_configured_state": True}, **BASE)
        r = TrainingArguments(str(tmp_path), accelerator_config={"use_configured_state": True}, **BASE)
        assert r.accelerator_config.to_dict() == h.accelerator_config.to_dict()
        with pytest.raises(ValueError, match="^accelerator_config: use_configured_state: .*scaling.num_workers"):
            TrainingArguments(str(tmp_path), accelerator_config={"use_configured_state": True},
                              scaling={"num_workers": 2}, **BASE)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("env, added", [({"KUBEFLOW_TRAINER_SERVER_URL": "https://x"}, True),
                                        ({"KUBEFLOW_TRAINER_SERVER_URL": "https://x",
                                          "DISABLE_KUBEFLOW_INTEGRATION": "true"}, False), ({}, False)])
def test_kubeflow_joins_report_to_inside_a_trainjob_as_hf(env, added, tmp_path, monkeypatch):
    from transformers.integrations import is_kubeflow_available

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert is_kubeflow_available() is added
    for report_to in ("none", "tensorboard", ["kubeflow", "tensorboard"])[:3 if env else 2]:
        kwargs = {"use_cpu": True, "report_to": report_to}
        h, r = HFArgs(str(tmp_path), **kwargs), TrainingArguments(str(tmp_path), **kwargs)
        assert sorted(r.report_to) == sorted(h.report_to) and ("kubeflow" in r.report_to) is (added or
                                                                                          "kubeflow" in report_to)


def test_fsdp_config_becomes_distributed_fsdp(tmp_path):
    _, TrainingArguments = rt()
    r = TrainingArguments(str(tmp_path), fsdp="full_shard offload", fsdp_config={
        "transformer_layer_cls_to_wrap": "Qwen3DecoderLayer", "activation_checkpointing": True}, **BASE)
    assert r.distributed.strategy == "fsdp"
    assert r.distributed.fsdp == {"reshard_after_forward": True, "cpu_offload": True,
                                  "activation_checkpointing": True, "wrap_classes": ["Qwen3DecoderLayer"]}
    own = TrainingArguments(str(tmp_path), fsdp=True, distributed={"fsdp": {"reshard_after_forward": True}},
                            fsdp_config={"reshard_after_forward": False}, **BASE)
    assert own.distributed.fsdp["reshard_after_forward"] is True  # distributed.fsdp's own wins
    for config, field in [({"version": 1}, "fsdp_config.version"),
                          ({"state_dict_type": "SHARDED_STATE_DICT"}, "fsdp_config.state_dict_type"),
                          ({"activation_checkpointing": True}, "fsdp_config.activation_checkpointing")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            TrainingArguments(str(tmp_path), fsdp=True, fsdp_config=config, activation_checkpointing=True, **BASE)


@pytest.mark.parametrize("kwargs, hf_does, raytrain_does", [c[1:] for c in DIFFERS], ids=[c[0] for c in DIFFERS])
def test_documented_differences(kwargs, hf_does, raytrain_does, tmp_path):
    from raytrain.config.sections import ConfigError

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    kwargs = {**BASE, "output_dir": str(tmp_path), **kwargs}
    if hf_does.startswith("refused"):
        with pytest.raises(ValueError):
            HFArgs(**kwargs)
    else:
        HFArgs(**kwargs)
    if raytrain_does.startswith("refused"):
        with pytest.raises(ConfigError, match=raytrain_does.split(": ", 1)[1].split(":")[0]):
            TrainingArguments(**kwargs)
    else:
        TrainingArguments(**kwargs)
