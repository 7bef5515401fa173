"""A continued sweep loses no trial: what Tune's last saved state recorded, and what the trials did after it.

Tune saves its state at most once a second; a driver that dies in between leaves trials whose own
checkpoints (and evaluations, in their trainer_state.json) run past their last recorded result, and
trial directories of trials Tune never recorded. On resume each trial is told the step Tune recorded
and re-reports its evaluations after it (from the checkpoint it continues); directories Tune does not
know are named in one line.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

from ..checkpoint.store import TRAINER_STATE, checkpoint_dir

logger = logging.getLogger(__name__)


def recorded_steps(state_dir: str) -> dict[str, int]:
    """trial id -> the `step` of its last result in Tune's newest saved experiment state ({} when
    there is none to read, e.g. at a URI)."""
    files = sorted(glob.glob(os.path.join(state_dir, "experiment_state-*.json")), key=os.path.getmtime)
    if not files:
        return {}
    with open(files[-1]) as f:
        trials = json.load(f).get("trial_data", [])
    steps = {}
    for entry in trials:
        meta = entry[0] if isinstance(entry[0], dict) else json.loads(entry[0])
        runtime = entry[1] if isinstance(entry[1], dict) else json.loads(entry[1])
        last = runtime.get("last_result") or {}
        steps[meta["trial_id"]] = int(last.get("step") or 0)
    return steps


def name_orphans(sweep_dir: str, known: dict[str, int]) -> list[str]:
    """Trial directories of trials Tune's saved state does not hold (started after its last save): the
    continued sweep does not run them again; their checkpoints stay where they are. Printed in one line."""
    orphans = sorted(d for d in glob.glob(os.path.join(sweep_dir, "trial_*"))
                     if os.path.isdir(d) and os.path.basename(d).removeprefix("trial_") not in known)
    if orphans and known:
        print(f"[sweep] not in the sweep's last saved state (started after it; left as they are): "
              f"{', '.join(os.path.basename(d) for d in orphans)}", flush=True)
    return orphans if known else []


def first_start_since_restore(trial_dir: str, restored: str) -> bool:
    """True the first time a trial starts after the restore `restored` (a token per restore): later starts
    of the same trial (PBT pausing it, a retry) have nothing Tune lost to re-report."""
    marker = os.path.join(trial_dir, f".restored-{restored}")
    if os.path.exists(marker):
        return False
    os.makedirs(trial_dir, exist_ok=True)
    open(marker, "w").close()
    return True


def unreported(checkpoint: str | None, recorded: int) -> tuple[int, list[tuple[dict[str, Any], int, str | None]]]:
    """The run's max_steps and (metrics, step, checkpoint dir or None) of each evaluation in `checkpoint`'s
    log history after `recorded`, the last step Tune heard of: what the trial reported but Tune's saved
    state lost."""
    if checkpoint is None:
        return 0, []
    with open(os.path.join(checkpoint, TRAINER_STATE)) as f:
        state = json.load(f)
    history = state.get("log_history", [])
    out = []
    for entry in history:
        step = int(entry.get("step", 0))
        if step > recorded and any(k.startswith("eval_") for k in entry):
            saved = checkpoint_dir(os.path.dirname(checkpoint), step)
            out.append(({k: v for k, v in entry.items() if k != "step"}, step,
                        saved if os.path.isdir(saved) else None))
    return int(state.get("max_steps") or 0), out
