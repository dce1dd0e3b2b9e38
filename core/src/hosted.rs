//! One secondary tier driven by another engine's tiering manager (rules G1–G10).
//!
//! vLLM 0.33's `TieringOffloadingSpec` owns the primary tier and calls each secondary tier
//! through its `SecondaryTierManager` interface. [`HostedTier`] is a kvtier tier index (T1–T15)
//! behind those calls: the host names jobs and primary slots, the tier decides what it holds,
//! what it evicts and which reads may start, and says so as [`Effect`]s for the IO layer.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::format;
use alloc::vec::Vec;

use crate::config::{TierConfig, TierKind};
use crate::error::{Error, Violation, ensure};
use crate::event::{Effect, Event, EventKind, Job, JobKind, JobResult, Medium, Outcome, Transfer};
use crate::key::{JobId, Key, RequestId, SlotId, TierId};
use crate::tier::{EntryState, ReadEnd, TierAnswer, TierIndex};

/// A hosted tier's answer to a lookup, with vLLM 0.33's `LookupResult` meanings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostedLookup {
    /// The tier holds the block; the host may promote it in this step (G1).
    Hit,
    /// The tier does not hold it (G3), or cannot ask (G4).
    Miss,
    /// The block is being written or probed: ask again later (G2, G4).
    Retry,
}

/// The end of one host job (G5–G8): vLLM's `JobResult`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostedResult {
    /// The host's job id.
    pub job: JobId,
    /// Whether the job did all it had to: every block the tier chose to write was written
    /// (store), every block the host named was read (load).
    pub success: bool,
    /// A load that did not succeed: the blocks that were read, in the host's order, when
    /// some were. `None` means every block shares `success`.
    pub succeeded: Option<Vec<Key>>,
    /// Blocks moved.
    pub blocks: u32,
    /// Whether it was a load (a promotion into the host's primary).
    pub load: bool,
}

/// What a hosted tier counted since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostedStats {
    /// Store jobs the host submitted.
    pub store_jobs: u64,
    /// Load jobs the host submitted.
    pub load_jobs: u64,
    /// Lookups answered `Hit`.
    pub hits: u64,
    /// Lookups answered `Miss`.
    pub misses: u64,
    /// Lookups answered `Retry`.
    pub retries: u64,
    /// Blocks written.
    pub blocks_stored: u64,
    /// Blocks a store offered that the tier already held or was writing (G5).
    pub blocks_already_held: u64,
    /// Blocks a store offered for which no room could be made (G5).
    pub blocks_skipped_full: u64,
    /// Blocks evicted for room.
    pub blocks_evicted: u64,
    /// Blocks whose write failed.
    pub store_failures: u64,
    /// Blocks read into the host's primary.
    pub blocks_loaded: u64,
    /// Blocks a load named that could not be read (not Present, failed, gone).
    pub load_failures: u64,
    /// Existence probes submitted (shared tiers).
    pub probes: u64,
    /// Lookups answered `Miss` because the probe bound was reached.
    pub probes_skipped: u64,
}

#[derive(Clone, Debug)]
enum HostJob {
    Store {
        /// Entry ids being written, in the job's order.
        entries: Vec<u32>,
        /// Their keys.
        keys: Vec<Key>,
    },
    Load {
        /// Every key the host named, in its order.
        keys: Vec<Key>,
        /// Per key, the entry being read, or `None` if it failed at once (G6).
        reads: Vec<Option<u32>>,
    },
}

/// Probe job ids have the top bit set; host job ids must not.
const PROBE_BIT: u64 = 1 << 63;

/// One secondary tier under a host's tiering manager (G1–G10). See `docs/state-machine.md`.
#[derive(Clone, Debug)]
pub struct HostedTier {
    index: TierIndex,
    config: TierConfig,
    step: u64,
    jobs: BTreeMap<JobId, HostJob>,
    /// Existence probes in flight: job → key.
    probes: BTreeMap<JobId, Key>,
    next_probe: u64,
    /// Entries held by this step's `Hit` answers (G1).
    holds: BTreeSet<u32>,
    effects: VecDeque<Effect>,
    finished: VecDeque<HostedResult>,
    events: Vec<Event>,
    stats: HostedStats,
}

impl HostedTier {
    /// An empty tier; `config.kind` says whether other nodes write it too.
    pub fn new(config: TierConfig) -> Self {
        HostedTier {
            index: TierIndex::new(TierId(0), &config),
            config,
            step: 0,
            jobs: BTreeMap::new(),
            probes: BTreeMap::new(),
            next_probe: 0,
            holds: BTreeSet::new(),
            effects: VecDeque::new(),
            finished: VecDeque::new(),
            events: Vec::new(),
            stats: HostedStats::default(),
        }
    }

    /// The tier's index.
    pub fn index(&self) -> &TierIndex {
        &self.index
    }

    /// What it counted.
    pub fn stats(&self) -> HostedStats {
        self.stats
    }

    /// Host jobs not yet ended.
    pub fn outstanding(&self) -> usize {
        self.jobs.len()
    }

    /// Jobs the IO layer runs now (host jobs and probes).
    pub fn in_flight(&self) -> usize {
        self.jobs.len() + self.probes.len()
    }

    /// Records the blocks a reopened store holds, oldest first, as Present up to the capacity.
    /// The keys that did not fit are deleted (an `Effect::Delete`).
    pub fn restore(&mut self, keys: impl IntoIterator<Item = Key>) {
        let rejected = self.index.restore(keys);
        let delete = self.index.to_delete(rejected);
        if !delete.is_empty() {
            self.effects.push_back(Effect::Delete {
                tier: TierId(0),
                keys: delete,
            });
        }
    }

    /// G1–G4.
    pub fn lookup(&mut self, key: &Key) -> HostedLookup {
        let (answer, id) = self.index.lookup_entry(key, self.step);
        let answer = match answer {
            TierAnswer::Present => {
                let id = id.expect("a Present answer names its entry");
                if !crate::mutant::active("no_hold") && self.holds.insert(id) {
                    self.index.start_read(id);
                }
                HostedLookup::Hit
            }
            TierAnswer::Busy => HostedLookup::Retry,
            TierAnswer::Absent => HostedLookup::Miss,
            TierAnswer::Unknown => {
                if self.probes.len() >= self.config.max_outstanding_probes as usize {
                    self.stats.probes_skipped += 1;
                    HostedLookup::Miss
                } else {
                    let job = JobId(PROBE_BIT | self.next_probe);
                    self.next_probe += 1;
                    self.index.start_probe(key.clone(), job);
                    self.probes.insert(job, key.clone());
                    self.stats.probes += 1;
                    self.effects.push_back(Effect::Submit(Job {
                        id: job,
                        tier: TierId(0),
                        kind: JobKind::Exists { key: key.clone() },
                    }));
                    HostedLookup::Retry
                }
            }
        };
        match answer {
            HostedLookup::Hit => self.stats.hits += 1,
            HostedLookup::Miss => self.stats.misses += 1,
            HostedLookup::Retry => self.stats.retries += 1,
        }
        self.debug_check();
        answer
    }

    /// Debug builds check I13 after every change, as the manager checks its invariants.
    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(v) = self.check_invariants() {
            panic!("{v}");
        }
    }

    /// G10: a job id the host may use now, and blocks with distinct keys.
    fn admit(&self, job: JobId, blocks: &[(Key, SlotId)]) -> Result<(), Error> {
        if job.0 & PROBE_BIT != 0 || self.jobs.contains_key(&job) {
            return Err(Error::JobInUse { job });
        }
        let distinct: BTreeSet<&Key> = blocks.iter().map(|(k, _)| k).collect();
        if distinct.len() != blocks.len() {
            return Err(Error::InvalidOutcome {
                job,
                reason: "a job names a block twice",
            });
        }
        Ok(())
    }

    /// G5: the host stores `blocks` (key, primary slot) from its primary into the tier.
    pub fn submit_store(&mut self, job: JobId, blocks: &[(Key, SlotId)]) -> Result<(), Error> {
        self.admit(job, blocks)?;
        self.stats.store_jobs += 1;
        let transfers: Vec<Transfer> = blocks
            .iter()
            .map(|(key, slot)| Transfer {
                key: key.clone(),
                slot: *slot,
            })
            .collect();
        let plan = self.index.plan_store(&transfers, &mut self.events);
        self.stats.blocks_already_held += plan.held as u64;
        self.stats.blocks_skipped_full += plan.full as u64;
        self.stats.blocks_evicted += plan.evicted.len() as u64;
        let delete = self.index.to_delete(plan.evicted);
        if !delete.is_empty() {
            self.effects.push_back(Effect::Delete {
                tier: TierId(0),
                keys: delete,
            });
        }
        if plan.writes.is_empty() {
            self.finished.push_back(HostedResult {
                job,
                success: true,
                succeeded: None,
                blocks: 0,
                load: false,
            });
            return Ok(());
        }
        let keys = plan.writes.iter().map(|t| t.key.clone()).collect();
        self.jobs.insert(
            job,
            HostJob::Store {
                entries: plan.entries,
                keys,
            },
        );
        self.effects.push_back(Effect::Submit(Job {
            id: job,
            tier: TierId(0),
            kind: JobKind::Store {
                request: RequestId(0),
                blocks: plan.writes,
            },
        }));
        self.debug_check();
        Ok(())
    }

    /// G6: the host loads `blocks` (key, primary slot) from the tier into its primary.
    pub fn submit_load(&mut self, job: JobId, blocks: &[(Key, SlotId)]) -> Result<(), Error> {
        self.admit(job, blocks)?;
        self.stats.load_jobs += 1;
        let mut reads = Vec::with_capacity(blocks.len());
        let mut transfers = Vec::with_capacity(blocks.len());
        for (key, slot) in blocks {
            match self.index.lookup_entry(key, self.step) {
                (TierAnswer::Present, Some(id)) => {
                    self.index.start_read(id);
                    reads.push(Some(id));
                    transfers.push(Transfer {
                        key: key.clone(),
                        slot: *slot,
                    });
                }
                _ => {
                    self.stats.load_failures += 1;
                    reads.push(None);
                }
            }
        }
        let keys: Vec<Key> = blocks.iter().map(|(k, _)| k.clone()).collect();
        if transfers.is_empty() {
            self.finished.push_back(HostedResult {
                job,
                success: false,
                succeeded: None,
                blocks: 0,
                load: true,
            });
            return Ok(());
        }
        self.jobs.insert(job, HostJob::Load { keys, reads });
        self.effects.push_back(Effect::Submit(Job {
            id: job,
            tier: TierId(0),
            kind: JobKind::Load {
                request: RequestId(0),
                blocks: transfers.into(),
            },
        }));
        self.debug_check();
        Ok(())
    }

    /// G7, G8, T5, T6: the IO layer's result of a job it was given.
    pub fn handle_job_result(&mut self, result: JobResult) -> Result<(), Error> {
        let job = result.job;
        if let Some(key) = self.probes.get(&job) {
            let found = match result.outcome {
                Outcome::Ok => Some(true),
                Outcome::NotFound => Some(false),
                Outcome::Failed => None,
                Outcome::Partial { .. } => {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "a probe has no partial outcome",
                    });
                }
            };
            let key = key.clone();
            self.probes.remove(&job);
            let evicted = self
                .index
                .finish_probe(&key, found, self.step, &mut self.events);
            self.stats.blocks_evicted += evicted.len() as u64;
            let delete = self.index.to_delete(evicted);
            if !delete.is_empty() {
                self.effects.push_back(Effect::Delete {
                    tier: TierId(0),
                    keys: delete,
                });
            }
            return Ok(());
        }
        let Some(host_job) = self.jobs.get(&job) else {
            return Err(Error::UnknownJob { job });
        };
        // Which of the job's blocks moved; the rest failed, or (a shared store's loads) are
        // gone from the store.
        let (moved, missing): (BTreeSet<&Key>, BTreeSet<&Key>) = match &result.outcome {
            Outcome::Ok => match host_job {
                HostJob::Store { keys, .. } => (keys.iter().collect(), BTreeSet::new()),
                HostJob::Load { keys, reads } => (
                    keys.iter()
                        .zip(reads)
                        .filter(|(_, r)| r.is_some())
                        .map(|(k, _)| k)
                        .collect(),
                    BTreeSet::new(),
                ),
            },
            Outcome::Failed => (BTreeSet::new(), BTreeSet::new()),
            Outcome::NotFound => match host_job {
                HostJob::Load { keys, reads } => (
                    BTreeSet::new(),
                    keys.iter()
                        .zip(reads)
                        .filter(|(_, r)| r.is_some())
                        .map(|(k, _)| k)
                        .collect(),
                ),
                HostJob::Store { .. } => {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "a store is never not found",
                    });
                }
            },
            Outcome::Partial { succeeded, missing } => {
                let carried: BTreeSet<&Key> = match host_job {
                    HostJob::Store { keys, .. } => keys.iter().collect(),
                    HostJob::Load { keys, reads } => keys
                        .iter()
                        .zip(reads)
                        .filter(|(_, r)| r.is_some())
                        .map(|(k, _)| k)
                        .collect(),
                };
                if let Some(k) = succeeded
                    .iter()
                    .chain(missing)
                    .find(|k| !carried.contains(k))
                {
                    return Err(Error::ForeignKey {
                        job,
                        key: k.clone(),
                    });
                }
                (succeeded.iter().collect(), missing.iter().collect())
            }
        };
        let moved: BTreeSet<Key> = moved.into_iter().cloned().collect();
        let missing: BTreeSet<Key> = missing.into_iter().cloned().collect();
        let host_job = self.jobs.remove(&job).expect("looked up above");
        let ended = match host_job {
            HostJob::Store { entries, keys } => {
                let total = keys.len();
                let mut stored = Vec::new();
                for (id, key) in entries.into_iter().zip(keys) {
                    let ok = moved.contains(&key);
                    self.index.finish_write(id, ok);
                    if ok {
                        stored.push(key);
                    } else {
                        self.stats.store_failures += 1;
                    }
                }
                let written = stored.len();
                let all = written == total;
                self.stats.blocks_stored += written as u64;
                if !stored.is_empty() {
                    self.events.push(Event {
                        medium: Medium::Tier(TierId(0)),
                        kind: EventKind::Stored,
                        keys: stored,
                    });
                }
                HostedResult {
                    job,
                    success: all,
                    succeeded: None,
                    blocks: written as u32,
                    load: false,
                }
            }
            HostJob::Load { keys, reads } => {
                let mut read = Vec::new();
                let mut delete = Vec::new();
                for (key, entry) in keys.iter().zip(&reads) {
                    let Some(id) = *entry else { continue };
                    let end = if moved.contains(key) {
                        ReadEnd::Ok
                    } else if missing.contains(key) {
                        ReadEnd::Missing
                    } else {
                        ReadEnd::Failed
                    };
                    if end == ReadEnd::Ok {
                        read.push(key.clone());
                    } else {
                        self.stats.load_failures += 1;
                    }
                    if let Some(k) = self.index.end_read(id, end, self.step) {
                        delete.push(k);
                    }
                }
                if !delete.is_empty() {
                    self.effects.push_back(Effect::Delete {
                        tier: TierId(0),
                        keys: delete,
                    });
                }
                self.stats.blocks_loaded += read.len() as u64;
                let blocks = read.len() as u32;
                let success = read.len() == keys.len();
                HostedResult {
                    job,
                    success,
                    succeeded: (!success && !read.is_empty()).then_some(read),
                    blocks,
                    load: true,
                }
            }
        };
        self.finished.push_back(ended);
        self.debug_check();
        Ok(())
    }

    /// T12: the host used `keys` (first to last).
    pub fn touch(&mut self, keys: &[Key]) {
        self.index.touch(keys);
    }

    /// G9: the host's step ended.
    pub fn end_step(&mut self) {
        for id in core::mem::take(&mut self.holds) {
            let released = self.index.end_read(id, ReadEnd::Cancelled, self.step);
            debug_assert!(released.is_none(), "a cancelled read deletes nothing");
        }
        self.step += 1;
        self.index.expire(self.step);
        self.debug_check();
    }

    /// The next effect for the IO layer, in order (a delete frees the room a later store uses).
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// The host jobs that ended since the last call, each exactly once.
    pub fn take_finished(&mut self) -> Vec<HostedResult> {
        self.finished.drain(..).collect()
    }

    /// What the tier stored and removed since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        core::mem::take(&mut self.events)
    }

    /// I13 and the index's own invariants (I7, I8).
    pub fn check_invariants(&self) -> Result<(), Violation> {
        self.index.check_invariants()?;
        let (writing, readers) = self.index.writing_and_readers();
        let mut want_writing = BTreeSet::new();
        let mut want_readers: BTreeMap<&Key, u32> = BTreeMap::new();
        for job in self.jobs.values() {
            match job {
                HostJob::Store { keys, .. } => want_writing.extend(keys.iter()),
                HostJob::Load { keys, reads } => {
                    for (k, r) in keys.iter().zip(reads) {
                        if r.is_some() {
                            *want_readers.entry(k).or_default() += 1;
                        }
                    }
                }
            }
        }
        for &id in &self.holds {
            let key = self.index.key_of(id);
            ensure!(key.is_some(), "I13", "a held entry {id} is gone");
            let key = key.expect("checked");
            ensure!(
                matches!(self.index.state_of(key), Some(EntryState::Present { .. })),
                "I13",
                "held {key} is not Present"
            );
            *want_readers.entry(key).or_default() += 1;
        }
        ensure!(
            writing == want_writing,
            "I13",
            "Writing keys {} differ from the store jobs' {}",
            writing.len(),
            want_writing.len()
        );
        let readers: BTreeMap<&Key, u32> = readers.into_iter().filter(|(_, r)| *r > 0).collect();
        ensure!(
            readers == want_readers,
            "I13",
            "readers {:?} differ from loads and holds {:?}",
            readers.len(),
            want_readers.len()
        );
        for (job, key) in &self.probes {
            ensure!(
                self.index.is_probing(key),
                "I13",
                "{job} probes {key}, which the index does not"
            );
        }
        ensure!(
            self.index.probes_outstanding() == self.probes.len(),
            "I13",
            "{} probing keys, {} probe jobs",
            self.index.probes_outstanding(),
            self.probes.len()
        );
        Ok(())
    }
}

impl HostedTier {
    /// Whether the tier is shared by other nodes (a Redis tier) or only this one's.
    pub fn kind(&self) -> TierKind {
        self.config.kind
    }

    /// A one-line summary for logs.
    pub fn describe(&self) -> alloc::string::String {
        format!(
            "{:?} tier: {} of {} blocks, {} jobs, {} probes",
            self.config.kind,
            self.index.len(),
            self.index.capacity(),
            self.jobs.len(),
            self.probes.len()
        )
    }
}
