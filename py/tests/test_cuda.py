"""The worker handler on CUDA tensors.

Without a GPU (the usual CI machine) a handler for GPU memory is refused with a clear error.
With one, set ``KVTIER_GPU_TESTS=1`` (and have torch with CUDA) to run the copies on it,
byte for byte.
"""

from __future__ import annotations

import os

import pytest

import kvtier
import kvtier.vllm as kv
from kvtier import _native
from vllm.v1.kv_offload import base

GPU = os.environ.get("KVTIER_GPU_TESTS") == "1"


@pytest.mark.skipif(_native.cuda_driver_present(), reason="this machine has a CUDA driver")
def test_without_a_cuda_driver_a_gpu_kv_cache_is_refused_clearly(region_dir):
    with pytest.raises(kvtier.TransferError, match="no CUDA driver library"):
        _native.Worker(
            region_path=str(region_dir / "r"), rows=2, workers=1, block_bytes_per_worker=4096,
            rank=0, groups=[[(0x7000_0000, 4, 4096, 4096)]], device=0,
        )


@pytest.mark.skipif(not GPU, reason="GPU tests run with KVTIER_GPU_TESTS=1")
def test_cuda_tensors_round_trip_through_the_region(region_dir):
    import torch

    page, blocks = 8192, 16
    tensors = [torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device="cuda") for _ in range(2)]
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
        group_data_refs=[[base.CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(2)]],
    )
    settings = kv.Settings(
        num_blocks=8, region_path=str(region_dir / "region"), block_bytes_per_worker=2 * page
    )
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    worker = kv.KvtierOffloadingWorker(caches, settings)
    try:
        ctx = base.ReqContext(req_id="g")
        manager.on_new_request(ctx)
        keys = [b"g0", b"g1", b"g2"]
        want = [[t[b].clone() for t in tensors] for b in (3, 7, 1)]
        out = manager.prepare_store(keys, ctx)
        assert worker.submit_store(1, base.GPULoadStoreSpec([3, 7, 1], [3], [0]), out.store_spec)
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        manager.complete_store(keys, ctx)
        for t in tensors:
            t[[10, 11, 12]] = 0
        src = manager.prepare_load(keys, ctx)
        assert worker.submit_load(2, src, base.GPULoadStoreSpec([10, 11, 12], [3], [0]))
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True]
        manager.complete_load(keys, ctx)
        for (b, w) in zip((10, 11, 12), want):
            for t, expect in zip(tensors, w):
                assert torch.equal(t[b], expect)
    finally:
        worker.shutdown()
        manager.shutdown()


def _one_tensor_cache(torch, blocks: int, page: int, region_dir):
    """A KV cache of one CUDA tensor of ``blocks`` pages, with kvtier's manager and worker
    over a primary of ``blocks`` slots."""
    t = torch.zeros((blocks, page), dtype=torch.uint8, device="cuda")
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=page)],
        group_data_refs=[[base.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
    )
    settings = kv.Settings(
        num_blocks=blocks, region_path=str(region_dir / "region"), block_bytes_per_worker=page
    )
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    worker = kv.KvtierOffloadingWorker(caches, settings)
    return t, manager, worker


def _store(manager, worker, job: int, keys, ctx, blocks: list[int]) -> None:
    """Stores GPU ``blocks`` under ``keys`` and waits for the store to end."""
    out = manager.prepare_store(keys, ctx)
    spec = base.GPULoadStoreSpec(blocks, [len(blocks)], [0])
    assert worker.submit_store(job, spec, out.store_spec)
    worker.wait({job})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_store(keys, ctx)


def _load(manager, worker, job: int, keys, ctx, blocks: list[int]) -> None:
    """Loads ``keys`` into GPU ``blocks`` and waits for the load to end."""
    src = manager.prepare_load(keys, ctx)
    assert worker.submit_load(job, src, base.GPULoadStoreSpec(blocks, [len(blocks)], [0]))
    worker.wait({job})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_load(keys, ctx)


# Device blocks that are not neighbours: a fresh primary hands out neighbouring slots, so
# these are not merged into one copy, and a driver with cuMemcpyBatchAsync gets one batch.
STORED = [0, 2, 4]
LOADED = [9, 11, 13]


def _warm_up(manager, worker, ctx) -> None:
    """One store and load first, so the engine (made at the first transfer, with calls that
    may synchronize the device) exists before a test queues its spin."""
    _store(manager, worker, 100, [b"warm"], ctx, [15])
    _load(manager, worker, 101, [b"warm"], ctx, [15])


# About a tenth of a second of GPU time on the current stream (torch.cuda._sleep spins for a
# number of clock cycles), long enough that a copy not ordered after it would run first.
SPIN_CYCLES = 200_000_000


@pytest.mark.skipif(not GPU, reason="GPU tests run with KVTIER_GPU_TESTS=1")
def test_a_store_copies_what_the_kernels_queued_before_it_wrote(region_dir):
    """A store is ordered after the work queued on the current stream when it is submitted:
    it copies the blocks as those kernels leave them, not as they were."""
    import torch

    t, manager, worker = _one_tensor_cache(torch, 16, 1 << 20, region_dir)
    try:
        ctx = base.ReqContext(req_id="s")
        manager.on_new_request(ctx)
        _warm_up(manager, worker, ctx)
        keys = [b"s0", b"s1", b"s2"]
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        t[STORED] = 7  # queued behind the spin: not yet run when the store is submitted
        _store(manager, worker, 1, keys, ctx, STORED)
        torch.cuda.synchronize()
        t.zero_()
        _load(manager, worker, 2, keys, ctx, LOADED)
        torch.cuda.synchronize()
        assert bool((t[LOADED] == 7).all()), "the store ran before the kernel that wrote its blocks"
    finally:
        worker.shutdown()
        manager.shutdown()


@pytest.mark.skipif(not GPU, reason="GPU tests run with KVTIER_GPU_TESTS=1")
def test_a_load_waits_for_the_kernels_that_read_the_blocks_it_overwrites(region_dir):
    """A load is ordered after the work queued on the current stream when it is submitted: a
    kernel queued before it still reads the blocks' old contents."""
    import torch

    t, manager, worker = _one_tensor_cache(torch, 16, 1 << 20, region_dir)
    try:
        ctx = base.ReqContext(req_id="l")
        manager.on_new_request(ctx)
        _warm_up(manager, worker, ctx)
        keys = [b"l0", b"l1", b"l2"]
        t[STORED] = 9
        torch.cuda.synchronize()
        _store(manager, worker, 1, keys, ctx, STORED)

        t[LOADED] = 3
        torch.cuda._sleep(SPIN_CYCLES)
        before = t[LOADED]  # queued behind the spin: reads the blocks the load overwrites
        _load(manager, worker, 2, keys, ctx, LOADED)
        torch.cuda.synchronize()
        assert bool((before == 3).all()), "the load overwrote blocks a queued kernel still read"
        assert bool((t[LOADED] == 9).all())
    finally:
        worker.shutdown()
        manager.shutdown()


@pytest.mark.skipif(not GPU, reason="GPU tests run with KVTIER_GPU_TESTS=1")
def test_a_gpu_job_submitted_after_shutdown_is_refused(region_dir):
    """Shutdown drops the CUDA engine: a later job is refused (as on the CPU), not given a
    new engine that outlives the shutdown."""
    import torch

    _, manager, worker = _one_tensor_cache(torch, 4, 4096, region_dir)
    try:
        ctx = base.ReqContext(req_id="late")
        manager.on_new_request(ctx)
        _store(manager, worker, 1, [b"a"], ctx, [0])
        out = manager.prepare_store([b"b"], ctx)
        worker.shutdown()
        assert not worker.submit_store(2, base.GPULoadStoreSpec([1], [1], [0]), out.store_spec)
        assert worker.get_finished() == []
    finally:
        manager.shutdown()


@pytest.mark.skipif(not GPU, reason="GPU tests run with KVTIER_GPU_TESTS=1")
def test_a_gpu_job_in_flight_at_shutdown_ends_and_is_reported(region_dir):
    """Shutdown lets a job still copying end, and reports it: ``get_finished`` has it and
    ``wait`` for it returns (dropped in flight, it stayed running for ever)."""
    import threading

    import torch

    blocks, page = 64, 4 << 20  # 256 MiB: still copying when shutdown begins
    _, manager, worker = _one_tensor_cache(torch, blocks, page, region_dir)
    try:
        ctx = base.ReqContext(req_id="in-flight")
        manager.on_new_request(ctx)
        keys = [b"f%d" % i for i in range(blocks)]
        out = manager.prepare_store(keys, ctx)
        spec = base.GPULoadStoreSpec(list(range(blocks)), [blocks], [0])
        assert worker.submit_store(1, spec, out.store_spec)
        worker.shutdown()
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
        waiting = threading.Thread(target=worker.wait, args=({1},), daemon=True)
        waiting.start()
        waiting.join(10)
        assert not waiting.is_alive(), "wait for a job reported ended did not return"
    finally:
        manager.shutdown()


@pytest.mark.skipif(not GPU, reason="GPU tests run with KVTIER_GPU_TESTS=1")
def test_a_first_gpu_job_waits_for_the_region_without_holding_the_gil(region_dir):
    """The scheduler, which creates the region, may start after the workers: the first GPU
    job waits for it (up to ``attach_timeout_s``) with the GIL released, so the worker's other
    Python threads (vLLM's among them) run meanwhile; a region that never appears fails the
    job with the reason."""
    import threading
    import time

    import torch

    page = 4096
    t = torch.zeros((4, page), dtype=torch.uint8, device="cuda")
    worker = _native.Worker(
        region_path=str(region_dir / "absent"), rows=2, workers=1, block_bytes_per_worker=page,
        rank=0, groups=[[(t.data_ptr(), 4, page, page)]], device=0, attach_timeout_s=0.5,
    )
    ticks = 0
    stop = threading.Event()

    def spin():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        before = ticks
        assert worker.submit(7, False, [0], [1], [0], [0])
        during = ticks - before
    finally:
        stop.set()
        spinner.join()
    worker.wait([7])
    assert [f[:2] for f in worker.get_finished()] == [(7, False)]
    assert "absent" in worker.error(7)
    # Half a second of waiting: the spinning thread ran through it, not after it.
    assert during > 50, during
    worker.shutdown()
