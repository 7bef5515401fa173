"""TrainingArguments and its nested sections: the one validated description of a run.

Field names and defaults follow Hugging Face transformers' TrainingArguments. Every
validation failure is a single-line ConfigError naming the field and what would be right.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import re
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SUPPORTED_INTEGRATIONS = ["mlflow"]
_NUMERIC = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ConfigError(ValueError):
    """A configuration problem, described in one line."""


class _Config(BaseModel):
    """Base of every config model: pydantic's errors become one-line ConfigErrors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(_first_error(type(self), e)) from None

    # Same as BaseModel.__init__ to pydantic, so nested sections validate without it.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        forbid = self.model_config.get("extra") == "forbid"
        if forbid and not name.startswith("_") and name not in type(self).model_fields:
            raise ConfigError(_unknown_field(type(self), name))
        before = dict(self.__dict__)
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            self.__dict__.update(before)  # pydantic leaves the failed value in place
            raise ConfigError(_first_error(type(self), e)) from None


class _FactorySection(_Config):
    """A section whose extra keys are keyword arguments for its factory."""

    model_config = ConfigDict(extra="allow")

    @property
    def kwargs(self) -> dict[str, Any]:
        """The extra keys, passed to the factory as keyword arguments."""
        return dict(self.model_extra or {})

    @field_validator("factory", "collator", "compute_metrics", check_fields=False)
    @classmethod
    def _check_import_string(cls, value: str | None) -> str | None:
        if value is not None and not _IMPORT_STRING.match(value):
            raise ValueError(f"expected an import string 'package.module:function', got {value!r}")
        return value


class ModelConfig(_FactorySection):
    """How to build the model: factory(**kwargs)."""

    factory: str = Field(description="import string 'package.module:function' that builds the model")


class DataConfig(_FactorySection):
    """Where the datasets, collator and metrics come from."""

    factory: str | None = Field(None, description="import string of a function returning the datasets")
    collator: str | None = Field(None, description="import string of the batch collator")
    compute_metrics: str | None = Field(
        None, description="import string of compute_metrics(EvalPrediction) -> dict"
    )


class ScalingConfig(_Config):
    """How many Ray Train workers and what each one gets."""

    num_workers: int = Field(1, ge=1, description="number of training workers (processes)")
    use_gpu: bool = Field(False, description="give each worker a GPU")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="Ray resources per worker, e.g. {CPU: 4, GPU: 1}"
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how Ray places the workers on nodes"
    )
    max_failures: int = Field(
        0, ge=-1, description="restarts from the last checkpoint after a worker failure; -1 retries forever"
    )
    storage_path: str | None = Field(None, description="where Ray stores checkpoints and results (local path or URI)")


class DistributedConfig(_Config):
    """Which distributed backend wraps the model, and its options."""

    strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field(
        "auto", description="distributed backend; auto picks ddp for several workers, else single process"
    )
    fsdp: dict[str, Any] = Field(default_factory=dict, description="FSDP options (free-form)")
    deepspeed: dict[str, Any] | str | None = Field(
        None, description="DeepSpeed config as a mapping or a path to a JSON file"
    )


_Steps = Literal["no", "steps", "epoch"]


class TrainingArguments(_Config):
    """Everything a run needs, validated once at the edge; names and defaults as in HF."""

    output_dir: str = Field("trainer_output", description="where checkpoints and logs are written")
    overwrite_output_dir: bool = Field(False, description="allow writing into a non-empty output_dir")
    num_train_epochs: float = Field(3.0, description="epochs to train (used when max_steps <= 0)")
    max_steps: int = Field(-1, description="total optimizer steps; > 0 overrides num_train_epochs")
    per_device_train_batch_size: int = Field(8, ge=1, description="training batch size per worker")
    per_device_eval_batch_size: int = Field(8, ge=1, description="evaluation batch size per worker")
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    learning_rate: float = Field(5e-5, ge=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2")
    adam_epsilon: float = Field(1e-8, ge=0, description="Adam epsilon")
    max_grad_norm: float | None = Field(1.0, ge=0, description="gradient clipping norm; null or 0 disables")
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd", "adafactor"] = Field(
        "adamw_torch", description="optimizer"
    )
    optim_args: dict[str, Any] | str | None = Field(
        None, description="extra optimizer arguments, a mapping or 'k=v,k2=v2'"
    )
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
        "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau", "warmup_stable_decay",
    ] = Field("linear", description="learning-rate schedule")
    lr_scheduler_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra schedule arguments")
    warmup_steps: int | float = Field(
        0, description="warmup: an int is a step count, a float in (0, 1) a ratio of total steps"
    )
    warmup_ratio: float = Field(0.0, description="warmup as a ratio of total steps (HF compatibility)")
    logging_strategy: _Steps = Field("steps", description="when to log")
    logging_steps: float = Field(500, gt=0, description="log every N steps; a float < 1 is a ratio of total steps")
    logging_first_step: bool = Field(False, description="also log after the first step")
    eval_strategy: _Steps = Field("no", description="when to evaluate")
    eval_steps: float | None = Field(
        None, gt=0, description="evaluate every N steps (ratio if < 1); defaults to logging_steps"
    )
    save_strategy: Literal["no", "steps", "epoch", "best"] = Field("steps", description="when to checkpoint")
    save_steps: float = Field(500, gt=0, description="checkpoint every N steps; a float < 1 is a ratio of total steps")
    save_total_limit: int | None = Field(None, ge=1, description="keep at most this many checkpoints (best is kept)")
    load_best_model_at_end: bool = Field(False, description="load the best checkpoint when training ends")
    metric_for_best_model: str | None = Field(
        None, description="metric that ranks checkpoints; 'loss' when load_best_model_at_end"
    )
    greater_is_better: bool | None = Field(
        None, description="whether a larger metric is better; if unset, false for *loss metrics, else true"
    )
    seed: int = Field(42, ge=0, description="random seed set at the start of training")
    data_seed: int | None = Field(None, ge=0, description="seed for data shuffling; defaults to seed")
    full_determinism: bool = Field(False, description="use deterministic algorithms (slower)")
    bf16: bool = Field(False, description="bfloat16 mixed precision")
    fp16: bool = Field(False, description="float16 mixed precision with loss scaling (CUDA only)")
    gradient_checkpointing: bool = Field(False, description="recompute activations to save memory")
    torch_compile: bool = Field(False, description="compile the model with torch.compile")
    dataloader_drop_last: bool = Field(False, description="drop the last incomplete batch")
    logging_nan_inf_filter: bool = Field(True, description="leave nan/inf losses out of the logged mean")
    skip_memory_metrics: bool = Field(True, description="skip memory profiling metrics")
    auto_find_batch_size: bool = Field(False, description="halve the batch size on out-of-memory and retry")
    report_to: str | list[str] = Field(
        "none", validate_default=True, description="integrations to report to: none, all, or mlflow"
    )
    run_name: str | None = Field(None, description="name of the run in the tracking integration")
    disable_tqdm: bool = Field(False, description="hide progress bars")
    save_async: bool = Field(False, description="write checkpoints in a background thread")
    max_nonfinite_steps: int = Field(
        3, ge=0, description="consecutive steps skipped for non-finite gradients before the run fails"
    )
    save_only_model: bool = Field(False, description="checkpoint only the model (cannot resume training)")
    ignore_data_skip: bool = Field(
        False, description="on resume, accept a changed batch size, accumulation or dataset length and restart "
                           "the saved epoch from its first batch (an unchanged run always continues exactly)")

    model: ModelConfig | None = Field(None, description="model section: factory plus its keyword arguments")
    data: DataConfig | None = Field(None, description="data section: factory plus its keyword arguments")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="workers and resources")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="distributed backend")

    @field_validator("logging_strategy", "eval_strategy", "save_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false: `save_strategy: no` means "no".
        return "no" if v is False else v

    @field_validator("optim_args")
    @classmethod
    def _parse_optim_args(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        out = {}
        for item in filter(None, (s.strip() for s in v.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"expected 'key=value,key2=value2', got {v!r}")
            out[key.strip()] = _parse_scalar(value.strip())
        return out

    @field_validator("warmup_steps")
    @classmethod
    def _check_warmup_steps(cls, v: int | float) -> int | float:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        if isinstance(v, float):
            if v >= 1 and v.is_integer():
                return int(v)
            if v >= 1:
                raise ValueError(f"a float must be a ratio in (0, 1), got {v}")
            if v == 0:
                return 0
        return v

    @field_validator("warmup_ratio")
    @classmethod
    def _check_warmup_ratio(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"a float must be a ratio in (0, 1), got {v}")
        return v

    @field_validator("logging_steps", "eval_steps", "save_steps")
    @classmethod
    def _check_steps(cls, v: float | None) -> float | None:
        if v is not None and v >= 1 and not float(v).is_integer():
            raise ValueError(f"must be an integer step count or a ratio < 1, got {v}")
        return v

    @field_validator("report_to")
    @classmethod
    def _normalize_report_to(cls, v: str | list[str]) -> list[str]:
        out: list[str] = []
        for name in [v] if isinstance(v, str) else v:
            if name == "all":
                out += SUPPORTED_INTEGRATIONS
            elif name in SUPPORTED_INTEGRATIONS:
                out.append(name)
            elif name != "none":
                valid = ", ".join(["none", "all", *SUPPORTED_INTEGRATIONS])
                raise ValueError(f"must be one of {valid}, got {name!r}")
        return list(dict.fromkeys(out))

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainingArguments:
        # Derived defaults go through __dict__: assigning would re-run this validator.
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.__dict__["eval_steps"] = self.logging_steps
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.__dict__["metric_for_best_model"] = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.__dict__["greater_is_better"] = not self.metric_for_best_model.endswith("loss")

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

            if not torch.cuda.is_available():
                raise ConfigError("fp16 requires a CUDA GPU (none found and scaling.use_gpu is false); use bf16 on CPU")
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ConfigError("save_strategy='best' requires metric_for_best_model to be set")
        if self.load_best_model_at_end:
            self._check_load_best()
        return self

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
                f"load_best_model_at_end requires save_steps ({_num(save)}) and eval_steps ({_num(ev)}) "
                f"to be both step counts or both ratios"
            )
        quotient = save / ev
        if not math.isclose(quotient, round(quotient), rel_tol=1e-9):
            raise ConfigError(
                f"load_best_model_at_end requires save_steps ({_num(save)}) to be a multiple of eval_steps ({_num(ev)})"
            )

    # --- derived values ---------------------------------------------------------------

    @property
    def train_batch_size(self) -> int:
        """Batch size per worker for training (HF: per device)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Batch size per worker for evaluation."""
        return self.per_device_eval_batch_size

    @property
    def world_size(self) -> int:
        return self.scaling.num_workers

    @property
    def should_use_distributed(self) -> bool:
        return self.scaling.num_workers > 1

    def resolve_steps(self, max_steps: int) -> tuple[int, int, int]:
        """(logging_steps, eval_steps, save_steps) as ints; ratios become ceil(max_steps * ratio)."""

        def resolve(v: float) -> int:
            return math.ceil(max_steps * v) if v < 1 else int(v)

        eval_steps = self.eval_steps if self.eval_steps is not None else self.logging_steps
        return resolve(self.logging_steps), resolve(eval_steps), resolve(self.save_steps)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup step count: warmup_steps if a count, else ceil(ratio * num_training_steps)."""
        if isinstance(self.warmup_steps, int) and self.warmup_steps > 0:
            return self.warmup_steps
        ratio = self.warmup_steps or self.warmup_ratio
        return math.ceil(ratio * num_training_steps)

    # --- (de)serialization -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingArguments:
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a mapping of fields, got {type(d).__name__}")
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise ConfigError(_first_error(cls, e)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> TrainingArguments:
        """Read a YAML config, apply "dotted.key=value" overrides, then validate."""
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {os.fspath(path)!r}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            what = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"invalid YAML in {os.fspath(path)}{where}: {what}") from None
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError(f"{os.fspath(path)}: top level must be a mapping of fields, got {type(d).__name__}")
        return cls.from_dict(apply_overrides(d, overrides or []))


# --- overrides and help ----------------------------------------------------------------


def _parse_scalar(text: str) -> Any:
    """A YAML value; numeric strings YAML leaves alone ("3e-4") become floats."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _NUMERIC.match(value.strip()):
        return float(value)
    return value


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of d with each "a.b.c=value" applied, creating nested sections as needed."""
    out = copy.deepcopy(d)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.strip().split(".")
        node = out
        for i, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                section = ".".join(parents[: i + 1])
                raise ConfigError(f"--set {item!r}: {section!r} is not a section (it is {node[part]!r})")
            node = node[part]
        node[leaf] = _parse_scalar(value)
    return out


_SECTIONS: dict[str, type[_Config]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "scaling": ScalingConfig,
    "distributed": DistributedConfig,
}


def _field_names() -> list[str]:
    names = list(TrainingArguments.model_fields)
    for section, model in _SECTIONS.items():
        names += [f"{section}.{n}" for n in model.model_fields]
    return names


def _show(value: Any) -> str:
    """A default as the user would write it in YAML."""
    return value if isinstance(value, str) else json.dumps(value)


def cli_help() -> str:
    """One line per field, nested sections as dotted names, for the CLI's --help."""
    rows = []
    for name in _field_names():
        section, _, leaf = name.rpartition(".")
        if not section and name in _SECTIONS:
            continue
        info = (_SECTIONS[section] if section else TrainingArguments).model_fields[leaf]
        text = info.description or ""
        if get_origin(info.annotation) is Literal:
            text += f" (one of: {', '.join(map(str, get_args(info.annotation)))})"
        if info.is_required():
            rows.append((name, f"{text} (required)"))
        else:
            rows.append((name, f"{text} (default: {_show(info.get_default(call_default_factory=True))})"))
    rows += [(f"{s}.<key>", f"any other key is passed to the {s} factory as a keyword argument") for s in ("model", "data")]
    width = max(len(n) for n, _ in rows) + len("=VALUE")
    return "\n".join(f"  --set {n + '=VALUE':<{width}}   {t}" for n, t in rows)


# --- error translation -----------------------------------------------------------------

_EXPECTED = {
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
    "float_parsing": "a number", "float_type": "a number",
    "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def _value(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _num(v: float | None) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _unknown_field(root: type[BaseModel], name: str) -> str:
    names = _field_names() if root is TrainingArguments else list(root.model_fields)
    match = difflib.get_close_matches(name, names, n=1)
    if match:
        return f"unknown field {name!r}: did you mean {match[0]!r}?"
    return f"unknown field {name!r} (see --help for valid fields)"


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and get_origin(annotation) is None and issubclass(annotation, BaseModel)


def _path(root: type[BaseModel], loc: tuple) -> list[str]:
    """The field names in loc, dropping pydantic's union-member tags and dict keys."""
    parts, model = [], root
    for item in loc:
        if model is None or item not in model.model_fields:
            break
        parts.append(item)
        ann = model.model_fields[item].annotation
        model = next((a for a in (ann, *get_args(ann)) if _is_model(a)), None)
    return parts


def _first_error(root: type[BaseModel], exc: ValidationError) -> str:
    """pydantic's first error as one line: 'FIELD: must be/expected ..., got VALUE'."""
    errors = exc.errors()
    err = errors[0]
    kind, ctx = err["type"], err.get("ctx", {})
    parts = _path(root, err["loc"])
    if kind == "extra_forbidden":
        return _unknown_field(root, ".".join([*parts, str(err["loc"][-1])]))
    field = ".".join(parts) or "config"
    if kind == "value_error":
        cause = ctx.get("error")
        return str(cause) if isinstance(cause, ConfigError) else f"{field}: {cause}"
    if kind == "missing":
        return f"{field}: must be set"
    if kind == "literal_error":
        choices = ", ".join(re.findall(r"'([^']*)'", ctx["expected"]))
        return f"{field}: must be one of {choices}, got {_value(err['input'])}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = _num(next(iter(ctx.values())))
        return f"{field}: must be {bounds[kind]} {limit}, got {_value(err['input'])}"
    # A union fails once per member: list every expected type at this field.
    same = [e for e in errors if _path(root, e["loc"]) == parts]
    expected = list(dict.fromkeys(_EXPECTED.get(e["type"], e["msg"].lower()) for e in same))
    if "a number" in expected and "an integer" in expected:
        expected.remove("an integer")
    return f"{field}: expected {' or '.join(expected)}, got {_value(err['input'])}"
