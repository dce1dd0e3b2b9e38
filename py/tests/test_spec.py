"""vLLM 0.33.0's own factory loads kvtier from the README's config, and bad configs are
``ValueError``s naming the key."""

from __future__ import annotations

import pickle

import pytest

import kvtier
import kvtier.vllm as kv
from vllm_oracle import offloading_config


@pytest.mark.parametrize(
    "groups, bpc, max_len",
    [
        ([(16, None)], 1, 4096),
        ([(16, None)], 2, 1000),
        ([(16, None), (16, 3), (32, None)], 1, 4097),
        ([(16, 100)], 4, 4096),
        ([(16, None)], 1, 0),
        ([], 1, 4096),
    ],
)
def test_kv_cache_size_tokens_is_vllms(vllm, groups, bpc, max_len):
    """``cpu_kv_cache_size_tokens`` is the figure vLLM's CPU tier reports for the same
    config: sliding windows, several groups, chunks of several blocks, unknown lengths."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload import config as c

    config = SimpleNamespace(
        groups=tuple(
            c.OffloadingGroupConfig(
                tokens_per_block=t, layer_names=(f"l{i}",), group_id=i,
                sliding_window_size_in_chunks=w,
            )
            for i, (t, w) in enumerate(groups)
        ),
        model=SimpleNamespace(max_model_len=max_len),
        cache=SimpleNamespace(blocks_per_chunk=bpc),
    )
    for chunks in (0, 1, 7, 1000):
        theirs = vllm.cpu_common.CPUOffloadingInfo.from_config(config, chunks, 1)
        assert kv._kv_cache_size_tokens(config, chunks) == theirs.cpu_kv_cache_size_tokens


def readme_extra(region_dir, tier_dir):
    """The README's kv_connector_extra_config, with test paths."""
    return {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.vllm",
        "cpu_bytes_to_use": 64 * 8192,
        "eviction_policy": "lru",
        "secondary_tiers": [
            {"type": "file", "path": str(tier_dir), "capacity_bytes": 256 * 8192}
        ],
        "region_dir": str(region_dir),
    }


def test_vllm_is_the_real_one(vllm):
    assert kv.HAVE_VLLM
    assert kv.LookupResult is vllm.LookupResult
    assert issubclass(kv.KvtierOffloadingManager, vllm.base.OffloadingManager)
    assert issubclass(kv.KvtierOffloadingWorker, vllm.base.OffloadingWorker)
    assert issubclass(kv.KvtierOffloadingSpec, vllm.base.OffloadingSpec)


def test_factory_builds_kvtier_from_the_readme_config(vllm, region_dir, tmp_path):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = offloading_config(vllm, readme_extra(region_dir, tmp_path / "tier"))
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec) is kv.KvtierOffloadingSpec
    manager = spec.get_manager()
    import numpy as np

    page = config.worker_kv_bytes_per_block
    kv_tensor = np.arange(4 * page, dtype=np.uint32).astype(np.uint8).reshape(4, page)
    caches = vllm.base.CanonicalKVCaches(
        tensors=[vllm.base.CanonicalKVCacheTensor(tensor=kv_tensor, page_size_bytes=page)],
        group_data_refs=[[vllm.base.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
    )
    worker = spec.get_worker(caches)
    try:
        assert isinstance(worker, vllm.base.OffloadingWorker)
        assert isinstance(manager, vllm.base.OffloadingManager)
        assert spec.get_manager() is manager
        assert spec.settings.num_blocks == 64
        info = manager.config_info()[0]
        assert info["cpu_num_chunks"] == 64
        assert tuple(info) == spec.config_info_keys(config.extra_config)
        # vLLM's CPU tier's labels, with its own figure of tokens.
        theirs = vllm.cpu_common.CPUOffloadingInfo.from_config(config, 64, 1).as_config_info()
        assert set(theirs) <= set(info)
        assert info["cpu_kv_cache_size_tokens"] == theirs["cpu_kv_cache_size_tokens"] == 1024
        assert manager.medium is vllm.Medium.CPU
        ctx = vllm.ReqContext(req_id="r")
        with manager.lock:
            assert manager.on_new_request(ctx).policy is vllm.base.OffloadPolicy.CHUNK_LEVEL
            key = vllm.make_offload_key(b"\x01" * 32, 0)
            assert manager.lookup(key, ctx) is vllm.LookupResult.MISS
            out = manager.prepare_store([key], ctx)
            assert isinstance(out, vllm.base.PrepareStoreOutput)
            assert isinstance(out.store_spec, vllm.cpu_common.CPULoadStoreSpec)
            assert out.store_spec.chunk_ids.tolist() == [0]
        # The spec reaches the workers pickled (vLLM's multiprocess executors): the copy
        # names the same slots and seal.
        sent = pickle.loads(pickle.dumps(out.store_spec))
        assert sent.block_ids.tolist() == out.store_spec.block_ids.tolist() == [0]
        assert sent.generation == out.store_spec.generation is not None
        gpu = vllm.base.GPULoadStoreSpec([2], [1], [0])
        assert worker.submit_store(1, gpu, sent)
        worker.wait({1})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
        with manager.lock:
            manager.complete_store(out.keys_to_store, ctx)
            assert manager.lookup(key, ctx) is vllm.LookupResult.HIT
            assert manager.get_load_source(key, ctx) == "host"
            manager.on_request_finished(ctx)
            manager.on_schedule_end(vllm.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
            events = list(manager.take_events())
            assert all(isinstance(e, vllm.base.OffloadingEvent) for e in events)
            assert [(e.medium, e.removed) for e in events][:1] == [(vllm.Medium.CPU, False)]
            stats = manager.get_stats()
            assert "vllm:kv_offload_cpu_cache_usage_perc" in str(stats.data)
        defs = kv.KvtierOffloadingSpec.build_metric_definitions(config.extra_config)
        assert "vllm:kv_offload_cpu_allocation_size" in defs
    finally:
        worker.shutdown()
        manager.shutdown()


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 100}, "cpu_bytes_to_use"),
        ({"eviction_policy": "lfu"}, "eviction_policy"),
        ({"secondary_tiers": {"type": "file"}}, "secondary_tiers"),
        ({"secondary_tiers": [{"type": "tape", "path": "/x", "capacity_bytes": 1}]}, "secondary_tiers[0].type"),
        ({"secondary_tiers": [{"type": "s3", "path": "/x", "capacity_bytes": 1}]}, "secondary_tiers[0].path"),
        ({"secondary_tiers": [{"type": "s3", "capacity_bytes": 1}]}, "secondary_tiers[0].bucket"),
        ({"secondary_tiers": [{"type": "s3", "bucket": "kv-b", "capacity_bytes": 1, "retries": True}]},
         "secondary_tiers[0].retries"),
        ({"secondary_tiers": [{"type": "file", "capacity_bytes": 1 << 30}]}, "secondary_tiers[0].path"),
        ({"secondary_tiers": [{"type": "file", "path": "P"}]}, "secondary_tiers[0].capacity_bytes"),
        ({"secondary_tiers": [{"type": "file", "path": "P", "capacity_bytes": 1}]}, "secondary_tiers[0].capacity_bytes"),
        ({"secondary_tiers": [{"type": "file", "path": "P", "capacity_bytes": 1 << 30, "fsync": "often"}]}, "secondary_tiers[0].fsync"),
        ({"secondary_tiers": [{"type": "file", "path": "P", "capacity_bytes": 1 << 30, "size": 3}]}, "secondary_tiers[0].size"),
        ({"secondary_tiers": [{"type": "file", "path": "P", "capacity_bytes": 1 << 30, "victim_lookahead": 0}]},
         "secondary_tiers[0].victim_lookahead"),
        ({"secondary_tiers": [{"type": "file", "path": "P", "capacity_bytes": 1 << 30, "victim_lookahead": "many"}]},
         "secondary_tiers[0].victim_lookahead"),
        ({"store_threshold": -1}, "store_threshold"),
        ({"shutdown_timeout_s": "soon"}, "shutdown_timeout_s"),
        ({"hit_pending_timeout_s": 0}, "hit_pending_timeout_s"),
        ({"hit_pending_timeout_s": -1}, "hit_pending_timeout_s"),
        ({"copy_cpus": 3}, "copy_cpus"),
        ({"copy_threads": 0}, "copy_threads"),
        ({"copy_threads": "all"}, "copy_threads"),
    ],
)
def test_a_bad_config_is_a_value_error_naming_the_key(vllm, region_dir, tmp_path, change, names):
    extra = readme_extra(region_dir, tmp_path / "tier")
    for key, value in change.items():
        if value is None:
            extra.pop(key)
        else:
            extra[key] = value
    for t in extra.get("secondary_tiers", []) if isinstance(extra.get("secondary_tiers"), list) else []:
        if t.get("path") == "P":
            t["path"] = str(tmp_path / "p")
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace("]", r"\]")) as e:
        spec = kv.KvtierOffloadingSpec(offloading_config(vllm, extra))
        spec.get_manager().shutdown()
    assert isinstance(e.value, kvtier.ConfigError)
    assert not list(region_dir.iterdir()), "a refused config leaves no region behind"


def test_no_kv_bytes_is_a_config_error(vllm, region_dir, tmp_path):
    with pytest.raises(kvtier.ConfigError, match="worker_kv_bytes_per_block"):
        kv.KvtierOffloadingSpec(
            offloading_config(vllm, readme_extra(region_dir, tmp_path), worker_bytes=0)
        )


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ({}, {"model": "test/other-model"}),
        ({"tp": 2, "pp": 1, "world": 2}, {"tp": 1, "pp": 2, "world": 2}),
    ],
    ids=["model", "parallelism"],
)
def test_a_tier_of_another_deployment_is_not_read(vllm, region_dir, tmp_path, first, then):
    """The file tier records the model, layout and parallelism; a tier written under others
    (here with blocks of the very same size) is refused."""
    extra = readme_extra(region_dir, tmp_path / "tier")
    kv.KvtierOffloadingSpec(offloading_config(vllm, extra, **first)).get_manager().shutdown()
    with pytest.raises(kvtier.TierError, match="holds blocks of"):
        kv.KvtierOffloadingSpec(offloading_config(vllm, extra, **then)).get_manager()
    # The same deployment opens it again.
    kv.KvtierOffloadingSpec(offloading_config(vllm, extra, **first)).get_manager().shutdown()


def test_works_without_vllm(tmp_path):
    """Without vLLM the package imports and works on its own types."""
    import subprocess
    import sys

    code = f"""
import sys
assert not any("vllm" in p for p in sys.path), sys.path
import kvtier.vllm as kv
from kvtier._standalone import ReqContext
assert not kv.HAVE_VLLM
m = kv.KvtierOffloadingManager(
    kv.Settings(num_blocks=2, region_path={str(tmp_path / "r")!r}, verify_stores=False)
)
ctx = ReqContext(req_id="a")
m.on_new_request(ctx)
keys = [b"k1", b"k2", b"k3"]
out = m.prepare_store(keys[:2], ctx)
assert out.keys_to_store == keys[:2] and list(out.store_spec.block_ids) == [0, 1]
m.complete_store(out.keys_to_store, ctx)
assert m.lookup(b"k1", ctx) is kv.LookupResult.HIT
assert m.lookup(b"k3", ctx) is kv.LookupResult.MISS
assert m.prepare_store([b"k3"], ctx).evicted_keys == [b"k1"]
m.shutdown()
print("standalone ok")
"""
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "standalone ok" in out.stdout


@pytest.fixture
def cpu_spec(vllm, monkeypatch):
    """vLLM 0.33's ``CPUOffloadingSpec``, whose constructor sizes vLLM's CPU tier. Its worker
    module needs vLLM's CUDA kernels, so a stand-in takes its place (the spec only names its
    class); the platform is made CUDA-like, the only one where vLLM keeps one copy for
    ``replicated_layout``."""
    import importlib
    import sys
    import types

    stub = types.ModuleType("vllm.v1.kv_offload.cpu.gpu_worker")
    stub.CPUOffloadingWorker = object
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    monkeypatch.delitem(sys.modules, "vllm.v1.kv_offload.cpu.spec", raising=False)
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: False, raising=False)
    return importlib.import_module("vllm.v1.kv_offload.cpu.spec").CPUOffloadingSpec


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize(
    "worker_bytes, world, bpc",
    [
        (8192, 1, 1), (8192, 2, 1), (8192, 8, 4),
        # Not a multiple of a page: vLLM pads the row, not each rank's part.
        (6000, 2, 1), (18432 * 61, 8, 1), (1000, 3, 3), (4097, 4, 2),
    ],
)
def test_the_slot_count_is_vllms_cpu_tiers(cpu_spec, vllm, tmp_path, worker_bytes, world, bpc,
                                           replicated):
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
             "cpu_bytes_to_use": 1_000_000_000}
    config = offloading_config(vllm, extra, worker_bytes=worker_bytes, world=world, bpc=bpc,
                               replicated=replicated)
    theirs = cpu_spec(config)
    ours = kv.Settings.from_vllm(config)
    assert theirs.replicated_layout is replicated
    assert ours.num_blocks == theirs.num_chunks
    assert ours.row_bytes == theirs.kv_bytes_per_chunk
    if replicated:
        plain = kv.Settings.from_vllm(
            offloading_config(vllm, extra, worker_bytes=worker_bytes, world=world, bpc=bpc)
        )
        assert ours.parts == 1
        if worker_bytes * bpc % 4096 == 0:
            # One copy instead of one per rank: `world` times the blocks (up to rounding).
            assert world * plain.num_blocks <= ours.num_blocks < world * (plain.num_blocks + 1)


def test_a_tier_written_under_another_layout_is_refused(vllm, region_dir, tmp_path):
    """The file tier's identity records whether the layout is replicated."""
    tier = tmp_path / "tier"
    extra = lambda: {**readme_extra(region_dir, tier), "cpu_bytes_to_use": 1 << 20}  # noqa: E731
    spec = kv.KvtierOffloadingSpec(offloading_config(vllm, extra(), world=2, worker_bytes=4096))
    spec.get_manager().shutdown()
    replicated = kv.KvtierOffloadingSpec(
        offloading_config(vllm, extra(), world=2, worker_bytes=4096, replicated=True)
    )
    with pytest.raises(kvtier.TierError):
        replicated.get_manager()
