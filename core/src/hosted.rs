//! One secondary tier driven by another engine's tiering manager (rules G1–G16).
//!
//! vLLM 0.33's `TieringOffloadingSpec` owns the primary tier and calls each secondary tier
//! through its `SecondaryTierManager` interface. [`HostedTier`] is a kvtier tier index (T1–T15)
//! behind those calls: the host names jobs and primary slots, the tier decides what it holds,
//! what it evicts and which reads may start, and says so as [`Effect`]s for the IO layer. It
//! also keeps the tier's health (a tier that keeps failing is skipped until a probe finds it
//! well) and a deadline on `Retry` answers, so a tier whose IO hangs never holds the host's
//! requests.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use crate::config::{Admission, ConfigError, HealthConfig, TierConfig, TierKind};
use crate::error::{Error, Violation, ensure};
use crate::event::{Effect, Event, EventKind, Job, JobKind, JobResult, Medium, Outcome, Transfer};
use crate::key::{JobId, Key, RequestId, SlotId, TierId};
use crate::stats::Health;
use crate::tier::{EntryState, ReadEnd, TierAnswer, TierIndex};

/// A hosted tier's answer to a lookup, with vLLM 0.33's `LookupResult` meanings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostedLookup {
    /// The tier holds the block; the host may promote it in this step (G1).
    Hit,
    /// The tier does not hold it, cannot ask, is Down, or waited too long (G3, G4, G11, G12).
    Miss,
    /// The block is being written or probed: ask again later (G2, G4).
    Retry,
}

/// How a hosted tier is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostedConfig {
    /// Its kind, capacity, policy and probe bounds. Its `admission` must be `Cascade`: the
    /// host's manager decides what the tier is written (a victim tier needs kvtier's
    /// `Manager`; [`HostedTier::new`] refuses another).
    pub tier: TierConfig,
    /// When it goes Down, and how often a Down tier is probed (G12–G14).
    pub health: HealthConfig,
    /// How long (in the clock's units) a block may answer `Retry` before it answers `Miss`
    /// (G11); `None`: for as long as its write or probe runs.
    pub wait_deadline: Option<u64>,
    /// G16: the blocks a load read update the tier's recency when it ends, as a `touch` of
    /// them would (the default). A host such as vLLM 0.33 never touches its tiers, so without
    /// it the tier's recency is its stores' alone; `false` gives that, for measurements.
    pub learn_reads: bool,
}

impl HostedConfig {
    /// `tier` with the default health rules and no deadline.
    pub fn new(tier: TierConfig) -> Self {
        HostedConfig {
            tier,
            health: HealthConfig::default(),
            wait_deadline: None,
            learn_reads: true,
        }
    }

    /// Checks the values as [`Config::validate`](crate::Config::validate) checks a
    /// secondary tier's (the fields named `tier.…`; the reuse-aware LRU is taken, fed by the
    /// blocks loads read, G16, and the host's touches) and the health thresholds; besides,
    /// the tier's admission must be [`Admission::Cascade`]: the host's manager decides what
    /// the tier is written, and a victim tier (V1–V4) needs kvtier's `Manager`. Any
    /// `wait_deadline` is taken (0: a busy block answers `Miss` once its clock has moved on).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tier.validate("tier", true)?;
        if self.tier.admission != Admission::Cascade {
            return Err(ConfigError::Invalid {
                field: String::from("tier.admission"),
                reason: "a hosted tier is written as its host's manager decides: a victim tier \
                         (V1-V4) needs kvtier's own Manager",
            });
        }
        self.health.validate()
    }
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
    /// Lookups answered `Miss` because the block had been busy for longer than the
    /// deadline (G11).
    pub wait_timeouts: u64,
    /// Blocks written.
    pub blocks_stored: u64,
    /// Blocks a store offered that the tier already held or was writing (G5).
    pub blocks_already_held: u64,
    /// Blocks a store offered for which no room could be made (G5).
    pub blocks_skipped_full: u64,
    /// Blocks a store offered while the tier was Down (G12).
    pub blocks_skipped_down: u64,
    /// Blocks evicted for room.
    pub blocks_evicted: u64,
    /// Blocks whose write failed.
    pub store_failures: u64,
    /// Blocks read into the host's primary.
    pub blocks_loaded: u64,
    /// Blocks a load named that could not be read (not Present, failed, Down).
    pub load_failures: u64,
    /// Blocks a load found gone from a shared store (T15; counted in `load_failures` too).
    pub load_missing: u64,
    /// Existence probes submitted (shared tiers).
    pub probes: u64,
    /// Lookups answered `Miss` because the probe bound was reached.
    pub probes_skipped: u64,
    /// Times the tier went Down.
    pub times_down: u64,
}

#[derive(Clone, Debug)]
enum HostJob {
    Store {
        /// Entry ids being written, in the job's order.
        entries: Vec<u32>,
        /// Their keys.
        keys: Vec<Key>,
        /// The primary slots it reads.
        slots: Vec<SlotId>,
    },
    Load {
        /// Every key the host named, in its order.
        keys: Vec<Key>,
        /// Per key, the entry being read, or `None` if it failed at once (G6).
        reads: Vec<Option<u32>>,
        /// The primary slots it writes.
        slots: Vec<SlotId>,
    },
}

/// The tier's own job ids (probes, health checks) have the top bit set; host job ids must
/// not.
const OWN_BIT: u64 = 1 << 63;

/// One secondary tier under a host's tiering manager (G1–G16). See `docs/state-machine.md`.
#[derive(Clone, Debug)]
pub struct HostedTier {
    index: TierIndex,
    config: HostedConfig,
    step: u64,
    clock: u64,
    jobs: BTreeMap<JobId, HostJob>,
    /// Existence probes in flight: job → key.
    probes: BTreeMap<JobId, Key>,
    next_own: u64,
    /// Entries held by this step's `Hit` answers (G1).
    holds: BTreeSet<u32>,
    /// When each Writing or Probing key became busy, on the clock (G11).
    busy_since: BTreeMap<Key, u64>,
    /// Entries whose read failed while other readers still held them: dropped, as that read
    /// ends them, when the last reader ends (G15).
    doomed: BTreeMap<u32, ReadEnd>,
    /// Primary slots written by outstanding loads, and read by outstanding stores (G10).
    loading: BTreeSet<SlotId>,
    storing: BTreeMap<SlotId, u32>,
    health: Health,
    failures: u32,
    health_job: Option<JobId>,
    effects: VecDeque<Effect>,
    finished: VecDeque<HostedResult>,
    events: Vec<Event>,
    stats: HostedStats,
}

impl HostedTier {
    /// An empty tier, Up; `config.tier.kind` says whether other nodes write it too. A
    /// configuration [`HostedConfig::validate`] refuses is a typed error naming the field.
    pub fn new(config: HostedConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(HostedTier {
            index: TierIndex::new(TierId(0), &config.tier),
            config,
            step: 0,
            clock: 0,
            jobs: BTreeMap::new(),
            probes: BTreeMap::new(),
            next_own: 0,
            holds: BTreeSet::new(),
            busy_since: BTreeMap::new(),
            doomed: BTreeMap::new(),
            loading: BTreeSet::new(),
            storing: BTreeMap::new(),
            health: Health::Up,
            failures: 0,
            health_job: None,
            effects: VecDeque::new(),
            finished: VecDeque::new(),
            events: Vec::new(),
            stats: HostedStats::default(),
        })
    }

    /// The tier's index.
    pub fn index(&self) -> &TierIndex {
        &self.index
    }

    /// What it counted.
    pub fn stats(&self) -> HostedStats {
        self.stats
    }

    /// Up, Down or Probing (G12–G14).
    pub fn health(&self) -> Health {
        self.health
    }

    /// Host jobs not yet ended.
    pub fn outstanding(&self) -> usize {
        self.jobs.len()
    }

    /// Jobs the IO layer runs now (host jobs, probes, a health check).
    pub fn in_flight(&self) -> usize {
        self.jobs.len() + self.probes.len() + usize::from(self.health_job.is_some())
    }

    /// Whether the tier is shared by other nodes (a Redis tier) or only this one's.
    pub fn kind(&self) -> TierKind {
        self.config.tier.kind
    }

    /// The time, in the units of `wait_deadline`; it never goes back (as W1).
    pub fn set_clock(&mut self, now: u64) {
        self.clock = self.clock.max(now);
    }

    /// Records the blocks a reopened store holds, oldest first, as Present up to the capacity.
    /// The keys that did not fit are deleted (an `Effect::Delete`).
    pub fn restore(&mut self, keys: impl IntoIterator<Item = Key>) {
        let rejected = self.index.restore(keys);
        self.delete(rejected);
    }

    fn delete(&mut self, keys: Vec<Key>) {
        let keys = self.index.to_delete(keys);
        if !keys.is_empty() {
            self.effects.push_back(Effect::Delete {
                tier: TierId(0),
                keys,
            });
        }
    }

    fn own_job(&mut self) -> JobId {
        let id = JobId(OWN_BIT | self.next_own);
        self.next_own += 1;
        id
    }

    fn up(&self) -> bool {
        self.health == Health::Up
    }

    /// G1–G4, G11, G12, G15.
    pub fn lookup(&mut self, key: &Key) -> HostedLookup {
        let answer = if self.up() {
            self.lookup_up(key)
        } else {
            HostedLookup::Miss
        };
        match answer {
            HostedLookup::Hit => self.stats.hits += 1,
            HostedLookup::Miss => self.stats.misses += 1,
            HostedLookup::Retry => self.stats.retries += 1,
        }
        self.debug_check();
        answer
    }

    fn lookup_up(&mut self, key: &Key) -> HostedLookup {
        let (answer, id) = self.index.lookup_entry(key, self.step);
        match answer {
            TierAnswer::Present => {
                let id = id.expect("a Present answer names its entry");
                if self.doomed.contains_key(&id) {
                    return HostedLookup::Miss;
                }
                if !crate::mutant::active("no_hold") && self.holds.insert(id) {
                    self.index.start_read(id);
                }
                HostedLookup::Hit
            }
            TierAnswer::Busy => {
                let since = self.busy_since.get(key).copied().unwrap_or(self.clock);
                match self.config.wait_deadline {
                    Some(d) if self.clock.saturating_sub(since) > d => {
                        self.stats.wait_timeouts += 1;
                        HostedLookup::Miss
                    }
                    _ => HostedLookup::Retry,
                }
            }
            TierAnswer::Absent => HostedLookup::Miss,
            TierAnswer::Unknown => {
                if self.probes.len() >= self.config.tier.max_outstanding_probes as usize {
                    self.stats.probes_skipped += 1;
                    return HostedLookup::Miss;
                }
                let job = self.own_job();
                self.index.start_probe(key.clone(), job);
                self.probes.insert(job, key.clone());
                self.busy_since.insert(key.clone(), self.clock);
                self.stats.probes += 1;
                self.effects.push_back(Effect::Submit(Job {
                    id: job,
                    tier: TierId(0),
                    kind: JobKind::Exists { key: key.clone() },
                }));
                HostedLookup::Retry
            }
        }
    }

    /// Debug builds check I13 after every change, as the manager checks its invariants.
    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(v) = self.check_invariants() {
            panic!("{v}");
        }
    }

    /// G10: a job id the host may use now, distinct keys and slots, and no slot that an
    /// outstanding job writes, or (for a load) reads.
    fn admit(&self, job: JobId, blocks: &[(Key, SlotId)], load: bool) -> Result<(), Error> {
        if job.0 & OWN_BIT != 0 || self.jobs.contains_key(&job) {
            return Err(Error::JobInUse { job });
        }
        let keys: BTreeSet<&Key> = blocks.iter().map(|(k, _)| k).collect();
        let slots: BTreeSet<SlotId> = blocks.iter().map(|(_, s)| *s).collect();
        if keys.len() != blocks.len() || slots.len() != blocks.len() {
            return Err(Error::InvalidOutcome {
                job,
                reason: "a job names a block or a slot twice",
            });
        }
        if let Some(&slot) = slots
            .iter()
            .find(|s| self.loading.contains(s) || (load && self.storing.contains_key(s)))
        {
            return Err(Error::SlotBusy { job, slot });
        }
        Ok(())
    }

    /// G5, G12: the host stores `blocks` (key, primary slot) from its primary into the tier.
    pub fn submit_store(&mut self, job: JobId, blocks: &[(Key, SlotId)]) -> Result<(), Error> {
        self.admit(job, blocks, false)?;
        self.stats.store_jobs += 1;
        if !self.up() {
            self.stats.blocks_skipped_down += blocks.len() as u64;
            self.end_at_once(job, false, false);
            return Ok(());
        }
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
        self.delete(plan.evicted);
        if plan.writes.is_empty() {
            self.end_at_once(job, true, false);
            return Ok(());
        }
        let keys: Vec<Key> = plan.writes.iter().map(|t| t.key.clone()).collect();
        let slots: Vec<SlotId> = plan.writes.iter().map(|t| t.slot).collect();
        for k in &keys {
            self.busy_since.insert(k.clone(), self.clock);
        }
        for s in &slots {
            *self.storing.entry(*s).or_default() += 1;
        }
        self.jobs.insert(
            job,
            HostJob::Store {
                entries: plan.entries,
                keys,
                slots,
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

    fn end_at_once(&mut self, job: JobId, success: bool, load: bool) {
        self.finished.push_back(HostedResult {
            job,
            success,
            succeeded: None,
            blocks: 0,
            load,
        });
    }

    /// G6, G12, G15: the host loads `blocks` (key, primary slot) from the tier into its
    /// primary.
    pub fn submit_load(&mut self, job: JobId, blocks: &[(Key, SlotId)]) -> Result<(), Error> {
        self.admit(job, blocks, true)?;
        self.stats.load_jobs += 1;
        let mut reads = Vec::with_capacity(blocks.len());
        let mut transfers = Vec::with_capacity(blocks.len());
        for (key, slot) in blocks {
            match self.index.lookup_entry(key, self.step) {
                (TierAnswer::Present, Some(id)) if self.up() && !self.doomed.contains_key(&id) => {
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
        if transfers.is_empty() {
            self.end_at_once(job, false, true);
            return Ok(());
        }
        let keys: Vec<Key> = blocks.iter().map(|(k, _)| k.clone()).collect();
        let slots: Vec<SlotId> = transfers.iter().map(|t| t.slot).collect();
        self.loading.extend(slots.iter().copied());
        self.jobs.insert(job, HostJob::Load { keys, reads, slots });
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

    /// G7, G8, G12–G15, T5, T6: the IO layer's result of a job it was given.
    pub fn handle_job_result(&mut self, result: JobResult) -> Result<(), Error> {
        let job = result.job;
        if self.health_job == Some(job) {
            self.health_job = None;
            if result.outcome == Outcome::Ok {
                self.health = Health::Up; // G14
                self.failures = 0;
            } else {
                self.health = Health::Down { since: self.step };
            }
            self.debug_check();
            return Ok(());
        }
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
            self.busy_since.remove(&key);
            let evicted = self
                .index
                .finish_probe(&key, found, self.step, &mut self.events);
            self.stats.blocks_evicted += evicted.len() as u64;
            self.delete(evicted);
            self.count_health(found.is_none());
            self.debug_check();
            return Ok(());
        }
        let Some(host_job) = self.jobs.get(&job) else {
            return Err(Error::UnknownJob { job });
        };
        let carried: BTreeSet<&Key> = match host_job {
            HostJob::Store { keys, .. } => keys.iter().collect(),
            HostJob::Load { keys, reads, .. } => keys
                .iter()
                .zip(reads)
                .filter(|(_, r)| r.is_some())
                .map(|(k, _)| k)
                .collect(),
        };
        // Which of the job's blocks moved; the rest failed, or (a shared store's loads) are
        // gone from the store.
        let (moved, missing): (BTreeSet<Key>, BTreeSet<Key>) = match &result.outcome {
            Outcome::Ok => (
                carried.iter().map(|&k| k.clone()).collect(),
                BTreeSet::new(),
            ),
            Outcome::Failed => (BTreeSet::new(), BTreeSet::new()),
            Outcome::NotFound => match host_job {
                HostJob::Load { .. } => (
                    BTreeSet::new(),
                    carried.iter().map(|&k| k.clone()).collect(),
                ),
                HostJob::Store { .. } => {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "a store is never not found",
                    });
                }
            },
            Outcome::Partial { succeeded, missing } => {
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
                (
                    succeeded.iter().cloned().collect(),
                    missing.iter().cloned().collect(),
                )
            }
        };
        let host_job = self.jobs.remove(&job).expect("looked up above");
        let ended = match host_job {
            HostJob::Store {
                entries,
                keys,
                slots,
            } => {
                for s in slots {
                    if let Some(n) = self.storing.get_mut(&s) {
                        *n -= 1;
                        if *n == 0 {
                            self.storing.remove(&s);
                        }
                    }
                }
                let total = keys.len();
                let mut stored = Vec::new();
                for (id, key) in entries.into_iter().zip(keys) {
                    self.busy_since.remove(&key);
                    let ok = moved.contains(&key);
                    self.index.finish_write(id, ok);
                    if ok {
                        stored.push(key);
                    } else {
                        self.stats.store_failures += 1;
                    }
                }
                let written = stored.len();
                self.stats.blocks_stored += written as u64;
                if !stored.is_empty() {
                    self.events.push(Event {
                        medium: Medium::Tier(TierId(0)),
                        kind: EventKind::Stored,
                        keys: stored,
                    });
                }
                self.count_health(written < total);
                HostedResult {
                    job,
                    success: written == total,
                    succeeded: None,
                    blocks: written as u32,
                    load: false,
                }
            }
            HostJob::Load { keys, reads, slots } => {
                for s in &slots {
                    self.loading.remove(s);
                }
                let mut read = Vec::new();
                let mut failed = false;
                for (key, entry) in keys.iter().zip(&reads) {
                    let Some(id) = *entry else { continue };
                    let end = if moved.contains(key) {
                        read.push(key.clone());
                        ReadEnd::Ok
                    } else if missing.contains(key) {
                        self.stats.load_failures += 1;
                        self.stats.load_missing += 1;
                        ReadEnd::Missing
                    } else {
                        self.stats.load_failures += 1;
                        failed = true;
                        ReadEnd::Failed
                    };
                    self.end_read(id, end);
                }
                self.stats.blocks_loaded += read.len() as u64;
                self.count_health(failed);
                // G16: what was read is used, whether or not the host ever touches.
                if self.config.learn_reads && !crate::mutant::active("hosted_reads_not_learned") {
                    let still: Vec<Key> = read
                        .iter()
                        .filter(|k| {
                            matches!(self.index.state_of(k), Some(EntryState::Present { .. }))
                        })
                        .cloned()
                        .collect();
                    self.index.touch(&still);
                }
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

    /// One read of entry `id` ended (T11, T15, G15): a block whose read failed is dropped once
    /// its last reader ends, and answers `Miss` until then.
    fn end_read(&mut self, id: u32, end: ReadEnd) {
        let key = self.index.key_of(id).expect("a read entry is live").clone();
        let end = match (end, self.doomed.get(&id)) {
            (ReadEnd::Failed | ReadEnd::Missing, _) => end,
            (_, Some(&doomed)) => doomed,
            (_, None) => end,
        };
        let deleted = self.index.end_read(id, end, self.step);
        if self.index.state_of(&key).is_some() {
            if matches!(end, ReadEnd::Failed | ReadEnd::Missing) {
                self.doomed.insert(id, end);
            }
            return;
        }
        // Dropped: this node no longer holds it.
        self.doomed.remove(&id);
        self.events.push(Event {
            medium: Medium::Tier(TierId(0)),
            kind: EventKind::Removed,
            keys: alloc::vec![key],
        });
        if let Some(k) = deleted {
            self.effects.push_back(Effect::Delete {
                tier: TierId(0),
                keys: alloc::vec![k],
            });
        }
    }

    /// G12, G13: a job ended with or without a failure.
    fn count_health(&mut self, failed: bool) {
        if !failed {
            self.failures = 0;
            return;
        }
        self.failures += 1;
        if self.up() && self.failures >= self.config.health.failures_to_down.max(1) {
            self.health = Health::Down { since: self.step };
            self.stats.times_down += 1;
        }
    }

    /// T12: the host used `keys` (first to last).
    pub fn touch(&mut self, keys: &[Key]) {
        self.index.touch(keys);
    }

    /// G9, G14: the host's step ended.
    pub fn end_step(&mut self) {
        for id in core::mem::take(&mut self.holds) {
            self.end_read(id, ReadEnd::Cancelled);
        }
        self.step += 1;
        self.index.expire(self.step);
        if let Health::Down { since } = self.health
            && self.step.saturating_sub(since) >= u64::from(self.config.health.probe_interval_steps)
        {
            let job = self.own_job();
            self.health = Health::Probing;
            self.health_job = Some(job);
            self.effects.push_back(Effect::Submit(Job {
                id: job,
                tier: TierId(0),
                kind: JobKind::Health,
            }));
        }
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
        let mut want_loading = BTreeSet::new();
        let mut want_storing: BTreeMap<SlotId, u32> = BTreeMap::new();
        for job in self.jobs.values() {
            match job {
                HostJob::Store { keys, slots, .. } => {
                    want_writing.extend(keys.iter());
                    for s in slots {
                        *want_storing.entry(*s).or_default() += 1;
                    }
                }
                HostJob::Load { keys, reads, slots } => {
                    want_loading.extend(slots.iter().copied());
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
        for &id in self.doomed.keys() {
            let key = self.index.key_of(id);
            ensure!(
                key.is_some_and(|k| readers.contains_key(k)),
                "I13",
                "doomed entry {id} has no reader left"
            );
        }
        ensure!(
            self.loading == want_loading && self.storing == want_storing,
            "I13",
            "the slots in use differ from the outstanding jobs'"
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
        for key in self.busy_since.keys() {
            ensure!(
                writing.contains(key) || self.index.is_probing(key),
                "I13",
                "{key} has a busy time but is neither written nor probed"
            );
        }
        ensure!(
            (self.health == Health::Probing) == self.health_job.is_some(),
            "I13",
            "health {:?} with health job {:?}",
            self.health,
            self.health_job
        );
        Ok(())
    }

    /// A one-line summary for logs.
    pub fn describe(&self) -> alloc::string::String {
        format!(
            "{:?} tier, {:?}: {} of {} blocks, {} jobs, {} probes",
            self.config.tier.kind,
            self.health,
            self.index.len(),
            self.index.capacity(),
            self.jobs.len(),
            self.probes.len()
        )
    }
}
