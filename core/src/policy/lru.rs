//! Least recently used: one recency list (rules L1–L3).

use alloc::string::String;
use alloc::vec::Vec;

use super::{EvictionPolicy, Lists};
use crate::key::Key;

const LIST: usize = 0;

/// LRU over resident ids: insertion and touch move to the most recent end; victims come from
/// the least recent end.
#[derive(Clone, Debug)]
pub struct LruPolicy {
    order: Lists<1>,
}

impl LruPolicy {
    /// An empty LRU sized for `capacity` ids.
    pub fn with_capacity(capacity: usize) -> Self {
        LruPolicy {
            order: Lists::with_capacity(capacity),
        }
    }
}

impl LruPolicy {
    /// Ids from least to most recent.
    pub(crate) fn order(&self) -> impl Iterator<Item = u32> + '_ {
        self.order.iter(LIST)
    }
}

impl EvictionPolicy for LruPolicy {
    fn insert(&mut self, id: u32, _key: &Key) {
        self.order.push_back(LIST, id); // L1
    }

    fn remove(&mut self, id: u32) {
        self.order.remove(id);
    }

    fn touch(&mut self, _key: &Key, resident: Option<(u32, bool)>) {
        if let Some((id, _)) = resident {
            self.order.move_to_back(LIST, id); // L2
        }
    }

    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        if n == 0 {
            return;
        }
        let mut found = 0;
        for id in self.order.iter(LIST) {
            // L3: least recent first.
            if eligible(id) {
                out.push(id);
                found += 1;
                if found == n {
                    return;
                }
            }
        }
    }

    fn evict(&mut self, id: u32, _key: Key) {
        self.order.remove(id);
    }

    fn contains(&self, id: u32) -> bool {
        self.order.list_of(id).is_some()
    }

    fn len(&self) -> usize {
        self.order.len(LIST)
    }

    fn check(&self) -> Result<(), String> {
        self.order.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_sees_a_broken_list() {
        let mut p = LruPolicy::with_capacity(2);
        p.insert(0, &Key::from([0u8]));
        p.check().unwrap();
        p.order.corrupt_len(0);
        assert!(p.check().is_err());
        assert!(
            crate::policy::Policy::Lru(p).check().is_err(),
            "the enum delegates"
        );
    }
}
