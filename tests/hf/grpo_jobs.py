"""TRL GRPO / RLOO scripts run twice, with `from trl import ...` and `from raytrain.trl import ...`: the same tiny
Llama (saved once, loaded by path: TRL reloads its reference model from there), tokenizer, prompts and reward
functions. Each reward function records what it was called with, so tests compare the sampled completions."""

from __future__ import annotations

import asyncio
import warnings

from .trl_jobs import libs

PROMPTS = 16


def save_tiny_model(path: str) -> str:
    from examples.sft import build_model

    build_model().save_pretrained(path)
    return path


def prompts(conversational: bool = True, n: int = PROMPTS):
    """Arithmetic questions with a `kind` column (the reward functions read it): every third one is 'chat'."""
    from datasets import Dataset
    from examples.sft import preferences

    rows = preferences(n, conversational=conversational)
    return Dataset.from_list([{"prompt": r["prompt"], "kind": "chat" if i % 3 == 2 else "math"}
                              for i, r in enumerate(rows)])


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


class Recorder:
    """TRL-signature reward functions that remember their calls: (step, prompts, completion ids, rewards); with a
    `folder`, each rank also appends them to folder/rank-R.jsonl (the calls made on Ray workers)."""

    def __init__(self, folder: str | None = None):
        self.calls: list[dict] = []
        self.folder = folder

    def _keep(self, call: dict) -> None:
        self.calls.append(call)
        if self.folder is not None:
            import json
            import os

            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, f"rank-{rank}.jsonl"), "a") as f:
                f.write(json.dumps(call) + "\n")

    def read(self, rank: int) -> list[dict]:
        import json
        import os

        with open(os.path.join(self.folder, f"rank-{rank}.jsonl")) as f:
            return [json.loads(line) for line in f]

    def functions(self, kinds=("length", "digits", "async")) -> list:
        out = []
        if "length" in kinds:
            def length(prompts, completions, completion_ids, trainer_state, **kw):
                rewards = [len(_text(c)) / 8 + 0.01 * trainer_state.global_step for c in completions]
                self._keep({"step": trainer_state.global_step, "prompts": prompts,
                            "completion_ids": [list(ids) for ids in completion_ids], "rewards": rewards})
                return rewards
            out.append(length)
        if "digits" in kinds:  # None where it does not apply (TRL's multi-task rewards)
            def digits(completions, kind, **kw):
                return [None if k == "chat" else float(sum(ch.isdigit() for ch in _text(c)))
                        for c, k in zip(completions, kind)]
            out.append(digits)
        if "async" in kinds:
            async def spaces(completions, **kw):
                await asyncio.sleep(0)
                return [float(_text(c).count(" ")) for c in completions]
            out.append(spaces)
        return out


def reward_model():
    """A sequence classifier (num_labels=1) built from a config, and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from examples.sft import build_tokenizer

    torch.manual_seed(1)
    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=256, num_labels=1,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForSequenceClassification(cfg).eval()
    model.config._name_or_path = "tiny-reward"  # its name in TRL's metrics (rewards/tiny-reward/mean)
    return model, tok


def config(lib: str, kind: str, out: str, **kw):
    base = dict(max_steps=10, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                logging_steps=1, learning_rate=1e-2, report_to="none", save_strategy="no", seed=0, bf16=False,
                disable_tqdm=True, use_cpu=True, gradient_accumulation_steps=2, gradient_checkpointing=False)
    cls = getattr(libs(lib), "GRPOConfig" if kind == "grpo" else "RLOOConfig")
    return cls(out, **{**base, **kw})


def trainer(lib: str, out: str, model_path: str, kind: str = "grpo", peft: bool = False, conversational: bool = True,
            recorder: Recorder | None = None, rewards=("length", "digits", "async"), with_reward_model: bool = False,
            callbacks=(), eval_dataset=None, **kw):
    from examples.sft import build_tokenizer

    from .trl_jobs import lora

    warnings.filterwarnings("ignore", category=FutureWarning)
    recorder = recorder if recorder is not None else Recorder()
    funcs, classes = recorder.functions(rewards), None
    if with_reward_model:
        model, tok = reward_model()
        funcs, classes = [*funcs, model], [None] * len(funcs) + [tok]
    cls = getattr(libs(lib), "GRPOTrainer" if kind == "grpo" else "RLOOTrainer")
    return cls(model=model_path, reward_funcs=funcs, args=config(lib, kind, out, **kw),
               train_dataset=prompts(conversational), eval_dataset=eval_dataset, processing_class=build_tokenizer(),
               reward_processing_classes=classes, peft_config=lora() if peft else None, callbacks=list(callbacks))


def steps(trainer) -> list[dict]:
    """Each step's log (TRL's metrics with it), less the timing."""
    return [{k: v for k, v in e.items() if k not in ("step_time",)} for e in trainer.state.log_history if "loss" in e]


def evaluations(trainer) -> list[dict]:
    """Each evaluation's log, less its timings."""
    return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history if "eval_loss" in e]


ON_TWO = dict(rewards=("length", "digits"), max_steps=4, per_device_train_batch_size=2, num_iterations=2,
              steps_per_generation=4, beta=0.04, peft=True)


def _trl_on_two_processes(out: str, model_path: str) -> None:
    """trl's GRPOTrainer on 2 torchrun processes (gloo): its log and each rank's completions, as JSON."""
    import json
    import os

    import torch

    torch.set_num_threads(1)
    t = trainer("trl", out, model_path, recorder=Recorder(os.path.join(out, "calls")), **ON_TWO)
    t.train()
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(out, "steps.json"), "w") as f:
            json.dump(steps(t), f)


if __name__ == "__main__":  # python -m torch.distributed.run --nproc_per_node 2 -m tests.hf.grpo_jobs OUT MODEL
    import sys

    _trl_on_two_processes(sys.argv[1], sys.argv[2])
