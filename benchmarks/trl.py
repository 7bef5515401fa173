"""TRL's SFT and GRPO scripts on raytrain.trl against trl 1.16 itself: tokens/s of the same job, rounds alternated.

    python benchmarks/trl.py [--hidden 256] [--layers 4] [--batch 4] [--max-length 512] [--warmup 2] [--steps 10]
                             [--rounds 3] [--threads 0] [--json results.json]
    python benchmarks/trl.py --script grpo [--batch 8] [--generations 4] [--completion-length 32] ...
    python benchmarks/trl.py --script async [--threads 2] [--trainer-threads 1] [--rollout-workers 1]
                             [--groups-per-call 0] [--max-staleness 1] ...
    python benchmarks/trl.py --quick [--script grpo|async]   # a 2-layer model, a few steps: the code path only

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
async: raytrain.trl's AsyncGRPOTrainer against its GRPOTrainer on the same model, prompts, batch and steps, at equal
cores: GRPOTrainer colocated with --threads torch threads in every phase; the async trainer with --trainer-threads
for training and --rollout-workers Ray actors of (threads - trainer-threads) / rollout-workers CPUs each, generating
--max-staleness versions ahead (1), --groups-per-call groups a generate() call (0: a step's). Tokens: the generated
ones plus those through the loss (prompts and completions).
Also printed: the staleness of the trained samples, each role's idle fraction over the timed steps (the trainer's
wait for rollouts; each actor's time not generating) and the weight-sync seconds (target: async >= 1.25x).
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


def run_async(lib: str, a, out: str) -> dict:
    """`lib` "colocated": raytrain.trl's GRPOTrainer on --threads threads; "async": its AsyncGRPOTrainer, training on
    --trainer-threads, the rest of the cores split between --rollout-workers actors."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    import raytrain.trl as rt
    from examples.grpo import brevity, correct_sum, prompts
    from examples.sft import build_model, build_tokenizer

    common = dict(max_steps=a.warmup + a.steps, per_device_train_batch_size=a.batch, num_generations=a.generations,
                  max_completion_length=a.completion_length, logging_steps=1, learning_rate=1e-3, report_to="none",
                  save_strategy="no", seed=0, bf16=False, disable_tqdm=True, use_cpu=not a.cuda,
                  optim="adamw_torch", gradient_checkpointing=False)
    threads = a.threads or os.cpu_count()
    if lib == "colocated":
        torch.set_num_threads(threads)
        args, cls = rt.GRPOConfig(out, **common), rt.GRPOTrainer
    else:
        torch.set_num_threads(a.trainer_threads)
        cpus = (threads - a.trainer_threads) / a.rollout_workers
        gpus = 0.5 / a.rollout_workers if a.cuda else 0.0  # on a GPU: the trainer and the actors share it
        rollout = {"num_workers": a.rollout_workers, "num_cpus_per_worker": cpus, "num_gpus_per_worker": gpus,
                   "groups_per_call": a.groups_per_call or None}
        args = rt.AsyncGRPOConfig(out, max_staleness=a.max_staleness, rollout=rollout, **common)
        cls = rt.AsyncGRPOTrainer
    timer = _timer("rt", a.warmup)
    torch.manual_seed(0)
    trainer = cls(model=build_model(hidden_size=a.hidden, num_layers=a.layers, intermediate_size=a.hidden * 2),
                  reward_funcs=[correct_sum, brevity], args=args, train_dataset=Dataset.from_list(prompts(a.rows)),
                  processing_class=build_tokenizer(), callbacks=[timer],
                  peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    timed = range(a.warmup + 1, a.warmup + a.steps + 1)
    generated = sum(logs[s]["completions/mean_length"] * a.batch for s in timed)
    if lib == "colocated":
        trained = logs[a.warmup + a.steps]["num_tokens"] - logs[a.warmup]["num_tokens"]
    else:
        trained = sum(logs[s]["batch/forwarded_tokens_per_step"] for s in timed)
    wall = timer.end[0] - timer.start[0]
    result = {"tokens": generated + trained, "generated": generated, "trained": trained, "wall_s": wall,
              "tokens_per_s": (generated + trained) / wall, "threads": threads,
              "last_reward": logs[a.warmup + a.steps]["reward"]}
    if lib == "async":
        begin = time.time() - (time.perf_counter() - timer.start[0])  # the timed window in wall-clock seconds
        end = begin + wall
        busy = {}
        calls = {}  # a bundle's groups share one call (one start): counted once, to its last group's end
        for _, _, worker, start, stop in trainer.rollout_timeline:
            calls[worker, start] = max(stop, calls.get((worker, start), stop))
        for (worker, start), stop in calls.items():
            busy[worker] = busy.get(worker, 0.0) + max(0.0, min(stop, end) - max(start, begin))
        stale = [logs[s]["sample/staleness_max"] for s in timed]
        result.update(trainer_idle=sum(logs[s]["perf/rollout_wait_s"] for s in timed) / wall,
                      actor_idle={w: round(1 - b / wall, 3) for w, b in sorted(busy.items())},
                      staleness={str(k): stale.count(k) for k in sorted(set(stale))},
                      weight_sync_s=sum(logs[s].get("perf/weight_sync_s", 0.0) for s in timed))
    return result


def main_async(a) -> None:
    """The async trainer against the colocated one, rounds alternated; the median ratio and its range."""
    import torch

    os.environ["RAY_ADDRESS"] = "local"  # a Ray cluster of this run's own, on this machine's cores
    a.cuda = torch.cuda.is_available()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ("colocated", "async") if r % 2 == 0 else ("async", "colocated")
            got = {lib: run_async(lib, a, os.path.join(tmp, f"{lib}{r}")) for lib in order}
            ratio = got["async"]["tokens_per_s"] / got["colocated"]["tokens_per_s"]
            rounds.append({"order": order, **got, "ratio": ratio})
            x = got["async"]
            print(f"round {r + 1} ({' then '.join(order)}): colocated {got['colocated']['tokens_per_s']:.0f} tok/s, "
                  f"async {x['tokens_per_s']:.0f} tok/s -> {ratio:.3f}x; async: staleness {x['staleness']}, "
                  f"trainer idle {x['trainer_idle']:.2f}, actors idle {x['actor_idle']}, weight sync "
                  f"{x['weight_sync_s']:.3f} s", flush=True)
    ratios = [x["ratio"] for x in rounds]
    result = {"torch": torch.__version__, "load_avg_end": os.getloadavg()[0], "args": vars(a), "rounds": rounds,
              "ratio_median": statistics.median(ratios)}
    print(f"async: AsyncGRPOTrainer / GRPOTrainer tokens/s at {a.threads or os.cpu_count()} cores: "
          f"{result['ratio_median']:.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}); target >= 1.25x; trainer "
          f"{a.trainer_threads} thread(s), {a.rollout_workers} rollout actor(s), groups per call "
          f"{a.groups_per_call or 'a step'}, max_staleness {a.max_staleness}; load avg at end "
          f"{result['load_avg_end']:.1f} ({os.cpu_count()} cpus)")
    if a.quick:
        print("quick run: the code path ran; its numbers are not figures to report")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", choices=("sft", "grpo", "async"), default="sft")
    p.add_argument("--trainer-threads", type=int, default=1, help="async: the async trainer's training threads")
    p.add_argument("--rollout-workers", type=int, default=1, help="async: its rollout actors")
    p.add_argument("--groups-per-call", type=int, default=0,
                   help="async: prompt groups per generate() call (0: a step's; 1 spreads a step over the actors)")
    p.add_argument("--max-staleness", type=int, default=1, help="async: policy versions a sample may lag")
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
        a.batch = 4 if a.script == "sft" else 8
    if a.quick:
        a.hidden, a.layers, a.max_length, a.rows, a.warmup, a.steps, a.rounds = 32, 2, 128, 200, 1, 2, 1
        a.completion_length = min(a.completion_length, 8)
    import torch

    if a.threads:  # raytrain keeps the user's OMP_NUM_THREADS (else it sets its own share of the cores)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    if a.script == "async":
        return main_async(a)
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
