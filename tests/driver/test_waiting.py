"""A run that waits for its workers says so on the driver's progress line; scaling.max_wait_s ends the wait
in one line (Ray Train's controller aborted, no worker ever started), and the same run goes through once
the cluster has room."""

from __future__ import annotations

import logging

import pytest

from raytrain import Trainer
from raytrain.config.sections import ConfigError
from raytrain.driver.waiting import Waiting
from tests.strategies._helpers import digits_args, digits_model


def test_the_waiting_line():
    line = Waiting(wanted=6, room=2, nodes=1, pending=3).line({"CPU": 1}, 20.4, 60)
    assert line == ("waiting for workers: 6 wanted of {CPU: 1}, room for 2 on the 1 node(s) up, 3 node(s) pending "
                    "(waited 20 s of scaling.max_wait_s=60)")
    assert "pending" not in Waiting(2, 0, 1, None).line({"CPU": 1}, 5, None)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_bounded_wait_ends_in_one_line_and_the_run_goes_through_later(ray_cluster, digits, tmp_path, caplog, capsys):
    train, _ = digits
    # 3 of the session cluster's 4 CPUs taken: the 2-worker group fits the cluster, not its room now.
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 3}])
    ray_cluster.get(blocker.ready(), timeout=60)
    args = digits_args(str(tmp_path / "out"), str(tmp_path / "ray"), max_steps=4, save_steps=2,
                       scaling={"max_wait_s": 12})
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as e:
            Trainer(digits_model(), args, train_dataset=train).train()
    finally:
        remove_placement_group(blocker)
    message = str(e.value)
    assert "\n" not in message and message.startswith("scaling.max_wait_s: waited 1") and \
        "for 2 workers of {CPU: 1} (room for 1 on the 1 node(s) up); the run stopped, nothing lost" in message
    shown = caplog.text + capsys.readouterr().err
    assert "waiting for workers: 2 wanted of {CPU: 1}, room for 1 on the 1 node(s) up" in shown
    out = Trainer(digits_model(), args, train_dataset=train).train()
    assert out.global_step == 4
