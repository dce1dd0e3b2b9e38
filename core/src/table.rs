//! `IdTable`: a deterministic open-addressing index from key hashes to dense ids.
//!
//! The keys live with their owners (the slot table, a tier's entries, ARC's ghosts); the table
//! keeps a 32-bit tag and the id, and asks its owner to compare keys on a tag match. Linear
//! probing with backward-shift deletion: no tombstones, so lookups stay short under churn.
//! The hash is fixed (no per-process seed), so the same operations give the same table on
//! every run; behaviour never depends on the table's iteration order (it has none).

use alloc::vec::Vec;

use crate::key::Key;

const EMPTY: u32 = u32::MAX;
const MIN_BUCKETS: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tag: u32,
    id: u32,
}

const FREE: Bucket = Bucket { tag: 0, id: EMPTY };

/// The 64-bit hash of a key (carried by the key, computed once).
#[inline]
pub(crate) fn hash(key: &Key) -> u64 {
    key.hash64()
}

fn tag_of(hash: u64) -> u32 {
    (hash ^ (hash >> 32)) as u32
}

/// Maps key hashes to ids; the owner resolves tag collisions by comparing keys.
#[derive(Clone, Debug, Default)]
pub(crate) struct IdTable {
    buckets: Vec<Bucket>,
    len: usize,
}

impl IdTable {
    /// A table that holds `n` ids without growing.
    pub(crate) fn with_capacity(n: usize) -> Self {
        let buckets = (n * 2).next_power_of_two().max(MIN_BUCKETS);
        IdTable {
            buckets: alloc::vec![FREE; buckets],
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// The id whose key has `hash` and for which `eq` answers true.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let tag = tag_of(hash);
        let mask = self.mask();
        let mut i = tag as usize & mask;
        loop {
            let b = self.buckets[i];
            if b.id == EMPTY {
                return None;
            }
            if b.tag == tag && eq(b.id) {
                return Some(b.id);
            }
            i = (i + 1) & mask;
        }
    }

    /// Adds `id` under `hash`; the caller knows its key is not in the table.
    pub(crate) fn insert(&mut self, hash: u64, id: u32) {
        debug_assert_ne!(id, EMPTY);
        if (self.len + 1) * 2 > self.buckets.len() {
            self.grow();
        }
        self.place(Bucket {
            tag: tag_of(hash),
            id,
        });
        self.len += 1;
    }

    fn place(&mut self, b: Bucket) {
        let mask = self.mask();
        let mut i = b.tag as usize & mask;
        while self.buckets[i].id != EMPTY {
            i = (i + 1) & mask;
        }
        self.buckets[i] = b;
    }

    fn grow(&mut self) {
        let size = (self.buckets.len() * 2).max(MIN_BUCKETS);
        let old = core::mem::replace(&mut self.buckets, alloc::vec![FREE; size]);
        for b in old {
            if b.id != EMPTY {
                self.place(b);
            }
        }
    }

    /// Removes `id`, which was inserted under `hash`. Returns whether it was there.
    pub(crate) fn remove(&mut self, hash: u64, id: u32) -> bool {
        if self.len == 0 {
            return false;
        }
        let tag = tag_of(hash);
        let mask = self.mask();
        let mut hole = tag as usize & mask;
        loop {
            let b = self.buckets[hole];
            if b.id == EMPTY {
                return false;
            }
            if b.id == id {
                break;
            }
            hole = (hole + 1) & mask;
        }
        // Backward shift: pull later members of the probe run into the hole when the hole
        // lies between their home bucket and where they sit.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b.id == EMPTY {
                break;
            }
            let home = b.tag as usize & mask;
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = FREE;
        self.len -= 1;
        true
    }

    /// Every id in the table (for invariant checks only: the order means nothing).
    pub(crate) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets.iter().filter(|b| b.id != EMPTY).map(|b| b.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::collections::BTreeMap;

    /// The table against a BTreeMap under random inserts and removes, with colliding tags.
    #[test]
    fn behaves_as_a_map() {
        let mut t = IdTable::default();
        let mut reference: BTreeMap<u32, u64> = BTreeMap::new();
        let mut x = 0x1234_5678_9abc_def1u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = (x % 600) as u32;
            // Few distinct hashes: many tag collisions and long probe runs.
            let h = (x >> 20) % 97;
            match reference.get(&id).copied() {
                Some(old) if x & 1 == 0 => {
                    assert!(t.remove(old, id));
                    reference.remove(&id);
                }
                Some(_) => {}
                None => {
                    t.insert(h, id);
                    reference.insert(id, h);
                }
            }
            assert_eq!(t.len(), reference.len());
        }
        for (&id, &h) in &reference {
            assert_eq!(t.find(h, |c| c == id), Some(id));
        }
        let mut ids: alloc::vec::Vec<u32> = t.ids().collect();
        ids.sort_unstable();
        assert_eq!(
            ids,
            reference.keys().copied().collect::<alloc::vec::Vec<_>>()
        );
        assert_eq!(t.find(1_000_003, |_| true), None);
    }
}
