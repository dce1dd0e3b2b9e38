"""vLLM 0.33.0's own KV-offloading managers as a differential oracle.

Runs vLLM's ``CPUOffloadingManager`` (LRU or ARC) or its ``TieringOffloadingManager`` (a CPU
primary tier plus scripted secondary tiers) in a subprocess that speaks JSON lines: one
request object per line on stdin, one response object per line on stdout. Logging goes to
stderr (level from ``KVTIER_ORACLE_LOG``, default WARNING).

vLLM comes from the install that ``scripts/vllm-oracle-setup.sh`` makes outside the clone:
``--vllm-dir DIR``, else ``$KVTIER_VLLM_DIR``, else ``${KVTIER_CACHE:-~/.cache/kvtier}/vllm-0.33.0``.
The few modules the managers import from the rest of vLLM (and torch) are stand-ins in
``fakes/`` next to this file; no manager or policy logic is faked.

Protocol
========

On start the oracle prints ``{"ready": {"vllm": "0.33.0", "python": "3.11.7", "site": DIR}}``,
or ``{"error": "..."}`` and exits with status 2 when vLLM cannot be imported.

Every request is ``{"op": NAME, ...fields}``. The answer is ``{"result": VALUE}`` or
``{"error": MESSAGE, "type": EXCEPTION_CLASS}``; an error (a bad request, or an exception
vLLM raised, e.g. an ``AssertionError`` of a misused manager) never ends the process.
End of input ends it with status 0.

Keys (``OffloadKey``) are raw bytes sent as lowercase hex strings. vLLM builds them as the
block hash followed by the KV-cache group index in 4 big-endian bytes; the oracle takes any
bytes. Requests are named by ``req`` (a string, vLLM's ``req_id``); the oracle keeps one
``ReqContext`` per name from ``new_request`` until ``drop_request``, because vLLM keeps
request-scoped state in it (recency rank, keys seen, token positions) and completions may
arrive after ``request_finished``.

Managers (one at a time; creating one drops the previous manager and all requests, once the
new one has been built):

- ``create_cpu {num_blocks, policy: "lru"|"arc", events: bool=true, store_threshold: int=1,
  max_tracker_size: int=64000}`` -> null. ``CPUOffloadingManager(num_chunks=num_blocks, ...)``.
- ``create_tiering {num_blocks, policy, events: bool=true, block_bytes: int=16,
  tiers: [{medium: "CPU"|"STORAGE"=STORAGE, locality: "LOCAL"|"REMOTE"|null,
  request_level: bool=false, drain_success: bool=true}]}`` -> null.
  ``TieringOffloadingManager`` over ``CPUPrimaryTierOffloadingManager`` (with an in-memory
  region of ``num_blocks x block_bytes`` instead of shared memory) and one scripted tier per
  entry (see "Scripted tiers"). The tier-poll thread is off.

The manager API (every call holds ``manager.lock``, as vLLM's scheduler does):

- ``new_request {req, kv_transfer_params: obj|null, load_tiers: [{medium, locality}]|null}``
  -> ``"chunk_level"|"request_level"``: ``on_new_request``. ``load_tiers`` becomes the
  context's ``TierFilter`` (absent: all tiers).
- ``set_positions {req, positions: [[key, end_token], ...]}`` -> null:
  ``ReqContext.set_offload_key_position`` (vLLM's scheduler records each key's end-token
  position as soon as the block hash exists; policies order a request's keys by it).
- ``lookup {req, key}`` -> ``"HIT"|"MISS"|"HIT_PENDING"|"RETRY"``.
- ``lookup_many {req, keys, until_miss: bool=true}`` -> list of those, one ``lookup`` per key,
  stopping after the first MISS when ``until_miss``.
- ``get_load_source {req, key}`` -> ``"host"|"disk"|"p2p"|"device"|"external_unspecified"``.
- ``prepare_load {req, keys}`` -> ``{"block_ids": [int]}`` (the CPU chunk ids, in key order).
- ``touch {req, keys}`` -> null.
- ``complete_load {req, keys}`` -> null.
- ``prepare_store {req, keys}`` -> null (cannot store: not enough evictable blocks) or
  ``{"keys_to_store": [key], "block_ids": [int], "evicted_keys": [key]}``; ``block_ids[i]``
  is the chunk allocated to ``keys_to_store[i]``.
- ``complete_store {req, keys, success: bool=true}`` -> null.
- ``request_finished {req}`` -> null: ``on_request_finished`` (the context is kept).
- ``drop_request {req}`` -> null: forget the context (oracle bookkeeping only).
- ``schedule_end {new_req_ids: [req]=[], preempted_req_ids: [req]=[]}`` -> null:
  ``on_schedule_end(ScheduleEndContext(...))``.
- ``take_events`` -> ``[{"keys": [key], "medium": "CPU"|"STORAGE", "removed": bool,
  "locality": "LOCAL"|"REMOTE"|null, "ownership": str|null, "removal_expected": bool,
  "metadata_only": bool}]`` (empty when the manager was created with ``events: false``).
- ``get_stats`` -> null or ``{"metrics": [{"name": str, "type": "counter"|"gauge"|"histogram",
  "labels": [str], "value": number | [number]}], "info": [obj]|null}``: one entry per
  (metric, label values) of the ``OffloadingConnectorStats`` payload; a histogram's value is
  its list of observations. ``get_stats`` resets the per-interval parts, as in vLLM.
- ``has_pending_work`` -> bool.
- ``reset_cache`` -> null; ``reset_flushed`` -> null (``on_reset_flushed``).
- ``config_info`` -> list of objects.
- ``shutdown`` -> null (the oracle then has no manager).
- ``inspect`` -> the manager's private state, read from 0.33's attributes (introspection for
  differential checks, not part of vLLM's API): ``{"num_blocks", "allocated", "free_list",
  "evictable", "write_pending", "blocks": [{"key", "block_id", "ref_cnt"}], "policy": P}``
  where P is ``{"kind": "lru", "order": [key], "evictable": [key]}`` (every block by rank,
  first evicted first; the evictable ones in the same order) or ``{"kind": "arc",
  "target_t1_size": float, "t1": [key], "t2": [key], "b1": [key], "b2": [key]}`` (each list
  least recent first). A tiering manager adds ``"tiering": {"jobs": [{"job_id", "tier",
  "is_promotion", "keys", "block_ids", "req"}], "pending_promotions": [{"tier", "req",
  "keys", "block_ids"}], "requests": {req: {"pending_primary_stores", "is_finished",
  "request_level_tiers", "pending_cascade_keys"}}, "promotions_held": bool}``.

Scripted tiers
==============

A scripted tier is a ``SecondaryTierManager`` whose outside world the client plays: it holds
a set of keys, answers ``lookup`` from it (RETRY for keys marked retry, HIT for held keys,
MISS otherwise), and records the jobs the manager submits until the client finishes them.

- ``tier_jobs {tier}`` -> ``[{"job_id", "keys", "block_ids", "is_promotion", "req"}]``: jobs
  submitted and not yet finished, oldest first.
- ``tier_finish {tier, job_id, success: bool=true, successful_keys: [key]|null}`` -> null:
  the job's ``JobResult`` is returned by the tier's next ``get_finished_jobs`` (which the
  manager polls at its own times). A successful store adds its keys to the tier.
- ``tier_put {tier, keys}`` / ``tier_remove {tier, keys}`` -> null: change the held keys.
- ``tier_retry {tier, keys, retry: bool=true}`` -> null: lookups of these keys answer RETRY.
- ``tier_keys {tier}`` -> held keys, in insertion order.
- ``tier_calls {tier}`` -> the calls the manager made into the tier since the last
  ``tier_calls``: ``{"call": "lookup", "key", "req"}``, ``{"call": "submit_store"|
  "submit_load", "job_id"}``, ``{"call": "touch", "keys", "req"}``, ``{"call":
  "on_new_request"|"on_request_finished", "req"}``, ``{"call": "on_schedule_end"}``,
  ``{"call": "drain_jobs"}``. (``get_finished_jobs`` polls are not recorded.)

``drain_jobs`` (called by ``reset_cache``) finishes every unfinished job with the tier's
``drain_success``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

VLLM_VERSION = "0.33.0"
ENV_DIR = "KVTIER_VLLM_DIR"
SETUP_HINT = "run scripts/vllm-oracle-setup.sh"


class OracleSetupError(RuntimeError):
    """vLLM is not installed where the oracle looks for it."""


def default_install_dir() -> str:
    """``${KVTIER_CACHE:-~/.cache/kvtier}/vllm-0.33.0``."""
    cache = os.environ.get("KVTIER_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvtier"
    )
    return os.path.join(cache, f"vllm-{VLLM_VERSION}")


def load_vllm(install_dir: str | None = None) -> SimpleNamespace:
    """Import vLLM 0.33.0's offloading managers from an install made by the setup script.

    Puts the install's ``site/`` and this file's ``fakes/`` on ``sys.path`` (the two merge
    into the ``vllm`` namespace package) and returns the modules and names the oracle uses.
    """
    install_dir = install_dir or os.environ.get(ENV_DIR) or default_install_dir()
    site = os.path.join(install_dir, "site")
    manager_py = os.path.join(site, "vllm", "v1", "kv_offload", "cpu", "manager.py")
    if not os.path.isfile(manager_py):
        raise OracleSetupError(
            f"vLLM {VLLM_VERSION} oracle not installed at {install_dir}: {SETUP_HINT}"
        )
    metadata = os.path.join(site, f"vllm-{VLLM_VERSION}.dist-info", "METADATA")
    version = None
    if os.path.isfile(metadata):
        with open(metadata, encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
                    break
    if version != VLLM_VERSION:
        raise OracleSetupError(
            f"{install_dir} holds vLLM {version}, not {VLLM_VERSION}: {SETUP_HINT}"
        )

    fakes = str(Path(__file__).resolve().parent / "fakes")
    for path in (site, fakes):  # fakes end up first: they win over any installed torch
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)

    def mod(name: str):
        m = importlib.import_module(name)
        if name.startswith("vllm.") and not os.path.realpath(m.__file__).startswith(
            os.path.realpath(site)
        ):
            raise OracleSetupError(f"{name} was imported from {m.__file__}, not from {site}")
        return m

    base = mod("vllm.v1.kv_offload.base")
    cpu_manager = mod("vllm.v1.kv_offload.cpu.manager")
    cpu_common = mod("vllm.v1.kv_offload.cpu.common")
    lru = mod("vllm.v1.kv_offload.cpu.policies.lru")
    arc = mod("vllm.v1.kv_offload.cpu.policies.arc")
    tiering_base = mod("vllm.v1.kv_offload.tiering.base")
    tiering_manager = mod("vllm.v1.kv_offload.tiering.manager")
    metrics = mod("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics")
    return SimpleNamespace(
        version=version,
        site=site,
        base=base,
        cpu_manager=cpu_manager,
        cpu_common=cpu_common,
        lru=lru,
        arc=arc,
        tiering_base=tiering_base,
        tiering_manager=tiering_manager,
        metrics=metrics,
        ReqContext=base.ReqContext,
        LookupResult=base.LookupResult,
        ScheduleEndContext=base.ScheduleEndContext,
        TierFilter=base.TierFilter,
        TierMatcher=base.TierMatcher,
        Medium=base.Medium,
        Locality=base.Locality,
        make_offload_key=base.make_offload_key,
        CPUOffloadingManager=cpu_manager.CPUOffloadingManager,
        CPUPrimaryTierOffloadingManager=tiering_manager.CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager=tiering_manager.TieringOffloadingManager,
        SecondaryTierManager=tiering_base.SecondaryTierManager,
        JobResult=tiering_base.JobResult,
        LRUCachePolicy=lru.LRUCachePolicy,
        ARCCachePolicy=arc.ARCCachePolicy,
    )


class RequestError(ValueError):
    """A malformed request (the client's fault, not vLLM's)."""


def _hex(key: bytes) -> str:
    return bytes(key).hex()


def _hexes(keys) -> list[str]:
    return [bytes(k).hex() for k in keys]


def _key(value: Any) -> bytes:
    if not isinstance(value, str):
        raise RequestError(f"a key is a hex string, got {value!r}")
    try:
        return bytes.fromhex(value)
    except ValueError as e:
        raise RequestError(f"bad hex key {value!r}: {e}") from None


def _keys(value: Any) -> list[bytes]:
    if not isinstance(value, list):
        raise RequestError(f"keys are a list of hex strings, got {value!r}")
    return [_key(v) for v in value]


def _field(msg: dict, name: str, kind=None, default=...):
    if name not in msg:
        if default is ...:
            raise RequestError(f"missing field {name!r}")
        return default
    value = msg[name]
    if kind is not None and value is not None and not isinstance(value, kind):
        raise RequestError(f"field {name!r} has the wrong type: {value!r}")
    if kind is int and isinstance(value, bool):
        raise RequestError(f"field {name!r} has the wrong type: {value!r}")
    return value


def offloading_config(
    vllm, extra, *, worker_bytes=8192, world=1, rank=0, bpc=1, events=True,
    model="test/model", tp=None, pp=1, engine_id="engine-0", replicated=False,
    max_model_len=4096,
):
    """An ``OffloadingConfig`` as vLLM's connector builds it for one KV cache group of
    16-token blocks (``py/tests`` and ``py/bench`` build their specs from it)."""
    from vllm.v1.kv_offload import config as c

    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=events,
        replicated_layout=replicated,
        extra_config=extra,
        engine_id=engine_id,
        model=c.OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=max_model_len),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=c.OffloadingParallelConfig(
            rank=rank,
            world_size=world,
            tp_size=world if tp is None else tp,
            pp_size=pp,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


class HostRegion:
    """A primary tier's memory as vLLM's ``SharedOffloadRegion`` hands it over: a view of
    ``memory``, which the caller owns (``py/tests`` and ``py/bench`` map it page-aligned, as
    vLLM's region is)."""

    def __init__(self, memory):
        self.memory = memory

    def create_kv_memoryview(self):
        return memoryview(self.memory)

    def cleanup(self):
        pass


class _MemoryRegion:
    """In-memory stand-in for the primary tier's SharedOffloadRegion (scheduler side)."""

    def __init__(self, num_chunks: int, row_bytes: int):
        # A memoryview cannot have a zero dimension: an empty tier still gets one row.
        self._shape = (max(num_chunks, 1), row_bytes)
        self._buf = bytearray(self._shape[0] * row_bytes)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self._buf).cast("B", self._shape)

    def cleanup(self) -> None:
        return


def make_scripted_tier_classes(vllm: SimpleNamespace) -> dict[str, type]:
    """One scripted SecondaryTierManager class per medium (the class's medium decides the
    cache-hit source vLLM reports, at class creation)."""
    LookupResult = vllm.LookupResult
    RequestOffloadingContext = vllm.base.RequestOffloadingContext
    OffloadPolicy = vllm.base.OffloadPolicy
    JobResult = vllm.JobResult

    class ScriptedTier(vllm.SecondaryTierManager):
        def __init__(self, primary_kv_view, locality, request_level, drain_success):
            super().__init__(
                offloading_spec=None,
                primary_kv_view=primary_kv_view,
                tier_type=f"scripted-{self.medium.value.lower()}",
            )
            self.locality = locality
            self.request_level = request_level
            self.drain_success = drain_success
            self.held: dict[bytes, None] = {}
            self.retry: set[bytes] = set()
            self.pending: dict[int, Any] = {}
            self.finished: list[Any] = []
            self.calls: list[dict] = []

        def lookup(self, key, req_context):
            self.calls.append({"call": "lookup", "key": _hex(key), "req": req_context.req_id})
            if key in self.retry:
                return LookupResult.RETRY
            if key in self.held:
                return LookupResult.HIT
            return LookupResult.MISS

        def submit_store(self, job_metadata):
            self.calls.append({"call": "submit_store", "job_id": job_metadata.job_id})
            self.pending[job_metadata.job_id] = job_metadata

        def submit_load(self, job_metadata):
            self.calls.append({"call": "submit_load", "job_id": job_metadata.job_id})
            self.pending[job_metadata.job_id] = job_metadata

        def get_finished_jobs(self):
            finished, self.finished = self.finished, []
            return finished

        def touch(self, keys, req_context):
            self.calls.append({"call": "touch", "keys": _hexes(keys), "req": req_context.req_id})

        def on_new_request(self, req_context):
            self.calls.append({"call": "on_new_request", "req": req_context.req_id})
            if self.request_level:
                return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
            return RequestOffloadingContext()

        def on_request_finished(self, req_context):
            self.calls.append({"call": "on_request_finished", "req": req_context.req_id})

        def on_schedule_end(self, context):
            self.calls.append({"call": "on_schedule_end"})

        def drain_jobs(self):
            self.calls.append({"call": "drain_jobs"})
            for job_id in list(self.pending):
                self.finish(job_id, self.drain_success, None)

        def finish(self, job_id, success, successful_keys):
            job = self.pending.pop(job_id, None)
            if job is None:
                raise RequestError(f"job {job_id} is not an unfinished job of this tier")
            if success and not job.is_promotion:
                for key in job.keys:
                    self.held[key] = None
            self.finished.append(
                JobResult(job_id=job_id, success=success, successful_keys=successful_keys)
            )

    return {
        medium.value: type(f"Scripted{medium.value.title()}Tier", (ScriptedTier,), {"medium": medium})
        for medium in vllm.Medium
    }


class Oracle:
    """Holds one vLLM manager, its request contexts and scripted tiers; answers requests."""

    def __init__(self, vllm: SimpleNamespace):
        self.vllm = vllm
        self.tier_classes = make_scripted_tier_classes(vllm)
        self.manager = None
        self.primary = None
        self.tiers: list = []
        self.requests: dict[str, Any] = {}

    # --- plumbing ---

    def handle_line(self, line: str) -> dict:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            return {"error": f"bad JSON: {e}", "type": "RequestError"}
        if not isinstance(msg, dict):
            return {"error": "a request is a JSON object", "type": "RequestError"}
        try:
            return {"result": self.handle(msg)}
        except Exception as e:  # noqa: BLE001 - every failure is an answer
            text = str(e)
            return {
                "error": f"{type(e).__name__}: {text}" if text else type(e).__name__,
                "type": type(e).__name__,
            }

    def handle(self, msg: dict) -> Any:
        op = _field(msg, "op", str)
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise RequestError(f"unknown op {op!r}")
        if op.startswith(("create_", "tier_")) or op in ("shutdown", "drop_request"):
            return handler(msg)
        manager = self._manager()
        with manager.lock:
            return handler(msg)

    def _manager(self):
        if self.manager is None:
            raise RequestError("no manager: send create_cpu or create_tiering first")
        return self.manager

    def _req(self, msg: dict):
        name = _field(msg, "req", str)
        ctx = self.requests.get(name)
        if ctx is None:
            raise RequestError(f"unknown request {name!r}: send new_request first")
        return ctx

    def _tier(self, msg: dict):
        index = _field(msg, "tier", int)
        if not 0 <= index < len(self.tiers):
            raise RequestError(f"no scripted tier {index} (there are {len(self.tiers)})")
        return self.tiers[index]

    def _drop_manager(self) -> None:
        if self.manager is not None:
            try:
                self.manager.shutdown()
            finally:
                self.manager = None
                self.primary = None
                self.tiers = []
                self.requests = {}

    # --- managers ---

    def op_create_cpu(self, msg: dict) -> None:
        num_blocks = _field(msg, "num_blocks", int)
        policy = _field(msg, "policy", str, "lru")
        events = _field(msg, "events", bool, True)
        store_threshold = _field(msg, "store_threshold", int, 1)
        max_tracker_size = _field(msg, "max_tracker_size", int, 64_000)
        manager = self.vllm.CPUOffloadingManager(
            num_chunks=num_blocks,
            cache_policy=policy,
            enable_events=events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
        )
        self._drop_manager()
        self.manager = self.primary = manager

    def op_create_tiering(self, msg: dict) -> None:
        num_blocks = _field(msg, "num_blocks", int)
        policy = _field(msg, "policy", str, "lru")
        events = _field(msg, "events", bool, True)
        block_bytes = _field(msg, "block_bytes", int, 16)
        tier_specs = _field(msg, "tiers", list, [])
        if block_bytes < 1:
            raise RequestError("block_bytes must be at least 1")
        primary = self.vllm.CPUPrimaryTierOffloadingManager(
            num_chunks=num_blocks,
            mmap_region=_MemoryRegion(num_blocks, block_bytes),
            cache_policy=policy,
            enable_events=events,
        )
        view = primary.get_kv_memoryview()
        tiers = []
        for spec in tier_specs:
            if not isinstance(spec, dict):
                raise RequestError(f"a tier is an object, got {spec!r}")
            medium = _field(spec, "medium", str, "STORAGE")
            cls = self.tier_classes.get(medium)
            if cls is None:
                raise RequestError(f"unknown medium {medium!r}")
            locality = _field(spec, "locality", str, None)
            tiers.append(
                cls(
                    view,
                    None if locality is None else self.vllm.Locality(locality),
                    _field(spec, "request_level", bool, False),
                    _field(spec, "drain_success", bool, True),
                )
            )
        manager = self.vllm.TieringOffloadingManager(
            primary_tier=primary, secondary_tiers=tiers, tier_poll_interval_s=0
        )
        self._drop_manager()
        self.manager = manager
        self.primary = primary
        self.tiers = tiers

    def op_shutdown(self, msg: dict) -> None:
        self._manager()
        self._drop_manager()

    # --- requests ---

    def op_new_request(self, msg: dict) -> str:
        name = _field(msg, "req", str)
        if name in self.requests:
            raise RequestError(f"request {name!r} exists (drop_request it first)")
        params = _field(msg, "kv_transfer_params", dict, None)
        load_tiers = _field(msg, "load_tiers", list, None)
        kwargs = {"req_id": name, "kv_transfer_params": params}
        if load_tiers is not None:
            matchers = []
            for m in load_tiers:
                medium = _field(m, "medium", str, None)
                locality = _field(m, "locality", str, None)
                matchers.append(
                    self.vllm.TierMatcher(
                        medium=None if medium is None else self.vllm.Medium(medium),
                        locality=None if locality is None else self.vllm.Locality(locality),
                    )
                )
            kwargs["load_tier_filter"] = self.vllm.TierFilter(matchers=tuple(matchers))
        ctx = self.vllm.ReqContext(**kwargs)
        result = self.manager.on_new_request(ctx)
        self.requests[name] = ctx
        return result.policy.value

    def op_set_positions(self, msg: dict) -> None:
        ctx = self._req(msg)
        positions = _field(msg, "positions", list)
        parsed = []
        for pair in positions:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)):
                raise RequestError(f"a position is [hex key, end token], got {pair!r}")
            parsed.append((_key(pair[0]), pair[1]))
        for key, end_token in parsed:
            ctx.set_offload_key_position(key, end_token)

    def op_drop_request(self, msg: dict) -> None:
        self._req(msg)
        del self.requests[msg["req"]]

    def op_request_finished(self, msg: dict) -> None:
        self.manager.on_request_finished(self._req(msg))

    # --- the manager API ---

    def op_lookup(self, msg: dict) -> str:
        return self.manager.lookup(_key(_field(msg, "key")), self._req(msg)).name

    def op_lookup_many(self, msg: dict) -> list[str]:
        ctx = self._req(msg)
        keys = _keys(_field(msg, "keys"))
        until_miss = _field(msg, "until_miss", bool, True)
        out = []
        for key in keys:
            result = self.manager.lookup(key, ctx)
            out.append(result.name)
            if until_miss and result is self.vllm.LookupResult.MISS:
                break
        return out

    def op_get_load_source(self, msg: dict) -> str:
        source = self.manager.get_load_source(_key(_field(msg, "key")), self._req(msg))
        return source.value

    def op_prepare_load(self, msg: dict) -> dict:
        spec = self.manager.prepare_load(_keys(_field(msg, "keys")), self._req(msg))
        return {"block_ids": [int(b) for b in spec.block_ids]}

    def op_touch(self, msg: dict) -> None:
        self.manager.touch(_keys(_field(msg, "keys")), self._req(msg))

    def op_complete_load(self, msg: dict) -> None:
        self.manager.complete_load(_keys(_field(msg, "keys")), self._req(msg))

    def op_prepare_store(self, msg: dict) -> dict | None:
        out = self.manager.prepare_store(_keys(_field(msg, "keys")), self._req(msg))
        if out is None:
            return None
        return {
            "keys_to_store": _hexes(out.keys_to_store),
            "block_ids": [int(b) for b in out.store_spec.block_ids],
            "evicted_keys": _hexes(out.evicted_keys),
        }

    def op_complete_store(self, msg: dict) -> None:
        success = _field(msg, "success", bool, True)
        self.manager.complete_store(_keys(_field(msg, "keys")), self._req(msg), success)

    def op_schedule_end(self, msg: dict) -> None:
        new_ids = _field(msg, "new_req_ids", list, [])
        preempted = _field(msg, "preempted_req_ids", list, [])
        self.manager.on_schedule_end(
            self.vllm.ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=preempted)
        )

    def op_take_events(self, msg: dict) -> list[dict]:
        return [
            {
                "keys": _hexes(e.keys),
                "medium": e.medium.value,
                "removed": bool(e.removed),
                "locality": None if e.locality is None else e.locality.value,
                "ownership": e.ownership,
                "removal_expected": bool(e.removal_expected),
                "metadata_only": bool(e.metadata_only),
            }
            for e in self.manager.take_events()
        ]

    def op_get_stats(self, msg: dict) -> dict | None:
        stats = self.manager.get_stats()
        if stats is None:
            return None
        keys = self.vllm.metrics._StatsKey
        types = stats.data.get(keys.TYPES, {})
        values = stats.data.get(keys.DATA, {})
        metrics = []
        for name in sorted(values):
            for labels, value in values[name].items():
                metrics.append(
                    {
                        "name": name,
                        "type": types.get(name),
                        "labels": [str(label) for label in labels],
                        "value": list(value) if isinstance(value, list) else value,
                    }
                )
        return {"metrics": metrics, "info": stats.data.get(keys.INFO)}

    def op_has_pending_work(self, msg: dict) -> bool:
        return bool(self.manager.has_pending_work())

    def op_reset_cache(self, msg: dict) -> None:
        self.manager.reset_cache()

    def op_reset_flushed(self, msg: dict) -> None:
        self.manager.on_reset_flushed()

    def op_config_info(self, msg: dict) -> list:
        return [dict(info) for info in self.manager.config_info()]

    def op_inspect(self, msg: dict) -> dict:
        m = self.primary
        policy = m._policy
        state = {
            "num_blocks": m._num_chunks,
            "allocated": m._num_allocated_chunks,
            "free_list": list(m._free_list),
            "evictable": m._num_evictable_cache_chunks,
            "write_pending": m._num_write_pending_chunks,
        }
        if isinstance(policy, self.vllm.LRUCachePolicy):
            order = sorted(policy.chunks, key=policy._ranks.__getitem__)
            state["policy"] = {
                "kind": "lru",
                "order": _hexes(order),
                "evictable": _hexes(k for k in order if k in policy._evictable),
            }
            chunks = [(k, policy.chunks[k]) for k in order]
        elif isinstance(policy, self.vllm.ARCCachePolicy):
            state["policy"] = {
                "kind": "arc",
                "target_t1_size": float(policy.target_t1_size),
                "t1": _hexes(policy.t1),
                "t2": _hexes(policy.t2),
                "b1": _hexes(policy.b1),
                "b2": _hexes(policy.b2),
            }
            chunks = list(policy.t1.items()) + list(policy.t2.items())
        else:
            raise RequestError(f"cannot inspect policy {type(policy).__name__}")
        state["blocks"] = [
            {"key": _hex(k), "block_id": int(c.chunk_id), "ref_cnt": int(c.ref_cnt)}
            for k, c in chunks
        ]
        if self.manager is not self.primary:
            t = self.manager
            state["tiering"] = {
                "jobs": [
                    {
                        "job_id": job_id,
                        "tier": meta.tier_idx,
                        "is_promotion": bool(meta.transfer_job.is_promotion),
                        "keys": _hexes(meta.transfer_job.keys),
                        "block_ids": [int(b) for b in meta.transfer_job.chunk_ids],
                        "req": meta.transfer_job.req_context.req_id,
                    }
                    for job_id, meta in sorted(t._jobs.items())
                ],
                "pending_promotions": [
                    {
                        "tier": tier_idx,
                        "req": req_id,
                        "keys": _hexes(p.keys),
                        "block_ids": [int(b) for b in p.chunk_ids],
                    }
                    for tier_idx, by_req in t._pending_load_submissions.items()
                    for req_id, p in by_req.items()
                ],
                "requests": {
                    req_id: {
                        "pending_primary_stores": s.pending_primary_stores,
                        "is_finished": bool(s.is_finished),
                        "request_level_tiers": None
                        if s.request_level_tiers is None
                        else sorted(s.request_level_tiers),
                        "pending_cascade_keys": _hexes(s.pending_cascade_keys),
                    }
                    for req_id, s in t._req_state.items()
                },
                "promotions_held": bool(t._promotions_held),
            }
        return state

    # --- scripted tiers ---

    def op_tier_jobs(self, msg: dict) -> list[dict]:
        return [
            {
                "job_id": job.job_id,
                "keys": _hexes(job.keys),
                "block_ids": [int(b) for b in job.chunk_ids],
                "is_promotion": bool(job.is_promotion),
                "req": job.req_context.req_id,
            }
            for job in self._tier(msg).pending.values()
        ]

    def op_tier_finish(self, msg: dict) -> None:
        tier = self._tier(msg)
        successful = _field(msg, "successful_keys", list, None)
        tier.finish(
            _field(msg, "job_id", int),
            _field(msg, "success", bool, True),
            None if successful is None else _keys(successful),
        )

    def op_tier_put(self, msg: dict) -> None:
        tier = self._tier(msg)
        for key in _keys(_field(msg, "keys")):
            tier.held[key] = None

    def op_tier_remove(self, msg: dict) -> None:
        tier = self._tier(msg)
        for key in _keys(_field(msg, "keys")):
            tier.held.pop(key, None)

    def op_tier_retry(self, msg: dict) -> None:
        tier = self._tier(msg)
        keys = _keys(_field(msg, "keys"))
        if _field(msg, "retry", bool, True):
            tier.retry.update(keys)
        else:
            tier.retry.difference_update(keys)

    def op_tier_keys(self, msg: dict) -> list[str]:
        return _hexes(self._tier(msg).held)

    def op_tier_calls(self, msg: dict) -> list[dict]:
        tier = self._tier(msg)
        calls, tier.calls = tier.calls, []
        return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-dir", help=f"the setup script's install (else ${ENV_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=os.environ.get("KVTIER_ORACLE_LOG", "WARNING").upper()
    )
    out = sys.stdout
    # Only the protocol writes to the real stdout; anything else printed goes to stderr.
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        out.flush()

    try:
        vllm = load_vllm(args.vllm_dir)
    except Exception as e:  # noqa: BLE001
        send({"error": f"{type(e).__name__}: {e}", "type": type(e).__name__})
        return 2
    oracle = Oracle(vllm)
    send({"ready": {"vllm": vllm.version, "python": platform.python_version(), "site": vllm.site}})
    for line in sys.stdin:
        if line.strip():
            send(oracle.handle_line(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
