//! Victim tiers (rules V1–V4): written with the primary's next victims, their recency the
//! order in which blocks left the primary.

mod common;

use common::*;
use kvtier_core::{
    Admission, Config, ConfigError, EntryState, JobKind, Lookup, Manager, Outcome, RequestId,
    TierConfig, TierId, TierKind,
};

const T0: TierId = TierId(0);

/// A primary of `num_blocks` (LRU) above one authoritative victim tier.
fn victim_manager(num_blocks: u32, tier: u32, lookahead: u32) -> Manager {
    manager_with(victim_config(num_blocks, tier, lookahead))
}

/// The configuration of [`victim_manager`], for a test to change before it is used.
fn victim_config(num_blocks: u32, tier: u32, lookahead: u32) -> Config {
    let mut c = Config::new(num_blocks);
    let mut t = TierConfig::new(TierKind::Authoritative, tier);
    t.admission = Admission::Victim { lookahead };
    c.tiers = vec![t];
    c
}

fn held(m: &Manager, k: u32) -> Option<EntryState> {
    m.tier(T0).unwrap().state_of(&key(k))
}

/// V1: a completed store writes nothing to a victim tier.
#[test]
fn v1_a_completed_store_is_not_cascaded_to_a_victim_tier() {
    let mut m = victim_manager(4, 8, 2);
    store(&mut m, R1, &keys([1, 2]));
    assert!(jobs(&drain(&mut m)).is_empty());
    assert_eq!(m.stats().job_pins, 0);
    assert_eq!(held(&m, 1), None);
}

/// V2: at the step's end the primary's next victims, in eviction order, are written in one
/// store job of `WRITE_AHEAD`, pinned until it ends; held blocks are not written again.
#[test]
fn v2_the_next_victims_are_written_ahead_at_the_end_of_a_step() {
    let mut m = victim_manager(4, 8, 2);
    store(&mut m, R1, &keys([1, 2, 3]));
    m.request_finished(R1);
    m.end_step();
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 1);
    assert!(
        matches!(&js[0].kind, JobKind::Store { request, .. } if *request == RequestId::WRITE_AHEAD)
    );
    // LRU after the finish: the tail first (3, then 2), the head last.
    assert_eq!(load_keys(&js[0]), keys([3, 2]));
    assert_eq!(held(&m, 3), Some(EntryState::Writing));
    assert_eq!(m.stats().job_pins, 2);
    report(&mut m, &js, Outcome::Ok);
    m.end_step(); // collects: 3 and 2 Present, and still the next two victims
    assert!(
        jobs(&drain(&mut m)).is_empty(),
        "held blocks are not written again"
    );
    assert_eq!(held(&m, 2), Some(EntryState::Present { readers: 0 }));
    assert_eq!(m.stats().job_pins, 0);
}

/// V2: a block not Ready (Pending: the engine has not written it) is never written ahead,
/// nor is a block with a load pin.
#[test]
fn v2_only_ready_unpinned_blocks_are_written_ahead() {
    let mut m = victim_manager(4, 8, 4);
    m.prepare_store(R1, &keys([1])).unwrap(); // Pending
    store(&mut m, R1, &keys([2]));
    m.prepare_load(R1, &keys([2])).unwrap();
    m.end_step();
    assert!(jobs(&drain(&mut m)).is_empty());
    m.complete_load(&keys([2])).unwrap();
    m.end_step();
    assert_eq!(load_keys(&jobs(&drain(&mut m))[0]), keys([2]));
}

/// V2: the write-ahead is a cascade: a tier at its back-pressure bound is skipped (not
/// counted) and written at the next step's end once its job ended; a block being written
/// counts toward the look-ahead; nothing is written after shutdown.
#[test]
fn v2_write_ahead_obeys_back_pressure_and_shutdown() {
    let mut c = victim_config(4, 8, 2);
    c.tiers[0].max_outstanding_stores = 1;
    let mut m = manager_with(c);
    store(&mut m, R1, &keys([1, 2, 3]));
    m.request_finished(R1);
    m.end_step();
    let first = jobs(&drain(&mut m));
    let written = load_keys(&first[0]);
    assert_eq!(written.len(), 2);
    m.end_step(); // the two being written are still the next two victims
    assert!(jobs(&drain(&mut m)).is_empty());
    // A load pin takes the first out of the look-ahead: the third block is next, but the
    // tier's one job is outstanding.
    m.prepare_load(R2, &written[..1]).unwrap();
    m.end_step();
    assert!(jobs(&drain(&mut m)).is_empty());
    assert_eq!(m.stats().tiers[0].1.skipped_backpressure, 0, "not counted");
    report(&mut m, &first, Outcome::Ok);
    m.end_step(); // collects: the bound is free again
    let third = jobs(&drain(&mut m));
    assert_eq!(third.len(), 1);
    assert!(!written.contains(&load_keys(&third[0])[0]));
    m.shutdown();
    m.end_step();
    assert!(jobs(&drain(&mut m)).is_empty());
}

/// V2: a Down victim tier is not written ahead, and a skipped write-ahead is not counted (it
/// is tried again at every step's end).
#[test]
fn v2_a_down_tier_is_not_written_ahead() {
    let mut c = victim_config(4, 8, 2);
    c.health.failures_to_down = 1;
    c.health.probe_interval_steps = 100;
    let mut m = manager_with(c);
    store(&mut m, R1, &keys([1, 2]));
    m.end_step();
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Failed);
    m.end_step(); // collects the failure: Down; no write-ahead
    assert!(matches!(
        m.health(T0),
        Some(kvtier_core::Health::Down { .. })
    ));
    for _ in 0..3 {
        m.end_step();
        assert!(jobs(&drain(&mut m)).is_empty());
    }
    let s = &m.stats().tiers[0].1;
    assert_eq!((s.skipped_down, s.skipped_full, s.skipped_held), (0, 0, 0));
}

/// Ends the step, completes the jobs it submitted and collects their results.
fn settle_step(m: &mut Manager) {
    m.end_step();
    complete_all(m);
    m.end_step();
}

/// Stores `k` as request `req` and finishes it.
fn store_one(m: &mut Manager, req: u64, k: u32) {
    store(m, RequestId(req), &keys([k]));
    m.request_finished(RequestId(req));
}

/// V3: a block written long ago and evicted now becomes the tier's most recent, so the tier
/// keeps it over a block that left the primary earlier.
#[test]
fn v3_an_eviction_makes_the_block_the_tier_most_recent() {
    let mut m = victim_manager(2, 3, 1);
    store_one(&mut m, 1, 1);
    store_one(&mut m, 2, 2);
    settle_step(&mut m); // writes 1, the first victim
    m.prepare_load(R1, &keys([1])).unwrap();
    m.complete_load(&keys([1])).unwrap();
    m.request_finished(R1); // the primary's order: 2, 1
    settle_step(&mut m); // writes 2: the tier's order 1, 2
    store_one(&mut m, 3, 3); // evicts 2
    // A step evicted one block: 2 ahead, 1 (held) and 3, written: the tier's order 1, 2, 3.
    settle_step(&mut m);
    store_one(&mut m, 4, 4); // evicts 1: the tier's order 2, 3, 1
    settle_step(&mut m); // writes 4: the tier is full and evicts its least recent, 2
    assert_eq!(held(&m, 2), None);
    assert_eq!(held(&m, 1), Some(EntryState::Present { readers: 0 }));
    assert_eq!(m.stats().tiers[0].1.victims_missed, 0);
}

/// V3: a victim the tier did not hold (no step ended since it was stored) is counted.
#[test]
fn v3_a_victim_evicted_unwritten_is_counted_as_missed() {
    let mut m = victim_manager(1, 2, 1);
    store(&mut m, R1, &keys([1]));
    store(&mut m, R1, &keys([2])); // evicts 1 before any step ended
    assert_eq!(m.stats().tiers[0].1.victims_missed, 1);
}

/// V4: a block promoted from a victim tier stays there (T11), and comes back as a Hit.
#[test]
fn v4_a_promoted_block_stays_on_the_victim_tier() {
    let mut m = victim_manager(1, 4, 1);
    store(&mut m, R1, &keys([1]));
    m.end_step();
    complete_all(&mut m);
    m.end_step();
    m.end_step();
    store(&mut m, R1, &keys([2])); // evicts 1, which the tier holds
    settle_step(&mut m); // writes 2
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    m.end_step();
    complete_all(&mut m);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Hit);
    assert_eq!(held(&m, 1), Some(EntryState::Present { readers: 0 }));
    assert_eq!(m.stats().tiers[0].1.victims_missed, 0);
}

/// A victim tier's look-ahead of 0 is refused, naming the field.
#[test]
fn a_victim_tier_needs_a_look_ahead() {
    let err = Manager::new(victim_config(4, 8, 0)).expect_err("refused");
    assert!(
        matches!(&err, ConfigError::Invalid { field, .. } if field == "tiers[0].admission"),
        "{err}"
    );
}

/// V2 over T7: a tier smaller than the look-ahead writes what fits and then settles; it never
/// evicts one upcoming victim to write another.
#[test]
fn v2_a_tier_smaller_than_the_look_ahead_settles() {
    let mut m = victim_manager(4, 1, 2);
    store(&mut m, R1, &keys([1, 2]));
    m.request_finished(R1);
    settle_step(&mut m); // writes 2, the first victim; no room for 1
    assert_eq!(held(&m, 2), Some(EntryState::Present { readers: 0 }));
    for _ in 0..3 {
        m.end_step();
        assert!(jobs(&drain(&mut m)).is_empty(), "no write at a later step");
    }
    assert_eq!(held(&m, 2), Some(EntryState::Present { readers: 0 }));
    assert_eq!(m.stats().tiers[0].1.skipped_held, 0);
}

/// V3 through a promotion (M4): a promotion that evicts a block the tier never held counts
/// it as missed, as a store's eviction does.
#[test]
fn v3_a_promotion_evicting_an_unwritten_block_counts_it() {
    let mut m = victim_manager(1, 4, 1);
    assert!(m.restore_tier(T0, keys([9])).unwrap().is_empty());
    store(&mut m, R1, &keys([1])); // no step has ended: not written ahead
    assert_eq!(m.lookup(R2, &key(9)), Lookup::HitPending); // evicts 1
    assert_eq!(m.stats().tiers[0].1.victims_missed, 1);
    assert_eq!(held(&m, 1), None);
}

/// V2: a victim tier looks ahead twice the most blocks one step evicted, beyond the blocks
/// it is writing, when that reaches further than its configured look-ahead: a step that
/// evicts more than was written ahead, or evicts while the last write-ahead is in flight,
/// loses fewer blocks the next time, and the tier is not written further than the primary's
/// evictions ask.
#[test]
fn v2_the_look_ahead_covers_twice_a_steps_evictions_beyond_the_writes_in_flight() {
    let mut m = victim_manager(8, 32, 1);
    store(&mut m, R1, &keys([1, 2, 3, 4, 5, 6, 7, 8]));
    m.request_finished(R1);
    m.end_step(); // nothing evicted yet: the configured 1 ahead, the tail
    let first = jobs(&drain(&mut m));
    assert_eq!(first.len(), 1);
    assert_eq!(load_keys(&first[0]), keys([8]));
    // 8 is pinned by its write: the store evicts the three after it, which the tier lacks.
    store(&mut m, R2, &keys([9, 10, 11]));
    m.request_finished(R2);
    assert_eq!(m.stats().tiers[0].1.victims_missed, 3);
    // A step evicted 3 and 1 block is being written: 2 × 3 + 1 = 7 ahead (8, held, then
    // R1's rest and R2's, each request tail first).
    m.end_step();
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 1);
    assert_eq!(load_keys(&js[0]), keys([4, 3, 2, 1, 11, 10]));
    report(&mut m, &first, Outcome::Ok);
    report(&mut m, &js, Outcome::Ok);
    m.end_step();
    assert_eq!(m.stats().job_pins, 0);
    // The next step evicts 2 blocks, all written: nothing is missed.
    store(&mut m, RequestId(3), &keys([12, 13]));
    m.request_finished(RequestId(3));
    assert_eq!(m.stats().tiers[0].1.victims_missed, 3);
}
