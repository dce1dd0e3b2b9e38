"""Type stub of ``kvtier._native``, the Rust half of the ``kvtier`` package.

``tests/test_native_stub.py`` checks it against the built module: names, parameters,
defaults, properties and exception bases.

A key is ``bytes`` (vLLM's ``OffloadKey``); any other type raises ``TypeError``. A
``req_context`` is vLLM's request context: an object whose ``req_id`` is a ``str``.
"""

from collections.abc import Iterable, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Literal, final

__version__: str

def cuda_driver_present() -> bool:
    """Whether the CUDA driver library can be loaded here (GPU KV caches need it)."""

# Exceptions.

class KvtierError(Exception):
    """Base class of every error kvtier raises."""

class ConfigError(KvtierError, ValueError):
    """A setting is missing or invalid; the message names it."""

class StateError(KvtierError):
    """A call that does not fit the blocks' states was refused; nothing changed."""

class RegionError(KvtierError):
    """The shared CPU region could not be created, attached or used."""

class TierError(KvtierError):
    """A secondary tier could not be opened or used."""

class TransferError(KvtierError):
    """A GPU <-> CPU transfer was refused or failed."""

# Classes.

@final
class Manager:
    """Scheduler-side manager: the core, its shared region and the secondary tiers' IO."""

    def __new__(
        cls,
        *,
        num_blocks: int,
        policy: str,
        region_path: str | PathLike[str],
        block_bytes_per_worker: int,
        workers: int,
        answers: Sequence[Any],
        output_class: type,
        spec_class: type,
        request_class: type,
        chunk_level: Any,
        tiers: Sequence[dict[str, Any]] = ...,
        events: bool = True,
        store_threshold: int = 0,
        max_tracker_size: int = 64000,
        identity: str = "",
        io_threads: int = 4,
        shutdown_timeout_s: float = 30.0,
        prefault_threads: int = 4,
        verify_stores: bool = False,
        hit_pending_timeout_s: float | None = None,
    ) -> Manager:
        """Creates the region at ``region_path`` and opens the secondary ``tiers``.

        ``answers`` are exactly four: vLLM's Miss, Hit, HitPending and Retry, in that order.
        """

    @property
    def region_path(self) -> Path:
        """The shared region's path (``@NAME`` for an anonymous one) the workers attach to."""

    @property
    def num_blocks(self) -> int:
        """Slots in the primary tier."""

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot's row, all workers' parts together."""

    @property
    def tier_capacity_blocks(self) -> list[int]:
        """Blocks each secondary tier can hold, in order."""

    def lookup(self, key: bytes, req_context: Any) -> Any:
        """vLLM's ``lookup``: one of the four ``answers`` (Miss, Hit, HitPending, Retry)."""

    def promoted(self, key: bytes, req_context: Any) -> bool:
        """Whether the request's hit on ``key`` was promoted from a secondary tier."""

    def on_new_request(self, req_context: Any) -> Any:
        """vLLM's ``on_new_request``: a new ``request_class`` context (chunk-level policy)."""

    def prepare_load(self, keys: Iterable[bytes], req_context: Any) -> Any:
        """vLLM's ``prepare_load``: pins the blocks; a ``spec_class`` of their slots."""

    def touch(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        """vLLM's ``touch``: the blocks of ``keys`` were used."""

    def complete_load(self, keys: Iterable[bytes], req_context: Any = None) -> None:
        """vLLM's ``complete_load``: releases the pins of ``prepare_load``."""

    def prepare_store(self, keys: Iterable[bytes], req_context: Any) -> Any | None:
        """vLLM's ``prepare_store``: an ``output_class`` answer, or ``None`` without room."""

    def complete_store(
        self, keys: Iterable[bytes], req_context: Any, success: bool = True
    ) -> None:
        """vLLM's ``complete_store``; with ``verify_stores``, unsealed blocks end failed."""

    def on_request_finished(self, req_context: Any) -> None:
        """vLLM's ``on_request_finished``: the request's key positions order its blocks."""

    def on_schedule_end(self, context: Any = None) -> None:
        """vLLM's ``on_schedule_end``: ends the scheduler step."""

    def take_events(self) -> list[tuple[int, Literal[0, 1, 2], list[bytes]]]:
        """``(tier, kind, keys)`` per event: tier -1 primary; kind 0 stored, 1 removed, 2 discarded."""

    def has_pending_work(self) -> bool:
        """Whether tier IO or promotions are still in flight (false after shutdown)."""

    def reset_cache(self, fence_steps: int | None = None) -> None:
        """vLLM's ``reset_cache``: waits for tier IO, then the primary forgets every block."""

    def on_reset_flushed(self) -> None:
        """vLLM's ``on_reset_flushed``: promotions may take freed slots again."""

    def take_metrics(self) -> tuple[float, float, float, list[int], int | None]:
        """``(usage, write_usage, read_usage, allocation_sizes, stores_skipped)`` of the primary;
        ``stores_skipped`` is ``None`` unless ``store_threshold`` is 2 or more."""

    def take_tier_metrics(self) -> list[dict[str, int | bool | list[tuple[bool, float]]]]:
        """Per secondary tier, its gauges, counters and promotion latencies since the last call."""

    def stats(self) -> dict[str, int | list[dict[str, int | str]]]:
        """The core's counters, ``unsealed``, and per tier (``tiers``) its figures and health."""

    def shutdown(self) -> tuple[int, int, int]:
        """Ends every job and removes the region: ``(drained, ended_failed, abandoned)``."""

@final
class PageCache:
    """kvtier's tiers as a page store that reads and writes the caller's memory by address."""

    def __new__(
        cls,
        *,
        num_blocks: int,
        page_bytes: int,
        region_path: str | PathLike[str],
        policy: str = "lru",
        tiers: Sequence[dict[str, Any]] = ...,
        identity: str = "",
        io_threads: int = 4,
        wait_timeout_s: float = 2.0,
        shutdown_timeout_s: float = 30.0,
    ) -> PageCache:
        """A primary of ``num_blocks`` pages of ``page_bytes`` and the secondary ``tiers``."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""

    @property
    def num_blocks(self) -> int:
        """Pages the primary holds."""

    def exists(self, keys: Iterable[bytes]) -> int:
        """Length of the leading run of ``keys`` Ready in the primary, promotions awaited."""

    def get(self, keys: Iterable[bytes], addrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Copies the pages of ``keys`` into the caller's pieces; per key, whether in full."""

    def set(self, keys: Iterable[bytes], addrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Stores the pages of ``keys`` from the caller's pieces; per key, whether it was Ready
        already or its page was copied in whole (it may since have been evicted, even by this
        call's later keys)."""

    def end_step(self) -> None:
        """Ends a core step: tier IO results are applied, queued promotions go out."""

    def drain(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for tier IO to end; whether none is left."""

    def clear(self, timeout_s: float) -> bool:
        """Forgets every page of the primary once idle (up to ``timeout_s``); whether it did."""

    def stats(self) -> dict[str, int | list[dict[str, int | str]]]:
        """The page calls' counters and the core's (per tier under ``tiers``)."""

    def check_invariants(self) -> None:
        """Checks the core's invariants; raises ``StateError`` on a violation."""

    def shutdown(self) -> None:
        """Waits for tier IO, stops the IO threads and frees the region."""

@final
class HostedTier:
    """One kvtier store as a secondary tier under a host's own tiering manager."""

    def __new__(
        cls,
        address: int,
        length: int,
        row_bytes: int,
        tier: dict[str, Any],
        identity: str,
        io_threads: int = 4,
        wait_deadline_ms: int | None = 5000,
        failures_to_down: int = 3,
        probe_interval_steps: int = 100,
        learn_reads: bool = True,
    ) -> HostedTier:
        """Opens the store ``tier`` describes over the host's ``length`` bytes at ``address``."""

    @property
    def capacity_blocks(self) -> int:
        """Blocks the tier can hold."""

    @property
    def kind(self) -> Literal["file", "redis", "s3"]:
        """The store's kind: ``"file"``, ``"redis"`` or ``"s3"``."""

    def lookup(self, key: bytes) -> Literal[0, 1, 2]:
        """0 miss, 1 hit, 2 retry."""

    def submit_store(self, job: int, keys: Iterable[bytes], chunks: Sequence[int]) -> None:
        """Store job ``job`` writes ``keys`` from the primary chunks ``chunks``."""

    def submit_load(self, job: int, keys: Iterable[bytes], chunks: Sequence[int]) -> None:
        """Load job ``job`` reads ``keys`` into the primary chunks ``chunks``."""

    def finished(self) -> list[tuple[int, bool, list[bytes] | None, int, float | None]]:
        """Jobs ended since the last call: ``(job, success, read_keys, bytes, seconds)``.

        ``read_keys`` lists the keys a failed load did read, else ``None``; ``seconds`` is
        ``None`` for a job that did no IO.
        """

    def touch(self, keys: Iterable[bytes]) -> None:
        """The host used ``keys``."""

    def end_step(self) -> None:
        """The host's step ended; forwards the tier threads' log records."""

    def has_pending_work(self) -> bool:
        """Whether jobs or probes are running."""

    def drain(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for every job to end; ``TierError`` if some still run."""

    def take_events(self) -> list[tuple[bool, list[bytes]]]:
        """``(removed, keys)`` per change of what the tier holds since the last call."""

    def stats(self) -> dict[str, int | bool | str | None]:
        """Gauges now (``up`` a bool), counts since the tier was opened, and ``last_error``;
        empty after shutdown."""

    def shutdown(self, timeout_s: float) -> None:
        """Drains (up to ``timeout_s``), stops the IO threads; ``TierError`` if jobs still run.

        After ``TierError`` the running jobs finish on their own and may still write the host's
        memory: keep it mapped for the life of the process.
        """

    def check_invariants(self) -> None:
        """Checks the tier's invariants; raises ``StateError`` naming a broken one."""

@final
class Worker:
    """One tensor-parallel rank's transfer handler between its KV tensors and the region."""

    def __new__(
        cls,
        *,
        region_path: str | PathLike[str],
        rows: int,
        workers: int,
        block_bytes_per_worker: int,
        rank: int,
        groups: Sequence[Sequence[tuple[int, int, int, int]]],
        blocks_per_chunk: int = 1,
        attach_timeout_s: float = 60.0,
        device: int | None = None,
        tensors: Sequence[Any] = ...,
        copy_cpus: str = "any",
        copy_threads: int = 2,
        store_share: tuple[int, int] | None = None,
    ) -> Worker:
        """Handler of rank ``rank``; ``groups``: per group, ``(address, blocks, stride, page)``."""

    @property
    def chunk_bytes(self) -> list[int]:
        """Bytes of a chunk of each group in this rank's sub-slot."""

    def submit(
        self,
        job_id: int,
        store: bool,
        block_ids: Sequence[int],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slots: Sequence[int],
        stream: int | None = None,
        seal: int | None = None,
    ) -> bool:
        """Starts a store (tensors to region) or load job; whether it was queued (never after
        ``shutdown``)."""

    def get_finished(self) -> list[tuple[int, bool, int, float]]:
        """Jobs ended since the last call: ``(job_id, success, bytes, seconds)``."""

    def error(self, job_id: int) -> str | None:
        """Why job ``job_id`` failed, if it did."""

    def wait(self, job_ids: Sequence[int]) -> None:
        """Waits until none of ``job_ids`` is running."""

    def shutdown(self) -> None:
        """Lets the queued and in-flight jobs finish (``get_finished`` reports them), stops
        the copy thread and drops the CUDA engine; later jobs are refused."""

    def _inject_page_delay(self, micros: int) -> None:
        """Test hook: pauses ``micros`` after each page copy from now on."""
