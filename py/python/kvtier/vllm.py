"""kvtier as vLLM's offloading backend (vLLM 0.32 and 0.33, told apart by feature).

vLLM loads it through its ``OffloadingConnector``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 64000000000,
        "eviction_policy": "lru",
        "secondary_tiers": [{"type": "file", "path": "/mnt/nvme/kvtier",
                             "capacity_bytes": 1000000000000}]}}'

- ``KvtierOffloadingSpec``: the spec vLLM's factory builds from that config.
- ``KvtierOffloadingManager``: the scheduler side (vLLM's ``OffloadingManager``), backed by
  kvtier's core; the secondary tiers' IO runs on kvtier's own threads.
- ``KvtierOffloadingWorker``: one rank's transfer handler (vLLM's ``OffloadingWorker``),
  copying between the rank's KV tensors and its part of the shared CPU region.

When vLLM is importable the classes subclass vLLM's abstract classes and answer with vLLM's
own types; without it they use the same shapes from ``kvtier._standalone``
(``HAVE_VLLM`` tells which).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import logging

import numpy as np

from kvtier import _native
from kvtier._native import ConfigError, TransferError

try:  # vLLM's own classes, so that its factories accept ours.
    from vllm.v1.kv_offload import base as _base
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HAVE_VLLM = True
except ImportError:
    from kvtier import _standalone as _base
    from kvtier._standalone import CacheHitSource

    HAVE_VLLM = False

try:  # vLLM's spec of CPU slots: the tiering layer and vLLM's tests check for it.
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as _SlotsSpec
except ImportError:
    _SlotsSpec = _base.BlockIDsLoadStoreSpec

LookupResult = _base.LookupResult
Medium = _base.Medium
Locality = _base.Locality
OffloadingEvent = _base.OffloadingEvent
PrepareStoreOutput = _base.PrepareStoreOutput
RequestOffloadingContext = _base.RequestOffloadingContext
TransferResult = _base.TransferResult


def _fields(cls: type) -> frozenset[str]:
    try:
        return frozenset(f.name for f in dataclasses.fields(cls))
    except TypeError:
        return frozenset()


# What the running vLLM offers, detected by feature, never by version string. vLLM 0.32 lacks
# each of these; 0.33 has them all.
#: ``OffloadingEvent.metadata_only``: a failed store's removal is reported (0.33). Without
#: it the failed store's blocks are not announced at all, as vLLM 0.32's own manager does.
EVENT_METADATA_ONLY = "metadata_only" in _fields(OffloadingEvent)
#: ``OffloadingManager.on_reset_flushed``: the connector says when the jobs in flight at a
#: cache reset have ended (0.33). Without it kvtier ends the fence itself, after
#: ``reset_fence_steps`` scheduler steps (see ``KvtierOffloadingManager.reset_cache``).
RESET_FLUSHED_CALLED = hasattr(_base.OffloadingManager, "on_reset_flushed")

#: The request context's public accessor of a key's position (vLLM 0.32 and 0.33): kvtier
#: orders a finished request's blocks by it, as vLLM's own policies do, and refuses to start
#: without it rather than drift from vLLM's eviction order.
POSITION_ACCESSOR = "get_offload_key_position"


def _need(obj: Any, path: str) -> Any:
    """``obj``'s attribute ``path`` (dotted), or a ``ConfigError`` naming what this vLLM
    lacks."""
    value = obj
    for name in path.split("."):
        try:
            value = getattr(value, name)
        except AttributeError:
            raise ConfigError(
                f"this vLLM's OffloadingConfig has no {path}: kvtier needs it and cannot run "
                "(supported: vLLM 0.32 and 0.33)"
            ) from None
    return value


def _opt(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` where this vLLM has it (a field another release may add or drop)."""
    return getattr(obj, name, default)

__all__ = [
    "HAVE_VLLM",
    "KvtierLoadStoreSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "Settings",
]

#: The page every sub-slot of the region is aligned to.
PAGE = 4096

_log = logging.getLogger("kvtier")

#: The metric names kvtier reports through vLLM's ``get_stats`` (those of vLLM's CPU tier).
CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
STORES_SKIPPED = "vllm:kv_offload_stores_skipped"

#: The label of kvtier's per-tier series: ``"{i+1}:{type}"`` for ``secondary_tiers[i]``
#: (``"1:file"``), and ``"0:primary"`` for the primary's series of ``config_info``; vLLM's
#: own tiering labels its tiers the same way.
TIER_LABEL = "tier"
PRIMARY_TIER = "0:primary"

# kvtier's per-tier metrics (label ``tier``; the table in docs/vllm.md says what each is).
TIER_CAPACITY_BLOCKS = "vllm:kvtier_tier_capacity_blocks"
TIER_CAPACITY_BYTES = "vllm:kvtier_tier_capacity_bytes"
TIER_USAGE_BLOCKS = "vllm:kvtier_tier_usage_blocks"
TIER_USAGE_BYTES = "vllm:kvtier_tier_usage_bytes"
TIER_UP = "vllm:kvtier_tier_up"
TIER_CASCADE_JOBS = "vllm:kvtier_tier_cascade_jobs"
TIER_CASCADED_BLOCKS = "vllm:kvtier_tier_cascaded_blocks"
TIER_WRITTEN_BYTES = "vllm:kvtier_tier_written_bytes"
TIER_PROMOTIONS = "vllm:kvtier_tier_promotions"
TIER_READ_BYTES = "vllm:kvtier_tier_read_bytes"
TIER_EVICTIONS = "vllm:kvtier_tier_evictions"
TIER_JOBS_FAILED = "vllm:kvtier_tier_jobs_failed"
TIER_WRITE_FAILURES = "vllm:kvtier_tier_write_failures"
TIER_READ_FAILURES = "vllm:kvtier_tier_read_failures"
TIER_VERIFICATION_FAILURES = "vllm:kvtier_tier_verification_failures"
TIER_BLOCKS_MISSING = "vllm:kvtier_tier_blocks_missing"
TIER_VICTIMS_MISSED = "vllm:kvtier_tier_victims_missed_blocks"
#: Labels ``tier`` and ``reason`` (``backpressure``, ``tier_down``, ``tier_full``).
TIER_CASCADES_SKIPPED = "vllm:kvtier_tier_cascades_skipped_blocks"
#: Labels ``tier`` and ``result`` (``ok``, ``failed``).
TIER_PROMOTION_LATENCY = "vllm:kvtier_tier_promotion_latency_seconds"

# (metric, key of the native figures, help): gauges, then counters, per tier.
_TIER_GAUGES = (
    (TIER_CAPACITY_BLOCKS, "capacity_blocks", "Blocks the kvtier tier can hold."),
    (TIER_CAPACITY_BYTES, "capacity_bytes", "Bytes of blocks the kvtier tier can hold."),
    (TIER_USAGE_BLOCKS, "blocks", "Blocks the kvtier tier holds or is writing."),
    (TIER_USAGE_BYTES, "bytes", "Bytes of the blocks the kvtier tier holds or is writing."),
    (TIER_UP, "up", "1 while the kvtier tier is Up; 0 while Down (skipped after failures)."),
)
_TIER_COUNTERS = (
    (TIER_CASCADE_JOBS, "cascade_jobs", "Cascade jobs (primary to tier writes) submitted."),
    (TIER_CASCADED_BLOCKS, "blocks_cascaded", "Blocks cascade jobs set out to write."),
    (TIER_WRITTEN_BYTES, "bytes_written", "Bytes cascade jobs wrote to the tier."),
    (TIER_PROMOTIONS, "promotions", "Promotions started: lookups that found the block here."),
    (TIER_READ_BYTES, "bytes_read", "Bytes promotion jobs read from the tier."),
    (TIER_EVICTIONS, "evictions", "Blocks evicted from the tier."),
    (TIER_JOBS_FAILED, "jobs_failed", "Tier jobs that ended with a failed block."),
    (TIER_WRITE_FAILURES, "write_failures", "Blocks whose write to the tier failed."),
    (TIER_READ_FAILURES, "read_failures", "Blocks whose read from the tier failed."),
    (
        TIER_VERIFICATION_FAILURES,
        "verification_failures",
        "Blocks read from the tier that failed verification (never served).",
    ),
    (
        TIER_BLOCKS_MISSING,
        "read_missing",
        "Blocks a promotion found gone from a shared tier (evicted or expired there).",
    ),
    (
        TIER_VICTIMS_MISSED,
        "victims_missed",
        "Victim tier: blocks the primary evicted before the tier held them "
        "(lost to the hierarchy).",
    ),
)
# The reasons of TIER_CASCADES_SKIPPED, with their native keys.
_SKIP_REASONS = (
    ("backpressure", "skipped_backpressure"),
    ("tier_down", "skipped_down"),
    ("tier_full", "skipped_full"),
)
#: Buckets of TIER_PROMOTION_LATENCY, in seconds.
PROMOTION_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)


def tier_metric_definitions() -> dict[str, Any]:
    """vLLM metric definitions of kvtier's per-tier gauges and counters (label ``tier``) and
    of the skipped cascades (labels ``tier`` and ``reason``)."""
    gauge, counter = _base.OffloadingGaugeMetadata, _base.OffloadingCounterMetadata
    tier = (TIER_LABEL,)
    defs: dict[str, Any] = {}
    for name, _, doc in _TIER_GAUGES:
        defs[name] = gauge(documentation=doc, labelnames=tier)
    for name, _, doc in _TIER_COUNTERS:
        defs[name] = counter(documentation=doc, labelnames=tier)
    defs[TIER_CASCADES_SKIPPED] = counter(
        documentation="Cascaded blocks not written to the tier, by reason: "
        "backpressure (its writes at their bound), tier_down (not Up), tier_full "
        "(no room could be made).",
        labelnames=(TIER_LABEL, "reason"),
    )
    return defs


def send_tier_figures(stats: Any, label: tuple[str, ...], figures: Mapping[str, Any],
                      every: bool) -> None:
    """One tier's figures onto ``stats``: its gauges as they are, and its counters'
    increases (``figures`` holds both, by the native keys); a zero increase is sent only
    with ``every`` (the first call, so that each series exists)."""
    for name, key, _ in _TIER_GAUGES:
        stats.set_gauge(name, int(figures[key]), label)
    for name, key, _ in _TIER_COUNTERS:
        if every or figures[key]:
            stats.increase_counter(name, figures[key], label)
    for reason, key in _SKIP_REASONS:
        if every or figures[key]:
            stats.increase_counter(TIER_CASCADES_SKIPPED, figures[key], (*label, reason))


def tier_labels(tiers: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``tier`` label of each of ``tiers`` (``secondary_tiers``' tables), in order."""
    return [f"{i + 1}:{t.get('type', 'file')}" for i, t in enumerate(tiers)]


class KvtierLoadStoreSpec(_SlotsSpec):
    """Primary slots (chunks of the shared region), one per offloaded block: a vLLM
    ``CPULoadStoreSpec`` where vLLM has that class (``block_ids`` and ``chunk_ids`` are the
    slots), else a ``BlockIDsLoadStoreSpec``.

    The manager answers the slots packed as native ``int32`` bytes: the scheduler only hands
    a spec on to the workers, so the array ``block_ids`` is made where it is read, on first
    use, and a spec crosses to the workers as one ``bytes`` object.
    """

    #: The slots as packed native-endian ``int32`` values (as the manager answers them).
    _packed: bytes = b""

    @property
    def block_ids(self) -> np.ndarray:
        ids = self.__dict__.get("_block_ids")
        if ids is None:
            ids = self.__dict__["_block_ids"] = np.frombuffer(self._packed, dtype=np.int32)
        return ids

    @block_ids.setter
    def block_ids(self, ids: Any) -> None:
        self.__dict__["_block_ids"] = np.asarray(ids, dtype=np.int32)

    @property
    def chunk_ids(self) -> np.ndarray:
        return self.block_ids

    #: A store's seal: each rank sets it on the slots once its copies are complete, and the
    #: manager makes a block readable only when every rank did. ``None`` for a load.
    generation: int | None = None


def _page_align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _timeout_setting(extra: Mapping[str, Any], key: str, default: float) -> float | None:
    """A positive number of seconds, or ``None`` (given as null) for no timeout."""
    if key in extra and extra[key] is None:
        return None
    value = _float_setting(extra, key, default)
    if value <= 0.0:
        raise ConfigError(
            f"kv_connector_extra_config.{key}: {value!r} is not positive (null: no deadline)"
        )
    return value


def _str_setting(extra: Mapping[str, Any], key: str, default: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is not a string")
    return value


def _int_setting(extra: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int:
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(f"kv_connector_extra_config.{key}: missing")
    if isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is not an integer")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"kv_connector_extra_config.{key}: {value!r} is not an integer"
        ) from None
    if number < minimum or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is below {minimum}")
    return number


def _kv_cache_size_tokens(config: Any, num_chunks: int) -> int | None:
    """The KV tokens ``num_chunks`` slots hold for requests of ``max_model_len`` tokens: the
    slots times that length, over the slots one such request takes (every group's chunks, a
    sliding window's group at most its window), rounded down. vLLM's CPU tier reports the
    same figure as ``cpu_kv_cache_size_tokens``; ``None`` when the length or the groups are
    unknown."""
    max_model_len = int(getattr(config.model, "max_model_len", 0) or 0)
    groups = list(config.groups)
    if max_model_len <= 0 or not groups:
        return None
    per_request = 0
    for g in groups:
        chunk_tokens = int(g.tokens_per_block) * int(config.cache.blocks_per_chunk)
        chunks = -(-max_model_len // chunk_tokens)
        window = g.sliding_window_size_in_chunks
        per_request += chunks if window is None else min(chunks, int(window))
    return num_chunks * max_model_len // per_request


def _float_setting(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is not a number") from None
    if not number >= 0.0:
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is negative")
    return number


def layout_identity(config: Any, prefix: str) -> str:
    """What a tier's blocks are, for vLLM's ``OffloadingConfig`` ``config``: ``prefix`` and a
    digest of the model, dtype, KV layout, cache groups, parallelism and cache geometry. A
    tier written under any other of these is refused at open, never read. Fields one vLLM
    release has and another lacks (a group's sliding window is 0.33's) count as None."""
    par = _need(config, "parallel")
    model = _need(config, "model")
    groups = [
        (
            _need(g, "group_id"),
            _need(g, "tokens_per_block"),
            _opt(g, "sliding_window_size_in_chunks"),
            list(_need(g, "layer_names")),
        )
        for g in _need(config, "groups")
    ]
    return prefix + hashlib.sha256(
        repr(
            (
                _need(model, "name"), _need(model, "dtype"),
                _opt(config, "kv_cache_layout"), groups,
                int(_need(par, "world_size")), _opt(par, "tp_size", 1), _opt(par, "pp_size", 1),
                _opt(par, "pcp_size", 1), _opt(par, "dcp_size", 1),
                int(_need(config, "worker_kv_bytes_per_block")),
                int(_need(config, "cache.blocks_per_chunk")),
                _opt(_need(config, "cache"), "tokens_per_hash"),
                bool(_opt(config, "replicated_layout", False)),
                bool(_opt(config, "canonical_layout", False)),
            )
        ).encode()
    ).hexdigest()


@dataclass(frozen=True)
class Settings:
    """kvtier's settings, read from vLLM's ``OffloadingConfig`` and checked.

    vLLM's own keys: ``cpu_bytes_to_use`` (required), ``eviction_policy`` (``"lru"``,
    ``"arc"``, or kvtier's ``"reuse"``), ``store_threshold``, ``max_tracker_size``. kvtier's: ``secondary_tiers``
    (a list of ``{"type": "file", "path", "capacity_bytes", "eviction_policy"?, "fsync"?}`` or
    ``{"type": "redis", "urls", "capacity_bytes", "cluster"?, "namespace"?, "timeout_ms"?,
    "ttl_s"?, "username_env"?, "password_env"?, "tls"?, "tls_ca_file"?, "eviction_policy"?}``
    or ``{"type": "s3", "bucket", "capacity_bytes", "endpoint"?, "prefix"?, "region"?,
    "access_key_id_env"?, "secret_access_key_env"?, "session_token_env"?, "virtual_hosted"?,
    "timeout_ms"?, "retries"?, "conditional_put"?, "eviction_policy"?}``),
    ``region_dir`` (none: an anonymous region), ``io_threads`` (4), ``shutdown_timeout_s``
    (30), ``attach_timeout_s`` (60), ``copy_cpus`` (``"any"``), ``copy_threads`` (2),
    ``hit_pending_timeout_s`` (5;
    null: none).

    ``region_path`` names the shared region: ``@NAME`` for an anonymous one (memory with no
    file, which the ranks receive from the scheduler process and the kernel frees once every
    process holding it is gone, however they end), any other path for a file region.
    ``from_vllm`` makes ``@kvtier-ENGINE_ID``, or ``REGION_DIR/kvtier-ENGINE_ID`` where
    ``region_dir`` is set.
    """

    num_blocks: int
    region_path: str
    policy: str = "lru"
    workers: int = 1
    rank: int = 0
    block_bytes_per_worker: int = PAGE
    blocks_per_chunk: int = 1
    tiers: tuple[dict[str, Any], ...] = ()
    events: bool = True
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    identity: str = ""
    io_threads: int = 4
    shutdown_timeout_s: float = 30.0
    attach_timeout_s: float = 60.0
    #: Where each rank's copy thread runs: ``"any"`` CPU the process may use, ``"inherit"``
    #: the binding of the engine thread that builds the handler (vLLM's CPU worker pins it to
    #: one core of the model's OpenMP team), or a CPU list such as ``"2,4-7"``.
    copy_cpus: str = "any"
    #: Threads each rank's copy of a job of host tensors is split across (on ``copy_cpus``),
    #: at most one per 4 MiB of the job: on a CPU engine a load shares the cores with the
    #: engine's own loops, and one thread does not reach the memory's bandwidth.
    copy_threads: int = 2
    #: How long one request may wait for one block (answered "pending" or "retry", as while
    #: a promotion from a hung tier is in flight) before kvtier answers "miss" and the engine
    #: computes the block (★9). ``None``: no deadline, as vLLM 0.33.
    hit_pending_timeout_s: float | None = 5.0
    #: Pipeline stages of the engine (vLLM's ``pp_size``): how many scheduler steps may run
    #: ahead of the workers, which bounds the reset fence where vLLM does not end it.
    pipeline_stages: int = 1
    #: Whether the manager makes a stored block readable only once every rank sealed its
    #: copy (on whenever workers copy the blocks; off only where nothing does, as in a
    #: replay of the calls alone).
    verify_stores: bool = True
    #: KV tokens the primary tier holds for requests of the model's longest length, as
    #: vLLM's CPU tier reports it (``None``: the length or the groups are not known).
    kv_cache_size_tokens: int | None = None

    #: vLLM's ``replicated_layout``: every rank's KV bytes are the same (a pure-MLA model
    #: under tensor parallelism), so a slot holds one copy, not one part per rank. Rank
    #: ``slot % workers`` writes and seals a slot's block; every rank reads it.
    replicated: bool = False

    @property
    def parts(self) -> int:
        """Parts of a slot: one per rank, or one in a replicated layout."""
        return 1 if self.replicated else self.workers

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot: its parts one after another, rounded up to a page (as vLLM's
        CPU tier sizes its rows)."""
        return _page_align(self.parts * self.block_bytes_per_worker)

    @classmethod
    def from_vllm(cls, config: Any) -> Settings:
        """Reads ``config`` (vLLM's ``OffloadingConfig``); a bad value is a ``ConfigError``
        (a ``ValueError``) naming the key."""
        extra = config.extra_config or {}
        cpu_bytes = _int_setting(extra, "cpu_bytes_to_use", None, 1)
        policy = extra.get("eviction_policy", "lru")
        if policy not in ("lru", "arc", "reuse"):
            raise ConfigError(
                f"kv_connector_extra_config.eviction_policy: {policy!r} is not \"lru\", "
                "\"arc\" or \"reuse\""
            )
        if extra.get("cache_policy_module_path"):
            raise ConfigError(
                "kv_connector_extra_config.cache_policy_module_path: kvtier's policies are "
                "its own (\"lru\", \"arc\", \"reuse\"); out-of-tree policies are not loaded"
            )
        if not hasattr(getattr(_base, "ReqContext", None), POSITION_ACCESSOR):
            raise ConfigError(
                "this vLLM's ReqContext has no get_offload_key_position: kvtier orders "
                "eviction by vLLM's key positions and cannot run without it"
            )
        bpc = int(_need(config, "cache.blocks_per_chunk"))
        worker_bytes = int(_need(config, "worker_kv_bytes_per_block"))
        par = _need(config, "parallel")
        workers = int(_need(par, "world_size"))
        if worker_bytes <= 0 or workers <= 0:
            raise ConfigError(
                "worker_kv_bytes_per_block: vLLM reported no KV cache bytes per block "
                f"({worker_bytes} bytes, {workers} workers)"
            )
        per_worker = worker_bytes * bpc
        # vLLM decides whether every rank's bytes are the same (pure MLA under TP); kvtier's
        # region is shared on every platform, so it keeps one copy whenever vLLM says so.
        replicated = bool(_opt(config, "replicated_layout", False))
        row = _page_align((1 if replicated else workers) * per_worker)
        num_blocks = cpu_bytes // row
        if num_blocks < 1:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes_to_use: {cpu_bytes} bytes hold no block "
                f"of {row} bytes"
            )
        tiers = extra.get("secondary_tiers", [])
        if isinstance(tiers, Mapping) or not isinstance(tiers, Sequence):
            raise ConfigError("kv_connector_extra_config.secondary_tiers: not a list of tables")
        for i, t in enumerate(tiers):
            if not isinstance(t, Mapping):
                raise ConfigError(f"kv_connector_extra_config.secondary_tiers[{i}]: not a table")
        region_dir = extra.get("region_dir")
        engine = re.sub(r"[^A-Za-z0-9_.-]", "_", str(_opt(config, "engine_id", ""))) or "engine"
        # Without a directory the region is anonymous: nothing of it outlives the engine's
        # processes. Every rank derives the same name from the engine's id.
        region_path = (
            f"@kvtier-{engine}"
            if region_dir is None
            else os.path.join(str(region_dir), f"kvtier-{engine}")
        )
        identity = layout_identity(config, "kvtier/vllm/")
        # Data-parallel engines on one node share the config: each gets its own directory.
        if int(_opt(par, "data_parallel_size", 1)) > 1:
            tiers = [
                {**t, "path": os.path.join(str(t.get("path", "")), f"dp{par.data_parallel_index}")}
                if "path" in t
                else t
                for t in tiers
            ]
        return cls(
            num_blocks=num_blocks,
            policy=policy,
            workers=workers,
            replicated=replicated,
            rank=int(_need(par, "rank")),
            pipeline_stages=int(_opt(par, "pp_size", 1) or 1),
            block_bytes_per_worker=per_worker,
            blocks_per_chunk=bpc,
            region_path=region_path,
            tiers=tuple(dict(t) for t in tiers),
            events=bool(_opt(config, "enable_kv_cache_events", False)),
            store_threshold=_int_setting(extra, "store_threshold", 0, 0),
            max_tracker_size=_int_setting(extra, "max_tracker_size", 64_000, 1),
            identity=identity,
            io_threads=_int_setting(extra, "io_threads", 4, 1),
            shutdown_timeout_s=_float_setting(extra, "shutdown_timeout_s", 30.0),
            attach_timeout_s=_float_setting(extra, "attach_timeout_s", 60.0),
            copy_cpus=_str_setting(extra, "copy_cpus", "any"),
            copy_threads=_int_setting(extra, "copy_threads", 2, 1),
            hit_pending_timeout_s=_timeout_setting(extra, "hit_pending_timeout_s", 5.0),
            kv_cache_size_tokens=_kv_cache_size_tokens(config, num_blocks),
        )


class _StandaloneStats:
    """The shape of vLLM's ``OffloadingConnectorStats`` where vLLM is absent: ``data`` maps
    a metric name to ``{label values: value}`` (a histogram's value is its observations)."""

    def __init__(self) -> None:
        self.data: dict[str, dict[tuple[str, ...], Any]] = {}

    def set_gauge(self, name: str, value: float, labelvalues: tuple[str, ...] = ()) -> None:
        self.data.setdefault(name, {})[labelvalues] = value

    def increase_counter(
        self, name: str, value: float = 1, labelvalues: tuple[str, ...] = ()
    ) -> None:
        values = self.data.setdefault(name, {})
        values[labelvalues] = values.get(labelvalues, 0) + value

    def observe_histogram(
        self, name: str, value: float, labelvalues: tuple[str, ...] = ()
    ) -> None:
        self.data.setdefault(name, {}).setdefault(labelvalues, []).append(value)


class KvtierOffloadingManager(_base.OffloadingManager):
    """vLLM 0.33's ``OffloadingManager`` over kvtier's core.

    Every method has vLLM's arguments and answers vLLM's types. The manager keeps no state in
    Python: the core holds it, behind its own mutex, and the IO threads of the secondary tiers
    never touch it (they queue their results, which the core applies at its next call).
    ``lock`` is a real lock, as vLLM's discipline asks of a manager that other threads may
    enter: callers hold it across a lookup HIT and the ``prepare_load`` that pins the block.
    """

    def __init__(self, settings: Settings, *, prefault_threads: int = 4):
        self.settings = settings
        #: The primary tier's medium, as vLLM's CPU manager has it (its events carry it).
        self.medium = Medium.CPU
        if settings.num_blocks < 1:
            # vLLM's CPU manager accepts zero slots and then never stores anything; kvtier's
            # core and region have at least one slot (docs/vllm.md).
            raise ConfigError(
                f"num_blocks: {settings.num_blocks}: kvtier's primary tier needs at least one "
                "slot (without room for a block, leave the offloading connector out)"
            )
        self._native = _native.Manager(
            num_blocks=settings.num_blocks,
            policy=settings.policy,
            region_path=settings.region_path,
            block_bytes_per_worker=settings.block_bytes_per_worker,
            workers=settings.parts,
            answers=(
                LookupResult.MISS,
                LookupResult.HIT,
                LookupResult.HIT_PENDING,
                LookupResult.RETRY,
            ),
            output_class=PrepareStoreOutput,
            spec_class=KvtierLoadStoreSpec,
            request_class=RequestOffloadingContext,
            chunk_level=_base.OffloadPolicy.CHUNK_LEVEL,
            tiers=[dict(t) for t in settings.tiers],
            events=settings.events,
            store_threshold=settings.store_threshold,
            max_tracker_size=settings.max_tracker_size,
            identity=settings.identity,
            io_threads=settings.io_threads,
            shutdown_timeout_s=settings.shutdown_timeout_s,
            prefault_threads=prefault_threads,
            verify_stores=settings.verify_stores,
            hit_pending_timeout_s=settings.hit_pending_timeout_s,
        )
        self._lock = threading.Lock()
        # The per-block calls go straight to the core: no Python frame in between.
        self.lookup = self._native.lookup
        self.prepare_store = self._native.prepare_store
        self.prepare_load = self._native.prepare_load
        self.on_new_request = self._native.on_new_request
        self.complete_store = self._native.complete_store
        self.complete_load = self._native.complete_load
        self.touch = self._native.touch
        self.on_request_finished = self._native.on_request_finished
        self.on_schedule_end = self._native.on_schedule_end
        self._tier_media = [
            (Medium.STORAGE, Locality.LOCAL, f"tier{i}:{t.get('type', 'file')}")
            for i, t in enumerate(settings.tiers)
        ]
        self._tier_labels = [(label,) for label in tier_labels(settings.tiers)]
        # Counters go out at the first get_stats even at zero (their series exist from the
        # start), then only when they grew.
        self._counters_sent = False

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def region_path(self) -> str:
        """The shared region's path (``@NAME`` for an anonymous region), created by this
        manager; the workers attach to it."""
        return str(self._native.region_path)

    # The methods below that __init__ binds to the core directly are here for the ABC and
    # for readers; calls reach the bound ones.

    def lookup(self, key: bytes, req_context: Any) -> Any:
        return self._native.lookup(key, req_context)

    def get_load_source(self, key: bytes, req_context: Any) -> CacheHitSource:
        if self._native.promoted(key, req_context):
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[bytes], req_context: Any) -> KvtierLoadStoreSpec:
        return self._native.prepare_load(keys, req_context)

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        self._native.touch(keys)

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        self._native.complete_load(keys)

    def prepare_store(self, keys: Collection[bytes], req_context: Any) -> Any:
        # A PrepareStoreOutput (its store_spec a KvtierLoadStoreSpec), or None: no room.
        return self._native.prepare_store(keys, req_context)

    def complete_store(
        self, keys: Collection[bytes], req_context: Any, success: bool = True
    ) -> None:
        # Blocks no rank sealed end as failed stores (counted in stats()["unsealed"]).
        self._native.complete_store(keys, req_context, success)

    def on_new_request(self, req_context: Any) -> Any:
        return self._native.on_new_request(req_context)

    def on_request_finished(self, req_context: Any) -> None:
        self._native.on_request_finished(req_context)

    def take_events(self) -> Iterable[Any]:
        for tier, kind, keys in self._native.take_events():
            if tier < 0:
                medium, locality, ownership = Medium.CPU, None, None
            else:
                medium, locality, ownership = self._tier_media[tier]
            if kind == 2:
                if not EVENT_METADATA_ONLY:
                    # This vLLM announces no removal for a failed store (0.32's own
                    # manager sends none): the blocks were never announced stored.
                    continue
                yield OffloadingEvent(
                    keys=keys,
                    medium=medium,
                    removed=True,
                    locality=locality,
                    ownership=ownership,
                    metadata_only=True,
                )
            else:
                yield OffloadingEvent(
                    keys=keys,
                    medium=medium,
                    removed=kind != 0,
                    locality=locality,
                    ownership=ownership,
                )

    def on_schedule_end(self, context: Any = None) -> None:
        self._native.on_schedule_end()

    def has_pending_work(self) -> bool:
        return self._native.has_pending_work()

    def reset_cache(self) -> None:
        self._native.reset_cache(None if RESET_FLUSHED_CALLED else self.reset_fence_steps)

    def on_reset_flushed(self) -> None:
        self._native.on_reset_flushed()

    @property
    def reset_fence_steps(self) -> int:
        """Scheduler steps after a cache reset by which every job in flight at the reset has
        ended, where vLLM does not say so (vLLM 0.32 never calls ``on_reset_flushed``).

        vLLM hands the workers the reset's jobs to flush with the next step, and each worker
        waits for them before it runs that step. The scheduler learns a step's output before
        it schedules the step ``B`` later, ``B`` being the batches it keeps in flight: one, or
        two with asynchronous scheduling, or one per pipeline stage. Counting two per stage,
        plus the step that carries the flush and one more, bounds them all."""
        return 2 + 2 * max(1, self.settings.pipeline_stages)

    def get_stats(self) -> Any:
        """vLLM's CPU-tier metrics for the primary, exactly as vLLM's CPU manager reports
        them, then kvtier's per-tier metrics (label ``tier``): gauges every call, counters
        as their increase since the previous call, promotion latencies as observations.
        Without vLLM, a dict of metric name to ``{label values: value}``."""
        usage, write_usage, read_usage, sizes, skipped = self._native.take_metrics()
        if HAVE_VLLM:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                OffloadingConnectorStats,
            )

            stats = OffloadingConnectorStats()
        else:
            stats = _StandaloneStats()
        stats.set_gauge(CPU_CACHE_USAGE_PERC, usage)
        for size in sizes:
            stats.observe_histogram(CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPU_CACHE_READ_USAGE_PERC, read_usage)
        if skipped is not None:
            stats.increase_counter(STORES_SKIPPED, skipped)
        if self._tier_labels:
            self._tier_stats(stats)
        return stats if HAVE_VLLM else stats.data

    def _tier_stats(self, stats: Any) -> None:
        """Each secondary tier's figures since the previous call onto ``stats``."""
        every = not self._counters_sent
        self._counters_sent = True
        for label, t in zip(self._tier_labels, self._native.take_tier_metrics()):
            send_tier_figures(stats, label, t, every)
            for ok, seconds in t["promotion_latencies"]:
                stats.observe_histogram(
                    TIER_PROMOTION_LATENCY, seconds, (*label, "ok" if ok else "failed")
                )

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        """vLLM's ``vllm:kv_offload_config_info`` series: the primary's (vLLM's CPU tier's
        labels and ``kvtier_secondary_tiers``), then one per secondary tier; each says its
        ``tier``, ``eviction_policy`` and capacity (``KvtierOffloadingSpec.config_info_keys``
        lists the labels)."""
        s = self.settings
        primary = {
            "cpu_num_chunks": s.num_blocks,
            "cpu_blocks_per_chunk": s.blocks_per_chunk,
            "cpu_kv_cache_size_bytes": s.num_blocks * s.row_bytes,
            # vLLM writes an unknown value as "None".
            "cpu_kv_cache_size_tokens": (
                "None" if s.kv_cache_size_tokens is None else s.kv_cache_size_tokens
            ),
            "kvtier_secondary_tiers": len(s.tiers),
            TIER_LABEL: PRIMARY_TIER,
            "eviction_policy": s.policy,
            "capacity_blocks": s.num_blocks,
            "capacity_bytes": s.num_blocks * s.row_bytes,
        }
        series = [primary]
        capacities = self._native.tier_capacity_blocks
        for (label,), t, blocks in zip(self._tier_labels, s.tiers, capacities):
            series.append(
                {
                    TIER_LABEL: label,
                    "eviction_policy": t.get("eviction_policy", "lru"),
                    "capacity_blocks": blocks,
                    "capacity_bytes": blocks * s.row_bytes,
                }
            )
        return series

    def stats(self) -> dict[str, Any]:
        """kvtier's own counters: lookups, hits, promotions, evictions, pins, and per tier
        its blocks and health."""
        return self._native.stats()

    def shutdown(self) -> None:
        self._native.shutdown()


def _tensor_address(tensor: Any, page_stride: int) -> tuple[int, int, int | None, Any]:
    """The address of block 0, the number of blocks and the GPU (``None``: host memory) of a
    KV tensor, and the object that keeps its memory alive and in place.

    Each block must be one contiguous page of ``page_stride`` bytes, the blocks one after the
    other: the handler copies a block's bytes from its address on."""
    device = None
    if hasattr(tensor, "data_ptr"):  # a torch tensor
        if getattr(tensor, "is_cuda", False):
            device = tensor.device.index if tensor.device.index is not None else 0
        elif str(getattr(tensor, "device", "cpu")) != "cpu":
            raise ConfigError(
                f"kv_caches: a KV tensor is on {tensor.device}; kvtier copies host and CUDA "
                "memory"
            )
        if not tensor.is_contiguous():
            raise ConfigError("kv_caches: a KV tensor is not contiguous")
        blocks = int(tensor.shape[0])
        nbytes = tensor.numel() * tensor.element_size()
        address, keep = int(tensor.data_ptr()), tensor
    else:  # a numpy array or any writable buffer
        if isinstance(tensor, np.ndarray):
            array = tensor
        else:
            # A view of the buffer, held: it keeps the buffer exported (a bytearray cannot be
            # resized under it) and alive.
            array = np.frombuffer(memoryview(tensor), np.uint8)
        if not array.flags.writeable:
            raise ConfigError("kv_caches: a KV tensor is read-only")
        if not array.flags.c_contiguous:
            raise ConfigError("kv_caches: a KV tensor is not contiguous")
        nbytes = array.nbytes
        blocks = nbytes // page_stride if array.ndim <= 1 else int(array.shape[0])
        address, keep = int(array.ctypes.data), array
    if blocks * page_stride != nbytes:
        raise ConfigError(
            f"kv_caches: a tensor of {nbytes} bytes is not {blocks} blocks of {page_stride}"
        )
    return address, blocks, device, keep


class KvtierOffloadingWorker(_base.OffloadingWorker):
    """vLLM 0.33's ``OffloadingWorker`` for one rank: copies its KV tensors' blocks to and
    from its part of the shared region (``submit_*`` never blocks).

    Host tensors are copied on a copy thread; CUDA tensors by kvtier's CUDA engine, each job
    ordered after the work queued so far on the current CUDA stream (a store waits for the
    kernels that write its blocks, a load for those that read the blocks it overwrites)."""

    def __init__(self, kv_caches: Any, settings: Settings, *, rank: int | None = None):
        self.settings = settings
        groups, devices, keep = [], set(), []
        for refs in kv_caches.group_data_refs:
            group = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx]
                address, blocks, device, held = _tensor_address(t.tensor, int(t.page_size_bytes))
                devices.add(device)
                keep.append(held)
                group.append((address, blocks, int(t.page_size_bytes), int(ref.page_size_bytes)))
            groups.append(group)
        if len(devices) > 1:
            raise ConfigError(f"kv_caches: the KV tensors are on several devices {devices}")
        self._device = devices.pop() if devices else None
        self._stream = None
        if self._device is not None:
            import torch

            device = torch.device("cuda", self._device)
            self._stream = lambda: torch.cuda.current_stream(device).cuda_stream
        self._stores: set[int] = set()
        rank = settings.rank if rank is None else rank
        self._native = _native.Worker(
            region_path=settings.region_path,
            rows=settings.num_blocks,
            workers=settings.parts,
            block_bytes_per_worker=settings.block_bytes_per_worker,
            rank=0 if settings.replicated else rank,
            store_share=(rank, settings.workers) if settings.replicated else None,
            groups=groups,
            blocks_per_chunk=settings.blocks_per_chunk,
            attach_timeout_s=settings.attach_timeout_s,
            copy_cpus=settings.copy_cpus,
            copy_threads=settings.copy_threads,
            device=self._device,
            # Held by the handler until its copies have stopped.
            tensors=keep,
        )

    @staticmethod
    def _gpu(spec: Any) -> tuple[list[int], list[int], list[int]]:
        ids = [int(b) for b in spec.block_ids]
        sizes = getattr(spec, "group_sizes", None)
        indices = getattr(spec, "block_indices", None)
        if sizes is None:
            sizes, indices = [len(ids)], [0]
        return ids, [int(s) for s in sizes], [int(i) for i in indices]

    def _submit(self, job_id: int, store: bool, gpu_spec: Any, slots_spec: Any) -> bool:
        ids, sizes, indices = self._gpu(gpu_spec)
        slots = np.asarray(slots_spec.block_ids).tolist()
        stream = self._stream() if self._stream is not None else None
        seal = getattr(slots_spec, "generation", None) if store else None
        if store:
            self._stores.add(job_id)  # before: the job may end before `submit` returns
        queued = self._native.submit(job_id, store, ids, sizes, indices, slots, stream, seal)
        if store and not queued:
            self._stores.discard(job_id)  # never reported by `get_finished`
        return queued

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, True, src_spec, dst_spec)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._submit(job_id, False, dst_spec, src_spec)

    def get_finished(self) -> list[Any]:
        """The jobs that ended since the last call.

        vLLM 0.33 cannot handle a failed transfer (its worker asserts that each succeeded).
        A failed store is reported finished: its rank never sealed its slots, so the manager,
        which checks every rank's seal, does not make its blocks readable, and the store is
        simply not cached. A failed load cannot be hidden (the GPU blocks it was to fill hold
        no valid KV), so it raises ``TransferError`` with the reason."""
        results = []
        for j, ok, size, secs in self._native.get_finished():
            store = j in self._stores
            self._stores.discard(j)
            if not ok:
                reason = self._native.error(j)
                if not store:
                    raise TransferError(f"load job {j} failed: {reason}")
                _log.warning("store job %d failed, its blocks are not cached: %s", j, reason)
                ok = self.settings.verify_stores
            results.append(
                TransferResult(job_id=j, success=ok, transfer_size=size, transfer_time=secs)
            )
        return results

    def error(self, job_id: int) -> str | None:
        """Why job ``job_id`` failed, if it did."""
        return self._native.error(job_id)

    def wait(self, job_ids: set[int]) -> None:
        self._native.wait(list(job_ids))

    def shutdown(self) -> None:
        self._native.shutdown()


class KvtierOffloadingSpec(_base.OffloadingSpec):
    """The spec vLLM's ``OffloadingSpecFactory`` builds for ``spec_name =
    "KvtierOffloadingSpec"``, ``spec_module_path = "kvtier.vllm"``."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        if not HAVE_VLLM:
            return {}
        gauge, hist, counter = (
            _base.OffloadingGaugeMetadata,
            _base.OffloadingHistogramMetadata,
            _base.OffloadingCounterMetadata,
        )
        defs: dict[str, Any] = {
            CPU_CACHE_USAGE_PERC: gauge(
                documentation="Fraction of kvtier's primary slots in use by transfers "
                "(stores, promotions, loads)."
            ),
            CPU_CACHE_WRITE_USAGE_PERC: gauge(
                documentation="Fraction of kvtier's primary slots being written."
            ),
            CPU_CACHE_READ_USAGE_PERC: gauge(
                documentation="Fraction of kvtier's primary slots pinned by loads."
            ),
            CPU_ALLOCATION_SIZE: hist(
                documentation="Blocks each prepare_store set out to allocate.",
                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
            ),
        }
        if int(extra_config.get("store_threshold", 0)) >= 2:
            defs[STORES_SKIPPED] = counter(
                documentation="Stores skipped because the reuse threshold was not reached."
            )
        if extra_config.get("secondary_tiers"):
            defs.update(tier_metric_definitions())
            defs[TIER_PROMOTION_LATENCY] = hist(
                documentation="Seconds from a promotion job's submission to the tier to its "
                "end (queueing included), by result (ok, failed).",
                labelnames=(TIER_LABEL, "result"),
                buckets=PROMOTION_LATENCY_BUCKETS,
            )
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info``: vLLM's CPU tier's, then
        kvtier's. The primary's series fills them all; a secondary tier's fills ``tier``,
        ``eviction_policy``, ``capacity_blocks`` and ``capacity_bytes``."""
        return (
            "cpu_num_chunks",
            "cpu_blocks_per_chunk",
            "cpu_kv_cache_size_bytes",
            "cpu_kv_cache_size_tokens",
            "kvtier_secondary_tiers",
            TIER_LABEL,
            "eviction_policy",
            "capacity_blocks",
            "capacity_bytes",
        )

    def __init__(self, config: Any):
        super().__init__(config)
        self.settings = Settings.from_vllm(config)
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> KvtierOffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self.settings)
        return self._manager

    def get_worker(self, kv_caches: Any) -> KvtierOffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(kv_caches, self.settings)
        return self._worker
