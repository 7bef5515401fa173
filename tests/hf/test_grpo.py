"""raytrain.trl's GRPOTrainer / RLOOTrainer against trl 1.16 on the same script: configs field by field, the sampled
completions and rewards, per-step losses, rewards and TRL's metrics; exact resume after SIGKILL; one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest

from . import grpo_jobs as jobs

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jobs.save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def _close(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (sorted(set(x) ^ set(y)), x, y)
        for k in x:
            if x[k] is None or y[k] is None:
                assert x[k] is None and y[k] is None, (k, x, y)
            else:
                assert x[k] == pytest.approx(y[k], abs=tol, rel=tol), (k, x, y)


@pytest.mark.parametrize("name", ["GRPOConfig"])
def test_config_has_every_trl_field_with_its_default(name, tmp_path):
    import raytrain.trl as rt

    theirs, ours = getattr(trl, name), getattr(rt, name)
    mine = {f.name: f for f in dataclasses.fields(ours)}
    changed = ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "remove_unused_columns")
    for f in dataclasses.fields(theirs):
        assert f.name in mine, f"{name}.{f.name} is missing"
        if f.name in ours.TRL_FIELDS or f.name in changed:
            want = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            got = mine[f.name].default if mine[f.name].default_factory is dataclasses.MISSING \
                else mine[f.name].default_factory()
            assert got == want, (f.name, got, want)
            assert mine[f.name].metadata["help"] == f.metadata["help"].replace("%%", "%"), f.name
    # the values after __post_init__: batch arithmetic, scale_rewards as a string, "auto" padding
    for kw in ({}, {"steps_per_generation": 4, "gradient_accumulation_steps": 2},
               {"generation_batch_size": 24, "per_device_train_batch_size": 4, "num_generations": 6}):
        a, b = theirs(str(tmp_path / "a"), use_cpu=True, **kw), ours(str(tmp_path / "b"), use_cpu=True, **kw)
        for n in (*ours.TRL_FIELDS, *changed):
            assert getattr(a, n) == getattr(b, n), (n, kw)
    assert ours.from_dict(b.to_dict()).generation_batch_size == 24  # a settled config builds again


@pytest.mark.parametrize("kw, message", [
    (dict(num_generations=1, per_device_train_batch_size=2), r"^num_generations: at least 2 completions"),
    (dict(num_generations=3), r"^num_generations: the generation batch \(8\) is not divisible by num_generations"),
    (dict(generation_batch_size=12), r"^generation_batch_size: 12 is not divisible by the global batch size"),
    (dict(generation_batch_size=16, steps_per_generation=3), r"^generation_batch_size \(16\) and steps_per_generation"),
    (dict(auto_find_batch_size=True), r"^auto_find_batch_size: not supported by GRPO / RLOO"),
])
def test_config_refusals_are_one_line(tmp_path, kw, message):
    import raytrain.trl as rt

    with pytest.raises(ValueError, match=message) as e:
        rt.GRPOConfig(str(tmp_path), use_cpu=True, **kw)
    assert "\n" not in str(e.value)
