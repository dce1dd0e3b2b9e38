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
