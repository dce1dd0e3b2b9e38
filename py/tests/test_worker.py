"""The worker handler's copies, byte for byte, on host buffers standing in for GPU tensors."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
import kvtier.vllm as kv

from vllm.v1.kv_offload import base  # noqa: E402  (conftest made vLLM importable)


def kv_caches(groups, gpu_blocks, rng):
    """KV tensors filled with random bytes: ``groups`` lists per group ``(stride, page)`` of
    each of its tensors."""
    tensors, refs = [], []
    for group in groups:
        refs.append([])
        for stride, page in group:
            array = rng.integers(0, 256, size=(gpu_blocks, stride), dtype=np.uint8)
            refs[-1].append(base.CanonicalKVCacheRef(tensor_idx=len(tensors), page_size_bytes=page))
            tensors.append(base.CanonicalKVCacheTensor(tensor=array, page_size_bytes=stride))
    return base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def copied(caches, group, block):
    """The bytes of ``block`` that a transfer of ``group`` moves, tensor by tensor."""
    return [
        caches.tensors[r.tensor_idx].tensor[block, : r.page_size_bytes].copy()
        for r in caches.group_data_refs[group]
    ]


class Rig:
    """A manager and one rank's handler on host buffers."""

    def __init__(self, region_dir, groups, *, bpc=1, gpu_blocks=16, slots=8, seed=0, copy_threads=2):
        self.rng = np.random.default_rng(seed)
        self.caches = kv_caches(groups, gpu_blocks, self.rng)
        per_worker = max(sum(p for _, p in g) for g in groups) * bpc
        self.settings = kv.Settings(
            num_blocks=slots,
            region_path=str(region_dir / "region"),
            block_bytes_per_worker=per_worker,
            blocks_per_chunk=bpc,
            copy_threads=copy_threads,
        )
        self.manager = kv.KvtierOffloadingManager(self.settings, prefault_threads=1)
        self.worker = kv.KvtierOffloadingWorker(self.caches, self.settings)
        self.ctx = base.ReqContext(req_id="r")
        self.manager.on_new_request(self.ctx)
        self.jobs = 0

    def run(self, submit, *args):
        self.jobs += 1
        assert submit(self.jobs, *args)
        self.worker.wait({self.jobs})
        (result,) = self.worker.get_finished()
        assert result.job_id == self.jobs
        return result

    def store(self, keys, gpu_ids, group_sizes=None, block_indices=None):
        out = self.manager.prepare_store(keys, self.ctx)
        assert out.keys_to_store == keys
        spec = base.GPULoadStoreSpec(
            gpu_ids, group_sizes or [len(gpu_ids)], block_indices or [0]
        )
        result = self.run(self.worker.submit_store, spec, out.store_spec)
        # As vLLM 0.33 does: a finished store is completed as a success.
        self.manager.complete_store(keys, self.ctx)
        return result

    def load(self, keys, gpu_ids, group_sizes=None, block_indices=None):
        for k in keys:
            assert self.manager.lookup(k, self.ctx) is kv.LookupResult.HIT
        src = self.manager.prepare_load(keys, self.ctx)
        dst = base.GPULoadStoreSpec(gpu_ids, group_sizes or [len(gpu_ids)], block_indices or [0])
        result = self.run(self.worker.submit_load, src, dst)
        self.manager.complete_load(keys, self.ctx)
        return result

    def close(self):
        self.worker.shutdown()
        self.manager.shutdown()


@pytest.fixture
def rig(region_dir, request):
    groups, bpc = request.param
    r = Rig(region_dir, groups, bpc=bpc)
    yield r
    r.close()


@pytest.mark.parametrize(
    "rig",
    [([[(1024, 1000), (3072, 3000)]], 1), ([[(512, 512)], [(256, 200), (128, 128)]], 1)],
    indirect=True,
    ids=["two-tensors-padded", "two-groups"],
)
def test_store_then_load_moves_every_byte(rig):
    groups = len(rig.caches.group_data_refs)
    keys = [bytes([i]) * 8 + g.to_bytes(4, "big") for g in range(groups) for i in range(3)]
    src_ids = [5, 2, 7] * groups
    sizes = [3] * groups
    want = [copied(rig.caches, g, b) for g in range(groups) for b in [5, 2, 7]]
    result = rig.store(keys, src_ids, sizes, [0] * groups)
    assert result.success and result.transfer_size == sum(a.nbytes for w in want for a in w)
    before = [t.tensor.copy() for t in rig.caches.tensors]
    dst_ids = [0, 3, 4] * groups
    assert rig.load(keys, dst_ids, sizes, [0] * groups).success
    for i, (g, b) in enumerate((g, b) for g in range(groups) for b in [0, 3, 4]):
        for got, expect in zip(copied(rig.caches, g, b), want[i]):
            assert np.array_equal(got, expect)
    # Nothing else changed: other blocks, and the padding after each page.
    for t, old in zip(rig.caches.tensors, before):
        for b in set(range(t.tensor.shape[0])) - set(dst_ids):
            assert np.array_equal(t.tensor[b], old[b])
    for g, group in enumerate(rig.caches.group_data_refs):
        for r in group:
            t = rig.caches.tensors[r.tensor_idx]
            for b in (0, 3, 4):
                assert np.array_equal(
                    t.tensor[b, r.page_size_bytes :], before[r.tensor_idx][b, r.page_size_bytes :]
                )


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_job_split_across_copy_threads_moves_every_byte(region_dir, threads):
    # Pages of 1 MiB and some bytes, not multiples of a cache line: a job of 10 blocks is
    # about 25 MiB, split across up to `threads` threads (one per 4 MiB), each page copied
    # around the caches with an unaligned head and tail.
    groups = [[((1 << 20) + 4096, (1 << 20) + 24), ((2 << 20) + 4096, (3 << 19) - 40)]]
    r = Rig(region_dir, groups, gpu_blocks=24, slots=12, copy_threads=threads)
    try:
        keys = [bytes([i]) * 8 + bytes(4) for i in range(10)]
        src_ids = [23, 0, 5, 9, 11, 2, 17, 3, 8, 20]
        want = [copied(r.caches, 0, b) for b in src_ids]
        result = r.store(keys, src_ids)
        assert result.success and result.transfer_size == sum(a.nbytes for w in want for a in w)
        before = [t.tensor.copy() for t in r.caches.tensors]
        dst_ids = [1, 4, 6, 7, 10, 12, 13, 14, 15, 16]
        assert r.load(keys, dst_ids).success
        for b, w in zip(dst_ids, want):
            for got, expect in zip(copied(r.caches, 0, b), w):
                assert np.array_equal(got, expect)
        for t, old in zip(r.caches.tensors, before):
            for b in set(range(t.tensor.shape[0])) - set(dst_ids):
                assert np.array_equal(t.tensor[b], old[b])
    finally:
        r.close()


@pytest.mark.parametrize("rig", [([[(256, 256), (128, 100)]], 2)], indirect=True, ids=["chunks-of-2"])
def test_chunks_of_several_blocks_and_an_unaligned_load(rig):
    # Logical blocks 2..7 are chunks 1, 2, 3, stored from GPU blocks 9, 1, 4, 8, 0, 11.
    keys = [b"chunk-1", b"chunk-2", b"chunk-3"]
    gpu = [9, 1, 4, 8, 0, 11]
    want = {2 + i: copied(rig.caches, 0, b) for i, b in enumerate(gpu)}
    assert rig.store(keys, gpu, [6], [2]).success
    # Load logical blocks 3..7 (the first chunk only from its second block) elsewhere.
    dst = [13, 14, 15, 12, 10]
    assert rig.load(keys, dst, [5], [3]).success
    for i, b in enumerate(dst):
        for got, expect in zip(copied(rig.caches, 0, b), want[3 + i]):
            assert np.array_equal(got, expect)


@pytest.mark.parametrize("rig", [([[(256, 256)]], 1)], indirect=True, ids=["one-tensor"])
def test_a_failed_copy_is_never_served(rig, caplog):
    # GPU block 99 does not exist: the job fails, the store is reported failed, the key
    # is not served.
    # vLLM 0.33 cannot take a failed transfer: the job is reported finished, and the store
    # completed as a success, but the rank never sealed the slots, so the manager refuses it.
    with caplog.at_level("WARNING", logger="kvtier"):
        result = rig.store([b"a", b"b"], [1, 99])
    assert "outside" in rig.worker.error(result.job_id)
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "kvtier")
    assert "not cached" in logged and "unsealed" in logged, logged
    for k in (b"a", b"b"):
        assert rig.manager.lookup(k, rig.ctx) is kv.LookupResult.MISS
    # Every slot is free again: a full store succeeds.
    keys = [bytes([i]) for i in range(rig.settings.num_blocks)]
    assert rig.store(keys, list(range(len(keys)))).success
    stats = rig.manager.stats()
    assert stats["load_pins"] == 0 and stats["job_pins"] == 0


@pytest.mark.parametrize("rig", [([[(256, 256)]], 1)], indirect=True, ids=["one-tensor"])
def test_a_store_completed_without_its_copy_is_not_served(rig):
    # The worker never ran: no rank sealed the slots.
    out = rig.manager.prepare_store([b"ghost"], rig.ctx)
    rig.manager.complete_store(out.keys_to_store, rig.ctx)
    assert rig.manager.stats()["unsealed"] == 1
    assert rig.manager.lookup(b"ghost", rig.ctx) is kv.LookupResult.MISS
    # A seal of an earlier store of the same slot does not count for a later one.
    assert rig.store([b"first"], [0]).success
    assert rig.manager.lookup(b"first", rig.ctx) is kv.LookupResult.HIT
    out = rig.manager.prepare_store([bytes([i]) for i in range(rig.settings.num_blocks)], rig.ctx)
    assert b"first" in out.evicted_keys
    rig.manager.complete_store(out.keys_to_store, rig.ctx)
    assert rig.manager.stats()["unsealed"] == 1 + len(out.keys_to_store)


@pytest.mark.parametrize("rig", [([[(256, 256)]], 1)], indirect=True, ids=["one-tensor"])
def test_a_failed_load_raises(rig):
    assert rig.store([b"l"], [2]).success
    rig.manager.lookup(b"l", rig.ctx)
    src = rig.manager.prepare_load([b"l"], rig.ctx)
    assert rig.worker.submit_load(5, src, base.GPULoadStoreSpec([99], [1], [0]))
    rig.worker.wait({5})
    with pytest.raises(kvtier.TransferError, match="load job 5 failed.*outside"):
        rig.worker.get_finished()
    rig.manager.complete_load([b"l"], rig.ctx)
    assert rig.manager.stats()["load_pins"] == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros((4, 512), np.uint8)[:, 256:],
        lambda: np.zeros((4, 256), np.uint8)[::-1],
        lambda: np.zeros((4, 256), np.uint8)[:3].repeat(1, axis=0).T,
    ],
    ids=["row-view", "reversed", "transposed"],
)
def test_a_tensor_whose_blocks_are_not_whole_pages_is_refused(region_dir, make):
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(tensor=make(), page_size_bytes=256)],
        group_data_refs=[[base.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=256)]],
    )
    settings = kv.Settings(num_blocks=2, region_path=str(region_dir / "r"), block_bytes_per_worker=256)
    with pytest.raises(kvtier.ConfigError, match="kv_caches"):
        kv.KvtierOffloadingWorker(caches, settings)


@pytest.mark.parametrize("rig", [([[(256, 256)]], 1)], indirect=True, ids=["one-tensor"])
def test_a_plan_that_does_not_fit_is_refused(rig):
    out = rig.manager.prepare_store([b"x"], rig.ctx)
    spec = base.GPULoadStoreSpec([1, 2], [2], [0])  # two blocks for one slot
    with pytest.raises(kvtier.TransferError, match="chunk slots"):
        rig.worker.submit_store(1, spec, out.store_spec)
    rig.manager.complete_store([b"x"], rig.ctx, success=False)
    assert rig.manager.lookup(b"x", rig.ctx) is kv.LookupResult.MISS


def test_a_region_that_never_appears_fails_the_job(region_dir):
    caches = kv_caches([[(256, 256)]], 4, np.random.default_rng(1))
    settings = kv.Settings(
        num_blocks=4, region_path=str(region_dir / "absent"), block_bytes_per_worker=256,
        attach_timeout_s=0.05,
    )
    worker = kv.KvtierOffloadingWorker(caches, settings)
    assert worker.submit_store(7, base.GPULoadStoreSpec([0], [1], [0]), kv.KvtierLoadStoreSpec([0]))
    worker.wait({7})
    (result,) = worker.get_finished()
    assert result.job_id == 7  # reported finished; the manager would find no seal
    assert "absent" in worker.error(7)
    worker.shutdown()


def test_a_tensor_larger_than_the_region_holds_is_refused(region_dir):
    caches = kv_caches([[(8192, 8192)]], 2, np.random.default_rng(2))
    settings = kv.Settings(num_blocks=2, region_path=str(region_dir / "r"), block_bytes_per_worker=4096)
    with pytest.raises(kvtier.ConfigError, match="kv_caches"):
        kv.KvtierOffloadingWorker(caches, settings)


def _copy_thread_cpus() -> set[int]:
    """The CPUs the copy thread of the one handler alive in this process may run on."""
    import glob
    import os

    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            # Other threads (an earlier test's) may end between the listing and the read.
            with open(comm) as f:
                if f.read().strip().startswith("kvtier-rank-"):
                    return os.sched_getaffinity(int(comm.split("/")[4]))
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError("no kvtier-rank thread")


@pytest.mark.parametrize("copy_cpus", ["any", "inherit", "first"])
def test_the_copy_thread_leaves_the_binding_of_the_thread_that_builds_it(region_dir, copy_cpus):
    """vLLM's CPU worker pins the thread that builds the handler to one core of the model's
    OpenMP team: by default the copy thread may run on every CPU the process may use."""
    import os
    import threading

    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    caches = kv_caches([[(256, 256)]], 4, np.random.default_rng(3))
    settings = kv.Settings(
        num_blocks=4, region_path=str(region_dir / "r"), block_bytes_per_worker=256,
        copy_cpus=str(first) if copy_cpus == "first" else copy_cpus,
    )
    built: dict = {}

    def build_pinned() -> None:  # as vLLM's worker thread: bound to one core
        os.sched_setaffinity(0, {first})
        built["worker"] = kv.KvtierOffloadingWorker(caches, settings)

    t = threading.Thread(target=build_pinned)
    t.start()
    t.join()
    try:
        want = allowed if copy_cpus == "any" else {first}
        assert _copy_thread_cpus() == want
    finally:
        built["worker"].shutdown()


@pytest.mark.parametrize("bad", ["all", "3-1", "99999"])
def test_a_bad_copy_cpus_is_refused(region_dir, bad):
    caches = kv_caches([[(256, 256)]], 4, np.random.default_rng(4))
    settings = kv.Settings(
        num_blocks=4, region_path=str(region_dir / "r"), block_bytes_per_worker=256, copy_cpus=bad,
    )
    with pytest.raises(kvtier.ConfigError, match="copy_cpus: .* is not a CPU set"):
        kv.KvtierOffloadingWorker(caches, settings)


def test_copy_cpus_with_no_usable_cpu_is_refused(region_dir):
    caches = kv_caches([[(256, 256)]], 4, np.random.default_rng(5))
    settings = kv.Settings(
        num_blocks=4, region_path=str(region_dir / "r"), block_bytes_per_worker=256,
        copy_cpus="1023",
    )
    with pytest.raises(kvtier.ConfigError, match=r"copy_cpus: cannot run a thread on CPUs \[1023\]"):
        kv.KvtierOffloadingWorker(caches, settings)


def test_a_job_submitted_after_shutdown_is_refused_and_never_reported(region_dir):
    # A replicated layout's two ranks: one block's slot is one rank's to copy, and the other
    # has nothing to copy (its submission used to end at once, shut down or not).
    caches = kv_caches([[(256, 256)]], 4, np.random.default_rng(3))
    settings = kv.Settings(
        num_blocks=4, region_path=str(region_dir / "region"), block_bytes_per_worker=256,
        workers=2, replicated=True,
    )
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    ranks = [kv.KvtierOffloadingWorker(caches, settings, rank=r) for r in (0, 1)]
    ctx = base.ReqContext(req_id="late")
    manager.on_new_request(ctx)
    out = manager.prepare_store([b"late"], ctx)
    for job, worker in enumerate(ranks, start=1):
        worker.shutdown()
        assert not worker.submit_store(job, base.GPULoadStoreSpec([0], [1], [0]), out.store_spec)
        assert worker.get_finished() == []
        assert job not in worker._stores  # a refused store is not awaited
    manager.shutdown()
