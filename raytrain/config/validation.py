"""The validators of TrainingArguments (args.py's schema adds the fields to them) and the warnings for
HF fields that are accepted but do nothing here. Each failure is one line naming the field."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from enum import Enum
from typing import Any

from pydantic import field_validator, model_validator

from . import derived
from .sections import ConfigError, StrictModel, parse_pairs, show_number, show_value
from ..hf import accelerate_config
from ..hf.args import debug_options, deprecated_alias
from ..hf.names import INTEGRATIONS, LOW_RANK, OWN_INTEGRATIONS, available_integrations, check_optim, installed

logger = logging.getLogger(__name__)

_HF_NOOP_WARNINGS = {
    "logging_dir": "logging_dir is not used without report_to tensorboard; logs are in trainer_state.json",
    "fsdp_config": "fsdp_config is read only with fsdp set (as HF); put FSDP options in distributed.fsdp",
    **{name: f"{name} is not supported without report_to trackio; it is ignored"
       for name in ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")},
}
#: Fields that an integration in report_to (or another field) reads: no warning when it is there.
_USED_BY = {"logging_dir": "tensorboard", "trackio_space_id": "trackio", "trackio_bucket_id": "trackio",
            "trackio_static_space_id": "trackio"}
#: HF fields whose other value raytrain cannot honour: refused in one line (what HF does, and what to do here).
REFUSED = {
    "push_to_hub": (False, "the Hugging Face Hub is not supported; the model is saved in output_dir (upload it "
                           "with huggingface_hub's upload_folder)"),
    "include_for_metrics": ([], "not supported; compute_metrics gets EvalPrediction's predictions and label_ids"),
    "eval_do_concat_batches": (True, "false is not supported; predictions are always concatenated across batches"),
    "dataloader_in_order": (True, "false is not supported; batches always come in order (a resume counts them)"),
}
_warned: set[str] = set()

#: HF 5.23's deprecated names of activation checkpointing: one sets the other.
ALIASES = {"gradient_checkpointing": "activation_checkpointing",
           "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}


def _check_installed(name: str) -> None:
    """A report_to name whose library is missing fails here, before any training, naming what to install."""
    if name == "kubeflow":  # transformers' test: it reports to the Kubeflow Trainer job it runs in
        if not os.environ.get("KUBEFLOW_TRAINER_SERVER_URL"):
            raise ValueError("kubeflow needs KUBEFLOW_TRAINER_SERVER_URL (set inside a Kubeflow Trainer job)")
        return
    modules, package = INTEGRATIONS[name]
    missing = [] if any(installed(m) for m in modules) else [package]
    if name not in OWN_INTEGRATIONS and not installed("transformers"):
        missing.append("transformers")  # the callback is transformers'
    if missing == [name]:
        raise ValueError(f"{name} is not installed; pip install {name}")
    if missing:
        raise ValueError(f"{name} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         f"not installed; pip install {' '.join(missing)}")


def warn_noop_fields(args) -> None:
    """Warn once per process for each accepted-but-ignored field set to other than its default."""
    for f in dataclasses.fields(args):
        if f.name not in _HF_NOOP_WARNINGS or f.name in _warned or _USED_BY.get(f.name) in args.report_to:
            continue
        if f.name == "fsdp_config" and args.fsdp:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if getattr(args, f.name) != default:
            _warned.add(f.name)
            logger.warning(_HF_NOOP_WARNINGS[f.name])


def mirror_aliases(changes: dict[str, Any]) -> dict[str, Any]:
    """An assignment to one of a deprecated name and its new name assigns both."""
    out = dict(changes)
    for old, new in ALIASES.items():
        if old in changes and new not in changes:
            out[new] = changes[old]
        elif new in changes and old not in changes:
            out[old] = changes[new]
    return out


class ArgumentRules(StrictModel):
    """The validators of TrainingArguments; the schema model adds the fields from the dataclass."""

    @field_validator("*", mode="before")
    @classmethod
    def _enum_values(cls, v: Any) -> Any:
        return v.value if isinstance(v, Enum) else v  # HF's SchedulerType.COSINE and friends

    @field_validator("logging_strategy", "eval_strategy", "save_strategy", mode="before", check_fields=False)
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false: `save_strategy: no` means "no".
        return "no" if v is False else v

    @field_validator("output_dir", mode="before", check_fields=False)
    @classmethod
    def _default_output_dir(cls, v: Any) -> Any:
        return "trainer_output" if v is None else v

    @field_validator(*REFUSED, check_fields=False)
    @classmethod
    def _refused(cls, v: Any, info) -> Any:
        default, why = REFUSED[info.field_name]
        if v != default and v is not None:
            raise ValueError(why)
        return default if v is None else v

    @field_validator("torch_empty_cache_steps", mode="before", check_fields=False)
    @classmethod
    def _cache_steps(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, int) and v > 0):  # HF's test: 1.0 is refused too
            raise ValueError(f"must be an integer > 0 (the device cache is emptied every N steps), got {show_value(v)}")
        return v

    @field_validator("debug", check_fields=False)
    @classmethod
    def _debug(cls, v: Any) -> list:
        return debug_options(v)

    @field_validator("accelerator_config", mode="before", check_fields=False)
    @classmethod
    def _accelerator_config(cls, v: Any) -> Any:
        return accelerate_config.parse(v)

    @field_validator("eval_delay", mode="before", check_fields=False)
    @classmethod
    def _none_is_zero(cls, v: Any) -> Any:
        return 0 if v is None else v  # HF's set_evaluate(delay=None)

    @field_validator("optim", check_fields=False)
    @classmethod
    def _check_optim(cls, v: Any) -> str:
        v = getattr(v, "value", v)  # transformers' OptimizerNames member
        check_optim(v)
        return v

    @field_validator("optim_args", check_fields=False)
    @classmethod
    def _parse_optim_args(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        pairs = parse_pairs(v)
        if pairs is None:
            raise ValueError(f"expected 'key=value,key2=value2', got {v!r}")
        return pairs

    @field_validator("lr_scheduler_kwargs", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
                     "fsdp_config", "deepspeed", mode="before", check_fields=False)
    @classmethod
    def _parse_json_mapping(cls, v: Any, info) -> Any:
        if isinstance(v, str) and v.strip().startswith("{"):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"expected a mapping or a JSON object, got {show_value(v)} ({e.msg})") from None
        if v is None and info.field_name == "lr_scheduler_kwargs":
            return {}
        return v

    @field_validator("include_num_input_tokens_seen", check_fields=False)
    @classmethod
    def _tokens_seen(cls, v: str | bool) -> str:
        v = {True: "all", False: "no"}.get(v, v) if isinstance(v, bool) else v
        if v not in ("no", "all", "non_padding"):
            raise ValueError(f"must be one of no, all, non_padding (or true/false), got {show_value(v)}")
        return v

    @field_validator("warmup_steps", check_fields=False)
    @classmethod
    def _check_warmup_steps(cls, v: float) -> int | float:
        if v < 0:
            raise ValueError(f"must be >= 0, got {show_number(v)}")
        if v >= 1 and not float(v).is_integer():
            raise ValueError(f"a float must be a ratio in (0, 1), got {v}")
        return int(v) if float(v).is_integer() else v

    @field_validator("warmup_ratio", check_fields=False)
    @classmethod
    def _check_warmup_ratio(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"a float must be a ratio in (0, 1), got {v}")
        return v

    @field_validator("report_to", mode="before", check_fields=False)
    @classmethod
    def _normalize_report_to(cls, v: Any) -> list[str]:
        out: list[str] = []
        for name in [] if v is None else [v] if isinstance(v, str) else v:
            if name == "all":
                out += available_integrations()
            elif name in INTEGRATIONS:
                _check_installed(name)
                out.append(name)
            elif name != "none":
                valid = ", ".join(["none", "all", *INTEGRATIONS])
                raise ValueError(f"must be one of {valid}, got {name!r}")
        return list(dict.fromkeys(out))

    @model_validator(mode="after")
    def _check_combinations(self):
        # Derived defaults go through __dict__: assigning would re-run this validator.
        self._resolve_aliases()
        derived.apply(self)  # HF's __post_init__: derived values and its refusals
        self._apply_hf_backends()

        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ConfigError("max_steps and num_train_epochs: set max_steps > 0 or num_train_epochs > 0")
        if self.warmup_steps and self.warmup_ratio:
            raise ConfigError(
                f"warmup_steps and warmup_ratio: set only one "
                f"(got warmup_steps={self.warmup_steps}, warmup_ratio={self.warmup_ratio})"
            )
        if self.fp16 and self.bf16:
            raise ConfigError("fp16 and bf16: set only one of them")
        if self.fp16 and not self.scaling.use_gpu:
            import torch

            if not torch.cuda.is_available() or self.use_cpu:
                raise ConfigError("fp16 requires a CUDA GPU (none found and scaling.use_gpu is false); use bf16 on CPU")
        self._check_parallelism()
        self._check_elastic_batch()
        if self.optim in LOW_RANK and self.optim_target_modules is None:
            raise ConfigError(f"optim_target_modules: {self.optim} projects the weights of these modules; set it "
                              f"(a list of module names, a regex or 'all-linear')")
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ConfigError("save_strategy='best': `args.metric_for_best_model` must be provided when using 'best' "
                              "save_strategy or if `args.load_best_model_at_end` is set to `True`")
        if self.load_best_model_at_end:
            self._check_load_best()
        return self

    def _check_elastic_batch(self) -> None:
        """An elastic group keeps the global batch of its largest size at every size it may take."""
        scaling, per_device, accum = self.scaling, self.per_device_train_batch_size, self.gradient_accumulation_steps
        bad = scaling.sizes_without_batch(per_device, accum)
        if bad:
            total = per_device * scaling.num_workers * accum
            raise ConfigError(
                f"scaling.num_workers: [{scaling.min_workers}, {scaling.num_workers}] cannot keep the global batch "
                f"of {total} (per_device_train_batch_size x {scaling.num_workers} workers x "
                f"gradient_accumulation_steps) at {', '.join(map(str, bad))} worker(s): neither "
                "gradient_accumulation_steps nor per_device_train_batch_size divides evenly there; "
                "narrow the range or pick a global batch that every size divides")

    def _check_parallelism(self) -> None:
        """parallelism_config normalised to a dict of sizes and checked against the world size and backend."""
        from ..strategies.mesh import ParallelDims, normalize

        try:
            sizes = normalize(self.parallelism_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if sizes is None:
            return
        self.__dict__["parallelism_config"] = sizes
        scaling, dist = self.scaling, self.distributed
        if sizes["cp_size"] > 1 and not scaling.use_gpu:  # first: on CPU, whatever the other sizes
            raise ConfigError(f"parallelism_config.cp_size: context parallelism needs CUDA (torch's ring attention has "
                              f"no CPU kernel); on CPU and gloo split the sequence with sp_size (DeepSpeed Ulysses), got "
                              f"cp_size {sizes['cp_size']}")
        try:
            dims = ParallelDims.resolve(sizes, scaling.num_workers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name, size in (("pp_size", dims.pp), ("tp_size", dims.tp), ("sp_size", dims.sp), ("cp_size", dims.cp)):
            if size > 1 and scaling.elastic:
                raise ConfigError(f"parallelism_config.{name}: {size} with an elastic scaling.num_workers range "
                                  f"is not supported; fix num_workers or set {name} 1")
        if dims.pp > 1 and dist.strategy in ("ddp", "deepspeed"):
            raise ConfigError(f"parallelism_config.pp_size: pipeline stages need distributed.strategy fsdp (or "
                              f"auto), not {dist.strategy}")
        if dims.cp > 1 and dist.strategy in ("ddp", "deepspeed"):
            raise ConfigError(f"parallelism_config.cp_size: context parallelism needs distributed.strategy fsdp (or "
                              f"auto: FSDP2, as torchtitan), not {dist.strategy}")
        try:
            dims.check_batch(self.per_device_train_batch_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if dist.strategy == "deepspeed" and (dims.tp > 1 or dims.dp_replicate > 1):
            raise ConfigError("parallelism_config: tp_size / dp_replicate_size > 1 need distributed.strategy fsdp "
                              "(FSDP2), not deepspeed (ZeRO shards over every rank)")
        if dist.strategy == "ddp" and (dims.tp > 1 or dims.dp_replicate > 1):
            raise ConfigError("parallelism_config: tp_size / dp_replicate_size > 1 need distributed.strategy fsdp "
                              "(or auto), not ddp")
        if dist.strategy == "auto" and (dims.tp > 1 or dims.dp_replicate > 1 or dims.pp > 1 or dims.cp > 1):
            self.__dict__["distributed"] = type(dist).model_validate({**dist.model_dump(), "strategy": "fsdp"})
        elif dist.strategy == "auto" and dims.sp > 1:  # HF's: ALST runs on DeepSpeed (ddp and fsdp split it too)
            self.__dict__["distributed"] = type(dist).model_validate({**dist.model_dump(), "strategy": "deepspeed"})

    def _resolve_aliases(self) -> None:
        """As HF 5.23: a deprecated name is used only when its new name is unset; then both agree."""
        for old, new in ALIASES.items():
            if getattr(self, new) is None and getattr(self, old) is not None:
                deprecated_alias(old, new)
                self.__dict__[new] = getattr(self, old)
            self.__dict__[old] = getattr(self, new)
        if self.activation_checkpointing is None:
            self.__dict__["activation_checkpointing"] = self.__dict__["gradient_checkpointing"] = False

    def _apply_hf_backends(self) -> None:
        """HF's top-level `deepspeed` / `fsdp` switches select our distributed backend; fsdp_config (read by
        transformers' own code) becomes distributed.fsdp's options."""
        dist = self.distributed
        if self.fsdp and dist.strategy in ("auto", "fsdp") and not self.deepspeed:
            self._apply_fsdp()
            return
        if dist.strategy != "auto" or not (self.deepspeed or self.fsdp):
            return
        update = ({"strategy": "deepspeed", "deepspeed": dist.deepspeed or self.deepspeed} if self.deepspeed
                  else {"strategy": "fsdp"})
        # a new section, validated as any other; __dict__ as above, to not re-run this validator
        self.__dict__["distributed"] = type(dist).model_validate({**dist.model_dump(), **update})

    def _apply_fsdp(self) -> None:
        dist = self.distributed
        if installed("transformers"):
            from ..hf.fsdp_args import fsdp_options

            try:
                config, options = fsdp_options(self.fsdp, self.fsdp_config, self.activation_checkpointing)
            except ValueError as e:
                raise ConfigError(str(e) if str(e).startswith("fsdp") else f"fsdp: {e}") from None
            self.__dict__.update(fsdp=True, fsdp_config=config)
        elif self.fsdp_config:
            raise ConfigError("fsdp_config: transformers reads it, and it is not installed; put the options in "
                              "distributed.fsdp")
        else:
            options = {}
        update = {"strategy": "fsdp", "fsdp": {**options, **dist.fsdp}}  # distributed.fsdp's own win
        self.__dict__["distributed"] = type(dist).model_validate({**dist.model_dump(), **update})

    def _check_load_best(self) -> None:
        if self.eval_strategy == "no":
            raise ConfigError("load_best_model_at_end requires eval_strategy 'steps' or 'epoch' (got eval_strategy='no')")
        if self.save_strategy not in (self.eval_strategy, "best"):
            raise ConfigError(
                f"load_best_model_at_end requires save_strategy to match eval_strategy "
                f"(got save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r})"
            )
        if self.save_strategy != "steps":
            return
        save, ev = self.save_steps, self.eval_steps
        if (save < 1) != (ev < 1):
            raise ConfigError(
                f"load_best_model_at_end requires save_steps ({show_number(save)}) and eval_steps ({show_number(ev)}) "
                f"to be both step counts or both ratios"
            )
        quotient = save / ev
        if not math.isclose(quotient, round(quotient), rel_tol=1e-9):
            raise ConfigError(
                f"load_best_model_at_end requires save_steps ({show_number(save)}) to be a multiple of eval_steps ({show_number(ev)})"
            )
