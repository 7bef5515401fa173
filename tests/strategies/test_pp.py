"""Pipeline parallelism (parallelism_config.pp_size) on gloo processes, a 4-layer tiny Llama from a config:
pp2 x dp2, pp2 x tp2, pp4 and an interleaved schedule (4 processes), pp2 x dp2 x tp2 (8 processes) do one
process's maths with the same global batch (logged loss, tokens seen, evaluation, predict and
compute_metrics); each rank holds only its stage's layers; a pp2 x dp2 checkpoint resumes under pp2 x dp2
(bit for bit), pp4, dp4, 2x2 and one process, a dp4 checkpoint under pp2 x tp2, one process's under pp2 x
dp2; every layout's final/ loads with from_pretrained; LoRA, activation checkpointing, gradient
accumulation, batches of varying lengths, a Gemma (embeddings scaled) and tied embeddings on the pipeline; the
refusals, one line each. One 4-process launch runs every 4-process layout, and test_tp.py's (conftest.py)."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from raytrain import TrainingArguments
from tests.strategies.test_tp import lm_args, token_rows

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 8
LAYOUTS = {  # name -> (parallelism_config, per-device batch); 4 processes each
    "pp2xdp2": ({"pp_size": 2, "dp_shard_size": 2}, 4),
    "pp2xtp2": ({"pp_size": 2, "tp_size": 2, "pp_schedule": "GPipe"}, 8),
    "pp4": ({"pp_size": 4, "pp_microbatches": 4}, 8),
    "interleaved": ({"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "Interleaved1F1B"}, 4),
    "dp4": ({"dp_shard_size": 4}, 2),
    "2x2": ({"dp_shard_size": 2, "tp_size": 2}, 4),
    "3d": ({"pp_size": 2, "dp_shard_size": 2, "tp_size": 2}, 4),  # 8 processes
}
FRESH = ("pp2xdp2", "pp2xtp2", "pp4", "interleaved", "dp4")
RESUMES = ("pp2xdp2", "pp4", "dp4", "2x2")  # from pp2xdp2's checkpoint-SAVE_AT
#: the parameters each rank holds (pp outermost: ranks 0-1 the first stage under pp2 x dp2 / tp2)
STAGE_LAYERS = {"pp2xdp2": [(0, 1), (0, 1), (2, 3), (2, 3)], "pp4": [(0,), (1,), (2,), (3,)],
                "interleaved": [(0, 2), (0, 2), (1, 3), (1, 3)]}

# One xdist worker runs this module and test_tp.py, so their shared 4-process launch (gloo4) runs once, and after
# or before the session's Ray worker group, never beside it (conftest.py: MULTIPROCESS).
pytestmark = pytest.mark.xdist_group("worker_group")


def tiny_llama(seed: int = 0, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                                        max_position_embeddings=64, tie_word_embeddings=tied))


def tiny_gemma(seed: int = 0):
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(seed)
    return GemmaForCausalLM(GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, vocab_size=128, max_position_embeddings=64,
                                        tie_word_embeddings=False))


def tiny_lora(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(seed), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                       target_modules=["q_proj", "v_proj", "o_proj", "up_proj",
                                                                       "down_proj"]))


def padded_rows() -> dict:
    """token_rows of 6 to 16 tokens, right-padded (mask 0, labels -100): `trim` cuts each batch to its longest."""
    rows = token_rows()
    lengths = np.random.default_rng(1).integers(6, 17, len(rows["input_ids"]))
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.int64)
    return {"input_ids": rows["input_ids"], "attention_mask": mask, "labels": np.where(mask == 1, rows["labels"], -100)}


def trim(features: list) -> dict:
    """A collator padding to the batch's longest row: batches of varying shapes, as a tokenizer's padding makes."""
    batch = {k: torch.as_tensor(np.stack([np.asarray(f[k]) for f in features])) for k in features[0]}
    longest = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :longest] for k, v in batch.items()}


def token_accuracy(prediction) -> dict:
    """compute_metrics: the next token's argmax against the label."""
    logits, labels = prediction.predictions, prediction.label_ids
    hits = logits[:, :-1].argmax(-1) == labels[:, 1:]
    return {"accuracy": float(hits.mean())}


def stage_names(names: list[str], layers: tuple[int, ...], first: bool, last: bool) -> list[str]:
    keep = []
    for name in names:
        parts = name.split(".")
        if "layers" in parts:
            keep += [name] if int(parts[parts.index("layers") + 1]) in layers else []
        elif "embed_tokens" in name:
            keep += [name] if first else []
        else:  # the final norm, the head
            keep += [name] if last else []
    return sorted(keep)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def predict(trainer) -> dict:
    out = trainer.predict(token_rows(12))
    return {"mean": float(np.mean(out.predictions)), "shape": list(out.predictions.shape),
            "labels": out.label_ids.tolist(), "loss": out.metrics["test_loss"]}


def _local_numel(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def rank_runs(root: str, single: str, runs: list) -> dict:
    """On each gloo process (tests/strategies/_gloo.py): `runs` ([(run, layout, resume from, extra args)]); this
    rank's logged losses per run, and for a fresh run its parameter names and elements, tokens seen, evaluation
    and predictions."""
    import torch.distributed as dist

    from raytrain import Trainer
    from raytrain.worker import loop

    world = dist.get_world_size()
    out = {}
    for run, layout, resume, extra in runs:
        parallelism, per_device = LAYOUTS[layout]
        saves = {} if run in FRESH or run == "tied-pp2xdp2" else {"save_strategy": "no"}  # no test reads the others'
        args = lm_args(os.path.join(root, run), parallelism, per_device, workers=world, **saves, **extra)
        if resume is not None:
            resume = os.path.join(single if resume.startswith("single") else root, resume, f"checkpoint-{SAVE_AT}")
        model = tiny_lora() if run.startswith("lora") else tiny_gemma() if run.startswith("gemma") else \
            tiny_llama(tied=run.startswith("tied"))
        data = dict(train_dataset=padded_rows(), data_collator=trim) if run.startswith("pad") else \
            dict(train_dataset=token_rows(), compute_metrics=token_accuracy)
        trainer = Trainer(model, args, **data)
        loop.train(trainer, resume)
        out[run] = _losses(trainer)
        if run.startswith("tied"):  # this rank's shard of the tied weight (the first and the last stage's)
            weight = dict(trainer.model.named_parameters()).get("model.embed_tokens.weight")
            out[f"{run}-tied"] = None if weight is None else \
                (weight.to_local() if hasattr(weight, "to_local") else weight).detach().flatten().tolist()
        if resume is None and not run.startswith(("lora", "ac", "ga", "pad", "gemma")):
            out[f"{run}-names"] = sorted(n for n, _ in trainer.model.named_parameters())
            out[f"{run}-numel"] = _local_numel(trainer.model)
            out[f"{run}-tokens"] = trainer.state.num_input_tokens_seen
            metrics = trainer.evaluate(eval_dataset=token_rows(16))
            out[f"{run}-eval"] = {k: metrics[k] for k in ("eval_loss", "eval_accuracy")}
            out[f"{run}-predict"] = predict(trainer)
            trainer.save_model(os.path.join(root, run, "final"))  # a collective, as at the end of raytrain.run
    return out


#: the 4-process runs: every layout fresh, the resumes across layouts, LoRA, Gemma, tied embeddings, activation
#: checkpointing, gradient accumulation and batches of varying lengths on pp2 x dp2
PIPELINE_RUNS = [(name, name, None, {}) for name in FRESH]
PIPELINE_RUNS += [(f"resume-{name}", name, "pp2xdp2", {}) for name in RESUMES]
PIPELINE_RUNS += [
    ("back-pp2xtp2", "pp2xtp2", "dp4", {}), ("single-pp2xdp2", "pp2xdp2", "single", {}),
    ("lora-pp2xdp2", "pp2xdp2", None, {}), ("gemma-pp2xdp2", "pp2xdp2", None, {}),
    # tied embeddings: fresh, resumed on the same layout, and one process's checkpoint under pp4
    ("tied-pp2xdp2", "pp2xdp2", None, {}), ("tied-resume-pp2xdp2", "pp2xdp2", "tied-pp2xdp2", {}),
    ("tied-single-pp4", "pp4", "single-tied", {}),
    ("ac-pp2xdp2", "pp2xdp2", None, {"activation_checkpointing": True}),
    ("ga-pp2xdp2", "pp2xdp2", None, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}),
    ("pad-pp2xdp2", "pp2xdp2", None, {})]


@pytest.fixture(scope="module")
def one_process(pp_one_process):
    """The reference: one process, the same global batch (and its checkpoint-SAVE_AT, for pp2 x tp2)."""
    return pp_one_process


@pytest.fixture(scope="module")
def pipelines(gloo4):
    """PIPELINE_RUNS on the 4 processes that test_tp.py's layouts share (conftest.py's gloo4)."""
    root, per_rank = gloo4
    return root / "pp", [results["pp"] for results in per_rank]


def _check_run(results: dict, name: str, ref: list[float], single, one) -> None:
    assert results[name] == pytest.approx(ref, abs=1e-5), name
    assert results[f"{name}-tokens"] == single.state.num_input_tokens_seen == STEPS * GLOBAL_BATCH * 16
    ev = results[f"{name}-eval"]
    for key in ("eval_loss", "eval_accuracy"):
        assert ev[key] == pytest.approx(one["eval"][key], abs=1e-5), (name, key)
    pred, ref_pred = results[f"{name}-predict"], one["predict"]
    assert pred["shape"] == ref_pred["shape"] and pred["labels"] == ref_pred["labels"]
    assert pred["mean"] == pytest.approx(ref_pred["mean"], abs=1e-5) and pred["loss"] == pytest.approx(ref_pred["loss"], abs=1e-5)


@pytest.mark.timeout(600)
def test_pipelines_match_one_process_and_resume_across_layouts(pipelines, one_process):
    from raytrain import Trainer

    root, per_rank = pipelines
    single, one = one_process[1]["single"], one_process[1]
    ref = _losses(single)
    assert len(ref) == STEPS and ref[-1] < ref[0]
    for results in per_rank[1:]:  # every rank logs the loss of the whole global batch, and evaluates alike
        assert {k: v for k, v in results.items() if not k.endswith(("-names", "-numel", "-tied"))} == \
            {k: v for k, v in per_rank[0].items() if not k.endswith(("-names", "-numel", "-tied"))}
    results = per_rank[0]
    for name in FRESH:
        _check_run(results, name, ref, single, one)
    # each rank holds its stages' parameters only: names, and numbers of elements (memory) fall with pp
    whole = sorted(n for n, _ in tiny_llama().named_parameters())
    full = sum(p.numel() for p in tiny_llama().parameters())
    for name, layers in STAGE_LAYERS.items():
        for rank, own in enumerate(layers):
            expected = stage_names(whole, own, first=0 in own, last=3 in own)
            assert per_rank[rank][f"{name}-names"] == expected, (name, rank)
    assert max(r["pp4-numel"] for r in per_rank) < full / 2 and max(r["pp2xdp2-numel"] for r in per_rank) < full / 2
    # 2 x dp2 -> itself is the same maths: bit for bit; other layouts within float tolerance
    assert results["resume-pp2xdp2"] == results["pp2xdp2"]
    for name in RESUMES:
        assert results[f"resume-{name}"] == pytest.approx(ref, abs=1e-5), name
    assert results["back-pp2xtp2"] == pytest.approx(ref, abs=1e-5)  # a dp4 checkpoint, pipelined
    assert results["single-pp2xdp2"] == pytest.approx(ref, abs=1e-5)  # one process's optimizer.pt, by stage
    resumed = Trainer(tiny_llama(), lm_args(str(one_process[0] / "resumed")), train_dataset=token_rows())
    resumed.train(resume_from_checkpoint=str(root / "pp2xdp2" / f"checkpoint-{SAVE_AT}"))
    assert _losses(resumed) == pytest.approx(ref, abs=1e-5)

    lora = _losses(one["lora"])  # LoRA on the pipelined model; activation checkpointing: the same maths
    assert lora[-1] < lora[0] and results["lora-pp2xdp2"] == pytest.approx(lora, abs=1e-5)
    assert results["ac-pp2xdp2"] == pytest.approx(ref, abs=1e-5)
    gemma = _losses(one["gemma"])  # its embedding module scales (sqrt(hidden_size)): once, on the first stage
    assert gemma[-1] < gemma[0] and results["gemma-pp2xdp2"] == pytest.approx(gemma, abs=1e-5)
    assert results["ga-pp2xdp2"] == pytest.approx(ref, abs=1e-5)  # 2 accumulated steps of 2 microbatches
    # batches of varying lengths, different on the two data-parallel ranks: each new shape sets up its schedule
    padded = _losses(one["pad"])
    assert padded[-1] < padded[0] and results["pad-pp2xdp2"] == pytest.approx(padded, abs=1e-5)

    manifest = json.loads((root / "pp2xdp2" / f"checkpoint-{SAVE_AT}" / "manifest.json").read_text())
    assert manifest["parallelism"] == {"pp_size": 2, "dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 1,
                                       "pp_schedule": "1F1B", "pp_stages": 2}


def test_every_pipelined_layout_saves_what_from_pretrained_loads(pipelines, one_process):
    from transformers import LlamaForCausalLM

    root, _ = pipelines
    ref = one_process[1]["single"].model.state_dict()
    for name, folder in [(n, f) for n in FRESH for f in (f"checkpoint-{STEPS}", "final")]:
        model, info = LlamaForCausalLM.from_pretrained(str(root / name / folder), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, ref[key], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(600)
def test_tied_embeddings_live_on_the_first_and_last_stages_and_resume_on_any_layout(pipelines, one_process):
    """tie_word_embeddings: the first stage's embedding and the last stage's head hold the weight under the model's
    own name, their gradients summed before each update and counted once in the norm: one process's losses within
    1e-5 and the two ends' shards equal after the last update; the checkpoint resumes bit for bit under pp2 x dp2
    and in one process, one process's resumes under pp4; final/ loads tied with from_pretrained, nothing missing."""
    from transformers import LlamaForCausalLM

    from raytrain import Trainer

    root, per_rank = pipelines
    one = one_process[1]["single-tied"]
    ref = _losses(one)
    assert len(ref) == STEPS and ref[-1] < ref[0] and ref != _losses(one_process[1]["single"])
    results = per_rank[0]
    assert results["tied-pp2xdp2"] == pytest.approx(ref, abs=1e-5)
    # pp2 x dp2: ranks 0-1 the first stage, 2-3 the last, rank r and r + 2 holding the same shard
    ends = [per_rank[r]["tied-pp2xdp2-tied"] for r in range(4)]
    assert ends[0] == ends[2] and ends[1] == ends[3] and ends[0] != ends[1]
    pp4 = [per_rank[r]["tied-single-pp4-tied"] for r in range(4)]
    assert pp4[1] is None and pp4[2] is None and pp4[0] == pp4[3]
    assert results["tied-resume-pp2xdp2"] == results["tied-pp2xdp2"]  # the same layout: bit for bit
    assert results["tied-single-pp4"] == pytest.approx(ref, abs=1e-5)  # one process's optimizer.pt, by stage
    resumed = Trainer(tiny_llama(tied=True), lm_args(str(one_process[0] / "tied-resumed")), train_dataset=token_rows())
    resumed.train(resume_from_checkpoint=str(root / "tied-pp2xdp2" / f"checkpoint-{SAVE_AT}"))
    assert _losses(resumed) == pytest.approx(ref, abs=1e-5)
    want = one.model.state_dict()
    for folder in (f"checkpoint-{STEPS}", "final"):
        model, info = LlamaForCausalLM.from_pretrained(str(root / "tied-pp2xdp2" / folder), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (folder, info)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(600)
def test_pp2_dp2_tp2_on_8_processes_matches_one_process(tmp_path, one_process):
    from tests.strategies._gloo import launch

    per_rank = [r["pp"] for r in launch(tmp_path, 8, {"pp": ("tests.strategies.test_pp:rank_runs", {
        "root": str(tmp_path), "single": str(one_process[0]), "runs": [("3d", "3d", None, {})]})})]
    single, one = one_process[1]["single"], one_process[1]
    for results in per_rank:
        _check_run(results, "3d", _losses(single), single, one)
    whole = sorted(n for n, _ in tiny_llama().named_parameters())
    for rank, results in enumerate(per_rank):  # pp outermost: ranks 0-3 the first stage
        assert results["3d-names"] == stage_names(whole, (0, 1) if rank < 4 else (2, 3), rank < 4, rank >= 4)
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(str(tmp_path / "3d" / "final"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, single.model.state_dict()[key], rtol=1e-4, atol=1e-5)


def _args(tmp_path, config, **kw):
    return dict(output_dir=str(tmp_path), max_steps=1, scaling={"num_workers": 4}, parallelism_config=config, **kw)


@pytest.mark.parametrize("config, overrides, message", [
    ({"pp_size": 3}, {}, "parallelism_config: pp_size 3 x dp_replicate_size 1 x tp_size 1 must divide the world size "
                         "(scaling.num_workers) 4"),
    ({"pp_size": 2, "dp_shard_size": 4}, {}, "parallelism_config: pp_size 2 x dp_replicate_size 1 x dp_shard_size 4 "
                                             "x tp_size 1 = 8 must equal the world size (scaling.num_workers) 4"),
    ({"pp_size": 2}, {"distributed": {"strategy": "ddp"}}, "parallelism_config.pp_size: pipeline stages need "
                                                             "distributed.strategy fsdp (or auto), not ddp"),
    ({"pp_size": 2}, {"distributed": {"strategy": "deepspeed"}}, "need distributed.strategy fsdp (or auto), not "
                                                                   "deepspeed"),
    ({"pp_size": 2}, {"scaling": {"num_workers": [2, 4]}}, "parallelism_config.pp_size: 2 with an elastic "
                                                            "scaling.num_workers range is not supported"),
    ({"pp_size": 2, "pp_microbatches": 3}, {"per_device_train_batch_size": 4},
     "parallelism_config.pp_microbatches: 3 must divide the per-rank batch (per_device_train_batch_size) 4"),
    ({"pp_size": 4}, {"per_device_train_batch_size": 2},
     "parallelism_config.pp_microbatches: 1F1B needs at least one microbatch per stage (4 stages), got 2"),
    ({"pp_size": 2, "pp_schedule": "zigzag"}, {}, "parallelism_config.pp_schedule: one of 1F1B, GPipe, "
                                                  "Interleaved1F1B"),
    ({"pp_size": 0}, {}, "parallelism_config.pp_size: an integer >= 1, got 0"),
])
def test_wrong_pipelines_are_refused_in_one_line(tmp_path, config, overrides, message):
    with pytest.raises(ValueError) as e:
        TrainingArguments(**{**_args(tmp_path, config), **overrides})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_models_that_cannot_be_split_are_refused_before_any_worker_starts(tmp_path):
    """Checked on the driver by Trainer.train (and again by each worker's strategy), in one line."""
    from transformers import GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from raytrain import Trainer
    from raytrain.config.args import ConfigError
    from tests.strategies._helpers import digits_model

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=128)

    args = TrainingArguments(**_args(tmp_path, {"pp_size": 4}))
    assert args.distributed.strategy == "fsdp" and args.parallelism_config["pp_schedule"] == "1F1B"
    (tmp_path / "run.yaml").write_text(f"output_dir: {tmp_path}\nmax_steps: 1\nscaling: {{num_workers: 4}}\n")
    args = TrainingArguments.from_yaml(tmp_path / "run.yaml", ["parallelism_config.pp_size=2",
                                                                "parallelism_config.pp_schedule=gpipe"])
    assert (args.parallelism_config["pp_size"], args.parallelism_config["pp_schedule"]) == (2, "GPipe")
    cases = [
        (tiny_llama(), {"pp_size": 2, "pp_schedule": "interleaved1f1b"}, None),  # 4 stages, 4 layers: fits
        (LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=128)), {"pp_size": 4},
         "parallelism_config.pp_size: 4 pipeline stages but LlamaForCausalLM has 2 decoder layers; every stage needs "
         "at least one"),
        (tiny_llama(), {"pp_size": 4, "pp_schedule": "Interleaved1F1B"},
         "parallelism_config.pp_size: 8 pipeline stages (2 per rank, Interleaved1F1B) but LlamaForCausalLM has 4"),
        (digits_model(), {"pp_size": 2}, "parallelism_config.pp_size: DigitsMLP cannot be split into pipeline "
                                         "stages: raytrain needs a base model (base_model_prefix) whose decoder layers "
                                         "are an nn.ModuleList"),
        (LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=128, tie_word_embeddings=True)), {"pp_size": 2, "tp_size": 2},
         "parallelism_config.pp_size: LlamaForCausalLM ties its input and output embeddings (tie_word_embeddings), "
         "which raytrain does not split over TP and pipeline stages at once; use tp_size 1"),
        (tiny_llama(tied=True), {"pp_size": 2}, None),  # tied, without TP: the first and last stages share it
        # Gemma scales its embeddings inside embed_tokens (the first stage's): it splits
        (GemmaForCausalLM(GemmaConfig(**small, head_dim=8, tie_word_embeddings=False)), {"pp_size": 2}, None),
        (_scaled_llama(), {"pp_size": 2}, "parallelism_config.pp_size: LlamaForCausalLM's base model scales "
                                          "inputs_embeds by 2 before its first decoder layer, so the stages after the "
                                          "first cannot run it from the previous stage's hidden states"),
        (GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, tie_word_embeddings=False)),
         {"pp_size": 2}, "parallelism_config.pp_size: GPT2LMHeadModel's base model does not run from inputs_embeds "
                         "without the first stage's modules (RuntimeError: "),
    ]
    for model, config, message in cases:
        trainer = Trainer(model, TrainingArguments(**_args(tmp_path, config, per_device_train_batch_size=8)),
                          train_dataset=token_rows())
        if message is None:
            model.train()
            rng = torch.random.get_rng_state()
            trainer._check_pipeline()  # probing the forward draws no RNG and leaves every module training
            assert torch.equal(rng, torch.random.get_rng_state()) and all(m.training for m in model.modules())
            continue
        with pytest.raises(ConfigError) as e:  # the CLI's exit 2
            trainer.train()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def _scaled_llama():
    """A Llama whose base forward scales inputs_embeds (as Gemma 1 and 2 did before transformers moved it into
    their embedding module)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    class ScaledLlamaModel(LlamaModel):
        def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            return super().forward(inputs_embeds=inputs_embeds * 2, **kwargs)

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         vocab_size=128))
    model.model.__class__ = ScaledLlamaModel
    return model


def test_the_split_follows_the_plan_or_else_the_layer_list():
    from raytrain.strategies.mesh import ParallelDims
    from raytrain.strategies.pipeline import Absent, Pipeline, Split

    planned, unplanned = tiny_llama(), tiny_llama()
    unplanned.config.base_model_pp_plan = None  # the base model's children in order instead
    for model in (planned, unplanned):
        split = Split(model)
        assert (split.first, split.layers, split.last, split.head) == (["embed_tokens"], "layers", ["norm"], ["lm_head"])
        assert split.bounds(3) == [(0, 2), (2, 3), (3, 4)]  # the first stages take the extra layer
    whole = sorted(n for n, _ in planned.named_parameters())
    pipeline = Pipeline(planned, ParallelDims.resolve({"pp_size": 2, "dp_shard_size": 1}, 2), 1, 4)
    assert sorted(n for n, _ in planned.named_parameters()) == stage_names(whole, (2, 3), False, True)
    assert isinstance(planned.model.embed_tokens, Absent) and not isinstance(planned.model.rotary_emb, Absent)
    assert (pipeline.stage_ids, pipeline.has_first, pipeline.has_last) == ((1,), False, True)


def test_a_pipelined_trainer_with_its_own_compute_loss_is_refused(tmp_path):
    from raytrain import Trainer

    class Custom(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Custom(tiny_llama(), lm_args(str(tmp_path)), train_dataset=token_rows())
    trainer.get_strategy().pipeline = object()  # as a pipelined strategy after setup
    with pytest.raises(ValueError, match=r"^parallelism_config.pp_size: Custom overrides compute_loss, which "
                                         r"pipeline stages cannot run .*; pass compute_loss_func instead"):
        trainer.training_step(trainer.model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})


@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.long  # ~2 min: by default pp2 x dp2 resumes bit-exact in the spawned runs, a Ray SIGKILL in test_launch
def test_ray_pp2_dp2_worker_sigkilled_resumes_bit_exactly(ray_cluster, pipelines, tmp_path):
    """4 Ray workers as pp2 x dp2; rank 2 (a last-stage rank) is SIGKILLed after step SAVE_AT + 2: Ray restarts the
    group from checkpoint-SAVE_AT, which ends where the uninterrupted spawned run ended, bit for bit."""
    from raytrain import Trainer, load_weights
    from tests.strategies._helpers import FaultInjector

    root, per_rank = pipelines
    parallelism, per_device = LAYOUTS["pp2xdp2"]
    out = tmp_path / "out"
    args = lm_args(str(out), parallelism, per_device, workers=4,
                   scaling={"num_workers": 4, "storage_path": str(tmp_path / "ray"), "max_failures": 1,
                            "resources_per_worker": {"CPU": 1}})
    trainer = Trainer(tiny_llama(), args, train_dataset=token_rows(),
                      callbacks=[FaultInjector(2, SAVE_AT + 2, signal.SIGKILL)])
    assert trainer.train().global_step == STEPS
    assert [int(s) for s in (out / "starts.txt").read_text().split()] == [0, SAVE_AT]
    ours, ref = load_weights(str(out / f"checkpoint-{STEPS}")), load_weights(str(root / "pp2xdp2" / f"checkpoint-{STEPS}"))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert _losses(trainer) == per_rank[0]["pp2xdp2"]
