//! Quick differential runs of the harness (the long ones are the proptest state machine and
//! the fuzzer).

use arbitrary::{Arbitrary, Unstructured};
use kvtier_model::{ConfigChoice, Harness, Op};

/// `runs` seeded (configuration, op sequence) pairs of up to 200 ops each.
fn seeded(seed: u64, runs: usize) -> impl Iterator<Item = (ConfigChoice, Vec<Op>)> {
    let mut x = seed;
    let mut bytes = vec![0u8; 4096];
    (0..runs).map(move |_| {
        for b in bytes.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let mut u = Unstructured::new(&bytes);
        let choice = ConfigChoice::arbitrary(&mut u).expect("enough bytes");
        let ops = (0..200).map_while(|_| Op::arbitrary(&mut u).ok()).collect();
        (choice, ops)
    })
}

#[test]
fn seeded_runs_agree_with_the_reference_model() {
    let runs: usize = std::env::var("KVTIER_HARNESS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for (run, (choice, ops)) in seeded(0x9E37_79B9_7F4A_7C15, runs).enumerate() {
        let mut h = Harness::new(choice.config()).unwrap();
        if let Err(m) = h.run(&ops).and_then(|()| h.settle()) {
            panic!("run {run}: {m}\nconfig: {:?}", choice.config());
        }
    }
}

/// The seeded runs reach deep states: promotions, tier evictions, health changes.
#[test]
fn seeded_runs_reach_the_interesting_transitions() {
    let (mut promoted, mut down, mut evicted, mut probes, mut failed) = (0, 0, 0, 0, 0);
    for (choice, ops) in seeded(0x1234_5678_9ABC_DEF1, 300) {
        let mut h = Harness::new(choice.config()).unwrap();
        h.run(&ops).unwrap();
        let s = h.core.stats();
        promoted += s.promotions_succeeded;
        failed += s.promotions_failed;
        for (_, t) in &s.tiers {
            down += t.went_down;
            evicted += t.evictions;
            probes += t.probes;
        }
    }
    for (what, n) in [
        ("promotions", promoted),
        ("failed promotions", failed),
        ("tiers down", down),
        ("tier evictions", evicted),
        ("probes", probes),
    ] {
        assert!(n >= 10, "only {n} {what}");
    }
}
