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

With ``--time RUNS`` the replay runs RUNS times on new managers and reports the nanoseconds
the manager calls took (the loop above; reading the trace, building the keys and making the
manager are outside the clock) and the median per *block operation*: one key passed to
``lookup``, ``prepare_load``, ``complete_load``, ``prepare_store`` or ``complete_store``.

Usage: replay.py [--vllm-dir DIR] [--policy lru|arc] [--fraction 0.05] [--time RUNS] TRACE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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


def request_keys(vllm, requests: list[list[int]]) -> list[list[bytes]]:
    """Every request's keys, built before any replay (and outside any timing)."""
    cache: dict[int, bytes] = {}

    def key(i: int) -> bytes:
        k = cache.get(i)
        if k is None:
            k = cache[i] = vllm.make_offload_key(i.to_bytes(8, "big", signed=False), 0)
        return k

    return [[key(i) for i in ids] for ids in requests]


def replay(
    vllm,
    requests: list[list[bytes]],
    num_blocks: int,
    policy: str,
    block_tokens: int,
    make_manager=None,
    on_defer=None,
    max_deferrals: int = MAX_DEFERRALS,
):
    """Replays the requests' keys; returns the totals and the nanoseconds the loop took.

    The manager is vLLM's ``CPUOffloadingManager``, or ``make_manager(num_blocks, policy)``:
    any manager with vLLM's interface gets the same calls (``py/bench/manager_bench.py``
    times kvtier's this way).

    The clock covers the loop of manager calls only: the manager is made before it and the
    keys are built by ``request_keys``. A *block operation* is one key passed to ``lookup``,
    ``prepare_load``, ``complete_load``, ``prepare_store`` or ``complete_store``
    (``block_ops``), counted as ``kvtier_model::replay`` counts them.

    ``on_defer``, if given, is called after each deferral's step end, at most
    ``max_deferrals`` times a request: a manager whose tiers do IO on their own threads
    (``py/bench/hosted_learning.py``) waits there for it.
    """
    if make_manager is None:
        m = vllm.CPUOffloadingManager(num_chunks=num_blocks, cache_policy=policy)
    else:
        m = make_manager(num_blocks, policy)
    LookupResult = vllm.LookupResult
    MISS, RETRY, HIT_PENDING = LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING
    step_end = vllm.ScheduleEndContext
    ReqContext = vllm.ReqContext

    totals = {
        "blocks": 0,
        "hits": 0,
        "stored": 0,
        "store_refused": 0,
        "deferrals": 0,
        "block_ops": 0,
    }
    start = time.perf_counter_ns()
    for n, keys in enumerate(requests):
        req_id = f"req-{n}"
        ctx = ReqContext(req_id=req_id)
        with m.lock:
            m.on_new_request(ctx)
            for index, k in enumerate(keys):
                ctx.set_offload_key_position(k, (index + 1) * block_tokens)

            new_req_ids = [req_id]
            for _ in range(max_deferrals):
                hits, retries, deferred = 0, 0, False
                for k in keys:
                    result = m.lookup(k, ctx)
                    if result is MISS:
                        totals["block_ops"] += 1
                        break
                    if result is RETRY:
                        retries += 1
                        deferred = True
                    else:
                        hits += 1
                        deferred |= result is HIT_PENDING
                totals["block_ops"] += hits + retries
                if not deferred:
                    break
                totals["deferrals"] += 1
                m.on_schedule_end(step_end(new_req_ids=[], preempted_req_ids=[]))
                if on_defer is not None:
                    on_defer()
            else:
                raise RuntimeError(f"{req_id}: lookups still deferred after {max_deferrals} steps")

            loaded, rest = keys[:hits], keys[hits:]
            if loaded:
                m.prepare_load(loaded, ctx)
                m.on_schedule_end(step_end(new_req_ids=new_req_ids, preempted_req_ids=[]))
                new_req_ids = []
                m.complete_load(loaded, ctx)
                totals["block_ops"] += 2 * hits
            if rest:
                out = m.prepare_store(rest, ctx)
                totals["block_ops"] += len(rest)
                m.on_schedule_end(step_end(new_req_ids=new_req_ids, preempted_req_ids=[]))
                new_req_ids = []
                if out is None:
                    totals["store_refused"] += 1
                elif out.keys_to_store:
                    totals["stored"] += len(out.keys_to_store)
                    m.complete_store(out.keys_to_store, ctx)
                    totals["block_ops"] += len(out.keys_to_store)
            m.on_request_finished(ctx)
            m.on_schedule_end(step_end(new_req_ids=new_req_ids, preempted_req_ids=[]))
        totals["blocks"] += len(keys)
        totals["hits"] += hits
    elapsed = time.perf_counter_ns() - start
    return totals, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--vllm-dir", help="the setup script's install")
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru")
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--time",
        type=int,
        metavar="RUNS",
        default=0,
        help="replay RUNS times, each on a new manager, and report the nanoseconds of each "
        "run's manager calls (manager_ns) and per block operation (ns_per_block_op, median)",
    )
    args = parser.parse_args(argv)

    vllm = vllm_oracle.load_vllm(args.vllm_dir)
    requests = read_trace(args.trace)
    distinct = len({i for ids in requests for i in ids})
    num_blocks = max(1, int(args.fraction * distinct))
    keys = request_keys(vllm, requests)
    runs = [replay(vllm, keys, num_blocks, args.policy, args.block_tokens)]
    for _ in range(1, args.time):
        runs.append(replay(vllm, keys, num_blocks, args.policy, args.block_tokens))
    totals = runs[0][0]
    if any(t != totals for t, _ in runs):
        raise RuntimeError("two runs of the same replay disagree")
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
    if args.time:
        ns = [elapsed for _, elapsed in runs]
        report["manager_ns"] = ns
        report["ns_per_block_op"] = round(statistics.median(ns) / totals["block_ops"], 1)
    if args.json:
        print(json.dumps(report))
    else:
        for name, value in report.items():
            print(f"{name:18} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
