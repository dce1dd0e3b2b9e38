//! The operation alphabet: every input of the core, valid or not.

use arbitrary::Arbitrary;
use kvtier_core::{
    Admission, Config, HealthConfig, Key, PolicyKind, RequestId, ReturnHorizon, ReuseFilter,
    TierConfig, TierKind,
};
use proptest::prelude::*;

/// How many distinct keys the alphabet names (`Key` bytes `[0]` .. `[KEYS - 1]`).
pub const KEYS: u8 = 6;
/// Most keys in one op's key list.
pub const MAX_LIST: usize = 4;

/// The key named by `k` (taken modulo [`KEYS`]).
pub fn key(k: u8) -> Key {
    Key::from([k % KEYS])
}

/// The keys named by a list, at most [`MAX_LIST`] of them.
pub fn keys(ks: &[u8]) -> Vec<Key> {
    ks.iter().take(MAX_LIST).map(|&k| key(k)).collect()
}

/// The request named by `r` (one of three).
pub fn request(r: u8) -> RequestId {
    RequestId(u64::from(r % 3))
}

/// How the harness ends an outstanding job.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// Everything succeeded (an existence probe: found).
    Ok,
    /// Nothing succeeded.
    Failed,
    /// The blocks whose bit is set in the mask succeeded (store and load jobs; others: Ok).
    Partial(u8),
    /// An existence probe: not found; a load from a shared tier: every block gone from the
    /// store (other jobs: Failed).
    NotFound,
    /// A load from a shared tier: the blocks whose bit is set are gone from the store, every
    /// second one of the others failed (J6); other store and load jobs: the blocks whose bit
    /// is set failed; other jobs: Ok.
    Missing(u8),
}

/// A deliberately invalid call.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// A result for a job that was never submitted.
    UnknownJob,
    /// A second result for a job already reported.
    DuplicateResult,
    /// A partial result naming a key the job does not carry.
    ForeignKey,
    /// An outcome that does not fit the job ("not found" for a store, "partial" for a probe).
    WrongOutcome,
    /// `complete_load` of a block without a load pin.
    UnpinnedLoad,
    /// `restore_tier` of a tier that is not configured.
    UnknownTier,
}

/// One input to the core.
///
/// `Arbitrary` weighs the variants like [`Op::strategy`]: common engine calls often, shutdown
/// rarely (it ends the interesting part of a run).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `lookup(request, key)`.
    Lookup {
        /// Request.
        req: u8,
        /// Key.
        key: u8,
    },
    /// `prepare_store(keys)` alone (its blocks stay Pending until a `CompleteStore`).
    PrepareStore {
        /// Keys.
        keys: Vec<u8>,
    },
    /// `complete_store(request, keys, ok)`.
    CompleteStore {
        /// Request.
        req: u8,
        /// Keys.
        keys: Vec<u8>,
        /// Whether the GPU → CPU copy succeeded.
        ok: bool,
    },
    /// `prepare_store` then `complete_store` of what it prepared: the engine's usual store.
    Store {
        /// Request.
        req: u8,
        /// Keys.
        keys: Vec<u8>,
        /// Whether the copy succeeded.
        ok: bool,
    },
    /// `prepare_load(keys)`.
    PrepareLoad {
        /// Keys.
        keys: Vec<u8>,
    },
    /// `complete_load(keys)`.
    CompleteLoad {
        /// Keys.
        keys: Vec<u8>,
    },
    /// `touch(keys)`.
    Touch {
        /// Keys.
        keys: Vec<u8>,
    },
    /// `end_step()`.
    EndStep,
    /// `set_clock(clock + advance)` (rule W1).
    Clock {
        /// How far the clock moves (0..=3; a deadline is 2..=5).
        advance: u8,
    },
    /// End one outstanding job (picked by index among those not yet reported).
    Finish {
        /// Which job.
        pick: u8,
        /// How it ends.
        how: Finish,
    },
    /// A dead server: every unreported job of the tier fails.
    TierDown {
        /// Which tier.
        tier: u8,
    },
    /// `restore_tier(tier, keys)`: blocks found on disk.
    Restore {
        /// Which tier.
        tier: u8,
        /// Keys.
        keys: Vec<u8>,
    },
    /// `set_position(request, key, 16 * pos)` (rule R2).
    Position {
        /// Request.
        req: u8,
        /// Key.
        key: u8,
        /// The end-token position, in 16-token chunks (equal positions happen).
        pos: u8,
    },
    /// `request_finished(request)` (rule R6).
    RequestFinished {
        /// Request.
        req: u8,
    },
    /// `shutdown()`.
    Shutdown,
    /// A deliberately invalid call, which must be refused without change.
    Invalid {
        /// Which.
        what: Invalid,
        /// A key or index it uses.
        arg: u8,
    },
}

impl<'a> Arbitrary<'a> for Op {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let list = |u: &mut arbitrary::Unstructured<'a>| -> arbitrary::Result<Vec<u8>> {
            let n = u.int_in_range(0..=MAX_LIST)?;
            (0..n).map(|_| u.int_in_range(0..=KEYS - 1)).collect()
        };
        let req = |u: &mut arbitrary::Unstructured<'a>| u.int_in_range(0..=2u8);
        Ok(match u.int_in_range(0..=199u8)? {
            0..=29 => Op::Lookup {
                req: req(u)?,
                key: u.int_in_range(0..=KEYS - 1)?,
            },
            30..=54 => Op::Store {
                req: req(u)?,
                keys: list(u)?,
                ok: u.ratio(7, 8)?,
            },
            55..=59 => Op::PrepareStore { keys: list(u)? },
            60..=64 => Op::CompleteStore {
                req: req(u)?,
                keys: list(u)?,
                ok: bool::arbitrary(u)?,
            },
            65..=74 => Op::PrepareLoad { keys: list(u)? },
            75..=84 => Op::CompleteLoad { keys: list(u)? },
            85..=94 => Op::Touch { keys: list(u)? },
            95..=114 => Op::EndStep,
            115..=119 => Op::Clock {
                advance: u.int_in_range(0..=3u8)?,
            },
            120..=174 => Op::Finish {
                pick: u8::arbitrary(u)?,
                how: Finish::arbitrary(u)?,
            },
            175..=179 => Op::TierDown {
                tier: u.int_in_range(0..=1u8)?,
            },
            180..=186 => Op::Restore {
                tier: u.int_in_range(0..=1u8)?,
                keys: list(u)?,
            },
            187..=190 => Op::Position {
                req: req(u)?,
                key: u.int_in_range(0..=KEYS - 1)?,
                pos: u.int_in_range(1..=8u8)?,
            },
            191..=193 => Op::RequestFinished { req: req(u)? },
            194..=198 => Op::Invalid {
                what: Invalid::arbitrary(u)?,
                arg: u8::arbitrary(u)?,
            },
            _ => Op::Shutdown,
        })
    }
}

fn key_list() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(0..KEYS, 0..=MAX_LIST)
}

fn finish() -> impl Strategy<Value = Finish> {
    prop_oneof![
        4 => Just(Finish::Ok),
        2 => Just(Finish::Failed),
        1 => any::<u8>().prop_map(Finish::Partial),
        1 => Just(Finish::NotFound),
        1 => any::<u8>().prop_map(Finish::Missing),
    ]
}

fn invalid() -> impl Strategy<Value = Invalid> {
    prop_oneof![
        Just(Invalid::UnknownJob),
        Just(Invalid::DuplicateResult),
        Just(Invalid::ForeignKey),
        Just(Invalid::WrongOutcome),
        Just(Invalid::UnpinnedLoad),
        Just(Invalid::UnknownTier),
    ]
}

impl Op {
    /// A proptest strategy over the alphabet, weighted towards the engine's common calls.
    pub fn strategy() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..3u8, 0..KEYS).prop_map(|(req, key)| Op::Lookup { req, key }),
            4 => (0..3u8, key_list(), any::<bool>())
                .prop_map(|(req, keys, ok)| Op::Store { req, keys, ok }),
            1 => key_list().prop_map(|keys| Op::PrepareStore { keys }),
            1 => (0..3u8, key_list(), any::<bool>())
                .prop_map(|(req, keys, ok)| Op::CompleteStore { req, keys, ok }),
            2 => key_list().prop_map(|keys| Op::PrepareLoad { keys }),
            2 => key_list().prop_map(|keys| Op::CompleteLoad { keys }),
            2 => key_list().prop_map(|keys| Op::Touch { keys }),
            4 => Just(Op::EndStep),
            2 => (0..=3u8).prop_map(|advance| Op::Clock { advance }),
            6 => (any::<u8>(), finish()).prop_map(|(pick, how)| Op::Finish { pick, how }),
            1 => (0..2u8).prop_map(|tier| Op::TierDown { tier }),
            1 => (0..2u8, key_list()).prop_map(|(tier, keys)| Op::Restore { tier, keys }),
            1 => (invalid(), any::<u8>()).prop_map(|(what, arg)| Op::Invalid { what, arg }),
            2 => (0..3u8, 0..KEYS, 1..=8u8).prop_map(|(req, key, pos)| Op::Position { req, key, pos }),
            1 => (0..3u8).prop_map(|req| Op::RequestFinished { req }),
            // Shutdown ends the interesting part of a run; keep it rare.
            1 => (0..20u8).prop_map(|n| if n == 0 { Op::Shutdown } else { Op::EndStep }),
        ]
    }
}

/// A small configuration chosen by one byte of entropy per field: tiny capacities so that
/// eviction, back-pressure, health and cooldowns all happen within a few dozen ops.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigChoice {
    /// Primary slots (1..=4), policy (bits 2 and 3), wait deadline (bits 4 to 6: none, or
    /// 2..=5 on the clock of [`Op::Clock`]).
    pub primary: u8,
    /// Number of tiers (0..=2) and their kinds, policies and admissions.
    pub tiers: u8,
    /// Tier capacities (1..=3 each).
    pub capacities: u8,
    /// Bounds: outstanding stores and probes (1..=2), probe interval and cooldown (1..=3).
    pub bounds: u8,
    /// Health threshold (1..=2), reuse filter, absent TTL.
    pub misc: u8,
}

impl ConfigChoice {
    /// The configuration this choice names. Always valid.
    pub fn config(self) -> Config {
        // Bit 0: ARC; else bit 1: the reuse-aware LRU; else LRU.
        let policy = |bits: u8| match bits & 3 {
            1 | 3 => PolicyKind::Arc,
            2 => PolicyKind::Reuse,
            _ => PolicyKind::Lru,
        };
        let mut c = Config::new(1 + u32::from(self.primary % 4));
        c.policy = policy(self.primary >> 2);
        // U10 off (bit 7 clear: U1–U9's due order alone), or on as states this small reach
        // it: every key sampled, a horizon after one gap or three (`misc`'s bit 7).
        c.return_horizon = (self.primary >> 7 == 1).then(|| ReturnHorizon {
            sample: 1,
            min_gaps: 1 + 2 * u32::from(self.misc >> 7),
        });
        c.wait_deadline = match (self.primary >> 4) & 3 {
            0 => None,
            d => Some(1 + u64::from(d) + u64::from((self.primary >> 6) & 1)),
        };
        let n_tiers = self.tiers % 3;
        for i in 0..n_tiers {
            let bits = self.tiers >> (2 + 3 * i);
            let kind = if bits & 1 == 1 {
                TierKind::Shared
            } else {
                TierKind::Authoritative
            };
            let mut t = TierConfig::new(kind, 1 + u32::from((self.capacities >> (4 * i)) % 3));
            // Bit 1 of the tier's three: ARC or LRU (the reuse-aware LRU is the primary's only).
            t.policy = policy((bits >> 1) & 1);
            // Bit 2: a victim tier (V1–V4), writing the next one or two victims ahead.
            if bits & 4 == 4 {
                t.admission = Admission::Victim {
                    lookahead: 1 + u32::from((self.capacities >> (4 * i + 2)) & 1),
                };
            }
            t.max_outstanding_stores = 1 + u32::from((self.bounds >> i) & 1);
            t.max_outstanding_probes = 1 + u32::from((self.bounds >> (2 + i)) & 1);
            t.absent_ttl_steps = 1 + u32::from((self.misc >> 4) % 3);
            c.tiers.push(t);
        }
        c.health = HealthConfig {
            failures_to_down: 1 + u32::from(self.misc & 1),
            probe_interval_steps: 1 + u32::from((self.bounds >> 4) % 3),
        };
        c.promotion_cooldown_steps = 1 + u32::from((self.bounds >> 6) % 3);
        if self.misc & 2 == 2 {
            c.reuse = Some(ReuseFilter {
                store_threshold: 2,
                max_tracker_size: 2 + u32::from((self.misc >> 2) & 3),
            });
        }
        c
    }

    /// A proptest strategy over configurations.
    pub fn strategy() -> impl Strategy<Value = ConfigChoice> {
        (
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
        )
            .prop_map(|(primary, tiers, capacities, bounds, misc)| ConfigChoice {
                primary,
                tiers,
                capacities,
                bounds,
                misc,
            })
    }
}
