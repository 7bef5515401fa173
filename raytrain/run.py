"""The CLI: python -m raytrain.run --config X.yaml [--set key=value ...] [--resume auto|never|PATH].

Bad configuration exits with code 2 and one line on stderr, before any training starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any, Callable

from .args import ConfigError, TrainingArguments, cli_help

EXIT_CONFIG = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        self.exit(EXIT_CONFIG, f"error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m raytrain.run",
        description="Train (and evaluate) a model described by a YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (set in the YAML or with --set):\n" + cli_help(),
    )
    p.add_argument("--config", required=True, help="YAML file with TrainingArguments and model/data sections")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, dotted for sections (model.hidden_size=128); repeatable")
    p.add_argument("--resume", default="auto",
                   help="auto: continue the newest valid checkpoint in output_dir if any (default); "
                        "never: start fresh (fails if output_dir has checkpoints); or a checkpoint path")
    p.add_argument("--search", default=None, help="YAML search space: run a hyperparameter search instead "
                                                  "(--resume auto continues the sweep of the same name)")
    return p


def import_string(path: str, field: str) -> Callable:
    """'package.module:attr' -> the object; a ConfigError naming `field` if it cannot be found."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({e})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr!r}") from None


def build_job(args: TrainingArguments) -> dict[str, Any]:
    """Model, datasets, collator and metrics from the config's factories (all validated here)."""
    if args.model is None:
        raise ConfigError("model: missing section; add model: {factory: 'package.module:build_model'}")
    if args.data is None or args.data.factory is None:
        raise ConfigError("data.factory: missing; add data: {factory: 'package.module:build_datasets'}")
    model_factory = import_string(args.model.factory, "model.factory")
    data_factory = import_string(args.data.factory, "data.factory")
    try:
        job: dict[str, Any] = {"model": model_factory(**args.model.kwargs)}
    except TypeError as e:
        raise ConfigError(f"model: {args.model.factory} rejected its arguments ({e})") from None
    try:
        datasets = data_factory(**args.data.kwargs)
    except TypeError as e:
        raise ConfigError(f"data: {args.data.factory} rejected its arguments ({e})") from None
    if isinstance(datasets, dict) and "train" in datasets:
        job["train_dataset"], job["eval_dataset"] = datasets["train"], datasets.get("eval")
    elif isinstance(datasets, (tuple, list)) and len(datasets) == 2:
        job["train_dataset"], job["eval_dataset"] = datasets
    else:
        raise ConfigError(f"data.factory: {args.data.factory} must return (train, eval) or "
                          "{'train': ..., 'eval': ...}")
    if args.data.collator:
        job["data_collator"] = import_string(args.data.collator, "data.collator")
    if args.data.compute_metrics:
        job["compute_metrics"] = import_string(args.data.compute_metrics, "data.compute_metrics")
    return job


def _resume_arg(value: str, output_dir: str):
    if value == "auto":
        return "auto"
    if value == "never":
        return None
    if not os.path.isdir(value):
        raise ConfigError(f"--resume: {value!r} is not a checkpoint directory (or use auto / never)")
    return value


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = TrainingArguments.from_yaml(ns.config, ns.overrides)
        resume = _resume_arg(ns.resume, args.output_dir)
        job = build_job(args)
        if ns.search:
            from .tune import run_search_cli
            return run_search_cli(args, job, ns.search, resume)
        from .trainer import Trainer
        trainer = Trainer(args=args, **job)
    except (ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        out = trainer.train(resume_from_checkpoint=resume)
    except (ConfigError, FileExistsError) as e:  # raised before the first step
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    summary = {"global_step": out.global_step, "train_loss": out.training_loss,
               "train_runtime": out.metrics.get("train_runtime")}
    if trainer.eval_dataset is not None:
        summary.update(trainer.evaluate())
    final = trainer.save_model(os.path.join(args.output_dir, "final"))
    summary["model"] = os.path.join(final, "model.safetensors")
    if trainer.state.best_model_checkpoint:
        summary["best_model_checkpoint"] = trainer.state.best_model_checkpoint
    print("summary: " + json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
