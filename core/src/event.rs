//! Events (what was stored and removed) and effects (what the IO layer must do).

use alloc::sync::Arc;
use alloc::vec::Vec;

use crate::key::{JobId, Key, RequestId, SlotId, TierId};

/// Where an event happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    /// The primary tier (CPU memory).
    Primary,
    /// A secondary tier.
    Tier(TierId),
}

/// What happened to the blocks of an [`Event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The blocks became readable.
    Stored,
    /// The blocks were evicted or deleted.
    Removed,
}

/// A change of which blocks a tier holds, for the engine's KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Where.
    pub medium: Medium,
    /// What.
    pub kind: EventKind,
    /// The blocks, in the order they changed.
    pub keys: Vec<Key>,
}

/// The answer of a lookup. More variants may come (vLLM's `HitPending`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Lookup {
    /// The block is Ready in the primary tier.
    Hit,
    /// Present but not yet readable: its store or promotion into the primary is in flight.
    HitPending,
    /// The block is being written or promoted: ask again in a later step.
    Retry,
    /// No tier can provide the block: recompute it.
    Miss,
}

/// One block moved between a primary slot and a secondary tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The block.
    pub key: Key,
    /// Its primary slot.
    pub slot: SlotId,
}

/// What a job asks the IO layer to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// Write each block from its primary slot into the tier (a cascade).
    Store {
        /// The request whose store this cascades.
        request: RequestId,
        /// The blocks, in order (shared with the core's record of the job).
        blocks: Arc<[Transfer]>,
    },
    /// Read each block from the tier into its primary slot, verifying it (a promotion).
    Load {
        /// The request whose lookups started it.
        request: RequestId,
        /// The blocks, in lookup order (shared with the core's record of the job).
        blocks: Arc<[Transfer]>,
    },
    /// Ask a shared tier whether it holds `key`.
    Exists {
        /// The block.
        key: Key,
    },
    /// Probe a Down tier's health.
    Health,
}

/// A job submitted to one secondary tier. It must end in exactly one [`JobResult`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// Its id.
    pub id: JobId,
    /// Its tier.
    pub tier: TierId,
    /// What to do.
    pub kind: JobKind,
}

impl Job {
    /// The blocks a store or load job carries; empty for probes.
    pub fn blocks(&self) -> &[Transfer] {
        match &self.kind {
            JobKind::Store { blocks, .. } | JobKind::Load { blocks, .. } => blocks,
            JobKind::Exists { .. } | JobKind::Health => &[],
        }
    }
}

/// Work for the IO layer, drained with [`Manager::poll_effect`](crate::Manager::poll_effect).
///
/// Effects of one tier must be carried out in the order they are polled (a delete frees the
/// room a later store uses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Start a job; report its end with [`Manager::handle_job_result`](crate::Manager::handle_job_result).
    Submit(Job),
    /// Delete blocks from a tier. Fire and forget: no result is expected.
    Delete {
        /// The tier.
        tier: TierId,
        /// The blocks.
        keys: Vec<Key>,
    },
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every block moved (store, load), the key exists (exists), the tier is healthy (health).
    Ok,
    /// Nothing succeeded.
    Failed,
    /// Store and load only: the listed blocks succeeded, the others failed.
    Partial {
        /// The blocks that succeeded.
        succeeded: Vec<Key>,
    },
    /// Exists only: the tier does not hold the key.
    NotFound,
}

/// The end of one job, handed to the core by the IO layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobResult {
    /// The job.
    pub job: JobId,
    /// How it ended.
    pub outcome: Outcome,
}
