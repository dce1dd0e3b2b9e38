"""kvtier.sglang against SGLang 0.5.23's own code: its host pool classes built on CPU tensors,
its storage factory loading the backend through ``dynamic``, and its cache controller's own
page functions driving the calls. The differential tests run the same calls into SGLang's
built-in ``file`` backend (``HiCacheFile``) and compare.

These tests need torch and SGLang: scripts/test.sh runs them in vLLM's CPU venv with SGLang
on PYTHONPATH (scripts/sglang-setup.sh). Elsewhere they are skipped loudly, except under
``CI=true``, where a missing SGLang is a failure.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
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
from kvtier import ConfigError, StateError  # noqa: E402
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
    nothing is stricter, and a minute for every promotion from its file tier (with the default
    wait of 2 s, on a machine loaded by two other builds, exists once answered a shorter run
    than HiCacheFile's)."""
    rng = random.Random(seed)
    kv_pool, file_pool = mha_pool(layout), mha_pool(layout)
    tiers = [{"type": "file", "path": str(tmp_path / "kvtier"), "capacity_bytes": 1 << 22}]
    extra = kvtier_extra(cpu_bytes_to_use=8 * 4096, secondary_tiers=tiers, wait_timeout_s=60)
    kv = attach(kv_pool, extra)
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


# -- shared tiers ----------------------------------------------------------------------------


def stored(pool, backend, keys: list[str], pages: list[int]) -> dict[str, bytes]:
    """Fills ``pages`` with the contents of ``keys``, stores them through SGLang's zero-copy
    set, and answers each key's bytes."""
    want = {}
    for p, k in zip(pages, keys):
        fill(pool, p, k)
        want[k] = page_bytes(pool, p)
    c = controller(backend, pool)
    assert HiCacheController._page_set_zero_copy(c, keys, indices(pages)) is True
    return want


def served(pool, backend, keys: list[str], want: dict[str, bytes], page: int = 15) -> list[bool]:
    """Gets each key alone into ``page``; asserts that every page served has its bytes."""
    out = []
    for k in keys:
        zero(pool, [page])
        ok = backend.batch_get_v1([k], indices([page]))[0]
        if ok:
            assert page_bytes(pool, page) == want[k], f"wrong bytes served for {k}"
        out.append(ok)
    return out


def test_two_nodes_share_pages_through_an_s3_tier(s3_server, monkeypatch):
    endpoint, bucket, access, secret = s3_server
    monkeypatch.setenv("KVTIER_SG_AK", access)
    monkeypatch.setenv("KVTIER_SG_SK", secret)
    tiers = [{"type": "s3", "endpoint": endpoint, "bucket": bucket, "region": "us-east-1",
              "access_key_id_env": "KVTIER_SG_AK", "secret_access_key_env": "KVTIER_SG_SK",
              "capacity_bytes": 1 << 24}]
    a_pool, b_pool = mha_pool("page_first"), mha_pool("page_first")
    a = attach(a_pool, kvtier_extra(secondary_tiers=tiers))
    b = attach(b_pool, kvtier_extra(secondary_tiers=tiers))
    try:
        keys = [key_of(i) for i in range(5)]
        want = stored(a_pool, a, keys, [0, 1, 2, 3, 4])
        assert a._native.drain(20.0)
        # Node B never stored them: it finds them in the bucket, promotes and serves them.
        assert b.batch_exists(keys) == 5
        assert served(b_pool, b, keys, want) == [True] * 5
        assert b.stats()["tiers"][0]["hits"] >= 5
    finally:
        a.close()
        b.close()


def test_mla_ranks_read_the_writer_ranks_pages_through_redis(redis_url):
    """SGLang writes an MLA model's pages from one rank (``is_storage_writer``); the other
    ranks of the TP group find them in the tier they share, under an identity without the
    rank."""
    tiers = [{"type": "redis", "urls": [redis_url], "capacity_bytes": 1 << 24}]
    w_pool, r_pool = mla_pool("page_first"), mla_pool("page_first")
    writer = attach(w_pool, kvtier_extra(secondary_tiers=tiers), mla=True, tp_rank=0, tp_size=2)
    reader = attach(r_pool, kvtier_extra(secondary_tiers=tiers), mla=True, tp_rank=1, tp_size=2)
    try:
        assert writer._config.is_storage_writer and not reader._config.is_storage_writer
        keys = [key_of(i) for i in range(4)]
        want = stored(w_pool, writer, keys, [0, 1, 2, 3])
        assert writer._native.drain(20.0)
        assert reader.batch_exists(keys) == 4
        assert served(r_pool, reader, keys, want) == [True] * 4
    finally:
        writer.close()
        reader.close()


# -- faults ----------------------------------------------------------------------------------


def test_a_corrupt_page_on_disk_is_never_served(tmp_path):
    pool = mha_pool("page_first")
    tiers = [{"type": "file", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 20}]
    extra = kvtier_extra(cpu_bytes_to_use=2 * 4096, secondary_tiers=tiers)
    kv = attach(pool, extra)
    keys = [key_of(i) for i in range(8)]
    want = stored(pool, kv, keys, list(range(8)))
    assert kv._native.drain(10.0)
    kv.close()
    # Flip one byte inside the stored bytes of every other page, found by their contents.
    data = next((tmp_path / "t").glob("*/blocks.kvt"))
    raw = bytearray(data.read_bytes())
    corrupt = keys[1::2]
    for k in corrupt:
        at = raw.find(want[k][:256])
        assert at > 0, "the page's bytes are in the file tier"
        raw[at + 100] ^= 0x5A
    data.write_bytes(bytes(raw))
    kv = attach(mha_pool("page_first"), extra)
    try:
        pool = kv.mem_pool_host
        assert kv.batch_exists(keys) == 1, "the leading run stops at the first corrupt page"
        got = served(pool, kv, keys, want)
        assert got == [k not in corrupt for k in keys]
        assert kv.stats()["tiers"][0]["read_failures"] >= len(corrupt)
        kv._native.check_invariants()
    finally:
        kv.close()
    # Where kvtier is stricter: SGLang's file backend, given the same pages and the same
    # damage, counts the damaged page and serves its bytes.
    hpool = mha_pool("page_first")
    hf = HiCacheFile(storage_config({}), file_path=str(tmp_path / "hicache"))
    hf.register_mem_pool_host(hpool)
    for p, k in enumerate(keys):
        fill(hpool, p, k)
    assert HiCacheController._generic_page_set(controller(hf, hpool), keys, indices(list(range(8))))
    for k in corrupt:
        f = next((tmp_path / "hicache").glob(f"{k}*.bin"))
        raw = bytearray(f.read_bytes())
        raw[100] ^= 0x5A
        f.write_bytes(bytes(raw))
    assert hf.batch_exists(keys) == 8
    zero(hpool, [15])
    assert HiCacheController._generic_page_get(controller(hf, hpool), op(), [corrupt[0]], indices([15])) == 1
    assert page_bytes(hpool, 15) != want[corrupt[0]], "HiCacheFile serves the damaged bytes"


def test_a_dead_redis_ends_every_call_in_bounded_time_and_serves_nothing_wrong(redis_server):
    url, proc = redis_server
    pool = mha_pool("page_first")
    tiers = [{"type": "redis", "urls": [url], "capacity_bytes": 1 << 24, "timeout_ms": 300}]
    kv = attach(pool, kvtier_extra(cpu_bytes_to_use=2 * 4096, secondary_tiers=tiers,
                                   wait_timeout_s=1.0))
    try:
        keys = [key_of(i) for i in range(6)]
        want = stored(pool, kv, keys, list(range(6)))
        assert kv._native.drain(20.0)
        proc.kill()
        proc.wait()
        start = time.monotonic()
        n = kv.batch_exists(keys)
        got = served(pool, kv, keys, want)
        assert time.monotonic() - start < 15.0
        # What the primary still holds is served right; what only Redis held is not served.
        assert n <= sum(got)
        assert sum(got) <= 2
        # Pages stored now still land in the primary: the cascade's failure loses nothing
        # that was served, and the calls go on.
        more = [key_of(i) for i in range(10, 12)]
        want.update(stored(pool, kv, more, [6, 7]))
        assert served(pool, kv, more, want) == [True, True]
        kv._native.check_invariants()
    finally:
        kv.close()


def test_a_full_tier_evicts_and_never_answers_for_what_it_dropped(tmp_path):
    """The file tier at its capacity evicts its least recent pages (HiCacheFile's evictor
    does too, by its own accounting); kvtier's answers follow what it holds."""
    pool = mha_pool("page_first")
    tiers = [{"type": "file", "path": str(tmp_path / "t"), "capacity_bytes": 4 * 4096}]
    kv = attach(pool, kvtier_extra(cpu_bytes_to_use=2 * 4096, secondary_tiers=tiers))
    try:
        keys = [key_of(i) for i in range(12)]
        want = {}
        for i in range(0, 12, 2):
            want.update(stored(pool, kv, keys[i:i + 2], [0, 1]))
            assert kv._native.drain(10.0)
        got = served(pool, kv, keys, want)
        assert 2 <= sum(got) <= 6
        assert got[-1], "the last page stored is held"
        kv._native.check_invariants()
    finally:
        kv.close()
    # Where kvtier is stricter: SGLang's file backend, with no cap set (its default), keeps
    # every page it is given.
    hpool = mha_pool("page_first")
    hf = HiCacheFile(storage_config({}), file_path=str(tmp_path / "hicache"))
    hf.register_mem_pool_host(hpool)
    for i in range(0, 12, 2):
        for p, k in zip([0, 1], keys[i:i + 2]):
            fill(hpool, p, k)
        assert HiCacheController._generic_page_set(controller(hf, hpool), keys[i:i + 2], indices([0, 1]))
    assert hf.batch_exists(keys) == 12


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import test_sglang as t
    pool = t.mha_pool("page_first")
    extra = t.kvtier_extra(cpu_bytes_to_use=4 * 4096, secondary_tiers=[
        {"type": "file", "path": sys.argv[2], "capacity_bytes": 1 << 22}])
    kv = t.attach(pool, extra)
    i = 0
    while True:
        keys = [t.key_of(i + j) for j in range(4)]
        for p, k in enumerate(keys):
            t.fill(pool, p, k)
        ok = kv.batch_set_v1(keys, t.indices([0, 1, 2, 3]))
        print("stored", i + 4 if all(ok) else i, flush=True)
        i += 4
""")


def test_a_rank_killed_mid_set_leaves_only_whole_pages(tmp_path):
    """A rank process storing pages in a loop is killed (SIGKILL) mid-set. A new one on the
    same file tier serves only pages whose bytes are whole, and serves some."""
    child = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", CHILD, str(Path(__file__).parent), str(tmp_path / "t")],
        stdout=subprocess.PIPE, text=True)
    stored_count = 0
    try:
        for line in child.stdout:
            stored_count = int(line.split()[1])
            if stored_count >= 200:
                break
        time.sleep(random.Random(7).uniform(0.0, 0.05))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert stored_count >= 200, "the child stored pages before it was killed"
    kv = attach(mha_pool("page_first"), kvtier_extra(cpu_bytes_to_use=4 * 4096, secondary_tiers=[
        {"type": "file", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 22}]))
    try:
        pool = kv.mem_pool_host
        keys = [key_of(i) for i in range(stored_count + 8)]
        want = {}
        for k in keys:
            fill(pool, 14, k)
            want[k] = page_bytes(pool, 14)
        got = served(pool, kv, keys, want)
        assert sum(got) >= 1, "pages cascaded before the kill are found again"
        kv._native.check_invariants()
    finally:
        kv.close()


# -- the calls' edges ------------------------------------------------------------------------


def test_a_call_whose_pieces_do_not_make_its_pages_is_refused_and_stores_nothing():
    pool = mha_pool("page_first")
    kv = attach(pool, kvtier_extra())
    try:
        native = kv._native
        ptrs, sizes = pool.get_page_buffer_meta(indices([0]))
        with pytest.raises(StateError, match="pieces"):
            native.set([b"p:x"], [], [])
        with pytest.raises(StateError, match="bytes"):
            native.set([b"p:x"], ptrs, [sizes[0], sizes[1] - 1])
        with pytest.raises(StateError, match="piece of"):
            native.set([b"p:x"], ptrs, [sizes[0] + sizes[1], 0])
        assert native.exists([b"p:x"]) == 0
    finally:
        kv.close()


def test_a_key_named_twice_in_a_batch_is_stored_once_and_read_twice():
    pool = mha_pool("page_first")
    kv = attach(pool, kvtier_extra())
    try:
        k = key_of(3)
        fill(pool, 0, k)
        fill(pool, 1, k)
        want = page_bytes(pool, 0)
        assert kv.batch_set_v1([k, k], indices([0, 1])) == [True, True]
        assert kv.stats()["primary_blocks"] == 1
        zero(pool, [4, 5])
        assert kv.batch_get_v1([k, k], indices([4, 5])) == [True, True]
        assert page_bytes(pool, 4) == want and page_bytes(pool, 5) == want
        assert kv.stats()["load_pins"] == 0
    finally:
        kv.close()


def test_clear_forgets_the_primary_and_the_file_tier_gives_the_pages_back(tmp_path):
    pool = mha_pool("page_first")
    tiers = [{"type": "file", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 20}]
    kv = attach(pool, kvtier_extra(secondary_tiers=tiers))
    try:
        keys = [key_of(i) for i in range(4)]
        want = stored(pool, kv, keys, [0, 1, 2, 3])
        assert kv._native.drain(10.0)
        assert kv.clear() is True
        assert kv.stats()["primary_blocks"] == 0
        assert kv.batch_exists(keys) == 4, "promoted back from the file tier"
        assert served(pool, kv, keys, want) == [True] * 4
    finally:
        kv.close()


def test_sglangs_threads_call_at_once_and_nothing_wrong_is_served(tmp_path):
    """The backup thread stores, the prefetch thread asks and reads, the scheduler takes the
    stats, all at once, with a primary smaller than the pages so that evictions, cascades and
    promotions interleave. Every page served has its own bytes; no pin is left."""
    tiers = [{"type": "file", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 22}]
    pool = mha_pool("page_first")
    kv = attach(pool, kvtier_extra(cpu_bytes_to_use=6 * 4096, secondary_tiers=tiers))
    want: dict[str, bytes] = {}
    ref = mha_pool("page_first")
    for i in range(24):
        fill(ref, 15, key_of(i))
        want[key_of(i)] = page_bytes(ref, 15)
    stop = time.monotonic() + 3.0
    errors: list[BaseException] = []
    counts = {"stored": 0, "served": 0}

    def backup():
        rng = random.Random(1)
        while time.monotonic() < stop:
            first = rng.randrange(0, 22)
            keys = [key_of(first), key_of(first + 1)]
            for p, k in zip([0, 1], keys):
                fill(pool, p, k)
            counts["stored"] += sum(kv.batch_set_v1(keys, indices([0, 1])))

    def prefetch():
        rng = random.Random(2)
        while time.monotonic() < stop:
            first = rng.randrange(0, 20)
            keys = [key_of(first + j) for j in range(4)]
            n = kv.batch_exists(keys)
            got = kv.batch_get_v1(keys[:n], indices([8, 9, 10, 11][:n])) if n else []
            for j, ok in enumerate(got):
                if ok:
                    assert page_bytes(pool, 8 + j) == want[keys[j]], keys[j]
                    counts["served"] += 1

    def scheduler():
        while time.monotonic() < stop:
            kv.get_stats()
            time.sleep(0.001)

    def run(f):
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in (backup, prefetch, scheduler)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert counts["stored"] > 0 and counts["served"] > 0, counts
        assert kv._native.drain(10.0)
        assert kv.stats()["load_pins"] == 0
        kv._native.check_invariants()
    finally:
        kv.close()


def test_get_stats_gives_sglang_its_storage_metrics():
    pool = mha_pool("page_first")
    kv = attach(pool, kvtier_extra())
    try:
        keys = [key_of(i) for i in range(3)]
        stored(pool, kv, keys, [0, 1, 2])
        assert kv.batch_get_v1(keys, indices([4, 5, 6])) == [True] * 3
        m = kv.get_stats()
        assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
        assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
        assert m.kvtier["pages_written"] == 3 and m.kvtier["pages_read"] == 3
        assert kv.get_stats().prefetch_pgs == [], "taken once"
    finally:
        kv.close()
