//! Eviction policies behind one trait: LRU and vLLM's simplified ARC.
//!
//! A policy orders *resident entries*, named by dense ids (a primary slot, or a tier index
//! entry), and chooses victims among those its caller calls eligible. It never decides
//! eligibility itself: pins, readers, Pending state and protection belong to the caller.

mod arc;
mod list;
mod lru;

use alloc::string::String;
use alloc::vec::Vec;

pub use self::arc::ArcPolicy;
pub use self::lru::LruPolicy;
pub(crate) use list::Lists;

use crate::config::PolicyKind;
use crate::key::Key;

/// An eviction policy over resident entries with dense `u32` ids.
pub trait EvictionPolicy {
    /// A new resident entry (rules L1, A1).
    fn insert(&mut self, id: u32, key: &Key);
    /// An entry leaves without being evicted (a failed store, a deletion); no ghost is kept.
    fn remove(&mut self, id: u32);
    /// A recency update of `key`; `resident` is its id and whether it is Ready, if resident
    /// (rules L2, A2–A5). Callers walk the touched keys last to first.
    fn touch(&mut self, key: &Key, resident: Option<(u32, bool)>);
    /// Appends up to `n` victims to `out`, best first, among entries for which `eligible`
    /// answers true (rules L3, A6). Fewer than `n` means no more could be found; the policy
    /// is unchanged either way.
    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>);
    /// A victim chosen by `select` has been evicted (rule A6: ARC keeps a ghost).
    fn evict(&mut self, id: u32, key: Key);
    /// Whether `id` is tracked as resident.
    fn contains(&self, id: u32) -> bool;
    /// Number of resident entries tracked.
    fn len(&self) -> usize;
    /// Whether no entry is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Checks the policy's own structure (invariant I7).
    fn check(&self) -> Result<(), String>;
}

/// The policy of one tier, chosen by configuration.
#[derive(Clone, Debug)]
pub enum Policy {
    /// Least recently used.
    Lru(LruPolicy),
    /// vLLM's simplified ARC.
    Arc(ArcPolicy),
}

impl Policy {
    /// A policy of `kind` for a tier of `capacity` entries.
    pub fn new(kind: PolicyKind, capacity: usize) -> Self {
        match kind {
            PolicyKind::Lru => Policy::Lru(LruPolicy::with_capacity(capacity)),
            PolicyKind::Arc => Policy::Arc(ArcPolicy::new(capacity)),
        }
    }

    /// ARC's target size of T1 (`p`); `None` for LRU.
    pub fn arc_target(&self) -> Option<f64> {
        match self {
            Policy::Arc(a) => Some(a.target()),
            Policy::Lru(_) => None,
        }
    }

    /// Writes the recency order to `out`, naming each id with `name`: the policy's whole
    /// behaviour-relevant state, independent of which ids were used.
    pub(crate) fn write_canonical(&self, out: &mut String, name: &dyn Fn(u32) -> String) {
        use core::fmt::Write;
        match self {
            Policy::Lru(p) => {
                out.push_str("lru[");
                for id in p.order() {
                    let _ = write!(out, "{},", name(id));
                }
                out.push(']');
            }
            Policy::Arc(a) => a.write_canonical(out, name),
        }
    }

    fn inner(&self) -> &dyn EvictionPolicy {
        match self {
            Policy::Lru(p) => p,
            Policy::Arc(p) => p,
        }
    }

    fn inner_mut(&mut self) -> &mut dyn EvictionPolicy {
        match self {
            Policy::Lru(p) => p,
            Policy::Arc(p) => p,
        }
    }
}

impl EvictionPolicy for Policy {
    fn insert(&mut self, id: u32, key: &Key) {
        self.inner_mut().insert(id, key)
    }
    fn remove(&mut self, id: u32) {
        self.inner_mut().remove(id)
    }
    fn touch(&mut self, key: &Key, resident: Option<(u32, bool)>) {
        self.inner_mut().touch(key, resident)
    }
    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        self.inner().select(n, eligible, out)
    }
    fn evict(&mut self, id: u32, key: Key) {
        self.inner_mut().evict(id, key)
    }
    fn contains(&self, id: u32) -> bool {
        self.inner().contains(id)
    }
    fn len(&self) -> usize {
        self.inner().len()
    }
    fn check(&self) -> Result<(), String> {
        self.inner().check()
    }
}
