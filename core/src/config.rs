//! Configuration of the core, validated before use.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

/// Most secondary tiers one manager may have (a block takes at most one cascade pin per tier).
pub const MAX_TIERS: usize = 64;

/// Most blocks a tier (primary or secondary) may have: ARC's ids, ghosts included, use 30 bits;
/// the reuse policy's, 29.
pub const MAX_BLOCKS: u32 = (1 << 29) - 2;

/// Which eviction policy a tier uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// Least recently used.
    #[default]
    Lru,
    /// vLLM's simplified adaptive replacement cache (T1/T2 with ghost lists B1/B2).
    Arc,
    /// kvtier's reuse-aware LRU (rules U1–U10), for the primary only: blocks reused or back
    /// after an eviction outlive new ones by a bonus that starts at two turnovers of the
    /// cache and adapts to how often each kind comes back.
    Reuse,
}

/// How complete a secondary tier's index is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierKind {
    /// The index is complete: only this node writes the tier (a local file tier).
    /// A key absent from the index is absent from the tier.
    Authoritative,
    /// Other nodes write the tier too (a remote store): a key absent from the index may still
    /// be there, so lookups ask the tier with an existence probe and cache the answer.
    Shared,
}

/// When a secondary tier is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Admission {
    /// vLLM 0.33's rule: every block the engine stores is cascaded to the tier when its
    /// store completes (M6), so the tier copies what the primary holds (inclusive).
    #[default]
    Cascade,
    /// A victim tier (rules V1–V4): a block is written when it is among the primary's next
    /// `lookahead` victims at the end of a step, and the primary's evictions touch the blocks
    /// they take (T12: the tier's most recent; ARC's frequent list). The tier holds what the
    /// primary is about to lose or has lost, not a second copy of what it keeps, so the two
    /// hold more blocks together.
    /// A block the primary holds is not on the tier until it nears eviction: it does not
    /// outlive the process.
    Victim {
        /// How many of the primary's next victims are written ahead at each step's end: at
        /// least the blocks one step can store (a block evicted before it was written is
        /// lost to the hierarchy, counted in `victims_missed`).
        lookahead: u32,
    },
}

/// One secondary tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    /// Authoritative (local) or shared (remote) index.
    pub kind: TierKind,
    /// Capacity in blocks; eviction makes room beyond it.
    pub capacity_blocks: u32,
    /// The tier's own eviction policy.
    pub policy: PolicyKind,
    /// Back-pressure bound: at most this many store jobs outstanding; a cascade beyond it skips
    /// the tier for those blocks.
    pub max_outstanding_stores: u32,
    /// Shared tiers: how many steps an existence probe's "not found" answer is trusted.
    pub absent_ttl_steps: u32,
    /// Shared tiers: at most this many existence probes outstanding; beyond it a lookup of an
    /// unknown key skips the tier (counted in `probes_skipped`).
    pub max_outstanding_probes: u32,
    /// When the tier is written: on every completed store (vLLM's), or as a victim tier.
    pub admission: Admission,
}

impl TierConfig {
    /// A tier with the given kind and capacity and the default policy and bounds.
    pub fn new(kind: TierKind, capacity_blocks: u32) -> Self {
        TierConfig {
            kind,
            capacity_blocks,
            policy: PolicyKind::Lru,
            max_outstanding_stores: 64,
            absent_ttl_steps: 64,
            max_outstanding_probes: 256,
            admission: Admission::Cascade,
        }
    }
}

/// Tier health thresholds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failed jobs after which a tier is Down.
    pub failures_to_down: u32,
    /// Steps a Down tier waits before one probe job decides whether it is Up again.
    pub probe_interval_steps: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            failures_to_down: 3,
            probe_interval_steps: 100,
        }
    }
}

/// The optional reuse filter: only store keys that `lookup` has seen often enough.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReuseFilter {
    /// Times a key must have been offered to `prepare_store` before it is stored (at least 2).
    pub store_threshold: u32,
    /// Keys the tracker remembers; the least recently seen is forgotten first.
    pub max_tracker_size: u32,
}

/// The most gaps [`ReturnHorizon::min_gaps`] may ask for: the counts are halved when they
/// reach 4,096, which leaves more than 1,024, so a horizon once formed stays.
pub const MAX_HORIZON_MIN_GAPS: u32 = 1024;

/// How the reuse-aware LRU learns its return horizon (U10). The defaults suit real caches;
/// the differential checks sample every key and need one gap or three, so that their small
/// states reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReturnHorizon {
    /// One key in this many, by its hash, is sampled (a power of two).
    pub sample: u32,
    /// Sampled return gaps counted before there is a horizon (1 ..= 1,024).
    pub min_gaps: u32,
}

impl Default for ReturnHorizon {
    fn default() -> Self {
        ReturnHorizon {
            sample: 16,
            min_gaps: 128,
        }
    }
}

/// Configuration of a [`Manager`](crate::Manager).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Slots in the primary tier.
    pub num_blocks: u32,
    /// The primary tier's eviction policy.
    pub policy: PolicyKind,
    /// Secondary tiers, asked in this order.
    pub tiers: Vec<TierConfig>,
    /// After a failed promotion of key K from tier T, lookups of K skip T for this many steps.
    pub promotion_cooldown_steps: u32,
    /// Tier health thresholds.
    pub health: HealthConfig,
    /// Optional reuse filter on stores.
    pub reuse: Option<ReuseFilter>,
    /// Record [`Event`](crate::Event)s for `take_events`. Events accumulate until taken: turn
    /// this off when the engine does not consume them.
    pub events: bool,
    /// How the primary's reuse-aware LRU learns its return horizon (U10); `None`: it has
    /// none (U1–U9 alone). Other policies ignore it.
    pub return_horizon: Option<ReturnHorizon>,
    /// ★9 (W1–W7): how long, in the units of [`Manager::set_clock`](crate::Manager::set_clock),
    /// one request may be answered `HitPending` or `Retry` for one key before its lookups of
    /// that key answer `Miss`. `None`: no deadline, as vLLM 0.33.
    pub wait_deadline: Option<u64>,
}

impl Config {
    /// A primary-only configuration with `num_blocks` slots and defaults elsewhere.
    pub fn new(num_blocks: u32) -> Self {
        Config {
            num_blocks,
            policy: PolicyKind::Lru,
            tiers: Vec::new(),
            promotion_cooldown_steps: 16,
            health: HealthConfig::default(),
            reuse: None,
            events: true,
            return_horizon: Some(ReturnHorizon::default()),
            wait_deadline: None,
        }
    }

    /// Checks every field; the error names the first invalid one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, reason: &'static str| {
            Err(ConfigError::Invalid {
                field: String::from(field),
                reason,
            })
        };
        if self.num_blocks == 0 {
            return bad("num_blocks", "must be at least 1");
        }
        if self.num_blocks > MAX_BLOCKS {
            return bad("num_blocks", "must be at most 536870910");
        }
        if let Some(h) = self.return_horizon {
            if !h.sample.is_power_of_two() {
                return bad(
                    "return_horizon.sample",
                    "must be a power of two (1, 2, 4, …)",
                );
            }
            if h.min_gaps == 0 || h.min_gaps > MAX_HORIZON_MIN_GAPS {
                return bad(
                    "return_horizon.min_gaps",
                    "must be 1 ..= 1024 (the gap counts are halved at 4,096, and a horizon \
                     stays once formed)",
                );
            }
        }
        if self.tiers.len() > MAX_TIERS {
            return bad("tiers", "at most 64 secondary tiers");
        }
        for (i, t) in self.tiers.iter().enumerate() {
            t.validate(&format!("tiers[{i}]"), false)?;
        }
        if self.promotion_cooldown_steps == 0 {
            return bad("promotion_cooldown_steps", "must be at least 1");
        }
        self.health.validate()?;
        if self.wait_deadline == Some(0) {
            return bad("wait_deadline", "must be at least 1");
        }
        if let Some(r) = self.reuse {
            if r.store_threshold < 2 {
                return bad("reuse.store_threshold", "must be at least 2");
            }
            if r.max_tracker_size == 0 {
                return bad("reuse.max_tracker_size", "must be at least 1");
            }
        }
        Ok(())
    }
}

fn invalid(field: String, reason: &'static str) -> Result<(), ConfigError> {
    Err(ConfigError::Invalid { field, reason })
}

impl TierConfig {
    /// Checks one tier's values; `field` names the tier in the error (`tiers[1]`, `tier`).
    /// `reuse`: whether the reuse-aware LRU is taken (a hosted tier's host may feed it its
    /// touches; under kvtier's `Manager` it would never see a finish).
    pub(crate) fn validate(&self, field: &str, reuse: bool) -> Result<(), ConfigError> {
        let bad = |name: &str, reason| invalid(format!("{field}.{name}"), reason);
        if self.capacity_blocks == 0 {
            return bad("capacity_blocks", "must be at least 1");
        }
        if self.capacity_blocks > MAX_BLOCKS {
            return bad("capacity_blocks", "must be at most 536870910");
        }
        if self.policy == PolicyKind::Reuse && !reuse {
            return bad(
                "policy",
                "the reuse-aware LRU learns from requests' finishes, which only the primary \
                 sees: a secondary tier takes Lru or Arc",
            );
        }
        if self.max_outstanding_stores == 0 {
            return bad("max_outstanding_stores", "must be at least 1");
        }
        if self.admission == (Admission::Victim { lookahead: 0 }) {
            return bad(
                "admission",
                "a victim tier's lookahead must be at least 1 block",
            );
        }
        if self.kind == TierKind::Shared && self.absent_ttl_steps == 0 {
            return bad("absent_ttl_steps", "must be at least 1");
        }
        Ok(())
    }
}

impl HealthConfig {
    /// Checks the thresholds (each at least 1).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.failures_to_down == 0 {
            return invalid(
                String::from("health.failures_to_down"),
                "must be at least 1",
            );
        }
        if self.probe_interval_steps == 0 {
            return invalid(
                String::from("health.probe_interval_steps"),
                "must be at least 1",
            );
        }
        Ok(())
    }
}

/// A configuration value is out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The named field is invalid.
    #[error("invalid config field `{field}`: {reason}")]
    Invalid {
        /// The field's path, for example `tiers[1].capacity_blocks`.
        field: String,
        /// Why it is invalid.
        reason: &'static str,
    },
}
