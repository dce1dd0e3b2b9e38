"""Replay a Mooncake-format trace through vLLM 0.33.0's own CPUOffloadingManager.

Each trace line is a JSON object with ``hash_ids`` (one id per block, in prefix order; the
other fields are ignored). Every id becomes the key ``make_offload_key(id as 8 big-endian
bytes, group 0)`` at end-token position ``(index + 1) * --block-tokens``. The primary tier
holds ``int(--fraction * distinct ids)`` blocks (at least 1).

Requests run one at a time, each with the call sequence vLLM 0.33's offloading scheduler
makes for a request that is prefilled in one step and finishes (no GPU prefix-cache hits, all
transfers completing before the next step):

    on_new_request(ctx); ctx.set_offload_key_position(key, end) for every key
    step 1 (get_num_new_matched_tokens):
        lookup(key) from the first key on, stopping at the first MISS
        any HIT_PENDING or RETRY before it: defer -> on_schedule_end, look up again next step
        hits = the HIT/HIT_PENDING prefix
    if hits:  prepare_load(hits); on_schedule_end; complete_load(hits)   (the async load step)
    if rest:  prepare_store(rest); on_schedule_end; complete_store(keys_to_store)
    on_request_finished(ctx); on_schedule_end

The primary hit ratio is hit blocks / looked-up blocks over the whole trace.

Usage: replay.py [--vllm-dir DIR] [--policy lru|arc] [--fraction 0.05] TRACE
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_oracle  # noqa: E402

MAX_DEFERRALS = 1000


def read_trace(path: str) -> list[list[int]]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}:{n}: hash_ids is not a list of integers")
            requests.append(ids)
    return requests


def replay(vllm, requests: list[list[int]], num_blocks: int, policy: str, block_tokens: int):
    m = vllm.CPUOffloadingManager(num_chunks=num_blocks, cache_policy=policy)
    LookupResult = vllm.LookupResult
    step_end = vllm.ScheduleEndContext

    def key(i: int) -> bytes:
        return vllm.make_offload_key(i.to_bytes(8, "big", signed=False), 0)

    totals = {"blocks": 0, "hits": 0, "stored": 0, "store_refused": 0, "deferrals": 0}
    for n, ids in enumerate(requests):
        req_id = f"req-{n}"
        ctx = vllm.ReqContext(req_id=req_id)
        keys = [key(i) for i in ids]
        with m.lock:
            m.on_new_request(ctx)
            for index, k in enumerate(keys):
                ctx.set_offload_key_position(k, (index + 1) * block_tokens)

            new_req_ids = [req_id]
            for _ in range(MAX_DEFERRALS):
                hits, deferred = 0, False
                for k in keys:
                    result = m.lookup(k, ctx)
                    if result is LookupResult.MISS:
                        break
                    if result is LookupResult.RETRY:
                        deferred = True
                    else:
                        hits += 1
                        deferred |= result is LookupResult.HIT_PENDING
                if not deferred:
                    break
                totals["deferrals"] += 1
                m.on_schedule_end(step_end(new_req_ids=[], preempted_req_ids=[]))
            else:
                raise RuntimeError(f"{req_id}: lookups still deferred after {MAX_DEFERRALS} steps")

            loaded, rest = keys[:hits], keys[hits:]
            if loaded:
                m.prepare_load(loaded, ctx)
                m.on_schedule_end(step_end(new_req_ids=new_req_ids, preempted_req_ids=[]))
                new_req_ids = []
                m.complete_load(loaded, ctx)
            if rest:
                out = m.prepare_store(rest, ctx)
                m.on_schedule_end(step_end(new_req_ids=new_req_ids, preempted_req_ids=[]))
                new_req_ids = []
                if out is None:
                    totals["store_refused"] += 1
                elif out.keys_to_store:
                    totals["stored"] += len(out.keys_to_store)
                    m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
            m.on_schedule_end(step_end(new_req_ids=new_req_ids, preempted_req_ids=[]))
        totals["blocks"] += len(keys)
        totals["hits"] += hits
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--vllm-dir", help="the setup script's install")
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru")
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    vllm = vllm_oracle.load_vllm(args.vllm_dir)
    requests = read_trace(args.trace)
    distinct = len({i for ids in requests for i in ids})
    num_blocks = max(1, int(args.fraction * distinct))
    totals = replay(vllm, requests, num_blocks, args.policy, args.block_tokens)
    ratio = totals["hits"] / totals["blocks"] if totals["blocks"] else 0.0
    report = {
        "vllm": vllm.version,
        "policy": args.policy,
        "requests": len(requests),
        "distinct_blocks": distinct,
        "capacity_blocks": num_blocks,
        "primary_hit_ratio": round(ratio, 4),
        **totals,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for name, value in report.items():
            print(f"{name:18} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
