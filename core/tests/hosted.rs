//! A tier under another manager (`HostedTier`, rules G1–G16 of `docs/state-machine.md`), one
//! test per rule, and a seeded walk that checks I13 and "every host job ends exactly once".

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::Rng;

use kvtier_core::{
    Admission, ConfigError, Effect, Error, EventKind, Health, HealthConfig, HostedConfig,
    HostedLookup, HostedResult, HostedTier, JobId, JobKind, JobResult, Key, Outcome, PolicyKind,
    SlotId, TierConfig, TierKind,
};

fn k(i: u8) -> Key {
    Key::new(&[b'k', i])
}

fn tier(kind: TierKind, capacity: u32) -> HostedTier {
    HostedTier::new(HostedConfig::new(TierConfig::new(kind, capacity))).expect("a valid tier")
}

fn blocks(keys: &[u8]) -> Vec<(Key, SlotId)> {
    keys.iter()
        .enumerate()
        .map(|(slot, &i)| (k(i), SlotId(slot as u32)))
        .collect()
}

/// Every effect polled now: the jobs submitted, and the keys deleted.
fn effects(t: &mut HostedTier) -> (Vec<kvtier_core::Job>, Vec<Key>) {
    let (mut jobs, mut deleted) = (Vec::new(), Vec::new());
    while let Some(e) = t.poll_effect() {
        match e {
            Effect::Submit(job) => jobs.push(job),
            Effect::Delete { keys, .. } => deleted.extend(keys),
        }
    }
    (jobs, deleted)
}

/// Stores `keys` as job `job` and ends it: every written block written.
fn stored(t: &mut HostedTier, job: u64, keys: &[u8]) -> HostedResult {
    t.submit_store(JobId(job), &blocks(keys)).unwrap();
    for j in effects(t).0 {
        t.handle_job_result(JobResult {
            job: j.id,
            outcome: Outcome::Ok,
        })
        .unwrap();
    }
    let mut done = t.take_finished();
    assert_eq!(done.len(), 1, "one result per job");
    done.pop().unwrap()
}

#[test]
fn g1_a_hit_holds_its_block_against_eviction_until_the_step_ends() {
    let mut t = tier(TierKind::Authoritative, 2);
    stored(&mut t, 1, &[0, 1]);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Hit);
    assert_eq!(t.lookup(&k(1)), HostedLookup::Hit);
    // Both are held: a store in the same step makes no room and skips its block.
    let r = stored(&mut t, 2, &[2]);
    assert!(
        r.success,
        "skipping for room is the tier's choice, not a failure"
    );
    assert_eq!(t.stats().blocks_skipped_full, 1);
    assert_eq!(t.lookup(&k(2)), HostedLookup::Miss);
    // The host promotes k0 at the end of the step: it is still there.
    t.submit_load(JobId(3), &[(k(0), SlotId(6))]).unwrap();
    let (jobs, _) = effects(&mut t);
    assert_eq!(jobs.len(), 1);
    t.end_step();
    // k1's hold ended with the step; k0 is still read by job 3. Storing k2 now evicts k1.
    let r = stored(&mut t, 4, &[2]);
    assert_eq!(r.blocks, 1);
    assert_eq!(t.lookup(&k(1)), HostedLookup::Miss);
    t.handle_job_result(JobResult {
        job: JobId(3),
        outcome: Outcome::Ok,
    })
    .unwrap();
    let done = t.take_finished();
    assert_eq!(done.len(), 1);
    assert!(done[0].success && done[0].load && done[0].blocks == 1);
    t.check_invariants().unwrap();
}

#[test]
fn g1_a_key_looked_up_twice_in_a_step_is_held_once() {
    let mut t = tier(TierKind::Authoritative, 2);
    stored(&mut t, 1, &[0]);
    for _ in 0..3 {
        assert_eq!(t.lookup(&k(0)), HostedLookup::Hit);
    }
    t.end_step();
    // No hold is left: the block can be evicted.
    stored(&mut t, 2, &[1, 2]);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss);
    t.check_invariants().unwrap();
}

#[test]
fn g2_a_block_being_written_answers_retry() {
    let mut t = tier(TierKind::Authoritative, 4);
    t.submit_store(JobId(1), &blocks(&[0])).unwrap();
    assert_eq!(t.lookup(&k(0)), HostedLookup::Retry);
    let (jobs, _) = effects(&mut t);
    t.handle_job_result(JobResult {
        job: jobs[0].id,
        outcome: Outcome::Ok,
    })
    .unwrap();
    assert_eq!(t.lookup(&k(0)), HostedLookup::Hit);
}

#[test]
fn g3_an_absent_block_misses_and_starts_nothing() {
    let mut t = tier(TierKind::Authoritative, 4);
    assert_eq!(t.lookup(&k(9)), HostedLookup::Miss);
    assert_eq!(effects(&mut t).0.len(), 0);
}

#[test]
fn g4_a_shared_tier_probes_an_unknown_key_and_remembers_the_answer() {
    let mut t = tier(TierKind::Shared, 4);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Retry);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Retry, "one probe per key");
    let (jobs, _) = effects(&mut t);
    assert_eq!(jobs.len(), 1);
    assert!(matches!(&jobs[0].kind, JobKind::Exists { key } if *key == k(0)));
    t.handle_job_result(JobResult {
        job: jobs[0].id,
        outcome: Outcome::Ok,
    })
    .unwrap();
    assert_eq!(t.lookup(&k(0)), HostedLookup::Hit);
    assert!(t.take_finished().is_empty(), "a probe is not a host job");

    assert_eq!(t.lookup(&k(1)), HostedLookup::Retry);
    let (jobs, _) = effects(&mut t);
    t.handle_job_result(JobResult {
        job: jobs[0].id,
        outcome: Outcome::NotFound,
    })
    .unwrap();
    assert_eq!(t.lookup(&k(1)), HostedLookup::Miss, "known absent");
    assert_eq!(effects(&mut t).0.len(), 0);
    t.check_invariants().unwrap();
}

#[test]
fn g4_beyond_the_probe_bound_a_lookup_misses() {
    let mut c = TierConfig::new(TierKind::Shared, 8);
    c.max_outstanding_probes = 2;
    let mut t = HostedTier::new(HostedConfig::new(c)).expect("a valid tier");
    assert_eq!(t.lookup(&k(0)), HostedLookup::Retry);
    assert_eq!(t.lookup(&k(1)), HostedLookup::Retry);
    assert_eq!(t.lookup(&k(2)), HostedLookup::Miss);
    assert_eq!(t.stats().probes_skipped, 1);
}

#[test]
fn g5_a_store_of_held_blocks_ends_at_once_with_success() {
    let mut t = tier(TierKind::Authoritative, 4);
    stored(&mut t, 1, &[0, 1]);
    t.submit_store(JobId(2), &blocks(&[1, 0])).unwrap();
    assert_eq!(effects(&mut t).0.len(), 0, "nothing to write");
    let done = t.take_finished();
    assert_eq!(done.len(), 1);
    assert!(done[0].success && done[0].blocks == 0);
    assert_eq!(t.stats().blocks_already_held, 2);
}

#[test]
fn g5_eviction_deletes_before_the_store_that_needs_the_room() {
    let mut t = tier(TierKind::Authoritative, 2);
    stored(&mut t, 1, &[0, 1]);
    t.submit_store(JobId(2), &blocks(&[2])).unwrap();
    let mut order = Vec::new();
    while let Some(e) = t.poll_effect() {
        order.push(e);
    }
    assert!(matches!(&order[0], Effect::Delete { keys, .. } if keys == &vec![k(0)]));
    assert!(matches!(&order[1], Effect::Submit(_)));
    let removed: Vec<_> = t
        .take_events()
        .into_iter()
        .filter(|e| e.kind == EventKind::Removed)
        .collect();
    assert_eq!(removed.len(), 1);
}

/// Whether the tier holds `key` (without a lookup, which would hold it, G1).
fn holds(t: &HostedTier, key: u8) -> bool {
    t.index().state_of(&k(key)).is_some()
}

/// Loads `keys` as job `job`, ends it with `outcome` and returns its one result.
fn loaded(t: &mut HostedTier, job: u64, keys: &[u8], outcome: Outcome) -> HostedResult {
    t.submit_load(JobId(job), &blocks(keys)).unwrap();
    effects(t);
    t.handle_job_result(JobResult {
        job: JobId(job),
        outcome,
    })
    .unwrap();
    let mut done = t.take_finished();
    assert_eq!(done.len(), 1, "one result per job");
    done.pop().unwrap()
}

/// G16 under `policy`: a full tier of 0 then 1; 0 is read back; the next store evicts 1,
/// stored after 0 and never read, not 0. (Without G16 a host that never touches, as vLLM
/// 0.33, leaves the tier its stores' order, and 0 goes first.)
fn a_block_read_back_outlives_one_never_read(policy: PolicyKind) {
    let mut t = with(TierKind::Authoritative, 2, |c| c.tier.policy = policy);
    stored(&mut t, 1, &[0, 1]);
    assert!(loaded(&mut t, 2, &[0], Outcome::Ok).success);
    t.check_invariants().unwrap();
    stored(&mut t, 3, &[2]);
    assert!(holds(&t, 0), "{policy:?}: the block read back was evicted");
    assert!(!holds(&t, 1), "{policy:?}");
    t.check_invariants().unwrap();
}

#[test]
fn g16_a_block_read_back_outlives_one_never_read_under_lru() {
    a_block_read_back_outlives_one_never_read(PolicyKind::Lru);
}

#[test]
fn g16_a_block_read_back_outlives_one_never_read_under_arc() {
    a_block_read_back_outlives_one_never_read(PolicyKind::Arc);
}

#[test]
fn g16_a_block_read_back_outlives_one_never_read_under_the_reuse_aware_lru() {
    a_block_read_back_outlives_one_never_read(PolicyKind::Reuse);
}

/// G16: a load's blocks are learned in the host's order, the first most recent (vLLM names
/// a request's blocks head first); a block whose read failed is dropped, not learned (G8).
#[test]
fn g16_a_loads_first_block_ends_most_recent_and_a_failed_read_is_not_learned() {
    let mut t = tier(TierKind::Authoritative, 3);
    stored(&mut t, 1, &[0, 1, 2]);
    loaded(&mut t, 2, &[0, 1], Outcome::Ok);
    stored(&mut t, 3, &[3]);
    assert!(!holds(&t, 2), "2 was never read: it goes first");
    stored(&mut t, 4, &[4]);
    assert!(
        holds(&t, 0) && !holds(&t, 1),
        "1 was read before 0 in the walk back"
    );

    let mut t = tier(TierKind::Authoritative, 3);
    stored(&mut t, 1, &[0, 1, 2]);
    let r = loaded(&mut t, 2, &[0, 1], Outcome::partial(vec![k(1)]));
    assert_eq!(r.blocks, 1);
    assert!(!holds(&t, 0), "G8: a failed read drops its block");
    stored(&mut t, 3, &[3, 4]); // one free row, then one eviction: 2, never read
    assert!(holds(&t, 1) && !holds(&t, 2));
    t.check_invariants().unwrap();
}

/// G16 off (`learn_reads: false`): the tier's recency is its stores' alone.
#[test]
fn g16_without_learning_the_stores_order_decides() {
    let mut t = with(TierKind::Authoritative, 2, |c| c.learn_reads = false);
    stored(&mut t, 1, &[0, 1]);
    loaded(&mut t, 2, &[0], Outcome::Ok);
    stored(&mut t, 3, &[2]);
    assert!(!holds(&t, 0) && holds(&t, 1));
}

#[test]
fn g5_a_shared_tier_never_deletes_what_it_evicts() {
    let mut t = tier(TierKind::Shared, 1);
    stored(&mut t, 1, &[0]);
    t.submit_store(JobId(2), &blocks(&[1])).unwrap();
    let (jobs, deleted) = effects(&mut t);
    assert_eq!(jobs.len(), 1);
    assert!(deleted.is_empty(), "T14");
}

#[test]
fn g6_a_load_of_blocks_the_tier_lacks_fails_at_once_and_never_reads_them() {
    let mut t = tier(TierKind::Authoritative, 4);
    stored(&mut t, 1, &[0]);
    t.submit_load(JobId(2), &blocks(&[5, 6])).unwrap();
    assert_eq!(effects(&mut t).0.len(), 0);
    let done = t.take_finished();
    assert!(!done[0].success && done[0].succeeded.is_none());
    // Mixed: only the held block is read; the job names it as the one that succeeded.
    t.submit_load(JobId(3), &blocks(&[5, 0])).unwrap();
    let (jobs, _) = effects(&mut t);
    assert_eq!(jobs[0].blocks().len(), 1);
    assert_eq!(jobs[0].blocks()[0].key, k(0));
    assert_eq!(
        jobs[0].blocks()[0].slot,
        SlotId(1),
        "the host's slot for that key"
    );
    t.handle_job_result(JobResult {
        job: JobId(3),
        outcome: Outcome::Ok,
    })
    .unwrap();
    let done = t.take_finished();
    assert!(!done[0].success);
    assert_eq!(done[0].succeeded, Some(vec![k(0)]));
}

#[test]
fn g7_a_failed_write_leaves_the_block_absent_and_the_job_failed() {
    let mut t = tier(TierKind::Authoritative, 4);
    t.submit_store(JobId(1), &blocks(&[0, 1])).unwrap();
    effects(&mut t);
    t.handle_job_result(JobResult {
        job: JobId(1),
        outcome: Outcome::partial(vec![k(1)]),
    })
    .unwrap();
    let done = t.take_finished();
    assert!(!done[0].success);
    assert_eq!(done[0].blocks, 1);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss);
    assert_eq!(t.lookup(&k(1)), HostedLookup::Hit);
    let stored: Vec<_> = t
        .take_events()
        .into_iter()
        .filter(|e| e.kind == EventKind::Stored)
        .flat_map(|e| e.keys)
        .collect();
    assert_eq!(stored, vec![k(1)], "only the written block is announced");
}

#[test]
fn g8_a_failed_read_is_never_served_and_the_block_is_dropped() {
    let mut t = tier(TierKind::Authoritative, 4);
    stored(&mut t, 1, &[0, 1, 2]);
    t.submit_load(JobId(2), &blocks(&[0, 1, 2])).unwrap();
    effects(&mut t);
    t.handle_job_result(JobResult {
        job: JobId(2),
        outcome: Outcome::partial(vec![k(2), k(0)]),
    })
    .unwrap();
    let done = t.take_finished();
    assert!(!done[0].success);
    assert_eq!(
        done[0].succeeded,
        Some(vec![k(0), k(2)]),
        "in the host's order"
    );
    let (_, deleted) = effects(&mut t);
    assert_eq!(deleted, vec![k(1)], "T11: an unreadable block is dropped");
    assert_eq!(t.lookup(&k(1)), HostedLookup::Miss);
}

#[test]
fn g8_a_shared_store_that_lost_a_block_forgets_it_without_a_probe() {
    let mut t = tier(TierKind::Shared, 4);
    stored(&mut t, 1, &[0]);
    t.submit_load(JobId(2), &blocks(&[0])).unwrap();
    effects(&mut t);
    t.handle_job_result(JobResult {
        job: JobId(2),
        outcome: Outcome::NotFound,
    })
    .unwrap();
    assert!(!t.take_finished()[0].success);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss, "T15: known absent");
    assert_eq!(effects(&mut t).0.len(), 0);
}

#[test]
fn g10_a_job_id_in_use_or_a_key_named_twice_is_refused_and_changes_nothing() {
    let mut t = tier(TierKind::Authoritative, 4);
    t.submit_store(JobId(1), &blocks(&[0])).unwrap();
    effects(&mut t);
    let before = format!("{:?}", t.index());
    assert_eq!(
        t.submit_store(JobId(1), &blocks(&[1])),
        Err(Error::JobInUse { job: JobId(1) })
    );
    assert!(matches!(
        t.submit_load(JobId(7), &[(k(0), SlotId(0)), (k(0), SlotId(1))]),
        Err(Error::InvalidOutcome { .. })
    ));
    assert!(matches!(
        t.submit_store(JobId(8), &[(k(3), SlotId(4)), (k(4), SlotId(4))]),
        Err(Error::InvalidOutcome { .. })
    ));
    assert!(matches!(
        t.submit_store(JobId(1 << 63), &blocks(&[2])),
        Err(Error::JobInUse { .. })
    ));
    assert_eq!(format!("{:?}", t.index()), before);
    assert!(matches!(
        t.handle_job_result(JobResult {
            job: JobId(99),
            outcome: Outcome::Ok
        }),
        Err(Error::UnknownJob { .. })
    ));
    assert!(matches!(
        t.handle_job_result(JobResult {
            job: JobId(1),
            outcome: Outcome::partial(vec![k(5)])
        }),
        Err(Error::ForeignKey { .. })
    ));
    assert_eq!(t.outstanding(), 1, "a refused result ends nothing");
}

#[test]
fn restore_keeps_the_oldest_blocks_up_to_capacity_and_deletes_the_rest() {
    let mut t = tier(TierKind::Authoritative, 2);
    t.restore([k(0), k(1), k(2)]);
    let (_, deleted) = effects(&mut t);
    assert_eq!(deleted, vec![k(2)]);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Hit);
    assert_eq!(t.lookup(&k(2)), HostedLookup::Miss);
}

#[test]
fn g10_a_slot_an_outstanding_load_writes_is_refused_to_every_other_job() {
    let mut t = tier(TierKind::Authoritative, 4);
    stored(&mut t, 1, &[0, 1]);
    t.submit_load(JobId(2), &[(k(0), SlotId(5))]).unwrap();
    effects(&mut t);
    assert_eq!(
        t.submit_load(JobId(3), &[(k(1), SlotId(5))]),
        Err(Error::SlotBusy {
            job: JobId(3),
            slot: SlotId(5)
        })
    );
    assert!(matches!(
        t.submit_store(JobId(4), &[(k(7), SlotId(5))]),
        Err(Error::SlotBusy { .. })
    ));
    // Two stores may read one slot together (a block cascaded twice); a load may not write it.
    t.submit_store(JobId(5), &[(k(8), SlotId(6))]).unwrap();
    t.submit_store(JobId(6), &[(k(9), SlotId(6))]).unwrap();
    assert!(matches!(
        t.submit_load(JobId(7), &[(k(1), SlotId(6))]),
        Err(Error::SlotBusy { .. })
    ));
    t.check_invariants().unwrap();
}

fn with(kind: TierKind, capacity: u32, f: impl FnOnce(&mut HostedConfig)) -> HostedTier {
    let mut c = HostedConfig::new(TierConfig::new(kind, capacity));
    f(&mut c);
    HostedTier::new(c).expect("a valid tier")
}

#[test]
fn g11_a_block_busy_past_the_deadline_answers_miss_and_its_job_goes_on() {
    let mut t = with(TierKind::Authoritative, 4, |c| c.wait_deadline = Some(100));
    t.set_clock(1_000);
    t.submit_store(JobId(1), &blocks(&[0])).unwrap();
    let (jobs, _) = effects(&mut t);
    t.set_clock(1_100);
    assert_eq!(
        t.lookup(&k(0)),
        HostedLookup::Retry,
        "not longer than the deadline"
    );
    t.set_clock(1_101);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss);
    t.set_clock(50); // the clock never goes back
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss);
    assert_eq!(t.stats().wait_timeouts, 2);
    // The write ends, late: its one result, and the block is served from then on.
    t.handle_job_result(JobResult {
        job: jobs[0].id,
        outcome: Outcome::Ok,
    })
    .unwrap();
    assert_eq!(t.take_finished().len(), 1);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Hit);
}

#[test]
fn g11_a_probe_that_never_answers_holds_no_lookup_past_the_deadline() {
    let mut t = with(TierKind::Shared, 4, |c| c.wait_deadline = Some(10));
    assert_eq!(t.lookup(&k(0)), HostedLookup::Retry);
    t.set_clock(11);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss);
    assert_eq!(effects(&mut t).0.len(), 1, "one probe, still running");
}

#[test]
fn g12_a_tier_whose_probes_fail_goes_down_then_a_health_probe_brings_it_back() {
    let mut t = with(TierKind::Shared, 8, |c| {
        c.health = HealthConfig {
            failures_to_down: 2,
            probe_interval_steps: 3,
        }
    });
    for i in 0..2 {
        assert_eq!(t.lookup(&k(i)), HostedLookup::Retry);
        let (jobs, _) = effects(&mut t);
        t.handle_job_result(JobResult {
            job: jobs[0].id,
            outcome: Outcome::Failed,
        })
        .unwrap();
    }
    assert!(matches!(t.health(), Health::Down { .. }));
    // Down: every lookup misses at once, with no probe; stores and loads end at once.
    assert_eq!(t.lookup(&k(5)), HostedLookup::Miss);
    assert_eq!(effects(&mut t).0.len(), 0);
    t.submit_store(JobId(1), &blocks(&[3])).unwrap();
    t.submit_load(JobId(2), &blocks(&[4])).unwrap();
    let done = t.take_finished();
    assert!(done.iter().all(|r| !r.success), "{done:?}");
    assert_eq!(t.stats().blocks_skipped_down, 1);
    for _ in 0..2 {
        t.end_step();
        assert_eq!(effects(&mut t).0.len(), 0, "no probe before the interval");
    }
    t.end_step();
    let (jobs, _) = effects(&mut t);
    assert!(matches!(jobs[0].kind, JobKind::Health));
    assert_eq!(t.health(), Health::Probing);
    t.handle_job_result(JobResult {
        job: jobs[0].id,
        outcome: Outcome::Ok,
    })
    .unwrap();
    assert_eq!(t.health(), Health::Up);
    assert_eq!(t.lookup(&k(5)), HostedLookup::Retry, "probing again");
    t.check_invariants().unwrap();
}

#[test]
fn g13_a_success_between_failures_keeps_the_tier_up() {
    let mut t = with(TierKind::Authoritative, 8, |c| {
        c.health.failures_to_down = 2
    });
    for (job, outcome) in [(1, Outcome::Failed), (2, Outcome::Ok), (3, Outcome::Failed)] {
        t.submit_store(JobId(job), &blocks(&[job as u8])).unwrap();
        effects(&mut t);
        t.handle_job_result(JobResult {
            job: JobId(job),
            outcome,
        })
        .unwrap();
    }
    assert_eq!(t.health(), Health::Up);
}

#[test]
fn g15_a_block_whose_read_failed_while_held_is_never_served_again() {
    let mut t = tier(TierKind::Authoritative, 4);
    stored(&mut t, 1, &[0]);
    assert_eq!(t.lookup(&k(0)), HostedLookup::Hit); // held until the step ends
    t.submit_load(JobId(2), &blocks(&[0])).unwrap();
    effects(&mut t);
    t.handle_job_result(JobResult {
        job: JobId(2),
        outcome: Outcome::Failed,
    })
    .unwrap();
    // Still held, so still indexed; but it answers Miss and no new load reads it.
    assert_eq!(t.lookup(&k(0)), HostedLookup::Miss);
    t.submit_load(JobId(3), &[(k(0), SlotId(7))]).unwrap();
    assert_eq!(effects(&mut t).0.len(), 0);
    t.take_finished();
    // The hold ends with the step: the block is dropped and deleted, and announced removed.
    t.end_step();
    let (_, deleted) = effects(&mut t);
    assert_eq!(deleted, vec![k(0)]);
    assert!(t.index().state_of(&k(0)).is_none());
    let removed: Vec<Key> = t
        .take_events()
        .into_iter()
        .filter(|e| e.kind == EventKind::Removed)
        .flat_map(|e| e.keys)
        .collect();
    assert_eq!(removed, vec![k(0)]);
    t.check_invariants().unwrap();
}

/// A host as vLLM's manager drives a tier, under each policy: lookups, a promotion of each hit
/// at the end of the step, stores of new blocks, jobs ending in any order with any outcome.
/// Checked after every call: I13, one result per job, and that a load of a block answered
/// `Hit` in the same step is always read (G1), never refused for lack of the block.
#[test]
fn a_random_host_never_loses_a_job_or_a_held_block() {
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let kind = if seed % 3 == 0 {
            TierKind::Shared
        } else {
            TierKind::Authoritative
        };
        // Each policy, since every load's reads now reach it (G16).
        let policy = [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::Reuse][(seed / 3 % 3) as usize];
        let mut t = with(kind, 2 + (seed % 4) as u32, |c| {
            c.tier.policy = policy;
            c.wait_deadline = Some(5);
            c.health = HealthConfig {
                failures_to_down: 3,
                probe_interval_steps: 2,
            };
        });
        let mut clock = 0u64;
        // Keys whose read ended badly in this step (G15 may then refuse their load).
        let mut failed_reads: BTreeSet<Key> = BTreeSet::new();
        let mut next_job = 0u64;
        let mut running: Vec<kvtier_core::Job> = Vec::new();
        let mut submitted: BTreeMap<u64, bool> = BTreeMap::new(); // job -> ended
        let mut hits: BTreeSet<Key> = BTreeSet::new();
        for _ in 0..300 {
            match rng.below(6) {
                0 | 1 => {
                    let key = k(rng.below(8) as u8);
                    if t.lookup(&key) == HostedLookup::Hit {
                        hits.insert(key);
                    }
                }
                2 => {
                    let n = 1 + rng.below(3) as u8;
                    let first = rng.below(8) as u8;
                    let keys: Vec<u8> = (0..n).map(|i| (first + i) % 8).collect();
                    next_job += 1;
                    t.submit_store(JobId(next_job), &blocks(&keys)).unwrap();
                    submitted.insert(next_job, false);
                }
                3 if !running.is_empty() => {
                    let job = running.swap_remove(rng.below(running.len() as u64) as usize);
                    let outcome = match (&job.kind, rng.below(4)) {
                        (JobKind::Health, 0) => Outcome::Failed,
                        (JobKind::Health, _) => Outcome::Ok,
                        (JobKind::Exists { .. }, 0) => Outcome::NotFound,
                        (JobKind::Exists { .. }, 1) => Outcome::Failed,
                        (JobKind::Exists { .. }, _) => Outcome::Ok,
                        (_, 0) => Outcome::Failed,
                        (_, 1) => Outcome::partial(
                            job.blocks()
                                .iter()
                                .step_by(2)
                                .map(|b| b.key.clone())
                                .collect(),
                        ),
                        (JobKind::Load { .. }, 2) if kind == TierKind::Shared => Outcome::NotFound,
                        _ => Outcome::Ok,
                    };
                    if matches!(job.kind, JobKind::Load { .. }) {
                        let ok: BTreeSet<Key> = match &outcome {
                            Outcome::Ok => job.blocks().iter().map(|b| b.key.clone()).collect(),
                            Outcome::Partial { succeeded, .. } => {
                                succeeded.iter().cloned().collect()
                            }
                            _ => BTreeSet::new(),
                        };
                        failed_reads.extend(
                            job.blocks()
                                .iter()
                                .map(|b| b.key.clone())
                                .filter(|k| !ok.contains(k)),
                        );
                    }
                    t.handle_job_result(JobResult {
                        job: job.id,
                        outcome,
                    })
                    .unwrap();
                }
                4 => {
                    t.touch(&[k(rng.below(8) as u8)]);
                    clock += rng.below(4);
                    t.set_clock(clock);
                }
                _ => {
                    // The end of the step: each hit is promoted, as vLLM's manager does.
                    if !hits.is_empty() {
                        next_job += 1;
                        // Fresh slots, as vLLM allocates a promotion's (G10).
                        let keys: Vec<(Key, SlotId)> = std::mem::take(&mut hits)
                            .into_iter()
                            .enumerate()
                            .map(|(i, key)| (key, SlotId(1000 + 8 * next_job as u32 + i as u32)))
                            .collect();
                        let up = t.health() == Health::Up;
                        let readable = keys
                            .iter()
                            .filter(|(k, _)| !failed_reads.contains(k))
                            .count();
                        t.submit_load(JobId(next_job), &keys).unwrap();
                        submitted.insert(next_job, false);
                        let mut submitted_load = None;
                        while let Some(e) = t.poll_effect() {
                            if let Effect::Submit(j) = e {
                                if j.id == JobId(next_job) {
                                    submitted_load = Some(j.blocks().len());
                                }
                                running.push(j);
                            }
                        }
                        if up {
                            // A block whose read failed in the step may be gone (G15), or
                            // stored again since; every other one is read.
                            assert!(
                                submitted_load.unwrap_or(0) >= readable,
                                "seed {seed}: G1: every block hit in the step is read"
                            );
                        }
                    }
                    failed_reads.clear();
                    t.end_step();
                }
            }
            while let Some(e) = t.poll_effect() {
                if let Effect::Submit(j) = e {
                    running.push(j);
                }
            }
            for r in t.take_finished() {
                let ended = submitted.get_mut(&r.job.0).expect("a submitted job");
                assert!(!*ended, "seed {seed}: {} ended twice", r.job);
                *ended = true;
                if let Some(s) = &r.succeeded {
                    assert!(!r.success && !s.is_empty());
                }
            }
            t.check_invariants()
                .unwrap_or_else(|v| panic!("seed {seed}: {v}"));
        }
        // Every job still running ends (a health check the last step started too); then
        // every host job has ended exactly once.
        for _ in 0..10 {
            for job in running.drain(..) {
                t.handle_job_result(JobResult {
                    job: job.id,
                    outcome: Outcome::Ok,
                })
                .unwrap();
            }
            t.end_step();
            while let Some(e) = t.poll_effect() {
                if let Effect::Submit(j) = e {
                    running.push(j);
                }
            }
        }
        assert!(
            running.is_empty(),
            "seed {seed}: the tier keeps starting jobs"
        );
        for r in t.take_finished() {
            let ended = submitted.get_mut(&r.job.0).unwrap();
            assert!(!*ended);
            *ended = true;
        }
        assert!(
            submitted.values().all(|e| *e),
            "seed {seed}: a job never ended"
        );
        assert_eq!(t.in_flight(), 0);
        assert_eq!(
            t.health(),
            Health::Up,
            "seed {seed}: a well tier comes back"
        );
        t.check_invariants().unwrap();
    }
}

/// A hosted tier's configuration is checked as a secondary tier's is in `Config::validate`
/// (but for the reuse-aware LRU, which the loads' reads and the host's touches feed), and
/// a victim admission (V1–V4 need kvtier's `Manager`) is refused too: each is a typed error
/// naming its field, never a tier that misbehaves later.
#[test]
fn a_hosted_configuration_out_of_range_is_a_typed_error_naming_its_field() {
    let refused = |f: &dyn Fn(&mut HostedConfig)| {
        let mut c = HostedConfig::new(TierConfig::new(TierKind::Shared, 8));
        f(&mut c);
        match HostedTier::new(c) {
            Err(ConfigError::Invalid { field, .. }) => field,
            Ok(_) => panic!("accepted"),
        }
    };
    type Set<'a> = &'a dyn Fn(&mut HostedConfig);
    let cases: [(Set<'_>, &str); 8] = [
        (&|c| c.tier.capacity_blocks = 0, "tier.capacity_blocks"),
        (
            &|c| c.tier.max_outstanding_stores = 0,
            "tier.max_outstanding_stores",
        ),
        (&|c| c.tier.absent_ttl_steps = 0, "tier.absent_ttl_steps"),
        (
            &|c| c.tier.admission = Admission::Victim { lookahead: 4 },
            "tier.admission",
        ),
        (
            &|c| c.health.failures_to_down = 0,
            "health.failures_to_down",
        ),
        (
            &|c| c.health.probe_interval_steps = 0,
            "health.probe_interval_steps",
        ),
        (
            &|c| c.tier.capacity_blocks = u32::MAX,
            "tier.capacity_blocks",
        ),
        (
            &|c| c.tier.admission = Admission::Victim { lookahead: 0 },
            "tier.admission",
        ),
    ];
    for (set, field) in cases {
        assert_eq!(refused(set), field);
    }
    // The message says why.
    let mut c = HostedConfig::new(TierConfig::new(TierKind::Authoritative, 8));
    c.tier.admission = Admission::Victim { lookahead: 4 };
    let Err(e) = HostedTier::new(c) else {
        panic!("accepted")
    };
    assert!(e.to_string().contains("victim tier"), "{e}");
    // And the edges that are valid are taken: the host's touches feed the reuse-aware LRU,
    // and a deadline of 0 makes a busy block a Miss once the clock moves.
    for policy in [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::Reuse] {
        let mut c = HostedConfig::new(TierConfig::new(TierKind::Shared, 1));
        c.wait_deadline = Some(0);
        c.tier.policy = policy;
        assert!(HostedTier::new(c).is_ok(), "{policy:?}");
    }
}
