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
    ] {
        let out = bench(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}
