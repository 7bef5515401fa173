"""On a CUDA device: fp16 (GradScaler) and bf16 runs killed with SIGKILL resume bit-exactly (CUDA RNG,
loss scale, dropout); a background checkpoint staged from GPU memory holds what a synchronous one holds;
fused AdamW, torch.compile and a LoRA (peft) model train and resume; checkpoints cross between GPU and
CPU; evaluation keeps no predictions on the GPU. `pytest -m gpu` runs them (benchmarks/gpu.sh); without
CUDA they skip. The tests at the end run everywhere: the parts of those paths a CPU can check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from raytrain import Trainer, TrainerCallback, TrainingArguments, get_last_checkpoint
from raytrain.checkpoint import store as ckpt
from raytrain.checkpoint import io as checkpoint_io
from test_checkpoint import ROOT, TESTS, assert_same, make_trainer, weights
from tiny import StopAt, TinyClassifier, args_for, columns, kill_when_paused, rows

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # full_determinism's cuBLAS, before any handle

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
LOGGED = ("loss", "grad_norm", "learning_rate", "step")


def cuda(fn):
    for mark in reversed(gpu):
        fn = mark(fn)
    return fn


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def logged(trainer) -> list[dict]:
    return [{k: h.get(k) for k in LOGGED} for h in trainer.state.log_history if "loss" in h]


def _subprocess(code: str, env: dict | None = None) -> subprocess.Popen:
    paths = [ROOT, TESTS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]  # carried wheels
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def _killed_main(out: str, kw: str) -> None:
    """The process the kill tests SIGKILL inside the save of a step (make_trainer's digits MLP, dropout 0.3)."""
    make_trainer(out, **json.loads(kw)).train()


def kill_and_resume(tmp_path, *, steps: int = 9, save_steps: int = 3, kill_at: int = 6, **kw):
    """Train in a subprocess that is SIGKILLed while it writes checkpoint-{kill_at}; resume here from the
    previous one. Returns the uninterrupted reference and the resumed trainer (both run in this process)."""
    out, flag = tmp_path / "run", tmp_path / "paused"
    run_kw = json.dumps({**kw, "max_steps": steps, "save_steps": save_steps})
    proc = _subprocess(f"from test_gpu import _killed_main; _killed_main({str(out)!r}, {run_kw!r})",
                       {checkpoint_io.PAUSE_ENV: f"{flag}@{kill_at}"})
    kill_when_paused(proc, flag, f"the save of step {kill_at}", seconds=240)
    assert get_last_checkpoint(str(out)) == str(out / f"checkpoint-{kill_at - save_steps}")
    reference = make_trainer(tmp_path / "ref", max_steps=steps, save_strategy="no", **kw)
    reference.train()
    resumed = make_trainer(out, init_seed=99, max_steps=steps, save_steps=save_steps, **kw)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == steps
    assert_same(weights(resumed), weights(reference))
    assert logged(resumed) == logged(reference) and len(logged(reference)) == steps
    return reference, resumed


# ---------------------------------------------------------------- mixed precision, killed and resumed


@cuda
@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_fp16_with_grad_scaler_killed_mid_run_resumes_bit_exact(tmp_path, save_async):
    reference, resumed = kill_and_resume(tmp_path, fp16=True, save_async=save_async)
    strategy = resumed.get_strategy()
    assert strategy.device.type == "cuda" and strategy.scaler is not None
    # The loss scale and its growth tracker (steps since the last overflow) continue from the checkpoint.
    assert strategy.scaler.state_dict() == reference.get_strategy().scaler.state_dict()
    saved_scale = strategy.scaler.state_dict()
    assert (saved_scale["scale"], saved_scale["_growth_tracker"]) != (2.0**16, 0)  # it moved: grew or backed off
    saved = ckpt.load_pickle(str(tmp_path / "run" / "checkpoint-3" / "rng_state.pth"))
    assert len(saved["cuda"]) == torch.cuda.device_count()  # dropout's masks come from the CUDA generator


@cuda
def test_bf16_killed_mid_run_resumes_bit_exact(tmp_path):
    _, resumed = kill_and_resume(tmp_path, bf16=True)
    assert resumed.get_strategy().device.type == "cuda" and resumed.get_strategy().scaler is None
    assert all(p.dtype == torch.float32 for p in resumed.model.parameters())  # autocast: fp32 weights


@cuda
def test_bf16_run_differs_from_fp32_on_cuda(tmp_path):
    """The precision tests above would pass with autocast silently off: it must change the numbers."""
    bf16 = make_trainer(tmp_path / "bf16", max_steps=3, save_strategy="no", bf16=True)
    bf16.train()
    fp32 = make_trainer(tmp_path / "fp32", max_steps=3, save_strategy="no")
    fp32.train()
    assert logged(bf16)[0]["loss"] != logged(fp32)[0]["loss"]


# ---------------------------------------------------------------- background saves from GPU memory


def _loaded_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_loaded_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_loaded_equal(x, y) for x, y in zip(a, b))
    return a == b


@cuda
def test_background_checkpoint_from_gpu_equals_a_synchronous_one(tmp_path):
    """Staged through pinned host buffers while the next steps run: the weights' file is the same bytes,
    every pickled piece (AdamW state, loss scale, RNG) loads equal, and so do the JSON files."""
    for mode in ("sync", "async"):
        make_trainer(tmp_path / mode, max_steps=6, save_steps=2, fp16=True, save_async=mode == "async").train()
    for step in (2, 4, 6):
        sync, background = tmp_path / "sync" / f"checkpoint-{step}", tmp_path / "async" / f"checkpoint-{step}"
        ckpt.verify_checkpoint(str(background))
        assert sorted(os.listdir(sync)) == sorted(os.listdir(background))
        assert (sync / "model.safetensors").read_bytes() == (background / "model.safetensors").read_bytes()
        for name in ("optimizer.pt", "scaler.pt", "rng_state.pth", "scheduler.pt"):
            assert _loaded_equal(ckpt.load_pickle(str(sync / name)), ckpt.load_pickle(str(background / name))), name
        for name in ("trainer_state.json", "loop_state.json", "data_state.json"):
            assert (sync / name).read_bytes() == (background / name).read_bytes(), name


# ---------------------------------------------------------------- fused AdamW, torch.compile


@cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fused_adamw_on_cuda_trains_and_resumes_bit_exact(tmp_path, recwarn, precision):
    kw = {"optim": "adamw_torch_fused", precision: True, "max_steps": 6, "save_steps": 3}
    reference = make_trainer(tmp_path / "ref", **{**kw, "save_strategy": "no"})
    reference.train()
    assert reference.optimizer.param_groups[0]["fused"] is True
    assert not [w for w in recwarn if "fused AdamW unavailable" in str(w.message)]  # no silent fallback
    make_trainer(tmp_path / "run", callbacks=[StopAt(3)], **kw).train()
    resumed = make_trainer(tmp_path / "run", init_seed=5, **kw)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))
    assert logged(resumed) == logged(reference)
    losses = [h["loss"] for h in logged(reference)]
    assert all(np.isfinite(losses))


@cuda
def test_torch_compile_trains_and_resumes_bit_exact(tmp_path):
    kw = {"torch_compile": True, "bf16": True, "max_steps": 6, "save_steps": 3}
    reference = make_trainer(tmp_path / "ref", **{**kw, "save_strategy": "no"})
    reference.train()
    assert hasattr(reference.model_wrapped, "_orig_mod")  # compiled; the checkpoint keeps the plain names
    make_trainer(tmp_path / "run", callbacks=[StopAt(3)], **kw).train()
    assert not any(k.startswith("_orig_mod") for k in ckpt.load_weights(str(tmp_path / "run" / "checkpoint-3")))
    resumed = make_trainer(tmp_path / "run", init_seed=5, **kw)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))
    assert logged(resumed) == logged(reference)


# ---------------------------------------------------------------- checkpoints between GPU and CPU


class _WeightsAtStart(TrainerCallback):
    """The weights a resumed run starts its first step from, on the CPU."""

    def __init__(self):
        self.weights = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.weights is None:
            self.weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _resume_on_cpu_main(out: str, result: str) -> None:
    """Resumed where no CUDA device is visible (a CPU machine): continue 3 steps, report what it saw."""
    assert not torch.cuda.is_available()
    start = _WeightsAtStart()
    trainer = make_trainer(out, init_seed=7, max_steps=6, save_steps=3, callbacks=[start])
    trainer.train(resume_from_checkpoint=str(os.path.join(out, "checkpoint-3")))
    os.makedirs(os.path.join(result, "start"))
    ckpt.save_weights(start.weights, os.path.join(result, "start"))
    json.dump({"step": trainer.state.global_step, "device": str(trainer.get_strategy().device),
               "optimizer_devices": sorted({str(v.device) for s in trainer.optimizer.state.values()
                                            for v in s.values() if torch.is_tensor(v)})},
              open(os.path.join(result, "result.json"), "w"))


@cuda
def test_a_checkpoint_written_on_gpu_resumes_on_a_cpu_machine(tmp_path):
    out, result = tmp_path / "run", tmp_path / "result"
    make_trainer(out, max_steps=6, save_steps=3, callbacks=[StopAt(3)]).train()
    assert "cuda" in ckpt.load_pickle(str(out / "checkpoint-3" / "rng_state.pth"))
    os.makedirs(result)
    _finish(_subprocess(f"from test_gpu import _resume_on_cpu_main; _resume_on_cpu_main({str(out)!r}, "
                        f"{str(result)!r})", {"CUDA_VISIBLE_DEVICES": ""}))
    seen = json.load(open(result / "result.json"))
    assert seen == {"step": 6, "device": "cpu", "optimizer_devices": ["cpu"]}
    assert_same(ckpt.load_weights(str(result / "start")), ckpt.load_weights(str(out / "checkpoint-3")))


def _write_on_cpu_main(out: str) -> None:
    assert not torch.cuda.is_available()
    make_trainer(out, max_steps=6, save_steps=3, callbacks=[StopAt(3)]).train()


@cuda
def test_a_checkpoint_written_on_a_cpu_machine_resumes_on_gpu(tmp_path):
    out = tmp_path / "run"
    _finish(_subprocess(f"from test_gpu import _write_on_cpu_main; _write_on_cpu_main({str(out)!r})",
                        {"CUDA_VISIBLE_DEVICES": ""}))
    assert "cuda" not in ckpt.load_pickle(str(out / "checkpoint-3" / "rng_state.pth"))
    start = _WeightsAtStart()
    trainer = make_trainer(out, init_seed=7, max_steps=6, save_steps=3, callbacks=[start])
    trainer.train(resume_from_checkpoint=True)
    assert trainer.get_strategy().device.type == "cuda" and trainer.state.global_step == 6
    # AdamW's moments follow their parameters to the GPU ("step" stays a CPU scalar unless fused, as torch keeps it)
    assert {v.device.type for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"} == {"cuda"}
    assert_same(start.weights, ckpt.load_weights(str(out / "checkpoint-3")))


def _with_extra_cuda_rng_state(path) -> None:
    """Rewrite a checkpoint's RNG file as a process that saw one more GPU would have written it."""
    from tests.worker.test_checkpoint_async import as_format_1

    rng = torch.load(path / "rng_state.pth", weights_only=False)
    rng["cuda"] = [*rng.get("cuda", [torch.zeros(16, dtype=torch.uint8)]), torch.zeros(16, dtype=torch.uint8)]
    torch.save(rng, path / "rng_state.pth")
    as_format_1(path)  # the manifest's checksums of the rewritten file


@cuda
def test_a_checkpoint_from_a_process_that_saw_more_gpus_resumes_bit_exact_on_one(tmp_path):
    reference = make_trainer(tmp_path / "ref", max_steps=6, save_strategy="no")
    reference.train()
    out = tmp_path / "run"
    make_trainer(out, max_steps=6, save_steps=3, callbacks=[StopAt(3)]).train()
    _with_extra_cuda_rng_state(out / "checkpoint-3")
    resumed = make_trainer(out, init_seed=3, max_steps=6, save_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))  # the visible GPU's generator (dropout) was restored


# ---------------------------------------------------------------- evaluation on the GPU


@cuda
def test_eval_accumulation_moves_predictions_off_the_gpu_as_hf_does(tmp_path):
    """8192 classes x 2048 rows: 64 MiB of logits over 32 batches. Predictions come back as numpy, the GPU
    never holds them all (peak well under their size), and they equal HF's Trainer.predict's."""
    transformers = pytest.importorskip("transformers")
    n, classes = 2048, 8192
    data = columns(n)
    torch.manual_seed(0)
    model = TinyClassifier(classes=classes)
    trainer = Trainer(model, args_for(tmp_path, per_device_eval_batch_size=64, eval_accumulation_steps=2))
    trainer.predict(data)  # warm-up: the model is on the GPU, kernels loaded
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours = trainer.predict(data)
    peak = torch.cuda.max_memory_allocated() - base
    assert isinstance(ours.predictions, np.ndarray) and ours.predictions.shape == (n, classes)
    assert peak < n * classes * 4 / 4, f"{peak / 2**20:.1f} MiB held on the GPU during predict"
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=64,
                                             eval_accumulation_steps=2, report_to="none")
    theirs = transformers.Trainer(model, hf_args).predict(rows(n))
    np.testing.assert_allclose(ours.predictions, theirs.predictions, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)


# ---------------------------------------------------------------- a LoRA model (peft)


def _base_llama():
    """A tiny Llama, the same weights every time (seed 0): the 'pretrained' base model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      attention_dropout=0.1)
    config._attn_implementation = "eager"  # deterministic backward under full_determinism
    return transformers.LlamaForCausalLM(config)


def _lora_model(init_seed: int):
    """LoRA on q and v of the base, initialised from `init_seed` (another one proves the adapter comes
    from the checkpoint); dropout in attention and in LoRA draws on the CUDA generator."""
    peft = pytest.importorskip("peft")
    base = _base_llama()
    torch.manual_seed(init_seed)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM", init_lora_weights="gaussian")
    return peft.get_peft_model(base, lora)


def _lora_trainer(out, init_seed: int = 0, callbacks=(), **kw) -> Trainer:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (48, 16), generator=g)
    args = dict(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                save_steps=3, max_steps=6, bf16=True, full_determinism=True, seed=0, disable_tqdm=True,
                report_to="none")
    return Trainer(_lora_model(init_seed), TrainingArguments(**{**args, **kw}),
                   train_dataset={"input_ids": ids, "labels": ids}, callbacks=list(callbacks))


@cuda
def test_lora_model_checkpoints_its_adapter_and_resumes_bit_exact(tmp_path):
    peft = pytest.importorskip("peft")
    reference = _lora_trainer(tmp_path / "ref", save_strategy="no")
    reference.train()
    _lora_trainer(tmp_path / "run", callbacks=[StopAt(3)]).train()
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "run" / "checkpoint-3"))
    resumed = _lora_trainer(tmp_path / "run", init_seed=5)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))
    assert logged(resumed) == logged(reference)

    final = str(tmp_path / "final")
    resumed.save_model(final)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(final))
    loaded = peft.PeftModel.from_pretrained(_base_llama(), final).cuda().eval()
    model = resumed.model.eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- what a CPU can check of these paths


def test_a_checkpoint_whose_pickles_hold_cuda_tensors_resumes_on_cpu_bit_exact(tmp_path, monkeypatch):
    """A GPU run's optimizer.pt and rng_state.pth hold tensors tagged 'cuda:0' (and the CUDA generators'
    states): written here as such (torch.save's location tag patched), they load on a machine without CUDA
    and the run continues bit-exactly; a plain torch.load of the same file would refuse it."""
    from tests.worker.test_checkpoint_async import as_format_1

    reference = make_trainer(tmp_path / "ref", max_steps=6, save_strategy="no")
    reference.train()
    out = tmp_path / "run"
    make_trainer(out, max_steps=6, save_steps=3, callbacks=[StopAt(3)]).train()
    path = out / "checkpoint-3"
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    rng = torch.load(path / "rng_state.pth", weights_only=False)
    rng["cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # torch.cuda.get_rng_state_all()'s form
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(optimizer, path / "optimizer.pt")
        torch.save(rng, path / "rng_state.pth")
    as_format_1(path)  # the manifest's checksums of the rewritten files
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path / "optimizer.pt", weights_only=True)
    resumed = make_trainer(out, init_seed=3, max_steps=6, save_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert_same(weights(resumed), weights(reference))
    assert logged(resumed) == logged(reference)


def test_cuda_rng_states_of_more_gpus_than_visible_restore_those_that_exist(monkeypatch):
    """What the GPU test above checks, with torch.cuda's calls stood in for: a run that saw 2 GPUs
    resumed where 1 is visible restores GPU 0's generator and asks nothing of a GPU 1."""
    from raytrain.worker import run_state

    state = run_state.rng_state()
    state["cuda"] = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.append((device, s[0].item())))
    run_state.load_rng_state(state)
    assert restored == [(0, 1)]
