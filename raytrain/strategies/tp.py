"""Tensor parallelism with torch's parallelize_module, from an HF-style plan (module name pattern -> style).

tp_plan "auto": the model's own plan, as transformers models carry it (the instance's `_tp_plan`, full
names; else `config.base_model_tp_plan`, relative to the base model). Read by attribute: no transformers
import here (strategies/ sits below hf/).
"""

from __future__ import annotations

import re
from typing import Any

import torch

#: HF's style names this supports, as transformers' distributed/tensor_parallel.py defines them.
_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
           "embedding_rowwise", "sequence_parallel", "replicate")


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "colwise":
        return ColwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):  # logits gathered: the loss sees the full vocab
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):  # the input (ids, or a replicated activation) is whole
        return RowwiseParallel(input_layouts=Replicate())
    if name == "sequence_parallel":
        return SequenceParallel(use_local_output=True)
    return None  # replicate: left as it is


def model_plan(model: torch.nn.Module, tp_plan: Any) -> dict[str, str]:
    """The plan to apply, by full module-name pattern; one-line ValueError naming tp_plan when none."""
    if isinstance(tp_plan, dict):
        plan = dict(tp_plan)
    elif tp_plan in (None, "auto"):
        plan = dict(getattr(model, "_tp_plan", None) or {})
        if not plan:
            base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
            prefix = getattr(model, "base_model_prefix", "")
            prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
            plan = {prefix + k: v for k, v in base.items()}
        if not plan:
            raise ValueError(f"tp_plan: {type(model).__name__} has no tensor-parallel plan (no _tp_plan or "
                             "config.base_model_tp_plan); pass tp_plan as a dict of module names to "
                             f"{', '.join(_STYLES[:3])}, ...")
    else:
        raise ValueError(f"tp_plan: 'auto' or a dict of module names to styles, got {tp_plan!r}")
    bad = {k: v for k, v in plan.items() if v not in _STYLES}
    if bad:
        raise ValueError(f"tp_plan: unsupported style(s) {bad}; supported: {', '.join(_STYLES)}")
    return plan


def resolve(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style for every module a pattern matches ('*' one name part, as HF's plans); in a
    PEFT model (names under base_model.model.) the same patterns, and a LoRA layer's parts (lora_layers)."""
    patterns = [(re.compile(r"(base_model\.model\.)?" + re.escape(p).replace(r"\*", r"[^.]+") + "$"), s)
                for p, s in plan.items()]
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Identity):  # another pipeline stage's module (nothing to split)
            continue
        for regex, style in patterns:
            if name and regex.match(name):
                out.update(lora_layers(name, module, style) if hasattr(module, "base_layer") else {name: style})
                break
    if not out:
        raise ValueError(f"tp_plan: no module of {type(model).__name__} matches {sorted(plan)}")
    return out


def lora_layers(name: str, module: torch.nn.Module, style: str) -> dict[str, str]:
    """A LoRA layer under TP (lora_B(lora_A(x)) added to the base's output): the base split as planned;
    colwise: lora_B split the same way (its output adds to the base's shard), lora_A whole; rowwise:
    lora_A split by rows (its input is the shard; its output reduced), lora_B whole."""
    out = {f"{name}.base_layer": style}
    split, whole = ("lora_B", "lora_A") if style.startswith("colwise") else ("lora_A", "lora_B")
    for adapter in getattr(module, split, {}):
        if style not in ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_rep",
                         "rowwise_split_input"):
            break
        out[f"{name}.{split}.{adapter}"], out[f"{name}.{whole}.{adapter}"] = style, "replicate"
    if getattr(module, "lora_embedding_A", None) or (len(out) == 1 and getattr(module, split, None)):
        raise ValueError(f"tp_plan: {name} is a LoRA {type(module).__name__} with style {style}, which tensor "
                         "parallelism cannot split; leave it out of the adapter's target_modules")
    return out


def check_divisible(model: torch.nn.Module, modules: dict[str, str], tp: int) -> None:
    """Every split dim (heads, widths, vocab) divisible by tp_size; one line naming the first that is not."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, attr, None)
        if isinstance(n, int) and n % tp:
            raise ValueError(f"parallelism_config.tp_size: {tp} must divide the model's {attr} ({n})")
    for name, style in modules.items():
        module = model.get_submodule(name)
        if style in ("replicate", "sequence_parallel"):
            continue
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            raise ValueError(f"tp_plan: {name} is a {type(module).__name__}, not a Linear or Embedding; tensor "
                             "parallelism splits those only")
        weight = module.weight
        dim = 0 if style.startswith("colwise") or isinstance(module, torch.nn.Embedding) else 1
        if weight.shape[dim] % tp:
            raise ValueError(f"parallelism_config.tp_size: {tp} must divide {name}'s {style} dim "
                             f"({weight.shape[dim]})")


def apply_tp(model: torch.nn.Module, tp_mesh, tp_plan: Any) -> dict[str, str]:
    """Shard the model's planned modules over `tp_mesh`; returns what was applied (module -> style)."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = resolve(model, model_plan(model, tp_plan))
    check_divisible(model, modules, tp_mesh.size())
    styles = {name: _style(style) for name, style in modules.items()}
    parallelize_module(model, tp_mesh, {k: v for k, v in styles.items() if v is not None})
    return modules


def unfuse_mixed_groups(optimizer) -> None:
    """A param group holding DTensors of different meshes, or DTensors and plain tensors (tp alone: a
    replicated LayerNorm beside a split bias), cannot step in one fused / foreach kernel: per tensor."""
    for group in optimizer.param_groups:
        kinds = {getattr(p, "device_mesh", None) for p in group["params"]}
        if len(kinds) > 1:
            for flag in ("fused", "foreach"):
                if group.get(flag):
                    group[flag] = False


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float | None, stages: Any = None,
                   device: Any = None, uncounted: set | None = None) -> torch.Tensor:
    """The 2-norm of all gradients across the mesh, exact, and clipping by it: DTensors on different
    meshes (TP weights on dp x tp, the rest on dp only) cannot share a foreach op, so per mesh and layout;
    `stages`: the pipeline's group, whose ranks hold the other stages' gradients (squares summed over it);
    `uncounted`: clipped but left out of the norm (a tied weight another stage counts)."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if hasattr(p.grad, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    norms = []
    for members in groups.values():
        counted = [p.grad for p in members if not uncounted or p not in uncounted]
        if not counted:
            continue
        n = torch.nn.utils.get_total_norm(counted, foreach=True)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else \
        norms[0] if norms else torch.zeros((), device=device)
    if stages is not None:
        import torch.distributed as dist

        square = total.square()
        dist.all_reduce(square, group=stages)
        total = square.sqrt()
    if max_norm:
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total, foreach=True)
    return total
