"""A character-level GPT on the help topics that ship with Python (pydoc_data, ~460 KB of English).

Documents are joined with an end-of-text character and packed into fixed blocks of `block_size`
characters (no padding, no sample crosses the train/validation split); the loss is per token,
summed and divided by the tokens of the whole update step, so accumulation and ranks weigh every
token alike. The yardstick is the unigram entropy of the validation text: what any model that
ignores context at best achieves. `python -m raytrain.run --config examples/chargpt.yaml`.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

EOT = "\x03"  # end of text: joins the packed documents


@functools.lru_cache(maxsize=1)
def documents() -> tuple[str, ...]:
    import pydoc_data.topics
    return tuple(pydoc_data.topics.topics.values())


@functools.lru_cache(maxsize=1)
def vocab() -> str:
    return "".join(sorted(set(EOT.join(documents())) | {EOT}))


def encode(text: str) -> np.ndarray:
    table = {c: i for i, c in enumerate(vocab())}
    return np.fromiter((table[c] for c in text), dtype=np.int64, count=len(text))


def decode(ids) -> str:
    v = vocab()
    return "".join(v[i] for i in ids)


@functools.lru_cache(maxsize=4)
def split_text(val_fraction: float = 0.1) -> tuple[str, str]:
    """(train, validation) text: whole documents, the last ones (about val_fraction of the characters)
    to validation, so no validation text is seen in training."""
    docs = documents()
    total, tail, cut = sum(map(len, docs)), 0, len(docs)
    while cut > 1 and tail < val_fraction * total:
        cut -= 1
        tail += len(docs[cut])
    return EOT.join(docs[:cut]) + EOT, EOT.join(docs[cut:]) + EOT


def pack(ids: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Non-overlapping blocks: input_ids = ids[i : i+T], labels = ids[i+1 : i+T+1]."""
    n = (len(ids) - 1) // block_size
    return {"input_ids": ids[:n * block_size].reshape(n, block_size),
            "labels": ids[1:n * block_size + 1].reshape(n, block_size)}


@functools.lru_cache(maxsize=4)
def unigram_baseline(val_fraction: float = 0.1) -> float:
    """Entropy (nats per character) of the validation text's own character frequencies."""
    counts = np.bincount(encode(split_text(val_fraction)[1]), minlength=len(vocab())).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def build_datasets(block_size: int = 128, val_fraction: float = 0.1, format: str = "arrays",
                   cache_dir: str | None = None):
    """(train, eval): packed blocks as int64 columns; format 'parquet' writes them once and returns Files."""
    train_text, val_text = split_text(val_fraction)
    train, val = pack(encode(train_text), block_size), pack(encode(val_text), block_size)
    print(f"chargpt: {len(train['labels'])} train and {len(val['labels'])} validation blocks of {block_size} "
          f"characters, vocabulary {len(vocab())}; unigram baseline {unigram_baseline(val_fraction):.4f} nats/char",
          flush=True)
    if format == "arrays":
        return train, val
    if format != "parquet":
        raise ValueError(f"data.format: expected 'arrays' or 'parquet', got {format!r}")
    from raytrain.data import Files
    return tuple(Files(_write_parquet(cols, cache_dir, f"{split}-{block_size}-{val_fraction}"))
                 for split, cols in (("train", train), ("val", val)))


def _write_parquet(cols: dict[str, np.ndarray], cache_dir: str | None, stem: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    directory = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "raytrain", "chargpt")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{stem}.parquet")
    if not os.path.exists(path):
        table = pa.table({k: pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), v.shape[1])
                          for k, v in cols.items()})
        pq.write_table(table, path + ".tmp", row_group_size=256)
        os.replace(path + ".tmp", path)
    return path


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A small decoder-only transformer; returns {"loss", "logits"} as HF models do."""

    def __init__(self, vocab_size: int, max_len: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
                 dropout: float = 0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, n_embd), nn.Embedding(max_len, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        t = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        out = {"logits": logits}
        if labels is not None:  # token-level: summed, over the tokens of the whole update step
            total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                    reduction="sum")
            n = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
            out["loss"] = total / n
        return out

    @torch.no_grad()
    def generate(self, prompt: str, n: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
        g = torch.Generator().manual_seed(seed)
        ids = torch.as_tensor(encode(prompt))[None]
        for _ in range(n):
            logits = self(ids[:, -self.pos.num_embeddings:])["logits"][:, -1] / temperature
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)], dim=1)
        return decode(ids[0].tolist())


def build_model(max_len: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
                dropout: float = 0.0) -> nn.Module:
    return CharGPT(len(vocab()), max_len, n_layer, n_head, n_embd, dropout)


def compute_metrics(pred) -> dict[str, float]:
    """Next-character accuracy, and the unigram baseline next to eval_loss for comparison."""
    logits, labels = pred
    mask = labels != -100
    return {"accuracy": float((logits.argmax(-1) == labels)[mask].mean()), "unigram_baseline": unigram_baseline()}


def main() -> None:
    """Train with the YAML defaults from Python, then print the losses and a sample."""
    from raytrain import Trainer, TrainingArguments
    train, val = build_datasets()
    args = TrainingArguments(output_dir="runs/chargpt-py", max_steps=1200, per_device_train_batch_size=32,
                             learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=100, weight_decay=0.1,
                             adam_beta2=0.99, logging_steps=100, save_strategy="no", overwrite_output_dir=True)
    trainer = Trainer(build_model(), args, train_dataset=train, eval_dataset=val)
    trainer.train()
    metrics = trainer.evaluate()
    print(f"validation loss {metrics['eval_loss']:.4f} nats/char; unigram baseline {unigram_baseline():.4f}")
    print(trainer.model.generate("The "))


if __name__ == "__main__":
    main()
