//! Eviction policies behind one trait: vLLM 0.33's ranked LRU and its simplified ARC, and
//! kvtier's reuse-aware LRU.
//!
//! A policy orders *resident entries*, named by dense ids (a primary slot, or a tier index
//! entry), and chooses victims among those its caller calls eligible. It never decides
//! eligibility itself: pins, readers, Pending state and protection belong to the caller.

mod arc;
mod list;
mod lru;
mod reuse;

use alloc::boxed::Box;
use alloc::string::String;
use alloc::vec::Vec;

pub use self::arc::ArcPolicy;
pub use self::lru::LruPolicy;
pub use self::reuse::{
    GHOST_GENERATION_CAPACITIES, HORIZON_PERCENTILE, MAX_BONUS_TURNOVERS, REUSE_BONUS_TURNOVERS,
    ReusePolicy,
};
pub(crate) use list::Lists;

use crate::config::{PolicyKind, ReturnHorizon};
use crate::key::Key;

/// A request's place in a ranked order (rules L1, L4): opened at the request's first access,
/// closed when it finishes. Policies without ranks give none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub(crate) sentinel: u32,
    pub(crate) rank: u64,
}

/// How a finishing request used one of its keys (rule R4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// The request stored the block and did not read it otherwise.
    Inserted,
    /// The request read the block (a load, or an offer of a block already Ready).
    Reused,
    /// The request's lookup promoted the block from a secondary tier: a block stored
    /// earlier, which the request is reading back (the policies of vLLM 0.33 count it as
    /// inserted).
    Promoted,
    /// None of these: the request only saw the key (for example, offered to a store that was
    /// refused for lack of room).
    Seen,
}

/// An eviction policy over resident entries with dense `u32` ids.
pub trait EvictionPolicy {
    /// A new resident entry, ranked after everything (rules L1 without a position, A1).
    fn insert(&mut self, id: u32, key: &Key);
    /// A new resident entry stored by the request of `run` at `position` (rules L1, A1).
    /// `key_of` names the other entries (for ties). Policies without ranks insert as usual.
    fn insert_in_run(
        &mut self,
        id: u32,
        key: &Key,
        run: Run,
        position: u64,
        key_of: &dyn Fn(u32) -> Key,
    ) {
        let _ = (run, position, key_of);
        self.insert(id, key);
    }
    /// Opens a run for a request at its first access (rule L4); `None` if the policy has no
    /// ranks.
    fn open_run(&mut self) -> Option<Run> {
        None
    }
    /// Closes a run when its request finishes; its entries keep their ranks.
    fn close_run(&mut self, run: Run) {
        let _ = run;
    }
    /// The request of `run` accessed resident entry `id` at `position` for the first time
    /// (rule L4).
    fn access(&mut self, id: u32, run: Run, position: u64, key_of: &dyn Fn(u32) -> Key) {
        let _ = (id, run, position, key_of);
    }
    /// A store of `key` is about to allocate it: a store miss (rule A7).
    fn store_miss(&mut self, key: &Key) {
        let _ = key;
    }
    /// A request of `keys` keys is finishing: its keys follow, tail first (rule U4).
    fn begin_finish(&mut self, keys: usize) {
        let _ = keys;
    }
    /// A finishing request's key, walked tail to head; `resident` is its id if resident
    /// (rules L5, A8).
    fn finish(&mut self, key: &Key, resident: Option<u32>, used: Use);
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
    fn evict(&mut self, id: u32, key: &Key);
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
    /// vLLM 0.33's ranked LRU.
    Lru(LruPolicy),
    /// vLLM's simplified ARC.
    Arc(ArcPolicy),
    /// kvtier's reuse-aware LRU (boxed: its per-class filters make it several times the
    /// others' size).
    Reuse(Box<ReusePolicy>),
}

impl Policy {
    /// A policy of `kind` for a tier of `capacity` entries.
    pub fn new(kind: PolicyKind, capacity: usize) -> Self {
        Self::with_horizon(kind, capacity, Some(ReturnHorizon::default()))
    }

    /// As [`Policy::new`], the reuse-aware LRU learning its return horizon (U10) as
    /// `horizon` says (`None`: never; the others ignore it; see
    /// [`ReusePolicy::with_horizon`] for values `Config::validate` refuses).
    pub fn with_horizon(kind: PolicyKind, capacity: usize, horizon: Option<ReturnHorizon>) -> Self {
        match kind {
            PolicyKind::Lru => Policy::Lru(LruPolicy::with_capacity(capacity)),
            PolicyKind::Arc => Policy::Arc(ArcPolicy::new(capacity)),
            PolicyKind::Reuse => {
                Policy::Reuse(Box::new(ReusePolicy::with_horizon(capacity, horizon)))
            }
        }
    }

    /// ARC's target size of T1 (`p`); `None` for LRU.
    pub fn arc_target(&self) -> Option<f64> {
        match self {
            Policy::Arc(a) => Some(a.target()),
            Policy::Lru(_) | Policy::Reuse(_) => None,
        }
    }

    /// Entries evicted while idle past the reuse-aware LRU's return horizon (U10) since the
    /// policy was made; 0 for the others.
    pub fn evicted_past_horizon(&self) -> u64 {
        match self {
            Policy::Reuse(r) => r.evicted_past_horizon(),
            Policy::Lru(_) | Policy::Arc(_) => 0,
        }
    }

    /// Writes the recency order to `out`, naming each id with `name` (which appends the
    /// name to the buffer it is given): the policy's whole
    /// behaviour-relevant state, independent of which ids were used.
    pub(crate) fn write_canonical(&self, out: &mut String, name: &dyn Fn(&mut String, u32)) {
        match self {
            Policy::Lru(p) => p.write_canonical(out, name),
            Policy::Arc(a) => a.write_canonical(out, name),
            Policy::Reuse(r) => r.write_canonical(out, name),
        }
    }

    fn inner(&self) -> &dyn EvictionPolicy {
        match self {
            Policy::Lru(p) => p,
            Policy::Arc(p) => p,
            Policy::Reuse(p) => p.as_ref(),
        }
    }

    fn inner_mut(&mut self) -> &mut dyn EvictionPolicy {
        match self {
            Policy::Lru(p) => p,
            Policy::Arc(p) => p,
            Policy::Reuse(p) => p.as_mut(),
        }
    }
}

impl EvictionPolicy for Policy {
    fn insert(&mut self, id: u32, key: &Key) {
        self.inner_mut().insert(id, key)
    }
    fn insert_in_run(
        &mut self,
        id: u32,
        key: &Key,
        run: Run,
        position: u64,
        key_of: &dyn Fn(u32) -> Key,
    ) {
        self.inner_mut()
            .insert_in_run(id, key, run, position, key_of)
    }
    fn open_run(&mut self) -> Option<Run> {
        self.inner_mut().open_run()
    }
    fn close_run(&mut self, run: Run) {
        self.inner_mut().close_run(run)
    }
    fn access(&mut self, id: u32, run: Run, position: u64, key_of: &dyn Fn(u32) -> Key) {
        self.inner_mut().access(id, run, position, key_of)
    }
    fn store_miss(&mut self, key: &Key) {
        self.inner_mut().store_miss(key)
    }
    fn begin_finish(&mut self, keys: usize) {
        self.inner_mut().begin_finish(keys)
    }
    fn finish(&mut self, key: &Key, resident: Option<u32>, used: Use) {
        self.inner_mut().finish(key, resident, used)
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
    fn evict(&mut self, id: u32, key: &Key) {
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
