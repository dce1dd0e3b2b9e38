"""vLLM 0.33.0's own manager tests, run against kvtier's manager.

``tests/v1/kv_offload/cpu/test_manager.py`` of vLLM's source release is not in this
repository: ``scripts/vllm-oracle-setup.sh`` fetches the release from PyPI and extracts that
one file into its install outside the clone. It is imported here as it is, and one thing is
changed: the name ``CPUOffloadingManager`` in its namespace, which its ``make_cpu_manager``
calls to build every manager, is bound to ``kvtier_cpu_manager``, a function with the
constructor's signature that builds kvtier's ``KvtierOffloadingManager``. Its tests are then
collected from this module, each reported on its own (``-rs`` lists the skipped ones and why).

Tests that cannot say anything about kvtier are skipped with their reason (``OUT_OF_SCOPE``):
those that read or replace vLLM's private internals (``manager._policy``, the policy's own
lists, ``manager._num_evictable_cache_chunks``, ...), or attributes of vLLM's implementation
outside the ``OffloadingManager`` interface, and those that build no manager at all. The
tests that meet a difference kvtier keeps on purpose are strict expected failures
(``DIFFERENT``): they must fail, and with the error named. Every other test must pass.

Without the install the module is skipped loudly, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import vllm_oracle
from conftest import VLLM, VLLM_ERROR
from kvtier.vllm import ConfigError, KvtierOffloadingManager, Settings

SUITE = Path("tests") / "v1" / "kv_offload" / "cpu" / "test_manager.py"

#: The tests that read or replace what is vLLM's own implementation, not the manager's
#: interface: name -> why.
OUT_OF_SCOPE = {
    **{
        name: "reads vLLM's private internals: the ARC policy object (manager._policy) and "
        "its lists t1/t2/b1/b2 and target_t1_size"
        for name in (
            "TestARCPolicy::test_basic",
            "TestARCPolicy::test_t1_to_t2_promotion",
            "TestARCPolicy::test_eviction_with_load",
            "TestARCPolicy::test_adaptive_target",
            "TestARCPolicy::test_t1_t2_eviction_policy",
            "TestARCPolicy::test_batch_eviction_scans_t1_and_t2_once",
            "TestARCPolicy::test_batch_eviction_falls_back_after_t1_iterator_exhausted",
            "TestARCPolicy::test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction",
            "TestARCPolicy::test_batch_eviction_failure_is_atomic",
            "TestARCPolicy::test_ghost_list_bounds",
            "TestARCPolicy::test_touch_ordering",
            "TestARCPolicy::test_failed_store",
            "TestARCPolicy::test_full_scenario",
            "test_reset_discards_stale_request_access_classification",
            "test_arc_counts_reuse_once_and_keeps_insertions_in_t1",
            "test_arc_reuse_wins_if_same_request_later_reinserts_key",
            "test_arc_ghost_hit_adapts_once_per_request_before_insertion",
            "test_arc_pending_chunk_is_not_a_frequency_hit",
        )
    },
    **{
        name: "reads vLLM's private internals: the LRU policy object (manager._policy), its "
        "evict() and its lazy heap (_heap)"
        for name in (
            "test_lru_batch_eviction_failure_is_atomic",
            "test_lru_repeated_pin_cycles_compact_lazy_heap_entries",
        )
    },
    "test_evictable_cache_chunk_count": "reads vLLM's private internals: "
    "manager._num_evictable_cache_chunks, and spies on manager._policy.evict",
    "test_touch_forwards_req_context_to_policy": "replaces vLLM's private internals: "
    "manager._policy.touch",
    "test_request_finish_forwards_grouped_deduplicated_accesses": "replaces vLLM's private "
    "internals: manager._policy.on_request_finished",
    "test_failed_store_records_access_once_and_uses_store_miss_hook": "replaces vLLM's "
    "private internals: manager._record_request_cache_access and manager._policy's hooks",
    "test_cpu_manager_reports_allocation_size_on_allocation_failure": "replaces vLLM's "
    "private internals: manager._allocate_chunks",
    "test_filter_reused_manager": "reads vLLM's implementation outside the OffloadingManager "
    "interface: the reuse tracker's table manager.counts",
    "test_store_threshold_does_not_hide_ready_reuse": "reads vLLM's implementation outside "
    "the OffloadingManager interface: manager.stores_skipped_in_current_batch",
    "test_lru_insert_orders_positioned_chunks_without_followup_access": "builds no manager: "
    "a unit test of vLLM's LRUCachePolicy class alone",
}

#: The tests that meet a difference kvtier keeps (docs/vllm.md): name -> (error, why).
DIFFERENT = {
    "test_cpu_manager_reports_cache_usage_gauge": (
        ConfigError,
        "kvtier refuses a primary tier of zero slots (its first manager has num_chunks=0)",
    ),
    "test_cpu_manager_reports_no_config_info_without_info": (
        AssertionError,
        "kvtier's manager is always built from its settings and reports them; vLLM's reports "
        "nothing only when built without its `info` argument (its spec always passes it)",
    ),
}

_regions = itertools.count()
_region_dir: list[str] = []  # made on first use, removed after the module's tests


@pytest.fixture(autouse=True, scope="module")
def _remove_region_dir():
    yield
    while _region_dir:
        shutil.rmtree(_region_dir.pop(), ignore_errors=True)


def kvtier_cpu_manager(
    num_chunks: int,
    cache_policy: str = "lru",
    cache_policy_module_path: str | None = None,
    enable_events: bool = False,
    store_threshold: int = 1,
    max_tracker_size: int = 64_000,
    info: object | None = None,
) -> KvtierOffloadingManager:
    """vLLM's ``CPUOffloadingManager(...)`` signature, building kvtier's manager."""
    if cache_policy_module_path is not None or info is not None:
        raise TypeError("kvtier_cpu_manager: out-of-tree policies and `info` are not mapped")
    if not _region_dir:
        shm = "/dev/shm"
        where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        _region_dir.append(tempfile.mkdtemp(prefix="kvtier-vllm-suite-", dir=where))
    return KvtierOffloadingManager(
        Settings(
            num_blocks=num_chunks,
            region_path=os.path.join(_region_dir[0], f"region-{next(_regions)}"),
            policy=cache_policy,
            events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            # No worker copies here: a store is readable once complete_store says so.
            verify_stores=False,
        ),
        prefault_threads=1,
    )


def _load_suite():
    """vLLM's test module, imported from the install, with the construction swapped."""
    if VLLM is None:
        return None, f"vLLM 0.33.0 not installed ({VLLM_ERROR})"
    path = Path(VLLM.site).parent / SUITE
    if not path.is_file():
        return None, f"{path} is missing: {vllm_oracle.SETUP_HINT}"
    name = "vllm_0_33_0_cpu_test_manager"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    assert module.CPUOffloadingManager is VLLM.CPUOffloadingManager
    module.CPUOffloadingManager = kvtier_cpu_manager  # the one change
    return module, None


def _mark(obj, qualname: str):
    if qualname in OUT_OF_SCOPE:
        return pytest.mark.skip(reason=f"out of scope: {OUT_OF_SCOPE[qualname]}")(obj)
    if qualname in DIFFERENT:
        error, why = DIFFERENT[qualname]
        return pytest.mark.xfail(strict=True, raises=error, reason=f"kept difference: {why}")(obj)
    return obj


def _export(module) -> list[str]:
    """Binds vLLM's tests in this module's namespace, marked; answers their names."""
    names = []
    for name, obj in vars(module).items():
        if name.startswith("test_") and callable(obj):
            globals()[name] = _mark(obj, name)
            names.append(name)
        elif name.startswith("Test") and isinstance(obj, type):
            for attr, fn in list(vars(obj).items()):
                if attr.startswith("test_") and callable(fn):
                    setattr(obj, attr, _mark(fn, f"{name}::{attr}"))
                    names.append(f"{name}::{attr}")
            globals()[name] = obj
    return names


_SUITE, _SUITE_ERROR = _load_suite()
if _SUITE is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"vLLM's manager tests: {_SUITE_ERROR}")
    pytestmark = pytest.mark.skip(reason=f"SKIPPED: vLLM's manager tests: {_SUITE_ERROR}")
    EXPORTED: list[str] = []
else:
    EXPORTED = _export(_SUITE)


def test_suite_lists_are_current():
    """Every listed test exists in vLLM's file, so that no list hides a renamed test."""
    if _SUITE is None:
        pytest.skip(f"SKIPPED: vLLM's manager tests: {_SUITE_ERROR}")
    stale = (set(OUT_OF_SCOPE) | set(DIFFERENT)) - set(EXPORTED)
    assert not stale, f"listed but not in vLLM's test_manager.py: {sorted(stale)}"
