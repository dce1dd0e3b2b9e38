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

# The oracle puts a stand-in for torch first on ``sys.path``. The GPU tests need the real one:
# imported first, it is the ``torch`` every later import gets.
if os.environ.get("KVTIER_GPU_TESTS") == "1":
    import torch  # noqa: F401

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


# The servers' fixtures (redis-server, SeaweedFS's S3 gateway), shared with py/hicache_tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import redis_server, redis_url, s3_server  # noqa: E402,F401
