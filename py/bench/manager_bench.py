"""vLLM's own offloading manager against kvtier's, through Python, on the same calls.

Replays a Mooncake-format trace with vLLM 0.33's scheduler call sequence (the loop of
``model/oracle/replay.py``: lookups up to the first miss, loads of the hits, stores of the
rest, the request's end, a step end after each) through vLLM's ``CPUOffloadingManager`` and
through ``kvtier.vllm.KvtierOffloadingManager``, alternating, RUNS times each, each run on a
new manager. The clock covers the manager calls only. Reports nanoseconds per block operation
(one key passed to ``lookup``, ``prepare_load``, ``complete_load``, ``prepare_store`` or
``complete_store``), min and median over the runs, and the ratio of the medians. Both must
answer the same: their hit ratios and store counts are compared.

The loop itself costs time too (its counters, slices and calls), the same for both managers.
A third manager measures it: it plays back the answers kvtier gave, from plain Python methods
that do nothing else. The "net" figures subtract its median from both managers' medians: the
cost of the manager calls alone.

Needs the vLLM oracle install (``scripts/vllm-oracle-setup.sh``) and kvtier installed in the
running Python (``pip install ./py``).

Usage: manager_bench.py TRACE [--policy lru|arc ...] [--fraction 0.05] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

# Both managers import numpy; its BLAS threads are not used here and would only compete
# with the replay for the cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "model" / "oracle"))

import replay  # noqa: E402
import vllm_oracle  # noqa: E402


def region_dir() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class Playback:
    """Answers ``lookup`` and ``prepare_store`` with recorded answers and does nothing else:
    the replay loop's own cost."""

    lock = contextlib.nullcontext()

    def __init__(self, lookups, stores):
        self._lookup = iter(lookups).__next__
        self._store = iter(stores).__next__

    def lookup(self, key, req_context):
        return self._lookup()

    def prepare_store(self, keys, req_context):
        return self._store()

    def on_new_request(self, req_context):
        pass

    def prepare_load(self, keys, req_context):
        pass

    def complete_load(self, keys, req_context):
        pass

    def complete_store(self, keys, req_context):
        pass

    def on_request_finished(self, req_context):
        pass

    def on_schedule_end(self, context):
        pass


class Recorder:
    """Passes every call to a manager and records its ``lookup`` and ``prepare_store``
    answers."""

    def __init__(self, manager):
        self.manager, self.lock = manager, manager.lock
        self.lookups, self.stores = [], []

    def lookup(self, key, req_context):
        r = self.manager.lookup(key, req_context)
        self.lookups.append(r)
        return r

    def prepare_store(self, keys, req_context):
        r = self.manager.prepare_store(keys, req_context)
        self.stores.append(r)
        return r

    def __getattr__(self, name):
        return getattr(self.manager, name)


def bench(vllm, keys, num_blocks, policy, runs, block_tokens):
    """Alternating runs of the managers: ``{"vllm": [...], "kvtier": [...], "loop": [...]}``
    of ``(totals, ns)``."""
    import kvtier.vllm as kv

    made = []
    scratch = tempfile.mkdtemp(prefix="kvtier-bench-", dir=region_dir())

    def make_kvtier(n, p):
        m = kv.KvtierOffloadingManager(
            kv.Settings(
                num_blocks=n,
                region_path=os.path.join(scratch, f"region-{len(made)}"),
                policy=p,
                events=False,
                verify_stores=False,  # no worker copies: the calls alone are timed
            ),
            prefault_threads=2,
        )
        made.append(m)
        return m

    out = {"vllm": [], "kvtier": [], "loop": []}
    try:
        recorder = Recorder(make_kvtier(num_blocks, policy))
        replay.replay(vllm, keys, num_blocks, policy, block_tokens, lambda n, p: recorder)
        while made:
            made.pop().shutdown()
        for _ in range(runs):
            out["loop"].append(
                replay.replay(
                    vllm, keys, num_blocks, policy, block_tokens,
                    lambda n, p: Playback(recorder.lookups, recorder.stores),
                )
            )
            out["vllm"].append(replay.replay(vllm, keys, num_blocks, policy, block_tokens))
            out["kvtier"].append(
                replay.replay(vllm, keys, num_blocks, policy, block_tokens, make_kvtier)
            )
            while made:
                made.pop().shutdown()
    finally:
        for m in made:
            m.shutdown()
        os.rmdir(scratch)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--policy", choices=("lru", "arc"), action="append")
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    vllm = vllm_oracle.load_vllm()
    import kvtier.vllm as kv

    if not kv.HAVE_VLLM:
        raise SystemExit("kvtier did not find vLLM's classes")
    requests = replay.read_trace(args.trace)
    distinct = len({i for ids in requests for i in ids})
    num_blocks = max(1, int(args.fraction * distinct))
    keys = replay.request_keys(vllm, requests)
    rows = []
    for policy in args.policy or ["lru", "arc"]:
        runs = bench(vllm, keys, num_blocks, policy, args.runs, args.block_tokens)
        totals = {name: [t for t, _ in r] for name, r in runs.items()}
        first = totals["vllm"][0]
        if any(t != first for ts in totals.values() for t in ts):
            raise SystemExit(f"{policy}: the managers' answers differ: {totals}")
        ops = first["block_ops"]
        row = {
            "policy": policy,
            "capacity_blocks": num_blocks,
            "primary_hit_ratio": round(first["hits"] / first["blocks"], 4),
            "block_ops": ops,
        }
        for name, r in runs.items():
            per_op = sorted(ns / ops for _, ns in r)
            row[f"{name}_ns_min"] = round(per_op[0], 1)
            row[f"{name}_ns_median"] = round(statistics.median(per_op), 1)
        row["ratio"] = round(row["vllm_ns_median"] / row["kvtier_ns_median"], 1)
        loop = row["loop_ns_median"]
        row["vllm_net_ns"] = round(row["vllm_ns_median"] - loop, 1)
        row["kvtier_net_ns"] = round(row["kvtier_ns_median"] - loop, 1)
        row["net_ratio"] = round(row["vllm_net_ns"] / row["kvtier_net_ns"], 1)
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{len(requests)} requests, {distinct} distinct blocks, primary of {num_blocks} "
        f"blocks ({args.fraction:.1%}), {args.runs} runs each, alternating"
    )
    print(
        f"{'policy':6} {'hit ratio':>9} {'block ops':>10} {'vLLM ns/op':>18} "
        f"{'kvtier ns/op':>18} {'ratio':>7} {'loop':>6} {'net vLLM':>9} {'net kvtier':>10} "
        f"{'net ratio':>9}"
    )
    for r in rows:
        print(
            f"{r['policy']:6} {r['primary_hit_ratio']:9.4f} {r['block_ops']:10} "
            f"{r['vllm_ns_min']:8.1f} / {r['vllm_ns_median']:7.1f} "
            f"{r['kvtier_ns_min']:8.1f} / {r['kvtier_ns_median']:7.1f} {r['ratio']:6.1f}x "
            f"{r['loop_ns_median']:6.1f} {r['vllm_net_ns']:9.1f} {r['kvtier_net_ns']:10.1f} "
            f"{r['net_ratio']:8.1f}x"
        )
    print(
        "(ns per block operation, min / median over the runs; loop: the replay loop alone, "
        "net: median minus loop)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
