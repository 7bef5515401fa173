"""Hyperparameter search on Ray Tune + Optuna: the search (search), the per-trial function (trial),
search spaces (space), samplers (sampler), the sweep's report, MLflow runs and URI mirror.

Names are imported on first use (PEP 562): a trial's process or a plain CLI run that reads a search
space does not import search.py and, through BestRun, transformers."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "search": ["BestRun", "hyperparameter_search"],
    "space": ["SearchSpace", "default_compute_objective", "load_search_spec", "space_from_spec"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
