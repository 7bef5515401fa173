"""DRIVER side: a sweep whose storage_path is a URI (s3://, gs://, ... as Ray's storage is).

Ray's storage (pyarrow.fs) persists what Tune owns: its experiment state and the checkpoints trials
report (raytrain's checkpoint directories, uploaded by the trial at each save; a distributed trial's
by its TorchTrainer, whose run lives in <uri>/<name>/trial_<id>/ray_train/). The rest of a sweep
is kept on the driver's disk in <output_dir>/sweeps/<name>/ and copied to <uri>/<name>/ by this
module: the Optuna study (SQLite needs a local file) whenever Tune saves its searcher state, and
trials.csv and the plots at the end. A restore on a machine without the local directory fetches the
study first, and the searcher unpickled from Tune's state is pointed at the current local directory
(StudyStorage, Mirror); the trials fetch their checkpoints from Tune (trial.py).
"""

from __future__ import annotations

import contextlib
import os

import optuna

STUDY = "optuna.db"
# (local sweep directory, URI) while Tune restores a URI sweep: the objects below, unpickled from
# Tune's state, follow them instead of the directory the sweep ran in before (another machine).
RESTORING_INTO: tuple[str, str] | None = None


@contextlib.contextmanager
def restoring_into(local_dir: str, uri: str):
    """While Tune restores a URI sweep: what it unpickles follows `local_dir` and `uri`."""
    global RESTORING_INTO
    RESTORING_INTO = (local_dir, uri)
    try:
        yield
    finally:
        RESTORING_INTO = None


def display(uri: str) -> str:
    """The URI without credentials or query options, for console lines and files."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.hostname or ''}{parts.path}"


class Mirror:
    """Copies between the local sweep directory and the sweep's URI (picklable: it travels in the
    searcher's saved state)."""

    def __init__(self, local_dir: str, uri: str):
        self.local_dir, self.uri = local_dir, uri

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if RESTORING_INTO is not None:
            self.local_dir, self.uri = RESTORING_INTO

    def _fs(self):
        import pyarrow.fs

        return pyarrow.fs.FileSystem.from_uri(self.uri)  # (filesystem, path) without the query

    def push(self, names: list[str]) -> None:
        import pyarrow.fs

        fs, base = self._fs()
        fs.create_dir(base, recursive=True)
        for name in names:
            src = os.path.join(self.local_dir, name)
            if os.path.isfile(src):
                pyarrow.fs.copy_files(src, f"{base}/{name}", destination_filesystem=fs)

    def push_study(self) -> None:
        self.push([STUDY])

    def push_results(self) -> None:
        self.push(sorted(n for n in os.listdir(self.local_dir)
                         if n == STUDY or n == "trials.csv" or n.endswith((".html", ".png", ".js"))))

    def fetch_study(self) -> bool:
        """Copy the study from the URI unless this machine has it (then it is at least as new)."""
        import pyarrow.fs

        local = os.path.join(self.local_dir, STUDY)
        if os.path.isfile(local):
            return False
        fs, base = self._fs()
        if fs.get_file_info(f"{base}/{STUDY}").type != pyarrow.fs.FileType.File:
            return False
        pyarrow.fs.copy_files(f"{base}/{STUDY}", local, source_filesystem=fs)
        return True

    def best_checkpoint(self, result, metric: str, mode: str, last: bool = False) -> str:
        """The URI of the trial's best (last: newest) persisted checkpoint ("" when it reported none)."""
        try:
            ckpt = result.checkpoint if last else result.get_best_checkpoint(metric, mode)
        except (RuntimeError, ValueError, KeyError):
            ckpt = None
        path = ckpt.path if ckpt is not None else self._best_train_checkpoint(result, metric, mode, last)
        if not path:
            return ""
        scheme = self.uri.split("://", 1)[0]
        return f"{scheme}://{path}"

    def _best_train_checkpoint(self, result, metric: str, mode: str, last: bool = False) -> str:
        """A distributed trial's checkpoints are Ray Train's (not Tune's): its results name them
        (checkpoint_path); the best-scoring one Ray Train has not rotated away."""
        import pyarrow.fs
        from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

        df = result.metrics_dataframe
        if df is None or CHECKPOINT_PATH_KEY not in df or metric not in df:
            return ""
        rows = df[df[CHECKPOINT_PATH_KEY].fillna("").astype(str) != ""].dropna(subset=[metric])
        fs, _ = self._fs()
        ordered = rows[::-1] if last else rows.sort_values(metric, ascending=mode == "min", kind="stable")
        for path in ordered[CHECKPOINT_PATH_KEY]:
            if fs.get_file_info(path).type == pyarrow.fs.FileType.Directory:
                return path
        return ""



class StudyStorage(optuna.storages.RDBStorage):
    """The sweep's SQLite study in <local sweep dir>/optuna.db. Unpickled from Tune's state during a
    restore (the searcher holds it), it opens the current local directory's copy, fetched from the
    URI, rather than the path it was created with."""

    def __init__(self, local_dir: str):
        super().__init__(f"sqlite:///{os.path.join(local_dir, STUDY)}")

    def __setstate__(self, state: dict) -> None:
        if RESTORING_INTO is not None:
            state = {**state, "url": f"sqlite:///{os.path.join(RESTORING_INTO[0], STUDY)}"}
        super().__setstate__(state)
