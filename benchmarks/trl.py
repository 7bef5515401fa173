"""TRL's SFT and GRPO scripts on raytrain.trl against trl 1.16 itself: tokens/s of the same job, rounds alternated.

    python benchmarks/trl.py [--hidden 256] [--layers 4] [--batch 4] [--max-length 512] [--warmup 2] [--steps 10]
                             [--rounds 3] [--threads 0] [--json results.json]
    python benchmarks/trl.py --script grpo [--batch 8] [--generations 4] [--completion-length 32] ...
    python benchmarks/trl.py --quick [--script grpo]   # a 2-layer model, a few steps: the code path only

SFT, the issue's script: a Llama built from its config (no download; examples/sft.py's byte-level tokenizer and
chat template), LoRA on q_proj / v_proj, conversations made in code, assistant_only_loss, bfd packing, TRL's
defaults otherwise (gradient checkpointing on; bf16 off so the CPU runs fp32); tokens are TRL's num_tokens.
GRPO: the same Llama and LoRA, examples/grpo.py's arithmetic prompts (conversational) and its two reward functions,
--generations completions of up to --completion-length tokens per prompt sampled with generate() in each step
(TRL's use_vllm=False path), TRL's defaults otherwise (loss dapo, beta 0, one iteration); tokens are the generated
ones (the completions) plus the trained ones (TRL's num_tokens: prompts and completions through the loss).
Each round trains both, in alternating order, from the same seed, over the --steps steps after --warmup, timed by
wall clock and by this process's CPU time (on a shared machine the CPU figure counts this run's work alone). Prints
each round and raytrain.trl / trl (target >= 1.0x) with the range of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
# this file's folder first on sys.path would make `import trl` import this file: the repository root instead
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _timer(lib: str, warmup: int):
    """A callback of the library's own TrainerCallback class: clocks from the end of step `warmup`."""
    if lib == "trl":
        from transformers import TrainerCallback
    else:
        from raytrain import TrainerCallback

    class Timer(TrainerCallback):
        start = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                self.start = (time.perf_counter(), time.process_time())

        def on_train_end(self, args, state, control, **kwargs):
            self.end = (time.perf_counter(), time.process_time())
    return Timer()


def run(lib: str, a, out: str) -> dict:
    """One training of the script with `lib`; tokens/s over the timed steps."""
    if a.script == "grpo":
        return run_grpo(lib, a, out)
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from examples.sft import build_model, build_tokenizer, conversations

    mod = __import__("trl") if lib == "trl" else __import__("raytrain.trl", fromlist=["SFTTrainer"])
    extra = {"data_order": "hf"} if lib == "rt" else {}
    args = mod.SFTConfig(out, max_steps=a.warmup + a.steps, per_device_train_batch_size=a.batch, logging_steps=1,
                         learning_rate=1e-3, assistant_only_loss=True, packing=True, max_length=a.max_length,
                         report_to="none", save_strategy="no", seed=0, bf16=False, disable_tqdm=True,
                         use_cpu=True, optim="adamw_torch", **extra)
    timer = _timer(lib, a.warmup)
    torch.manual_seed(0)
    trainer = mod.SFTTrainer(model=build_model(hidden_size=a.hidden, num_layers=a.layers,
                                               intermediate_size=a.hidden * 2), args=args,
                             train_dataset=Dataset.from_list(conversations(a.rows)),
                             processing_class=build_tokenizer(), callbacks=[timer],
                             peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                    task_type="CAUSAL_LM"))
    trainer.train()
    tokens = {e["step"]: e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e and "loss" in e}
    counted = tokens[a.warmup + a.steps] - tokens[a.warmup]
    wall, cpu = timer.end[0] - timer.start[0], timer.end[1] - timer.start[1]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"tokens": counted, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": counted / wall,
            "tokens_per_cpu_s": counted / cpu, "last_loss": losses[-1]}


def run_grpo(lib: str, a, out: str) -> dict:
    """GRPO with `lib`: generated + trained tokens/s over the timed steps."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from examples.grpo import brevity, correct_sum, prompts
    from examples.sft import build_model, build_tokenizer

    mod = __import__("trl") if lib == "trl" else __import__("raytrain.trl", fromlist=["GRPOTrainer"])
    args = mod.GRPOConfig(out, max_steps=a.warmup + a.steps, per_device_train_batch_size=a.batch,
                          num_generations=a.generations, max_completion_length=a.completion_length, logging_steps=1,
                          learning_rate=1e-3, report_to="none", save_strategy="no", seed=0, bf16=False,
                          disable_tqdm=True, use_cpu=True, optim="adamw_torch")
    timer = _timer(lib, a.warmup)
    torch.manual_seed(0)
    trainer = mod.GRPOTrainer(model=build_model(hidden_size=a.hidden, num_layers=a.layers,
                                                intermediate_size=a.hidden * 2),
                              reward_funcs=[correct_sum, brevity], args=args,
                              train_dataset=Dataset.from_list(prompts(a.rows)), processing_class=build_tokenizer(),
                              callbacks=[timer], peft_config=LoraConfig(r=8, lora_alpha=16,
                                                                        target_modules=["q_proj", "v_proj"],
                                                                        task_type="CAUSAL_LM"))
    trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    timed = range(a.warmup + 1, a.warmup + a.steps + 1)  # one generation per step (steps_per_generation 1)
    generated = sum(logs[s]["completions/mean_length"] * a.batch for s in timed)
    trained = logs[a.warmup + a.steps]["num_tokens"] - logs[a.warmup]["num_tokens"]
    wall, cpu = timer.end[0] - timer.start[0], timer.end[1] - timer.start[1]
    counted = generated + trained
    return {"tokens": counted, "generated": generated, "trained": trained, "wall_s": wall, "cpu_s": cpu,
            "tokens_per_s": counted / wall, "tokens_per_cpu_s": counted / cpu,
            "last_loss": logs[a.warmup + a.steps]["loss"], "last_reward": logs[a.warmup + a.steps]["reward"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", choices=("sft", "grpo"), default="sft")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="per-device batch (default 4 for sft, 8 for grpo)")
    p.add_argument("--generations", type=int, default=4, help="grpo: completions per prompt")
    p.add_argument("--completion-length", type=int, default=32, help="grpo: max_completion_length")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.batch is None:
        a.batch = 8 if a.script == "grpo" else 4
    if a.quick:
        a.hidden, a.layers, a.max_length, a.rows, a.warmup, a.steps, a.rounds = 32, 2, 128, 200, 1, 2, 1
        a.completion_length = min(a.completion_length, 8)
    import torch

    if a.threads:  # raytrain keeps the user's OMP_NUM_THREADS (else it sets its own share of the cores)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    import trl
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ("trl", "rt") if r % 2 == 0 else ("rt", "trl")
            got = {lib: run(lib, a, os.path.join(tmp, f"{lib}{r}")) for lib in order}
            ratio = got["rt"]["tokens_per_s"] / got["trl"]["tokens_per_s"]
            cpu_ratio = got["rt"]["tokens_per_cpu_s"] / got["trl"]["tokens_per_cpu_s"]
            rounds.append({"order": order, **got, "ratio": ratio, "cpu_ratio": cpu_ratio})
            same = f"last loss {got['trl']['last_loss']:.6f} / {got['rt']['last_loss']:.6f}"
            if a.script == "grpo":
                same += (f", last reward {got['trl']['last_reward']:.6f} / {got['rt']['last_reward']:.6f}, tokens "
                         f"{got['trl']['generated']:.0f}+{got['trl']['trained']:.0f} / "
                         f"{got['rt']['generated']:.0f}+{got['rt']['trained']:.0f} generated+trained")
            print(f"round {r + 1} ({' then '.join(order)}): trl {got['trl']['tokens_per_s']:.0f} tok/s, raytrain.trl "
                  f"{got['rt']['tokens_per_s']:.0f} tok/s -> {ratio:.3f}x wall, {cpu_ratio:.3f}x CPU ({same})",
                  flush=True)
    ratios, cpu = [x["ratio"] for x in rounds], [x["cpu_ratio"] for x in rounds]
    result = {"trl": trl.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_avg_end": os.getloadavg()[0], "args": vars(a), "rounds": rounds,
              "ratio_median": statistics.median(ratios), "cpu_ratio_median": statistics.median(cpu)}
    print(f"{a.script}: raytrain.trl / trl tokens/s: {result['ratio_median']:.3f}x wall (rounds {min(ratios):.3f}-"
          f"{max(ratios):.3f}), {result['cpu_ratio_median']:.3f}x CPU (rounds {min(cpu):.3f}-{max(cpu):.3f}); "
          f"target >= 1.0x; trl {trl.__version__}, torch threads {torch.get_num_threads()}, "
          f"load avg at end {result['load_avg_end']:.1f} ({os.cpu_count()} cpus)")
    if a.quick:
        print("quick run: the code path ran; its numbers are not figures to report")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
