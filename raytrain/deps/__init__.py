"""The libraries whose private names raytrain uses, the versions its tests ran against, and the check where raytrain
first imports each: another version is refused in one line naming the supported range, before an AttributeError
mid-run. pyproject.toml bounds the same ranges (tests/test_deps.py compares the two).

- ray: Ray Train v2's internals (the elastic policy's _get_reserved_resources, the controller and worker context,
  _TorchBackend, the default callbacks' DatasetsCallback), ray._private's state API, the fake autoscaler's provider,
  Ray Data's internals;
- trl: TRL 1.16's private trainer methods (_generate_and_score_completions, _compute_loss, _prepare_dataset, ...);
- deepspeed: ZeRO-3's parameter-offload hooks (_register_deepspeed_module, the coordinator's _invalidate_trace).

Imports nothing but the standard library: any layer may ask."""

from __future__ import annotations

import importlib.metadata
import re

#: distribution -> (lowest supported, first unsupported, what to run instead)
SUPPORTED: dict[str, tuple[str, str, str]] = {
    "ray": ("2.60", "2.61", "pip install 'ray[default,train,tune,data]>=2.60,<2.61'"),
    "trl": ("1.16", "1.17", "pip install 'raytrain[trl]'"),
    "deepspeed": ("0.19", "0.20", "pip install 'raytrain[deepspeed]'"),
}


def installed(dist: str) -> str | None:
    """The installed version of distribution `dist`, None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def require(dist: str, user: str) -> None:
    """ImportError in one line when `dist` is installed at a version outside SUPPORTED[dist], naming `user` (what
    needs it), the range and the command that installs a supported one. Nothing when `dist` is not installed:
    the import that follows says so."""
    version = installed(dist)
    if version is None:
        return
    low, high, hint = SUPPORTED[dist]
    release = _release(version)
    if release is None or not _release(low) <= release < _release(high):
        raise ImportError(f"{user} needs {dist}>={low},<{high} (installed: {version}): {hint}")
