"""report_to's trackers (HF's names): transformers' own callbacks where it is installed, TensorBoard
without it, one-line errors at argument validation, rank 0 only; TensorBoard's event files read back
and compared with trainer_state.json and with transformers' own Trainer."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest
import torch

import raytrain.hf.trackers as trackers
from raytrain import Trainer, TrainingArguments
from raytrain.config.sections import ConfigError
from raytrain.run import main
from raytrain.callbacks.state import TrainerControl, TrainerState

from tests.tiny import TinyClassifier, columns

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard is in the dev extra")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("azure_ml, clearml, codecarbon, comet_ml, dagshub, dvclive, flyte, kubeflow, mlflow, neptune, swanlab, "
         "tensorboard, trackio, wandb")


def scalars(logdir) -> dict[str, dict[int, float]]:
    """Every scalar of the event files under `logdir`: tag -> {step: value}."""
    (run,) = {os.path.dirname(p) for p in glob.glob(os.path.join(str(logdir), "**", "events.out.tfevents.*"),
                                                     recursive=True)}
    acc = event_accumulator.EventAccumulator(run, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def logged(log_history: list[dict], key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in log_history if key in e}


def _train(tmp_path, **kw) -> Trainer:
    args = TrainingArguments(str(tmp_path / "out"), report_to="tensorboard", max_steps=6, logging_steps=2,
                             eval_strategy="steps", eval_steps=3, per_device_train_batch_size=4, disable_tqdm=True,
                             seed=0, **kw)
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(32), eval_dataset=columns(8, seed=1))
    trainer.train()
    trainer.save_state()
    return trainer


def _assert_scalars_are_the_log_history(logdir, output_dir) -> dict:
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    got = scalars(logdir)
    for key, tag in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"),
                     ("learning_rate", "train/learning_rate"), ("eval_loss", "eval/loss")):
        want = logged(history, key)
        assert want and got[tag] == pytest.approx(want, rel=1e-6), tag  # event files store float32
    assert sorted(got["train/loss"]) == [2, 4, 6]
    return got


def test_tensorboard_through_transformers_writes_the_log_history_under_logging_dir(tmp_path):
    pytest.importorskip("transformers")
    trainer = _train(tmp_path, logging_dir=str(tmp_path / "tb"), hub_token="hf_secret_value_123")
    from transformers.integrations import TensorBoardCallback

    assert type(trainer.callback_handler.callbacks[-1]) is TensorBoardCallback  # transformers' own
    _assert_scalars_are_the_log_history(tmp_path / "tb", trainer.args.output_dir)
    assert not os.path.exists(os.path.join(trainer.args.output_dir, "runs"))
    (run,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    text = open(run, "rb").read()
    assert b"learning_rate" in text and b"<redacted>" in text  # the args text, its token redacted
    assert b"hf_secret_value_123" not in text


def test_tensorboard_without_transformers_writes_the_same_scalars(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "transformers_installed", lambda: False)
    trainer = _train(tmp_path)
    assert type(trainer.callback_handler.callbacks[-1]) is trackers.TensorBoardCallback
    (logdir,) = glob.glob(os.path.join(trainer.args.output_dir, "runs", "*"))  # torch's default name
    got = _assert_scalars_are_the_log_history(logdir, trainer.args.output_dir)
    assert {"train/epoch", "eval/runtime", "train/train_loss"} <= set(got)  # transformers' tags


def test_transformers_tensorboard_callback_on_raytrain_matches_transformers_trainer(tmp_path, monkeypatch):
    """One batch per step (the whole data set): both Trainers see the same losses; each writes them
    through transformers' TensorBoardCallback under the same tags at the same steps."""
    transformers = pytest.importorskip("transformers")
    from tests.hf.scripts import TinyRegressor

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    rows = [{"x": xi, "labels": yi} for xi, yi in zip(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]))]
    common = dict(max_steps=5, logging_steps=1, per_device_train_batch_size=16, learning_rate=0.1, optim="adamw_torch",
                  report_to="tensorboard", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    runs = {}
    for name, (trainer_cls, args_cls) in {"hf": (transformers.Trainer, transformers.TrainingArguments),
                                          "rt": (Trainer, TrainingArguments)}.items():
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / name / "tb"))
        trainer = trainer_cls(model=TinyRegressor(), args=args_cls(str(tmp_path / name), **common),
                              train_dataset=rows)
        trainer.train()
        got = scalars(tmp_path / name / "tb")
        assert got["train/loss"] == pytest.approx(logged(trainer.state.log_history, "loss"), rel=1e-6)
        runs[name] = got
    assert set(runs["rt"]) == set(runs["hf"])
    for tag in ("train/loss", "train/grad_norm", "train/learning_rate", "train/epoch"):
        assert runs["rt"][tag] == pytest.approx(runs["hf"][tag], rel=1e-4), tag


def _wandb_records(path):
    """The records of an offline run's .wandb file (wandb's LevelDB-style log: a 7-byte header, 32 KiB
    blocks of chunks, each chunk: crc32 (4), length (2), type (1: whole, 2-4: first, middle, last))."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_gets_the_losses_and_no_secret(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (not a raytrain dependency)")
    pytest.importorskip("transformers")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = TrainingArguments(str(tmp_path / "out"), report_to="wandb", max_steps=4, logging_steps=2,
                             per_device_train_batch_size=4, disable_tqdm=True, seed=0, run_name="tiny",
                             hub_token="hf_secret_value_123")
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16))
    trainer.train()
    import wandb

    assert wandb.run.name == "tiny"
    wandb.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    losses, config = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        items = record.history.item if kind == "history" else record.config.update if kind == "config" else []
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
        if "train/loss" in row:
            losses[row["train/global_step"]] = row["train/loss"]
        if kind == "config":
            config.update(row)
    assert losses == pytest.approx(logged(trainer.state.log_history, "loss"))
    assert sorted(losses) == [2, 4]
    assert config["hub_token"] == "<redacted>" and config["learning_rate"] == 5e-05
    assert b"hf_secret_value_123" not in open(path, "rb").read()


# ---------------------------------------------------------------- rank 0 only


@pytest.mark.parametrize("with_transformers", [True, False])
def test_only_world_process_zero_writes(tmp_path, monkeypatch, with_transformers):
    if with_transformers:
        pytest.importorskip("transformers")
    else:
        monkeypatch.setattr(trackers, "transformers_installed", lambda: False)
    args = TrainingArguments(str(tmp_path), report_to="tensorboard", logging_dir=str(tmp_path / "tb"))
    (cb,) = trackers.integration_callbacks(args)
    for rank in (1, 0):
        state = TrainerState(global_step=3, is_world_process_zero=rank == 0, is_local_process_zero=rank == 0)
        cb.on_train_begin(args, state, TrainerControl())
        cb.on_log(args, state, TrainerControl(), logs={"loss": float(rank + 1)})
        cb.on_train_end(args, state, TrainerControl())
        if rank == 1:
            assert not os.path.exists(tmp_path / "tb")  # another rank: nothing written
    assert scalars(tmp_path / "tb")["train/loss"] == {3: 1.0}


# ---------------------------------------------------------------- validation


def _hide(monkeypatch, *modules):
    """Make these modules look uninstalled to importlib.util.find_spec."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in modules else find_spec(name, *a))


def test_unknown_name_is_one_line_listing_the_valid_names():
    with pytest.raises(ConfigError) as e:
        TrainingArguments(report_to=["tensorboard", "tensorbored"])
    assert str(e.value) == f"report_to: must be one of none, all, {NAMES}, got 'tensorbored'"


@pytest.mark.parametrize("name, hidden, message", [
    ("wandb", ("wandb",), "wandb is not installed; pip install wandb"),
    ("comet_ml", ("comet_ml",), "comet_ml needs comet-ml, which is not installed; pip install comet-ml"),
    ("azure_ml", ("azureml",), "azure_ml needs azureml-core, which is not installed; pip install azureml-core"),
    ("tensorboard", ("tensorboard", "tensorboardX"), "tensorboard is not installed; pip install tensorboard"),
    ("trackio", ("trackio", "transformers"),
     "trackio needs trackio and transformers, which are not installed; pip install trackio transformers"),
    ("swanlab", ("transformers",), "swanlab needs transformers, which is not installed; pip install transformers"),
    ("kubeflow", (), "kubeflow needs KUBEFLOW_TRAINER_SERVER_URL (set inside a Kubeflow Trainer job)"),
])
def test_a_library_that_is_not_installed_fails_at_validation(monkeypatch, name, hidden, message):
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    if name == "swanlab" and not importlib.util.find_spec("swanlab"):
        hidden = ("swanlab", "transformers")
        message = "swanlab needs swanlab and transformers, which are not installed; pip install swanlab transformers"
    _hide(monkeypatch, *hidden)
    with pytest.raises(ConfigError) as e:
        TrainingArguments(report_to=name)
    assert str(e.value) == f"report_to: {message}"


def test_tensorboard_and_mlflow_need_no_transformers(monkeypatch):
    _hide(monkeypatch, "transformers")
    assert TrainingArguments(report_to=["tensorboard", "mlflow", "none"]).report_to == ["tensorboard", "mlflow"]
    assert TrainingArguments(report_to="all").report_to == ["mlflow", "tensorboard"]
    _hide(monkeypatch, "tensorboard", "tensorboardX", "transformers")
    assert TrainingArguments(report_to="all").report_to == ["mlflow"]


def test_all_is_what_transformers_finds_installed():
    pytest.importorskip("transformers")
    from transformers.integrations import get_available_reporting_integrations

    assert TrainingArguments(report_to="all").report_to == get_available_reporting_integrations()
    assert "tensorboard" in TrainingArguments(report_to="all").report_to  # tensorboard is in the dev extra


def test_logging_dir_warns_only_without_tensorboard(tmp_path, caplog, monkeypatch):
    import raytrain.config.validation

    monkeypatch.setattr(raytrain.config.validation, "_warned", set())
    TrainingArguments(str(tmp_path), logging_dir="tb", report_to="tensorboard")
    assert "logging_dir" not in caplog.text
    TrainingArguments(str(tmp_path), logging_dir="tb")
    assert "logging_dir is not used without report_to tensorboard" in caplog.text


# ---------------------------------------------------------------- the CLI


def test_cli_yaml_report_to_tensorboard(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # examples.digits by import string
    out = tmp_path / "digits"
    config = tmp_path / "digits.yaml"
    config.write_text(open(os.path.join(ROOT, "examples", "digits.yaml")).read()
                      + f"report_to: tensorboard\noutput_dir: {out}\n")
    code = main(["--config", str(config), "--set", "max_steps=10", "--set", "logging_steps=5",
                 "--set", "eval_strategy=steps", "--set", "eval_steps=5", "--set", "save_strategy=no",
                 "--set", "load_best_model_at_end=false", "--no-report"])
    assert code == 0, capsys.readouterr().err
    (logdir,) = glob.glob(str(out / "runs" / "*"))
    got = scalars(logdir)
    with open(out / "trainer_state.json") as f:
        history = json.load(f)["log_history"]
    assert got["train/loss"] == pytest.approx(logged(history, "loss"), rel=1e-6)
    assert sorted(got["train/loss"]) == [5, 10]
    assert got["eval/accuracy"] == pytest.approx(logged(history, "eval_accuracy"), rel=1e-6)


def test_cli_not_installed_tracker_is_one_line(tmp_path, capsys, monkeypatch):
    _hide(monkeypatch, "wandb")
    monkeypatch.chdir(ROOT)
    code = main(["--config", "examples/digits.yaml", "--set", f"output_dir={tmp_path}", "--set", "report_to=wandb"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == ["error: report_to: wandb is not installed; pip install wandb"]
