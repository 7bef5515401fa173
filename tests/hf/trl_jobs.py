"""TRL scripts run twice, with `from trl import ...` and `from raytrain.trl import ...`: the same tiny Llama, tokenizer
and data (examples/sft.py), importable on Ray workers too (PYTHONPATH is the repo root)."""

from __future__ import annotations

import warnings

STEP_KEYS = ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens")
DPO_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "entropy", "mean_token_accuracy", "num_tokens")


def libs(lib: str):
    if lib == "trl":
        import trl
        return trl
    import raytrain.trl
    return raytrain.trl


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def sft_args(lib: str, out: str, **kw):
    extra = {"data_order": "hf"} if lib != "trl" else {}  # HF's sampler order, as trl draws it
    base = dict(max_steps=4, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-2, max_length=128,
                report_to="none", save_strategy="no", seed=0, bf16=False, disable_tqdm=True, use_cpu=True)
    return libs(lib).SFTConfig(out, **{**base, **extra, **kw})


def sft_trainer(lib: str, out: str, data=None, peft: bool = True, callbacks=(), **kw):
    """The issue's SFT script: LoRA, conversations with a chat template, assistant-only loss, bfd packing."""
    from datasets import Dataset
    from examples.sft import build_model, build_tokenizer, conversations

    warnings.filterwarnings("ignore", category=FutureWarning)
    kw = {"assistant_only_loss": True, "packing": True, **kw}
    data = Dataset.from_list(conversations(48)) if data is None else data
    return libs(lib).SFTTrainer(model=build_model(), args=sft_args(lib, out, **kw), train_dataset=data,
                                processing_class=build_tokenizer(), peft_config=lora() if peft else None,
                                callbacks=list(callbacks))


def dpo_trainer(lib: str, out: str, data=None, peft: bool = True, ref: bool = False, callbacks=(), **kw):
    """A TRL DPO script: conversational preferences (explicit prompt), LoRA (the reference: adapter disabled)."""
    from datasets import Dataset
    from examples.sft import build_model, build_tokenizer, preferences

    warnings.filterwarnings("ignore", category=FutureWarning)
    extra = {"data_order": "hf"} if lib != "trl" else {}
    base = dict(max_steps=4, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-2, max_length=64,
                report_to="none", save_strategy="no", seed=0, bf16=False, disable_tqdm=True, use_cpu=True)
    args = libs(lib).DPOConfig(out, **{**base, **extra, **kw})
    data = Dataset.from_list(preferences(48)) if data is None else data
    return libs(lib).DPOTrainer(model=build_model(), ref_model=build_model() if ref else None, args=args,
                                train_dataset=data, processing_class=build_tokenizer(),
                                peft_config=lora() if peft else None, callbacks=list(callbacks))


def steps(trainer, keys=STEP_KEYS) -> list[dict]:
    return log_steps(trainer.state.log_history, keys)


def log_steps(log_history: list[dict], keys=STEP_KEYS) -> list[dict]:
    return [{k: e[k] for k in keys if k in e} | {"step": e["step"]} for e in log_history if "loss" in e]


class RankMarker:
    """A callback writing `rank-R-of-W` into `folder` when training starts: which processes trained."""

    def __new__(cls, folder: str):
        import os

        from raytrain import TrainerCallback

        class _Marker(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                import torch.distributed as dist

                rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
                os.makedirs(folder, exist_ok=True)
                open(os.path.join(folder, f"rank-{rank}-of-{world}"), "w").close()

        return _Marker()
