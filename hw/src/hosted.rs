//! One kvtier store as a secondary tier of another engine's tiering manager: the core's
//! [`HostedTier`] (rules G1–G16), the store's IO threads, and the host's primary memory.
//!
//! vLLM 0.33's `TieringOffloadingSpec` hands each secondary tier a view of its primary tier's
//! memory and names primary slots in each job; [`HostRows`] is that memory, and
//! [`HostedDriver`] runs the core's effects against the store with it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::{
    Effect, Event, Health, HostedConfig, HostedLookup, HostedStats, HostedTier, JobId, Key,
    Outcome, SlotId, TierId,
};

use crate::engine::{Completion, Completions};
use crate::io::{Rows, TierIo};
use crate::queue::Queue;
use crate::store::{SecondaryStore, StoreError};
use crate::{HwError, JobPath};

/// A host's primary memory: `len` bytes at `base`, one row of `row_bytes` per slot.
///
/// The host keeps the memory mapped, and does not read or write the rows of a job while
/// the job runs (vLLM pins a store's slots and allocates a load's, G5, G6).
pub struct HostRows {
    base: usize,
    len: usize,
    row_bytes: usize,
}

impl HostRows {
    /// The rows of `len` bytes at `base`.
    ///
    /// # Safety
    ///
    /// `base..base + len` must stay valid for reads and writes for as long as any
    /// [`HostedDriver`] made with it lives, and the host must not touch a slot's row while a
    /// job that names the slot runs.
    pub unsafe fn new(base: *mut u8, len: usize, row_bytes: usize) -> Result<Self, HwError> {
        if base.is_null() || row_bytes == 0 || len < row_bytes {
            return Err(HwError::Setup(format!(
                "the primary memory ({len} bytes) holds no row of {row_bytes} bytes"
            )));
        }
        Ok(HostRows {
            base: base as usize,
            len,
            row_bytes,
        })
    }

    /// Rows in the memory.
    pub fn rows(&self) -> u64 {
        (self.len / self.row_bytes) as u64
    }

    fn offset(&self, slot: SlotId) -> Result<usize, String> {
        let row = u64::from(slot.0);
        if row >= self.rows() {
            return Err(format!(
                "slot {} is outside the primary's {} rows",
                slot.0,
                self.rows()
            ));
        }
        Ok(row as usize * self.row_bytes)
    }
}

impl Rows for HostRows {
    fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    fn with_rows<R>(&self, slots: &[SlotId], f: impl FnOnce(&[&[u8]]) -> R) -> Result<R, String> {
        let rows = slots
            .iter()
            .map(|&s| {
                let at = self.offset(s)?;
                // SAFETY: in bounds (checked above); `new`'s contract keeps the memory valid
                // and unwritten by the host while the job runs.
                Ok(unsafe {
                    std::slice::from_raw_parts((self.base + at) as *const u8, self.row_bytes)
                })
            })
            .collect::<Result<Vec<&[u8]>, String>>()?;
        Ok(f(&rows))
    }

    fn with_rows_mut<R>(
        &self,
        slots: &[SlotId],
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R, String> {
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err("a job names one primary slot twice".into());
        }
        let mut rows = slots
            .iter()
            .map(|&s| {
                let at = self.offset(s)?;
                // SAFETY: in bounds and distinct (checked above), so no two slices overlap;
                // `new`'s contract keeps the memory valid and untouched by the host while
                // the job runs, and the core gives a slot to one job at a time.
                Ok(unsafe {
                    std::slice::from_raw_parts_mut((self.base + at) as *mut u8, self.row_bytes)
                })
            })
            .collect::<Result<Vec<&mut [u8]>, String>>()?;
        Ok(f(&mut rows))
    }
}

/// The end of one host job, as vLLM's `JobResult` reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct HostedDone {
    /// The host's job id.
    pub job: u64,
    /// Whether it did all it had to (G7, G8).
    pub success: bool,
    /// A load that did not succeed: the blocks that were read, when some were.
    pub succeeded: Option<Vec<Key>>,
    /// Whether it was a load.
    pub load: bool,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from submission to the end of its IO; `None` when it ended without IO.
    pub seconds: Option<f64>,
}

/// What the IO added to the core's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostedIoStats {
    /// The core's counts.
    pub core: HostedStats,
    /// Bytes written to the store.
    pub bytes_written: u64,
    /// Bytes read from the store.
    pub bytes_read: u64,
    /// Blocks that failed verification on read (never served).
    pub corrupt_reads: u64,
    /// Store jobs that ended, and their total seconds.
    pub store_jobs: u64,
    /// Total seconds of store jobs.
    pub store_seconds: f64,
    /// Load jobs that ended with IO.
    pub load_jobs: u64,
    /// Total seconds of load jobs.
    pub load_seconds: f64,
    /// Jobs in which a block failed.
    pub jobs_failed: u64,
    /// Deletes the store refused.
    pub delete_failures: u64,
}

/// A kvtier store driven by a host's tiering manager: call it from one thread at a time (vLLM
/// calls a tier under its manager's lock).
pub struct HostedDriver {
    core: HostedTier,
    io: TierIo,
    store: Arc<dyn SecondaryStore>,
    done: Completions,
    /// Per job with IO: its bytes and seconds, until the core reports its end.
    io_of: HashMap<JobId, (u64, f64)>,
    stats: HostedIoStats,
    last_error: Option<String>,
    /// The core's clock is in milliseconds since this instant (G11).
    started: Instant,
    /// Set when `shutdown` left jobs running: their threads are not joined, and the host's
    /// memory must stay mapped.
    detached: bool,
}

impl HostedDriver {
    /// Runs `store` as one tier of `config`'s capacity, policy, health rules and deadline (in
    /// milliseconds) over the host's `rows`, with `threads` IO threads. The blocks the store
    /// recovered are restored (oldest first, up to the capacity; the rest are deleted).
    pub fn new(
        store: Arc<dyn SecondaryStore>,
        config: HostedConfig,
        rows: HostRows,
        threads: usize,
    ) -> Result<Self, HwError> {
        // A configuration the core refuses (a victim admission among others: the host's
        // manager decides what the tier is written) fails here, before anything starts.
        let mut core = HostedTier::new(config)?;
        core.restore(store.recovered());
        let done: Completions = Arc::new(Queue::new());
        let io = TierIo::start(
            TierId(0),
            store.clone(),
            Arc::new(rows),
            done.clone(),
            threads,
        )
        .map_err(|e| HwError::Setup(format!("starting the tier's IO threads: {e}")))?;
        let mut d = HostedDriver {
            core,
            io,
            store,
            done,
            io_of: HashMap::new(),
            stats: HostedIoStats::default(),
            last_error: None,
            started: Instant::now(),
            detached: false,
        };
        d.pump();
        Ok(d)
    }

    /// The store's name ("file", "redis").
    pub fn store_name(&self) -> &str {
        self.store.name()
    }

    /// Up, Down or Probing (G12–G14).
    pub fn health(&self) -> Health {
        self.core.health()
    }

    /// Blocks the tier holds or writes, and its capacity.
    pub fn usage(&self) -> (usize, u32) {
        (self.core.index().len(), self.core.index().capacity())
    }

    /// G1–G4, G11, G12, after taking the completions that arrived (a finished write answers
    /// `Hit`) and setting the core's clock.
    pub fn lookup(&mut self, key: &Key) -> HostedLookup {
        self.collect();
        self.tick();
        let answer = self.core.lookup(key);
        self.pump();
        answer
    }

    /// G5: writes `blocks` (key, primary slot) from the host's primary into the store.
    pub fn submit_store(&mut self, job: u64, blocks: &[(Key, SlotId)]) -> Result<(), HwError> {
        // The writes' busy time starts now (G11).
        self.tick();
        self.core.submit_store(JobId(job), blocks)?;
        self.pump();
        Ok(())
    }

    /// G6: reads `blocks` (key, primary slot) from the store into the host's primary.
    pub fn submit_load(&mut self, job: u64, blocks: &[(Key, SlotId)]) -> Result<(), HwError> {
        self.core.submit_load(JobId(job), blocks)?;
        self.pump();
        Ok(())
    }

    /// T12.
    pub fn touch(&mut self, keys: &[Key]) {
        self.core.touch(keys);
    }

    /// G9: the host's step ended.
    pub fn end_step(&mut self) {
        self.collect();
        self.core.end_step();
        self.pump();
    }

    /// The host jobs that ended since the last call, each exactly once.
    pub fn finished(&mut self) -> Vec<HostedDone> {
        self.collect();
        self.core
            .take_finished()
            .into_iter()
            .map(|r| {
                let io = self.io_of.remove(&r.job);
                HostedDone {
                    job: r.job.0,
                    success: r.success,
                    succeeded: r.succeeded,
                    load: r.load,
                    bytes: io.map_or(0, |(b, _)| b),
                    seconds: io.map(|(_, s)| s),
                }
            })
            .collect()
    }

    /// Whether jobs or probes are running.
    pub fn has_pending_work(&self) -> bool {
        self.core.in_flight() > 0
    }

    /// Waits until every job and probe has ended (their results wait for [`Self::finished`]),
    /// at most `timeout`. A job is never abandoned halfway: on timeout the jobs still run,
    /// and the error says how many.
    pub fn drain(&mut self, timeout: Duration) -> Result<(), HwError> {
        // A bound beyond the clock's range waits without one.
        let until = Instant::now().checked_add(timeout);
        self.collect();
        while self.core.in_flight() > 0 {
            let left = until.map_or(Duration::MAX, |u| {
                u.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(HwError::Store(StoreError::Unavailable(format!(
                    "{} jobs of the {} tier still running after {:.1} s",
                    self.core.in_flight(),
                    self.store.name(),
                    timeout.as_secs_f64()
                ))));
            }
            if let Some(c) = self.done.pop_timeout(left.min(Duration::from_millis(100))) {
                self.apply(c);
                self.collect();
            }
        }
        Ok(())
    }

    /// What the tier stored and removed since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.core.take_events()
    }

    /// The counts since the tier was made.
    pub fn stats(&self) -> HostedIoStats {
        HostedIoStats {
            core: self.core.stats(),
            ..self.stats
        }
    }

    /// The last store error, if any.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The core's invariants (I13, I7, I8).
    pub fn check_invariants(&self) -> Result<(), kvtier_core::Violation> {
        self.core.check_invariants()
    }

    /// Drains (at most `timeout`), then stops the IO threads. If every job ended, the
    /// threads are joined and the host's memory is no longer touched: `Ok`. If some still
    /// run (a hung disk or server), queued jobs are dropped unrun, the running ones are left
    /// to end alone, and the threads are not joined: the error says so, and the host must keep
    /// its memory mapped for as long as the process lives.
    pub fn shutdown(mut self, timeout: Duration) -> Result<(), HwError> {
        match self.drain(timeout) {
            Ok(()) => {
                self.stop();
                Ok(())
            }
            Err(e) => {
                drop(self.io.stop());
                self.detached = true;
                Err(e)
            }
        }
    }

    fn stop(&mut self) {
        for t in self.io.stop() {
            let _ = t.join();
        }
    }

    /// Applies every completion queued now.
    fn collect(&mut self) {
        let mut batch = Vec::new();
        self.done.drain_into(&mut batch);
        for c in batch {
            self.apply(c);
        }
    }

    fn apply(&mut self, c: Completion) {
        let Completion::Tier(d) = c else {
            return; // no transfers run here
        };
        let ok = d.error.is_none() && d.result.outcome != Outcome::Failed;
        let seconds = d.elapsed.as_secs_f64();
        match d.path {
            JobPath::Cascade => {
                self.stats.bytes_written += d.bytes;
                self.stats.store_jobs += 1;
                self.stats.store_seconds += seconds;
            }
            JobPath::Promote => {
                self.stats.bytes_read += d.bytes;
                self.stats.load_jobs += 1;
                self.stats.load_seconds += seconds;
            }
            JobPath::Probe => {}
        }
        self.stats.corrupt_reads += d.corrupt;
        if !ok && d.path != JobPath::Probe {
            self.stats.jobs_failed += 1;
        }
        if let Some(e) = &d.error {
            tracing::debug!(job = %d.result.job, error = %e, "hosted tier job failed");
            self.last_error = Some(e.clone());
        }
        if d.path != JobPath::Probe {
            self.io_of.insert(d.result.job, (d.bytes, seconds));
        }
        if let Err(e) = self.core.handle_job_result(d.result) {
            tracing::error!(error = %e, "hosted tier job result refused");
        }
        self.pump();
    }

    /// The core's clock: milliseconds since the driver started.
    fn tick(&mut self) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.core.set_clock(now);
    }

    /// Carries out the core's effects in order: deletes here, jobs on the IO threads.
    fn pump(&mut self) {
        while let Some(effect) = self.core.poll_effect() {
            match effect {
                Effect::Delete { keys, .. } => {
                    for key in keys {
                        if let Err(e) = self.store.delete(&key) {
                            self.stats.delete_failures += 1;
                            tracing::warn!(%key, error = %e, "hosted tier delete failed");
                        }
                    }
                }
                Effect::Submit(job) => {
                    if let Err(job) = self.io.submit(job) {
                        let r = kvtier_core::JobResult {
                            job: job.id,
                            outcome: Outcome::Failed,
                        };
                        if let Err(e) = self.core.handle_job_result(r) {
                            tracing::error!(error = %e, "hosted tier job result refused");
                        }
                    }
                }
            }
        }
    }
}

impl Drop for HostedDriver {
    /// The IO threads end before the host's memory can go: queued jobs are dropped unrun,
    /// running ones finish.
    fn drop(&mut self) {
        if !self.detached {
            self.stop();
        }
    }
}
