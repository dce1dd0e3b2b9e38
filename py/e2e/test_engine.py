"""kvtier inside a real vLLM engine (vLLM's CPU build): answers unchanged, blocks byte for
byte, hits really served from kvtier, under every policy, with chunks, a file tier across a
restart, a cache reset, KV cache events, two ranks, and the OpenAI-compatible server.

vLLM's own ``CPUOffloadingSpec`` refuses the CPU platform; kvtier's host copy path makes it
an offloading backend for vLLM's CPU build, which these tests run.
"""

from __future__ import annotations

import pytest

from conftest import BLOCK, BLOCK_BYTES, FIRST, SECOND, Run, file_tier, kvtier, same_answers

def served_from_kvtier(run: Run) -> None:
    """Hits in kvtier's stats and in vLLM's own metrics, and every loaded block checked."""
    stats = run.stats()
    assert stats["hits"] > 0, stats
    assert run.metric("vllm:external_prefix_cache_hits") > 0, run.metrics
    assert run.check_blocks() > 0


@pytest.mark.parametrize(
    "policy, blocks_per_chunk, events",
    [("lru", 1, False), ("arc", 1, True), ("reuse", 2, False)],
    ids=["lru", "arc-kv-events", "reuse-chunks-of-2"],
)
def test_a_small_primary_evicts_and_answers_stay_the_same(run_engine, reference, policy,
                                                          blocks_per_chunk, events):
    """40 blocks of room for 75 distinct ones: the primary evicts under each policy, and
    what it serves changes no token and no logprob. The ``arc`` run has KV cache events on;
    the ``reuse`` run has chunks of two vLLM blocks (``block_size`` 64 in the extra config),
    so loads that start inside a chunk must still place every GPU block's bytes."""
    slots = 40 // blocks_per_chunk
    run = run_engine(kvtier(slots, blocks_per_chunk=blocks_per_chunk, eviction_policy=policy),
                     [{"prompts": FIRST}, {"prompts": SECOND}], kv_events=events)
    same_answers(reference, run)
    served_from_kvtier(run)
    assert run.stats()["evictions"] > 0
    # More of each returning prompt came from a cache than without kvtier.
    cached = sum(a["cached_tokens"] for a in run.rounds[1])
    assert cached > sum(a["cached_tokens"] for a in reference.rounds[1])


def test_a_file_tier_promotes_and_serves_its_blocks_after_a_restart(run_engine, reference,
                                                                    tmp_path):
    """Blocks the primary evicted come back from the file tier (promotions); a new engine
    on the same tier serves every returning prompt from it."""
    tier = file_tier(tmp_path / "tier")
    run = run_engine(kvtier(16, secondary_tiers=[tier]), [{"prompts": FIRST}, {"prompts": SECOND}])
    same_answers(reference, run)
    served_from_kvtier(run)
    stats = run.stats()
    assert stats["promotions_started"] > 0 and stats["promotions_failed"] == 0, stats
    assert stats["tiers"][0]["hits"] > 0, stats

    again = run_engine(kvtier(16, secondary_tiers=[tier]), [{"prompts": SECOND}])
    for a, b in zip(reference.rounds[1], again.rounds[0]):
        assert a["tokens"] == b["tokens"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= 1e-5
    stats = again.stats()
    assert stats["promotions_started"] > 0 and stats["tiers"][0]["hits"] > 0, stats
    assert again.check_blocks(run) > 0
    # The first request of the new engine found its whole prefix in the tier.
    assert again.rounds[0][0]["cached_tokens"] >= (len(SECOND[0]) // BLOCK) * BLOCK


def test_a_reset_with_the_connector_is_followed_by_hits_again(run_engine, reference, tmp_path):
    """``reset_prefix_cache(reset_connector=True)`` empties the device cache and kvtier's
    primary; the file tier's blocks are promoted again afterwards (vLLM 0.32 never reports
    the reset's flush, so kvtier ends its fence by scheduler steps), and the primary hits
    again once the prompts were stored anew."""
    tier = file_tier(tmp_path / "tier")
    run = run_engine(kvtier(40, secondary_tiers=[tier]),
                     [{"prompts": FIRST}, {"prompts": SECOND, "reset": True},
                      {"prompts": SECOND[:2], "reset": True}, {"prompts": SECOND[:2]}])
    # After each reset the device cache and the primary are empty. The first request finds
    # nothing (its lookups fall inside kvtier's fence: jobs in flight at the reset may
    # still write the slots it freed); every later one finds its whole prefix again,
    # promoted from the file tier.
    whole = (len(SECOND[0]) // BLOCK) * BLOCK
    for r in (1, 2):
        assert all(a["cached_tokens"] == whole for a in run.rounds[r][1:]), run.rounds[r]
    # And the primary hits again once the prompts were stored anew.
    assert all(a["cached_tokens"] == whole for a in run.rounds[3]), run.rounds[3]
    served_from_kvtier(run)
    assert run.stats()["promotions_started"] > 0
    for r, rnd in enumerate(run.rounds[1:], start=1):
        ref = reference.rounds[1][: len(rnd)]
        for a, b in zip(ref, rnd):
            assert a["tokens"] == b["tokens"], f"round {r}"


def test_two_ranks_share_one_region_and_a_kill_leaves_nothing(run_engine, reference):
    """TP=2 on the CPU: two worker processes copy their halves into one region. Then every
    process of the engine is killed with SIGKILL: no primary-tier memory stays, in
    /dev/shm or anywhere (the region is memory that dies with its last mapper)."""
    region = 256 << 20
    run = run_engine(kvtier(region // BLOCK_BYTES), [{"prompts": FIRST}, {"prompts": SECOND}],
                     tp=2, kill=True)
    served_from_kvtier(run)
    ranks = {l["rank"] for l in run.blocks()}
    assert ranks == {0, 1}, ranks
    for a, b in zip(reference.rounds[1], run.rounds[1]):
        assert a["tokens"] == b["tokens"]
    # The region (256 MiB, faulted in at start) was mapped by the scheduler and both ranks,
    # and nothing of it stays once they are killed: Shmem falls by its size at once.
    mappers, before, after = run.killed
    assert len(mappers) >= 3 and all(size >= region for size in mappers.values()), mappers
    assert before - after >= region * 3 // 4, (before, after)
