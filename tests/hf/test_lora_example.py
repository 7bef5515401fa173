"""examples/lora.yaml as users run it, shortened by --set: the CLI in one process (what final/ holds loads
with PeftModel.from_pretrained and, merged, with from_pretrained), on 2 Ray workers, and its sweep
(search_spaces/lora.yaml) with 2 trials; the two Ray runs are the docs' commands (docs/snippets/)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 8 steps of 8 blocks of 32 bytes, evaluated (and saved) every 4 on 16 blocks; eval_on_start evaluates the base
SMALL = ["--set", "max_steps=8", "--set", "per_device_train_batch_size=8", "--set", "data.block_size=32",
         "--set", "eval_steps=4", "--set", "save_steps=4", "--set", "logging_steps=4",
         "--set", "data.max_eval_blocks=16", "--no-report"]


def _cli(argv: list[str], env: dict | None = None, timeout: float = 280) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "raytrain.run", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _shown(path: str) -> list[str]:
    """The raytrain.run command of a docs snippet, as argv after `python -m raytrain.run`."""
    with open(path) as f:
        [line] = [ln for ln in f.read().splitlines() if ln.startswith("python -m raytrain.run")]
    return shlex.split(line)[3:]


def _eval_losses(out) -> list[tuple[int, float]]:
    with open(os.path.join(out, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    return [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]


def _logits(model) -> torch.Tensor:
    from examples.lora import build_tokenizer

    batch = build_tokenizer()(["def f(x):\n    return x", "The import statement"], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def test_the_example_trains_and_its_final_adapter_and_merged_model_load(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.lora import build_base_model, build_tokenizer

    out = tmp_path / "lora"
    proc = _cli(["--config", "examples/lora.yaml", "--set", f"output_dir={out}", *SMALL],
                {"PYTHONWARNINGS": "default"})
    assert "FutureWarning" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("summary: ")[1].splitlines()[0])
    losses = _eval_losses(out)
    # the base model's and two evaluations; the summary reuses step 8's (the best, still loaded): shown once
    assert [s for s, _ in losses] == [0, 4, 8]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert sum(1 for ln in lines if ln.startswith("step 8/8 eval_loss=")) == 1
    assert summary["eval_loss"] == losses[-1][1] < losses[1][1] < losses[0][1]
    assert summary["best_model_checkpoint"] == str(out / "checkpoint-8")
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-8"]

    final = out / "final"
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(os.listdir(final))
    assert "config.json" not in os.listdir(final) and "model.safetensors" not in os.listdir(final)
    adapter = PeftModel.from_pretrained(build_base_model(), str(final))
    merged, info = AutoModelForCausalLM.from_pretrained(str(final / "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(_logits(merged), _logits(adapter), rtol=1e-5, atol=1e-5)
    base = _logits(build_base_model())
    assert not torch.allclose(_logits(adapter), base)  # the adapter trained; the base is the factory's, untouched
    with adapter.disable_adapter():
        torch.testing.assert_close(_logits(adapter), base)
    text = "lambda x: x ** 2  # é"
    for saved in (final, final / "merged"):
        assert AutoTokenizer.from_pretrained(str(saved))(text)["input_ids"] == build_tokenizer()(text)["input_ids"]


def test_a_missing_extra_is_one_line_naming_it(tmp_path):
    """The README's LoRA command without the peft extra: one line naming the package and the extra, exit 2."""
    code = ("import sys; sys.modules['peft'] = None; from raytrain.run import main; "
            f"sys.exit(main(['--config', 'examples/lora.yaml', '--set', 'output_dir={tmp_path}', '--no-report']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if "peft" in ln]
    assert line.startswith("error: model.factory: examples.lora:build_model needs peft, which is not installed")
    assert 'pip install "raytrain[peft]"' in line
    assert set(os.listdir(tmp_path)) <= {"raytrain.log"}  # no checkpoint, no final model: nothing started


# Long (1-2 minutes): by default LoRA on 2 Ray workers (DDP, FSDP2, ZeRO-3) runs in test_peft_on_ray.py and the
# CLI's 2-worker run in driver/test_quiet.py.
@pytest.mark.long
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_example_on_two_ray_workers(ray_cluster, tmp_path):
    """docs/snippets/llm_workers.sh (DDP on 2 workers) on the session's cluster: the same final files."""
    from peft import PeftModel

    from examples.lora import build_base_model

    out = tmp_path / "lora-2"
    env = {"RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    shown = _shown(os.path.join(ROOT, "docs", "snippets", "llm_workers.sh"))
    proc = _cli([*shown, "--set", f"output_dir={out}", *SMALL], env)
    assert "| 2 processes (ddp) |" in proc.stdout + proc.stderr
    losses = _eval_losses(out)
    assert [s for s, _ in losses] == [0, 4, 8] and losses[-1][1] < losses[0][1]
    PeftModel.from_pretrained(build_base_model(), str(out / "final"))
    assert os.path.isfile(out / "final" / "merged" / "model.safetensors")


# Long (1 minute): by default the CLI's sweep runs in sweep/test_search.py (resumed by name), and the snippet and
# search_spaces/lora.yaml are checked in test_docs.py.
@pytest.mark.long
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_lora_sweep_runs_two_trials(ray_cluster, tmp_path):
    """docs/snippets/llm_sweep.sh (search_spaces/lora.yaml: rank and learning rate), 2 of its 8 trials."""
    import pandas as pd

    out = tmp_path / "lora"
    env = {"RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    shown = _shown(os.path.join(ROOT, "docs", "snippets", "llm_sweep.sh"))
    proc = _cli([*shown, "--set", f"output_dir={out}", "--set", "search.num_samples=2", *SMALL], env)
    table = pd.read_csv(out / "sweeps" / "lora" / "trials.csv")
    assert len(table) == 2 and set(table["model.r"]) <= {4, 8, 16}
    assert table["learning_rate"].between(1e-3, 3e-2).all() and all(math.isfinite(v) for v in table["objective"])
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("[sweep] best trial ")]
    assert float(line.split("objective=")[1].split()[0]) == pytest.approx(table["objective"].min(), rel=1e-4)
