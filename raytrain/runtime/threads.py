"""torch's intra-op threads: the node's cores shared among the training processes on it, unless the user
chose (OMP_NUM_THREADS, or torch.set_num_threads before raytrain set anything)."""

from __future__ import annotations

import os

import torch

from ..config.sections import ConfigError

__all__ = ["THREADS_ENV", "apply_threads", "default_threads", "explicit_threads", "node_cores"]

#: The user's choice, read on the driver (or the in-process run); it wins over raytrain's default.
THREADS_ENV = "OMP_NUM_THREADS"

# torch's count when this module first looked: a different count later means torch.set_num_threads was called.
_seen = torch.get_num_threads()
_pinned = False  # a Ray worker applied the driver's choice: later calls (set_seed) leave it


def node_cores() -> int:
    """The cores this process may run on: its CPU affinity, at most the physical cores (torch's own
    choice for one process: hyperthreads do not speed up its kernels)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return max(1, min(cores, physical or cores))


def default_threads(cores: int, local_workers: int) -> int:
    """raytrain's default: an equal share of the node's cores per process on it, at least 1 (torchrun sets 1
    whenever several processes share a node; a share keeps large nodes busy)."""
    return max(1, cores // max(1, local_workers))


def explicit_threads(environ=None) -> int | None:
    """OMP_NUM_THREADS as a positive int, None when unset; a bad value is a one-line error."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{THREADS_ENV}={value!r}: expected a positive integer (torch's intra-op threads)")
    return int(value)


def apply_threads(local_workers: int, explicit: int | None = None, *, read_env: bool = True,
                  cores: int | None = None, pin: bool = False) -> int:
    """Set torch's intra-op threads for this process and return the count: `explicit` (else OMP_NUM_THREADS
    when `read_env`) wins; a count the user set with torch.set_num_threads stays; else the default.
    A Ray worker passes the driver's OMP_NUM_THREADS and pin=True: Ray sets the worker's own to its CPUs."""
    global _seen, _pinned
    if _pinned and not pin:
        return torch.get_num_threads()
    _pinned = _pinned or pin
    if explicit is None and read_env:
        explicit = explicit_threads()
    if explicit is None and torch.get_num_threads() != _seen:
        return torch.get_num_threads()  # set by the user's own torch.set_num_threads
    n = explicit or default_threads(node_cores() if cores is None else cores, local_workers)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _seen = n
    return n
