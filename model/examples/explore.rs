//! Explores the stateright model to a given depth and prints the state counts:
//! `cargo run --release -p kvtier-model --example explore -- DEPTH`.
#![allow(clippy::print_stdout)]

use std::time::Instant;

use kvtier_model::checker::TieringModel;
use stateright::{Checker, Model};

fn main() {
    let depth: usize = std::env::args()
        .nth(1)
        .and_then(|d| d.parse().ok())
        .unwrap_or(8);
    let mut model = TieringModel::small();
    for flag in std::env::args().skip(2) {
        match flag.as_str() {
            "-touch" => model.touch = false,
            "-fail" => model.failed_stores = false,
            "-loads" => model.loads = false,
            "-shutdown" => model.shutdown = false,
            "-shared" => model.config.tiers[1].kind = kvtier_core::TierKind::Authoritative,
            "ci" => model = TieringModel::ci(),
            other => panic!("unknown flag {other}"),
        }
    }
    if depth == 0 {
        walk(&model);
        return;
    }
    let started = Instant::now();
    let checker = model
        .checker()
        .threads(2)
        .target_max_depth(depth)
        .spawn_bfs()
        .join();
    for (name, path) in checker.discoveries() {
        if name.starts_with("no transition")
            || name.starts_with("invariants")
            || name.starts_with("every")
        {
            println!("DISCOVERY {name}:");
            for (state, action) in path.into_vec() {
                println!("  {action:?}  -> {:?}", state.violation);
            }
        }
    }
    println!(
        "depth {depth}: {} unique states, {} generated, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
}

/// A long random walk through the model, to spot a state component that grows without bound.
#[allow(dead_code)]
fn walk(model: &TieringModel) {
    let mut s = model.init_states().remove(0);
    let mut x = 88172645463325252u64;
    let mut longest = String::new();
    for i in 0..200_000 {
        let mut acts = Vec::new();
        model.actions(&s, &mut acts);
        if acts.is_empty() {
            println!(
                "step {i}: violation {:?}\n{}",
                s.violation,
                s.core.canonical_state()
            );
            return;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let a = acts[(x % acts.len() as u64) as usize].clone();
        if let Some(n) = model.next_state(&s, a) {
            s = n;
        }
        let c = s.core.canonical_state();
        if c.len() > longest.len() {
            longest = c;
            println!("{i}: {} bytes", longest.len());
        }
    }
    println!("{longest}");
}
