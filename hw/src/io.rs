//! A secondary tier's IO threads: they run the core's jobs against a [`SecondaryStore`],
//! reading and writing primary rows, and report each job's end exactly once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::{
    Job, JobId, JobKind, JobResult, Key, Outcome, SlotId, TierId, TierKind, Transfer,
};

use crate::engine::{Completion, Completions};
use crate::queue::Queue;
use crate::region::Region;
use crate::store::{SecondaryStore, StoreError};

/// The primary's rows, as the IO threads read and write them: kvtier's own [`Region`], or a
/// host's primary memory ([`crate::hosted::HostRows`]).
pub(crate) trait Rows: Send + Sync + 'static {
    /// Bytes of one row (one block).
    fn row_bytes(&self) -> usize;
    /// Calls `f` with the rows of `slots`, read only.
    fn with_rows<R>(&self, slots: &[SlotId], f: impl FnOnce(&[&[u8]]) -> R) -> Result<R, String>;
    /// Calls `f` with the rows of `slots` (distinct), writable.
    fn with_rows_mut<R>(
        &self,
        slots: &[SlotId],
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R, String>;
    /// Calls `f` with the row of `slot`, read only.
    fn with_row<R>(&self, slot: SlotId, f: impl FnOnce(&[u8]) -> R) -> Result<R, String> {
        self.with_rows(&[slot], |rows| f(rows[0]))
    }
    /// Calls `f` with the row of `slot`, writable.
    fn with_row_mut<R>(&self, slot: SlotId, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, String> {
        self.with_rows_mut(&[slot], |rows| f(&mut *rows[0]))
    }
}

impl Rows for Region {
    fn row_bytes(&self) -> usize {
        self.layout().row_bytes()
    }
    fn with_rows<R>(&self, slots: &[SlotId], f: impl FnOnce(&[&[u8]]) -> R) -> Result<R, String> {
        Region::with_rows(self, slots, f).map_err(|e| e.to_string())
    }
    fn with_rows_mut<R>(
        &self,
        slots: &[SlotId],
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R, String> {
        Region::with_rows_mut(self, slots, f).map_err(|e| e.to_string())
    }
    fn with_row<R>(&self, slot: SlotId, f: impl FnOnce(&[u8]) -> R) -> Result<R, String> {
        Region::with_row(self, slot, f).map_err(|e| e.to_string())
    }
    fn with_row_mut<R>(&self, slot: SlotId, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, String> {
        Region::with_row_mut(self, slot, f).map_err(|e| e.to_string())
    }
}

/// What a tier job moved, for the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobPath {
    /// A cascade: primary → tier.
    Cascade,
    /// A promotion: tier → primary.
    Promote,
    /// An existence probe or a health probe.
    Probe,
}

/// The end of one tier job.
#[derive(Debug)]
pub struct TierDone {
    /// The tier.
    pub tier: TierId,
    /// The result for the core.
    pub result: JobResult,
    /// What kind of job it was.
    pub path: JobPath,
    /// Bytes moved by the blocks that succeeded.
    pub bytes: u64,
    /// From submission to end (its latency, queueing included).
    pub elapsed: Duration,
    /// From the start of its IO to end (its service time).
    pub service: Duration,
    /// The first store error, if any (for logs and counts).
    pub error: Option<String>,
    /// Blocks whose read failed verification ([`StoreError::Corrupt`]): never served.
    pub corrupt: u64,
}

/// What an IO thread takes from a tier's queue.
enum Work {
    /// One job, submitted at the instant.
    Job(Job, Instant),
    /// The existence probes of one step, asked together (one round trip to a remote store).
    Probes(Vec<Job>, Instant),
}

/// One tier's job queue and IO threads.
pub(crate) struct TierIo {
    pub(crate) store: Arc<dyn SecondaryStore>,
    jobs: Arc<Queue<Work>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl TierIo {
    pub(crate) fn start<P: Rows>(
        tier: TierId,
        store: Arc<dyn SecondaryStore>,
        region: Arc<P>,
        done: Completions,
        threads: usize,
    ) -> std::io::Result<Self> {
        let jobs: Arc<Queue<Work>> = Arc::new(Queue::new());
        let threads = (0..threads.max(1))
            .map(|i| {
                let (jobs, store, region, done) =
                    (jobs.clone(), store.clone(), region.clone(), done.clone());
                std::thread::Builder::new()
                    .name(format!("kvtier-tier{}-{i}", tier.0))
                    .spawn(move || {
                        let mut more = Vec::new();
                        while let Some(work) = jobs.pop() {
                            let ended = match work {
                                Work::Job(job, at) => {
                                    let store_job = matches!(job.kind, JobKind::Store { .. });
                                    let mut group = vec![(job, at)];
                                    // Cascades queued behind a cascade go with it, as one
                                    // batch; never past a promotion or probe waiting to go
                                    // first (Q4). Queued cascades are ordinary items.
                                    if store_job {
                                        jobs.take_ordinary(MAX_GROUP - 1, &mut more);
                                        group.extend(more.drain(..).filter_map(|w| match w {
                                            Work::Job(j, at) => Some((j, at)),
                                            Work::Probes(..) => None,
                                        }));
                                    }
                                    run_guarded(tier, &*store, &*region, group)
                                }
                                Work::Probes(probes, at) => {
                                    probe_guarded(tier, &*store, probes, at)
                                }
                            };
                            for d in ended {
                                let _ = done.push(Completion::Tier(d));
                            }
                        }
                    })
            })
            .collect::<std::io::Result<Vec<_>>>();
        let threads = match threads {
            Ok(t) => t,
            Err(e) => {
                jobs.close(); // the threads that did start end at once
                return Err(e);
            }
        };
        Ok(TierIo {
            store,
            jobs,
            threads,
        })
    }

    /// Queues `job`; hands it back if the threads have stopped. Promotions and probes, which
    /// a request or the tier's health waits for, go ahead of cascades (Q4).
    pub(crate) fn submit(&self, job: Job) -> Result<(), Job> {
        let urgent = !matches!(job.kind, JobKind::Store { .. });
        let item = Work::Job(job, Instant::now());
        let pushed = if urgent {
            self.jobs.push_urgent(item)
        } else {
            self.jobs.push(item)
        };
        pushed.map_err(|w| match w {
            Work::Job(j, _) => j,
            Work::Probes(..) => unreachable!("a job was pushed"),
        })
    }

    /// Queues a step's existence probes (each an `Exists` job) as one piece of work, ahead of
    /// cascades (Q4); hands them back if the threads have stopped.
    pub(crate) fn submit_probes(&self, probes: Vec<Job>) -> Result<(), Vec<Job>> {
        debug_assert!(
            probes
                .iter()
                .all(|j| matches!(j.kind, JobKind::Exists { .. }))
        );
        self.jobs
            .push_urgent(Work::Probes(probes, Instant::now()))
            .map_err(|w| match w {
                Work::Probes(p, _) => p,
                Work::Job(..) => unreachable!("probes were pushed"),
            })
    }

    /// Stops taking jobs and drops those still queued, unrun: their slots are no longer the
    /// jobs' once the core has shut down. Jobs already running end alone. Returns the thread
    /// handles to join.
    pub(crate) fn stop(&mut self) -> Vec<std::thread::JoinHandle<()>> {
        self.jobs.close();
        let mut dropped = Vec::new();
        self.jobs.drain_into(&mut dropped);
        if !dropped.is_empty() {
            tracing::debug!(jobs = dropped.len(), "queued tier jobs dropped at shutdown");
        }
        std::mem::take(&mut self.threads)
    }
}

/// Cascade jobs an IO thread takes together at most: their blocks are written as one batch
/// (adjacent records in one IO, one sync under the file tier's `Batch` policy).
const MAX_GROUP: usize = 16;

/// Asks the store about a step's probes in one call, ending each probe as `run_job` ends one
/// (found, not found, or failed), and each as failed if the store panics.
fn probe_guarded(
    tier: TierId,
    store: &dyn SecondaryStore,
    probes: Vec<Job>,
    started: Instant,
) -> Vec<TierDone> {
    let begun = Instant::now();
    let keys: Vec<&Key> = probes
        .iter()
        .filter_map(|j| match &j.kind {
            JobKind::Exists { key } => Some(key),
            _ => None,
        })
        .collect();
    let answers = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.contains_many(&keys)
    }))
    .unwrap_or_else(|panic| {
        let message = panic_message(&*panic);
        tracing::error!(%tier, probes = keys.len(), panic = %message, "tier IO panicked; its probes failed");
        keys.iter()
            .map(|_| Err(StoreError::Unavailable(format!("panicked: {message}"))))
            .collect()
    });
    // Answers go to the probes in order; anything else (never sent here) fails on its own.
    let mut answers = answers.into_iter();
    probes
        .iter()
        .map(|job| {
            let answer = match job.kind {
                JobKind::Exists { .. } => answers.next().unwrap_or_else(|| {
                    Err(StoreError::Unavailable(
                        "the store gave too few answers".into(),
                    ))
                }),
                _ => Err(StoreError::BadInput(format!("{} is not a probe", job.id))),
            };
            probe_ended(answer).finish(tier, job.id, JobPath::Probe, started, begun)
        })
        .collect()
}

/// How an existence probe ended, from the store's answer.
fn probe_ended(answer: Result<bool, StoreError>) -> Ended {
    let (outcome, error) = match answer {
        Ok(true) => (Outcome::Ok, None),
        Ok(false) => (Outcome::NotFound, None),
        Err(e) => (Outcome::Failed, Some(e)),
    };
    Ended {
        outcome,
        bytes: 0,
        error,
        corrupt: 0,
    }
}

/// Runs a group of jobs (one job, or cascades taken together), ending each as failed if the
/// store panics: every job reports exactly once, and the thread lives on to serve the next.
fn run_guarded(
    tier: TierId,
    store: &dyn SecondaryStore,
    region: &impl Rows,
    group: Vec<(Job, Instant)>,
) -> Vec<TierDone> {
    let ids: Vec<(JobId, JobPath, Instant)> = group
        .iter()
        .map(|(j, started)| (j.id, JobPath::of(&j.kind), *started))
        .collect();
    let begun = Instant::now();
    // The store's shared state is behind locks that ignore poisoning, and a failed job
    // changes nothing in the core; what a store loses to a panic is its own (the file tier
    // may hold the records it had taken until it is reopened).
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_group(tier, store, region, group)
    })) {
        Ok(done) => done,
        Err(panic) => {
            let message = panic_message(&*panic);
            tracing::error!(%tier, jobs = ids.len(), panic = %message, "tier IO panicked; its jobs failed");
            ids.into_iter()
                .map(|(job, path, started)| TierDone {
                    tier,
                    result: JobResult {
                        job,
                        outcome: Outcome::Failed,
                    },
                    path,
                    bytes: 0,
                    elapsed: started.elapsed(),
                    service: begun.elapsed(),
                    error: Some(format!("panicked: {message}")),
                    corrupt: 0,
                })
                .collect()
        }
    }
}

/// The text of a panic's payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".to_owned())
}

impl JobPath {
    fn of(kind: &JobKind) -> Self {
        match kind {
            JobKind::Store { .. } => JobPath::Cascade,
            JobKind::Load { .. } => JobPath::Promote,
            JobKind::Exists { .. } | JobKind::Health => JobPath::Probe,
        }
    }
}

/// Runs a group: the blocks of every store or load job in it go to the store as one batch,
/// and each job ends with the results of its own blocks.
fn run_group(
    tier: TierId,
    store: &dyn SecondaryStore,
    region: &impl Rows,
    group: Vec<(Job, Instant)>,
) -> Vec<TierDone> {
    let begun = Instant::now();
    let load = group
        .iter()
        .any(|(j, _)| matches!(j.kind, JobKind::Load { .. }));
    let blocks: Vec<&Transfer> = group.iter().flat_map(|(j, _)| j.blocks()).collect();
    let mut results = if blocks.is_empty() {
        Vec::new()
    } else {
        block_results(store, region, &blocks, load)
    }
    .into_iter();
    group
        .into_iter()
        .map(|(job, started)| {
            let mine: Vec<_> = results.by_ref().take(job.blocks().len()).collect();
            run_job(store, region, &job, mine).finish(
                tier,
                job.id,
                JobPath::of(&job.kind),
                started,
                begun,
            )
        })
        .collect()
}

/// Reads or writes `blocks` as one batch; one result per block, in order.
fn block_results(
    store: &dyn SecondaryStore,
    region: &impl Rows,
    blocks: &[&Transfer],
    load: bool,
) -> Vec<Result<(), StoreError>> {
    // Store: each slot is Ready and pinned by its job (I4); load: each slot is Promoting for
    // its job (I5). Either way no one else writes the rows, and the slots are distinct, so
    // the rows are borrowed all at once and the store batches their IO.
    let slots: Vec<SlotId> = blocks.iter().map(|b| b.slot).collect();
    let results = if load {
        region.with_rows_mut(&slots, |rows| {
            let mut batch: Vec<(&Key, &mut [u8])> = blocks
                .iter()
                .zip(rows.iter_mut())
                .map(|(b, row)| (&b.key, &mut **row))
                .collect();
            store.get_many(&mut batch)
        })
    } else {
        region.with_rows(&slots, |rows| {
            let batch: Vec<(&Key, &[u8])> = blocks
                .iter()
                .map(|b| &b.key)
                .zip(rows.iter().copied())
                .collect();
            store.put_many(&batch)
        })
    };
    match results {
        Ok(r) => r,
        // A slot outside the region (or named twice): each block on its own, so the others
        // still run; a slot a load names again is refused, never written twice.
        Err(_) => {
            let mut seen = std::collections::BTreeSet::new();
            blocks
                .iter()
                .map(|b| {
                    if load && !seen.insert(b.slot) {
                        return Err(StoreError::BadInput(format!(
                            "slot {} is named twice in one batch",
                            b.slot.0
                        )));
                    }
                    let r = if load {
                        region.with_row_mut(b.slot, |row| store.get(&b.key, row))
                    } else {
                        region.with_row(b.slot, |row| store.put(&b.key, row))
                    };
                    r.unwrap_or_else(|e| Err(StoreError::BadInput(e)))
                })
                .collect()
        }
    }
}

/// How one job ended, before its timing is added.
struct Ended {
    outcome: Outcome,
    bytes: u64,
    error: Option<StoreError>,
    /// Blocks that failed verification.
    corrupt: u64,
}

impl Ended {
    fn finish(
        self,
        tier: TierId,
        job: JobId,
        path: JobPath,
        started: Instant,
        begun: Instant,
    ) -> TierDone {
        if let Some(e) = &self.error {
            tracing::debug!(%tier, %job, error = %e, "tier operation failed");
        }
        TierDone {
            tier,
            result: JobResult {
                job,
                outcome: self.outcome,
            },
            path,
            bytes: self.bytes,
            elapsed: started.elapsed(),
            service: begun.elapsed(),
            error: self.error.map(|e| e.to_string()),
            corrupt: self.corrupt,
        }
    }
}

/// Ends `job`: a store or load job from its blocks' `results`, a probe by asking the store.
fn run_job(
    store: &dyn SecondaryStore,
    region: &impl Rows,
    job: &Job,
    results: Vec<Result<(), StoreError>>,
) -> Ended {
    let mut error = None;
    let mut corrupt = 0;
    let (outcome, bytes) = match &job.kind {
        JobKind::Store { blocks, .. } | JobKind::Load { blocks, .. } => {
            // J6: a block a shared store no longer holds (its memory policy evicted it, it
            // expired, the store was flushed) is missing, not failed.
            let loads_shared =
                matches!(job.kind, JobKind::Load { .. }) && store.kind() == TierKind::Shared;
            let mut ok = Vec::with_capacity(blocks.len());
            let mut missing = Vec::new();
            for (b, r) in blocks.iter().zip(results) {
                match r {
                    Ok(()) => ok.push(b.key.clone()),
                    Err(StoreError::NotFound { .. }) if loads_shared => missing.push(b.key.clone()),
                    Err(e) => {
                        corrupt += u64::from(matches!(e, StoreError::Corrupt { .. }));
                        error.get_or_insert(e);
                    }
                }
            }
            let bytes = ok.len() as u64 * region.row_bytes() as u64;
            let outcome = if ok.len() == blocks.len() {
                Outcome::Ok
            } else if missing.len() == blocks.len() {
                Outcome::NotFound
            } else if ok.is_empty() && missing.is_empty() {
                Outcome::Failed
            } else {
                Outcome::Partial {
                    succeeded: ok,
                    missing,
                }
            };
            (outcome, bytes)
        }
        JobKind::Exists { key } => return probe_ended(store.contains(key)),
        JobKind::Health => match store.check() {
            Ok(()) => (Outcome::Ok, 0),
            Err(e) => {
                error = Some(e);
                (Outcome::Failed, 0)
            }
        },
    };
    Ended {
        outcome,
        bytes,
        error,
        corrupt,
    }
}
