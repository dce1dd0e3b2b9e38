//! `kvtier-model`: the checkers of `kvtier-core`.
//!
//! - [`Op`]: the operation alphabet, every input of the core (valid or deliberately not), with
//!   `Arbitrary` for the fuzzer and a proptest strategy.
//! - [`RefModel`]: the tiering contract written for obviousness.
//! - [`Harness`]: applies each op to the core and the model, compares everything observable and
//!   runs the core's `check_invariants` after every op.
//! - [`checker`]: the stateright model over the real core and its outstanding jobs.
//! - [`fuzz_ops`], [`fuzz_config`]: the bodies of the cargo-fuzz targets, also replayed on
//!   stable by the corpus test.
//! - [`oracle`]: vLLM 0.33.0's own offloading managers as a differential oracle
//!   ([`oracle::VllmOracle`], a client of `model/oracle/vllm_oracle.py`).
//! - [`replay`]: a Mooncake-format trace replayed with vLLM 0.33's scheduler call sequence
//!   through the core, through vLLM's manager, or both in lockstep with every answer compared
//!   (the `vllm-replay` binary and `tests/vllm_replay.rs`).

pub mod checker;
mod harness;
mod op;
pub mod oracle;
mod reference;
pub mod replay;

pub use harness::{Harness, Mismatch};
pub use op::{ConfigChoice, Finish, Invalid, KEYS, MAX_LIST, Op, key, keys, request};
pub use reference::{BlockView, PolicyView, PrimaryView, RefModel};

use arbitrary::{Arbitrary, Unstructured};
use kvtier_core::{Config, Manager, PolicyKind, TierConfig, TierKind};

/// Fuzz target `ops`: a configuration and an op sequence through the harness. Panics on a
/// mismatch or a broken invariant, and on a run that does not settle.
pub fn fuzz_ops(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(choice) = ConfigChoice::arbitrary(&mut u) else {
        return;
    };
    let Ok(ops) = Vec::<Op>::arbitrary(&mut u) else {
        return;
    };
    let mut h = Harness::new(choice.config()).expect("choices are valid");
    if let Err(m) = h.run(&ops).and_then(|()| h.settle()) {
        panic!("{m}\nconfig: {:?}\nops: {ops:?}", choice.config());
    }
}

/// An arbitrary configuration, valid or not, with every field reachable.
#[derive(Arbitrary, Debug)]
struct RawConfig {
    num_blocks: u32,
    policy: u8,
    tiers: Vec<(bool, u32, u8, u32, u32, u32)>,
    cooldown: u32,
    failures_to_down: u32,
    probe_interval: u32,
    reuse: Option<(u32, u32)>,
    events: bool,
}

/// Fuzz target `config`: validation never panics; a valid configuration runs a few ops.
pub fn fuzz_config(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(raw) = RawConfig::arbitrary(&mut u) else {
        return;
    };
    let policy = |p: u8| match p % 3 {
        0 => PolicyKind::Lru,
        1 => PolicyKind::Arc,
        _ => PolicyKind::Reuse,
    };
    let mut c = Config::new(raw.num_blocks % 4096);
    c.policy = policy(raw.policy);
    c.tiers = raw
        .tiers
        .iter()
        .take(70)
        .map(|&(shared, cap, p, stores, ttl, probes)| {
            let kind = if shared {
                TierKind::Shared
            } else {
                TierKind::Authoritative
            };
            let mut t = TierConfig::new(kind, cap % 8192);
            t.policy = policy(p);
            t.max_outstanding_stores = stores % 4;
            t.absent_ttl_steps = ttl % 4;
            t.max_outstanding_probes = probes % 4;
            t
        })
        .collect();
    c.promotion_cooldown_steps = raw.cooldown % 4;
    c.health.failures_to_down = raw.failures_to_down % 4;
    c.health.probe_interval_steps = raw.probe_interval % 4;
    c.reuse = raw.reuse.map(|(t, s)| kvtier_core::ReuseFilter {
        store_threshold: t % 4,
        max_tracker_size: s % 4,
    });
    c.events = raw.events;
    let valid = c.validate();
    match Manager::new(c.clone()) {
        Err(e) => assert_eq!(Err(e), valid, "new and validate disagree"),
        Ok(_) => {
            assert_eq!(valid, Ok(()));
            let ops = Vec::<Op>::arbitrary(&mut u).unwrap_or_default();
            let mut h = Harness::new(c.clone()).expect("valid");
            if let Err(m) = h.run(&ops) {
                panic!("{m}\nconfig: {c:?}");
            }
        }
    }
}
