"""TrainingArguments as HF users write it: HfArgumentParser, subclasses, positional output_dir, no-op fields."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import pytest

from .scripts import hf, rt


@dataclass
class ModelArgs:
    model_name: str = field(default="tiny", metadata={"help": "model"})
    hidden: int = 32


@dataclass
class DataArgs:
    data_path: str = "data"
    max_length: int = 64


def parse(TrainingArguments, out):
    from transformers import HfArgumentParser

    @dataclass
    class MyArgs(TrainingArguments):
        extra: int = 1

    parser = HfArgumentParser((ModelArgs, DataArgs, TrainingArguments))
    m, d, t = parser.parse_args_into_dataclasses(
        ["--output_dir", str(out), "--model_name", "bert", "--max_length", "16", "--learning_rate", "0.003",
         "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--use_cpu", "--report_to", "none"])
    (mine,) = HfArgumentParser(MyArgs).parse_args_into_dataclasses(
        ["--output_dir", str(out), "--extra", "7", "--use_cpu", "--report_to", "none"])
    positional = MyArgs(str(out), extra=3, use_cpu=True, report_to="none")
    return m, d, t, mine, positional


@pytest.mark.parametrize("lib", ["hf", "rt"])
def test_hf_argument_parser_and_user_subclass(lib, tmp_path):
    Trainer, TrainingArguments = {"hf": hf, "rt": rt}[lib]()
    m, d, t, mine, positional = parse(TrainingArguments, tmp_path)
    assert (m.model_name, m.hidden, d.data_path, d.max_length) == ("bert", 32, "data", 16)
    assert isinstance(t, TrainingArguments)
    assert (t.learning_rate, t.per_device_train_batch_size, t.num_train_epochs) == (0.003, 4, 2)
    assert t.output_dir == str(tmp_path)
    assert isinstance(mine, TrainingArguments) and mine.extra == 7
    assert positional.extra == 3 and positional.output_dir == str(tmp_path)


def test_a_subclass_dtype_field_is_its_name_in_to_dict_as_hf(tmp_path):
    """HF's test_dtype_to_json: a subclass's torch.dtype field is written as its name (JSON-able)."""
    import json

    import torch

    out = {}
    for lib in ("hf", "rt"):
        base = {"hf": hf, "rt": rt}[lib]()[1]
        cls = dataclass(type("DtypeArgs", (base,), {"__annotations__": {"dtype": torch.dtype},
                                                   "dtype": field(default=torch.float32)}))
        args = cls(output_dir=str(tmp_path / lib), dtype=torch.bfloat16, use_cpu=True, report_to="none")
        out[lib] = (args.to_dict()["dtype"], json.loads(args.to_json_string())["dtype"])
    assert out["rt"] == out["hf"] == ("bfloat16", "bfloat16")


def test_misspelt_field_is_one_line_naming_the_close_field(tmp_path):
    _, TrainingArguments = rt()
    with pytest.raises(Exception) as e:
        TrainingArguments(str(tmp_path), learning_rat=1e-3)
    msg = str(e.value)
    assert "\n" not in msg.strip()
    assert "learning_rat" in msg and "learning_rate" in msg


NOOP_FIELDS = dict(do_train=True, do_eval=True, do_predict=True, logging_dir="logs", hub_model_id="me/model",
                   hub_strategy="end", hub_token="x", hub_private_repo=True, dataloader_pin_memory=False,
                   dataloader_persistent_workers=True, eval_accumulation_steps=4, log_level="warning",
                   remove_unused_columns=False, label_names=["labels"], include_num_input_tokens_seen=True,
                   restore_callback_states_from_checkpoint=True,
                   dataloader_num_workers=0, eval_delay=0, batch_eval_metrics=False)


@pytest.mark.parametrize("name", sorted(NOOP_FIELDS))
def test_accepted_hf_field_constructs(name, tmp_path):
    _, HFArgs = hf()
    _, TrainingArguments = rt()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", **{name: NOOP_FIELDS[name]})
    if name in {f.name for f in fields(HFArgs)}:  # transformers 5.23 dropped logging_dir; we still take it
        h = HFArgs(str(tmp_path), use_cpu=True, report_to="none", **{name: NOOP_FIELDS[name]})
        assert getattr(args, name) == getattr(h, name)
    else:
        assert getattr(args, name) == NOOP_FIELDS[name]


@pytest.mark.parametrize("name, value", [("push_to_hub", True), ("include_for_metrics", ["inputs"]),
                                         ("eval_do_concat_batches", False), ("dataloader_in_order", False)])
def test_what_raytrain_cannot_do_is_refused_in_one_line(name, value, tmp_path):
    from raytrain.config.sections import ConfigError

    _, TrainingArguments = rt()
    with pytest.raises(ConfigError, match=rf"^{name}: .*not supported") as e:
        TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", **{name: value})
    assert "\n" not in str(e.value)
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ConfigError, match=rf"^{name}: "):  # an assignment too, and it is rolled back
        setattr(args, name, value)
    assert getattr(args, name) != value


def test_process_attributes_like_hf(tmp_path):
    import torch

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    h = HFArgs(str(tmp_path), use_cpu=True, report_to="none")
    r = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    assert r.device == h.device == torch.device("cpu")
    for name in ("n_gpu", "world_size", "process_index", "local_process_index", "should_save", "should_log"):
        assert getattr(r, name) == getattr(h, name), name
    assert (r.world_size, r.process_index, r.should_save, r.should_log) == (1, 0, True, True)


# --- the whole of transformers 5.23's TrainingArguments -------------------------------------------

#: Shared fields whose constructed values differ from HF's, and why.
KNOWN_DIFFERENCES = {
    "lr_scheduler_kwargs": "raytrain normalises None to {}",
    "accelerator_config": "HF builds AcceleratorConfig(); raytrain keeps None (accelerate's defaults apply)",
}
NEW_IN_5_23 = ["activation_checkpointing", "activation_checkpointing_kwargs", "dataloader_in_order",
               "dataloader_multiprocessing_context", "ddp_broadcast_buffers", "ddp_bucket_cap_mb", "ddp_static_graph",
               "enable_jit_checkpoint", "eval_use_gather_object", "liger_kernel_config", "optim_target_modules",
               "parallelism_config", "trackio_bucket_id", "trackio_space_id", "trackio_static_space_id", "use_cache"]


def _default(f):
    import dataclasses

    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_field_of_transformers_training_arguments_is_accepted():
    _, HFArgs = hf()
    _, TrainingArguments = rt()
    missing = sorted({f.name for f in fields(HFArgs)} - {f.name for f in fields(TrainingArguments)})
    assert not missing, f"fields of transformers' TrainingArguments that raytrain refuses: {missing}"


def test_new_fields_have_hf_defaults_and_construct_like_hf(tmp_path):
    _, HFArgs = hf()
    _, TrainingArguments = rt()
    hf_fields, rt_fields = {f.name: f for f in fields(HFArgs)}, {f.name: f for f in fields(TrainingArguments)}
    for name in NEW_IN_5_23 + ["gradient_checkpointing", "gradient_checkpointing_kwargs"]:
        assert _default(rt_fields[name]) == _default(hf_fields[name]), name
        assert rt_fields[name].metadata["help"] and "\n" not in rt_fields[name].metadata["help"], name
    h = HFArgs(str(tmp_path), use_cpu=True, report_to="none")
    r = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    differ = [n for n in rt_fields if n in hf_fields and n not in KNOWN_DIFFERENCES and getattr(r, n) != getattr(h, n)]
    assert not differ, {n: (getattr(r, n), getattr(h, n)) for n in differ}


ALIAS_CASES = [
    {},
    {"gradient_checkpointing": True},
    {"activation_checkpointing": True},
    {"gradient_checkpointing": True, "activation_checkpointing": False},
    {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
    {"activation_checkpointing_kwargs": '{"every_n_layers": 2}', "gradient_checkpointing_kwargs": {"offload": True}},
]


@pytest.mark.parametrize("kwargs", ALIAS_CASES)
def test_activation_checkpointing_and_its_deprecated_alias_like_hf(kwargs, tmp_path):
    import warnings

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    names = ["activation_checkpointing", "gradient_checkpointing", "activation_checkpointing_kwargs",
             "gradient_checkpointing_kwargs"]
    seen = {}
    for lib, cls in (("hf", HFArgs), ("rt", TrainingArguments)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = cls(str(tmp_path), use_cpu=True, report_to="none", **kwargs)
        future = sorted(str(w.message) for w in caught if issubclass(w.category, FutureWarning)
                        and "deprecated" in str(w.message))
        seen[lib] = ({n: getattr(a, n) for n in names}, future)
    assert seen["rt"] == seen["hf"]


LEVEL_CASES = [("passive", "warning"), ("info", "passive"), ("debug", "error"), ("critical", "info")]


@pytest.mark.parametrize("replica", [False, True])
def test_get_process_log_level_like_hf(replica, tmp_path, monkeypatch):
    import transformers

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    if replica:  # another process: should_log is false there
        for cls in (HFArgs, TrainingArguments):
            monkeypatch.setattr(cls, "should_log", property(lambda self: False))
    # passive: HF gives transformers' verbosity, raytrain its own logger's level
    loggers = [transformers.utils.logging.get_logger(), logging.getLogger("raytrain")]
    before = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        for level, replica_level in LEVEL_CASES:
            kw = dict(use_cpu=True, report_to="none", log_level=level, log_level_replica=replica_level)
            h, r = HFArgs(str(tmp_path), **kw), TrainingArguments(str(tmp_path), **kw)
            assert r.get_process_log_level() == h.get_process_log_level(), (level, replica_level)
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)


def test_parallel_mode_place_model_on_device_and_warmup_like_hf(tmp_path, monkeypatch):
    import sys

    from raytrain.hf.args import ParallelMode

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    h = HFArgs(str(tmp_path), use_cpu=True, report_to="none")
    r = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    assert r.parallel_mode == h.parallel_mode  # HF's own enum once transformers.training_args is loaded
    assert r.place_model_on_device == h.place_model_on_device
    monkeypatch.delitem(sys.modules, "transformers.training_args")
    assert r.parallel_mode is ParallelMode.NOT_PARALLEL and r.parallel_mode.value == h.parallel_mode.value
    assert {m.value for m in ParallelMode} == {m.value for m in type(h.parallel_mode)}
    for warmup in (0, 10, 0.1, 0.25, 5.0):
        h = HFArgs(str(tmp_path), use_cpu=True, report_to="none", warmup_steps=warmup)
        r = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", warmup_steps=warmup)
        for n in (0, 7, 100, 1001):
            assert r.get_warmup_steps(n) == h.get_warmup_steps(n), (warmup, n)


SETTERS = [
    ("set_training", dict(learning_rate=1e-4, batch_size=32, weight_decay=0.01, num_epochs=2, max_steps=10,
                          gradient_accumulation_steps=2, seed=3, activation_checkpointing=True)),
    ("set_training", dict(gradient_checkpointing=True)),
    ("set_evaluate", dict(strategy="steps", steps=100, batch_size=16, accumulation_steps=2, delay=5, loss_only=True)),
    ("set_evaluate", {}),
    ("set_testing", dict(batch_size=32, loss_only=True)),
    ("set_save", dict(strategy="epoch", steps=200, total_limit=2, on_each_node=True)),
    ("set_logging", dict(strategy="steps", steps=100, report_to=["mlflow"], level="info", first_step=True,
                         nan_inf_filter=True, on_each_node=False, replica_level="error")),
    ("set_optimizer", dict(name="sgd", learning_rate=0.1, weight_decay=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6)),
    ("set_lr_scheduler", dict(name="cosine", num_epochs=2, max_steps=50, warmup_steps=0.05)),
    ("set_dataloader", dict(train_batch_size=16, eval_batch_size=64, drop_last=True, num_workers=2, pin_memory=False,
                            persistent_workers=True, prefetch_factor=4, multiprocessing_context="spawn",
                            in_order=True, auto_find_batch_size=True, ignore_data_skip=True, sampler_seed=7)),
]


def _plain(v):
    return getattr(v, "value", v)


@pytest.mark.parametrize("method, kwargs", SETTERS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SETTERS)])
def test_set_helpers_like_hf(method, kwargs, tmp_path):
    import inspect
    import warnings

    _, HFArgs = hf()
    _, TrainingArguments = rt()
    hf_params = inspect.signature(getattr(HFArgs, method)).parameters
    rt_params = inspect.signature(getattr(TrainingArguments, method)).parameters
    assert [(p.name, _plain(p.default)) for p in rt_params.values()] == \
           [(p.name, _plain(p.default)) for p in hf_params.values()]
    h = HFArgs(str(tmp_path), use_cpu=True, report_to="none")
    r = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    before = {f.name: getattr(h, f.name) for f in fields(HFArgs)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert getattr(h, method)(**kwargs) is h and getattr(r, method)(**kwargs) is r
    changed = [n for n, v in before.items() if getattr(h, n) != v]
    assert changed
    expected = {n: _plain(getattr(h, n)) for n in changed}
    if expected.get("eval_delay", 0) is None:
        expected["eval_delay"] = 0  # HF's set_evaluate stores None for "no delay"; raytrain keeps the float 0
    assert {n: _plain(getattr(r, n)) for n in changed} == expected


def test_set_push_to_hub_is_refused_as_push_to_hub_is(tmp_path):
    from raytrain.config.sections import ConfigError

    _, TrainingArguments = rt()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ConfigError, match="^push_to_hub: the Hugging Face Hub is not supported"):
        args.set_push_to_hub("me/model", strategy="end")
    assert (args.push_to_hub, args.hub_model_id) == (False, None)  # rolled back together


@pytest.mark.parametrize("method", ["set_evaluate", "set_save", "set_logging"])
def test_set_helpers_refuse_zero_steps_like_hf(method, tmp_path):
    _, HFArgs = hf()
    _, TrainingArguments = rt()
    for cls in (HFArgs, TrainingArguments):
        with pytest.raises(ValueError, match="requires a positive value for `steps`"):
            getattr(cls(str(tmp_path), use_cpu=True, report_to="none"), method)(strategy="steps", steps=0)


def test_main_process_first_on_one_process_just_runs_the_block(tmp_path):
    _, HFArgs = hf()
    _, TrainingArguments = rt()
    for cls in (HFArgs, TrainingArguments):
        ran = []
        with cls(str(tmp_path), use_cpu=True, report_to="none").main_process_first(desc="map"):
            ran.append(1)
        assert ran == [1]
