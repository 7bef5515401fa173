"""Hyperparameter search on Ray Tune + Optuna: the search (search), the per-trial function (trial),
search spaces (space), samplers (sampler), the sweep's report, MLflow runs and URI mirror.

Names are imported on first use (PEP 562): a trial's process or a plain CLI run that reads a search
space does not import search.py and, through BestRun, transformers."""

from __future__ import annotations

from ..runtime.lazy import lazy_exports

_EXPORTS = {
    "search": ["BestRun", "hyperparameter_search"],
    "space": ["SearchSpace", "default_compute_objective", "load_search_spec", "space_from_spec"],
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
