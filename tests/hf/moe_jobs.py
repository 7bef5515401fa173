"""Tiny mixture-of-experts models (Qwen3-MoE, Mixtral) with their router loss on, their data, and the oracle of a
2-process run: transformers' own Trainer.compute_loss on each rank's batch, with accelerate's process count set
to 2, the gradients averaged as DDP averages them. Importable on Ray workers (PYTHONPATH is the repo root)."""

from __future__ import annotations

import json
import os
from unittest import mock

import torch

VOCAB, SEQ = 64, 10
COMMON = dict(use_cpu=True, report_to="none", disable_tqdm=True, seed=0, logging_steps=1, save_strategy="no",
              learning_rate=3e-3, optim="adamw_torch", lr_scheduler_type="constant", max_grad_norm=1.0)


def model(kind: str, coef: float = 0.05):
    """A 2-layer MoE causal LM of `kind` ("qwen3_moe" or "mixtral"), seeded, router loss weighted by `coef`."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(3)
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=32, use_cache=False, pad_token_id=0,
                num_experts_per_tok=2, router_aux_loss_coef=coef, output_router_logits=True)
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**base, moe_intermediate_size=24, num_experts=4))
    return MixtralForCausalLM(MixtralConfig(**base, num_local_experts=4))


class Rows(torch.utils.data.Dataset):
    """`n` token rows of SEQ, some shorter (padded: attention_mask 0, labels -100), so micro-batches differ in
    their loss items."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(11)
        self.rows = []
        for i in range(n):
            ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
            keep = SEQ - (i % 4)
            mask = (torch.arange(SEQ) < keep).long()
            self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                              "labels": torch.where(mask.bool(), ids, torch.tensor(-100))})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


class RecordRows:
    """A forward pre-hook (pickled with the model to the workers): each training forward's input rows, appended to
    <directory>/rank<R>.jsonl."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, module, args, kwargs) -> None:
        if module.training:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            with open(os.path.join(self.directory, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(kwargs["input_ids"].tolist()) + "\n")


def two_process_oracle(kind: str, rows: Rows, batches: dict[int, list[list[int]]], steps_mb: int, out: str,
                       **kw) -> list[float]:
    """Per-step losses HF's Trainer logs on 2 processes: each rank's micro-batches (`batches[rank]`, dataset
    indices, `steps_mb` per step) through transformers' compute_loss with num_processes 2 and num_items_in_batch
    counted over both ranks' labels[..., 1:]; DDP's mean of the gradients; the logged loss the ranks' mean."""
    from transformers import Trainer, TrainingArguments

    net = model(kind)
    trainer = Trainer(model=net, args=TrainingArguments(out, **{**COMMON, **kw}))
    collate = torch.utils.data.default_collate
    optimizer = torch.optim.AdamW(net.parameters(), lr=COMMON["learning_rate"], weight_decay=0.0)
    n_mb = len(batches[0])
    logged = []
    with mock.patch.object(trainer.accelerator.state, "num_processes", 2):
        for start in range(0, n_mb, steps_mb):
            step = {r: [collate([rows[i] for i in b]) for b in batches[r][start:start + steps_mb]] for r in (0, 1)}
            items = sum(mb["labels"][..., 1:].ne(-100).sum() for r in (0, 1) for mb in step[r])
            total = 0.0
            for r in (0, 1):
                for mb in step[r]:
                    loss = trainer.compute_loss(net, mb, num_items_in_batch=items)
                    (loss / 2).backward()  # DDP: the mean over the ranks
                    total += float(loss) / 2
            torch.nn.utils.clip_grad_norm_(net.parameters(), COMMON["max_grad_norm"])
            optimizer.step()
            optimizer.zero_grad()
            logged.append(total)
    return logged
