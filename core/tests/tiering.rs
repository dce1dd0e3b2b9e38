//! The tiering manager: promotion, cascade, jobs, health, back-pressure (rules M1–M11,
//! J1–J6, H1–H6, T1–T15 and the "beyond vLLM" rules ★2–★8).

mod common;

use common::*;
use kvtier_core::{
    BlockState, Config, EntryState, Error, Event, EventKind, Health, HealthConfig, JobId, JobKind,
    JobResult, Lookup, Manager, Medium, Outcome, RequestId, SlotId, TierConfig, TierId, TierKind,
};

const T0: TierId = TierId(0);
const T1: TierId = TierId(1);

fn job_pins(m: &Manager, k: u32) -> u16 {
    match m.primary().state_of(&key(k)).unwrap().1 {
        BlockState::Ready { job_pins, .. } => job_pins,
        s => panic!("not ready: {s:?}"),
    }
}

/// Puts `ks` into tier 0 and out of the primary, by restoring them (as at start).
fn in_tier(m: &mut Manager, tier: TierId, ks: &[u32]) {
    assert!(
        m.restore_tier(tier, keys(ks.iter().copied()))
            .unwrap()
            .is_empty()
    );
}

/// M6: a successful store cascades to every tier with one pin per tier; J1 unpins on the
/// result, ok or not.
#[test]
fn cascade_pins_once_per_tier() {
    let mut m = manager(4, &[8, 8]);
    store(&mut m, R1, &keys([1, 2]));
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 2);
    assert_eq!((js[0].tier, js[1].tier), (T0, T1));
    assert!(matches!(&js[0].kind, JobKind::Store { request, .. } if *request == R1));
    assert_eq!(load_keys(&js[0]), keys([1, 2]));
    assert_eq!(js[0].blocks()[1].slot, SlotId(1));
    assert_eq!((job_pins(&m, 1), job_pins(&m, 2)), (2, 2));
    assert_eq!(m.stats().job_pins, 4);
    // Pinned blocks are not evictable.
    store(&mut m, R1, &keys([3, 4]));
    drain(&mut m);
    assert!(matches!(
        m.prepare_store(R1, &keys([5])),
        Err(Error::NoRoom { .. })
    ));
    report(&mut m, &js[..1], Outcome::Ok);
    report(&mut m, &js[1..], Outcome::Failed);
    // Results wait for the next collection (M1): prepare_store collected in this step.
    m.end_step();
    assert_eq!(job_pins(&m, 1), 2);
    m.end_step();
    assert_eq!((job_pins(&m, 1), job_pins(&m, 2)), (0, 0));
    assert_eq!(
        m.tier(T0).unwrap().state_of(&key(1)),
        Some(EntryState::Present { readers: 0 })
    );
    assert_eq!(m.tier(T1).unwrap().state_of(&key(1)), None); // T9
    let tier_stored = Event {
        medium: Medium::Tier(T0),
        kind: EventKind::Stored,
        keys: keys([1, 2]),
    };
    assert!(m.take_events().contains(&tier_stored)); // T8
}

/// M7: a failed store does not cascade.
#[test]
fn failed_store_does_not_cascade() {
    let mut m = manager(4, &[8]);
    m.prepare_store(R1, &keys([1])).unwrap();
    m.complete_store(R1, &keys([1]), false);
    assert!(drain(&mut m).is_empty());
    assert_eq!(m.stats().job_pins, 0);
}

/// T7, T13: a store job skips keys the tier holds and evicts idle blocks for room, never one
/// a job writes, nor one of the cascade's own blocks; what does not fit is skipped.
#[test]
fn tier_store_skips_held_and_evicts_idle() {
    let mut m = manager(8, &[2]);
    in_tier(&mut m, T0, &[1, 2]); // tier, least recent first: 1 2
    m.touch(&keys([1])); // tier: 2 1 — 2 would be the LRU victim, but it is cascaded too
    store(&mut m, R1, &keys([2, 4]));
    let effects = drain(&mut m);
    assert_eq!(deletes(&effects), vec![(T0, keys([1]))]);
    assert_eq!(load_keys(&jobs(&effects)[0]), keys([4]));
    assert_eq!(m.stats().tiers[0].1.skipped_held, 1);
    store(&mut m, R1, &keys([5])); // 2 is idle: evicted for 5
    assert_eq!(deletes(&drain(&mut m)), vec![(T0, keys([2]))]);
    store(&mut m, R1, &keys([6])); // 4 and 5 are Writing: no room
    assert!(drain(&mut m).is_empty());
    assert_eq!(m.stats().tiers[0].1.skipped_full, 1);
    assert_eq!(job_pins(&m, 6), 0);
}

/// T12, M8: touch reaches every tier's recency.
#[test]
fn touch_reaches_tiers() {
    let mut m = manager(8, &[2]);
    store_and_settle(&mut m, R1, &keys([1]));
    store_and_settle(&mut m, R1, &keys([2]));
    m.touch(&keys([1])); // tier order: 2 1
    store(&mut m, R1, &keys([3]));
    assert_eq!(deletes(&drain(&mut m)), vec![(T0, keys([2]))]);
}

/// M4, J2: a promotion takes two steps: HitPending in the step of the lookup, the load job is
/// submitted at end_step, and the next step's first lookup sees the result.
#[test]
fn promotion_two_step_timing() {
    let mut m = manager(4, &[8]);
    in_tier(&mut m, T0, &[7]);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    assert_eq!(
        m.primary().state_of(&key(7)).unwrap().1,
        BlockState::Promoting
    );
    assert!(drain(&mut m).is_empty(), "batched until end_step");
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending); // M3, no second promotion
    m.end_step();
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 1);
    assert!(
        matches!(&js[0].kind, JobKind::Load { request, blocks } if *request == R1 && blocks[0].slot == SlotId(0))
    );
    assert_eq!(
        m.tier(T0).unwrap().state_of(&key(7)),
        Some(EntryState::Present { readers: 1 })
    );

    // Step 1: a lookup before the result arrives collects nothing...
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    report(&mut m, &js, Outcome::Ok);
    // ...and the result is not collected again in the same step (M1).
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.end_step();
    // Step 2: Hit.
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Hit);
    let promoted = Event {
        medium: Medium::Primary,
        kind: EventKind::Stored,
        keys: keys([7]),
    };
    assert!(m.take_events().contains(&promoted));
    let s = m.stats();
    assert_eq!((s.promotions_started, s.promotions_succeeded), (1, 1));
    assert_eq!(s.tiers[0].1.hits, 1);
}

/// M1: with no lookup in a step, end_step collects the results.
#[test]
fn end_step_collects_when_no_lookup_came() {
    let mut m = manager(4, &[8]);
    in_tier(&mut m, T0, &[7]);
    m.lookup(R1, &key(7));
    m.end_step();
    complete_all(&mut m);
    m.end_step();
    assert_eq!(
        m.primary().state_of(&key(7)).unwrap().1,
        BlockState::Ready {
            load_pins: 0,
            job_pins: 0
        }
    );
}

/// M5: one load job per (tier, request), keys in lookup order; tiers in the order of their
/// first staged promotion, then requests in the order of their first promotion from the tier
/// (vLLM 0.33's flush order); a block wanted by two requests is promoted once.
#[test]
fn promotions_batched_per_tier_and_request() {
    let mut m = manager(8, &[8, 8]);
    in_tier(&mut m, T0, &[1, 2, 4]);
    in_tier(&mut m, T1, &[3]);
    let r3 = RequestId(3);
    assert_eq!(m.lookup(R2, &key(2)), Lookup::HitPending);
    assert_eq!(m.lookup(R1, &key(4)), Lookup::HitPending);
    assert_eq!(m.lookup(R2, &key(3)), Lookup::HitPending);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    assert_eq!(m.lookup(r3, &key(2)), Lookup::HitPending); // shared block: no second promotion
    m.end_step();
    let js = jobs(&drain(&mut m));
    let shape: Vec<(TierId, RequestId, Vec<kvtier_core::Key>)> = js
        .iter()
        .map(|j| match &j.kind {
            JobKind::Load { request, .. } => (j.tier, *request, load_keys(j)),
            k => panic!("unexpected {k:?}"),
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (T0, R2, keys([2, 1])),
            (T0, R1, keys([4])),
            (T1, R2, keys([3])),
        ]
    );
    // Job ids are given at submission, in order.
    assert_eq!(
        js.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![JobId(1), JobId(2), JobId(3)]
    );
    assert_eq!(m.stats().promotions_started, 4);
}

/// ★2, J3: a failed promotion removes the Promoting block and makes lookups skip the tier for
/// the key: the engine gets Miss and recomputes instead of retrying forever.
#[test]
fn failed_promotion_does_not_livelock() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 8)];
    c.promotion_cooldown_steps = 3;
    let mut m = manager_with(c);
    in_tier(&mut m, T0, &[7]);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.end_step();
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Failed);
    m.end_step(); // step 1 collects: failure at step 1, skip until step 4
    assert_eq!(m.primary().state_of(&key(7)), None);
    // The failed promotion is a Discarded block, never a Stored one (J3).
    assert!(
        m.take_events()
            .iter()
            .all(|e| e.medium != Medium::Primary || e.kind == EventKind::Discarded)
    );
    for _ in 0..2 {
        assert_eq!(m.lookup(R1, &key(7)), Lookup::Miss);
        assert!(
            drain(&mut m).is_empty(),
            "no probe, no promotion while cooling down"
        );
        m.end_step();
    }
    // After the cooldown the shared tier is asked again (it forgot the block: a probe).
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Retry);
    assert!(matches!(
        &jobs(&drain(&mut m))[0].kind,
        JobKind::Exists { .. }
    ));
    assert_eq!(m.stats().promotions_failed, 1);
}

/// ★2: a cooldown is per (tier, key): while one block cools down, another block of the same
/// tier still promotes.
#[test]
fn cooldown_skips_only_its_own_key() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 8)];
    let mut m = manager_with(c);
    in_tier(&mut m, T0, &[7, 8]);
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.end_step();
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Failed);
    m.end_step();
    assert_eq!(m.lookup(R1, &key(7)), Lookup::Miss, "7 cools down");
    assert_eq!(m.lookup(R1, &key(8)), Lookup::HitPending, "8 is promoted");
    m.end_step();
    let js = jobs(&drain(&mut m));
    assert_eq!(load_keys(&js[0]), keys([8]));
}

/// T11: a failed read on an authoritative tier drops the block and deletes it.
#[test]
fn failed_read_on_authoritative_tier_deletes_block() {
    let mut m = manager(4, &[8]);
    in_tier(&mut m, T0, &[7]);
    m.lookup(R1, &key(7));
    m.end_step();
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Failed);
    m.end_step();
    assert_eq!(deletes(&drain(&mut m)), vec![(T0, keys([7]))]);
    assert_eq!(m.tier(T0).unwrap().state_of(&key(7)), None);
}

/// ★8: a promotion that could only make room by evicting blocks its own request was just
/// answered Hit for answers Miss; another request may evict them.
#[test]
fn promotion_never_evicts_own_hits() {
    let mut m = manager(2, &[8]);
    store_and_settle(&mut m, R1, &keys([1, 2]));
    in_tier(&mut m, T0, &[3]);
    m.primary().check_invariants().unwrap();
    // The tier holds 1 2 3; the primary 1 2.
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Hit);
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Hit);
    assert_eq!(m.lookup(R1, &key(3)), Lookup::Miss);
    assert_eq!(m.stats().promotions_refused, 1);
    assert_eq!(m.primary().state_of(&key(1)).map(|s| s.0), Some(SlotId(0)));
    // Another request is not protected by R1's hits: its promotion evicts the LRU block.
    assert_eq!(m.lookup(R2, &key(3)), Lookup::HitPending);
    assert_eq!(m.primary().state_of(&key(1)), None);
    // Protection ends with the step.
    m.end_step();
    complete_all(&mut m);
    m.end_step();
    assert_eq!(m.lookup(R1, &key(3)), Lookup::Hit);
    assert_eq!(m.lookup(R1, &key(1)), Lookup::HitPending); // promoted back, evicting 2
}

/// M4: a busy tier (a write in flight) makes the answer Retry, not Miss, and does not stop
/// the scan of later tiers.
#[test]
fn busy_tier_answers_retry_and_scan_continues() {
    let mut m = manager(1, &[8, 8]);
    store(&mut m, R1, &keys([1])); // writing to both tiers
    let js = jobs(&drain(&mut m));
    report(&mut m, &js[1..], Outcome::Ok); // tier 1 done, tier 0 still writing
    m.end_step();
    // Evict 1 from the primary: 1 is pinned by tier 0's job, so nothing can be evicted.
    assert!(m.prepare_store(R1, &keys([2])).is_err());
    report(&mut m, &js[..1], Outcome::Ok);
    m.end_step();
    store(&mut m, R1, &keys([2]));
    let js2 = jobs(&drain(&mut m));
    // Now 1 is Present in both tiers; 2 is Writing in both.
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Hit);
    m.end_step();
    m.prepare_store(R1, &keys([3])).unwrap_err(); // 2 is pinned by its cascade
    report(&mut m, &js2, Outcome::Ok);
    m.end_step();
    m.prepare_store(R1, &keys([3])).unwrap(); // evicts 2
    // 2 is Present in the tiers, 3 Pending in the primary: 1's promotion has no room.
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Miss);
    assert_eq!(m.stats().promotions_refused, 1);
    // A key being written in tier 0 and absent in tier 1 → Retry.
    m.complete_store(R1, &keys([3]), true);
    let js3 = jobs(&drain(&mut m));
    report(&mut m, &js3[1..], Outcome::Failed); // tier 1 fails
    m.end_step();
    m.lookup(R2, &key(0)); // collect
    assert_eq!(
        m.tier(T0).unwrap().state_of(&key(3)),
        Some(EntryState::Writing)
    );
    assert_eq!(m.tier(T1).unwrap().state_of(&key(3)), None);
}

/// ★3, H1–H5: consecutive failures take a tier Down: cascades and lookups skip it and no pins
/// are taken; after the interval one probe decides; a healthy probe brings it Up.
#[test]
fn tier_health_down_skip_probe_up() {
    let mut c = Config::new(8);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 8)];
    c.health = HealthConfig {
        failures_to_down: 2,
        probe_interval_steps: 3,
    };
    let mut m = manager_with(c);
    in_tier(&mut m, T0, &[100]);
    for i in 0..2 {
        store(&mut m, R1, &keys([i]));
        let js = jobs(&drain(&mut m));
        report(&mut m, &js, Outcome::Failed);
        m.end_step();
    }
    // The first failure was collected in step 1; step 2 has no lookup, so end_step collects
    // the second: H1.
    m.end_step();
    assert_eq!(m.health(T0), Some(Health::Down { since: 2 }));
    store(&mut m, R1, &keys([5, 6]));
    assert!(drain(&mut m).is_empty());
    assert_eq!(job_pins(&m, 5), 0);
    assert_eq!(m.stats().tiers[0].1.skipped_down, 2);
    assert_eq!(m.lookup(R1, &key(100)), Lookup::Miss); // the tier is skipped
    m.end_step(); // end of step 3
    m.end_step(); // end of step 4
    assert!(drain(&mut m).is_empty());
    m.end_step(); // end of step 5: 3 steps since Down → H3
    let js = jobs(&drain(&mut m));
    assert!(matches!(js[..], [ref j] if j.kind == JobKind::Health));
    assert_eq!(m.health(T0), Some(Health::Probing));
    report(&mut m, &js, Outcome::Failed);
    m.end_step(); // step 6 collects: H5
    assert_eq!(m.health(T0), Some(Health::Down { since: 6 }));
    for _ in 0..3 {
        m.end_step();
    }
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 1);
    report(&mut m, &js, Outcome::Ok);
    m.end_step(); // H4
    assert_eq!(m.health(T0), Some(Health::Up));
    assert_eq!(m.lookup(R1, &key(100)), Lookup::HitPending);
    let s = m.stats().tiers[0].1.clone();
    assert_eq!((s.went_down, s.came_up), (1, 1));
}

/// H2: a successful job resets the failure count.
#[test]
fn success_resets_failure_count() {
    let mut c = Config::new(8);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 8)];
    c.health.failures_to_down = 2;
    let mut m = manager_with(c);
    for (i, outcome) in [Outcome::Failed, Outcome::Ok, Outcome::Failed]
        .into_iter()
        .enumerate()
    {
        store(&mut m, R1, &keys([i as u32]));
        let js = jobs(&drain(&mut m));
        report(&mut m, &js, outcome);
        m.end_step();
    }
    m.end_step(); // collects the last failure: one since the reset, not two
    assert_eq!(m.health(T0), Some(Health::Up));
}

/// ★4: a cascade beyond the bound on outstanding store jobs skips the tier for those blocks,
/// counted, and takes no pins for it.
#[test]
fn back_pressure_skips_and_counts() {
    let mut c = Config::new(8);
    let mut t = TierConfig::new(TierKind::Authoritative, 8);
    t.max_outstanding_stores = 1;
    c.tiers = vec![t.clone(), TierConfig::new(TierKind::Authoritative, 8)];
    let mut m = manager_with(c);
    store(&mut m, R1, &keys([1]));
    store(&mut m, R1, &keys([2, 3]));
    let js = jobs(&drain(&mut m));
    assert_eq!(js.iter().filter(|j| j.tier == T0).count(), 1);
    assert_eq!(js.iter().filter(|j| j.tier == T1).count(), 2);
    assert_eq!((job_pins(&m, 1), job_pins(&m, 2)), (2, 1));
    assert_eq!(m.stats().tiers[0].1.skipped_backpressure, 2);
    report(&mut m, &js, Outcome::Ok);
    m.end_step();
    store(&mut m, R1, &keys([4]));
    assert_eq!(jobs(&drain(&mut m)).len(), 2);
}

/// T4–T6: a shared tier asks about unknown keys with one existence probe, answers busy
/// meanwhile, and caches the answer.
#[test]
fn shared_tier_probes_and_caches() {
    let mut c = Config::new(4);
    let mut t = TierConfig::new(TierKind::Shared, 8);
    t.absent_ttl_steps = 2;
    c.tiers = vec![t];
    let mut m = manager_with(c);
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Retry);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Retry);
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Retry);
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 2, "one probe per key");
    assert!(matches!(&js[0].kind, JobKind::Exists { key: k } if *k == key(1)));
    report(&mut m, &js[..1], Outcome::Ok);
    report(&mut m, &js[1..], Outcome::NotFound);
    m.end_step();
    assert_eq!(m.lookup(R1, &key(1)), Lookup::HitPending); // found: promotion starts
    assert_eq!(
        m.primary().state_of(&key(1)).unwrap().1,
        BlockState::Promoting
    );
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Miss); // cached absent
    assert!(drain(&mut m).is_empty());
    m.end_step(); // submits the load of 1
    drain(&mut m);
    m.end_step();
    // The absent answer expired: probe again.
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Retry);
    assert_eq!(jobs(&drain(&mut m)).len(), 1);
    assert_eq!(m.stats().tiers[0].1.probes, 3);
}

/// T14: evicting from a shared tier forgets the block on this node and never deletes it
/// (other nodes may be reading it), whether the room is made for a cascade (T7) or for a
/// block a probe found (T5); the authoritative tier beside it deletes what it evicts.
#[test]
fn t14_a_shared_tier_forgets_what_it_evicts() {
    let mut c = Config::new(8);
    c.tiers = vec![
        TierConfig::new(TierKind::Authoritative, 2),
        TierConfig::new(TierKind::Shared, 2),
    ];
    let mut m = manager_with(c);
    store_and_settle(&mut m, R1, &keys([1, 2]));
    // Both tiers are full: 3's cascade evicts 1 from each, but deletes it from tier 0 only.
    store(&mut m, R1, &keys([3]));
    let effects = drain(&mut m);
    assert_eq!(deletes(&effects), vec![(T0, keys([1]))]);
    report(&mut m, &jobs(&effects), Outcome::Ok);
    assert_eq!(m.stats().tiers[1].1.evictions, 1);
    m.end_step();
    m.end_step();
    // A probe that finds a block makes room by forgetting too.
    assert_eq!(m.lookup(R2, &key(9)), Lookup::Retry);
    let probes = jobs(&drain(&mut m));
    assert!(matches!(&probes[..], [j] if j.tier == T1));
    report(&mut m, &probes, Outcome::Ok);
    m.end_step(); // the lookup collected this step: the result waits for the next (M1)
    m.end_step();
    assert!(deletes(&drain(&mut m)).is_empty());
    assert_eq!(m.stats().tiers[1].1.evictions, 2);
    assert_eq!(
        m.tier(T1).unwrap().state_of(&key(9)),
        Some(EntryState::Present { readers: 0 })
    );
}

/// J6, T15: a load finds blocks gone from the shared store (its memory policy evicted them,
/// they expired, it was flushed). The promotions end (slots freed), the tier forgets the
/// blocks and remembers them as absent (no probe, no promotion: the engine recomputes), and
/// nothing counts as a failure: with `failures_to_down = 1` the tier stays Up. The block that
/// was read is served.
#[test]
fn j6_blocks_gone_from_a_shared_store_are_forgotten_not_failures() {
    let mut c = Config::new(8);
    let mut t = TierConfig::new(TierKind::Shared, 8);
    t.absent_ttl_steps = 4;
    c.tiers = vec![t];
    c.health.failures_to_down = 1;
    let mut m = manager_with(c);
    in_tier(&mut m, T0, &[1, 2, 3]);
    for k in [1, 2, 3] {
        assert_eq!(m.lookup(R1, &key(k)), Lookup::HitPending);
    }
    m.end_step();
    let loads = jobs(&drain(&mut m));
    assert!(matches!(&loads[..], [j] if j.blocks().len() == 3));
    let outcome = Outcome::Partial {
        succeeded: keys([1]),
        missing: keys([2, 3]),
    };
    report(&mut m, &loads, outcome);
    m.end_step();
    let s = m.stats();
    assert_eq!((s.promotions_succeeded, s.promotions_missing), (1, 2));
    assert_eq!(s.promotions_failed, 0);
    let (health, t0) = &s.tiers[0];
    assert_eq!(*health, Health::Up);
    assert_eq!(
        (t0.read_missing, t0.read_failures, t0.jobs_failed),
        (2, 0, 0)
    );
    assert_eq!(m.primary().state_of(&key(2)), None);
    assert_eq!(m.tier(T0).unwrap().state_of(&key(2)), None);
    assert_eq!(
        m.tier(T0).unwrap().state_of(&key(1)),
        Some(EntryState::Present { readers: 0 })
    );
    // Known absent (T6's cache): a Miss without a probe, until the answer expires.
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Hit);
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Miss);
    assert!(drain(&mut m).is_empty());
    // A load whose every block is gone is "not found".
    in_tier(&mut m, T0, &[4]);
    assert_eq!(m.lookup(R2, &key(4)), Lookup::HitPending);
    m.end_step();
    let load = jobs(&drain(&mut m));
    report(&mut m, &load, Outcome::NotFound);
    m.end_step();
    assert_eq!(m.stats().tiers[0].0, Health::Up);
    assert_eq!(m.stats().promotions_missing, 3);
    assert_eq!(m.lookup(R2, &key(4)), Lookup::Miss);
    for _ in 0..4 {
        m.end_step();
    }
    assert_eq!(m.lookup(R2, &key(4)), Lookup::Retry); // expired: ask the store again
}

/// J6: "missing" is an answer of a shared store to a load; anything else is refused.
#[test]
fn j6_missing_applies_to_shared_loads_only() {
    let mut c = Config::new(8);
    c.tiers = vec![
        TierConfig::new(TierKind::Authoritative, 8),
        TierConfig::new(TierKind::Shared, 8),
    ];
    let mut m = manager_with(c);
    in_tier(&mut m, T0, &[1]);
    in_tier(&mut m, T1, &[2]);
    m.lookup(R1, &key(1));
    m.lookup(R1, &key(2));
    m.end_step();
    let js = jobs(&drain(&mut m));
    let (auth, shared) = (js[0].id, js[1].id);
    let before = fingerprint(&m);
    let gone = |k| Outcome::Partial {
        succeeded: Vec::new(),
        missing: keys([k]),
    };
    for (job, outcome) in [
        (auth, gone(1)),
        (auth, Outcome::NotFound),
        (
            shared,
            Outcome::Partial {
                succeeded: keys([2]),
                missing: keys([2]),
            },
        ),
    ] {
        assert!(matches!(
            m.handle_job_result(JobResult { job, outcome }),
            Err(Error::InvalidOutcome { .. })
        ));
    }
    assert_eq!(
        m.handle_job_result(JobResult {
            job: shared,
            outcome: gone(9)
        }),
        Err(Error::ForeignKey {
            job: shared,
            key: key(9)
        })
    );
    assert_eq!(fingerprint(&m), before);
    m.handle_job_result(JobResult {
        job: shared,
        outcome: gone(2),
    })
    .unwrap();
}

/// H1: one collection counts at most one failure per tier, however many of its jobs failed
/// (a step's probes share one round trip to the store: one lost round trip is one failure).
#[test]
fn h1_one_collection_counts_one_failure_per_tier() {
    let mut c = Config::new(8);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 8)];
    c.health.failures_to_down = 2;
    let mut m = manager_with(c);
    for k in 1..=3 {
        assert_eq!(m.lookup(R1, &key(k)), Lookup::Retry);
    }
    let probes = jobs(&drain(&mut m));
    assert_eq!(probes.len(), 3);
    report(&mut m, &probes, Outcome::Failed);
    m.end_step();
    m.end_step();
    assert_eq!(m.stats().tiers[0].1.jobs_failed, 3);
    assert_eq!(
        m.stats().tiers[0].0,
        Health::Up,
        "one collection, one failure"
    );
    assert_eq!(m.lookup(R1, &key(4)), Lookup::Retry);
    let probe = jobs(&drain(&mut m));
    report(&mut m, &probe, Outcome::Failed);
    m.end_step();
    m.end_step();
    assert!(matches!(m.stats().tiers[0].0, Health::Down { .. }));
}

/// T9: a shared tier trusts a "not found" for exactly `absent_ttl_steps` steps after it is
/// collected, and remembers at most `capacity` such answers, forgetting the oldest first.
#[test]
fn absent_answers_last_their_ttl_and_are_bounded() {
    let mut c = Config::new(4);
    let mut t = TierConfig::new(TierKind::Shared, 2);
    t.absent_ttl_steps = 3;
    c.tiers = vec![t];
    let mut m = manager_with(c);
    for _ in 0..5 {
        m.end_step();
    }
    for k in [1, 2] {
        assert_eq!(m.lookup(R1, &key(k)), Lookup::Retry);
    }
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::NotFound);
    m.end_step(); // step 5 had collected already: step 6's first lookup collects (M1)
    for step in 6..=8 {
        assert_eq!(m.step(), step);
        for k in [1, 2] {
            assert_eq!(m.lookup(R1, &key(k)), Lookup::Miss, "step {step}");
        }
        assert!(drain(&mut m).is_empty(), "no probe at step {step}");
        m.end_step();
    }
    assert_eq!(
        m.lookup(R1, &key(1)),
        Lookup::Retry,
        "collected at 6, expired at 6 + 3"
    );
    assert_eq!(jobs(&drain(&mut m)).len(), 1);
    // Bounded: a third answer forgets the oldest one.
    let mut c = Config::new(4);
    let mut t = TierConfig::new(TierKind::Shared, 2);
    t.absent_ttl_steps = 100;
    c.tiers = vec![t];
    let mut m = manager_with(c);
    for k in [1, 2, 3] {
        assert_eq!(m.lookup(R1, &key(k)), Lookup::Retry);
        let js = jobs(&drain(&mut m));
        report(&mut m, &js, Outcome::NotFound);
        m.end_step();
        m.end_step();
    }
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Miss);
    assert_eq!(m.lookup(R1, &key(3)), Lookup::Miss);
    assert!(drain(&mut m).is_empty());
    assert_eq!(
        m.lookup(R1, &key(1)),
        Lookup::Retry,
        "the oldest answer was forgotten"
    );
}

/// J1, J2: partial results: the named blocks succeeded, the others failed.
#[test]
fn partial_results() {
    let mut m = manager(4, &[8]);
    store(&mut m, R1, &keys([1, 2]));
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::partial(keys([2])));
    m.end_step();
    m.end_step();
    let t = m.tier(T0).unwrap();
    assert_eq!(t.state_of(&key(1)), None);
    assert_eq!(
        t.state_of(&key(2)),
        Some(EntryState::Present { readers: 0 })
    );
    assert_eq!(m.stats().job_pins, 0);
    assert_eq!(m.stats().tiers[0].1.write_failures, 1);

    in_tier(&mut m, T0, &[5, 6]);
    m.lookup(R1, &key(5));
    m.lookup(R1, &key(6));
    m.end_step();
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::partial(keys([6])));
    m.end_step();
    assert_eq!(m.lookup(R1, &key(6)), Lookup::Hit);
    assert_eq!(m.lookup(R1, &key(5)), Lookup::Miss); // cooling down (and dropped)
}

/// ★7: bad results are typed errors and change nothing.
#[test]
fn bad_results_are_rejected_without_change() {
    let mut m = manager(4, &[8]);
    store(&mut m, R1, &keys([1]));
    let js = jobs(&drain(&mut m));
    let before = fingerprint(&m);
    let bad = |job, outcome| JobResult { job, outcome };
    assert_eq!(
        m.handle_job_result(bad(JobId(99), Outcome::Ok)),
        Err(Error::UnknownJob { job: JobId(99) })
    );
    assert_eq!(
        m.handle_job_result(bad(js[0].id, Outcome::partial(keys([9])))),
        Err(Error::ForeignKey {
            job: js[0].id,
            key: key(9)
        })
    );
    assert!(matches!(
        m.handle_job_result(bad(js[0].id, Outcome::NotFound)),
        Err(Error::InvalidOutcome { .. })
    ));
    assert_eq!(fingerprint(&m), before);
    m.handle_job_result(bad(js[0].id, Outcome::Ok)).unwrap();
    let before = fingerprint(&m);
    assert_eq!(
        m.handle_job_result(bad(js[0].id, Outcome::Failed)),
        Err(Error::DuplicateResult { job: js[0].id })
    );
    assert_eq!(fingerprint(&m), before);
    assert_eq!(
        m.restore_tier(TierId(5), keys([1])),
        Err(Error::UnknownTier { tier: TierId(5) })
    );
}

/// M10: shutdown ends every job: outstanding stores unpin, in-flight and batched promotions
/// free their slots; later results are unknown; the primary goes on alone.
#[test]
fn shutdown_ends_every_job() {
    let mut m = manager(4, &[8]);
    in_tier(&mut m, T0, &[7, 8]);
    store(&mut m, R1, &keys([1]));
    m.lookup(R1, &key(7));
    m.end_step();
    let js = jobs(&drain(&mut m));
    assert_eq!(js.len(), 2);
    m.lookup(R2, &key(8)); // batched, not submitted
    report(&mut m, &js[..1], Outcome::Ok); // received, not collected
    m.shutdown();
    assert_eq!(m.outstanding_jobs().count(), 0);
    assert_eq!(m.stats().job_pins, 0);
    assert_eq!(m.primary().state_of(&key(7)), None);
    assert_eq!(m.primary().state_of(&key(8)), None);
    assert_eq!(
        m.tier(T0).unwrap().state_of(&key(8)),
        Some(EntryState::Present { readers: 0 })
    );
    assert_eq!(
        m.tier(T0).unwrap().state_of(&key(1)),
        Some(EntryState::Present { readers: 0 })
    );
    assert_eq!(
        m.handle_job_result(JobResult {
            job: js[1].id,
            outcome: Outcome::Ok
        }),
        Err(Error::UnknownJob { job: js[1].id })
    );
    assert_eq!(m.health(T0), Some(Health::Closed));
    store(&mut m, R1, &keys([2]));
    assert_eq!(m.lookup(R1, &key(8)), Lookup::Miss);
    m.end_step();
    assert!(drain(&mut m).is_empty());
    assert!(m.is_closed());
}

/// ★6: restoring a tier at start keeps what fits and returns the rest.
#[test]
fn restore_tier_within_capacity() {
    let mut m = manager(4, &[2]);
    let rejected = m.restore_tier(T0, keys([1, 2, 2, 3])).unwrap();
    assert_eq!(rejected, keys([3]));
    assert_eq!(m.tier(T0).unwrap().len(), 2);
}

/// The quiescence property on one scenario: with every job completed and the step ended,
/// nothing is Pending, Promoting or pinned.
#[test]
fn settles_to_quiescence() {
    let mut m = manager(3, &[4, 4]);
    in_tier(&mut m, T1, &[10, 11]);
    for i in 0..6u32 {
        let ks = keys([i, i + 1]);
        if m.prepare_store(R1, &ks).is_ok() {
            m.complete_store(R1, &ks, true);
        }
        m.lookup(R2, &key(10 + i % 2));
        m.end_step();
        complete_all(&mut m);
    }
    m.end_step();
    complete_all(&mut m);
    m.end_step();
    assert_eq!(m.outstanding_jobs().count(), 0);
    assert_eq!(m.stats().job_pins, 0);
    for i in 0..12 {
        if let Some((_, s)) = m.primary().state_of(&key(i)) {
            assert_eq!(
                s,
                BlockState::Ready {
                    load_pins: 0,
                    job_pins: 0
                }
            );
        }
    }
}

/// T4 bounded: beyond `max_outstanding_probes` a shared tier is skipped for unknown keys.
#[test]
fn probes_are_bounded() {
    let mut c = Config::new(4);
    let mut t = TierConfig::new(TierKind::Shared, 8);
    t.max_outstanding_probes = 1;
    c.tiers = vec![t];
    let mut m = manager_with(c);
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Retry);
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Miss);
    assert_eq!(jobs(&drain(&mut m)).len(), 1);
    assert_eq!(m.stats().tiers[0].1.probes_skipped, 1);
}

/// M12–M15: a reset waits for the jobs to end, forgets the primary, keeps the tiers, and holds
/// promotions until the engine says the pre-reset transfers are flushed.
#[test]
fn reset_cache_forgets_the_primary_and_holds_promotions_until_flushed() {
    let mut m = manager(4, &[8]);
    store(&mut m, R1, &keys([1, 2]));
    assert!(m.has_pending_work(), "the cascade is outstanding");
    assert_eq!(m.reset_cache(), Err(Error::Busy { jobs: 1 }));
    complete_all(&mut m);
    assert!(m.has_pending_work(), "its result waits for collection");
    m.prepare_load(R1, &keys([1])).unwrap();
    assert_eq!(m.reset_cache(), Ok(()));
    assert!(!m.has_pending_work());
    assert!(m.primary().is_empty());
    assert_eq!(m.primary().free_slots(), 4);
    assert_eq!(m.stats().load_pins, 0);
    assert_eq!(
        m.complete_load(&keys([1])),
        Err(Error::NotPinned { key: key(1) }),
        "a forgotten pin"
    );
    // The tier kept both blocks, but promotions are held: a primary miss is a Miss.
    assert_eq!(m.tier(T0).unwrap().len(), 2);
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Miss);
    assert!(drain(&mut m).is_empty(), "no promotion, no probe");
    // Fresh slots again, from 0.
    assert_eq!(m.prepare_store(R1, &keys([3])).unwrap().slots, [SlotId(0)]);
    m.reset_flushed();
    assert_eq!(m.lookup(R1, &key(1)), Lookup::HitPending);
    m.check_invariants().unwrap();
}

/// M13: a reset keeps the positions a live request was given (vLLM keeps them in the request's
/// context and its scheduler does not give them again): the request's blocks stored after the
/// reset are still ranked tail first (L1).
#[test]
fn reset_cache_keeps_live_requests_positions() {
    let mut m = manager(2, &[]);
    let s = RequestId(9);
    m.set_position(R1, &key(1), 16);
    m.set_position(R1, &key(2), 32);
    m.reset_cache().unwrap();
    store(&mut m, R1, &keys([1, 2]));
    assert_eq!(
        m.prepare_store(s, &keys([3])).unwrap().evicted,
        keys([2]),
        "the tail (position 32) goes first"
    );
}

/// P16: events come as vLLM 0.33 gives them: the primary's first, then each tier's.
#[test]
fn events_come_primary_first_then_by_tier() {
    let mut m = manager(1, &[4]);
    store(&mut m, R1, &keys([1])); // cascade job
    complete_all(&mut m);
    m.end_step();
    m.lookup(R1, &key(9)); // collects: the tier's Stored event
    m.prepare_store(R1, &keys([2])).unwrap(); // evicts 1 from the primary
    let media: Vec<Medium> = m.take_events().iter().map(|e| e.medium).collect();
    assert_eq!(
        media,
        [Medium::Primary, Medium::Primary, Medium::Tier(T0)],
        "stored 1, removed 1, then the tier's stored 1"
    );
}
