"""ProgressCallback: the run line, the terminal bars (loss and learning rate in the bar, an evaluation
bar) and the one-line-per-log output elsewhere."""

from __future__ import annotations

import io

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


def test_terminal_shows_a_bar_with_loss_and_learning_rate_and_an_eval_bar(tmp_path):
    out = _train(tmp_path, _Terminal())
    assert "8/8" in out and "loss=" in out and "lr=" in out  # the bar's postfix
    assert "evaluating" in out                                 # the evaluation bar
    assert "\r" in out                                         # redrawn in place
