"""group_by_length: transformers 5.23's LengthGroupedSampler is the oracle for the order (seeded as accelerate
seeds its RandomSampler: data_seed, else seed, plus the epoch), accelerate's loader for the ranks' batches, and
HF's Trainer for the losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrain.config.args import TrainingArguments
from raytrain.data.errors import DataError
from raytrain.data.loaders import build_loader
from raytrain.data.sources import Files, MapSource, group_by_length, hf_order

from . import scripts

EPOCHS = 3


def _hf_batches(lengths, batch_size, accum, world_size, rank, seed) -> list[list[list[int]]]:
    """Each epoch's batches of `rank`: HF's LengthGroupedSampler(batch_size * accum) under a generator seeded
    with seed + epoch, in a loader prepared by accelerate for `world_size` processes."""
    from accelerate.data_loader import prepare_data_loader
    from transformers.trainer_pt_utils import LengthGroupedSampler

    out = []
    for epoch in range(EPOCHS):
        sampler = LengthGroupedSampler(batch_size * accum, lengths=list(lengths),
                                       generator=torch.Generator().manual_seed(seed + epoch))
        loader = torch.utils.data.DataLoader(list(range(len(lengths))), batch_size=batch_size, sampler=sampler,
                                             drop_last=True)
        loader = prepare_data_loader(loader, num_processes=world_size, process_index=rank)
        out.append([b.tolist() for b in loader])
    return out


def _source(lengths, batch_size, accum, world_size, rank, seed, hf=True) -> MapSource:
    source = MapSource({"input_ids": np.zeros((len(lengths), 2)), "length": np.asarray(lengths), "i":
                        np.arange(len(lengths))}, batch_size, seed=seed, rank=rank, world_size=world_size,
                       drop_last=True)
    if hf:
        hf_order(source)
    group_by_length(source, batch_size * accum)
    return source


@pytest.mark.parametrize("n,batch_size,accum,world_size", [(300, 4, 1, 1), (1000, 2, 2, 1), (203, 3, 1, 2),
                                                           (64, 4, 2, 4), (10, 1, 1, 1)])
def test_order_is_hfs_length_grouped_sampler_on_every_rank(n, batch_size, accum, world_size):
    lengths = np.random.default_rng(n).integers(1, 40, size=n)  # many ties: the sort must be stable
    for rank in range(world_size):
        source = _source(lengths, batch_size, accum, world_size, rank, seed=3)
        got = [[b["i"].tolist() for b in source.iter_batches(epoch)] for epoch in range(EPOCHS)]
        assert got == _hf_batches(lengths, batch_size, accum, world_size, rank, seed=3), rank
        assert [b["i"].tolist() for b in source.iter_batches(2, start=3)] == got[2][3:]  # mid-epoch resume
    first = [b["i"].tolist() for b in _source(lengths, batch_size, accum, 1, 0, seed=3).iter_batches(0)][0]
    assert lengths[first[0]] == lengths.max()  # the longest sample comes first, as in HF


def test_raytrains_own_shuffle_is_grouped_too_and_ranks_split_it_by_the_sharding_rule():
    lengths = np.random.default_rng(0).integers(1, 500, size=400)
    whole = _source(lengths, 8, 1, 1, 0, seed=1, hf=False)
    ranks = [_source(lengths, 2, 4, 4, r, seed=1, hf=False) for r in range(4)]  # the same megabatch (8)
    for epoch in range(2):
        want = [b["i"].tolist() for b in whole.iter_batches(epoch)]
        got = [sum((b["i"].tolist() for b in parts), []) for parts in zip(*(s.iter_batches(epoch) for s in ranks))]
        assert got == want
        # Megabatches (12 batches here) are sorted: a batch's lengths are far closer than a shuffled one's.
        spread = np.mean([np.ptp(lengths[b]) for b in want])
        shuffled = np.mean([np.ptp(lengths[b["i"]]) for b in MapSource({"i": np.arange(400)}, 8).iter_batches(0)])
        assert spread < shuffled / 5 and sorted(sum(want, [])) == list(range(400))
    assert whole.state()["group_by_length"] == 8 and "group_by_length" not in MapSource({"x": [1, 2]}, 1).state()


def test_lengths_come_from_the_length_column_else_from_input_ids():
    from datasets import Dataset

    ragged = [[1] * k for k in (3, 1, 2)]
    for data, want in [({"input_ids": np.array(ragged, dtype=object)}, [3, 1, 2]),
                       ({"input_ids": np.zeros((3, 5))}, [5, 5, 5]),
                       (Dataset.from_dict({"input_ids": ragged}), [3, 1, 2]),
                       (Dataset.from_dict({"input_ids": ragged, "length": [7, 8, 9]}), [7, 8, 9]),
                       ([{"input_ids": r} for r in ragged], [3, 1, 2])]:
        source = MapSource(data, 1)
        group_by_length(source, 1)
        assert source.lengths.tolist() == want
    source = MapSource({"input_ids": np.array(ragged, dtype=object), "n": np.array([5, 6, 4])}, 1)
    group_by_length(source, 1, length_column="n")
    assert source.lengths.tolist() == [5, 6, 4]


def test_what_cannot_be_grouped_is_refused_in_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(DataError, match=r"^group_by_length: train_dataset's samples have no 'input_ids' to measure "
                                        r"and no 'length' column \(length_column_name\); .*group_by_length=False$"):
        group_by_length(MapSource([{"x": 1.0}, {"x": 2.0}], 1, name="train_dataset"), 1)
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]] * 8}), tmp_path / "d.parquet")
    args = TrainingArguments(str(tmp_path), train_sampling_strategy="group_by_length", report_to="none")
    kw = dict(seed=0, shuffle=True, drop_last=False, rank=0, world_size=1, collate_fn=list, name="train_dataset")
    with pytest.raises(DataError, match=r"^group_by_length: train_dataset \(.*\) is streamed.*stream=False"):
        build_loader(Files(str(tmp_path / "d.parquet"), stream=True), 4, args, **kw)
    assert build_loader(Files(str(tmp_path / "d.parquet")), 4, args, **kw).lengths.tolist() == [2, 1] * 8
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        TrainingArguments(str(tmp_path), train_sampling_strategy="batch_rebalance")


# ---------------------------------------------------------------- the Trainer, side by side with HF's


def _pad(features):
    """Pads input_ids to the batch's longest; labels ignore padding and the first token (HF counts
    the items of a causal LM's loss from the second label on)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft(lib, out, resume=None, **kw):
    """A tiny Llama on 40 token sequences of 3 to 30 tokens, in batches of 4 padded to their longest."""
    from datasets import Dataset

    Trainer, Args = scripts.LIBS[lib][0]()
    rng = np.random.default_rng(0)
    data = Dataset.from_dict({"input_ids": [rng.integers(1, 64, int(rng.integers(3, 30))).tolist()
                                            for _ in range(40)]})
    args = Args(str(out), num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                **{"save_strategy": "no", "train_sampling_strategy": "group_by_length", **scripts.COMMON, **kw})
    trainer = (_SeededHF if lib == "hf" else Trainer)(model=tiny_llama(), args=args, train_dataset=data,
                                                      data_collator=_pad)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def _hf_trainer():
    import transformers
    from transformers.trainer_pt_utils import LengthGroupedSampler

    class Seeded(LengthGroupedSampler):
        """HF 5.23 draws this sampler's permutation from the global generator; seeded by epoch here."""

        def __init__(self, *a, seed=0, **kw):
            super().__init__(*a, **kw)
            self.seed, self.epoch = seed, 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
            return super().__iter__()

    class Trainer(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            sampler = super()._get_train_sampler(train_dataset)
            return Seeded(sampler.batch_size, lengths=sampler.lengths, seed=self.args.seed)

    return Trainer


def _SeededHF(**kw):
    return _hf_trainer()(**kw)


def _losses(trainer, after=0):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > after]


def test_losses_equal_hfs_and_a_mid_epoch_resume_continues_bit_exact(tmp_path):
    want = _losses(sft("hf", tmp_path / "hf"))
    got = _losses(sft("rt", tmp_path / "rt", data_order="hf", save_strategy="steps", save_steps=13))
    assert len(got) == 20 and got == pytest.approx(want, rel=1e-5)
    assert _losses(sft("rt", tmp_path / "plain", data_order="hf", train_sampling_strategy="random")) != \
        pytest.approx(want, rel=1e-3)
    resumed = sft("rt", tmp_path / "rt", resume=str(tmp_path / "rt" / "checkpoint-13"), data_order="hf",
                  save_strategy="steps", save_steps=13)  # 3 batches into epoch 1
    assert _losses(resumed, after=13) == got[13:]
    assert _losses(sft("rt", tmp_path / "old", data_order="hf", group_by_length=True,
                       train_sampling_strategy="random")) == got  # HF 4's name


def test_a_resume_keeps_the_saved_megabatches_and_refuses_a_change_of_grouping(tmp_path):
    from types import SimpleNamespace

    from raytrain.worker.resume import _check_data_compat

    lengths = np.arange(64) % 7
    saved = {"epoch": 0, "next_batch": 4, **_source(lengths, 2, 4, 1, 0, seed=0, hf=False).state()}  # megabatch 8
    args = TrainingArguments(str(tmp_path), report_to="none")
    now = _source(lengths, 4, 1, 2, 0, seed=0, hf=False)  # an elastic resize: 2 ranks, batch 4, megabatch 4
    _check_data_compat(SimpleNamespace(trainer=SimpleNamespace(args=args), data=now), dict(saved), "ckpt")
    assert now.length_batch == 8 and torch.equal(now.order(0), _source(lengths, 8, 1, 1, 0, 0, hf=False).order(0))
    plain = MapSource({"length": lengths, "i": np.arange(64)}, 2, seed=0, drop_last=True)
    with pytest.raises(ValueError, match=r"^ckpt: resuming would change the data order \(group_by_length True -> "
                                         r"False\); .*ignore_data_skip"):
        _check_data_compat(SimpleNamespace(trainer=SimpleNamespace(args=args), data=plain), dict(saved), "ckpt")
