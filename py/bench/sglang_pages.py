"""kvtier's HiCache backend against SGLang's built-in ``file`` backend (``HiCacheFile``), side
by side, through SGLang 0.5.23's own controller functions: the zero-copy ones
(``_page_set_zero_copy``, ``_page_get_zero_copy``) for kvtier, the generic ones
(``_generic_page_set``, ``_generic_page_get``) for HiCacheFile, as SGLang picks them for each.

One round, for each backend on a host pool of its own (same shape), in alternating order:

- ``backup``: ``--batches`` batches of ``--pages`` pages (SGLang's batches are at most 128),
  each page with new contents, stored;
- ``prefetch``: ``batch_exists`` then the get of every batch stored, into other host pages;
- ``restart``: a new instance of the backend on the same directory (kvtier: its file tier;
  kvtier's primary starts empty), then ``prefetch`` again: kvtier promotes the pages from
  its file tier (read with ``O_DIRECT``, so from the disk). HiCacheFile reads through the OS
  page cache, which is warm unless ``--cold``: then the restart phase is timed again after
  ``sync`` and ``/proc/sys/vm/drop_caches`` (root only), as ``restart-cold``.

Every get's bytes are compared with the stored ones (untimed). Reports, per phase, the median
over ``--rounds`` of pages per second for each backend and the ratio of the medians.

Needs torch and SGLang importable (scripts/sglang-setup.sh; run with the engine venv's
python and ``PYTHONPATH`` set to the site directory it prints) and kvtier installed.

Usage: sglang_pages.py [--pages 64] [--batches 8] [--rounds 5] [--layout page_first] [--cold]
                       [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from kvtier.sglang import KvtierHiCacheStorage

# A page of 32 tokens of a model with 16 layers and 4 KV heads of 64 (fp16): 512 KiB.
LAYERS, HEADS, DIM, PAGE = 16, 4, 64, 32


def pool(layout: str, pages: int):
    tokens = pages * PAGE
    k = tuple(torch.zeros(tokens, HEADS, DIM, dtype=torch.float16) for _ in range(LAYERS))
    v = tuple(torch.zeros(tokens, HEADS, DIM, dtype=torch.float16) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=torch.float16,
        device=torch.device("cpu"),
    )
    # host_size in GB: room for twice the pages (stored ones and a get's targets).
    p = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                             device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS)
    p._keep = (k, v)
    return p


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/sglang-pages", extra_config=extra)


def kvtier(host, directory: Path, pages: int):
    page_bytes = HEADS * DIM * 2 * 2 * LAYERS * PAGE
    b = KvtierHiCacheStorage(config({
        "interface_v1": 1, "cpu_bytes_to_use": 2 * pages * page_bytes,
        "secondary_tiers": [{"type": "file", "path": str(directory),
                             "capacity_bytes": 4 * pages * page_bytes}]}))
    b.register_mem_pool_host(host)
    return b, True


def hicache_file(host, directory: Path, pages: int):
    b = HiCacheFile(config({}), file_path=str(directory))
    b.register_mem_pool_host(host)
    return b, False


def indices(first: int, n: int):
    return torch.arange(first * PAGE, (first + n) * PAGE)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run(make, layout: str, pages: int, batches: int, salt: int, cold: bool) -> dict[str, float]:
    """One round of one backend: pages per second of each phase."""
    directory = Path(tempfile.mkdtemp(prefix="kvtier-sglang-bench-"))
    host = pool(layout, 2 * pages)
    backend, zero_copy = make(host, directory, batches * pages)
    c = SimpleNamespace(storage_backend=backend, storage_host_pool=host, mem_pool_host=host,
                        page_size=PAGE)
    op = SimpleNamespace(request_id="bench", is_terminated=lambda: False)
    keys = [[f"{salt:08x}{b:08x}{i:08x}" + "0" * 40 for i in range(pages)] for b in range(batches)]
    want = []
    out: dict[str, float] = {}
    elapsed = 0.0
    for b in range(batches):
        flat = host.get_dummy_flat_data_page()
        stored = []
        for i in range(pages):
            flat.copy_(torch.randn(flat.shape, generator=torch.Generator().manual_seed(salt * 7919 + b * 131 + i)).to(flat.dtype))
            host.set_from_flat_data_page(i * PAGE, flat)
            stored.append(host.get_data_page(i * PAGE, flat=True).clone())
        want.append(stored)
        start = time.perf_counter()
        if zero_copy:
            ok = HiCacheController._page_set_zero_copy(c, keys[b], indices(0, pages))
        else:
            ok = HiCacheController._generic_page_set(c, keys[b], indices(0, pages))
        elapsed += time.perf_counter() - start
        assert ok, "every page stored"
    out["backup"] = batches * pages / elapsed
    if zero_copy:
        backend._native.drain(60.0)

    def prefetch(backend, host) -> float:
        c.storage_backend, c.storage_host_pool, c.mem_pool_host = backend, host, host
        elapsed = 0.0
        for b in range(batches):
            start = time.perf_counter()
            n = backend.batch_exists(keys[b])
            if zero_copy:
                got = HiCacheController._page_get_zero_copy(c, op, keys[b][:n], indices(pages, n))
            else:
                got = HiCacheController._generic_page_get(c, op, keys[b][:n], indices(pages, n))
            elapsed += time.perf_counter() - start
            assert got == pages, f"batch {b}: {got} of {pages} pages"
            for i in range(pages):
                assert torch.equal(host.get_data_page((pages + i) * PAGE, flat=True), want[b][i])
        return batches * pages / elapsed

    out["prefetch"] = prefetch(backend, host)
    if zero_copy:
        backend.close()
    host2 = pool(layout, 2 * pages)
    backend2, _ = make(host2, directory, batches * pages)
    out["restart"] = prefetch(backend2, host2)
    if zero_copy:
        backend2.close()
    if cold:
        host3 = pool(layout, 2 * pages)
        drop_caches()
        backend3, _ = make(host3, directory, batches * pages)
        out["restart-cold"] = prefetch(backend3, host3)
        if zero_copy:
            backend3.close()
    shutil.rmtree(directory, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--cold", action="store_true", help="also time a restart after dropping the OS page cache (root)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    results: dict[str, dict[str, list[float]]] = {"kvtier": {}, "file": {}}
    for r in range(a.rounds):
        order = [("kvtier", kvtier), ("file", hicache_file)]
        if r % 2:
            order.reverse()
        for name, make in order:
            for phase, v in run(make, a.layout, a.pages, a.batches, salt=r * 2 + (name == "file"), cold=a.cold).items():
                results[name].setdefault(phase, []).append(v)
    summary = {
        phase: {
            "kvtier_pages_per_s": statistics.median(results["kvtier"][phase]),
            "file_pages_per_s": statistics.median(results["file"][phase]),
        }
        for phase in results["kvtier"]
    }
    for s in summary.values():
        s["ratio"] = s["kvtier_pages_per_s"] / s["file_pages_per_s"]
    if a.json:
        json.dump({"args": vars(a), "summary": summary, "runs": results}, sys.stdout, indent=1)
        print()
    else:
        page_kib = HEADS * DIM * 2 * 2 * LAYERS * PAGE // 1024
        print(f"{a.rounds} rounds, {a.batches} batches of {a.pages} pages of {page_kib} KiB, layout {a.layout}")
        for phase, s in summary.items():
            print(f"{phase:9} kvtier {s['kvtier_pages_per_s']:9.0f} pages/s   HiCacheFile "
                  f"{s['file_pages_per_s']:9.0f} pages/s   ratio {s['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
