"""GRPO with raytrain.trl on prompts made in code (no download): the LoRA Llama of examples/sft.py is rewarded for
answering arithmetic questions with the right sum, briefly. `python -m raytrain.run --config examples/grpo.yaml`;
the YAML names the reward functions below by import string (reward_funcs)."""

from __future__ import annotations

import random
import re


def prompts(n: int = 64, seed: int = 0) -> list[dict]:
    """Rows of {'prompt': [user turn], 'answer'}: conversational prompts; `answer` reaches the reward functions."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)})
    return rows


def build_datasets(n_train: int = 64, n_eval: int = 8) -> dict:
    """{'train', 'eval', 'processing_class'} as datasets.Dataset, with examples/sft.py's chat tokenizer."""
    from datasets import Dataset

    from examples.sft import build_tokenizer

    return {"train": Dataset.from_list(prompts(n_train, seed=0)), "eval": Dataset.from_list(prompts(n_eval, seed=1)),
            "processing_class": build_tokenizer()}


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct_sum(completions, answer, **kwargs) -> list[float]:
    """1 when the completion's first number is the sum, else 0 (TRL's signature: `answer` is the dataset's column)."""
    rewards = []
    for completion, want in zip(completions, answer):
        number = re.search(r"\d+", _text(completion))
        rewards.append(1.0 if number is not None and number.group() == want else 0.0)
    return rewards


def brevity(completions, **kwargs) -> list[float]:
    """Up to 0.5 for a short answer: minus 0.05 per character beyond the first four."""
    return [0.5 - 0.05 * max(0, len(_text(c).strip()) - 4) for c in completions]
