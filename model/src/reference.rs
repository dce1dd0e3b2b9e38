//! `RefModel`: the tiering contract written for obviousness.
//!
//! Every rule of `docs/state-machine.md` as plainly as it can be said: `BTreeMap`s keyed by
//! block, recency as `Vec`s of keys scanned from the front or as a rank stored per block and
//! sorted, no indexes, no ids but the ones the contract gives out (slots and jobs). It
//! predicts every observable answer of [`kvtier_core::Manager`]: lookups, slot ids, victims,
//! errors, jobs, deletions and events. It is slow on purpose; it only has to be right.
//!
//! The primary follows vLLM 0.33's `CPUOffloadingManager`: a record per live request (the keys
//! it accessed, inserted, reused and missed, and their positions) that the eviction policy
//! applies when the request finishes (R1–R7), vLLM's ranked LRU (L1–L5) and its ARC (A1–A8).

use std::cmp::Reverse;
use std::collections::BTreeMap;

use kvtier_core::{
    Admission, Config, Effect, Error, Event, EventKind, Job, JobId, JobKind, JobResult, Key,
    Lookup, Medium, Outcome, PolicyKind, PreparedStore, RequestId, SlotId, TierId, TierKind,
    Transfer,
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

/// What one live request did to the primary (R1–R5), applied when it finishes (R6).
#[derive(Clone, Debug, Default)]
struct Record {
    /// Every key the request accessed, in first-seen order (R3).
    seen: Vec<Key>,
    /// Keys its stores (or promotions) put in `to_store` and allocated (R4).
    inserted: Vec<Key>,
    /// Of those, the keys its promotions allocated (U4: a promoted block is read back).
    promoted: Vec<Key>,
    /// Keys it read, except keys it had inserted by then (R4).
    reused: Vec<Key>,
    /// Keys that went to the policy as this request's store misses (R5).
    missed: Vec<Key>,
    /// End-token positions (R2).
    positions: BTreeMap<Key, u64>,
    /// LRU: the request's rank `r`, taken at its first access or positioned insert (L1, L4).
    rank: Option<u64>,
}

/// The group index of a key: its last 4 bytes, big-endian; shorter keys are group 0 (R6).
fn group_of(key: &Key) -> u32 {
    let b = key.as_bytes();
    if b.len() < 4 {
        return 0;
    }
    u32::from_be_bytes(b[b.len() - 4..].try_into().expect("4 bytes"))
}

impl Record {
    fn position(&self, key: &Key) -> Option<u64> {
        self.positions.get(key).copied()
    }

    /// R6: the request's keys head to tail.
    fn head_to_tail(&self) -> Vec<Key> {
        let mut groups: BTreeMap<u32, Vec<Key>> = BTreeMap::new();
        for k in &self.seen {
            groups.entry(group_of(k)).or_default().push(k.clone());
        }
        let mut order = Vec::new();
        for (_, mut keys) in groups {
            if keys.iter().all(|k| self.position(k).is_some()) {
                keys.sort_by_key(|k| self.position(k));
            }
            order.extend(keys);
        }
        if order.iter().all(|k| self.position(k).is_some()) {
            order.sort_by_key(|k| self.position(k));
        }
        order
    }
}

/// An LRU rank `(r, −position)`: smaller ranks are evicted first.
type Rank = (u64, Reverse<u64>);

/// Recency of one tier: vLLM's ranked LRU or its simplified ARC.
#[derive(Clone, Debug)]
enum Recency {
    Lru {
        /// Every resident key's rank.
        ranks: BTreeMap<Key, Rank>,
        /// The last `r` given out.
        last: u64,
    },
    Arc {
        t1: Vec<Key>,
        t2: Vec<Key>,
        b1: Vec<Key>,
        b2: Vec<Key>,
        p: f64,
        cap: usize,
    },
    /// The reuse-aware LRU (U1–U10), the primary's only.
    Reuse {
        /// Every resident key's class, due time and the order it took them in.
        entries: BTreeMap<Key, ReuseEntry>,
        /// Ticks once per key a finish or touch walks.
        clock: u64,
        /// Orders placements (ties in due time within a class).
        placed: u64,
        /// How far ahead a key of each class is due (U9): reused
        /// `2 × cap` at first, new 0, then adapted.
        bonus: BTreeMap<ReuseClass, u64>,
        /// U9: what the steps left over after taking their fifths (0..5).
        fifths: u64,
        /// Two generations of distinct evicted keys; `current` takes them, up to `4 × cap`.
        ghosts: [Vec<Key>; 2],
        current: usize,
        /// U9: two generations of victims of every class, repeats kept;
        /// `recent_current` takes them, up to `⌈24 × cap / 40⌉` in all.
        recent: [Vec<(Key, ReuseClass)>; 2],
        recent_current: usize,
        cap: usize,
        /// U10: the workload's return horizon.
        horizon: Gaps,
    },
}

/// U10: sampled keys' last walks, the return gaps they gave, and the horizon.
#[derive(Clone, Debug, Default)]
struct Gaps {
    /// Table position → (tag, clock at the walk), for the positions written.
    table: BTreeMap<u64, (u32, u64)>,
    /// Table positions: the capacity, at least 64.
    len: u64,
    /// One key in this many is sampled (0: none, U10 off); gaps needed before there is a
    /// horizon.
    sample: u64,
    min_gaps: u32,
    /// Bucket → gaps counted.
    gaps: BTreeMap<usize, u32>,
    /// Idle ticks past which a head goes first; `None`: no horizon.
    past: Option<u64>,
}

impl Gaps {
    /// The gap histogram's bucket of `gap ≥ 1`: 8 an octave, the last (384) for 2^48 or more.
    fn bucket(gap: u64) -> usize {
        let octave = gap.ilog2() as usize;
        if octave >= 48 {
            return 384;
        }
        let base = 1u64 << octave;
        // The eighth of the octave the gap falls in.
        let eighth = ((gap - base) as u128 * 8 / base as u128) as usize;
        8 * octave + eighth
    }

    /// A key walked at `clock`.
    fn walked(&mut self, key: &Key, clock: u64) {
        let h = key.hash64();
        if self.sample == 0 || !h.is_multiple_of(self.sample) {
            return;
        }
        let at = (h >> 32) % self.len;
        let tag = (h >> 8) as u32 | 1;
        if let Some(&(t, tick)) = self.table.get(&at)
            && t == tag
        {
            *self.gaps.entry(Self::bucket(clock - tick)).or_default() += 1;
            let mut total: u32 = self.gaps.values().sum();
            if total == 4096 {
                for c in self.gaps.values_mut() {
                    *c /= 2;
                }
                total = self.gaps.values().sum();
            }
            if total >= self.min_gaps {
                // The 95th percentile (U10).
                let within = u64::from(total) * 95 / 100;
                let mut sum = 0u64;
                let b = self
                    .gaps
                    .iter()
                    .find(|(_, c)| {
                        sum += u64::from(**c);
                        sum > within
                    })
                    .map(|(b, _)| *b)
                    .expect("the sum exceeds it");
                self.past = (b < 384).then(|| {
                    let (octave, eighth) = (b / 8, (b % 8) as u64);
                    (1u64 << octave) * (9 + eighth) / 8
                });
            }
        }
        self.table.insert(at, (tag, clock));
    }
}

/// A resident key under the reuse-aware LRU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReuseEntry {
    class: ReuseClass,
    due: u64,
    placed: u64,
    /// The clock when it was placed (U10).
    last: u64,
}

/// U5's eviction order: new and reused merged by due time; on a tie the new classes first,
/// shortest requests first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum ReuseClass {
    /// A new block of a request of 1–3 (0), 4–15 (1), 16–63 (2) or 64 or more (3) keys.
    New(u8),
    Reused,
}

/// U4: the new class of a request of `keys` keys.
fn new_class(keys: usize) -> ReuseClass {
    ReuseClass::New(match keys {
        0..4 => 0,
        4..16 => 1,
        16..64 => 2,
        _ => 3,
    })
}

/// Every class U9 adapts, in the order a recent victim is looked for.
const ADAPTED: [ReuseClass; 5] = [
    ReuseClass::Reused,
    ReuseClass::New(0),
    ReuseClass::New(1),
    ReuseClass::New(2),
    ReuseClass::New(3),
];

/// Places `key` in `class` now (U1, U2, U4): due its class's bonus ticks later.
fn reuse_place(
    entries: &mut BTreeMap<Key, ReuseEntry>,
    key: &Key,
    class: ReuseClass,
    clock: u64,
    bonus: &BTreeMap<ReuseClass, u64>,
    placed: &mut u64,
) {
    *placed += 1;
    // U9: a reused key never before the latest of any class, a new one never before the
    // latest of its class.
    let floor = |e: &&ReuseEntry| match class {
        ReuseClass::New(_) => e.class == class,
        ReuseClass::Reused => true,
    };
    let latest = entries
        .values()
        .filter(floor)
        .map(|e| e.due)
        .max()
        .unwrap_or(0);
    let due = (clock + bonus.get(&class).copied().unwrap_or(0)).max(latest);
    entries.insert(
        key.clone(),
        ReuseEntry {
            class,
            due,
            placed: *placed,
            last: clock,
        },
    );
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

/// A5: a ghost in B1 raises `p`, one in B2 lowers it; the ghost moves to its list's end.
fn ghost_hit(key: &Key, b1: &mut Vec<Key>, b2: &mut Vec<Key>, p: &mut f64, cap: usize) {
    if b1.contains(key) {
        let delta = (b2.len() as f64 / b1.len() as f64).max(1.0);
        *p = (*p + delta).min(cap as f64);
        remove_key(b1, key);
        b1.push(key.clone());
    } else if b2.contains(key) {
        let delta = (b1.len() as f64 / b2.len() as f64).max(1.0);
        *p = (*p - delta).max(0.0);
        remove_key(b2, key);
        b2.push(key.clone());
    }
}

impl Recency {
    fn new(kind: PolicyKind, cap: usize, horizon: Option<kvtier_core::ReturnHorizon>) -> Self {
        match kind {
            PolicyKind::Lru => Recency::Lru {
                ranks: BTreeMap::new(),
                last: 0,
            },
            PolicyKind::Arc => Recency::Arc {
                t1: Vec::new(),
                t2: Vec::new(),
                b1: Vec::new(),
                b2: Vec::new(),
                p: 0.0,
                cap,
            },
            PolicyKind::Reuse => Recency::Reuse {
                entries: BTreeMap::new(),
                clock: 0,
                placed: 0,
                bonus: ADAPTED
                    .iter()
                    .map(|&c| {
                        (
                            c,
                            if c == ReuseClass::Reused {
                                2 * cap as u64
                            } else {
                                0
                            },
                        )
                    })
                    .collect(),
                fifths: 0,
                ghosts: [Vec::new(), Vec::new()],
                current: 0,
                recent: [Vec::new(), Vec::new()],
                recent_current: 0,
                cap,
                horizon: Gaps {
                    len: cap.max(64) as u64,
                    sample: horizon.map_or(0, |h| u64::from(h.sample)),
                    min_gaps: horizon.map_or(u32::MAX, |h| h.min_gaps),
                    ..Gaps::default()
                },
            },
        }
    }

    /// L1 / A1. `record` is the inserting request's (none for a tier).
    fn insert(&mut self, key: &Key, record: Option<&mut Record>) {
        match self {
            Recency::Lru { ranks, last } => {
                let rank = match record {
                    Some(rec) if rec.position(key).is_some() => {
                        let pos = rec.position(key).expect("checked");
                        (request_rank(rec, last), Reverse(pos))
                    }
                    _ => {
                        *last += 1;
                        (*last, Reverse(0))
                    }
                };
                ranks.insert(key.clone(), rank);
            }
            Recency::Arc { t1, b1, b2, .. } => {
                t1.push(key.clone());
                remove_key(b1, key);
                remove_key(b2, key);
            }
            Recency::Reuse {
                entries,
                clock,
                placed,
                bonus,
                fifths,
                ghosts,
                recent,
                cap,
                ..
            } => {
                // U9: a recent victim coming back adapts the bonuses: its class's (reused
                // before new, shorter requests first) lengthens by a step weighed by one over
                // the class's share of the victims, then every class's shortens by a fifth.
                let was = |c: ReuseClass| recent.iter().flatten().any(|(k, x)| k == key && *x == c);
                if let Some(class) = ADAPTED.into_iter().find(|&c| was(c)) {
                    let count =
                        |c: ReuseClass| recent.iter().flatten().filter(|(_, x)| *x == c).count();
                    let total = recent.iter().flatten().count() as u64;
                    let cap = *cap as u64;
                    let step = (cap * total / (500 * count(class).max(1) as u64))
                        .min(cap / 10)
                        .max(1);
                    let own = bonus.get_mut(&class).expect("adapted");
                    *own = (*own + step).min(8 * cap);
                    // The fifths of small steps add up: what is left over goes with the next.
                    *fifths += step;
                    for b in bonus.values_mut() {
                        *b = b.saturating_sub(*fifths / 5);
                    }
                    *fifths %= 5;
                    // A new class passing the reused one takes it along: no new class outlives
                    // reused blocks.
                    let raised = bonus[&class];
                    let reused = bonus.get_mut(&ReuseClass::Reused).expect("adapted");
                    *reused = (*reused).max(raised);
                }
                // U1: back after an eviction → reused; else new, in the longest requests'
                // class until the request finishes.
                let class = if ghosts.iter().any(|g| g.contains(key)) {
                    ReuseClass::Reused
                } else {
                    ReuseClass::New(3)
                };
                reuse_place(entries, key, class, *clock, bonus, placed);
            }
        }
    }

    /// The block left without eviction: no ghost.
    fn remove(&mut self, key: &Key) {
        match self {
            Recency::Lru { ranks, .. } => {
                ranks.remove(key);
            }
            Recency::Arc { t1, t2, .. } => {
                if !remove_key(t1, key) {
                    remove_key(t2, key);
                }
            }
            Recency::Reuse { entries, .. } => {
                entries.remove(key); // U7
            }
        }
    }

    /// L2 / A2–A5 for `keys`, walked last to first; `ready` says whether a held key is
    /// Ready (`None`: not held).
    fn touch(&mut self, keys: &[Key], ready: impl Fn(&Key) -> Option<bool>) {
        for key in keys.iter().rev() {
            match self {
                Recency::Lru { ranks, last } => {
                    if let Some(rank) = ranks.get_mut(key) {
                        *last += 1;
                        *rank = (*last, Reverse(0));
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
                    if remove_key(t1, key) {
                        if ready(key) == Some(true) { t2 } else { t1 }.push(key.clone());
                    } else if remove_key(t2, key) {
                        t2.push(key.clone());
                    } else {
                        ghost_hit(key, b1, b2, p, *cap);
                    }
                }
                Recency::Reuse {
                    entries,
                    clock,
                    placed,
                    bonus,
                    horizon,
                    ..
                } => {
                    *clock += 1; // U2
                    horizon.walked(key, *clock); // U10
                    if entries.contains_key(key) {
                        reuse_place(entries, key, ReuseClass::Reused, *clock, bonus, placed);
                    }
                }
            }
        }
    }

    /// L4 / U8: the request's newly seen keys (ARC: nothing).
    fn access(&mut self, new_keys: &[Key], record: &mut Record) {
        if let Recency::Reuse {
            entries,
            clock,
            placed,
            bonus,
            ..
        } = self
        {
            for k in new_keys {
                if record.position(k).is_some() && entries.contains_key(k) {
                    reuse_place(entries, k, ReuseClass::Reused, *clock, bonus, placed);
                }
            }
        }
        if let Recency::Lru { ranks, last } = self {
            let r = request_rank(record, last);
            for k in new_keys {
                let (Some(pos), Some(rank)) = (record.position(k), ranks.get_mut(k)) else {
                    continue;
                };
                if *rank < (r, Reverse(pos)) {
                    *rank = (r, Reverse(pos));
                }
            }
        }
    }

    /// A7: store misses, last to first (LRU: nothing, the keys are not held).
    fn store_miss(&mut self, keys: &[Key]) {
        if let Recency::Arc { b1, b2, p, cap, .. } = self {
            for k in keys.iter().rev() {
                ghost_hit(k, b1, b2, p, *cap);
            }
        }
    }

    /// L5 / A8: a finished request's keys, head to tail, walked tail to head.
    fn finish(&mut self, record: &Record) {
        let keys = record.head_to_tail();
        let (keys, count) = (keys.iter().rev(), keys.len());
        // U4: whether the walk has placed a key reused (the keys after it are its ancestors).
        let mut walked_reused = false;
        for key in keys {
            match self {
                Recency::Lru { ranks, last } => {
                    if let Some(rank) = ranks.get_mut(key) {
                        *last += 1;
                        *rank = (*last, Reverse(0));
                    }
                }
                Recency::Arc { t1, t2, .. } => {
                    let reused = record.reused.contains(key);
                    let inserted_only = record.inserted.contains(key) && !reused;
                    if inserted_only {
                        if remove_key(t1, key) {
                            t1.push(key.clone());
                        } else if remove_key(t2, key) {
                            t2.push(key.clone());
                        }
                    } else if reused && (remove_key(t1, key) || remove_key(t2, key)) {
                        t2.push(key.clone());
                    }
                }
                Recency::Reuse {
                    entries,
                    clock,
                    placed,
                    bonus,
                    horizon,
                    ..
                } => {
                    *clock += 1; // U4: every walked key ticks
                    horizon.walked(key, *clock); // U10
                    let Some(e) = entries.get(key) else {
                        continue;
                    };
                    // Promoted blocks are read back: reused, like loaded ones.
                    let inserted_only = record.inserted.contains(key)
                        && !record.reused.contains(key)
                        && !record.promoted.contains(key);
                    let class = if !inserted_only || e.class == ReuseClass::Reused || walked_reused
                    {
                        walked_reused = true;
                        ReuseClass::Reused
                    } else {
                        new_class(count)
                    };
                    reuse_place(entries, key, class, *clock, bonus, placed);
                }
            }
        }
    }

    /// L3 / A6: up to `n` victims among the keys `eligible` accepts, in eviction order.
    /// Fewer than `n` means the policy refuses.
    fn select(&self, n: usize, eligible: impl Fn(&Key) -> bool) -> Vec<Key> {
        let mut chosen: Vec<Key> = Vec::new();
        match self {
            Recency::Lru { ranks, .. } => {
                let mut order: Vec<(Rank, &Key)> = ranks
                    .iter()
                    .filter(|(k, _)| eligible(k))
                    .map(|(k, r)| (*r, k))
                    .collect();
                order.sort();
                chosen.extend(order.into_iter().take(n).map(|(_, k)| k.clone()));
            }
            Recency::Arc { t1, t2, p, .. } => {
                let mut t1_len = t1.len();
                let next = |list: &Vec<Key>, chosen: &Vec<Key>| {
                    list.iter()
                        .find(|k| eligible(k) && !chosen.contains(k))
                        .cloned()
                };
                for _ in 0..n {
                    let mut pick = None;
                    if t1_len >= p.floor() as usize {
                        pick = next(t1, &chosen);
                        if pick.is_some() {
                            t1_len -= 1;
                        }
                    }
                    if pick.is_none() {
                        pick = next(t2, &chosen);
                    }
                    if pick.is_none() {
                        pick = next(t1, &chosen);
                        if pick.is_some() {
                            t1_len -= 1;
                        }
                    }
                    match pick {
                        Some(k) => chosen.push(k),
                        None => break,
                    }
                }
            }
            Recency::Reuse {
                entries,
                clock,
                horizon,
                ..
            } => {
                // U5 within each class; U10: each step takes a class's first entry idle past
                // the horizon, the longest idle first, before the classes' merge by due time.
                let mut classes: BTreeMap<ReuseClass, Vec<(&Key, &ReuseEntry)>> = BTreeMap::new();
                for (k, e) in entries {
                    classes.entry(e.class).or_default().push((k, e));
                }
                for list in classes.values_mut() {
                    list.sort_by_key(|(_, e)| (e.due, e.placed));
                    list.reverse(); // the first is popped last
                }
                let expired = |e: &ReuseEntry| horizon.past.is_some_and(|p| *clock - e.last > p);
                while chosen.len() < n {
                    let firsts = classes
                        .iter()
                        .filter_map(|(c, list)| list.last().map(|(_, e)| (*c, *e)));
                    let pick = firsts
                        .clone()
                        .filter(|(_, e)| expired(e))
                        .min_by_key(|(c, e)| (e.last, *c))
                        .or_else(|| firsts.min_by_key(|(c, e)| (e.due, *c)));
                    let Some((class, _)) = pick else {
                        break;
                    };
                    let (k, _) = classes
                        .get_mut(&class)
                        .expect("a class")
                        .pop()
                        .expect("a first");
                    if eligible(k) {
                        chosen.push(k.clone());
                    }
                }
            }
        }
        chosen
    }

    /// A6: evicted blocks become ghosts of their list, then each ghost list is trimmed to
    /// the capacity from its oldest end.
    fn evict(&mut self, victims: &[Key]) {
        match self {
            Recency::Lru { ranks, .. } => {
                for v in victims {
                    ranks.remove(v);
                }
            }
            Recency::Arc {
                t1,
                t2,
                b1,
                b2,
                cap,
                ..
            } => {
                for v in victims {
                    if remove_key(t1, v) {
                        b1.push(v.clone());
                    } else if remove_key(t2, v) {
                        b2.push(v.clone());
                    }
                }
                for ghosts in [b1, b2] {
                    while ghosts.len() > *cap {
                        ghosts.remove(0);
                    }
                }
            }
            Recency::Reuse {
                entries,
                ghosts,
                current,
                recent,
                recent_current,
                cap,
                ..
            } => {
                // U6: a victim neither generation holds goes into the current one; when that
                // has 4 × cap keys, the other is emptied and becomes the current one.
                let limit = (24 * *cap).div_ceil(40);
                for v in victims {
                    // U9: every victim, repeats too.
                    match entries.get(v).map(|e| e.class) {
                        Some(c) if limit > 0 => {
                            recent[*recent_current].push((v.clone(), c));
                            if recent[*recent_current].len() == limit {
                                *recent_current = 1 - *recent_current;
                                recent[*recent_current].clear();
                            }
                        }
                        _ => {}
                    }
                    if entries.remove(v).is_some() && !ghosts.iter().any(|g| g.contains(v)) {
                        ghosts[*current].push(v.clone());
                        if ghosts[*current].len() == 4 * *cap {
                            *current = 1 - *current;
                            ghosts[*current].clear();
                        }
                    }
                }
            }
        }
    }

    fn view(&self) -> PolicyView {
        match self {
            Recency::Lru { ranks, .. } => {
                let mut order: Vec<(Rank, &Key)> = ranks.iter().map(|(k, r)| (*r, k)).collect();
                order.sort();
                let mut runs: Vec<(Rank, Vec<Key>)> = Vec::new();
                for (rank, key) in order {
                    match runs.last_mut() {
                        Some((r, keys)) if *r == rank => keys.push(key.clone()),
                        _ => runs.push((rank, vec![key.clone()])),
                    }
                }
                PolicyView::Lru {
                    order: runs.into_iter().map(|(_, keys)| keys).collect(),
                }
            }
            Recency::Arc {
                t1, t2, b1, b2, p, ..
            } => PolicyView::Arc {
                p: *p,
                t1: t1.clone(),
                t2: t2.clone(),
                b1: b1.clone(),
                b2: b2.clone(),
            },
            Recency::Reuse { .. } => PolicyView::Reuse {
                order: self.select(usize::MAX, |_| true),
            },
        }
    }
}

/// L1, L4: the request's `r`, given out fresh at its first use.
fn request_rank(record: &mut Record, last: &mut u64) -> u64 {
    *record.rank.get_or_insert_with(|| {
        *last += 1;
        *last
    })
}

/// The primary's policy state, for comparison with vLLM's.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyView {
    /// Ranked LRU: every held block grouped by rank, the next victims' group first; blocks of
    /// one rank (a request's blocks at the same position) in key order, which is also the
    /// order they are evicted in.
    Lru {
        /// The groups, by ascending rank.
        order: Vec<Vec<Key>>,
    },
    /// ARC: each list least recent first.
    Arc {
        /// The target size of T1.
        p: f64,
        /// Blocks not reused since they were stored.
        t1: Vec<Key>,
        /// Blocks reused.
        t2: Vec<Key>,
        /// Ghosts evicted from T1.
        b1: Vec<Key>,
        /// Ghosts evicted from T2.
        b2: Vec<Key>,
    },
    /// The reuse-aware LRU: every held block in eviction order.
    Reuse {
        /// The next victim first.
        order: Vec<Key>,
    },
}

/// One block held in the primary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockView {
    /// Its key.
    pub key: Key,
    /// Its slot.
    pub slot: SlotId,
    /// Ready (readable), rather than Pending or Promoting.
    pub ready: bool,
    /// Load pins plus cascade pins.
    pub pins: u32,
}

/// The primary's state, for comparison with vLLM's `CPUOffloadingManager`.
#[derive(Clone, Debug, PartialEq)]
pub struct PrimaryView {
    /// Slots handed out at least once (fresh slots go in increasing order).
    pub fresh_used: u32,
    /// The free stack, the next slot to reuse last.
    pub free: Vec<SlotId>,
    /// Every held block, in key order.
    pub blocks: Vec<BlockView>,
    /// The eviction policy.
    pub policy: PolicyView,
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
    /// A victim tier's look-ahead (V2); `None`: written by M6's cascade.
    victim: Option<usize>,
}

impl Tier {
    fn evict(&mut self, n: usize, protected: &[Key]) -> Vec<Key> {
        let victims = self.recency.select(n, |k| {
            self.entries.get(k) == Some(&Entry::Present(0)) && !protected.contains(k)
        });
        for v in &victims {
            self.entries.remove(v);
        }
        self.recency.evict(&victims);
        victims
    }

    fn insert(&mut self, key: &Key, e: Entry) {
        self.entries.insert(key.clone(), e);
        self.recency.insert(key, None);
        self.absent.retain(|(k, _)| k != key);
    }

    fn drop_entry(&mut self, key: &Key) {
        self.entries.remove(key);
        self.recency.remove(key);
    }

    /// T6, T15: `key` is absent for `absent_ttl` steps; the oldest answers go first.
    fn known_absent(&mut self, key: &Key, step: u64) {
        self.absent.retain(|(k, _)| k != key);
        self.absent.push((key.clone(), step + self.absent_ttl));
        while self.absent.len() > self.cap {
            self.absent.remove(0);
        }
    }
}

/// The promotions staged in one step for one tier: per request, in the order of its first
/// promotion from the tier, the blocks in lookup order (M4, M5).
#[derive(Clone, Debug)]
struct Batch {
    tier: TierId,
    requests: Vec<(RequestId, Vec<Transfer>)>,
}

/// The reference model of a [`kvtier_core::Manager`].
#[derive(Clone, Debug)]
pub struct RefModel {
    config: Config,
    blocks: BTreeMap<Key, Block>,
    next_fresh: u32,
    free: Vec<u32>,
    recency: Recency,
    /// The live requests' records (R1), in creation order.
    records: Vec<(RequestId, Record)>,
    /// Reuse filter (P17): tracked keys with their offer counts, least recent first.
    tracker: Vec<(Key, u32)>,
    stores_skipped: u64,
    tiers: Vec<Tier>,
    jobs: BTreeMap<JobId, (Job, bool)>,
    next_job: u64,
    inbox: Vec<JobResult>,
    effects: Vec<Effect>,
    events: Vec<Event>,
    step: u64,
    collected: bool,
    /// This step's hits per request (★8).
    hits: Vec<(RequestId, Vec<Key>)>,
    /// This step's promotions, tiers in the order of their first staged promotion (M5).
    batches: Vec<Batch>,
    cooldown: BTreeMap<(TierId, Key), u64>,
    closed: bool,
    /// W1: the clock.
    clock: u64,
    /// ★9: (request, key, since): a request answered HitPending or Retry for the key since
    /// that time, or (`None`) one that gave the key up.
    waiting: Vec<(RequestId, Key, Option<u64>)>,
    wait_timeouts: u64,
    /// V2: blocks the primary evicted since the last write-ahead.
    evicted_since: usize,
    /// V2: the most the primary evicted between two write-aheads, a sixteenth less at each.
    eviction_peak: usize,
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
                recency: Recency::new(t.policy, t.capacity_blocks as usize, config.return_horizon),
                probing: BTreeMap::new(),
                absent: Vec::new(),
                health: Health::Up,
                failures: 0,
                stores: 0,
                victim: match t.admission {
                    Admission::Cascade => None,
                    Admission::Victim { lookahead } => Some(lookahead as usize),
                },
            })
            .collect();
        RefModel {
            recency: Recency::new(
                config.policy,
                config.num_blocks as usize,
                config.return_horizon,
            ),
            blocks: BTreeMap::new(),
            next_fresh: 0,
            free: Vec::new(),
            records: Vec::new(),
            tracker: Vec::new(),
            stores_skipped: 0,
            tiers,
            jobs: BTreeMap::new(),
            next_job: 1,
            inbox: Vec::new(),
            effects: Vec::new(),
            events: Vec::new(),
            step: 0,
            collected: false,
            hits: Vec::new(),
            batches: Vec::new(),
            cooldown: BTreeMap::new(),
            closed: false,
            evicted_since: 0,
            eviction_peak: 0,
            clock: 0,
            waiting: Vec::new(),
            wait_timeouts: 0,
            config,
        }
    }

    /// W1: the clock moves forward only.
    pub fn set_clock(&mut self, now: u64) {
        if now > self.clock {
            self.clock = now;
        }
    }

    /// Lookups that gave up waiting (W3).
    pub fn wait_timeouts(&self) -> u64 {
        self.wait_timeouts
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

    /// Offered keys the reuse filter left out of stores so far (P17).
    pub fn stores_skipped(&self) -> u64 {
        self.stores_skipped
    }

    /// The primary's slots, blocks and policy state.
    pub fn primary_view(&self) -> PrimaryView {
        PrimaryView {
            fresh_used: self.next_fresh,
            free: self.free.iter().map(|&s| SlotId(s)).collect(),
            blocks: self
                .blocks
                .iter()
                .map(|(k, b)| BlockView {
                    key: k.clone(),
                    slot: SlotId(b.slot),
                    ready: b.state == State::Ready,
                    pins: b.load_pins + b.job_pins,
                })
                .collect(),
            policy: self.recency.view(),
        }
    }

    fn emit(&mut self, medium: Medium, kind: EventKind, keys: Vec<Key>) {
        if self.config.events && !keys.is_empty() {
            self.events.push(Event { medium, kind, keys });
        }
    }

    /// R1: `req`'s record, created if it has none.
    fn record(&mut self, req: RequestId) -> &mut Record {
        if let Some(i) = self.records.iter().position(|(r, _)| *r == req) {
            return &mut self.records[i].1;
        }
        self.records.push((req, Record::default()));
        &mut self.records.last_mut().expect("pushed").1
    }

    // ----- requests ------------------------------------------------------------------

    /// R1.
    pub fn new_request(&mut self, req: RequestId) {
        self.record(req);
    }

    /// R2.
    pub fn set_position(&mut self, req: RequestId, key: &Key, end_token: u64) {
        self.record(req).positions.insert(key.clone(), end_token);
    }

    /// R6, R7: the request's keys go to the policy and its record is dropped; R8: what it
    /// read reaches every tier; W6: its waits are forgotten.
    pub fn request_finished(&mut self, req: RequestId) {
        self.waiting.retain(|(r, _, _)| *r != req);
        if let Some(i) = self.records.iter().position(|(r, _)| *r == req) {
            let (_, record) = self.records.remove(i);
            self.recency.finish(&record);
            // R8: the keys it read, head to tail, reach every tier as a touch (T12).
            let read: Vec<Key> = record
                .head_to_tail()
                .into_iter()
                .filter(|k| record.reused.contains(k) || record.promoted.contains(k))
                .collect();
            for tier in &mut self.tiers {
                let entries = &tier.entries;
                tier.recency.touch(&read, |k| {
                    entries.get(k).map(|e| matches!(e, Entry::Present(_)))
                });
            }
        }
    }

    /// R3, R4: `keys` accessed by `req` (the newly seen ones go to the policy as one
    /// access); `reused` are the keys it read.
    fn access(&mut self, req: RequestId, keys: &[Key], reused: &[Key]) {
        let i = match self.records.iter().position(|(r, _)| *r == req) {
            Some(i) => i,
            None => {
                self.records.push((req, Record::default()));
                self.records.len() - 1
            }
        };
        let record = &mut self.records[i].1;
        let mut new_keys: Vec<Key> = Vec::new();
        for k in keys {
            if !record.seen.contains(k) {
                record.seen.push(k.clone());
                new_keys.push(k.clone());
            }
        }
        if !new_keys.is_empty() {
            self.recency.access(&new_keys, record);
        }
        for k in reused {
            if !record.inserted.contains(k) && !record.reused.contains(k) {
                record.reused.push(k.clone());
            }
        }
    }

    // ----- primary -------------------------------------------------------------------

    fn free_slots(&self) -> usize {
        (self.config.num_blocks - self.next_fresh) as usize + self.free.len()
    }

    /// P4–P7 and M4: `req` stores the offered keys `offer`, of which `to_store` are absent
    /// and to be stored and `ready` are Ready. Store misses (R5) and the access (R3) happen
    /// first; then room is made without evicting `protected`, and `to_store` is inserted
    /// in `state`. The allocation is all or nothing.
    fn admit(
        &mut self,
        req: RequestId,
        offer: &[Key],
        to_store: &[Key],
        ready: &[Key],
        protected: &[Key],
        state: State,
    ) -> Result<(Vec<SlotId>, Vec<Key>), Error> {
        let record = self.record(req);
        let misses: Vec<Key> = to_store
            .iter()
            .filter(|k| !record.missed.contains(k))
            .cloned()
            .collect();
        record.missed.extend(misses.iter().cloned());
        self.recency.store_miss(&misses);
        let accessed: Vec<Key> = offer
            .iter()
            .filter(|k| to_store.contains(k) || ready.contains(k))
            .cloned()
            .collect();
        self.access(req, &accessed, ready);
        if to_store.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let needed = to_store.len().saturating_sub(self.free_slots());
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
        }
        self.recency.evict(&victims);
        self.evicted_since += victims.len();
        // V3: each victim tier makes the victims it holds its most recent, the last one most
        // recent of all (a touch walks last to first, so they go in reversed).
        for tier in self.tiers.iter_mut().filter(|t| t.victim.is_some()) {
            let held: Vec<Key> = victims
                .iter()
                .rev()
                .filter(|k| tier.entries.contains_key(*k))
                .cloned()
                .collect();
            let entries = &tier.entries;
            tier.recency.touch(&held, |k| {
                entries.get(k).map(|e| matches!(e, Entry::Present(_)))
            });
        }
        self.emit(Medium::Primary, EventKind::Removed, victims.clone());
        let mut slots = Vec::new();
        for k in to_store {
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
            slots.push(SlotId(slot));
        }
        let i = self
            .records
            .iter()
            .position(|(r, _)| *r == req)
            .expect("recorded above");
        let record = &mut self.records[i].1;
        for k in to_store {
            self.recency.insert(k, Some(&mut *record));
        }
        record.inserted.extend(to_store.iter().cloned());
        if state == State::Promoting {
            record.promoted.extend(to_store.iter().cloned());
        }
        Ok((slots, victims))
    }

    fn release(&mut self, key: &Key) {
        let b = self.blocks.remove(key).expect("released block is held");
        self.free.push(b.slot);
        self.recency.remove(key);
    }

    // ----- the calls -------------------------------------------------------------------

    /// M1: apply every result received so far.
    fn collect(&mut self) {
        self.collected = true;
        let mut failed_in = BTreeMap::new();
        for r in std::mem::take(&mut self.inbox) {
            if let Some((t, failed)) = self.apply(r, false) {
                *failed_in.entry(t).or_insert(false) |= failed;
            }
        }
        self.health_after(failed_in);
    }

    /// H1, H2: each tier's verdict over one collection counts once.
    fn health_after(&mut self, failed_in: BTreeMap<usize, bool>) {
        for (t, failed) in failed_in {
            let tier = &mut self.tiers[t];
            if tier.health != Health::Up {
                continue;
            }
            if !failed {
                tier.failures = 0;
                continue;
            }
            tier.failures += 1;
            if tier.failures >= self.config.health.failures_to_down {
                tier.health = Health::Down(self.step);
            }
        }
    }

    /// M2–M4, with W2–W5 around them when a deadline is set.
    pub fn lookup(&mut self, req: RequestId, key: &Key) -> Lookup {
        if !self.collected {
            self.collect();
        }
        let Some(deadline) = self.config.wait_deadline else {
            return self.answer(req, key); // W7
        };
        let found = self
            .waiting
            .iter()
            .position(|(r, k, _)| *r == req && k == key);
        if let Some(i) = found {
            let ready = self
                .blocks
                .get(key)
                .is_some_and(|b| b.state == State::Ready);
            match self.waiting[i].2 {
                None => return Lookup::Miss, // W4
                Some(since) if !ready && self.clock - since > deadline => {
                    self.waiting[i].2 = None; // W3
                    self.wait_timeouts += 1;
                    return Lookup::Miss;
                }
                Some(_) => {}
            }
        }
        let answer = self.answer(req, key);
        match (answer, found) {
            (Lookup::HitPending | Lookup::Retry, None) => {
                self.waiting.push((req, key.clone(), Some(self.clock))); // W2
            }
            (Lookup::HitPending | Lookup::Retry, Some(_)) => {}
            (_, Some(i)) => {
                self.waiting.remove(i); // W5
            }
            (_, None) => {}
        }
        answer
    }

    /// M2–M4: the answer without the deadline.
    fn answer(&mut self, req: RequestId, key: &Key) -> Lookup {
        if let Some(b) = self.blocks.get(key) {
            if b.state == State::Ready {
                match self.hits.iter_mut().find(|(r, _)| *r == req) {
                    Some((_, hits)) => hits.push(key.clone()),
                    None => self.hits.push((req, vec![key.clone()])),
                }
                return Lookup::Hit;
            }
            return Lookup::HitPending;
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

    /// M4: a promotion is admitted as `req`'s store of `key` would be (without the reuse
    /// filter), protecting `req`'s hits of this step.
    fn promote(&mut self, req: RequestId, tier: TierId, key: &Key) -> Lookup {
        let mut protected: Vec<Key> = self
            .hits
            .iter()
            .filter(|(r, _)| *r == req)
            .flat_map(|(_, hits)| hits.iter().cloned())
            .collect();
        protected.push(key.clone());
        let one = std::slice::from_ref(key);
        let Ok((slots, _)) = self.admit(req, one, one, &[], &protected, State::Promoting) else {
            return Lookup::Miss;
        };
        if let Some(Entry::Present(r)) = self.tiers[tier.0 as usize].entries.get_mut(key) {
            *r += 1;
        }
        let transfer = Transfer {
            key: key.clone(),
            slot: slots[0],
        };
        let batch = match self.batches.iter().position(|b| b.tier == tier) {
            Some(i) => &mut self.batches[i],
            None => {
                self.batches.push(Batch {
                    tier,
                    requests: Vec::new(),
                });
                self.batches.last_mut().expect("pushed")
            }
        };
        match batch.requests.iter_mut().find(|(r, _)| *r == req) {
            Some((_, blocks)) => blocks.push(transfer),
            None => batch.requests.push((req, vec![transfer])),
        }
        Lookup::HitPending
    }

    /// P17: counts an offer; an untracked key is tracked when there is room or a tracked
    /// key not in this offer can be forgotten (the least recent).
    fn count_offer(&mut self, offer: &[Key], max: usize) {
        for k in offer {
            if let Some(i) = self.tracker.iter().position(|(t, _)| t == k) {
                let (key, count) = self.tracker.remove(i);
                self.tracker.push((key, count + 1));
            }
        }
        for k in offer {
            if self.tracker.iter().any(|(t, _)| t == k) {
                continue;
            }
            if self.tracker.len() >= max {
                match self.tracker.iter().position(|(t, _)| !offer.contains(t)) {
                    Some(i) => {
                        self.tracker.remove(i);
                    }
                    None => continue,
                }
            }
            self.tracker.push((k.clone(), 1));
        }
    }

    /// P4–P7, P17, R3–R5.
    pub fn prepare_store(&mut self, req: RequestId, keys: &[Key]) -> Result<PreparedStore, Error> {
        self.collect();
        let mut offer: Vec<Key> = Vec::new();
        for k in keys {
            if !offer.contains(k) {
                offer.push(k.clone());
            }
        }
        if let Some(reuse) = self.config.reuse {
            // vLLM counts every occurrence of an offered key, repeated ones too.
            self.count_offer(keys, reuse.max_tracker_size as usize);
        }
        let mut to_store: Vec<Key> = Vec::new();
        let mut ready: Vec<Key> = Vec::new();
        for k in &offer {
            match self.blocks.get(k) {
                None => to_store.push(k.clone()),
                Some(b) if b.state == State::Ready => ready.push(k.clone()),
                Some(_) => {}
            }
        }
        if let Some(reuse) = self.config.reuse {
            let count = |k: &Key| {
                self.tracker
                    .iter()
                    .find(|(t, _)| t == k)
                    .map_or(0, |(_, c)| *c)
            };
            // Skipped: every offered occurrence of an absent key below the threshold.
            let skipped = keys
                .iter()
                .filter(|k| !self.blocks.contains_key(k) && count(k) < reuse.store_threshold)
                .count();
            to_store.retain(|k| count(k) >= reuse.store_threshold);
            self.stores_skipped += skipped as u64;
        }
        let (slots, evicted) =
            self.admit(req, &offer, &to_store, &ready, &offer, State::Pending)?;
        Ok(PreparedStore {
            keys: to_store,
            slots,
            evicted,
        })
    }

    /// P8–P10 and M6–M7.
    pub fn complete_store(&mut self, req: RequestId, keys: &[Key], ok: bool) {
        let mut ready = Vec::new();
        let mut discarded = Vec::new();
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
                        discarded.push(k.clone());
                    }
                }
                _ => {}
            }
        }
        // A failed store is vLLM's metadata-only removal.
        self.emit(Medium::Primary, EventKind::Discarded, discarded);
        self.emit(
            Medium::Primary,
            EventKind::Stored,
            ready.iter().map(|t| t.key.clone()).collect(),
        );
        if ready.is_empty() || self.closed {
            return;
        }
        // V1: a victim tier is written by V2 alone.
        for t in 0..self.tiers.len() {
            if self.tiers[t].victim.is_none() {
                self.cascade(t, req, &ready);
            }
        }
    }

    /// M6 (and V2) for tier `t`: Down or at its bound → skipped; else room is made by
    /// evicting idle blocks not being cascaded, the absent blocks that fit are written in one
    /// job, each pinned.
    fn cascade(&mut self, t: usize, req: RequestId, ready: &[Transfer]) {
        let id = TierId(t as u16);
        let tier = &mut self.tiers[t];
        if tier.health != Health::Up || tier.stores >= tier.max_stores {
            return;
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
        let tier_kind = tier.kind;
        let room = tier.cap - tier.entries.len();
        let evicted = tier.evict(to_write.len().saturating_sub(room), &held);
        let room = tier.cap - tier.entries.len();
        let writes: Vec<Transfer> = to_write.into_iter().take(room).cloned().collect();
        for w in &writes {
            tier.insert(&w.key, Entry::Writing);
        }
        self.emit(Medium::Tier(id), EventKind::Removed, evicted.clone());
        // T14: only a tier this node alone writes deletes what it evicts.
        if !evicted.is_empty() && tier_kind == TierKind::Authoritative {
            self.effects.push(Effect::Delete {
                tier: id,
                keys: evicted,
            });
        }
        if writes.is_empty() {
            return;
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

    /// P11–P12, R3–R4. Does not collect (M1).
    pub fn prepare_load(&mut self, req: RequestId, keys: &[Key]) -> Result<Vec<SlotId>, Error> {
        for k in keys {
            if self.blocks.get(k).is_none_or(|b| b.state != State::Ready) {
                return Err(Error::NotReady { key: k.clone() });
            }
        }
        let slots = keys
            .iter()
            .map(|k| {
                let b = self.blocks.get_mut(k).expect("checked");
                b.load_pins += 1;
                SlotId(b.slot)
            })
            .collect();
        self.access(req, keys, keys);
        Ok(slots)
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
        let blocks = &self.blocks;
        self.recency
            .touch(keys, |k| blocks.get(k).map(|b| b.state == State::Ready));
        for tier in &mut self.tiers {
            let entries = &tier.entries;
            tier.recency.touch(keys, |k| {
                entries.get(k).map(|e| matches!(e, Entry::Present(_)))
            });
        }
    }

    /// M5.
    pub fn end_step(&mut self) {
        if !self.collected {
            self.collect();
        }
        for batch in std::mem::take(&mut self.batches) {
            for (req, blocks) in batch.requests {
                self.submit(
                    batch.tier,
                    JobKind::Load {
                        request: req,
                        blocks: blocks.into(),
                    },
                );
            }
        }
        // V2: each victim tier is written the primary's next victims it does not hold: as
        // many as twice the peak of a step's evictions, beyond the blocks it is writing.
        if !self.closed {
            let evicted = std::mem::take(&mut self.evicted_since);
            self.eviction_peak = evicted.max(self.eviction_peak - self.eviction_peak.div_ceil(16));
        }
        for t in 0..self.tiers.len() {
            let Some(lookahead) = self.tiers[t].victim else {
                continue;
            };
            if self.closed {
                break;
            }
            let writing: usize = (self.jobs.values())
                .filter(|(job, _)| job.tier == TierId(t as u16))
                .map(|(job, _)| match &job.kind {
                    JobKind::Store { blocks, .. } => blocks.len(),
                    _ => 0,
                })
                .sum();
            let ahead = lookahead.max(2 * self.eviction_peak + writing);
            // Blocks being written fill places in the look-ahead; `writing` extends it by as
            // many.
            let next: Vec<Transfer> = self
                .recency
                .select(ahead, |k| {
                    let b = &self.blocks[k];
                    b.state == State::Ready && b.load_pins == 0
                })
                .into_iter()
                .map(|k| Transfer {
                    slot: SlotId(self.blocks[&k].slot),
                    key: k,
                })
                .collect();
            // The held ones too: the cascade must not evict them to make room.
            self.cascade(t, RequestId::WRITE_AHEAD, &next);
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
        self.hits.clear();
        self.step += 1;
        let step = self.step;
        self.cooldown.retain(|_, until| *until > step);
        for tier in &mut self.tiers {
            tier.absent.retain(|(_, until)| *until > step);
        }
        self.collected = false;
    }

    /// The events since the last call; a `Discarded` event keeps the keys still absent, and
    /// none is given empty.
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut events = std::mem::take(&mut self.events);
        events.retain_mut(|e| {
            if e.kind == EventKind::Discarded {
                e.keys.retain(|k| !self.blocks.contains_key(k));
            }
            !e.keys.is_empty()
        });
        // vLLM's tiering manager yields the primary's events, then tier 0's, tier 1's, ...
        let mut ordered: Vec<Event> = events
            .iter()
            .filter(|e| e.medium == Medium::Primary)
            .cloned()
            .collect();
        for t in 0..self.tiers.len() {
            let tier = Medium::Tier(TierId(t as u16));
            ordered.extend(events.iter().filter(|e| e.medium == tier).cloned());
        }
        ordered
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
        let shared_load = matches!(j.kind, JobKind::Load { .. })
            && self.tiers[j.tier.0 as usize].kind == TierKind::Shared;
        match (&result.outcome, blocks, &j.kind) {
            (Outcome::Partial { succeeded, missing }, Some(blocks), _) => {
                for k in succeeded.iter().chain(missing) {
                    if !blocks.iter().any(|b| &b.key == k) {
                        return Err(Error::ForeignKey {
                            job,
                            key: k.clone(),
                        });
                    }
                }
                if !missing.is_empty() && !shared_load {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "missing blocks apply to loads from a shared tier only",
                    });
                }
                if succeeded.iter().any(|k| missing.contains(k)) {
                    return Err(Error::InvalidOutcome {
                        job,
                        reason: "a block is both read and missing",
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
            (Outcome::NotFound, _, _) if shared_load => {}
            (Outcome::NotFound, _, _) => {
                return Err(Error::InvalidOutcome {
                    job,
                    reason: "not found applies to existence probes and loads from a shared tier only",
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
        self.waiting.clear(); // W6
        let mut failed_in = BTreeMap::new();
        for mut r in std::mem::take(&mut self.inbox) {
            // A closing tier caches no probe answer.
            if matches!(self.jobs[&r.job].0.kind, JobKind::Exists { .. }) {
                r.outcome = Outcome::Failed;
                self.apply(r, true);
            } else if let Some((t, failed)) = self.apply(r, false) {
                *failed_in.entry(t).or_insert(false) |= failed;
            }
        }
        self.health_after(failed_in);
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
        for batch in std::mem::take(&mut self.batches) {
            for (_, blocks) in batch.requests {
                let keys = blocks.iter().map(|b| b.key.clone()).collect();
                self.emit(Medium::Primary, EventKind::Discarded, keys);
                for b in &blocks {
                    self.release(&b.key);
                    if let Some(Entry::Present(r)) =
                        self.tiers[batch.tier.0 as usize].entries.get_mut(&b.key)
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

    /// J1–J6; the job's tier and whether it failed, for the collection's health verdict.
    fn apply(&mut self, result: JobResult, cancelled: bool) -> Option<(usize, bool)> {
        let (job, _) = self.jobs.remove(&result.job).expect("checked job");
        let ok = |k: &Key| match &result.outcome {
            Outcome::Ok => true,
            Outcome::Partial { succeeded, .. } => succeeded.contains(k),
            _ => false,
        };
        // Loads from a shared tier only (validated): the store let these blocks go.
        let gone = |k: &Key| match &result.outcome {
            Outcome::NotFound => true,
            Outcome::Partial { missing, .. } => missing.contains(k),
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
                let mut discarded = Vec::new();
                let mut deletes = Vec::new();
                for b in blocks.iter() {
                    if ok(&b.key) {
                        self.blocks.get_mut(&b.key).expect("promoting").state = State::Ready;
                        stored.push(b.key.clone());
                    } else {
                        self.release(&b.key);
                        discarded.push(b.key.clone());
                    }
                }
                // vLLM completes a promotion's good blocks as one store, then the rest as a
                // failed one.
                self.emit(Medium::Primary, EventKind::Stored, stored);
                self.emit(Medium::Primary, EventKind::Discarded, discarded);
                for b in blocks.iter() {
                    let good = ok(&b.key);
                    let tier = &mut self.tiers[t];
                    let Some(Entry::Present(r)) = tier.entries.get_mut(&b.key) else {
                        unreachable!("a read block is present");
                    };
                    *r -= 1;
                    let last = *r == 0;
                    if !cancelled && gone(&b.key) {
                        // Forgotten and known absent, like a probe's "not found"; the tier
                        // answered, so this is no failure and starts no cooldown.
                        if last {
                            tier.drop_entry(&b.key);
                            tier.known_absent(&b.key, self.step);
                        }
                        continue;
                    }
                    if !good && !cancelled && last {
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
                            // Probes ask shared tiers only, and a shared tier forgets what
                            // it evicts: no deletion (T14).
                            self.emit(Medium::Tier(tid), EventKind::Removed, evicted);
                        }
                        Outcome::NotFound => tier.known_absent(key, self.step),
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
                return None;
            }
        }
        (!cancelled).then_some((t, failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(name: &str) -> Key {
        Key::new(name.as_bytes())
    }

    /// One request that stores `names` (all absent) and finishes.
    fn store(m: &mut RefModel, req: u64, names: &[&str]) -> PreparedStore {
        let keys: Vec<Key> = names.iter().map(|n| k(n)).collect();
        let r = RequestId(req);
        m.new_request(r);
        let prepared = m.prepare_store(r, &keys).expect("room");
        m.complete_store(r, &prepared.keys, true);
        m.request_finished(r);
        prepared
    }

    fn arc(view: PrimaryView) -> (f64, Vec<Key>, Vec<Key>) {
        match view.policy {
            PolicyView::Arc { p, t1, t2, .. } => (p, t1, t2),
            other => panic!("not ARC: {other:?}"),
        }
    }

    // Rule A6: a store that fits after evicting every unpinned, eligible block succeeds,
    // also when T1 is below its target and T2 holds fewer eligible blocks than the shortfall.
    #[test]
    fn arc_eviction_falls_back_to_t1_when_t2_runs_out() {
        let mut c = Config::new(3);
        c.policy = PolicyKind::Arc;
        let mut m = RefModel::new(c);
        for (req, name) in [(1, "a"), (2, "b"), (3, "c")] {
            store(&mut m, req, &[name]);
        }
        // Each store evicts T1's oldest block; storing the evicted key again is a B1 ghost
        // hit that raises p by 1, until p reaches the capacity.
        assert_eq!(store(&mut m, 4, &["d"]).evicted, vec![k("a")]);
        assert_eq!(store(&mut m, 5, &["a"]).evicted, vec![k("b")]);
        assert_eq!(store(&mut m, 6, &["b"]).evicted, vec![k("c")]);
        assert_eq!(store(&mut m, 7, &["c"]).evicted, vec![k("d")]);
        // A request that reads `a` moves it to T2 when it finishes.
        let r = RequestId(8);
        m.new_request(r);
        m.prepare_load(r, &[k("a")]).expect("ready");
        m.complete_load(&[k("a")]).expect("pinned");
        m.request_finished(r);
        let (p, t1, t2) = arc(m.primary_view());
        assert_eq!(p, 3.0);
        assert_eq!((t1, t2), (vec![k("b"), k("c")], vec![k("a")]));
        // Two blocks to free, |T1| = 2 < p: T2 gives `a`, then T2 has nothing left and T1
        // gives `b`.
        let r = RequestId(9);
        m.new_request(r);
        let prepared = m
            .prepare_store(r, &[k("x"), k("y")])
            .expect("two blocks can be freed");
        assert_eq!(prepared.evicted, vec![k("a"), k("b")]);
        assert_eq!(prepared.keys, vec![k("x"), k("y")]);
    }
}
