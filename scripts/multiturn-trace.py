#!/usr/bin/env python3
"""Writes a synthetic multi-turn chat trace in Mooncake's JSONL format, for `kvtier bench`.

Conversations arrive as a Poisson process. Each turn's prompt is the previous prompt, the
previous answer and a new user message, so a turn repeats every full block of the turn before
it; the last, partial block is new in every turn. A conversation continues after a turn with a
probability that grows with its length (`--p0 + --pgrow * turns`, at most `--pmax`), after an
exponential think time. Hash ids: one per block, chained by conversation and position.

    scripts/multiturn-trace.py out.jsonl --seed 1 --rate 2.0
    kvtier bench --trace out.jsonl --fraction 0.025,0.05,0.1

The same arguments always write the same trace (Python's seeded `random`).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random


def generate(a: argparse.Namespace) -> list[dict]:
    rng = random.Random(a.seed)
    next_id = [0]

    def fresh() -> int:
        next_id[0] += 1
        return next_id[0]

    events = []
    t = 0.0
    for c in range(a.conversations):
        t += rng.expovariate(a.rate)
        heapq.heappush(events, (t, c, 0, [], 0))
    requests = []
    while events:
        t, c, turn, blocks, tokens = heapq.heappop(events)
        tokens += rng.randint(*(a.first if turn == 0 else a.message))
        while len(blocks) < tokens // a.block_tokens:
            blocks.append(fresh())
        ids = list(blocks)
        if tokens % a.block_tokens:
            ids.append(fresh())  # the partial last block: new in every turn
        answer = rng.randint(*a.answer)
        requests.append({
            "timestamp": int(t * 1000),
            "input_length": tokens,
            "output_length": answer,
            "hash_ids": ids,
        })
        tokens += answer
        while len(blocks) < tokens // a.block_tokens:
            blocks.append(fresh())
        if rng.random() < min(a.pmax, a.p0 + a.pgrow * turn):
            think = rng.expovariate(1.0 / a.think)
            heapq.heappush(events, (t + think, c, turn + 1, blocks, tokens))
    requests.sort(key=lambda r: r["timestamp"])
    return requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--rate", type=float, default=1.0, help="conversations per second")
    p.add_argument("--think", type=float, default=60.0, help="mean seconds between turns")
    p.add_argument("--p0", type=float, default=0.5, help="chance of a second turn")
    p.add_argument("--pgrow", type=float, default=0.1, help="added per turn")
    p.add_argument("--pmax", type=float, default=0.9)
    p.add_argument("--first", type=int, nargs=2, default=(200, 2000),
                   help="tokens of a first message (uniform range)")
    p.add_argument("--message", type=int, nargs=2, default=(20, 400),
                   help="tokens of a later message")
    p.add_argument("--answer", type=int, nargs=2, default=(50, 600), help="tokens of an answer")
    p.add_argument("--block-tokens", type=int, default=512)
    a = p.parse_args()
    with open(a.out, "w") as f:
        for r in generate(a):
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
