"""raytrain.trl against trl 1.16 on the same script, data and order: configs field by field, the prepared dataset,
the first collated batch, per-step losses and TRL's metrics; resume after SIGKILL; one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from . import trl_jobs as jobs

trl = pytest.importorskip("trl")


def _close(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            if k == "num_tokens":
                assert x[k] == y[k], (k, x, y)
            else:
                assert x[k] == pytest.approx(y[k], abs=tol, rel=tol), (k, x, y)


@pytest.mark.parametrize("name", ["SFTConfig", "DPOConfig"])
def test_config_has_every_trl_field_with_its_default(name, tmp_path):
    import raytrain.trl as rt

    theirs, ours = getattr(trl, name), getattr(rt, name)
    mine = {f.name: f for f in dataclasses.fields(ours)}
    for f in dataclasses.fields(theirs):
        assert f.name in mine, f"{name}.{f.name} is missing"
        if f.name in ours.TRL_FIELDS or f.name in ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16"):
            want = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            got = mine[f.name].default if mine[f.name].default_factory is dataclasses.MISSING \
                else mine[f.name].default_factory()
            assert got == want, (f.name, got, want)
    # the values after __post_init__ too (bf16 resolved, deprecated names renamed, "auto" padding)
    a, b = theirs(str(tmp_path / "a"), use_cpu=True), ours(str(tmp_path / "b"), use_cpu=True)
    for n in (*ours.TRL_FIELDS, "learning_rate", "logging_steps", "gradient_checkpointing", "bf16"):
        assert getattr(a, n) == getattr(b, n), n


def test_config_refuses_a_bad_choice_in_one_line(tmp_path):
    import raytrain.trl as rt

    with pytest.raises(ValueError, match=r"^packing_strategy: 'best' is not one of 'bfd', 'bfd_split', 'wrapped'$"):
        rt.SFTConfig(str(tmp_path), packing_strategy="best")


def _sft_pair(tmp_path, **kw):
    return {lib: jobs.sft_trainer(lib, str(tmp_path / lib), **kw) for lib in ("trl", "rt")}


def _same_prepared_and_first_batch(pair) -> None:
    ours, theirs = pair["rt"], pair["trl"]
    assert ours.train_dataset.column_names == theirs.train_dataset.column_names
    assert ours.train_dataset.to_list() == theirs.train_dataset.to_list()
    rows = [theirs.train_dataset[i] for i in range(4)]
    a, b = theirs.data_collator(rows), ours.data_collator(rows)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_sft_script_lora_assistant_only_bfd_packing_matches_trl(tmp_path):
    pair = _sft_pair(tmp_path)
    _same_prepared_and_first_batch(pair)
    for t in pair.values():
        t.train()
    _close(jobs.steps(pair["rt"]), jobs.steps(pair["trl"]))
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(pair["rt"].state.log_history[0])


@pytest.mark.parametrize("case", ["text_wrapped_dft", "prompt_completion", "pretokenized_padding"])
def test_sft_formats_match_trl(tmp_path, case):
    from datasets import Dataset
    from examples.sft import conversations

    rows = conversations(40)
    if case == "text_wrapped_dft":
        data = Dataset.from_list([{"text": " ".join(m["content"] for m in r["messages"])} for r in rows])
        kw = dict(packing_strategy="wrapped", loss_type="dft", max_length=48)
    elif case == "prompt_completion":  # completion_only_loss by default, conversational prompt / completion
        data = Dataset.from_list([{"prompt": r["messages"][:2], "completion": r["messages"][2:]} for r in rows])
        kw = dict(packing=False)
    else:
        data = Dataset.from_list([{"input_ids": list(range(3, 3 + 5 + i % 7))} for i in range(40)])
        kw = dict(packing=False, max_length=10)
    pair = {lib: jobs.sft_trainer(lib, str(tmp_path / lib), data=data, peft=case != "text_wrapped_dft",
                                  **{"assistant_only_loss": False, **kw}) for lib in ("trl", "rt")}
    _same_prepared_and_first_batch(pair)
    for t in pair.values():
        t.train()
    _close(jobs.steps(pair["rt"]), jobs.steps(pair["trl"]))


def test_sft_bad_inputs_one_line(tmp_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match="^assistant_only_loss: the dataset is not conversational"):
        jobs.sft_trainer("rt", str(tmp_path), data=Dataset.from_list([{"text": "a b"}] * 4))
    with pytest.raises(ValueError, match="^activation_offloading: not supported"):
        jobs.sft_trainer("rt", str(tmp_path), activation_offloading=True)


def _dpo_pair(tmp_path, **kw):
    return {lib: jobs.dpo_trainer(lib, str(tmp_path / lib), **kw) for lib in ("trl", "rt")}


def test_dpo_script_lora_conversational_matches_trl(tmp_path):
    """Explicit conversational prompt; the reference is the base model (adapter disabled)."""
    pair = _dpo_pair(tmp_path, max_steps=3)
    _same_prepared_and_first_batch(pair)
    for t in pair.values():
        t.train()
    _close(jobs.steps(pair["rt"], jobs.DPO_KEYS), jobs.steps(pair["trl"], jobs.DPO_KEYS))
    assert {"rewards/chosen", "rewards/margins", "logps/rejected"} <= set(pair["rt"].state.log_history[0])


@pytest.mark.parametrize("case", ["ref_model_implicit_prompt_ipo", "precompute_sigmoid_plus_sft"])
def test_dpo_reference_models_and_losses_match_trl(tmp_path, case):
    from datasets import Dataset
    from examples.sft import preferences

    rows = preferences(32)
    if case == "ref_model_implicit_prompt_ipo":  # a separate ref_model, full fine-tuning, the prompt inside each turn list
        data = Dataset.from_list([{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                                  for r in rows])
        kw = dict(data=data, peft=False, ref=True, loss_type="ipo", beta=0.5)
    else:
        data = Dataset.from_list(preferences(32, conversational=False))
        kw = dict(data=data, precompute_ref_log_probs=True, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    pair = _dpo_pair(tmp_path, max_steps=3, learning_rate=1e-3, **kw)
    _same_prepared_and_first_batch(pair)
    for t in pair.values():
        t.train()
    _close(jobs.steps(pair["rt"], jobs.DPO_KEYS), jobs.steps(pair["trl"], jobs.DPO_KEYS))


def test_dpo_bad_inputs_one_line(tmp_path):
    with pytest.raises(ValueError, match="^sync_ref_model: not supported"):
        jobs.dpo_trainer("rt", str(tmp_path), sync_ref_model=True)
    with pytest.raises(ValueError, match="^ref_model: give one"):
        jobs.dpo_trainer("rt", str(tmp_path), peft=False)


KILLED = dict(max_steps=6, save_strategy="steps", save_steps=2)


def _killed_main(kind: str, out: str, threads: int) -> None:
    """The process the SIGKILL test kills (a fresh interpreter), on the test's thread count."""
    torch.set_num_threads(threads)
    make = jobs.sft_trainer if kind == "sft" else jobs.dpo_trainer
    make("rt", out, **KILLED).train()


def _adapter(model) -> dict:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_sigkill_during_a_save_then_resume_is_bit_exact_and_the_output_loads(tmp_path, kind):
    """Killed while checkpoint-4 is written: the run resumes from checkpoint-2 and ends with the uninterrupted
    run's adapter, losses and TRL metrics (num_tokens too); final/ loads with PeftModel.from_pretrained."""
    import os

    from peft import PeftModel
    from transformers import AutoTokenizer

    from examples.sft import build_model
    from raytrain import get_last_checkpoint
    from tests.tiny import kill_at_save

    out, flag = tmp_path / "run", tmp_path / "paused"
    kill_at_save(f"from tests.hf.test_trl import _killed_main; "
                 f"_killed_main({kind!r}, {str(out)!r}, {torch.get_num_threads()})", flag, 4, seconds=240)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    make = jobs.sft_trainer if kind == "sft" else jobs.dpo_trainer
    keys = jobs.STEP_KEYS if kind == "sft" else jobs.DPO_KEYS
    reference = make("rt", str(tmp_path / "ref"), **{**KILLED, "save_strategy": "no"})
    reference.train()
    resumed = make("rt", str(out), **KILLED)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert jobs.steps(resumed, keys) == jobs.steps(reference, keys)  # exactly: every step, num_tokens included
    want, got = _adapter(reference.model), _adapter(resumed.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    checkpoint = out / "checkpoint-6"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(checkpoint))
    resumed.save_model(str(tmp_path / "final"))
    loaded = PeftModel.from_pretrained(build_model(), str(tmp_path / "final"))
    assert all(torch.equal(v, _adapter(loaded)[k]) for k, v in got.items())
    assert AutoTokenizer.from_pretrained(str(tmp_path / "final")).chat_template == resumed.processing_class.chat_template


def test_the_cli_picks_dpo_for_examples_dpo_yaml():
    """examples/dpo.yaml names beta (DPO's own): a DPOConfig and a DPOTrainer (its run is the SFT one's path)."""
    import raytrain.trl as rt
    from raytrain.cli.trl import trainer_for, trl_arguments

    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = trl_arguments(os.path.join(root, "examples", "dpo.yaml"), ["output_dir=x"], "beta")
    assert type(args) is rt.DPOConfig and args.beta == 0.1 and args.loss_type == ["sigmoid"]
    assert trainer_for(args) is rt.DPOTrainer


@pytest.mark.parametrize("config", ["sft"])
def test_the_cli_examples_run_and_their_adapter_loads(tmp_path, config, capsys, monkeypatch):
    """`python -m raytrain.run --config examples/sft.yaml` (shortened), through the CLI's main in this process: TRL's
    fields pick the TRL trainer."""
    import json
    import os

    from peft import PeftModel

    from examples.sft import build_model
    from tests.tiny import run_main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "run"
    argv = ["--config", f"examples/{config}.yaml", "--set", f"output_dir={out}", "--set", "max_steps=4",
            "--set", "eval_steps=2", "--set", "save_steps=2", "--set", "logging_steps=2", "--set", "data.n_train=48"]
    monkeypatch.chdir(root)
    code, stdout, stderr = run_main(capsys, *argv)
    assert code == 0, stderr[-3000:]
    summary = json.loads(stdout.split("summary: ")[-1].splitlines()[0])
    assert summary["global_step"] == 4
    assert ("eval_mean_token_accuracy" if config == "sft" else "eval_rewards/margins") in summary
    PeftModel.from_pretrained(build_model(), str(out / "final"))
    assert os.path.exists(out / "plots" / ("loss.png"))


def test_the_cli_knows_trl_fields_without_importing_trl():
    import raytrain.trl as rt
    from raytrain.cli.trl import TRL_FIELDS

    assert TRL_FIELDS == set(rt.SFTConfig.TRL_FIELDS) | set(rt.DPOConfig.TRL_FIELDS) | rt.rollout_fields() | \
        rt.async_fields()


def test_without_trl_the_import_names_the_package_in_one_line():
    import subprocess
    import sys

    code = "import sys; sys.modules['trl'] = None; import raytrain.trl"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: raytrain.trl needs trl>=1.16,<1.17 (trl is missing): pip install 'raytrain[trl]'")
