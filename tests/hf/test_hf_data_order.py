"""data_order="hf": transformers' own Trainer is the oracle for the losses, accelerate's data loader for the
ranks' batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain.config.args import TrainingArguments
from raytrain.data.errors import DataError
from raytrain.data.loaders import build_loader
from raytrain.data.sources import Files, MapSource, hf_order

from . import scripts

EPOCHS = 3  # the shuffle changes every epoch


def _losses(trainer, after: int = 0) -> list[float]:
    """The logged training losses of the steps after `after` (a resumed run's history holds the earlier ones)."""
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > after]


def regression(lib, out, resume=None, **kw):
    """36 rows in batches of 8: 5 steps per epoch, the last one of 4 rows."""
    Trainer, TrainingArguments = scripts.LIBS[lib][0]()
    args = TrainingArguments(str(out), num_train_epochs=EPOCHS, per_device_train_batch_size=8, learning_rate=0.05,
                             logging_steps=1, **{"save_strategy": "no", **scripts.COMMON, **kw})
    trainer = Trainer(model=scripts.TinyRegressor(), args=args, train_dataset=scripts.regression_data(36))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def classification(lib, out, **kw):
    """Tiny BERT on 48 tokenized sentences in batches of 10, padded per batch: the order changes the inputs."""
    from transformers import DataCollatorWithPadding

    Trainer, TrainingArguments = scripts.LIBS[lib][0]()
    tok, train, _ = scripts.tokenized_classification()
    args = TrainingArguments(str(out), num_train_epochs=EPOCHS, per_device_train_batch_size=10, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", **scripts.COMMON, **kw)
    trainer = Trainer(model=scripts.bert(tok), args=args, train_dataset=train, processing_class=tok,
                      data_collator=DataCollatorWithPadding(tok))
    trainer.train()
    return trainer


@pytest.mark.parametrize("script,steps", [(regression, 15), (classification, 15)])
def test_losses_equal_hf_step_for_step_and_differ_without_the_option(tmp_path, script, steps):
    want = _losses(script("hf", tmp_path / "hf"))
    got = _losses(script("rt", tmp_path / "rt", data_order="hf"))
    own = _losses(script("rt", tmp_path / "own"))
    assert len(want) == len(got) == len(own) == steps
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert own[0] != pytest.approx(want[0], rel=1e-3)  # the first batch already differs
    assert own != pytest.approx(want, rel=1e-3)


def test_data_seed_seeds_the_order_as_in_hf(tmp_path):
    want = _losses(regression("hf", tmp_path / "hf", data_seed=5))
    assert _losses(regression("rt", tmp_path / "rt", data_seed=5, data_order="hf")) == pytest.approx(want, rel=1e-6)
    assert _losses(regression("rt", tmp_path / "rt0", data_order="hf")) != pytest.approx(want, rel=1e-3)


def test_resume_mid_epoch_skips_what_hf_skips_bit_exact(tmp_path):
    """Checkpoint 7 is 2 batches into epoch 1: both resume at batch 2 of epoch 1's HF order."""
    save = dict(save_strategy="steps", save_steps=7)
    full = _losses(regression("rt", tmp_path / "rt", data_order="hf", **save))
    resumed = _losses(regression("rt", tmp_path / "rt", resume=str(tmp_path / "rt" / "checkpoint-7"),
                                 data_order="hf", **save), after=7)
    assert len(resumed) == 8 and resumed == full[7:]  # bit-exact
    hf_full = _losses(regression("hf", tmp_path / "hf", **save))
    hf_resumed = _losses(regression("hf", tmp_path / "hf", resume=str(tmp_path / "hf" / "checkpoint-7"), **save),
                         after=7)
    assert hf_resumed == pytest.approx(hf_full[7:], rel=1e-6)
    assert resumed == pytest.approx(hf_resumed, rel=1e-6)


def test_resume_refuses_a_checkpoint_of_the_other_order(tmp_path):
    regression("rt", tmp_path, save_strategy="steps", save_steps=7)
    with pytest.raises(ValueError, match="data_order raytrain -> hf.*ignore_data_skip"):
        regression("rt", tmp_path, resume=str(tmp_path / "checkpoint-7"), data_order="hf")


def _accelerate_batches(n, batch_size, world_size, rank, drop_last, seed, split=False) -> list[list[list[int]]]:
    """Each epoch's batches of `rank` as transformers 5.23 builds the loader: a RandomSampler prepared by
    accelerate (use_seedable_sampler, data_seed, even_batches, split_batches: batch_size the global batch) and
    set_epoch per epoch."""
    from accelerate.data_loader import prepare_data_loader

    rows = list(range(n))
    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size, sampler=torch.utils.data.RandomSampler(rows),
                                         drop_last=drop_last)
    loader = prepare_data_loader(loader, num_processes=world_size, process_index=rank, use_seedable_sampler=True,
                                 data_seed=seed, split_batches=split, even_batches=True)
    out = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        out.append([b.tolist() for b in loader])
    return out


def _source(n, batch_size, world_size, rank, drop_last, seed, split=False, even=True) -> MapSource:
    source = MapSource({"i": np.arange(n)}, batch_size // world_size if split else batch_size, seed=seed, rank=rank,
                       world_size=world_size, drop_last=drop_last)
    hf_order(source, even_batches=even, split_batches=split)
    return source


#: (samples, batch, ranks, drop_last, split_batches): full global batches, dropped tails, tails accelerate fills
#: with samples from the start of the epoch (even_batches), and split batches (the batch is the global one).
CASES = [(40, 4, 2, False, False), (37, 4, 2, True, False), (37, 3, 4, True, False), (36, 8, 1, False, False),
         (38, 4, 2, False, False), (37, 3, 4, False, False), (9, 4, 3, False, False), (38, 8, 2, False, True),
         (37, 6, 3, False, True), (40, 8, 4, True, True)]


@pytest.mark.parametrize("n,batch_size,world_size,drop_last,split", CASES)
def test_ranks_take_the_batches_accelerate_gives_them(n, batch_size, world_size, drop_last, split):
    for rank in range(world_size):
        source = _source(n, batch_size, world_size, rank, drop_last, seed=7, split=split)
        got = [[b["i"].tolist() for b in source.iter_batches(epoch)] for epoch in range(EPOCHS)]
        assert got == _accelerate_batches(n, batch_size, world_size, rank, drop_last, seed=7, split=split), rank
        assert [b["i"].tolist() for b in source.iter_batches(1, start=2)] == got[1][2:]  # resume: skip 2 batches


def test_what_it_cannot_reproduce_is_refused_in_one_line(tmp_path):
    with pytest.raises(DataError, match=r"^accelerator_config.even_batches: false leaves dataset's last partial "
                                        r"global batch \(6 of 8 samples\) to some ranks only.*dataloader_drop_last$"):
        _source(38, 4, 2, 0, False, seed=0, even=False)
    pq.write_table(pa.table({"x": np.arange(16.0)}), tmp_path / "d.parquet")
    args = TrainingArguments(str(tmp_path), data_order="hf", report_to="none")
    kw = dict(seed=0, shuffle=True, drop_last=False, rank=0, world_size=1, collate_fn=None, name="train_dataset")
    with pytest.raises(DataError, match=r"^data_order='hf': train_dataset \(.*\) is streamed.*stream=False"):
        build_loader(Files(str(tmp_path / "d.parquet"), stream=True), 4, args, **kw)
    assert build_loader(Files(str(tmp_path / "d.parquet")), 4, args, **kw).data_order == "hf"
    eval_kw = {**kw, "shuffle": False, "name": "eval_dataset"}  # evaluation keeps its order: nothing to refuse
    build_loader(Files(str(tmp_path / "d.parquet"), stream=True), 4, args, **eval_kw)
