"""PEFT (LoRA) fine-tuning of a causal language model: one script run by transformers 5.23's Trainer (the
oracle) and by raytrain's; what raytrain saves loads with PeftModel.from_pretrained and, merged, with
from_pretrained; resume is bit-exact, after a SIGKILL too; transformers' PEFT checkpoints resume."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny import kill_at_save

from . import corpus, scripts

peft = pytest.importorskip("peft")
# One xdist worker runs the module, so that its module fixture (`runs`: two LoRA trainings) runs once.
pytestmark = pytest.mark.xdist_group("peft")

ADAPTER = {"adapter_config.json", "adapter_model.safetensors"}


def llama_config(vocab_size: int, tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tie, pad_token_id=0)


def base_model(vocab_size: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(vocab_size))


def lora_model(vocab_size: int, adapter_seed: int | None = None, dropout: float = 0.1):
    """The same base (a pretrained model stands for it) with a fresh LoRA adapter (another one with `adapter_seed`)."""
    from peft import LoraConfig, get_peft_model

    model = base_model(vocab_size)
    if adapter_seed is not None:
        torch.manual_seed(adapter_seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))


def lm_data(n_train: int = 40, n_eval: int = 8):
    from datasets import Dataset

    tok = corpus.tokenizer()
    ds = Dataset.from_dict({"text": corpus.sentences()[:n_train + n_eval]})
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=24), batched=True, remove_columns=["text"])
    return tok, ds.select(range(n_train)), ds.select(range(n_train, n_train + n_eval))


def lora_script(lib: str, out, model=None, resume=None, **kw):
    """The job people bring: LoRA on q_proj/v_proj, gradient checkpointing, cosine, save_total_limit 2, the
    best adapter loaded at the end; written once for transformers and raytrain."""
    from transformers import DataCollatorForLanguageModeling

    Trainer, TrainingArguments = scripts.LIBS[lib][0]()
    tok, train, test = lm_data()
    extra = {"data_order": "hf"} if lib == "rt" else {}  # HF's sampler order: the losses compare step for step
    args = TrainingArguments(str(out), **{
        "max_steps": 10, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8, "learning_rate": 5e-3,
        "lr_scheduler_type": "cosine", "warmup_steps": 2, "gradient_checkpointing": True, "eval_strategy": "steps",
        "eval_steps": 5, "save_steps": 5, "save_total_limit": 2, "load_best_model_at_end": True, "logging_steps": 1,
        **scripts.COMMON, **extra, **kw})
    trainer = Trainer(model=model if model is not None else lora_model(len(tok)), args=args, train_dataset=train,
                      eval_dataset=test, processing_class=tok, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logits(model, tok):
    batch = tok(["the import statement", "a short sentence, with a comma"], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The LoRA script trained by transformers and by raytrain (the latter also writing the merged model)."""
    root = tmp_path_factory.mktemp("lora")
    hf = lora_script("hf", root / "hf")
    hf.save_model(str(root / "hf" / "final"))
    rt = lora_script("rt", root / "rt", save_merged_model=True)
    rt.save_model(str(root / "rt" / "final"))
    return root, hf, rt


def test_lora_script_trains_as_transformers_does(runs):
    _, hf, rt = runs
    loss = lambda t: [e["loss"] for e in t.state.log_history if "loss" in e]  # noqa: E731
    ev = lambda t: [e["eval_loss"] for e in t.state.log_history if "eval_loss" in e]  # noqa: E731
    # data_order hf: HF's order and HF's draws from torch's generator (each DataLoader pass, training's and
    # evaluation's), so LoRA dropout's masks are HF's too
    assert len(loss(rt)) == 10 and loss(rt) == pytest.approx(loss(hf), rel=1e-6)
    assert ev(rt) == pytest.approx(ev(hf), rel=1e-6)
    frozen = [n for n, p in rt.model.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" not in n for n in frozen)
    base = base_model(rt.model.get_base_model().config.vocab_size)  # the base weights did not move
    for name, value in base.state_dict().items():
        torch.testing.assert_close(rt.model.get_base_model().state_dict()[name.replace(".weight", ".base_layer.weight")
                                   if name not in rt.model.get_base_model().state_dict() else name], value)


def test_checkpoints_hold_the_adapter_as_transformers_writes_it(runs):
    root, hf, rt = runs
    for step in (5, 10):
        mine, theirs = root / "rt" / f"checkpoint-{step}", root / "hf" / f"checkpoint-{step}"
        files = set(os.listdir(mine))
        assert ADAPTER <= files and "model.safetensors" not in files and "config.json" not in files
        assert set(os.listdir(theirs)) - {"rng_state.pth"} <= files  # HF's files, and raytrain's manifest and states
        assert load_file(mine / "adapter_model.safetensors").keys() == load_file(theirs / "adapter_model.safetensors").keys()
        # its size scales with the adapter: within a few hundred bytes of HF's adapter file
        assert abs(os.path.getsize(mine / "adapter_model.safetensors") -
                   os.path.getsize(theirs / "adapter_model.safetensors")) < 512
        manifest = (mine / "manifest.json").read_text()
        assert "adapter_model.safetensors" in manifest and "adapter_config.json" in manifest
    full = sum(p.numel() for p in rt.model.parameters()) * 4
    assert os.path.getsize(root / "rt" / "checkpoint-10" / "adapter_model.safetensors") < full / 10


def test_final_adapter_loads_with_peft_and_reproduces_the_trained_logits(runs):
    from peft import PeftModel

    root, _, rt = runs
    final = root / "rt" / "final"
    assert ADAPTER <= set(os.listdir(final)) and "config.json" not in os.listdir(final)
    assert "model.safetensors" not in os.listdir(final)
    loaded = PeftModel.from_pretrained(base_model(rt.model.get_base_model().config.vocab_size), str(final))
    torch.testing.assert_close(logits(loaded, rt.processing_class), logits(rt.model, rt.processing_class))


def test_merged_model_loads_with_from_pretrained_with_no_missing_key(runs):
    from transformers import AutoModelForCausalLM

    root, _, rt = runs
    merged, info = AutoModelForCausalLM.from_pretrained(str(root / "rt" / "final" / "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(logits(merged, rt.processing_class), logits(rt.model, rt.processing_class),
                               rtol=1e-5, atol=1e-5)


def test_load_best_model_at_end_reloads_the_best_adapter(runs):
    root, hf, rt = runs
    assert rt.state.best_model_checkpoint == str(root / "rt" / f"checkpoint-{hf.state.best_global_step}")
    best = load_file(os.path.join(rt.state.best_model_checkpoint, "adapter_model.safetensors"))
    mine = adapter_tensors(rt.model)
    assert best.keys() == mine.keys()
    for k in best:
        assert torch.equal(best[k], mine[k]), k


def test_save_model_of_a_transformers_model_loads_with_no_missing_key(tmp_path):
    """Plain, tied embeddings and torch.compile'd: what final/ holds loads with from_pretrained, nothing
    missing nor unexpected, same logits."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from raytrain import Trainer, TrainingArguments

    tok = corpus.tokenizer()
    for name, tie, compiled in (("plain", False, False), ("tied", True, False), ("compiled", False, True)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(len(tok), tie=tie))
        trainer = Trainer(model=torch.compile(model) if compiled else model,
                          args=TrainingArguments(str(tmp_path / name), **scripts.COMMON))
        trainer.save_model(str(tmp_path / name / "final"))
        loaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / name / "final"), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        torch.testing.assert_close(logits(loaded, tok), logits(model, tok))


def test_a_transformers_peft_checkpoint_resumes_on_raytrain(tmp_path):
    """transformers' checkpoint-2 of the LoRA script (adapter, optimizer, scheduler, RNG, state; full batches,
    so HF's sampler order cannot matter): its adapter is what the model holds on resume, and the run
    continues to step 4 with transformers' own losses and learning rates."""
    tok = corpus.tokenizer()
    full = dict(per_device_train_batch_size=40, max_steps=4, save_steps=2, eval_strategy="no",
                load_best_model_at_end=False, save_total_limit=None)
    hf = lora_script("hf", tmp_path / "hf", model=lora_model(len(tok), dropout=0.0), **full)
    checkpoint = tmp_path / "hf" / "checkpoint-2"
    assert ADAPTER <= set(os.listdir(checkpoint)) and not (checkpoint / "manifest.json").exists()
    loaded = _resume(tmp_path / "loaded", checkpoint, max_steps=2)  # nothing left to train: the restored adapter
    assert loaded.state.global_step == 2
    saved, mine = load_file(checkpoint / "adapter_model.safetensors"), adapter_tensors(loaded.model)
    assert saved.keys() == mine.keys() and all(torch.equal(saved[k], mine[k]) for k in saved)
    continued = _resume(tmp_path / "continued", checkpoint, max_steps=4)
    assert continued.state.global_step == 4
    after = lambda t, key: [e[key] for e in t.state.log_history if "loss" in e and e["step"] > 2]  # noqa: E731
    assert after(continued, "learning_rate") == after(hf, "learning_rate")
    assert after(continued, "loss") == pytest.approx(after(hf, "loss"), rel=1e-5)


KILLED = dict(max_steps=9, save_steps=3, eval_strategy="no", load_best_model_at_end=False, save_total_limit=None)


def _killed_main(out: str, threads: int, tokenizer_file: str) -> None:
    """The process the SIGKILL test kills (imported by a fresh interpreter), on the test's thread count and
    with its tokenizer (WordPiece training differs from process to process)."""
    torch.set_num_threads(threads)
    with open(tokenizer_file) as f:
        corpus._tokenizer_json = lambda text=f.read(): text
    lora_script("rt", out, **KILLED)


def test_sigkill_during_a_lora_save_then_resume_is_bit_exact(tmp_path):
    """Killed while checkpoint-6 is being written (every file but the manifest): the run resumes from
    checkpoint-3's adapter, optimizer and RNG (LoRA dropout on) and ends with the uninterrupted run's adapter."""
    from raytrain import get_last_checkpoint

    out, flag, tokenizer_file = tmp_path / "run", tmp_path / "paused", tmp_path / "tokenizer.json"
    tokenizer_file.write_text(corpus._tokenizer_json())
    kill_at_save(f"from tests.hf.test_peft import _killed_main; "
                 f"_killed_main({str(out)!r}, {torch.get_num_threads()}, {str(tokenizer_file)!r})", flag, 6,
                 seconds=180)
    assert ADAPTER <= set(os.listdir(out / ".tmp-checkpoint-6"))
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")
    tok = corpus.tokenizer()
    reference = lora_script("rt", tmp_path / "ref", **{**KILLED, "save_strategy": "no"})
    resumed = lora_script("rt", out, model=lora_model(len(tok), adapter_seed=99), resume=True, **KILLED)
    assert resumed.state.global_step == 9
    want, got = adapter_tensors(reference.model), adapter_tensors(resumed.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]


def _resume(out, checkpoint, max_steps: int):
    """The LoRA script on raytrain (full batches, no dropout) from a fresh adapter of another seed,
    resumed from `checkpoint`."""
    from transformers import DataCollatorForLanguageModeling

    from raytrain import Trainer, TrainingArguments

    tok, train, _ = lm_data()
    args = TrainingArguments(str(out), max_steps=4, per_device_train_batch_size=40, learning_rate=5e-3,
                             lr_scheduler_type="cosine", warmup_steps=2, gradient_checkpointing=True, logging_steps=1,
                             save_strategy="no", **scripts.COMMON)
    trainer = Trainer(model=lora_model(len(tok), adapter_seed=7, dropout=0.0), args=args, train_dataset=train,
                      processing_class=tok, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.args.max_steps = max_steps
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer


def test_a_peft_model_without_a_task_type_trains_on_its_base_models_columns(tmp_path):
    """A PeftModel made without task_type has forward(*args, **kwargs): the columns kept and required are
    its base model's, as HF inspects them (get_base_model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling

    from raytrain import Trainer, TrainingArguments

    tok, train, _ = lm_data()
    model = get_peft_model(base_model(len(tok)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert type(model).__name__ == "PeftModel"
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=8, save_strategy="no",
                             **scripts.COMMON)
    trainer = Trainer(model=model, args=args, train_dataset=train.add_column("text", ["x"] * len(train)),
                      processing_class=tok, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    assert trainer.train().global_step == 2
