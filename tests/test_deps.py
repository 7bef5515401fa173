"""raytrain/deps: the versions of the libraries whose private names raytrain uses are bounded in pyproject.toml as
in deps.SUPPORTED, the installed ones (what the tests run against) are inside, and another is refused in one line
where raytrain first imports it."""

from __future__ import annotations

import os
import re
import sys

import pytest

from raytrain import deps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirements() -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]


def test_pyproject_bounds_each_library_as_deps_supports_it():
    seen = set()
    for requirement in _requirements():
        name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)", requirement).groups()
        if name in deps.SUPPORTED:
            low, high, _ = deps.SUPPORTED[name]
            assert spec in (f">={low},<{high}", f"=={low}.*"), requirement
            seen.add(name)
    assert seen == set(deps.SUPPORTED)


def test_the_installed_versions_are_the_supported_ones():
    for dist in deps.SUPPORTED:
        if deps.installed(dist) is not None:
            deps.require(dist, "the tests")


@pytest.mark.parametrize("version, refused", [("1.16.0", False), ("1.16.3", False), ("1.17.0", True),
                                              ("1.15.2", True), ("2.0.0.dev0", True), ("nightly", True)])
def test_the_range_is_the_minor_version(monkeypatch, version, refused):
    monkeypatch.setattr(deps, "installed", lambda dist: version)
    if refused:
        with pytest.raises(ImportError, match=re.escape(f"(installed: {version})")):
            deps.require("trl", "raytrain.trl")
    else:
        deps.require("trl", "raytrain.trl")


def _fresh(monkeypatch, *prefixes: str) -> None:
    """Forget the imported modules under `prefixes` for this test (monkeypatch puts them back)."""
    for name in [n for n in sys.modules if n.startswith(prefixes)]:
        monkeypatch.delitem(sys.modules, name)


def test_another_trl_is_refused_in_one_line_at_import(monkeypatch):
    monkeypatch.setattr(deps, "installed", lambda dist: "1.17.0" if dist == "trl" else None)
    _fresh(monkeypatch, "raytrain.trl", "raytrain.hf.trl")
    with pytest.raises(ImportError) as e:
        import raytrain.trl  # noqa: F401
    assert str(e.value) == "raytrain.trl needs trl>=1.16,<1.17 (installed: 1.17.0): pip install 'raytrain[trl]'"


def test_another_ray_is_refused_in_one_line_before_ray_trains_internals(monkeypatch):
    monkeypatch.setattr(deps, "installed", lambda dist: "2.61.0" if dist == "ray" else None)
    _fresh(monkeypatch, "raytrain.driver.torch_trainer", "raytrain.driver.launch")
    with pytest.raises(ImportError) as e:
        import raytrain.driver.launch  # noqa: F401  (what a Ray run and a sweep import first)
    assert str(e.value) == ("raytrain needs ray>=2.60,<2.61 (installed: 2.61.0): "
                            "pip install 'ray[default,train,tune,data]>=2.60,<2.61'")


def test_another_deepspeed_is_refused_in_one_line_by_its_strategy(monkeypatch, tmp_path):
    from raytrain import TrainingArguments
    from raytrain.strategies import create_strategy

    monkeypatch.setattr(deps, "installed", lambda dist: "0.18.4" if dist == "deepspeed" else None)
    args = TrainingArguments(output_dir=str(tmp_path), distributed={"strategy": "deepspeed"})
    with pytest.raises(ImportError) as e:
        create_strategy(args)
    assert str(e.value) == ("distributed.strategy deepspeed needs deepspeed>=0.19,<0.20 (installed: 0.18.4): "
                            "pip install 'raytrain[deepspeed]'")
