//! The primary tier, vLLM-compatible rules P1–P17, L1–L3 and A1–A6, through a manager with no
//! secondary tiers (M11) and through `Primary` alone.

mod common;

use common::*;
use kvtier_core::{
    BlockState, Config, Error, Event, EventKind, Lookup, Medium, PolicyKind, Primary, ReuseFilter,
    SlotId,
};

fn slots(ids: &[u32]) -> Vec<SlotId> {
    ids.iter().map(|&i| SlotId(i)).collect()
}

fn stored(ids: &[u32]) -> Event {
    Event {
        medium: Medium::Primary,
        kind: EventKind::Stored,
        keys: keys(ids.iter().copied()),
    }
}

fn removed(ids: &[u32]) -> Event {
    Event {
        medium: Medium::Primary,
        kind: EventKind::Removed,
        keys: keys(ids.iter().copied()),
    }
}

/// vLLM's LRU manager on 4 slots: slot ids, victims and events (P5, P6, P8, P9, L1–L3, slot
/// allocation order).
#[test]
fn lru_four_slots_matches_vllm() {
    let mut m = manager(4, &[]);
    let p = m.prepare_store(R1, &keys([1, 2, 3])).unwrap();
    assert_eq!(p.keys, keys([1, 2, 3]));
    assert_eq!(p.slots, slots(&[0, 1, 2])); // fresh slots ascending
    assert!(p.evicted.is_empty());
    assert_eq!(m.lookup(R1, &key(1)), Lookup::HitPending); // P2: Pending
    m.complete_store(R1, &keys([1, 2, 3]), true);
    assert_eq!(m.take_events(), vec![stored(&[1, 2, 3])]); // P8: one event
    assert_eq!(m.prepare_store(R1, &keys([4])).unwrap().slots, slots(&[3]));
    m.complete_store(R1, &keys([4]), true);
    m.take_events();

    m.touch(&keys([1])); // order, least recent first: 2 3 4 1
    let p = m.prepare_store(R1, &keys([5, 6])).unwrap();
    assert_eq!(p.evicted, keys([2, 3])); // P6: exactly the shortfall, least recent first
    // Victims freed in order (slots 1 then 2), reused last-freed-first.
    assert_eq!(p.slots, slots(&[2, 1]));
    assert_eq!(m.take_events(), vec![removed(&[2, 3])]);

    m.complete_store(R1, &keys([5]), true);
    m.complete_store(R1, &keys([6]), false); // P9: slot 1 freed, a Discarded event
    let discarded = Event {
        medium: Medium::Primary,
        kind: EventKind::Discarded,
        keys: keys([6]),
    };
    assert_eq!(m.take_events(), vec![stored(&[5]), discarded]);
    // A discarded key stored again before the events are taken is left out (P16).
    m.prepare_store(R1, &keys([6])).unwrap();
    m.complete_store(R1, &keys([6]), false);
    m.prepare_store(R1, &keys([6])).unwrap();
    assert_eq!(m.take_events(), vec![]);
    m.complete_store(R1, &keys([6]), false);
    m.take_events();
    assert_eq!(m.prepare_store(R1, &keys([7])).unwrap().slots, slots(&[1]));

    assert_eq!(m.lookup(R1, &key(5)), Lookup::Hit); // P3
    assert_eq!(m.lookup(R1, &key(6)), Lookup::Miss); // P1
    assert_eq!(m.lookup(R1, &key(7)), Lookup::HitPending); // P2

    // Pinned and Pending blocks are not victims: order is 4 1 5 7(pending).
    m.prepare_load(R1, &keys([1])).unwrap();
    m.complete_store(R1, &keys([7]), true);
    let p = m.prepare_store(R1, &keys([8, 9])).unwrap();
    assert_eq!(p.evicted, keys([4, 5]));
}

/// P4, P5: present keys are skipped; all present → empty result, not a refusal; input keys
/// are never victims; duplicates are stored once.
#[test]
fn prepare_store_skips_present_and_protects_input_keys() {
    let mut m = manager(2, &[]);
    store(&mut m, R1, &keys([1, 2]));
    let p = m.prepare_store(R1, &keys([1, 2])).unwrap();
    assert!(p.keys.is_empty() && p.slots.is_empty() && p.evicted.is_empty());
    // 1 is the least recent, but it is an input key: 2 goes instead.
    let p = m.prepare_store(R1, &keys([1, 3])).unwrap();
    assert_eq!(p.keys, keys([3]));
    assert_eq!(p.evicted, keys([2]));
    // Duplicate input keys are stored once.
    let mut m = manager(4, &[]);
    let p = m.prepare_store(R1, &keys([9, 9, 8])).unwrap();
    assert_eq!(p.keys, keys([9, 8]));
    assert_eq!(p.slots, slots(&[0, 1]));
}

/// P7: refusal changes nothing; P12, P14: load contract errors change nothing.
#[test]
fn refusals_and_contract_errors_leave_state_unchanged() {
    let mut m = manager(2, &[]);
    store(&mut m, R1, &keys([1]));
    m.prepare_store(R1, &keys([2])).unwrap(); // Pending
    m.prepare_load(R1, &keys([1])).unwrap(); // pinned
    m.take_events();

    // A refused store still records the request's access (R3, as vLLM does): refuse once,
    // then a second refusal changes nothing.
    let refused = Err(Error::NoRoom {
        needed: 1,
        available: 0,
    });
    assert_eq!(m.prepare_store(R1, &keys([3])), refused);
    m.take_metrics();
    let before = fingerprint(&m);
    assert_eq!(m.prepare_store(R1, &keys([3])), refused);
    // The metrics saw the attempt (vLLM's allocation-size histogram counts refusals).
    assert_eq!(m.take_metrics().allocation_sizes, [1]);
    assert_eq!(fingerprint(&m), before);

    assert_eq!(
        m.prepare_load(R1, &keys([1, 2])),
        Err(Error::NotReady { key: key(2) })
    );
    assert_eq!(
        m.prepare_load(R1, &keys([7])),
        Err(Error::NotReady { key: key(7) })
    );
    assert_eq!(fingerprint(&m), before);

    // One pin, two unpins: the first must be undone.
    assert_eq!(
        m.complete_load(&keys([1, 1])),
        Err(Error::NotPinned { key: key(1) })
    );
    assert_eq!(fingerprint(&m), before);
    assert_eq!(
        m.complete_load(&keys([2])),
        Err(Error::NotPinned { key: key(2) })
    );
    assert_eq!(fingerprint(&m), before);
    assert!(m.take_events().is_empty());

    m.complete_load(&keys([1])).unwrap();
    assert_eq!(
        m.primary().state_of(&key(1)),
        Some((
            SlotId(0),
            BlockState::Ready {
                load_pins: 0,
                job_pins: 0
            }
        ))
    );
}

/// P11, P13: pins per occurrence, slot ids in key order.
#[test]
fn prepare_load_pins_per_occurrence() {
    let mut m = manager(4, &[]);
    store(&mut m, R1, &keys([1, 2]));
    assert_eq!(
        m.prepare_load(R1, &keys([2, 1, 2])).unwrap(),
        slots(&[1, 0, 1])
    );
    assert_eq!(
        m.primary().state_of(&key(2)).unwrap().1,
        BlockState::Ready {
            load_pins: 2,
            job_pins: 0
        }
    );
    assert_eq!(m.stats().load_pins, 3);
    m.complete_load(&keys([2, 2, 1])).unwrap();
    assert_eq!(m.stats().load_pins, 0);
}

/// P10: complete_store ignores absent and Ready blocks.
#[test]
fn complete_store_ignores_absent_and_ready() {
    let mut m = manager(4, &[]);
    store(&mut m, R1, &keys([1]));
    m.take_events();
    let before = fingerprint(&m);
    m.complete_store(R1, &keys([1, 5]), true);
    m.complete_store(R1, &keys([1, 5]), false);
    assert_eq!(fingerprint(&m), before);
    assert!(m.take_events().is_empty());
}

/// P15: touch walks last to first, so the first key ends most recent.
#[test]
fn touch_makes_first_key_most_recent() {
    let mut m = manager(3, &[]);
    store(&mut m, R1, &keys([1, 2, 3]));
    m.touch(&keys([1, 2])); // order 3 2 1
    assert_eq!(m.prepare_store(R1, &keys([4])).unwrap().evicted, keys([3]));
    assert_eq!(m.prepare_store(R1, &keys([5])).unwrap().evicted, keys([2]));
}

/// A1–A6 on 4 slots: T1 / T2 moves, ghost lists, `p` adapting only on touch.
#[test]
fn arc_four_slots_matches_vllm() {
    let mut m = manager_with(arc_config(4));
    let p_of = |m: &kvtier_core::Manager| m.primary().policy().arc_target().unwrap();
    store(&mut m, R1, &keys([1, 2, 3, 4])); // T1 = 1 2 3 4
    m.touch(&keys([1, 2])); // A2: T1 = 3 4, T2 = 2 1
    assert_eq!(p_of(&m), 0.0);
    // A6: t1 = 2 >= p = 0: evict from T1.
    assert_eq!(m.prepare_store(R1, &keys([5])).unwrap().evicted, keys([3]));
    m.complete_store(R1, &keys([5]), true);
    assert_eq!(m.prepare_store(R1, &keys([6])).unwrap().evicted, keys([4]));
    m.complete_store(R1, &keys([6]), true); // T1 = 5 6, B1 = 3 4
    // A5: touching a B1 ghost: p += max(1, |B2|/|B1|) = 1.
    m.touch(&keys([3]));
    assert_eq!(p_of(&m), 1.0);
    // t1 = 2 >= 1: still from T1.
    assert_eq!(m.prepare_store(R1, &keys([7])).unwrap().evicted, keys([5]));
    m.complete_store(R1, &keys([7]), true); // T1 = 6 7, B1 = 4 3 5
    m.touch(&keys([4]));
    m.touch(&keys([3]));
    assert_eq!(p_of(&m), 3.0);
    // t1 = 2 < 3: from T2, its least recent (2).
    assert_eq!(m.prepare_store(R1, &keys([8])).unwrap().evicted, keys([2]));
    // A5 on B2: p -= max(1, |B1|/|B2|) = 3.
    m.touch(&keys([2]));
    assert_eq!(p_of(&m), 0.0);
    // A1: inserting a ghost's key forgets the ghost, p unchanged.
    m.complete_store(R1, &keys([8]), true);
    m.prepare_store(R1, &keys([3])).unwrap();
    m.touch(&keys([3])); // resident and Pending now: A3, no adaptation
    assert_eq!(p_of(&m), 0.0);
}

/// A3: a Pending block in T1 stays in T1 when touched; A6 with T1 holding only ineligible
/// blocks falls back to T2.
#[test]
fn arc_pending_touch_stays_in_t1_and_falls_back_to_t2() {
    let mut m = manager_with(arc_config(3));
    store(&mut m, R1, &keys([1, 2]));
    m.touch(&keys([1, 2])); // T2 = 2 1
    m.prepare_store(R1, &keys([3])).unwrap(); // T1 = 3 (Pending)
    m.touch(&keys([3]));
    // 3 is Pending: the victim must come from T2.
    assert_eq!(m.prepare_store(R1, &keys([4])).unwrap().evicted, keys([2]));
}

/// A6: ghost lists are trimmed to the capacity from the oldest end.
#[test]
fn arc_ghosts_trimmed_to_capacity() {
    let mut m = manager_with(arc_config(2));
    for i in 0..10 {
        store(&mut m, R1, &keys([i]));
    }
    // Ghosts of 0..8 were kept in B1, only the last 2 remain: touching 0 adapts nothing.
    m.touch(&keys([0]));
    assert_eq!(m.primary().policy().arc_target(), Some(0.0));
    m.touch(&keys([7]));
    assert_eq!(m.primary().policy().arc_target(), Some(1.0));
}

/// P17: the reuse filter counts offers to `prepare_store` (as vLLM 0.33 does) and stores a
/// key at its `store_threshold`-th offer; a full tracker forgets the least recently offered
/// key that is not in the current offer, and tracks nothing new when every key is.
#[test]
fn reuse_filter_counts_offers_in_a_bounded_tracker() {
    let mut c = Config::new(8);
    c.reuse = Some(ReuseFilter {
        store_threshold: 2,
        max_tracker_size: 2,
    });
    let mut m = manager_with(c);
    assert_eq!(m.lookup(R1, &key(1)), Lookup::Miss); // lookups count nothing
    assert!(m.prepare_store(R1, &keys([1])).unwrap().keys.is_empty());
    assert_eq!(m.stats().stores_skipped, 1);
    assert_eq!(m.prepare_store(R1, &keys([1])).unwrap().keys, keys([1]));
    assert!(m.prepare_store(R1, &keys([2])).unwrap().keys.is_empty());
    // Full (1, 2): 3 forgets 1, the least recently offered.
    assert!(m.prepare_store(R1, &keys([3])).unwrap().keys.is_empty());
    // The two tracked keys count first; then nothing can be forgotten for 4.
    assert_eq!(
        m.prepare_store(R1, &keys([2, 3, 4])).unwrap().keys,
        keys([2, 3])
    );
    // 4 was not tracked: counted from 1, forgetting 2.
    assert!(m.prepare_store(R1, &keys([4])).unwrap().keys.is_empty());
    assert_eq!(m.stats().stores_skipped, 5);
    m.complete_store(R1, &keys([1, 2, 3]), true);
    assert!(m.prepare_store(R1, &keys([5, 5])).unwrap().keys.is_empty());
    assert_eq!(
        m.stats().stores_skipped,
        7,
        "each offered occurrence counts"
    );
}

/// P4: a store of many keys (past the short-list path) stores each distinct key once, in
/// first-occurrence order.
#[test]
fn long_stores_deduplicate_in_order() {
    let mut m = manager(64, &[]);
    let ids: Vec<u32> = (0..40)
        .chain([3, 39, 0])
        .chain(40..45)
        .chain([44, 7])
        .collect();
    let p = m.prepare_store(R1, &keys(ids.iter().copied())).unwrap();
    assert_eq!(p.keys, keys(0..45));
    assert_eq!(p.slots.len(), 45);
}

/// The primary used on its own gives the same answers as the manager with no tiers (M11).
#[test]
fn primary_alone_equals_manager_without_tiers() {
    let mut p = Primary::new(3, PolicyKind::Lru, None);
    let mut m = manager(3, &[]);
    for i in 0..12u32 {
        let ks = keys([i, i + 1]);
        let a = p.prepare_store(R1, &ks);
        let b = m.prepare_store(R1, &ks);
        assert_eq!(a, b);
        p.complete_store(&ks, i % 3 != 0);
        m.complete_store(R1, &ks, i % 3 != 0);
        p.touch(&keys([i / 2]));
        m.touch(&keys([i / 2]));
        assert_eq!(p.lookup(&key(i / 2)), m.lookup(R1, &key(i / 2)));
        assert_eq!(p.take_events(), m.take_events());
        p.check_invariants().unwrap();
    }
}
