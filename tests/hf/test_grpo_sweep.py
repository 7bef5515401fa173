"""A GRPO sweep on Ray Tune + Optuna over beta, learning_rate and num_generations: each trial sets TRL's GRPO up again
with its own values (the reference model with beta > 0, the groups of num_generations completions) and its
objective is the mean reward of its evaluation's completions, maximized."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("trl")


def _recording_reward(folder: str):
    """TRL-signature reward: the number of characters / 8; each call's prompts and rewards in folder/<trial>.jsonl."""
    def length(prompts, completions, trainer_state, **kw):
        text = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [len(t) / 8 for t in text]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{trainer_state.trial_name}.jsonl"), "a") as f:
            f.write(json.dumps({"prompts": prompts, "rewards": rewards}) + "\n")
        return rewards
    return length


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_two_trial_sweep_reports_the_mean_reward_of_each_trials_evaluation(ray_cluster, tmp_path):
    import pandas as pd
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import raytrain.trl as rt
    from examples.sft import build_tokenizer, preferences
    from tests.hf import grpo_jobs

    tiny = grpo_jobs.save_tiny_model(str(tmp_path / "tiny"))
    calls = tmp_path / "calls"
    train = grpo_jobs.prompts(conversational=False)
    evals = Dataset.from_list([{"prompt": "Eval: " + r["prompt"]}
                               for r in preferences(4, seed=7, conversational=False)])
    args = rt.GRPOConfig(str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=6, per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=2,
                         save_strategy="steps", save_steps=2, logging_steps=1, learning_rate=1e-2, seed=0, bf16=False,
                         report_to="none", disable_tqdm=True, use_cpu=True)
    trainer = rt.GRPOTrainer(model_init=lambda: AutoModelForCausalLM.from_pretrained(tiny),
                             reward_funcs=_recording_reward(str(calls)), args=args, train_dataset=train,
                             eval_dataset=evals, processing_class=build_tokenizer())
    space = {"beta": {"choice": [0.0, 0.04]}, "learning_rate": {"loguniform": [1e-3, 1e-2]},
             "num_generations": {"choice": [2, 4]}}
    best = trainer.hyperparameter_search(space, backend="ray", n_trials=2, scheduler="none", seed=4,
                                         max_concurrent_trials=1, name="grpo", plots=False)
    table = pd.read_csv(tmp_path / "out" / "sweeps" / "grpo" / "trials.csv", dtype={"trial_id": str})
    assert len(table) == 2 and list(table["status"]) == ["finished", "finished"], table
    assert set(table["beta"]) == {0.0, 0.04} and set(table["num_generations"]) == {2, 4}  # the sampler's, seed 4
    assert best.objective == table["objective"].max()  # maximized: GRPO's own objective
    eval_prompts = {r["prompt"] for r in evals}
    for _, row in table.iterrows():
        trial = tmp_path / "out" / "sweeps" / "grpo" / f"trial_{row['trial_id']}"
        state = json.loads((trial / "checkpoint-2" / "trainer_state.json").read_text())
        assert state["trial_params"]["num_generations"] == row["num_generations"]
        logs = [e for e in state["log_history"] if "loss" in e]
        evaluation = next(e for e in state["log_history"] if "eval_reward" in e)
        assert row["objective"] == pytest.approx(evaluation["eval_reward"])
        assert ("kl" in logs[0]) == (row["beta"] > 0)  # the reference model only with beta > 0
        # the trial's reward calls: training groups of num_generations copies of a prompt; the evaluation's
        # rewards, whose mean is the objective
        with open(calls / f"{state['trial_name']}.jsonl") as f:
            recorded = [json.loads(line) for line in f]
        training = [c for c in recorded if not set(c["prompts"]) & eval_prompts]
        n = int(row["num_generations"])
        for c in training:
            groups = [c["prompts"][i:i + n] for i in range(0, len(c["prompts"]), n)]
            assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == len(groups)
        evaluated = [r for c in recorded if set(c["prompts"]) <= eval_prompts for r in c["rewards"]]
        assert len(evaluated) == len(evals) * n
        assert row["objective"] == pytest.approx(sum(evaluated) / len(evaluated), abs=1e-6)


def test_model_init_gives_each_train_a_fresh_model_set_up_as_trl_sets_it_up(tmp_path):
    """HF's model_init on GRPOTrainer (raytrain's addition, for sweeps): the trainer builds its model with it; each
    in-process train() starts from a fresh one, set up again (LoRA from peft_config, beta's reference adapter), so two
    train() calls end with the same adapter; the callbacks given stay."""
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    import raytrain.trl as rt
    from examples.sft import build_tokenizer
    from raytrain import TrainerCallback
    from tests.hf import grpo_jobs
    from tests.hf.trl_jobs import lora

    class Steps(TrainerCallback):
        def __init__(self):
            self.ends = 0

        def on_train_end(self, args, state, control, **kwargs):
            self.ends += 1

    tiny = grpo_jobs.save_tiny_model(str(tmp_path / "tiny"))
    steps = Steps()
    args = grpo_jobs.config("rt", "grpo", str(tmp_path / "out"), max_steps=1, beta=0.04)
    trainer = rt.GRPOTrainer(model_init=lambda: AutoModelForCausalLM.from_pretrained(tiny),
                             reward_funcs=grpo_jobs.Recorder().functions(("length",)), args=args,
                             train_dataset=grpo_jobs.prompts(), processing_class=build_tokenizer(),
                             peft_config=lora(), callbacks=[steps])
    first_model = trainer.model
    before = {k: v.clone() for k, v in get_peft_model_state_dict(first_model).items()}
    trainer.train()
    first = {k: v.clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    assert any(not torch.equal(before[k], first[k]) for k in first)  # it trained
    trainer.train()
    assert trainer.model is not first_model and trainer.model_init is not None and steps.ends == 2
    second = get_peft_model_state_dict(trainer.model)
    assert all(torch.equal(first[k], second[k]) for k in first)  # from a fresh model: the same run again


def test_a_trainer_needs_a_model_or_model_init(tmp_path):
    import raytrain.trl as rt
    from tests.hf import grpo_jobs

    with pytest.raises(ValueError, match=r"^model: GRPOTrainer needs a model \(or model_init, a function "
                                         r"returning one\)$"):
        rt.GRPOTrainer(reward_funcs=len, args=grpo_jobs.config("rt", "grpo", str(tmp_path)),
                       train_dataset=grpo_jobs.prompts())
