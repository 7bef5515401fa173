"""raytrain on Ray against a bare Ray TorchTrainer and against torchrun: the same DDP job three ways.

    python benchmarks/ddp_vs_torchrun.py [--steps 60] [--no-attached] [--no-memory]

2 CPU workers, the same ~5M-parameter MLP and batch shapes:
  torchrun   a hand-written DDP loop under `torchrun --nproc_per_node 2`
  bare       the same hand-written loop as train_loop_per_worker of a bare ray.train TorchTrainer
  raytrain   raytrain's Trainer (DDP strategy, 2 workers) on Ray
Each runs in a fresh process, timed from the command's start. Printed:
  (a) steady-state median step time (steps after the first `--warmup`): raytrain / bare (target <= 1.05)
      and both / torchrun;
  (b) wall time from the command's start to the first optimizer step: raytrain / bare (target <= 1.1)
      and both / torchrun; again with Ray already running (`ray start --head`, RAY_ADDRESS), which
      is what raytrain does under `ray job submit` or with RAY_ADDRESS set;
  (c) per-rank memory of parameters + gradients + optimizer state for a ~50M-parameter model under
      FSDP2 and ZeRO-3 against DDP (target <= 0.6), from the tensors each rank holds after a step,
      with the growth of the process's resident memory alongside. Launched with torchrun: raytrain's
      strategies run under any launcher that initialises torch.distributed.
Timings print as ratios against a reference measured in the same invocation; nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

BATCH = 128          # per worker
WIDTH, DEPTH = 1024, 5        # ~5.3M parameters
BIG_WIDTH, BIG_DEPTH = 2048, 12  # ~50M parameters


class MLP(nn.Module):
    """Inputs -> DEPTH x (Linear + GELU) -> 10 classes; returns {"loss", "logits"} as raytrain expects."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x, labels=None):
        logits = self.head(self.blocks(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def make_data(steps: int, world: int = 2, width: int = WIDTH) -> dict:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH * world
    return {"x": torch.randn(n, width, generator=g), "labels": torch.randint(0, 10, (n,), generator=g)}


# ---------------------------------------------------------------- the hand-written DDP loop


def hand_loop(config: dict) -> dict:
    """Plain DDP: the loop a user writes by hand. Runs under torchrun and inside a bare TorchTrainer."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(config["steps"], world)
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, first = [], None
    for step in range(config["steps"]):
        lo = (step * world + rank) * BATCH
        batch = {k: v[lo:lo + BATCH] for k, v in data.items()}
        loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
        if first is None:
            first = time.time()
    return {"rank": rank, "step_times": _diffs(times), "first_step_wall": first}


def _diffs(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def role_torchrun(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = hand_loop({"steps": args.steps})
    if result["rank"] == 0:
        _write(args.out, result)
    dist.destroy_process_group()


def role_bare(args) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init()
    result = TorchTrainer(hand_loop, train_loop_config={"steps": args.steps},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="bare", storage_path=args.storage)).fit()
    _write(args.out, result.return_value)


# ---------------------------------------------------------------- raytrain


def _timing_callback(out: str):
    from raytrain import TrainerCallback

    class StepTimes(TrainerCallback):
        """Wall time of the first optimizer step and the time of every step end (rank 0 writes them)."""

        def __init__(self):
            self.times, self.first = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            torch.set_num_threads(1)

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self.first is None:
                self.first = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                _write(out, {"step_times": _diffs(self.times), "first_step_wall": self.first})

    return StepTimes()


def role_raytrain(args) -> None:
    from raytrain import Trainer, TrainingArguments

    data = make_data(args.steps)
    targs = TrainingArguments(
        output_dir=os.path.join(args.storage, "out"), max_steps=args.steps, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
        max_grad_norm=1.0, disable_tqdm=True, report_to="none",
        scaling={"num_workers": 2, "storage_path": os.path.join(args.storage, "ray")},
        distributed={"strategy": "ddp"})
    torch.manual_seed(0)
    Trainer(MLP(), targs, train_dataset=data, callbacks=[_timing_callback(args.out)]).train()


# ---------------------------------------------------------------- (c) memory


def role_memory(args) -> None:
    """One backend under torchrun: three steps of the ~50M model, then count what this rank holds."""
    import torch.distributed as dist

    from raytrain import Trainer, TrainerCallback, TrainingArguments  # noqa: F401
    from raytrain.worker import loop  # noqa: F401

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = make_data(3, width=BIG_WIDTH)
    rss0 = _rss()
    distributed = {"ddp": {"strategy": "ddp"},
                   "fsdp": {"strategy": "fsdp", "fsdp": {"wrap_classes": ["Linear"]}},
                   # Communication buckets sized for this model (as HF's "auto" does from hidden_size),
                   # not DeepSpeed's defaults of hundreds of MB.
                   "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {
                       "stage": 3, "reduce_bucket_size": BIG_WIDTH ** 2,
                       "stage3_prefetch_bucket_size": int(0.9 * BIG_WIDTH ** 2),
                       "stage3_param_persistence_threshold": 10 * BIG_WIDTH, "sub_group_size": 10 ** 8}}}}
    result = {}

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args_, state, control, **kwargs):
            if state.global_step == 2:  # the third step: gradients and optimizer state both exist
                result.update(_held_bytes(trainer.get_strategy()), rss_delta=_rss() - rss0)

    targs = TrainingArguments(
        output_dir=os.path.join(args.storage, args.backend), max_steps=3, per_device_train_batch_size=16,
        logging_steps=10**6, save_strategy="no", disable_tqdm=True, report_to="none",
        scaling={"num_workers": 2}, distributed=distributed[args.backend])
    torch.manual_seed(0)
    trainer = Trainer(MLP(BIG_WIDTH, BIG_DEPTH), targs, train_dataset=data, callbacks=[Probe()])
    loop.train(trainer)  # this rank's loop, in-process: torchrun already started every rank
    gathered = trainer.get_strategy().all_gather_object(result)
    if dist.get_rank() == 0:
        _write(args.out, {"backend": args.backend, "ranks": gathered,
                          "params": sum(p.numel() for p in MLP(BIG_WIDTH, BIG_DEPTH).parameters())})
    dist.destroy_process_group()


def _held_bytes(strategy) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards under FSDP2 and
    ZeRO), counted once per storage; taken before an optimizer step, when all three exist."""
    seen: dict[int, tuple[str, int]] = {}

    def add(kind, t):
        if t is None:
            return
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (kind, storage.nbytes())

    if strategy.name == "deepspeed":
        opt = strategy.engine.optimizer  # ZeRO-3: partitioned parameters, fp32 partitions, gradient buffer
        for p in strategy.unwrap(strategy.engine).parameters():
            add("params", p.ds_tensor)
        for t in opt.fp32_partitioned_groups_flat:
            add("params", t)
        add("grads", getattr(opt, "grad_partitions_flat_buffer", None))
        states = opt.optimizer.state
    else:
        for p in strategy.unwrap(strategy.model).parameters():
            add("params", p)
            add("grads", p.grad)
        states = strategy.optimizer.state
    for s in states.values():
        for v in s.values():
            if torch.is_tensor(v):
                add("optimizer", v)
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for kind, n in seen.values():
        out[kind] += n
    if strategy.name == "ddp":
        out["grads"] *= 2  # DDP's all-reduce buckets hold every gradient once more (no bucket views)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- driver


def _write(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _run(cmd: list[str], out: str, env: dict | None = None, timeout: int = 900) -> tuple[dict, float]:
    """Run `cmd` timed from its start; return its JSON result and the start's wall clock."""
    start = time.time()
    if os.path.exists(out):
        os.remove(out)
    proc = subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and os.path.exists(out):
        # The result was written; a crash while tearing the process group down does not void it.
        print(f"    (note: {os.path.basename(out)}: the command exited with {proc.returncode} after writing "
              "its result)", flush=True)
    elif proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd[:4])}... failed with exit code {proc.returncode}")
    with open(out) as f:
        return json.load(f), start


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(role: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            __file__, "--role", role, "--out", out, *extra]


def _self(role: str, out: str, storage: str, steps: int) -> list[str]:
    return [sys.executable, __file__, "--role", role, "--out", out, "--storage", storage, "--steps", str(steps)]


def _timing_runs(tmp: str, steps: int, warmup: int, env: dict | None, tag: str) -> dict:
    runs = {}
    for role in ("bare", "raytrain"):
        out = os.path.join(tmp, f"{role}-{tag}.json")
        result, start = _run(_self(role, out, os.path.join(tmp, f"{role}-{tag}"), steps), out, env)
        runs[role] = {"step": statistics.median(result["step_times"][warmup:]),
                      "first": result["first_step_wall"] - start}
        print(f"  {role:9s} [{tag}] median step {runs[role]['step'] * 1e3:7.1f} ms   "
              f"start -> first step {runs[role]['first']:6.1f} s", flush=True)
    return runs


def _ray_head(tmp: str):
    """A `ray start --head --block` cluster in its own process group; returns (process, address)."""
    port, dash = _free_port(), _free_port()
    env = _env(RAY_AUTH_MODE="token")
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--port", str(port), "--num-cpus", "4",
                             "--dashboard-port", str(dash), "--dashboard-host", "127.0.0.1",
                             "--temp-dir", tempfile.mkdtemp(prefix="rtb-", dir="/tmp"), "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.time() + 180
    while subprocess.run(["ray", "status", "--address", address], env=env, capture_output=True).returncode != 0:
        if time.time() > deadline or head.poll() is not None:
            raise SystemExit("ray start --head did not come up")
        time.sleep(2)
    return head, address


def _stop(head) -> None:
    import signal

    for signum, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, signum)
            head.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def main(args) -> None:
    tmp = tempfile.mkdtemp(prefix="ddp-vs-torchrun-")
    n = sum(p.numel() for p in MLP().parameters())
    print(f"model: {n / 1e6:.1f}M parameters; 2 workers x batch {BATCH}; {args.steps} steps "
          f"(median over steps {args.warmup + 1}..{args.steps}); {os.cpu_count()} CPU cores", flush=True)

    if args.timing:
        out = os.path.join(tmp, "torchrun.json")
        result, start = _run(_torchrun("torchrun", out, "--steps", str(args.steps)), out)
        ref = {"step": statistics.median(result["step_times"][args.warmup:]),
               "first": result["first_step_wall"] - start}
        print(f"  torchrun  median step {ref['step'] * 1e3:7.1f} ms   start -> first step {ref['first']:6.1f} s",
              flush=True)
        cold = _timing_runs(tmp, args.steps, args.warmup, None, "cold")
        warm = None
        if args.attached:
            head, address = _ray_head(tmp)
            try:
                env = _env(RAY_ADDRESS=address, RAY_AUTH_MODE="token")
                warm = _timing_runs(tmp, args.steps, args.warmup, env, "attached")
            finally:
                _stop(head)

        print("\n(a) steady-state median step time")
        print(f"    raytrain / bare TorchTrainer = {cold['raytrain']['step'] / cold['bare']['step']:.3f}  "
              "(target <= 1.05)")
        print(f"    bare TorchTrainer / torchrun = {cold['bare']['step'] / ref['step']:.3f}")
        print(f"    raytrain / torchrun          = {cold['raytrain']['step'] / ref['step']:.3f}")
        print("(b) command start -> first optimizer step")
        print(f"    raytrain / bare TorchTrainer = {cold['raytrain']['first'] / cold['bare']['first']:.3f}  "
              f"(target <= 1.1)  [{cold['raytrain']['first']:.1f} s vs {cold['bare']['first']:.1f} s, "
              "Ray started by the command]")
        print(f"    bare TorchTrainer / torchrun = {cold['bare']['first'] / ref['first']:.3f}  [torchrun {ref['first']:.1f} s]")
        print(f"    raytrain / torchrun          = {cold['raytrain']['first'] / ref['first']:.3f}")
        if warm:
            print(f"    attached to a running cluster: raytrain / bare = "
                  f"{warm['raytrain']['first'] / warm['bare']['first']:.3f} [{warm['raytrain']['first']:.1f} s vs "
                  f"{warm['bare']['first']:.1f} s]; raytrain attached / torchrun = "
                  f"{warm['raytrain']['first'] / ref['first']:.3f}")

    if args.memory:
        print("(c) per-rank parameters + gradients + optimizer state, ~50M-parameter model, 2 workers")
        mem = {}
        for backend in ("ddp", "fsdp", "zero3"):
            out = os.path.join(tmp, f"mem-{backend}.json")
            result, _ = _run(_torchrun("memory", out, "--backend", backend, "--storage", tmp), out)
            held = max(sum(r[k] for k in ("params", "grads", "optimizer")) for r in result["ranks"])
            rss = max(r["rss_delta"] for r in result["ranks"])
            mem[backend] = (held, rss)
            print(f"    {backend:6s} {held / 2**20:8.1f} MiB held  ({rss / 2**20:8.1f} MiB resident growth)   "
                  f"[{result['params'] / 1e6:.1f}M parameters]", flush=True)
        for backend in ("fsdp", "zero3"):
            print(f"    {backend} / ddp = {mem[backend][0] / mem['ddp'][0]:.3f} held, "
                  f"{mem[backend][1] / mem['ddp'][1]:.3f} resident  (target <= 0.6)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="main", choices=["main", "torchrun", "bare", "raytrain", "memory"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--storage", default=None)
    p.add_argument("--backend", default="ddp")
    p.add_argument("--no-attached", dest="attached", action="store_false", help="skip the runs on a running cluster")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip (c)")
    p.add_argument("--no-timing", dest="timing", action="store_false", help="skip (a) and (b)")
    args = p.parse_args()
    {"main": main, "torchrun": role_torchrun, "bare": role_bare, "raytrain": role_raytrain,
     "memory": role_memory}[args.role](args)
