"""MkDocs hook: renders TrainingArguments' fields and help texts into configuration.md at build time.

The page holds the marker below; the tables come from raytrain.config.args (the dataclass fields and the
sections in args.SECTIONS), the same source as `python -m raytrain.run --help`, so they cannot drift.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, fields

MARKER = "<!-- config-reference -->"


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "`null`"
    text = annotation.__name__ if isinstance(annotation, type) and not typing.get_args(annotation) else str(annotation)
    return f"`{text.replace('typing.', '')}`"


def _default(value) -> str:
    if value is MISSING:
        return "required"
    shown = value if isinstance(value, str) else json.dumps(value, default=str)
    return f"`{shown}`" if shown != "" else '`""`'


def _row(name: str, annotation, default, text: str) -> str:
    return f"| `{name}` | {_type(annotation)} | {_default(default)} | {text.replace('|', chr(92) + '|')} |"


def render() -> str:
    from raytrain.config.args import SECTIONS, TrainingArguments
    from raytrain.config.seq2seq import SEQ2SEQ_FIELDS, Seq2SeqTrainingArguments

    head = "| field | type | default | what it does |\n|---|---|---|---|"
    hints = typing.get_type_hints(TrainingArguments, include_extras=True)
    rows = []
    for f in fields(TrainingArguments):
        if f.name in SECTIONS:
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        rows.append(_row(f.name, hints[f.name], default, f.metadata.get("help", "")))
    out = ["## Training arguments", "", f"{len(rows)} fields, at the top level of a config.", "", head, *rows]
    hints = typing.get_type_hints(Seq2SeqTrainingArguments, include_extras=True)
    seq2seq = [_row(f.name, hints[f.name], f.default, f.metadata.get("help", ""))
               for f in fields(Seq2SeqTrainingArguments) if f.name in SEQ2SEQ_FIELDS]
    out += ["", "## Seq2Seq arguments", "", "`Seq2SeqTrainingArguments`' own fields, at the top level too: a config "
            "that sets any of them runs a `Seq2SeqTrainer`.", "", head, *seq2seq]
    for section, model in SECTIONS.items():
        out += ["", f"## `{section}`", "", (model.__doc__ or "").strip().split("\n")[0], "", head]
        for name, info in model.model_fields.items():
            default = MISSING if info.is_required() else info.get_default(call_default_factory=True)
            out.append(_row(f"{section}.{name}", info.annotation, default, info.description or ""))
        if section in ("model", "data"):
            out.append(f"| `{section}.<key>` | any | | any other key is passed to the {section} factory "
                       "as a keyword argument |")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
