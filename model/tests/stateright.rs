//! Exhaustive breadth-first exploration of the real core (stateright). The unique state count
//! is pinned, so that a change that shrinks (or grows) the search is noticed.
#![allow(clippy::print_stderr)] // the figures the docs quote

use kvtier_model::checker::TieringModel;
use stateright::{Checker, Model};

/// Every explored state clones the core (its maps and lists): most of the checker's time was
/// the system allocator's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Unique states of [`TieringModel::ci`] at its closure.
const CI_STATES: usize = 7_703_526;

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "20 minutes in a release build, far more here: scripts/test.sh runs it with --release"
)]
fn ci_configuration_is_checked_exhaustively() {
    let started = std::time::Instant::now();
    let checker = TieringModel::ci().checker().threads(2).spawn_bfs().join();
    eprintln!(
        "{} unique states, {} generated, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    checker.assert_properties();
    assert_eq!(checker.unique_state_count(), CI_STATES);
}

/// Explores `model` breadth-first to `depth` on two threads, prints its figures under
/// `label`, and requires that no `always` property is broken.
fn explore_to_depth(model: TieringModel, depth: usize, label: &str) -> impl Checker<TieringModel> {
    let started = std::time::Instant::now();
    let checker = model
        .checker()
        .threads(2)
        .target_max_depth(depth)
        .spawn_bfs()
        .join();
    eprintln!(
        "{label} to depth {depth}: {} unique states, {} generated, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    checker.assert_no_discovery("invariants hold");
    checker.assert_no_discovery("no transition breaks a rule");
    checker.assert_no_discovery("every state settles");
    checker
}

/// Depth of [`TieringModel::ci_reuse`]'s exploration in CI.
const REUSE_DEPTH: usize = 11;

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "minutes in a release build: scripts/test.sh runs it with --release"
)]
fn reuse_policy_configuration_to_a_depth_bound() {
    explore_to_depth(TieringModel::ci_reuse(), REUSE_DEPTH, "reuse-aware LRU");
}

/// Depth of [`TieringModel::ci_reuse_horizon`]'s exploration in CI.
const HORIZON_DEPTH: usize = 8;

/// U10: the reuse-aware LRU with its return horizon formed from the first gap.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "minutes in a release build: scripts/test.sh runs it with --release"
)]
fn reuse_policy_with_its_return_horizon_to_a_depth_bound() {
    let depth = std::env::var("KVTIER_HORIZON_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(HORIZON_DEPTH);
    let checker = explore_to_depth(
        TieringModel::ci_reuse_horizon(),
        depth,
        "reuse-aware LRU with U10",
    );
    checker.assert_any_discovery("a block idle past the return horizon is evicted");
}

/// Depth of [`TieringModel::ci_deadline`]'s exploration in CI.
const DEADLINE_DEPTH: usize = 9;

/// ★9: no request is held past the wait deadline (W3, W4), with hung jobs, probes that
/// answer Retry, and the clock moving at any point.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "minutes in a release build: scripts/test.sh runs it with --release"
)]
fn deadline_configuration_to_a_depth_bound() {
    let checker = explore_to_depth(TieringModel::ci_deadline(), DEADLINE_DEPTH, "wait deadline");
    checker.assert_any_discovery("a request gives up waiting");
}

/// Depth of [`TieringModel::ci_victim`]'s exploration in CI.
const VICTIM_DEPTH: usize = 12;

/// V1–V4: a victim tier beside a cascaded one; the write-ahead is checked to copy only
/// written data, to pin what it writes, and to settle.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "minutes in a release build: scripts/test.sh runs it with --release"
)]
fn victim_tier_configuration_to_a_depth_bound() {
    explore_to_depth(TieringModel::ci_victim(), VICTIM_DEPTH, "victim tier");
}

/// The larger configuration (shared tier, every action) to a depth bound; figures in
/// `docs/verification.md`. Run with `cargo test --release -p kvtier-model --test stateright
/// -- --ignored`.
#[test]
#[ignore = "minutes; run by hand"]
fn larger_configuration_to_depth_10() {
    explore_to_depth(TieringModel::small(), 10, "the larger configuration");
}

/// For the negative tests (`scripts/mutants.sh`): explores [`TieringModel::small`] (or
/// [`TieringModel::ci_deadline`] when `KVTIER_MODEL` is `deadline`, [`TieringModel::ci_victim`]
/// when it is `victim`) checking only the property
/// named by `KVTIER_PROPERTY`, and stops at its first counterexample.
#[test]
#[ignore = "run by scripts/mutants.sh against a seeded defect"]
fn one_property_until_first_counterexample() {
    let name: &'static str = std::env::var("KVTIER_PROPERTY")
        .expect("KVTIER_PROPERTY names a property")
        .leak();
    let mut model = match std::env::var("KVTIER_MODEL").as_deref() {
        Ok("deadline") => TieringModel::ci_deadline(),
        Ok("victim") => TieringModel::ci_victim(),
        _ => TieringModel::small(),
    };
    model.only = Some(name);
    let checker = model
        .checker()
        .threads(2)
        .target_max_depth(12)
        .finish_when(stateright::HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    assert!(
        checker.discovery(name).is_none(),
        "{name} broken:\n{}",
        checker
            .discovery(name)
            .map(|p| {
                let violation = p.last_state().violation.clone();
                format!("{violation:?}\nafter {:#?}", p.into_actions())
            })
            .unwrap_or_default()
    );
}
