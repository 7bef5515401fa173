"""LoRA jobs for the Ray tests, importable on the driver and on Ray workers (PYTHONPATH is the repo root):
token ids made from a seeded generator, so every process builds the same data without a tokenizer."""

from __future__ import annotations

import os

import torch

VOCAB = 96
BACKENDS = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp", "fsdp": {"wrap_classes": ["LlamaDecoderLayer"]}},
    "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 3}}},
}


FULL = {"full_ddp": "ddp", "full_fsdp": "fsdp", "full_zero3": "zero3"}  # the base model itself, no adapter


def lm_rows(n: int = 32, length: int = 16) -> list[dict]:
    ids = torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def base_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def lora_model(dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base_model(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM"))


def lora_args(output_dir: str, workers: int, **kw):
    from raytrain import TrainingArguments

    return TrainingArguments(output_dir, **{
        "max_steps": 6, "per_device_train_batch_size": 8 // workers, "learning_rate": 1e-2, "logging_steps": 1,
        "save_steps": 3, "seed": 0, "report_to": "none", "disable_tqdm": True, "use_cpu": True,
        "optim": "adamw_torch", "scaling": {"num_workers": workers}, **kw})


def run_lora_backends(config: dict) -> dict:
    """A Ray Train worker function: the LoRA job once per backend in one worker group (DDP, FSDP2 with
    LoRA's mixed requires_grad, ZeRO-3), then the base model fully fine-tuned on each; rank 0 returns each
    run's losses, or its error."""
    from raytrain import Trainer
    from raytrain.worker import loop

    results = {}
    runs = [(name, lora_model, distributed) for name, distributed in BACKENDS.items()]
    runs += [(name, base_model, BACKENDS[backend]) for name, backend in FULL.items()]
    for name, build, distributed in runs:
        out = os.path.join(config["root"], name)
        trainer = Trainer(build(), lora_args(out, 2, distributed=distributed), train_dataset=lm_rows())
        try:
            loop.train(trainer)
            trainer.save_model(os.path.join(out, "final"))
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results[name] = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    return results if int(os.environ.get("RANK", 0)) == 0 else None
