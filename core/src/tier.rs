//! The index of one secondary tier (rules T1–T13).
//!
//! The core keeps every tier's index so the whole protocol is checked: which keys a tier holds,
//! which are being written or read, its capacity and its eviction. The IO layer only carries
//! out the effects.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::format;
use alloc::string::String;
use alloc::sync::Arc;
use alloc::vec::Vec;

use crate::config::{TierConfig, TierKind};
use crate::error::{Violation, ensure};
use crate::event::{Event, EventKind, Medium, Transfer};
use crate::key::{JobId, Key, TierId};
use crate::policy::{EvictionPolicy, Policy};
use crate::table::{IdTable, hash};

/// A tier's answer to a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierAnswer {
    /// The tier holds the block and it can be read (T1).
    Present,
    /// A write or an existence probe of the block is in flight (T2).
    Busy,
    /// The tier does not hold the block (T3, or a cached probe answer).
    Absent,
    /// A shared tier does not know: an existence probe must ask (T4).
    Unknown,
}

/// The state of one key in a tier index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryState {
    /// A store job writes the block.
    Writing,
    /// The block is stored; `readers` load jobs are reading it.
    Present {
        /// Load jobs (or batched promotions) reading the block.
        readers: u32,
    },
}

/// How one block's read ended, as the tier index sees it (T11, T15).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadEnd {
    /// The block was read.
    Ok,
    /// The read failed.
    Failed,
    /// The shared store no longer holds the block (evicted or expired there).
    Missing,
    /// The job was cancelled at shutdown.
    Cancelled,
}

#[derive(Clone, Debug)]
struct Entry {
    key: Key,
    state: EntryState,
}

/// How `plan_store` treated the blocks it was offered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StorePlan {
    /// Blocks to write, in offered order; now Writing (shared with the job that writes them).
    pub(crate) writes: Arc<[Transfer]>,
    /// Their entry ids, in the same order.
    pub(crate) entries: Vec<u32>,
    /// Blocks evicted for room; the IO layer deletes them.
    pub(crate) evicted: Vec<Key>,
    /// Blocks skipped because the tier already holds or writes them.
    pub(crate) held: usize,
    /// Blocks skipped because no room could be made.
    pub(crate) full: usize,
}

/// The index of one secondary tier.
#[derive(Clone, Debug)]
pub struct TierIndex {
    id: TierId,
    kind: TierKind,
    capacity: u32,
    entries: Vec<Option<Entry>>,
    free_ids: Vec<u32>,
    index: IdTable,
    policy: Policy,
    probing: BTreeMap<Key, JobId>,
    absent_ttl: u64,
    known_absent: BTreeMap<Key, u64>,
    absent_expiry: VecDeque<(u64, Key)>,
    record_events: bool,
}

impl TierIndex {
    /// An empty index for tier `id`.
    pub fn new(id: TierId, config: &TierConfig) -> Self {
        TierIndex {
            id,
            kind: config.kind,
            capacity: config.capacity_blocks,
            entries: Vec::new(),
            free_ids: Vec::new(),
            index: IdTable::default(),
            policy: Policy::new(config.policy, config.capacity_blocks as usize),
            probing: BTreeMap::new(),
            absent_ttl: u64::from(config.absent_ttl_steps),
            known_absent: BTreeMap::new(),
            absent_expiry: VecDeque::new(),
            record_events: true,
        }
    }

    /// Whether to record events (on by default).
    pub fn set_events(&mut self, on: bool) {
        self.record_events = on;
    }

    /// Blocks held or being written.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the index holds nothing.
    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// The entry id of `key`, if indexed.
    #[inline]
    fn find(&self, key: &Key) -> Option<u32> {
        self.index.find(hash(key), |id| {
            self.entries[id as usize]
                .as_ref()
                .is_some_and(|e| &e.key == key)
        })
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// The tier's eviction policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The state of `key`, if the index has it.
    pub fn state_of(&self, key: &Key) -> Option<EntryState> {
        self.find(key).map(|id| self.entry(id).state)
    }

    /// Existence probes in flight.
    pub fn probes_outstanding(&self) -> usize {
        self.probing.len()
    }

    /// Whether an existence probe of `key` is in flight.
    pub fn is_probing(&self, key: &Key) -> bool {
        self.probing.contains_key(key)
    }

    fn entry(&self, id: u32) -> &Entry {
        self.entries[id as usize]
            .as_ref()
            .expect("mapped entry exists")
    }

    fn entry_mut(&mut self, id: u32) -> &mut Entry {
        self.entries[id as usize]
            .as_mut()
            .expect("mapped entry exists")
    }

    /// T1–T4.
    pub fn lookup(&self, key: &Key, step: u64) -> TierAnswer {
        self.lookup_entry(key, step).0
    }

    /// T1–T4, with the entry's id when the answer is Present (for [`Self::start_read`]).
    pub(crate) fn lookup_entry(&self, key: &Key, step: u64) -> (TierAnswer, Option<u32>) {
        if let Some(id) = self.find(key) {
            return match self.entry(id).state {
                EntryState::Present { .. } => (TierAnswer::Present, Some(id)),
                EntryState::Writing => (TierAnswer::Busy, None),
            };
        }
        (self.lookup_absent(key, step), None)
    }

    /// T3–T4: the answer for a key the index does not hold.
    fn lookup_absent(&self, key: &Key, step: u64) -> TierAnswer {
        if self.probing.contains_key(key) {
            return TierAnswer::Busy;
        }
        match self.kind {
            TierKind::Authoritative => TierAnswer::Absent,
            TierKind::Shared => match self.known_absent.get(key) {
                Some(&until) if until > step => TierAnswer::Absent,
                _ => TierAnswer::Unknown,
            },
        }
    }

    /// Inserts `key` in `state`; the caller made room. Returns its entry id.
    fn insert(&mut self, key: &Key, state: EntryState) -> u32 {
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None => {
                self.entries.push(None);
                (self.entries.len() - 1) as u32
            }
        };
        self.policy.insert(id, key);
        self.known_absent.remove(key);
        let entry = &mut self.entries[id as usize];
        debug_assert!(entry.is_none(), "a free entry id");
        // In place (see `push_clone`).
        entry.get_or_insert_with(|| Entry {
            key: key.clone(),
            state,
        });
        let entries = &self.entries;
        self.index.insert(hash(key), id, |other| {
            hash(&entries[other as usize].as_ref().expect("indexed entry").key)
        });
        id
    }

    /// The key of entry `id`, if live.
    pub(crate) fn key_of(&self, id: u32) -> Option<&Key> {
        self.entries.get(id as usize)?.as_ref().map(|e| &e.key)
    }

    /// Removes `key`'s entry; `evicted` keeps an ARC ghost.
    fn remove(&mut self, id: u32, evicted: bool) -> Key {
        let entry = self.entries[id as usize]
            .take()
            .expect("mapped entry exists");
        self.index.remove(hash(&entry.key), id);
        if evicted {
            self.policy.evict(id, &entry.key);
        } else {
            self.policy.remove(id);
        }
        self.free_ids.push(id);
        entry.key
    }

    /// T13: evicts up to `n` idle Present blocks not in `protected` (sorted ids); returns their
    /// keys and pushes one Removed event.
    fn evict(&mut self, n: usize, protected: &[u32], events: &mut Vec<Event>) -> Vec<Key> {
        if n == 0 {
            return Vec::new();
        }
        let mut victims = Vec::with_capacity(n);
        let entries = &self.entries;
        self.policy.select(
            n,
            &mut |id| {
                matches!(
                    entries[id as usize],
                    Some(Entry {
                        state: EntryState::Present { readers: 0 },
                        ..
                    })
                ) && protected.binary_search(&id).is_err()
            },
            &mut victims,
        );
        let keys: Vec<Key> = victims.iter().map(|&v| self.remove(v, true)).collect();
        if !keys.is_empty() {
            tracing::debug!(tier = self.id.0, count = keys.len(), "tier evict");
        }
        if !keys.is_empty() && self.record_events {
            events.push(Event {
                medium: Medium::Tier(self.id),
                kind: EventKind::Removed,
                keys: keys.clone(),
            });
        }
        keys
    }

    /// T14: the blocks of `evicted` the store must delete: all of them on an authoritative
    /// tier; none on a shared tier, where other nodes may be reading them (evicting there
    /// forgets them on this node, and the store's own memory policy bounds its space).
    pub(crate) fn to_delete(&self, evicted: Vec<Key>) -> Vec<Key> {
        if self.kind == TierKind::Authoritative || crate::mutant::active("shared_delete") {
            evicted
        } else {
            Vec::new()
        }
    }

    fn room(&self) -> usize {
        self.capacity as usize - self.index.len()
    }

    /// T7: plan a store job for `blocks`: skip held keys, evict idle blocks for room, mark the
    /// rest Writing. Blocks beyond the room that can be made are skipped.
    pub(crate) fn plan_store(&mut self, blocks: &[Transfer], events: &mut Vec<Event>) -> StorePlan {
        let mut plan = StorePlan::default();
        let mut protected = Vec::new();
        let mut to_write = Vec::with_capacity(blocks.len());
        for b in blocks {
            match self.find(&b.key) {
                Some(id) => {
                    protected.push(id);
                    plan.held += 1;
                }
                None => to_write.push(b),
            }
        }
        protected.sort_unstable();
        let needed = to_write.len().saturating_sub(self.room());
        plan.evicted = self.evict(needed, &protected, events);
        let writable = to_write.len().min(self.room());
        plan.full = to_write.len() - writable;
        plan.entries.reserve_exact(writable);
        for b in &to_write[..writable] {
            plan.entries.push(self.insert(&b.key, EntryState::Writing));
        }
        // One allocation, of the exact size.
        plan.writes = to_write[..writable].iter().map(|&b| b.clone()).collect();
        tracing::debug!(
            tier = self.id.0,
            writes = plan.writes.len(),
            held = plan.held,
            full = plan.full,
            "tier plan_store"
        );
        plan
    }

    /// T8–T9: the write of entry `id` ended.
    pub(crate) fn finish_write(&mut self, id: u32, ok: bool) {
        debug_assert_eq!(self.entry(id).state, EntryState::Writing, "I8");
        if ok {
            self.entry_mut(id).state = EntryState::Present { readers: 0 };
        } else {
            self.remove(id, false);
        }
    }

    /// T10: a promotion starts reading entry `id` (Present, from [`Self::lookup_entry`]).
    pub(crate) fn start_read(&mut self, id: u32) {
        match &mut self.entry_mut(id).state {
            EntryState::Present { readers } => *readers += 1,
            EntryState::Writing => unreachable!("T10: only Present blocks are read"),
        }
    }

    /// T11, T15: a read ended. A failed read drops the block (returns the key to delete, as
    /// T14 allows); a block the shared store no longer holds is forgotten and remembered as
    /// absent for `absent_ttl_steps`. A cancelled read (shutdown) only releases the reader.
    pub(crate) fn end_read(&mut self, id: u32, end: ReadEnd, step: u64) -> Option<Key> {
        let EntryState::Present { readers } = &mut self.entry_mut(id).state else {
            unreachable!("I8: a read block is Present");
        };
        *readers -= 1;
        if matches!(end, ReadEnd::Ok | ReadEnd::Cancelled) || *readers > 0 {
            return None;
        }
        let key = self.remove(id, false);
        if end == ReadEnd::Missing {
            tracing::debug!(tier = self.id.0, %key, "the shared store no longer holds the block");
            self.remember_absent(&key, step);
            return None;
        }
        tracing::debug!(tier = self.id.0, %key, "tier drops unreadable block");
        self.to_delete(alloc::vec![key]).pop()
    }

    /// T4: an existence probe of `key` was submitted.
    pub(crate) fn start_probe(&mut self, key: Key, job: JobId) {
        self.probing.insert(key, job);
    }

    /// T5–T6: a probe ended: `Some(found)`, or `None` if it failed. Returns keys evicted to
    /// make room for a found block.
    pub(crate) fn finish_probe(
        &mut self,
        key: &Key,
        found: Option<bool>,
        step: u64,
        events: &mut Vec<Event>,
    ) -> Vec<Key> {
        self.probing.remove(key);
        if self.find(key).is_some() {
            return Vec::new(); // written meanwhile by this node
        }
        match found {
            Some(true) => {
                let evicted = self.evict(1usize.saturating_sub(self.room()), &[], events);
                if self.room() > 0 {
                    self.insert(key, EntryState::Present { readers: 0 });
                }
                evicted
            }
            Some(false) => {
                self.remember_absent(key, step);
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    /// Authoritative or shared.
    pub fn kind(&self) -> TierKind {
        self.kind
    }

    /// T6, T15: `key` is known absent for `absent_ttl_steps` from `step`.
    fn remember_absent(&mut self, key: &Key, step: u64) {
        let until = step + self.absent_ttl;
        self.known_absent.insert(key.clone(), until);
        self.absent_expiry.push_back((until, key.clone()));
        // Bounded: forget the oldest answers first. The queue may hold stale entries (a key
        // answered again, or written since); those are skipped.
        while self.known_absent.len() > self.capacity as usize {
            let (until, old) = self.absent_expiry.pop_front().expect("bounded by entries");
            if self.known_absent.get(&old) == Some(&until) {
                self.known_absent.remove(&old);
            }
        }
    }

    /// Forgets cached "absent" answers that expire by `step`.
    pub(crate) fn expire(&mut self, step: u64) {
        while let Some((until, _)) = self.absent_expiry.front() {
            if *until > step {
                break;
            }
            let (until, key) = self.absent_expiry.pop_front().expect("front exists");
            if self.known_absent.get(&key) == Some(&until) {
                self.known_absent.remove(&key);
            }
        }
    }

    /// T12: recency update, last key to first.
    pub fn touch(&mut self, keys: &[Key]) {
        for key in keys.iter().rev() {
            let resident = self.find(key).map(|id| {
                (
                    id,
                    matches!(self.entry(id).state, EntryState::Present { .. }),
                )
            });
            self.policy.touch(key, resident);
        }
    }

    /// Durability: records blocks found in the tier at start as Present, up to the capacity.
    /// Returns the keys that did not fit (the IO layer deletes them).
    pub(crate) fn restore(&mut self, keys: impl IntoIterator<Item = Key>) -> Vec<Key> {
        let mut rejected = Vec::new();
        for key in keys {
            if self.find(&key).is_some() {
                continue;
            }
            if self.room() == 0 {
                rejected.push(key);
                continue;
            }
            self.insert(&key, EntryState::Present { readers: 0 });
        }
        rejected
    }

    /// Keys being written, and the readers of each Present key (for I8).
    pub(crate) fn writing_and_readers(&self) -> (BTreeSet<&Key>, BTreeMap<&Key, u32>) {
        let mut writing = BTreeSet::new();
        let mut readers = BTreeMap::new();
        for e in self.entries.iter().flatten() {
            match e.state {
                EntryState::Writing => {
                    writing.insert(&e.key);
                }
                EntryState::Present { readers: r } if r > 0 => {
                    readers.insert(&e.key, r);
                }
                EntryState::Present { .. } => {}
            }
        }
        (writing, readers)
    }

    /// Probes in flight (for I10).
    pub(crate) fn probes(&self) -> impl Iterator<Item = (&Key, JobId)> + '_ {
        self.probing.iter().map(|(k, &j)| (k, j))
    }

    /// See `Manager::canonical_state`; `rank` renames job ids, `step` makes times relative.
    pub(crate) fn write_canonical(
        &self,
        out: &mut String,
        rank: &dyn Fn(JobId) -> usize,
        step: u64,
    ) {
        use core::fmt::Write;
        let mut held: Vec<(&Key, EntryState)> = self
            .entries
            .iter()
            .flatten()
            .map(|e| (&e.key, e.state))
            .collect();
        held.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (k, s) in held {
            let _ = write!(out, "{k}:{s:?};");
        }
        let name = |out: &mut String, id: u32| match self.key_of(id) {
            Some(k) => {
                let _ = write!(out, "{k}");
            }
            None => out.push('?'),
        };
        self.policy.write_canonical(out, &name);
        out.push_str(" probing[");
        for (k, j) in &self.probing {
            let _ = write!(out, "{k}@{},", rank(*j));
        }
        out.push_str("] absent[");
        for (until, k) in &self.absent_expiry {
            if self.known_absent.get(k) == Some(until) && *until > step {
                let _ = write!(out, "{k}+{},", until - step);
            }
        }
        out.push(']');
    }

    /// I7 and I8 for this index alone.
    pub fn check_invariants(&self) -> Result<(), Violation> {
        let t = self.id;
        let len = self.index.len();
        ensure!(
            len <= self.capacity as usize,
            "I8",
            "{t} holds {len} blocks, capacity {}",
            self.capacity
        );
        let live = self.entries.iter().flatten().count();
        ensure!(
            live == len && live + self.free_ids.len() == self.entries.len(),
            "I8",
            "{t}: {live} entries, {len} indexed, {} free ids",
            self.free_ids.len()
        );
        for (id, e) in self.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            let key = &e.key;
            ensure!(
                self.find(key) == Some(id as u32),
                "I8",
                "{t}: index and entries disagree on {key}"
            );
            ensure!(
                self.policy.contains(id as u32),
                "I7",
                "{t}: policy misses {key}"
            );
        }
        ensure!(
            self.policy.len() == len,
            "I7",
            "{t}: policy tracks {}, index {len}",
            self.policy.len()
        );
        self.policy
            .check()
            .map_err(|d| Violation::new("I7", format!("{t}: {d}")))?;
        if let Policy::Arc(arc) = &self.policy {
            for e in self.entries.iter().flatten() {
                ensure!(
                    !arc.is_ghost(&e.key),
                    "I7",
                    "{t}: resident {} is also a ghost",
                    e.key
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! `check_invariants` of a tier index must fail on a corrupted index (I7, I8).

    use super::*;
    use crate::config::{PolicyKind, TierConfig};
    use crate::policy::EvictionPolicy;

    fn index(policy: PolicyKind) -> TierIndex {
        let mut c = TierConfig::new(TierKind::Authoritative, 3);
        c.policy = policy;
        let mut t = TierIndex::new(TierId(0), &c);
        let keys: Vec<Key> = (0u8..3).map(|i| Key::from([i])).collect();
        assert!(t.restore(keys).is_empty());
        t.check_invariants().unwrap();
        t
    }

    fn violated(t: &TierIndex) -> &'static str {
        t.check_invariants()
            .expect_err("corruption not detected")
            .id
    }

    #[test]
    fn detects_an_index_over_capacity() {
        let mut t = index(PolicyKind::Lru);
        t.capacity = 2;
        assert_eq!(violated(&t), "I8");
    }

    #[test]
    fn detects_an_entry_lost_from_the_index() {
        let mut t = index(PolicyKind::Lru);
        t.entries[1] = None;
        assert_eq!(violated(&t), "I8");
    }

    #[test]
    fn detects_a_policy_out_of_step() {
        let mut t = index(PolicyKind::Lru);
        t.policy.remove(2);
        assert_eq!(violated(&t), "I7");
    }

    #[test]
    fn detects_a_resident_ghost() {
        let mut t = index(PolicyKind::Arc);
        // Entry 0 (key 0) stays in the index while the policy turns key 0 into a ghost and
        // tracks id 0 again (under another key): a resident that is also a ghost.
        t.policy.evict(0, &Key::from([0u8]));
        t.policy.insert(0, &Key::from([9u8]));
        assert_eq!(violated(&t), "I7");
    }
}
