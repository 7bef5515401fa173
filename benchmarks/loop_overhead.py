"""Loop overhead: raytrain's Trainer against a hand-written PyTorch loop, same model, batches, optimizer.

    python benchmarks/loop_overhead.py [--steps 300] [--warmup 30] [--rounds 3] [--threads 1]

Prints the median step time of each and their ratio (targets: <= 1.10x on a tiny MLP, where fixed
per-step overhead dominates, and <= 1.03x on a ~10M-parameter transformer, both below HF's Trainer).
Each round runs the hand loop, raytrain and (with `transformers` installed, the `bench` extra) HF's
Trainer, their order rotated from round to round so that drift on a shared machine hits all alike.
Beside wall time it prints the main thread's CPU time per step: with one torch thread all the work is
on that thread, so its ratio holds even when other jobs load the machine (wall time does not).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class SmallTransformer(nn.Module):
    """~10M parameters: 8 pre-norm encoder layers of width 320 over 256 tokens."""

    def __init__(self, vocab=256, d=320, layers=8, heads=8, seq=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        h = self.blocks(self.emb(input_ids) + self.pos[: input_ids.shape[1]])
        logits = self.head(h)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def make_case(name: str, steps: int):
    g = torch.Generator().manual_seed(0)
    if name == "tiny_mlp":
        bs = 32
        data = {"x": torch.randn(steps * bs, 32, generator=g), "labels": torch.randint(0, 10, (steps * bs,), generator=g)}
        return TinyMLP, data, bs
    bs, seq = 8, 128
    ids = torch.randint(0, 256, (steps * bs, seq), generator=g)
    return SmallTransformer, {"input_ids": ids, "labels": ids.roll(-1, dims=1)}, bs


def batch_order(data: dict, bs: int, seed: int) -> list[torch.Tensor]:
    """The index batches raytrain's sampler uses for epoch 0: both loops gather the same rows."""
    from raytrain.data import MapSource
    source = MapSource(data, bs, seed=seed)
    order = source.order(0)
    return [source.batch_indices(0, b, order) for b in range(len(source))]


def hand_loop(model_cls, data, bs, steps, warmup) -> list[float]:
    torch.manual_seed(0)
    model = model_cls()
    order = batch_order(data, bs, seed=42)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    times, last = [], (time.perf_counter(), time.thread_time())
    model.train()
    for idx in order[:steps]:
        batch = {k: v[idx] for k, v in data.items()}
        loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        now = (time.perf_counter(), time.thread_time())
        times.append((now[0] - last[0], now[1] - last[1]))
        last = now
    return times[warmup:]


class _StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.last = [], None

    def on_step_end(self, args, state, control, **kw):
        now = (time.perf_counter(), time.thread_time())
        if self.last is not None:
            self.times.append((now[0] - self.last[0], now[1] - self.last[1]))
        self.last = now


def raytrain_loop(model_cls, data, bs, steps, warmup) -> list[float]:
    torch.manual_seed(0)
    model = model_cls()
    timer = _StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=bs, learning_rate=1e-4,
                                 weight_decay=0.0, logging_steps=10**9, save_strategy="no", disable_tqdm=True,
                                 optim="adamw_torch")  # the hand loop's AdamW (the default is the fused one)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[timer])
        trainer.remove_callback(trainer.callback_handler.callbacks[1])  # printer: no output in the timing
        trainer.train()
    return timer.times[warmup - 1:]


def hf_loop(model_cls, data, bs, steps, warmup) -> list[float] | None:
    try:
        import transformers
    except ImportError:
        return None

    class _HFTimer(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_end(self, args, state, control, **kw):
            now = (time.perf_counter(), time.thread_time())
            if self.last is not None:
                self.times.append((now[0] - self.last[0], now[1] - self.last[1]))
            self.last = now

    class _Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(next(iter(data.values())))

        def __getitem__(self, i):
            return {k: v[i] for k, v in data.items()}

    torch.manual_seed(0)
    timer = _HFTimer()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=bs,
                                              learning_rate=1e-4, logging_steps=10**9, save_strategy="no",
                                              report_to="none", disable_tqdm=True, use_cpu=True,
                                              optim="adamw_torch")
        transformers.Trainer(model_cls(), args, train_dataset=_Rows(), callbacks=[timer]).train()
    return timer.times[warmup - 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: CPU time is all on one thread)")
    p.add_argument("--cases", default="tiny_mlp,transformer_10m")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} torch={torch.__version__} "
          f"python={platform.python_version()} torch_threads={a.threads} load_avg={os.getloadavg()[0]:.2f}")
    print(f"{'case':<16} {'params':>8} {'hand ms':>8} {'ours ms':>8} {'ratio':>7} {'HF ratio':>9} "
          f"{'CPU ratio':>10} {'HF CPU':>8}")
    loops = {"hand": hand_loop, "ours": raytrain_loop, "hf": hf_loop}
    for name in a.cases.split(","):
        model_cls, data, bs = make_case(name, a.steps)
        params = sum(p.numel() for p in model_cls().parameters())
        times: dict[str, list] = {k: [] for k in loops}
        names = list(loops)
        for i in range(a.rounds):
            for key in names[i % 3:] + names[:i % 3]:
                times[key].extend(loops[key](model_cls, data, bs, a.steps, a.warmup) or [])
        wall = {k: statistics.median(t[0] for t in v) for k, v in times.items() if v}
        cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items() if v}
        hf = f"{wall['hf'] / wall['hand']:.3f}x" if "hf" in wall else "n/a"
        hf_cpu = f"{cpu['hf'] / cpu['hand']:.3f}x" if "hf" in cpu else "n/a"
        print(f"{name:<16} {params / 1e6:>7.2f}M {wall['hand'] * 1e3:>8.3f} {wall['ours'] * 1e3:>8.3f} "
              f"{wall['ours'] / wall['hand']:>6.3f}x {hf:>9} {cpu['ours'] / cpu['hand']:>9.3f}x {hf_cpu:>8}")
    print(f"medians over {a.rounds} rotated rounds of {a.steps - a.warmup} timed steps; load_avg at end "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
