"""LoRA fine-tuning of a small Llama on the help topics that ship with Python (pydoc_data, no download).

The base model is a LlamaForCausalLM built from a LlamaConfig with a fixed seed: it stands for a
pretrained checkpoint, which a real job loads with from_pretrained. LoRA (peft) trains low-rank
adapters on q_proj and v_proj; the base stays frozen. The tokenizer is byte-level with a fixed
vocabulary (3 special tokens, then the 256 bytes), so every process, Ray workers included, encodes
the text alike, and final/ saves it beside the adapter. Documents are joined with </s> and packed
into blocks of `block_size` tokens, as transformers' run_clm.py does.
`python -m raytrain.run --config examples/lora.yaml`.
"""

from __future__ import annotations

import warnings

import functools

import numpy as np
import torch

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2; byte b is id 3 + b


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({c: len(SPECIAL) + b for b, c in enumerate(_byte_chars())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return tok.to_str()


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte 0..255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def build_tokenizer():
    """A byte-level PreTrainedTokenizerFast over a fixed vocabulary of 259 tokens (save_pretrained-able)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


@functools.lru_cache(maxsize=1)
def documents() -> tuple[str, ...]:
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    return tuple(topics[k] for k in sorted(topics))


def _packed(docs, tok, block_size: int, max_blocks: int | None) -> dict[str, np.ndarray]:
    ids = [i for d in tok(list(docs))["input_ids"] for i in (*d, tok.eos_token_id)]
    n = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    blocks = np.asarray(ids[:n * block_size], dtype=np.int64).reshape(n, block_size)
    return {"input_ids": blocks, "labels": blocks.copy()}  # the model shifts the labels itself


def build_datasets(block_size: int = 64, val_fraction: float = 0.1, max_train_blocks: int | None = None,
                   max_eval_blocks: int | None = 64) -> dict:
    """{'train', 'eval', 'processing_class'}: packed blocks of whole documents (the last ones, about
    val_fraction of the text, to validation) and the tokenizer, which final/ saves."""
    tok, docs = build_tokenizer(), documents()
    cut = len(docs) - max(1, round(val_fraction * len(docs)))
    train = _packed(docs[:cut], tok, block_size, max_train_blocks)
    val = _packed(docs[cut:], tok, block_size, max_eval_blocks)
    print(f"lora: {len(train['labels'])} train and {len(val['labels'])} validation blocks of {block_size} "
          f"byte tokens (vocabulary {len(tok)})", flush=True)
    return {"train": train, "eval": val, "processing_class": tok}


def build_base_model(hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 172, max_len: int = 256, init_std: float = 0.1, seed: int = 0):
    """The frozen base: a LlamaForCausalLM from a config, its weights from `seed` (a pretrained stand-in).
    init_std 0.1 rather than HF's 0.02: a frozen random head that small caps what an adapter can learn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(SPECIAL) + 256, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_len,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         initializer_range=init_std)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def build_model(r: int = 8, alpha: int = 16, dropout: float = 0.05,
                target_modules: tuple[str, ...] = ("q_proj", "v_proj"), **base):
    """The base model with a LoRA adapter (peft.get_peft_model); `base` goes to build_base_model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(r), lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(build_base_model(**base), config)


def compute_metrics(pred) -> dict[str, float]:
    """Next-byte accuracy over the labelled tokens (position t predicts token t + 1)."""
    logits, labels = pred
    predicted, labels = logits[:, :-1].argmax(-1), labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((predicted == labels)[mask].mean())}
