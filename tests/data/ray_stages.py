"""map_batches stages that Ray Data's worker processes import by name: numpy only, so that each of those
processes does not import torch and raytrain as data_helpers.py would make it."""

from __future__ import annotations

import os

import numpy as np


def featurize(batch):
    ids = batch["id"]
    return {"x": np.stack([ids * 1.0, -ids * 1.0], axis=1).astype(np.float32), "labels": ids % 2}


def featurize_ids(batch):
    """A map_batches stage: features from the id, and the pid of the process it ran in."""
    ids_ = batch["idx"]
    return {"idx": ids_, "x": np.stack([ids_ * 1.0, -ids_ * 1.0], axis=1).astype(np.float32),
            "labels": ids_ % 2, "pid": np.full(len(ids_), os.getpid())}


def featurize_range(batch):
    """featurize_ids for ray.data.range (its column is "id")."""
    return featurize_ids({"idx": batch["id"]})
