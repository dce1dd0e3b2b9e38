"""kvtier's file, Redis and S3 tiers as secondary tiers of vLLM 0.33's own tiering spec.

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
- ``KvtierS3Tier``: kvtier's S3 tier (AWS S3 or an S3-compatible server), shared by many
  nodes. Settings: ``bucket``, ``capacity_bytes``, ``eviction_policy``, ``endpoint``,
  ``prefix``, ``region``, ``access_key_id_env``, ``secret_access_key_env``,
  ``session_token_env``, ``virtual_hosted``, ``timeout_ms``, ``retries``, ``conditional_put``.

All also take:

- ``io_threads`` (default 4);
- ``hit_pending_timeout_s`` (default 5; null: none): a block answers RETRY while it is written
  or probed, at most this long, then MISS (its job goes on);
- ``failures_to_down`` (3) and ``probe_interval_steps`` (100): a tier whose jobs fail that
  many times in a row is Down (every lookup a MISS, stores skipped) until a health probe,
  every that many steps, finds it well;
- ``drain_timeout_s`` (default: none): how long ``drain_jobs`` (vLLM's ``reset_cache``) waits
  before it raises ``TierError``. It warns every 10 s while it waits;
- ``shutdown_timeout_s`` (30): how long ``shutdown`` waits for running jobs. After that it
  leaves them to end alone and keeps vLLM's primary memory mapped for the process's life;
- ``learn_reads`` (true): the blocks a promotion read become the tier's most recently used
  when it ends, as a ``touch`` would (vLLM 0.33 never touches its tiers); false leaves the
  tier's recency to its stores alone, for comparison;
- vLLM's ``locality`` and ``enable_kv_events``. The decisions (what the tier holds, what it evicts,
which reads start) are kvtier's core's (rules G1-G16 of ``docs/state-machine.md``); the IO
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
from kvtier._native import ConfigError, StateError, TierError
from kvtier.vllm import (
    _SKIP_REASONS,
    _TIER_COUNTERS,
    layout_identity,
    send_tier_figures,
    tier_metric_definitions,
)

_log = logging.getLogger("kvtier")

_ANSWERS = (LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY)

#: Primary buffers of tiers whose shutdown left jobs running: kept mapped for the process's
#: life, since those jobs may still write into them.
_KEPT_MAPPED: list[Any] = []


def _seconds(tier_type: str, key: str, value: Any, *, none_ok: bool) -> float | None:
    """A setting in seconds: a finite number >= 0 (or None where that means no bound)."""
    if value is None and none_ok:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not (0.0 <= number < float("inf")):
        raise ConfigError(
            f"secondary tier {tier_type}.{key}: {value!r} is not a number of seconds"
        )
    return number


def _count(tier_type: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"secondary tier {tier_type}.{key}: {value!r} is not >= 1")
    return value


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

    #: The kvtier store type: "file", "redis" or "s3".
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
        hit_pending_timeout_s: float | None = 5.0,
        failures_to_down: int = 3,
        probe_interval_steps: int = 100,
        drain_timeout_s: float | None = None,
        shutdown_timeout_s: float = 30.0,
        learn_reads: bool = True,
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
        io_threads = _count(tier_type, "io_threads", io_threads)
        failures_to_down = _count(tier_type, "failures_to_down", failures_to_down)
        probe_interval_steps = _count(tier_type, "probe_interval_steps", probe_interval_steps)
        wait = _seconds(tier_type, "hit_pending_timeout_s", hit_pending_timeout_s, none_ok=True)
        if not isinstance(learn_reads, bool):
            raise ConfigError(
                f"secondary tier {tier_type}.learn_reads: {learn_reads!r} is not a bool"
            )
        self._drain_timeout = _seconds(
            tier_type, "drain_timeout_s", drain_timeout_s, none_ok=True
        )
        self._shutdown_timeout = _seconds(
            tier_type, "shutdown_timeout_s", shutdown_timeout_s, none_ok=False
        )
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
                None if wait is None else int(wait * 1000),
                failures_to_down,
                probe_interval_steps,
                learn_reads,
            )
        except BaseException:
            self._buffer = None
            raise
        self._policy = str(settings.get("eviction_policy", "lru"))
        self._sent: dict[str, int] = {}
        # Jobs refused by the tier (never started): they end failed at the next poll, so
        # vLLM's manager still gets exactly one result for each.
        self._refused: list[JobResult] = []
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

    def _submit(self, submit: Any, job_metadata: TransferJob) -> None:
        try:
            submit(
                job_metadata.job_id,
                list(job_metadata.keys),
                np.asarray(job_metadata.chunk_ids).tolist(),
            )
        except StateError as e:
            # A job id in use, a block or slot named twice, a slot another job is using:
            # the job never starts, and ends failed (nothing is read or written).
            _log.error("kvtier tier %s refused job %s: %s", self._label[0], job_metadata.job_id, e)
            self._refused.append(JobResult(job_id=job_metadata.job_id, success=False))

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._native.submit_store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._native.submit_load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        refused, self._refused = self._refused, []
        return refused + [
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
        return bool(self._refused) or self._native.has_pending_work()

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
                    keys=keys,
                    medium=self.medium,
                    removed=removed,
                    locality=self.locality,
                    # This tier announces its removals itself (evictions, dropped blocks).
                    ownership=self.tier_type,
                    removal_expected=True,
                )
            )
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Waits until every job has ended: no IO touches the primary after it returns. It
        never returns early (a job's copy is never abandoned halfway): it warns every 10 s
        while it waits, and with ``drain_timeout_s`` set raises ``TierError`` after that."""
        waited = 0.0
        while True:
            step = 10.0
            if self._drain_timeout is not None:
                step = min(step, self._drain_timeout - waited)
            try:
                self._native.drain(max(step, 0.0))
                return
            except TierError:
                waited += step
                if self._drain_timeout is not None and waited >= self._drain_timeout:
                    raise
                _log.warning(
                    "kvtier tier %s: jobs still running after %.0f s of drain_jobs (%s)",
                    self._label[0],
                    waited,
                    self._native.stats().get("last_error"),
                )

    def shutdown(self) -> None:
        """Waits up to ``shutdown_timeout_s`` for running jobs, then stops the tier. Jobs that
        still run then (a hung disk or server) are left to end alone, and vLLM's primary
        memory they may write is kept mapped for the process's life; it does not raise, so
        vLLM goes on to shut the other tiers down."""
        buffer, self._buffer = self._buffer, None
        try:
            self._native.shutdown(self._shutdown_timeout)
        except TierError as e:
            _KEPT_MAPPED.append(buffer)
            _log.error(
                "kvtier tier %s: shut down with jobs still running; its primary memory stays "
                "mapped until the process exits: %s",
                self._label[0],
                e,
            )

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return tier_metric_definitions()

    def get_stats(self) -> Any:
        """kvtier's per-tier figures (label ``tier``): gauges as they are, counters as their
        increase since the previous call. vLLM's manager adds its own per-tier read, write,
        failure and latency figures."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        # The native counts are totals; vLLM's counters take increases. A reason this tier
        # never skips for (back-pressure is vLLM's own here) counts 0.
        counters = {key for _, key, _ in _TIER_COUNTERS} | {key for _, key in _SKIP_REASONS}
        now = {**dict.fromkeys(counters, 0), **self._native.stats()}
        stats = OffloadingConnectorStats()
        figures = {
            k: v - self._sent.get(k, 0) if k in counters else v
            for k, v in now.items()
            if isinstance(v, int)
        }
        send_tier_figures(stats, self._label, figures, every=not self._sent)
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


class KvtierS3Tier(_KvtierTier):
    """kvtier's S3 tier under vLLM's tiering spec: one bucket shared by every node that names
    the same bucket, prefix and model; objects are checked before they are served, and
    existence is probed without blocking the scheduler (a lookup answers RETRY until the
    probe returns)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    _default_locality = Locality.REMOTE
    _store = "s3"


__all__ = ["KvtierFileTier", "KvtierRedisTier", "KvtierS3Tier"]
