"""Configuration machinery: ConfigError, the pydantic base whose errors are one line, the
TrainingArguments sections (model, data, scaling, distributed), YAML-typed overrides, and the
translation of pydantic's errors into 'FIELD: must be ..., got VALUE'."""

from __future__ import annotations

import copy
import importlib
import difflib
import json
import re
from typing import Any, Callable, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_NUMERIC = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ConfigError(ValueError):
    """A configuration problem, described in one line."""


class StrictModel(BaseModel):
    """Base of every config model: pydantic's errors become one-line ConfigErrors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, __text: str | None = None, **data: Any) -> None:
        if __text is not None:  # a section from a command line (HfArgumentParser): 'k=v,k2=v2' or JSON
            data = {**_parse_section_text(type(self), __text), **data}
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(_first_error(type(self), e)) from None

    # Same as BaseModel.__init__ to pydantic, so nested sections validate without it.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        forbid = self.model_config.get("extra") == "forbid"
        if forbid and not name.startswith("_") and name not in type(self).model_fields:
            raise ConfigError(unknown_field_message(type(self), name))
        before = dict(self.__dict__)
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            self.__dict__.update(before)  # pydantic leaves the failed value in place
            raise ConfigError(_first_error(type(self), e)) from None


class _FactorySection(StrictModel):
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


class ScalingConfig(StrictModel):
    """How many Ray Train workers and what each one gets."""

    num_workers: int | tuple[int, int] = Field(
        1, description="number of training workers (processes); [min, max]: an elastic group that Ray resizes "
        "between min and max workers (then num_workers reads max, min_workers min)")
    min_workers: int | None = Field(
        None, description="the smallest elastic group, set by num_workers: [min, max]; none: a fixed size")
    resize_interval_s: float = Field(
        60.0, ge=0, description="elastic groups: seconds between Ray's checks whether the group can grow")
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
    max_preemption_failures: int = Field(
        -1, ge=-1, description="restarts after a node preemption that Ray announced (a drained spot node: "
        "the workers save a checkpoint and stop), counted apart from max_failures; -1 retries forever")
    storage_path: str | None = Field(None, description="where Ray stores checkpoints and results (local path or URI)")
    max_wait_s: float | None = Field(
        None, gt=0, description="the longest the run waits for its workers (at start, or to restart after a "
        "failure) before it ends in one line, its checkpoints kept for --resume; none: wait as long as it takes")

    @field_validator("num_workers", mode="before")
    @classmethod
    def _check_num_workers(cls, v: Any) -> Any:
        whole = lambda n: isinstance(n, int) and not isinstance(n, bool)  # noqa: E731
        if whole(v) and v >= 1:
            return v
        if whole(v):
            raise ValueError(f"must be >= 1, got {v}")
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(map(whole, v)) and 1 <= v[0] <= v[1]:
            return tuple(v)
        raise ValueError("expected an integer >= 1 or [min, max] with 1 <= min <= max, got "
                         f"{show_value(list(v) if isinstance(v, tuple) else v)}")

    @model_validator(mode="after")
    def _split_range(self) -> ScalingConfig:
        # num_workers holds the most workers (what every `num_workers > 1` check means), min_workers the least.
        if isinstance(self.num_workers, tuple):
            low, high = self.num_workers
            self.__dict__.update(num_workers=high, min_workers=low)
        if self.min_workers is not None and not 1 <= self.min_workers <= self.num_workers:
            raise ConfigError(f"scaling.num_workers: [min, max] needs 1 <= min <= max, got "
                              f"[{self.min_workers}, {self.num_workers}]")
        return self

    @property
    def elastic(self) -> bool:
        """Whether Ray may resize the group (min_workers < num_workers)."""
        return self.min_workers is not None and self.min_workers < self.num_workers

    def batch_at(self, world_size: int, per_device: int, accumulation: int) -> tuple[int, int] | None:
        """(per_device_train_batch_size, gradient_accumulation_steps) at `world_size` workers that keep the
        global batch of num_workers (max) workers: the accumulation changed if it divides, else the per-device
        batch; None if neither divides."""
        total = per_device * self.num_workers * accumulation
        if total % (per_device * world_size) == 0:
            return per_device, total // (per_device * world_size)
        if total % (world_size * accumulation) == 0:
            return total // (world_size * accumulation), accumulation
        return None

    def sizes_without_batch(self, per_device: int, accumulation: int) -> list[int]:
        """The world sizes of the elastic range at which the global batch cannot be kept."""
        if not self.elastic:
            return []
        return [w for w in range(self.min_workers, self.num_workers + 1)
                if self.batch_at(w, per_device, accumulation) is None]


class RolloutConfig(StrictModel):
    """An asynchronous RL trainer's rollout workers (AsyncGRPOTrainer): Ray actors named raytrain-rollout-<i> that
    generate and score completions ahead of training."""

    num_workers: int = Field(1, ge=0, description="rollout actors; 0: completions generated in the trainer's "
                             "process (rank 0), one group at a time")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved for each rollout actor; its torch "
                                       "threads (whole CPUs, at least 1; the same in the trainer's process with 0 "
                                       "actors, so that every choice gives the same completions)")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="GPUs for each rollout actor (it generates on the "
                                       "GPU when it has one)")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="other Ray resources each rollout actor needs, e.g. a node type's custom resource")
    groups_per_call: int | None = Field(
        None, ge=1, description="prompt groups generated together in one generate() call (one actor's task); none: "
                                "a step's groups. Fixed, not sized to the actors, so the completions do not "
                                "depend on how many there are; smaller spreads a step over more actors")


class DistributedConfig(StrictModel):
    """Which distributed backend wraps the model, and its options."""

    strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field(
        "auto", description="distributed backend; auto picks ddp for several workers, else single process"
    )
    fsdp: dict[str, Any] = Field(default_factory=dict, description="FSDP options (free-form)")
    deepspeed: dict[str, Any] | str | None = Field(
        None, description="DeepSpeed config as a mapping or a path to a JSON file"
    )


def _parse_section_text(cls: type, text: str) -> dict[str, Any]:
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cls.__name__}: expected 'key=value,key2=value2' or a JSON object, got "
                              f"{show_value(text)} ({e.msg})") from None
        if isinstance(value, dict):
            return value
    pairs = parse_pairs(text)
    if pairs is None:
        raise ConfigError(f"{cls.__name__}: expected 'key=value,key2=value2' or a JSON object, got {show_value(text)}")
    return pairs


def parse_pairs(text: str) -> dict[str, Any] | None:
    """'k=v,k2=v2' as a mapping with YAML-typed values; None when it is not of that form."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            return None
        out[key.strip()] = parse_scalar(value.strip())
    return out


# --- overrides ---------------------------------------------------------------------------


def parse_scalar(text: str) -> Any:
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
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r} (write --set {key.strip() or 'KEY'}=VALUE)")
        *parents, leaf = key.strip().split(".")
        node = out
        for i, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                section = ".".join(parents[: i + 1])
                raise ConfigError(f"--set {item!r}: {section!r} is not a section (it is {node[part]!r})")
            node = node[part]
        node[leaf] = parse_scalar(value)
    return out


# --- error translation -----------------------------------------------------------------

_EXPECTED = {
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
    "float_parsing": "a number", "float_type": "a number",
    "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def show_value(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def show_number(v: float | None) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def unknown_field_message(root: type[BaseModel], name: str) -> str:
    # TrainingArguments' schema offers every dotted name (sections included) to match against.
    names = root.field_names() if hasattr(root, "field_names") else list(root.model_fields)
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
        return unknown_field_message(root, ".".join([*parts, str(err["loc"][-1])]))
    field = ".".join(parts) or "config"
    if kind == "value_error":
        cause = ctx.get("error")
        return str(cause) if isinstance(cause, ConfigError) else f"{field}: {cause}"
    if kind == "missing":
        return f"{field}: must be set"
    if kind == "literal_error":
        choices = ", ".join(re.findall(r"'([^']*)'", ctx["expected"]))
        return f"{field}: must be one of {choices}, got {show_value(err['input'])}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = show_number(next(iter(ctx.values())))
        return f"{field}: must be {bounds[kind]} {limit}, got {show_value(err['input'])}"
    # A union fails once per member: list every expected type at this field.
    same = [e for e in errors if _path(root, e["loc"]) == parts]
    expected = list(dict.fromkeys(_EXPECTED.get(e["type"], e["msg"].lower()) for e in same))
    if "a number" in expected and "an integer" in expected:
        expected.remove("an integer")
    return f"{field}: expected {' or '.join(expected)}, got {show_value(err['input'])}"


#: The extra of raytrain that installs each optional package a factory may need.
EXTRAS = {"peft": "peft", "trl": "trl", "transformers": "hf", "datasets": "hf", "accelerate": "hf",
          "tokenizers": "hf", "deepspeed": "deepspeed"}


def missing_package(error: ModuleNotFoundError, field: str, path: str) -> ConfigError | None:
    """A factory's missing optional package as one line naming the pip extra that installs it."""
    package = (error.name or "").split(".")[0]
    if package not in EXTRAS:
        return None
    return ConfigError(f"{field}: {path} needs {package}, which is not installed; "
                       f"pip install \"raytrain[{EXTRAS[package]}]\" (or pip install -e \".[{EXTRAS[package]}]\")")


def import_string(path: str, field: str) -> Callable:
    """'package.module:attr' -> the object; a ConfigError naming `field` if it cannot be found."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise missing_package(e, field, path) or ConfigError(
            f"{field}: cannot import module {module_name!r} ({e})") from None
    except ImportError as e:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({e})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr!r}") from None
