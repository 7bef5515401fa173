"""TRL's SFTTrainer / SFTConfig, DPOTrainer / DPOConfig, GRPOTrainer / GRPOConfig, RLOOTrainer / RLOOConfig and
AsyncGRPOTrainer / AsyncGRPOConfig (trl.experimental.async_grpo's) on raytrain's Trainer: a TRL 1.16 script runs
with `from trl import ...` changed to `from raytrain.trl import ...` (needs the trl extra)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config.args import ConfigError, TrainingArguments
from .config.sections import RolloutConfig
from .driver.rollout import RayRolloutPool
from .hf.trl import config as _trl
from .hf.trl.async_grpo import AsyncGRPOMethods
from .hf.trl.dpo import DPOMethods
from .hf.trl.grpo import GRPOMethods
from .hf.trl.rloo import RLOOMethods
from .hf.trl.sft import SFTMethods
from .trainer import Trainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "RLOOConfig",
           "RLOOTrainer", "SFTConfig", "SFTTrainer"]

_BASE = {f.name for f in dataclasses.fields(TrainingArguments)}


def _post_init(kind: str, own: tuple[str, ...]):
    normalize = {"sft": _trl.normalize_sft, "dpo": _trl.normalize_dpo, "grpo": _trl.normalize_grpo,
                 "rloo": _trl.normalize_grpo, "async_grpo": _rollout_section}[kind]
    settle = {"grpo": _trl.settle_grpo, "rloo": _trl.settle_grpo, "async_grpo": _settle_async}.get(kind)

    def __post_init__(self) -> None:
        try:
            if self.bf16 is None:  # TRL's default: bf16 unless fp16 (autocast on the CPU too)
                object.__setattr__(self, "bf16", not self.fp16)
            normalize(self)  # first: deprecated names (bfd-requeue) become current ones
            _trl.check_choices(self, own)
            TrainingArguments.__post_init__(self)
            if settle is not None:  # after: it needs the checked batch sizes and the world size
                settle(self)
                if kind != "async_grpo":
                    _trl.refuse_config(self, kind.upper())
            if (self.parallelism_config or {}).get("pp_size", 1) > 1:
                raise ConfigError(f"parallelism_config.pp_size: pipeline parallelism is not supported by "
                                  f"raytrain.trl's {kind.upper()}Trainer (TRL's loss needs the whole model's outputs on one rank); "
                                  "set pp_size 1 (FSDP2 or ZeRO-3 shard the model instead)")
            if kind != "sft" and (self.parallelism_config or {}).get("sp_size", 1) > 1:  # as TRL's own configs
                raise ConfigError(f"parallelism_config.sp_size: sequence parallelism is not supported by raytrain.trl's "
                                  f"{kind.upper()}Trainer (its inputs are built inside the trainer); set sp_size 1")
        except ConfigError:
            raise
        except ValueError as e:  # TRL's checks are configuration errors too (the CLI's exit 2)
            raise ConfigError(str(e)) from None
    return __post_init__


# GRPO / RLOO: the reward functions by import string, for the CLI (TRL's `trl grpo` takes them as a script argument;
# a Python script passes reward_funcs= to the trainer, as with trl)
_REWARD_FUNCS = ("reward_funcs", list[str] | None, dataclasses.field(default=None, metadata={
    "help": "Reward functions for the CLI, as import strings 'package.module:function' (TRL's signature: "
            "prompts, completions, completion_ids, the dataset's other columns, trainer_state). raytrain's; "
            "a Python script passes reward_funcs= to the trainer instead."}))


# AsyncGRPO: its rollout actors, a section like `scaling`
_ROLLOUT = ("rollout", RolloutConfig, dataclasses.field(default_factory=RolloutConfig, metadata={
    "help": "AsyncGRPOTrainer's rollout workers: num_workers Ray actors (0: in the trainer's process), "
            "num_cpus_per_worker, num_gpus_per_worker, resources_per_worker. raytrain's."}))


def _rollout_section(args: Any) -> None:
    """The rollout section as a RolloutConfig (a mapping, or 'k=v,...' text from a command line), checked."""
    value = args.rollout
    if not isinstance(value, RolloutConfig):
        try:
            value = RolloutConfig(value) if isinstance(value, str) else RolloutConfig(**dict(value or {}))
        except ConfigError as e:
            raise ConfigError(f"rollout.{e}" if not str(e).startswith("unknown") else str(e)) from None
        object.__setattr__(args, "rollout", value)


def _settle_async(args: Any) -> None:
    if args.scaling.min_workers is not None:
        raise ConfigError("scaling.num_workers: an elastic group is not supported by AsyncGRPOTrainer (the schedule "
                          "holds the samples of a step for a fixed number of ranks); give one number")
    _trl.settle_async(args)


def _config(name: str, kind: str) -> type:
    own = _trl.trl_field_names(kind, _BASE)
    extra = [_REWARD_FUNCS] if kind in ("grpo", "rloo") else [_REWARD_FUNCS, _ROLLOUT] if kind == "async_grpo" else []
    cls = dataclasses.make_dataclass(name, _trl.trl_fields(kind, _BASE) + extra, bases=(TrainingArguments,),
                                     namespace={"__post_init__": _post_init(kind, own), "TRL_FIELDS": own,
                                                "__doc__": f"TRL {_trl.TRL_VERSION}'s {name} on raytrain's "
                                                           "TrainingArguments: TRL's fields, defaults and help."})
    cls.__module__ = __name__
    return cls


SFTConfig = _config("SFTConfig", "sft")
DPOConfig = _config("DPOConfig", "dpo")
GRPOConfig = _config("GRPOConfig", "grpo")
RLOOConfig = _config("RLOOConfig", "rloo")
AsyncGRPOConfig = _config("AsyncGRPOConfig", "async_grpo")


class SFTTrainer(SFTMethods, Trainer):
    """TRL's SFTTrainer (same arguments, dataset preparation, collator, loss and metrics) on raytrain's loop."""

    config_class = SFTConfig


class DPOTrainer(DPOMethods, Trainer):
    """TRL's DPOTrainer (same arguments, dataset preparation, losses and metrics) on raytrain's loop."""

    config_class = DPOConfig


class GRPOTrainer(GRPOMethods, Trainer):
    """TRL's GRPOTrainer (same arguments, sampler, generation, rewards, advantages, losses and metrics) on raytrain's
    loop, resumed exactly: checkpoints hold the rollout buffer and its position."""

    config_class = GRPOConfig


class RLOOTrainer(RLOOMethods, Trainer):
    """TRL's RLOOTrainer (same arguments, sampler, generation, leave-one-out advantages, loss and metrics) on
    raytrain's loop, resumed exactly as GRPOTrainer."""

    config_class = RLOOConfig


class AsyncGRPOTrainer(AsyncGRPOMethods, Trainer):
    """TRL's AsyncGRPOTrainer (its arguments, loss and metrics) on raytrain's loop, generating ahead of training on
    Ray actors (rollout.num_workers), on a schedule that makes runs reproducible and resumed exactly."""

    config_class = AsyncGRPOConfig
    _pool_class = RayRolloutPool


def __getattr__(name: str) -> Any:
    raise AttributeError(f"raytrain.trl has no {name!r}; it exports {', '.join(__all__)}")


def config_from_yaml(path: str, overrides: list[str]) -> TrainingArguments | None:
    """The CLI's TRL config: AsyncGRPOConfig when the YAML (or --set) names one of its own fields (rollout,
    max_staleness, ...), GRPOConfig when a field of GRPO / RLOO alone (RLOOConfig when one of RLOO's own), else
    DPOConfig when it names a DPO-only field, SFTConfig when an SFT-only one, else None."""
    import yaml

    with open(path) as f:
        d = yaml.safe_load(f) or {}
    keys = set(d) | {o.partition("=")[0].split(".")[0].strip() for o in overrides}
    if keys & (set(AsyncGRPOConfig.TRL_FIELDS) - rollout_fields() - set(SFTConfig.TRL_FIELDS) | {"rollout"}):
        return AsyncGRPOConfig.from_yaml(path, overrides)
    if keys & (rollout_fields() - set(SFTConfig.TRL_FIELDS) - set(DPOConfig.TRL_FIELDS)):
        rloo = keys & (set(RLOOConfig.TRL_FIELDS) - set(GRPOConfig.TRL_FIELDS))
        return (RLOOConfig if rloo else GRPOConfig).from_yaml(path, overrides)
    for cls, other in ((DPOConfig, SFTConfig), (SFTConfig, DPOConfig)):
        if keys & (set(cls.TRL_FIELDS) - set(other.TRL_FIELDS)):
            return cls.from_yaml(path, overrides)
    return None


def async_fields() -> set[str]:
    """AsyncGRPOConfig's own fields, reward_funcs and the rollout section included."""
    return set(AsyncGRPOConfig.TRL_FIELDS) | {_REWARD_FUNCS[0], _ROLLOUT[0]}


def rollout_fields() -> set[str]:
    """GRPOConfig's and RLOOConfig's own fields, reward_funcs included."""
    return set(GRPOConfig.TRL_FIELDS) | set(RLOOConfig.TRL_FIELDS) | {_REWARD_FUNCS[0]}


def trainer_for(args: Any) -> type | None:
    """The CLI's trainer for a TRL config (None for other arguments)."""
    return {SFTConfig: SFTTrainer, DPOConfig: DPOTrainer, GRPOConfig: GRPOTrainer, RLOOConfig: RLOOTrainer,
            AsyncGRPOConfig: AsyncGRPOTrainer}.get(type(args))
