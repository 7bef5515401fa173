"""A Trainer's own sampler as the order of a map-style source (data/sources.sampler_order, what GRPO's RepeatSampler
uses): each epoch is the sampler's next pass, as one torch DataLoader iterated once per epoch; resuming mid-epoch
gives the rest of the same pass; torch's global generator is drawn from at an epoch's start only (also with
DataLoader worker processes)."""

from __future__ import annotations

import torch

from raytrain.data.loaders import WorkerPool
from raytrain.data.sources import MapSource, sampler_order


class Repeat(torch.utils.data.Sampler):
    """A shuffled order with every index twice in a row, from its own generator (as TRL's RepeatSampler)."""

    def __init__(self, n: int, seed: int):
        self.n, self.generator = n, torch.Generator().manual_seed(seed)

    def __iter__(self):
        for i in torch.randperm(self.n, generator=self.generator).tolist():
            yield i
            yield i

    def __len__(self) -> int:
        return 2 * self.n


def _source(sampler, batch_size: int = 4) -> MapSource:
    source = MapSource({"idx": torch.arange(10)}, batch_size, shuffle=True, seed=0, name="train_dataset")
    sampler_order(source, sampler)
    return source


def test_each_epoch_is_the_samplers_next_pass_and_a_resume_the_rest_of_it():
    want = torch.utils.data.DataLoader(range(10), batch_size=4, sampler=Repeat(10, seed=3))
    expected = [[b.tolist() for b in want] for _ in range(3)]  # one DataLoader, three epochs
    source = _source(Repeat(10, seed=3))
    assert len(source) == 5 and source.num_samples == 20
    for epoch in range(3):
        assert [b["idx"].tolist() for b in source.iter_batches(epoch)] == expected[epoch]
    assert [b["idx"].tolist() for b in source.iter_batches(1, start=3)] == expected[1][3:]
    assert expected[0] != expected[1] and source.state()["sampler"] == "Repeat"


def test_the_global_generator_is_drawn_from_at_an_epochs_start_only_with_or_without_workers():
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()  # what torch's DataLoader draws for its base seed
    after_one_draw = torch.get_rng_state()
    for source in (_source(Repeat(10, 3)), WorkerPool(_source(Repeat(10, 3)), num_workers=1)):
        torch.manual_seed(0)
        assert len(list(source.iter_batches(0, start=0))) == 5
        assert torch.equal(torch.get_rng_state(), after_one_draw)
        torch.manual_seed(0)
        fresh = torch.get_rng_state()
        assert len(list(source.iter_batches(0, start=2))) == 3  # a resumed epoch: the restored RNG goes on
        assert torch.equal(torch.get_rng_state(), fresh)
