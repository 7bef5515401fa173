"""WORKER side: input tokens seen (HF's include_num_input_tokens_seen), counted as HF's
_track_num_input_tokens counts them and summed over ranks.

Each micro-batch is counted as read (before it moves to the device: no host sync); several ranks sum
their counts in the step's one all_reduce with the loss items, and the sum (on the device) reaches
TrainerState.num_input_tokens_seen at the next log, evaluation or save (flush).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def counter(trainer: Any) -> Callable[[dict], int] | None:
    """The tokens of one micro-batch under args.include_num_input_tokens_seen; None when it is "no"."""
    how = trainer.args.include_num_input_tokens_seen
    if how == "no":
        return None
    main = getattr(trainer.model, "main_input_name", "input_ids")
    pad = getattr(trainer.processing_class, "pad_token_id", None)
    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:
            warned.add(message)
            logger.warning(message)

    def count(batch: dict) -> int:
        ids = batch.get(main)
        if ids is None:
            warn(f"include_num_input_tokens_seen: the batches have no {main!r} (the model's main_input_name); "
                 "their tokens are not counted")
            return 0
        if how == "non_padding":
            if "attention_mask" in batch:
                return int(batch["attention_mask"].sum())
            if pad is not None:
                return int((ids != pad).sum())
            warn("include_num_input_tokens_seen=non_padding: no attention_mask and no pad_token_id; counting all "
                 "tokens")
        return ids.numel()

    return count


def reduce_counts(strategy: Any, items: torch.Tensor | None, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(items, tokens) summed over ranks in one all_reduce."""
    device = items.device if items is not None else strategy.device
    both = torch.stack([items if items is not None else torch.zeros((), dtype=torch.long, device=device),
                        torch.tensor(tokens, dtype=torch.long, device=device)])
    both = strategy.all_reduce(both)
    return both[0], both[1]


def flush(run: Any) -> None:
    """Add the ranks' tokens summed since the last flush to TrainerState.num_input_tokens_seen."""
    if run.tokens_pending is not None:
        run.trainer.state.num_input_tokens_seen += int(run.tokens_pending)
        run.tokens_pending = None


def speed(run: Any, now: float) -> dict:
    """HF's speed_metrics of a logging step: train_runtime and train_tokens_per_second of this session."""
    runtime = now - run.start_time
    out = {"train_runtime": round(runtime, 4)}
    if runtime > 0:
        tokens = run.trainer.state.num_input_tokens_seen - run.start_tokens
        out["train_tokens_per_second"] = round(tokens / runtime, 3)
    return out
