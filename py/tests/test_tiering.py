"""Tiering through vLLM's calls: a file tier below the primary, promotions, persistence.

Each scenario drives the manager as vLLM's scheduler does and moves the bytes with a worker
handler on host buffers, so every block served is checked byte for byte.
"""

from __future__ import annotations

import re
import socket
import time

import numpy as np
import pytest

import kvtier.vllm as kv
from vllm.v1.kv_offload import base

from test_worker import copied, kv_caches

PAGE = 4096
END = base.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[])


class Node:
    """A manager with one secondary tier (a file tier unless told), and one rank's handler."""

    def __init__(self, region_dir, tier_dir, caches, *, slots=4, tier_blocks=64, policy="lru",
                 tier=None, region="region", hit_pending_timeout_s=5.0):
        if tier is None:
            tier = {"type": "file", "path": str(tier_dir)}
        self.settings = kv.Settings(
            num_blocks=slots,
            region_path=str(region_dir / region),
            block_bytes_per_worker=PAGE,
            policy=policy,
            tiers=({**tier, "capacity_bytes": tier_blocks * PAGE},),
            identity="test/model",
            hit_pending_timeout_s=hit_pending_timeout_s,
        )
        self.manager = kv.KvtierOffloadingManager(self.settings, prefault_threads=1)
        self.worker = kv.KvtierOffloadingWorker(caches, self.settings)
        self.jobs = 0
        self.requests = 0

    def request(self):
        self.requests += 1
        ctx = base.ReqContext(req_id=f"req-{self.requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def transfer(self, submit, a, b):
        self.jobs += 1
        assert submit(self.jobs, a, b)
        self.worker.wait({self.jobs})
        (r,) = self.worker.get_finished()
        return r.success

    def store(self, keys, gpu_ids):
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        ok = self.transfer(
            self.worker.submit_store,
            base.GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]),
            out.store_spec,
        )
        assert ok
        self.manager.complete_store(out.keys_to_store, ctx)  # as vLLM 0.33 does
        self.manager.on_request_finished(ctx)
        self.manager.on_schedule_end(END)
        return out

    def settle(self):
        """Steps until no tier IO is in flight."""
        deadline = time.monotonic() + 10
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier IO did not end"
            self.manager.on_schedule_end(END)
            time.sleep(0.001)

    def lookup_until_settled(self, key, ctx):
        """Looks `key` up, stepping while it is pending (a promotion in flight)."""
        deadline = time.monotonic() + 10
        seen = []
        while True:
            r = self.manager.lookup(key, ctx)
            seen.append(r)
            if r in (kv.LookupResult.HIT, kv.LookupResult.MISS):
                return r, seen
            assert time.monotonic() < deadline, f"{key!r} still {r}"
            self.manager.on_schedule_end(END)
            time.sleep(0.001)

    def load(self, keys, gpu_ids, ctx):
        src = self.manager.prepare_load(keys, ctx)
        ok = self.transfer(
            self.worker.submit_load, src, base.GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0])
        )
        self.manager.complete_load(keys, ctx)
        return ok

    def close(self):
        self.worker.shutdown()
        self.manager.shutdown()


def test_an_evicted_block_comes_back_from_the_file_tier(region_dir, tmp_path):
    caches = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(3))
    node = Node(region_dir, tmp_path / "tier", caches)
    try:
        keys = [f"block-{i}".encode() for i in range(8)]
        want = {k: copied(caches, 0, i) for i, k in enumerate(keys)}
        # Eight blocks through a primary of four: the first four are evicted to make room,
        # after their cascade to the file tier.
        node.store(keys[:4], [0, 1, 2, 3])
        node.settle()
        out = node.store(keys[4:], [4, 5, 6, 7])
        assert sorted(out.evicted_keys) == sorted(keys[:4])
        node.settle()
        assert node.manager.stats()["tiers"][0]["blocks"] == 8
        events = list(node.manager.take_events())
        stored = [k for e in events if e.medium is kv.Medium.STORAGE and not e.removed for k in e.keys]
        assert sorted(stored) == sorted(keys)
        # block-0 is a miss in the primary, a promotion from the tier, then a hit.
        ctx = node.request()
        result, seen = node.lookup_until_settled(keys[0], ctx)
        assert result is kv.LookupResult.HIT and seen[0] is kv.LookupResult.HIT_PENDING
        assert node.manager.get_load_source(keys[0], ctx) == "disk"
        caches.tensors[0].tensor[12] = 0
        assert node.load([keys[0]], [12], ctx)
        assert np.array_equal(copied(caches, 0, 12)[0], want[keys[0]][0])
        node.manager.on_request_finished(ctx)
        assert node.manager.stats()["load_pins"] == 0
    finally:
        node.close()


def test_a_victim_tier_is_written_ahead_of_the_primarys_evictions(region_dir, tmp_path):
    """``victim_lookahead`` (rules V1–V4): a completed store writes nothing to the tier; the
    step's end writes the primary's next two victims; evicting four blocks finds two of them
    on the tier and counts the other two as missed; a written one comes back."""
    caches = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(5))
    tier = {"type": "file", "path": str(tmp_path / "tier"), "victim_lookahead": 2}
    node = Node(region_dir, tmp_path / "tier", caches, tier=tier)
    try:
        keys = [f"victim-{i}".encode() for i in range(8)]
        want = {k: copied(caches, 0, i) for i, k in enumerate(keys)}
        node.store(keys[:4], [0, 1, 2, 3])  # its step's end writes two ahead
        node.settle()
        (tier_stats,) = node.manager.stats()["tiers"]
        assert (tier_stats["blocks"], tier_stats["blocks_cascaded"]) == (2, 2)
        node.store(keys[4:], [4, 5, 6, 7])  # evicts all four
        node.settle()
        (tier_stats,) = node.manager.stats()["tiers"]
        assert tier_stats["victims_missed"] == 2
        events = list(node.manager.take_events())
        written = [k for e in events if e.medium is kv.Medium.STORAGE and not e.removed for k in e.keys]
        assert set(written[:2]) <= set(keys[:4])
        ctx = node.request()
        result, _ = node.lookup_until_settled(written[0], ctx)
        assert result is kv.LookupResult.HIT
        caches.tensors[0].tensor[12] = 0
        assert node.load([written[0]], [12], ctx)
        assert np.array_equal(copied(caches, 0, 12)[0], want[written[0]][0])
        node.manager.on_request_finished(ctx)
    finally:
        node.close()


def test_the_file_tier_survives_a_restart(region_dir, tmp_path):
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(4))
    keys = [b"persist-a", b"persist-b"]
    want = [copied(caches, 0, 0), copied(caches, 0, 1)]
    node = Node(region_dir, tmp_path / "tier", caches)
    node.store(keys, [0, 1])
    node.settle()
    node.close()
    # A new process' manager: an empty primary, the tier's blocks found on disk.
    fresh = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(5))
    node = Node(region_dir, tmp_path / "tier", fresh)
    try:
        assert node.manager.stats()["tiers"][0]["blocks"] == 2
        ctx = node.request()
        for k in keys:
            result, seen = node.lookup_until_settled(k, ctx)
            assert result is kv.LookupResult.HIT and seen[0] is kv.LookupResult.HIT_PENDING
        assert node.load(keys, [6, 7], ctx)
        assert np.array_equal(copied(fresh, 0, 6)[0], want[0][0])
        assert np.array_equal(copied(fresh, 0, 7)[0], want[1][0])
    finally:
        node.close()


def test_reset_cache_holds_promotions_until_flushed(region_dir, tmp_path):
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(6))
    node = Node(region_dir, tmp_path / "tier", caches)
    try:
        node.store([b"r"], [0])
        node.settle()
        node.manager.reset_cache()
        ctx = node.request()
        # The primary forgot the block; the tier keeps it, but no promotion starts before
        # vLLM says the workers flushed (their writes to freed slots could race it).
        assert node.manager.lookup(b"r", ctx) is kv.LookupResult.MISS
        node.manager.on_reset_flushed()
        result, _ = node.lookup_until_settled(b"r", ctx)
        assert result is kv.LookupResult.HIT
    finally:
        node.close()


def test_where_vllm_never_reports_the_flush_the_fence_ends_after_its_steps(
    region_dir, tmp_path, monkeypatch
):
    """vLLM 0.32 never calls on_reset_flushed: the fence ends at the reset_fence_steps-th
    scheduler step after the reset, not one step earlier."""
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(16))
    monkeypatch.setattr(kv, "RESET_FLUSHED_CALLED", False)
    node = Node(region_dir, tmp_path / "tier", caches)
    try:
        node.store([b"r"], [0])
        node.settle()
        steps = node.manager.reset_fence_steps
        assert steps == 4  # one pipeline stage
        node.manager.reset_cache()
        ctx = node.request()
        for _ in range(steps - 1):
            assert node.manager.lookup(b"r", ctx) is kv.LookupResult.MISS
            node.manager.on_schedule_end(END)
        assert node.manager.lookup(b"r", ctx) is kv.LookupResult.MISS
        # The fence's last step: promotions may take the freed slots again.
        node.manager.on_schedule_end(END)
        result, _ = node.lookup_until_settled(b"r", ctx)
        assert result is kv.LookupResult.HIT
    finally:
        node.close()


def test_a_failed_store_never_cascades(region_dir, tmp_path):
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(7))
    node = Node(region_dir, tmp_path / "tier", caches)
    try:
        ctx = node.request()
        out = node.manager.prepare_store([b"bad"], ctx)
        node.manager.complete_store(out.keys_to_store, ctx, success=False)
        node.manager.on_schedule_end(END)
        node.settle()
        assert node.manager.stats()["tiers"][0]["blocks"] == 0
        assert node.manager.lookup(b"bad", ctx) is kv.LookupResult.MISS
        events = list(node.manager.take_events())
        assert all(e.metadata_only for e in events if e.removed)
    finally:
        node.close()


def test_where_events_have_no_metadata_only_a_failed_store_announces_nothing(
    region_dir, tmp_path, monkeypatch
):
    """vLLM 0.32's OffloadingEvent has no metadata_only, and its own manager sends no event
    for a failed store: neither does kvtier's there (building the event would raise)."""
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(17))
    monkeypatch.setattr(kv, "EVENT_METADATA_ONLY", False)
    node = Node(region_dir, tmp_path / "tier", caches)
    try:
        node.store([b"good"], [0])
        ctx = node.request()
        out = node.manager.prepare_store([b"bad"], ctx)
        node.manager.complete_store(out.keys_to_store, ctx, success=False)
        events = list(node.manager.take_events())
        assert events and not any(e.metadata_only for e in events)
        assert not any(b"bad" in e.keys for e in events if e.removed)
    finally:
        node.close()


def test_a_corrupt_tier_block_is_not_served_and_the_warning_reaches_python(
    region_dir, tmp_path, caplog
):
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(8))
    node = Node(region_dir, tmp_path / "tier", caches)
    try:
        node.store([b"c"], [0])
        node.settle()
        block = copied(caches, 0, 0)[0].tobytes()
        data = max((tmp_path / "tier").iterdir(), key=lambda p: p.stat().st_size)
        with open(data, "r+b") as f:  # flip bytes of the block's payload on disk
            at = f.read().find(block[:256])
            assert at >= 0, "the block's bytes are in the tier's data file"
            f.seek(at + 1000)
            f.write(bytes(b ^ 0xFF for b in block[1000:1064]))
        node.manager.reset_cache()
        node.manager.on_reset_flushed()
        ctx = node.request()
        with caplog.at_level("WARNING", logger="kvtier"):
            result, seen = node.lookup_until_settled(b"c", ctx)
            node.manager.on_schedule_end(END)
        assert seen[0] is kv.LookupResult.HIT_PENDING  # a promotion was tried
        assert result is kv.LookupResult.MISS  # and failed: the block is not served
        logged = " ".join(r.getMessage() for r in caplog.records if r.name == "kvtier")
        assert "failed verification" in logged, logged
        assert node.manager.stats()["load_pins"] == 0
    finally:
        node.close()


def two_nodes(region_dir, tier, seed):
    """Two nodes over the same shared ``tier``, each with a primary and caches of its own."""
    caches_a = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(seed))
    caches_b = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(seed + 1))
    a = Node(region_dir, None, caches_a, tier=tier, region="a")
    b = Node(region_dir, None, caches_b, tier=tier, region="b")
    a.caches, b.caches = caches_a, caches_b
    return a, b


def promoted_by_the_other(a, b, name):
    """Node A stores four blocks, which cascade to the shared tier; node B finds the third by
    an existence probe, promotes it and loads A's bytes. The keys, in order."""
    keys = [f"{name}-{i}".encode() for i in range(4)]
    a.store(keys, [0, 1, 2, 3])
    a.settle()
    assert a.manager.stats()["tiers"][0]["blocks"] == 4
    ctx = b.request()
    result, seen = b.lookup_until_settled(keys[2], ctx)
    assert result is kv.LookupResult.HIT and kv.LookupResult.HIT_PENDING in seen
    b.caches.tensors[0].tensor[9] = 0
    assert b.load([keys[2]], [9], ctx)
    assert np.array_equal(copied(b.caches, 0, 9)[0], copied(a.caches, 0, 2)[0])
    b.manager.on_request_finished(ctx)
    return keys


def test_two_nodes_share_a_redis_tier(region_dir, tmp_path, redis_url):
    """Node A's blocks cascade to a shared Redis tier; node B, with a primary of its own,
    finds one by an existence probe, promotes it and serves the same bytes. A block the
    server no longer holds (flushed) is a Miss, and the tier stays up."""
    tier = {"type": "redis", "urls": [redis_url], "namespace": "pytest", "timeout_ms": 2000}
    a, b = two_nodes(region_dir, tier, 5)
    try:
        keys = promoted_by_the_other(a, b, "shared")
        # B's probe finds block 3 and B's index holds it; then the server lets it go (a
        # flush here; its own eviction or an expiry alike). The promotion finds it missing:
        # a Miss, nothing served, and no failure: the tier stays up.
        ctx = b.request()
        assert b.manager.lookup(keys[3], ctx) is kv.LookupResult.RETRY
        b.manager.on_request_finished(ctx)
        b.manager.on_schedule_end(END)
        b.settle()
        host, port = redis_url.removeprefix("redis://").split(":")
        with socket.create_connection((host, int(port))) as c:
            c.sendall(b"FLUSHALL\r\n")
            assert c.recv(16).startswith(b"+OK")
        ctx = b.request()
        result, seen = b.lookup_until_settled(keys[3], ctx)
        assert result is kv.LookupResult.MISS and kv.LookupResult.HIT_PENDING in seen
        b.manager.on_request_finished(ctx)
        stats = b.manager.stats()
        tier_stats = stats["tiers"][0]
        assert (tier_stats["read_missing"], tier_stats["read_failures"]) == (1, 0), stats
        assert tier_stats["health"] == "Up", stats
        assert stats["promotions_missing"] == 1
    finally:
        a.close()
        b.close()


def test_two_nodes_share_an_s3_tier(region_dir, s3_server, monkeypatch):
    """Node A's blocks cascade to a shared S3 tier (a real SeaweedFS server, signed requests
    with credentials from the environment variables the settings name); node B, with a
    primary of its own, finds one by an existence probe, promotes it and serves the same
    bytes. A block no node stored is a Miss. Settings set to None (JSON's null) are absent."""
    endpoint, bucket, access, secret = s3_server
    monkeypatch.setenv("KVTIER_PY_S3_KEY", access)
    monkeypatch.setenv("KVTIER_PY_S3_SECRET", secret)
    tier = {"type": "s3", "endpoint": endpoint, "bucket": bucket, "prefix": "pytest",
            "access_key_id_env": "KVTIER_PY_S3_KEY", "secret_access_key_env": "KVTIER_PY_S3_SECRET",
            "timeout_ms": 5000, "region": None, "session_token_env": None}
    a, b = two_nodes(region_dir, tier, 15)
    try:
        promoted_by_the_other(a, b, "s3-shared")
        ctx = b.request()
        result, _ = b.lookup_until_settled(b"never-stored", ctx)
        assert result is kv.LookupResult.MISS
        b.manager.on_request_finished(ctx)
        stats = b.manager.stats()["tiers"][0]
        assert (stats["read_failures"], stats["health"]) == (0, "Up"), stats
    finally:
        a.close()
        b.close()


def test_s3_credentials_come_from_the_environment(region_dir, s3_server, monkeypatch):
    """A variable the settings name that is not set is a configuration error naming the key
    and the variable; a wrong secret is refused when the tier opens."""
    endpoint, bucket, access, _ = s3_server
    monkeypatch.delenv("KVTIER_PY_S3_UNSET", raising=False)
    tier = {"type": "s3", "endpoint": endpoint, "bucket": bucket,
            "access_key_id_env": "KVTIER_PY_S3_KEY", "secret_access_key_env": "KVTIER_PY_S3_UNSET"}
    monkeypatch.setenv("KVTIER_PY_S3_KEY", access)
    caches = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(17))
    with pytest.raises(Exception, match="secret_access_key_env.*KVTIER_PY_S3_UNSET"):
        Node(region_dir, None, caches, tier=tier, region="c")
    monkeypatch.setenv("KVTIER_PY_S3_UNSET", "not the secret")
    with pytest.raises(Exception, match="refused the credentials"):
        Node(region_dir, None, caches, tier=tier, region="d")


def test_a_stopped_redis_holds_a_request_only_until_the_deadline(region_dir, redis_server):
    """★9 (W3): with its Redis server stopped (SIGSTOP: it accepts nothing and answers
    nothing, as a hung server), a request that wants a block it holds is deferred for
    ``hit_pending_timeout_s``, then answered "miss" and computes the block. Once the server
    runs again, the probe ends once, a new request promotes and loads the block with the bytes
    node A stored, and nothing is left pinned or in flight."""
    import os
    import signal

    url, server = redis_server
    # A client timeout far beyond the deadline: the deadline alone ends the wait.
    tier = {"type": "redis", "urls": [url], "namespace": "pytest", "timeout_ms": 60_000}
    caches_a = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(8))
    caches_b = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(9))
    a = Node(region_dir, None, caches_a, tier=tier, region="a")
    b = Node(region_dir, None, caches_b, tier=tier, region="b", hit_pending_timeout_s=1.0)
    try:
        keys = [b"stall-0", b"stall-1"]
        a.store(keys, [0, 1])
        a.settle()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            ctx = b.request()
            started = time.monotonic()
            seen = []
            while True:
                r = b.manager.lookup(keys[0], ctx)
                seen.append(r)
                if r is kv.LookupResult.MISS:
                    break
                assert r in (kv.LookupResult.RETRY, kv.LookupResult.HIT_PENDING), seen
                assert time.monotonic() - started < 30, f"held for 30 s: {len(seen)} lookups"
                b.manager.on_schedule_end(END)
                time.sleep(0.005)
            waited = time.monotonic() - started
            assert waited > 1.0, waited
            assert kv.LookupResult.RETRY in seen
            assert b.manager.lookup(keys[0], ctx) is kv.LookupResult.MISS  # W4
            assert b.manager.stats()["wait_timeouts"] == 1
            assert b.manager.has_pending_work(), "the probe is still in flight"
        finally:
            os.kill(server.pid, signal.SIGCONT)
        b.manager.on_request_finished(ctx)
        b.settle()
        ctx = b.request()
        result, _ = b.lookup_until_settled(keys[0], ctx)
        assert result is kv.LookupResult.HIT
        caches_b.tensors[0].tensor[9] = 0
        assert b.load([keys[0]], [9], ctx)
        assert np.array_equal(copied(caches_b, 0, 9)[0], copied(caches_a, 0, 0)[0])
        b.manager.on_request_finished(ctx)
        b.settle()
        stats = b.manager.stats()
        assert stats["wait_timeouts"] == 1, stats
        assert (stats["load_pins"], stats["job_pins"], stats["jobs_outstanding"]) == (0, 0, 0)
        assert stats["tiers"][0]["health"] == "Up", stats
        assert not b.manager.has_pending_work()
    finally:
        a.close()
        b.close()


def test_a_redis_tier_setting_of_the_wrong_type_names_the_key(region_dir, redis_url):
    caches = kv_caches([[(PAGE, PAGE)]], 4, np.random.default_rng(7))
    for tier, key in [
        ({"type": "redis", "urls": [redis_url], "path": "/tmp/x"}, "secondary_tiers[0].path"),
        ({"type": "redis"}, "secondary_tiers[0].urls"),
        ({"type": "redis", "urls": [redis_url], "timeout_ms": "soon"}, "secondary_tiers[0].timeout_ms"),
        ({"type": "redis", "urls": [redis_url], "password_env": "KVTIER_TEST_UNSET_VARIABLE"},
         "KVTIER_TEST_UNSET_VARIABLE"),
        ({"type": "file", "path": "/tmp/x", "urls": [redis_url]}, "secondary_tiers[0].urls"),
        ({"type": "redis", "urls": [redis_url], "ttl_s": 0}, "secondary_tiers[0].ttl_s"),
        ({"type": "redis", "urls": [redis_url], "tls": False, "tls_ca_file": "/tmp/ca.pem"},
         "secondary_tiers[0].tls_ca_file"),
        ({"type": "redis", "urls": [redis_url], "username_env": "KVTIER_TEST_UNSET_VARIABLE"},
         "secondary_tiers[0].username_env"),
    ]:
        with pytest.raises(kv.ConfigError, match=re.escape(key)):
            Node(region_dir, None, caches, tier=tier)
