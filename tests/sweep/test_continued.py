"""sweep/continued.py without Ray: what a trial re-reports after a restore, and which trial directories Tune's
saved state does not hold (the Ray side: test_restore.py's SIGKILLed driver)."""

from __future__ import annotations

import json

from raytrain import Trainer
from raytrain.sweep.continued import first_start_since_restore, name_orphans, recorded_steps, unreported
from tests.tiny import TinyClassifier, args_for, columns


def test_evaluations_after_the_recorded_step_are_read_back_from_the_checkpoint(tmp_path):
    args = args_for(tmp_path, max_steps=20, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=5,
                    save_strategy="steps", save_steps=10, logging_steps=5)
    trainer = Trainer(TinyClassifier(), args, train_dataset=columns(16), eval_dataset=columns(6, seed=1))
    trainer.train()
    last = str(tmp_path / "out" / "checkpoint-20")
    max_steps, lost = unreported(last, 10)
    assert max_steps == 20 and [step for _, step, _ in lost] == [15, 20]
    evals = {h["step"]: h for h in trainer.state.log_history if "eval_loss" in h}
    assert [m["eval_loss"] for m, _, _ in lost] == [evals[15]["eval_loss"], evals[20]["eval_loss"]]
    assert all("step" not in m for m, _, _ in lost)
    assert [saved for _, _, saved in lost] == [None, last]  # no checkpoint at 15 (save_steps=10)
    assert unreported(last, 20) == (20, []) and unreported(None, 0) == (0, [])


def test_recorded_steps_and_orphans_from_tunes_saved_state(tmp_path, capsys):
    state = {"trial_data": [
        [json.dumps({"trial_id": "a1"}), json.dumps({"last_result": {"step": 30}})],
        [json.dumps({"trial_id": "b2"}), json.dumps({"last_result": {}})],
    ]}
    (tmp_path / "experiment_state-2026-11-24_00-00-00.json").write_text(json.dumps(state))
    for trial in ("a1", "b2", "c3"):
        (tmp_path / f"trial_{trial}").mkdir()
    known = recorded_steps(str(tmp_path))
    assert known == {"a1": 30, "b2": 0}
    assert name_orphans(str(tmp_path), known) == [str(tmp_path / "trial_c3")]
    assert capsys.readouterr().out == ("[sweep] not in the sweep's last saved state (started after it; left as they "
                                       "are): trial_c3\n")
    assert recorded_steps(str(tmp_path / "nothing")) == {} and name_orphans(str(tmp_path), {}) == []


def test_a_trial_re_reports_on_its_first_start_after_a_restore_only(tmp_path):
    """PBT pausing a trial, or a retry, starts it again within the same restore: nothing more to re-report."""
    trial = str(tmp_path / "trial_a1")
    assert first_start_since_restore(trial, "r1") and not first_start_since_restore(trial, "r1")
    assert first_start_since_restore(trial, "r2")  # the sweep's next restore


def test_a_distributed_trial_re_reports_from_its_own_process_before_its_workers_start(tmp_path, monkeypatch):
    """A trial on 2 workers: after a restore, the evaluations after Tune's recorded step go to Tune from
    the trial's own process (sweep/trial.py's _run_trial, with Tune's API faked), before its TorchTrainer
    starts; then the TorchTrainer resumes from the trial's newest checkpoint."""
    import cloudpickle
    from ray import tune

    from raytrain.sweep import trial as trial_module

    trial_dir = tmp_path / "trial_a1"
    kw = dict(max_steps=20, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=5,
              save_strategy="steps", save_steps=10, logging_steps=5)
    first = Trainer(TinyClassifier(), args_for(tmp_path, output_dir=str(trial_dir), **kw),
                    train_dataset=columns(16), eval_dataset=columns(6, seed=1))
    first.train()  # the trial's first life: checkpoints 10 and 20, Tune's saved state heard of step 10 only
    evals = {h["step"]: h["eval_loss"] for h in first.state.log_history if "eval_loss" in h}
    trainer = Trainer(args=args_for(tmp_path, scaling={"num_workers": 2}, **kw), model_init=TinyClassifier,
                      train_dataset=columns(16), eval_dataset=columns(6, seed=1))
    spec = {"trainer": cloudpickle.dumps(trainer), "metric": "eval_loss", "mode": "min", "directions": ["minimize"],
            "compute_objective": lambda m: m["eval_loss"], "scheduler": None, "recorded": {"a1": 10},
            "restored": "r1", "callbacks": [], "remote": False}

    class Context:
        def get_trial_id(self):
            return "a1"

        def get_trial_name(self):
            return "trial_a1"

    reported, launched = [], []
    monkeypatch.setattr(tune, "get_context", lambda: Context())
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "report", lambda result, checkpoint=None: reported.append(result))
    monkeypatch.setattr(trial_module, "_run_distributed",
                        lambda trainer, resume, reporter, *a: launched.append((resume, len(reported))))
    trial_module._run_trial({}, spec, str(trial_dir))
    assert [(r["step"], r["objective"], r["max_steps"]) for r in reported] == [(15, evals[15], 20), (20, evals[20], 20)]
    assert launched == [(str(trial_dir / "checkpoint-20"), 2)]  # after the re-reports, from the newest checkpoint
    trial_module._run_trial({}, spec, str(trial_dir))  # started again within the same restore: nothing more
    assert len(reported) == 2 and len(launched) == 2
