//! Exhaustive breadth-first exploration of the real core (stateright). The unique state count
//! is pinned, so that a change that shrinks (or grows) the search is noticed.
#![allow(clippy::print_stderr)] // the figures the docs quote

use kvtier_model::checker::TieringModel;
use stateright::{Checker, Model};

/// Unique states of [`TieringModel::ci`] at its closure.
const CI_STATES: usize = 7_299_494;

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "11 minutes in a release build, far more here: scripts/test.sh runs it with --release"
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

/// Depth of [`TieringModel::ci_reuse`]'s exploration in CI.
const REUSE_DEPTH: usize = 11;

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "minutes in a release build: scripts/test.sh runs it with --release"
)]
fn reuse_policy_configuration_to_a_depth_bound() {
    let started = std::time::Instant::now();
    let checker = TieringModel::ci_reuse()
        .checker()
        .threads(2)
        .target_max_depth(REUSE_DEPTH)
        .spawn_bfs()
        .join();
    eprintln!(
        "reuse-aware LRU to depth {REUSE_DEPTH}: {} unique states, {} generated, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    checker.assert_no_discovery("invariants hold");
    checker.assert_no_discovery("no transition breaks a rule");
    checker.assert_no_discovery("every state settles");
}

/// The larger configuration (shared tier, every action) to a depth bound; figures in
/// `docs/verification.md`. Run with `cargo test --release -p kvtier-model --test stateright
/// -- --ignored`.
#[test]
#[ignore = "minutes; run by hand"]
fn larger_configuration_to_depth_10() {
    let started = std::time::Instant::now();
    let checker = TieringModel::small()
        .checker()
        .threads(2)
        .target_max_depth(10)
        .spawn_bfs()
        .join();
    eprintln!(
        "{} unique states, {} generated, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    checker.assert_no_discovery("invariants hold");
    checker.assert_no_discovery("no transition breaks a rule");
    checker.assert_no_discovery("every state settles");
}

/// For the negative tests (`scripts/mutants.sh`): explores [`TieringModel::small`] checking
/// only the property named by `KVTIER_PROPERTY`, and stops at its first counterexample.
#[test]
#[ignore = "run by scripts/mutants.sh against a seeded defect"]
fn one_property_until_first_counterexample() {
    let name: &'static str = std::env::var("KVTIER_PROPERTY")
        .expect("KVTIER_PROPERTY names a property")
        .leak();
    let mut model = TieringModel::small();
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
