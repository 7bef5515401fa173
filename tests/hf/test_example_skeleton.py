"""The skeleton every official HF example script shares (run_glue.py, run_ner.py) runs against raytrain
with only the import changed; transformers 5.23 runs the same script as the oracle."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import pytest
import torch

from . import scripts
from tests.tiny import logged
from .scripts import hf, rt

logger = logging.getLogger("run_glue")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="tiny-bert", metadata={"help": "built from a config"})


@dataclass
class DataTrainingArguments:
    max_seq_length: int = 32
    max_train_samples: int | None = None
    max_eval_samples: int | None = None


def run_glue(Trainer, TrainingArguments, argv: list[str]) -> dict:
    """run_glue.py's main() with a tiny BERT and the bundled corpus; returns what the test compares."""
    import datasets
    import transformers
    from transformers import DataCollatorWithPadding, HfArgumentParser

    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
                   f"n_gpu: {training_args.n_gpu}, distributed training: "
                   f"{training_args.parallel_mode.value == 'distributed'}, 16-bits training: {training_args.fp16}")
    transformers.set_seed(training_args.seed)

    tok = scripts.corpus.tokenizer()
    raw = scripts.corpus.classification_dataset(64).train_test_split(test_size=16, seed=0)
    with training_args.main_process_first(desc="dataset map pre-processing"):
        raw = raw.map(lambda b: tok(b["text"], truncation=True, max_length=data_args.max_seq_length), batched=True)
    train_dataset, eval_dataset = raw["train"], raw["test"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    trainer = Trainer(model=scripts.bert(tok), args=training_args,
                      train_dataset=train_dataset if training_args.do_train else None,
                      eval_dataset=eval_dataset if training_args.do_eval else None,
                      compute_metrics=scripts.accuracy, processing_class=tok,
                      data_collator=DataCollatorWithPadding(tok))
    out: dict = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        out["train"] = metrics
    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        out["eval"] = metrics
    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-classification"}
    trainer.create_model_card(**kwargs)
    out["trainer"] = trainer
    return out


ARGV = ["--do_train", "--do_eval", "--num_train_epochs", "2", "--per_device_train_batch_size", "8",
        "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
        "--eval_strategy", "epoch", "--save_strategy", "no", "--logging_steps", "1", "--log_level", "info",
        "--use_cpu", "--report_to", "none", "--seed", "0"]  # tqdm on: see the note in the test


def _run(lib: str, out, caplog, argv=ARGV) -> tuple[dict, list[str]]:
    Trainer, TrainingArguments = {"hf": hf, "rt": rt}[lib]()
    caplog.clear()
    roots = [lg for lg in map(logging.getLogger, ("transformers", "raytrain")) if not lg.propagate]
    for r in roots:  # transformers' root logger does not propagate: caplog hears it there
        r.addHandler(caplog.handler)
    try:
        result = run_glue(Trainer, TrainingArguments, ["--output_dir", str(out), *argv])
    finally:
        for r in roots:
            r.removeHandler(caplog.handler)
    return result, [rec.getMessage() for rec in caplog.records]


def _info_blocks(messages: list[str]) -> list[str]:
    """HF's "***** Running ... *****" blocks: each header and the indented lines right after it."""
    out, inside = [], False
    for m in messages:
        if m.lstrip("\n").startswith("***** Running "):
            out.append(m)
            inside = True
        elif inside and m.startswith("  "):
            out.append(m)
        else:
            inside = False
    return out


def _metric_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("  ") and " = " in line]


def _card_sections(text: str) -> dict[str, str]:
    """The card's parts the test compares: name, hyperparameters, results table (losses masked),
    metadata; the framework versions differ by design (raytrain's own line)."""
    hyper = text.split("### Training hyperparameters\n")[1].split("\n### ")[0]
    table = text.split("### Training results\n\n")[1].split("\n\n")[0].splitlines()
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in table]
    return {"front": text.split("\n---\n")[0], "title": [ln for ln in text.splitlines() if ln.startswith("# ")],
            "hyper": hyper, "header": rows[:2], "epoch_step": [r[1:3] for r in rows[2:]],
            "results": [ln.split(":")[0] for ln in text.split("on the evaluation set:\n")[1].split("\n\n")[0]
                        .splitlines()]}


def test_run_glue_skeleton_runs_against_raytrain_as_against_transformers(tmp_path, caplog, capsys):
    argv = [*ARGV, "--optim", "adamw_torch"]  # transformers 5.23 defaults to the fused AdamW
    h, h_logs = _run("hf", tmp_path / "hf", caplog, argv)
    h_out = capsys.readouterr().out
    r, r_logs = _run("rt", tmp_path / "rt", caplog, argv)
    r_out = capsys.readouterr().out

    # The same files in output_dir (raytrain's save_model also writes training_args.json).
    h_files, r_files = set(os.listdir(tmp_path / "hf")), set(os.listdir(tmp_path / "rt"))
    assert {"README.md", "all_results.json", "train_results.json", "eval_results.json", "trainer_state.json"} <= h_files
    assert r_files - h_files == {"training_args.json"} and h_files <= r_files
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        h_json, r_json = (json.loads((tmp_path / lib / name).read_text()) for lib in ("hf", "rt"))
        assert sorted(r_json) == sorted(h_json), name
    assert sorted(r["train"]) == sorted(h["train"]) and sorted(r["eval"]) == sorted(h["eval"])
    assert r["eval"]["eval_samples"] == h["eval"]["eval_samples"] == 16

    # HF's info lines at log_level="info", line by line: training block, one evaluation per epoch and the final one.
    h_info, r_info = _info_blocks(h_logs), _info_blocks(r_logs)
    assert h_info[:10] == ["***** Running training *****", "  Num examples = 48", "  Num Epochs = 2",
                           "  Num update steps per epoch = 3", "  Instantaneous batch size per device = 8",
                           "  Total train batch size (w. parallel, distributed & accumulation) = 16",
                           "  Gradient Accumulation steps = 2", "  Total optimization steps = 6",
                           "  Number of trainable parameters = 36,386", "\n***** Running Evaluation *****"]
    assert h_info.count("\n***** Running Evaluation *****") == 3
    assert r_info == h_info

    # log_metrics prints the same keys, aligned as HF aligns them (values right-aligned to one width).
    for split in ("train", "eval"):
        h_block, r_block = (out.split(f"***** {split} metrics *****\n")[1].split("*****")[0] for out in (h_out, r_out))
        h_lines, r_lines = _metric_lines(h_block), _metric_lines(r_block)
        assert [ln.split(" = ")[0] for ln in r_lines] == [ln.split(" = ")[0] for ln in h_lines]
        assert len({len(ln) for ln in r_lines}) == 1 and len({ln.index(" = ") for ln in r_lines}) == 1
    for key in ("epoch", "train_samples"):
        assert next(ln for ln in _metric_lines(r_out) if ln.split()[0] == key) == \
            next(ln for ln in _metric_lines(h_out) if ln.split()[0] == key)

    # create_model_card: the same metadata, name, hyperparameters and results table shape.
    h_card, r_card = ((tmp_path / lib / "README.md").read_text() for lib in ("hf", "rt"))
    hs, rs = _card_sections(h_card), _card_sections(r_card)
    assert rs["title"] == ["# rt"] and hs["title"] == ["# hf"]
    assert rs["front"] == hs["front"].replace("name: hf", "name: rt")
    assert rs["header"] == hs["header"] == [
        ["Training Loss", "Epoch", "Step", "Validation Loss", "Accuracy"], [":-------------:", ":-----:", ":----:",
                                                                             ":---------------:", ":--------:"]]
    assert rs["epoch_step"] == hs["epoch_step"] == [["1.0", "3"], ["2.0", "6"]]
    assert rs["results"] == hs["results"] == ["- Loss", "- Accuracy"]
    assert rs["hyper"] == hs["hyper"].replace("OptimizerNames.ADAMW_TORCH", "adamw_torch")
    assert "- gradient_accumulation_steps: 2\n- total_train_batch_size: 16\n" in rs["hyper"]
    assert r_card.split("### Framework versions")[0].count("\n") == h_card.split("### Framework versions")[0].count("\n")
    assert "- raytrain " in r_card and "- Transformers " in r_card


# ---------------------------------------------------------------- the helpers, against HF's where HF has them
def _regressor_trainer(out, callbacks=None, **kw):
    Trainer, TrainingArguments = rt()
    args = TrainingArguments(str(out), max_steps=2, per_device_train_batch_size=8, save_strategy="no",
                             weight_decay=0.1, **scripts.COMMON, **kw)
    data = scripts.regression_data()
    return Trainer(model=scripts.TinyRegressor(), args=args, train_dataset=data, eval_dataset=data,
                   callbacks=callbacks)


def test_log_metrics_and_metrics_format_print_what_hf_prints(tmp_path, capsys):
    from transformers.trainer_pt_utils import log_metrics, metrics_format

    metrics = {"epoch": 2.0, "train_loss": 0.123456789, "train_runtime": 3725.5, "train_samples": 48,
               "total_flos": 3 * 2**30 + 5.0, "train_mem_cpu_alloc_delta": 5 * 2**20, "train_samples_per_second": 1.5}
    trainer = _regressor_trainer(tmp_path)
    assert trainer.metrics_format(metrics) == metrics_format(metrics)
    log_metrics(trainer, "train", metrics)
    want = capsys.readouterr().out
    trainer.log_metrics("train", metrics)
    assert capsys.readouterr().out == want
    assert "  train_runtime             = 1:02:05.50" in want


def test_optimizer_helpers_match_hf(tmp_path):
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFArgs

    _, TrainingArguments = rt()
    tok = scripts.corpus.tokenizer()
    bert = scripts.bert(tok)
    trainer = _regressor_trainer(tmp_path)
    assert trainer.get_decay_parameter_names(bert) == HFTrainer.get_decay_parameter_names(None, bert)
    for optim in ("adamw_torch", "adamw_torch_fused"):
        kw = dict(optim=optim, learning_rate=3e-4, adam_beta2=0.98, use_cpu=True, report_to="none")
        got = type(trainer).get_optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path), **kw))
        assert got == HFTrainer.get_optimizer_cls_and_kwargs(HFArgs(str(tmp_path), **kw)), optim
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path), optim="sgd",
                                                                         optim_args="momentum=0.9"))
    assert (cls, kwargs) == (torch.optim.SGD, {"lr": 5e-5, "momentum": 0.9})

    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_optimizer_group()
    trainer.train()
    opt = trainer.optimizer
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args)
    assert type(opt) is cls and all(opt.defaults[k] == (list(v) if k == "betas" else v) or opt.defaults[k] == v
                                    for k, v in kwargs.items())
    weight, bias = trainer.model.lin.weight, trainer.model.lin.bias
    assert trainer.get_optimizer_group(weight)["weight_decay"] == 0.1
    assert trainer.get_optimizer_group(bias)["weight_decay"] == 0.0
    assert [[id(p) for p in g] for g in trainer.get_optimizer_group()] == [[id(weight)], [id(bias)]]
    assert trainer.get_decay_parameter_names(trainer.model) == ["lin.weight"]


def test_num_examples_flos_is_in_train_and_loss_context(tmp_path, caplog):
    from transformers import TrainerCallback

    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(trainer.is_in_train)

    trainer = _regressor_trainer(tmp_path, callbacks=[Watch()])
    assert trainer.num_examples(trainer.get_train_dataloader()) == 32
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    assert trainer.num_examples(loader) == 10
    assert trainer.num_examples([[1], [2], [3]]) == 3 * 8  # no dataset: batches x per-device batch, as HF
    assert trainer.is_in_train is False
    trainer.train()
    assert seen == [True, True] and trainer.is_in_train is False
    total = trainer.state.total_flos
    trainer.current_flos += 1000
    trainer.store_flos()
    assert (trainer.state.total_flos, trainer.current_flos) == (total + 1000, 0)
    with trainer.compute_loss_context_manager():
        assert not torch.is_autocast_enabled("cpu")
    bf16 = _regressor_trainer(tmp_path / "bf16", bf16=True)
    with bf16.compute_loss_context_manager():
        assert torch.is_autocast_enabled("cpu")
    # On transformers' logger, as HF (its own level too: an in-process CLI run earlier set it to WARNING).
    with logged("transformers.trainer") as records:
        trainer.predict(scripts.regression_data(12))
    assert [r.getMessage() for r in records] == [
        "\n***** Running Prediction *****", "  Num examples = 12", "  Batch size = 8"]  # HF's text for predict


def test_accelerator_in_process_and_on_a_process_group(tmp_path, capsys):
    import torch.distributed as dist

    trainer = _regressor_trainer(tmp_path)
    acc = trainer.accelerator
    assert (acc.num_processes, acc.process_index, acc.local_process_index) == (1, 0, 0)
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert acc.device == trainer.args.device
    acc.print("from main")
    assert capsys.readouterr().out == "from main\n"
    acc.wait_for_everyone()
    x = torch.arange(3.0)
    assert acc.gather(x) is x and acc.gather({"a": (x,)})["a"][0] is x

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert acc.unwrap_model(Wrapper(trainer.model)) is trainer.model
    assert acc.free_memory(x, trainer) == [None, None]
    with pytest.raises(TypeError, match="gather: expected tensors"):
        acc.gather("text")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert (acc.num_processes, acc.process_index) == (1, 0)
        assert acc.gather(torch.tensor(2.0)).tolist() == [2.0]  # a scalar: one element per process
        assert acc.gather({"x": x})["x"].tolist() == [0.0, 1.0, 2.0]
        with acc.main_process_first():
            acc.wait_for_everyone()
    finally:
        dist.destroy_process_group()


def test_model_card_for_a_plain_module_and_a_card_already_there(tmp_path):
    trainer = _regressor_trainer(tmp_path / "plain-run")
    trainer.evaluate()
    readme = tmp_path / "plain-run" / "README.md"
    readme.parent.mkdir()
    readme.write_text("---\ntags:\n- kept\n---\nold card\n")
    trainer.create_model_card(tags=["mine"], language="en", license="mit", dataset="digits")
    card = readme.read_text()
    front = card.split("\n---\n")[0]
    assert "library_name" not in front  # not a transformers model
    assert "language:\n- en\nlicense: mit\ntags:\n- mine\n- kept\n- generated_from_trainer\n" in front
    assert "# plain-run\n\nThis model was trained from scratch on the digits dataset." in card
    assert "- eval_loss: " in card and "### Training results" not in card  # evaluated, never trained: as HF
    assert "- training_steps: 2\n" in card and "- optimizer: Use adamw_torch_fused with betas=(0.9,0.999)" in card
