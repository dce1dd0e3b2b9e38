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
    /// A failed store or promotion freed the blocks: they were never announced as stored, so
    /// consumers of public KV events may skip it (vLLM 0.33's metadata-only removal). Keys that
    /// are held again by the time the events are taken are left out.
    Discarded,
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

/// The answer of a lookup, with vLLM 0.33's meanings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Lookup {
    /// The block is Ready in the primary tier.
    Hit,
    /// The block is in the primary tier but not readable yet: its store, or its promotion
    /// from a secondary tier, is in flight. The engine counts it as a hit and asks again in a
    /// later step.
    HitPending,
    /// A secondary tier cannot answer yet (a write or an existence probe is in flight): ask
    /// again in a later step.
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
        /// The request whose store this cascades ([`RequestId::WRITE_AHEAD`] for a victim
        /// tier's write-ahead, V2).
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
    /// Store and load only: the blocks in `succeeded` moved, those in `missing` are no longer
    /// in the store, the others failed.
    Partial {
        /// The blocks that succeeded.
        succeeded: Vec<Key>,
        /// Loads from a shared tier only (J6): blocks the store no longer holds (its own
        /// memory policy evicted them, they expired, or it was flushed). Not a failure: the
        /// tier forgets them (T15) and stays healthy. Empty for every other job.
        missing: Vec<Key>,
    },
    /// Exists: the tier does not hold the key. Load from a shared tier: the store holds none
    /// of the job's blocks any more (every block missing, J6).
    NotFound,
}

impl Outcome {
    /// Store and load: the blocks in `succeeded` moved, the others failed.
    pub fn partial(succeeded: Vec<Key>) -> Self {
        Outcome::Partial {
            succeeded,
            missing: Vec::new(),
        }
    }
}

/// The end of one job, handed to the core by the IO layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobResult {
    /// The job.
    pub job: JobId,
    /// How it ended.
    pub outcome: Outcome,
}
