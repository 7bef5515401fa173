"""TRL 1.16's SFTConfig / DPOConfig / GRPOConfig / RLOOConfig fields, read from the installed trl: raytrain.trl adds
them to TrainingArguments with TRL's names, defaults and help, and checks them as TRL's __post_init__ does, so a
config keeps its meaning."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ...deps import SUPPORTED

try:
    import trl
    from trl import DPOConfig as _DPOConfig, GRPOConfig as _GRPOConfig, RLOOConfig as _RLOOConfig, \
        SFTConfig as _SFTConfig
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig as _AsyncGRPOConfig
except ImportError as e:  # one line naming the package to install (another version: refused in __init__.py)
    low, high, hint = SUPPORTED["trl"]
    raise ImportError(f"raytrain.trl needs trl>={low},<{high} ({e.name} is missing): {hint}") from None

TRL_VERSION = trl.__version__

# Fields of transformers' TrainingArguments whose default TRL changes (its _BaseConfig and each config).
_CHANGED = ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "lr_scheduler_kwargs", "disable_tqdm")
_CLASSES = {"sft": _SFTConfig, "dpo": _DPOConfig, "grpo": _GRPOConfig, "rloo": _RLOOConfig,
            "async_grpo": _AsyncGRPOConfig}
# ... and per config: GRPO / RLOO keep the dataset's other columns for the reward functions
_CHANGED_BY = {"grpo": ("remove_unused_columns",), "rloo": ("remove_unused_columns",),
               "async_grpo": ("lr_scheduler_type", "ignore_data_skip")}


def trl_fields(kind: str, base_names: set[str]) -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) for make_dataclass: TRL's own fields (not in `base_names`) and the changed defaults."""
    changed = _CHANGED + _CHANGED_BY.get(kind, ())
    out = []
    for f in dataclasses.fields(_CLASSES[kind]):
        if f.name in base_names and f.name not in changed:
            continue
        help_text = str(f.metadata.get("help", "")).replace("%%", "%")
        meta = {"help": help_text, **({"choices": f.metadata["choices"]} if "choices" in f.metadata else {})}
        if f.default_factory is not dataclasses.MISSING:
            new = dataclasses.field(default_factory=f.default_factory, metadata=meta)
        else:
            new = dataclasses.field(default=f.default, metadata=meta)
        out.append((f.name, Any, new))
    return out


def trl_field_names(kind: str, base_names: set[str]) -> tuple[str, ...]:
    return tuple(name for name, _, _ in trl_fields(kind, base_names) if name not in base_names)


def check_choices(args: Any, names: tuple[str, ...]) -> None:
    """TRL's `choices` metadata as raytrain's one-line ValueError naming the field."""
    for f in dataclasses.fields(args):
        if f.name in names and "choices" in f.metadata:
            value = getattr(args, f.name)
            if value not in f.metadata["choices"]:
                raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(map(repr, f.metadata['choices']))}")


def normalize_sft(args: Any) -> None:
    """What SFTConfig.__post_init__ does to its own fields (deprecated names, 'auto' padding)."""
    s = object.__setattr__
    if args.packing_strategy == "bfd-requeue":
        warnings.warn("packing_strategy 'bfd-requeue' is now 'bfd_split'", FutureWarning, stacklevel=4)
        s(args, "packing_strategy", "bfd_split")
    _normalize_common(args)
    if args.loss_type == "chunked_nll":
        warnings.warn("loss_type='chunked_nll' is deprecated: 'nll' computes the loss the same way",
                      FutureWarning, stacklevel=4)
        s(args, "loss_type", "nll")


def _normalize_common(args: Any) -> None:
    s = object.__setattr__
    pad = args.pad_to_multiple_of
    if isinstance(pad, str) and pad != "auto":
        s(args, "pad_to_multiple_of", None if pad.lower() in ("none", "null") else int(pad))
    if args.pad_to_multiple_of == "auto":  # 128 on Neuron only (it compiles per shape); raytrain runs no Neuron
        s(args, "pad_to_multiple_of", None)
    if args.pad_token is not None:
        warnings.warn("pad_token is deprecated: set tokenizer.pad_token", FutureWarning, stacklevel=4)
    if args.truncation_mode == "keep_end":
        warnings.warn("truncation_mode='keep_end' is deprecated", FutureWarning, stacklevel=4)


def normalize_dpo(args: Any) -> None:
    """What DPOConfig.__post_init__ does to its own fields (loss_type as a list, loss_weights matching it)."""
    if isinstance(args.loss_type, str):
        object.__setattr__(args, "loss_type", [args.loss_type])
    if args.loss_weights is not None and len(args.loss_weights) != len(args.loss_type):
        raise ValueError(f"loss_weights: {len(args.loss_weights)} weights for {len(args.loss_type)} loss types; "
                         "give one weight per loss_type")
    _normalize_common(args)


def normalize_grpo(args: Any) -> None:
    """What GRPOConfig / RLOOConfig.__post_init__ do to their own fields before TrainingArguments' checks."""
    s = object.__setattr__
    pad = args.pad_to_multiple_of
    if isinstance(pad, str) and pad != "auto":
        s(args, "pad_to_multiple_of", None if pad.lower() in ("none", "null") else int(pad))
    if args.pad_to_multiple_of == "auto":  # 128 on Neuron only; raytrain runs no Neuron
        s(args, "pad_to_multiple_of", None)
    if args.use_transformers_paged:
        warnings.warn("use_transformers_paged is deprecated: use use_transformers_continuous_batching",
                      FutureWarning, stacklevel=4)
        s(args, "use_transformers_continuous_batching", True)
    if hasattr(args, "scale_rewards"):
        s(args, "scale_rewards", {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards))
    if getattr(args, "vllm_importance_sampling_cap", None) is not None:
        warnings.warn("vllm_importance_sampling_cap is deprecated: use vllm_importance_sampling_clip_max",
                      FutureWarning, stacklevel=4)
        s(args, "vllm_importance_sampling_clip_max", args.vllm_importance_sampling_cap)
    if args.auto_find_batch_size:
        raise ValueError("auto_find_batch_size: not supported by GRPO / RLOO (a smaller batch would split the "
                         "num_generations completions of a prompt); lower per_device_train_batch_size instead")


def settle_grpo(args: Any) -> None:
    """GRPOConfig / RLOOConfig's batch arithmetic, after TrainingArguments' checks (it needs the world size:
    the Ray workers of `scaling`, or the process group's)."""
    s, world = object.__setattr__, args.world_size
    per_step = args.per_device_train_batch_size * world
    gen, spg = args.generation_batch_size, args.steps_per_generation
    if gen is not None and spg is not None and gen != per_step * spg:
        raise ValueError(f"generation_batch_size ({gen}) and steps_per_generation ({spg}): set only one of them")
    if gen is None and spg is None:
        spg = args.gradient_accumulation_steps
    elif spg is None:
        if gen % per_step:
            raise ValueError(f"generation_batch_size: {gen} is not divisible by the global batch size "
                             f"({args.per_device_train_batch_size} x {world} processes)")
        spg = gen // per_step
    s(args, "steps_per_generation", spg)
    s(args, "generation_batch_size", per_step * spg)
    if args.do_eval and args.eval_strategy != "no":
        n = args.num_generations_eval or args.num_generations
        if args.per_device_eval_batch_size * world % n:
            raise ValueError(f"per_device_eval_batch_size: the global eval batch ({args.per_device_eval_batch_size} "
                             f"x {world}) is not divisible by the generations per prompt in evaluation ({n})")
    if args.generation_batch_size % args.num_generations:
        raise ValueError(f"num_generations: the generation batch ({args.generation_batch_size}) is not divisible by "
                         f"num_generations ({args.num_generations})")
    if args.num_generations < 2:
        raise ValueError(f"num_generations: at least 2 completions per prompt are needed for the advantages, got "
                         f"{args.num_generations}")
    if getattr(args, "log_completions_hub_repo", None) is not None and not args.log_completions:
        raise ValueError("log_completions_hub_repo: set, but log_completions is False")
    lo, hi = getattr(args, "vllm_importance_sampling_clip_min", None), getattr(args, "vllm_importance_sampling_clip_max", None)
    if lo is not None and hi is not None and lo >= hi:
        raise ValueError(f"vllm_importance_sampling_clip_min: {lo} is not below vllm_importance_sampling_clip_max ({hi})")


_GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


def refuse_config(args: Any, kind: str) -> None:
    """One line for each of TRL's GRPO / RLOO settings that raytrain.trl does not run (`kind`: GRPO or RLOO): checked
    by the config itself, so a CLI run stops before the model loads, and again by the trainer."""
    why = {"use_vllm": "vLLM generation is not run; generation uses transformers' generate()",
           "use_transformers_continuous_batching": "continuous batching is not run; generation uses generate()",
           "cast_lm_head_to_fp32": "the fp32 LM head is not wired",
           "sync_ref_model": "the reference model is not checkpointed, so a resumed run would not continue the "
                             "same run",
           "log_completions_hub_repo": "completions are written to output_dir/completions, not pushed"}
    for name, reason in why.items():
        if getattr(args, name, None):
            raise ValueError(f"{name}: not supported by raytrain.trl's {kind}Trainer ({reason})")
    if args.model_init_kwargs is not None and "device_map" in args.model_init_kwargs:
        raise ValueError("model_init_kwargs.device_map: not supported; raytrain places the model on each worker")
    if args.include_num_input_tokens_seen not in ("no", False):
        raise ValueError(f"include_num_input_tokens_seen: {kind} counts prompt and completion tokens itself "
                         "(the num_tokens metric); leave it 'no'")
    if (args.parallelism_config or {}).get("tp_size", 1) > 1:
        raise ValueError(f"parallelism_config.tp_size: tensor parallelism is not supported by raytrain.trl's "
                         f"{kind}Trainer (generation runs on whole parameters)")
    if kind == "GRPO":
        for name, choices in (("loss_type", _GRPO_LOSS_TYPES), ("importance_sampling_level", ("token", "sequence")),
                              ("scale_rewards", ("group", "batch", "none"))):
            if getattr(args, name) not in choices:
                raise ValueError(f"{name}: {getattr(args, name)!r} is not one of {', '.join(map(repr, choices))}")


# AsyncGRPOConfig's fields that talk to a vLLM server, with their defaults: any other value is refused.
_VLLM_FIELDS = {"vllm_server_base_url": "http://localhost:8000", "vllm_server_timeout": 240.0, "request_timeout": 600,
                "weight_sync_timeout": 1800}


def settle_async(args: Any) -> None:
    """AsyncGRPOConfig's checks after TrainingArguments' (the world size is known): the batch holds whole prompt
    groups, TRL's max_inflight_tasks default, and one line for each setting raytrain's rollouts do not run."""
    s, world = object.__setattr__, args.world_size
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    if args.num_generations < 2:
        raise ValueError(f"num_generations: at least 2 completions per prompt are needed for the advantages, got "
                         f"{args.num_generations}")
    if per_step % args.num_generations:
        raise ValueError(f"num_generations: the samples of a step ({args.per_device_train_batch_size} per device x "
                         f"{args.gradient_accumulation_steps} accumulation steps x {world} processes = {per_step}) "
                         f"are not whole groups of {args.num_generations} completions; make them a multiple of it")
    if args.max_staleness < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {args.max_staleness}")
    if args.weight_sync_steps < 1:
        raise ValueError(f"weight_sync_steps: must be >= 1, got {args.weight_sync_steps}")
    if args.max_inflight_tasks < 0:  # TRL's default: what can be trained on before it is stale, at least a step
        s(args, "max_inflight_tasks", max(args.max_staleness, 1) * per_step)
    if args.max_tool_calling_iterations is not None:
        raise ValueError("max_tool_calling_iterations: tool calling is not run by raytrain's AsyncGRPOTrainer")
    layout = args.parallelism_config or {}
    for name in ("tp_size", "cp_size", "sp_size"):
        if layout.get(name, 1) > 1:
            raise ValueError(f"parallelism_config.{name}: not supported by AsyncGRPOTrainer (completions are "
                             "scored on whole sequences and whole parameters); set it to 1")


def refuse_vllm(args: Any) -> None:
    """AsyncGRPOConfig's vLLM-server fields and token_budget, refused when raytrain's rollout actors generate (with a
    TRL rollout_worker they are that worker's settings, and TRL's planner budgets its micro-batches)."""
    if args.token_budget is not None and args.token_budget > 0:
        raise ValueError(f"token_budget: a step trains on whole prompt groups of per_device_train_batch_size samples "
                         f"per micro-batch here (token budgets plan a TRL rollout_worker's queue); set token_budget "
                         f"0 or leave it unset, got {args.token_budget}")
    for name, default in _VLLM_FIELDS.items():
        if getattr(args, name) != default:
            raise ValueError(f"{name}: only for a vLLM server, which raytrain's AsyncGRPOTrainer does not use (its "
                             "rollout actors generate with transformers); leave it unset")
