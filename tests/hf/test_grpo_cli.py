"""examples/grpo.yaml as users run it (raytrain.run's main): GRPO's fields pick GRPOConfig and
GRPOTrainer (RLOO's own fields RLOOConfig and RLOOTrainer), the reward functions named by import string are the
ones scored, the adapter loads with PEFT; a reward function that does not resolve is one line, exit 2."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("trl")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "grpo.yaml")


def test_the_cli_runs_examples_grpo_yaml_and_its_adapter_loads(tmp_path, capsys, monkeypatch):
    """docs/snippets/grpo_cli.sh as shown, shorter (2 steps), through the CLI's main in this process (a subprocess
    would import torch, transformers and trl again: test_docs.py runs the shell snippets' shape)."""
    import shlex

    from peft import PeftModel

    from examples.sft import build_model
    from tests.tiny import run_main

    with open(os.path.join(ROOT, "docs", "snippets", "grpo_cli.sh")) as f:
        (shown,) = [shlex.split(line) for line in f if line.strip() and not line.startswith("#")]
    assert shown[:3] == ["python", "-m", "raytrain.run"]
    out = tmp_path / "run"
    argv = [*shown[3:], "--set", f"output_dir={out}", "--set", "max_steps=2", "--set", "eval_steps=2",
            "--set", "save_steps=2", "--set", "logging_steps=1", "--set", "data.n_train=16"]
    monkeypatch.chdir(ROOT)
    code, stdout, stderr = run_main(capsys, *argv)
    assert code == 0, stderr[-3000:]
    summary = json.loads(stdout.split("summary: ")[-1].splitlines()[0])
    assert summary["global_step"] == 2
    # the final evaluation's mean reward, the sum of the two functions the YAML names
    assert summary["eval_reward"] == pytest.approx(summary["eval_rewards/correct_sum/mean"]
                                                   + summary["eval_rewards/brevity/mean"], abs=1e-5)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [e for e in state["log_history"] if "loss" in e]
    assert len(logged) == 2 and {"reward", "rewards/correct_sum/mean", "rewards/brevity/mean", "kl"} <= set(logged[0])
    args = json.loads((out / "checkpoint-2" / "training_args.json").read_text())
    assert args["reward_funcs"] == ["examples.grpo:correct_sum", "examples.grpo:brevity"]
    assert args["num_generations"] == 4 and args["beta"] == 0.04
    PeftModel.from_pretrained(build_model(), str(out / "final"))


@pytest.mark.parametrize("extra, kind", [([], "GRPO"), (["normalize_advantages=true"], "RLOO")])
def test_the_cli_picks_grpo_or_rloo_from_the_yamls_fields(extra, kind):
    import raytrain.trl as rt
    from raytrain.cli.trl import trainer_for, trl_arguments

    args = trl_arguments(EXAMPLE, ["output_dir=x", *extra], "reward_funcs")
    assert type(args) is getattr(rt, f"{kind}Config") and args.num_generations == 4
    assert args.reward_funcs == ["examples.grpo:correct_sum", "examples.grpo:brevity"]
    assert trainer_for(args) is getattr(rt, f"{kind}Trainer")


@pytest.mark.parametrize("value, message", [
    ("[examples.grpo:no_such_reward]", "reward_funcs[0]: module 'examples.grpo' has no attribute 'no_such_reward'"),
    ("[examples.grpo:correct_sum, examples.no_module:f]",
     "reward_funcs[1]: cannot import module 'examples.no_module' (No module named 'examples.no_module')"),
    ("[examples.grpo.correct_sum]",
     "reward_funcs[0]: expected an import string 'package.module:function', got 'examples.grpo.correct_sum'"),
    ("[examples.sft:CHAT_TEMPLATE]", "reward_funcs[0]: examples.sft:CHAT_TEMPLATE is a str, not a function"),
    ("null", "reward_funcs: missing; name at least one reward function, e.g. "
             "reward_funcs: ['package.module:function']"),
])
def test_a_reward_function_that_does_not_resolve_is_one_line_exit_2(tmp_path, capsys, value, message):
    from raytrain.run import main

    code = main(["--config", EXAMPLE, "--set", f"output_dir={tmp_path / 'o'}", "--set", f"reward_funcs={value}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"error: {message} (traceback in {tmp_path / 'o' / 'raytrain.log'}; --debug prints it)\n")
    assert not (tmp_path / "o" / "checkpoint-1").exists()


@pytest.mark.parametrize("setting, message", [
    ("use_vllm=true", "use_vllm: not supported by raytrain.trl's GRPOTrainer (vLLM generation is not run; "
                      "generation uses transformers' generate())"),
    ("loss_type=ppo", "loss_type: 'ppo' is not one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo', 'cispo', 'sapo', "
                      "'vespo'"),
    ("scale_rewards=all", "scale_rewards: 'all' is not one of 'group', 'batch', 'none'"),
])
def test_a_grpo_setting_not_run_is_a_configuration_error_before_the_model_loads(tmp_path, capsys, setting, message):
    """The config refuses it (exit 2, one line), before any factory runs: no output_dir, no log."""
    from raytrain.run import main

    code = main(["--config", EXAMPLE, "--set", f"output_dir={tmp_path / 'o'}", "--set", setting])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_the_cli_sweep_of_examples_grpo_yaml_maximizes_the_mean_reward(tmp_path, monkeypatch):
    """--search search_spaces/grpo.yaml (no metric, no mode): a GRPOTrainer built with model_init and the YAML's
    reward functions, swept on GRPO's own objective, eval_reward, maximized. (tests/hf/test_grpo_sweep.py runs such
    a sweep on Ray Tune.)"""
    import raytrain.sweep as sweep
    import raytrain.trl as rt
    from raytrain.cli.job import build_job
    from raytrain.cli.search import run_search_cli
    from raytrain.cli.trl import trl_arguments
    from raytrain.sweep.space import objective_defaults

    seen = {}

    def search(trainer, space, **kw):
        seen.update(trainer=trainer, space=space, **kw)
        return None

    monkeypatch.setattr(sweep, "hyperparameter_search", search)
    args = trl_arguments(EXAMPLE, [f"output_dir={tmp_path}"], "reward_funcs")
    run_search_cli(args, build_job(args), os.path.join(ROOT, "search_spaces", "grpo.yaml"))
    trainer = seen["trainer"]
    assert type(trainer) is rt.GRPOTrainer and trainer.model_init is not None
    assert [f.__name__ for f in trainer.reward_funcs] == ["correct_sum", "brevity"]
    assert set(seen["space"].names) == {"beta", "learning_rate", "num_generations"}
    assert (seen["metric"], seen["direction"]) == (None, None)
    assert objective_defaults(trainer, None, None) == ("eval_reward", "maximize")


def test_the_cli_sweeps_only_trainers_that_take_model_init(tmp_path):
    from raytrain.cli.job import build_job
    from raytrain.cli.search import run_search_cli
    from raytrain.cli.trl import trl_arguments
    from raytrain.config.args import ConfigError

    args = trl_arguments(os.path.join(ROOT, "examples", "sft.yaml"), [f"output_dir={tmp_path}"], "packing")
    with pytest.raises(ConfigError) as e:
        run_search_cli(args, build_job(args), os.path.join(ROOT, "search_spaces", "lora.yaml"))
    assert str(e.value) == ("--search: SFTTrainer takes no model_init (a fresh model per trial); the CLI sweeps "
                            "raytrain's Trainer, Seq2SeqTrainer, GRPOTrainer and RLOOTrainer")
