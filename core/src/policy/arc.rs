//! vLLM's simplified adaptive replacement cache (rules A1–A6).

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::{EvictionPolicy, Lists, Use};
use crate::key::Key;
use crate::table::{IdTable, hash};

const T1: usize = 0;
const T2: usize = 1;
const B1: usize = 0;
const B2: usize = 1;

/// ARC over resident ids with ghost lists.
///
/// T1 holds blocks stored once, T2 blocks that a request reused (or touched again while
/// Ready); B1 and B2 remember the blocks evicted from each. `p` (the target size of T1) adapts
/// when a store misses on a ghost, or a ghost is touched.
///
/// A ghost remembers its key's fixed 64-bit hash, not its bytes: ghosts only steer `p`, so the
/// chance of two keys sharing a hash (about n²/2⁶⁵ for n keys) can at worst nudge `p`, never
/// serve a block; and an evicted block's bytes are freed at once instead of lingering in B1/B2.
/// (If two ghosts ever shared a hash, which of them a lookup finds is up to the ghost index's
/// layout: the same on every run of one build, not specified beyond that.)
#[derive(Clone, Debug)]
pub struct ArcPolicy {
    capacity: usize,
    p: f64,
    resident: Lists<2>,
    ghosts: Ghosts,
}

/// Ghost lists B1 and B2 of key hashes, each bounded by the capacity.
#[derive(Clone, Debug)]
struct Ghosts {
    hashes: Vec<u64>,
    free: Vec<u32>,
    by_hash: IdTable,
    lists: Lists<2>,
}

impl Ghosts {
    fn push(&mut self, list: usize, h: u64) {
        let id = match self.free.pop() {
            Some(id) => {
                self.hashes[id as usize] = h;
                id
            }
            None => {
                self.hashes.push(h);
                (self.hashes.len() - 1) as u32
            }
        };
        let hashes = &self.hashes;
        self.by_hash.insert(h, id, |g| hashes[g as usize]);
        self.lists.push_back(list, id);
    }

    fn find(&self, h: u64) -> Option<u32> {
        self.by_hash.find(h, |g| self.hashes[g as usize] == h)
    }

    fn remove(&mut self, id: u32) {
        self.lists.remove(id);
        self.by_hash.remove(self.hashes[id as usize], id);
        self.free.push(id);
    }

    fn trim(&mut self, list: usize, capacity: usize) {
        while self.lists.len(list) > capacity {
            let oldest = self.lists.front(list).expect("non-empty list has a front");
            self.remove(oldest);
        }
    }
}

impl ArcPolicy {
    /// An empty ARC for `capacity` resident entries; `p` starts at 0.
    pub fn new(capacity: usize) -> Self {
        let ghost_reserve = (2 * capacity + 1).min(1 << 20);
        ArcPolicy {
            capacity,
            p: 0.0,
            resident: Lists::with_capacity(capacity),
            ghosts: Ghosts {
                // B1 and B2 hold at most `capacity` each (one more while trimming). Reserve
                // that much up front, up to a million, rather than let doubling overshoot.
                hashes: Vec::with_capacity(ghost_reserve),
                free: Vec::new(),
                by_hash: IdTable::default(),
                lists: Lists::with_capacity(ghost_reserve),
            },
        }
    }

    /// The target size of T1, `p`.
    pub fn target(&self) -> f64 {
        self.p
    }

    /// Sizes of T1, T2, B1, B2.
    pub fn list_lens(&self) -> [usize; 4] {
        [
            self.resident.len(T1),
            self.resident.len(T2),
            self.ghosts.lists.len(B1),
            self.ghosts.lists.len(B2),
        ]
    }

    /// A5, A7: a ghost of `key` adapts `p` by the ratio of the ghost lists and moves to its
    /// list's end; other keys change nothing.
    fn adapt(&mut self, key: &Key) {
        let Some(g) = self.ghosts.find(hash(key)) else {
            return;
        };
        let b1 = self.ghosts.lists.len(B1) as f64;
        let b2 = self.ghosts.lists.len(B2) as f64;
        let cap = self.capacity as f64;
        let list = self.ghosts.lists.list_of(g).expect("ghost is linked");
        if list == B1 {
            self.p = (self.p + (b2 / b1).max(1.0)).min(cap);
        } else {
            self.p = (self.p - (b1 / b2).max(1.0)).max(0.0);
        }
        self.ghosts.lists.move_to_back(list, g);
    }

    /// Next eligible id at or after `cursor` in `list`.
    fn next_eligible(
        &self,
        cursor: &mut Option<u32>,
        eligible: &mut dyn FnMut(u32) -> bool,
    ) -> Option<u32> {
        while let Some(id) = *cursor {
            *cursor = self.resident.next(id);
            if eligible(id) {
                return Some(id);
            }
        }
        None
    }
}

impl EvictionPolicy for ArcPolicy {
    fn insert(&mut self, id: u32, key: &Key) {
        // A1: append to T1, forget the key's ghost, no adaptation.
        self.resident.push_back(T1, id);
        if let Some(g) = self.ghosts.find(hash(key)) {
            self.ghosts.remove(g);
        }
    }

    fn remove(&mut self, id: u32) {
        self.resident.remove(id);
    }

    fn touch(&mut self, key: &Key, resident: Option<(u32, bool)>) {
        if let Some((id, ready)) = resident {
            match self.resident.list_of(id) {
                Some(T1) if ready => self.resident.move_to_back(T2, id), // A2
                Some(T1) => self.resident.move_to_back(T1, id),          // A3
                Some(_) => self.resident.move_to_back(T2, id),           // A4
                None => {}
            }
            return;
        }
        self.adapt(key); // A5
    }

    fn store_miss(&mut self, key: &Key) {
        self.adapt(key); // A7
    }

    fn finish(&mut self, _key: &Key, resident: Option<u32>, used: Use) {
        // A8: a store keeps its list; a reuse is the second access that earns T2.
        let Some(id) = resident else {
            return;
        };
        match (used, self.resident.list_of(id)) {
            (Use::Inserted | Use::Promoted, Some(list)) => self.resident.move_to_back(list, id),
            (Use::Reused, Some(_)) => self.resident.move_to_back(T2, id),
            _ => {}
        }
    }

    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        // A6. `p` is non-negative, so truncation is its floor.
        let target = self.p as usize;
        let mut t1 = self.resident.len(T1);
        let mut c1 = self.resident.front(T1);
        let mut c2 = self.resident.front(T2);
        for _ in 0..n {
            if t1 >= target
                && let Some(id) = self.next_eligible(&mut c1, eligible)
            {
                out.push(id);
                t1 -= 1;
                continue;
            }
            if let Some(id) = self.next_eligible(&mut c2, eligible) {
                out.push(id);
                continue;
            }
            // T2 has nothing left: fall back to T1.
            if crate::mutant::active("arc_no_fallback") {
                return;
            }
            match self.next_eligible(&mut c1, eligible) {
                Some(id) => {
                    out.push(id);
                    t1 -= 1;
                }
                None => return,
            }
        }
    }
    fn evict(&mut self, id: u32, key: &Key) {
        let ghost_list = match self.resident.remove(id) {
            Some(T1) => B1,
            Some(_) => B2,
            None => return,
        };
        self.ghosts.push(ghost_list, hash(key));
        self.ghosts.trim(ghost_list, self.capacity);
    }

    fn contains(&self, id: u32) -> bool {
        self.resident.list_of(id).is_some()
    }

    fn len(&self) -> usize {
        self.resident.len(T1) + self.resident.len(T2)
    }

    fn check(&self) -> Result<(), String> {
        self.resident.check()?;
        self.ghosts.lists.check()?;
        if !(0.0..=self.capacity as f64).contains(&self.p) {
            return Err(format!("p = {} outside 0..={}", self.p, self.capacity));
        }
        for list in [B1, B2] {
            if self.ghosts.lists.len(list) > self.capacity {
                return Err(format!("ghost list B{} above capacity", list + 1));
            }
        }
        let ghosts = self.ghosts.lists.len(B1) + self.ghosts.lists.len(B2);
        if self.ghosts.by_hash.len() != ghosts {
            return Err(format!(
                "{} ghosts indexed but {ghosts} linked",
                self.ghosts.by_hash.len()
            ));
        }
        for g in self.ghosts.by_hash.ids() {
            if self.ghosts.lists.list_of(g).is_none() {
                return Err(format!("ghost {g} is indexed but in no list"));
            }
            if self.ghosts.find(self.ghosts.hashes[g as usize]) != Some(g) {
                return Err(format!("ghost {g} is not found by its hash"));
            }
        }
        Ok(())
    }
}

impl ArcPolicy {
    /// See `Policy::write_canonical`.
    pub(crate) fn write_canonical(&self, out: &mut String, name: &dyn Fn(&mut String, u32)) {
        use core::fmt::Write;
        let _ = write!(out, "arc p={:x} t1[", self.p.to_bits());
        for id in self.resident.iter(T1) {
            name(out, id);
            out.push(',');
        }
        out.push_str("] t2[");
        for id in self.resident.iter(T2) {
            name(out, id);
            out.push(',');
        }
        out.push_str("] b1[");
        for g in self.ghosts.lists.iter(B1) {
            let _ = write!(out, "{:x},", self.ghosts.hashes[g as usize]);
        }
        out.push_str("] b2[");
        for g in self.ghosts.lists.iter(B2) {
            let _ = write!(out, "{:x},", self.ghosts.hashes[g as usize]);
        }
        out.push(']');
    }

    /// Whether `key` is remembered in a ghost list (used to check I7: ghosts are not resident).
    pub(crate) fn is_ghost(&self, key: &Key) -> bool {
        self.ghosts.find(hash(key)).is_some()
    }
}

#[cfg(test)]
mod tests {
    //! `check` must fail on each broken part of ARC's state (I7).

    use super::*;

    fn arc() -> ArcPolicy {
        let mut a = ArcPolicy::new(2);
        a.insert(0, &Key::from([0u8]));
        a.insert(1, &Key::from([1u8]));
        a.evict(0, &Key::from([0u8]));
        a.check().unwrap();
        a
    }

    #[test]
    fn check_sees_each_corruption() {
        let mut a = arc();
        a.resident.corrupt_len(T1);
        assert!(a.check().is_err());
        let mut a = arc();
        a.ghosts.lists.corrupt_len(B1);
        assert!(a.check().is_err());
        let mut a = arc();
        a.p = 3.0;
        assert!(a.check().is_err());
        let mut a = arc();
        a.p = -0.5;
        assert!(a.check().is_err());
        assert!(crate::policy::Policy::Arc(arc()).check().is_ok());
    }

    fn k(i: u8) -> Key {
        Key::from([i])
    }

    /// T1 = {5, 6, 7} → evicted to B1; T2 = {0..4}, of which 0 and 1 evicted to B2.
    fn with_ghosts() -> ArcPolicy {
        let mut a = ArcPolicy::new(8);
        for i in 0..8 {
            a.insert(u32::from(i), &k(i));
        }
        for i in 0..5 {
            a.touch(&k(i), Some((u32::from(i), true))); // A2: to T2
        }
        for i in [5, 6, 7, 0, 1] {
            a.evict(u32::from(i), &k(i));
        }
        assert_eq!(a.list_lens(), [0, 3, 3, 2]);
        a
    }

    /// A5: a B1 hit raises p by max(|B2| / |B1|, 1); a B2 hit lowers it by max(|B1| / |B2|, 1).
    #[test]
    fn ghost_hits_adapt_p_by_the_list_ratio() {
        let mut a = with_ghosts();
        a.touch(&k(5), None);
        assert_eq!(a.target(), 1.0, "B1 hit: 2/3 rounds up to 1");
        for i in [5, 6, 7] {
            a.touch(&k(i), None);
        }
        assert_eq!(a.target(), 4.0);
        a.touch(&k(0), None);
        assert_eq!(a.target(), 2.5, "B2 hit: p - 3/2");
        a.check().unwrap();
    }

    /// A6: victims come from T1 while |T1| ≥ p, counting the ones already chosen, then T2.
    #[test]
    fn select_counts_down_t1() {
        let mut a = ArcPolicy::new(8);
        for i in 0..5 {
            a.insert(u32::from(i), &k(i));
        }
        a.touch(&k(3), Some((3, true)));
        a.touch(&k(4), Some((4, true))); // T1 = [0, 1, 2], T2 = [3, 4]
        a.p = 2.0;
        let mut out = Vec::new();
        a.select(3, &mut |_| true, &mut out);
        assert_eq!(out, [0, 1, 3], "T1 down to p = 2, then T2");
    }

    /// A6: when T2 has no eligible block left, the rest comes from T1: a store that fits after
    /// evicting every unpinned block is never refused.
    #[test]
    fn select_falls_back_to_t1_when_t2_runs_out() {
        let mut a = ArcPolicy::new(8);
        for i in 0..5 {
            a.insert(u32::from(i), &k(i));
        }
        a.touch(&k(3), Some((3, true)));
        a.touch(&k(4), Some((4, true))); // T1 = [0, 1, 2], T2 = [3, 4]
        a.p = 4.0; // |T1| < p: T2 first
        let mut out = Vec::new();
        a.select(4, &mut |id| id != 1, &mut out);
        assert_eq!(out, [3, 4, 0, 2], "T2, then T1 past the ineligible 1");
    }

    /// A8: a finishing request moves the blocks it reused to T2's end, and the blocks it only
    /// stored to the end of their own list.
    #[test]
    fn finish_promotes_reuses_only() {
        let mut a = ArcPolicy::new(8);
        for i in 0..4 {
            a.insert(u32::from(i), &k(i));
        }
        a.finish(&k(2), Some(2), Use::Reused);
        a.finish(&k(0), Some(0), Use::Inserted);
        a.finish(&k(1), Some(1), Use::Seen);
        assert_eq!(a.resident.iter(T1).collect::<Vec<_>>(), [1, 3, 0]);
        assert_eq!(a.resident.iter(T2).collect::<Vec<_>>(), [2]);
        a.check().unwrap();
    }

    /// A6: each ghost list keeps exactly `capacity` ghosts, the newest.
    #[test]
    fn ghost_lists_hold_exactly_capacity() {
        let mut a = ArcPolicy::new(2);
        for i in 0..5 {
            a.insert(u32::from(i), &k(i));
            a.evict(u32::from(i), &k(i));
        }
        assert_eq!(a.list_lens(), [0, 0, 2, 0]);
        assert!(a.ghosts.find(hash(&k(4))).is_some() && a.ghosts.find(hash(&k(3))).is_some());
        assert!(a.ghosts.find(hash(&k(2))).is_none());
    }
}

#[cfg(test)]
mod touch_tests {
    use super::*;

    /// A3: touching a T1 block that is not Ready (its store is still Pending) keeps it in T1.
    #[test]
    fn a_pending_block_stays_in_t1() {
        let mut a = ArcPolicy::new(4);
        a.insert(0, &Key::from([0u8]));
        a.touch(&Key::from([0u8]), Some((0, false)));
        assert_eq!(a.list_lens(), [1, 0, 0, 0]);
        a.touch(&Key::from([0u8]), Some((0, true)));
        assert_eq!(a.list_lens(), [0, 1, 0, 0]);
    }
}
