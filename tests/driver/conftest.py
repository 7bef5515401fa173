"""The uninterrupted 2-worker run that the fault tests of test_launch and test_preemption compare with:
computed once per session (those tests share the xdist group "ddp_run", so one xdist worker runs them)."""

from __future__ import annotations

import pytest

from raytrain import Trainer
from tests.strategies._helpers import WeightsProbe, digits_args, digits_model


@pytest.fixture(scope="session")
def ddp_run(ray_cluster, tmp_path_factory):
    from examples.digits import build_datasets

    root = tmp_path_factory.mktemp("ddp")
    train, _ = build_datasets()
    trainer = Trainer(digits_model(), digits_args(str(root / "out"), str(root / "ray")),
                      train_dataset=train, callbacks=[WeightsProbe()])
    return root / "out", trainer, trainer.train()
