"""kvtier's metrics through vLLM's own Prometheus classes as installed (vLLM 0.32 here):
``metrics_vllm032.py`` in a process of its own (it registers real prometheus_client
metrics, which live once per process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_kvtier_metrics_reach_vllms_prometheus_exposition():
    script = Path(__file__).resolve().parent / "metrics_vllm032.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "vllm:kvtier_tier_capacity_blocks" in proc.stdout
