//! `kvtier bench --policy a,b --fraction x,y`: the policy sweep, end to end through the CLI.

use std::path::PathBuf;
use std::process::{Command, Output};

fn excerpt() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/mooncake-excerpt.jsonl")
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("bench")
        .arg("--trace")
        .arg(excerpt())
        .args(args)
        .output()
        .expect("the kvtier binary runs")
}

/// The JSON report of a sweep that must succeed.
fn report(args: &[&str]) -> serde_json::Value {
    let out = bench(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn a_sweep_reports_every_policy_at_every_capacity() {
    let report = report(&["--fraction", "0.05,0.1", "--json"]);
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    let blocks = report["blocks"].as_u64().expect("blocks");
    for row in rows {
        let optimum = row["optimum"].as_u64().expect("optimum");
        let cells = row["cells"].as_array().expect("cells");
        let names: Vec<&str> = cells
            .iter()
            .map(|c| c["policy"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["lru", "arc", "reuse"], "every policy by default");
        for c in cells {
            let hits = c["hits"].as_u64().expect("hits");
            assert!(
                hits > 0 && hits <= optimum && optimum <= blocks,
                "{c} vs {optimum}"
            );
        }
    }
    // The same replay gives the same figures: a table, with the policies asked for.
    let text = bench(&["--policy", "reuse,lru", "--fraction", "0.05"]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("reuse") && text.contains("optimum"), "{text}");
    let reuse_hits = rows[0]["cells"][2]["hits"].as_u64().unwrap();
    let ratio = format!("{:.4}", reuse_hits as f64 / blocks as f64);
    assert!(text.contains(&ratio), "{ratio} not in\n{text}");
}

#[test]
fn without_capacities_a_sweep_spans_one_to_fifty_percent() {
    let report = report(&["--policy", "lru,reuse", "--json"]);
    let fractions: Vec<f64> = report["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["fraction"].as_f64().expect("fraction"))
        .collect();
    assert_eq!(fractions, [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]);
}

/// `--seeds N`: each cell replayed N times with the keys named anew; the JSON keeps each
/// replay's overall hits, LRU's agree, and a cell's counts are the first naming's (a single
/// replay's: never above the optimum).
#[test]
fn seeds_replay_each_cell_and_keep_every_replay() {
    let report = report(&[
        "--policy",
        "lru,reuse",
        "--fraction",
        "0.05",
        "--seeds",
        "3",
        "--json",
    ]);
    assert_eq!(report["seeds"], 3);
    for c in report["rows"][0]["cells"].as_array().expect("cells") {
        let by_seed: Vec<u64> = c["by_seed"]
            .as_array()
            .expect("by_seed")
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(by_seed.len(), 3, "{c}");
        let first = c["hits"].as_u64().unwrap() + c["promoted"].as_u64().unwrap();
        assert_eq!(by_seed[0], first, "{c}");
        let optimum = report["rows"][0]["optimum"].as_u64().unwrap();
        assert!(by_seed.iter().all(|&h| h <= optimum), "{c}");
        if c["policy"] == "lru" {
            assert!(by_seed.iter().all(|&h| h == by_seed[0]), "{c}");
        }
    }
    let text = bench(&[
        "--policy",
        "lru,reuse",
        "--fraction",
        "0.05",
        "--seeds",
        "2",
    ]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("replayed 2 times") && text.contains('–'),
        "{text}"
    );
}

#[test]
fn a_sweep_above_a_tier_counts_promoted_hits() {
    let report = report(&["--fraction", "0.05", "--tier-fraction", "0.25", "--json"]);
    assert_eq!(report["tier"]["policy"], "lru");
    let row = &report["rows"][0];
    assert!(row["tier_blocks"].as_u64().unwrap() > 0);
    for c in row["cells"].as_array().expect("cells") {
        assert!(c["promoted"].as_u64().unwrap() > 0, "{c}");
    }
}

#[test]
fn a_bad_capacity_or_several_nodes_are_refused() {
    for (args, message) in [
        (&["--fraction", "1.5"][..], "--fraction"),
        (&["--fraction", "0.05", "--nodes", "2"][..], "--nodes"),
        (&["--fraction", "0.05", "--seeds", "0"][..], "--seeds"),
        (&["--seeds", "2"][..], "--seeds"),
    ] {
        let out = bench(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

/// A trace is replayed as vLLM caches it, whole blocks alone: a line's partial last block is
/// neither looked up nor stored, and a line with no whole block is not replayed;
/// `--partial-blocks` replays them too.
#[test]
fn a_trace_is_replayed_in_whole_blocks_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    // Two turns of one conversation, each ending inside a block (ids 2 and 4 are partial),
    // and a line shorter than one block.
    let lines = [
        (1000, "1, 2"),
        (1600, "1, 3, 4"),
        (100, "5"),
    ]
    .map(|(tokens, ids)| {
        format!(
            "{{\"timestamp\": 0, \"input_length\": {tokens}, \"output_length\": 1, \"hash_ids\": [{ids}]}}\n"
        )
    });
    std::fs::write(&trace, lines.concat()).unwrap();
    let sweep = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["bench", "--trace", trace.to_str().unwrap()])
            .args(["--policy", "lru", "--fraction", "0.5", "--json"])
            .args(extra)
            .output()
            .expect("the kvtier binary runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("JSON")
    };
    let whole = sweep(&[]);
    assert_eq!(whole["requests"], 2, "{whole}");
    assert_eq!(whole["blocks"], 3, "blocks 1; 1 and 3: {whole}");
    assert_eq!(whole["distinct"], 2, "{whole}");
    assert_eq!(
        whole["rows"][0]["cells"][0]["hits"], 1,
        "block 1 again: {whole}"
    );
    let partial = sweep(&["--partial-blocks"]);
    assert_eq!(partial["requests"], 3, "{partial}");
    assert_eq!(partial["blocks"], 6, "{partial}");
    assert_eq!(partial["distinct"], 5, "{partial}");
}
