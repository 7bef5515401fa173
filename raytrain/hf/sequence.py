"""sp_size (and cp_size) on a transformers model (the bridge's part of HF's ALST), and the Trainer's step under
them (a mixin of trainer.Trainer).

The model's attention key (config._attn_implementation) becomes one registered for the run, whose function hands
query, key and value to DeepSpeed's UlyssesSPAttentionHF (strategies/sequence.py) around the model's own sdpa,
eager or flash attention. The key is the model's alone, where DeepSpeed's register_with_transformers overrides
"sdpa" for every model of the process; and since transformers builds no mask for an unknown key (it would be the
slice's), the mask is built here for the whole gathered sequence from its global position ids, with transformers'
own mask functions: causal, and per document where the position ids restart (packed sequences), as transformers
does for one process. (DeepSpeed drops every mask and refuses eager, which then would not be causal.) A padding
mask is not applied, as in HF's ALST: pad on the right with labels -100, or pack.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from functools import partial
from typing import Any

import torch

from . import objects as hf
from ..strategies.base import unwrap_model

_PREFIX = "raytrain_ulysses"
_CORES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
_runs = itertools.count()


def _base(model: Any) -> Any:
    model = unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_model(model: Any, sp: int, cp: int = 1) -> None:
    """What Ulysses (sp) or ring attention (cp) needs of the model, each in one line: a transformers config, heads
    that split over sp_size, an attention it can wrap (cp: SDPA), and only full-attention layers (a sliding window
    or a recurrent layer sees the sequence otherwise)."""
    field = "sp_size" if cp == 1 else "cp_size"
    config = getattr(_base(model), "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ValueError(f"parallelism_config.{field}: {type(_base(model)).__name__} is not a transformers model; "
                         "raytrain splits a transformers model's attention")
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp:
        raise ValueError(f"parallelism_config.sp_size: {sp} must divide the model's num_attention_heads ({heads})")
    if kv % sp and sp % kv:
        raise ValueError(f"parallelism_config.sp_size: {sp} must divide the model's num_key_value_heads ({kv}) or be "
                         "a multiple of it")
    core, cores = _core_name(config), _CORES if cp == 1 else ("sdpa",)
    if core not in cores:
        raise ValueError(f"parallelism_config.{field}: attention {core!r} cannot be split here; load the model with "
                         f"attn_implementation {' or '.join(cores)}")
    kinds = set(getattr(text, "layer_types", None) or [])
    if kinds - {"full_attention"} or (not kinds and getattr(text, "sliding_window", None)):
        raise ValueError(f"parallelism_config.{field}: {type(_base(model)).__name__} has layers other than full "
                         f"attention ({', '.join(sorted(kinds - {'full_attention'})) or 'sliding_window'}), which "
                         f"the split sequence's causal mask does not express; use {field} 1")


def _core_name(config: Any) -> str:
    name = config._attn_implementation or "eager"
    return name.split(":", 1)[1] if name.startswith(_PREFIX) else name


def attach(model: Any, sequence: Any) -> None:
    """The model's attention through `sequence`'s Ulysses from its next forward on (once; idempotent)."""
    config = _base(model).config
    if (config._attn_implementation or "").startswith(_PREFIX):
        return
    ring = sequence.kind == "cp"
    check_model(model, 1 if ring else sequence.size, sequence.size if ring else 1)
    from transformers import AttentionInterface

    core = _core_name(config)
    key = f"{_PREFIX}{next(_runs)}:{core}"
    layers = config.get_text_config().num_hidden_layers
    fn = _causal_sdpa if ring else partial(_ulysses, sequence=sequence, core=partial(_attend, core), layers=layers)
    AttentionInterface.register(key, fn)
    config._attn_implementation = key


def _ulysses(module, query, key, value, attention_mask, *args, sequence, core, layers, **kwargs):
    """transformers' attention call (q, k, v: batch x heads x slice x head_dim) through UlyssesSPAttentionHF."""
    ulysses = sequence.attention(core, query.shape[0], query.shape[1], key.shape[1], query.shape[-1], layers)
    groups = getattr(module, "num_key_value_groups", None)
    try:
        return ulysses(module, query, key, value, attention_mask, *args, **kwargs)
    finally:  # DeepSpeed rewrites it when it replicates kv heads (sp_size > kv heads); evaluation needs the model's
        if groups is not None:
            module.num_key_value_groups = groups


def _causal_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """cp_size: causal SDPA without a mask, which context_parallel turns into ring attention (accelerate's hooks
    drop the mask the same way); no mask was built for the shard (an unknown key gets none)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kwargs["is_causal"] = True
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, *args, **kwargs)


def _attend(core: str, module, query, key, value, attention_mask, *args, **kwargs):
    """The model's own attention over whole sequences, with the mask transformers would build for them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if attention_mask is None and core in ("sdpa", "eager") and query.shape[2] == key.shape[2]:  # not cached decoding
        attention_mask = _mask(core, query, kwargs.get("position_ids"), module)
    if core == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"parallelism_config.sp_size: {type(module).__name__}'s module has no "
                             "eager_attention_forward; load the model with attn_implementation 'sdpa'")
    else:
        fn = ALL_ATTENTION_FUNCTIONS[core]
    return fn(module, query, key, value, attention_mask, *args, **kwargs)


def _mask(core: str, query: torch.Tensor, position_ids: torch.Tensor | None, module: Any):
    """Causal over the gathered sequence, per document where position ids restart (transformers' masking_utils);
    None for sdpa when plain causal (its is_causal)."""
    from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function,
                                            find_packed_sequence_indices, packed_sequence_compatibility_function)

    batch, length = query.shape[0], query.shape[2]
    packed = None
    if position_ids is not None:
        position_ids = position_ids.expand(batch, -1)
        packed = find_packed_sequence_indices(position_ids)
    if packed is None and core == "sdpa":
        return None
    fn = causal_mask_function if packed is None else \
        packed_sequence_compatibility_function(causal_mask_function, position_ids, packed)
    return ALL_MASK_ATTENTION_FUNCTIONS[core](batch_size=batch, q_length=length, kv_length=length, mask_function=fn,
                                              attention_mask=None, allow_is_causal_skip=False, dtype=query.dtype,
                                              device=query.device, config=getattr(module, "config", None))


class SequenceMethods:
    """The Trainer's hooks for sp_size and cp_size; the Trainer provides args, model, compute_loss_func and
    get_strategy."""

    @contextlib.contextmanager
    def _sequence_step(self, model, inputs: dict):
        """Around a training step's forward and backward: under sp_size the model's attention through Ulysses;
        under cp_size through ring attention, inside torch's context_parallel."""
        sequence = self.get_strategy().sequence
        if sequence is None:
            yield
            return
        self._check_sequence_loss()
        attach(model, sequence)
        with sequence.step(inputs):
            yield

    def _check_layout(self) -> None:
        """Before any worker starts: the pipeline's split, and what a split sequence needs of the model; one line
        each."""
        self._check_pipeline()
        config = self.args.parallelism_config or {}
        sp, cp = config.get("sp_size", 1), config.get("cp_size", 1)
        if sp > 1 or cp > 1:
            self._check_sequence_loss()
            check_model(self.model, sp, cp)

    def _label_shift(self, model, inputs: dict) -> bool:
        """Whether the label smoother shifts the labels: a causal LM's, unless the batch's are shifted already
        (shift_labels: a sequence slice's, a padding-free collator's)."""
        return "shift_labels" not in inputs and hf.is_causal_lm(unwrap_model(model))

    def _check_sequence_loss(self) -> None:
        if self.compute_loss_func is not None:  # as TRL's SFTTrainer under ALST
            raise ValueError("compute_loss_func: not supported with parallelism_config.sp_size or cp_size (each rank "
                             "holds a slice of the logits and its labels shifted before the cut); the model's own loss "
                             "is summed over the ranks instead")
