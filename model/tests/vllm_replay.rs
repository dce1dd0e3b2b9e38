//! The repository's Mooncake excerpt replayed through `kvtier-core` and through vLLM 0.33.0's
//! own `CPUOffloadingManager`, in lockstep, with vLLM 0.33's scheduler call sequence
//! (`kvtier_model::replay`, the sequence of `model/oracle/replay.py`). Every lookup answer,
//! every prepared store (keys, slot ids, evicted keys, in order), every load's slot ids and
//! the events must be equal, for LRU and ARC, at 5 % and 25 % of the distinct blocks.
//!
//! Needs the install of `scripts/vllm-oracle-setup.sh`: without it, a loud skip (a failure
//! under `CI=true`).

use kvtier_model::oracle::{Policy, VllmOracle};
use kvtier_model::replay::{
    CoreEngine, OracleEngine, Pair, RULE_HIT_PROTECTION, RULE_T7, ReplayError, Setup, Trace,
    TraceError, core_keys, lockstep, replay_core, run_lockstep,
};

/// The oracle, or `None` (after a loud message) when it is not installed outside CI.
fn oracle() -> Option<VllmOracle> {
    VllmOracle::spawn_or_skip()
}

/// The excerpt's requests: each one's block ids in prefix order.
fn excerpt() -> Trace {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/mooncake-excerpt.jsonl"
    );
    Trace::read(path.as_ref()).unwrap()
}

/// The excerpt at 5 % and 25 % of its 16,156 distinct blocks, LRU and ARC: every answer equal,
/// and the hit counts vLLM gives (`model/oracle/README.md`). The core's timed replay (no
/// observation) replays exactly the same.
#[test]
fn the_core_replays_the_mooncake_excerpt_exactly_as_vllm() {
    let Some(mut o) = oracle() else { return };
    let trace = excerpt();
    assert_eq!(trace.distinct_blocks(), 16_156);
    let keys = core_keys(&trace);
    for (policy, fraction, capacity, hits) in [
        (Policy::Lru, 0.05, 807, 162),
        (Policy::Arc, 0.05, 807, 247),
        (Policy::Lru, 0.25, 4039, 1057),
        (Policy::Arc, 0.25, 4039, 1107),
    ] {
        assert_eq!(trace.capacity(fraction), capacity);
        let setup = Setup::primary(policy, capacity);
        let report = lockstep(&mut o, &trace, &setup).unwrap_or_else(|e| panic!("{e}"));
        let t = &report.totals;
        assert_eq!(t.blocks, 18_882);
        assert_eq!(t.hits, hits, "{policy:?} at {capacity} blocks");
        assert_eq!(t.loaded, hits, "one request at a time never defers");
        assert_eq!(t.deferrals, 0);
        assert!(t.evicted > 0, "the replay evicts");
        assert!(report.exceptions.is_empty(), "{:?}", report.exceptions);
        assert_eq!(report.resyncs, 0);
        let (alone, _) = replay_core(&keys, &setup);
        assert_eq!(&alone, t, "the timed replay is the same replay");
    }
}

/// The lockstep does see a difference: the core on LRU against vLLM on ARC differs at a
/// named request, in a named answer.
#[test]
fn the_lockstep_reports_the_first_difference() {
    let Some(mut o) = oracle() else { return };
    let trace = excerpt();
    let core = CoreEngine::new(&Setup::primary(Policy::Lru, 807));
    let vllm = OracleEngine::new(&mut o, &Setup::primary(Policy::Arc, 807)).unwrap();
    match run_lockstep(Pair::of(core, vllm), &trace) {
        Err(ReplayError::Differ(d)) => {
            assert!(d.request < trace.requests.len());
            assert_ne!(d.core, d.vllm, "{d}");
        }
        other => panic!("expected a difference, got {other:?}"),
    }
}

/// A malformed trace line is a typed error naming the line.
#[test]
fn a_bad_trace_line_is_named() {
    let ok = Trace::parse("{\"hash_ids\": [1, 2]}\n\n{\"timestamp\": 3, \"hash_ids\": []}\n");
    assert_eq!(ok.unwrap().requests, vec![vec![1, 2], vec![]]);
    for (text, line) in [
        ("{\"hash_ids\": [1]}\nnot json", 2),
        ("{\"ids\": [1]}", 1),
        ("\n{\"hash_ids\": [1, -2]}", 2),
    ] {
        match Trace::parse(text) {
            Err(TraceError::Line { line: l, .. }) => assert_eq!(l, line, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
    }
}

fn with_tiers(policy: Policy, num_blocks: u32, tiers: usize, capacity: u32) -> Setup {
    let mut setup = Setup::primary(policy, num_blocks);
    setup.tiers = vec![capacity; tiers];
    setup
}

/// Two secondary tiers under vLLM's `TieringOffloadingManager` (scripted tiers whose IO the
/// replay plays) and the core's two authoritative tiers: every answer, job and event equal
/// on the excerpt at 5 %, deferrals and promotions included.
#[test]
fn with_two_tiers_the_core_replays_the_excerpt_as_vllm() {
    let Some(mut o) = oracle() else { return };
    let trace = excerpt();
    for (policy, hits, promoted, deferrals) in
        [(Policy::Lru, 162, 2564, 57), (Policy::Arc, 247, 2479, 55)]
    {
        let setup = with_tiers(policy, 807, 2, 16_156);
        let report = lockstep(&mut o, &trace, &setup).unwrap_or_else(|e| panic!("{e}"));
        let t = &report.totals;
        assert_eq!(
            (t.hits, t.promoted, t.deferrals),
            (hits, promoted, deferrals),
            "{policy:?}"
        );
        assert_eq!(t.loaded, hits + promoted, "{policy:?}");
        assert!(report.exceptions.is_empty(), "{:?}", report.exceptions);
    }
}

/// A primary of 32 blocks: a request's promotions need room while its own hits are the
/// least recent blocks. vLLM evicts them; the core does not (★8). The replay counts each
/// case by name, restarts both primaries over the tiers' blocks, and finds no other
/// difference.
#[test]
fn a_promotion_evicting_its_own_hits_is_a_named_exception() {
    let Some(mut o) = oracle() else { return };
    let trace = excerpt();
    let report = lockstep(&mut o, &trace, &with_tiers(Policy::Lru, 32, 2, 16_156))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        report.exceptions.get(RULE_HIT_PROTECTION),
        Some(&2),
        "{:?}",
        report.diverged
    );
    assert_eq!(report.exceptions.len(), 1, "{:?}", report.exceptions);
    assert_eq!(report.resyncs, 2);
}

/// A block stored again while the tiers hold it (it follows a miss in its request): vLLM
/// cascades it to every tier again, the core does not (T7); counted per block and tier.
#[test]
fn a_cascade_of_held_blocks_is_a_named_exception() {
    let Some(mut o) = oracle() else { return };
    let trace = Trace {
        requests: vec![vec![1, 2, 3], vec![4, 5, 6], vec![7, 8], vec![9, 2, 3]],
    };
    let report = lockstep(&mut o, &trace, &with_tiers(Policy::Lru, 4, 2, 64))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.exceptions.get(RULE_T7), Some(&4), "{report:?}");
    assert_eq!(report.resyncs, 0);
}
