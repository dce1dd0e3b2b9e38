//! The repository's Mooncake excerpt replayed through `kvtier-core` and through vLLM 0.33.0's
//! own `CPUOffloadingManager`, in lockstep, with vLLM 0.33's scheduler call sequence (the
//! sequence of `model/oracle/replay.py`). Every lookup answer, every prepared store (keys,
//! slot ids, evicted keys, in order), every load's slot ids and the events must be equal, for
//! LRU and ARC, at 5 % and 25 % of the distinct blocks.
//!
//! Needs the install of `scripts/vllm-oracle-setup.sh`: without it, a loud skip (a failure
//! under `CI=true`).

use std::io::Write;

use kvtier_core::{Config, EventKind, Key, Lookup, Manager, PolicyKind, RequestId};
use kvtier_model::oracle::{self, CpuConfig, LookupResult, OracleError, Policy, VllmOracle};

fn oracle() -> Option<VllmOracle> {
    match VllmOracle::spawn() {
        Ok(o) => Some(o),
        Err(e @ OracleError::NotInstalled { .. }) => {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{e}");
            }
            let _ = writeln!(
                std::io::stderr(),
                "\n**********\nSKIPPED: {e}\n**********\n"
            );
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The excerpt's requests: each one's block ids in prefix order.
fn excerpt() -> Vec<Vec<u64>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/mooncake-excerpt.jsonl"
    );
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap())
                .collect()
        })
        .collect()
}

fn core_key(id: u64) -> Key {
    Key::new(&oracle::Key::block(id).0)
}

fn answer(l: Lookup) -> LookupResult {
    match l {
        Lookup::Hit => LookupResult::Hit,
        Lookup::HitPending => LookupResult::HitPending,
        Lookup::Retry => LookupResult::Retry,
        Lookup::Miss => LookupResult::Miss,
        other => panic!("unknown answer {other:?}"),
    }
}

const BLOCK_TOKENS: u64 = 512;

/// What one replay observed, for the report.
#[derive(Debug, Default, PartialEq, Eq)]
struct Totals {
    blocks: u64,
    hits: u64,
    evicted: u64,
}

/// Replays `trace` through both, comparing every answer; returns the core's totals.
fn lockstep(o: &mut VllmOracle, trace: &[Vec<u64>], num_blocks: u32, policy: Policy) -> Totals {
    o.create_cpu(&CpuConfig::new(num_blocks, policy)).unwrap();
    let mut config = Config::new(num_blocks);
    config.policy = match policy {
        Policy::Lru => PolicyKind::Lru,
        Policy::Arc => PolicyKind::Arc,
    };
    let mut m = Manager::new(config).unwrap();
    let mut totals = Totals::default();
    for (n, ids) in trace.iter().enumerate() {
        let name = format!("req-{n}");
        let req = RequestId(n as u64);
        let at = |what: &str| format!("request {n}, {what}");
        let vkeys: Vec<oracle::Key> = ids.iter().map(|&i| oracle::Key::block(i)).collect();
        let ckeys: Vec<Key> = ids.iter().map(|&i| core_key(i)).collect();
        let positions: Vec<(oracle::Key, u64)> = vkeys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), BLOCK_TOKENS * (i as u64 + 1)))
            .collect();
        o.new_request(&name).unwrap();
        o.set_positions(&name, &positions).unwrap();
        m.new_request(req);
        for (i, k) in ckeys.iter().enumerate() {
            m.set_position(req, k, BLOCK_TOKENS * (i as u64 + 1));
        }
        // Lookups up to the first miss.
        let expected = o.lookup_many(&name, &vkeys, true).unwrap();
        let mut got = Vec::new();
        for k in &ckeys {
            let a = answer(m.lookup(req, k));
            got.push(a);
            if a == LookupResult::Miss {
                break;
            }
        }
        assert_eq!(got, expected, "{}", at("lookups"));
        assert!(
            got.iter()
                .all(|a| matches!(a, LookupResult::Hit | LookupResult::Miss)),
            "{}: one request at a time never defers",
            at("lookups")
        );
        let hits = got.iter().take_while(|a| **a == LookupResult::Hit).count();
        let mut new_req_ids = vec![name.as_str()];
        if hits > 0 {
            let expected = o.prepare_load(&name, &vkeys[..hits]).unwrap();
            let slots = m.prepare_load(req, &ckeys[..hits]).unwrap();
            let slots: Vec<i64> = slots.iter().map(|s| i64::from(s.0)).collect();
            assert_eq!(slots, expected, "{}", at("prepare_load"));
            o.schedule_end(&new_req_ids, &[]).unwrap();
            m.end_step();
            new_req_ids.clear();
            o.complete_load(&name, &vkeys[..hits]).unwrap();
            m.complete_load(&ckeys[..hits]).unwrap();
        }
        if hits < ids.len() {
            let expected = o
                .prepare_store(&name, &vkeys[hits..])
                .unwrap()
                .expect("vLLM refused a store");
            let p = m.prepare_store(req, &ckeys[hits..]).unwrap();
            let keys: Vec<Vec<u8>> = p.keys.iter().map(|k| k.as_bytes().to_vec()).collect();
            let want: Vec<Vec<u8>> = expected.keys_to_store.iter().map(|k| k.0.clone()).collect();
            assert_eq!(keys, want, "{}", at("keys to store"));
            let slots: Vec<i64> = p.slots.iter().map(|s| i64::from(s.0)).collect();
            assert_eq!(slots, expected.block_ids, "{}", at("slots"));
            let evicted: Vec<Vec<u8>> = p.evicted.iter().map(|k| k.as_bytes().to_vec()).collect();
            let want: Vec<Vec<u8>> = expected.evicted_keys.iter().map(|k| k.0.clone()).collect();
            assert_eq!(evicted, want, "{}", at("evicted keys, in order"));
            totals.evicted += evicted.len() as u64;
            o.schedule_end(&new_req_ids, &[]).unwrap();
            m.end_step();
            new_req_ids.clear();
            o.complete_store(&name, &expected.keys_to_store, true)
                .unwrap();
            m.complete_store(req, &p.keys, true);
        }
        o.request_finished(&name).unwrap();
        m.request_finished(req);
        o.schedule_end(&new_req_ids, &[]).unwrap();
        m.end_step();
        o.drop_request(&name).unwrap();
        // The events: one stored per store, one removed per evicting store.
        let expected = o.take_events().unwrap();
        let got = m.take_events();
        let shape = |removed: bool, keys: Vec<Vec<u8>>| (removed, keys);
        let got: Vec<_> = got
            .into_iter()
            .map(|e| {
                shape(
                    e.kind == EventKind::Removed,
                    e.keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
                )
            })
            .collect();
        let expected: Vec<_> = expected
            .into_iter()
            .map(|e| shape(e.removed, e.keys.into_iter().map(|k| k.0).collect()))
            .collect();
        assert_eq!(got, expected, "{}", at("events"));
        totals.blocks += ids.len() as u64;
        totals.hits += hits as u64;
    }
    m.check_invariants().unwrap();
    assert_eq!(m.primary().live_requests(), 0, "every request finished");
    totals
}

/// The excerpt at 5 % and 25 % of its 16,156 distinct blocks, LRU and ARC: every answer equal,
/// and the hit counts vLLM gives (`model/oracle/README.md`).
#[test]
fn the_core_replays_the_mooncake_excerpt_exactly_as_vllm() {
    let Some(mut o) = oracle() else { return };
    let trace = excerpt();
    for (policy, capacity, hits) in [
        (Policy::Lru, 807, 162),
        (Policy::Arc, 807, 247),
        (Policy::Lru, 4039, 1057),
        (Policy::Arc, 4039, 1107),
    ] {
        let t = lockstep(&mut o, &trace, capacity, policy);
        assert_eq!(t.blocks, 18_882);
        assert_eq!(t.hits, hits, "{policy:?} at {capacity} blocks");
        assert!(t.evicted > 0, "the replay evicts");
    }
}
