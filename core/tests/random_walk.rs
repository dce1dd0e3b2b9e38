//! Seeded random walks over every input of the manager, with every invariant checked after
//! each call (debug builds check inside the manager; this test checks again explicitly).
//! The exhaustive and differential checkers live in `kvtier-model`; this is the core's own
//! smoke test of its invariants under arbitrary interleavings.

mod common;

use common::*;
use kvtier_core::{
    BlockState, Config, Effect, Error, HealthConfig, Job, JobKind, JobResult, Manager, Outcome,
    PolicyKind, RequestId, ReuseFilter, SlotId, TierConfig, TierKind,
};

fn config(seed: u64) -> Config {
    let policy = |b| if b { PolicyKind::Arc } else { PolicyKind::Lru };
    let mut c = Config::new(2 + (seed % 4) as u32);
    c.policy = policy(seed & 1 == 1);
    c.promotion_cooldown_steps = 2;
    c.health = HealthConfig {
        failures_to_down: 2,
        probe_interval_steps: 2,
    };
    let mut t0 = TierConfig::new(TierKind::Authoritative, 3 + (seed % 3) as u32);
    t0.policy = policy(seed & 2 == 2);
    t0.max_outstanding_stores = 2;
    let mut t1 = TierConfig::new(TierKind::Shared, 4);
    t1.policy = policy(seed & 4 == 4);
    t1.absent_ttl_steps = 3;
    c.tiers = vec![t0, t1];
    if seed.is_multiple_of(5) {
        c.reuse = Some(ReuseFilter {
            store_threshold: 2,
            max_tracker_size: 4,
        });
    }
    c
}

/// Blocks that are Ready, unpinned and not among `offered`.
fn evictable_besides(m: &Manager, offered: &[kvtier_core::Key]) -> usize {
    let p = m.primary();
    (0..p.num_blocks())
        .filter_map(|s| p.key_at(SlotId(s)))
        .filter(|k| !offered.contains(k))
        .filter(|k| {
            matches!(
                p.state_of(k),
                Some((
                    _,
                    BlockState::Ready {
                        load_pins: 0,
                        job_pins: 0
                    }
                ))
            )
        })
        .count()
}

fn walk(seed: u64, ops: usize) -> Manager {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut m = Manager::new(config(seed)).unwrap();
    let mut submitted: Vec<Job> = Vec::new();
    let mut pins: Vec<kvtier_core::Key> = Vec::new();
    for _ in 0..ops {
        let k = |rng: &mut Rng| key(rng.below(8) as u32);
        let req = RequestId(rng.below(3));
        match rng.below(14) {
            0 | 1 => {
                m.lookup(req, &k(&mut rng));
            }
            2 => {
                let ks = vec![k(&mut rng), k(&mut rng)];
                match m.prepare_store(req, &ks) {
                    Ok(p) => {
                        let ok = rng.below(4) != 0;
                        m.complete_store(req, &p.keys, ok);
                    }
                    Err(Error::NoRoom { needed, .. }) => {
                        // P7, A6: refused only when even evicting every evictable block
                        // would not make room, whatever the policy.
                        let evictable = evictable_besides(&m, &ks);
                        assert!(
                            evictable < needed,
                            "seed {seed}: {needed} refused, {evictable} evictable"
                        );
                    }
                    Err(e) => panic!("seed {seed}: {e}"),
                }
            }
            3 => {
                let ks = vec![k(&mut rng)];
                if m.prepare_load(R1, &ks).is_ok() {
                    pins.extend(ks);
                }
            }
            4 => {
                if !pins.is_empty() {
                    let i = rng.below(pins.len() as u64) as usize;
                    m.complete_load(&[pins.swap_remove(i)]).unwrap();
                }
            }
            5 => m.touch(&[k(&mut rng), k(&mut rng)]),
            11 => {
                let key = k(&mut rng);
                m.set_position(req, &key, 16 * (1 + rng.below(4)));
            }
            12 => m.request_finished(req),
            6 | 7 => m.end_step(),
            8..=10 => {
                if !submitted.is_empty() {
                    let j = submitted.swap_remove(rng.below(submitted.len() as u64) as usize);
                    let outcome = match (rng.below(4), &j.kind) {
                        (0, _) => Outcome::Failed,
                        (1, JobKind::Exists { .. }) => Outcome::NotFound,
                        (1, JobKind::Store { blocks, .. } | JobKind::Load { blocks, .. }) => {
                            Outcome::partial(blocks.iter().take(1).map(|b| b.key.clone()).collect())
                        }
                        _ => Outcome::Ok,
                    };
                    m.handle_job_result(JobResult { job: j.id, outcome })
                        .unwrap();
                }
            }
            _ => {
                // Invalid calls: typed errors, no change. The step's collection (M1) is part
                // of the step, not of the call: let a lookup do it first.
                m.lookup(req, &k(&mut rng));
                let before = fingerprint(&m);
                let bad = key(100 + rng.below(4) as u32);
                assert!(m.prepare_load(R1, std::slice::from_ref(&bad)).is_err());
                assert!(m.complete_load(&[bad]).is_err());
                assert_eq!(fingerprint(&m), before);
            }
        }
        while let Some(e) = m.poll_effect() {
            if let Effect::Submit(j) = e {
                submitted.push(j);
            }
        }
        m.check_invariants().unwrap();
    }
    // Quiescence: completing everything and ending the step leaves no pins or jobs.
    m.complete_load(&pins).unwrap();
    for _ in 0..4 {
        report(&mut m, &submitted, Outcome::Ok);
        submitted.clear();
        m.end_step();
        submitted.extend(jobs(&drain(&mut m)));
    }
    let still: Vec<_> = m
        .outstanding_jobs()
        .filter(|j| j.kind != JobKind::Health)
        .collect();
    assert!(still.is_empty(), "seed {seed}: outstanding {still:?}");
    assert_eq!(m.stats().job_pins, 0);
    assert_eq!(m.stats().load_pins, 0);
    m
}

#[test]
fn random_walks_keep_invariants_and_settle() {
    for seed in 0..300 {
        walk(seed, 400);
    }
}

#[test]
fn random_walks_are_deterministic() {
    for seed in [3, 17, 99] {
        assert_eq!(fingerprint(&walk(seed, 300)), fingerprint(&walk(seed, 300)));
    }
}

#[test]
fn shutdown_mid_walk_ends_everything() {
    for seed in 0..50 {
        let mut m = walk(seed, 200);
        m.shutdown();
        m.check_invariants().unwrap();
        assert_eq!(m.outstanding_jobs().count(), 0);
    }
}

/// The walks reach the interesting transitions (a walk that never promotes proves little).
#[test]
fn random_walks_cover_the_transitions() {
    let mut total = kvtier_core::TierStats::default();
    let (mut promoted, mut failed, mut refused, mut evicted) = (0, 0, 0, 0);
    for seed in 0..100 {
        let s = walk(seed, 400).stats();
        promoted += s.promotions_succeeded;
        failed += s.promotions_failed;
        refused += s.promotions_refused;
        evicted += s.evictions;
        for (_, t) in &s.tiers {
            total.went_down += t.went_down;
            total.came_up += t.came_up;
            total.skipped_backpressure += t.skipped_backpressure;
            total.skipped_full += t.skipped_full;
            total.evictions += t.evictions;
            total.probes += t.probes;
        }
    }
    for (what, n) in [
        ("promotions", promoted),
        ("failed promotions", failed),
        ("refused promotions", refused),
        ("primary evictions", evicted),
        ("tier down", total.went_down),
        ("tier up", total.came_up),
        ("back-pressure", total.skipped_backpressure),
        ("tier evictions", total.evictions),
        ("probes", total.probes),
    ] {
        assert!(n > 0, "no {what} in 100 walks");
    }
}
