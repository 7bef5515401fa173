"""Every `optim` name of transformers 5.23 side by side with HF's Trainer: the same optimizer class with the
same arguments (or the same failure, refused here in one line naming the package), the optimizer state
resumed bit-exactly for names of each family, and the refusal of a name whose library is missing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from examples.digits import build_model
from raytrain import ConfigError, Trainer, TrainingArguments
from raytrain.hf.optim import optimizer_cls_and_kwargs
from raytrain.hf.names import OPTIM_NAMES, TORCH_NAMES
from tests.tiny import StopAt

transformers = pytest.importorskip("transformers")
from transformers.training_args import OptimizerNames  # noqa: E402

#: optim_args HF reads for each family (HF ignores them for adamw_torch and adafactor, raytrain does not).
OPTIM_ARGS = {
    "sgd": "momentum=0.9,nesterov=True", "adagrad": "lr_decay=0.1,eps=1e-9", "rmsprop": "alpha=0.9,centered=True",
    "rmsprop_bnb": "alpha=0.9", "ademamix": "alpha=4.0,t_alpha=100,beta3=0.99", "galore": "rank=4,update_proj_gap=10",
    "apollo": "rank=4,scale=2.0", "grokadamw": "lamb=3.0", "adamw_torch_4bit": "block_size=128",
    "adamw_torch_8bit": "bf16_stochastic_round=True", "schedule_free": "weight_lr_power=1.5,r=0.5",
    "stable_adamw": "decouple_lr=True",
}


def optim_args_for(name: str) -> str | None:
    for key, value in OPTIM_ARGS.items():
        if name == key or (name.startswith(key) and key not in TORCH_NAMES):
            return value
    return "alpha=0.9" if name.startswith("rmsprop_bnb") else None


def model_pair() -> tuple[nn.Module, nn.Module]:
    """Two equal models: a layer-wise resolution hooks every parameter of the model it is given."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    return make(), make()


def comparable(value, names: dict[int, str]):
    """A resolution's kwargs with parameters, models and inner optimizers by name, so that two models'
    resolutions compare."""
    if isinstance(value, nn.Parameter):
        return names[id(value)]
    if isinstance(value, nn.Module):
        return "<the model>"
    if isinstance(value, torch.optim.Optimizer):
        return (type(value), comparable(value.param_groups, names))
    if isinstance(value, dict):
        return {comparable(k, names): comparable(v, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(v, names) for v in value)
    return value


def hf_resolution(name: str, model: nn.Module, **kw):
    args = transformers.TrainingArguments("unused", optim=name, use_cpu=True, report_to="none", **kw)
    try:
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as err:  # HF's "install ..." for a missing library, or its own failure
        return err
    return cls, comparable(kwargs, {id(p): n for n, p in model.named_parameters()})


def test_the_names_are_transformers_names():
    assert list(OPTIM_NAMES) == [n.value for n in OptimizerNames]


@pytest.mark.parametrize("name", list(OPTIM_NAMES))
def test_each_name_resolves_as_hf_trainer_does(name, tmp_path):
    kw = dict(learning_rate=3e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.01,
              warmup_steps=3, optim_args=optim_args_for(name))
    if name.startswith(("galore_", "apollo_")):
        kw["optim_target_modules"] = ["0", "2"]
    hf_model, our_model = model_pair()
    expected = hf_resolution(name, hf_model, **kw)
    missing = [pkg for mod, pkg in OPTIM_NAMES[name] if importlib.util.find_spec(mod) is None]
    if missing:  # HF fails asking for the library; raytrain refuses the arguments, naming its package
        assert isinstance(expected, Exception)
        with pytest.raises(ConfigError) as err:
            TrainingArguments(str(tmp_path), optim=name, report_to="none", **kw)
        assert str(err.value) == (f"optim: {name} needs {' and '.join(missing)}, which is not "
                                  f"installed; pip install {' '.join(missing)}")
        return
    args = TrainingArguments(str(tmp_path), optim=name, report_to="none", **kw)
    if isinstance(expected, Exception):  # HF's own failure (galore_adafactor_layerwise's lr): the same one
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            optimizer_cls_and_kwargs(args, our_model)
        return
    cls, kwargs = optimizer_cls_and_kwargs(args, our_model)
    assert (cls.__module__, cls.__qualname__) == (expected[0].__module__, expected[0].__qualname__)
    assert comparable(kwargs, {id(p): n for n, p in our_model.named_parameters()}) == expected[1]


def test_torch_names_take_every_optim_args_key_of_their_class(tmp_path):
    """Where HF reads no optim_args (adamw_torch) raytrain passes them on, refusing a key the class lacks."""
    args = TrainingArguments(str(tmp_path), optim="adamw_torch", optim_args="amsgrad=true", report_to="none")
    assert optimizer_cls_and_kwargs(args)[1]["amsgrad"] is True
    with pytest.raises(ValueError, match="optim_args: unknown key 'rank' for adamw_torch"):
        optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path), optim="adamw_torch", optim_args="rank=4",
                                                   report_to="none"))


# ---- a missing library: one line, before any work ------------------------------------------------------


@pytest.fixture
def without(monkeypatch):
    """Make find_spec report the given top-level modules missing."""
    def hide(*modules):
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name.split(".")[0] in modules else real(name, *a))
    return hide


def test_a_missing_library_is_refused_in_one_line_naming_the_package(tmp_path, without):
    without("bitsandbytes")
    with pytest.raises(ConfigError) as err:
        TrainingArguments(str(tmp_path), optim="paged_adamw_8bit")
    assert str(err.value) == "optim: paged_adamw_8bit needs bitsandbytes, which is not installed; pip install bitsandbytes"
    without("bitsandbytes", "transformers")
    with pytest.raises(ConfigError, match=r"^optim: lion_8bit needs bitsandbytes and transformers, which are not "
                                          r"installed; pip install bitsandbytes transformers$"):
        TrainingArguments(str(tmp_path), optim="lion_8bit")
    assert TrainingArguments(str(tmp_path), optim="sgd").optim == "sgd"  # torch's names need neither


def test_a_library_put_in_sys_modules_counts_as_installed_as_hf(tmp_path):
    """HF's optimizer-choice tests put a mock library in sys.modules (it has no __spec__): the name is
    accepted and transformers' resolution returns the mock's class, as for HF; None there blocks it."""
    from unittest.mock import Mock, patch

    from transformers.utils import is_bitsandbytes_available

    from raytrain import Trainer

    assert is_bitsandbytes_available()  # transformers caches it, as HF's @require_bitsandbytes does first
    mock = Mock()
    with patch.dict("sys.modules", {"bitsandbytes": mock, "bitsandbytes.optim": mock.optim}):
        args = TrainingArguments(str(tmp_path), optim="paged_adamw_8bit")
        assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is mock.optim.AdamW
    with patch.dict("sys.modules", {"bitsandbytes": None}):
        with pytest.raises(ConfigError, match="needs bitsandbytes, which is not installed"):
            TrainingArguments(str(tmp_path), optim="paged_adamw_8bit")


def test_an_unknown_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as err:
        TrainingArguments(str(tmp_path), optim="adam")
    message = str(err.value)
    assert "\n" not in message and message.startswith("optim: unknown optimizer 'adam' (valid: adamw_torch, ")
    assert all(name in message for name in OPTIM_NAMES)


def test_galore_needs_its_target_modules(tmp_path):
    with pytest.raises(ConfigError, match="^optim_target_modules: galore_adamw projects the weights"):
        TrainingArguments(str(tmp_path), optim="galore_adamw")


def test_without_transformers_torch_names_build_torch_classes(tmp_path, without):
    without("transformers")
    args = TrainingArguments(str(tmp_path), optim="adafactor", report_to="none")
    assert optimizer_cls_and_kwargs(args)[0] is torch.optim.Adafactor  # HF's own Adafactor needs transformers
    args = TrainingArguments(str(tmp_path), optim="rmsprop", report_to="none")
    assert optimizer_cls_and_kwargs(args) == (torch.optim.RMSprop, {"lr": 5e-5})


# ---- the optimizer state resumes bit-exactly -------------------------------------------------------------


def make_trainer(out, optim: str, *, init_seed: int = 0, callbacks=(), **kw) -> Trainer:
    rng = np.random.default_rng(0)
    data = {"pixels": rng.random((24, 64), dtype=np.float32), "labels": rng.integers(0, 10, 24)}
    kw = {"eval_strategy": "steps", "eval_steps": 3, **kw}
    args = TrainingArguments(output_dir=str(out), optim=optim, per_device_train_batch_size=4, learning_rate=0.01,
                             max_steps=8, logging_steps=1, save_steps=1, seed=0, disable_tqdm=True, report_to="none",
                             **kw)
    torch.manual_seed(init_seed)  # another init: the weights must come from the checkpoint
    return Trainer(build_model(hidden_size=16, dropout=0.0), args, train_dataset=data, eval_dataset=data,
                   callbacks=list(callbacks))


def history(trainer) -> list[tuple]:
    return [(h.get("loss"), h.get("grad_norm"), h.get("learning_rate"), h.get("eval_loss"))
            for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]


LOW_RANK = {"optim_target_modules": "all-linear", "optim_args": "rank=4,update_proj_gap=2"}
RESUMED = {"adamw_torch_fused": ("torch", {}), "adamw_bnb_8bit": ("bitsandbytes", {}),
           "lion_32bit": ("bitsandbytes", {}), "schedule_free_adamw": ("schedulefree", {}),
           "adamw_torch_8bit": ("torchao", {}), "stable_adamw": ("optimi", {}), "lomo": ("lomo_optim", {}),
           "galore_adamw": ("galore_torch", LOW_RANK), "apollo_adamw": ("apollo_torch", LOW_RANK)}


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_stopped_run_resumes_bit_exact(name, tmp_path):
    library, kw = RESUMED[name]
    pytest.importorskip(library)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = make_trainer(tmp_path / "ref", name, save_strategy="no", **kw)
        ref.train()
        make_trainer(tmp_path / "run", name, callbacks=[StopAt(3)], **kw).train()  # saved after its evaluation
        assert os.path.isdir(tmp_path / "run" / "checkpoint-3")
        resumed = make_trainer(tmp_path / "run", name, init_seed=7, **kw)
        resumed.train(resume_from_checkpoint=True)
    assert type(resumed.optimizer) is type(ref.optimizer)
    ref_w, got_w = ref.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
    assert history(resumed) == history(ref)  # losses, grad norms, rates and evaluations: bitwise equal
    assert sum(h[0] is not None for h in history(ref)) == 8 and sum(h[3] is not None for h in history(ref)) >= 2


# ---- the CLI: the refusal before any work, and torch's names without transformers ------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cli_refuses_a_missing_library_with_exit_2_before_torch_is_imported(tmp_path):
    probe = ("import runpy, sys\n"
             "sys.argv = ['raytrain.run', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('raytrain.run', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print(e.code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe, "--config", "examples/digits.yaml", "--set",
                           f"output_dir={tmp_path / 'o'}", "--set", "optim=adamw_torch_xla"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert done.stderr.strip() == "error: optim: adamw_torch_xla needs torch-xla, which is not installed; pip install torch-xla"
    assert done.stdout.split("\n")[0] == "2 []"
    assert not os.path.exists(tmp_path / "o")


def test_torch_names_build_without_importing_transformers():
    probe = ("import sys, torch\n"
             "from raytrain import TrainingArguments, create_optimizer\n"
             "for name in ('adamw_torch_fused', 'sgd', 'adagrad', 'rmsprop'):\n"
             "    create_optimizer(torch.nn.Linear(2, 2), TrainingArguments('o', optim=name, report_to='none'))\n"
             "print('transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_a_layerwise_optimizer_trains_each_parameter_on_its_schedule(tmp_path):
    """GaLore layer-wise: each parameter's optimizer and schedule step in its gradient hook (HF's dummy
    scheduler fails under torch 2.13; raytrain's reports the first parameter's rate)."""
    pytest.importorskip("galore_torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tmp_path, "galore_adamw_layerwise", optim_target_modules="all-linear",
                               optim_args="rank=4", save_strategy="no", eval_strategy="no")
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
    assert all(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    rates = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    assert rates == pytest.approx([0.01 * (8 - s) / 8 for s in range(8)])  # linear, per parameter
    assert {opt.param_groups[0]["lr"] for opt in trainer.optimizer.optimizer_dict.values()} == {0.0}
