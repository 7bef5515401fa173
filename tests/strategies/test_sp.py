"""Sequence parallelism (parallelism_config.sp_size, DeepSpeed's Ulysses) on 4 gloo processes, a tiny Llama (4 heads,
2 kv heads) at 256 tokens: sp2 x dp2 on ZeRO-2 and sp4 on FSDP2 (eager attention, kv heads replicated) do one
process's maths with the same global batch (losses, tokens seen, evaluation), each rank's attention module seeing
256 / sp_size tokens; so do sp2 x dp2 on DDP, ZeRO-1 with gradient accumulation and activation checkpointing,
ZeRO-3 with LoRA, and TRL's SFTTrainer with packing (position ids restart per document). Checkpoints move: sp2 x
dp2 resumes under sp2 x dp2 (bit for bit) and dp4, and back; a DDP one in one process, and back; every layout's
loads with from_pretrained. The refusals, one line each. One 4-process launch runs every layout."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from raytrain import TrainingArguments
from tests.strategies._gloo import free_port, start

STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 10, 5, 4, 256
SP2 = {"sp_size": 2, "sp_backend": "deepspeed"}
LAYOUTS = {"sp2xdp2": (SP2, 2), "sp4": ({"sp_size": 4}, 4), "dp4": (None, 1)}  # (parallelism_config, per device)
ZERO = {n: {"strategy": "deepspeed", "deepspeed": {"zero_optimization": {"stage": n}}} for n in (1, 2, 3)}
#: name -> (layout, distributed, resumed from, model, extra arguments); one 4-process launch runs them in order
RUNS = {
    "z2": ("sp2xdp2", ZERO[2], None, "llama", {}),
    "z2-again": ("sp2xdp2", ZERO[2], "z2", "llama", {}),
    "z2-dp4": ("dp4", ZERO[2], None, "llama", {}),
    "z2-dp4-from-sp": ("dp4", ZERO[2], "z2", "llama", {}),
    "z2-sp-from-dp4": ("sp2xdp2", ZERO[2], "z2-dp4", "llama", {}),
    "fsdp-sp4": ("sp4", {"strategy": "fsdp"}, None, "eager", {}),
    "ddp": ("sp2xdp2", {"strategy": "ddp"}, None, "llama", {}),
    "ddp-from-single": ("sp2xdp2", {"strategy": "ddp"}, "single", "llama", {}),
    "z1-ga-ac": ("sp2xdp2", ZERO[1], None, "llama", {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
                                                     "activation_checkpointing": True, "save_strategy": "no"}),
    "z3-lora": ("sp2xdp2", ZERO[3], None, "lora", {"save_strategy": "no"}),
    "sft": ("sp2xdp2", ZERO[2], None, "sft", {}),
}
FRESH = ("z2", "fsdp-sp4", "ddp")  # evaluated, final/ saved, attention shapes recorded

# Its 4-process launch runs in the xdist worker of the other multi-process launches, one after the other
# (conftest.py: MULTIPROCESS).
pytestmark = pytest.mark.xdist_group("worker_group")


def tiny_llama(seed: int = 0, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=2 * SEQ,
                                        attn_implementation=attn))


def tiny_lora(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(seed), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                       target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))


def token_rows(n: int = STEPS * GLOBAL_BATCH, length: int = SEQ) -> dict:
    """Counting sequences (random start and stride): something to learn in 10 steps."""
    rng = np.random.default_rng(0)
    ids = (rng.integers(0, 128, (n, 1)) + rng.integers(1, 4, (n, 1)) * np.arange(length)) % 128
    return {"input_ids": ids, "labels": ids.copy()}


def lm_args(output_dir: str, layout: str = "single", distributed: dict | None = None, **kw) -> TrainingArguments:
    parallelism, per_device = LAYOUTS.get(layout, (None, GLOBAL_BATCH))
    workers = 1 if layout == "single" else 4
    base = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=per_device, learning_rate=3e-3,
                max_grad_norm=1.0, logging_steps=1, save_steps=SAVE_AT, seed=3, disable_tqdm=True, report_to="none",
                scaling={"num_workers": workers}, include_num_input_tokens_seen="all", parallelism_config=parallelism)
    if distributed is not None:
        base["distributed"] = distributed
    return TrainingArguments(**{**base, **kw})


def sft_trainer(output_dir: str, layout: str = "single", distributed: dict | None = None, **kw):
    """TRL's SFT with bfd packing (padding-free rows, position ids restarting per conversation), padded to a
    multiple of 4 tokens."""
    from datasets import Dataset

    from examples.sft import build_model, build_tokenizer, conversations
    from raytrain.trl import SFTConfig, SFTTrainer

    parallelism, per_device = LAYOUTS.get(layout, (None, GLOBAL_BATCH))
    extra = {} if layout == "single" else {"scaling": {"num_workers": 4}, "parallelism_config": parallelism,
                                           "distributed": distributed}
    args = SFTConfig(output_dir, max_steps=STEPS, per_device_train_batch_size=per_device, logging_steps=1,
                     learning_rate=1e-2, max_length=128, packing=True, pad_to_multiple_of=4, report_to="none",
                     save_strategy="no", seed=0, bf16=False, disable_tqdm=True, use_cpu=True, **extra, **kw)
    return SFTTrainer(model=build_model(), args=args, train_dataset=Dataset.from_list(conversations(48)),
                      processing_class=build_tokenizer())


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _attention_lengths(model) -> list[int]:
    """The tokens each training forward hands the first attention module (a forward pre-hook)."""
    seen: list[int] = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def hook(module, args, kwargs):
        if module.training:
            seen.append((kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]).shape[1])

    base.model.layers[0].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _rank(rank: int, root: str, port: int, single: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from raytrain import Trainer
    from raytrain.worker import loop

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    out = {}
    for run, (layout, distributed, resume, model, extra) in RUNS.items():
        if resume is not None:
            resume = os.path.join(single if resume == "single" else os.path.join(root, resume), f"checkpoint-{SAVE_AT}")
        if model == "sft":
            trainer = sft_trainer(os.path.join(root, run), layout, distributed, **extra)
        else:
            net = tiny_lora() if model == "lora" else tiny_llama(attn="eager" if model == "eager" else "sdpa")
            trainer = Trainer(net, lm_args(os.path.join(root, run), layout, distributed, **extra),
                              train_dataset=token_rows())
        seen = _attention_lengths(trainer.model)
        loop.train(trainer, resume)
        out[run] = _losses(trainer)
        if run in FRESH:
            out[f"{run}-seen"] = sorted(set(seen))
            out[f"{run}-tokens"] = trainer.state.num_input_tokens_seen
            out[f"{run}-eval"] = trainer.evaluate(eval_dataset=token_rows(8))["eval_loss"]
            trainer.save_model(os.path.join(root, run, "final"))  # a collective, as at the end of raytrain.run
    dist.destroy_process_group()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """The references: one process, the same global batch (its checkpoint-5 resumed under sp2 x dp2)."""
    from raytrain import Trainer

    root = tmp_path_factory.mktemp("sp1")
    out = {}
    for name, model in (("single", tiny_llama()), ("eager", tiny_llama(attn="eager")), ("lora", tiny_lora())):
        trainer = Trainer(model, lm_args(str(root / name), save_strategy="steps" if name == "single" else "no"),
                          train_dataset=token_rows())
        trainer.train()
        out[name] = trainer
    out["eval"] = out["single"].evaluate(eval_dataset=token_rows(8))["eval_loss"]
    out["sft"] = sft_trainer(str(root / "sft"))
    out["sft"].train()
    return root, out


@pytest.fixture(scope="session")
def layouts(tmp_path_factory, one_process):
    """The 4 processes fork from a server that imported the libraries once (tests/strategies/_gloo.py)."""
    root = tmp_path_factory.mktemp("sp")
    start(_rank, (str(root), free_port(), str(one_process[0] / "single")), 4)
    return root, [json.loads((root / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(600)
def test_sequence_layouts_match_one_process_and_resume_across_layouts(layouts, one_process):
    from raytrain import Trainer

    root, per_rank = layouts
    one = one_process[1]
    ref = _losses(one["single"])
    assert len(ref) == STEPS and ref[-1] < ref[0]
    for results in per_rank[1:]:  # every rank logs the loss of the whole global batch, and evaluates alike
        assert results == per_rank[0]
    results = per_rank[0]
    for run, sp in (("z2", 2), ("fsdp-sp4", 4), ("ddp", 2)):
        assert results[run] == pytest.approx(_losses(one["eager"] if run == "fsdp-sp4" else one["single"]), abs=1e-5), run
        assert results[f"{run}-seen"] == [SEQ // sp], run  # each rank's attention sees its slice
        assert results[f"{run}-tokens"] == one["single"].state.num_input_tokens_seen == STEPS * GLOBAL_BATCH * SEQ
        assert results[f"{run}-eval"] == pytest.approx(one["eval"], abs=1e-5), run
    assert results["z1-ga-ac"] == pytest.approx(ref, abs=1e-5)  # 2 accumulated micro-batches, recomputed layers
    lora = _losses(one["lora"])
    assert lora[-1] < lora[0] and results["z3-lora"] == pytest.approx(lora, abs=1e-5)
    sft = _losses(one["sft"])
    assert len(sft) == STEPS and sft[-1] < sft[0] and results["sft"] == pytest.approx(sft, abs=1e-5)

    # checkpoints: the same layout bit for bit; dp4 and back, and one process and back, within float tolerance
    assert results["z2-again"] == results["z2"]
    for run in ("z2-dp4", "z2-dp4-from-sp", "z2-sp-from-dp4", "ddp-from-single"):
        assert results[run] == pytest.approx(ref, abs=1e-5), run
    resumed = Trainer(tiny_llama(), lm_args(str(one_process[0] / "resumed")), train_dataset=token_rows())
    resumed.train(resume_from_checkpoint=str(root / "ddp" / f"checkpoint-{SAVE_AT}"))
    assert _losses(resumed) == pytest.approx(ref, abs=1e-5)
    manifest = json.loads((root / "z2" / f"checkpoint-{SAVE_AT}" / "manifest.json").read_text())
    assert manifest["parallelism"] == {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 1, "sp_size": 2}


def test_every_sequence_layout_saves_what_from_pretrained_loads(layouts, one_process):
    from transformers import LlamaForCausalLM

    root, _ = layouts
    for run in FRESH:
        ref = one_process[1]["eager" if run == "fsdp-sp4" else "single"].model.state_dict()
        for folder in (f"checkpoint-{STEPS}", "final"):
            model, info = LlamaForCausalLM.from_pretrained(str(root / run / folder), output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], (run, info)
            assert model.config._attn_implementation in ("sdpa", "eager")  # the run's attention key is not saved
            for key, value in model.state_dict().items():
                torch.testing.assert_close(value, ref[key], rtol=1e-4, atol=1e-5)


def test_a_zero_checkpoint_of_a_sequence_layout_in_one_process_is_refused_in_one_line(layouts):
    """ZeRO's optimizer partitions need DeepSpeed on the same number of ranks (dp4 reads them, above)."""
    from raytrain import Trainer
    from raytrain.checkpoint.store import CheckpointError

    root, _ = layouts
    trainer = Trainer(tiny_llama(), lm_args(str(root / "refused")), train_dataset=token_rows())
    with pytest.raises(CheckpointError, match=r"the optimizer state is DeepSpeed's own \(ZeRO partitions\)") as e:
        trainer.train(resume_from_checkpoint=str(root / "z2" / f"checkpoint-{SAVE_AT}"))
    assert "\n" not in str(e.value)


def _args(tmp_path, config, **kw):
    return dict(output_dir=str(tmp_path), max_steps=1, scaling={"num_workers": 4}, parallelism_config=config, **kw)


@pytest.mark.parametrize("config, overrides, message", [
    ({"sp_size": 3}, {}, "parallelism_config: dp_replicate_size 1 x tp_size 1 x sp_size 3 must divide the world size "
                         "(scaling.num_workers) 4"),
    ({"sp_size": 2, "dp_shard_size": 4}, {}, "parallelism_config: dp_replicate_size 1 x dp_shard_size 4 x tp_size 1 x "
                                             "sp_size 2 = 8 must equal the world size (scaling.num_workers) 4"),
    ({"sp_size": 2, "tp_size": 2}, {}, "parallelism_config.sp_size: 2 composes with data parallelism (dp_shard_size) "
                                       "only, not with tp_size 2; set those 1, or sp_size 1"),
    ({"sp_size": 2, "pp_size": 2}, {}, "parallelism_config.sp_size: 2 composes with data parallelism (dp_shard_size) "
                                       "only, not with pp_size 2"),
    ({"sp_size": 2, "sp_backend": "ring"}, {}, "parallelism_config.sp_backend: 'deepspeed' (HF's only backend), got "
                                               "'ring'"),
    ({"sp_size": 2, "dp_replicate_size": 2}, {}, "parallelism_config.sp_size: 2 composes with data parallelism "
                                                 "(dp_shard_size) only, not with dp_replicate_size 2"),
    ({"cp_size": 2, "cp_backend": "ring"}, {}, "parallelism_config.cp_backend: 'torch' (HF's only backend), got "
                                               "'ring'"),
    ({"sp_size": 2, "cp_size": 2}, {}, "parallelism_config: sp_size and cp_size split the same sequence"),
    ({"sp_size": 2}, {"scaling": {"num_workers": [2, 4]}}, "parallelism_config.sp_size: 2 with an elastic"),
    ({"cp_size": 2}, {}, "parallelism_config.cp_size: context parallelism needs CUDA (torch's ring attention has no "
                         "CPU kernel); on CPU and gloo split the sequence with sp_size (DeepSpeed Ulysses), got cp_size 2"),
    ({"cp_size": 2}, {"scaling": {"num_workers": 4, "use_gpu": True}, "distributed": {"strategy": "deepspeed"}},
     "parallelism_config.cp_size: context parallelism needs distributed.strategy fsdp"),
])
def test_wrong_sequence_layouts_are_refused_in_one_line(tmp_path, config, overrides, message):
    with pytest.raises(ValueError) as e:
        TrainingArguments(**{**_args(tmp_path, config), **overrides})
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sp_picks_deepspeed_and_reads_accelerates_object(tmp_path):
    args = TrainingArguments(**_args(tmp_path, SP2))
    assert args.distributed.strategy == "deepspeed" and args.parallelism_config["sp_size"] == 2
    accelerate = pytest.importorskip("accelerate")
    args = TrainingArguments(**_args(tmp_path, accelerate.ParallelismConfig(sp_size=2, sp_backend="deepspeed")))
    assert args.parallelism_config["sp_size"] == 2 and args.parallelism_config["dp_shard_size"] == -1  # the rest
    args = TrainingArguments(**_args(tmp_path, SP2, distributed={"strategy": "fsdp"}))
    assert args.distributed.strategy == "fsdp"


def test_models_and_batches_ulysses_cannot_split_are_refused_in_one_line(tmp_path):
    """Checked on the driver by Trainer.train (and again by each worker before its first step), in one line."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from raytrain import Trainer
    from raytrain.config.args import ConfigError
    from raytrain.strategies.sequence import cut
    from tests.strategies._helpers import digits_model

    small = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, vocab_size=128)
    cases = [
        (LlamaForCausalLM(LlamaConfig(**small, num_attention_heads=6, num_key_value_heads=6)), {"sp_size": 4}, {},
         "parallelism_config.sp_size: 4 must divide the model's num_attention_heads (6)"),
        (LlamaForCausalLM(LlamaConfig(**small, num_attention_heads=6, num_key_value_heads=3)), SP2, {},
         "parallelism_config.sp_size: 2 must divide the model's num_key_value_heads (3) or be a multiple of it"),
        (MistralForCausalLM(MistralConfig(**small, num_attention_heads=4, num_key_value_heads=2, sliding_window=16)),
         SP2, {}, "parallelism_config.sp_size: MistralForCausalLM has layers other than full attention (sliding_window)"),
        (tiny_llama(), SP2, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()},
         "compute_loss_func: not supported with parallelism_config.sp_size"),
        (tiny_llama(attn="eager"), {"cp_size": 2}, {}, "parallelism_config.cp_size: attention 'eager' cannot be split "
                                                       "here; load the model with attn_implementation sdpa"),
        (digits_model(), SP2, {}, "parallelism_config.sp_size: DigitsMLP is not a transformers model; raytrain splits "
                                  "a transformers model's attention"),
    ]
    for model, config, kw, message in cases:
        gpu = {"scaling": {"num_workers": 4, "use_gpu": True}} if "cp_size" in config else {}
        trainer = Trainer(model, TrainingArguments(**{**_args(tmp_path, config), **gpu}), train_dataset=token_rows(8),
                          **kw)
        with pytest.raises(ConfigError) as e:  # the CLI's exit 2
            trainer.train()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    batch = {"input_ids": torch.zeros(2, 10, dtype=torch.long), "labels": torch.zeros(2, 10, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"^parallelism_config.sp_size: 4 must divide every batch's sequence length, "
                                         r"got 10; pad batches to a multiple of it \(the collator's pad_to_multiple_of"):
        cut(batch, 0, 4)
    # the slice: global positions, labels shifted before the cut (the last label of a slice is the next one's first)
    batch = {"input_ids": torch.arange(8).reshape(1, 8), "labels": torch.arange(8).reshape(1, 8)}
    parts = [cut(batch, r, 2) for r in range(2)]
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert [p["shift_labels"].tolist() for p in parts] == [[[1, 2, 3, 4]], [[5, 6, 7, -100]]]
    assert all(torch.equal(p["labels"], p["shift_labels"]) for p in parts)
    # cp_size: the whole batch for torch's context_parallel to split, no padding mask, packed rows refused
    from raytrain.strategies.sequence import ContextParallel

    whole = ContextParallel(None, 2).shard({**batch, "attention_mask": torch.ones(1, 8, dtype=torch.long)})
    assert sorted(whole) == ["input_ids", "labels", "position_ids", "shift_labels"] and whole["input_ids"].shape == (1, 8)
    with pytest.raises(ValueError, match=r"^parallelism_config.cp_size: 4 must divide every batch's sequence length"):
        ContextParallel(None, 2).shard({"input_ids": torch.zeros(1, 6, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"^parallelism_config.cp_size: ring attention cannot keep packed sequences"):
        ContextParallel(None, 2).shard({**batch, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])})


def test_the_whole_sequences_mask_keeps_packed_documents_apart():
    """After Ulysses' gather: causal within each document where the position ids restart, as transformers masks
    packed rows in one process; plain causal rows leave SDPA its is_causal (no mask)."""
    from raytrain.hf.sequence import _mask

    query = torch.zeros(1, 2, 5, 4)
    packed = _mask("sdpa", query, torch.tensor([[0, 1, 2, 0, 1]]), None)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    causal[3:, :3] = False  # the second document sees none of the first
    assert torch.equal(packed[0, 0], causal)
    assert _mask("sdpa", query, torch.arange(5)[None], None) is None
    eager = _mask("eager", query, torch.arange(5)[None], None)[0, 0]
    assert torch.equal(eager == 0, torch.ones(5, 5, dtype=torch.bool).tril())


def test_trl_trainers_other_than_sft_refuse_sp(tmp_path):
    from raytrain.config.args import ConfigError
    from raytrain.trl import DPOConfig

    with pytest.raises(ConfigError, match=r"^parallelism_config.sp_size: sequence parallelism is not supported by "
                                          r"raytrain.trl's DPOTrainer"):
        DPOConfig(str(tmp_path), scaling={"num_workers": 4}, parallelism_config=SP2, bf16=False)


@pytest.mark.ray
@pytest.mark.timeout(900)
@pytest.mark.long  # ~2 min: by default the same layouts run on spawned gloo processes (the `layouts` fixture)
def test_ray_workers_split_sequences_as_one_process(ray_cluster, one_process, tmp_path):
    """sp2 x dp2 (ZeRO-2) and sp4 (FSDP2) on 4 Ray workers through Trainer.train: one process's losses and evaluation
    loss within 1e-5 over 10 steps, the same global batch."""
    from raytrain import Trainer

    one = one_process[1]
    for layout, distributed in (("sp2xdp2", ZERO[2]), ("sp4", {"strategy": "fsdp"})):
        scaling = {"num_workers": 4, "storage_path": str(tmp_path / "ray"), "resources_per_worker": {"CPU": 1}}
        args = lm_args(str(tmp_path / layout), layout, distributed, save_strategy="no", eval_strategy="steps",
                       eval_steps=STEPS, scaling=scaling)
        trainer = Trainer(tiny_llama(), args, train_dataset=token_rows(), eval_dataset=token_rows(8))
        trainer.train()
        assert _losses(trainer) == pytest.approx(_losses(one["single"]), abs=1e-5), layout
        evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        assert len(evals) == 1 and evals[0] == pytest.approx(one["eval"], abs=1e-5), layout


def _cp_rank(rank: int, root: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import torch.distributed as dist

    from raytrain import Trainer
    from raytrain.worker import loop

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    args = lm_args(os.path.join(root, "cp2"), "single", {"strategy": "fsdp"}, save_strategy="no",
                   scaling={"num_workers": 2, "use_gpu": True}, parallelism_config={"cp_size": 2})
    trainer = Trainer(tiny_llama(), args, train_dataset=token_rows())
    loop.train(trainer, None)
    if rank == 0:
        with open(os.path.join(root, "cp2.json"), "w") as f:
            json.dump(_losses(trainer), f)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="cp_size 2 needs 2 CUDA devices")
@pytest.mark.timeout(300)
def test_cp2_on_two_gpus_matches_one_gpu(tmp_path):
    """torch's context_parallel (ring attention) under FSDP2 on 2 GPUs: one GPU's losses (benchmarks/gpu.sh)."""
    from raytrain import Trainer

    start(_cp_rank, (str(tmp_path), free_port()), 2)
    one = Trainer(tiny_llama(), lm_args(str(tmp_path / "one"), save_strategy="no", scaling={"num_workers": 1,
                                                                                          "use_gpu": True}),
                  train_dataset=token_rows())
    one.train()
    got = json.loads((tmp_path / "cp2.json").read_text())
    assert _losses(one)[-1] < _losses(one)[0] and got == pytest.approx(_losses(one), abs=1e-4)
