"""One tensor-parallel rank in its own process, for the multi-process tests.

It holds KV tensors of its own (16 blocks of one page, random bytes seeded by the rank),
attaches a ``KvtierOffloadingWorker`` to the scheduler's region, and answers JSON lines on
stdin:

- ``{"op": "store"|"load", "job", "gpu", "slots", "seal", "wait"}``: submits the transfer
  (a store seals its slots with ``seal`` once copied); with
  ``wait`` answers ``{"job", "ok"}`` when it ended, else ``{"submitted": job}`` at once.
- ``{"op": "digest", "blocks"}``: the SHA-256 of each block's bytes.
- ``{"op": "zero", "blocks"}``: clears blocks.
- ``{"op": "slow", "us"}``: pauses after each page copy from now on.

Usage: rank_process.py REGION_PATH ROWS WORKERS RANK [replicated]

With ``replicated`` every rank holds the same bytes (seeded alike) and the region keeps one
copy per slot (vLLM's ``replicated_layout``).
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from kvtier import _standalone as s
import kvtier.vllm as kv

PAGE = 4096
BLOCKS = 16


def main() -> None:
    region, rows, workers, rank = sys.argv[1], *map(int, sys.argv[2:5])
    replicated = sys.argv[5:6] == ["replicated"]
    seed = 1000 if replicated else 1000 + rank
    tensor = np.random.default_rng(seed).integers(0, 256, (BLOCKS, PAGE), np.uint8)
    caches = s.CanonicalKVCaches(
        tensors=[s.CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=PAGE)],
        group_data_refs=[[s.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]],
    )
    settings = kv.Settings(
        num_blocks=rows, region_path=region, workers=workers, rank=rank,
        block_bytes_per_worker=PAGE, attach_timeout_s=10, replicated=replicated,
    )
    worker = kv.KvtierOffloadingWorker(caches, settings)
    print(json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op in ("store", "load"):
            gpu = s.GPULoadStoreSpec(cmd["gpu"], [len(cmd["gpu"])], [0])
            slots = kv.KvtierLoadStoreSpec(cmd["slots"])
            slots.generation = cmd.get("seal")
            if op == "store":
                ok = worker.submit_store(cmd["job"], gpu, slots)
            else:
                ok = worker.submit_load(cmd["job"], slots, gpu)
            if not cmd.get("wait", True):
                print(json.dumps({"submitted": cmd["job"], "ok": ok}), flush=True)
                continue
            worker.wait({cmd["job"]})
            results = {r.job_id: r.success for r in worker.get_finished()}
            print(json.dumps({"job": cmd["job"], "ok": ok and results.get(cmd["job"], False)}), flush=True)
        elif op == "digest":
            print(json.dumps([hashlib.sha256(tensor[b].tobytes()).hexdigest() for b in cmd["blocks"]]), flush=True)
        elif op == "zero":
            tensor[cmd["blocks"]] = 0
            print(json.dumps(True), flush=True)
        elif op == "slow":
            worker._native._inject_page_delay(cmd["us"])
            print(json.dumps(True), flush=True)
    worker.shutdown()


if __name__ == "__main__":
    main()
