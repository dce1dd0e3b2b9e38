//! vLLM's simplified adaptive replacement cache (rules A1–A6).

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::{EvictionPolicy, Lists};
use crate::key::Key;
use crate::table::{IdTable, hash};

const T1: usize = 0;
const T2: usize = 1;
const B1: usize = 0;
const B2: usize = 1;

/// ARC over resident ids with ghost lists of keys.
///
/// T1 holds blocks seen once, T2 blocks touched again while Ready; B1 and B2 remember the keys
/// evicted from each. `p` (the target size of T1) adapts only when a ghost is touched.
#[derive(Clone, Debug)]
pub struct ArcPolicy {
    capacity: usize,
    p: f64,
    resident: Lists<2>,
    ghosts: Ghosts,
}

/// Ghost lists B1 and B2: keys only, each bounded by the capacity.
#[derive(Clone, Debug, Default)]
struct Ghosts {
    keys: Vec<Option<Key>>,
    free: Vec<u32>,
    by_key: IdTable,
    lists: Lists<2>,
}

impl Ghosts {
    fn push(&mut self, list: usize, key: Key) {
        let id = match self.free.pop() {
            Some(id) => {
                self.keys[id as usize] = Some(key.clone());
                id
            }
            None => {
                self.keys.push(Some(key.clone()));
                (self.keys.len() - 1) as u32
            }
        };
        self.by_key.insert(hash(&key), id);
        self.lists.push_back(list, id);
    }

    fn find(&self, key: &Key) -> Option<u32> {
        self.by_key
            .find(hash(key), |g| self.keys[g as usize].as_ref() == Some(key))
    }

    fn remove(&mut self, id: u32) {
        self.lists.remove(id);
        if let Some(key) = self.keys[id as usize].take() {
            self.by_key.remove(hash(&key), id);
        }
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
        ArcPolicy {
            capacity,
            p: 0.0,
            resident: Lists::with_capacity(capacity),
            ghosts: Ghosts::default(),
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
        if let Some(g) = self.ghosts.find(key) {
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
        // A5: a ghost adapts p and moves to its list's end.
        let Some(g) = self.ghosts.find(key) else {
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

    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        // A6. `p` is non-negative, so truncation is its floor.
        let target = self.p as usize;
        let mut t1 = self.resident.len(T1);
        let mut c1 = self.resident.front(T1);
        let mut c2 = self.resident.front(T2);
        for _ in 0..n {
            if t1 >= target {
                if let Some(id) = self.next_eligible(&mut c1, eligible) {
                    out.push(id);
                    t1 -= 1;
                    continue;
                }
            }
            match self.next_eligible(&mut c2, eligible) {
                Some(id) => out.push(id),
                None => return,
            }
        }
    }

    fn evict(&mut self, id: u32, key: Key) {
        let ghost_list = match self.resident.remove(id) {
            Some(T1) => B1,
            Some(_) => B2,
            None => return,
        };
        self.ghosts.push(ghost_list, key);
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
        if self.ghosts.by_key.len() != ghosts {
            return Err(format!(
                "{} ghost keys indexed but {ghosts} linked",
                self.ghosts.by_key.len()
            ));
        }
        for g in self.ghosts.by_key.ids() {
            let Some(key) = &self.ghosts.keys[g as usize] else {
                return Err(format!("ghost {g} is indexed but holds no key"));
            };
            if self.ghosts.find(key) != Some(g) {
                return Err(format!("ghost {g} is not found by its key {key}"));
            }
        }
        Ok(())
    }
}

impl ArcPolicy {
    /// Whether `key` is remembered in a ghost list (used to check I7: ghosts are not resident).
    pub(crate) fn is_ghost(&self, key: &Key) -> bool {
        self.ghosts.find(key).is_some()
    }
}
