"""Search spaces from YAML (search_spaces/*.yaml): validated once, then handed to Optuna or Ray Tune.

A spec maps dotted config keys to one distribution each, optionally conditional on an earlier choice::

    learning_rate: {loguniform: [1.0e-4, 1.0e-2]}
    model.num_layers: {int: [1, 3]}              # inclusive bounds
    per_device_train_batch_size: {logint: [16, 128]}
    optim: {choice: [adamw_torch, sgd]}
    optim_args: {choice: ["momentum=0.9", "momentum=0.99"], when: {optim: sgd}}

Distributions: uniform, loguniform, quniform [low, high, q], int, logint, randint [low, high) (Ray's),
choice [values]. Each problem is one ConfigError naming `space.<key>` and what would be right.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..config.args import ConfigError
from ..config.sections import apply_overrides

_RANGES = {"uniform": 2, "loguniform": 2, "quniform": 3, "int": 2, "logint": 2, "randint": 2}
DISTRIBUTIONS = sorted([*_RANGES, "choice"])
SPEC_KEYS = ("metric", "mode", "num_samples", "scheduler", "scheduler_kwargs", "space",
             "max_concurrent_trials", "seed", "sampler", "name", "show_trial_logs", "storage_path")


@dataclass
class Param:
    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    choices: list | None = None
    when: dict[str, list] = field(default_factory=dict)

    @property
    def log(self) -> bool:
        return self.kind in ("loguniform", "logint")


class SearchSpace:
    """An ordered list of validated Params; a callable define-by-run space for OptunaSearch."""

    def __init__(self, params: list[Param]):
        self.params = params

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def conditional(self) -> bool:
        return any(p.when for p in self.params)

    def __call__(self, trial) -> None:
        """Optuna define-by-run: suggest each parameter whose conditions hold (Ray captures them)."""
        chosen: dict[str, Any] = {}
        for p in self.params:
            if any(chosen.get(k, _MISSING) not in v for k, v in p.when.items()):
                continue
            if p.kind == "choice":
                chosen[p.name] = trial.suggest_categorical(p.name, p.choices)
            elif p.kind in ("int", "logint", "randint"):
                high = int(p.high) - (1 if p.kind == "randint" else 0)
                chosen[p.name] = trial.suggest_int(p.name, int(p.low), high, log=p.log)
            else:
                chosen[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.log, step=p.step)
        return None

    def describe(self) -> dict[str, str]:
        """{name: "loguniform[0.0001, 0.01]"}, as the sweep's MLflow params show the space."""
        out = {}
        for p in self.params:
            values = p.choices if p.kind == "choice" else [v for v in (p.low, p.high, p.step) if v is not None]
            out[p.name] = f"{p.kind}{values}" + (f" when {p.when}" if p.when else "")
        return out

    def to_tune(self) -> dict[str, Any]:
        """Ray Tune sample objects (for PBT's mutations and searcher-less sweeps)."""
        from ray import tune

        if self.conditional:
            bad = next(p.name for p in self.params if p.when)
            raise ConfigError(f"space.{bad}.when: conditional parameters need Optuna's sampler; "
                              "they cannot be used with scheduler pbt")
        out = {}
        for p in self.params:
            out[p.name] = {
                "choice": lambda: tune.choice(p.choices),
                "uniform": lambda: tune.uniform(p.low, p.high),
                "loguniform": lambda: tune.loguniform(p.low, p.high),
                "quniform": lambda: tune.quniform(p.low, p.high, p.step),
                "int": lambda: tune.randint(int(p.low), int(p.high) + 1),
                "logint": lambda: tune.lograndint(int(p.low), int(p.high) + 1),
                "randint": lambda: tune.randint(int(p.low), int(p.high)),
            }[p.kind]()
        return out


_MISSING = object()


class FunctionSpace(SearchSpace):
    """HF's Optuna-style hp_space: a function of an optuna.Trial that suggests each value and returns
    the trial's parameters as a dict (define-by-run, for OptunaSearch on Ray or Optuna itself)."""

    def __init__(self, fn, names: list[str]):
        super().__init__([])
        self.fn, self._names = fn, list(names)

    @property
    def names(self) -> list[str]:
        return self._names

    @property
    def conditional(self) -> bool:
        return True  # what a function suggests may depend on earlier suggestions

    def __call__(self, trial) -> dict[str, Any]:
        params = self.fn(trial)
        if not isinstance(params, dict):
            raise ValueError(f"hp_space must return a dict of parameters, got {type(params).__name__}")
        captured = getattr(trial, "captured_values", None)  # Ray's captor: the config is the returned dict only
        if isinstance(captured, dict):
            for name in [k for k in captured if k not in params]:
                del captured[name]
        return params

    def describe(self) -> dict[str, str]:
        return {n: f"{getattr(self.fn, '__name__', 'hp_space')}(trial)" for n in self._names}

    def to_tune(self) -> dict[str, Any]:
        raise ConfigError("hp_space: a function of an Optuna trial cannot give PBT its mutations; "
                          "pass a dict space (YAML form or Ray Tune sample objects)")

    def __getstate__(self):  # Tune pickles the searcher with plain pickle: the function goes by value
        import cloudpickle
        return {"fn": cloudpickle.dumps(self.fn), "names": self._names}

    def __setstate__(self, state):
        import cloudpickle
        SearchSpace.__init__(self, [])
        self.fn, self._names = cloudpickle.loads(state["fn"]), state["names"]


def default_hp_space_optuna(trial) -> dict[str, Any]:
    """HF's default search space (transformers.trainer_utils.default_hp_space_optuna)."""
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
            "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
            "seed": trial.suggest_int("seed", 1, 40),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8, 16, 32, 64])}


def default_compute_objective(metrics: dict[str, float]) -> float:
    """HF's default: eval_loss when it is the only metric, else the sum of the other eval metrics."""
    metrics = {k: v for k, v in metrics.items()
               if not k.endswith(("_runtime", "_per_second")) and k not in ("epoch", "step")}
    loss = metrics.pop("eval_loss", None)
    return loss if not metrics else sum(metrics.values())


def objective_defaults(trainer, metric: str | None, direction, compute_objective=None) -> tuple[str | None, Any]:
    """(metric, direction) of a sweep: a trainer's own objective (Trainer.hp_objective; TRL's GRPO / RLOO: eval_reward,
    the mean reward of the evaluation's completions, maximized) when the sweep names neither metric nor
    compute_objective, else HF's (default_compute_objective or the metric given), minimized unless told."""
    own = getattr(trainer, "hp_objective", None)
    if own is not None and metric is None and compute_objective is None:
        return own[0], own[1] if direction is None else direction
    return metric, "minimize" if direction is None else direction


def function_space(hp_space, empty_ok: bool = False) -> FunctionSpace | None:
    """hp_space as a FunctionSpace when it is HF's Optuna style (it suggests on a probe trial of a
    throw-away in-memory study); None when it suggests nothing (a function returning a space).
    With empty_ok, one returning {} is Optuna style too (model_init suggests the parameters, as HF)."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory"
    try:
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
        try:
            params = hp_space(trial)
        except Exception:
            if trial.params:
                raise
            return None  # e.g. a Ray-style function that reads its argument as a dict
    finally:
        optuna.logging.set_verbosity(verbosity)
    if not trial.params:
        return FunctionSpace(hp_space, []) if empty_ok and params == {} else None
    if not isinstance(params, dict):
        raise ValueError(f"hp_space must return a dict of parameters, got {type(params).__name__}")
    return FunctionSpace(hp_space, list(params))


def space_from_spec(spec: dict[str, Any]) -> SearchSpace:
    """{"learning_rate": {"loguniform": [1e-4, 1e-2]}, ...} -> SearchSpace, or a one-line ConfigError."""
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"space: expected a mapping of parameter -> distribution, got {spec!r}")
    params: list[Param] = []
    for key, dist in spec.items():
        params.append(_param(str(key), dist, {p.name: p for p in params}))
    return SearchSpace(params)


def _param(key: str, dist: Any, before: dict[str, Param]) -> Param:
    where = f"space.{key}"
    valid = ", ".join(DISTRIBUTIONS)
    if not isinstance(dist, dict):
        raise ConfigError(f"{where}: expected {{distribution: [values]}} with one of {valid}, got {dist!r}")
    kinds = [k for k in dist if k in _RANGES or k == "choice"]
    unknown = [k for k in dist if k not in kinds and k != "when"]
    if unknown and not kinds:
        raise ConfigError(f"{where}: unknown distribution {unknown[0]!r} (valid: {valid})")
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (valid: one distribution and 'when')")
    if len(kinds) != 1:
        raise ConfigError(f"{where}: expected exactly one distribution, got {kinds}")
    kind, values = kinds[0], dist[kinds[0]]
    if kind == "choice":
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: choice needs a non-empty list of values, got {values!r}")
        param = Param(key, kind, choices=list(values))
    else:
        param = _range(where, kind, values)
    param.when = _when(where, dist.get("when"), before)
    return param


def _range(where: str, kind: str, values: Any) -> Param:
    n = _RANGES[kind]
    shape = "[low, high, q]" if n == 3 else "[low, high]"
    if not isinstance(values, list) or len(values) != n or \
            not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: {kind} expects {shape} numbers, got {values!r}")
    low, high = values[0], values[1]
    if kind in ("int", "logint", "randint") and not all(float(v).is_integer() for v in values):
        raise ConfigError(f"{where}: {kind} expects integer bounds, got {values!r}")
    if low > high or (kind == "randint" and low == high):
        raise ConfigError(f"{where}: low ({low}) must be {'<' if kind == 'randint' else '<='} high ({high})")
    if kind in ("loguniform", "logint") and low <= 0:
        raise ConfigError(f"{where}: {kind} needs low > 0 (a log scale), got low={low}")
    if n == 3 and values[2] <= 0:
        raise ConfigError(f"{where}: quniform's q must be > 0, got {values[2]}")
    return Param(where.split(".", 1)[1], kind, float(low), float(high), float(values[2]) if n == 3 else None)


def _when(where: str, when: Any, before: dict[str, Param]) -> dict[str, list]:
    if when is None:
        return {}
    if not isinstance(when, dict) or not when:
        raise ConfigError(f"{where}.when: expected {{earlier_choice_param: value or [values]}}, got {when!r}")
    out = {}
    for name, value in when.items():
        parent = before.get(name)
        if parent is None or parent.kind != "choice":
            raise ConfigError(f"{where}.when: {name!r} must be a choice parameter listed before {where}")
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if v not in parent.choices]
        if bad:
            raise ConfigError(f"{where}.when: {bad[0]!r} is not one of space.{name}'s choices {parent.choices}")
        out[name] = values
    return out


def load_search_spec(path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read and check a search YAML (with KEY=VALUE overrides, the CLI's --set search.KEY=VALUE); the
    space is validated here too, before any trial starts."""
    if not os.path.isfile(path):
        raise ConfigError(f"--search: file not found: {path!r}")
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(spec).__name__}")
    bad = sorted({o.partition("=")[0].split(".")[0] for o in overrides or []} - set(SPEC_KEYS))
    if bad:
        raise ConfigError(f"--set search.{bad[0]}: not a search setting (valid: {', '.join(sorted(SPEC_KEYS))})")
    spec = apply_overrides(spec, overrides or [])
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown} (valid: {', '.join(sorted(SPEC_KEYS))})")
    modes = spec.get("mode", "min")
    for mode in modes if isinstance(modes, list) else [modes]:
        if mode not in ("min", "max"):
            raise ConfigError(f"{path}: mode must be min or max (or a list of them), got {mode!r}")
    if not spec.get("space"):
        raise ConfigError(f"{path}: 'space' is missing or empty")
    space_from_spec(spec["space"])
    return spec
