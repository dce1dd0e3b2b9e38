"""kvtier.sglang against SGLang 0.5.23's own code: its host pool classes built on CPU tensors,
its storage factory loading the backend through ``dynamic``, and its cache controller's own
page functions driving the calls. The differential tests run the same calls into SGLang's
built-in ``file`` backend (``HiCacheFile``) and compare.

These tests need torch and SGLang: scripts/test.sh runs them in vLLM's CPU venv with SGLang
on PYTHONPATH (scripts/sglang-setup.sh). Elsewhere they are skipped loudly, except under
``CI=true``, where a missing SGLang is a failure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import (
        AsymmetricMHATokenToKVPoolHost,
        MHATokenToKVPoolHost,
    )
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    SGLANG_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise
    SGLANG_ERROR = str(e)

if SGLANG_ERROR is not None:  # pragma: no cover
    pytest.skip(
        f"SKIPPED: SGLang 0.5.23 and torch are not importable ({SGLANG_ERROR}); "
        "scripts/test.sh runs these tests with them",
        allow_module_level=True,
    )

import kvtier.sglang  # noqa: E402
from kvtier import ConfigError  # noqa: E402
from kvtier.sglang import KvtierHiCacheStorage  # noqa: E402

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 4, 64
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def mha_pool(layout: str, dtype=torch.float32):
    """SGLang's MHA host pool over CPU "device" buffers of LAYERS layers."""
    k = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=dtype) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
    )
    pool._keep = (k, v)
    return pool


def mla_pool(layout: str):
    """SGLang's MLA host pool (one latent row a token and layer)."""
    width = 24
    rows = tuple(torch.zeros(TOKENS, 1, width) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows, data_ptrs=torch.tensor([r.data_ptr() for r in rows], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
        kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=width, dtype=torch.float32,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS,
    )
    pool._keep = rows
    return pool


def storage_config(extra: dict, *, mla=False, tp_rank=0, tp_size=1, model="kvtier-test/tiny"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=extra,
    )


def kvtier_extra(**settings) -> dict:
    extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
             "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
             "cpu_bytes_to_use": 1 << 20}
    extra.update(settings)
    return extra


def attach(pool, extra: dict, **config):
    """The backend as SGLang's controller attaches it: the factory's ``dynamic`` path, then
    the host pool's registration."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def controller(backend, pool):
    """The state SGLang's ``HiCacheController`` page functions read, to call them unbound."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                           page_size=pool.page_size)


def op():
    return SimpleNamespace(request_id="t", is_terminated=lambda: False)


def page_bytes(pool, page: int) -> bytes:
    """Page ``page``'s bytes in SGLang's flat form (its own ``get_data_page``)."""
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def fill(pool, page: int, key: str) -> None:
    """Writes the contents of ``key`` (derived from it) into page ``page`` of ``pool``."""
    flat = pool.get_dummy_flat_data_page()
    g = torch.Generator().manual_seed(int(key[:12], 16))
    flat.copy_(torch.rand(flat.shape, generator=g, dtype=torch.float32).to(flat.dtype))
    pool.set_from_flat_data_page(page * pool.page_size, flat)


def indices(pages: list[int], page_size: int = PAGE):
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


def key_of(i: int) -> str:
    return f"{i:012x}" + "ab" * 26


def zero(pool, pages):
    for p in pages:
        pool.set_from_flat_data_page(p * pool.page_size, torch.zeros_like(pool.get_dummy_flat_data_page()))


# -- loading ---------------------------------------------------------------------------------


def test_sglang_loads_kvtier_through_dynamic_with_interface_v1():
    pool = mha_pool("page_first")
    backend = attach(pool, kvtier_extra())
    try:
        assert isinstance(backend, KvtierHiCacheStorage)
        # SGLang's controller picks its zero-copy page functions for this configuration.
        extra = storage_config(kvtier_extra()).extra_config
        assert bool(extra.get("interface_v1", 0))
        assert "tp=0/1" in backend.identity and "layout=page_first" in backend.identity
        assert "model=kvtier-test/tiny" in backend.identity
    finally:
        backend.close()


def test_without_interface_v1_it_refuses_naming_the_setting():
    extra = kvtier_extra()
    del extra["interface_v1"]
    with pytest.raises(ConfigError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


@pytest.mark.parametrize(
    "settings, match",
    [({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
     ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
     ({"eviction_policy": "fifo"}, "eviction_policy"),
     ({"secondary_tiers": {"type": "file"}}, "secondary_tiers"),
     ({"wait_timeout_s": 0}, "wait_timeout_s"),
     ({"cpu_byte_to_use": 1}, "cpu_byte_to_use")],
)
def test_a_bad_setting_is_refused_naming_it(settings, match):
    with pytest.raises(ConfigError, match=match):
        StorageBackendFactory.create_backend("dynamic", storage_config(kvtier_extra(**settings)), None)


def test_a_bad_tier_setting_is_refused_at_registration_naming_it(tmp_path):
    pool = mha_pool("page_first")
    extra = kvtier_extra(secondary_tiers=[{"type": "file", "path": str(tmp_path)}])
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].capacity_bytes"):
        attach(pool, extra)


def test_an_unsupported_pool_or_layout_is_refused_at_attach_naming_it():
    # K and V of different widths (MiMo-V2): a pool kvtier does not store.
    k = tuple(torch.zeros(TOKENS, HEADS, DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM // 2) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM // 2, dtype=torch.float32,
        device=torch.device("cpu"))
    pool = AsymmetricMHATokenToKVPoolHost(info, 2.0, 0, PAGE, "page_first", pin_memory=False,
                                          device="cpu", device_capacity_tokens=TOKENS,
                                          start_layer=0, end_layer=LAYERS)
    with pytest.raises(ConfigError, match=r"AsymmetricMHATokenToKVPoolHost \(layout 'page_first'\)"):
        attach(pool, kvtier_extra())
    # A layout whose pages SGLang cannot give by address.
    with pytest.raises(ConfigError, match="layout 'page_unified'"):
        attach(mha_pool("page_unified"), kvtier_extra())
    # A hybrid model's side pools come through HiCache's v2 registration: refused too.
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(kvtier_extra()), None)
    with pytest.raises(ConfigError, match="v2 interface"):
        backend.register_mem_host_pool_v2(mha_pool("page_first"), "mamba")


def test_mla_with_tensor_parallelism_needs_a_tier_the_ranks_share(tmp_path):
    tiers = [{"type": "file", "path": str(tmp_path), "capacity_bytes": 1 << 20}]
    with pytest.raises(ConfigError, match='"redis" or "s3"'):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(kvtier_extra(secondary_tiers=tiers), mla=True, tp_size=2), None)


# -- round trips in every layout -------------------------------------------------------------


@pytest.mark.parametrize("kind, layout", [("mha", l) for l in MHA_LAYOUTS] + [("mla", l) for l in MLA_LAYOUTS])
def test_pages_round_trip_through_sglangs_zero_copy_functions_in_every_layout(kind, layout):
    pool = mha_pool(layout) if kind == "mha" else mla_pool(layout)
    backend = attach(pool, kvtier_extra(), mla=kind == "mla")
    c = controller(backend, pool)
    try:
        keys = [key_of(i) for i in range(6)]
        src, dst = [0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14]
        for p, k in zip(src, keys):
            fill(pool, p, k)
        want = [page_bytes(pool, p) for p in src]
        assert HiCacheController._page_set_zero_copy(c, keys, indices(src)) is True
        assert backend.batch_exists(keys) == 6
        assert backend.batch_exists(keys[:3] + [key_of(99)] + keys[3:]) == 3
        zero(pool, dst)
        assert HiCacheController._page_get_zero_copy(c, op(), keys, indices(dst)) == 6
        assert [page_bytes(pool, p) for p in dst] == want
        s = backend.stats()
        assert s["pages_written"] == 6 and s["pages_read"] == 6
        backend._native.check_invariants()
    finally:
        backend.close()


def test_the_identity_separates_models_ranks_and_layouts():
    ids = set()
    for model, rank, layout in [("a", 0, "page_first"), ("b", 0, "page_first"),
                                ("a", 1, "page_first"), ("a", 0, "layer_first")]:
        pool = mha_pool(layout)
        b = attach(pool, kvtier_extra(), tp_rank=rank, tp_size=2, model=model)
        ids.add(b.identity)
        b.close()
    assert len(ids) == 4
    # An MLA page is the same on every rank: its identity has no rank.
    a = attach(mla_pool("page_first"), kvtier_extra(), mla=True)
    assert "tp=" not in a.identity
    a.close()


# -- differential against SGLang's HiCacheFile -----------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_same_calls_same_answers_as_sglangs_file_backend(tmp_path, seed, layout):
    """Random batches of sets, exists and gets, through SGLang's own controller functions:
    the zero-copy ones for kvtier, the generic ones for HiCacheFile. Equal exists answers,
    equal bytes from every get both serve. kvtier is given room for every page here, so
    nothing is stricter."""
    rng = random.Random(seed)
    kv_pool, file_pool = mha_pool(layout), mha_pool(layout)
    tiers = [{"type": "file", "path": str(tmp_path / "kvtier"), "capacity_bytes": 1 << 22}]
    kv = attach(kv_pool, kvtier_extra(cpu_bytes_to_use=8 * 4096, secondary_tiers=tiers))
    hf = HiCacheFile(storage_config({}), file_path=str(tmp_path / "hicache"))
    hf.register_mem_pool_host(file_pool)
    ckv, cfile = controller(kv, kv_pool), controller(hf, file_pool)
    universe = [key_of(i) for i in range(24)]
    try:
        for step in range(60):
            start = rng.randrange(len(universe))
            keys = universe[start:start + rng.randint(1, 6)]
            pages = rng.sample(range(TOKENS // PAGE), len(keys))
            what = rng.choice(["set", "get", "exists"])
            if what == "set":
                for p, k in zip(pages, keys):
                    fill(kv_pool, p, k)
                    fill(file_pool, p, k)
                assert HiCacheController._page_set_zero_copy(ckv, keys, indices(pages)) is True
                assert HiCacheController._generic_page_set(cfile, keys, indices(pages)) is True
            elif what == "exists":
                assert kv.batch_exists(keys) == hf.batch_exists(keys), (step, keys)
            else:
                zero(kv_pool, pages)
                zero(file_pool, pages)
                got_kv = HiCacheController._page_get_zero_copy(ckv, op(), keys, indices(pages))
                got_file = HiCacheController._generic_page_get(cfile, op(), keys, indices(pages))
                assert got_kv == got_file, (step, keys)
                for p in pages[:got_kv]:
                    assert page_bytes(kv_pool, p) == page_bytes(file_pool, p), (step, p)
        # After a restart kvtier finds its pages in its file tier, as HiCacheFile does on disk.
        assert kv._native.drain(10.0)
        kv.close()
        kv_pool2 = mha_pool(layout)
        kv = attach(kv_pool2, kvtier_extra(cpu_bytes_to_use=8 * 4096, secondary_tiers=tiers))
        assert kv.batch_exists(universe[:6]) == hf.batch_exists(universe[:6])
    finally:
        kv.close()


def test_where_kvtier_is_stricter_its_capacity_is_a_bound(tmp_path):
    """HiCacheFile keeps every page it is given here; kvtier holds at most its primary plus
    its file tier's capacity, evicting the rest, and never answers for a page it dropped."""
    pool = mha_pool("page_first")
    row = 4096  # one 1 KiB page per aligned row
    tiers = [{"type": "file", "path": str(tmp_path / "t"), "capacity_bytes": 6 * row}]
    kv = attach(pool, kvtier_extra(cpu_bytes_to_use=4 * row, secondary_tiers=tiers))
    c = controller(kv, pool)
    try:
        keys = [key_of(i) for i in range(16)]
        for i in range(0, 16, 2):
            pages = [i % 8, i % 8 + 1]
            for p, k in zip(pages, keys[i:i + 2]):
                fill(pool, p, k)
            assert HiCacheController._page_set_zero_copy(c, keys[i:i + 2], indices(pages))
            assert kv._native.drain(10.0)
        held = [k for k in keys if kv.batch_exists([k]) == 1]
        assert 4 <= len(held) <= 10, held
        assert held == keys[-len(held):], "the most recent pages are the ones kept"
        for k in held:
            fill(pool, 15, k)
            want = page_bytes(pool, 15)
            zero(pool, [15])
            assert kv.batch_get_v1([k], indices([15])) == [True]
            assert page_bytes(pool, 15) == want
    finally:
        kv.close()
