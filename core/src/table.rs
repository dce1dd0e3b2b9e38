//! `IdTable`: a deterministic hash index from key hashes to dense ids.
//!
//! The keys live with their owners (the slot table, a tier's entries, ARC's ghosts, a request's
//! record); the table keeps only the ids, and asks its owner to compare keys, and to hash its
//! ids again whenever it rebuilds itself (when it grows, and when removals have left enough
//! deleted buckets that it rebuilds in place: so even a table sized once asks). It is a SwissTable (`hashbrown`'s `HashTable`): a control byte
//! per bucket holds 7 bits of the hash, so a lookup compares a group of control bytes at once
//! and asks the owner only on a 7-bit match (1 in 128 for a different key), and a miss touches
//! nothing but the compact control bytes. The hash is the key's fixed hash (no per-process
//! seed), so the same operations give the same table on every run; behaviour never depends on
//! the table's order (only invariant checks iterate). The one place where the layout could
//! decide is between two ids whose owner says both are equal, which owners never allow except
//! ARC's ghosts, compared by hash alone (see `ArcPolicy`).

use crate::key::Key;

/// The 64-bit hash of a key (carried by the key, computed once).
#[inline]
pub(crate) fn hash(key: &Key) -> u64 {
    key.hash64()
}

/// Maps key hashes to ids; the owner compares keys and rehashes ids.
#[derive(Clone, Default)]
pub(crate) struct IdTable {
    table: hashbrown::HashTable<u32>,
}

/// The ids in order: what the table holds, not where (a lookup may grow the table, which moves
/// ids without changing them).
impl core::fmt::Debug for IdTable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut ids: alloc::vec::Vec<u32> = self.ids().collect();
        ids.sort_unstable();
        f.debug_struct("IdTable").field("ids", &ids).finish()
    }
}

impl IdTable {
    /// A table that holds `n` ids without growing.
    pub(crate) fn with_capacity(n: usize) -> Self {
        IdTable {
            table: hashbrown::HashTable::with_capacity(n),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Removes every id, keeping the buckets.
    pub(crate) fn clear(&mut self) {
        self.table.clear();
    }

    /// The id whose key has `hash` and for which `eq` answers true.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.table.find(hash, |&id| eq(id)).copied()
    }

    /// Adds `id` under `hash`; the caller knows its key is not in the table. `rehash` gives
    /// the hash of an id already in the table (asked whenever the table rebuilds itself, which
    /// may happen at any insert: every id in the table must have its owner's entry set).
    #[inline]
    pub(crate) fn insert(&mut self, hash: u64, id: u32, rehash: impl Fn(u32) -> u64) {
        self.table.insert_unique(hash, id, |&id| rehash(id));
    }

    /// The id for which `eq` answers true under `hash`, or else `new_id()` added under it, with
    /// whether it was added: one probe for both. `rehash` as for [`Self::insert`].
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(u32) -> bool,
        rehash: impl Fn(u32) -> u64,
        new_id: impl FnOnce() -> u32,
    ) -> (u32, bool) {
        match self.table.entry(hash, |&id| eq(id), |&id| rehash(id)) {
            hashbrown::hash_table::Entry::Occupied(e) => (*e.get(), false),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let id = new_id();
                e.insert(id);
                (id, true)
            }
        }
    }

    /// Removes `id`, which was inserted under `hash`. Returns whether it was there.
    #[inline]
    pub(crate) fn remove(&mut self, hash: u64, id: u32) -> bool {
        match self.table.find_entry(hash, |&b| b == id) {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Every id in the table (for invariant checks only: the order means nothing).
    pub(crate) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::collections::BTreeMap;

    /// The table against a BTreeMap under random inserts and removes, with colliding hashes,
    /// through growth.
    #[test]
    fn behaves_as_a_map() {
        behaves_as_a_map_with(IdTable::default());
        behaves_as_a_map_with(IdTable::with_capacity(300));
        behaves_as_a_map_with(IdTable::with_capacity(14));
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

    fn behaves_as_a_map_with(mut t: IdTable) {
        let mut reference: BTreeMap<u32, u64> = BTreeMap::new();
        for x in xorshift(0x1234_5678_9abc_def1).take(20_000) {
            let id = (x % 600) as u32;
            // Few distinct hashes, spread over the whole range: many ids share one hash, so
            // the owner's `eq` decides, and removals leave deleted buckets behind.
            let h = ((x >> 20) % 97).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            match reference.get(&id).copied() {
                Some(old) if x & 1 == 0 => {
                    assert!(t.remove(old, id));
                    reference.remove(&id);
                }
                Some(_) => {}
                None => {
                    t.insert(h, id, |other| reference[&other]);
                    reference.insert(id, h);
                }
            }
            assert_eq!(t.len(), reference.len());
        }
        for (&id, &h) in &reference {
            assert_eq!(t.find(h, |c| c == id), Some(id));
            let found = t.find_or_insert(h, |c| c == id, |c| reference[&c], || unreachable!());
            assert_eq!(found, (id, false));
        }
        let fresh = 1_000_003u64.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let before = t.len();
        assert_eq!(
            t.find_or_insert(fresh, |_| false, |c| reference[&c], || 600),
            (600, true)
        );
        assert_eq!(t.len(), before + 1);
        assert_eq!(t.find(fresh, |c| c == 600), Some(600));
        assert!(t.remove(fresh, 600));
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
