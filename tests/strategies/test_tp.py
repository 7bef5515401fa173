"""Tensor and 2-D parallelism (parallelism_config) on 4 gloo processes, a tiny Llama from a config: 2x2
(FSDP2 x TP), dp4 and tp4 do one process's maths with the same global batch; a checkpoint written under
2x2 resumes under 2x2 (bit for bit), dp4, tp4 and one process; every layout's checkpoint loads with
from_pretrained; wrong layouts are refused in one line. One 4-process launch runs every layout, and
test_pp.py's (conftest.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from raytrain import TrainingArguments

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 8
LAYOUTS = {  # name -> (parallelism_config, per-device batch); 4 processes each
    "2x2": ({"dp_shard_size": 2, "tp_size": 2}, 4),
    "dp4": ({"dp_shard_size": 4}, 2),
    "tp4": ({"tp_size": 4}, 8),
    "hsdp": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 2),  # FSDP2 pairs, replicated
}
RESUMES = ("2x2", "dp4", "tp4")  # from 2x2's checkpoint-SAVE_AT
BACK = ("dp4", "tp4", "single")  # 2x2 resumes from these layouts' checkpoint-SAVE_AT

# One xdist worker runs this module and test_pp.py, so their shared 4-process launch (gloo4) runs once, and after
# or before the session's Ray worker group, never beside it (conftest.py: MULTIPROCESS).
pytestmark = pytest.mark.xdist_group("worker_group")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                                        max_position_embeddings=64))


def tiny_lora(seed: int = 0):
    """LoRA on every planned kind of layer: colwise (q, v, up) and rowwise (o, down)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(seed), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                       target_modules=["q_proj", "v_proj", "o_proj", "up_proj",
                                                                       "down_proj"]))


#: A model with no plan of its own (the digits MLP, LayerNorms between its Linears): a plan by name.
MLP_PLAN = {"body.0": "colwise_gather_output", "body.4": "colwise_gather_output", "head": "replicate"}  # 10 classes


def mlp_run(output_dir: str, workers: int = 1):
    from raytrain import Trainer
    from tests.strategies._helpers import digits_model

    rng = np.random.default_rng(0)
    pixels = rng.random((STEPS * 32, 64), dtype=np.float32)
    rows = {"pixels": pixels, "labels": pixels[:, :10].argmax(1)}  # learnable
    args = lm_args(output_dir, {"tp_size": 4} if workers > 1 else None, 32, workers=workers, tp_plan=MLP_PLAN,
                   include_num_input_tokens_seen="no", save_strategy="no")
    return Trainer(digits_model(), args, train_dataset=rows)


def token_rows(n: int = STEPS * GLOBAL_BATCH, length: int = 16) -> dict:
    """Counting sequences (random start and stride): something to learn in STEPS steps."""
    rng = np.random.default_rng(0)
    ids = (rng.integers(0, 128, (n, 1)) + rng.integers(1, 4, (n, 1)) * np.arange(length)) % 128
    return {"input_ids": ids, "labels": ids.copy()}


def lm_args(output_dir: str, parallelism=None, per_device: int = GLOBAL_BATCH, workers: int = 1, **kw):
    base = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=per_device,
                learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1, save_steps=SAVE_AT, seed=3,
                disable_tqdm=True, report_to="none", scaling={"num_workers": workers},
                include_num_input_tokens_seen="all",
                parallelism_config=parallelism)
    if parallelism is not None:
        base["distributed"] = {"strategy": "fsdp"}
    return TrainingArguments(**{**base, **kw})


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def rank_runs(root: str, single: str) -> dict:
    """On each of 4 gloo processes (tests/strategies/_gloo.py): every layout, the resumes across layouts, LoRA and
    the MLP's tp_plan by name; this rank's logged losses (and tokens seen, evaluation) per run."""
    from raytrain import Trainer
    from raytrain.worker import loop

    runs = [(name, name, None) for name in LAYOUTS]
    first = os.path.join(root, "2x2", f"checkpoint-{SAVE_AT}")
    runs += [(f"resume-{name}", name, first) for name in RESUMES]
    runs += [(f"back-{name}", "2x2", os.path.join(single if name == "single" else os.path.join(root, name),
                                                  f"checkpoint-{SAVE_AT}")) for name in BACK]
    runs.append(("lora-2x2", "2x2", None))
    out = {}
    for run, layout, resume in runs:
        parallelism, per_device = LAYOUTS[layout]
        args = lm_args(os.path.join(root, run), parallelism, per_device, workers=4,  # no test reads the others' saves
                       **({} if run in LAYOUTS else {"save_strategy": "no"}))
        trainer = Trainer(tiny_lora() if run.startswith("lora") else tiny_llama(), args, train_dataset=token_rows())
        loop.train(trainer, resume)
        out[run] = _losses(trainer)
        if run in LAYOUTS:
            trainer.save_model(os.path.join(root, run, "final"))  # a collective, as at the end of raytrain.run
            out[f"{run}-tokens"] = trainer.state.num_input_tokens_seen
            out[f"{run}-eval"] = trainer.evaluate(eval_dataset=token_rows(16))["eval_loss"]
    trainer = mlp_run(os.path.join(root, "mlp-tp4"), workers=4)
    loop.train(trainer, None)
    out["mlp-tp4"] = _losses(trainer)
    return out


@pytest.fixture(scope="module")
def layouts(gloo4):
    """rank_runs on the 4 processes that test_pp.py's pipelines share (conftest.py's gloo4)."""
    root, per_rank = gloo4
    return root / "tp", [results["tp"] for results in per_rank]


@pytest.fixture(scope="module")
def one_process(tp_one_process):
    """The reference: one process, the same global batch; and the 2x2 checkpoint resumed in one process."""
    return tp_one_process


@pytest.mark.timeout(400)
def test_layouts_match_one_process_and_resume_across_layouts(layouts, one_process):
    from raytrain import Trainer

    root, per_rank = layouts
    ref = _losses(one_process[1])
    assert len(ref) == STEPS and ref[-1] < ref[0]
    for results in per_rank:  # every rank logs the loss of the whole global batch
        assert results == per_rank[0]
    results = per_rank[0]
    single = one_process[1]
    eval_loss = single.evaluate(eval_dataset=token_rows(16))["eval_loss"]
    for name in LAYOUTS:  # the logged loss, tokens seen and evaluation: reduced over data-parallel ranks only
        assert results[name] == pytest.approx(ref, abs=1e-5), name
        assert results[f"{name}-tokens"] == single.state.num_input_tokens_seen == STEPS * GLOBAL_BATCH * 16
        assert results[f"{name}-eval"] == pytest.approx(eval_loss, abs=1e-5), name
    # (a resumed run's history starts with the checkpoint's.) 2x2 -> 2x2 is the same maths: bit for bit;
    # other layouts within float tolerance
    assert results["resume-2x2"] == results["2x2"]
    for name in RESUMES:
        assert results[f"resume-{name}"] == pytest.approx(ref, abs=1e-5), name
    for name in BACK:  # and back: 2x2 from dp4's, tp4's and one process's checkpoint
        assert results[f"back-{name}"] == pytest.approx(ref, abs=1e-5), name
    single = Trainer(tiny_llama(), lm_args(str(one_process[0] / "resumed")), train_dataset=token_rows())
    single.train(resume_from_checkpoint=str(root / "2x2" / f"checkpoint-{SAVE_AT}"))
    assert _losses(single) == pytest.approx(ref, abs=1e-5)

    lora = _losses(one_process[1].lora)  # LoRA on the TP model: the adapter's parts split or whole as planned
    assert lora[-1] < lora[0] and results["lora-2x2"] == pytest.approx(lora, abs=1e-5)

    mlp = _losses(one_process[1].mlp)  # tp_plan by name for a model without one
    assert mlp[-1] < mlp[0] and results["mlp-tp4"] == pytest.approx(mlp, abs=1e-5)

    manifest = json.loads((root / "2x2" / f"checkpoint-{SAVE_AT}" / "manifest.json").read_text())
    assert manifest["parallelism"] == {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2}
    assert manifest["world_size"] == 4


def test_every_layout_saves_what_from_pretrained_loads(layouts, one_process):
    from transformers import LlamaForCausalLM

    root, _ = layouts
    ref = one_process[1].model.state_dict()
    for name, folder in [(n, f) for n in LAYOUTS for f in (f"checkpoint-{STEPS}", "final")]:
        model, info = LlamaForCausalLM.from_pretrained(str(root / name / folder), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, ref[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config, overrides, message", [
    ({"dp_shard_size": 3, "tp_size": 2}, {}, "parallelism_config: dp_replicate_size 1 x dp_shard_size 3 x tp_size 2 = 6 "
                                             "must equal the world size (scaling.num_workers) 4"),
    ({"tp_size": 3}, {}, "parallelism_config: dp_replicate_size 1 x tp_size 3 must divide the world size"),
    ({"tp_size": 2, "cp_size": 2}, {}, "parallelism_config.cp_size: context parallelism needs CUDA"),
    ({"tp_size": 2, "ep_size": 2}, {}, "parallelism_config: unknown field(s) ['ep_size']"),
    ({"sp_size": 2, "tp_size": 2}, {}, "parallelism_config.sp_size: 2 composes with data parallelism"),
    ({"tp_size": 0}, {}, "parallelism_config.tp_size: an integer >= 1, got 0"),
    ({"tp_size": 2}, {"distributed": {"strategy": "deepspeed"}}, "need distributed.strategy fsdp (FSDP2), not deepspeed"),
    ({"tp_size": 2}, {"distributed": {"strategy": "ddp"}}, "need distributed.strategy fsdp (or auto), not ddp"),
    ({"tp_size": 2}, {"scaling": {"num_workers": [2, 4]}}, "parallelism_config.tp_size: 2 with an elastic"),
])
def test_wrong_layouts_are_refused_in_one_line(tmp_path, config, overrides, message):
    kw = {"output_dir": str(tmp_path), "max_steps": 1, "scaling": {"num_workers": 4}, "parallelism_config": config,
          **overrides}
    with pytest.raises(ValueError) as e:
        TrainingArguments(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_auto_picks_fsdp_and_a_parallelism_config_object_is_read_by_attribute(tmp_path):
    class ParallelismConfig:  # accelerate's, duck-typed
        dp_replicate_size, dp_shard_size, tp_size, cp_size = 1, 2, 2, 1

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, scaling={"num_workers": 4},
                             parallelism_config=ParallelismConfig())
    assert args.parallelism_config == {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2, "cp_size": 1}
    assert args.distributed.strategy == "fsdp"
    (tmp_path / "run.yaml").write_text(f"output_dir: {tmp_path}\nmax_steps: 1\nscaling: {{num_workers: 4}}\n")
    args = TrainingArguments.from_yaml(tmp_path / "run.yaml", ["parallelism_config.tp_size=2"])
    assert args.parallelism_config["tp_size"] == 2 and args.distributed.strategy == "fsdp"
    accelerate = pytest.importorskip("accelerate")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, scaling={"num_workers": 4},
                             parallelism_config=accelerate.ParallelismConfig(dp_shard_size=2, tp_size=2))
    assert args.parallelism_config == {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2, "cp_size": 1}


def test_tp_plan_errors_name_the_option():
    from raytrain.strategies import tp

    with pytest.raises(ValueError, match=r"^tp_plan: Sequential has no tensor-parallel plan"):
        tp.model_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), "auto")
    with pytest.raises(ValueError, match=r"^tp_plan: unsupported style"):
        tp.model_plan(torch.nn.Sequential(), {"0": "diagonal"})
    model = tiny_llama()
    modules = tp.resolve(model, tp.model_plan(model, "auto"))
    assert modules["model.layers.1.self_attn.q_proj"] == "colwise" and modules["lm_head"] == "colwise_gather_output"
    with pytest.raises(ValueError, match=r"^parallelism_config.tp_size: 3 must divide the model's num_attention_heads"):
        tp.check_divisible(model, modules, 3)


@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.long  # ~100 s: by default 2x2 resumes bit-exact in the spawned runs, a Ray worker's SIGKILL in test_launch
def test_ray_2x2_worker_sigkilled_resumes_bit_exactly(ray_cluster, layouts, tmp_path):
    """4 Ray workers as 2x2; rank 1 is SIGKILLed after step SAVE_AT + 2: Ray restarts the group from
    checkpoint-SAVE_AT, which ends where the uninterrupted 2x2 run (the spawned one) ended, bit for bit."""
    import signal

    from raytrain import Trainer, load_weights
    from tests.strategies._helpers import FaultInjector

    root, per_rank = layouts
    parallelism, per_device = LAYOUTS["2x2"]
    out = tmp_path / "out"
    args = lm_args(str(out), parallelism, per_device, workers=4,
                   scaling={"num_workers": 4, "storage_path": str(tmp_path / "ray"), "max_failures": 1,
                            "resources_per_worker": {"CPU": 1}})
    trainer = Trainer(tiny_llama(), args, train_dataset=token_rows(),
                      callbacks=[FaultInjector(1, SAVE_AT + 2, signal.SIGKILL)])
    assert trainer.train().global_step == STEPS
    assert [int(s) for s in (out / "starts.txt").read_text().split()] == [0, SAVE_AT]
    ours, ref = load_weights(str(out / f"checkpoint-{STEPS}")), load_weights(str(root / "2x2" / f"checkpoint-{STEPS}"))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert _losses(trainer) == per_rank[0]["2x2"]


def test_the_world_size_at_setup_and_the_node_size_are_checked_again():
    from raytrain.strategies.mesh import ParallelDims

    dims = ParallelDims.resolve({"dp_shard_size": -1, "tp_size": 2}, 8)
    assert (dims.dp_shard, dims.dp, dims.dp_rank(5), dims.tp_rank(5)) == (4, 4, 2, 1)
    with pytest.raises(ValueError, match=r"^parallelism_config: dp_replicate_size 1 x dp_shard_size 2 x tp_size 2 = 4 "
                                         r"must equal the world size \(scaling.num_workers\) 2$"):
        ParallelDims.resolve({"dp_shard_size": 2, "tp_size": 2}, 2)
    with pytest.raises(ValueError, match=r"^parallelism_config.tp_size: 4 must divide the workers per node \(2\)"):
        ParallelDims.resolve({"tp_size": 4}, 4).check_local(2)
