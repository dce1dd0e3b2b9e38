"""kvtier's file and Redis tiers as secondary tiers of vLLM 0.33's own tiering spec.

vLLM's ``TieringOffloadingSpec`` keeps vLLM's CPU tier as the primary and loads an
out-of-tree secondary tier by class name and module::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64000000000,
        "secondary_tiers": [{"type": "KvtierFileTier", "module_path": "kvtier.vllm_tiers",
                             "path": "/mnt/nvme/kvtier", "capacity_bytes": 1000000000000}]}}'

- ``KvtierFileTier``: kvtier's file tier (bounded, evicting, checksummed, crash-safe, locked
  against a second opener). Settings: ``path``, ``capacity_bytes``, ``eviction_policy``
  (``lru``, ``arc``, ``reuse``), ``fsync``.
- ``KvtierRedisTier``: kvtier's Redis or Redis Cluster tier, shared by many nodes. Settings:
  ``urls``, ``capacity_bytes``, ``eviction_policy``, ``cluster``, ``namespace``,
  ``timeout_ms``, ``ttl_s``, ``username_env``, ``password_env``, ``tls``, ``tls_ca_file``.

Both also take ``io_threads`` (default 4), ``drain_timeout_s`` (default 60), and vLLM's
``locality`` and ``enable_kv_events``. The decisions (what the tier holds, what it evicts,
which reads start) are kvtier's core's (rules G1-G10 of ``docs/state-machine.md``); the IO
runs on kvtier's threads, never on the scheduler's.

This module needs vLLM 0.33 or later (``vllm.v1.kv_offload.tiering``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import numpy as np

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier import _native
from kvtier._native import ConfigError
from kvtier.vllm import (
    _SKIP_REASONS,
    _TIER_COUNTERS,
    _TIER_GAUGES,
    TIER_CASCADES_SKIPPED,
    TIER_LABEL,
    layout_identity,
)

_log = logging.getLogger("kvtier")

_ANSWERS = (LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY)

#: Settings of this module's own, not the store's.
_OWN = ("io_threads", "drain_timeout_s")


def _label(spec: Any, tier_type: str, settings: dict[str, Any]) -> tuple[str]:
    """vLLM's ``tier`` label of this tier, ``"{i+1}:{type}"`` for ``secondary_tiers[i]``:
    the first table of this type whose settings are these."""
    tables = (getattr(spec, "extra_config", None) or {}).get("secondary_tiers") or []
    for i, t in enumerate(tables):
        if t.get("type") == tier_type and all(t.get(k) == v for k, v in settings.items()):
            return (f"{i + 1}:{tier_type}",)
    return (f"?:{tier_type}",)


class _KvtierTier(SecondaryTierManager):
    """A kvtier store under vLLM's ``TieringOffloadingManager``."""

    #: The kvtier store type: "file" or "redis".
    _store: ClassVar[str]
    _default_locality: ClassVar[Locality | None] = None

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        locality: str | None = None,
        enable_kv_events: bool = False,
        io_threads: int = 4,
        drain_timeout_s: float = 60.0,
        **settings: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else self._default_locality
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                _log.warning(
                    "enable_kv_events is set on secondary tier %r but KV cache events are "
                    "disabled globally; the tier emits none",
                    tier_type,
                )
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"secondary tier {tier_type}.io_threads: {io_threads!r} is not >= 1")
        try:
            self._drain_timeout = float(drain_timeout_s)
        except (TypeError, ValueError):
            raise ConfigError(
                f"secondary tier {tier_type}.drain_timeout_s: {drain_timeout_s!r} is not a number"
            ) from None
        self._label = _label(offloading_spec, tier_type, settings)
        config = offloading_spec.config
        par = config.parallel
        table = {"type": self._store, **settings}
        # Data-parallel engines on one node share the config: each gets its own directory.
        if "path" in table and int(getattr(par, "data_parallel_size", 1) or 1) > 1:
            table["path"] = os.path.join(str(table["path"]), f"dp{par.data_parallel_index}")
        # An export of vLLM's primary buffer: it stays mapped while the tier's threads may
        # touch it, and is given back at shutdown (before vLLM releases its view).
        self._buffer: np.ndarray | None = np.frombuffer(primary_kv_view, dtype=np.uint8)
        if not self._buffer.flags.writeable:
            raise ConfigError("the primary tier's memory view is read-only")
        # Blocks in vLLM's primary rows are laid out as vLLM's CPU tier lays them out, not
        # as kvtier's region does: a tier of either kind refuses the other's blocks.
        identity = layout_identity(config, "kvtier/vllm-tiering/")
        try:
            self._native = _native.HostedTier(
                self._buffer.ctypes.data,
                self._buffer.nbytes,
                self.block_size_bytes,
                table,
                identity,
                io_threads,
            )
        except BaseException:
            self._buffer = None
            raise
        self._policy = str(settings.get("eviction_policy", "lru"))
        self._sent: dict[str, int] = {}
        _log.info(
            "kvtier %s tier %s: %d blocks of %d bytes",
            self._store,
            self._label[0],
            self._native.capacity_blocks,
            self.block_size_bytes,
        )

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _ANSWERS[self._native.lookup(key)]

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._native.submit_store(
            job_metadata.job_id,
            list(job_metadata.keys),
            np.asarray(job_metadata.chunk_ids).tolist(),
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._native.submit_load(
            job_metadata.job_id,
            list(job_metadata.keys),
            np.asarray(job_metadata.chunk_ids).tolist(),
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [
            JobResult(
                job_id=job,
                success=success,
                successful_keys=tuple(keys) if keys is not None else None,
                transfer_time=seconds,
                transfer_bytes=nbytes or None,
            )
            for job, success, keys, nbytes, seconds in self._native.finished()
        ]

    def has_pending_work(self) -> bool:
        return self._native.has_pending_work()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._native.touch(list(keys))

    def on_schedule_end(self, context: Any) -> None:
        self._native.end_step()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            self._native.take_events()  # not kept
            return ()
        for removed, keys in self._native.take_events():
            self._events.append(
                OffloadingEvent(
                    keys=keys, medium=self.medium, removed=removed, locality=self.locality
                )
            )
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Waits until every job has ended: no IO touches the primary after it returns. A
        tier whose IO hangs raises ``TierError`` after ``drain_timeout_s`` instead of
        returning early (a job's copy is never abandoned halfway)."""
        self._native.drain(self._drain_timeout)

    def shutdown(self) -> None:
        try:
            self._native.shutdown(self._drain_timeout)
        finally:
            self._buffer = None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import (
            OffloadingCounterMetadata,
            OffloadingGaugeMetadata,
        )

        tier = (TIER_LABEL,)
        defs: dict[str, Any] = {}
        for name, _, doc in _TIER_GAUGES:
            defs[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=tier)
        for name, _, doc in _TIER_COUNTERS:
            defs[name] = OffloadingCounterMetadata(documentation=doc, labelnames=tier)
        defs[TIER_CASCADES_SKIPPED] = OffloadingCounterMetadata(
            documentation="Cascaded blocks not written to the tier, by reason: backpressure "
            "(its writes at their bound), tier_down (not Up), tier_full (no room could be made).",
            labelnames=(TIER_LABEL, "reason"),
        )
        return defs

    def get_stats(self) -> Any:
        """kvtier's per-tier figures (label ``tier``): gauges as they are, counters as their
        increase since the previous call. vLLM's manager adds its own per-tier read, write,
        failure and latency figures."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        now = self._native.stats()
        stats = OffloadingConnectorStats()
        for name, key, _ in _TIER_GAUGES:
            stats.set_gauge(name, int(now[key]), self._label)
        first = not self._sent
        for name, key, _ in _TIER_COUNTERS:
            delta = now[key] - self._sent.get(key, 0)
            if first or delta:
                stats.increase_counter(name, delta, self._label)
        for reason, key in _SKIP_REASONS:
            delta = now.get(key, 0) - self._sent.get(key, 0)
            if first or delta:
                stats.increase_counter(TIER_CASCADES_SKIPPED, delta, (*self._label, reason))
        self._sent = {k: v for k, v in now.items() if isinstance(v, int)}
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("eviction_policy", "capacity_blocks", "capacity_bytes")

    def config_info(self) -> dict[str, Any]:
        blocks = self._native.capacity_blocks
        return {
            "eviction_policy": self._policy,
            "capacity_blocks": blocks,
            "capacity_bytes": blocks * self.block_size_bytes,
        }

    def stats(self) -> dict[str, Any]:
        """kvtier's counts since the tier was opened: lookups by answer, blocks stored,
        loaded, evicted and skipped, failures, and the last store error."""
        return self._native.stats()

    def check_invariants(self) -> None:
        """Raises ``StateError`` naming the first broken invariant (I13 and the tier
        index's)."""
        self._native.check_invariants()


class KvtierFileTier(_KvtierTier):
    """kvtier's file tier under vLLM's tiering spec: a bound in bytes, eviction by
    ``eviction_policy``, a checksum per block (a block that fails it is never loaded),
    crash-safe records, and a lock against a second process on the same path."""

    medium: ClassVar[Medium] = Medium.STORAGE
    _store = "file"


class KvtierRedisTier(_KvtierTier):
    """kvtier's Redis or Redis Cluster tier under vLLM's tiering spec: shared by every node
    that names the same servers and namespace; existence is probed without blocking the
    scheduler (a lookup answers RETRY until the probe returns)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    _default_locality = Locality.REMOTE
    _store = "redis"


__all__ = ["KvtierFileTier", "KvtierRedisTier"]
