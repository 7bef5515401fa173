"""ProgressCallback: the run line, the terminal bars (loss and learning rate in the bar, an evaluation
bar) and the one-line-per-log output elsewhere."""

from __future__ import annotations

import io
import re

from raytrain import Trainer
from raytrain.callbacks import ProgressCallback
from tests.tiny import TinyClassifier, args_for, columns


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _train(tmp_path, stream, **kw):
    args = args_for(tmp_path, max_steps=8, logging_steps=4, per_device_train_batch_size=4, eval_strategy="steps",
                    eval_steps=8, save_strategy="no", **kw)
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(32), eval_dataset=columns(12, seed=1))
    trainer.add_callback(ProgressCallback(stream))
    trainer.train()
    return stream.getvalue()


def test_non_tty_prints_the_run_line_and_one_line_per_log(tmp_path):
    out = _train(tmp_path, io.StringIO())
    lines = out.splitlines()
    assert lines[0] == (f"training TinyClassifier (15 parameters) | 32 training samples, 8 batches per epoch | "
                        f"8 steps (1 epoch) | 1 process | output_dir {tmp_path / 'out'} | from step 0")
    assert [ln.split(" ")[1] for ln in lines[1:]] == ["4/8", "8/8", "8/8", "8/8"]  # loss, loss, eval, train end
    assert lines[1].startswith("step 4/8 loss=") and "learning_rate=" in lines[1] and lines[1].split()[-1] \
        .startswith("eta=")
    assert lines[3].startswith("step 8/8 eval_loss=") and "eval_runtime" not in lines[3]
    assert "\r" not in out


def test_a_run_that_stops_early_prints_no_eta_on_its_last_lines(tmp_path):
    from raytrain import TrainerCallback

    class StopAt4(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 4

    args = args_for(tmp_path, max_steps=8, logging_steps=2, per_device_train_batch_size=4, save_strategy="no")
    stream = io.StringIO()
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(32), callbacks=[StopAt4()])
    trainer.add_callback(ProgressCallback(stream))
    trainer.train()
    lines = stream.getvalue().splitlines()[1:]
    assert [ln.split(" ")[1] for ln in lines] == ["2/8", "4/8", "4/8"]  # loss, loss (stopping), train end
    assert "eta=" in lines[0] and not any("eta=" in ln for ln in lines[1:])


def test_the_eta_after_a_resume_is_this_attempts_rate(tmp_path, monkeypatch):
    """Resumed at step 40 of 50, a step taking 60 s on a fake clock: at step 45 five steps are left,
    5:00, not total steps / total time (45 steps in 300 s: 0:33)."""
    import types

    from raytrain import TrainerCallback
    from raytrain.callbacks import progress

    clock = [0.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0],
                                                                monotonic=lambda: clock[0]))

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock[0] += 60.0

    def attempt(max_steps, **kw):
        args = args_for(tmp_path, max_steps=max_steps, logging_steps=5, per_device_train_batch_size=4,
                        save_strategy="steps", save_steps=40)
        stream = io.StringIO()
        trainer = Trainer(TinyClassifier(), args, train_dataset=columns(32), callbacks=[Tick()])
        trainer.add_callback(ProgressCallback(stream))
        trainer.train(**kw)
        return stream.getvalue().splitlines()

    first = attempt(40)
    assert first[1].startswith("step 5/40 ") and first[1].endswith(" eta=35:00")  # 35 steps left at 60 s
    clock[0] = 1e6  # a later process: the clock's origin means nothing
    lines = attempt(50, resume_from_checkpoint=True)
    assert lines[0].endswith("| resuming at step 40")
    assert [ln.split(" ")[1] for ln in lines[1:]] == ["45/50", "50/50", "50/50"]
    assert lines[1].endswith(" eta=5:00") and "eta=" not in lines[2] + lines[3]


def test_terminal_shows_a_bar_with_loss_and_learning_rate_and_an_eval_bar(tmp_path):
    out = _train(tmp_path, _Terminal())
    assert "8/8" in out and "loss=" in out and "lr=" in out  # the bar's postfix
    assert "evaluating" in out                                 # the evaluation bar
    assert "\r" in out                                         # redrawn in place


# ---------------------------------------------------------------- Ray runs: rank 0's events, drawn by the driver


def _fed(tmp_path, driver_stream, interval: float):
    """An in-process run whose progress goes through ProgressFeeder -> ProgressFeed -> ProgressReplay, as
    rank 0's does to the driver in a Ray run (the actor and the driver's thread aside)."""
    from raytrain.callbacks.progress import ProgressFeed, ProgressFeeder, ProgressReplay

    args = args_for(tmp_path, max_steps=8, logging_steps=4, per_device_train_batch_size=4, eval_strategy="steps",
                    eval_steps=8, save_strategy="no", disable_tqdm=False)
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(32), eval_dataset=columns(12, seed=1))
    trainer.pop_callback(ProgressCallback)  # the worker prints nothing itself
    feed, sends = ProgressFeed(), []

    def send(events):
        sends.append(events)
        feed.push(events)

    trainer.add_callback(ProgressFeeder(send, send, interval=interval))
    driver = ProgressReplay([ProgressCallback(driver_stream)], args, TinyClassifier())
    trainer.train()
    events = feed.drain()
    driver(events)
    return driver_stream.getvalue(), sends, events


def test_the_driver_prints_rank_0s_lines_as_an_in_process_run_does(tmp_path):
    direct = _train(tmp_path / "direct", io.StringIO()).replace(str(tmp_path / "direct"), "OUT")
    replayed, sends, events = _fed(tmp_path / "fed", io.StringIO(), interval=3600)
    replayed = replayed.replace(str(tmp_path / "fed"), "OUT")

    def untimed(text):  # the timings differ between two runs
        return [re.sub(r" train_runtime=\S+", "", ln.split(" eta=")[0]) for ln in text.splitlines()]

    assert untimed(replayed) == untimed(direct) and len(untimed(direct)) == 5  # run line + 4 log lines
    # Throttled: with a long interval, one send at the start and one (the flush) at the end; the steps
    # in between are coalesced to the latest count.
    assert len(sends) == 2 and [e[0] for e in sends[0]] == ["begin"]
    kinds = [e[0] for e in events]
    assert kinds == ["begin", "step", "log", "step", "log", "eval", "log", "eval_end", "log", "end"], kinds
    assert [e[1]["global_step"] for e in events if e[0] == "step"] == [4, 8]


def test_the_driver_draws_the_bars_from_rank_0s_events(tmp_path):
    out, sends, _ = _fed(tmp_path, _Terminal(), interval=0.0)
    assert len(sends) > 2                                      # sent as it went
    assert "8/8" in out and "loss=" in out and "lr=" in out    # the bar, with the latest loss and lr
    assert "evaluating" in out and "\r" in out


def test_counting_tokens_adds_tokens_per_second_to_each_line_and_keeps_the_eta(tmp_path):
    import torch

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 1)

        def forward(self, input_ids, labels):
            return {"loss": ((self.emb(input_ids).sum((1, 2)) - labels) ** 2).mean()}

    data = {"input_ids": torch.randint(0, 8, (32, 5), generator=torch.Generator().manual_seed(0)),
            "labels": torch.ones(32)}
    args = args_for(tmp_path, max_steps=8, logging_steps=4, per_device_train_batch_size=4, save_strategy="no",
                    include_num_input_tokens_seen=True)
    stream = io.StringIO()
    trainer = Trainer(Tokens(), args, train_dataset=data)
    trainer.add_callback(ProgressCallback(stream))
    trainer.train()
    lines = stream.getvalue().splitlines()[1:]
    assert re.match(r"step 4/8 loss=\S+ grad_norm=\S+ learning_rate=\S+ epoch=0.5 num_input_tokens_seen=80 "
                    r"tokens/s=\S+ eta=", lines[0]), lines[0]
    assert "train_runtime" not in lines[0] and "train_runtime=" in lines[-1] and "eta=" not in lines[-1]
    assert trainer.state.log_history[0]["train_tokens_per_second"] > 0
