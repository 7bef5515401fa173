"""What raytrain.trl's GRPOTrainer / RLOOTrainer do not run is refused in one line naming the field, before any
work; a reward function that raises or returns the wrong thing is named in one line before the step's update."""

from __future__ import annotations

import pytest
import torch

from . import grpo_jobs as jobs

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jobs.save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def _one_line(error: BaseException, pattern: str) -> None:
    import re

    text = str(error)
    assert "\n" not in text and re.search(pattern, text), text


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("kw, pattern", [
    (dict(use_vllm=True), r"^use_vllm: not supported by raytrain.trl's (GRPO|RLOO)Trainer \(vLLM"),
    (dict(use_transformers_continuous_batching=True), r"^use_transformers_continuous_batching: not supported"),
    (dict(use_transformers_paged=True), r"^use_transformers_continuous_batching: not supported"),
    (dict(sync_ref_model=True, beta=0.1), r"^sync_ref_model: not supported .* not checkpointed"),
    (dict(model_init_kwargs={"device_map": "cpu"}), r"^model_init_kwargs.device_map: not supported"),
    (dict(include_num_input_tokens_seen="all"), r"^include_num_input_tokens_seen: (GRPO|RLOO) counts"),
    (dict(parallelism_config={"tp_size": 2}, scaling={"num_workers": 2}, distributed={"strategy": "fsdp"}),
     r"^parallelism_config.tp_size: tensor parallelism is not supported"),
    (dict(parallelism_config={"pp_size": 2, "dp_shard_size": 2}, scaling={"num_workers": 4},
          distributed={"strategy": "fsdp"}), r"^parallelism_config.pp_size: pipeline parallelism is not supported by "
                                             r"raytrain.trl's (GRPO|RLOO)Trainer \(TRL's loss"),
])
def test_config_features_not_run_are_refused(tmp_path, tiny, kind, kw, pattern):
    with pytest.raises(ValueError) as e:
        jobs.trainer("rt", str(tmp_path), tiny, kind=kind, **kw)
    _one_line(e.value, pattern)


@pytest.mark.parametrize("kw, pattern", [
    (dict(cast_lm_head_to_fp32=True), r"^cast_lm_head_to_fp32: not supported"),
    (dict(log_completions=True, log_completions_hub_repo="me/completions"), r"^log_completions_hub_repo: not "),
    (dict(loss_type="ppo"), r"^loss_type: 'ppo' is not one of 'grpo', 'bnpo'"),
    (dict(importance_sampling_level="batch"), r"^importance_sampling_level: 'batch' is not one of"),
    (dict(scale_rewards="all"), r"^scale_rewards: 'all' is not one of 'group', 'batch', 'none'$"),
])
def test_grpo_only_fields_are_checked(tmp_path, tiny, kw, pattern):
    with pytest.raises(ValueError) as e:
        jobs.trainer("rt", str(tmp_path), tiny, **kw)
    _one_line(e.value, pattern)


@pytest.mark.parametrize("name", ["tools", "rollout_func", "environment_factory"])
def test_tools_rollout_functions_and_environments_are_refused(tmp_path, tiny, name):
    import raytrain.trl as rt
    from examples.sft import build_tokenizer

    def tool(x: int) -> int:
        """A tool."""
        return x

    value = [tool] if name == "tools" else tool
    with pytest.raises(ValueError) as e:
        rt.GRPOTrainer(model=tiny, reward_funcs=jobs.Recorder().functions(("length",)),
                       args=jobs.config("rt", "grpo", str(tmp_path)), train_dataset=jobs.prompts(),
                       processing_class=build_tokenizer(), **{name: value})
    _one_line(e.value, rf"^{name}: not supported by raytrain.trl's GRPOTrainer \(tool calling")


def test_vision_models_and_datasets_are_refused(tmp_path, tiny):
    from datasets import Dataset
    from transformers import ProcessorMixin

    import raytrain.trl as rt

    class Processor(ProcessorMixin):
        attributes = []

    args = jobs.config("rt", "grpo", str(tmp_path))
    funcs = jobs.Recorder().functions(("length",))
    with pytest.raises(ValueError) as e:
        rt.GRPOTrainer(model=tiny, reward_funcs=funcs, args=args, train_dataset=jobs.prompts(),
                       processing_class=object.__new__(Processor))
    _one_line(e.value, r"^processing_class: vision-language processors are not supported")
    images = Dataset.from_list([{"prompt": "a", "image": None}] * 4)
    with pytest.raises(ValueError) as e:
        rt.GRPOTrainer(model=tiny, reward_funcs=funcs, args=args, train_dataset=images)
    _one_line(e.value, r"^train_dataset: image columns \(vision datasets\) are not supported")


def test_bad_datasets_and_reward_sources_are_named(tmp_path, tiny):
    from datasets import Dataset, IterableDataset

    import raytrain.trl as rt
    from examples.sft import build_tokenizer

    args, tok = jobs.config("rt", "grpo", str(tmp_path)), build_tokenizer()
    funcs = jobs.Recorder().functions(("length",))
    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "a"}] * 4))
    cases = [
        (dict(train_dataset=stream, reward_funcs=funcs), TypeError, r"^train_dataset: a map-style datasets.Dataset"),
        (dict(train_dataset=Dataset.from_list([{"text": "a"}] * 4), reward_funcs=funcs), ValueError,
         r"^train_dataset: no 'prompt' column \(it has \['text'\]\)"),
        (dict(train_dataset=jobs.prompts(), reward_funcs=[]), ValueError, r"^reward_funcs: give at least one"),
        (dict(train_dataset=jobs.prompts(), reward_funcs=[3]), TypeError, r"^reward_funcs\[0\]: expected a function"),
        (dict(train_dataset=jobs.prompts(), reward_funcs=funcs, reward_processing_classes=[tok, tok]), ValueError,
         r"^reward_processing_classes: 2 for 1 reward functions"),
    ]
    for kw, kind, pattern in cases:
        with pytest.raises(kind) as e:
            rt.GRPOTrainer(model=tiny, args=args, processing_class=tok, **kw)
        _one_line(e.value, pattern)
    with pytest.raises(ValueError) as e:
        jobs.trainer("rt", str(tmp_path), tiny, reward_weights=[1.0])
    _one_line(e.value, r"^reward_weights: 1 weights for 3 reward functions")


def _bad_reward(how: str):
    def judge(completions, trainer_state, **kw):
        if how == "raises":
            raise KeyError("answer")
        if how == "short":
            return [1.0] * (len(completions) - 1)
        if how == "text":
            return ["good"] * len(completions)
        return 1.0
    return judge


@pytest.mark.parametrize("kind, how, pattern", [
    ("grpo", "raises", r"^reward function 'judge' raised KeyError: 'answer' \(step 1\); the step's update was not "
                       r"made$"),
    ("rloo", "raises", r"^reward function 'judge' raised KeyError: 'answer' \(step 1\)"),
    ("grpo", "short", r"^reward function 'judge' returned 7 rewards for 8 completions; return one per completion"),
    ("rloo", "text", r"^reward function 'judge' returned str 'good' for completion 0; a reward is a number or None"),
    ("grpo", "scalar", r"^reward function 'judge' returned float 1.0, not a list of 8 rewards"),
])
def test_a_bad_reward_function_is_named_before_the_update(tmp_path, tiny, kind, how, pattern):
    from examples.sft import build_tokenizer

    import raytrain.trl as rt

    cls = rt.GRPOTrainer if kind == "grpo" else rt.RLOOTrainer
    trainer = cls(model=tiny, reward_funcs=[*jobs.Recorder().functions(("length",)), _bad_reward(how)],
                  args=jobs.config("rt", kind, str(tmp_path)), train_dataset=jobs.prompts(),
                  processing_class=build_tokenizer())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError) as e:
        trainer.train()
    _one_line(e.value, pattern)
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

