"""raytrain.trl's GRPOTrainer on 2 Ray Train workers: under DDP each rank samples trl's own completions on 2 processes
(TRL's device-specific seed) and every metric is trl's; under DDP, FSDP2 (full and LoRA) and ZeRO-3 the losses,
rewards and weights are one process's on the same global batch and completions, the reference model sharded like
the policy under FSDP2 and ZeRO-3; generation needs no collective under FSDP2
or ZeRO-3; the LoRA adapter saved by the workers loads with PeftModel.from_pretrained."""

from __future__ import annotations

import os

import pytest

from tests.group import part
from tests.hf import grpo_ray_jobs as jobs  # by this name on the Ray workers too

pytest.importorskip("trl")
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("worker_group")]


def _close(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (sorted(set(x) ^ set(y)), x, y)
        for k in x:
            assert x[k] == pytest.approx(y[k], abs=tol, rel=tol), (k, x, y)


def group_part(root):
    """This module's runs in the session's worker group (conftest.py), with the tiny model they all start from."""
    from tests.hf import grpo_jobs

    model = grpo_jobs.save_tiny_model(str(root / "tiny"))
    config = {"root": str(root), "model": model, "cases": jobs.worker_cases(str(root), model)}
    return "tests.hf.grpo_ray_jobs:run_on_two_workers", config


@pytest.fixture(scope="module")
def two_workers(worker_group):
    root, results = part(worker_group, __file__)
    return root, str(root / "tiny"), results


@pytest.mark.timeout(900)  # the first test of the worker group waits for all of it
def test_ddp_on_two_workers_samples_and_logs_what_trl_does_on_two_processes(two_workers):
    """The same prompts, completions and rewards on each rank, every generation; every logged metric."""
    root, _, results = two_workers
    for rank in (0, 1):
        theirs, ours = jobs.rank_calls(root / "trl" / "calls", rank), jobs.rank_calls(root / "ddp" / "calls", rank)
        assert [c["step"] for c in ours] == [0, 2] and ours == theirs, rank
    assert jobs.rank_calls(root / "ddp" / "calls", 0)[0]["completion_ids"] != \
        jobs.rank_calls(root / "ddp" / "calls", 1)[0]["completion_ids"]
    _close(jobs.steps(results["ddp"]["log"]), jobs.steps(results["trl"]))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(jobs.CASES))
def test_two_workers_match_one_process_on_the_same_batch_and_completions(two_workers, tmp_path, case):
    """trl's GRPOTrainer in one process (per-device batch 4), given the completions the 2 workers sampled: the same
    prompts and rewards per generation, the per-step losses, grad norms and rewards within 1e-5, the final weights
    within 1e-5 (LoRA: the adapter the workers saved at the last step as PEFT writes it, loaded by
    PeftModel.from_pretrained)."""
    import io

    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    root, model, results = two_workers
    lora = jobs.CASES[case][1]
    calls = jobs.global_calls(root / case / "calls")
    one = jobs.replay(str(tmp_path / "one"), model, calls, peft=lora)
    replayed = jobs.global_calls(tmp_path / "one" / "calls", ranks=1)
    assert [(c["prompts"], c["rewards"]) for c in replayed] == [(c["prompts"], c["rewards"]) for c in calls]
    ours = jobs.steps(results[case]["log"], jobs.GLOBAL_KEYS)
    theirs = jobs.steps(one.state.log_history, jobs.GLOBAL_KEYS)
    assert len(ours) == 4 and {"loss", "grad_norm", "reward", "rewards/length/mean"} <= set(ours[0])
    _close(ours, theirs)
    if lora:
        saved = root / case / "checkpoint-4"
        assert "model.safetensors" not in os.listdir(saved)
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(saved))
        got, want = get_peft_model_state_dict(loaded), get_peft_model_state_dict(one.model)
    else:
        got = torch.load(io.BytesIO(results[case]["weights"]), weights_only=True)
        want = one.model.state_dict()
    assert got.keys() == want.keys() and len(got) > 0
    for k, v in got.items():
        torch.testing.assert_close(v, want[k].detach().cpu(), rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.timeout(900)
def test_generation_under_fsdp2_and_zero3_runs_no_collective(two_workers):
    """Rank 0 generated 6 tokens inside Strategy.full_parameters while rank 1 generated none (no rank waited for
    the other), the unsharded model's tokens."""
    _, _, results = two_workers
    for backend, tokens in results["generation"].items():
        assert tokens["got"] == tokens["want"] and len(tokens["want"]) == 11, backend


@pytest.mark.timeout(900)
def test_reference_models_are_sharded_as_the_trained_model_is(two_workers):
    """Strategy.place_frozen (the reference and reward models of GRPO, RLOO and DPO): whole under DDP, about half
    the elements per rank on 2 workers under FSDP2 and ZeRO-3 (TRL's prepare_fsdp / prepare_deepspeed), the whole
    model's logits either way."""
    _, _, results = two_workers
    frozen = results["frozen"]
    assert frozen["ddp"]["held"] == frozen["ddp"]["whole"] > 0
    for backend in ("fsdp2", "zero3"):
        assert frozen[backend]["held"] < 0.6 * frozen[backend]["whole"], (backend, frozen[backend])
    for backend, got in frozen.items():
        assert got["max_diff"] <= 1e-6, (backend, got)


@pytest.mark.long  # two Ray runs: by default test_grpo.py's in-process SIGKILL and driver/test_launch.py's Ray SIGKILL
@pytest.mark.timeout(900)
def test_a_killed_rank_resumes_mid_buffer_bit_exact(ray_cluster, tmp_path):
    """LoRA, num_iterations=2, steps_per_generation 4 > gradient_accumulation_steps 2 on 2 Ray workers: rank 1 is
    SIGKILLed after step 4; Ray restarts the group from checkpoint-3, in the middle of the first generation batch
    (its rollout buffer, position and generation RNG per rank in the checkpoint). Step 4 trains on the saved buffer,
    step 5 samples the uninterrupted run's completions on each rank; every logged value and the adapter are the
    uninterrupted run's, bit for bit."""
    import signal

    import torch
    from safetensors.torch import load_file

    from tests.hf import grpo_jobs
    from tests.strategies._helpers import FaultInjector

    model = grpo_jobs.save_tiny_model(str(tmp_path / "tiny"))
    runs = {}
    for name, faults in (("whole", []), ("killed", [FaultInjector(1, 4, signal.SIGKILL)])):
        out = tmp_path / name
        trainer = jobs.ray_trainer(str(out), model, peft=True, callbacks=faults, max_steps=6, num_iterations=2,
                                   beta=0.04, steps_per_generation=4, save_strategy="steps", save_steps=3,
                                   logging_steps=2, distributed=jobs.BACKENDS["ddp"],
                                   scaling={"num_workers": 2, "max_failures": 1,
                                            "storage_path": str(tmp_path / f"ray_{name}")})
        trainer.train()
        final = trainer.save_model(str(out / "final"))
        runs[name] = (jobs.steps(trainer.state.log_history), load_file(os.path.join(final, "adapter_model.safetensors")))
    assert [int(s) for s in (tmp_path / "killed" / "starts.txt").read_text().split()] == [0, 3]
    for rank in (0, 1):
        whole, killed = (jobs.rank_calls(tmp_path / n / "calls", rank) for n in ("whole", "killed"))
        assert [c["step"] for c in whole] == [0, 4] and killed == whole, rank  # step 0 sampled before the kill
    killed, whole = runs["killed"][0], runs["whole"][0]
    assert killed == whole, [(a["step"], k, a.get(k), b.get(k)) for a, b in zip(killed, whole)
                             for k in set(a) | set(b) if a.get(k) != b.get(k)]
    assert [e["step"] for e in whole] == [2, 4, 6]
    want, got = runs["whole"][1], runs["killed"][1]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
