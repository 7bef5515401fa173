"""SFT data side by side with transformers 5.23's Trainer: padding-free packing (DataCollatorWithFlattening),
NEFTune, and the token counters (include_num_input_tokens_seen, train_tokens_per_second)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import scripts
from .test_hf_group_by_length import _pad, tiny_llama


def _data(n=24):
    from datasets import Dataset

    rng = np.random.default_rng(0)
    return Dataset.from_dict({"input_ids": [rng.integers(1, 64, int(rng.integers(3, 20))).tolist() for _ in range(n)]})


class _Inputs:
    """Records the keyword arguments the model's forward receives."""

    def __init__(self, model):
        self.keys: set[str] = set()
        model.register_forward_pre_hook(lambda m, a, kw: self.keys.update(kw), with_kwargs=True)


def run(lib, out, collator=None, callbacks=(), model=None, resume=None, **kw):
    Trainer, Args = scripts.LIBS[lib][0]()
    args = Args(str(out), num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                **{"save_strategy": "no", **scripts.COMMON, **kw})
    if lib == "rt":
        args.data_order = "hf"  # HF's shuffle, and its draws from torch's generator
    model = model if model is not None else tiny_llama()
    trainer = Trainer(model=model, args=args, train_dataset=_data(), data_collator=collator or _pad,
                      callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _losses(trainer, after=0):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > after]


@pytest.mark.parametrize("options", [{}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}])
def test_packing_with_data_collator_with_flattening_trains_as_hf(tmp_path, options):
    from transformers import DataCollatorWithFlattening

    models = {lib: tiny_llama() for lib in ("hf", "rt")}
    seen = {lib: _Inputs(m) for lib, m in models.items()}
    hf = run("hf", tmp_path / "hf", DataCollatorWithFlattening(**options), model=models["hf"])
    rt = run("rt", tmp_path / "rt", DataCollatorWithFlattening(**options), model=models["rt"])
    assert len(_losses(rt)) == 12 and _losses(rt) == pytest.approx(_losses(hf), rel=1e-5)
    assert rt.state.log_history[-1]["train_loss"] == pytest.approx(hf.state.log_history[-1]["train_loss"], rel=1e-6)
    # Both pass num_items_in_batch to a forward taking **kwargs (HF's model_accepts_loss_kwargs).
    assert seen["rt"].keys == seen["hf"].keys >= {"num_items_in_batch"} | {"input_ids", "labels", "position_ids"} | (
        {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} if options else set())
    # Each packed sequence attends only to itself (position_ids): the loss of the same rows padded.
    assert _losses(run("rt", tmp_path / "padded"))[:2] == pytest.approx(_losses(rt)[:2], rel=1e-4)


def test_neftune_losses_equal_hfs_and_its_noise_is_absent_in_evaluation(tmp_path):
    from raytrain import TrainerCallback

    class Probe(TrainerCallback):
        """At step 2: the hooked embeddings add noise in train mode only."""

        def __init__(self):
            self.seen = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                emb = model.get_input_embeddings()
                ids = torch.tensor([[1, 2, 3]])
                rng = torch.get_rng_state()  # the probe's noise must not shift the training's
                with torch.no_grad():
                    emb.eval()
                    quiet = torch.equal(emb(ids), emb.weight[ids])
                    emb.train()
                    noisy = not torch.equal(emb(ids), emb.weight[ids])
                torch.set_rng_state(rng)
                self.seen = (quiet, noisy)

    want = _losses(run("hf", tmp_path / "hf", neftune_noise_alpha=5.0))
    probe = Probe()
    rt = run("rt", tmp_path / "rt", neftune_noise_alpha=5.0, callbacks=[probe])
    assert len(want) == 12 and _losses(rt) == pytest.approx(want, rel=1e-5)
    assert _losses(run("rt", tmp_path / "quiet")) != pytest.approx(want, rel=1e-3)  # the noise changes the losses
    assert probe.seen == (True, True)
    emb = rt.model.get_input_embeddings()  # removed after training, as HF
    assert not emb._forward_hooks and not hasattr(emb, "neftune_noise_alpha")


def test_neftune_on_a_peft_model_hooks_the_base_models_embeddings_as_hf(tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                     task_type="CAUSAL_LM"))

    want = _losses(run("hf", tmp_path / "hf", model=lora(), neftune_noise_alpha=5.0, max_steps=4))
    rt = run("rt", tmp_path / "rt", model=lora(), neftune_noise_alpha=5.0, max_steps=4)
    assert _losses(rt) == pytest.approx(want, rel=1e-5)
    assert _losses(run("rt", tmp_path / "quiet", model=lora(), max_steps=4)) != pytest.approx(want, rel=1e-3)


def test_neftune_without_input_embeddings_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^neftune_noise_alpha: TinyRegressor has no get_input_embeddings\(\)"):
        Trainer, Args = scripts.LIBS["rt"][0]()
        args = Args(str(tmp_path), max_steps=1, neftune_noise_alpha=1.0, **scripts.COMMON)
        Trainer(model=scripts.TinyRegressor(), args=args, train_dataset=scripts.regression_data(8)).train()


def _tokens(trainer):
    return [(e["step"], e["num_input_tokens_seen"]) for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("how", [True, "all", "non_padding"])
def test_tokens_seen_and_per_second_as_hf_logs_them(tmp_path, how):
    kw = dict(include_num_input_tokens_seen=how, gradient_accumulation_steps=2)
    hf, rt = run("hf", tmp_path / "hf", **kw), run("rt", tmp_path / "rt", **kw)
    assert _tokens(rt) == _tokens(hf) and len(_tokens(rt)) == 6
    assert rt.state.num_input_tokens_seen == hf.state.num_input_tokens_seen
    step = lambda t: next(e for e in t.state.log_history if "loss" in e)  # noqa: E731
    assert set(step(rt)) == set(step(hf)) >= {"num_input_tokens_seen", "train_runtime", "train_tokens_per_second"}
    assert set(rt.state.log_history[-1]) - {"total_flos"} == set(hf.state.log_history[-1]) - {"total_flos"}
    if how == "non_padding":  # the attention mask's ones: fewer than the padded batches' entries
        assert rt.state.num_input_tokens_seen == 2 * sum(len(r) for r in _data()["input_ids"])


def test_tokens_seen_survive_a_resume_and_cost_nothing_when_off(tmp_path):
    kw = dict(include_num_input_tokens_seen="non_padding", save_strategy="steps", save_steps=7)
    full = run("rt", tmp_path, **kw)
    resumed = run("rt", tmp_path, resume=str(tmp_path / "checkpoint-7"), **kw)
    assert _tokens(resumed)[-5:] == _tokens(full)[-5:] and resumed.state.num_input_tokens_seen == \
        full.state.num_input_tokens_seen
    off = run("rt", tmp_path / "off")
    assert off.state.num_input_tokens_seen == 0 and not any("train_runtime" in e for e in off.state.log_history[:-1])


def test_ranks_tokens_are_summed_in_the_steps_one_all_reduce():
    from types import SimpleNamespace

    from raytrain.worker import tokens

    class TwoRanks:  # rank 1 saw as many items and 5 tokens more than this rank
        device = torch.device("cpu")

        def all_reduce(self, t):
            self.calls = getattr(self, "calls", 0) + 1
            return t * 2 + torch.tensor([0, 5])

    strategy = TwoRanks()
    items, seen = tokens.reduce_counts(strategy, torch.tensor(7), 30)
    assert (int(items), int(seen), strategy.calls) == (14, 65, 1)
    state = SimpleNamespace(num_input_tokens_seen=10)
    run_ = SimpleNamespace(tokens_pending=seen, trainer=SimpleNamespace(state=state))
    tokens.flush(run_)
    assert run_.trainer.state.num_input_tokens_seen == 75 and run_.tokens_pending is None
