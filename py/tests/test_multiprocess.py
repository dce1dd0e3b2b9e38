"""A scheduler process and two rank processes on one shared region, and processes that die.

The test process is the scheduler: it owns the manager (and so the region) and hands each
rank the transfers vLLM's connector would. Each rank process (``rank_process.py``) attaches to
the region and copies its own KV tensors to and from its own part of each slot. The tests run
on a file region and on an anonymous one; the last ones kill a scheduler of its own process
(``scheduler_process.py``) with its ranks, and check that nothing is left.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvtier
import kvtier.vllm as kv
from vllm.v1.kv_offload import base

PAGE = 4096
RANK = str(Path(__file__).with_name("rank_process.py"))
SCHEDULER = str(Path(__file__).with_name("scheduler_process.py"))
_names = itertools.count()


def anonymous_name():
    """An anonymous region's name that no other test (of any process) uses."""
    return f"@kvtier-test-{os.getpid()}-{next(_names)}"


def shmem():
    """``Shmem`` of ``/proc/meminfo`` in bytes: shared memory, anonymous regions included."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def kvtier_files_in_dev_shm(name):
    """Entries of ``/dev/shm`` whose name holds ``name``."""
    return [n for n in os.listdir("/dev/shm") if name in n]


class Rank:
    def __init__(self, region, rows, workers, rank, replicated=False):
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, RANK, region, str(rows), str(workers), str(rank)]
            + (["replicated"] if replicated else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask_line() == {"ready": rank}

    def ask_line(self):
        line = self.proc.stdout.readline()
        assert line, f"rank {self.rank} exited with {self.proc.wait()}"
        return json.loads(line)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(params=["file", "anonymous"])
def region_path(request, region_dir):
    """A region's path: a file in ``region_dir``, or a name of an anonymous region."""
    return str(region_dir / "region") if request.param == "file" else anonymous_name()


@pytest.fixture
def cluster(region_path):
    settings = kv.Settings(
        num_blocks=8, region_path=region_path, workers=2, block_bytes_per_worker=PAGE,
    )
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    ranks = [Rank(settings.region_path, 8, 2, r) for r in range(2)]
    yield manager, ranks, settings
    for r in ranks:
        r.close()
    manager.shutdown()


def transfer(ranks, op, job, gpu, slots, seal=None):
    """One job on every rank, as vLLM's connector runs it; succeeds if every rank's did."""
    return all(r.ask(op=op, job=job, gpu=gpu, slots=slots, seal=seal)["ok"] for r in ranks)


def slots_of(spec):
    return [int(s) for s in spec.block_ids]


def test_two_ranks_store_and_load_their_own_bytes(cluster):
    manager, ranks, _ = cluster
    ctx = base.ReqContext(req_id="a")
    manager.on_new_request(ctx)
    keys = [b"k%d" % i for i in range(4)]
    out = manager.prepare_store(keys, ctx)
    seal = out.store_spec.generation
    assert transfer(ranks, "store", 1, [0, 1, 2, 3], slots_of(out.store_spec), seal)
    manager.complete_store(keys, ctx)
    assert manager.stats()["unsealed"] == 0
    original = [r.ask(op="digest", blocks=[0, 1, 2, 3]) for r in ranks]
    assert original[0] != original[1], "the ranks hold different bytes"
    for r in ranks:
        r.ask(op="zero", blocks=[8, 9, 10, 11])
    assert all(manager.lookup(k, ctx) is kv.LookupResult.HIT for k in keys)
    src = manager.prepare_load(keys, ctx)
    assert transfer(ranks, "load", 2, [8, 9, 10, 11], [int(s) for s in src.block_ids])
    manager.complete_load(keys, ctx)
    for r, want in zip(ranks, original):
        assert r.ask(op="digest", blocks=[8, 9, 10, 11]) == want
    assert manager.stats()["load_pins"] == 0


def test_a_rank_that_dies_mid_store_leaves_nothing_served_and_no_pin(cluster):
    manager, ranks, settings = cluster
    ctx = base.ReqContext(req_id="b")
    manager.on_new_request(ctx)
    keys = [b"d%d" % i for i in range(6)]
    out = manager.prepare_store(keys, ctx)
    slots, seal = slots_of(out.store_spec), out.store_spec.generation
    assert ranks[0].ask(op="store", job=1, gpu=list(range(6)), slots=slots, seal=seal)["ok"]
    ranks[1].ask(op="slow", us=200_000)
    assert ranks[1].ask(
        op="store", job=1, gpu=list(range(6)), slots=slots, seal=seal, wait=False
    )["ok"]
    time.sleep(0.3)  # the rank is copying its second page
    ranks[1].kill()
    # Even a connector that completes the store as a success (vLLM 0.33 has no failure
    # path) gets nothing served: the dead rank sealed none of the slots.
    manager.complete_store(keys, ctx)
    assert manager.stats()["unsealed"] == len(keys)
    for k in keys:
        assert manager.lookup(k, ctx) is kv.LookupResult.MISS
    manager.on_request_finished(ctx)
    stats = manager.stats()
    assert stats["load_pins"] == 0 and stats["job_pins"] == 0
    # Every slot is free: a replacement rank and the survivor store a full primary.
    ranks[1] = Rank(settings.region_path, 8, 2, 1)
    ctx = base.ReqContext(req_id="c")
    manager.on_new_request(ctx)
    full = [b"f%d" % i for i in range(8)]
    out = manager.prepare_store(full, ctx)
    assert out is not None and len(out.keys_to_store) == 8
    ok = transfer(
        ranks, "store", 2, list(range(8)), slots_of(out.store_spec), out.store_spec.generation
    )
    manager.complete_store(full, ctx)
    assert ok and manager.stats()["unsealed"] == 6
    assert all(manager.lookup(k, ctx) is kv.LookupResult.HIT for k in full)


def test_a_rank_that_dies_mid_load_releases_the_pins(cluster):
    manager, ranks, settings = cluster
    ctx = base.ReqContext(req_id="e")
    manager.on_new_request(ctx)
    keys = [b"l%d" % i for i in range(4)]
    out = manager.prepare_store(keys, ctx)
    seal = out.store_spec.generation
    assert transfer(ranks, "store", 1, [0, 1, 2, 3], slots_of(out.store_spec), seal)
    manager.complete_store(keys, ctx)
    assert manager.stats()["unsealed"] == 0
    want = ranks[1].ask(op="digest", blocks=[0, 1, 2, 3])
    src = [int(s) for s in manager.prepare_load(keys, ctx).block_ids]
    assert manager.stats()["load_pins"] == 4
    ranks[1].ask(op="slow", us=200_000)
    ranks[1].ask(op="load", job=2, gpu=[8, 9, 10, 11], slots=src, wait=False)
    time.sleep(0.3)
    ranks[1].kill()
    manager.complete_load(keys, ctx)  # the connector ends the job, failed
    assert manager.stats()["load_pins"] == 0
    # The stored blocks were only read: a new rank loads them intact.
    ranks[1] = Rank(settings.region_path, 8, 2, 1)
    ranks[1].ask(op="zero", blocks=[8, 9, 10, 11])
    assert all(manager.lookup(k, ctx) is kv.LookupResult.HIT for k in keys)
    src = [int(s) for s in manager.prepare_load(keys, ctx).block_ids]
    assert ranks[1].ask(op="load", job=3, gpu=[8, 9, 10, 11], slots=src)["ok"]
    manager.complete_load(keys, ctx)
    assert ranks[1].ask(op="digest", blocks=[8, 9, 10, 11]) == want


@pytest.fixture
def replicated(region_path):
    """Two ranks whose KV bytes are the same, on a region of one copy per slot."""
    settings = kv.Settings(
        num_blocks=8, region_path=region_path, workers=2, block_bytes_per_worker=PAGE,
        replicated=True,
    )
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    ranks = [Rank(settings.region_path, 8, 2, r, replicated=True) for r in range(2)]
    yield manager, ranks, settings
    for r in ranks:
        r.close()
    manager.shutdown()


def test_a_replicated_layout_keeps_one_copy_written_once_and_read_by_every_rank(replicated):
    manager, ranks, settings = replicated
    assert settings.row_bytes == PAGE, "one part per slot, not one per rank"
    ctx = base.ReqContext(req_id="r")
    manager.on_new_request(ctx)
    keys = [b"r%d" % i for i in range(4)]
    out = manager.prepare_store(keys, ctx)
    seal = out.store_spec.generation
    assert transfer(ranks, "store", 1, [0, 1, 2, 3], slots_of(out.store_spec), seal)
    manager.complete_store(keys, ctx)
    assert manager.stats()["unsealed"] == 0, "each slot sealed by its one writer"
    want = ranks[0].ask(op="digest", blocks=[0, 1, 2, 3])
    assert ranks[1].ask(op="digest", blocks=[0, 1, 2, 3]) == want, "the ranks hold the same bytes"
    for r in ranks:
        r.ask(op="zero", blocks=[8, 9, 10, 11])
    assert all(manager.lookup(k, ctx) is kv.LookupResult.HIT for k in keys)
    src = [int(s) for s in manager.prepare_load(keys, ctx).block_ids]
    assert transfer(ranks, "load", 2, [8, 9, 10, 11], src)
    manager.complete_load(keys, ctx)
    for r in ranks:
        assert r.ask(op="digest", blocks=[8, 9, 10, 11]) == want


def test_a_replicated_writer_that_dies_mid_store_leaves_its_blocks_unserved(replicated):
    manager, ranks, settings = replicated
    ctx = base.ReqContext(req_id="w")
    manager.on_new_request(ctx)
    keys = [b"w%d" % i for i in range(6)]
    out = manager.prepare_store(keys, ctx)
    slots, seal = slots_of(out.store_spec), out.store_spec.generation
    assert ranks[0].ask(op="store", job=1, gpu=list(range(6)), slots=slots, seal=seal)["ok"]
    ranks[1].ask(op="slow", us=200_000)
    ranks[1].ask(op="store", job=1, gpu=list(range(6)), slots=slots, seal=seal, wait=False)
    time.sleep(0.3)  # rank 1 is copying the second of its slots
    ranks[1].kill()
    manager.complete_store(keys, ctx)  # vLLM 0.33 completes it as a success anyway
    mine = {k for k, s in zip(keys, slots) if s % 2 == 1}
    assert len(mine) == 3 and manager.stats()["unsealed"] == 3
    for k in keys:
        want = kv.LookupResult.MISS if k in mine else kv.LookupResult.HIT
        assert manager.lookup(k, ctx) is want, k
    manager.on_request_finished(ctx)
    assert manager.stats()["job_pins"] == 0


def test_the_region_is_removed_when_the_scheduler_shuts_down(region_dir):
    settings = kv.Settings(num_blocks=2, region_path=str(region_dir / "region"))
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    assert os.path.exists(settings.region_path)
    manager.shutdown()
    assert not os.path.exists(settings.region_path)
    manager.shutdown()  # a second shutdown is a no-op
    with pytest.raises(kvtier.KvtierError, match="shut down"):
        manager.lookup(b"k", base.ReqContext(req_id="x"))


def test_a_manager_made_from_vllms_config_leaves_nothing_in_dev_shm(vllm):
    from test_spec import offloading_config

    engine = f"anon-{os.getpid()}"
    extra = {"cpu_bytes_to_use": 64 * PAGE}  # no region_dir: the default
    config = offloading_config(vllm, extra, worker_bytes=PAGE, engine_id=engine)
    spec = kv.KvtierOffloadingSpec(config)
    assert spec.settings.region_path == f"@kvtier-{engine}"
    manager = spec.get_manager()
    try:
        assert manager.region_path == f"@kvtier-{engine}"
        assert kvtier_files_in_dev_shm(engine) == []
        # A rank finds it by the same name.
        rank = Rank(manager.region_path, 64, 1, 0)
        ctx = base.ReqContext(req_id="a")
        manager.on_new_request(ctx)
        out = manager.prepare_store([b"k"], ctx)
        assert transfer([rank], "store", 1, [0], slots_of(out.store_spec), out.store_spec.generation)
        manager.complete_store([b"k"], ctx)
        assert manager.stats()["unsealed"] == 0
        rank.close()
    finally:
        manager.shutdown()
    assert kvtier_files_in_dev_shm(engine) == []


class Scheduler:
    """``scheduler_process.py``: a manager, and so the region, in a process of its own."""

    def __init__(self, region, rows, workers):
        self.proc = subprocess.Popen(
            [sys.executable, SCHEDULER, region, str(rows), str(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line, f"the scheduler exited with {self.proc.wait()}"
        assert json.loads(line) == {"ready": self.proc.pid}

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def test_sigkill_of_the_scheduler_and_its_ranks_leaves_nothing_behind():
    region = anonymous_name()
    size = 256 << 20
    rows = size // (2 * PAGE)
    scheduler = Scheduler(region, rows, 2)
    ranks = [Rank(region, rows, 2, r) for r in range(2)]
    try:
        # Each rank attaches at its first transfer: a store into slots at both ends.
        slots = [0, 1, rows - 2, rows - 1]
        assert transfer(ranks, "store", 1, [0, 1, 2, 3], slots, seal=1)
        during = shmem()
    finally:
        scheduler.kill()
        for r in ranks:
            r.kill()
    deadline = time.monotonic() + 5
    while during - shmem() < size * 3 // 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    freed = during - shmem()
    assert freed >= size * 3 // 4, f"Shmem fell by {freed} bytes, not by the region's {size}"
    assert kvtier_files_in_dev_shm(region[1:]) == []
