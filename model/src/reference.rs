//! `RefModel`: the tiering contract written for obviousness.
//!
//! Every rule of `docs/state-machine.md` as plainly as it can be said: `BTreeMap`s keyed by
//! block, recency as `Vec`s of keys scanned from the front, no indexes, no ids but the ones the
//! contract gives out (slots and jobs). It predicts every observable answer of
//! [`kvtier_core::Manager`]: lookups, slot ids, victims, errors, jobs, deletions and events.
//! It is slow on purpose; it only has to be right.

use std::collections::BTreeMap;

use kvtier_core::{
    Config, Effect, Error, Event, EventKind, Job, JobId, JobKind, JobResult, Key, Lookup, Medium,
    Outcome, PolicyKind, PreparedStore, RequestId, SlotId, TierId, TierKind, Transfer,
};

/// A block's state in the primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pending,
    Promoting,
    Ready,
}

#[derive(Clone, Debug)]
struct Block {
    slot: u32,
    state: State,
    load_pins: u32,
    job_pins: u32,
}

impl Block {
    fn evictable(&self) -> bool {
        self.state == State::Ready && self.load_pins == 0 && self.job_pins == 0
    }
}

/// Recency of one tier: LRU (one list) or vLLM's simplified ARC.
#[derive(Clone, Debug)]
enum Recency {
    Lru(Vec<Key>),
    Arc {
        t1: Vec<Key>,
        t2: Vec<Key>,
        b1: Vec<Key>,
        b2: Vec<Key>,
        p: f64,
        cap: usize,
    },
}

fn remove_key(list: &mut Vec<Key>, key: &Key) -> bool {
    match list.iter().position(|k| k == key) {
        Some(i) => {
            list.remove(i);
            true
        }
        None => false,
    }
}

impl Recency {
    fn new(kind: PolicyKind, cap: usize) -> Self {
        match kind {
            PolicyKind::Lru => Recency::Lru(Vec::new()),
            PolicyKind::Arc => Recency::Arc {
                t1: Vec::new(),
                t2: Vec::new(),
                b1: Vec::new(),
                b2: Vec::new(),
                p: 0.0,
                cap,
            },
        }
    }

    /// L1 / A1.
    fn insert(&mut self, key: &Key) {
        match self {
            Recency::Lru(order) => order.push(key.clone()),
            Recency::Arc { t1, b1, b2, .. } => {
                t1.push(key.clone());
                remove_key(b1, key);
                remove_key(b2, key);
            }
        }
    }

    /// The block left without eviction: no ghost.
    fn remove(&mut self, key: &Key) {
        match self {
            Recency::Lru(order) => {
                remove_key(order, key);
            }
            Recency::Arc { t1, t2, .. } => {
                if !remove_key(t1, key) {
                    remove_key(t2, key);
                }
            }
        }
    }

    /// L2 / A2–A5 for one key; `resident` says whether it is held and Ready.
    fn touch(&mut self, key: &Key, resident: Option<bool>) {
        match self {
            Recency::Lru(order) => {
                if resident.is_some() && remove_key(order, key) {
                    order.push(key.clone());
                }
            }
            Recency::Arc {
                t1,
                t2,
                b1,
                b2,
                p,
                cap,
            } => {
                if let Some(ready) = resident {
                    if remove_key(t1, key) {
                        if ready { t2 } else { t1 }.push(key.clone());
                    } else if remove_key(t2, key) {
                        t2.push(key.clone());
                    }
                } else if remove_key(b1, key) {
                    let ratio = b2.len() as f64 / (b1.len() + 1) as f64;
                    *p = (*p + ratio.max(1.0)).min(*cap as f64);
                    b1.push(key.clone());
                } else if remove_key(b2, key) {
                    let ratio = b1.len() as f64 / (b2.len() + 1) as f64;
                    *p = (*p - ratio.max(1.0)).max(0.0);
                    b2.push(key.clone());
                }
            }
        }
    }

    /// L3 / A6: up to `n` victims among the keys `eligible` accepts.
    fn select(&self, n: usize, eligible: impl Fn(&Key) -> bool) -> Vec<Key> {
        let mut chosen: Vec<Key> = Vec::new();
        match self {
            Recency::Lru(order) => {
                for k in order {
                    if chosen.len() < n && eligible(k) {
                        chosen.push(k.clone());
                    }
                }
            }
            Recency::Arc { t1, t2, p, .. } => {
                let mut t1_len = t1.len();
                for _ in 0..n {
                    let pick = |list: &Vec<Key>, chosen: &Vec<Key>| {
                        list.iter()
                            .find(|k| eligible(k) && !chosen.contains(k))
                            .cloned()
                    };
                    let from_t1 = if t1_len >= p.floor() as usize {
                        pick(t1, &chosen)
                    } else {
                        None
                    };
                    if let Some(k) = from_t1 {
                        chosen.push(k);
                        t1_len -= 1;
                    } else if let Some(k) = pick(t2, &chosen) {
                        chosen.push(k);
                    } else {
                        break;
                    }
                }
            }
        }
        chosen
    }

    /// A6: evicted blocks become ghosts of their list, each ghost list bounded.
    fn evict(&mut self, key: &Key) {
        match self {
            Recency::Lru(order) => {
                remove_key(order, key);
            }
            Recency::Arc {
                t1,
                t2,
                b1,
                b2,
                cap,
                ..
            } => {
                let ghosts = if remove_key(t1, key) {
                    b1
                } else {
                    remove_key(t2, key);
                    b2
                };
                ghosts.push(key.clone());
                while ghosts.len() > *cap {
                    ghosts.remove(0);
                }
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Writing,
    Present(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Health {
    Up,
    Down(u64),
    Probing(JobId),
    Closed,
}

#[derive(Clone, Debug)]
struct Tier {
    kind: TierKind,
    cap: usize,
    max_stores: u32,
    max_probes: usize,
    absent_ttl: u64,
    entries: BTreeMap<Key, Entry>,
    recency: Recency,
    probing: BTreeMap<Key, JobId>,
    /// Known-absent answers, oldest first: (key, valid until step).
    absent: Vec<(Key, u64)>,
    health: Health,
    failures: u32,
    stores: u32,
}

impl Tier {
    fn evict(&mut self, n: usize, protected: &[Key]) -> Vec<Key> {
        let victims = self.recency.select(n, |k| {
            self.entries.get(k) == Some(&Entry::Present(0)) && !protected.contains(k)
        });
        for v in &victims {
            self.entries.remove(v);
            self.recency.evict(v);
        }
        victims
    }

    fn insert(&mut self, key: &Key, e: Entry) {
        self.entries.insert(key.clone(), e);
        self.recency.insert(key);
        self.absent.retain(|(k, _)| k != key);
    }

    fn drop_entry(&mut self, key: &Key) {
        self.entries.remove(key);
        self.recency.remove(key);
    }
}

#[derive(Clone, Debug, Default)]
struct RequestStep {
    hits: Vec<Key>,
    /// Per tier in first-seen order: the promoted blocks in lookup order.
    batches: Vec<(TierId, Vec<Transfer>)>,
}

/// The reference model of a [`kvtier_core::Manager`].
#[derive(Clone, Debug)]
pub struct RefModel {
    config: Config,
    blocks: BTreeMap<Key, Block>,
    next_fresh: u32,
    free: Vec<u32>,
    recency: Recency,
    /// Reuse filter: key → (times seen, when last seen); least recently seen forgotten first.
    seen: BTreeMap<Key, (u32, u64)>,
    clock: u64,
    tiers: Vec<Tier>,
    jobs: BTreeMap<JobId, (Job, bool)>,
    next_job: u64,
    inbox: Vec<JobResult>,
    effects: Vec<Effect>,
    events: Vec<Event>,
    step: u64,
    collected: bool,
    requests: Vec<(RequestId, RequestStep)>,
    cooldown: BTreeMap<(TierId, Key), u64>,
    closed: bool,
}

impl RefModel {
    /// A model of a manager built from `config` (which must be valid).
    pub fn new(config: Config) -> Self {
        let tiers = config
            .tiers
            .iter()
            .map(|t| Tier {
                kind: t.kind,
                cap: t.capacity_blocks as usize,
                max_stores: t.max_outstanding_stores,
                max_probes: t.max_outstanding_probes as usize,
                absent_ttl: u64::from(t.absent_ttl_steps),
                entries: BTreeMap::new(),
                recency: Recency::new(t.policy, t.capacity_blocks as usize),
                probing: BTreeMap::new(),
                absent: Vec::new(),
                health: Health::Up,
                failures: 0,
                stores: 0,
            })
            .collect();
        RefModel {
            recency: Recency::new(config.policy, config.num_blocks as usize),
            blocks: BTreeMap::new(),
            next_fresh: 0,
            free: Vec::new(),
            seen: BTreeMap::new(),
            clock: 0,
            tiers,
            jobs: BTreeMap::new(),
            next_job: 1,
            inbox: Vec::new(),
            effects: Vec::new(),
            events: Vec::new(),
            step: 0,
            collected: false,
            requests: Vec::new(),
            cooldown: BTreeMap::new(),
            closed: false,
            config,
        }
    }

    /// Jobs submitted and not yet ended, by id.
    pub fn outstanding(&self) -> impl Iterator<Item = &Job> + '_ {
        self.jobs.values().map(|(j, _)| j)
    }

    /// Blocks that are Pending, Promoting, or pinned (for quiescence checks).
    pub fn busy_blocks(&self) -> usize {
        self.blocks
            .values()
            .filter(|b| b.state != State::Ready || b.load_pins > 0 || b.job_pins > 0)
            .count()
    }

    fn emit(&mut self, medium: Medium, kind: EventKind, keys: Vec<Key>) {
        if self.config.events && !keys.is_empty() {
            self.events.push(Event { medium, kind, keys });
        }
    }

    fn request(&mut self, req: RequestId) -> &mut RequestStep {
        if let Some(i) = self.requests.iter().position(|(r, _)| *r == req) {
            return &mut self.requests[i].1;
        }
        self.requests.push((req, RequestStep::default()));
        &mut self.requests.last_mut().expect("pushed").1
    }

    // ----- primary -------------------------------------------------------------------

    fn free_slots(&self) -> usize {
        (self.config.num_blocks - self.next_fresh) as usize + self.free.len()
    }

    /// P6/P7 and M4: make room for `keys` without evicting `protected`, insert them in
    /// `state`. All or nothing.
    fn admit(
        &mut self,
        keys: &[Key],
        protected: &[Key],
        state: State,
    ) -> Result<(Vec<SlotId>, Vec<Key>), Error> {
        let needed = keys.len().saturating_sub(self.free_slots());
        let victims = self.recency.select(needed, |k| {
            self.blocks[k].evictable() && !protected.contains(k)
        });
        if victims.len() < needed {
            return Err(Error::NoRoom {
                needed,
                available: victims.len(),
            });
        }
        for v in &victims {
            let b = self.blocks.remove(v).expect("victim is held");
            self.free.push(b.slot);
            self.recency.evict(v);
        }
        self.emit(Medium::Primary, EventKind::Removed, victims.clone());
        let mut slots = Vec::new();
        for k in keys {
            let slot = if self.next_fresh < self.config.num_blocks {
                self.next_fresh += 1;
                self.next_fresh - 1
            } else {
                self.free.pop().expect("room was made")
            };
            self.blocks.insert(
                k.clone(),
                Block {
                    slot,
                    state,
                    load_pins: 0,
                    job_pins: 0,
                },
            );
            self.recency.insert(k);
            slots.push(SlotId(slot));
        }
        Ok((slots, victims))
    }

    fn release(&mut self, key: &Key) {
        let b = self.blocks.remove(key).expect("released block is held");
        self.free.push(b.slot);
        self.recency.remove(key);
    }

    // ----- the calls -------------------------------------------------------------------

    fn collect(&mut self) {
        if !self.collected {
            self.collected = true;
            for r in std::mem::take(&mut self.inbox) {
                self.apply(r, false);
            }
        }
    }

    /// M2–M4.
    pub fn lookup(&mut self, req: RequestId, key: &Key) -> Lookup {
        self.collect();
        if let Some(reuse) = self.config.reuse {
            self.clock += 1;
            let count = self.seen.get(key).map_or(0, |s| s.0);
            self.seen
                .insert(key.clone(), (count.saturating_add(1), self.clock));
            let max = reuse.max_tracker_size as usize;
            if self.seen.len() > max {
                let oldest = self
                    .seen
                    .iter()
                    .min_by_key(|(_, s)| s.1)
                    .map(|(k, _)| k.clone())
                    .expect("not empty");
                self.seen.remove(&oldest);
            }
        }
        if let Some(b) = self.blocks.get(key) {
            if b.state == State::Ready {
                self.request(req).hits.push(key.clone());
                return Lookup::Hit;
            }
            return Lookup::Retry;
        }
        let mut busy = false;
        for t in 0..self.tiers.len() {
            let id = TierId(t as u16);
            if self.tiers[t].health != Health::Up {
                continue;
            }
            if self
                .cooldown
                .get(&(id, key.clone()))
                .is_some_and(|&u| u > self.step)
            {
                continue;
            }
            let tier = &self.tiers[t];
            match tier.entries.get(key) {
                Some(Entry::Present(_)) => return self.promote(req, id, key),
                Some(Entry::Writing) => busy = true,
                None if tier.probing.contains_key(key) => busy = true,
                None if tier.kind == TierKind::Authoritative => {}
                None if tier
                    .absent
                    .iter()
                    .any(|(k, until)| k == key && *until > self.step) => {}
                None if tier.probing.len() >= tier.max_probes => {}
                None => {
                    let job = self.submit(id, JobKind::Exists { key: key.clone() });
                    self.tiers[t].probing.insert(key.clone(), job);
                    busy = true;
                }
            }
        }
        if busy { Lookup::Retry } else { Lookup::Miss }
    }

    fn promote(&mut self, req: RequestId, tier: TierId, key: &Key) -> Lookup {
        let protected: Vec<Key> = self
            .requests
            .iter()
            .filter(|(r, _)| *r == req)
            .flat_map(|(_, s)| s.hits.iter())
            .cloned()
            .collect();
        let Ok((slots, _)) = self.admit(std::slice::from_ref(key), &protected, State::Promoting)
        else {
            return Lookup::Miss;
        };
        if let Some(Entry::Present(r)) = self.tiers[tier.0 as usize].entries.get_mut(key) {
            *r += 1;
        }
        let transfer = Transfer {
            key: key.clone(),
            slot: slots[0],
        };
        let step = self.request(req);
        match step.batches.iter_mut().find(|(t, _)| *t == tier) {
            Some((_, blocks)) => blocks.push(transfer),
            None => step.batches.push((tier, vec![transfer])),
        }
        Lookup::Retry
    }

    /// P4–P7, P17.
    pub fn prepare_store(&mut self, _req: RequestId, keys: &[Key]) -> Result<PreparedStore, Error> {
        self.collect();
        let mut to_store: Vec<Key> = Vec::new();
        for k in keys {
            let reused = match self.config.reuse {
                None => true,
                Some(r) => self.seen.get(k).is_some_and(|s| s.0 >= r.store_threshold),
            };
            if !self.blocks.contains_key(k) && reused && !to_store.contains(k) {
                to_store.push(k.clone());
            }
        }
        if to_store.is_empty() {
            return Ok(PreparedStore::default());
        }
        let protected: Vec<Key> = keys
            .iter()
            .filter(|k| self.blocks.contains_key(*k))
            .cloned()
            .collect();
        let (slots, evicted) = self.admit(&to_store, &protected, State::Pending)?;
        Ok(PreparedStore {
            keys: to_store,
            slots,
            evicted,
        })
    }

    /// P8–P10 and M6–M7.
    pub fn complete_store(&mut self, req: RequestId, keys: &[Key], ok: bool) {
        let mut ready = Vec::new();
        for k in keys {
            match self.blocks.get_mut(k) {
                Some(b) if b.state == State::Pending => {
                    if ok {
                        b.state = State::Ready;
                        ready.push(Transfer {
                            key: k.clone(),
                            slot: SlotId(b.slot),
                        });
                    } else {
                        self.release(k);
                    }
                }
                _ => {}
            }
        }
        self.emit(
            Medium::Primary,
            EventKind::Stored,
            ready.iter().map(|t| t.key.clone()).collect(),
        );
        if ready.is_empty() || self.closed {
            return;
        }
        for t in 0..self.tiers.len() {
            let id = TierId(t as u16);
            let tier = &mut self.tiers[t];
            if tier.health != Health::Up || tier.stores >= tier.max_stores {
                continue;
            }
            let held: Vec<Key> = ready
                .iter()
                .filter(|b| tier.entries.contains_key(&b.key))
                .map(|b| b.key.clone())
                .collect();
            let to_write: Vec<&Transfer> = ready
                .iter()
                .filter(|b| !tier.entries.contains_key(&b.key))
                .collect();
            let room = tier.cap - tier.entries.len();
            let evicted = tier.evict(to_write.len().saturating_sub(room), &held);
            let room = tier.cap - tier.entries.len();
            let writes: Vec<Transfer> = to_write.into_iter().take(room).cloned().collect();
            for w in &writes {
                tier.insert(&w.key, Entry::Writing);
            }
            self.emit(Medium::Tier(id), EventKind::Removed, evicted.clone());
            if !evicted.is_empty() {
                self.effects.push(Effect::Delete {
                    tier: id,
                    keys: evicted,
                });
            }
            if writes.is_empty() {
                continue;
            }
            self.tiers[t].stores += 1;
            for w in &writes {
                self.blocks.get_mut(&w.key).expect("ready").job_pins += 1;
            }
            self.submit(
                id,
                JobKind::Store {
                    request: req,
                    blocks: writes.into(),
                },
            );
        }
    }

    /// P11–P12.
    pub fn prepare_load(&mut self, _req: RequestId, keys: &[Key]) -> Result<Vec<SlotId>, Error> {
        self.collect();
        for k in keys {
            if self.blocks.get(k).is_none_or(|b| b.state != State::Ready) {
                return Err(Error::NotReady { key: k.clone() });
            }
        }
        Ok(keys
            .iter()
            .map(|k| {
                let b = self.blocks.get_mut(k).expect("checked");
                b.load_pins += 1;
                SlotId(b.slot)
            })
            .collect())
    }

    /// P13–P14.
    pub fn complete_load(&mut self, keys: &[Key]) -> Result<(), Error> {
        for (i, k) in keys.iter().enumerate() {
            let uses = keys[..=i].iter().filter(|x| *x == k).count() as u32;
            if self.blocks.get(k).is_none_or(|b| b.load_pins < uses) {
                return Err(Error::NotPinned { key: k.clone() });
            }
        }
        for k in keys {
            self.blocks.get_mut(k).expect("checked").load_pins -= 1;
        }
        Ok(())
    }

    /// M8.
    pub fn touch(&mut self, keys: &[Key]) {
        for k in keys.iter().rev() {
            let resident = self.blocks.get(k).map(|b| b.state == State::Ready);
            self.recency.touch(k, resident);
            for tier in &mut self.tiers {
                let resident = tier.entries.get(k).map(|e| matches!(e, Entry::Present(_)));
                tier.recency.touch(k, resident);
            }
        }
    }

    /// M5.
    pub fn end_step(&mut self) {
        self.collect();
        for (req, step) in std::mem::take(&mut self.requests) {
            for (tier, blocks) in step.batches {
                self.submit(
                    tier,
                    JobKind::Load {
                        request: req,
                        blocks: blocks.into(),
                    },
                );
            }
        }
        let interval = u64::from(self.config.health.probe_interval_steps);
        for t in 0..self.tiers.len() {
            if let Health::Down(since) = self.tiers[t].health
                && self.step >= since + interval
            {
                let job = self.submit(TierId(t as u16), JobKind::Health);
                self.tiers[t].health = Health::Probing(job);
            }
        }
        self.step += 1;
        let step = self.step;
        self.cooldown.retain(|_, until| *until > step);
        for tier in &mut self.tiers {
            tier.absent.retain(|(_, until)| *until > step);
        }
        self.collected = false;
    }

    /// The events since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Every effect since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// ★6.
    pub fn restore_tier(&mut self, tier: TierId, keys: &[Key]) -> Result<Vec<Key>, Error> {
        let t = self
            .tiers
            .get_mut(tier.0 as usize)
            .ok_or(Error::UnknownTier { tier })?;
        let mut rejected = Vec::new();
        for k in keys {
            if t.entries.contains_key(k) {
                continue;
            }
            if t.entries.len() == t.cap {
                rejected.push(k.clone());
            } else {
                t.insert(k, Entry::Present(0));
            }
        }
        Ok(rejected)
    }

    /// Checks a result and queues it.
    pub fn handle_job_result(&mut self, result: JobResult) -> Result<(), Error> {
        let job = result.job;
        let (j, reported) = self.jobs.get(&job).ok_or(Error::UnknownJob { job })?;
        if *reported {
            return Err(Error::DuplicateResult { job });
        }
        let blocks: Option<&[Transfer]> = match &j.kind {
            JobKind::Store { blocks, .. } | JobKind::Load { blocks, .. } => Some(blocks),
            _ => None,
        };
        match (&result.outcome, blocks, &j.kind) {
            (Outcome::Partial { succeeded }, Some(blocks), _) => {
                if let Some(k) = succeeded
                    .iter()
                    .find(|k| !blocks.iter().any(|b| &b.key == *k))
                {
                    return Err(Error::ForeignKey {
                        job,
                        key: k.clone(),
                    });
                }
            }
            (Outcome::Partial { .. }, None, _) => {
                return Err(Error::InvalidOutcome {
                    job,
                    reason: "partial success applies to store and load jobs only",
                });
            }
            (Outcome::NotFound, _, JobKind::Exists { .. }) => {}
            (Outcome::NotFound, _, _) => {
                return Err(Error::InvalidOutcome {
                    job,
                    reason: "not found applies to existence probes only",
                });
            }
            _ => {}
        }
        self.jobs.get_mut(&job).expect("checked").1 = true;
        self.inbox.push(result);
        Ok(())
    }

    /// M10.
    pub fn shutdown(&mut self) {
        if self.closed {
            return;
        }
        for mut r in std::mem::take(&mut self.inbox) {
            // A closing tier caches no probe answer.
            if matches!(self.jobs[&r.job].0.kind, JobKind::Exists { .. }) {
                r.outcome = Outcome::Failed;
                self.apply(r, true);
            } else {
                self.apply(r, false);
            }
        }
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
        for (_, step) in std::mem::take(&mut self.requests) {
            for (tier, blocks) in step.batches {
                for b in &blocks {
                    self.release(&b.key);
                    if let Some(Entry::Present(r)) =
                        self.tiers[tier.0 as usize].entries.get_mut(&b.key)
                    {
                        *r -= 1;
                    }
                }
            }
        }
        for t in &mut self.tiers {
            t.health = Health::Closed;
        }
        self.closed = true;
    }

    fn submit(&mut self, tier: TierId, kind: JobKind) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        let job = Job { id, tier, kind };
        self.effects.push(Effect::Submit(job.clone()));
        self.jobs.insert(id, (job, false));
        id
    }

    /// J1–J5.
    fn apply(&mut self, result: JobResult, cancelled: bool) {
        let (job, _) = self.jobs.remove(&result.job).expect("checked job");
        let ok = |k: &Key| match &result.outcome {
            Outcome::Ok => true,
            Outcome::Partial { succeeded } => succeeded.contains(k),
            _ => false,
        };
        let t = job.tier.0 as usize;
        let mut failed = false;
        match &job.kind {
            JobKind::Store { blocks, .. } => {
                self.tiers[t].stores -= 1;
                let mut stored = Vec::new();
                for b in blocks.iter() {
                    self.blocks.get_mut(&b.key).expect("pinned").job_pins -= 1;
                    if ok(&b.key) {
                        self.tiers[t]
                            .entries
                            .insert(b.key.clone(), Entry::Present(0));
                        stored.push(b.key.clone());
                    } else {
                        self.tiers[t].drop_entry(&b.key);
                        failed = true;
                    }
                }
                self.emit(Medium::Tier(job.tier), EventKind::Stored, stored);
            }
            JobKind::Load { blocks, .. } => {
                let mut stored = Vec::new();
                let mut deletes = Vec::new();
                for b in blocks.iter() {
                    if ok(&b.key) {
                        self.blocks.get_mut(&b.key).expect("promoting").state = State::Ready;
                        stored.push(b.key.clone());
                    } else {
                        self.release(&b.key);
                    }
                }
                self.emit(Medium::Primary, EventKind::Stored, stored);
                for b in blocks.iter() {
                    let good = ok(&b.key);
                    let tier = &mut self.tiers[t];
                    let Some(Entry::Present(r)) = tier.entries.get_mut(&b.key) else {
                        unreachable!("a read block is present");
                    };
                    *r -= 1;
                    if !good && !cancelled && *r == 0 {
                        tier.drop_entry(&b.key);
                        if tier.kind == TierKind::Authoritative {
                            deletes.push(b.key.clone());
                        }
                    }
                    if !good {
                        failed = true;
                        if !cancelled {
                            let until = self.step + u64::from(self.config.promotion_cooldown_steps);
                            self.cooldown.insert((job.tier, b.key.clone()), until);
                        }
                    }
                }
                if !deletes.is_empty() {
                    self.effects.push(Effect::Delete {
                        tier: job.tier,
                        keys: deletes,
                    });
                }
            }
            JobKind::Exists { key } => {
                let tier = &mut self.tiers[t];
                tier.probing.remove(key);
                failed = !matches!(result.outcome, Outcome::Ok | Outcome::NotFound);
                if !tier.entries.contains_key(key) {
                    match result.outcome {
                        Outcome::Ok => {
                            let room = tier.cap - tier.entries.len();
                            let evicted = tier.evict(1usize.saturating_sub(room), &[]);
                            if tier.entries.len() < tier.cap {
                                tier.insert(key, Entry::Present(0));
                            }
                            let tid = job.tier;
                            self.emit(Medium::Tier(tid), EventKind::Removed, evicted.clone());
                            if !evicted.is_empty() {
                                self.effects.push(Effect::Delete {
                                    tier: tid,
                                    keys: evicted,
                                });
                            }
                        }
                        Outcome::NotFound => {
                            let until = self.step + tier.absent_ttl;
                            tier.absent.retain(|(k, _)| k != key);
                            tier.absent.push((key.clone(), until));
                            while tier.absent.len() > tier.cap {
                                tier.absent.remove(0);
                            }
                        }
                        _ => {}
                    }
                }
            }
            JobKind::Health => {
                if !cancelled {
                    let tier = &mut self.tiers[t];
                    if result.outcome == Outcome::Ok {
                        tier.health = Health::Up;
                        tier.failures = 0;
                    } else {
                        tier.health = Health::Down(self.step);
                    }
                }
                return;
            }
        }
        let tier = &mut self.tiers[t];
        if cancelled || tier.health != Health::Up {
            return;
        }
        if failed {
            tier.failures += 1;
            if tier.failures >= self.config.health.failures_to_down {
                tier.health = Health::Down(self.step);
            }
        } else {
            tier.failures = 0;
        }
    }
}
