"""The line a run waiting for its workers shows on the driver's console. The wait itself, bounded by
scaling.max_wait_s and resumed later, runs on the laptop twin of cluster.yaml: test_local_cluster.py."""

from __future__ import annotations



from raytrain.driver.waiting import Waiting


def test_the_waiting_line():
    line = Waiting(wanted=6, room=2, nodes=1, pending=3).line({"CPU": 1}, 20.4, 60)
    assert line == ("waiting for workers: 6 wanted of {CPU: 1}, room for 2 on the 1 node(s) up, 3 node(s) pending "
                    "(waited 20 s of scaling.max_wait_s=60)")
    assert "pending" not in Waiting(2, 0, 1, None).line({"CPU": 1}, 5, None)
    failing = Waiting(2, 0, 1, 2, "ray.worker.gpu_spot: InsufficientInstanceCapacity").line({"CPU": 1}, 8, None)
    assert failing == ("waiting for workers: 2 wanted of {CPU: 1}, room for 0 on the 1 node(s) up, 2 node(s) pending, "
                       "launches failing: ray.worker.gpu_spot: InsufficientInstanceCapacity (waited 8 s)")


def test_a_wait_is_said_at_once_while_nodes_are_pending_and_again_when_it_changes(monkeypatch):
    import threading
    from types import SimpleNamespace

    from raytrain.driver import waiting

    seen = [Waiting(2, 0, 1, 0), Waiting(2, 0, 1, 2), Waiting(2, 0, 1, 2), Waiting(2, 1, 2, 1),
            Waiting(2, 1, 2, 1), None, Waiting(2, 0, 1, None)]
    done = threading.Event()

    def observe(scaling, failures_after=None):
        if not seen:
            done.set()
            return None
        return seen.pop(0)

    monkeypatch.setattr(waiting, "observe", observe)
    said = []
    scaling = SimpleNamespace(max_wait_s=None, resources_per_worker={"CPU": 1}, use_gpu=False)
    with waiting.WaitWatch(scaling, said.append, every_s=60, poll_s=0.01, grace_s=30):
        assert done.wait(10)
    # within grace_s and nothing pending: silent; nodes pending: said at once; the same again: silent;
    # a change: said; after the wait ended, a new one within grace_s and no autoscaler: silent
    assert [line.split(" (waited")[0] for line in said] == [
        "waiting for workers: 2 wanted of {CPU: 1}, room for 0 on the 1 node(s) up, 2 node(s) pending",
        "waiting for workers: 2 wanted of {CPU: 1}, room for 1 on the 2 node(s) up, 1 node(s) pending"]
