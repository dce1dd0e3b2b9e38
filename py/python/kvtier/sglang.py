"""kvtier as SGLang's HiCache storage backend (SGLang 0.5.23, ``dynamic`` backend, zero-copy
``interface_v1``).

SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "file", "path": "/mnt/nvme/kvtier",
                             "capacity_bytes": 1000000000000}]}'

Each rank process gets its own kvtier primary (a region of ``cpu_bytes_to_use`` bytes) with
the secondary tiers beneath it; SGLang's host pool (its L2) copies pages in and out of the
primary by address. See docs/sglang.md for every setting and for how SGLang's calls map to
kvtier's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier import _native
from kvtier._native import ConfigError

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as e:  # pragma: no cover - the module is only useful inside SGLang
    raise ImportError(f"kvtier.sglang needs SGLang (sglang 0.5.23): {e}") from e

logger = logging.getLogger(__name__)

__all__ = ["KvtierHiCacheStorage", "SUPPORTED_POOLS"]

#: SGLang's host pool classes kvtier stores pages of: the plain MHA and MLA pools, in every
#: layout whose pages they can describe by address (``get_page_buffer_meta``).
SUPPORTED_POOLS = frozenset({"MHATokenToKVPoolHost", "MLATokenToKVPoolHost"})

#: The settings of ``--hicache-storage-backend-extra-config`` that kvtier reads, beside
#: SGLang's own (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``).
SETTINGS = frozenset(
    {
        "cpu_bytes_to_use",
        "eviction_policy",
        "secondary_tiers",
        "namespace",
        "io_threads",
        "wait_timeout_s",
        "shutdown_timeout_s",
    }
)
#: SGLang's own keys in the same table (the dynamic loader's, and its prefetch knobs).
_SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)

#: The key prefixes of the two page formats: SGLang's zero-copy pages (``batch_*_v1``), and
#: its flat pages (the legacy ``get``/``set``), whose bytes are ordered differently.
_PAGE = b"p:"
_FLAT = b"f:"

_instances = 0
_instances_lock = threading.Lock()


def _setting(extra: Mapping[str, Any], key: str) -> str:
    return f"hicache_storage_backend_extra_config.{key}"


def _int(extra: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int:
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(f"{_setting(extra, key)}: missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{_setting(extra, key)}: {value!r} is not an integer of at least {minimum}")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{_setting(extra, key)}: {value!r} is not a positive number of seconds")
    return float(value)


def _replica() -> int | None:
    """The data-parallel replica of this SGLang process (its DP controller's rank), or
    ``None`` without one. SGLang's storage config gives only the attention-DP rank, which is
    0 in every replica of plain data parallelism."""
    try:
        from sglang.srt.runtime_context import get_parallel

        replica = get_parallel().dp_rank
    except Exception:  # an SGLang without it, or a process it did not set up
        return None
    return replica if isinstance(replica, int) else None


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over kvtier's primary and secondary tiers.

    Built by SGLang as ``KvtierHiCacheStorage(storage_config, kwargs)``; the tiers open when
    SGLang registers its host pool (``register_mem_pool_host``), whose page shape sizes the
    primary's rows. A pool or layout kvtier cannot store is refused there, which fails
    SGLang's attach with the reason.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None):
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ConfigError(
                f"{_setting(extra, 'interface_v1')}: kvtier.sglang moves pages by address only: "
                'set "interface_v1": 1'
            )
        unknown = sorted(set(extra) - SETTINGS - _SGLANG_KEYS)
        if unknown:
            raise ConfigError(
                f"hicache_storage_backend_extra_config: unknown key {unknown[0]!r} "
                f"(kvtier reads {', '.join(sorted(SETTINGS))})"
            )
        self._config = storage_config
        self._cpu_bytes = _int(extra, "cpu_bytes_to_use", None, 1)
        policy = extra.get("eviction_policy", "lru")
        if policy not in ("lru", "arc", "reuse"):
            raise ConfigError(
                f"{_setting(extra, 'eviction_policy')}: {policy!r} is not \"lru\", \"arc\" or \"reuse\""
            )
        self._policy = policy
        tiers = extra.get("secondary_tiers", [])
        if isinstance(tiers, Mapping) or not isinstance(tiers, Sequence):
            raise ConfigError(f"{_setting(extra, 'secondary_tiers')}: not a list of tables")
        for i, t in enumerate(tiers):
            if not isinstance(t, Mapping):
                raise ConfigError(f"{_setting(extra, 'secondary_tiers')}[{i}]: not a table")
        self._tiers = [dict(t) for t in tiers]
        namespace = extra.get("namespace", "")
        if not isinstance(namespace, str):
            raise ConfigError(f"{_setting(extra, 'namespace')}: {namespace!r} is not a string")
        self._namespace = namespace
        self._io_threads = _int(extra, "io_threads", 4, 1)
        self._wait_timeout_s = _seconds(extra, "wait_timeout_s", 2.0)
        self._shutdown_timeout_s = _seconds(extra, "shutdown_timeout_s", 30.0)
        c = storage_config
        self._mla = bool(c.is_mla_model)
        shared = any(t.get("type") in ("redis", "s3") for t in self._tiers)
        if self._mla and c.tp_size > 1 and getattr(c, "dcp_size", 1) == 1 and not shared:
            # SGLang lets one rank write an MLA model's replicated pages (is_storage_writer):
            # the other ranks find them only in a tier they share with it.
            raise ConfigError(
                f"{_setting(extra, 'secondary_tiers')}: an MLA model with tensor parallelism "
                f"({c.tp_size} ranks) stores its pages from rank 0 alone; the other ranks read "
                'them from a tier they share, so one tier must be "redis" or "s3"'
            )
        self._native: Any = None
        #: What this rank's pages are stored under (model, pool, layout, dtype, page shape,
        #: shard); set when the host pool is registered.
        self.identity = ""
        self._stats_lock = threading.Lock()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}

    # -- the host pool ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Checks SGLang's host pool and opens kvtier's tiers for its pages."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        name = type(pool).__name__
        layout = getattr(pool, "layout", None)
        if name not in SUPPORTED_POOLS:
            raise ConfigError(
                f"kvtier.sglang: host pool {name} (layout {layout!r}) is not supported: kvtier "
                f"stores the pages of {', '.join(sorted(SUPPORTED_POOLS))} (hybrid pools such as "
                "Mamba's or SWA's need HiCache's v2 interface)"
            )
        import torch

        page_size = int(pool.page_size)
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        except (ValueError, AssertionError, NotImplementedError, AttributeError) as e:
            raise ConfigError(
                f"kvtier.sglang: host pool {name} with layout {layout!r} cannot describe its "
                f"pages by address ({e}); use a layout it can, such as 'page_first'"
            ) from None
        page_bytes = sum(int(s) for s in sizes)
        if not ptrs or page_bytes <= 0:
            raise ConfigError(f"kvtier.sglang: host pool {name} (layout {layout!r}) has empty pages")
        row = -(-page_bytes // 4096) * 4096
        num_blocks = self._cpu_bytes // row
        if num_blocks == 0:
            raise ConfigError(
                f"hicache_storage_backend_extra_config.cpu_bytes_to_use: {self._cpu_bytes} bytes "
                f"hold no page of {page_bytes} bytes ({row} with alignment)"
            )
        self.identity = self._identity(pool, name, page_bytes, [int(s) for s in sizes])
        digest = hashlib.sha256(self.identity.encode()).hexdigest()[:16]
        c = self._config
        # Each rank process owns its file tiers (a tier takes a lock): a directory per
        # deployment, TP rank, attention-DP rank and data-parallel replica.
        rank_dir = f"sglang-{digest}-tp{c.tp_rank}-dp{getattr(c, 'dp_rank', 0)}"
        replica = _replica()
        if replica is not None:
            rank_dir += f"-r{replica}"
        tiers = [
            {**t, "path": os.path.join(str(t["path"]), rank_dir)}
            if t.get("type") == "file" and t.get("path") is not None
            else t
            for t in self._tiers
        ]
        global _instances
        with _instances_lock:
            _instances += 1
            n = _instances
        self._native = _native.PageCache(
            num_blocks=num_blocks,
            page_bytes=page_bytes,
            region_path=f"@kvtier-sglang-{os.getpid()}-{n}",
            policy=self._policy,
            tiers=tiers,
            identity=self.identity,
            io_threads=self._io_threads,
            wait_timeout_s=self._wait_timeout_s,
            shutdown_timeout_s=self._shutdown_timeout_s,
        )
        logger.info(
            "kvtier.sglang: %d pages of %d bytes in the primary, %d secondary tiers, identity %s",
            num_blocks,
            page_bytes,
            len(tiers),
            self.identity,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Refuses every pool beside the KV pool: kvtier implements HiCache's v1 calls."""
        if str(host_pool_name) != "kv":
            raise ConfigError(
                f"kvtier.sglang: host pool {type(host_pool).__name__} ({host_pool_name}) needs "
                "HiCache's v2 interface (hybrid and sidecar pools), which kvtier does not implement"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _identity(self, pool: Any, name: str, page_bytes: int, sizes: list[int]) -> str:
        """What a page's bytes depend on: model, shard, pool, layout, dtype and shape."""
        c = self._config
        parts = [
            "kvtier/sglang/1",
            f"model={c.model_name or ''}",
            f"pool={name}",
            f"layout={getattr(pool, 'layout', '')}",
            f"dtype={getattr(pool, 'dtype', '')}",
            f"page={pool.page_size}",
            f"bytes={page_bytes}",
            f"pieces={len(sizes)}x{sizes[0]}",
        ]
        if not self._mla:
            # An MHA rank holds its own heads; an MLA page is the same on every rank.
            parts.append(f"tp={c.tp_rank}/{c.tp_size}")
        if c.pp_size > 1:
            parts.append(f"pp={c.pp_rank}/{c.pp_size}")
        if getattr(c, "attn_cp_size", 1) > 1:
            parts.append(f"cp={c.attn_cp_rank}/{c.attn_cp_size}")
        if getattr(c, "dcp_size", 1) > 1:
            parts.append(f"dcp={c.dcp_rank}/{c.dcp_size}/tp{c.tp_size}")
        if self._namespace:
            parts.append(f"ns={self._namespace}")
        return ";".join(parts)

    def _live(self) -> Any:
        if self._native is None:
            raise _native.StateError(
                "kvtier.sglang: no host pool registered yet (register_mem_pool_host opens the tiers)"
            )
        return self._native

    # -- HiCache's zero-copy calls ------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The leading run of ``keys`` whose pages are ready to read: in kvtier's primary, or
        promoted there from a secondary tier within ``wait_timeout_s``."""
        return self._live().exists([_PAGE + k.encode() for k in keys])

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Copies each key's page into the host pool at ``host_indices``; per key, whether its
        page was written in full."""
        return self._move("prefetch", "get", keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Stores each key's page from the host pool at ``host_indices``; per key, whether
        kvtier held it already or its copy into kvtier's primary ended whole."""
        return self._move("backup", "set", keys, host_indices)

    def _move(self, kind: str, call: str, keys: list[str], host_indices: Any) -> list[bool]:
        """The native ``get`` or ``set`` of ``keys`` over the host pool's pieces at
        ``host_indices``, timed into the ``kind`` metrics."""
        native = self._live()
        if not keys:
            return []
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        start = time.perf_counter()
        out = getattr(native, call)([_PAGE + k.encode() for k in keys], ptrs, sizes)
        self._record(kind, sum(out), native.page_bytes, time.perf_counter() - start)
        return out

    # -- the legacy calls: SGLang's flat pages, under keys of their own -----------------

    def _flat(self, tensor: Any) -> tuple[list[int], list[int]]:
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise _native.StateError("kvtier.sglang: a flat page must be a contiguous CPU tensor")
        return [tensor.data_ptr()], [tensor.numel() * tensor.element_size()]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Reads the flat page of ``key`` into ``target_location``; it, or ``None``."""
        if target_location is None:
            return None
        ptrs, sizes = self._flat(target_location)
        ok = self._live().get([_FLAT + key.encode()], ptrs, sizes)
        return target_location if ok[0] else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """``get`` of each key."""
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores the flat page ``value`` under ``key``."""
        if value is None:
            return False
        ptrs, sizes = self._flat(value)
        return bool(self._live().set([_FLAT + key.encode()], ptrs, sizes)[0])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """``set`` of each key; whether all were stored."""
        if values is None:
            return False
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def exists(self, key: str) -> bool:
        """Whether the flat page of ``key`` is ready to read."""
        return self._live().exists([_FLAT + key.encode()]) == 1

    # -- the rest -----------------------------------------------------------------------

    def clear(self) -> bool:
        """Forgets every page in kvtier's primary, once no get or set is copying and tier IO
        has ended (waiting up to ``wait_timeout_s``); the secondary tiers keep theirs (a
        shared tier's pages are other nodes' too). Whether the primary was cleared."""
        return bool(self._live().clear(self._wait_timeout_s))

    def _record(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        with self._stats_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            if seconds > 0:
                self._metrics[f"{kind}_bandwidth"].append(pages * page_bytes / seconds / 1e9)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last one (pages per call and
        GB/s), with kvtier's own counters as ``kvtier``."""
        with self._stats_lock:
            taken, self._metrics = self._metrics, {k: [] for k in self._metrics}
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # pragma: no cover
            return None
        m = StorageMetrics()
        for k, v in taken.items():
            setattr(m, k, v)
        if self._native is not None:
            m.kvtier = self._native.stats()
        return m

    def stats(self) -> dict[str, Any]:
        """kvtier's counters: pages found, read, written and not, and the core's."""
        return self._live().stats()

    def close(self) -> None:
        """Waits for the tiers' IO in flight (up to ``shutdown_timeout_s``) and closes them."""
        if self._native is not None:
            self._native.shutdown()
