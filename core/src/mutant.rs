//! Seeded defects for the negative tests (`scripts/mutants.sh`, `docs/verification.md`).
//!
//! Each defect is a named point in the code, `mutant::active("name")`. Without the
//! `mutants` feature every point is the constant `false` and compiles away. With it, the
//! defect named by the environment variable `KVTIER_MUTANT` (read once per process) is
//! switched on, so one build serves every defect: each checker is run once per name against
//! the same binary. The feature exists for those tests only; never enable it in a build that
//! serves requests.

/// Every defect a point may name. `KVTIER_MUTANT` set to a name outside this list is refused
/// when first read; a point that misspells its name is never switched on, and the negative
/// test that names it reports it missed.
pub const NAMES: &[&str] = &[
    "evict_pinned",
    "keep_pin_on_failure",
    "reuse_slot_early",
    "hit_pending",
    "ready_failed_load",
    "stall_batches",
    "refusal_touches",
    "no_hit_protection",
    "no_cooldown",
    "no_step_gate",
    "arc_no_fallback",
    "skip_seal_check",
    "no_store_positions",
    "shared_delete",
    "missing_is_failure",
    "no_deadline",
    "no_hold",
    "hosted_reads_not_learned",
    "no_tier_learning",
    "write_ahead_unready",
    "victims_not_refreshed",
    "lookahead_fixed",
    "sglang_count_pending",
    "sglang_report_unread",
    "no_return_horizon",
];

/// Whether the seeded defect `name` is switched on in this process: always `false` unless
/// the crate is built with the `mutants` feature and `KVTIER_MUTANT` names it.
#[inline(always)]
#[must_use]
pub fn active(name: &str) -> bool {
    #[cfg(feature = "mutants")]
    {
        enabled::current() == Some(name)
    }
    #[cfg(not(feature = "mutants"))]
    {
        let _ = name;
        false
    }
}

#[cfg(feature = "mutants")]
mod enabled {
    extern crate std;

    use std::string::String;
    use std::sync::OnceLock;

    static CURRENT: OnceLock<Option<String>> = OnceLock::new();

    /// The defect named by `KVTIER_MUTANT`, if any.
    pub(super) fn current() -> Option<&'static str> {
        CURRENT
            .get_or_init(|| {
                let name = std::env::var("KVTIER_MUTANT")
                    .ok()
                    .filter(|n| !n.is_empty())?;
                assert!(
                    super::NAMES.contains(&name.as_str()),
                    "KVTIER_MUTANT={name:?} names no seeded defect (known: {:?})",
                    super::NAMES
                );
                Some(name)
            })
            .as_deref()
    }
}
