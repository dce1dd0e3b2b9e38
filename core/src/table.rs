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
#[derive(Clone, Debug)]
pub(crate) struct IdTable {
    buckets: Vec<Bucket>,
    len: usize,
    /// Grow when more than this share (in percent) of the buckets would be used.
    max_load: usize,
}

impl Default for IdTable {
    fn default() -> Self {
        IdTable {
            buckets: Vec::new(),
            len: 0,
            max_load: 50,
        }
    }
}

impl IdTable {
    /// A table that holds `n` ids without growing, at most `max_load` percent full.
    pub(crate) fn with_capacity(n: usize, max_load: usize) -> Self {
        let buckets = (n * 100).div_ceil(max_load).max(MIN_BUCKETS);
        IdTable {
            buckets: alloc::vec![FREE; buckets],
            len: 0,
            max_load,
        }
    }

    /// An empty table that packs ids up to 80 % of its buckets: less memory at the cost of
    /// longer probes (ARC's ghosts, which only steer `p`).
    pub(crate) fn dense() -> Self {
        IdTable {
            max_load: 80,
            ..IdTable::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Removes every id, keeping the buckets.
    pub(crate) fn clear(&mut self) {
        self.buckets.fill(FREE);
        self.len = 0;
    }

    /// The bucket where a tag's probe run starts: the tag scaled to the bucket count (no
    /// power-of-two rounding, so a table can be sized to its load exactly).
    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.buckets.len() as u64) >> 32) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    /// How far bucket `j` is past `from`, going forward and wrapping.
    #[inline]
    fn distance(&self, from: usize, j: usize) -> usize {
        if j >= from {
            j - from
        } else {
            j + self.buckets.len() - from
        }
    }

    /// The id whose key has `hash` and for which `eq` answers true.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let tag = tag_of(hash);
        let mut i = self.home(tag);
        loop {
            let b = self.buckets[i];
            if b.id == EMPTY {
                return None;
            }
            if b.tag == tag && eq(b.id) {
                return Some(b.id);
            }
            i = self.next(i);
        }
    }

    /// Adds `id` under `hash`; the caller knows its key is not in the table.
    pub(crate) fn insert(&mut self, hash: u64, id: u32) {
        debug_assert_ne!(id, EMPTY);
        if (self.len + 1) * 100 > self.buckets.len() * self.max_load {
            self.grow();
        }
        self.place(Bucket {
            tag: tag_of(hash),
            id,
        });
        self.len += 1;
    }

    fn place(&mut self, b: Bucket) {
        let mut i = self.home(b.tag);
        while self.buckets[i].id != EMPTY {
            i = self.next(i);
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
        let mut hole = self.home(tag_of(hash));
        loop {
            let b = self.buckets[hole];
            if b.id == EMPTY {
                return false;
            }
            if b.id == id {
                break;
            }
            hole = self.next(hole);
        }
        // Backward shift: pull later members of the probe run into the hole when the hole
        // lies between their home bucket and where they sit.
        let mut j = hole;
        loop {
            j = self.next(j);
            let b = self.buckets[j];
            if b.id == EMPTY {
                break;
            }
            let home = self.home(b.tag);
            if self.distance(home, j) >= self.distance(hole, j) {
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
        behaves_as_a_map_with(IdTable::default());
        behaves_as_a_map_with(IdTable::dense());
        behaves_as_a_map_with(IdTable::with_capacity(300, 50));
        behaves_as_a_map_with(IdTable::with_capacity(300, 80));
    }

    /// A deterministic stream of pseudo-random numbers (xorshift64).
    fn xorshift(mut x: u64) -> impl Iterator<Item = u64> {
        core::iter::from_fn(move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Some(x)
        })
    }

    /// Runs that wrap around the end of a nearly full table, with homes in its last buckets:
    /// every deletion's backward shift measures distances across the wrap.
    #[test]
    fn wrapped_runs_survive_deletions() {
        let mut t = IdTable::with_capacity(14, 90);
        let n = t.buckets.len();
        // Hashes whose probe runs start in the last three buckets.
        let homes: alloc::vec::Vec<u64> = (1u64..)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .filter(|&h| t.home(tag_of(h)) >= n - 3)
            .take(3)
            .collect();
        let mut reference: BTreeMap<u32, u64> = BTreeMap::new();
        for x in xorshift(0x0bad_5eed_1234_5678).take(5_000) {
            let id = (x % 14) as u32;
            match reference.get(&id).copied() {
                Some(h) => {
                    assert!(t.remove(h, id));
                    reference.remove(&id);
                }
                None => {
                    let h = homes[(x >> 8) as usize % homes.len()];
                    t.insert(h, id);
                    reference.insert(id, h);
                }
            }
            for (&id, &h) in &reference {
                assert_eq!(t.find(h, |c| c == id), Some(id), "id {id} lost");
            }
        }
        assert_eq!(t.buckets.len(), n, "sized once");
    }

    fn behaves_as_a_map_with(mut t: IdTable) {
        let mut reference: BTreeMap<u32, u64> = BTreeMap::new();
        for x in xorshift(0x1234_5678_9abc_def1).take(20_000) {
            let id = (x % 600) as u32;
            // Few distinct hashes, spread over the whole range: many equal tags, long probe
            // runs, and runs that wrap around the end of the table.
            let h = ((x >> 20) % 97).wrapping_mul(0x9E37_79B9_7F4A_7C15);
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
        assert_eq!(
            t.find(1_000_003u64.wrapping_mul(0x9E37_79B9_7F4A_7C15), |_| false),
            None
        );
    }
}
