"""The sweep's Optuna sampler: suggestions are a function of (seed, trial number, study history).

Optuna's samplers draw from one RNG stream per sampler object. Tune pickles the searcher (and so the
sampler's RNG) at most once a second; after a driver restore the stream restarts from that pickle,
so the trials after a restore would draw other numbers than an uninterrupted sweep (or repeat the
numbers of a trial asked after the last save). Here each trial gets a fresh sampler seeded from
(seed, trial.number): the same trial number over the same history suggests the same values whether
or not the driver died in between. Samplers whose state matters across trials keep it in the study
(CMA-ES: the optimizer in trial attributes; QMC: the sample index in study attributes), so a fresh
object per trial loses nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optuna
from optuna.samplers import BaseSampler


def startup_trials(n_trials: int) -> int:
    """TPE samples at random for its first n_startup_trials (Optuna: 10): in a sweep of 8 it never
    would model anything. A third of the sweep, 2 to 10 trials, explores first."""
    return min(10, max(2, n_trials // 3))


def _make(name: str, seed: int | None, trial_seed: int | None, n_trials: int) -> BaseSampler:
    s = optuna.samplers
    if name == "tpe":
        return s.TPESampler(seed=trial_seed, n_startup_trials=startup_trials(n_trials))
    if name == "random":
        return s.RandomSampler(seed=trial_seed)
    if name == "cmaes":
        return s.CmaEsSampler(seed=trial_seed, independent_sampler=s.RandomSampler(seed=trial_seed))
    if name == "qmc":  # one scrambled sequence for the sweep (its seed), indexed in the study
        return s.QMCSampler(seed=seed, scramble=seed is not None,
                            independent_sampler=s.RandomSampler(seed=trial_seed))
    raise ValueError(f"sampler: must be one of tpe, random, cmaes, qmc, got {name!r}")


def trial_seed(seed: int, number: int) -> int:
    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


class TrialSeededSampler(BaseSampler):
    """Optuna's sampler `name`, rebuilt before each trial with a seed from (seed, trial number)."""

    def __init__(self, name: str, seed: int, n_trials: int):
        self.name, self.seed, self.n_trials = name, seed, n_trials
        self._inner = _make(name, seed, trial_seed(seed, 0), n_trials)

    def before_trial(self, study, trial) -> None:
        self._inner = _make(self.name, self.seed, trial_seed(self.seed, trial.number), self.n_trials)
        self._inner.before_trial(study, trial)

    def infer_relative_search_space(self, study, trial) -> dict[str, Any]:
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        return self._inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        pass  # the seed is (seed, trial number) by design


def make_sampler(name: str, seed: int | None, n_trials: int) -> BaseSampler:
    """The sweep's sampler: trial-seeded when a seed is given, else Optuna's own (unseeded)."""
    if seed is None:
        return _make(name, None, None, n_trials)
    return TrialSeededSampler(name, seed, n_trials)
