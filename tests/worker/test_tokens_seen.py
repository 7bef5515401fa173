"""include_num_input_tokens_seen on 2 ranks (processes, gloo, DDP, no Ray): every rank's state holds the
tokens of both ranks' batches, summed in the step's all_reduce, at each log and at the end, and a
resumed run continues the count."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from tests.strategies._gloo import free_port, start

N, WIDTH = 48, 6  # one epoch: 48 rows in global batches of 8 (4 per rank), 6 steps


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, input_ids, attention_mask, labels):
        pooled = (self.emb(input_ids) * attention_mask[..., None]).sum(1)
        return {"loss": torch.nn.functional.mse_loss(self.out(pooled).squeeze(-1), labels)}


def _data():
    rng = np.random.default_rng(0)
    mask = (np.arange(WIDTH)[None] < rng.integers(1, WIDTH + 1, N)[:, None]).astype(np.int64)
    return {"input_ids": rng.integers(0, 16, (N, WIDTH)), "attention_mask": mask,
            "labels": rng.random(N, dtype=np.float32)}


def _rank(rank: int, root: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from raytrain import Trainer, TrainingArguments
    from raytrain.worker import loop

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for how in ("all", "non_padding"):
        for name, resume in (("full", None), ("resumed", os.path.join(root, how, "checkpoint-4"))):
            args = TrainingArguments(os.path.join(root, how), max_steps=6, per_device_train_batch_size=4,
                                     logging_steps=2, save_steps=4, include_num_input_tokens_seen=how,
                                     disable_tqdm=True, report_to="none", scaling={"num_workers": 2},
                                     distributed={"strategy": "ddp"})
            trainer = Trainer(Bag(), args, train_dataset=_data())
            loop.train(trainer, resume)
            out[f"{how}/{name}"] = [(e["step"], e["num_input_tokens_seen"]) for e in trainer.state.log_history]
    dist.destroy_process_group()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_every_rank_counts_the_tokens_of_all_ranks_and_a_resume_continues(tmp_path):
    start(_rank, (str(tmp_path), free_port()), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    full = {how: dict(ranks[0][f"{how}/full"]) for how in ("all", "non_padding")}
    assert full["all"][6] == N * WIDTH and [full["all"][s] for s in (2, 4)] == [16 * WIDTH, 32 * WIDTH]
    assert full["non_padding"][6] == int(_data()["attention_mask"].sum()) < N * WIDTH
    for how in ("all", "non_padding"):
        assert ranks[0][f"{how}/resumed"][-2:] == ranks[0][f"{how}/full"][-2:]  # step 6's log and the end


def test_a_batch_is_counted_as_hf_counts_it(caplog):
    from types import SimpleNamespace

    from raytrain.worker import tokens

    def count(how, batch, pad=None, main="input_ids"):
        trainer = SimpleNamespace(args=SimpleNamespace(include_num_input_tokens_seen=how),
                                  model=SimpleNamespace(main_input_name=main),
                                  processing_class=SimpleNamespace(pad_token_id=pad) if pad is not None else None)
        return tokens.counter(trainer)(batch)

    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    mask = (ids != 0).long()
    assert tokens.counter(SimpleNamespace(args=SimpleNamespace(include_num_input_tokens_seen="no"))) is None
    assert count("all", {"input_ids": ids, "attention_mask": mask}) == 6
    assert count("non_padding", {"input_ids": ids, "attention_mask": mask}) == 3
    assert count("non_padding", {"input_ids": ids}, pad=0) == 3  # no mask: the tokenizer's pad token
    assert count("non_padding", {"input_ids": ids}) == 6 and "counting all tokens" in caplog.text
    assert count("all", {"pixel_values": ids}, main="pixel_values") == 6  # the model's main_input_name
    assert count("all", {"x": ids}) == 0 and "no 'input_ids'" in caplog.text
