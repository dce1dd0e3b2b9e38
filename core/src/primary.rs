//! The primary tier: CPU slots, block states, eviction and events (rules P1–P17).
//!
//! This is vLLM's CPU offloading manager, exactly: the same answers, slot ids, victims and
//! events. The [`Manager`](crate::Manager) adds promotion (the Promoting state) and cascade pins.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::string::String;
use alloc::vec::Vec;

use crate::config::{PolicyKind, ReturnHorizon, ReuseFilter};
use crate::error::{Error, Violation, ensure};
use crate::event::{Event, EventKind, Lookup, Medium, Transfer};
use crate::key::{Key, RequestId, SlotId, push_clone};
use crate::policy::{EvictionPolicy, Policy, Run, Use};
use crate::table::{IdTable, hash};

/// The state of a block in the primary tier, as seen from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// A store by the engine is in flight.
    Pending,
    /// A load from a secondary tier into the slot is batched or in flight.
    Promoting,
    /// Readable.
    Ready {
        /// Pins taken by `prepare_load`.
        load_pins: u32,
        /// Pins taken by outstanding cascade store jobs (one per tier and job).
        job_pins: u16,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    Free,
    Pending,
    Promoting,
    Ready,
}

/// One cache line: the key (inline up to 46 bytes), the state and the pins. (Twice the 32
/// bytes the fields would need with a shared key; the key's own allocation is gone.)
#[derive(Clone, Debug)]
#[repr(align(64))]
struct Slot {
    key: Option<Key>,
    state: SlotState,
    job_pins: u16,
    load_pins: u32,
}

const _: () = assert!(core::mem::size_of::<Slot>() == 64);

const FREE_SLOT: Slot = Slot {
    key: None,
    state: SlotState::Free,
    job_pins: 0,
    load_pins: 0,
};

/// One key a request has touched in some way (rules R2–R5).
#[derive(Clone, Debug)]
struct AccessKey {
    key: Key,
    position: Option<u64>,
    flags: u8,
    /// The slot the key was last seen in by this request (checked before use: the block may
    /// have left since).
    slot: u32,
}

const NO_SLOT: u32 = u32::MAX;

const SEEN: u8 = 1;
const INSERTED: u8 = 2;
const REUSED: u8 = 4;
const MISSED: u8 = 8;
/// Inserted by a promotion (the request's lookup found the block in a secondary tier).
const PROMOTED: u8 = 32;
/// Set while a call collects its keys to store, to take each once.
const QUEUED: u8 = 16;

/// The keys one store (or promotion) will allocate, with their entries in the request's
/// record, and the slots it must not evict.
#[derive(Clone, Debug, Default)]
struct Offer {
    keys: Vec<Key>,
    entries: Vec<u32>,
    protected: Vec<u32>,
}

/// Where a store's keys come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Offered {
    /// The engine's `prepare_store`: filtered (P17), each key looked up.
    Store,
    /// A promotion (M4) of one key the caller found absent: no filter, no lookup.
    Promotion,
}

/// What one live request accessed (rules R1–R7), until it finishes.
#[derive(Clone, Debug, Default)]
struct Access {
    /// The request's run in a ranked policy, from its first access.
    run: Option<Run>,
    keys: Vec<AccessKey>,
    index: IdTable,
    /// Indexes into `keys`, in first-seen order.
    seen: Vec<u32>,
    /// The entry after the last one found or made: calls usually name a request's keys in
    /// the order they were first entered, so this is tried before the index.
    cursor: u32,
}

impl Access {
    fn entry(&mut self, key: &Key) -> &mut AccessKey {
        let i = self.entry_index(key);
        &mut self.keys[i as usize]
    }

    fn entry_index(&mut self, key: &Key) -> u32 {
        let next = self.cursor as usize;
        if self.keys.get(next).is_some_and(|e| &e.key == key) {
            self.cursor += 1;
            return next as u32;
        }
        let i = self.find_or_insert(key);
        self.cursor = i + 1;
        i
    }

    fn find_or_insert(&mut self, key: &Key) -> u32 {
        let keys = &self.keys;
        let next = keys.len() as u32;
        let (i, added) = self.index.find_or_insert(
            hash(key),
            |j| &keys[j as usize].key == key,
            |j| hash(&keys[j as usize].key),
            || next,
        );
        if added {
            // In place (see `push_clone`).
            self.keys.resize_with(i as usize + 1, || AccessKey {
                key: key.clone(),
                position: None,
                flags: 0,
                slot: NO_SLOT,
            });
        }
        i
    }

    /// M13: keeps only the keys' positions: no rank, nothing seen, stored or reused.
    fn forget_all_but_positions(&mut self) {
        self.run = None;
        self.cursor = 0;
        self.seen.clear();
        self.keys.retain(|k| k.position.is_some());
        self.index.clear();
        for k in &mut self.keys {
            k.flags = 0;
            k.slot = NO_SLOT;
        }
        let keys = &self.keys;
        for (i, k) in keys.iter().enumerate() {
            self.index
                .insert(hash(&k.key), i as u32, |j| hash(&keys[j as usize].key));
        }
    }

    /// Empties the record, keeping its allocations.
    fn clear(&mut self) {
        self.run = None;
        self.cursor = 0;
        self.keys.clear();
        self.index.clear();
        self.seen.clear();
    }

    /// R6: the seen keys, head to tail, into `out` (emptied first).
    fn order_into(&self, out: &mut Vec<u32>) {
        let group = |i: u32| {
            let k = self.keys[i as usize].key.as_bytes();
            match k.len().checked_sub(4) {
                Some(at) => u32::from_be_bytes(k[at..].try_into().expect("4 bytes")),
                None => 0,
            }
        };
        let pos = |i: u32| self.keys[i as usize].position;
        out.clear();
        out.extend_from_slice(&self.seen);
        if out.iter().all(|&i| pos(i).is_some()) {
            // Every key has a position: by position, ties by group, then first seen (what the
            // group-wise sorts below followed by a stable sort by position give).
            // Usually already so: a request sees its blocks head first.
            if !out.is_sorted_by_key(|&i| (pos(i), group(i))) {
                out.sort_by_key(|&i| (pos(i), group(i)));
            }
            return;
        }
        // Groups ascending, first-seen order within a group (the sort is stable), and a group
        // by position when each of its keys has one.
        out.sort_by_key(|&i| group(i));
        let mut start = 0;
        while start < out.len() {
            let g = group(out[start]);
            let end = start + out[start..].iter().take_while(|&&i| group(i) == g).count();
            if out[start..end].iter().all(|&i| pos(i).is_some()) {
                out[start..end].sort_by_key(|&i| pos(i));
            }
            start = end;
        }
    }
}

/// What `prepare_store` decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreparedStore {
    /// The keys to store (absent before the call), in input order; now Pending.
    pub keys: Vec<Key>,
    /// Their slot ids, in the same order.
    pub slots: Vec<SlotId>,
    /// The keys evicted to make room.
    pub evicted: Vec<Key>,
}

/// The primary tier.
#[derive(Clone, Debug)]
pub struct Primary {
    slots: Vec<Slot>,
    index: IdTable,
    next_fresh: u32,
    free: Vec<u32>,
    policy: Policy,
    events: Vec<Event>,
    record_events: bool,
    reuse: Option<ReuseTracker>,
    requests: BTreeMap<RequestId, Access>,
    /// Records of finished requests, emptied, kept for their allocations.
    spare: Vec<Access>,
    /// Reused by `request_finished`.
    order_scratch: Vec<u32>,
    /// Reused by every store and promotion (emptied after each).
    offer: Offer,
    /// Reused by `admit` and `next_victims`.
    victims: Vec<u32>,
    /// Reused by `promote`: the slot of one promotion.
    promoted: Vec<SlotId>,
    stores_skipped: u64,
    /// Entries the policies replaced by `reset` evicted past the return horizon (U10).
    evicted_past_horizon_before: u64,
    /// Ready blocks with no pin (vLLM's evictable chunks).
    evictable: u32,
    /// Pending or Promoting blocks (vLLM's write-pending chunks).
    writing: u32,
    /// Metrics since the last `take_metrics`.
    window: Window,
    /// How a reuse-aware LRU learns its return horizon (kept for `reset`).
    horizon: Option<ReturnHorizon>,
}

/// Live requests the primary's LRU has room for without growing (more still fit).
const RESERVED_RUNS: usize = 256;

/// Emptied request records kept for reuse.
const MAX_SPARE_RECORDS: usize = 64;

/// Most allocation sizes kept between two `take_metrics` calls; later ones are counted only.
const MAX_ALLOCATION_SIZES: usize = 1 << 16;

/// What accumulates between two `take_metrics` calls.
#[derive(Clone, Debug, Default)]
struct Window {
    allocation_sizes: Vec<u32>,
    allocations_dropped: u64,
    stores_skipped: u64,
}

/// vLLM 0.33's `get_stats` of the primary tier: gauges at the time of the call, and what
/// accumulated since the previous call (see [`Primary::take_metrics`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Slots in the primary.
    pub num_blocks: u32,
    /// Occupied blocks that cannot be evicted now: in flight (Pending, Promoting) or pinned.
    pub used_blocks: u32,
    /// Blocks being written: a store (Pending) or a promotion (Promoting, staged or
    /// submitted).
    pub writing_blocks: u32,
    /// The number of blocks each `prepare_store` (and each promotion) set out to allocate,
    /// refused or not, in call order (vLLM's allocation-size histogram).
    pub allocation_sizes: Vec<u32>,
    /// Allocation sizes not kept because more than 65,536 came between two calls.
    pub allocation_sizes_dropped: u64,
    /// Offered keys the reuse filter left out; `None` without a reuse filter.
    pub stores_skipped: Option<u64>,
}

impl Metrics {
    /// vLLM's `kv_offload_cpu_cache_usage_perc`: used blocks over all blocks (0 to 1).
    pub fn usage(&self) -> f64 {
        f64::from(self.used_blocks) / f64::from(self.num_blocks.max(1))
    }

    /// vLLM's `kv_offload_cpu_cache_write_usage_perc`: blocks being written over all blocks.
    pub fn write_usage(&self) -> f64 {
        f64::from(self.writing_blocks) / f64::from(self.num_blocks.max(1))
    }

    /// vLLM's `kv_offload_cpu_cache_read_usage_perc`: usage minus write usage, at least 0.
    pub fn read_usage(&self) -> f64 {
        (self.usage() - self.write_usage()).max(0.0)
    }
}

impl Primary {
    /// A primary tier of `num_blocks` slots (at least 1, below `u32::MAX`).
    pub fn new(num_blocks: u32, policy: PolicyKind, reuse: Option<ReuseFilter>) -> Self {
        Self::with_horizon(num_blocks, policy, reuse, Some(ReturnHorizon::default()))
    }

    /// As [`Primary::new`], a reuse-aware LRU learning its return horizon (U10) as `horizon`
    /// says (`None`: never; see [`ReusePolicy::with_horizon`](crate::policy::ReusePolicy::with_horizon)
    /// for values [`Config::validate`](crate::Config::validate) refuses).
    pub fn with_horizon(
        num_blocks: u32,
        policy: PolicyKind,
        reuse: Option<ReuseFilter>,
        horizon: Option<ReturnHorizon>,
    ) -> Self {
        let n = num_blocks as usize;
        Primary {
            slots: alloc::vec![FREE_SLOT; n],
            // At most half full: hashbrown then clears the deleted buckets that churn leaves by
            // rebuilding in place, and never reallocates the index.
            index: IdTable::with_capacity(2 * n),
            next_fresh: 0,
            free: Vec::new(),
            policy: {
                let mut p = Policy::with_horizon(policy, n, horizon);
                if let Policy::Lru(lru) = &mut p {
                    lru.reserve_runs(RESERVED_RUNS);
                }
                p
            },
            events: Vec::new(),
            record_events: true,
            reuse: reuse.map(ReuseTracker::new),
            requests: BTreeMap::new(),
            spare: Vec::new(),
            order_scratch: Vec::new(),
            offer: Offer::default(),
            victims: Vec::new(),
            promoted: Vec::new(),
            stores_skipped: 0,
            evicted_past_horizon_before: 0,
            evictable: 0,
            writing: 0,
            window: Window::default(),
            horizon,
        }
    }

    /// M13: forgets every block, the recency state and the request records; the reuse filter's
    /// counts and the metrics window stay. The caller ensures no transfer uses a slot.
    pub(crate) fn reset(&mut self) {
        let n = self.slots.len();
        let kind = match self.policy {
            Policy::Lru(_) => crate::config::PolicyKind::Lru,
            Policy::Arc(_) => crate::config::PolicyKind::Arc,
            Policy::Reuse(_) => crate::config::PolicyKind::Reuse,
        };
        self.slots.fill(FREE_SLOT);
        self.index.clear();
        self.next_fresh = 0;
        self.free.clear();
        self.evicted_past_horizon_before += self.policy.evicted_past_horizon();
        self.policy = Policy::with_horizon(kind, n, self.horizon);
        if let Policy::Lru(lru) = &mut self.policy {
            lru.reserve_runs(RESERVED_RUNS);
        }
        // Live requests keep the positions the engine gave (vLLM keeps them in the request's
        // context, and its scheduler does not give them again); everything else they
        // accessed is forgotten with the cache.
        for access in self.requests.values_mut() {
            access.forget_all_but_positions();
        }
        self.evictable = 0;
        self.writing = 0;
    }

    /// vLLM 0.33's `get_stats`: the gauges now, and the allocation sizes and skipped stores
    /// since the previous call (which this call resets).
    pub fn take_metrics(&mut self) -> Metrics {
        let window = core::mem::take(&mut self.window);
        Metrics {
            num_blocks: self.num_blocks(),
            used_blocks: self.len() as u32 - self.evictable,
            writing_blocks: self.writing,
            allocation_sizes: window.allocation_sizes,
            allocation_sizes_dropped: window.allocations_dropped,
            stores_skipped: self.reuse.as_ref().map(|_| window.stores_skipped),
        }
    }

    fn observe_allocation(&mut self, blocks: usize) {
        if self.window.allocation_sizes.len() < MAX_ALLOCATION_SIZES {
            self.window.allocation_sizes.push(blocks as u32);
        } else {
            self.window.allocations_dropped += 1;
        }
    }

    /// Whether slot `s` is Ready with no pin.
    fn is_evictable(&self, s: usize) -> bool {
        let slot = &self.slots[s];
        slot.state == SlotState::Ready && slot.load_pins == 0 && slot.job_pins == 0
    }

    /// The slots that the last admission (a store's or a promotion's) freed by evicting, in
    /// the order of its evicted keys. Every admission replaces them; after a refused one
    /// (no room) they are candidates that were not evicted. An embedding uses it, right after
    /// a successful store, to pair the evicted keys with what it kept per slot.
    pub fn last_evicted_slots(&self) -> impl ExactSizeIterator<Item = SlotId> + '_ {
        self.victims.iter().map(|&v| SlotId(v))
    }

    /// Offered keys the reuse filter left out of stores (P17), since the start.
    pub fn stores_skipped(&self) -> u64 {
        self.stores_skipped
    }

    /// Blocks evicted while idle past the reuse-aware LRU's return horizon (U10), since the
    /// start; 0 under the other policies.
    pub fn evicted_past_horizon(&self) -> u64 {
        self.evicted_past_horizon_before + self.policy.evicted_past_horizon()
    }

    /// Number of live requests (started and not finished).
    pub fn live_requests(&self) -> usize {
        self.requests.len()
    }

    /// `req`'s record, started (from a spare one when there is one) if it has none.
    fn access<'a>(
        requests: &'a mut BTreeMap<RequestId, Access>,
        spare: &mut Vec<Access>,
        req: RequestId,
    ) -> &'a mut Access {
        requests
            .entry(req)
            .or_insert_with(|| spare.pop().unwrap_or_default())
    }

    /// R1: starts `req`'s record if it has none.
    pub fn new_request(&mut self, req: RequestId) {
        Self::access(&mut self.requests, &mut self.spare, req);
    }

    /// R2: the end-token position of `key` in `req`.
    pub fn set_position(&mut self, req: RequestId, key: &Key, end_token: u64) {
        Self::access(&mut self.requests, &mut self.spare, req)
            .entry(key)
            .position = Some(end_token);
    }

    /// R3, R4: `req` loaded `keys` (all Ready, in `slots`): each is a reuse unless the request
    /// inserted it; the first-seen ones go to the policy (L4).
    fn record_loads(&mut self, req: RequestId, keys: &[Key], slots: &[SlotId]) {
        let access = Self::access(&mut self.requests, &mut self.spare, req);
        let first = access.seen.len();
        for (key, &SlotId(s)) in keys.iter().zip(slots) {
            let i = access.entry_index(key);
            let e = &mut access.keys[i as usize];
            e.slot = s;
            if e.flags & SEEN == 0 {
                e.flags |= SEEN;
                access.seen.push(i);
            }
            if e.flags & INSERTED == 0 {
                e.flags |= REUSED;
            }
        }
        if access.seen.len() == first {
            return;
        }
        // L4: the request takes its rank at its first access.
        if access.run.is_none() {
            access.run = self.policy.open_run();
        }
        let Some(run) = access.run else {
            return;
        };
        let slots = &self.slots;
        let key_of = |id: u32| slots[id as usize].key.clone().expect("resident");
        for &i in &access.seen[first..] {
            let e = &access.keys[i as usize];
            if let Some(position) = e.position {
                self.policy.access(e.slot, run, position, &key_of);
            }
        }
    }

    /// R6: `req` finished: its keys go to the policy tail to head, and its record is dropped.
    pub fn request_finished(&mut self, req: RequestId) {
        let mut read = Vec::new();
        self.request_finished_into(req, &mut read);
    }

    /// R6, R8: as [`Self::request_finished`], and the keys the request read (loaded from the
    /// primary, or promoted from a tier), head to tail, into `read` (emptied first).
    pub fn request_finished_into(&mut self, req: RequestId, read: &mut Vec<Key>) {
        read.clear();
        let Some(access) = self.requests.remove(&req) else {
            return;
        };
        let mut order = core::mem::take(&mut self.order_scratch);
        access.order_into(&mut order);
        read.extend(
            order
                .iter()
                .map(|&i| &access.keys[i as usize])
                .filter(|e| e.flags & (REUSED | PROMOTED) != 0)
                .map(|e| e.key.clone()),
        );
        self.policy.begin_finish(order.len()); // U4
        for &i in order.iter().rev() {
            let e = &access.keys[i as usize];
            let used = if e.flags & REUSED != 0 {
                Use::Reused
            } else if e.flags & PROMOTED != 0 {
                Use::Promoted
            } else if e.flags & INSERTED != 0 {
                Use::Inserted
            } else {
                Use::Seen
            };
            // The slot the request last saw it in, if it still holds it; else the index.
            let hinted = self
                .slots
                .get(e.slot as usize)
                .is_some_and(|slot| slot.key.as_ref() == Some(&e.key));
            let resident = if hinted {
                Some(e.slot)
            } else {
                self.find(&e.key)
            };
            self.policy.finish(&e.key, resident, used);
        }
        self.order_scratch = order;
        if let Some(run) = access.run {
            self.policy.close_run(run);
        }
        tracing::debug!(%req, keys = access.seen.len(), "request finished");
        // Most requests are alike: keep a few records' allocations for the next ones.
        if self.spare.len() < MAX_SPARE_RECORDS {
            let mut access = access;
            access.clear();
            self.spare.push(access);
        }
    }

    /// Whether to record events (on by default). Events accumulate until taken.
    pub fn set_events(&mut self, on: bool) {
        self.record_events = on;
    }

    fn emit(&mut self, kind: EventKind, keys: Vec<Key>) {
        if self.record_events && !keys.is_empty() {
            self.events.push(Event {
                medium: Medium::Primary,
                kind,
                keys,
            });
        }
    }

    /// Number of slots.
    pub fn num_blocks(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Number of occupied slots.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no slot is occupied.
    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// The slot holding `key`, in any state.
    #[inline]
    fn find(&self, key: &Key) -> Option<u32> {
        self.index.find(hash(key), |s| {
            self.slots[s as usize].key.as_ref() == Some(key)
        })
    }

    /// Number of free slots (never used, or freed).
    pub fn free_slots(&self) -> usize {
        (self.num_blocks() - self.next_fresh) as usize + self.free.len()
    }

    /// The eviction policy (for ARC's `p`, for example).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The state and slot of `key`, if present.
    pub fn state_of(&self, key: &Key) -> Option<(SlotId, BlockState)> {
        let s = self.find(key)?;
        let slot = &self.slots[s as usize];
        let state = match slot.state {
            SlotState::Pending => BlockState::Pending,
            SlotState::Promoting => BlockState::Promoting,
            SlotState::Ready => BlockState::Ready {
                load_pins: slot.load_pins,
                job_pins: slot.job_pins,
            },
            SlotState::Free => unreachable!("I2: a mapped slot is occupied"),
        };
        Some((SlotId(s), state))
    }

    /// The key held by `slot`, if occupied.
    pub fn key_at(&self, slot: SlotId) -> Option<&Key> {
        self.slots.get(slot.index())?.key.as_ref()
    }

    /// P1–P3: Miss, HitPending or Hit.
    pub fn lookup(&mut self, key: &Key) -> Lookup {
        self.lookup_slot(key).0
    }

    /// `lookup`, also giving the slot of a Hit.
    #[inline]
    pub(crate) fn lookup_slot(&self, key: &Key) -> (Lookup, Option<SlotId>) {
        match self.find(key) {
            None => (Lookup::Miss, None),
            Some(s) => match self.slots[s as usize].state {
                SlotState::Ready => (Lookup::Hit, Some(SlotId(s))),
                SlotState::Promoting if crate::mutant::active("hit_pending") => {
                    (Lookup::Hit, Some(SlotId(s)))
                }
                _ => (Lookup::HitPending, None),
            },
        }
    }

    /// P4–P7, P17, R3–R5: allocate Pending slots for `req`'s absent keys, evicting exactly
    /// the shortfall.
    pub fn prepare_store(&mut self, req: RequestId, keys: &[Key]) -> Result<PreparedStore, Error> {
        if let Some(r) = &mut self.reuse {
            r.record_offer(keys); // P17
        }
        let mut offer = self.begin_store(req, keys, Offered::Store);
        if offer.keys.is_empty() {
            self.end_offer(offer);
            return Ok(PreparedStore::default()); // P4
        }
        self.observe_allocation(offer.keys.len());
        let mut slots = Vec::with_capacity(offer.keys.len());
        let mut evicted = Vec::new();
        let admitted = self.admit(req, &offer, SlotState::Pending, &mut slots, &mut evicted);
        // The stored keys go to the caller; the offer's other vectors are kept.
        let keys = core::mem::take(&mut offer.keys);
        self.end_offer(offer);
        admitted?;
        tracing::debug!(
            stored = keys.len(),
            evicted = evicted.len(),
            "primary prepare_store"
        );
        Ok(PreparedStore {
            keys,
            slots,
            evicted,
        })
    }

    /// M4: admits `key`, found in a secondary tier and absent from the primary (the caller
    /// looked it up), as `req`'s store would (R3–R5, L1, A1, A7; no reuse filter), in state
    /// Promoting, never evicting a slot in `protected` (sorted).
    /// Returns the slot; the blocks evicted go to `evicted` (empty on entry).
    pub(crate) fn promote(
        &mut self,
        req: RequestId,
        key: &Key,
        protected: &[u32],
        evicted: &mut Vec<Key>,
    ) -> Result<SlotId, Error> {
        debug_assert!(self.find(key).is_none(), "a promoted key is absent");
        let mut offer = self.begin_store(req, core::slice::from_ref(key), Offered::Promotion);
        if !protected.is_empty() {
            offer.protected.extend_from_slice(protected);
            offer.protected.sort_unstable();
        }
        self.observe_allocation(1);
        let mut slots = core::mem::take(&mut self.promoted);
        let admitted = self.admit(req, &offer, SlotState::Promoting, &mut slots, evicted);
        self.end_offer(offer);
        let out = admitted.map(|()| slots[0]);
        slots.clear();
        self.promoted = slots;
        out
    }

    /// Empties `offer` and keeps it for the next store.
    fn end_offer(&mut self, mut offer: Offer) {
        offer.keys.clear();
        offer.entries.clear();
        offer.protected.clear();
        self.offer = offer;
    }

    /// The common part of a store and a promotion, in one pass over the offer: P17's filter
    /// (a store's only), the keys to store (absent, each once, in offer order), R3–R4 (the
    /// Ready and to-be-stored keys recorded in offer order, Ready ones as reuses), R5 (store
    /// misses to the policy, last to first) and L4 (the request's run, newly seen resident
    /// keys ranked). A promotion's one key is absent (its caller looked it up): it is not
    /// looked up again.
    fn begin_store(&mut self, req: RequestId, keys: &[Key], offered: Offered) -> Offer {
        let filter = offered == Offered::Store;
        let access = Self::access(&mut self.requests, &mut self.spare, req);
        let first_seen = access.seen.len();
        let mut offer = core::mem::take(&mut self.offer);
        offer.keys.reserve(keys.len());
        offer.entries.reserve(keys.len());
        // Newly seen Ready keys with a position: (slot, position) for L4.
        let mut ranked = Vec::new();
        for key in keys {
            let slots = &self.slots;
            let found = match offered {
                Offered::Store => self
                    .index
                    .find(hash(key), |s| slots[s as usize].key.as_ref() == Some(key)),
                Offered::Promotion => None, // absent: `promote` checks it
            };
            let ready = match found {
                Some(s) => {
                    offer.protected.push(s);
                    if self.slots[s as usize].state != SlotState::Ready {
                        continue; // Pending or Promoting: not recorded
                    }
                    true
                }
                None if filter && self.reuse.as_ref().is_some_and(|r| !r.reused(key)) => {
                    self.stores_skipped += 1; // P17: not offered often enough
                    self.window.stores_skipped += 1;
                    continue;
                }
                None => false,
            };
            let i = access.entry_index(key);
            let e = &mut access.keys[i as usize];
            if let Some(s) = found {
                e.slot = s;
            }
            if e.flags & SEEN == 0 {
                e.flags |= SEEN;
                access.seen.push(i);
                if let (Some(s), Some(position)) = (found, e.position) {
                    ranked.push((s, position));
                }
            }
            if ready {
                if e.flags & INSERTED == 0 {
                    e.flags |= REUSED;
                }
            } else if e.flags & QUEUED == 0 {
                e.flags |= QUEUED; // each key once (P5)
                push_clone(&mut offer.keys, key);
                offer.entries.push(i);
            }
        }
        // R5, A7: the store misses to the policy, last to first (the entries are distinct).
        for &i in offer.entries.iter().rev() {
            let e = &mut access.keys[i as usize];
            e.flags &= !QUEUED;
            if e.flags & MISSED == 0 {
                e.flags |= MISSED;
                self.policy.store_miss(&e.key);
            }
        }
        if access.seen.len() > first_seen && access.run.is_none() {
            access.run = self.policy.open_run(); // L4: the request's rank
        }
        if let Some(run) = access.run {
            let slots = &self.slots;
            let key_of = |id: u32| slots[id as usize].key.clone().expect("resident");
            for (s, position) in ranked {
                self.policy.access(s, run, position, &key_of); // L4
            }
        }
        offer.protected.sort_unstable();
        offer
    }

    /// Makes room for `offer.keys` (all absent, distinct) without evicting a slot in
    /// `offer.protected` (sorted), then inserts them in `state` as `req`'s (L1). All or
    /// nothing.
    ///
    /// The slots go to `slots` and the evicted keys to `evicted`, both empty on entry.
    fn admit(
        &mut self,
        req: RequestId,
        offer: &Offer,
        state: SlotState,
        slots: &mut Vec<SlotId>,
        evicted: &mut Vec<Key>,
    ) -> Result<(), Error> {
        let keys = &offer.keys;
        let protected = &offer.protected;
        let needed = keys.len().saturating_sub(self.free_slots());
        let mut victims = core::mem::take(&mut self.victims);
        victims.clear();
        if needed > 0 {
            let slots = &self.slots;
            self.policy.select(
                needed,
                &mut |id| {
                    let s = &slots[id as usize];
                    s.state == SlotState::Ready
                        && s.load_pins == 0
                        && (s.job_pins == 0 || crate::mutant::active("evict_pinned"))
                        && protected.binary_search(&id).is_err()
                },
                &mut victims,
            );
            if victims.len() < needed {
                let available = victims.len();
                self.victims = victims;
                return Err(Error::NoRoom { needed, available }); // P7
            }
        }
        // P6: free the victims in order, one Removed event.
        evicted.reserve(victims.len());
        self.evictable -= victims.len() as u32;
        self.writing += keys.len() as u32;
        for &v in &victims {
            let at = evicted.len();
            evicted.resize_with(at + 1, || self.release(v)); // in place (see `push_clone`)
            self.policy.evict(v, &evicted[at]);
        }
        if !evicted.is_empty() {
            tracing::debug!(count = evicted.len(), "primary evict");
            if self.record_events {
                self.emit(EventKind::Removed, evicted.clone());
            }
        }
        self.victims = victims;
        for _ in keys {
            let s = self.allocate();
            slots.push(SlotId(s));
        }
        let access = self
            .requests
            .get_mut(&req)
            .expect("begin_store made the record");
        for ((key, &i), &SlotId(s)) in keys.iter().zip(&offer.entries).zip(slots.iter()) {
            let slot = &mut self.slots[s as usize];
            debug_assert!(slot.key.is_none(), "allocated slots are free");
            slot.key.get_or_insert_with(|| key.clone()); // in place (see `push_clone`)
            slot.state = state;
            let slots = &self.slots;
            self.index.insert(hash(key), s, |id| {
                hash(
                    slots[id as usize]
                        .key
                        .as_ref()
                        .expect("indexed slot holds a key"),
                )
            });
            // L1: ranked in the request's run when the request gave the key a position.
            let e = &mut access.keys[i as usize];
            e.flags |= INSERTED;
            if state == SlotState::Promoting {
                e.flags |= PROMOTED;
            }
            e.slot = s;
            match e.position {
                Some(position) => {
                    if access.run.is_none() {
                        access.run = self.policy.open_run();
                    }
                    match access.run {
                        Some(run) => {
                            let slots = &self.slots;
                            let key_of =
                                |id: u32| slots[id as usize].key.clone().expect("resident");
                            self.policy.insert_in_run(s, key, run, position, &key_of);
                        }
                        None => self.policy.insert(s, key),
                    }
                }
                None => self.policy.insert(s, key),
            }
        }
        Ok(())
    }

    /// V2: appends to `out` the next `n` Ready blocks with no load pin, in the policy's
    /// eviction order: what P6 takes once their job pins (writes in flight) are gone.
    pub(crate) fn next_victims(&mut self, n: usize, out: &mut Vec<Transfer>) {
        let mut ids = core::mem::take(&mut self.victims);
        ids.clear();
        let slots = &self.slots;
        self.policy.select(
            n,
            &mut |id| {
                let s = &slots[id as usize];
                (s.state == SlotState::Ready || crate::mutant::active("write_ahead_unready"))
                    && s.load_pins == 0
            },
            &mut ids,
        );
        out.extend(ids.iter().map(|&id| {
            Transfer {
                key: self.slots[id as usize]
                    .key
                    .clone()
                    .expect("a victim holds a key"),
                slot: SlotId(id),
            }
        }));
        self.victims = ids;
    }

    /// Slot allocation: fresh slots ascending first, then last-freed-first.
    fn allocate(&mut self) -> u32 {
        if self.next_fresh < self.num_blocks() {
            self.next_fresh += 1;
            self.next_fresh - 1
        } else {
            self.free.pop().expect("admit made room")
        }
    }

    /// Empties slot `s` and puts it on the free stack; returns its key. The caller updates the
    /// policy.
    fn release(&mut self, s: u32) -> Key {
        let slot = &mut self.slots[s as usize];
        let key = slot.key.take().expect("released slot is occupied");
        slot.state = SlotState::Free;
        slot.job_pins = 0;
        slot.load_pins = 0;
        self.index.remove(hash(&key), s);
        self.free.push(s);
        key
    }

    /// P8–P10. Pending blocks become Ready (ok) or are removed (not ok); others are ignored.
    pub fn complete_store(&mut self, keys: &[Key], ok: bool) {
        self.complete_store_into(keys, ok, None);
    }

    /// `complete_store`, also listing the blocks that became Ready in `out`.
    pub(crate) fn complete_store_into(
        &mut self,
        keys: &[Key],
        ok: bool,
        mut out: Option<&mut Vec<Transfer>>,
    ) {
        let mut stored = Vec::new();
        let mut discarded = Vec::new();
        let mut count = 0usize;
        for key in keys {
            let Some(s) = self.find(key) else {
                continue;
            };
            if self.slots[s as usize].state != SlotState::Pending {
                continue; // P10
            }
            self.writing -= 1;
            if ok {
                self.slots[s as usize].state = SlotState::Ready; // P8
                self.evictable += 1;
                count += 1;
                if self.record_events {
                    push_clone(&mut stored, key);
                }
                if let Some(out) = out.as_deref_mut() {
                    // In place (see `push_clone`).
                    out.resize_with(out.len() + 1, || Transfer {
                        key: key.clone(),
                        slot: SlotId(s),
                    });
                }
            } else {
                self.release(s); // P9
                self.policy.remove(s);
                if self.record_events {
                    push_clone(&mut discarded, key);
                }
            }
        }
        tracing::debug!(ok, stored = count, "primary complete_store");
        self.emit(EventKind::Discarded, discarded);
        self.emit(EventKind::Stored, stored);
    }

    /// P11–P12, R3: pin every key once per occurrence for `req`; all must be Ready.
    pub fn prepare_load(&mut self, req: RequestId, keys: &[Key]) -> Result<Vec<SlotId>, Error> {
        let mut slots = Vec::with_capacity(keys.len());
        for key in keys {
            match self.find(key) {
                Some(s) if self.slots[s as usize].state == SlotState::Ready => {
                    slots.push(SlotId(s))
                }
                _ => return Err(Error::NotReady { key: key.clone() }),
            }
        }
        for s in &slots {
            if self.is_evictable(s.index()) {
                self.evictable -= 1;
            }
            self.slots[s.index()].load_pins += 1;
        }
        self.record_loads(req, keys, &slots);
        tracing::debug!(count = slots.len(), "primary prepare_load");
        Ok(slots)
    }

    /// P13–P14: unpin every key once per occurrence; all or nothing.
    pub fn complete_load(&mut self, keys: &[Key]) -> Result<(), Error> {
        for (i, key) in keys.iter().enumerate() {
            let slot = self.find(key).map(|s| s as usize);
            match slot {
                Some(s) if self.slots[s].load_pins > 0 => {
                    self.slots[s].load_pins -= 1;
                    if self.is_evictable(s) {
                        self.evictable += 1;
                    }
                }
                _ => {
                    // Undo the unpins done so far: the state stays unchanged.
                    for done in &keys[..i] {
                        let s = self.find(done).expect("unpinned above") as usize;
                        if self.is_evictable(s) {
                            self.evictable -= 1;
                        }
                        self.slots[s].load_pins += 1;
                    }
                    if crate::mutant::active("refusal_touches") {
                        self.touch(core::slice::from_ref(key));
                    }
                    return Err(Error::NotPinned { key: key.clone() });
                }
            }
        }
        tracing::debug!(count = keys.len(), "primary complete_load");
        Ok(())
    }

    /// P15: recency update, walking the keys last to first.
    pub fn touch(&mut self, keys: &[Key]) {
        tracing::debug!(count = keys.len(), "primary touch");
        for key in keys.iter().rev() {
            let resident = self
                .find(key)
                .map(|s| (s, self.slots[s as usize].state == SlotState::Ready));
            self.policy.touch(key, resident);
        }
    }

    /// P16: the events since the last call, in order. A `Discarded` event keeps only the keys
    /// that are still absent (a retry may own the key again), and none is given empty.
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut events = core::mem::take(&mut self.events);
        self.filter_discarded(&mut events);
        events
    }

    /// P9, P16: drops from `Discarded` events of the primary the keys it holds again.
    pub(crate) fn filter_discarded(&self, events: &mut Vec<Event>) {
        events.retain_mut(|e| {
            if e.kind != EventKind::Discarded || e.medium != Medium::Primary {
                return true;
            }
            e.keys.retain(|k| self.find(k).is_none());
            !e.keys.is_empty()
        });
    }

    /// Moves the pending events to the end of `out`.
    pub(crate) fn drain_events(&mut self, out: &mut Vec<Event>) {
        out.append(&mut self.events);
    }

    /// Takes one cascade pin on a Ready block.
    pub(crate) fn pin_job(&mut self, slot: SlotId) {
        if self.is_evictable(slot.index()) {
            self.evictable -= 1;
        }
        let s = &mut self.slots[slot.index()];
        debug_assert_eq!(s.state, SlotState::Ready, "I3");
        s.job_pins += 1;
    }

    /// Releases one cascade pin.
    pub(crate) fn unpin_job(&mut self, slot: SlotId) {
        let s = &mut self.slots[slot.index()];
        debug_assert!(s.job_pins > 0, "I4: a store job holds a pin");
        s.job_pins -= 1;
        if self.is_evictable(slot.index()) {
            self.evictable += 1;
        }
    }

    /// Ends promotions: ok blocks become Ready (one Stored event), the others are removed.
    pub(crate) fn finish_promotions(&mut self, blocks: impl Iterator<Item = (SlotId, bool)>) {
        let (mut stored, mut discarded) = (Vec::new(), Vec::new());
        for (slot, ok) in blocks {
            let s = slot.index();
            debug_assert_eq!(self.slots[s].state, SlotState::Promoting, "I5");
            self.writing -= 1;
            if ok || crate::mutant::active("ready_failed_load") {
                self.slots[s].state = SlotState::Ready;
                self.evictable += 1;
                stored.push(
                    self.slots[s]
                        .key
                        .clone()
                        .expect("I5: promoting slot is occupied"),
                );
            } else {
                let key = self.release(slot.0);
                self.policy.remove(slot.0);
                discarded.push(key);
            }
        }
        // vLLM 0.33 ends a promotion with a successful store of its good blocks, then a
        // failed one of the others.
        self.emit(EventKind::Stored, stored);
        self.emit(EventKind::Discarded, discarded);
    }

    /// Frees `slot` whatever its state (tests of the invariant checks only).
    #[cfg(test)]
    pub(crate) fn force_free(&mut self, slot: SlotId) {
        self.slots[slot.index()].job_pins = 0;
        self.slots[slot.index()].load_pins = 0;
        self.release(slot.0);
        self.policy.remove(slot.0);
    }

    /// Iterates occupied slots: (slot, key, state).
    pub(crate) fn blocks(&self) -> impl Iterator<Item = (SlotId, &Key, BlockState)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, slot)| {
            let key = slot.key.as_ref()?;
            let (_, state) = self.state_of(key)?;
            Some((SlotId(i as u32), key, state))
        })
    }

    /// See `Manager::canonical_state`.
    pub(crate) fn write_canonical(&self, out: &mut String) {
        use core::fmt::Write;
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(k) = &s.key {
                let _ = write!(
                    out,
                    "s{i}={k}:{:?}:{}:{};",
                    s.state, s.load_pins, s.job_pins
                );
            }
        }
        let _ = write!(out, "fresh={} free={:?} ", self.next_fresh, self.free);
        let name = |out: &mut String, s: u32| {
            let _ = write!(out, "{}", SlotId(s).0);
        };
        self.policy.write_canonical(out, &name);
        if let Some(r) = &self.reuse {
            out.push_str(" seen[");
            for key in r.by_age.values() {
                let _ = write!(out, "{key}x{},", r.counts[key].0);
            }
            out.push(']');
        }
        for (req, a) in &self.requests {
            let _ = write!(out, " {req}(run {:?}:", a.run.map(|r| r.sentinel));
            for k in &a.keys {
                let _ = write!(out, "{}@{:?}/{},", k.key, k.position, k.flags);
            }
            out.push_str(" seen");
            for i in &a.seen {
                let _ = write!(out, " {i}");
            }
            out.push(')');
        }
        let _ = write!(out, " events={:?};", self.events);
    }

    /// I1, I2, I3, I7 for the primary tier.
    pub fn check_invariants(&self) -> Result<(), Violation> {
        let n = self.slots.len();
        // I1: slot conservation.
        let fresh = n - self.next_fresh as usize;
        let occupied = self.index.len();
        ensure!(
            fresh + self.free.len() + occupied == n,
            "I1",
            "fresh {fresh} + free {} + occupied {occupied} != {n}",
            self.free.len()
        );
        let mut on_stack = BTreeSet::new();
        for &s in &self.free {
            ensure!(on_stack.insert(s), "I1", "slot {s} on the free stack twice");
            ensure!(
                s < self.next_fresh,
                "I1",
                "fresh slot {s} on the free stack"
            );
            ensure!(
                self.slots[s as usize].state == SlotState::Free,
                "I1",
                "slot {s} is both free and occupied"
            );
        }
        for (i, slot) in self.slots.iter().enumerate() {
            if i >= self.next_fresh as usize {
                ensure!(
                    slot.state == SlotState::Free,
                    "I1",
                    "fresh slot {i} is occupied"
                );
            }
            // I2: one key per slot, and the map agrees.
            match (&slot.key, slot.state) {
                (None, SlotState::Free) => {}
                (Some(k), st) if st != SlotState::Free => {
                    ensure!(
                        self.find(k) == Some(i as u32),
                        "I2",
                        "slot {i} holds {k} but the map disagrees"
                    );
                }
                _ => {
                    return Err(Violation::new(
                        "I2",
                        alloc::format!("slot {i} half occupied"),
                    ));
                }
            }
            // I3: pins only on Ready blocks.
            if slot.state != SlotState::Ready {
                ensure!(
                    slot.load_pins == 0 && slot.job_pins == 0,
                    "I3",
                    "slot {i} is pinned but not Ready"
                );
            }
            // I7: the policy tracks exactly the occupied slots.
            ensure!(
                self.policy.contains(i as u32) == (slot.state != SlotState::Free),
                "I7",
                "policy and slot {i} disagree on residency"
            );
        }
        ensure!(
            self.policy.len() == occupied,
            "I7",
            "policy tracks {} blocks, {occupied} occupied",
            self.policy.len()
        );
        ensure!(
            self.index
                .ids()
                .all(|s| self.slots[s as usize].key.is_some()),
            "I2",
            "the key index names a free slot"
        );
        self.policy.check().map_err(|d| Violation::new("I7", d))?;
        if let Policy::Arc(arc) = &self.policy {
            for k in self.slots.iter().filter_map(|s| s.key.as_ref()) {
                ensure!(!arc.is_ghost(k), "I7", "resident {k} is also a ghost");
            }
        }
        // I11: the metrics' counters match the slots.
        let evictable = (0..n).filter(|&s| self.is_evictable(s)).count();
        let writing = self
            .slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Pending | SlotState::Promoting))
            .count();
        ensure!(
            self.evictable as usize == evictable && self.writing as usize == writing,
            "I11",
            "counted {} evictable and {} writing, the slots say {evictable} and {writing}",
            self.evictable,
            self.writing
        );
        Ok(())
    }
}

/// The reuse filter's bounded counter: least recently seen keys are forgotten first.
#[derive(Clone, Debug)]
struct ReuseTracker {
    filter: ReuseFilter,
    counts: BTreeMap<Key, (u32, u64)>,
    by_age: BTreeMap<u64, Key>,
    clock: u64,
}

impl ReuseTracker {
    fn new(filter: ReuseFilter) -> Self {
        ReuseTracker {
            filter,
            counts: BTreeMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
        }
    }

    /// P17: counts an offer to `prepare_store`, as vLLM 0.33 does: tracked keys move to the
    /// most recent end and count one more; untracked keys start at 1, forgetting the least
    /// recently offered key that is not in this offer when the tracker is full.
    fn record_offer(&mut self, keys: &[Key]) {
        let mut in_offer = BTreeSet::new();
        for key in keys {
            if let Some((count, age)) = self.counts.get_mut(key) {
                self.clock += 1;
                self.by_age.remove(age);
                *count = count.saturating_add(1);
                *age = self.clock;
                self.by_age.insert(self.clock, key.clone());
                in_offer.insert(key.clone());
            }
        }
        let mut unprotected = self.counts.len() - in_offer.len();
        for key in keys {
            if self.counts.contains_key(key) {
                continue;
            }
            if self.counts.len() >= self.filter.max_tracker_size as usize {
                if unprotected == 0 {
                    continue;
                }
                let (_, oldest) = self.by_age.pop_first().expect("a tracked key");
                self.counts.remove(&oldest);
                unprotected -= 1;
            }
            self.clock += 1;
            self.counts.insert(key.clone(), (1, self.clock));
            self.by_age.insert(self.clock, key.clone());
        }
    }

    fn reused(&self, key: &Key) -> bool {
        self.counts
            .get(key)
            .is_some_and(|&(c, _)| c >= self.filter.store_threshold)
    }
}

#[cfg(test)]
mod tests {
    //! `check_invariants` of the primary must fail on a corrupted state.

    use super::*;

    fn full() -> Primary {
        let mut p = Primary::new(4, PolicyKind::Arc, None);
        let keys: Vec<Key> = (0u8..3).map(|i| Key::from([i])).collect();
        p.prepare_store(RequestId(1), &keys).unwrap();
        p.complete_store(&keys[..2], true);
        p.check_invariants().unwrap();
        p
    }

    fn violated(p: &Primary) -> &'static str {
        p.check_invariants()
            .expect_err("corruption not detected")
            .id
    }

    #[test]
    fn detects_a_slot_freed_twice() {
        let mut p = full();
        p.force_free(SlotId(0));
        p.free.push(0);
        assert_eq!(violated(&p), "I1");
    }

    #[test]
    fn detects_a_lost_slot() {
        let mut p = full();
        p.next_fresh += 1;
        assert_eq!(violated(&p), "I1");
    }

    #[test]
    fn detects_double_ownership() {
        let mut p = full();
        p.slots[1].key = p.slots[0].key.clone();
        assert_eq!(violated(&p), "I2");
    }

    #[test]
    fn detects_a_pin_on_a_pending_block() {
        let mut p = full();
        p.slots[2].load_pins = 1;
        assert_eq!(violated(&p), "I3");
    }

    #[test]
    fn detects_a_free_slot_that_keeps_its_key() {
        let mut p = full();
        p.slots[1].state = SlotState::Free;
        assert_eq!(violated(&p), "I2");
    }

    #[test]
    fn detects_a_policy_out_of_step() {
        let mut p = full();
        p.policy.remove(1);
        assert_eq!(violated(&p), "I7");
    }

    #[test]
    fn detects_a_resident_ghost() {
        let mut p = full();
        p.policy.evict(0, &Key::from([0u8]));
        p.policy.insert(0, &Key::from([9u8]));
        assert_eq!(violated(&p), "I7");
    }
}
