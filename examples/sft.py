"""SFT and DPO with raytrain.trl on data made in code (no download): a small Llama (examples/lora.py's byte-level
tokenizer, with a chat template whose assistant turns are marked for assistant_only_loss) learns arithmetic
conversations. `python -m raytrain.run --config examples/sft.yaml` (or dpo.yaml)."""

from __future__ import annotations

import random

from examples.lora import build_base_model, build_tokenizer as _byte_tokenizer

# {% generation %} marks what assistant_only_loss trains on: the answer and its end-of-turn token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}</s>"
    "{% endgeneration %}{% else %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer():
    """The byte-level tokenizer (259 tokens) with CHAT_TEMPLATE."""
    tok = _byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(hidden_size: int = 32, num_layers: int = 2, intermediate_size: int = 64, seed: int = 0):
    """A tiny LlamaForCausalLM from a config (a pretrained stand-in); LoRA comes from the trainer's peft_config."""
    return build_base_model(hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                            intermediate_size=intermediate_size, max_len=256, seed=seed)


def build_lora_model(r: int = 8, alpha: int = 16, dropout: float = 0.0,
                     target_modules: tuple[str, ...] = ("q_proj", "v_proj"), **base):
    """build_model with a LoRA adapter: what `peft_config=LoraConfig(...)` gives a script (the CLI passes a model)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(r), lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    return get_peft_model(build_model(**base), config)


def _question(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b}?", f"{a + b}.", f"{a + b + rng.choice([-2, -1, 1, 2])}."


def conversations(n: int = 64, seed: int = 0) -> list[dict]:
    """Rows of {'messages': [system, user, assistant]}: the same rows for the same seed, on every process."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, a, _ = _question(rng)
        rows.append({"messages": [{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return rows


def preferences(n: int = 64, seed: int = 0, conversational: bool = True) -> list[dict]:
    """Rows of {'prompt', 'chosen', 'rejected'} (explicit prompt): the right sum chosen, a near miss rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, good, bad = _question(rng)
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": q}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
        else:
            rows.append({"prompt": q + " ", "chosen": good, "rejected": bad})
    return rows


def build_datasets(n_train: int = 256, n_eval: int = 32, kind: str = "sft") -> dict:
    """{'train', 'eval', 'processing_class'} as datasets.Dataset: conversations (sft) or preferences (dpo)."""
    from datasets import Dataset

    make = conversations if kind == "sft" else preferences
    return {"train": Dataset.from_list(make(n_train, seed=0)), "eval": Dataset.from_list(make(n_eval, seed=1)),
            "processing_class": build_tokenizer()}
