//! Typed errors of the core. Every error leaves the state unchanged.

use alloc::string::String;

use crate::key::{JobId, Key, TierId};

/// A call the core refused. The state is exactly as it was before the call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `prepare_store` could not make room: too few Ready, unpinned, unprotected blocks.
    #[error("no room in the primary tier: {needed} slots needed, only {available} can be freed")]
    NoRoom {
        /// Slots that had to be freed.
        needed: usize,
        /// Slots that could be freed.
        available: usize,
    },
    /// `prepare_load` named a block that is absent, Pending or Promoting.
    #[error("block {key} is not ready to load")]
    NotReady {
        /// The first such key.
        key: Key,
    },
    /// `complete_load` named a block that has no load pin left for it.
    #[error("block {key} is not pinned by a load")]
    NotPinned {
        /// The first such key.
        key: Key,
    },
    /// A job result names a job that was never submitted or has already ended.
    #[error("{job} is not outstanding")]
    UnknownJob {
        /// The job.
        job: JobId,
    },
    /// A second result for the same job.
    #[error("{job} already has a result")]
    DuplicateResult {
        /// The job.
        job: JobId,
    },
    /// A partial result names a key that the job does not carry.
    #[error("{job} does not carry block {key}")]
    ForeignKey {
        /// The job.
        job: JobId,
        /// The key.
        key: Key,
    },
    /// The outcome does not fit the job's kind (for example "not found" for a store).
    #[error("outcome not valid for {job}: {reason}")]
    InvalidOutcome {
        /// The job.
        job: JobId,
        /// Why.
        reason: &'static str,
    },
    /// `reset_cache` while jobs are outstanding: end them and hand their results in first.
    #[error("cannot reset the cache: {jobs} jobs outstanding")]
    Busy {
        /// Jobs not yet ended.
        jobs: usize,
    },
    /// A hosted tier was given a job id that is still outstanding, or one of the ids it keeps
    /// for its own probes (the top bit set).
    #[error("{job} is in use: give each job a new id below 2^63")]
    JobInUse {
        /// The job.
        job: JobId,
    },
    /// A hosted tier was given a job that names a primary slot an outstanding job writes,
    /// or, for a load, reads: the two would race on the slot's bytes.
    #[error("{job} names slot {} that an outstanding job is using", slot.0)]
    SlotBusy {
        /// The job.
        job: JobId,
        /// The slot.
        slot: crate::key::SlotId,
    },
    /// A tier id beyond the configured tiers.
    #[error("{tier} is not configured")]
    UnknownTier {
        /// The tier.
        tier: TierId,
    },
}

/// A broken invariant, named by its id in `docs/state-machine.md`.
///
/// Returned by `check_invariants`; a violation is a bug in kvtier, never bad input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invariant {id} violated: {detail}")]
pub struct Violation {
    /// The invariant's id, for example `"I4"`.
    pub id: &'static str,
    /// What was found.
    pub detail: String,
}

impl Violation {
    pub(crate) fn new(id: &'static str, detail: String) -> Self {
        Violation { id, detail }
    }
}

/// Returns a [`Violation`] from the enclosing function when `cond` is false.
macro_rules! ensure {
    ($cond:expr, $id:literal, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::Violation::new($id, alloc::format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;
