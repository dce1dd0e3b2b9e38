//! The small public API around the state machine: keys, ids, accessors and counters. Each is
//! observable by an embedding engine (logs, metrics, persistence), so each is pinned here.

mod common;

use common::*;
use kvtier_core::{Config, JobResult, Key, Lookup, Outcome, TierConfig, TierId, TierKind};

#[test]
fn key_bytes_length_and_order() {
    let k = Key::new(b"abc");
    assert_eq!(k.as_bytes(), b"abc");
    assert_eq!(k.as_ref(), b"abc");
    assert_eq!(k.len(), 3);
    assert!(!k.is_empty());
    assert!(Key::new(b"").is_empty());
    assert_eq!(Key::new(b"").len(), 0);
    // Equal by bytes, also through different allocations; ordered by bytes.
    assert_eq!(k, Key::new(b"abc"));
    assert_ne!(k, Key::new(b"abd"));
    assert!(Key::new(b"abc") < Key::new(b"abd"));
    assert_eq!(
        Key::new(b"b").partial_cmp(&Key::new(b"a")),
        Some(std::cmp::Ordering::Greater)
    );
}

/// The key hash is fixed (no seed): a block's hash is the same in every process and run, so
/// it may be logged, compared across workers, and persisted. It is XXH3-64 with no seed: the
/// empty string's value is the one the XXH3 reference publishes.
#[test]
fn key_hash_is_fixed() {
    let golden: [(&[u8], u64); 5] = [
        (b"", 0x2d06_8005_38d3_94c2),
        (b"a", 0xe6c6_32b6_1e96_4e1f),
        (b"12345678", 0x62e2_9b4c_ad9e_2ef6),
        (b"123456789", 0x72dc_b18b_67a1_7dff),
        (b"block hash + group id", 0xd5c7_cf8c_299a_8595),
    ];
    for (bytes, want) in golden {
        assert_eq!(
            Key::new(bytes).hash64(),
            want,
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    // `Hash` feeds exactly that value to the hasher.
    use std::hash::{Hash, Hasher};
    struct Record(Vec<u64>);
    impl Hasher for Record {
        fn finish(&self) -> u64 {
            0
        }
        fn write(&mut self, _: &[u8]) {
            unreachable!("only write_u64")
        }
        fn write_u64(&mut self, x: u64) {
            self.0.push(x);
        }
    }
    let mut r = Record(Vec::new());
    Key::new(b"a").hash(&mut r);
    assert_eq!(r.0, vec![Key::new(b"a").hash64()]);
}

#[test]
fn key_display_and_debug() {
    assert_eq!(Key::new(&[0xde, 0xad]).to_string(), "dead");
    assert_eq!(Key::new(&[1; 8]).to_string(), "0101010101010101");
    assert_eq!(Key::new(&[1; 9]).to_string(), "0101010101010101…");
    assert_eq!(format!("{:?}", Key::new(&[0xab])), "Key(ab)");
}

#[test]
fn step_reported_and_closed() {
    let mut m = manager(2, &[4]);
    assert_eq!(m.step(), 0);
    m.end_step();
    m.end_step();
    assert_eq!(m.step(), 2);
    store(&mut m, R1, &keys([1]));
    let job = jobs(&drain(&mut m)).remove(0);
    assert!(!m.is_reported(job.id));
    m.handle_job_result(JobResult {
        job: job.id,
        outcome: Outcome::Ok,
    })
    .unwrap();
    assert!(m.is_reported(job.id));
    assert!(!m.is_closed());
    m.shutdown();
    assert!(m.is_closed());
}

/// Every counter of `Stats` and `TierStats` moves by exactly what happened.
#[test]
fn counters_count_exactly() {
    let mut c = Config::new(2);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 4)];
    let mut m = manager_with(c);
    // Three blocks through a 2-slot primary: one eviction, three cascades of one block.
    for i in 1..=3 {
        store_and_settle(&mut m, R1, &keys([i]));
    }
    let s = m.stats();
    assert_eq!(s.evictions, 1);
    assert_eq!(s.tiers[0].1.cascades_submitted, 3);
    assert_eq!(s.tiers[0].1.blocks_cascaded, 3);
    assert_eq!(s.job_pins, 0);
    // Lookups: a hit, a miss, a promotion (HitPending), then its hit.
    assert_eq!(m.lookup(R1, &key(3)), Lookup::Hit);
    assert_eq!(m.lookup(R1, &key(9)), Lookup::Miss);
    assert_eq!(m.lookup(R2, &key(1)), Lookup::HitPending);
    m.end_step();
    complete_all(&mut m);
    m.end_step();
    assert_eq!(m.lookup(R2, &key(1)), Lookup::Hit);
    let s = m.stats();
    assert_eq!(
        (s.lookups, s.hits, s.misses, s.retries, s.hits_pending),
        (4, 2, 1, 0, 1)
    );
    assert_eq!(
        (
            s.promotions_started,
            s.promotions_succeeded,
            s.promotions_failed
        ),
        (1, 1, 0)
    );
    assert_eq!(s.evictions, 2, "the promotion evicted one more block");
    assert_eq!(s.tiers[0].1.hits, 1);
    m.prepare_load(R1, &keys([1, 1])).unwrap();
    assert_eq!(m.stats().load_pins, 2);
    m.complete_load(&keys([1, 1])).unwrap();
    assert_eq!(m.stats().load_pins, 0);
    assert_eq!(m.stats().jobs_outstanding, 0);
    assert_eq!(m.stats().tiers[0].1.blocks, 3);
}

/// Tier counters: evictions made by a cascade's plan, failed writes and reads, failed jobs;
/// and a failed cascade reports no Stored event for the tier.
#[test]
fn tier_counters_and_events_count_exactly() {
    use kvtier_core::{EventKind, Medium};
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 2)];
    c.health.failures_to_down = 10;
    let mut m = manager_with(c);
    for i in 1..=3 {
        store_and_settle(&mut m, R1, &keys([i]));
    }
    let t = m.stats().tiers[0].1.clone();
    assert_eq!((t.evictions, t.write_failures, t.jobs_failed), (1, 0, 0));
    let removed: Vec<_> = m
        .take_events()
        .into_iter()
        .filter(|e| e.medium == Medium::Tier(TierId(0)) && e.kind == EventKind::Removed)
        .collect();
    assert_eq!(removed.len(), 1);
    assert_eq!(
        removed[0].keys,
        keys([1]),
        "the tier's eviction is reported"
    );
    // A cascade that fails wholly: a failed write and a failed job, and no tier event.
    store(&mut m, R1, &keys([4]));
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Failed);
    m.end_step(); // prepare_store collected this step already: applied at the next (M1)
    m.end_step();
    let t = m.stats().tiers[0].1.clone();
    assert_eq!((t.evictions, t.write_failures, t.jobs_failed), (2, 1, 1));
    assert!(
        !m.take_events()
            .iter()
            .any(|e| e.medium == Medium::Tier(TierId(0)) && e.kind == EventKind::Stored),
        "nothing was stored in the tier"
    );
    // A promotion that fails: a failed read and one more failed job.
    let mut m = manager(4, &[4]);
    m.restore_tier(TierId(0), keys([7])).unwrap();
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
    m.end_step();
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Failed);
    m.end_step();
    let t = m.stats().tiers[0].1.clone();
    assert_eq!(
        (t.read_failures, t.jobs_failed, t.write_failures),
        (1, 1, 0)
    );
}

/// With events off nothing is recorded, also for the tiers' stores and evictions.
#[test]
fn events_off_records_nothing() {
    let mut c = Config::new(2);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 2)];
    c.events = false;
    let mut m = manager_with(c);
    for i in 1..=3 {
        store_and_settle(&mut m, R1, &keys([i]));
    }
    assert_eq!(m.stats().tiers[0].1.evictions, 1);
    assert!(m.take_events().is_empty());
}

/// The read-only views an engine uses for its metrics.
#[test]
fn accessors_answer_exactly() {
    let mut c = Config::new(3);
    let mut shared = TierConfig::new(TierKind::Shared, 5);
    shared.policy = kvtier_core::PolicyKind::Arc;
    c.tiers = vec![shared];
    c.policy = kvtier_core::PolicyKind::Arc;
    let mut m = manager_with(c);
    assert!(m.primary().is_empty() && m.tier(TierId(0)).unwrap().is_empty());
    assert_eq!(m.tier(TierId(0)).unwrap().capacity(), 5);
    store(&mut m, R1, &keys([1, 2]));
    assert_eq!(m.primary().len(), 2);
    assert!(!m.primary().is_empty());
    assert!(!m.tier(TierId(0)).unwrap().is_empty(), "Writing counts");
    assert_eq!(
        m.lookup(R1, &key(9)),
        Lookup::Retry,
        "a shared tier is asked"
    );
    assert!(m.tier(TierId(0)).unwrap().is_probing(&key(9)));
    assert!(!m.tier(TierId(0)).unwrap().is_probing(&key(1)));
    match m.primary().policy() {
        kvtier_core::policy::Policy::Arc(a) => assert_eq!(a.list_lens(), [2, 0, 0, 0]),
        other => panic!("ARC configured, got {other:?}"),
    }
}

#[test]
fn a_policy_is_empty_until_an_insert() {
    use kvtier_core::policy::{ArcPolicy, EvictionPolicy, LruPolicy};
    let mut lru = LruPolicy::with_capacity(4);
    let mut arc = ArcPolicy::new(4);
    assert!(lru.is_empty() && arc.is_empty());
    lru.insert(0, &key(1));
    arc.insert(0, &key(1));
    assert!(!lru.is_empty() && !arc.is_empty());
}

/// The canonical state (stateright's state identity) ignores job-id offsets and absolute
/// steps, and keeps what changes future answers: here, an active cooldown.
#[test]
fn canonical_state_names_what_matters() {
    let fresh = |pre_steps: u32| {
        let mut c = Config::new(4);
        c.tiers = vec![TierConfig::new(TierKind::Shared, 8)];
        c.promotion_cooldown_steps = 3;
        let mut m = manager_with(c);
        for _ in 0..pre_steps {
            m.end_step();
        }
        m
    };
    let (mut a, mut b) = (fresh(0), fresh(5));
    assert_eq!(
        a.canonical_state(),
        b.canonical_state(),
        "absolute steps do not matter"
    );
    for m in [&mut a, &mut b] {
        m.restore_tier(TierId(0), keys([7])).unwrap();
        assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending);
        m.end_step();
        let js = jobs(&drain(m));
        report(m, &js, Outcome::Failed);
        m.end_step();
    }
    assert_eq!(a.canonical_state(), b.canonical_state());
    assert!(
        a.canonical_state().contains("cool0:"),
        "{}",
        a.canonical_state()
    );
    let cooling = a.canonical_state();
    for _ in 0..3 {
        a.end_step();
    }
    assert!(
        !a.canonical_state().contains("cool0:"),
        "{}",
        a.canonical_state()
    );
    assert_ne!(a.canonical_state(), cooling);
}

/// Each part of the state shows in the canonical encoding: the primary's blocks, a tier's
/// blocks, and the eviction order (LRU and ARC).
#[test]
fn canonical_state_covers_every_part() {
    use kvtier_core::PolicyKind;
    let pair = |policy: PolicyKind, prep: &dyn Fn(&mut kvtier_core::Manager, u32)| {
        let mut c = Config::new(4);
        c.policy = policy;
        c.tiers = vec![TierConfig::new(TierKind::Authoritative, 4)];
        c.tiers[0].policy = policy;
        let mut ms = [manager_with(c.clone()), manager_with(c)];
        for (i, m) in ms.iter_mut().enumerate() {
            prep(m, i as u32);
            m.take_events();
        }
        let [a, b] = ms;
        assert_ne!(a.canonical_state(), b.canonical_state());
    };
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        // Different blocks in the primary (no tier involved: failed stores cascade nothing).
        pair(policy, &|m, i| {
            m.prepare_store(R1, &keys([i])).unwrap();
        });
        // Different blocks in the tier.
        pair(policy, &|m, i| {
            m.restore_tier(TierId(0), keys([i])).unwrap();
        });
        // The same blocks in another recency order, in the primary.
        pair(policy, &|m, i| {
            store(m, R1, &keys([1, 2]));
            drain(m);
            m.touch(&keys([1 + i]));
        });
        // The same blocks in another recency order, in the tier.
        pair(policy, &|m, i| {
            m.restore_tier(TierId(0), keys([1, 2])).unwrap();
            m.touch(&keys([1 + i]));
        });
    }
}

/// A shared tier's probe that finds a block adds it to a full index by evicting one (T9),
/// counted like any tier eviction.
#[test]
fn a_found_probe_counts_its_eviction() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 1)];
    let mut m = manager_with(c);
    m.restore_tier(TierId(0), keys([1])).unwrap();
    assert_eq!(m.lookup(R1, &key(2)), Lookup::Retry);
    let js = jobs(&drain(&mut m));
    report(&mut m, &js, Outcome::Ok);
    m.end_step();
    m.end_step();
    assert_eq!(m.stats().tiers[0].1.evictions, 1);
    assert!(m.tier(TierId(0)).unwrap().state_of(&key(2)).is_some());
}

/// A manager with a shared tier, two steps on; with `absent`, key 1 was probed and answered
/// "not found" meanwhile.
fn after_probe(absent: bool) -> kvtier_core::Manager {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Shared, 4)];
    let mut m = manager_with(c);
    if absent {
        assert_eq!(m.lookup(R1, &key(1)), Lookup::Retry);
        let js = jobs(&drain(&mut m));
        report(&mut m, &js, Outcome::NotFound);
    }
    m.end_step();
    m.end_step();
    m
}

/// A cached "absent" answer made stale by a later write does not show in the canonical
/// state: it no longer changes any answer.
#[test]
fn a_stale_absent_answer_is_not_state() {
    let run = |absent: bool| {
        let mut m = after_probe(absent);
        store(&mut m, R1, &keys([1])); // written by this node: the answer is stale
        complete_all(&mut m);
        m.end_step();
        m.end_step();
        m.take_events();
        m
    };
    assert_eq!(run(true).canonical_state(), run(false).canonical_state());
}

/// A live cached "absent" answer is state: it changes the next lookup's answer (Miss instead
/// of a probe).
#[test]
fn a_live_absent_answer_is_state() {
    let (a, b) = (after_probe(true), after_probe(false));
    assert_ne!(a.canonical_state(), b.canonical_state());
    let (mut a, mut b) = (a, b);
    assert_eq!(a.lookup(R1, &key(1)), Lookup::Miss);
    assert_eq!(b.lookup(R1, &key(1)), Lookup::Retry);
}
