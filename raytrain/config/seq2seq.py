"""Seq2SeqTrainingArguments: TrainingArguments plus transformers' five seq2seq fields, validated as the
rest (one-line errors naming the field). transformers is never imported here: a GenerationConfig is
recognised by its class name, and loaded by the Seq2SeqTrainer."""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Annotated, Any, get_type_hints

from pydantic import Field, create_model, field_validator

from .args import SECTIONS, TrainingArguments, UnknownFieldError
from .sections import ConfigError, StrictModel, show_value, unknown_field_message

logger = logging.getLogger(__name__)

__all__ = ["SEQ2SEQ_FIELDS", "Seq2SeqTrainingArguments", "arguments_from_yaml", "seq2seq_help"]

_warned: set[str] = set()  # the sortish_sampler warning: once per process


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments):
    """TrainingArguments with transformers' Seq2SeqTrainingArguments fields (same names and defaults)."""

    sortish_sampler: bool = _f(False, "accepted for HF compatibility: batches are raytrain's seeded shuffle "
                                      "(warned once when set)")
    predict_with_generate: bool = _f(
        False, "evaluate() and predict() call the model's generate(): predictions are generated token ids "
               "(for generative metrics such as ROUGE or BLEU)")
    generation_max_length: Annotated[int | None, Field(ge=1)] = _f(
        None, "generate()'s max_length in each evaluation with predict_with_generate; default: the model's "
              "generation config")
    generation_num_beams: Annotated[int | None, Field(ge=1)] = _f(
        None, "generate()'s num_beams in each evaluation with predict_with_generate; default: the model's "
              "generation config")
    generation_config: dict[str, Any] | str | None = _f(
        None, "the model's GenerationConfig for prediction: a directory or file written by "
              "GenerationConfig.save_pretrained, a model id, a mapping of its fields, or a GenerationConfig")

    def _validate(self, changes: dict[str, Any]) -> None:
        own = {k: v for k, v in changes.items() if k in SEQ2SEQ_FIELDS}
        checked = _schema()(**{n: own[n] if n in own else getattr(self, n) for n in SEQ2SEQ_FIELDS})
        super()._validate({k: v for k, v in changes.items() if k not in own})
        for name in SEQ2SEQ_FIELDS:
            object.__setattr__(self, name, getattr(checked, name))
        if self.sortish_sampler and "sortish_sampler" not in _warned:
            _warned.add("sortish_sampler")
            logger.warning("sortish_sampler is not supported; batches are a seeded shuffle (the same for any "
                           "number of workers)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SEQ2SEQ_FIELDS and "_validated" in self.__dict__:
            self._validate({name: value})  # validated as the other fields are
        else:
            super().__setattr__(name, value)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values; a GenerationConfig as its mapping (as HF)."""
        d = super().to_dict()
        if _is_generation_config(d["generation_config"]):
            d["generation_config"] = d["generation_config"].to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingArguments:
        if isinstance(d, dict):  # an unknown key is matched against these fields too
            names = {f.name for f in fields(cls) if f.init}
            unknown = [k for k in d if k not in names]
            if unknown:
                raise ConfigError(unknown_field_message(_schema(), unknown[0]))
        return super().from_dict(d)


SEQ2SEQ_FIELDS = tuple(f.name for f in fields(Seq2SeqTrainingArguments)
                       if f.name not in {g.name for g in fields(TrainingArguments)})
_dataclass_init = Seq2SeqTrainingArguments.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args: Any, **kwargs: Any) -> None:
    # A misspelt keyword gets the closest field's name, as TrainingArguments' does.
    names = {f.name for f in fields(Seq2SeqTrainingArguments)}
    for key in kwargs:
        if key not in names:
            raise UnknownFieldError(unknown_field_message(_schema(), key))
    _dataclass_init(self, *args, **kwargs)


Seq2SeqTrainingArguments.__init__ = _init  # type: ignore[method-assign]


def _is_generation_config(value: Any) -> bool:
    return any(c.__name__ == "GenerationConfig" for c in type(value).__mro__)


class _Rules(StrictModel):
    @field_validator("generation_config", mode="before", check_fields=False)
    @classmethod
    def _check_generation_config(cls, value: Any) -> Any:
        if value is None or isinstance(value, (str, dict)) or _is_generation_config(value):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)  # kept as a string: the arguments stay JSON
        raise ValueError("expected a path or model id, a mapping of GenerationConfig fields or a GenerationConfig, "
                         f"got {show_value(value)}")

    @classmethod
    def field_names(cls) -> list[str]:  # what an unknown field's suggestion is chosen from
        names = [f.name for f in fields(Seq2SeqTrainingArguments)]
        return names + [f"{s}.{n}" for s, model in SECTIONS.items() for n in model.model_fields]


@functools.cache
def _schema() -> type[StrictModel]:
    """The pydantic model of the seq2seq fields (TrainingArguments' own schema validates the rest)."""
    hints = get_type_hints(Seq2SeqTrainingArguments, include_extras=True)
    spec = {}
    for f in fields(Seq2SeqTrainingArguments):
        if f.name in SEQ2SEQ_FIELDS:
            annotation = Any if f.name == "generation_config" else hints[f.name]
            spec[f.name] = (annotation, Field(default=f.default, description=f.metadata["help"]))
    return create_model("Seq2SeqTrainingArguments", __base__=_Rules, **spec)


def arguments_from_yaml(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainingArguments:
    """The CLI's arguments: TrainingArguments, or Seq2SeqTrainingArguments when the config names one of its
    fields (an unknown field is then matched against the seq2seq fields too)."""
    try:
        return TrainingArguments.from_yaml(path, overrides)
    except ConfigError as e:
        if not str(e).startswith("unknown field '"):
            raise
    return Seq2SeqTrainingArguments.from_yaml(path, overrides)


def seq2seq_help() -> str:
    """The seq2seq fields for the CLI's --help, as cli_help lists TrainingArguments'."""
    rows = []
    for f in fields(Seq2SeqTrainingArguments):
        if f.name in SEQ2SEQ_FIELDS:
            default = f.default if f.default is not MISSING else None
            shown = default if isinstance(default, str) else json.dumps(default)
            rows.append((f.name, f"{f.metadata['help']} (default: {shown})"))
    width = max(len(n) for n, _ in rows) + len("=VALUE")
    head = "seq2seq fields (setting any of them runs a Seq2SeqTrainer, as transformers' Seq2SeqTrainingArguments):"
    return "\n".join([head] + [f"  --set {n + '=VALUE':<{width}}   {t}" for n, t in rows])
