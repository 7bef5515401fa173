"""hyperparameter_search: the sweep directory, trials table, best checkpoint, schedulers, PBT, failures,
multi-objective, MLflow parent/child runs, distributed trials, the CLI. Sweeps are tiny (digits, a few
evaluations per trial) and share the session's Ray cluster; one trial at a time (one trial process, reused by the
next trial) unless several at once is what a test needs (ASHA, PBT)."""

from __future__ import annotations

import json
import os
import tempfile

import pandas as pd
import pytest

from raytrain import Trainer, TrainingArguments
from tests.sweep.test_restore import moto_bucket

pytestmark = pytest.mark.ray


def _trainer(tmp_path, digits, model_init=None, callbacks=None, **kw):
    from examples.digits import build_model, compute_metrics

    train, val = digits
    base = dict(output_dir=str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=32,
                eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=5, logging_steps=5,
                save_total_limit=1, disable_tqdm=True)
    args = TrainingArguments(**{**base, **kw})
    return Trainer(args=args, model_init=model_init or (lambda **k: build_model(**k)), train_dataset=train,
                   eval_dataset=val, compute_metrics=compute_metrics, callbacks=callbacks)


def _ours_in_tmp() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("raytrain")}


def test_asha_sweep_directory_table_and_best_checkpoint(ray_cluster, tmp_path, digits, capsys):
    import optuna
    import torch

    from examples.digits import build_model, compute_metrics
    from raytrain.checkpoint.store import load_weights

    before = _ours_in_tmp()
    space = {"learning_rate": {"loguniform": [1e-3, 1e-2]}, "model.hidden_size": {"choice": [32, 64]}}
    best = _trainer(tmp_path, digits).hyperparameter_search(
        space, n_trials=6, direction="maximize", metric="accuracy", scheduler="asha", seed=0,
        max_concurrent_trials=2, name="digits")
    sweep = tmp_path / "out" / "sweeps" / "digits"
    table = pd.read_csv(sweep / "trials.csv", dtype={"trial_id": str})

    # One directory per trial under the sweep directory, one row each; nothing of ours left in /tmp.
    dirs = sorted(p.name for p in sweep.iterdir() if p.name.startswith("trial_"))
    assert dirs == sorted(f"trial_{t}" for t in table["trial_id"]) and len(dirs) == 6
    assert all((sweep / d / "trial.log").stat().st_size > 0 and (sweep / d / "result.json").exists() for d in dirs)
    assert _ours_in_tmp() == before
    assert list(table.columns[:3]) == ["trial_id", "learning_rate", "model.hidden_size"]
    assert set(table["status"]) <= {"finished", "stopped early"} and (table["status"] == "finished").any()
    # ASHA stopped some trials early: fewer steps than the 6 x 20 every trial runs without a scheduler.
    assert table["steps"].sum() < 6 * 20
    # save_total_limit=1 rotates each trial to one checkpoint, the best one kept.
    assert all(len([c for c in os.listdir(sweep / d) if c.startswith("checkpoint-")]) <= 2 for d in dirs)

    # The best trial's checkpoint holds the weights whose accuracy is the reported objective.
    assert best.run_summary.equals(table) or len(best.run_summary) == 6
    assert best.objective == table["objective"].max() > 0.5
    assert best.checkpoint.startswith(str(sweep / f"trial_{best.run_id}"))
    model = build_model(hidden_size=best.hyperparameters["model.hidden_size"])
    model.load_state_dict(load_weights(best.checkpoint))
    model.eval()
    _, val = digits
    with torch.no_grad():
        logits = model(pixels=torch.from_numpy(val["pixels"]))["logits"].numpy()
    assert compute_metrics((logits, val["labels"]))["accuracy"] == pytest.approx(best.objective, abs=1e-12)

    study = optuna.load_study(study_name="digits", storage=f"sqlite:///{sweep / 'optuna.db'}")
    assert len(study.trials) == 6
    for f in ("optimization_history.html", "param_importances.html", "parallel_coordinate.html",
              "plots/objective.png"):  # the one objective plot, as `python -m raytrain.report` draws it
        assert (sweep / f).stat().st_size > 1000, f
    out = capsys.readouterr().out
    assert out.count("started learning_rate=") == 6
    assert f"[sweep] best trial {best.run_id}: objective=" in out
    assert "Current time:" not in out and "Trial status" not in out  # no Tune progress tables


def test_each_trial_trains_the_users_trainer_subclass_with_all_its_arguments(ray_cluster, tmp_path, digits):
    """A trial runs the user's own Trainer: its class (an overridden compute_loss whose loss is 3.25 exactly)
    and the arguments it was built with (processing_class, optimizer_cls_and_kwargs), with the trial's args."""
    import torch

    from examples.digits import build_model, compute_metrics

    class ConstantLoss(Trainer):  # local: cloudpickle ships it by value to the trials
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            seen = os.path.join(self.args.output_dir, "seen.json")
            if self.optimizer is not None and not os.path.exists(seen):
                group = self.optimizer.param_groups[0]
                with open(seen, "w") as f:
                    json.dump({"processing_class": self.processing_class, "optimizer": type(self.optimizer).__name__,
                               "momentum": group["momentum"], "weight_decay": group["weight_decay"]}, f)
            loss = loss * 0.0 + 3.25
            return (loss, outputs) if return_outputs else loss

    train, val = digits
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=32,
                             eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=4,
                             logging_steps=2, disable_tqdm=True)
    trainer = ConstantLoss(args=args, model_init=lambda **k: build_model(**k), train_dataset=train, eval_dataset=val,
                           compute_metrics=compute_metrics, processing_class="digits-v1",
                           optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.5}))
    best = trainer.hyperparameter_search(
        {"weight_decay": {"uniform": [0.01, 0.1]}}, n_trials=2, compute_objective=lambda m: m["eval_loss"],
        scheduler="none", seed=0, max_concurrent_trials=1, name="subclass", plots=False)
    table = best.run_summary.set_index("trial_id")
    assert len(table) == 2 and list(table["status"]) == ["finished", "finished"]
    assert list(table["objective"]) == [3.25, 3.25]  # the override's eval loss, in every trial
    for trial_id, row in table.iterrows():
        trial_dir = tmp_path / "out" / "sweeps" / "subclass" / f"trial_{trial_id}"
        state = json.loads((trial_dir / "checkpoint-4" / "trainer_state.json").read_text())
        assert [h["loss"] for h in state["log_history"] if "loss" in h] == [3.25, 3.25]
        assert state["trial_params"] == {"weight_decay": pytest.approx(row["weight_decay"])}
        assert state["trial_name"] and state["is_hyper_param_search"]
        seen = json.loads((trial_dir / "seen.json").read_text())
        assert seen == {"processing_class": "digits-v1", "optimizer": "SGD", "momentum": 0.5,
                        "weight_decay": pytest.approx(row["weight_decay"])}


@pytest.mark.timeout(300)
def test_failures_multi_objective_and_mlflow_parent_child(ray_cluster, tmp_path, digits, monkeypatch, capsys):
    mlflow = pytest.importorskip("mlflow")
    from examples.digits import build_model

    arm, fired = tmp_path / "arm", tmp_path / "fired"

    def model_init(**kw):  # the first trial to start fails; the driver's own call does not
        if arm.exists() and not fired.exists():
            fired.touch()
            raise RuntimeError("model_init exploded on purpose")
        return build_model(**kw)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sweep-test")
    trainer = _trainer(tmp_path, digits, model_init=model_init, max_steps=10, report_to="mlflow")
    arm.touch()
    front = trainer.hyperparameter_search(
        {"learning_rate": {"loguniform": [1e-3, 3e-2]}}, n_trials=3, direction=["minimize", "maximize"],
        compute_objective=lambda m: (m["eval_loss"], m["eval_accuracy"]), scheduler="none", sampler="random",
        seed=1, max_concurrent_trials=1, name="multi")
    sweep = tmp_path / "out" / "sweeps" / "multi"
    table = pd.read_csv(sweep / "trials.csv", dtype={"trial_id": str}, keep_default_na=False)
    failed = table[table["status"] == "failed"]
    assert len(table) == 3 and len(failed) == 1
    assert failed["error"].iloc[0] == "RuntimeError: model_init exploded on purpose"
    done = table[table["status"] == "finished"]
    assert len(done) == 2 and (done["steps"] == 10).all()  # no scheduler: every trial runs max_steps

    # The Pareto front: the finished trials no other finished trial beats on both objectives.
    assert isinstance(front, list) and front
    rows = {r.trial_id: (float(r.objective_0), float(r.objective_1)) for r in done.itertuples()}
    dominated = {a for a in rows for b in rows if b != a and rows[b][0] <= rows[a][0] and rows[b][1] >= rows[a][1]
                 and rows[b] != rows[a]}
    assert sorted(b.run_id for b in front) == sorted(set(rows) - dominated)
    assert all(b.objective == list(rows[b.run_id]) for b in front)
    assert (sweep / "pareto_front.html").exists()

    # MLflow: one parent, one child per trial (params, metrics by step, status), the best tagged.
    assert not list(sweep.glob("trial_*/mlflow.db")) and not list(sweep.glob("trial_*/mlruns"))
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("sweep-test")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["raytrain.trial_id"]: r for r in runs if r.data.tags.get("mlflow.parentRunId")}
    assert parent.info.run_name == "multi" and parent.info.status == "FINISHED"
    assert sorted(children) == sorted(table["trial_id"])
    assert {t: children[t].info.status for t in table["trial_id"]} == \
        {t: ("FAILED" if s == "failed" else "FINISHED") for t, s in zip(table["trial_id"], table["status"])}
    for t in done["trial_id"]:
        child = children[t]
        lr = float(table.set_index("trial_id").loc[t, "learning_rate"])
        assert float(child.data.params["learning_rate"]) == pytest.approx(lr)
        assert [m.step for m in client.get_metric_history(child.info.run_id, "eval_accuracy")] == [5, 10]
    assert parent.data.tags["best_trial_id"] == front[0].run_id
    # The sweep says where its runs are; the parent carries its settings and results; each child its checkpoint.
    assert f"[sweep] MLflow: parent run 'multi' ({parent.info.run_id}), one child run per trial; see them with: " \
           f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in capsys.readouterr().out
    assert parent.data.params["sweep.n_trials"] == "3" and parent.data.params["sweep.sampler"] == "random"
    assert parent.data.params["sweep.space.learning_rate"] == "loguniform[0.001, 0.03]"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    # Every file the sweep drew is an artifact. Two objectives have no one `objective` to draw over steps:
    # no plots/objective.png (tests/sweep/test_sweep_tracking.py sends a single objective's PNG to the parent).
    drawn = {p.name for p in sweep.glob("*.html")}
    assert drawn >= {"pareto_front.html", "optimization_history.html"} and not (sweep / "plots").exists()
    assert artifacts == {"trials.csv"} | drawn
    for t in done["trial_id"]:
        assert children[t].data.tags["checkpoint"] == table.set_index("trial_id").loc[t, "checkpoint"]
    assert "model_init exploded" in children[failed["trial_id"].iloc[0]].data.tags["raytrain.error"]


@pytest.mark.parametrize("scheduler,sampler", [("hyperband", "cmaes"), ("median", "qmc")])
def test_hyperband_median_cmaes_and_qmc_run_real_sweeps(ray_cluster, tmp_path, digits, scheduler, sampler):
    """Each scheduler and sampler not covered above runs a real (tiny) sweep to its n_trials; the sweep's
    Tune state names the scheduler, and the study holds what only that sampler writes."""
    import optuna
    from ray import cloudpickle
    from ray.tune import schedulers as s

    if sampler == "cmaes":
        pytest.importorskip("cmaes")
    best = _trainer(tmp_path, digits, max_steps=10).hyperparameter_search(
        {"learning_rate": {"loguniform": [1e-4, 3e-2]}, "weight_decay": {"uniform": [0.0, 0.1]}}, n_trials=4,
        direction="maximize", metric="accuracy", scheduler=scheduler, sampler=sampler, seed=0,
        max_concurrent_trials=1, name=scheduler, plots=False)
    sweep = tmp_path / "out" / "sweeps" / scheduler
    table = best.run_summary
    assert len(table) == 4 and set(table["status"]) <= {"finished", "stopped early"}
    assert (table["status"] == "finished").any() and table["objective"].notna().all()
    tuned = cloudpickle.loads((sweep / "tuner.pkl").read_bytes())["_tune_config"].scheduler
    if scheduler == "hyperband":  # async HyperBand: ASHA's class with several brackets
        assert isinstance(tuned, s.AsyncHyperBandScheduler) and len(tuned._brackets) == 3
    else:
        assert isinstance(tuned, s.MedianStoppingRule)
    storage = optuna.storages.RDBStorage(f"sqlite:///{sweep / 'optuna.db'}")
    study = optuna.load_study(study_name=scheduler, storage=storage)
    assert len(study.trials) == 4
    if sampler == "cmaes":  # CMA-ES keeps its optimizer in the trials it sampled: all but the first (sampled
        # independently; one trial at a time here)
        assert sum(any(k.startswith("cma:") for k in t.system_attrs) for t in study.trials) == 3
    else:  # QMC counts its points in the study: the first trial samples at random (it learns the space
        # from it), the other 3 take points 0..2
        attrs = storage.get_study_system_attrs(storage.get_study_id_from_name(scheduler))
        assert [v for k, v in attrs.items() if k.startswith("qmc:")] == [2]


def test_pbt_clones_a_checkpoint_with_the_mutated_learning_rate(ray_cluster, tmp_path, digits):
    trainer = _trainer(tmp_path, digits, lr_scheduler_type="constant", save_total_limit=None)
    best = trainer.hyperparameter_search(
        {"learning_rate": {"loguniform": [1e-4, 1e-2]}}, n_trials=2, direction="maximize", metric="accuracy",
        scheduler="pbt", scheduler_kwargs={"perturbation_interval": 2, "quantile_fraction": 0.5, "synch": True}, seed=0,
        name="pbt")
    sweep = tmp_path / "out" / "sweeps" / "pbt"
    table = best.run_summary
    assert (table["steps"] == 20).all() and (table["status"] == "finished").all()
    clones = []
    for d in sweep.glob("trial_*"):
        for line in (d / "trial.log").read_text().splitlines():
            if "PBT: continuing from" in line:
                clones.append((d, line))
    # A clone at step 20 (the end) trains no further: look at one made before.
    clones = [(d, *line.split("continuing from ")[1].split(" with learning_rate=")) for d, line in clones]
    clones = [(d, source, lr) for d, source, lr in clones if int(source.rsplit("-", 1)[1]) < 20]
    assert clones, "PBT never cloned a trial before its last evaluation"
    d, source, lr = clones[0]
    assert os.path.dirname(source) != str(d) and os.path.isdir(source)
    step = int(source.rsplit("-", 1)[1])
    # The clone trained on from the source step with the mutated learning rate (constant schedule).
    final = sorted(d.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    history = json.loads((final / "trainer_state.json").read_text())["log_history"]
    after = [h["learning_rate"] for h in history if "learning_rate" in h and h["step"] > step]
    assert after and all(v == pytest.approx(float(lr)) for v in after)
    before = [h["learning_rate"] for h in history if "learning_rate" in h and h["step"] <= step]
    assert before and all(v != pytest.approx(float(lr)) for v in before)  # the source trial's own rate


# Long (3 minutes): by default the URI sweep's restore runs in test_restore.py, a killed worker's restart in
# driver/test_launch.py and a rank's trial reporter in test_trial_register.py.
@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_two_worker_trial_at_a_uri_restores_elsewhere_and_restarts_a_killed_worker(ray_cluster, tmp_path, digits,
                                                                                     monkeypatch):
    """A 2-worker trial in a sweep whose storage_path is an S3 URI (a moto server). Its driver is SIGKILLed
    after step 7 (the trial unfinished in Tune's saved state); with the local sweep directory deleted, the sweep
    is restored into another output_dir and the trial continues from checkpoint-5, which its TorchTrainer
    persisted in the bucket; there rank 1 is SIGKILLed after step 7 and the trial's FailureConfig
    (scaling.max_failures) restarts the group from checkpoint-5 again. The trial ends with the weights of one
    process trained with the same global batch and seed (the same maths, as test_launch shows)."""
    import shutil
    import subprocess
    import sys

    import pyarrow.fs
    import torch
    from safetensors.torch import load as load_safetensors

    from examples.digits import build_model, compute_metrics
    from raytrain.checkpoint.store import load_weights
    from raytrain.runtime.seeding import set_seed
    from tests.sweep._sweep_driver import KillWorkerOnce, ddp_search, ddp_trainer

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with moto_bucket(monkeypatch) as (fs, uri):
        driver = subprocess.run([sys.executable, os.path.join(root, "tests", "sweep", "_sweep_driver.py"),
                                 str(tmp_path / "out"), "ddp", uri], cwd=root, env=env, capture_output=True, text=True,
                                timeout=400)
        assert driver.returncode == -9, driver.stdout[-3000:] + driver.stderr[-3000:]
        (first,) = (tmp_path / "out" / "sweeps" / "ddp").glob("trial_*")
        assert (first / "starts.txt").read_text().split() == ["0"]
        ray_train = f"bucket/sweeps/ddp/{first.name}/ray_train"
        assert fs.get_file_info(f"{ray_train}/checkpoint-5/manifest.json").type == pyarrow.fs.FileType.File

        shutil.rmtree(tmp_path / "out")  # as on another machine
        trainer = ddp_trainer(str(tmp_path / "elsewhere"), KillWorkerOnce(str(tmp_path / "killed"), rank=1, step=7))
        best = ddp_search(trainer, uri, True)
        table = best.run_summary
        assert (tmp_path / "killed").exists() and f"trial_{best.run_id}" == first.name
        assert list(table["status"]) == ["finished"] and list(table["steps"]) == [10]
        trial_dir = tmp_path / "elsewhere" / "sweeps" / "ddp" / first.name
        # Restored from the bucket's checkpoint-5, then restarted from it after the kill (no newer one).
        assert (trial_dir / "starts.txt").read_text().split() == ["5", "5"]
        # The best checkpoint is the bucket's copy (save_total_limit=1: Ray Train rotated checkpoint-5 away).
        assert best.checkpoint == f"s3://{ray_train}/checkpoint-10"
        kept = fs.get_file_info(pyarrow.fs.FileSelector(ray_train))
        assert sorted(i.base_name for i in kept if i.type == pyarrow.fs.FileType.Directory) == ["checkpoint-10"]
        ours = load_weights(str(trial_dir / "checkpoint-10"))
        with fs.open_input_file(f"{ray_train}/checkpoint-10/model.safetensors") as f:
            assert all(torch.equal(v, ours[k]) for k, v in load_safetensors(f.read()).items())

    set_seed(trainer.args.seed)  # as the trial seeds before model_init
    model = build_model(dropout=0.0)
    args = TrainingArguments(output_dir=str(tmp_path / "one"), max_steps=10, per_device_train_batch_size=64,
                             learning_rate=3e-3, save_steps=10, disable_tqdm=True)
    one = Trainer(model=model, args=args, train_dataset=digits[0], eval_dataset=digits[1],
                  compute_metrics=compute_metrics)
    one.train()
    ref = load_weights(str(tmp_path / "one" / "checkpoint-10"))
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-5)
    assert best.objective == pytest.approx(one.evaluate()["eval_accuracy"], abs=1 / 359 + 1e-9)


@pytest.mark.timeout(300)
def test_the_docs_python_sweep_runs(ray_cluster, tmp_path, monkeypatch, capsys):
    """docs/snippets/sweep.py as shown, smaller: 2 of its 16 trials, 20 steps instead of 180."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "snippets", "sweep.py")) as f:
        shown = f.read()
    small = shown
    for big, little in [("n_trials=16", "n_trials=2"), ("max_steps=180", "max_steps=20"), ("eval_steps=45", "eval_steps=10"),
                        ("save_steps=45", "save_steps=10")]:
        assert big in small, big
        small = small.replace(big, little)
    monkeypatch.chdir(tmp_path)  # its output_dir is relative: runs/digits
    exec(compile(small, "sweep.py", "exec"), {"__name__": "__main__"})
    table = pd.read_csv(tmp_path / "runs" / "digits" / "sweeps" / "digits" / "trials.csv", dtype={"trial_id": str})
    assert len(table) == 2 and set(table["status"]) <= {"finished", "stopped early"}
    ids = set(table["trial_id"])
    out = capsys.readouterr().out
    # print(best.run_id, best.objective, best.hyperparameters, best.checkpoint): the id, then the objective
    [line] = [ln for ln in out.splitlines() if ln.split()[:1] and ln.split()[0] in ids and "{" in ln]
    assert float(line.split()[1]) == pytest.approx(table["objective"].max(), abs=1e-4) and "checkpoint-" in line


@pytest.mark.timeout(300)
def test_cli_search_resumes_by_name(ray_cluster, tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    import shlex

    from raytrain.run import main

    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The docs' sweep command (docs/snippets/sweep.sh, search_spaces/digits.yaml), 2 of its 8 trials.
    with open(os.path.join(root, "docs", "snippets", "sweep.sh")) as f:
        [shown] = [line for line in f.read().splitlines() if line.startswith("python -m raytrain.run")]
    argv = shlex.split(shown)[3:] + [
        "--set", f"output_dir={tmp_path / 'out'}", "--set", "search.num_samples=2",  # the CLI's override of the search YAML
        "--set", "search.max_concurrent_trials=1"]
    cmd = [sys.executable, "-m", "raytrain.run", *argv]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stdout.splitlines() if "best trial" in ln]  # printed once
    assert line.startswith("[sweep] best trial ")
    assert "learning_rate" in line and float(line.split("objective=")[1].split()[0]) > 0.8
    table = pd.read_csv(tmp_path / "out" / "sweeps" / "digits" / "trials.csv")
    assert len(table) == 2
    # Continuing a finished sweep (what --resume auto calls) is test_tune_restore's cloud test, in-process.
    # --resume never refuses before any work: the CLI's main in this process (a second subprocess costs seconds)
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert main([*argv, "--resume", "never"]) == 2
    assert "already holds a sweep" in capsys.readouterr().err
