"""set_seed: the one place every entry point (Trainer, CLI, Ray workers, sweep trials) seeds from."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

# Imported with the package, not at the first set_seed: threads.py notes torch's count before a script's
# own torch.set_num_threads, which it then keeps.
from .threads import apply_threads


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and CUDA); full determinism also pins the algorithms. Every run
    passes here first, so torch's thread count is settled here too (threads.py)."""
    # LOCAL_WORLD_SIZE: torchrun's (and Ray Train's) processes on this node; 1 in a plain process.
    apply_threads(int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
