"""A sweep whose driver is SIGKILLed continues with the same command (Tuner.restore + the Optuna study in
SQLite): finished trials are not rerun, running ones continue from their checkpoints, n_trials in total."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _driver(out, mode, env):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "sweep", "_sweep_driver.py"), str(out), mode],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# Long (2 minutes): by default a sweep restores by name (test_search.py's CLI resume) and from a URI without
# its local directory (below), and a restore's suggestions equal an uninterrupted sweep's (below).
@pytest.mark.long
@pytest.mark.timeout(600)
def test_sigkilled_driver_resumes_without_rerunning_finished_trials(ray_cluster, tmp_path):
    import optuna

    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out, sweep = tmp_path / "out", tmp_path / "out" / "sweeps" / "restore"
    proc = _driver(out, "fresh", env)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in proc.stdout], daemon=True)
    reader.start()

    def events(word):
        return {ln.split()[2]: t for t, ln in list(lines) if ln.startswith("[sweep] trial ") and f" {word} " in ln}

    # Kill once the first two trials have finished and a third holds its last checkpoint before reporting
    # it (_sweep_driver.HoldLastSave): its own checkpoints run past what Tune's saved state holds.
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        done, reported = events("finished"), events("reported")
        held = [n.removeprefix(".holding-trial_") for n in (os.listdir(sweep) if sweep.is_dir() else [])
                if n.startswith(".holding-trial_")]
        if len(done) >= 2 and set(reported) - set(done) and held:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended before it could be killed:\n" + "".join(ln for _, ln in lines)
    time.sleep(1.5)  # Tune saves its state at most once a second (TUNE_GLOBAL_CHECKPOINT_S=1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(5)
    killed_at = time.monotonic()
    finished = {tid for tid, t in events("finished").items() if killed_at - t > 1.5}
    part_way = set(events("reported")) - set(events("finished"))
    assert finished and part_way, "".join(f"{t - killed_at:.1f} {ln}" for t, ln in lines)
    results = {tid: (sweep / f"trial_{tid}" / "result.json").read_bytes() for tid in finished}

    again = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sweep", "_sweep_driver.py"), str(out), "resume"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[sweep] resuming" in again.stdout
    started = {ln.split()[2] for ln in again.stdout.splitlines() if ln.startswith("[sweep] trial ") and " started " in ln}
    assert not started & finished  # finished trials are not rerun ...
    assert all((sweep / f"trial_{t}" / "result.json").read_bytes() == b for t, b in results.items())  # ... or touched
    table = pd.read_csv(sweep / "trials.csv", dtype={"trial_id": str})
    assert len(table) == 4 and set(finished) <= set(table["trial_id"])
    assert (table["status"] == "finished").all() and (table["steps"] == 40).all()
    # The held trial re-reported the evaluation Tune's saved state lost: its objective is its step-40 accuracy.
    for tid in held:
        log = (sweep / f"trial_{tid}" / "trial.log").read_text()
        assert "re-reporting 1 evaluation(s) after step 30" in log, log[-2000:]
        state = json.loads((sweep / f"trial_{tid}" / "checkpoint-40" / "trainer_state.json").read_text())
        (last,) = [h for h in state["log_history"] if h.get("step") == 40 and "eval_accuracy" in h]
        row = table[table["trial_id"] == tid].iloc[0]
        assert row["objective"] == pytest.approx(last["eval_accuracy"]), row
    # A trial killed part-way continued from its checkpoint rather than from step 0.
    resumed = [t for t in part_way & started if "resumed from" in (sweep / f"trial_{t}" / "trial.log").read_text()]
    assert resumed, [(sweep / f"trial_{t}" / "trial.log").read_text()[-1500:] for t in part_way]
    study = optuna.load_study(study_name="restore", storage=f"sqlite:///{sweep / 'optuna.db'}")
    assert len(study.trials) == 4
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)


def _searcher(db, sampler="tpe"):
    """raytrain's OptunaSearch over a SQLite study, as hyperparameter_search builds it."""
    import optuna

    from raytrain.sweep.space import space_from_spec
    from raytrain.sweep.sampler import make_sampler
    from raytrain.sweep.search import _search_class

    space = space_from_spec({"learning_rate": {"loguniform": [1e-4, 1e-1]}, "weight_decay": {"uniform": [0, 0.1]},
                             "model.hidden_size": {"choice": [16, 32, 64]}})
    return _search_class()(space=space, metric="objective", mode="max", sampler=make_sampler(sampler, 5, 9),
                           study_name="s", storage=optuna.storages.RDBStorage(f"sqlite:///{db}"))


def _objective(cfg: dict) -> float:
    import math

    return -(math.log10(cfg["learning_rate"]) + 2.5) ** 2 - 10 * cfg["weight_decay"] + cfg["model.hidden_size"] / 100


@pytest.mark.parametrize("sampler", ["tpe", "qmc", "cmaes"])
def test_suggestions_after_a_restore_equal_an_uninterrupted_sweep(tmp_path, sampler):
    """One trial at a time, 9 trials (TPE models from the 4th on). The restored sweep is what Tuner.restore
    rebuilds: the searcher as the Tuner was created (tuner.pkl) with Tune's last saved searcher state, saved
    after 4 trials; a 5th was asked after that save (its Optuna trial is an orphan) when the driver died."""
    import optuna
    from ray import cloudpickle as pickle  # as Tune pickles the Tuner

    if sampler == "cmaes":
        pytest.importorskip("cmaes")

    uninterrupted = _searcher(tmp_path / "a.db", sampler)
    reference = []
    for i in range(9):
        cfg = uninterrupted.suggest(f"a{i}")
        reference.append(cfg)
        uninterrupted.on_trial_complete(f"a{i}", {"objective": _objective(cfg)})

    searcher = _searcher(tmp_path / "b.db", sampler)
    as_created = pickle.dumps(searcher)
    for i in range(4):
        searcher.on_trial_complete(f"b{i}", {"objective": _objective(searcher.suggest(f"b{i}"))})
    searcher.save(str(tmp_path / "searcher-state.pkl"))
    assert searcher.suggest("b4") == reference[4]  # asked after the save; then the driver dies
    del searcher

    restored = pickle.loads(as_created)
    restored.restore(str(tmp_path / "searcher-state.pkl"))
    after = []
    for i in range(4, 9):
        cfg = restored.suggest(f"c{i}")  # Tune's new trial ids
        after.append(cfg)
        restored.on_trial_complete(f"c{i}", {"objective": _objective(cfg)})
    assert after == reference[4:]
    assert len({c["learning_rate"] for c in reference}) == 9  # not one value repeated
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'b.db'}")
    assert [t.number for t in study.trials] == list(range(9))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)


def test_a_trial_the_scheduler_stopped_early_is_pruned_for_optuna(tmp_path):
    """Ray's OptunaSearch told Optuna an ASHA-stopped trial was COMPLETE with its accuracy after a few
    steps; it is PRUNED (with that value as its last intermediate), as Optuna's own pruners leave it."""
    import optuna

    searcher = _searcher(tmp_path / "p.db")
    searcher.suggest("full")
    searcher.suggest("cut")
    searcher.on_trial_result("cut", {"objective": 0.3, "training_iteration": 1, "step": 10, "max_steps": 300})
    searcher.on_trial_complete("cut", {"objective": 0.5, "training_iteration": 3, "step": 30, "max_steps": 300})
    searcher.on_trial_complete("full", {"objective": 0.9, "training_iteration": 30, "step": 300, "max_steps": 300})
    full, cut = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'p.db'}").trials
    assert full.state == optuna.trial.TrialState.COMPLETE and full.value == 0.9
    assert cut.state == optuna.trial.TrialState.PRUNED and cut.intermediate_values == {1: 0.3, 3: 0.5}


def _moto_multipart_fix(monkeypatch):
    """moto 5.2.1 answers CompleteMultipartUpload with the wrong XML root, which pyarrow's S3 client
    (every write is a multipart upload) rejects (getmoto/moto#10055, fixed after 5.2.1)."""
    from moto.s3.responses import S3Response

    post = S3Response._key_response_post

    def fixed(self, *a, **kw):
        status, headers, body = post(self, *a, **kw)
        wrong, right = "CompleteMultipartUploadResponse", "CompleteMultipartUploadResult"
        if isinstance(body, bytes):
            body = body.replace(wrong.encode(), right.encode())
        elif isinstance(body, str):
            body = body.replace(wrong, right)
        return status, headers, body

    monkeypatch.setattr(S3Response, "_key_response_post", fixed)


@contextlib.contextmanager
def moto_bucket(monkeypatch):
    """An S3 API (a moto server on a free port) with an empty bucket: (its pyarrow filesystem, the sweeps URI
    s3://testing:testing@bucket/sweeps?endpoint_override=...)."""
    import socket

    import pyarrow.fs
    from moto.server import ThreadedMotoServer

    _moto_multipart_fix(monkeypatch)
    monkeypatch.setattr(logging.getLogger("werkzeug"), "level", logging.WARNING)  # a line per request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        fs, _ = pyarrow.fs.FileSystem.from_uri(f"s3://testing:testing@bucket?{query}&allow_bucket_creation=true")
        fs.create_dir("bucket")
        yield fs, f"s3://testing:testing@bucket/sweeps?{query}"
    finally:
        server.stop()


def test_cloud_storage_path_persists_the_sweep_and_restores_without_the_local_dir(ray_cluster, tmp_path, digits,
                                                                                   monkeypatch, capsys):
    """storage_path an S3 URI (a moto server): Tune's state, the reported raytrain checkpoints, the Optuna
    study, trials.csv and the plots reach the bucket; with the local sweep directory deleted, the same
    call continues from the URI (nothing rerun) and a trial fetches its checkpoint back from it."""
    import shutil

    import optuna
    import pyarrow.fs
    import torch
    from ray import tune

    from examples.digits import build_model, compute_metrics
    from raytrain import Trainer, TrainingArguments
    from raytrain.sweep.trial import _fetch_checkpoint
    from raytrain.checkpoint.store import load_weights, verify_checkpoint

    with moto_bucket(monkeypatch) as (fs, uri):
        train, val = digits
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, per_device_train_batch_size=32,
                                 eval_strategy="steps", eval_steps=5, save_steps=5, logging_steps=5,
                                 save_total_limit=1, disable_tqdm=True)

        def search(resume, output_dir):
            args.output_dir = str(output_dir)
            trainer = Trainer(args=args, model_init=lambda **k: build_model(**k), train_dataset=train,
                              eval_dataset=val, compute_metrics=compute_metrics)
            return trainer.hyperparameter_search({"learning_rate": {"loguniform": [1e-3, 1e-2]}}, n_trials=2,
                                                 direction="maximize", metric="accuracy", scheduler="none", seed=0,
                                                 max_concurrent_trials=1, storage_path=uri, name="cloud",
                                                 resume=resume, plots=False)

        best = search(False, tmp_path / "out")
        local = tmp_path / "out" / "sweeps" / "cloud"
        ids = sorted(best.run_summary["trial_id"])
        assert sorted(p.name for p in local.glob("trial_*")) == [f"trial_{t}" for t in ids]  # trained locally
        listed = {i.path.removeprefix("bucket/sweeps/cloud/") for i in
                  fs.get_file_info(pyarrow.fs.FileSelector("bucket/sweeps/cloud", recursive=True))}
        assert {"optuna.db", "trials.csv"} <= listed and any(n.startswith("experiment_state") for n in listed)
        # Each trial's raytrain checkpoint went to the bucket through Tune, rotated to save_total_limit=1
        # (Tune also keeps the latest: here the same one, step 10).
        for t in ids:
            ckpts = sorted(n for n in listed if n.startswith(f"trial_{t}/checkpoint_") and n.count("/") == 1)
            assert len(ckpts) == 1, ckpts
            state = json.loads(fs.open_input_file(f"bucket/sweeps/cloud/{ckpts[0]}/trainer_state.json").read())
            assert state["global_step"] == 10
        assert best.checkpoint.startswith(f"s3://bucket/sweeps/cloud/trial_{best.run_id}/checkpoint_")

        shutil.rmtree(local)
        local = tmp_path / "elsewhere" / "sweeps" / "cloud"  # as on another machine
        again = search(True, tmp_path / "elsewhere")  # from the URI alone
        assert again.run_id == best.run_id and again.objective == best.objective
        assert "[sweep] resuming s3://bucket/sweeps/cloud\n" in capsys.readouterr().out  # no credentials shown
        assert sorted(p.name for p in local.glob("trial_*")) == []  # nothing rerun
        assert not (tmp_path / "out" / "sweeps" / "cloud").exists()  # the restored searcher uses the new directory
        study = optuna.load_study(study_name="cloud", storage=f"sqlite:///{local / 'optuna.db'}")
        assert len(study.trials) == 2  # fetched from the bucket

        # A trial given its persisted checkpoint (a restore elsewhere, or PBT cloning it) downloads it into its
        # own directory as checkpoint-<step>, verified; another trial's is marked as a clone.
        ckpt = tune.Checkpoint(best.checkpoint.removeprefix("s3://"), filesystem=fs)
        own = local / f"trial_{best.run_id}"
        path, cloned = _fetch_checkpoint(ckpt, str(own))
        assert path == str(own / "checkpoint-10") and not cloned and verify_checkpoint(path)
        model = build_model()
        model.load_state_dict(load_weights(path))
        model.eval()
        with torch.no_grad():
            logits = model(pixels=torch.from_numpy(val["pixels"]))["logits"].numpy()
        assert compute_metrics((logits, val["labels"]))["accuracy"] == pytest.approx(best.objective, abs=1e-12)
        other = next(t for t in ids if t != best.run_id)
        path, cloned = _fetch_checkpoint(ckpt, str(local / f"trial_{other}"))
        assert cloned and path.endswith(f"trial_{other}/checkpoint-10")
