//! Belady's offline optimum: the best hit ratio any cache of a given capacity could reach on
//! a known sequence of block references (evict the block used farthest in the future; do not
//! admit a block used later than everything cached).

use std::collections::{BTreeMap, BTreeSet};

/// Hits of the optimal cache of `capacity` blocks on `refs`.
///
/// Every reference counts, also those after a miss in the same request: this is an upper
/// bound on the prefix hits a real cache can reach.
pub fn optimal_hits(refs: &[u64], capacity: usize) -> u64 {
    if capacity == 0 {
        return 0;
    }
    // next[i]: index of the next reference to the same block, or usize::MAX.
    let mut next = vec![usize::MAX; refs.len()];
    let mut last: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, b) in refs.iter().enumerate().rev() {
        if let Some(&j) = last.get(b) {
            next[i] = j;
        }
        last.insert(*b, i);
    }
    // Cached blocks by their next use; `at` maps a block to its entry.
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut at: BTreeMap<u64, usize> = BTreeMap::new();
    let mut hits = 0;
    for (i, &b) in refs.iter().enumerate() {
        if let Some(n) = at.remove(&b) {
            hits += 1;
            by_next.remove(&(n, b));
        } else if by_next.len() >= capacity {
            let &(far, victim) = by_next.last().expect("the cache is full");
            if next[i] >= far {
                continue; // bypass: this block is needed later than anything cached
            }
            by_next.remove(&(far, victim));
            at.remove(&victim);
        }
        if next[i] != usize::MAX {
            by_next.insert((next[i], b));
            at.insert(b, next[i]);
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_textbook_example() {
        // 3 frames: 7, 0, 1 and 2 (evicting 7) and 3 (evicting 1) miss; 4 is never used
        // again, so it bypasses the cache and 2, 0, 3 stay: 6 misses, 7 hits. (Demand paging,
        // which must admit 4, evicts 0 and misses it once more: 6 hits.)
        let refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2];
        assert_eq!(optimal_hits(&refs, 3), 7);
        assert_eq!(optimal_hits(&refs, 2), 5);
        assert_eq!(optimal_hits(&refs, 0), 0);
        assert_eq!(
            optimal_hits(&refs, 100),
            13 - 6,
            "only the 6 first uses miss"
        );
    }

    #[test]
    fn never_below_lru() {
        let refs: Vec<u64> = (0..2000u64)
            .map(|i| (i * 7919) % 97 % (1 + i % 31))
            .collect();
        for cap in [1, 4, 16, 64] {
            let mut lru: Vec<u64> = Vec::new();
            let mut lru_hits = 0;
            for &b in &refs {
                if let Some(p) = lru.iter().position(|&x| x == b) {
                    lru.remove(p);
                    lru_hits += 1;
                } else if lru.len() == cap {
                    lru.remove(0);
                }
                lru.push(b);
            }
            assert!(optimal_hits(&refs, cap) >= lru_hits, "capacity {cap}");
        }
    }
}
