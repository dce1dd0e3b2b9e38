"""The Python benchmark runs, and both managers give it the same answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_manager_benchmark_runs_on_the_excerpt(vllm):
    out = subprocess.run(
        [
            sys.executable, str(ROOT / "py" / "bench" / "manager_bench.py"),
            str(ROOT / "tests" / "data" / "mooncake-excerpt.jsonl"),
            "--runs", "1", "--json",
        ],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["policy"] for r in rows] == ["lru", "arc"]
    for r in rows:
        assert r["block_ops"] > 0 and r["kvtier_ns_median"] > 0 and r["vllm_ns_median"] > 0
