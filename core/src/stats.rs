//! Observability: a snapshot of counters.

use alloc::vec::Vec;

/// Health of a secondary tier (rules H1–H6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Lookups and cascades use the tier.
    Up,
    /// Too many consecutive failures: the tier is skipped until a probe succeeds.
    Down {
        /// The step it went Down (or its last probe failed).
        since: u64,
    },
    /// A health probe job is outstanding; the tier is still skipped.
    Probing,
    /// The manager shut down.
    Closed,
}

/// Counters of one secondary tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks held or being written.
    pub blocks: u64,
    /// Lookups that found the block here and started a promotion.
    pub hits: u64,
    /// Store jobs submitted by cascades.
    pub cascades_submitted: u64,
    /// Blocks written by those jobs.
    pub blocks_cascaded: u64,
    /// Cascaded blocks skipped because the tier already held them.
    pub skipped_held: u64,
    /// Cascaded blocks skipped because no room could be made.
    pub skipped_full: u64,
    /// Cascaded blocks skipped by the back-pressure bound.
    pub skipped_backpressure: u64,
    /// Cascaded blocks skipped because the tier was not Up.
    pub skipped_down: u64,
    /// Blocks evicted from the tier.
    pub evictions: u64,
    /// A victim tier: blocks the primary evicted that this tier neither held nor was
    /// writing (the look-ahead was shorter than a step's evictions, back-pressure, or the
    /// tier was not Up); lost unless another tier holds them.
    pub victims_missed: u64,
    /// Blocks whose write failed.
    pub write_failures: u64,
    /// Blocks whose read (promotion) failed.
    pub read_failures: u64,
    /// Blocks a load found gone from a shared store (its memory policy evicted them, they
    /// expired, or it was flushed): forgotten (T15), not failures (J6).
    pub read_missing: u64,
    /// Jobs that ended with at least one failure.
    pub jobs_failed: u64,
    /// Existence probes submitted (shared tiers).
    pub probes: u64,
    /// Lookups that skipped the tier because its probes were at their bound.
    pub probes_skipped: u64,
    /// Times the tier went Down.
    pub went_down: u64,
    /// Times a health probe brought it back Up.
    pub came_up: u64,
}

/// A snapshot of the manager's counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    /// Steps ended.
    pub step: u64,
    /// Lookups answered.
    pub lookups: u64,
    /// Lookups answered Hit (primary).
    pub hits: u64,
    /// Lookups answered Miss.
    pub misses: u64,
    /// Lookups answered Retry (a secondary tier busy).
    pub retries: u64,
    /// Lookups answered HitPending (a store or promotion in flight, including the lookups
    /// that started a promotion).
    pub hits_pending: u64,
    /// Lookups that stopped waiting for a block at the deadline and answered Miss (W3): the
    /// engine computed the block instead.
    pub wait_timeouts: u64,
    /// Offered keys the reuse filter left out of stores.
    pub stores_skipped: u64,
    /// Promotions started.
    pub promotions_started: u64,
    /// Promoted blocks that became Ready.
    pub promotions_succeeded: u64,
    /// Promoted blocks whose load failed.
    pub promotions_failed: u64,
    /// Promotions from a shared tier whose block the store no longer held (J6).
    pub promotions_missing: u64,
    /// Promotions not started because the primary could not make room without evicting a
    /// pinned, Pending or protected block (answered Miss).
    pub promotions_refused: u64,
    /// Blocks evicted from the primary.
    pub evictions: u64,
    /// Of those, blocks evicted while idle past the reuse-aware LRU's return horizon (U10):
    /// 0 under the other policies.
    pub evictions_past_horizon: u64,
    /// Load pins outstanding (taken by `prepare_load`).
    pub load_pins: u64,
    /// Cascade pins outstanding (one per block per store job).
    pub job_pins: u64,
    /// Jobs submitted and not yet ended.
    pub jobs_outstanding: u64,
    /// Per secondary tier, with its health.
    pub tiers: Vec<(Health, TierStats)>,
}
