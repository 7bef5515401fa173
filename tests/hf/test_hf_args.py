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


def test_push_to_hub_warns_once(tmp_path, caplog, monkeypatch):
    import raytrain.validation

    _, TrainingArguments = rt()
    monkeypatch.setattr(raytrain.validation, "_warned", set())  # the warning is once per process
    with caplog.at_level(logging.WARNING):
        TrainingArguments(str(tmp_path), push_to_hub=True, use_cpu=True, report_to="none")
        TrainingArguments(str(tmp_path), push_to_hub=True, use_cpu=True, report_to="none")
    hub = [r for r in caplog.records if "push_to_hub" in r.getMessage()]
    assert len(hub) == 1 and "not supported" in hub[0].getMessage()


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
