"""A kvtier file tier under vLLM 0.33's own tiering manager: the hit ratio with and without
the tier learning from what it is read (rule G16 of ``docs/state-machine.md``).

vLLM 0.33's ``TieringOffloadingManager`` never calls ``touch`` on its tiers. Without G16 a
secondary tier's recency comes from its stores alone; with it, the blocks a load read become
the tier's most recently used when the load ends. This replays a Mooncake-format trace
through vLLM's manager, its CPU primary tier (vLLM's LRU) and a ``KvtierFileTier`` (each
``--policy``), once as shipped (``learns``) and once with ``learn_reads: false``
(``forgets``: the tier before G16).

The call sequence is ``model/oracle/replay.py``'s, run by its ``replay`` (vLLM 0.33's
scheduler for a request prefilled in one step): lookups from the first key to the first
MISS, a deferral (the step ends, the lookups run again) while any answers RETRY or
HIT_PENDING, loads of the hits, stores of the rest, the request's end and the step's end.
The tier's IO runs on its threads; a deferral waits a millisecond for it. Every store and promotion is written and read on a
real file in ``--dir`` (default: a temporary directory).

The overall hit ratio is the blocks finally hit (from the primary, or promoted from the tier
and then hit) over the blocks looked up; "promoted" counts the tier's loaded blocks.

Needs the vLLM oracle install (``scripts/vllm-oracle-setup.sh``) and kvtier installed in the
running Python (``pip install ./py``).

Usage: hosted_learning.py TRACE [--fraction 0.05] [--tier-fraction 0.25]
    [--policy lru,arc,reuse] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "model" / "oracle"))

import replay  # noqa: E402
import vllm_oracle  # noqa: E402

ROW = 4096
MAX_DEFERRALS = 10_000


def build(vllm, chunks: int, table: dict):
    """vLLM's tiering manager over its CPU primary of ``chunks`` rows and the tier ``table``
    describes."""
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    class Spec(OffloadingSpec):
        def get_manager(self):
            raise NotImplementedError

        def get_worker(self, kv_caches):
            raise NotImplementedError

    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [table]}
    spec = Spec(
        vllm_oracle.offloading_config(
            vllm, extra, worker_bytes=ROW, events=False, model="bench/model",
            max_model_len=1 << 20,
        )
    )
    mapping = mmap.mmap(-1, chunks * ROW)
    import numpy as np

    memory = np.frombuffer(mapping, dtype=np.uint8).reshape(chunks, ROW)
    primary = CPUPrimaryTierOffloadingManager(
        num_chunks=chunks, mmap_region=vllm_oracle.HostRegion(memory), enable_events=False
    )
    tier = SecondaryTierFactory.create_secondary_tier(table, primary.get_kv_memoryview(), spec)
    manager = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0)
    return manager, tier, mapping


def run(vllm, requests: list[list[bytes]], chunks: int, table: dict) -> dict:
    """Replays ``requests`` with ``replay.replay``'s loop, waiting a millisecond at each
    deferral; returns the blocks looked up and hit, and the tier's figures."""
    m, tier, mapping = build(vllm, chunks, table)
    try:
        totals, elapsed = replay.replay(
            vllm,
            requests,
            chunks,
            "lru",
            16,
            make_manager=lambda _n, _p: m,
            on_defer=lambda: time.sleep(0.001),
            max_deferrals=MAX_DEFERRALS,
        )
        stats = tier.stats()
        totals["promoted"] = stats["blocks_loaded"]
        totals["tier_evictions"] = stats["evictions"]
        totals["tier_blocks"] = tier.config_info()["capacity_blocks"]
        totals["seconds"] = round(elapsed / 1e9, 1)
        tier.check_invariants()
    finally:
        m.shutdown()
        del mapping  # vLLM and the tier keep views of it until they are collected
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--fraction", type=float, default=0.05, help="primary, of distinct blocks")
    p.add_argument("--tier-fraction", type=float, default=0.25, help="tier, of distinct blocks")
    p.add_argument("--policy", default="lru,arc,reuse", help="the tier's eviction policies")
    p.add_argument("--dir", help="where the tiers' files go (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)

    vllm = vllm_oracle.load_vllm()
    requests = replay.request_keys(vllm, replay.read_trace(args.trace))
    distinct = len({k for keys in requests for k in keys})
    chunks = max(1, int(args.fraction * distinct))
    tier_blocks = max(1, int(args.tier_fraction * distinct))
    if not args.json:
        print(
            f"{args.trace}: {len(requests)} requests, {distinct} distinct blocks; primary "
            f"{chunks} (vLLM's LRU), file tier {tier_blocks} blocks"
        )
        print("| tier policy | tier | overall hit ratio | promoted | tier evictions | tier blocks | s |")
        print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for policy in args.policy.split(","):
            for learns in (False, True):
                # A record takes a header page besides its row.
                table = {
                    "type": "KvtierFileTier",
                    "module_path": "kvtier.vllm_tiers",
                    "path": os.path.join(d, f"{policy}-{learns}"),
                    "capacity_bytes": tier_blocks * 2 * ROW,
                    "eviction_policy": policy,
                    "fsync": "none",
                    "learn_reads": learns,
                }
                t = run(vllm, requests, chunks, table)
                label = "learns" if learns else "forgets"
                ratio = t["hits"] / t["blocks"]
                if args.json:
                    print(json.dumps({"policy": policy, "tier": label, "ratio": ratio, **t}))
                else:
                    print(
                        f"| {policy} | {label} | {ratio:.4f} | {t['promoted']:,} | "
                        f"{t['tier_evictions']:,} | {t['tier_blocks']:,} | {t['seconds']} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
