"""Handwritten digits (scikit-learn's bundled 8x8 images, no download) with a small MLP."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class DigitsMLP(nn.Module):
    """64 pixels -> hidden -> hidden -> 10 classes; returns {"loss", "logits"} as HF models do."""

    def __init__(self, hidden_size: int = 128, dropout: float = 0.1, num_layers: int = 2):
        super().__init__()
        layers, width = [], 64
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_size), nn.LayerNorm(hidden_size), nn.GELU(), nn.Dropout(dropout)]
            width = hidden_size
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, pixels, labels=None):
        logits = self.head(self.body(pixels))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def build_model(hidden_size: int = 128, dropout: float = 0.1, num_layers: int = 2) -> nn.Module:
    return DigitsMLP(hidden_size, dropout, num_layers)


def build_datasets(val_fraction: float = 0.2, split_seed: int = 0):
    """(train, eval) as dicts of arrays: pixels scaled to [0, 1], a fixed stratified-by-shuffle split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    idx = np.random.default_rng(split_seed).permutation(len(y))
    n_val = int(len(y) * val_fraction)
    val, train = idx[:n_val], idx[n_val:]
    return {"pixels": x[train], "labels": y[train]}, {"pixels": x[val], "labels": y[val]}


def compute_metrics(pred) -> dict[str, float]:
    predictions, labels = pred
    return {"accuracy": float((np.argmax(predictions, axis=-1) == labels).mean())}


def main() -> None:
    """The same job from Python instead of the CLI."""
    from raytrain import Trainer, TrainingArguments

    train, val = build_datasets()
    args = TrainingArguments(output_dir="runs/digits-py", num_train_epochs=20, per_device_train_batch_size=32,
                             learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=0.05,
                             eval_strategy="epoch", save_strategy="epoch", save_total_limit=2,
                             load_best_model_at_end=True, metric_for_best_model="accuracy", logging_steps=50,
                             overwrite_output_dir=True)
    trainer = Trainer(build_model(), args, train_dataset=train, eval_dataset=val, compute_metrics=compute_metrics)
    trainer.train()
    print(trainer.evaluate())


if __name__ == "__main__":
    main()
