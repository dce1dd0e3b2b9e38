//! vLLM 0.33's ranked LRU (rules L1–L5).
//!
//! Every resident entry has a rank `(r, −position)`, and victims are taken in ascending
//! `(r, −position, key bytes)`. A *fresh* rank has an `r` above every rank given so far; a
//! request takes one fresh `r` at its first access and shares it among its blocks, which are
//! ordered by position, tail first.
//!
//! The order is one intrusive list, so that no operation sorts. A fresh rank is the list's
//! back. A request's rank is a *run*: a sentinel entry placed at the back when the request
//! takes its rank, followed by the request's entries in rank order. Since every rank given
//! later is larger, a run's entries always sit right behind its sentinel, before anything
//! ranked after the request began. Entering a run walks it from the sentinel; blocks usually
//! arrive head first (ascending positions), so the walk stops at once.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::{EvictionPolicy, Lists, Run, Use};
use crate::key::Key;

const LIST: usize = 0;

/// A rank: `r`, then the negated position (0 for fresh ranks).
type Rank = (u64, i64);

/// vLLM 0.33's LRU over resident ids.
#[derive(Clone, Debug)]
pub struct LruPolicy {
    order: Lists<1>,
    /// Ids below this are entries; ids from it up are run sentinels.
    first_sentinel: u32,
    /// The rank of every id in `order` (sentinels: their run's `(r, i64::MIN)`).
    ranks: Vec<Rank>,
    next_rank: u64,
    /// Sentinel ids (minus `first_sentinel`) free for reuse.
    free_sentinels: Vec<u32>,
    sentinels: u32,
    entries: usize,
}

impl LruPolicy {
    /// An empty LRU sized for `capacity` ids (entry ids must stay below it while runs are
    /// open).
    pub fn with_capacity(capacity: usize) -> Self {
        LruPolicy {
            order: Lists::with_capacity(capacity),
            first_sentinel: capacity as u32,
            // Grown on demand: a tier's index holds far fewer entries than its capacity.
            ranks: Vec::new(),
            next_rank: 0,
            free_sentinels: Vec::new(),
            sentinels: 0,
            entries: 0,
        }
    }

    /// Makes room for `runs` open runs beside `capacity` entries, so that a run's sentinel
    /// does not double the tables (the primary's LRU, whose slots all fill).
    pub(crate) fn reserve_runs(&mut self, runs: usize) {
        let ids = self.first_sentinel as usize + runs;
        self.order.reserve_ids(ids);
        self.ranks
            .reserve_exact(ids.saturating_sub(self.ranks.len()));
    }

    /// Ids from the next victim to the most recent, sentinels left out.
    #[cfg(test)]
    pub(crate) fn order(&self) -> impl Iterator<Item = u32> + '_ {
        let first_sentinel = self.first_sentinel;
        self.order.iter(LIST).filter(move |&id| id < first_sentinel)
    }

    /// See `Policy::write_canonical`: the order with sentinels, each entry's rank as its
    /// `r`'s index among the distinct `r`s in order, and its position.
    pub(crate) fn write_canonical(&self, out: &mut String, name: &dyn Fn(&mut String, u32)) {
        use core::fmt::Write;
        out.push_str("lru[");
        let mut class = 0u64;
        let mut last = None;
        for id in self.order.iter(LIST) {
            let (r, neg) = self.ranks[id as usize];
            if last.is_some_and(|l| l != r) {
                class += 1;
            }
            last = Some(r);
            if id >= self.first_sentinel {
                let _ = write!(out, "S{}/{class},", id - self.first_sentinel);
            } else {
                name(out, id);
                let _ = write!(out, "/{class}@{},", -neg);
            }
        }
        out.push(']');
    }

    fn fresh(&mut self) -> Rank {
        self.next_rank += 1;
        (self.next_rank, 0)
    }

    fn set_rank(&mut self, id: u32, rank: Rank) {
        let i = id as usize;
        if i >= self.ranks.len() {
            self.ranks.resize(i + 1, (0, 0));
        }
        self.ranks[i] = rank;
    }

    /// Links `id` (unlinked) into `run` at its rank `(run.rank, −position)`.
    fn link_in_run(&mut self, id: u32, run: Run, position: u64, key_of: &dyn Fn(u32) -> Key) {
        let neg = -(position.min(i64::MAX as u64) as i64);
        self.set_rank(id, (run.rank, neg));
        let mut prev = run.sentinel;
        while let Some(next) = self.order.next(prev) {
            let (r, other) = self.ranks[next as usize];
            // Sentinels of later runs have larger ranks: the run ends at anything not ranked r.
            if next >= self.first_sentinel || r != run.rank {
                break;
            }
            // Equal positions (rare) fall back to the key bytes.
            if other > neg || (other == neg && key_of(next) > key_of(id)) {
                break;
            }
            prev = next;
        }
        self.order.insert_after(LIST, prev, id);
    }
}

impl EvictionPolicy for LruPolicy {
    fn insert(&mut self, id: u32, _key: &Key) {
        let rank = self.fresh(); // L1, without a position
        self.set_rank(id, rank);
        self.order.push_back(LIST, id);
        self.entries += 1;
    }

    fn insert_in_run(
        &mut self,
        id: u32,
        _key: &Key,
        run: Run,
        position: u64,
        key_of: &dyn Fn(u32) -> Key,
    ) {
        self.link_in_run(id, run, position, key_of); // L1
        self.entries += 1;
    }

    fn remove(&mut self, id: u32) {
        if self.order.remove(id).is_some() {
            self.entries -= 1;
        }
    }

    fn touch(&mut self, _key: &Key, resident: Option<(u32, bool)>) {
        if let Some((id, _)) = resident {
            let rank = self.fresh(); // L2
            self.set_rank(id, rank);
            self.order.move_to_back(LIST, id);
        }
    }

    fn open_run(&mut self) -> Option<Run> {
        let sentinel = match self.free_sentinels.pop() {
            Some(s) => s,
            None => {
                self.sentinels += 1;
                self.sentinels - 1
            }
        } + self.first_sentinel;
        self.next_rank += 1;
        let rank = self.next_rank;
        self.set_rank(sentinel, (rank, i64::MIN));
        self.order.push_back(LIST, sentinel);
        Some(Run { sentinel, rank })
    }

    fn close_run(&mut self, run: Run) {
        self.order.remove(run.sentinel);
        self.free_sentinels.push(run.sentinel - self.first_sentinel);
    }

    fn access(&mut self, id: u32, run: Run, position: u64, key_of: &dyn Fn(u32) -> Key) {
        // L4: only a later rank moves the entry.
        let neg = -(position.min(i64::MAX as u64) as i64);
        if self.ranks[id as usize] >= (run.rank, neg) {
            return;
        }
        self.order.remove(id);
        self.link_in_run(id, run, position, key_of);
    }

    fn finish(&mut self, key: &Key, resident: Option<u32>, _use: Use) {
        // L5: a fresh rank, like a touch.
        self.touch(key, resident.map(|id| (id, true)));
    }

    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        if n == 0 {
            return;
        }
        let mut found = 0;
        for id in self.order.iter(LIST) {
            // L3: in rank order, sentinels skipped.
            if id < self.first_sentinel && eligible(id) {
                out.push(id);
                found += 1;
                if found == n {
                    return;
                }
            }
        }
    }

    fn evict(&mut self, id: u32, _key: &Key) {
        self.remove(id);
    }

    fn contains(&self, id: u32) -> bool {
        id < self.first_sentinel && self.order.list_of(id).is_some()
    }

    fn len(&self) -> usize {
        self.entries
    }

    fn check(&self) -> Result<(), String> {
        self.order.check()?;
        let open = self.sentinels as usize - self.free_sentinels.len();
        if self.order.len(LIST) != self.entries + open {
            return Err(format!(
                "{} linked but {} entries and {open} open runs",
                self.order.len(LIST),
                self.entries
            ));
        }
        // The ranks ascend along the list (a sentinel ranks first in its run).
        let mut last: Option<Rank> = None;
        for id in self.order.iter(LIST) {
            let rank = self.ranks[id as usize];
            if last.is_some_and(|l| l > rank) {
                return Err(format!("rank of id {id} below its predecessor's"));
            }
            last = Some(rank);
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

    fn key_of(id: u32) -> Key {
        k(id as u8)
    }

    fn order(p: &LruPolicy) -> Vec<u32> {
        p.order().collect()
    }

    #[test]
    fn check_sees_a_broken_list() {
        let mut p = LruPolicy::with_capacity(2);
        p.insert(0, &k(0));
        p.check().unwrap();
        p.order.corrupt_len(0);
        assert!(p.check().is_err());
        assert!(
            crate::policy::Policy::Lru(p).check().is_err(),
            "the enum delegates"
        );
    }

    /// L1, L4: a request's blocks sit behind everything ranked before it began, tail first,
    /// and ahead of everything ranked later.
    #[test]
    fn a_run_sits_where_its_request_began() {
        let mut p = LruPolicy::with_capacity(8);
        p.insert(0, &k(0));
        let run = p.open_run().unwrap();
        p.insert(1, &k(1)); // ranked after the run began
        for (id, pos) in [(2, 16), (3, 32), (4, 48)] {
            p.insert_in_run(id, &k(id as u8), run, pos, &key_of); // head first
        }
        assert_eq!(order(&p), [0, 4, 3, 2, 1]);
        p.access(0, run, 8, &key_of); // L4: a later rank, the run's head
        assert_eq!(order(&p), [4, 3, 2, 0, 1]);
        p.access(1, run, 4, &key_of); // a fresh rank after the run is later: unchanged
        assert_eq!(order(&p), [4, 3, 2, 0, 1]);
        p.check().unwrap();
        // L5: the request's end ranks its blocks fresh, tail to head.
        for id in [4, 3, 2, 0] {
            p.finish(&k(id as u8), Some(id), Use::Inserted);
        }
        p.close_run(run);
        assert_eq!(order(&p), [1, 4, 3, 2, 0]);
        p.check().unwrap();
    }

    /// L3: equal positions in one run fall back to the key bytes.
    #[test]
    fn equal_positions_order_by_key() {
        let mut p = LruPolicy::with_capacity(4);
        let run = p.open_run().unwrap();
        p.insert_in_run(3, &k(3), run, 16, &key_of);
        p.insert_in_run(1, &k(1), run, 16, &key_of);
        p.insert_in_run(2, &k(2), run, 16, &key_of);
        assert_eq!(order(&p), [1, 2, 3]);
        p.check().unwrap();
    }
}
