//! The stateright model: the **real** core plus the jobs it owes, explored breadth-first.
//!
//! Actions are the engine's calls (lookups, stores that succeed or fail, loads and their
//! release, touches, the end of a step, shutdown, deliberately invalid calls) and the end of any
//! outstanding job in any order, succeeding, failing or partly succeeding. States are
//! deduplicated by [`Manager::canonical_state`] plus the model's own shadow of which data each
//! slot holds, so the exploration is finite.
//!
//! Properties (see `docs/verification.md`):
//! - always: `check_invariants` holds; no block is evicted while pinned, in use by a job,
//!   Pending, Promoting or protected as its request's hit; no slot named by an outstanding job
//!   holds another block; a lookup never answers Hit for a block whose data was not fully
//!   written into its slot; refused calls change nothing; from every state, ending every
//!   outstanding job and the step settles (no Pending, Promoting, cascade pins or jobs left).
//! - sometimes: a promotion completes; an eviction happens; a tier goes Down and comes back;
//!   with the reuse-aware LRU's return horizon, a block idle past it is evicted.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};

use kvtier_core::{
    Admission, BlockState, Config, Effect, EntryState, EventKind, Job, JobId, JobKind, JobResult,
    Key, Lookup, Manager, Medium, Outcome, PolicyKind, RequestId, ReturnHorizon, SlotId,
    TierConfig, TierId, TierKind,
};
use stateright::{Model, Property};

/// The model: a configuration and the alphabet's size.
#[derive(Clone, Debug)]
pub struct TieringModel {
    /// The core's configuration (events must be on: evictions are observed through them).
    pub config: Config,
    /// Keys `0..keys`.
    pub keys: u8,
    /// Requests `0..requests`.
    pub requests: u8,
    /// Include `touch` actions.
    pub touch: bool,
    /// Include stores whose GPU copy fails.
    pub failed_stores: bool,
    /// Include the engine's load pins (`prepare_load` / `complete_load`).
    pub loads: bool,
    /// Include `shutdown`.
    pub shutdown: bool,
    /// ★9: the clock moves (`Tick`), and a request's record lasts across its lookups until
    /// its `Finish`, so that it can wait past `config.wait_deadline` (which must be set).
    pub deadline: bool,
    /// Check only the property of this name (the negative tests: each property alone must
    /// catch its seeded defect).
    pub only: Option<&'static str>,
}

impl TieringModel {
    /// The configuration explored to its closure in CI: 3 keys, 1 request, a 2-slot LRU
    /// primary, two authoritative tiers of 2 blocks each (one store job each at a time), one
    /// failure takes a tier Down and one step later it is probed. Actions: lookups, stores of
    /// one key and of a pair, the end of a step, refused calls, and every end of every owed
    /// job (success, failure, partial success).
    pub fn ci() -> Self {
        let mut m = Self::small();
        m.config.tiers[1].kind = TierKind::Authoritative;
        m.touch = false;
        m.failed_stores = false;
        m.loads = false;
        m.shutdown = false;
        m
    }

    /// As [`TieringModel::ci`], with kvtier's reuse-aware LRU (U1–U10) for the primary (the
    /// tiers keep LRU), explored in CI to a depth bound.
    pub fn ci_reuse() -> Self {
        let mut m = Self::ci();
        m.config.policy = PolicyKind::Reuse;
        // U1–U9: U10's idle ages grow with the clock, so that almost no two states are alike
        // (an exploration to depth 11 ran out of 24 GB); the differential harness and the
        // fuzzer check U10.
        m.config.return_horizon = None;
        m
    }

    /// As [`TieringModel::ci_reuse`] with U10 on: every key sampled and a horizon from the
    /// first return gap, so that the horizon forms, moves and expires entries within a few
    /// calls. The idle ages grow with the clock and few states are alike, so it is explored
    /// to a shallower bound than U1–U9.
    pub fn ci_reuse_horizon() -> Self {
        let mut m = Self::ci_reuse();
        m.config.return_horizon = Some(ReturnHorizon {
            sample: 1,
            min_gaps: 1,
        });
        m
    }

    /// V1–V4: as [`TieringModel::ci`] with the first tier a victim tier writing the next
    /// two victims ahead (the second cascades, as vLLM's), explored in CI to a depth bound.
    pub fn ci_victim() -> Self {
        let mut m = Self::ci();
        m.config.tiers[0].admission = Admission::Victim { lookahead: 2 };
        m
    }

    /// ★9 (W1–W7): as [`TieringModel::ci`] with a shared second tier (a key it has not
    /// probed yet answers `Retry`), a wait deadline of 2 ticks, the clock's ticks and the end
    /// of a request as actions. Explored in CI to a depth bound.
    pub fn ci_deadline() -> Self {
        let mut m = Self::small();
        m.touch = false;
        m.failed_stores = false;
        m.loads = false;
        m.shutdown = false;
        m.config.wait_deadline = Some(2);
        m.deadline = true;
        m
    }

    /// The larger configuration: as [`TieringModel::ci`] with a shared second tier (existence
    /// probes, cached absent answers) and every action: touches, failed stores, the engine's
    /// load pins, shutdown. Its closure is beyond a CI run; it is explored to a depth bound.
    pub fn small() -> Self {
        let mut c = Config::new(2);
        c.tiers = vec![
            TierConfig::new(TierKind::Authoritative, 2),
            TierConfig::new(TierKind::Shared, 2),
        ];
        for t in &mut c.tiers {
            t.max_outstanding_stores = 1;
            t.max_outstanding_probes = 1;
            t.absent_ttl_steps = 1;
        }
        c.health.failures_to_down = 1;
        c.health.probe_interval_steps = 1;
        c.promotion_cooldown_steps = 1;
        TieringModel {
            config: c,
            keys: 3,
            requests: 1,
            touch: true,
            failed_stores: true,
            loads: true,
            shutdown: true,
            deadline: false,
            only: None,
        }
    }
}

/// One explored state.
#[derive(Clone, Debug)]
pub struct ModelState {
    /// The real core.
    pub core: Manager,
    /// The data shadow: which block's bytes each slot holds, fully written.
    written: BTreeMap<SlotId, Key>,
    /// Hits answered in this step, per request (★8: never evicted by its own promotion).
    hits: BTreeSet<(RequestId, Key)>,
    /// ★9, from the answers seen: since when a request has been answered HitPending or
    /// Retry for a key, or `None` once it was answered Miss at the deadline.
    waits: BTreeMap<(RequestId, Key), Option<u64>>,
    /// The results handed in and not yet applied: per job, its tier and whether it counts as
    /// a failed job (J6: a block the shared store no longer holds is no failure). Derived
    /// from the core's inbox, which is part of the canonical state.
    failing: BTreeMap<JobId, (TierId, bool)>,
    /// The first property this state's transition broke, if any.
    pub violation: Option<String>,
    /// A 128-bit digest of the state's identity (the core's canonical state, the waits seen,
    /// the violation): two states are one state when their digests are equal. A digest, not
    /// the text, because every generated state is cloned and compared; a collision between
    /// two of the millions of states explored has a chance near 2^-84.
    canon: u128,
}

impl ModelState {
    fn new(core: Manager) -> Self {
        let mut s = ModelState {
            core,
            written: BTreeMap::new(),
            hits: BTreeSet::new(),
            waits: BTreeMap::new(),
            failing: BTreeMap::new(),
            violation: None,
            canon: 0,
        };
        s.seal();
        s
    }

    fn seal(&mut self) {
        // The shadow matters only for Ready blocks, where it must equal the core's own map
        // (checked at every transition), and the hits are the core's own step state: neither
        // adds information, so neither is part of the identity of a state.
        self.written
            .retain(|slot, k| self.core.primary().key_at(*slot) == Some(k));
        // Waits by age, ages past the deadline alike (as the core's own encoding).
        let deadline = self.core.config().wait_deadline.unwrap_or(0) + 1;
        let clock = self.core.clock();
        let waits: Vec<_> = self
            .waits
            .iter()
            .map(|(rk, w)| (rk, w.map(|t| (clock - t).min(deadline))))
            .collect();
        self.canon = CANON_TEXT.with_borrow_mut(|text| {
            use std::fmt::Write;
            text.clear();
            self.core.write_canonical_state(text);
            let _ = write!(text, " | {waits:?} | {:?}", self.violation);
            digest(text.as_bytes())
        });
    }

    /// Jobs the IO layer owes a result: outstanding and not yet reported.
    pub fn owed(&self) -> Vec<Job> {
        self.core
            .outstanding_jobs()
            .filter(|j| !self.core.is_reported(j.id))
            .cloned()
            .collect()
    }
}

thread_local! {
    /// One text buffer per checker thread, reused for every state it seals.
    static CANON_TEXT: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Two SipHash-1-3 sums of `bytes` under different prefixes, as one 128-bit digest.
fn digest(bytes: &[u8]) -> u128 {
    let half = |prefix: u8| {
        let mut h = std::hash::DefaultHasher::new();
        h.write_u8(prefix);
        h.write(bytes);
        h.finish()
    };
    (u128::from(half(0)) << 64) | u128::from(half(1))
}

impl PartialEq for ModelState {
    fn eq(&self, other: &Self) -> bool {
        self.canon == other.canon
    }
}

impl Eq for ModelState {}

impl Hash for ModelState {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.canon.hash(state);
    }
}

/// How an outstanding job ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum End {
    /// Every block moved / found / healthy.
    Ok,
    /// Nothing moved.
    Failed,
    /// Only the first block moved (store and load jobs of two or more blocks).
    FirstOnly,
    /// Not found (existence probes); no block held any more (loads from a shared tier).
    NotFound,
}

/// An action of the model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `lookup(request, key)`.
    Lookup(u8, u8),
    /// `prepare_store` + `complete_store(ok)` of these keys.
    Store(Vec<u8>, bool),
    /// `prepare_load` of one key (the engine pins it).
    Load(u8),
    /// `complete_load` of one key the engine pinned.
    Unload(u8),
    /// `touch` of one key.
    Touch(u8),
    /// `end_step`.
    EndStep,
    /// The end of the owed job with this id.
    End(u64, End),
    /// `complete_load` of a key without a load pin: refused, nothing changes.
    BadUnload(u8),
    /// `shutdown`.
    Shutdown,
    /// The clock moves by one (W1).
    Tick,
    /// `request_finished(request)` (W6).
    Finish(u8),
}

fn key(k: u8) -> Key {
    Key::from([k])
}

impl TieringModel {
    /// The request of the engine's stores and loads: request 0, or with the deadline one of
    /// its own, so that a store does not end the waits of the requests that look blocks up.
    fn writer(&self) -> RequestId {
        RequestId(if self.deadline {
            u64::from(self.requests)
        } else {
            0
        })
    }

    fn apply(&self, s: &ModelState, action: &Action) -> ModelState {
        let mut n = s.clone();
        n.violation = None;
        // Calls that collect job results (M1) may free blocks before they decide: compare
        // evictions with the state as the collection left it.
        let mut collected = s.core.clone();
        match action {
            Action::Lookup(..) | Action::EndStep => collected.collect_step(),
            Action::Store(..) => {
                let _ = collected.prepare_store(RequestId(0), &[]);
            }
            _ => {}
        }
        let before = &collected;
        let m = &mut n.core;
        match action {
            Action::Lookup(r, k) => {
                let (req, k) = (RequestId(u64::from(*r)), key(*k));
                // W3, W4: a request that waited for the block past the deadline (or gave it
                // up) is answered Miss, unless the block is readable now (W3 only).
                let expired = match n.waits.get(&(req, k.clone())) {
                    Some(None) => Some("W4"),
                    Some(Some(since)) => {
                        let deadline = self.config.wait_deadline.expect("waits need a deadline");
                        let ready = matches!(
                            before.primary().state_of(&k),
                            Some((_, BlockState::Ready { .. }))
                        );
                        (!ready && before.clock() - since > deadline).then_some("W3")
                    }
                    None => None,
                };
                let timeouts = |c: &Manager| c.stats().wait_timeouts;
                let before_timeouts = if self.deadline { timeouts(before) } else { 0 };
                let answer = m.lookup(req, &k);
                if self.deadline && expired.is_none() && timeouts(m) != before_timeouts {
                    n.violation = Some(format!(
                        "W3: {req} gave up {k} before waiting past the deadline"
                    ));
                }
                if let Some(rule) = expired
                    && answer != Lookup::Miss
                {
                    n.violation = Some(format!(
                        "{rule}: {req} waited for {k} past the deadline and was answered {answer:?}"
                    ));
                }
                if self.deadline {
                    match (expired, answer) {
                        (Some(_), _) => {
                            n.waits.insert((req, k.clone()), None);
                        }
                        (None, Lookup::HitPending | Lookup::Retry) => {
                            let now = m.clock();
                            n.waits.entry((req, k.clone())).or_insert(Some(now));
                        }
                        (None, _) => {
                            n.waits.remove(&(req, k.clone()));
                        }
                    }
                }
                if answer == Lookup::Hit {
                    let (slot, _) = m.primary().state_of(&k).expect("hit is held");
                    if n.written.get(&slot) != Some(&k) {
                        n.violation = Some(format!("Hit for {k} whose data is not in {slot}"));
                    }
                    n.hits.insert((req, k));
                }
                // Each engine call is a whole request (R1–R6): no record outlives an action,
                // so the state space stays that of the blocks. The ★8 protection of the
                // step's hits is the manager's, kept until the step ends. With the deadline,
                // a request lasts until its Finish.
                if !self.deadline {
                    m.request_finished(req);
                }
            }
            Action::Tick => m.set_clock(m.clock() + 1),
            Action::Finish(r) => {
                let req = RequestId(u64::from(*r));
                m.request_finished(req);
                n.waits.retain(|(q, _), _| *q != req);
            }
            Action::Store(ks, ok) => {
                let ks: Vec<Key> = ks.iter().map(|&k| key(k)).collect();
                if let Ok(p) = m.prepare_store(self.writer(), &ks) {
                    for (k, slot) in p.keys.iter().zip(&p.slots) {
                        // The engine copies the block in; a failed copy leaves garbage.
                        if *ok {
                            n.written.insert(*slot, k.clone());
                        } else {
                            n.written.remove(slot);
                        }
                    }
                    m.complete_store(self.writer(), &p.keys, *ok);
                }
                m.request_finished(self.writer());
            }
            Action::Load(k) => {
                let _ = m.prepare_load(self.writer(), &[key(*k)]);
                m.request_finished(self.writer());
            }
            Action::Unload(k) => {
                if m.complete_load(&[key(*k)]).is_err() {
                    n.violation = Some(format!("a held load pin of {k} was refused"));
                }
            }
            Action::Touch(k) => m.touch(&[key(*k)]),
            Action::EndStep => {
                m.end_step();
                n.hits.clear();
            }
            Action::End(id, end) => {
                let job = s
                    .owed()
                    .into_iter()
                    .find(|j| j.id.0 == *id)
                    .expect("owed job");
                let blocks = job.blocks();
                let outcome = match end {
                    End::Ok => Outcome::Ok,
                    End::Failed => Outcome::Failed,
                    End::FirstOnly => Outcome::partial(vec![blocks[0].key.clone()]),
                    End::NotFound => Outcome::NotFound,
                };
                // A load writes into the slots: the blocks that succeeded hold their data,
                // the others hold whatever a broken transfer left.
                if let JobKind::Load { .. } = job.kind {
                    for (i, b) in blocks.iter().enumerate() {
                        let good = match end {
                            End::Ok => true,
                            End::FirstOnly => i == 0,
                            _ => false,
                        };
                        if good {
                            n.written.insert(b.slot, b.key.clone());
                        } else {
                            n.written.remove(&b.slot);
                        }
                    }
                }
                let counts = !matches!(job.kind, JobKind::Health)
                    && matches!(end, End::Failed | End::FirstOnly);
                n.failing.insert(job.id, (job.tier, counts));
                if let Err(e) = m.handle_job_result(JobResult {
                    job: job.id,
                    outcome,
                }) {
                    n.violation = Some(format!("a valid result was refused: {e}"));
                }
            }
            Action::BadUnload(k) => {
                let canon = m.canonical_state();
                if m.complete_load(&[key(*k)]).is_ok() {
                    n.violation = Some(format!("complete_load of unpinned {k} accepted"));
                } else if m.canonical_state() != canon {
                    n.violation = Some("a refused complete_load changed the state".into());
                }
            }
            Action::Shutdown => {
                m.shutdown();
                n.waits.clear();
            }
        }
        // Drain the IO layer's side: jobs are now owed; a deletion must name a tier only this
        // node writes (T14: a shared tier forgets what it evicts, others may be reading it).
        while let Some(e) = m.poll_effect() {
            if let Effect::Delete { tier, keys } = &e
                && m.config().tiers[tier.index()].kind == TierKind::Shared
                && n.violation.is_none()
            {
                n.violation = Some(format!("T14: {keys:?} deleted from shared {tier}"));
            }
        }
        // The metrics window is no part of the state: keep it from growing along a path.
        let _ = m.take_metrics();
        // No block leaves by eviction unless it was idle: Ready, unpinned, not in use, and
        // not one of the promoting request's own hits.
        for ev in m.take_events() {
            if ev.kind != EventKind::Removed || n.violation.is_some() {
                continue;
            }
            for k in &ev.keys {
                let idle = match ev.medium {
                    // The primary evicts only while admitting blocks, never while collecting.
                    Medium::Primary => matches!(
                        before.primary().state_of(k),
                        Some((
                            _,
                            BlockState::Ready {
                                load_pins: 0,
                                job_pins: 0
                            }
                        ))
                    ),
                    // A tier may evict while the collection applies results (a probe found a
                    // block): a block whose writer or readers already reported is finishing,
                    // not busy. Judge by the state before the call and what it had received.
                    Medium::Tier(t) => {
                        let reported = |store: bool| {
                            s.core
                                .outstanding_jobs()
                                .filter(|j| j.tier == t && s.core.is_reported(j.id))
                                .filter(|j| matches!(j.kind, JobKind::Store { .. }) == store)
                                .filter(|j| j.blocks().iter().any(|b| &b.key == k))
                                .count() as u32
                        };
                        match s.core.tier(t).and_then(|x| x.state_of(k)) {
                            None | Some(EntryState::Present { readers: 0 }) => true,
                            Some(EntryState::Writing) => reported(true) > 0,
                            Some(EntryState::Present { readers }) => readers <= reported(false),
                        }
                    }
                };
                if !idle {
                    n.violation = Some(format!("{k} evicted from {:?} while busy", ev.medium));
                }
                if let (Medium::Primary, Action::Lookup(r, _)) = (ev.medium, action)
                    && s.hits.contains(&(RequestId(u64::from(*r)), k.clone()))
                {
                    n.violation = Some(format!("a promotion evicted its request's hit {k}"));
                }
            }
        }
        // J6, H1: a tier counts as failed exactly the jobs that failed; a block the shared
        // store no longer holds is no failure. Shutdown cancels jobs: it is not judged.
        let applied: Vec<JobId> = n
            .failing
            .keys()
            .filter(|j| !m.outstanding_jobs().any(|o| o.id == **j))
            .copied()
            .collect();
        for t in 0..m.config().tiers.len() {
            let tid = TierId(t as u16);
            let expected = applied
                .iter()
                .filter(|j| n.failing[j] == (tid, true))
                .count() as u64;
            let counted = |c: &Manager| c.stats().tiers[t].1.jobs_failed;
            let delta = counted(m) - counted(&s.core);
            if *action != Action::Shutdown && delta != expected && n.violation.is_none() {
                n.violation = Some(format!(
                    "J6: {tid} counted {delta} failed jobs, the results applied hold {expected}"
                ));
            }
        }
        for j in applied {
            n.failing.remove(&j);
        }
        if *action == Action::Shutdown {
            n.failing.clear();
        }
        // A block is Ready only once its data is fully written into its slot.
        for k in 0..self.keys {
            let k = key(k);
            if let Some((slot, BlockState::Ready { .. })) = m.primary().state_of(&k)
                && n.written.get(&slot) != Some(&k)
                && n.violation.is_none()
            {
                n.violation = Some(format!("{k} is Ready but {slot} does not hold its data"));
            }
        }
        // A store job (M6, V2) copies only a slot holding its block's data, fully written.
        for j in m.outstanding_jobs() {
            if !matches!(j.kind, JobKind::Store { .. })
                || s.core.outstanding_jobs().any(|o| o.id == j.id)
            {
                continue;
            }
            for b in j.blocks() {
                if n.written.get(&b.slot) != Some(&b.key) && n.violation.is_none() {
                    n.violation = Some(format!(
                        "{} writes {} from {}, which does not hold its data",
                        j.id, b.key, b.slot
                    ));
                }
            }
        }
        // No slot named by an outstanding job holds another block.
        for j in m.outstanding_jobs() {
            for b in j.blocks() {
                if m.primary().key_at(b.slot) != Some(&b.key) && n.violation.is_none() {
                    n.violation = Some(format!("{} of {} reused under {}", b.slot, b.key, j.id));
                }
            }
        }
        n.seal();
        n
    }

    /// Ends every owed job with success and ends steps until nothing is outstanding.
    fn settles(&self, s: &ModelState) -> Result<(), String> {
        let mut m = s.core.clone();
        for _ in 0..6 {
            let owed: Vec<Job> = m
                .outstanding_jobs()
                .filter(|j| !m.is_reported(j.id))
                .cloned()
                .collect();
            for j in owed {
                m.handle_job_result(JobResult {
                    job: j.id,
                    outcome: Outcome::Ok,
                })
                .map_err(|e| e.to_string())?;
            }
            m.end_step();
            while m.poll_effect().is_some() {}
            if m.outstanding_jobs().next().is_none() {
                break;
            }
        }
        if let Some(j) = m.outstanding_jobs().next() {
            return Err(format!("{} never ends", j.id));
        }
        for k in 0..self.keys {
            match m.primary().state_of(&key(k)) {
                Some((_, BlockState::Pending | BlockState::Promoting)) => {
                    return Err(format!("{k} still in flight"));
                }
                Some((_, BlockState::Ready { job_pins, .. })) if job_pins > 0 => {
                    return Err(format!("{k} still has cascade pins"));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl Model for TieringModel {
    type State = ModelState;
    type Action = Action;

    fn init_states(&self) -> Vec<ModelState> {
        let mut c = self.config.clone();
        c.events = true;
        vec![ModelState::new(Manager::new(c).expect("valid config"))]
    }

    fn actions(&self, s: &ModelState, actions: &mut Vec<Action>) {
        if s.violation.is_some() {
            return; // the property reports it; nothing follows
        }
        for r in 0..self.requests {
            for k in 0..self.keys {
                actions.push(Action::Lookup(r, k));
            }
        }
        for k in 0..self.keys {
            actions.push(Action::Store(vec![k], true));
            if self.failed_stores {
                actions.push(Action::Store(vec![k], false));
            }
            if self.touch {
                actions.push(Action::Touch(k));
            }
            match s.core.primary().state_of(&key(k)) {
                Some((_, BlockState::Ready { load_pins, .. })) if load_pins > 0 => {
                    if self.loads {
                        actions.push(Action::Unload(k));
                    }
                }
                Some((_, BlockState::Ready { .. })) => {
                    if self.loads {
                        actions.push(Action::Load(k));
                    }
                    actions.push(Action::BadUnload(k));
                }
                _ => actions.push(Action::BadUnload(k)),
            }
        }
        if self.keys >= 2 {
            actions.push(Action::Store(vec![0, 1], true));
        }
        actions.push(Action::EndStep);
        if self.deadline {
            actions.push(Action::Tick);
            for r in 0..self.requests {
                actions.push(Action::Finish(r));
            }
        }
        if self.shutdown && !s.core.is_closed() {
            actions.push(Action::Shutdown);
        }
        for j in s.owed() {
            let shared = self.config.tiers[j.tier.index()].kind == TierKind::Shared;
            let ends: &[End] = match &j.kind {
                // J6: a shared store may no longer hold a load's blocks.
                JobKind::Load { blocks, .. } if shared && blocks.len() > 1 => {
                    &[End::Ok, End::Failed, End::FirstOnly, End::NotFound]
                }
                JobKind::Load { .. } if shared => &[End::Ok, End::Failed, End::NotFound],
                JobKind::Store { blocks, .. } | JobKind::Load { blocks, .. }
                    if blocks.len() > 1 =>
                {
                    &[End::Ok, End::Failed, End::FirstOnly]
                }
                JobKind::Exists { .. } => &[End::Ok, End::NotFound, End::Failed],
                _ => &[End::Ok, End::Failed],
            };
            for &e in ends {
                actions.push(Action::End(j.id.0, e));
            }
        }
    }

    fn next_state(&self, s: &ModelState, action: Action) -> Option<ModelState> {
        let n = self.apply(s, &action);
        (n != *s).then_some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut all = vec![
            Property::always("invariants hold", |_, s: &ModelState| {
                s.core.check_invariants().is_ok()
            }),
            Property::always("no transition breaks a rule", |_, s: &ModelState| {
                s.violation.is_none()
            }),
            Property::always("every state settles", |m: &TieringModel, s: &ModelState| {
                m.settles(s).is_ok()
            }),
            Property::sometimes("a promotion completes", |_, s: &ModelState| {
                s.core.stats().promotions_succeeded > 0
            }),
            Property::sometimes("an eviction happens", |_, s: &ModelState| {
                s.core.stats().evictions > 0
            }),
            Property::sometimes("a tier goes down and comes back", |_, s: &ModelState| {
                s.core.stats().tiers.iter().any(|(_, t)| t.came_up > 0)
            }),
        ];
        if self.deadline {
            all.push(Property::sometimes(
                "a request gives up waiting",
                |_, s: &ModelState| s.core.stats().wait_timeouts > 0,
            ));
        }
        if self.config.policy == PolicyKind::Reuse && self.config.return_horizon.is_some() {
            all.push(Property::sometimes(
                "a block idle past the return horizon is evicted",
                |_, s: &ModelState| s.core.stats().evictions_past_horizon > 0,
            ));
        }
        match self.only {
            Some(name) => all.into_iter().filter(|p| p.name == name).collect(),
            None => all,
        }
    }
}
