"""raytrain.trl's GRPOTrainer / RLOOTrainer against trl 1.16 on the same script: configs field by field, the sampled
completions and rewards, per-step losses, rewards and TRL's metrics; exact resume after SIGKILL; one-line refusals."""

from __future__ import annotations

import dataclasses
import os

import pytest

from . import grpo_jobs as jobs

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jobs.save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def _close(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (sorted(set(x) ^ set(y)), x, y)
        for k in x:
            if x[k] is None or y[k] is None:
                assert x[k] is None and y[k] is None, (k, x, y)
            else:
                assert x[k] == pytest.approx(y[k], abs=tol, rel=tol), (k, x, y)


@pytest.mark.parametrize("name", ["GRPOConfig", "RLOOConfig"])
def test_config_has_every_trl_field_with_its_default(name, tmp_path):
    import raytrain.trl as rt

    theirs, ours = getattr(trl, name), getattr(rt, name)
    mine = {f.name: f for f in dataclasses.fields(ours)}
    changed = ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "remove_unused_columns")
    for f in dataclasses.fields(theirs):
        assert f.name in mine, f"{name}.{f.name} is missing"
        if f.name in ours.TRL_FIELDS or f.name in changed:
            want = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            got = mine[f.name].default if mine[f.name].default_factory is dataclasses.MISSING \
                else mine[f.name].default_factory()
            assert got == want, (f.name, got, want)
            assert mine[f.name].metadata["help"] == f.metadata["help"].replace("%%", "%"), f.name
    # the values after __post_init__: batch arithmetic, scale_rewards as a string, "auto" padding
    for kw in ({}, {"steps_per_generation": 4, "gradient_accumulation_steps": 2},
               {"generation_batch_size": 24, "per_device_train_batch_size": 4, "num_generations": 6}):
        a, b = theirs(str(tmp_path / "a"), use_cpu=True, **kw), ours(str(tmp_path / "b"), use_cpu=True, **kw)
        for n in (*ours.TRL_FIELDS, *changed):
            assert getattr(a, n) == getattr(b, n), (n, kw)
    assert ours.from_dict(b.to_dict()).generation_batch_size == 24  # a settled config builds again


@pytest.mark.parametrize("kw, message", [
    (dict(num_generations=1, per_device_train_batch_size=2), r"^num_generations: at least 2 completions"),
    (dict(num_generations=3), r"^num_generations: the generation batch \(8\) is not divisible by num_generations"),
    (dict(generation_batch_size=12), r"^generation_batch_size: 12 is not divisible by the global batch size"),
    (dict(generation_batch_size=16, steps_per_generation=3), r"^generation_batch_size \(16\) and steps_per_generation"),
    (dict(auto_find_batch_size=True), r"^auto_find_batch_size: not supported by GRPO / RLOO"),
])
def test_config_refusals_are_one_line(tmp_path, kw, message):
    import raytrain.trl as rt

    with pytest.raises(ValueError, match=message) as e:
        rt.GRPOConfig(str(tmp_path), use_cpu=True, **kw)
    assert "\n" not in str(e.value)


GRPO_CASES = {  # every combination of num_iterations 1 / 2, beta 0 / 0.04, full fine-tuning / LoRA; TRL's options spread
    "full-iter1-beta0": dict(num_iterations=1, beta=0.0, peft=False, loss_type="grpo", with_reward_model=True),
    "full-iter1-beta0.04": dict(num_iterations=1, beta=0.04, peft=False, conversational=False, loss_type="bnpo",
                                top_entropy_quantile=0.5, eval_prompts=4, eval_strategy="steps", eval_steps=5,
                                per_device_eval_batch_size=4, num_generations_eval=2),
    "full-iter2-beta0": dict(num_iterations=2, beta=0.0, peft=False, steps_per_generation=4, scale_rewards="none",
                             multi_objective_aggregation="normalize_then_sum"),
    "full-iter2-beta0.04": dict(num_iterations=2, beta=0.04, peft=False, steps_per_generation=4,
                                scale_rewards="batch", temperature=0.7, top_k=20),
    "lora-iter1-beta0": dict(num_iterations=1, beta=0.0, peft=True, loss_type="cispo", entropy_coef=0.01,
                             log_completions=True, num_completions_to_print=2),
    "lora-iter1-beta0.04": dict(num_iterations=1, beta=0.04, peft=True, conversational=False, loss_type="dr_grpo",
                                importance_sampling_level="sequence", top_p=0.9),
    "lora-iter2-beta0": dict(num_iterations=2, beta=0.0, peft=True, steps_per_generation=4, epsilon_high=0.28,
                             reward_weights=[1.0, 0.5, 2.0], mask_truncated_completions=True),
    "lora-iter2-beta0.04": dict(num_iterations=2, beta=0.04, peft=True, steps_per_generation=4, loss_type="sapo",
                                use_adaptive_entropy=True, entropy_target=5.0),
}


def _pair(tmp_path, tiny, eval_prompts: int = 0, **kw):
    out = {}
    for lib in ("trl", "rt"):
        recorder = jobs.Recorder()
        evals = jobs.prompts(kw.get("conversational", True), n=eval_prompts) if eval_prompts else None
        t = jobs.trainer(lib, str(tmp_path / lib), tiny, recorder=recorder, eval_dataset=evals, **kw)
        t.train()
        out[lib] = (t, recorder)
    return out


def _same_run(pair) -> None:
    (theirs, their_calls), (ours, our_calls) = pair["trl"], pair["rt"]
    first_theirs, first_ours = their_calls.calls[0], our_calls.calls[0]
    assert first_ours["step"] == first_theirs["step"] == 0
    assert first_ours["prompts"] == first_theirs["prompts"]
    assert first_ours["completion_ids"] == first_theirs["completion_ids"]  # the same sampled tokens at step 1
    assert first_ours["rewards"] == first_theirs["rewards"]
    assert [c["completion_ids"] for c in our_calls.calls] == [c["completion_ids"] for c in their_calls.calls]
    assert len(our_calls.calls) >= 3
    _close(jobs.steps(ours), jobs.steps(theirs))
    if jobs.evaluations(theirs):
        _close(jobs.evaluations(ours), jobs.evaluations(theirs))
    logged = set().union(*jobs.steps(ours))
    assert {"reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/mean_length",
            "completions/clipped_ratio", "num_tokens"} <= logged


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_matches_trl_step_for_step(tmp_path, tiny, case):
    """10 steps: the same completions (every generation batch), rewards, losses, grad norms and TRL's metrics."""
    kw = GRPO_CASES[case]
    pair = _pair(tmp_path, tiny, **kw)
    _same_run(pair)
    logged = set().union(*jobs.steps(pair["rt"][0]))
    assert {"rewards/length/mean", "rewards/digits/std", "rewards/spaces/mean"} <= logged
    assert ("kl" in logged) == (kw["beta"] != 0.0)
    if kw.get("loss_type", "dapo") in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert {"clip_ratio/low_mean", "clip_ratio/region_mean", "clip_ratio/high_max"} <= logged
    if kw.get("with_reward_model"):
        assert {"rewards/tiny-reward/mean", "rewards/tiny-reward/std"} <= logged
    if kw.get("eval_prompts"):  # evaluation generates num_generations_eval completions per prompt, as TRL
        assert [e["step"] for e in jobs.evaluations(pair["rt"][0])] == [5, 10]
        assert {"eval_loss", "eval_reward", "eval_rewards/digits/mean", "eval_completions/mean_length"} <= \
            set(jobs.evaluations(pair["rt"][0])[0])
    if kw.get("log_completions"):  # TRL's completions table, Parquet per logging step
        import pandas as pd

        names = sorted(os.listdir(tmp_path / "trl" / "completions"))
        assert names == sorted(os.listdir(tmp_path / "rt" / "completions")) and len(names) == 10
        for name in names:
            theirs = pd.read_parquet(tmp_path / "trl" / "completions" / name)
            ours = pd.read_parquet(tmp_path / "rt" / "completions" / name)
            pd.testing.assert_frame_equal(ours, theirs, atol=1e-5)
    if kw.get("use_adaptive_entropy"):
        assert "entropy_coef" in logged


@pytest.mark.parametrize("given", ["peft_model", "in_memory"])
def test_the_reference_of_a_given_peft_model_or_of_a_model_built_in_memory(tmp_path, tiny, given, monkeypatch):
    """beta 0.04: a PeftModel given as the model gets TRL's frozen `ref` copy of its adapter (both libraries); a model
    built in memory (no path to reload, where trl fails) gets a frozen copy of itself, which is what trl's reload of
    the same weights from their path gives, placed once by the backend (Strategy.place_frozen: sharded under FSDP2
    and ZeRO-3, test_grpo_backends_on_ray.py)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from examples.sft import build_model
    from raytrain.strategies.base import Strategy

    from .trl_jobs import lora

    placed, place = [], Strategy.place_frozen
    monkeypatch.setattr(Strategy, "place_frozen", lambda self, m: placed.append(type(m).__name__) or place(self, m))

    runs = {}
    for lib in ("trl", "rt"):
        recorder = jobs.Recorder()
        if given == "peft_model":
            torch.manual_seed(0)  # the adapter's random init, made before the trainer seeds
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), lora())
        else:
            model = tiny if lib == "trl" else build_model()  # the weights saved at `tiny`
        t = jobs.trainer(lib, str(tmp_path / lib), model, recorder=recorder, beta=0.04, num_iterations=2,
                         steps_per_generation=4)
        t.train()
        runs[lib] = (t, recorder)
        if given == "peft_model":
            assert set(t.model.peft_config) == {"default", "ref"}
            # trained in train mode throughout, as HF's training_step sets it (from_pretrained's model came in eval)
            assert all(m.training for m in t.model.modules())
    assert runs["rt"][0].ref_model is None if given == "peft_model" else not runs["rt"][0].ref_model.training
    assert placed == ([] if given == "peft_model" else ["LlamaForCausalLM"])
    _same_run(runs)


RLOO_CASES = {  # RLOO's advantage (leave-one-out baseline, the KL penalty in the reward) on the same grid's corners
    "full-iter1-beta0.04": dict(num_iterations=1, beta=0.04, peft=False, normalize_advantages=True),
    "full-iter2-beta0": dict(num_iterations=2, beta=0.0, peft=False, steps_per_generation=4,
                             reward_clip_range=(-1.0, 2.0), conversational=False),
    "lora-iter1-beta0": dict(num_iterations=1, beta=0.0, peft=True, with_reward_model=True),
    "lora-iter2-beta0.04": dict(num_iterations=2, beta=0.04, peft=True, steps_per_generation=4),
}


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_rloo_matches_trl_step_for_step(tmp_path, tiny, case):
    kw = RLOO_CASES[case]
    pair = _pair(tmp_path, tiny, kind="rloo", **kw)
    _same_run(pair)
    logged = set().union(*jobs.steps(pair["rt"][0]))
    assert ("kl" in logged) == (kw["beta"] != 0.0)
    assert {"clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean"} <= logged


KILLED = dict(max_steps=10, num_iterations=2, beta=0.04, peft=True, steps_per_generation=4, logging_steps=2,
              save_strategy="steps", save_steps=3)


def _killed_main(out: str, tiny: str, threads: int) -> None:
    """The process the SIGKILL test kills (a fresh interpreter), on the test's thread count."""
    import torch

    torch.set_num_threads(threads)
    jobs.trainer("rt", out, tiny, **KILLED).train()


def test_sigkill_mid_buffer_then_resume_is_bit_exact_and_the_adapter_loads(tmp_path, tiny):
    """num_iterations=2, steps_per_generation 4 > gradient_accumulation_steps 2: a generation batch serves 4 steps.
    Killed while checkpoint-6 is written, the run resumes from checkpoint-3, in the middle of a generation batch's
    second iteration (logging every 2 steps: step 3's metrics not yet logged). It continues with the saved rollout
    buffer, not new completions, and ends with the uninterrupted run's completions, rewards, losses, metrics and
    adapter; checkpoint-3 and final/ load with PeftModel.from_pretrained."""
    import os

    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from raytrain import get_last_checkpoint
    from tests.tiny import kill_at_save

    out, flag = tmp_path / "run", tmp_path / "paused"
    kill_at_save(f"from tests.hf.test_grpo import _killed_main; "
                 f"_killed_main({str(out)!r}, {tiny!r}, {torch.get_num_threads()})", flag, 6, seconds=240)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")
    assert "trainer_rank_state.pth" in os.listdir(out / "checkpoint-3")

    reference_calls, resumed_calls = jobs.Recorder(), jobs.Recorder()
    reference = jobs.trainer("rt", str(tmp_path / "ref"), tiny, recorder=reference_calls,
                             **{**KILLED, "save_strategy": "no"})
    reference.train()
    resumed = jobs.trainer("rt", str(out), tiny, recorder=resumed_calls, **KILLED)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 10
    # generation batches at steps 0, 4, 8: the resumed run generates at 4 and 8 only (step 3 trains on the buffer)
    assert [c["step"] for c in reference_calls.calls] == [0, 4, 8]
    assert [(c["step"], c["completion_ids"], c["rewards"]) for c in resumed_calls.calls] == \
        [(c["step"], c["completion_ids"], c["rewards"]) for c in reference_calls.calls[1:]]
    assert jobs.steps(resumed) == jobs.steps(reference)  # exactly: losses, rewards, kl, every metric
    logs = jobs.steps(resumed)
    assert [e["step"] for e in logs] == [2, 4, 6, 8, 10] and "reward" in logs[2]  # step 5 generated
    assert {"kl", "entropy", "loss"} <= set(logs[1])  # step 4's log: the mean of steps 3 (saved unlogged) and 4
    want, got = get_peft_model_state_dict(reference.model), get_peft_model_state_dict(resumed.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    resumed.save_model(str(tmp_path / "final"))
    for path in (out / "checkpoint-3", tmp_path / "final"):
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(path))
        assert set(get_peft_model_state_dict(loaded)) == set(got)
    loaded = get_peft_model_state_dict(loaded)
    assert all(torch.equal(v, loaded[k]) for k, v in got.items())
