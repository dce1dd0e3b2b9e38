"""Shared fixtures: vLLM 0.33.0's own offloading classes (the oracle install that
scripts/vllm-oracle-setup.sh makes outside the clone) are put on ``sys.path`` before
``kvtier.vllm`` is imported, so that kvtier subclasses and answers with vLLM's real classes.

Without the install the tests that need vLLM are skipped with a loud reason, except under
``CI=true``, where a missing install is a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "model" / "oracle"))

import vllm_oracle  # noqa: E402

try:
    VLLM = vllm_oracle.load_vllm()
    VLLM_ERROR = None
except vllm_oracle.OracleSetupError as e:  # pragma: no cover - depends on the machine
    if os.environ.get("CI") == "true":
        raise
    VLLM, VLLM_ERROR = None, str(e)

import kvtier.vllm  # noqa: E402  (after vLLM is importable)


@pytest.fixture
def vllm():
    """vLLM's modules and names (``vllm_oracle.load_vllm``)."""
    if VLLM is None:
        pytest.skip(f"SKIPPED: vLLM 0.33.0 not installed ({VLLM_ERROR})")
    return VLLM


@pytest.fixture
def region_dir(tmp_path):
    """A directory for regions (tmpfs when there is one, so that tests do not write disk)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = shm / f"kvtier-test-{os.getpid()}-{tmp_path.name}"
        d.mkdir()
        yield d
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    else:
        yield tmp_path


@pytest.fixture
def redis_url(redis_server):
    """The URL of a redis-server of its own (``redis_server``)."""
    return redis_server[0]


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of its own on a free loopback port, as ``(url, process)``
    (``scripts/redis-setup.sh`` installs it); without one the test is skipped loudly, except
    under ``CI=true``, where it fails."""
    import shutil
    import socket
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed (scripts/redis-setup.sh installs it)")
        pytest.skip("SKIPPED: redis-server is not installed (scripts/redis-setup.sh)")
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.02)
        if proc.poll() is None:
            break
        # Another process took the port between the probe and the start: try another.
    else:
        pytest.fail("redis-server did not start")
    try:
        yield f"redis://127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()
