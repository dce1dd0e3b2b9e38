"""Fixtures of the SGLang tests: the servers of py/tests (redis-server, SeaweedFS's S3
gateway). These tests run in vLLM's CPU venv, whose torch SGLang uses, with SGLang on
PYTHONPATH (scripts/test.sh); py/tests's own conftest, which loads vLLM 0.33's oracle
classes, is not theirs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import redis_server, redis_url, s3_server  # noqa: E402,F401
