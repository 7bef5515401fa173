"""`raytrain.tune`, the sweep's public names under their first home (the code lives in raytrain.sweep)."""

from .sweep import BestRun, default_compute_objective, hyperparameter_search, load_search_spec, space_from_spec

__all__ = ["BestRun", "default_compute_objective", "hyperparameter_search", "load_search_spec", "space_from_spec"]
