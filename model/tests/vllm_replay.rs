//! The repository's Mooncake excerpt replayed through `kvtier-core` and through vLLM 0.33.0's
//! own `CPUOffloadingManager`, in lockstep, with vLLM 0.33's scheduler call sequence
//! (`kvtier_model::replay`, the sequence of `model/oracle/replay.py`). Every lookup answer,
//! every prepared store (keys, slot ids, evicted keys, in order), every load's slot ids and
//! the events must be equal, for LRU and ARC, at 5 % and 25 % of the distinct blocks.
//!
//! Needs the install of `scripts/vllm-oracle-setup.sh`: without it, a loud skip (a failure
//! under `CI=true`).

use std::io::Write;

use kvtier_model::oracle::{OracleError, Policy, VllmOracle};
use kvtier_model::replay::{
    CoreEngine, OracleEngine, Pair, ReplayError, Setup, Trace, TraceError, core_keys, lockstep,
    replay_core, run_lockstep,
};

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
