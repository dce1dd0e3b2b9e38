//! Reuse-aware LRU (rules U1–U7): recency, with a head start for blocks that came back.
//!
//! Multi-turn traffic sorts blocks into three kinds, which LRU treats alike:
//! - a request's last block that no request had before: nearly always partial (the prompt
//!   rarely ends on a block boundary), and a partial block's hash changes with the next turn,
//!   so it is almost never read again;
//! - a block seen for the first time: some return (a conversation continues), many do not;
//! - a block a request has already reused, or that comes back after an eviction: it belongs
//!   to a conversation or document that returns, and is likely to return again.
//!
//! Every entry has a *due* time on a clock that ticks once per key a request's finish (or a
//! touch) walks. A new block is due when it was last walked; a reused one `4 × capacity` ticks
//! later, so it outlives new blocks by about four turnovers of the cache; a new tail is
//! evicted before either. Victims are taken in due order. Since a request walks its keys tail
//! to head and every request holding a block holds its whole prefix, an entry's ancestors are
//! never due before it: eviction takes a prefix's deepest blocks first and never strands a
//! block behind a missing parent (lookups stop at the first miss).
//!
//! Which blocks came back after an eviction is remembered by a *ghost*: the 32-bit
//! fingerprints of the last `6 × capacity` distinct keys evicted. Two keys sharing a
//! fingerprint (about one in 2³² per lookup per ghost) can make a new block look reused:
//! it then stays longer, and nothing else changes.
//!
//! Each class is an intrusive list in due order, so every operation is O(1) but `select`,
//! which merges the lists' heads. Metadata: 16 bytes per entry (links and due), and 4 bytes
//! in the ring plus one bucket of at most 5 bytes (often 10 with the table's slack) in the
//! ghost's table per remembered key: at most `16 + 6 × 14 = 100` bytes per block of capacity.

use alloc::collections::VecDeque;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use super::{EvictionPolicy, Lists, Run, Use};
use crate::key::Key;

/// Request tails no request had before: evicted first.
const TAIL: usize = 0;
/// Blocks seen by one request only.
const NEW: usize = 1;
/// Blocks reused, or back after an eviction.
const REUSED: usize = 2;

/// How many cache turnovers (capacity ticks) a reused block outlives a new one (U2, U4).
pub const REUSE_BONUS_TURNOVERS: u64 = 4;
/// How many capacities of evicted keys the ghost remembers (U6).
pub const GHOST_CAPACITIES: usize = 6;

/// The reuse-aware LRU over resident ids.
#[derive(Clone, Debug)]
pub struct ReusePolicy {
    lists: Lists<3>,
    /// The due time of every id in `lists`.
    due: Vec<u64>,
    clock: u64,
    /// `REUSE_BONUS_TURNOVERS × capacity`.
    bonus: u64,
    /// The next finished key is its request's tail (U3).
    tail_next: bool,
    ghost: Ghost,
}

/// The fingerprints of the last `limit` distinct evicted keys, oldest first.
#[derive(Clone, Debug)]
struct Ghost {
    ring: VecDeque<u32>,
    set: hashbrown::HashTable<u32>,
    limit: usize,
}

/// The buckets of a `hashbrown` table that holds up to `items` (7/8 of a power of two).
fn ghost_buckets(items: usize) -> usize {
    if items == 0 {
        0
    } else {
        (items * 8).div_ceil(7).next_power_of_two()
    }
}

fn fingerprint(key: &Key) -> u32 {
    (key.hash64() >> 32) as u32
}

/// The table's hash of a fingerprint (spread over 64 bits for the table's control bytes).
fn spread(fp: u32) -> u64 {
    u64::from(fp).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Ghost {
    fn contains(&self, fp: u32) -> bool {
        self.set.find(spread(fp), |&x| x == fp).is_some()
    }

    /// U6: remembers `fp` unless it is remembered already; forgets the oldest past the limit.
    fn push(&mut self, fp: u32) {
        if self.limit == 0 || self.contains(fp) {
            return;
        }
        if self.ring.len() == self.limit {
            let old = self.ring.pop_front().expect("a full ring");
            if let Ok(e) = self.set.find_entry(spread(old), |&x| x == old) {
                e.remove();
            }
        }
        self.ring.push_back(fp);
        self.set.insert_unique(spread(fp), fp, |&x| spread(x));
    }
}

impl ReusePolicy {
    /// An empty policy for a tier of `capacity` entries.
    pub fn new(capacity: usize) -> Self {
        ReusePolicy {
            lists: Lists::with_capacity(capacity),
            due: Vec::new(),
            clock: 0,
            bonus: REUSE_BONUS_TURNOVERS * capacity as u64,
            tail_next: false,
            ghost: Ghost {
                ring: VecDeque::new(),
                set: hashbrown::HashTable::new(),
                limit: GHOST_CAPACITIES * capacity,
            },
        }
    }

    /// Bytes of heap the policy holds now (its tables' allocations).
    pub fn heap_bytes(&self) -> usize {
        // A table bucket holds a u32 and a control byte.
        self.due.capacity() * 8
            + self.lists_bytes()
            + self.ghost.ring.capacity() * 4
            + ghost_buckets(self.ghost.set.capacity()) * 5
    }

    fn lists_bytes(&self) -> usize {
        self.lists.capacity_ids() * 8
    }

    /// Places `id` at the end of `class` with due time `due`.
    fn place(&mut self, id: u32, class: usize, due: u64) {
        let i = id as usize;
        if i >= self.due.len() {
            self.due.resize(i + 1, 0);
        }
        self.due[i] = due;
        self.lists.move_to_back(class, id);
    }

    /// U2/U4: a reused block, walked now.
    fn reuse(&mut self, id: u32) {
        self.place(id, REUSED, self.clock + self.bonus);
    }

    /// See `Policy::write_canonical`: the lists in eviction order, each entry with its due
    /// time relative to the clock (times at or before the clock are all alike to anything
    /// that comes later, so they are written as 0: the order keeps their difference), then
    /// the ghost's fingerprints, oldest first.
    pub(crate) fn write_canonical(&self, out: &mut String, name: &dyn Fn(u32) -> String) {
        out.push_str("reuse[");
        let mut victims = Vec::new();
        self.select(self.len(), &mut |_| true, &mut victims);
        for id in victims {
            let class = ["t", "n", "r"][self.lists.list_of(id).expect("resident")];
            let rel = self.due[id as usize].saturating_sub(self.clock);
            let _ = write!(out, "{}/{class}{rel},", name(id));
        }
        out.push_str("|ghost");
        for fp in &self.ghost.ring {
            let _ = write!(out, ",{fp:x}");
        }
        out.push(']');
    }
}

impl EvictionPolicy for ReusePolicy {
    fn insert(&mut self, id: u32, key: &Key) {
        // U1: a block back after an eviction is reused at once; any other starts new.
        if self.ghost.contains(fingerprint(key)) {
            self.reuse(id);
        } else {
            self.place(id, NEW, self.clock);
        }
    }

    fn open_run(&mut self) -> Option<Run> {
        // No ranks, but the accesses of U8 (the primary passes them within a run).
        Some(Run {
            sentinel: u32::MAX,
            rank: 0,
        })
    }

    fn access(&mut self, id: u32, _run: Run, _position: u64, _key_of: &dyn Fn(u32) -> Key) {
        // U8: a request is reading the block, so it is reused now: it outlives the request's
        // own stores, which evict before the request finishes.
        self.reuse(id);
    }

    fn begin_finish(&mut self) {
        self.tail_next = true; // U3
    }

    fn finish(&mut self, _key: &Key, resident: Option<u32>, used: Use) {
        self.clock += 1; // U4: every walked key ticks
        let tail = core::mem::replace(&mut self.tail_next, false);
        let Some(id) = resident else {
            return;
        };
        match used {
            Use::Reused | Use::Seen => self.reuse(id),
            Use::Inserted if self.lists.list_of(id) == Some(REUSED) => self.reuse(id),
            Use::Inserted if tail => self.place(id, TAIL, self.clock),
            Use::Inserted => self.place(id, NEW, self.clock),
        }
    }

    fn touch(&mut self, _key: &Key, resident: Option<(u32, bool)>) {
        self.clock += 1; // U2
        if let Some((id, _)) = resident {
            self.reuse(id);
        }
    }

    fn remove(&mut self, id: u32) {
        self.lists.remove(id); // U7: no ghost
    }

    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        // U5: tails first, oldest first; then new and reused merged by due time, new first
        // on a tie.
        let mut found = 0;
        if n == 0 {
            return;
        }
        for id in self.lists.iter(TAIL) {
            if eligible(id) {
                out.push(id);
                found += 1;
                if found == n {
                    return;
                }
            }
        }
        let mut new = self.lists.front(NEW);
        let mut reused = self.lists.front(REUSED);
        loop {
            let id = match (new, reused) {
                (Some(a), Some(b)) if self.due[a as usize] <= self.due[b as usize] => {
                    new = self.lists.next(a);
                    a
                }
                (_, Some(b)) => {
                    reused = self.lists.next(b);
                    b
                }
                (Some(a), None) => {
                    new = self.lists.next(a);
                    a
                }
                (None, None) => return,
            };
            if eligible(id) {
                out.push(id);
                found += 1;
                if found == n {
                    return;
                }
            }
        }
    }

    fn evict(&mut self, id: u32, key: &Key) {
        if self.lists.remove(id).is_some() {
            self.ghost.push(fingerprint(key)); // U6
        }
    }

    fn contains(&self, id: u32) -> bool {
        self.lists.list_of(id).is_some()
    }

    fn len(&self) -> usize {
        self.lists.len(TAIL) + self.lists.len(NEW) + self.lists.len(REUSED)
    }

    fn check(&self) -> Result<(), String> {
        self.lists.check()?;
        for (class, name) in [(TAIL, "tail"), (NEW, "new"), (REUSED, "reused")] {
            let mut last = 0;
            for id in self.lists.iter(class) {
                let due = self.due[id as usize];
                if due < last {
                    return Err(format!("{name} list: id {id} due before its predecessor"));
                }
                if due > self.clock + self.bonus {
                    return Err(format!("id {id} due after the clock's reach"));
                }
                last = due;
            }
        }
        if self.ghost.ring.len() != self.ghost.set.len() || self.ghost.ring.len() > self.ghost.limit
        {
            return Err(format!(
                "ghost: {} in the ring, {} in the table, limit {}",
                self.ghost.ring.len(),
                self.ghost.set.len(),
                self.ghost.limit
            ));
        }
        if let Some(fp) = self.ghost.ring.iter().find(|&&fp| !self.ghost.contains(fp)) {
            return Err(format!(
                "ghost fingerprint {fp:x} in the ring, not the table"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> Key {
        Key::from([i])
    }

    fn order(p: &ReusePolicy) -> Vec<u32> {
        let mut out = Vec::new();
        p.select(p.len(), &mut |_| true, &mut out);
        out
    }

    /// A request's finish, keys head to tail, all resident with ids = key bytes.
    fn finish(p: &mut ReusePolicy, head_to_tail: &[(u8, Use)]) {
        p.begin_finish();
        for &(i, used) in head_to_tail.iter().rev() {
            p.finish(&k(i), Some(u32::from(i)), used);
        }
        p.check().unwrap();
    }

    /// U3, U4, U5: the new tail goes first, then new blocks deepest first; reused blocks
    /// outlive new ones walked later.
    #[test]
    fn tails_go_first_reused_blocks_last() {
        let mut p = ReusePolicy::new(4);
        for i in 0..3 {
            p.insert(u32::from(i), &k(i));
        }
        finish(
            &mut p,
            &[(0, Use::Inserted), (1, Use::Inserted), (2, Use::Inserted)],
        );
        assert_eq!(order(&p), [2, 1, 0], "tail, then deepest first");
        // A second request reuses 0 and 1 and stores 3 (its tail).
        p.insert(3, &k(3));
        finish(
            &mut p,
            &[(0, Use::Reused), (1, Use::Reused), (3, Use::Inserted)],
        );
        assert_eq!(order(&p), [2, 3, 1, 0], "tails oldest first, reused last");
    }

    /// U1, U6: a block back after an eviction starts reused; one removed leaves no ghost.
    #[test]
    fn ghosts_remember_evictions_not_removals() {
        let mut p = ReusePolicy::new(2);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.evict(0, &k(0));
        p.remove(1);
        p.check().unwrap();
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        assert_eq!(p.lists.list_of(0), Some(REUSED));
        assert_eq!(p.lists.list_of(1), Some(NEW));
        assert_eq!(order(&p), [1, 0]);
    }

    /// U6: the ghost keeps the last `6 × capacity` distinct keys.
    #[test]
    fn the_ghost_forgets_its_oldest() {
        let mut p = ReusePolicy::new(1);
        for i in 0..8u8 {
            p.insert(0, &k(i));
            p.evict(0, &k(i));
            p.evict(0, &k(i)); // not resident any more: no second ghost
        }
        p.check().unwrap();
        assert_eq!(p.ghost.ring.len(), GHOST_CAPACITIES);
        assert!(!p.ghost.contains(fingerprint(&k(1))));
        assert!(p.ghost.contains(fingerprint(&k(2))));
    }

    /// U5: only eligible ids, and a merge that keeps due order across the lists.
    #[test]
    fn select_merges_by_due_time() {
        let mut p = ReusePolicy::new(1); // bonus of 4 ticks
        for i in 0..4 {
            p.insert(u32::from(i), &k(i));
        }
        p.touch(&k(0), Some((0, true))); // clock 1, due 5
        for i in 1..4u8 {
            p.finish(&k(i), Some(u32::from(i)), Use::Inserted); // clocks 2..4, no tail
        }
        p.clock += 3;
        p.finish(&k(3), Some(3), Use::Inserted); // clock 8: due after 0's
        assert_eq!(order(&p), [1, 2, 0, 3]);
        let mut out = Vec::new();
        p.select(2, &mut |id| id != 1, &mut out);
        assert_eq!(out, [2, 0]);
        // A new block due when a reused one is goes first.
        let mut p = ReusePolicy::new(1);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.touch(&k(0), Some((0, true))); // clock 1, due 5
        p.clock += 3;
        p.finish(&k(1), Some(1), Use::Inserted); // clock 5, due 5
        assert_eq!(order(&p), [1, 0]);
        p.check().unwrap();
    }

    #[test]
    fn check_sees_a_broken_order() {
        let mut p = ReusePolicy::new(4);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.due[0] = 3;
        assert!(p.check().is_err());
    }
}
