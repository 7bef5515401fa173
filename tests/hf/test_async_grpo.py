"""raytrain.trl's AsyncGRPOTrainer in one process (rollout.num_workers 0: the engine beside the trainer): the
schedule (which version generates a step's groups, with which seed), the staleness it logs, TRL's metric keys, the
reward rising, an evaluation, and every setting it refuses in one line. The Ray actors: test_async_grpo_on_ray.py."""

from __future__ import annotations

import pytest

from tests.hf import async_grpo_jobs as jobs

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The local run the Ray tests compare with too (10 steps, max_staleness 1)."""
    t = jobs.trainer(str(tmp_path_factory.mktemp("async_ref")))
    t.train()
    return {"steps": jobs.steps(t), "weights": jobs.weights(t.model), "eval": t.evaluate()}


def test_the_schedule_fixes_version_staleness_and_seed_by_the_step():
    from raytrain.hf.trl.schedule import Schedule

    s = Schedule(seed=7, num_prompts=5, groups_per_step=2, max_staleness=1, weight_sync_steps=2)
    # version v is published after 2v steps; step n trains on the newest one at its start, less one
    assert [s.published(n) for n in range(1, 8)] == [0, 0, 1, 1, 2, 2, 3]
    assert [s.version(n) for n in range(1, 8)] == [0, 0, 0, 0, 1, 1, 2]
    assert [s.staleness(n) for n in range(1, 8)] == [0, 0, 1, 1, 1, 1, 1]
    assert list(s.groups(3)) == [4, 5] and s.step_of(5) == 3
    assert [s.prompt_index(g) for g in range(7)] == [0, 1, 2, 3, 4, 0, 1]  # TRL's order, again from the first
    seeds = {s.seed_of(g) for g in range(100)}
    assert len(seeds) == 100 and s.seed_of(3) == Schedule(7, 5, 2, 0, 1).seed_of(3)  # (seed, prompt, group) only
    assert s.seed_of(0) != Schedule(8, 5, 2).seed_of(0)
    # what the published versions can generate: exactly the steps whose version is out
    for published in range(4):
        ready = s.last_ready_step(published, 100)
        assert s.version(ready) <= published < s.version(ready + 1)
    assert s.last_ready_step(-1, 100) == 0


def test_groups_per_call_bundles_each_steps_groups_in_order():
    from types import SimpleNamespace

    from raytrain.hf.trl.rollouts import ScheduledRollouts
    from raytrain.hf.trl.schedule import Schedule

    class Recording:
        def __init__(self):
            self.calls, self.done = [], {}

        def publish(self, version, weights):
            pass

        def submit(self, requests):
            self.calls.append([(r.group, r.version) for r in requests])
            for r in requests:
                self.done[r.group] = SimpleNamespace(group=r.group, worker="w", started=0.0, finished=0.0)

        def result(self, group):
            return self.done.pop(group)

        def discard(self, groups):
            for g in groups:
                self.done.pop(g, None)

    pool = Recording()
    rollouts = ScheduledRollouts(Schedule(seed=1, num_prompts=4, groups_per_step=3, max_staleness=1), pool,
                                 rows=[{"prompt": str(i)} for i in range(4)], max_steps=3, max_ahead_groups=6,
                                 per_call=2)
    rollouts.publish(0, {})
    assert [g.group for g in rollouts.take(1)] == [0, 1, 2]
    # a step's groups in calls of at most 2, never mixing steps (nor versions): steps 1 and 2 from version 0
    assert pool.calls == [[(0, 0), (1, 0)], [(2, 0)], [(3, 0), (4, 0)], [(5, 0)]]
    rollouts.publish(1, {})
    assert [g.group for g in rollouts.take(2)] == [3, 4, 5]
    assert pool.calls[4:] == [[(6, 1), (7, 1)], [(8, 1)]]


def test_a_local_run_logs_trls_keys_its_staleness_and_a_rising_reward(reference):
    logs = reference["steps"]
    assert [e["step"] for e in logs] == list(range(1, 11))
    keys = {"loss", "reward", "reward_std", "rewards/low_ids/mean", "rewards/low_ids/std", "kl", "entropy", "ratio",
            "clip_ratio/low_mean", "clip_ratio/high_max", "completions/mean_length", "sample/staleness_mean",
            "sample/staleness_max", "sample/dropped_stale_total"}
    assert keys <= set(logs[0]), sorted(keys - set(logs[0]))
    # max_staleness 1: step 1 trains on version 0 (nothing older), every later step on the version before
    assert [e["sample/staleness_max"] for e in logs] == [0.0] + [1.0] * 9
    assert all(e["sample/dropped_stale_total"] == 0 for e in logs)
    assert logs[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(e["ratio"] - 1) > 1e-3 for e in logs[1:])  # off-policy: the behaviour policy's log-probs
    first, last = (sum(e["reward"] for e in part) / 3 for part in (logs[:3], logs[-3:]))
    assert last > first + 0.1, [e["reward"] for e in logs]
    assert set(reference["eval"]) >= {"eval_reward", "eval_reward_std", "eval_rewards/low_ids/mean"}


def test_on_policy_has_no_staleness_and_a_ratio_of_one(tmp_path):
    t = jobs.trainer(str(tmp_path), max_staleness=0, max_steps=3)
    t.train()
    logs = jobs.steps(t)
    assert [e["sample/staleness_max"] for e in logs] == [0.0, 0.0, 0.0]
    assert all(e["ratio"] == pytest.approx(1.0, abs=1e-5) for e in logs)


def test_weight_sync_steps_publish_every_nth_step(tmp_path):
    t = jobs.trainer(str(tmp_path), max_staleness=0, weight_sync_steps=2, max_steps=4)
    t.train()
    # versions published after steps 0, 2: steps 2 and 4 train on a policy one update old (staleness 0 in versions)
    logs = jobs.steps(t)
    assert [e["sample/staleness_max"] for e in logs] == [0.0] * 4
    assert logs[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and abs(logs[1]["ratio"] - 1) > 1e-4


def test_evaluation_is_the_same_twice_and_on_any_pool(reference, tmp_path):
    t = jobs.trainer(str(tmp_path), max_steps=1)
    first, second = t.evaluate(), t.evaluate()
    assert first == second and first["eval_rewards/low_ids/mean"] == first["eval_reward"]


@pytest.mark.parametrize("kw, message", [
    ({"max_tool_calling_iterations": 2}, "max_tool_calling_iterations: tool calling is not run"),
    ({"num_generations": 3}, "num_generations: the samples of a step"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "num_generations: at least 2 completions"),
    ({"max_staleness": -1}, "max_staleness: must be >= 0"),
    ({"weight_sync_steps": 0}, "weight_sync_steps: must be >= 1"),
    ({"rollout": {"num_workers": -1}}, "rollout.num_workers: must be >= 0"),
    ({"rollout": {"workers": 2}}, "unknown field"),
    ({"rollout": {"groups_per_call": 0}}, "rollout.groups_per_call: must be >= 1"),
    ({"scaling": {"num_workers": [1, 2]}}, "scaling.num_workers: an elastic group is not supported"),
    ({"parallelism_config": {"tp_size": 2}, "scaling": {"num_workers": 2}}, "parallelism_config.tp_size"),
    ({"parallelism_config": {"pp_size": 2}, "scaling": {"num_workers": 2}}, "parallelism_config.pp_size"),
    ({"parallelism_config": {"cp_size": 2}, "scaling": {"num_workers": 2}}, "parallelism_config.cp_size"),
    ({"parallelism_config": {"sp_size": 2}, "scaling": {"num_workers": 2}}, "parallelism_config.sp_size"),
])
def test_settings_it_does_not_run_are_refused_in_one_line(tmp_path, kw, message):
    from raytrain.config.sections import ConfigError
    from raytrain.trl import AsyncGRPOConfig

    args = {**jobs.RUN, "output_dir": str(tmp_path), **kw}
    with pytest.raises(ConfigError) as e:
        AsyncGRPOConfig(**args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_trainer_arguments_it_does_not_run_are_refused_in_one_line(tmp_path):
    from datasets import Dataset

    from examples.sft import build_model

    cases = [({"tools": [print]}, "tools: not supported"),
             ({"args": {"vllm_server_base_url": "http://x:8000"}}, "vllm_server_base_url: only for a vLLM server"),
             ({"args": {"token_budget": 256}}, "token_budget: a step trains on whole prompt groups"),
             ({"environment_factory": object}, "environment_factory: not supported"),
             ({"reward_funcs": "some/reward-model"}, "reward_funcs[0]: AsyncGRPOTrainer takes reward functions"),
             ({"train_dataset": Dataset.from_list([{"question": "1+1"}])}, "train_dataset: no 'prompt' column"),
             ({"train_dataset": Dataset.from_list([{"prompt": "1+1", "image": "x.png"}])},
              "train_dataset: image columns"),
             ({"train_dataset": None}, "`train_dataset` is required")]
    for kw, message in cases:
        with pytest.raises((ValueError, TypeError)) as e:
            t = jobs.trainer(str(tmp_path), max_steps=1)
            if isinstance(kw.get("args"), dict):
                kw = {"args": type(t.args)(**{**jobs.RUN, "output_dir": str(tmp_path), **kw["args"]})}
            type(t)(build_model(), **{"reward_funcs": jobs.low_ids, "args": t.args, "train_dataset": t.train_dataset,
                                      "processing_class": t.processing_class, **kw})
        assert message in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    with pytest.raises(ValueError, match="use_liger_kernel: not supported"):
        jobs.trainer(str(tmp_path), use_liger_kernel=True)


def test_a_reward_function_that_fails_is_named_in_one_line(tmp_path):
    from raytrain.hf.trl.engine import RewardError

    t = jobs.trainer(str(tmp_path), max_steps=1)
    t.reward_funcs = [lambda completions, **kw: [1.0]]  # one reward for 4 completions
    t.reward_func_names = ["short"]
    with pytest.raises(RewardError, match="reward function 'short' returned 1 rewards for 4 completions"):
        t.train()
