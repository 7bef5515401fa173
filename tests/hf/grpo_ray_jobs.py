"""GRPO on 2 Ray workers against trl: reward functions that write what each rank scored (the completions it sampled)
into a folder; one Ray Train worker group that runs trl's GRPOTrainer on its 2 processes (accelerate over the
group's gloo process group), then raytrain.trl's under DDP, FSDP2 (LoRA) and ZeRO-3 through the workers' own
function (ray_worker.train_loop_per_worker, the trainer pickled on the driver as a Ray run ships it); trl's
GRPOTrainer in one process replaying the workers' completions. Importable on Ray workers too (PYTHONPATH is the
repo root)."""

from __future__ import annotations

import json
import os

from . import grpo_jobs

BACKENDS = {"ddp": {"strategy": "ddp"},
            "fsdp2": {"strategy": "fsdp", "fsdp": {"wrap_classes": ["LlamaDecoderLayer"]}},
            "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 3}}}}
# num_iterations 2 with beta > 0 (the old policy's and the reference's log-probs); steps_per_generation = the 2
# accumulation steps, so each update sees its whole generation batch: the gradient does not depend on which rows
# each rank holds, and 2 workers can match one process (TRL shuffles a rank's rows into its micro-batches)
RUN = dict(max_steps=4, num_iterations=2, beta=0.04)
# the LoRA run last: it saves checkpoint-4 on the workers, which Ray then hands to any later run of the group as
# the checkpoint to restart from
CASES = {"ddp": ("ddp", False), "zero3": ("zero3", False), "zero3-layerwise": ("zero3", False),
         "fsdp2": ("fsdp2", False), "fsdp2-lora": ("fsdp2", True)}
# the metrics that are the same on any number of ranks for the same global batch; TRL's kl, entropy and clip
# ratios are means of each rank's mean
GLOBAL_KEYS = ("loss", "grad_norm", "learning_rate", "num_tokens", "reward", "reward_std", "frac_reward_zero_std",
               "rewards/length/mean", "rewards/length/std", "rewards/digits/mean", "rewards/digits/std",
               "completions/mean_length", "completions/max_length", "completions/clipped_ratio")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def recording_rewards(folder: str) -> list:
    """TRL-signature reward functions; `length` appends (step, prompts, completion ids, rewards) of each call to
    folder/rank-R.jsonl."""
    def length(prompts, completions, completion_ids, trainer_state, **kw):
        rewards = [len(grpo_jobs._text(c)) / 8 + 0.01 * trainer_state.global_step for c in completions]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank-{_rank()}.jsonl"), "a") as f:
            f.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts,
                                "completion_ids": [list(c) for c in completion_ids], "rewards": rewards}) + "\n")
        return rewards

    def digits(completions, kind, **kw):
        return [None if k == "chat" else float(sum(ch.isdigit() for ch in grpo_jobs._text(c)))
                for c, k in zip(completions, kind)]
    return [length, digits]


def rank_calls(folder: str, rank: int) -> list[dict]:
    with open(os.path.join(folder, f"rank-{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def global_calls(folder: str, ranks: int = 2) -> list[dict]:
    """Each generation's calls, the ranks' rows concatenated in rank order (the global generation batch)."""
    per_rank = [rank_calls(folder, r) for r in range(ranks)]
    assert len({len(c) for c in per_rank}) == 1, [len(c) for c in per_rank]
    out = []
    for parts in zip(*per_rank):
        assert len({p["step"] for p in parts}) == 1
        out.append({k: [x for p in parts for x in p[k]] for k in ("prompts", "completion_ids", "rewards")}
                   | {"step": parts[0]["step"]})
    return out


def steps(log_history: list[dict], keys=None) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "step_time" and (keys is None or k in keys or k == "step")}
            for e in log_history if "loss" in e]


def _trainer(lib: str, out: str, model_path: str, peft: bool, callbacks=(), **kw):
    from examples.sft import build_tokenizer

    from .trl_jobs import libs, lora

    args = grpo_jobs.config(lib, "grpo", out, **kw)
    return libs(lib).GRPOTrainer(model=model_path, reward_funcs=recording_rewards(os.path.join(out, "calls")),
                                 args=args, train_dataset=grpo_jobs.prompts(), processing_class=build_tokenizer(),
                                 peft_config=lora() if peft else None, callbacks=list(callbacks))


def ray_trainer(out: str, model_path: str, peft: bool = False, **kw):
    """raytrain.trl's GRPOTrainer for a Ray run (scaling and distributed in `kw`), per-device batch 2."""
    return _trainer("rt", out, model_path, peft, per_device_train_batch_size=2, **kw)


def worker_cases(root: str, model_path: str) -> dict:
    """On the driver: each case's trainer (2 workers, half the per-device batch) shipped as a Ray run ships it
    (tests/group.py)."""
    from tests.group import ship

    cases = {}
    for name, (backend, peft) in CASES.items():
        out = os.path.join(root, name)
        saves = {"save_strategy": "steps", "save_steps": 4} if peft else {"save_strategy": "no"}
        if name == "zero3-layerwise":  # TRL's ds3_gather_for_generation=False: each forward gathers its layers
            saves["ds3_gather_for_generation"] = False
        trainer = _trainer("rt", out, model_path, peft, per_device_train_batch_size=2,
                           scaling={"num_workers": 2}, distributed=BACKENDS[backend], **RUN, **saves)
        cases[name] = ship(trainer, name)
    return cases


def run_on_two_workers(config: dict) -> dict | None:
    """A Ray Train worker function: trl's GRPOTrainer on the group's 2 processes, each case of worker_cases through
    the workers' own function, then generation of unequal lengths per rank under FSDP2 and ZeRO-3. Rank 0 returns
    the runs' log histories (or errors)."""
    from raytrain.worker.ray_worker import train_loop_per_worker

    os.environ["ACCELERATE_USE_CPU"] = "1"  # accelerate's MULTI_CPU over the group Ray Train initialised
    results = {}
    if config.get("only"):
        config = {**config, "cases": {k: v for k, v in config["cases"].items() if k in config["only"]}}
    trl_run = _trainer("trl", os.path.join(config["root"], "trl"), config["model"], False,
                       per_device_train_batch_size=2, save_strategy="no", **RUN)
    trl_run.train()
    results["trl"] = trl_run.state.log_history
    for name, case in config["cases"].items():
        value = train_loop_per_worker(case)  # rank 0's: the state and the final weights (gathered)
        results[name] = {"log": json.loads(value["state"])["log_history"], "weights": value["weights"]} \
            if value else None
    results["generation"] = unequal_generation(config["root"], config["model"])
    results["frozen"] = frozen_placement(config["root"], config["model"])
    return results if _rank() == 0 else None


def frozen_placement(root: str, model_path: str) -> dict:
    """A reference model placed by each backend's Strategy.place_frozen beside a trained one: the elements this
    rank holds against the whole model's, and whether its logits are the whole model's. Rank 0's, per backend."""
    import torch

    from raytrain import TrainingArguments
    from raytrain.strategies import create_strategy
    from transformers import AutoModelForCausalLM

    out = {}
    ids = torch.tensor([[5, 17, 33, 2, 9], [7, 7, 1, 40, 3]])
    for name in ("ddp", "fsdp2", "zero3"):
        args = TrainingArguments(os.path.join(root, f"frozen-{name}"), use_cpu=True, report_to="none",
                                 per_device_train_batch_size=1, scaling={"num_workers": 2},
                                 distributed=BACKENDS[name])
        strategy = create_strategy(args)
        strategy.setup(AutoModelForCausalLM.from_pretrained(model_path),
                       lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        whole = AutoModelForCausalLM.from_pretrained(model_path).eval().requires_grad_(False)
        with torch.no_grad():
            want = whole(ids).logits
        ref = strategy.place_frozen(AutoModelForCausalLM.from_pretrained(model_path).eval().requires_grad_(False))
        with torch.no_grad():
            got = ref(input_ids=ids).logits
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else
                   p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in ref.parameters())
        out[name] = {"held": held, "whole": sum(p.numel() for p in whole.parameters()),
                     "max_diff": float((got - want).abs().max())}
        strategy.barrier()
    return out


def unequal_generation(root: str, model_path: str) -> dict:
    """Under FSDP2 and ZeRO-3, inside Strategy.full_parameters rank 0 generates 6 tokens greedily and rank 1
    nothing: a collective in generation would leave rank 0 waiting. Rank 0's tokens and those of the unsharded
    model, per backend."""
    import torch

    from raytrain import TrainingArguments
    from raytrain.strategies import create_strategy
    from transformers import AutoModelForCausalLM

    out = {}
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    for name in ("fsdp2", "zero3"):
        args = TrainingArguments(os.path.join(root, f"gen-{name}"), use_cpu=True, report_to="none",
                                 per_device_train_batch_size=1, scaling={"num_workers": 2},
                                 distributed=BACKENDS[name])
        model = AutoModelForCausalLM.from_pretrained(model_path)
        want = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0].tolist()
        strategy = create_strategy(args)
        wrapped, _ = strategy.setup(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        got = None
        with strategy.full_parameters(), torch.no_grad():
            if _rank() == 0:
                got = strategy.unwrap(wrapped).generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                                        synced_gpus=False)[0].tolist()
        strategy.barrier()
        out[name] = {"want": want, "got": got}
    return out


def replay(out: str, model_path: str, calls: list[dict], peft: bool):
    """trl's GRPOTrainer in one process on the workers' global batch (per-device 4), its generations replaced by
    the workers' completions, in order."""
    import trl

    from examples.sft import build_tokenizer

    from .trl_jobs import lora

    completions = [c["completion_ids"] for c in calls]

    class Replay(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            ids = completions.pop(0)
            assert len(ids) == len(prompt_ids)
            return ids, None

    args = grpo_jobs.config("trl", "grpo", out, per_device_train_batch_size=4, save_strategy="no", **RUN)
    trainer = Replay(model=model_path, reward_funcs=recording_rewards(os.path.join(out, "calls")), args=args,
                     train_dataset=grpo_jobs.prompts(), processing_class=build_tokenizer(),
                     peft_config=lora() if peft else None)
    trainer.train()
    assert not completions
    return trainer
