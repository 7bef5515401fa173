"""Sharded weights in checkpoints, as Hugging Face users make them: raytrain shards as save_pretrained
does and lists every shard in the manifest; it resumes a checkpoint of transformers' own Trainer
(sharded or not) and a raytrain checkpoint whose weights were re-saved by save_pretrained; a damaged
shard or an incomplete re-save is refused, naming the file."""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil

import pytest
import torch
import xxhash
from safetensors.torch import load_file

pytest.importorskip("transformers")

from raytrain import CheckpointError, TrainerCallback  # noqa: E402
from raytrain.checkpoint import store as ckpt, weights as ckpt_weights  # noqa: E402
from tests.hf import scripts  # noqa: E402
from tests.tiny import StopAt  # noqa: E402

SHARD = 30_000     # bytes: the tiny BERT's 146 kB of weights in 4 shards, its word embeddings alone in one
RESHARD = 50_000   # a user's re-save: 3 shards, other file names
FULL = 48          # the whole training split in one batch: HF's sampler order cannot change a step


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def data():
    return scripts.tokenized_classification()


def run(lib, out, data, *, max_steps=4, batch=16, init_seed=0, callbacks=(), **kw):
    from transformers import DataCollatorWithPadding

    Trainer, TrainingArguments = scripts.LIBS[lib][0]()
    tok, train, _ = data
    args = TrainingArguments(str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=batch,
                             learning_rate=1e-3, logging_steps=1, **scripts.COMMON, **kw)
    return Trainer(model=scripts.bert(tok, seed=init_seed), args=args, train_dataset=train, processing_class=tok,
                   data_collator=DataCollatorWithPadding(tok), callbacks=list(callbacks))


def rt(out, data, **kw):
    return run("rt", out, data, full_determinism=True, **kw)


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def losses(trainer) -> list:
    return [(h["step"], h["loss"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def shards(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("model-"))


class WeightsAtStart(TrainerCallback):
    """The model's weights when training begins, i.e. right after the checkpoint was applied."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.step = state.global_step


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """raytrain's uninterrupted 4 steps (unsharded: the weights' layout on disk changes nothing)."""
    ref = rt(tmp_path_factory.mktemp("ref"), data, save_strategy="no")
    ref.train()
    return weights(ref), losses(ref)


def test_sharded_as_save_pretrained_shards_and_every_shard_is_in_the_manifest(tmp_path, data, monkeypatch):
    from huggingface_hub.serialization._base import parse_size_to_int
    from transformers import BertForSequenceClassification, PreTrainedModel

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert ckpt_weights.MAX_SHARD_BYTES == parse_size_to_int(default)  # HF's Trainer saves with that default
    monkeypatch.setattr(ckpt_weights, "MAX_SHARD_BYTES", SHARD)
    trainer = rt(tmp_path / "rt", data, max_steps=2)
    trainer.train()
    path = tmp_path / "rt" / "checkpoint-2"
    trainer.model.save_pretrained(tmp_path / "hf", max_shard_size=SHARD)
    index = json.load(open(path / ckpt.WEIGHTS_INDEX))
    assert shards(path) == shards(tmp_path / "hf") and len(shards(path)) == 4 and not (path / ckpt.WEIGHTS).exists()
    assert index["weight_map"] == json.load(open(tmp_path / "hf" / ckpt.WEIGHTS_INDEX))["weight_map"]
    files = json.load(open(path / "manifest.json"))["files"]
    for name in [*shards(path), ckpt.WEIGHTS_INDEX]:
        digest = xxhash.xxh3_128((path / name).read_bytes()).hexdigest()
        assert files[name] == {"size": os.path.getsize(path / name), "xxh3_128": digest}
    assert_same(BertForSequenceClassification.from_pretrained(path).state_dict(), weights(trainer))
    # tensors larger than the limit in the middle (the position embeddings, the feed-forward weights):
    # each alone in a shard, placed where save_pretrained places it
    os.makedirs(tmp_path / "small")
    ckpt.save_weights(weights(trainer), str(tmp_path / "small"), max_shard_bytes=6000)
    trainer.model.save_pretrained(tmp_path / "hf_small", max_shard_size=6000)
    assert shards(tmp_path / "small") == shards(tmp_path / "hf_small") and len(shards(tmp_path / "small")) > 10
    assert (json.load(open(tmp_path / "small" / ckpt.WEIGHTS_INDEX))["weight_map"]
            == json.load(open(tmp_path / "hf_small" / ckpt.WEIGHTS_INDEX))["weight_map"])
    # HF 5.23 has no save_safetensors (always safetensors): both refuse it
    Trainer, TrainingArguments = scripts.hf()
    with pytest.raises(TypeError, match="save_safetensors"):
        TrainingArguments(str(tmp_path), save_safetensors=False)
    with pytest.raises(TypeError, match="unknown field 'save_safetensors'"):
        scripts.rt()[1](str(tmp_path), save_safetensors=False)


def test_raytrain_sharded_checkpoint_resumes_bit_exact_and_a_damaged_shard_is_refused(tmp_path, data, reference,
                                                                                       monkeypatch):
    ref_weights, ref_losses = reference
    monkeypatch.setattr(ckpt_weights, "MAX_SHARD_BYTES", SHARD)
    rt(tmp_path, data, callbacks=[StopAt(2)]).train()
    path = tmp_path / "checkpoint-2"
    assert len(shards(path)) == 4
    resumed = rt(tmp_path, data, init_seed=7)
    resumed.train(resume_from_checkpoint=str(path))
    assert_same(weights(resumed), ref_weights)
    assert losses(resumed) == ref_losses
    # one flipped byte in a shard: refused, naming the shard and what to do
    last = path / shards(path)[-1]
    raw = bytearray(last.read_bytes())
    raw[-1] ^= 0xFF
    last.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"checkpoint-2/{last.name}: xxh3_128 checksum mismatch .*"
                                              "resume from another checkpoint"):
        rt(tmp_path, data).train(resume_from_checkpoint=str(path))
    with pytest.raises(CheckpointError, match=rf"checkpoint-2/{last.name}: .*checksum mismatch"):
        ckpt.load_weights(str(path), ckpt.read_manifest(str(path)))


def test_weights_resaved_by_save_pretrained_sharded_resume_bit_exact_only_when_complete(tmp_path, data, reference,
                                                                                         monkeypatch, caplog):
    from transformers import BertForSequenceClassification

    ref_weights, ref_losses = reference
    monkeypatch.setattr(ckpt_weights, "MAX_SHARD_BYTES", SHARD)
    rt(tmp_path, data, callbacks=[StopAt(2)]).train()
    path = tmp_path / "checkpoint-2"
    ours = shards(path)
    BertForSequenceClassification.from_pretrained(path).save_pretrained(path, max_shard_size=RESHARD)
    assert len(shards(path)) == 3 and not set(shards(path)) & set(ours)  # save_pretrained removed raytrain's
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        resumed = rt(tmp_path, data, init_seed=7)
        resumed.train(resume_from_checkpoint=str(path))
    note = next(r.getMessage() for r in caplog.records if "re-saved by another tool" in r.getMessage())
    assert "model-00001-of-00003.safetensors" in note and f"{ours[0]}" in note and "config.json" in note
    assert_same(weights(resumed), ref_weights)
    assert losses(resumed) == ref_losses
    # an incomplete re-save (a shard the index lists is gone) is refused, naming it and what to do
    os.remove(path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"checkpoint-2/model-00002-of-00003\.safetensors: missing \(listed in "
                                              r"model\.safetensors\.index\.json\).*save_pretrained"):
        rt(tmp_path, data).train(resume_from_checkpoint=str(path))


def test_unsharded_checkpoint_with_a_sharded_copy_beside_it_loads_the_manifests_weights(tmp_path, data, reference,
                                                                                        caplog):
    from transformers import BertForSequenceClassification

    ref_weights, ref_losses = reference
    rt(tmp_path, data, callbacks=[StopAt(2)]).train()
    path = tmp_path / "checkpoint-2"
    model = BertForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        model.classifier.bias.add_(1.0)  # from_pretrained reads model.safetensors first, and so does raytrain
    model.save_pretrained(path, max_shard_size=RESHARD)
    assert (path / ckpt.WEIGHTS).exists() and len(shards(path)) == 3
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        resumed = rt(tmp_path, data, init_seed=7)
        resumed.train(resume_from_checkpoint=str(path))
    assert "model-00001-of-00003.safetensors" in caplog.text and "ignored" in caplog.text
    assert_same(weights(resumed), ref_weights)
    assert losses(resumed) == ref_losses


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single"])
def test_a_checkpoint_of_transformers_trainer_resumes(tmp_path, data, sharded, monkeypatch, caplog):
    """HF's own run to step 4 against raytrain continuing HF's checkpoint-2 (full batches: HF's sampler
    order cannot matter): the weights, optimizer and schedule come back, so steps 3 and 4 agree."""
    from transformers import PreTrainedModel

    if sharded:  # HF's Trainer saves with save_pretrained's default max_shard_size: make it small
        save = PreTrainedModel.save_pretrained
        monkeypatch.setattr(PreTrainedModel, "save_pretrained",
                            lambda self, d, **kw: save(self, d, **{**kw, "max_shard_size": SHARD}))
    hf = run("hf", tmp_path / "hf", data, batch=FULL)
    hf.train()
    src = tmp_path / "hf" / "checkpoint-2"
    assert (len(shards(src)) == 4) == sharded and not (src / "manifest.json").exists()
    saved = {k: v for n in os.listdir(src) if n.endswith(".safetensors") for k, v in load_file(src / n).items()}
    start = WeightsAtStart()
    with caplog.at_level(logging.WARNING, logger="raytrain.worker.resume"):
        if sharded:  # auto resume finds it in output_dir
            shutil.copytree(src, tmp_path / "rt" / "checkpoint-2")
            resumed = run("rt", tmp_path / "rt", data, batch=FULL, init_seed=7, callbacks=[start])
            resumed.train(resume_from_checkpoint=True)
        else:
            resumed = run("rt", tmp_path / "rt", data, batch=FULL, init_seed=7, callbacks=[start])
            resumed.train(resume_from_checkpoint=str(src))
    assert "written by transformers' Trainer" in caplog.text
    assert start.step == 2
    assert_same(start.weights, saved)
    ours, theirs = losses(resumed), losses(hf)
    assert ours[:2] == theirs[:2] and [s for s, _, _ in ours] == [1, 2, 3, 4]  # trainer_state.json's history
    assert [lr for _, _, lr in ours] == [lr for _, _, lr in theirs]  # the schedule continues
    torch.testing.assert_close([loss for _, loss, _ in ours[2:]], [loss for _, loss, _ in theirs[2:]],
                               rtol=1e-4, atol=1e-4)
    for k, v in weights(hf).items():
        torch.testing.assert_close(weights(resumed)[k], v, rtol=1e-4, atol=1e-5)
    assert json.load(open(tmp_path / "rt" / "checkpoint-4" / "manifest.json"))["global_step"] == 4
