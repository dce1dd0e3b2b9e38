//! The tiering manager: the primary, the secondary tier indexes, jobs, promotion, cascade,
//! health and back-pressure (rules M1–M11, J1–J6, H1–H6).

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
#[cfg(test)]
use alloc::sync::Arc;
use alloc::vec::Vec;

use crate::config::{Admission, Config, ConfigError, TierKind};
use crate::error::{Error, Violation, ensure};
use crate::event::{
    Effect, Event, EventKind, Job, JobKind, JobResult, Lookup, Medium, Outcome, Transfer,
};
use crate::key::{JobId, Key, RequestId, SlotId, TierId, push_clone};
use crate::primary::{BlockState, PreparedStore, Primary};
use crate::stats::{Health, Stats, TierStats};
use crate::tier::{ReadEnd, TierAnswer, TierIndex};

/// One secondary tier: its index, health and counters.
#[derive(Clone, Debug)]
struct Tier {
    index: TierIndex,
    health: HealthState,
    failures: u32,
    stores_outstanding: u32,
    max_outstanding_stores: u32,
    max_outstanding_probes: u32,
    admission: Admission,
    stats: TierStats,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HealthState {
    Up,
    Down { since: u64 },
    Probing { job: JobId },
    Closed,
}

/// A submitted job, waiting for its result.
#[derive(Clone, Debug)]
struct Outstanding {
    job: Job,
    /// Store and load jobs: the tier entry id of each block, in block order.
    entries: Vec<u32>,
    reported: bool,
}

/// Promotions of one request from one tier, waiting for `end_step`.
#[derive(Clone, Debug)]
struct Batch {
    tier: TierId,
    blocks: Vec<Transfer>,
    entries: Vec<u32>,
}

/// What one request did in the current step: its Hit answers (protected from its own
/// promotions, rule ★8) and its promotions waiting for `end_step`.
#[derive(Clone, Debug, Default)]
struct RequestStep {
    hits: Vec<Key>,
    batches: Vec<Batch>,
}

/// Per-request state of the current step, in one place.
#[derive(Clone, Debug, Default)]
struct Requests {
    by_id: BTreeMap<RequestId, RequestStep>,
    /// Tiers in the order of their first staged promotion, each with its requests in the
    /// order of their first promotion from it (M5).
    staged: Vec<(TierId, Vec<RequestId>)>,
}

impl Requests {
    fn get_mut(&mut self, req: RequestId) -> &mut RequestStep {
        self.by_id.entry(req).or_default()
    }

    /// Takes the staged promotion batches in M5's order: tiers by first staged promotion,
    /// then requests by first promotion from the tier.
    fn take_staged(&mut self) -> Vec<(RequestId, Batch)> {
        let mut out = Vec::new();
        for (tier, reqs) in core::mem::take(&mut self.staged) {
            for req in reqs {
                let step = self.by_id.get_mut(&req).expect("staged request exists");
                let i = step
                    .batches
                    .iter()
                    .position(|b| b.tier == tier)
                    .expect("staged batch exists");
                out.push((req, step.batches.swap_remove(i)));
            }
        }
        out
    }
}

/// Failed promotions: `(tier, key)` skipped by lookups until a step (rule ★2).
#[derive(Clone, Debug, Default)]
struct Cooldowns {
    until: BTreeMap<(TierId, Key), u64>,
    expiry: VecDeque<(u64, TierId, Key)>,
}

impl Cooldowns {
    fn active(&self, tier: TierId, key: &Key, step: u64) -> bool {
        // Avoid building a (tier, key) pair on the hot path when nothing is cooling down.
        !self.until.is_empty()
            && self
                .until
                .get(&(tier, key.clone()))
                .is_some_and(|&u| u > step)
    }

    fn start(&mut self, tier: TierId, key: Key, until: u64) {
        self.until.insert((tier, key.clone()), until);
        self.expiry.push_back((until, tier, key));
    }

    fn expire(&mut self, step: u64) {
        while self.expiry.front().is_some_and(|e| e.0 <= step) {
            let (until, tier, key) = self.expiry.pop_front().expect("front exists");
            let pair = (tier, key);
            if self.until.get(&pair) == Some(&until) {
                self.until.remove(&pair);
            }
        }
    }
}

/// What one collection's results say of each tier's health (H1, H2): per tier, in the order
/// first seen, whether any of its applied jobs failed.
#[derive(Debug, Default)]
struct Verdicts(Vec<(TierId, bool)>);

impl Verdicts {
    fn note(&mut self, tier: TierId, failed: bool) {
        match self.0.iter_mut().find(|(t, _)| *t == tier) {
            Some((_, f)) => *f |= failed,
            None => self.0.push((tier, failed)),
        }
    }
}

/// The multi-tier KV offloading manager: a pure state machine.
///
/// Inputs are calls (`lookup`, `prepare_store`, `complete_store`, `prepare_load`,
/// `complete_load`, `touch`, `end_step`, `handle_job_result`, `shutdown`); outputs are answers,
/// [`Effect`]s drained with [`poll_effect`](Self::poll_effect) and [`Event`]s drained with
/// [`take_events`](Self::take_events). It reads no clock and does no IO.
#[derive(Clone, Debug)]
pub struct Manager {
    config: Config,
    primary: Primary,
    tiers: Vec<Tier>,
    jobs: BTreeMap<JobId, Outstanding>,
    next_job: u64,
    inbox: VecDeque<JobResult>,
    effects: VecDeque<Effect>,
    events: Vec<Event>,
    step: u64,
    collected: bool,
    requests: Requests,
    cooldowns: Cooldowns,
    stats: Stats,
    closed: bool,
    /// M13: after `reset_cache`, secondary hits are not promoted until `reset_flushed`.
    promotions_held: bool,
    /// W1: the latest time given to `set_clock`.
    clock: u64,
    /// W2–W6: per request, the keys it waits for (since a time) or gave up.
    waits: BTreeMap<RequestId, BTreeMap<Key, Wait>>,
    /// R8: the keys a finishing request read (kept for its allocation).
    read_scratch: Vec<Key>,
    /// V2: the primary's next victims (kept for its allocation).
    victim_scratch: Vec<Transfer>,
    /// V2: blocks the primary evicted in this step so far.
    step_evictions: u32,
    /// V2: the most blocks the primary evicted in one step, decaying by a sixteenth (rounded
    /// up) a step.
    eviction_peak: u32,
    /// V3: the keys a promotion evicted (kept for its allocation).
    evicted_scratch: Vec<Key>,
}

/// A request's wait for one block (★9).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    /// Answered `HitPending` or `Retry` since this time (W2).
    Since(u64),
    /// Gave the block up at the deadline: `Miss` from then on (W3, W4).
    GaveUp,
}

impl Manager {
    /// A manager for a validated `config`.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let tiers = config
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| Tier {
                index: TierIndex::new(TierId(i as u16), t),
                health: HealthState::Up,
                failures: 0,
                stores_outstanding: 0,
                max_outstanding_stores: t.max_outstanding_stores,
                max_outstanding_probes: t.max_outstanding_probes,
                admission: t.admission,
                stats: TierStats::default(),
            })
            .collect();
        let mut primary = Primary::with_horizon(
            config.num_blocks,
            config.policy,
            config.reuse,
            config.return_horizon,
        );
        primary.set_events(config.events);
        let mut tiers: Vec<Tier> = tiers;
        for t in &mut tiers {
            t.index.set_events(config.events);
        }
        Ok(Manager {
            primary,
            tiers,
            jobs: BTreeMap::new(),
            next_job: 1,
            inbox: VecDeque::new(),
            effects: VecDeque::new(),
            events: Vec::new(),
            step: 0,
            collected: false,
            requests: Requests::default(),
            cooldowns: Cooldowns::default(),
            stats: Stats {
                step: 0,
                lookups: 0,
                hits: 0,
                misses: 0,
                retries: 0,
                hits_pending: 0,
                wait_timeouts: 0,
                stores_skipped: 0,
                promotions_started: 0,
                promotions_succeeded: 0,
                promotions_failed: 0,
                promotions_missing: 0,
                promotions_refused: 0,
                evictions: 0,
                evictions_past_horizon: 0,
                load_pins: 0,
                job_pins: 0,
                jobs_outstanding: 0,
                tiers: Vec::new(),
            },
            closed: false,
            promotions_held: false,
            clock: 0,
            waits: BTreeMap::new(),
            read_scratch: Vec::new(),
            victim_scratch: Vec::new(),
            step_evictions: 0,
            eviction_peak: 0,
            evicted_scratch: Vec::new(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The primary tier, read-only.
    pub fn primary(&self) -> &Primary {
        &self.primary
    }

    /// The index of a secondary tier, read-only.
    pub fn tier(&self, tier: TierId) -> Option<&TierIndex> {
        self.tiers.get(tier.index()).map(|t| &t.index)
    }

    /// The health of a secondary tier.
    pub fn health(&self, tier: TierId) -> Option<Health> {
        self.tiers.get(tier.index()).map(|t| t.public_health())
    }

    /// The current step (the number of `end_step` calls so far).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Jobs submitted and not yet ended.
    pub fn outstanding_jobs(&self) -> impl Iterator<Item = &Job> + '_ {
        self.jobs.values().map(|o| &o.job)
    }

    /// Whether a result for `job` was handed in (and waits for the next collection).
    pub fn is_reported(&self, job: JobId) -> bool {
        self.jobs.get(&job).is_some_and(|o| o.reported)
    }

    /// Whether `shutdown` was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.step = self.step;
        s.stores_skipped = self.primary.stores_skipped();
        s.evictions_past_horizon = self.primary.evicted_past_horizon();
        s.jobs_outstanding = self.jobs.len() as u64;
        s.tiers = self
            .tiers
            .iter()
            .map(|t| {
                let mut ts = t.stats.clone();
                ts.blocks = t.index.len() as u64;
                (t.public_health(), ts)
            })
            .collect();
        s
    }

    // ----- inputs from the engine -------------------------------------------------------

    /// W1: the time, in the units of [`Config::wait_deadline`] (the driver and the Python
    /// package use milliseconds of a monotonic clock). It never goes back: a smaller `now`
    /// changes nothing.
    pub fn set_clock(&mut self, now: u64) {
        self.clock = self.clock.max(now);
    }

    /// The latest time given to [`set_clock`](Self::set_clock).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// M2–M4, M16: look up one block for `req`.
    pub fn lookup(&mut self, req: RequestId, key: &Key) -> Lookup {
        self.collect_once();
        self.stats.lookups += 1;
        let wait = self.wait_of(req, key);
        let in_primary = self.primary.lookup_slot(key).0;
        let ready = in_primary == Lookup::Hit;
        let given_up = match wait {
            Some(Wait::GaveUp) => true, // W4
            Some(Wait::Since(t)) if !ready => {
                // W3: the deadline is set, or no wait would have been kept (W7).
                let deadline = self.config.wait_deadline.unwrap_or(u64::MAX);
                let expired = self.clock.saturating_sub(t) > deadline;
                if expired && !crate::mutant::active("no_deadline") {
                    self.stats.wait_timeouts += 1;
                    tracing::debug!(%req, %key, since = t, clock = self.clock, "gave up waiting");
                    true
                } else {
                    false
                }
            }
            _ => false,
        };
        let answer = match in_primary {
            _ if given_up => Lookup::Miss,
            Lookup::Hit => {
                self.stats.hits += 1;
                // ★8's protection is only for promotions, which need a tier.
                if !self.tiers.is_empty() {
                    push_clone(&mut self.requests.get_mut(req).hits, key);
                }
                Lookup::Hit
            }
            Lookup::Miss => self.lookup_tiers(req, key),
            other => other, // M3: HitPending
        };
        if self.config.wait_deadline.is_some() {
            self.note_wait(req, key, wait, given_up, answer);
        }
        match answer {
            Lookup::Miss => self.stats.misses += 1,
            Lookup::Retry => self.stats.retries += 1,
            Lookup::HitPending => self.stats.hits_pending += 1,
            _ => {}
        }
        tracing::debug!(step = self.step, %req, %key, ?answer, "lookup");
        self.debug_check();
        answer
    }

    fn lookup_tiers(&mut self, req: RequestId, key: &Key) -> Lookup {
        if self.promotions_held {
            return Lookup::Miss; // M13
        }
        let mut busy = false;
        for t in 0..self.tiers.len() {
            let id = TierId(t as u16);
            let tier = &self.tiers[t];
            if tier.health != HealthState::Up || self.cooldowns.active(id, key, self.step) {
                continue;
            }
            let (answer, entry) = tier.index.lookup_entry(key, self.step);
            match answer {
                TierAnswer::Present => {
                    let entry = entry.expect("a Present answer names its entry");
                    return self.start_promotion(req, id, entry, key);
                }
                TierAnswer::Busy => busy = true,
                TierAnswer::Absent => {}
                TierAnswer::Unknown
                    if tier.index.probes_outstanding() >= tier.max_outstanding_probes as usize =>
                {
                    self.tiers[t].stats.probes_skipped += 1; // bounded, like ★4
                }
                TierAnswer::Unknown => {
                    let job = self.submit(id, JobKind::Exists { key: key.clone() }, Vec::new());
                    let tier = &mut self.tiers[t];
                    tier.index.start_probe(key.clone(), job);
                    tier.stats.probes += 1;
                    busy = true;
                }
            }
        }
        if busy { Lookup::Retry } else { Lookup::Miss }
    }

    /// M4: prepare a Promoting slot for `key` from `tier`, never evicting `req`'s own hits.
    fn start_promotion(&mut self, req: RequestId, tier: TierId, entry: u32, key: &Key) -> Lookup {
        let step = self.requests.get_mut(req);
        // ★8: protect the blocks this request was answered Hit for in this step, wherever they
        // are now (a hit block evicted by a store and stored again is the same block).
        let mut protected: Vec<u32> = step
            .hits
            .iter()
            .filter(|_| !crate::mutant::active("no_hit_protection"))
            .filter_map(|k| self.primary.state_of(k).map(|(slot, _)| slot.0))
            .collect();
        protected.sort_unstable();
        let mut evicted = core::mem::take(&mut self.evicted_scratch);
        let admitted = self.primary.promote(req, key, &protected, &mut evicted);
        self.primary.drain_events(&mut self.events);
        self.stats.evictions += evicted.len() as u64;
        self.primary_evicted(&evicted);
        evicted.clear();
        self.evicted_scratch = evicted;
        let Ok(slot) = admitted else {
            self.stats.promotions_refused += 1;
            tracing::debug!(%req, %key, %tier, "promotion refused: no room");
            return Lookup::Miss;
        };
        self.stats.promotions_started += 1;
        let t = &mut self.tiers[tier.index()];
        t.stats.hits += 1;
        debug_assert_eq!(t.index.key_of(entry), Some(key), "the looked-up entry");
        t.index.start_read(entry);
        let transfer = Transfer {
            key: key.clone(),
            slot,
        };
        let batches = &mut self.requests.by_id.entry(req).or_default().batches;
        let batch = match batches.iter().position(|b| b.tier == tier) {
            Some(i) => &mut batches[i],
            None => {
                // M5's flush order: tiers by first staged promotion, then requests.
                match self.requests.staged.iter_mut().find(|(t, _)| *t == tier) {
                    Some((_, reqs)) => reqs.push(req),
                    None => self.requests.staged.push((tier, alloc::vec![req])),
                }
                batches.push(Batch {
                    tier,
                    blocks: Vec::new(),
                    entries: Vec::new(),
                });
                batches.last_mut().expect("just pushed")
            }
        };
        batch.blocks.push(transfer);
        batch.entries.push(entry);
        tracing::debug!(%req, %key, %tier, slot = slot.0, "promotion started");
        Lookup::HitPending
    }

    fn wait_of(&self, req: RequestId, key: &Key) -> Option<Wait> {
        self.waits.get(&req)?.get(key).copied()
    }

    /// W2–W5: the wait `req` keeps for `key` after a lookup answered `answer`.
    fn note_wait(
        &mut self,
        req: RequestId,
        key: &Key,
        wait: Option<Wait>,
        given_up: bool,
        answer: Lookup,
    ) {
        let next = match (given_up, answer) {
            (true, _) => Some(Wait::GaveUp),
            (false, Lookup::HitPending | Lookup::Retry) => {
                Some(wait.unwrap_or(Wait::Since(self.clock)))
            }
            (false, _) => None,
        };
        if next == wait {
            return;
        }
        match next {
            Some(w) => {
                self.waits.entry(req).or_default().insert(key.clone(), w);
            }
            None => {
                if let Some(keys) = self.waits.get_mut(&req) {
                    keys.remove(key);
                    if keys.is_empty() {
                        self.waits.remove(&req);
                    }
                }
            }
        }
    }

    /// R1: starts `req`'s record (optional: any call naming `req` starts it).
    pub fn new_request(&mut self, req: RequestId) {
        self.primary.new_request(req);
        self.debug_check();
    }

    /// R2: the end-token position of `key` in `req` (vLLM's `set_offload_key_position`).
    pub fn set_position(&mut self, req: RequestId, key: &Key, end_token: u64) {
        self.primary.set_position(req, key, end_token);
    }

    /// R6, R8, W6: `req` finished; its accesses set the recency of its blocks, head most
    /// recent, in the primary and (what it read) in every tier; its waits are forgotten.
    pub fn request_finished(&mut self, req: RequestId) {
        let mut read = core::mem::take(&mut self.read_scratch);
        self.primary.request_finished_into(req, &mut read);
        // R8: every tier learns from what the request read, as the primary does.
        if !read.is_empty() && !crate::mutant::active("no_tier_learning") {
            for tier in &mut self.tiers {
                tier.index.touch(&read);
            }
        }
        self.read_scratch = read;
        self.waits.remove(&req);
        self.debug_check();
    }

    /// P4–P7, P17, R3–R5 through the manager (collects job results first, M1).
    pub fn prepare_store(&mut self, req: RequestId, keys: &[Key]) -> Result<PreparedStore, Error> {
        self.collect();
        let out = self.primary.prepare_store(req, keys);
        self.primary.drain_events(&mut self.events);
        if let Ok(p) = &out {
            self.stats.evictions += p.evicted.len() as u64;
            self.primary_evicted(&p.evicted);
        }
        self.debug_check();
        out
    }

    /// M6–M7: the engine's store of `keys` ended; if ok, cascade them to every tier.
    pub fn complete_store(&mut self, req: RequestId, keys: &[Key], ok: bool) {
        let cascade = ok && !self.closed && !self.tiers.is_empty();
        let mut ready = Vec::with_capacity(if cascade { keys.len() } else { 0 });
        self.primary
            .complete_store_into(keys, ok, cascade.then_some(&mut ready));
        self.primary.drain_events(&mut self.events);
        // `ready` is empty unless `cascade`: nothing cascades after shutdown.
        if !ready.is_empty() {
            for t in 0..self.tiers.len() {
                if self.tiers[t].admission == Admission::Cascade {
                    self.cascade(req, TierId(t as u16), &ready);
                }
            }
        }
        self.debug_check();
    }

    /// M6 (and V2) for one tier.
    fn cascade(&mut self, req: RequestId, id: TierId, ready: &[Transfer]) {
        let tier = &mut self.tiers[id.index()];
        // A write-ahead (V2) names held victims too and is tried again at every step's end:
        // its skips are not counted (a block it never wrote and the primary evicted is, in
        // `victims_missed`).
        let counted = req != RequestId::WRITE_AHEAD;
        let n = if counted { ready.len() as u64 } else { 0 };
        if tier.health != HealthState::Up {
            tier.stats.skipped_down += n;
            tracing::debug!(%id, blocks = n, "cascade skipped: tier not up");
            return;
        }
        if tier.stores_outstanding >= tier.max_outstanding_stores {
            tier.stats.skipped_backpressure += n; // ★4
            tracing::debug!(%id, blocks = n, "cascade skipped: back-pressure");
            return;
        }
        let plan = tier.index.plan_store(ready, &mut self.events);
        if counted {
            tier.stats.skipped_held += plan.held as u64;
            tier.stats.skipped_full += plan.full as u64;
        }
        tier.stats.evictions += plan.evicted.len() as u64;
        let deletes = tier.index.to_delete(plan.evicted); // T14
        if !deletes.is_empty() {
            self.effects.push_back(Effect::Delete {
                tier: id,
                keys: deletes,
            });
        }
        if plan.writes.is_empty() {
            return;
        }
        tier.stores_outstanding += 1;
        tier.stats.cascades_submitted += 1;
        tier.stats.blocks_cascaded += plan.writes.len() as u64;
        for w in plan.writes.iter() {
            if !crate::mutant::active("reuse_slot_early") {
                self.primary.pin_job(w.slot);
            }
        }
        self.stats.job_pins += plan.writes.len() as u64;
        self.submit(
            id,
            JobKind::Store {
                request: req,
                blocks: plan.writes,
            },
            plan.entries,
        );
    }

    /// V2: every victim tier is written the primary's next victims it neither holds nor is
    /// writing, as one cascade (M6: health, back-pressure, room without evicting the held
    /// ones, job pins), in eviction order. It looks as far ahead as its configured look-ahead,
    /// or twice the peak of a step's evictions beyond the blocks it is writing, if further.
    fn write_ahead(&mut self) {
        if self.closed {
            return;
        }
        let evicted = core::mem::take(&mut self.step_evictions);
        self.eviction_peak = evicted.max(self.eviction_peak - self.eviction_peak.div_ceil(16));
        for t in 0..self.tiers.len() {
            let Admission::Victim { lookahead } = self.tiers[t].admission else {
                continue;
            };
            let tier = TierId(t as u16);
            let writing: usize = self
                .jobs
                .values()
                .filter(|o| o.job.tier == tier)
                .map(|o| match &o.job.kind {
                    JobKind::Store { blocks, .. } => blocks.len(),
                    _ => 0,
                })
                .sum();
            let ahead = if crate::mutant::active("lookahead_fixed") {
                lookahead as usize
            } else {
                (lookahead as usize).max(2 * self.eviction_peak as usize + writing)
            };
            let mut next = core::mem::take(&mut self.victim_scratch);
            self.primary.next_victims(ahead, &mut next);
            // The held ones go to the plan too: T7 protects them, so that the tier never
            // evicts one upcoming victim to write another (with a tier smaller than the
            // look-ahead, two steps would write each over the other for ever). When it holds
            // them all, the plan writes and evicts nothing.
            self.cascade(RequestId::WRITE_AHEAD, TierId(t as u16), &next);
            next.clear();
            self.victim_scratch = next;
        }
    }

    /// V3: the primary evicted `evicted` (in eviction order): every victim tier holding one
    /// makes it most recent, the last victim most recent of all, as if each had been written
    /// as it left; one it does not hold is lost to the hierarchy (`victims_missed`).
    fn primary_evicted(&mut self, evicted: &[Key]) {
        if evicted.is_empty() {
            return;
        }
        self.step_evictions = self.step_evictions.saturating_add(evicted.len() as u32);
        for t in &mut self.tiers {
            if t.admission == Admission::Cascade {
                continue;
            }
            let mut held = Vec::with_capacity(evicted.len());
            // A touch walks its keys last to first: the last victim goes in first.
            for k in evicted.iter().rev() {
                if t.index.state_of(k).is_some() {
                    held.push(k.clone());
                } else {
                    t.stats.victims_missed += 1;
                }
            }
            if !crate::mutant::active("victims_not_refreshed") {
                t.index.touch(&held);
            }
        }
    }

    /// P11–P12, R3 (no collection, M1).
    pub fn prepare_load(&mut self, req: RequestId, keys: &[Key]) -> Result<Vec<SlotId>, Error> {
        let out = self.primary.prepare_load(req, keys);
        if out.is_ok() {
            self.stats.load_pins += keys.len() as u64;
        }
        self.debug_check();
        out
    }

    /// P13–P14.
    pub fn complete_load(&mut self, keys: &[Key]) -> Result<(), Error> {
        let out = self.primary.complete_load(keys);
        if out.is_ok() {
            self.stats.load_pins -= keys.len() as u64;
        }
        self.debug_check();
        out
    }

    /// M8: recency update in the primary and every tier.
    pub fn touch(&mut self, keys: &[Key]) {
        self.primary.touch(keys);
        for t in &mut self.tiers {
            t.index.touch(keys);
        }
        self.debug_check();
    }

    /// M5: end the step: collect results if not done, submit batched promotions and due
    /// health probes, expire cooldowns, clear per-request state.
    pub fn end_step(&mut self) {
        self.collect_once();
        let mut requests = core::mem::take(&mut self.requests);
        if crate::mutant::active("stall_batches") {
            // Promotions stay batched forever.
            requests.by_id.values_mut().for_each(|s| s.hits.clear());
            self.requests = requests;
            requests = Requests::default();
        }
        for (req, b) in requests.take_staged() {
            self.submit(
                b.tier,
                JobKind::Load {
                    request: req,
                    blocks: b.blocks.into(),
                },
                b.entries,
            );
        }
        self.write_ahead();
        let interval = u64::from(self.config.health.probe_interval_steps);
        for t in 0..self.tiers.len() {
            if let HealthState::Down { since } = self.tiers[t].health
                && self.step >= since + interval
            {
                let job = self.submit(TierId(t as u16), JobKind::Health, Vec::new());
                self.tiers[t].health = HealthState::Probing { job };
                tracing::debug!(tier = t, %job, "health probe");
            }
        }
        self.step += 1;
        self.cooldowns.expire(self.step);
        for t in &mut self.tiers {
            t.index.expire(self.step);
        }
        self.collected = false;
        tracing::debug!(step = self.step, "end_step");
        self.debug_check();
    }

    /// The events since the last call, in order (P16; `Discarded` keys held again are left
    /// out).
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut events = core::mem::take(&mut self.events);
        self.primary.filter_discarded(&mut events);
        // As vLLM 0.33 gives them: the primary's first, then each tier's, each in order.
        events.sort_by_key(|e| match e.medium {
            Medium::Primary => 0,
            Medium::Tier(t) => 1 + u32::from(t.0),
        });
        events
    }

    /// vLLM 0.33's `get_stats` for the primary: gauges now, and what accumulated since the
    /// previous call.
    pub fn take_metrics(&mut self) -> crate::Metrics {
        self.primary.take_metrics()
    }

    /// M12, M13: vLLM 0.33's `reset_cache`: the primary forgets everything (the secondary
    /// tiers keep their blocks); with tiers, promotions are held until
    /// [`reset_flushed`](Self::reset_flushed). Refused with [`Error::Busy`] while a job is
    /// outstanding.
    pub fn reset_cache(&mut self) -> Result<(), Error> {
        let running = self.jobs.values().filter(|o| !o.reported).count();
        if running > 0 {
            return Err(Error::Busy { jobs: running });
        }
        self.collect();
        let requests = core::mem::take(&mut self.requests);
        for (_, step) in requests.by_id {
            for b in step.batches {
                for &e in &b.entries {
                    self.tiers[b.tier.index()]
                        .index
                        .end_read(e, ReadEnd::Cancelled, self.step);
                }
            }
        }
        self.primary.reset();
        // W6: waits are forgotten; a block given up stays given up for its request.
        for keys in self.waits.values_mut() {
            keys.retain(|_, w| *w == Wait::GaveUp);
        }
        self.waits.retain(|_, keys| !keys.is_empty());
        self.stats.load_pins = 0;
        self.collected = false; // vLLM reopens its once-per-step poll
        self.promotions_held = !self.tiers.is_empty();
        tracing::debug!(held = self.promotions_held, "cache reset");
        self.debug_check();
        Ok(())
    }

    /// M14: vLLM 0.33's `on_reset_flushed`: promotions are no longer held.
    pub fn reset_flushed(&mut self) {
        self.promotions_held = false;
    }

    /// vLLM 0.33's `has_pending_work`, a little wider: a job is outstanding (its result
    /// handed in or not), or a promotion waits for `end_step` to be submitted (vLLM counts
    /// those only once submitted; its scheduler asks after the step's end).
    pub fn has_pending_work(&self) -> bool {
        !self.jobs.is_empty() || !self.requests.staged.is_empty()
    }

    /// Durability (★6): records blocks found in a tier at start as Present, up to its
    /// capacity. Returns the keys that did not fit; the IO layer should delete them.
    pub fn restore_tier(
        &mut self,
        tier: TierId,
        keys: impl IntoIterator<Item = Key>,
    ) -> Result<Vec<Key>, Error> {
        let t = self
            .tiers
            .get_mut(tier.index())
            .ok_or(Error::UnknownTier { tier })?;
        let rejected = t.index.restore(keys);
        tracing::debug!(%tier, blocks = t.index.len(), rejected = rejected.len(), "tier restored");
        self.debug_check();
        Ok(rejected)
    }

    // ----- the IO layer's side ----------------------------------------------------------

    /// The next effect for the IO layer, in order.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// A job ended. The result is checked now and applied at the next collection (M1).
    pub fn handle_job_result(&mut self, result: JobResult) -> Result<(), Error> {
        let job = result.job;
        let o = self.jobs.get(&job).ok_or(Error::UnknownJob { job })?;
        if o.reported {
            return Err(Error::DuplicateResult { job });
        }
        let shared = self.tiers[o.job.tier.index()].index.kind() == TierKind::Shared;
        match (&result.outcome, &o.job.kind) {
            (
                Outcome::Partial { succeeded, missing },
                JobKind::Store { blocks, .. } | JobKind::Load { blocks, .. },
            ) => {
                if let Some(key) = succeeded
                    .iter()
                    .chain(missing)
                    .find(|k| !blocks.iter().any(|b| &b.key == *k))
                {
                    return Err(Error::ForeignKey {
                        job,
                        key: key.clone(),
                    });
                }
                let shared_load = shared && matches!(o.job.kind, JobKind::Load { .. });
                if !missing.is_empty() && !shared_load {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "missing blocks apply to loads from a shared tier only",
                    });
                }
                if missing.iter().any(|k| succeeded.contains(k)) {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "a block is both read and missing",
                    });
                }
            }
            (Outcome::Partial { .. }, _) => {
                return Err(Error::InvalidOutcome {
                    job,
                    reason: "partial success applies to store and load jobs only",
                });
            }
            (Outcome::NotFound, JobKind::Exists { .. }) | (Outcome::Ok | Outcome::Failed, _) => {}
            (Outcome::NotFound, JobKind::Load { .. }) if shared => {}
            (Outcome::NotFound, _) => {
                return Err(Error::InvalidOutcome {
                    job,
                    reason: "not found applies to existence probes and loads from a shared tier only",
                });
            }
        }
        self.jobs.get_mut(&job).expect("checked above").reported = true;
        tracing::debug!(%job, outcome = ?result.outcome, "job result received");
        self.inbox.push_back(result);
        Ok(())
    }

    /// M10: end every job. Results already received are applied; every other outstanding
    /// job ends as failed; unsubmitted promotions are dropped; every tier is Closed. The IO
    /// layer must have stopped touching primary memory before calling this.
    pub fn shutdown(&mut self) {
        if self.closed {
            return;
        }
        // Results already received are applied, but a closing tier caches no probe answer:
        // nothing is inserted, so nothing is evicted or deleted while shutting down.
        let mut verdicts = Verdicts::default();
        while let Some(mut r) = self.inbox.pop_front() {
            if matches!(self.jobs[&r.job].job.kind, JobKind::Exists { .. }) {
                r.outcome = Outcome::Failed;
                self.apply(r, true);
            } else if let Some((tier, failed)) = self.apply(r, false) {
                verdicts.note(tier, failed);
            }
        }
        self.account_health(verdicts);
        let ids: Vec<JobId> = self.jobs.keys().copied().collect();
        for job in ids {
            self.apply(
                JobResult {
                    job,
                    outcome: Outcome::Failed,
                },
                true,
            );
        }
        let mut requests = core::mem::take(&mut self.requests);
        for (_, b) in requests.take_staged() {
            self.primary
                .finish_promotions(b.blocks.iter().map(|t| (t.slot, false)));
            for &e in &b.entries {
                self.tiers[b.tier.index()]
                    .index
                    .end_read(e, ReadEnd::Cancelled, self.step);
            }
        }
        self.primary.drain_events(&mut self.events);
        for t in &mut self.tiers {
            t.health = HealthState::Closed;
        }
        self.waits.clear(); // W6
        self.closed = true;
        tracing::debug!("shutdown");
        self.debug_check();
    }

    // ----- internals --------------------------------------------------------------------

    fn submit(&mut self, tier: TierId, kind: JobKind, entries: Vec<u32>) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        let job = Job { id, tier, kind };
        tracing::debug!(%id, %tier, blocks = job.blocks().len(), "job submitted");
        self.effects.push_back(Effect::Submit(job.clone()));
        self.jobs.insert(
            id,
            Outstanding {
                job,
                entries,
                reported: false,
            },
        );
        id
    }

    /// M1: applies the job results received so far, unless this step has collected already
    /// (what the step's first `lookup` does before it answers).
    pub fn collect_step(&mut self) {
        self.collect_once();
        self.debug_check();
    }

    /// M1: apply every received result, at most once per step.
    fn collect_once(&mut self) {
        if self.collected && !crate::mutant::active("no_step_gate") {
            return;
        }
        self.collect();
    }

    /// M1: apply every received result now.
    fn collect(&mut self) {
        self.collected = true;
        let mut verdicts = Verdicts::default();
        while let Some(r) = self.inbox.pop_front() {
            if let Some((tier, failed)) = self.apply(r, false) {
                verdicts.note(tier, failed);
            }
        }
        self.account_health(verdicts);
    }

    /// J1–J6. `cancelled` (shutdown) skips health accounting, cooldowns and deletions.
    /// Returns the job's tier and whether the job failed, for health accounting (H1, H2);
    /// nothing for a health probe or a cancelled job.
    fn apply(&mut self, result: JobResult, cancelled: bool) -> Option<(TierId, bool)> {
        let Outstanding { job, entries, .. } =
            self.jobs.remove(&result.job).expect("validated job");
        let mut lists: [Vec<&Key>; 2] = match &result.outcome {
            Outcome::Partial { succeeded, missing } => {
                [succeeded.iter().collect(), missing.iter().collect()]
            }
            _ => [Vec::new(), Vec::new()],
        };
        for l in &mut lists {
            l.sort_unstable();
        }
        let [succeeded, missing] = &lists;
        let end_of = |key: &Key| match &result.outcome {
            Outcome::Ok => ReadEnd::Ok,
            Outcome::Partial { .. } if succeeded.binary_search(&key).is_ok() => ReadEnd::Ok,
            Outcome::Partial { .. } if missing.binary_search(&key).is_ok() => ReadEnd::Missing,
            Outcome::NotFound => ReadEnd::Missing,
            Outcome::Partial { .. } | Outcome::Failed => ReadEnd::Failed,
        };
        let tid = job.tier;
        let mut failed = false;
        match &job.kind {
            JobKind::Store { blocks, .. } => {
                // J1: unpin whether it succeeded or not.
                let tier = &mut self.tiers[tid.index()];
                tier.stores_outstanding -= 1;
                let events = self.config.events;
                let mut stored = Vec::with_capacity(if events { blocks.len() } else { 0 });
                for (b, &e) in blocks.iter().zip(&entries) {
                    let ok = end_of(&b.key) == ReadEnd::Ok;
                    if ok || !crate::mutant::active("keep_pin_on_failure") {
                        self.primary.unpin_job(b.slot);
                    }
                    tier.index.finish_write(e, ok);
                    if ok {
                        if events {
                            stored.push(b.key.clone());
                        }
                    } else {
                        tier.stats.write_failures += 1;
                        failed = true;
                    }
                }
                self.stats.job_pins -= blocks.len() as u64;
                if !stored.is_empty() {
                    self.events.push(Event {
                        medium: Medium::Tier(tid),
                        kind: EventKind::Stored,
                        keys: stored,
                    });
                }
            }
            JobKind::Load { blocks, .. } => {
                // J2, J3, J6.
                self.primary.finish_promotions(
                    blocks
                        .iter()
                        .map(|b| (b.slot, end_of(&b.key) == ReadEnd::Ok)),
                );
                self.primary.drain_events(&mut self.events);
                let mut deletes = Vec::new();
                for (b, &e) in blocks.iter().zip(&entries) {
                    let end = match end_of(&b.key) {
                        _ if cancelled => ReadEnd::Cancelled,
                        end => end,
                    };
                    let tier = &mut self.tiers[tid.index()];
                    if let Some(k) = tier.index.end_read(e, end, self.step) {
                        deletes.push(k);
                    }
                    match end {
                        ReadEnd::Ok => self.stats.promotions_succeeded += 1,
                        ReadEnd::Missing if !crate::mutant::active("missing_is_failure") => {
                            // J6: the store let the block go; the tier forgot it (T15).
                            self.stats.promotions_missing += 1;
                            tier.stats.read_missing += 1;
                        }
                        ReadEnd::Missing | ReadEnd::Failed | ReadEnd::Cancelled => {
                            self.stats.promotions_failed += 1;
                            tier.stats.read_failures += 1;
                            failed = true;
                            if !cancelled {
                                let until =
                                    self.step + u64::from(self.config.promotion_cooldown_steps);
                                if !crate::mutant::active("no_cooldown") {
                                    self.cooldowns.start(tid, b.key.clone(), until); // ★2
                                }
                            }
                        }
                    }
                }
                if !deletes.is_empty() {
                    self.effects.push_back(Effect::Delete {
                        tier: tid,
                        keys: deletes,
                    });
                }
            }
            JobKind::Exists { key } => {
                // J4.
                let found = match result.outcome {
                    Outcome::Ok => Some(true),
                    Outcome::NotFound => Some(false),
                    _ => None,
                };
                failed = found.is_none();
                let tier = &mut self.tiers[tid.index()];
                let evicted = tier
                    .index
                    .finish_probe(key, found, self.step, &mut self.events);
                tier.stats.evictions += evicted.len() as u64;
                let deletes = tier.index.to_delete(evicted); // T14
                if !deletes.is_empty() {
                    self.effects.push_back(Effect::Delete {
                        tier: tid,
                        keys: deletes,
                    });
                }
            }
            JobKind::Health => {
                // J5: H4 / H5.
                let tier = &mut self.tiers[tid.index()];
                if !cancelled {
                    if result.outcome == Outcome::Ok {
                        tier.health = HealthState::Up;
                        tier.failures = 0;
                        tier.stats.came_up += 1;
                        tracing::debug!(tier = tid.0, "tier up");
                    } else {
                        tier.health = HealthState::Down { since: self.step };
                        tracing::debug!(tier = tid.0, "tier still down");
                    }
                }
                return None;
            }
        }
        let tier = &mut self.tiers[tid.index()];
        if failed {
            tier.stats.jobs_failed += 1;
        }
        tracing::debug!(job = result.job.0, tier = tid.0, failed, "job applied");
        (!cancelled).then_some((tid, failed))
    }

    /// H1, H2, once per collection: a tier with any failed job among the results applied
    /// counts one failure, however many there were (a step's probes share one round trip: one
    /// lost round trip is one failure); a tier whose applied jobs all succeeded is reset.
    fn account_health(&mut self, verdicts: Verdicts) {
        for (tid, failed) in verdicts.0 {
            let tier = &mut self.tiers[tid.index()];
            if tier.health != HealthState::Up {
                continue;
            }
            if failed {
                tier.failures += 1;
                if tier.failures >= self.config.health.failures_to_down {
                    tier.health = HealthState::Down { since: self.step };
                    tier.stats.went_down += 1;
                    tracing::debug!(tier = tid.0, failures = tier.failures, "tier down");
                }
            } else {
                tier.failures = 0;
            }
        }
    }

    /// An encoding of every behaviour-relevant part of the state, for model checkers that
    /// deduplicate states: job ids are renamed by rank, times are relative to the current step,
    /// waits are their age on the clock (ages past the deadline alike), tier entries and
    /// ghosts are named by key, and the counters of [`Stats`] are left out. Two managers of one
    /// configuration with equal encodings answer every future sequence of calls alike, up to a
    /// constant offset of job ids, steps and clock.
    pub fn canonical_state(&self) -> alloc::string::String {
        let mut out = alloc::string::String::new();
        self.write_canonical_state(&mut out);
        out
    }

    /// Appends [`Manager::canonical_state`] to `out`, for checkers that reuse one buffer
    /// across the states they visit.
    pub fn write_canonical_state(&self, out: &mut alloc::string::String) {
        use core::fmt::Write;
        let ids: Vec<JobId> = self.jobs.keys().copied().collect();
        let rank = |j: JobId| ids.binary_search(&j).unwrap_or(usize::MAX);
        let step = self.step;
        self.primary.write_canonical(out);
        for (i, t) in self.tiers.iter().enumerate() {
            let health = match t.health {
                HealthState::Up => alloc::string::String::from("up"),
                HealthState::Down { since } => {
                    // Only the wait left until the probe matters.
                    let interval = u64::from(self.config.health.probe_interval_steps);
                    alloc::format!("down-{}", (since + interval).saturating_sub(step))
                }
                HealthState::Probing { job } => alloc::format!("probing@{}", rank(job)),
                HealthState::Closed => alloc::string::String::from("closed"),
            };
            let _ = write!(
                out,
                " tier{i}[{health} f={} st={} ",
                t.failures, t.stores_outstanding
            );
            t.index.write_canonical(out, &rank, step);
            out.push(']');
        }
        for (r, o) in self.jobs.values().enumerate() {
            let _ = write!(
                out,
                " job{r}[{} {:?} {:?} {}]",
                o.job.tier.0,
                o.job.kind,
                o.entries.len(),
                o.reported
            );
        }
        for r in &self.inbox {
            let _ = write!(out, " result@{}={:?}", rank(r.job), r.outcome);
        }
        let _ = write!(out, " staged{:?}", self.requests.staged);
        for (req, s) in &self.requests.by_id {
            // Hits are a set: a block looked up twice protects no more than once.
            let mut hits: Vec<&Key> = s.hits.iter().collect();
            hits.sort_unstable();
            hits.dedup();
            let _ = write!(out, " {req}[hits {hits:?}");
            for b in &s.batches {
                let _ = write!(out, " {}:{:?}", b.tier.0, b.blocks);
            }
            out.push(']');
        }
        for ((t, k), until) in &self.cooldowns.until {
            if *until > step {
                let _ = write!(out, " cool{}:{k}+{}", t.0, until - step);
            }
        }
        // W3 compares a wait's age with the deadline: ages past it are all alike.
        let deadline = self.config.wait_deadline.unwrap_or(0).saturating_add(1);
        for (req, keys) in &self.waits {
            for (key, w) in keys {
                match w {
                    Wait::Since(t) => {
                        let age = self.clock.saturating_sub(*t).min(deadline);
                        let _ = write!(out, " wait{req}:{key}+{age}");
                    }
                    Wait::GaveUp => {
                        let _ = write!(out, " gaveup{req}:{key}");
                    }
                }
            }
        }
        let _ = write!(
            out,
            " collected={} closed={} held={} effects={:?} events={:?}",
            self.collected, self.closed, self.promotions_held, self.effects, self.events
        );
        // V2's look-ahead follows the evictions only where a victim tier reads it.
        if self.tiers.iter().any(|t| t.admission != Admission::Cascade) {
            let _ = write!(
                out,
                " evicted={} peak={}",
                self.step_evictions, self.eviction_peak
            );
        }
    }

    #[inline]
    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(v) = self.check_invariants() {
            panic!("{v}");
        }
    }

    /// Checks every invariant of `docs/state-machine.md` (I1–I12); returns the first violated.
    pub fn check_invariants(&self) -> Result<(), Violation> {
        self.primary.check_invariants()?;
        // Pins and Promoting slots claimed by jobs and batches.
        let mut job_pins: BTreeMap<u32, u16> = BTreeMap::new();
        let mut promoting: BTreeMap<u32, &Key> = BTreeMap::new();
        let mut writes: Vec<BTreeSet<&Key>> = alloc::vec![BTreeSet::new(); self.tiers.len()];
        let mut reads: Vec<BTreeMap<&Key, u32>> = alloc::vec![BTreeMap::new(); self.tiers.len()];
        let mut stores: Vec<u32> = alloc::vec![0; self.tiers.len()];
        let mut probes: Vec<BTreeMap<&Key, JobId>> = alloc::vec![BTreeMap::new(); self.tiers.len()];
        let mut health_jobs: BTreeMap<usize, JobId> = BTreeMap::new();
        let mut promoted: Vec<(TierId, &Transfer)> = Vec::new();
        let batched = self.requests.by_id.values().flat_map(|r| {
            r.batches
                .iter()
                .map(|b| (b.tier, &b.blocks[..], &b.entries[..]))
        });
        let loads = self.jobs.values().filter_map(|o| match &o.job.kind {
            JobKind::Load { blocks, .. } => Some((o.job.tier, &blocks[..], &o.entries[..])),
            _ => None,
        });
        for (tier, blocks, entries) in batched.chain(loads) {
            ensure!(
                blocks.len() == entries.len(),
                "I8",
                "{tier}: a promotion's blocks and tier entries differ in number"
            );
            for (b, &entry) in blocks.iter().zip(entries) {
                ensure!(
                    self.tiers[tier.index()].index.key_of(entry) == Some(&b.key),
                    "I8",
                    "{tier}: promotion of {} reads entry {entry} of another block",
                    b.key
                );
                promoted.push((tier, b));
            }
        }
        for (tier, b) in promoted {
            // I5, I6: each Promoting slot belongs to exactly one promotion, with its key.
            ensure!(
                promoting.insert(b.slot.0, &b.key).is_none(),
                "I5",
                "{} claimed by two promotions",
                b.slot
            );
            ensure!(
                self.primary.key_at(b.slot) == Some(&b.key),
                "I6",
                "{} read into by a promotion of {} holds another block",
                b.slot,
                b.key
            );
            *reads[tier.index()].entry(&b.key).or_default() += 1;
        }
        for o in self.jobs.values() {
            let t = o.job.tier.index();
            match &o.job.kind {
                JobKind::Store { blocks, .. } => {
                    stores[t] += 1;
                    ensure!(
                        o.entries.len() == blocks.len(),
                        "I8",
                        "{}: {} blocks, {} tier entries",
                        o.job.id,
                        blocks.len(),
                        o.entries.len()
                    );
                    for (b, &e) in blocks.iter().zip(&o.entries) {
                        ensure!(
                            self.tiers[t].index.key_of(e) == Some(&b.key),
                            "I8",
                            "{} writes {} into entry {e} of another block",
                            o.job.id,
                            b.key
                        );
                        ensure!(
                            self.primary.key_at(b.slot) == Some(&b.key),
                            "I6",
                            "{} written from by {} holds another block",
                            b.slot,
                            o.job.id
                        );
                        *job_pins.entry(b.slot.0).or_default() += 1;
                        ensure!(
                            writes[t].insert(&b.key),
                            "I8",
                            "{} written by two store jobs of tier {t}",
                            b.key
                        );
                    }
                }
                JobKind::Exists { key } => {
                    probes[t].insert(key, o.job.id);
                }
                JobKind::Health => {
                    health_jobs.insert(t, o.job.id);
                }
                JobKind::Load { .. } => {}
            }
        }
        let mut promoting_blocks = 0;
        for (slot, key, state) in self.primary.blocks() {
            match state {
                BlockState::Ready { job_pins: p, .. } => {
                    let expected = job_pins.get(&slot.0).copied().unwrap_or(0);
                    ensure!(
                        p == expected,
                        "I4",
                        "{key} has {p} cascade pins, {expected} store jobs use {slot}"
                    );
                }
                BlockState::Promoting => {
                    promoting_blocks += 1;
                    ensure!(
                        promoting.get(&slot.0) == Some(&key),
                        "I5",
                        "promoting {key} at {slot} has no promotion"
                    );
                }
                BlockState::Pending => {
                    ensure!(
                        !job_pins.contains_key(&slot.0),
                        "I4",
                        "pending {key} at {slot} is used by a store job"
                    );
                }
            }
        }
        ensure!(
            promoting_blocks == promoting.len(),
            "I5",
            "{promoting_blocks} promoting blocks, {} promotions",
            promoting.len()
        );
        let total_pins: u64 = job_pins.values().map(|&p| u64::from(p)).sum();
        ensure!(
            total_pins == self.stats.job_pins,
            "I4",
            "{total_pins} cascade pins held, {} counted",
            self.stats.job_pins
        );
        for (t, tier) in self.tiers.iter().enumerate() {
            tier.index.check_invariants()?;
            let (w, r) = tier.index.writing_and_readers();
            ensure!(
                w == writes[t],
                "I8",
                "tier {t}: writing entries differ from store jobs"
            );
            ensure!(
                r == reads[t],
                "I8",
                "tier {t}: readers differ from promotions"
            );
            ensure!(
                tier.stores_outstanding == stores[t] && stores[t] <= tier.max_outstanding_stores,
                "I9",
                "tier {t}: {} store jobs counted, {} outstanding, bound {}",
                tier.stores_outstanding,
                stores[t],
                tier.max_outstanding_stores
            );
            ensure!(
                tier.index.probes_outstanding() <= tier.max_outstanding_probes as usize,
                "I9",
                "tier {t}: {} probes outstanding, bound {}",
                tier.index.probes_outstanding(),
                tier.max_outstanding_probes
            );
            let indexed: BTreeMap<&Key, JobId> = tier.index.probes().collect();
            ensure!(
                indexed == probes[t],
                "I10",
                "tier {t}: probes differ from exists jobs"
            );
            let probing = match tier.health {
                HealthState::Probing { job } => Some(job),
                _ => None,
            };
            ensure!(
                probing == health_jobs.get(&t).copied(),
                "I10",
                "tier {t}: health {:?} but health job {:?}",
                tier.health,
                health_jobs.get(&t)
            );
        }
        // I12: waits only with a deadline, none begun after the clock, no empty record.
        ensure!(
            self.waits.is_empty() || self.config.wait_deadline.is_some(),
            "I12",
            "waits kept without a wait_deadline"
        );
        for (req, keys) in &self.waits {
            ensure!(
                !keys.is_empty(),
                "I12",
                "request {req} keeps an empty wait record"
            );
            for (key, w) in keys {
                if let Wait::Since(t) = w {
                    ensure!(
                        *t <= self.clock,
                        "I12",
                        "request {req} waits for {key} since {t}, after the clock {}",
                        self.clock
                    );
                }
            }
        }
        Ok(())
    }
}

impl Tier {
    fn public_health(&self) -> Health {
        match self.health {
            HealthState::Up => Health::Up,
            HealthState::Down { since } => Health::Down { since },
            HealthState::Probing { .. } => Health::Probing,
            HealthState::Closed => Health::Closed,
        }
    }
}

#[cfg(test)]
mod tests {
    //! `check_invariants` must fail on a corrupted state: each test breaks one invariant by
    //! hand and expects its id.

    use super::*;
    use crate::config::{TierConfig, TierKind};

    fn key(i: u8) -> Key {
        Key::from([i])
    }

    /// A manager with blocks 1 and 2 Ready and cascading to one tier (one store job out).
    fn busy() -> Manager {
        let mut c = Config::new(4);
        c.tiers = alloc::vec![TierConfig::new(TierKind::Authoritative, 4)];
        let mut m = Manager::new(c).unwrap();
        m.prepare_store(RequestId(1), &[key(1), key(2)]).unwrap();
        m.complete_store(RequestId(1), &[key(1), key(2)], true);
        m.check_invariants().unwrap();
        m
    }

    fn violated(m: &Manager) -> &'static str {
        m.check_invariants()
            .expect_err("corruption not detected")
            .id
    }

    #[test]
    fn detects_a_lost_cascade_pin() {
        let mut m = busy();
        m.primary.unpin_job(SlotId(0));
        assert_eq!(violated(&m), "I4");
    }

    #[test]
    fn detects_a_forgotten_store_job() {
        let mut m = busy();
        m.jobs.clear();
        assert_eq!(violated(&m), "I4");
    }

    #[test]
    fn detects_a_promotion_without_a_job() {
        let mut m = busy();
        m.restore_tier(TierId(0), [key(9)]).unwrap();
        assert_eq!(m.lookup(RequestId(1), &key(9)), Lookup::HitPending);
        m.requests = Requests::default();
        assert_eq!(violated(&m), "I5");
    }

    #[test]
    fn detects_a_freed_slot_under_a_job() {
        let mut m = busy();
        // Free slot 0 behind the store job's back (as an early release on timeout would).
        m.primary.force_free(SlotId(0));
        m.primary.check_invariants().unwrap();
        assert_eq!(violated(&m), "I6");
    }

    #[test]
    fn detects_back_pressure_overrun() {
        let mut m = busy();
        m.tiers[0].max_outstanding_stores = 0;
        assert_eq!(violated(&m), "I9");
    }

    #[test]
    fn detects_a_health_job_mismatch() {
        let mut m = busy();
        m.tiers[0].health = HealthState::Probing { job: JobId(42) };
        assert_eq!(violated(&m), "I10");
    }

    #[test]
    fn detects_a_tier_write_without_a_job() {
        let mut m = busy();
        let job = m.jobs.values_mut().next().unwrap();
        job.job.kind = JobKind::Store {
            request: RequestId(1),
            blocks: Arc::from(alloc::vec![]),
        };
        // The job's tier entries no longer match its blocks.
        assert_eq!(violated(&m), "I8");
        let mut m = busy();
        let entry = m.jobs.values().next().unwrap().entries[0];
        m.tiers[0].index.finish_write(entry, true);
        assert_eq!(violated(&m), "I8");
    }
}
