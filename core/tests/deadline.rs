//! ★9: a request waits for a block at most `wait_deadline` (rules W1–W7).

mod common;

use common::*;
use kvtier_core::{
    BlockState, Config, ConfigError, Lookup, Manager, Outcome, RequestId, TierConfig, TierId,
    TierKind,
};

const T0: TierId = TierId(0);

/// A primary of 4 slots, one authoritative tier holding key 7, and a deadline of 100.
fn waiting() -> Manager {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 8)];
    c.wait_deadline = Some(100);
    let mut m = manager_with(c);
    assert!(m.restore_tier(T0, keys([7])).unwrap().is_empty());
    m
}

/// W2, W3, J2: a promotion whose tier hangs answers HitPending until the deadline has passed,
/// then Miss
/// without asking the tier again; the job still ends in one result, which alone makes the
/// block Ready, and another request is answered Hit.
#[test]
fn w3_a_hung_promotion_answers_miss_at_the_deadline() {
    let mut m = waiting();
    m.set_clock(1_000);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending); // W2: waits since 1000
    m.end_step();
    let load = jobs(&drain(&mut m)); // the load job: its tier never answers (yet)
    assert_eq!(load.len(), 1);
    m.set_clock(1_100);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.end_step();
    m.set_clock(1_101);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Miss); // W3
    assert_eq!(m.stats().wait_timeouts, 1);
    // Nothing else changed: the slot stays Promoting under its job, no new job.
    assert_eq!(
        m.primary().state_of(&key(7)).unwrap().1,
        BlockState::Promoting
    );
    m.end_step();
    assert!(drain(&mut m).is_empty());
    // W4: Miss from then on for R1, also once the block is Ready.
    report(&mut m, &load, Outcome::Ok);
    m.end_step();
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Miss);
    assert_eq!(
        m.primary().state_of(&key(7)).unwrap().1,
        BlockState::Ready {
            load_pins: 0,
            job_pins: 0
        }
    );
    // Another request uses the block (W4's last sentence).
    assert_eq!(m.lookup(R2, &key(7)), Lookup::Hit);
    assert_eq!(m.stats().wait_timeouts, 1, "a give-up is counted once");
    // W6: once R1 finished, a new request under its id is answered as anyone.
    m.request_finished(R1);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Hit);
    m.check_invariants().unwrap();
}

/// W3 for a pending store that another request waits on (M3): the store ends normally.
#[test]
fn w3_applies_to_a_store_another_request_waits_on() {
    let mut m = waiting();
    m.prepare_store(R1, &keys([1])).unwrap(); // Pending: R1's copy is in flight
    m.set_clock(5);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    m.set_clock(105);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    m.set_clock(106);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Miss);
    m.complete_store(R1, &keys([1]), true);
    assert!(matches!(
        m.primary().state_of(&key(1)).unwrap().1,
        BlockState::Ready { .. }
    ));
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Miss, "R2 gave it up (W4)");
    assert_eq!(m.lookup(RequestId(3), &key(1)), Lookup::Hit);
}

/// W5: a wait that ends in time (the block became Ready) is forgotten: a later wait for the
/// same key starts afresh. (No tiers: the deadline holds for the primary alone too.)
#[test]
fn w5_a_wait_that_ends_in_time_is_forgotten() {
    let mut c = Config::new(1);
    c.wait_deadline = Some(100);
    let mut m = manager_with(c);
    m.prepare_store(R1, &keys([1])).unwrap();
    m.set_clock(0);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending); // waits since 0
    m.complete_store(R1, &keys([1]), true);
    m.set_clock(50);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Hit); // W5
    m.end_step();
    store(&mut m, R1, &keys([2])); // evicts 1
    m.prepare_store(R1, &keys([1])).unwrap(); // evicts 2: 1 is Pending again
    m.set_clock(120);
    assert_eq!(
        m.lookup(R2, &key(1)),
        Lookup::HitPending,
        "a new wait, since 120"
    );
    m.set_clock(220);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    m.set_clock(221);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Miss);
    assert_eq!(m.stats().wait_timeouts, 1);
    m.check_invariants().unwrap();
}

/// W1: the clock never goes back.
#[test]
fn w1_the_clock_never_goes_back() {
    let mut m = waiting();
    m.set_clock(50);
    m.set_clock(10);
    assert_eq!(m.clock(), 50);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending); // since 50
    m.set_clock(150);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.set_clock(151);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Miss);
}

/// W3 for Retry: a shared tier whose existence probe never answers.
#[test]
fn w3_applies_to_retry_answers() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 8)];
    c.wait_deadline = Some(10);
    let mut m = manager_with(c);
    m.set_clock(3);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::Retry); // probe submitted; waits since 3
    let probe = jobs(&drain(&mut m));
    assert_eq!(probe.len(), 1);
    m.end_step();
    m.set_clock(13);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::Retry);
    m.set_clock(14);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::Miss); // W3
    assert!(drain(&mut m).is_empty(), "no new probe");
    // The probe still ends in one result; the tier learns the answer.
    report(&mut m, &probe, Outcome::NotFound);
    m.end_step();
    assert_eq!(m.lookup(R2, &key(5)), Lookup::Miss);
    m.check_invariants().unwrap();
}

/// W7: without a deadline no waits are kept and HitPending lasts as long as the job.
#[test]
fn w7_without_a_deadline_a_wait_never_ends() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 8)];
    let mut m = manager_with(c);
    assert!(m.restore_tier(T0, keys([7])).unwrap().is_empty());
    m.set_clock(0);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.set_clock(u64::MAX);
    m.end_step();
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    assert_eq!(m.stats().wait_timeouts, 0);
}

#[test]
fn a_zero_deadline_is_refused() {
    let mut c = Config::new(4);
    c.wait_deadline = Some(0);
    assert!(matches!(
        Manager::new(c),
        Err(ConfigError::Invalid { field, .. }) if field == "wait_deadline"
    ));
}

/// W6: `reset_cache` forgets every wait, and keeps a live request's give-ups.
#[test]
fn w6_a_reset_forgets_waits_and_keeps_give_ups() {
    let mut c = Config::new(4);
    c.wait_deadline = Some(10);
    let mut m = manager_with(c);
    m.prepare_store(R1, &keys([1, 2])).unwrap(); // both Pending
    m.set_clock(0);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    m.set_clock(11);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Miss); // gave 1 up
    assert_eq!(m.lookup(R2, &key(2)), Lookup::HitPending); // waits for 2 since 11
    m.complete_store(R1, &keys([1, 2]), false);
    m.reset_cache().unwrap();
    m.prepare_store(R1, &keys([1, 2])).unwrap();
    m.set_clock(25);
    assert_eq!(
        m.lookup(R2, &key(1)),
        Lookup::Miss,
        "given up before the reset"
    );
    assert_eq!(
        m.lookup(R2, &key(2)),
        Lookup::HitPending,
        "a new wait: the old one (since 11) was forgotten"
    );
    m.set_clock(36);
    assert_eq!(m.lookup(R2, &key(2)), Lookup::Miss);
    m.check_invariants().unwrap();
}

/// W2: a wait that starts as Retry (a shared tier's probe) and goes on as HitPending (the
/// probe found the block: a promotion) keeps its first time.
#[test]
fn w2_a_wait_keeps_its_start_from_retry_to_hit_pending() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 8)];
    c.wait_deadline = Some(10);
    let mut m = manager_with(c);
    m.set_clock(0);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::Retry);
    m.end_step(); // the probe goes out
    let probe = jobs(&drain(&mut m));
    report(&mut m, &probe, Outcome::Ok); // found
    m.end_step();
    m.set_clock(6);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::HitPending); // promoting now
    m.set_clock(10);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::HitPending);
    m.set_clock(11);
    assert_eq!(
        m.lookup(R1, &key(5)),
        Lookup::Miss,
        "the wait began at 0, not at 6"
    );
}
