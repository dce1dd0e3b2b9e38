//! `HostedTier`: one kvtier store (file, Redis or S3) as a secondary tier of vLLM 0.33's own
//! `TieringOffloadingManager`, over that manager's primary memory. `kvtier/vllm_tiers.py`
//! adapts vLLM's `SecondaryTierManager` calls onto it.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use kvtier_core::{
    EventKind, Health, HealthConfig, HostedConfig, HostedLookup, Key, SlotId, TierConfig,
};
use kvtier_hw::{HostRows, HostedDriver};

use crate::errors;
use crate::manager::{key_of, keys_into, tier_settings};

/// One kvtier store under a host's tiering manager. Every call returns at once except
/// `drain` and `shutdown`; a call after `shutdown` raises `StateError`.
#[pyclass(module = "kvtier._native", frozen)]
pub(crate) struct HostedTier {
    driver: Mutex<Option<HostedDriver>>,
    row_bytes: usize,
    capacity_blocks: u32,
    kind: &'static str,
}

fn lock(m: &Mutex<Option<HostedDriver>>) -> MutexGuard<'_, Option<HostedDriver>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn live(d: &mut Option<HostedDriver>) -> PyResult<&mut HostedDriver> {
    d.as_mut()
        .ok_or_else(|| errors::StateError::new_err("the tier was shut down"))
}

/// A bound in seconds as a `Duration`: infinite means none (the longest a clock holds).
fn seconds(s: f64) -> PyResult<Duration> {
    if s.is_nan() || s < 0.0 {
        return Err(errors::config(
            "timeout",
            format!("{s} is not a number of seconds"),
        ));
    }
    Ok(Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX))
}

/// `(key, slot)` pairs of a job: its keys, and the primary chunk of each.
fn blocks(keys: &Bound<'_, PyAny>, chunks: Vec<i64>) -> PyResult<Vec<(Key, SlotId)>> {
    let mut ks = Vec::new();
    keys_into(keys, &mut ks)?;
    if ks.len() != chunks.len() {
        return Err(errors::StateError::new_err(format!(
            "a job of {} keys names {} primary chunks",
            ks.len(),
            chunks.len()
        )));
    }
    ks.into_iter()
        .zip(chunks)
        .map(|(k, c)| {
            u32::try_from(c)
                .map(|c| (k, SlotId(c)))
                .map_err(|_| errors::StateError::new_err(format!("chunk id {c} out of range")))
        })
        .collect()
}

#[pymethods]
impl HostedTier {
    /// Opens the store that `tier` describes (`kvtier.vllm`'s `secondary_tiers` table: `type`
    /// "file" or "redis", `capacity_bytes`, `eviction_policy`, and the store's own keys) for
    /// blocks of `row_bytes`, recorded under `identity`, over the host's primary memory of
    /// `length` bytes at `address`. The caller keeps that memory alive and mapped until
    /// `shutdown` has returned.
    ///
    /// `wait_deadline_ms`: a block answers "retry" (being written or probed) at most this
    /// long, then "miss" (`None`: for as long as its job runs). `failures_to_down` jobs that
    /// fail in a row make the tier Down (every lookup a miss) until a health probe, every
    /// `probe_interval_steps` steps, finds it well. `learn_reads`: the blocks a load read
    /// update the tier's recency when it ends (G16; false: its stores alone).
    #[new]
    #[pyo3(signature = (address, length, row_bytes, tier, identity, io_threads = 4,
        wait_deadline_ms = Some(5000), failures_to_down = 3, probe_interval_steps = 100,
        learn_reads = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: usize,
        length: usize,
        row_bytes: usize,
        tier: &Bound<'_, PyDict>,
        identity: String,
        io_threads: usize,
        wait_deadline_ms: Option<u64>,
        failures_to_down: u32,
        probe_interval_steps: u32,
        learn_reads: bool,
    ) -> PyResult<Self> {
        if failures_to_down == 0 {
            return Err(errors::config("failures_to_down", "must be at least 1"));
        }
        let settings = tier_settings(0, tier)?;
        if settings.victim_lookahead.is_some() {
            // The host's manager decides what its secondary tier is written: a HostedTier
            // writes what it is given.
            return Err(errors::config(
                "victim_lookahead",
                "a tier under vLLM's own tiering is written as vLLM decides; a victim tier \
                 needs kvtier's manager (kvtier.vllm's connector, the bench)",
            ));
        }
        // SAFETY: the caller (kvtier.vllm_tiers) holds an export of the host's buffer, so
        // the memory stays mapped until `shutdown` has joined the IO threads; the host
        // touches no slot while a job that names it runs (vLLM pins and allocates them).
        let rows =
            unsafe { HostRows::new(address as *mut u8, length, row_bytes) }.map_err(errors::hw)?;
        let (store, kind) = py.detach(|| settings.open(0, &identity, row_bytes))?;
        let capacity_blocks = store.capacity_blocks();
        let mut tier = TierConfig::new(kind, capacity_blocks);
        tier.policy = settings.policy;
        let config = HostedConfig {
            tier,
            health: HealthConfig {
                failures_to_down,
                probe_interval_steps,
            },
            wait_deadline: wait_deadline_ms,
            learn_reads,
        };
        let driver =
            HostedDriver::new(store, config, rows, io_threads.max(1)).map_err(errors::hw)?;
        Ok(HostedTier {
            driver: Mutex::new(Some(driver)),
            row_bytes,
            capacity_blocks,
            kind: settings.kind(),
        })
    }

    /// Blocks the tier can hold.
    #[getter]
    fn capacity_blocks(&self) -> u32 {
        self.capacity_blocks
    }

    /// "file", "redis" or "s3".
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// G1–G4: 0 miss, 1 hit, 2 retry.
    fn lookup(&self, key: &Bound<'_, PyAny>) -> PyResult<u8> {
        let key = key_of(key)?;
        let mut d = lock(&self.driver);
        Ok(match live(&mut d)?.lookup(&key) {
            HostedLookup::Miss => 0,
            HostedLookup::Hit => 1,
            HostedLookup::Retry => 2,
        })
    }

    /// G5: store job `job` writes `keys` from the primary chunks `chunks`.
    fn submit_store(&self, job: u64, keys: &Bound<'_, PyAny>, chunks: Vec<i64>) -> PyResult<()> {
        let blocks = blocks(keys, chunks)?;
        let mut d = lock(&self.driver);
        live(&mut d)?.submit_store(job, &blocks).map_err(errors::hw)
    }

    /// G6: load job `job` reads `keys` into the primary chunks `chunks`.
    fn submit_load(&self, job: u64, keys: &Bound<'_, PyAny>, chunks: Vec<i64>) -> PyResult<()> {
        let blocks = blocks(keys, chunks)?;
        let mut d = lock(&self.driver);
        live(&mut d)?.submit_load(job, &blocks).map_err(errors::hw)
    }

    /// The jobs that ended since the last call: `(job, success, succeeded keys or None,
    /// bytes, seconds or None)` each.
    #[allow(clippy::type_complexity)]
    fn finished<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            u64,
            bool,
            Option<Vec<Bound<'py, PyBytes>>>,
            u64,
            Option<f64>,
        )>,
    > {
        let mut d = lock(&self.driver);
        Ok(live(&mut d)?
            .finished()
            .into_iter()
            .map(|r| {
                let keys = r.succeeded.map(|ks| {
                    ks.iter()
                        .map(|k| PyBytes::new(py, k.as_bytes()))
                        .collect::<Vec<_>>()
                });
                (r.job, r.success, keys, r.bytes, r.seconds)
            })
            .collect())
    }

    /// T12: the host used `keys`.
    fn touch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ks = Vec::new();
        keys_into(keys, &mut ks)?;
        let mut d = lock(&self.driver);
        live(&mut d)?.touch(&ks);
        Ok(())
    }

    /// G9, G14: the host's step ended. Forwards the log records of the tier's threads.
    fn end_step(&self, py: Python<'_>) -> PyResult<()> {
        {
            let mut d = lock(&self.driver);
            live(&mut d)?.end_step();
        }
        crate::log::flush(py)
    }

    /// Whether jobs or probes are running.
    fn has_pending_work(&self) -> bool {
        lock(&self.driver)
            .as_ref()
            .is_some_and(|d| d.has_pending_work())
    }

    /// Waits until every job has ended, at most `timeout_s`; `TierError` if some still run.
    fn drain(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = seconds(timeout_s)?;
        py.detach(|| {
            let mut d = lock(&self.driver);
            match d.as_mut() {
                Some(d) => d.drain(timeout).map_err(errors::hw),
                None => Ok(()),
            }
        })
    }

    /// `(removed, keys)` for each change of what the tier holds since the last call.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<(bool, Bound<'py, PyList>)>> {
        let mut d = lock(&self.driver);
        live(&mut d)?
            .take_events()
            .into_iter()
            .filter(|e| e.kind != EventKind::Discarded)
            .map(|e| {
                let keys = PyList::new(py, e.keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))?;
                Ok((e.kind == EventKind::Removed, keys))
            })
            .collect()
    }

    /// The counts since the tier was opened, named as `kvtier.vllm`'s per-tier metrics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = lock(&self.driver);
        let out = PyDict::new(py);
        let Some(d) = d.as_ref() else {
            return Ok(out);
        };
        let s = d.stats();
        let c = s.core;
        let (blocks, capacity) = d.usage();
        let row = self.row_bytes as u64;
        for (k, v) in [
            ("capacity_blocks", u64::from(capacity)),
            ("capacity_bytes", u64::from(capacity) * row),
            ("blocks", blocks as u64),
            ("bytes", blocks as u64 * row),
            ("cascade_jobs", c.store_jobs),
            ("blocks_cascaded", c.blocks_stored + c.store_failures),
            ("bytes_written", s.bytes_written),
            ("promotions", c.load_jobs),
            ("bytes_read", s.bytes_read),
            ("evictions", c.blocks_evicted),
            ("jobs_failed", s.jobs_failed),
            ("write_failures", c.store_failures),
            ("read_failures", c.load_failures),
            ("verification_failures", s.corrupt_reads),
            ("read_missing", c.load_missing),
            ("skipped_full", c.blocks_skipped_full),
            ("skipped_down", c.blocks_skipped_down),
            ("wait_timeouts", c.wait_timeouts),
            ("times_down", c.times_down),
            ("already_held", c.blocks_already_held),
            ("hits", c.hits),
            ("misses", c.misses),
            ("retries", c.retries),
            ("probes", c.probes),
            ("probes_skipped", c.probes_skipped),
            ("blocks_stored", c.blocks_stored),
            ("blocks_loaded", c.blocks_loaded),
            ("delete_failures", s.delete_failures),
        ] {
            out.set_item(k, v)?;
        }
        // A bool, as `Manager.take_tier_metrics` gives it.
        out.set_item("up", d.health() == Health::Up)?;
        out.set_item("last_error", d.last_error())?;
        Ok(out)
    }

    /// Drains (at most `timeout_s`), then stops the IO threads. `Ok`: every job ended, and
    /// the tier no longer touches the host's memory. `TierError`: some jobs still run (a hung
    /// disk or server); they are left to end alone, and the host must keep its memory mapped
    /// for as long as the process lives.
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = seconds(timeout_s)?;
        let d = lock(&self.driver).take();
        match d {
            Some(d) => py.detach(|| d.shutdown(timeout)).map_err(errors::hw),
            None => Ok(()),
        }
    }

    /// I13 and the tier index's invariants; `StateError` naming the one broken.
    fn check_invariants(&self) -> PyResult<()> {
        let d = lock(&self.driver);
        match d.as_ref() {
            Some(d) => d
                .check_invariants()
                .map_err(|v| errors::StateError::new_err(v.to_string())),
            None => Ok(()),
        }
    }
}
