"""kvtier's figures in vLLM's Prometheus metrics, through vLLM 0.33.0's own classes.

``get_stats`` fills vLLM's ``OffloadingConnectorStats``; vLLM's ``OffloadPromMetrics`` builds
its metrics from ``KvtierOffloadingSpec.build_metric_definitions`` and
``config_info_keys`` and observes each payload. The oracle install has no prometheus_client,
so the metric classes here are small recording stand-ins with its interface (``labels``
checks the label count, each kind has only its own method); everything else, the
definitions' merge, the label checks and the config-info series, is vLLM's code.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import kvtier.vllm as kv

from test_tiering import END, PAGE, Node
from test_worker import copied, kv_caches

TIER = ("1:file",)


class Metric:
    """A prometheus_client metric's interface: ``labels(*values)`` gives the child series
    (the count checked against the label names); a child has only its kind's method."""

    def __init__(self, kind, name, documentation, labelnames, buckets=None,
                 multiprocess_mode=None):
        self.kind, self.name, self.labelnames = kind, name, list(labelnames)
        self.buckets = buckets
        self.series: dict[tuple[str, ...], Child] = {}

    def labels(self, *values):
        assert len(values) == len(self.labelnames), (self.name, values, self.labelnames)
        return self.series.setdefault(tuple(str(v) for v in values), Child(self.kind))


class Child:
    def __init__(self, kind):
        self.value = 0.0
        self.observed: list[float] = []
        if kind == "counter":
            self.inc = self._inc
        elif kind == "gauge":
            self.set = self._set
        else:
            self.observe = self.observed.append

    def _inc(self, v=1):
        assert v >= 0, "a counter only grows"
        self.value += v

    def _set(self, v):
        self.value = v


def kind(k):
    return lambda **kw: Metric(k, **kw)


@pytest.fixture
def prom(vllm, monkeypatch):
    """``make(extra_config)``: vLLM's ``OffloadPromMetrics`` for one engine (label
    ``engine`` = "0"), built with the recording metrics; ``warnings`` collects what it
    logs once (a config-info disagreement)."""
    metrics = vllm.metrics
    base = metrics.KVConnectorPromMetrics

    def base_init(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        # What vLLM's KVConnectorPromMetrics.__init__ keeps (the oracle's stand-in refuses).
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls, self._counter_cls, self._histogram_cls = (
            kind("gauge"), kind("counter"), kind("histogram"),
        )
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    monkeypatch.setattr(base, "__init__", base_init)
    # OffloadPromMetrics asks whether the spec is vLLM's CPU spec, whose module needs
    # vLLM's compiled ops: a stand-in class that kvtier's spec is not.
    cpu_spec = types.ModuleType("vllm.v1.kv_offload.cpu.spec")
    cpu_spec.CPUOffloadingSpec = type("CPUOffloadingSpec", (), {})
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.cpu.spec", cpu_spec)
    warnings = []
    monkeypatch.setattr(metrics.logger, "warning_once", lambda *a, **k: warnings.append(a))

    def make(extra):
        extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm", **extra}
        config = types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra)
        )
        return metrics.OffloadPromMetrics(config, {}, ["engine"], {0: ["0"]})

    make.warnings = warnings
    return make


def series(p, name):
    """``{label values without the engine's: child}`` of metric ``name``."""
    return {k[1:]: v for k, v in p._offloading_metric_defs[name].series.items()}


def values(p, name):
    return {k: c.value for k, c in series(p, name).items()}


def tier_extra(node):
    return {"secondary_tiers": [dict(t) for t in node.settings.tiers]}


def observe(p, manager):
    stats = manager.get_stats()
    p.observe(stats.data)
    return stats


def corrupt(tier_dir, block: bytes):
    """Flips bytes of ``block``'s payload in the file tier's data file."""
    data = max(tier_dir.iterdir(), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        at = f.read().find(block[:256])
        assert at >= 0, "the block's bytes are in the tier's data file"
        f.seek(at + 1000)
        f.write(bytes(b ^ 0xFF for b in block[1000:1064]))


def test_tier_figures_reach_vllms_prometheus_metrics(vllm, prom, region_dir, tmp_path):
    """Stores, a cascade, promotions (one good, three failing verification), the tier going
    Down and a cascade skipped for it: each figure as vLLM's metrics end up holding it."""
    caches = kv_caches([[(PAGE, PAGE)]], 16, np.random.default_rng(11))
    node = Node(region_dir, tmp_path / "tier", caches, slots=4, tier_blocks=64)
    m = node.manager
    p = prom(tier_extra(node))
    try:
        # A file tier of 64 pages holds 31 blocks: a page of header, a page of record each.
        (capacity,) = m._native.tier_capacity_blocks
        assert capacity == 31
        # The first payload: every gauge, and every counter at zero (the series exist).
        first = observe(p, m)
        assert values(p, kv.TIER_CAPACITY_BLOCKS) == {TIER: capacity}
        assert values(p, kv.TIER_CAPACITY_BYTES) == {TIER: capacity * PAGE}
        assert values(p, kv.TIER_USAGE_BLOCKS) == {TIER: 0}
        assert values(p, kv.TIER_UP) == {TIER: 1}
        for name, _, _ in kv._TIER_COUNTERS:
            assert values(p, name) == {TIER: 0}, name
        assert values(p, kv.TIER_CASCADES_SKIPPED) == {
            (*TIER, r): 0 for r in ("backpressure", "tier_down", "tier_full")
        }
        # Only kvtier's names and vLLM's CPU ones.
        assert all(n.startswith(("vllm:kvtier_", "vllm:kv_offload_cpu")) for n in first.data["data"])

        keys = [f"m-{i}".encode() for i in range(4)]
        node.store(keys, [0, 1, 2, 3])
        node.settle()
        second = observe(p, m)
        # Counters are increments: only those that grew are in the second payload.
        grew = {n for n in second.data["data"] if n.startswith("vllm:kvtier_tier_")}
        assert grew == {
            kv.TIER_CAPACITY_BLOCKS, kv.TIER_CAPACITY_BYTES, kv.TIER_USAGE_BLOCKS,
            kv.TIER_USAGE_BYTES, kv.TIER_UP, kv.TIER_CASCADE_JOBS, kv.TIER_CASCADED_BLOCKS,
            kv.TIER_WRITTEN_BYTES,
        }
        assert values(p, kv.TIER_CASCADE_JOBS) == {TIER: 1}
        assert values(p, kv.TIER_CASCADED_BLOCKS) == {TIER: 4}
        assert values(p, kv.TIER_WRITTEN_BYTES) == {TIER: 4 * PAGE}
        assert values(p, kv.TIER_USAGE_BLOCKS) == {TIER: 4}
        assert values(p, kv.TIER_USAGE_BYTES) == {TIER: 4 * PAGE}
        # The primary's figures, as vLLM's CPU tier reports them.
        assert values(p, kv.CPU_CACHE_USAGE_PERC) == {(): 0.0}
        assert sum(series(p, kv.CPU_ALLOCATION_SIZE)[()].observed) == 4

        # Three blocks corrupted on disk; the primary forgets everything.
        for i in range(3):
            corrupt(tmp_path / "tier", copied(caches, 0, i)[0].tobytes())
        m.reset_cache()
        m.on_reset_flushed()
        ctx = node.request()
        result, _ = node.lookup_until_settled(keys[3], ctx)
        assert result is kv.LookupResult.HIT
        # Three failed promotions, one step each: three failures in a row take it Down.
        for k in keys[:3]:
            result, _ = node.lookup_until_settled(k, ctx)
            assert result is kv.LookupResult.MISS
            m.on_schedule_end(END)
        m.on_request_finished(ctx)
        assert m.stats()["tiers"][0]["health"].startswith("Down")
        observe(p, m)
        assert values(p, kv.TIER_PROMOTIONS) == {TIER: 4}
        assert values(p, kv.TIER_READ_BYTES) == {TIER: PAGE}
        assert values(p, kv.TIER_READ_FAILURES) == {TIER: 3}
        assert values(p, kv.TIER_VERIFICATION_FAILURES) == {TIER: 3}
        assert values(p, kv.TIER_JOBS_FAILED) == {TIER: 3}
        assert values(p, kv.TIER_WRITE_FAILURES) == {TIER: 0}
        assert values(p, kv.TIER_UP) == {TIER: 0}
        latency = series(p, kv.TIER_PROMOTION_LATENCY)
        assert sorted(latency) == [(*TIER, "failed"), (*TIER, "ok")]
        assert len(latency[(*TIER, "ok")].observed) == 1
        assert len(latency[(*TIER, "failed")].observed) == 3
        assert all(0 < s < 10 for c in latency.values() for s in c.observed)
        tier_blocks = m.stats()["tiers"][0]["blocks"]
        assert values(p, kv.TIER_USAGE_BLOCKS) == {TIER: tier_blocks}

        # A store while the tier is Down: its cascade is skipped for that reason.
        node.store([b"m-late"], [5])
        node.settle()
        observe(p, m)
        assert values(p, kv.TIER_CASCADES_SKIPPED) == {
            (*TIER, "backpressure"): 0, (*TIER, "tier_down"): 1, (*TIER, "tier_full"): 0
        }
        assert values(p, kv.TIER_CASCADE_JOBS) == {TIER: 1}
        # Nothing happened since: the next payload adds nothing to any counter.
        quiet = m.get_stats()
        assert not [n for n, kind_ in quiet.data["types"].items()
                    if kind_ != "gauge" and n.startswith("vllm:kvtier_")]
    finally:
        node.close()


def test_a_cascade_with_no_room_counts_as_tier_full(vllm, prom, region_dir, tmp_path):
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(12))
    # Three pages: a header and one block's record.
    node = Node(region_dir, tmp_path / "tier", caches, slots=4, tier_blocks=3)
    assert node.manager._native.tier_capacity_blocks == [1]
    p = prom(tier_extra(node))
    try:
        # Two blocks cascade together into a tier of one: the second finds no room (the
        # first, being written, cannot be evicted for it).
        node.store([b"f-0", b"f-1"], [0, 1])
        node.settle()
        observe(p, node.manager)
        assert values(p, kv.TIER_CASCADES_SKIPPED)[(*TIER, "tier_full")] == 1
        assert values(p, kv.TIER_CASCADED_BLOCKS) == {TIER: 1}
        assert values(p, kv.TIER_USAGE_BLOCKS) == {TIER: 1}
    finally:
        node.close()


def test_config_info_reaches_vllms_info_metric(vllm, prom, region_dir, tmp_path):
    """One series for the primary and one per tier, every declared label filled by some
    series and none dropped (vLLM logs either)."""
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(13))
    node = Node(region_dir, tmp_path / "tier", caches, slots=4, tier_blocks=8, policy="arc")
    extra = tier_extra(node)
    p = prom(extra)
    try:
        info = node.manager.config_info()
        stats = vllm.metrics.OffloadingConnectorStats()
        stats.set_info(info)
        p.observe(stats.data)
        assert prom.warnings == []
        keys = kv.KvtierOffloadingSpec.config_info_keys(extra)
        assert list(p._offloading_metric_defs["vllm:kv_offload_config_info"].labelnames) == [
            "engine", *keys
        ]
        got = [dict(zip(keys, v)) for v in values(p, "vllm:kv_offload_config_info")]
        primary, tier = got
        assert primary["tier"] == "0:primary" and tier["tier"] == "1:file"
        assert primary["eviction_policy"] == "arc" and tier["eviction_policy"] == "lru"
        assert (primary["capacity_blocks"], primary["capacity_bytes"]) == ("4", str(4 * PAGE))
        assert (tier["capacity_blocks"], tier["capacity_bytes"]) == ("3", str(3 * PAGE))
        assert primary["cpu_num_chunks"] == "4" and primary["kvtier_secondary_tiers"] == "1"
        assert tier["cpu_num_chunks"] == ""  # the primary's facts are on its series only
    finally:
        node.close()


def test_every_emitted_name_is_defined_with_its_kind_and_labels(vllm, region_dir, tmp_path):
    """The check vLLM's frontend relies on: each name in a payload is defined, as the same
    kind, with as many labels as its values have. Fails when a definition is missing."""
    caches = kv_caches([[(PAGE, PAGE)]], 8, np.random.default_rng(14))
    node = Node(region_dir, tmp_path / "tier", caches, slots=4, tier_blocks=8)
    try:
        node.store([b"d-0", b"d-1"], [0, 1])
        node.settle()
        ctx = node.request()
        node.manager.reset_cache()
        node.manager.on_reset_flushed()
        assert node.lookup_until_settled(b"d-0", ctx)[0] is kv.LookupResult.HIT
        node.manager.on_request_finished(ctx)
        stats = node.manager.get_stats()
        defs = kv.KvtierOffloadingSpec.build_metric_definitions(tier_extra(node))
        check(vllm, stats.data, defs)
        assert kv.TIER_PROMOTION_LATENCY in stats.data["data"]
        for name in list(defs):  # the check can fail: each definition is needed
            if name in stats.data["data"]:
                with pytest.raises(AssertionError):
                    check(vllm, stats.data, {n: d for n, d in defs.items() if n != name})
        name = kv.TIER_CASCADES_SKIPPED
        fewer = dict(defs)
        fewer[name] = vllm.base.OffloadingCounterMetadata(documentation="", labelnames=("tier",))
        with pytest.raises(AssertionError):
            check(vllm, stats.data, fewer)
    finally:
        node.close()


def check(vllm, data, defs):
    kinds = {
        "counter": vllm.base.OffloadingCounterMetadata,
        "gauge": vllm.base.OffloadingGaugeMetadata,
        "histogram": vllm.base.OffloadingHistogramMetadata,
    }
    for name, by_labels in data["data"].items():
        assert name in defs, f"{name} is not defined"
        assert isinstance(defs[name], kinds[data["types"][name]]), name
        for labels in by_labels:
            assert len(labels) == len(defs[name].labelnames), (name, labels)


def test_without_tiers_nothing_of_kvtiers_own_is_defined_or_sent(vllm, region_dir):
    settings = kv.Settings(num_blocks=4, region_path=str(region_dir / "r"))
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=1)
    try:
        assert set(manager.get_stats().data["data"]) == {
            kv.CPU_CACHE_USAGE_PERC, kv.CPU_CACHE_WRITE_USAGE_PERC, kv.CPU_CACHE_READ_USAGE_PERC
        }
        defs = kv.KvtierOffloadingSpec.build_metric_definitions({})
        assert not [n for n in defs if n.startswith("vllm:kvtier_")]
        (info,) = manager.config_info()
        assert info["tier"] == "0:primary"
    finally:
        manager.shutdown()
