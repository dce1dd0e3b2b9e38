"""kvtier's page cache (``kvtier._native.PageCache``, what ``kvtier.sglang`` drives) under a
stalled tier: a real redis-server, stopped with SIGSTOP while cascades are in flight."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import numpy as np
import pytest

from kvtier import _native

PAGE = 4096


def cache(num_blocks: int, redis_url: str) -> "_native.PageCache":
    tiers = [{"type": "redis", "urls": [redis_url], "capacity_bytes": 1 << 26, "timeout_ms": 30000}]
    return _native.PageCache(num_blocks=num_blocks, page_bytes=PAGE,
                             region_path=f"@kvtier-pages-{uuid.uuid4().hex[:12]}",
                             tiers=tiers, identity="kvtier-test-pages", wait_timeout_s=30.0)


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE), dtype=np.uint8)


def pieces(buf: np.ndarray) -> tuple[list[int], list[int]]:
    base = buf.ctypes.data
    return [base + i * PAGE for i in range(len(buf))], [PAGE] * len(buf)


def test_promotions_refused_for_want_of_slots_are_asked_again_until_the_pins_go(redis_server):
    """P-rule of the page calls: a get whose promotions find every slot pinned by cascades in
    flight asks again once those end, within its wait. The cascades' pins go when a step
    applies their results, which comes after the driver counts the jobs ended: a get that
    looked only at the IO in flight answered Miss in that gap for pages its tier held (found
    under load as a page fewer than SGLang's own file backend served). Many keys make each
    round of lookups long, so the cascades' end lands inside one; the trials repeat it."""
    url, proc = redis_server
    n = 512
    for trial in range(12):
        pc = cache(n, url)
        try:
            old = [f"old-{trial}-{i}".encode() for i in range(n)]
            new = [f"new-{trial}-{i}".encode() for i in range(n)]
            want = pages(n, 2 * trial)
            assert all(pc.set(old, *pieces(want)))
            assert pc.drain(20.0)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                # Every slot now holds a page whose cascade hangs on the stopped server.
                assert all(pc.set(new, *pieces(pages(n, 2 * trial + 1))))
                assert pc.stats()["job_pins"] == n
                threading.Timer(0.1 + 0.0037 * trial, os.kill, (proc.pid, signal.SIGCONT)).start()
                out = np.zeros_like(want)
                got = pc.get(old, *pieces(out))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert got == [True] * n, f"trial {trial}: {got.count(False)} pages not served"
            assert np.array_equal(out, want)
            pc.check_invariants()
        finally:
            pc.shutdown()


@pytest.mark.parametrize("found_first", [True, False])
def test_exists_keeps_the_pages_it_found_while_it_waits_for_another(redis_server, found_first):
    """★8 through the page calls: ``exists`` answers the leading run of pages ready at once,
    and a promotion it waits for must not evict a page it found, before or after it in the
    run. The core protects a request's hits for one step, and each round of the wait ends
    one: every round looks every page found up again, as vLLM's scheduler does at every step.
    Here page A is found, page B is only in the stalled tier, and the primary's other slot is
    pinned by a cascade: B's promotion waits for that slot, and never takes A's."""
    url, proc = redis_server
    pc = cache(2, url)
    try:
        a, b, x = b"page-a", b"page-b", b"page-x"
        data = pages(3, 7)
        assert pc.set([b], *pieces(data[1:2]))
        assert pc.drain(20.0)
        assert pc.set([a], *pieces(data[0:1]))
        assert pc.drain(20.0)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert pc.set([x], *pieces(data[2:3]))  # evicts B, held in the tier
            assert pc.stats()["job_pins"] == 1
            threading.Timer(0.3, os.kill, (proc.pid, signal.SIGCONT)).start()
            found = pc.exists([a, b] if found_first else [b, a])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert found == 2
        out = np.zeros((2, PAGE), dtype=np.uint8)
        assert pc.get([a, b], *pieces(out)) == [True, True]
        assert np.array_equal(out, data[0:2])
        pc.check_invariants()
    finally:
        pc.shutdown()
