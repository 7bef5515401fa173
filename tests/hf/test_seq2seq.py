"""Seq2SeqTrainer and Seq2SeqTrainingArguments against transformers 5.23's own, on a tiny T5 (built from a
config, no downloads) that reverses short token sequences."""

from __future__ import annotations

import inspect
import logging
from dataclasses import fields

import numpy as np
import pytest
import torch

from . import corpus

COMMON = dict(use_cpu=True, report_to="none", disable_tqdm=True, seed=0, per_device_eval_batch_size=4)


def libs():
    import transformers

    import raytrain

    return {"hf": (transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments),
            "rt": (raytrain.Seq2SeqTrainer, raytrain.Seq2SeqTrainingArguments)}


def t5(tok, seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id, decoder_start_token_id=tok.pad_token_id))


def reverse_task(n: int, seed: int, length: int = 6):
    """input: `length` random word ids and [SEP]; target: the same ids reversed, then [SEP]."""
    from datasets import Dataset

    x = np.random.default_rng(seed).integers(5, 40, size=(n, length)).tolist()
    return Dataset.from_dict({"input_ids": [r + [3] for r in x], "attention_mask": [[1] * (length + 1)] * n,
                              "labels": [r[::-1] + [3] for r in x]})


def compute_metrics(p):
    """What the predictions are: generated ids (2-D) and how many match the target exactly."""
    preds, labels = p.predictions, p.label_ids
    preds = preds[0] if isinstance(preds, tuple) else preds  # without generation: the logits first
    out = {"pred_ndim": float(preds.ndim), "pred_width": float(preds.shape[-1] if preds.ndim == 2 else 0),
           "rows": float(preds.shape[0])}
    if preds.ndim == 2:
        width = min(preds.shape[1] - 1, labels.shape[1])
        out["exact"] = float((preds[:, 1:width + 1] == labels[:, :width]).all(axis=1).mean())
    return out


# --- the arguments --------------------------------------------------------------------------------------


def test_fields_are_transformers_seq2seq_fields():
    from transformers import HfArgumentParser

    (_, HFArgs), (_, Args) = libs()["hf"], libs()["rt"]
    from raytrain.config.seq2seq import SEQ2SEQ_FIELDS

    hf_fields, rt_fields = {f.name: f for f in fields(HFArgs)}, {f.name: f for f in fields(Args)}
    assert not sorted(set(hf_fields) - set(rt_fields)), "fields of transformers' Seq2SeqTrainingArguments refused"
    from transformers import TrainingArguments as HFBase

    assert set(SEQ2SEQ_FIELDS) == set(hf_fields) - {f.name for f in fields(HFBase)} == {
        "sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams",
        "generation_config"}
    for name in SEQ2SEQ_FIELDS:
        assert rt_fields[name].default == hf_fields[name].default, name
        assert rt_fields[name].metadata["help"] and "\n" not in rt_fields[name].metadata["help"], name
    argv = ["--output_dir", "out", "--predict_with_generate", "--generation_max_length", "7",
            "--generation_num_beams", "2", "--use_cpu", "--report_to", "none"]
    (h,) = HfArgumentParser(HFArgs).parse_args_into_dataclasses(argv)
    (r,) = HfArgumentParser(Args).parse_args_into_dataclasses(argv)
    assert isinstance(r, Args)
    assert {n: getattr(r, n) for n in SEQ2SEQ_FIELDS} == {n: getattr(h, n) for n in SEQ2SEQ_FIELDS} == \
        dict(sortish_sampler=False, predict_with_generate=True, generation_max_length=7, generation_num_beams=2,
             generation_config=None)


def test_seq2seq_fields_are_validated_in_one_line(tmp_path, caplog, monkeypatch):
    import raytrain.config.seq2seq
    from raytrain import ConfigError, Seq2SeqTrainingArguments

    monkeypatch.setattr(raytrain.config.seq2seq, "_warned", set())
    cases = {"generation_num_beams": (0, "generation_num_beams: must be >= 1, got 0"),
             "generation_max_length": ("x", "generation_max_length: expected an integer, got 'x'"),
             "generation_config": (3, "generation_config: expected a path or model id, a mapping of GenerationConfig "
                                      "fields or a GenerationConfig, got 3"),
             "predict_with_generat": (True, "unknown field 'predict_with_generat': did you mean "
                                            "'predict_with_generate'?")}
    for name, (value, message) in cases.items():
        with pytest.raises(ConfigError) as e:
            Seq2SeqTrainingArguments(str(tmp_path), **{name: value})
        assert str(e.value) == message
    args = Seq2SeqTrainingArguments(str(tmp_path), generation_max_length=5)
    with pytest.raises(ConfigError, match="^generation_max_length: must be >= 1, got 0$"):
        args.generation_max_length = 0
    assert args.generation_max_length == 5  # rolled back
    args.learning_rate = 0.1  # TrainingArguments' own fields are validated as ever
    with pytest.raises(ConfigError, match="^learning_rate: must be >= 0"):
        args.learning_rate = -1
    with caplog.at_level(logging.WARNING):
        Seq2SeqTrainingArguments(str(tmp_path), sortish_sampler=True)
        args.sortish_sampler = True
    sortish = [r.getMessage() for r in caplog.records if "sortish_sampler" in r.getMessage()]
    assert sortish == ["sortish_sampler is not supported; batches are a seeded shuffle (the same for any number "
                       "of workers)"]
    assert Seq2SeqTrainingArguments.from_dict(args.to_dict()) == args


def test_config_and_cli_take_the_seq2seq_fields(tmp_path):
    from raytrain import ConfigError, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
    from raytrain.run import _parser
    from raytrain.trainer import trainer_class
    from raytrain.config.seq2seq import arguments_from_yaml
    from raytrain.sweep.trial import trial_args

    plain, seq = tmp_path / "plain.yaml", tmp_path / "seq.yaml"
    plain.write_text("learning_rate: 0.01\n")
    seq.write_text("learning_rate: 0.01\npredict_with_generate: true\n")
    a, b = arguments_from_yaml(plain), arguments_from_yaml(seq, ["generation_max_length=9", "generation_config.max_length=9"])
    assert type(a) is TrainingArguments and trainer_class(a) is Trainer
    assert type(b) is Seq2SeqTrainingArguments and trainer_class(b) is Seq2SeqTrainer
    assert (b.learning_rate, b.predict_with_generate, b.generation_max_length, b.generation_config) == \
        (0.01, True, 9, {"max_length": 9})
    with pytest.raises(ConfigError, match="^unknown field 'generation_max_lenght': did you mean 'generation_max_length'"):
        arguments_from_yaml(plain, ["generation_max_lenght=3"])
    with pytest.raises(ConfigError, match="^unknown field 'learnin_rate': did you mean 'learning_rate'"):
        arguments_from_yaml(seq, ["learnin_rate=3"])
    help_text = _parser().format_help()
    assert "--set predict_with_generate=VALUE" in help_text and "--set generation_num_beams=VALUE" in help_text
    import importlib.util
    import os

    hook = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "hooks", "config_reference.py")
    spec = importlib.util.spec_from_file_location("config_reference", hook)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = module.render()  # the configuration page of the docs site
    assert "## Seq2Seq arguments" in reference and "| `generation_max_length` |" in reference
    trial = trial_args(b, {"learning_rate": 0.5}, str(tmp_path / "trial"), None, None)  # a sweep's trial
    assert type(trial) is Seq2SeqTrainingArguments and (trial.learning_rate, trial.generation_max_length) == (0.5, 9)


def test_seq2seq_trainer_keeps_the_worker_protocol():
    from raytrain import Seq2SeqTrainer
    from raytrain.worker.protocol import TrainerProtocol

    for name in ("evaluate", "prediction_step"):  # the Protocol's parameters, then HF's **gen_kwargs
        ours = list(inspect.signature(getattr(Seq2SeqTrainer, name)).parameters)
        theirs = list(inspect.signature(getattr(TrainerProtocol, name)).parameters)
        assert ours == theirs + ["gen_kwargs"], name


# --- generation, side by side with transformers -------------------------------------------------------


def test_predict_with_generate_matches_transformers(tmp_path):
    from transformers import DataCollatorForSeq2Seq

    tok = corpus.tokenizer()
    eval_set = reverse_task(8, seed=1)
    trainers = {}
    for lib, (Trainer, Args) in libs().items():
        model = t5(tok)
        args = Args(str(tmp_path / lib), predict_with_generate=True, **COMMON)
        trainers[lib] = Trainer(model=model, args=args, eval_dataset=eval_set, processing_class=tok,
                                data_collator=DataCollatorForSeq2Seq(tok, model=model), compute_metrics=compute_metrics)
    metrics = {lib: t.evaluate() for lib, t in trainers.items()}
    assert sorted(metrics["rt"]) == sorted(metrics["hf"])
    assert metrics["rt"]["eval_loss"] == pytest.approx(metrics["hf"]["eval_loss"], rel=1e-5)
    assert metrics["rt"]["eval_pred_ndim"] == 2 and metrics["rt"]["eval_rows"] == 8
    assert metrics["rt"]["eval_pred_width"] == metrics["hf"]["eval_pred_width"]

    # generation_max_length / generation_num_beams from the arguments, max_length / max_new_tokens /
    # num_beams given to predict(): the same generated ids, padded to the same width, as transformers'
    settings = [({"generation_max_length": 8}, {}), ({"generation_max_length": 30}, {}),
                ({"generation_num_beams": 2}, {}), ({"generation_max_length": 30}, {"max_length": 12}),
                ({}, {"max_new_tokens": 25, "num_beams": 2})]
    widths, preds = [], []
    for arg_values, gen_kwargs in settings:
        out = {}
        for lib, trainer in trainers.items():
            for name in ("generation_max_length", "generation_num_beams"):
                setattr(trainer.args, name, arg_values.get(name))
            out[lib] = trainer.predict(eval_set, **gen_kwargs)
        setting = (arg_values, gen_kwargs)
        assert out["rt"].predictions.dtype.kind == "i", setting  # token ids, not logits
        np.testing.assert_array_equal(out["rt"].predictions, out["hf"].predictions, err_msg=str(setting))
        np.testing.assert_array_equal(out["rt"].label_ids, out["hf"].label_ids, err_msg=str(setting))
        assert out["rt"].metrics["test_loss"] == pytest.approx(out["hf"].metrics["test_loss"], rel=1e-5)
        widths.append(out["rt"].predictions.shape[1])
        preds.append(out["rt"].predictions)
    # HF's padding: to the generation config's max_length (20), or max_new_tokens + 1, with the pad id
    assert widths == [20, 30, 20, 20, 26]
    assert (preds[0][:, 8:] == tok.pad_token_id).all() and (preds[0][:, 1:8] != tok.pad_token_id).any()
    assert (preds[3][:, 12:] == tok.pad_token_id).all() and (preds[3][:, 1:12] != tok.pad_token_id).any()
    assert not np.array_equal(preds[2], preds[0])  # the beams found other sequences than greedy search

    # without predict_with_generate the predictions are the logits, as in HF
    for lib, trainer in trainers.items():
        trainer.args.predict_with_generate = False
    plain = {lib: t.predict(eval_set) for lib, t in trainers.items()}
    assert plain["rt"].predictions[0].shape == plain["hf"].predictions[0].shape == (8, 7, len(tok))


def test_generation_config_is_loaded_like_transformers(tmp_path):
    import transformers
    from transformers import GenerationConfig

    from raytrain import Seq2SeqTrainer, Seq2SeqTrainingArguments

    given = GenerationConfig(max_length=25, num_beams=2, pad_token_id=0, eos_token_id=3, decoder_start_token_id=0)
    given.save_pretrained(tmp_path / "gen")
    sources = [given, str(tmp_path / "gen"), str(tmp_path / "gen" / "generation_config.json")]
    for source in sources:
        ours = Seq2SeqTrainer.load_generation_config(source)
        assert ours.to_dict() == transformers.Seq2SeqTrainer.load_generation_config(source).to_dict()
    assert Seq2SeqTrainer.load_generation_config({"max_length": 25, "num_beams": 2}).max_length == 25
    with pytest.raises(ValueError) as hf_error:
        transformers.Seq2SeqTrainer.load_generation_config(GenerationConfig(do_sample=False, temperature=0.5))
    with pytest.raises(ValueError) as error:
        Seq2SeqTrainer.load_generation_config({"do_sample": False, "temperature": 0.5})
    assert str(error.value).startswith("generation_config: ") and "\n" not in str(error.value)
    assert "temperature" in str(error.value) and "temperature" in str(hf_error.value)

    tok = corpus.tokenizer()
    args = Seq2SeqTrainingArguments(str(tmp_path / "rt"), predict_with_generate=True,
                                    generation_config={"max_length": 25, "decoder_start_token_id": 0}, **COMMON)
    trainer = Seq2SeqTrainer(model=t5(tok), args=args, processing_class=tok)
    assert trainer.model.generation_config.max_length == 25
    assert trainer.predict(reverse_task(8, seed=2)).predictions.shape == (8, 25)


# --- on Ray workers ---------------------------------------------------------------------------------------


_SHIPPED: dict = {}


def group_part(root):
    """The T5 run in the session's worker group (conftest.py), shipped as Trainer.train ships it."""
    from transformers import DataCollatorForSeq2Seq

    from raytrain import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from tests.group import ship

    def shapes(p):  # defined here: pickled by value for the workers, as HF scripts' own functions are
        return {"pred_ndim": float(p.predictions.ndim), "pred_width": float(p.predictions.shape[-1]),
                "rows": float(p.predictions.shape[0])}

    tok = corpus.tokenizer()
    model = t5(tok)
    args = Seq2SeqTrainingArguments(
        str(root / "out"), predict_with_generate=True, generation_max_length=24, per_device_train_batch_size=8,
        max_steps=6, learning_rate=3e-3, eval_strategy="steps", eval_steps=3, save_strategy="no",
        scaling={"num_workers": 2}, **COMMON)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=reverse_task(96, seed=0),
                             eval_dataset=reverse_task(16, seed=1), processing_class=tok,
                             data_collator=DataCollatorForSeq2Seq(tok, model=model), compute_metrics=shapes)
    _SHIPPED["t5"] = trainer
    return "tests.group:run_cases", {"cases": {"t5": ship(trainer, "t5")}}


@pytest.mark.ray
@pytest.mark.xdist_group("worker_group")
@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
def test_seq2seq_trainer_generates_on_two_ray_workers(worker_group):
    """On 2 Ray workers (the session's worker group), then in the driver's trainer as Trainer.train leaves it."""
    from tests.group import land, part

    _, values = part(worker_group, __file__)
    trainer = _SHIPPED["t5"]
    out = land(trainer, values["t5"])
    assert out.global_step == 6
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [3, 6]
    for h in evals:  # generated ids from both ranks' halves, padded to generation_max_length
        assert (h["eval_pred_ndim"], h["eval_pred_width"], h["eval_rows"]) == (2, 24, 16), h
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    again = trainer.evaluate(num_beams=2, max_length=10)  # the driver holds rank 0's model afterwards
    assert (again["eval_pred_width"], again["eval_rows"]) == (20, 16)
    # HF 5.23's factor: T5's forward takes **kwargs, so HF's compute_loss multiplies its loss by the process count
    # (2 on the workers, 1 on the driver), which T5's mean cross-entropy does not divide back out
    assert 2 * again["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-4)
