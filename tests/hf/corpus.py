"""Bundled text, a tokenizer trained on it, and tiny HF models built from configs: no downloads."""

from __future__ import annotations

import functools
import re


@functools.cache
def sentences(n: int = 400) -> list[str]:
    """Sentences of the standard library's pydoc topics (shipped with every CPython)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    out = [s.strip() for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text)) if 20 <= len(s.strip()) <= 200]
    return out[:n]


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(sentences(), trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok.to_str()


def tokenizer():
    """A BERT-style fast tokenizer trained on the bundled sentences."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), unk_token="[UNK]",
                                   pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=64)


def classification_dataset(n: int = 160):
    """A datasets.Dataset of (text, label): label 1 when the sentence has a comma."""
    from datasets import Dataset

    texts = sentences()[:n]
    labels = [int("," in t) for t in texts]
    return Dataset.from_dict({"text": texts, "label": labels})


def bert_config(vocab_size: int, num_labels: int = 2):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, num_labels=num_labels)


def gpt2_config(vocab_size: int):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64)
