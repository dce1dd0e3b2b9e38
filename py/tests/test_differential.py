"""kvtier's manager against vLLM 0.33.0's own ``CPUOffloadingManager``, in one process.

Random call sequences, as vLLM's scheduler makes them (requests with key positions, lookups,
loads of hit blocks, stores with successes and failures, touches, finished requests, step
ends, resets), go to both managers; every answer must be equal: lookup results, the slots
of ``prepare_load`` and ``prepare_store``, the keys to store and the evicted keys, refusals,
events and stats.
"""

from __future__ import annotations

import random

import pytest

from kvtier.vllm import KvtierOffloadingManager, Settings

SEEDS = range(150)
OPS = 600


def stats_data(stats):
    return None if stats is None else stats.data


def events(manager):
    return [(list(e.keys), e.medium, e.removed, e.metadata_only) for e in manager.take_events()]


class Pair:
    """The same calls into vLLM's manager and kvtier's; each answer compared."""

    def __init__(self, vllm, region_dir, *, blocks, policy, threshold):
        self.vllm = vllm
        self.theirs = vllm.CPUOffloadingManager(
            num_chunks=blocks,
            cache_policy=policy,
            enable_events=True,
            store_threshold=threshold,
            max_tracker_size=8,
        )
        self.ours = KvtierOffloadingManager(
            Settings(
                num_blocks=blocks,
                region_path=str(region_dir / "region"),
                policy=policy,
                store_threshold=threshold,
                max_tracker_size=8,
                verify_stores=False,  # no worker copies here: the calls alone are compared
            ),
            prefault_threads=1,
        )
        self.log: list[str] = []

    def both(self, name, *args, compare=lambda a: a, **kwargs):
        """Calls `name` on both; equal results, or both raise."""
        self.log.append(f"{name}{args!r}")
        outcomes = []
        for m in (self.theirs, self.ours):
            try:
                outcomes.append(("ok", compare(getattr(m, name)(*args, **kwargs))))
            except Exception as e:  # vLLM asserts; kvtier raises StateError
                outcomes.append(("raised", type(e).__name__))
        theirs, ours = outcomes
        if theirs[0] == "raised" or ours[0] == "raised":
            # vLLM refuses a misuse with an assertion, kvtier with StateError.
            refused = (("raised", "AssertionError"), ("raised", "StateError"))
            assert (theirs, ours) == refused, self.trace(f"{name}: vLLM {theirs}, kvtier {ours}")
            return None
        assert theirs[1] == ours[1], self.trace(f"{name}: vLLM {theirs[1]!r}, kvtier {ours[1]!r}")
        return theirs[1]

    def trace(self, message):
        return message + "\n  after: " + "\n  ".join(self.log[-30:])


def block_ids(spec):
    return None if spec is None else [int(b) for b in spec.block_ids]


def store_answer(out):
    if out is None:
        return None
    return (list(out.keys_to_store), block_ids(out.store_spec), list(out.evicted_keys))


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", SEEDS)
def test_same_answers_as_vllm(vllm, region_dir, policy, seed):
    rng = random.Random(seed * 7919 + (policy == "arc"))
    blocks = rng.choice([1, 2, 3, 5, 8])
    threshold = rng.choice([0, 0, 0, 2])
    pair = Pair(vllm, region_dir, blocks=blocks, policy=policy, threshold=threshold)
    key = [vllm.make_offload_key(i.to_bytes(8, "big"), rng.choice([0, 0, 1])) for i in range(14)]
    live: dict[str, tuple[object, list[bytes]]] = {}  # requests that may still submit
    contexts: dict[str, object] = {}  # every request, for completions after it finished
    loads: list[tuple[str, list[bytes]]] = []
    stores: list[tuple[str, list[bytes]]] = []
    late: list[tuple[object, bytes, int]] = []  # positions recorded after the key was used
    n = 0
    try:
        for _ in range(OPS):
            op = rng.random()
            if op < 0.10 or not live:
                n += 1
                req = f"r{n}"
                length = rng.randint(1, 6)
                start = rng.randrange(len(key))
                keys = [key[(start + i) % len(key)] for i in range(length)]
                ctx = vllm.ReqContext(req_id=req)
                for i, k in enumerate(keys):
                    ctx.set_offload_key_position(k, (i + 1) * 16)
                live[req], contexts[req] = (ctx, keys), ctx
                pair.both("on_new_request", ctx, compare=lambda r: r.policy)
                continue
            req = rng.choice(sorted(live))
            ctx, keys = live[req]
            if op < 0.35:
                hits = []
                for k in keys:
                    r = pair.both("lookup", k, ctx)
                    if r is not vllm.LookupResult.HIT:
                        break
                    hits.append(k)
                if hits and rng.random() < 0.7:
                    pair.both("prepare_load", hits, ctx, compare=block_ids)
                    loads.append((req, hits))
            elif op < 0.55:
                chosen = keys[rng.randrange(len(keys)) :]
                if rng.random() < 0.15:
                    # A key the request has no position for (yet): vLLM's policies rank it
                    # by call order, and read its position at the request's end if it has
                    # one by then.
                    extra = rng.choice(key)
                    if extra not in chosen:
                        chosen = chosen + [extra]
                        # vLLM records a key's position once, when it makes the key.
                        if ctx.get_offload_key_position(extra) is None and rng.random() < 0.5:
                            late.append((ctx, extra, 16 * (len(keys) + 1)))
                out = pair.both("prepare_store", chosen, ctx, compare=store_answer)
                if out and out[0]:
                    stores.append((req, out[0]))
            elif op < 0.70 and stores:
                r, ks = stores.pop(rng.randrange(len(stores)))
                ok = rng.random() < 0.8
                pair.both("complete_store", ks, contexts[r], success=ok)
            elif op < 0.78 and loads:
                r, ks = loads.pop(rng.randrange(len(loads)))
                pair.both("complete_load", ks, contexts[r])
            elif op < 0.80 and late:
                c, k, end = late.pop()
                c.set_offload_key_position(k, end)  # one context, seen by both managers
            elif op < 0.82:
                pair.both("touch", rng.sample(keys, rng.randint(1, len(keys))), ctx)
            elif op < 0.88:
                pair.both("on_request_finished", ctx)
                del live[req]
            elif op < 0.95:
                pair.both("on_schedule_end", vllm.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
            elif op < 0.985:
                pair.both("get_stats", compare=stats_data)
            else:
                # vLLM's scheduler never completes a job from before a reset.
                pair.both("reset_cache")
                loads.clear()
                stores.clear()
                pair.both("on_reset_flushed")
            # Events are compared as they come.
            theirs, ours = events(pair.theirs), events(pair.ours)
            assert theirs == ours, pair.trace(f"events: vLLM {theirs}, kvtier {ours}")
    finally:
        pair.ours.shutdown()
