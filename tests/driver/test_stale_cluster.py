"""ensure_ray and a Ray cluster that is gone: the address `ray start` recorded is checked within a second
(a local cluster then starts, with one warning naming the record), and an address the user named is a
one-line error. Each case runs in a subprocess with its own RAY_TMPDIR, so that the session's cluster and
any record of other users on this machine stay untouched."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import time
t = time.monotonic()
import ray
from raytrain.driver.launch import ensure_ray
try:
    ensure_ray()
except Exception as e:
    print(f"@@ {type(e).__name__}: {e}", flush=True)
    raise SystemExit(3)
print(f"@@ initialized={ray.is_initialized()} local={ray.get_runtime_context().gcs_address} "
      f"seconds={time.monotonic() - t:.1f}", flush=True)
ray.shutdown()
"""


def _dead_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there any more
    return f"127.0.0.1:{port}"


@pytest.fixture
def short_tmp():
    """A short RAY_TMPDIR: Ray's socket paths under it must fit in 107 bytes (pytest's tmp_path does not)."""
    path = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(tmp_path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    base.update(PYTHONPATH=ROOT, RAY_TMPDIR=str(tmp_path), RAY_USAGE_STATS_ENABLED="0", **env)
    return subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=base, text=True,
                          capture_output=True, timeout=150)


def test_a_stale_record_starts_a_local_cluster_with_one_warning(short_tmp):
    dead = _dead_address()
    record = os.path.join(short_tmp, "ray", "ray_current_cluster")  # where `ray start` writes it
    os.mkdir(os.path.dirname(record))
    with open(record, "w") as f:
        f.write(dead)
    p = _run(short_tmp)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("@@ ")]
    assert line.startswith("@@ initialized=True") and dead not in line, out[-3000:]
    # Without the check, ray.init() retries the dead address for minutes; a local start takes seconds.
    assert float(line.rsplit("=", 1)[1]) < 60, line
    warnings = [ln for ln in out.splitlines() if "is gone" in ln]
    assert warnings == [f"the Ray cluster recorded in {record} ({dead}) is gone: starting a local one"], out[-3000:]
    assert "Failed to connect to GCS" not in out


def test_a_dead_ray_address_is_a_one_line_error(tmp_path):
    dead = _dead_address()
    p = _run(tmp_path, RAY_ADDRESS=dead)
    assert p.returncode == 3, (p.stdout + p.stderr)[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("@@ ")]
    assert line == (f"@@ ConfigError: no Ray cluster answers at RAY_ADDRESS={dead} (nothing listens there); "
                    "start it, or leave the address out to run on a local cluster")
