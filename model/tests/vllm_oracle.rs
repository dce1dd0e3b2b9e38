//! vLLM 0.33.0's own offloading managers, driven through the oracle client: these tests pin
//! the behaviour observed in vLLM (which block ids `prepare_store` hands out, which keys it
//! evicts and in what order, what `lookup` answers, the events and the stats) and the
//! oracle's protocol.
//!
//! They need the install of `scripts/vllm-oracle-setup.sh`. Without it they print a loud
//! skip message and pass, except under `CI=true`, where they fail with the setup message.

use kvtier_model::oracle::{
    CpuConfig, Event, Key, LookupResult, Medium, MetricValue, OffloadPolicy, OracleError, Policy,
    PolicyState, PreparedStore, ScriptedTier, TierCall, TieringConfig, VllmOracle,
};

use std::io::Write;

use LookupResult::{Hit, HitPending, Miss};

/// The oracle, or `None` (after a loud message) when it is not installed outside CI.
fn oracle() -> Option<VllmOracle> {
    VllmOracle::spawn_or_skip()
}

fn k(id: u64) -> Key {
    Key::block(id)
}

fn ks(ids: &[u64]) -> Vec<Key> {
    ids.iter().map(|&i| k(i)).collect()
}

/// A new request whose blocks `ids` are 16-token chunks in this order (end tokens 16, 32, ...),
/// as vLLM's scheduler records them.
fn request(o: &mut VllmOracle, req: &str, ids: &[u64]) {
    assert_eq!(o.new_request(req).unwrap(), OffloadPolicy::ChunkLevel);
    let positions: Vec<(Key, u64)> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| (k(id), 16 * (i as u64 + 1)))
        .collect();
    o.set_positions(req, &positions).unwrap();
}

/// prepare_store then complete_store (success) of `ids`; the prepared store.
fn store(o: &mut VllmOracle, req: &str, ids: &[u64]) -> PreparedStore {
    let prepared = o
        .prepare_store(req, &ks(ids))
        .unwrap()
        .expect("store refused");
    o.complete_store(req, &prepared.keys_to_store, true)
        .unwrap();
    prepared
}

/// A whole request that stores `ids` and finishes.
fn store_request(o: &mut VllmOracle, req: &str, ids: &[u64]) -> PreparedStore {
    request(o, req, ids);
    let prepared = store(o, req, ids);
    o.request_finished(req).unwrap();
    prepared
}

/// A whole request that loads `ids` (all hits) and finishes.
fn load_request(o: &mut VllmOracle, req: &str, ids: &[u64]) {
    request(o, req, ids);
    o.prepare_load(req, &ks(ids)).unwrap();
    o.complete_load(req, &ks(ids)).unwrap();
    o.request_finished(req).unwrap();
}

fn lru_order(o: &mut VllmOracle) -> Vec<Key> {
    match o.inspect().unwrap().policy {
        PolicyState::Lru { order, .. } => order,
        other => panic!("not LRU: {other:?}"),
    }
}

/// (target_t1_size, t1, t2, b1, b2), each list least recent first.
type ArcLists = (f64, Vec<Key>, Vec<Key>, Vec<Key>, Vec<Key>);

fn arc_lists(o: &mut VllmOracle) -> ArcLists {
    match o.inspect().unwrap().policy {
        PolicyState::Arc {
            target_t1_size,
            t1,
            t2,
            b1,
            b2,
        } => (target_t1_size, t1, t2, b1, b2),
        other => panic!("not ARC: {other:?}"),
    }
}

fn stored(keys: &[u64]) -> Event {
    Event {
        keys: ks(keys),
        medium: Medium::Cpu,
        removed: false,
        locality: None,
        ownership: None,
        removal_expected: false,
        metadata_only: false,
    }
}

fn removed(keys: &[u64]) -> Event {
    Event {
        removed: true,
        ..stored(keys)
    }
}

#[test]
fn a_missing_install_names_the_setup_script() {
    let Err(e) = VllmOracle::spawn_in(std::path::Path::new("/nonexistent/kvtier-vllm-oracle"))
    else {
        panic!("an oracle started from a directory that does not exist");
    };
    assert!(matches!(e, OracleError::NotInstalled { .. }), "{e:?}");
    let message = e.to_string();
    assert!(
        message.contains("run scripts/vllm-oracle-setup.sh"),
        "{message}"
    );
    assert!(
        message.contains("/nonexistent/kvtier-vllm-oracle"),
        "{message}"
    );
}

#[test]
fn lru_hands_out_fresh_blocks_then_evicts_a_requests_tail_first() {
    let Some(mut o) = oracle() else { return };
    o.create_cpu(&CpuConfig::new(4, Policy::Lru)).unwrap();

    request(&mut o, "a", &[1, 2, 3, 4]);
    assert_eq!(
        o.lookup_many("a", &ks(&[1, 2, 3, 4]), false).unwrap(),
        [Miss; 4]
    );
    // The scheduler's prefix lookup stops at the first MISS.
    assert_eq!(
        o.lookup_many("a", &ks(&[1, 2, 3, 4]), true).unwrap(),
        [Miss]
    );
    let prepared = o.prepare_store("a", &ks(&[1, 2, 3, 4])).unwrap().unwrap();
    assert_eq!(
        prepared,
        PreparedStore {
            keys_to_store: ks(&[1, 2, 3, 4]),
            block_ids: vec![0, 1, 2, 3],
            evicted_keys: vec![]
        }
    );
    // Allocated, store in flight: present but not readable.
    assert_eq!(o.lookup("a", &k(1)).unwrap(), HitPending);
    o.complete_store("a", &ks(&[1, 2, 3, 4]), true).unwrap();
    assert_eq!(o.lookup("a", &k(1)).unwrap(), Hit);
    o.request_finished("a").unwrap();
    // Request-scoped recency: the request's blocks are ranked tail to head at its end, so
    // its last block is the first to go.
    assert_eq!(lru_order(&mut o), ks(&[4, 3, 2, 1]));

    request(&mut o, "b", &[5, 6]);
    let prepared = store(&mut o, "b", &[5, 6]);
    assert_eq!(prepared.evicted_keys, ks(&[4, 3]));
    // Freed chunks are reused last-freed first: 4 had chunk 3, 3 had chunk 2.
    assert_eq!(prepared.block_ids, vec![2, 3]);
    assert_eq!(
        o.lookup_many("b", &ks(&[1, 2, 3, 4]), false).unwrap(),
        [Hit, Hit, Miss, Miss]
    );
    o.request_finished("b").unwrap();
    assert_eq!(lru_order(&mut o), ks(&[2, 1, 6, 5]));

    assert_eq!(
        o.take_events().unwrap(),
        vec![stored(&[1, 2, 3, 4]), removed(&[4, 3]), stored(&[5, 6])]
    );
    assert_eq!(o.take_events().unwrap(), vec![], "take_events drains");
}

#[test]
fn lru_ranks_a_request_at_its_first_access_and_again_at_its_end() {
    let Some(mut o) = oracle() else { return };
    o.create_cpu(&CpuConfig::new(4, Policy::Lru)).unwrap();
    store_request(&mut o, "a", &[1, 2, 3, 4]);
    assert_eq!(lru_order(&mut o), ks(&[4, 3, 2, 1]));

    // A load moves the block behind everything ranked before the request began, at once.
    request(&mut o, "b", &[4]);
    assert_eq!(o.prepare_load("b", &ks(&[4])).unwrap(), vec![3]);
    assert_eq!(lru_order(&mut o), ks(&[3, 2, 1, 4]));
    o.complete_load("b", &ks(&[4])).unwrap();

    // A later request's blocks rank after b's, while b is still running...
    request(&mut o, "c", &[2]);
    o.prepare_load("c", &ks(&[2])).unwrap();
    o.complete_load("c", &ks(&[2])).unwrap();
    assert_eq!(lru_order(&mut o), ks(&[3, 1, 4, 2]));
    o.request_finished("c").unwrap();
    assert_eq!(lru_order(&mut o), ks(&[3, 1, 4, 2]));
    // ...until b ends: finishing re-ranks its blocks after everything.
    o.request_finished("b").unwrap();
    assert_eq!(lru_order(&mut o), ks(&[3, 1, 2, 4]));

    // touch() re-ranks at once, its keys' last first (the first key ends most recent).
    request(&mut o, "d", &[]);
    o.touch("d", &ks(&[3, 1])).unwrap();
    assert_eq!(lru_order(&mut o), ks(&[2, 4, 1, 3]));

    // Eviction follows the order.
    request(&mut o, "e", &[7, 8]);
    assert_eq!(store(&mut o, "e", &[7, 8]).evicted_keys, ks(&[2, 4]));
}

#[test]
fn lru_never_evicts_pinned_or_offered_blocks_and_refuses_when_it_must() {
    let Some(mut o) = oracle() else { return };
    o.create_cpu(&CpuConfig::new(2, Policy::Lru)).unwrap();
    store_request(&mut o, "a", &[1, 2]);
    assert_eq!(lru_order(&mut o), ks(&[2, 1]));

    // Both blocks are being read: no room for a third.
    request(&mut o, "b", &[1, 2]);
    assert_eq!(o.prepare_load("b", &ks(&[1, 2])).unwrap(), vec![0, 1]);
    request(&mut o, "c", &[3]);
    assert_eq!(o.prepare_store("c", &ks(&[3])).unwrap(), None);
    assert_eq!(o.lookup("c", &k(3)).unwrap(), Miss);
    // One read ends: its block is the only candidate, whatever its rank.
    o.complete_load("b", &ks(&[1])).unwrap();
    let prepared = o.prepare_store("c", &ks(&[3])).unwrap().unwrap();
    assert_eq!(prepared.evicted_keys, ks(&[1]));
    assert_eq!(prepared.block_ids, vec![0]);
    // A block whose store is in flight is not evictable either.
    request(&mut o, "d", &[4]);
    assert_eq!(o.prepare_store("d", &ks(&[4])).unwrap(), None);
    o.complete_store("c", &ks(&[3]), true).unwrap();
    o.complete_load("b", &ks(&[2])).unwrap();
    o.request_finished("b").unwrap();
    o.request_finished("c").unwrap();
    assert_eq!(lru_order(&mut o), ks(&[2, 3]));

    // Keys offered to prepare_store are protected: 2 is next in line, but it is offered
    // (already stored, so not stored again), so 3 goes instead. (With its position known,
    // the offer itself would rank 2 after 3 first: only keys with a position are ranked.)
    assert_eq!(o.new_request("e").unwrap(), OffloadPolicy::ChunkLevel);
    o.set_positions("e", &[(k(5), 32)]).unwrap();
    let prepared = o.prepare_store("e", &ks(&[2, 5])).unwrap().unwrap();
    assert_eq!(prepared.keys_to_store, ks(&[5]));
    assert_eq!(prepared.evicted_keys, ks(&[3]));
    assert_eq!(lru_order(&mut o), ks(&[2, 5]));

    let state = o.inspect().unwrap();
    assert_eq!(
        (state.allocated, state.evictable, state.write_pending),
        (2, 1, 1)
    );
}

#[test]
fn arc_keeps_stores_in_t1_promotes_reuse_at_the_request_end_and_learns_from_ghosts() {
    let Some(mut o) = oracle() else { return };
    o.create_cpu(&CpuConfig::new(4, Policy::Arc)).unwrap();
    store_request(&mut o, "a", &[1, 2, 3, 4]);
    assert_eq!(
        arc_lists(&mut o),
        (0.0, ks(&[4, 3, 2, 1]), vec![], vec![], vec![])
    );

    // A reuse counts when the request ends, not when the block is read.
    request(&mut o, "b", &[1]);
    o.prepare_load("b", &ks(&[1])).unwrap();
    o.complete_load("b", &ks(&[1])).unwrap();
    assert_eq!(arc_lists(&mut o).2, vec![]);
    o.request_finished("b").unwrap();
    assert_eq!(
        arc_lists(&mut o),
        (0.0, ks(&[4, 3, 2]), ks(&[1]), vec![], vec![])
    );

    // T1 is at or above its target: evict from T1's LRU end into ghost list B1.
    request(&mut o, "c", &[5, 6]);
    let prepared = store(&mut o, "c", &[5, 6]);
    assert_eq!(
        (prepared.evicted_keys, prepared.block_ids),
        (ks(&[4, 3]), vec![2, 3])
    );
    // New blocks join T1's MRU end in offer order; the request's end re-orders them tail first.
    assert_eq!(
        arc_lists(&mut o),
        (0.0, ks(&[2, 5, 6]), ks(&[1]), ks(&[4, 3]), vec![])
    );
    o.request_finished("c").unwrap();
    assert_eq!(
        arc_lists(&mut o),
        (0.0, ks(&[2, 6, 5]), ks(&[1]), ks(&[4, 3]), vec![])
    );

    // Storing a B1 ghost again raises T1's target by max(1, |B2| / |B1|) and re-inserts the
    // block into T1 (a store is not a reuse).
    let prepared = store_request(&mut o, "d", &[4]);
    assert_eq!(
        (prepared.evicted_keys, prepared.block_ids),
        (ks(&[2]), vec![1])
    );
    assert_eq!(
        arc_lists(&mut o),
        (1.0, ks(&[6, 5, 4]), ks(&[1]), ks(&[3, 2]), vec![])
    );
}

#[test]
fn arc_evicts_from_t2_below_target_and_falls_back_to_t1_when_t2_has_no_candidate() {
    let Some(mut o) = oracle() else { return };
    // Drive T1's target to the whole cache with B1 ghost hits.
    let setup = |o: &mut VllmOracle| {
        o.create_cpu(&CpuConfig::new(3, Policy::Arc)).unwrap();
        store_request(o, "a", &[1, 2, 3]);
        load_request(o, "b", &[1]);
        assert_eq!(store_request(o, "c", &[4]).evicted_keys, ks(&[3]));
        assert_eq!(store_request(o, "d", &[3]).evicted_keys, ks(&[2]));
        assert_eq!(store_request(o, "e", &[2]).evicted_keys, ks(&[4]));
        assert_eq!(arc_lists(o), (2.0, ks(&[3, 2]), ks(&[1]), ks(&[4]), vec![]));
    };

    // |T1| = 2 < target 3 (after this store's ghost hit): the victim comes from T2.
    setup(&mut o);
    let prepared = store_request(&mut o, "f", &[4]);
    assert_eq!(prepared.evicted_keys, ks(&[1]));
    assert_eq!(
        arc_lists(&mut o),
        (3.0, ks(&[3, 2, 4]), vec![], ks(&[]), ks(&[1]))
    );

    // The same, with T2's only block being read: fall back to T1's LRU end.
    setup(&mut o);
    request(&mut o, "g", &[1]);
    o.prepare_load("g", &ks(&[1])).unwrap();
    let prepared = store_request(&mut o, "f", &[4]);
    assert_eq!(prepared.evicted_keys, ks(&[3]));
    assert_eq!(
        arc_lists(&mut o),
        (3.0, ks(&[2, 4]), ks(&[1]), ks(&[3]), vec![])
    );
}

#[test]
fn a_failed_store_frees_its_blocks_with_a_metadata_only_removal() {
    let Some(mut o) = oracle() else { return };
    o.create_cpu(&CpuConfig::new(2, Policy::Lru)).unwrap();
    request(&mut o, "a", &[1, 2]);
    assert_eq!(
        o.prepare_store("a", &ks(&[1, 2]))
            .unwrap()
            .unwrap()
            .block_ids,
        vec![0, 1]
    );
    o.complete_store("a", &ks(&[1, 2]), false).unwrap();
    assert_eq!(
        o.lookup_many("a", &ks(&[1, 2]), false).unwrap(),
        [Miss, Miss]
    );
    let state = o.inspect().unwrap();
    assert_eq!(
        (state.free_list, state.write_pending, state.blocks.len()),
        (vec![0, 1], 0, 0)
    );

    // A retry stores 1 again before the events are taken: the removal no longer names it.
    request(&mut o, "b", &[1]);
    assert_eq!(store(&mut o, "b", &[1]).block_ids, vec![1]);
    assert_eq!(
        o.take_events().unwrap(),
        vec![
            Event {
                metadata_only: true,
                ..removed(&[2])
            },
            stored(&[1])
        ]
    );
}

#[test]
fn stats_report_usage_allocations_and_skipped_stores() {
    let Some(mut o) = oracle() else { return };
    let mut config = CpuConfig::new(4, Policy::Lru);
    config.store_threshold = 2;
    o.create_cpu(&config).unwrap();

    // First offer: tracked, not stored.
    request(&mut o, "a", &[1, 2]);
    assert_eq!(
        o.prepare_store("a", &ks(&[1, 2])).unwrap(),
        Some(PreparedStore {
            keys_to_store: vec![],
            block_ids: vec![],
            evicted_keys: vec![]
        })
    );
    o.request_finished("a").unwrap();
    // Second offer: stored.
    request(&mut o, "b", &[1, 2]);
    assert_eq!(
        o.prepare_store("b", &ks(&[1, 2]))
            .unwrap()
            .unwrap()
            .block_ids,
        vec![0, 1]
    );

    let stats = o
        .get_stats()
        .unwrap()
        .expect("the CPU manager always reports");
    let num = |v: Option<&MetricValue>| match v {
        Some(MetricValue::Number(n)) => *n,
        other => panic!("not a number: {other:?}"),
    };
    assert_eq!(num(stats.get("vllm:kv_offload_stores_skipped", &[])), 2.0);
    assert_eq!(
        stats.get("vllm:kv_offload_cpu_allocation_size", &[]),
        Some(&MetricValue::Samples(vec![2.0]))
    );
    assert_eq!(
        num(stats.get("vllm:kv_offload_cpu_cache_usage_perc", &[])),
        0.5
    );
    assert_eq!(
        num(stats.get("vllm:kv_offload_cpu_cache_write_usage_perc", &[])),
        0.5
    );
    assert_eq!(
        num(stats.get("vllm:kv_offload_cpu_cache_read_usage_perc", &[])),
        0.0
    );
    assert_eq!(stats.info, None);

    // Counters and histograms are per interval; gauges are snapshots.
    o.complete_store("b", &ks(&[1, 2]), true).unwrap();
    o.prepare_load("b", &ks(&[1])).unwrap();
    let stats = o.get_stats().unwrap().unwrap();
    assert_eq!(num(stats.get("vllm:kv_offload_stores_skipped", &[])), 0.0);
    assert_eq!(stats.get("vllm:kv_offload_cpu_allocation_size", &[]), None);
    assert_eq!(
        num(stats.get("vllm:kv_offload_cpu_cache_usage_perc", &[])),
        0.25
    );
    assert_eq!(
        num(stats.get("vllm:kv_offload_cpu_cache_read_usage_perc", &[])),
        0.25
    );
}

#[test]
fn tiering_cascades_stores_and_promotes_secondary_hits() {
    let Some(mut o) = oracle() else { return };
    o.create_tiering(&TieringConfig::new(
        2,
        Policy::Lru,
        vec![ScriptedTier::storage()],
    ))
    .unwrap();
    assert!(!o.has_pending_work().unwrap());

    // A completed primary store cascades to the tier; the primary blocks stay pinned
    // (being read) until the tier's job is reported done.
    request(&mut o, "a", &[1, 2]);
    store(&mut o, "a", &[1, 2]);
    let jobs = o.tier_jobs(0).unwrap();
    assert_eq!(jobs.len(), 1);
    assert!(!jobs[0].is_promotion);
    assert_eq!(
        (jobs[0].keys.clone(), jobs[0].block_ids.clone()),
        (ks(&[1, 2]), vec![0, 1])
    );
    assert!(o.has_pending_work().unwrap());
    o.request_finished("a").unwrap();
    o.tier_finish(0, jobs[0].job_id, true, None).unwrap();
    // The step already polled (prepare_store polls every time and sets the step's gate), so
    // the result waits for the next step's first lookup or prepare_store.
    o.schedule_end(&["a"], &[]).unwrap();
    assert!(o.has_pending_work().unwrap());
    request(&mut o, "b", &[1]);
    assert_eq!(o.lookup("b", &k(1)).unwrap(), Hit);
    assert!(!o.has_pending_work().unwrap());
    assert_eq!(o.inspect().unwrap().evictable, 2);
    assert_eq!(o.tier_keys(0).unwrap(), ks(&[1, 2]));
    o.request_finished("b").unwrap();
    o.schedule_end(&["b"], &[]).unwrap();

    // A key only the tier holds: the lookup reserves a primary block (evicting) and answers
    // HIT_PENDING; the load is submitted at the end of the step.
    o.tier_put(0, &ks(&[3])).unwrap();
    request(&mut o, "c", &[3]);
    assert_eq!(o.lookup("c", &k(3)).unwrap(), HitPending);
    assert_eq!(o.lookup("c", &k(3)).unwrap(), HitPending);
    assert_eq!(o.tier_jobs(0).unwrap(), vec![]);
    o.schedule_end(&["c"], &[]).unwrap();
    let jobs = o.tier_jobs(0).unwrap();
    assert_eq!(jobs.len(), 1);
    assert!(jobs[0].is_promotion);
    assert_eq!(jobs[0].keys, ks(&[3]));
    o.tier_finish(0, jobs[0].job_id, true, None).unwrap();
    assert_eq!(o.lookup("c", &k(3)).unwrap(), Hit);
    assert_eq!(o.get_load_source("c", &k(3)).unwrap(), "disk");
    o.prepare_load("c", &ks(&[3])).unwrap();
    o.complete_load("c", &ks(&[3])).unwrap();
    o.request_finished("c").unwrap();

    // The tier saw one lookup (the second found the reserved block in the primary).
    let calls = o.tier_calls(0).unwrap();
    let lookups: Vec<&TierCall> = calls
        .iter()
        .filter(|c| matches!(c, TierCall::Lookup { .. }))
        .collect();
    assert_eq!(
        lookups,
        [&TierCall::Lookup {
            key: k(3),
            req: "c".into()
        }]
    );
    assert_eq!(
        calls.first(),
        Some(&TierCall::OnNewRequest { req: "a".into() })
    );
    assert!(calls.contains(&TierCall::SubmitLoad {
        job_id: jobs[0].job_id
    }));
    assert!(calls.contains(&TierCall::OnRequestFinished { req: "c".into() }));

    // After a reset, promotions are held (a secondary hit is a MISS) until the flush.
    o.reset_cache().unwrap();
    request(&mut o, "d", &[3]);
    assert_eq!(o.lookup("d", &k(3)).unwrap(), Miss);
    o.reset_flushed().unwrap();
    assert_eq!(o.lookup("d", &k(3)).unwrap(), HitPending);
}

#[test]
fn errors_come_back_as_answers_and_the_oracle_keeps_going() {
    let Some(mut o) = oracle() else { return };
    let refused = |r: Result<(), OracleError>| match r {
        Err(OracleError::Refused { kind, message, .. }) => (kind, message),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let (kind, message) = refused(o.new_request("a").map(drop));
    assert_eq!(kind, "RequestError");
    assert!(message.contains("create_cpu"), "{message}");

    o.create_cpu(&CpuConfig::new(2, Policy::Lru)).unwrap();
    let (kind, _) = refused(o.lookup("nobody", &k(1)).map(drop));
    assert_eq!(kind, "RequestError");
    request(&mut o, "a", &[1]);
    // vLLM's own assertion: prepare_load of a block that is not there.
    let (kind, message) = refused(o.prepare_load("a", &ks(&[1])).map(drop));
    assert_eq!(kind, "AssertionError");
    assert!(message.contains("not found"), "{message}");
    let (kind, _) = refused(o.call_raw("no_such_op", serde_json::json!({})).map(drop));
    assert_eq!(kind, "RequestError");

    assert_eq!(o.lookup("a", &k(1)).unwrap(), Miss);
    assert_eq!(store_request(&mut o, "b", &[1]).block_ids, vec![0]);
}

#[test]
fn tiering_starts_a_failed_promotion_again_at_the_next_lookup() {
    let Some(mut o) = oracle() else { return };
    o.create_tiering(&TieringConfig::new(
        2,
        Policy::Lru,
        vec![ScriptedTier::storage()],
    ))
    .unwrap();
    o.tier_put(0, &ks(&[3])).unwrap();
    request(&mut o, "a", &[3]);
    let mut block_ids = vec![];
    for _step in 0..3 {
        assert_eq!(o.lookup("a", &k(3)).unwrap(), HitPending);
        o.schedule_end(&[], &[]).unwrap();
        let jobs = o.tier_jobs(0).unwrap();
        assert_eq!(jobs.len(), 1);
        assert!(jobs[0].is_promotion);
        block_ids.push(jobs[0].block_ids.clone());
        o.tier_finish(0, jobs[0].job_id, false, None).unwrap();
    }
    // Each failure frees the reserved block, and the next step's lookup finds the key in the
    // tier again and reserves a block for a new promotion: a tier that always fails keeps the
    // request waiting. Fresh blocks come first, then the last one freed.
    assert_eq!(block_ids, vec![vec![0], vec![1], vec![1]]);
    // The failed writes' removals name a key the retry owns again: none is reported.
    assert_eq!(o.take_events().unwrap(), vec![]);
}

/// A small multi-turn trace: 400 requests, each a shared prefix of one of 40 conversations
/// followed by blocks of its own.
fn synthetic_trace() -> Vec<Vec<u64>> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % n
    };
    (0..400u64)
        .map(|i| {
            let conversation = next(40);
            let shared = next(12) + 1;
            let own = next(4);
            (0..shared)
                .map(|j| conversation * 100 + j)
                .chain((0..own).map(|j| 10_000 + i * 10 + j))
                .collect()
        })
        .collect()
}

/// `model/oracle/replay.py`'s call sequence, sent through the client: (hit blocks, stored).
fn replay_through_client(
    o: &mut VllmOracle,
    trace: &[Vec<u64>],
    num_blocks: u32,
    policy: Policy,
) -> (u64, u64) {
    o.create_cpu(&CpuConfig::new(num_blocks, policy)).unwrap();
    let (mut hits, mut stored) = (0, 0);
    for (n, ids) in trace.iter().enumerate() {
        let req = format!("req-{n}");
        let keys = ks(ids);
        let positions: Vec<(Key, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| (key.clone(), 512 * (i as u64 + 1)))
            .collect();
        o.new_request(&req).unwrap();
        o.set_positions(&req, &positions).unwrap();
        let answers = o.lookup_many(&req, &keys, true).unwrap();
        assert!(
            answers.iter().all(|a| matches!(a, Hit | Miss)),
            "{answers:?}"
        );
        let n_hits = answers.iter().take_while(|a| **a == Hit).count();
        let mut new_req_ids = vec![req.as_str()];
        if n_hits > 0 {
            o.prepare_load(&req, &keys[..n_hits]).unwrap();
            o.schedule_end(&new_req_ids, &[]).unwrap();
            new_req_ids.clear();
            o.complete_load(&req, &keys[..n_hits]).unwrap();
        }
        if n_hits < keys.len() {
            let prepared = o.prepare_store(&req, &keys[n_hits..]).unwrap();
            o.schedule_end(&new_req_ids, &[]).unwrap();
            new_req_ids.clear();
            let prepared = prepared.expect("store refused");
            if !prepared.keys_to_store.is_empty() {
                stored += prepared.keys_to_store.len() as u64;
                o.complete_store(&req, &prepared.keys_to_store, true)
                    .unwrap();
            }
        }
        o.request_finished(&req).unwrap();
        o.schedule_end(&new_req_ids, &[]).unwrap();
        o.drop_request(&req).unwrap();
        hits += n_hits as u64;
    }
    (hits, stored)
}

/// `model/oracle/replay.py --json` on `trace` at `fraction` of its distinct blocks.
fn replay_py(trace: &std::path::Path, policy: &str, fraction: &str) -> serde_json::Value {
    let dir = kvtier_model::oracle::install_dir();
    let out = std::process::Command::new(dir.join("venv/bin/python"))
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/oracle/replay.py"))
        .args(["--vllm-dir".as_ref(), dir.as_os_str()])
        .args(["--policy", policy, "--fraction", fraction, "--json"])
        .arg(trace)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn field(report: &serde_json::Value, name: &str) -> u64 {
    report[name]
        .as_u64()
        .unwrap_or_else(|| panic!("{name} in {report}"))
}

#[test]
fn the_replay_script_and_the_client_agree_on_a_trace() {
    let Some(mut o) = oracle() else { return };
    let trace = synthetic_trace();
    let mut file = tempfile::NamedTempFile::new().unwrap();
    for ids in &trace {
        writeln!(
            file,
            "{}",
            serde_json::json!({ "timestamp": 0, "hash_ids": ids })
        )
        .unwrap();
    }
    for (policy, name) in [(Policy::Lru, "lru"), (Policy::Arc, "arc")] {
        let report = replay_py(file.path(), name, "0.1");
        assert_eq!(
            field(&report, "blocks"),
            trace.iter().map(|ids| ids.len() as u64).sum::<u64>()
        );
        assert_eq!(field(&report, "deferrals"), 0);
        assert_eq!(field(&report, "store_refused"), 0);
        let capacity = u32::try_from(field(&report, "capacity_blocks")).unwrap();
        let (hits, stored) = replay_through_client(&mut o, &trace, capacity, policy);
        assert_eq!(
            (hits, stored),
            (field(&report, "hits"), field(&report, "stored")),
            "{name}: client vs replay.py"
        );
        assert!(hits > 0, "{name}: the trace has reuse");
    }
}

/// vLLM's hits on the repository's Mooncake excerpt (800 requests, 18,882 blocks, 16,156
/// distinct), one request at a time with the scheduler's call sequence: the reference the
/// core's replay must match.
#[test]
fn the_mooncake_excerpt_replays_to_vllms_hit_counts() {
    if oracle().is_none() {
        return;
    }
    let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/mooncake-excerpt.jsonl");
    for (policy, fraction, capacity, hits) in [
        ("lru", "0.05", 807, 162),
        ("arc", "0.05", 807, 247),
        ("lru", "0.25", 4039, 1057),
        ("arc", "0.25", 4039, 1107),
    ] {
        let report = replay_py(&trace, policy, fraction);
        assert_eq!(field(&report, "blocks"), 18_882);
        assert_eq!(field(&report, "capacity_blocks"), capacity);
        assert_eq!(field(&report, "hits"), hits, "{policy} at {fraction}");
    }
}
