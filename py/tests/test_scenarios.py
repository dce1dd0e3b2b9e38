"""vLLM's own small cases for its CPU manager, re-encoded for vLLM 0.33's interface.

Each scenario is a list of calls with the answer written out: which keys are stored and in
which slots, which keys are evicted, what lookups answer, which events come. Every call goes
to vLLM 0.33.0's own ``CPUOffloadingManager`` and to kvtier's manager, and both must give the
written answer, so a wrong expectation fails as surely as a wrong manager.
"""

from __future__ import annotations

import pytest

import kvtier.vllm as kv

MISS, HIT, PENDING = "MISS", "HIT", "HIT_PENDING"


def key(vllm, i):
    return vllm.make_offload_key(str(i).encode(), 0)


def ids(keys):
    return [int(bytes(k)[:-4]) for k in keys]


class Both:
    """One request's calls into vLLM's manager and kvtier's, every answer checked."""

    def __init__(self, vllm, region_dir, policy, blocks):
        self.vllm = vllm
        self.theirs = vllm.CPUOffloadingManager(
            num_chunks=blocks, cache_policy=policy, enable_events=True
        )
        self.ours = kv.KvtierOffloadingManager(
            kv.Settings(
                num_blocks=blocks,
                region_path=str(region_dir / "region"),
                policy=policy,
                verify_stores=False,  # the calls alone: no worker copies here
            ),
            prefault_threads=1,
        )
        self.ctx = vllm.ReqContext(req_id="a")
        for m in self.managers:
            m.on_new_request(self.ctx)

    @property
    def managers(self):
        return (self.theirs, self.ours)

    def keys(self, numbers):
        return [key(self.vllm, i) for i in numbers]

    def store(self, numbers, expected):
        """``expected``: ``(stored, slots, evicted)``, or ``None`` for no room."""
        for m in self.managers:
            out = m.prepare_store(self.keys(numbers), self.ctx)
            got = None if out is None else (
                ids(out.keys_to_store),
                [int(s) for s in out.store_spec.block_ids],
                ids(out.evicted_keys),
            )
            assert got == expected, f"{type(m).__name__}: prepare_store({numbers})"

    def complete(self, numbers, success=True):
        for m in self.managers:
            m.complete_store(self.keys(numbers), self.ctx, success=success)

    def lookup(self, numbers, expected):
        for m in self.managers:
            got = [m.lookup(key(self.vllm, i), self.ctx).name for i in numbers]
            assert got == expected, f"{type(m).__name__}: lookups of {numbers}"

    def load(self, numbers, slots):
        for m in self.managers:
            got = [int(s) for s in m.prepare_load(self.keys(numbers), self.ctx).block_ids]
            assert got == slots, f"{type(m).__name__}: prepare_load({numbers})"

    def loaded(self, numbers):
        for m in self.managers:
            m.complete_load(self.keys(numbers), self.ctx)

    def touch(self, numbers):
        for m in self.managers:
            m.touch(self.keys(numbers), self.ctx)

    def events(self, expected):
        """``expected``: ``(removed, metadata_only, keys)`` per event, in order."""
        for m in self.managers:
            got = [(e.removed, e.metadata_only, sorted(ids(e.keys))) for e in m.take_events()]
            assert got == expected, f"{type(m).__name__}: events"

    def close(self):
        self.ours.shutdown()


@pytest.fixture
def both(vllm, region_dir, request):
    policy, blocks = request.param
    b = Both(vllm, region_dir, policy, blocks)
    yield b
    b.close()


@pytest.mark.parametrize("both", [("lru", 4), ("arc", 4)], indirect=True, ids=["lru", "arc"])
def test_the_cpu_managers_walk_through(both):
    both.store([1, 2], ([1, 2], [0, 1], []))
    both.lookup([1], [PENDING])  # stored, not yet written
    both.events([])
    both.complete([1, 2])
    both.events([(False, False, [1, 2])])
    both.lookup([1, 2, 3], [HIT, HIT, MISS])
    both.touch([1])
    # 2 is stored already: it is not stored again, and not evicted to make room.
    both.store([2, 3, 4, 5], ([3, 4, 5], [2, 3, 0], [1]))
    both.events([(True, False, [1])])
    both.store([1, 6], None)  # every slot is being written: no room
    both.complete([2, 3, 4, 5])
    both.load([2, 3], [1, 2])
    both.store([6, 7, 8], None)  # 2 and 3 are pinned by the load: no room for three
    both.loaded([2, 3])
    both.store([6, 7, 8], ([6, 7, 8], [3, 2, 1], [2, 3, 4]))
    both.complete([6, 7, 8])
    both.touch([5, 6, 7])
    both.store([9], ([9], [1], [8]))
    # A failed store drops only what it was writing: 7 was stored before.
    both.complete([7, 9], success=False)
    both.lookup([7, 9], [HIT, MISS])
    both.events(
        [
            (False, False, [3, 4, 5]),
            (True, False, [2, 3, 4]),
            (False, False, [6, 7, 8]),
            (True, False, [8]),
            (True, True, [9]),  # never announced as stored: a metadata-only removal
        ]
    )


@pytest.mark.parametrize("both", [("lru", 4), ("arc", 4)], indirect=True, ids=["lru", "arc"])
def test_a_block_already_stored_is_not_evicted_by_its_own_store(both):
    both.store([1, 2], ([1, 2], [0, 1], []))
    both.complete([1, 2])
    both.touch([1])  # 2 is now the eviction candidate
    both.store([2, 3, 4, 5], ([3, 4, 5], [2, 3, 0], [1]))
    both.complete([2, 3, 4, 5])
    both.lookup([2], [HIT])


@pytest.mark.parametrize("both", [("arc", 4)], indirect=True, ids=["arc"])
def test_arc_keeps_blocks_used_twice_over_blocks_used_once(both):
    both.store([1, 2, 3, 4], ([1, 2, 3, 4], [0, 1, 2, 3], []))
    both.complete([1, 2, 3, 4])
    both.touch([3, 4])  # a second use: T2
    both.store([5], ([5], [0], [1]))
    both.complete([5])
    both.store([6], ([6], [1], [2]))
    both.complete([6])
    both.lookup([3, 4, 5, 6, 1, 2], [HIT, HIT, HIT, HIT, MISS, MISS])


@pytest.mark.parametrize("both", [("arc", 2)], indirect=True, ids=["arc"])
def test_arc_remembers_what_it_evicted(both):
    both.store([1, 2], ([1, 2], [0, 1], []))
    both.complete([1, 2])
    both.store([3], ([3], [0], [1]))  # 1 becomes a ghost
    both.complete([3])
    both.touch([1])  # a ghost hit: T1's target grows
    both.touch([3])  # 3 to T2
    both.store([4], ([4], [1], [2]))
    both.complete([4])
    both.store([5], ([5], [1], [4]))  # T1 is over its target: its LRU goes, not 3
    both.complete([5])
    both.lookup([3], [HIT])


@pytest.mark.parametrize("both", [("arc", 2)], indirect=True, ids=["arc"])
def test_arc_ghost_lists_stay_bounded(both):
    both.store([1, 2], ([1, 2], [0, 1], []))
    both.complete([1, 2])
    for i in range(3, 40):
        out = both.ours.prepare_store(both.keys([i]), both.ctx)
        their = both.theirs.prepare_store(both.keys([i]), both.ctx)
        assert ids(out.evicted_keys) == ids(their.evicted_keys)
        both.complete([i])
    # Every evicted block is a ghost for a while only: an old one is a plain miss.
    both.lookup([1, 2, 38, 39], [MISS, MISS, HIT, HIT])
