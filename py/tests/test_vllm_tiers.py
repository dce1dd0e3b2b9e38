"""kvtier's tiers under vLLM 0.33's own tiering manager (``kvtier.vllm_tiers``).

vLLM's ``TieringOffloadingManager`` and its CPU primary tier (the oracle install) drive the
tier, built by vLLM's ``SecondaryTierFactory`` from ``type`` and ``module_path`` alone. The
same call sequences run side by side on vLLM's own ``fs`` tier: the answers and the bytes
loaded are the same where the contract says so; where kvtier is stricter (a bound, checksums)
the difference is asserted.
"""

from __future__ import annotations

import mmap
import random
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier
import vllm_oracle
from test_spec import offloading_config

ROW = 4096
FILE_TIER = {"type": "KvtierFileTier", "module_path": "kvtier.vllm_tiers"}
REDIS_TIER = {"type": "KvtierRedisTier", "module_path": "kvtier.vllm_tiers"}
S3_TIER = {"type": "KvtierS3Tier", "module_path": "kvtier.vllm_tiers"}


class Engine:
    """vLLM's tiering manager with its CPU primary of ``chunks`` rows and one secondary
    tier made by vLLM's factory from ``table``; the GPU side is played by writing and
    reading the primary's rows."""

    def __init__(self, vllm, table, *, chunks=8, model="test/model", events=True):
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

        self.vllm = vllm
        extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [table]}
        self.spec = Spec(offloading_config(vllm, extra, worker_bytes=ROW, model=model,
                                           events=events))
        # Page-aligned, as vLLM's mmap'ed region is (vLLM's fs tier uses O_DIRECT).
        self._mapping = mmap.mmap(-1, chunks * ROW)
        self.memory = np.frombuffer(self._mapping, dtype=np.uint8).reshape(chunks, ROW)
        primary = CPUPrimaryTierOffloadingManager(
            num_chunks=chunks, mmap_region=vllm_oracle.HostRegion(self.memory), enable_events=events
        )
        self.tier = SecondaryTierFactory.create_secondary_tier(
            table, primary.get_kv_memoryview(), self.spec
        )
        self.manager = TieringOffloadingManager(primary, [self.tier], tier_poll_interval_s=0)
        self.end = vllm.base.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[])
        self.requests = 0

    def request(self):
        self.requests += 1
        ctx = self.vllm.ReqContext(req_id=f"req-{self.requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self):
        with self.manager.lock:
            self.manager.on_schedule_end(self.end)

    def settle(self):
        deadline = time.monotonic() + 10
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier IO did not end"
            self.step()
            time.sleep(0.001)
        self.step()

    def store(self, keys):
        """One request stores ``keys``: each block's bytes are made from its key."""
        ctx = self.request()
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.memory[chunk] = content(key)
        with self.manager.lock:
            if out.keys_to_store:  # as vLLM's scheduler: only a store it prepared
                self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.settle()

    def fetch(self, keys, steps=50):
        """Looks ``keys`` up step after step until each is a HIT or a MISS (as the
        scheduler does while it defers a request), then loads the hits from the primary.
        Returns each key's final answer and the bytes loaded for the hits."""
        LR = self.vllm.base.LookupResult
        ctx = self.request()
        for _ in range(steps):
            with self.manager.lock:
                answers = [self.manager.lookup(k, ctx) for k in keys]
            if all(a in (LR.HIT, LR.MISS) for a in answers):
                break
            self.step()
            time.sleep(0.002)
        else:
            raise AssertionError(f"lookups did not resolve: {answers}")
        hits = [k for k, a in zip(keys, answers) if a is LR.HIT]
        loaded = {}
        if hits:
            with self.manager.lock:
                spec = self.manager.prepare_load(hits, ctx)
            for key, chunk in zip(hits, spec.chunk_ids):
                loaded[key] = bytes(self.memory[chunk])
            with self.manager.lock:
                self.manager.complete_load(hits, ctx)
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        self.step()
        return [a.name for a in answers], loaded

    def shutdown(self):
        self.manager.shutdown()


def content(key: bytes) -> np.ndarray:
    """The bytes of a block: a pattern seeded by its key."""
    return np.random.default_rng(list(key)).integers(0, 256, ROW, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"\x00\x00\x00\x00"  # vLLM's block hash and group 0


def file_tier(path, blocks=64, **more):
    return {**FILE_TIER, "path": str(path), "capacity_bytes": tier_bytes(blocks), **more}


def tier_bytes(blocks: int) -> int:
    """Bytes of a kvtier file tier that holds ``blocks`` rows: each record carries a
    header page, and the tier's own files take a few more."""
    return (blocks + 2) * (ROW + 4096)


def test_vllms_factory_loads_the_tier_from_type_and_module_path(vllm, tmp_path):
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    e = Engine(vllm, file_tier(tmp_path / "t"))
    try:
        assert isinstance(e.tier, SecondaryTierManager)
        assert type(e.tier).__name__ == "KvtierFileTier"
        assert e.tier.cache_hit_source is CacheHitSource.DISK
        assert e.tier.block_size_bytes == ROW
        assert e.tier.config_info()["capacity_blocks"] >= 64
    finally:
        e.shutdown()


def test_same_answers_and_bytes_as_vllms_fs_tier_on_the_same_calls(vllm, tmp_path):
    """Seeded sequences of stores and returning prompts, on a primary too small to keep
    them: every returning block comes back from the secondary tier. Both tiers are large
    enough to keep everything, so the contract says the answers are equal."""
    for seed in range(3):
        rng = random.Random(seed)
        ours = Engine(vllm, file_tier(tmp_path / f"k{seed}", blocks=256))
        theirs = Engine(vllm, {"type": "fs", "root_dir": str(tmp_path / f"fs{seed}")})
        try:
            prompts = [[key(100 * p + b) for b in range(rng.randint(1, 4))] for p in range(12)]
            seen: list[list[bytes]] = []
            for _ in range(30):
                if seen and rng.random() < 0.6:
                    keys = rng.choice(seen) + [key(9999 + rng.randint(0, 3))]
                    a, la = ours.fetch(keys)
                    b, lb = theirs.fetch(keys)
                    assert a == b, f"seed {seed}: {keys}: kvtier {a}, vLLM fs {b}"
                    assert la.keys() == lb.keys()
                    for k in la:
                        assert la[k] == lb[k] == content(k).tobytes(), f"seed {seed}: {k}"
                else:
                    p = rng.choice(prompts)
                    ours.store(p)
                    theirs.store(p)
                    seen.append(p)
            assert ours.tier.stats()["blocks_loaded"] > 0, "blocks came back from the tier"
            ours.tier.check_invariants()
        finally:
            ours.shutdown()
            theirs.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc", "reuse"])
def test_every_documented_eviction_policy_is_taken_and_serves_its_blocks(vllm, tmp_path, policy):
    """The module's docs list ``lru``, ``arc`` and ``reuse`` for a tier under vLLM's manager;
    each builds a tier that serves back, byte for byte, a prompt the primary no longer holds."""
    e = Engine(vllm, file_tier(tmp_path / "k", blocks=32, eviction_policy=policy))
    try:
        assert e.manager.config_info()[1]["eviction_policy"] == policy
        first = [key(1), key(2), key(3)]
        e.store(first)
        for p in range(2, 8):  # push the first prompt out of the primary's 8 rows
            e.store([key(100 * p + b) for b in range(3)])
        answers, loaded = e.fetch(first)
        assert answers == ["HIT"] * 3
        assert e.tier.stats()["blocks_loaded"] > 0, "blocks came back from the tier"
        for k in first:
            assert loaded[k] == content(k).tobytes()
        e.tier.check_invariants()
    finally:
        e.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc", "reuse"])
@pytest.mark.parametrize("learn_reads", [True, False])
def test_a_block_read_back_outlives_one_never_read_though_vllm_never_touches(
    vllm, tmp_path, policy, learn_reads
):
    """G16: vLLM 0.33's manager never calls ``touch``; the blocks a promotion read become the
    tier's most recent when it ends, so the full tier evicts a block stored after one read
    back and never read, not it. With ``learn_reads: false`` the stores' order decides, and
    the block read back goes first."""
    e = Engine(
        vllm,
        file_tier(tmp_path / "k", blocks=6, eviction_policy=policy, learn_reads=learn_reads),
        chunks=2,
    )
    try:
        capacity = e.tier.config_info()["capacity_blocks"]
        for i in range(capacity):  # the tier full, key(0) stored first
            e.store([key(i)])
        assert e.tier.stats()["evictions"] == 0
        answers, loaded = e.fetch([key(0)])  # the primary's 2 rows lost it: read back
        assert answers == ["HIT"] and loaded[key(0)] == content(key(0)).tobytes()
        assert e.tier.stats()["blocks_loaded"] == 1
        e.store([key(1000)])  # one eviction in the tier
        assert e.tier.stats()["evictions"] == 1
        LR = vllm.base.LookupResult
        ctx = e.request()
        kept = (LR.HIT, LR.MISS) if learn_reads else (LR.MISS, LR.HIT)
        assert e.tier.lookup(key(0), ctx) is kept[0], f"learn_reads={learn_reads}"
        assert e.tier.lookup(key(1), ctx) is kept[1]
        e.step()
        e.tier.check_invariants()
    finally:
        e.shutdown()


def test_the_tier_keeps_its_bound_where_vllms_fs_tier_grows(vllm, tmp_path):
    ours = Engine(vllm, file_tier(tmp_path / "k", blocks=6, eviction_policy="lru"))
    theirs = Engine(vllm, {"type": "fs", "root_dir": str(tmp_path / "fs")})
    try:
        capacity = ours.tier.config_info()["capacity_blocks"]
        n = 4 * capacity
        for i in range(n):
            ours.store([key(i)])
            theirs.store([key(i)])
        stats = ours.tier.stats()
        assert stats["up"] is True, "a bool, as Manager.take_tier_metrics gives it"
        assert stats["blocks"] <= capacity
        assert stats["evictions"] == n - capacity
        files = [f for f in (tmp_path / "fs").rglob("*.bin")]
        assert len(files) == n, "vLLM's fs tier keeps every block: it has no bound"
        # The newest blocks are served by both; the oldest only by the unbounded tier.
        newest = [key(n - 1)]
        assert ours.fetch(newest)[0] == theirs.fetch(newest)[0] == ["HIT"]
        oldest = [key(0)]
        assert ours.fetch(oldest)[0] == ["MISS"]
        assert theirs.fetch(oldest)[0] == ["HIT"]
    finally:
        ours.shutdown()
        theirs.shutdown()


def _flip_every_block(files, row):
    for f in files:
        data = bytearray(f.read_bytes())
        for at in range(0, len(data), 512):
            data[at] ^= 0xFF
        f.write_bytes(bytes(data))


def test_a_corrupt_block_is_never_loaded_where_vllms_fs_tier_serves_it(vllm, tmp_path):
    ours = Engine(vllm, file_tier(tmp_path / "k"))
    theirs = Engine(vllm, {"type": "fs", "root_dir": str(tmp_path / "fs")})
    keys = [key(1), key(2)]
    try:
        ours.store(keys)
        theirs.store(keys)
        # Push them out of both primaries.
        for i in range(10, 18):
            ours.store([key(i)])
            theirs.store([key(i)])
        # Damage the block data on disk, under both tiers.
        data = max((p for p in (tmp_path / "k").iterdir() if p.is_file()),
                   key=lambda p: p.stat().st_size)
        _flip_every_block([data], ROW)
        _flip_every_block(list((tmp_path / "fs").rglob("*.bin")), ROW)
        answers, loaded = ours.fetch(keys)
        assert answers == ["MISS", "MISS"], "a block that fails its checksum is not served"
        assert not loaded
        assert ours.tier.stats()["verification_failures"] >= 1
        answers, loaded = theirs.fetch(keys)
        assert answers == ["HIT", "HIT"]
        assert any(loaded[k] != content(k).tobytes() for k in keys), (
            "vLLM's fs tier has no checksum: it serves the damaged bytes"
        )
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_restarted_engine_serves_the_tiers_blocks(vllm, tmp_path):
    table = file_tier(tmp_path / "k")
    e = Engine(vllm, table)
    e.store([key(1), key(2), key(3)])
    e.shutdown()  # vLLM releases its primary view after the tier let go of it
    e = Engine(vllm, table)
    try:
        answers, loaded = e.fetch([key(1), key(2), key(3), key(4)])
        assert answers == ["HIT", "HIT", "HIT", "MISS"]
        for k, b in loaded.items():
            assert b == content(k).tobytes()
    finally:
        e.shutdown()


def test_a_tier_written_for_another_model_is_refused(vllm, tmp_path):
    table = file_tier(tmp_path / "k")
    e = Engine(vllm, table, model="model-a")
    e.store([key(1)])
    e.shutdown()
    with pytest.raises(kvtier.TierError, match="another model or layout"):
        Engine(vllm, table, model="model-b")


def test_a_second_engine_on_the_same_path_is_refused(vllm, tmp_path):
    table = file_tier(tmp_path / "k")
    e = Engine(vllm, table)
    try:
        with pytest.raises(kvtier.TierError, match="already open"):
            Engine(vllm, table)
    finally:
        e.shutdown()


def test_bad_settings_are_config_errors_naming_the_key(vllm, tmp_path):
    with pytest.raises(kvtier.ConfigError, match="capacity_bytes"):
        Engine(vllm, {**FILE_TIER, "path": str(tmp_path / "k")})
    with pytest.raises(kvtier.ConfigError, match="color"):
        Engine(vllm, file_tier(tmp_path / "k", color="red"))
    with pytest.raises(kvtier.ConfigError, match="eviction_policy"):
        Engine(vllm, file_tier(tmp_path / "k", eviction_policy="mru"))
    with pytest.raises(kvtier.ConfigError, match="learn_reads"):
        Engine(vllm, file_tier(tmp_path / "k", learn_reads="yes"))


def test_events_and_metrics_through_vllms_manager(vllm, tmp_path):
    from vllm.v1.kv_offload.base import Medium

    from kvtier.vllm import TIER_CAPACITY_BLOCKS, TIER_USAGE_BLOCKS, TIER_WRITTEN_BYTES

    e = Engine(vllm, file_tier(tmp_path / "k", enable_kv_events=True))
    try:
        e.store([key(1), key(2)])
        with e.manager.lock:
            events = list(e.manager.take_events())
        stored = [ev for ev in events if ev.medium is Medium.STORAGE and not ev.removed]
        assert sorted(k for ev in stored for k in ev.keys) == [key(1), key(2)]
        with e.manager.lock:
            stats = e.manager.get_stats()
        label = ("1:KvtierFileTier",)
        _, data = stats.metric_sections()
        assert data[TIER_USAGE_BLOCKS][label] == 2
        assert data[TIER_CAPACITY_BLOCKS][label] >= 64
        assert data[TIER_WRITTEN_BYTES][label] == 2 * ROW
        defs = type(e.tier).build_metric_definitions({})
        assert TIER_USAGE_BLOCKS in defs
        info = e.manager.config_info()
        assert info[1]["tier"] == "1:KvtierFileTier"
        assert info[1]["eviction_policy"] == "lru"
    finally:
        e.shutdown()


def test_reset_cache_drains_the_tier_and_hits_come_back(vllm, tmp_path):
    e = Engine(vllm, file_tier(tmp_path / "k"))
    try:
        e.store([key(1)])
        for i in range(10, 18):
            e.store([key(i)])
        with e.manager.lock:
            e.manager.reset_cache()
            e.manager.on_reset_flushed()
        answers, loaded = e.fetch([key(1)])
        assert answers == ["HIT"]
        assert loaded[key(1)] == content(key(1)).tobytes()
    finally:
        e.shutdown()


def shared_by_two_engines(vllm, table):
    """Engine A stores two blocks through a shared tier of ``table``; engine B never stored
    them: its lookups probe the store (RETRY), then promote, and it loads A's bytes."""
    a = Engine(vllm, table)
    b = Engine(vllm, table)
    try:
        a.store([key(1), key(2)])
        answers, loaded = b.fetch([key(1), key(2), key(3)])
        assert answers == ["HIT", "HIT", "MISS"]
        for k in (key(1), key(2)):
            assert loaded[k] == content(k).tobytes()
        assert b.tier.stats()["probes"] >= 3
    finally:
        a.shutdown()
        b.shutdown()


def test_a_redis_tier_is_shared_by_two_engines(vllm, redis_url):
    table = {**REDIS_TIER, "urls": [redis_url], "capacity_bytes": tier_bytes(64),
             "namespace": "vllm-tiers"}
    shared_by_two_engines(vllm, table)


def test_an_s3_tier_is_shared_by_two_engines(vllm, s3_server, monkeypatch):
    """vLLM's factory builds kvtier's S3 tier from its table; two engines share one bucket
    on a real SeaweedFS server: one stores, the other probes, promotes and loads the bytes."""
    endpoint, bucket, access, secret = s3_server
    monkeypatch.setenv("KVTIER_PY_S3_KEY", access)
    monkeypatch.setenv("KVTIER_PY_S3_SECRET", secret)
    table = {**S3_TIER, "endpoint": endpoint, "bucket": bucket, "prefix": "vllm-tiers",
             "access_key_id_env": "KVTIER_PY_S3_KEY", "secret_access_key_env": "KVTIER_PY_S3_SECRET",
             "capacity_bytes": tier_bytes(64)}
    shared_by_two_engines(vllm, table)


def test_a_redis_tier_that_is_gone_answers_miss_and_goes_down(vllm, redis_server):
    """A dead server must not hold requests: failed probes make the tier Down (G12), and
    every lookup is then a MISS at once."""
    url, proc = redis_server
    table = {**REDIS_TIER, "urls": [url], "capacity_bytes": tier_bytes(64),
             "failures_to_down": 2, "timeout_ms": 500}
    e = Engine(vllm, table)
    try:
        proc.kill()
        proc.wait()
        answers, loaded = e.fetch([key(1), key(2)])
        assert answers == ["MISS", "MISS"] and not loaded
        stats = e.tier.stats()
        assert stats["up"] is False and stats["times_down"] == 1
        answers, _ = e.fetch([key(3)])
        assert answers == ["MISS"]
        assert e.tier.stats()["probes"] == stats["probes"], "no probe while Down"
        with e.manager.lock:
            data = e.manager.get_stats().metric_sections()[1]
        from kvtier.vllm import TIER_UP

        assert data[TIER_UP][("1:KvtierRedisTier",)] == 0
    finally:
        e.shutdown()


def test_a_stopped_redis_holds_a_lookup_only_until_the_deadline(vllm, redis_server):
    """A server that stops answering (SIGSTOP) leaves probes hanging: a lookup answers
    RETRY until hit_pending_timeout_s, then MISS (G11); the probe ends once it wakes."""
    import signal

    url, proc = redis_server
    table = {**REDIS_TIER, "urls": [url], "capacity_bytes": tier_bytes(64),
             "hit_pending_timeout_s": 0.3, "timeout_ms": 60_000}
    a = Engine(vllm, table)
    b = Engine(vllm, table)
    try:
        a.store([key(1)])
        proc.send_signal(signal.SIGSTOP)
        begun = time.monotonic()
        answers, loaded = b.fetch([key(1)], steps=1000)
        waited = time.monotonic() - begun
        assert answers == ["MISS"] and not loaded
        assert 0.3 <= waited < 5, waited
        assert b.tier.stats()["wait_timeouts"] >= 1
    finally:
        proc.send_signal(signal.SIGCONT)
        a.shutdown()
        b.shutdown()


def test_bad_timeouts_are_config_errors(vllm, tmp_path):
    for key_, value in [("drain_timeout_s", float("inf")), ("shutdown_timeout_s", None),
                        ("hit_pending_timeout_s", float("nan")), ("failures_to_down", 0),
                        ("io_threads", True)]:
        with pytest.raises(kvtier.ConfigError, match=key_):
            Engine(vllm, file_tier(tmp_path / "k", **{key_: value}))


def test_events_name_the_tier_and_expect_its_removals(vllm, tmp_path):
    e = Engine(vllm, file_tier(tmp_path / "k", blocks=2, enable_kv_events=True))
    try:
        capacity = e.tier.config_info()["capacity_blocks"]
        for i in range(capacity + 1):
            e.store([key(i)])
        with e.manager.lock:
            events = [ev for ev in e.manager.take_events() if ev.ownership == "KvtierFileTier"]
        assert all(ev.removal_expected for ev in events)
        removed = [k for ev in events if ev.removed for k in ev.keys]
        assert removed == [key(0)], "the evicted block is announced removed"
    finally:
        e.shutdown()


def test_a_job_the_tier_refuses_still_ends_once_failed(vllm, tmp_path):
    """G10: a job naming one primary slot twice is never run; vLLM's manager still gets its
    one result (a failed one), so no pin of vLLM's leaks."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    e = Engine(vllm, file_tier(tmp_path / "k"))
    try:
        e.store([key(1), key(2)])
        job = TransferJob(job_id=10_000, keys=[key(1), key(2)], chunk_ids=np.array([3, 3]),
                          is_promotion=True, req_context=vllm.ReqContext(req_id="x"))
        e.tier.submit_load(job)
        assert e.tier.has_pending_work()
        (result,) = [r for r in e.tier.get_finished_jobs() if r.job_id == 10_000]
        assert not result.success and result.successful_keys is None
        e.tier.check_invariants()
    finally:
        e.shutdown()
