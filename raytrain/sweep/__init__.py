"""Hyperparameter search on Ray Tune + Optuna: the search (search), the per-trial function (trial),
search spaces (space), samplers (sampler), the sweep's report, MLflow runs and URI mirror."""

from .search import BestRun, default_compute_objective, hyperparameter_search
from .space import SearchSpace, load_search_spec, space_from_spec

__all__ = ["BestRun", "SearchSpace", "default_compute_objective", "hyperparameter_search", "load_search_spec",
           "space_from_spec"]
