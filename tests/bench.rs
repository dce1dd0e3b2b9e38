//! `kvtier bench` in miniature, in process: every loaded block is verified, the hit ratio stays
//! under Belady's optimum, and every path moves bytes.

use std::path::Path;

use kvtier_hw::bench::{self, BenchSettings, Request, Synthetic, TierSettings};

fn small(dir: &Path) -> BenchSettings {
    BenchSettings {
        cpu_bytes: 256 * 4096,
        block_bytes: 4096,
        region_dir: Some(dir.to_path_buf()),
        tiers: vec![TierSettings::new(Some(dir.join("tier")), 1024 * 2 * 4096)],
        ..BenchSettings::default()
    }
}

fn check(report: &bench::Report) {
    assert_eq!(
        report.wrong_blocks, 0,
        "★1: no loaded block differs from what was stored"
    );
    assert!(
        report.hit_ratio <= report.optimal_hit_ratio + 1e-9,
        "{report}"
    );
    assert!(
        report.primary_hit_ratio <= report.optimal_primary_hit_ratio + 1e-9,
        "{report}"
    );
    assert_eq!(
        report.promotions.failed, 0,
        "no promotion fails on a healthy tier"
    );
    assert!(
        report.promoted_hits > 0 && report.primary_hits > 0,
        "{report}"
    );
}

#[test]
fn the_synthetic_workload_hits_every_path() {
    let dir = tempfile::tempdir().unwrap();
    let requests = Synthetic {
        requests: 1500,
        conversations: 400,
        max_blocks: 48,
        ..Synthetic::default()
    }
    .generate();
    let report = bench::run(&small(dir.path()), &requests, &mut ()).unwrap();
    check(&report);
    assert!(report.primary_evictions > 0);
    assert!(report.paths.iter().take(4).all(|p| p.bytes > 0), "{report}");
}

#[test]
fn the_mooncake_trace_replays() {
    let dir = tempfile::tempdir().unwrap();
    // An excerpt of Mooncake's public trace, kept in the repository (see tests/data/README.md).
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mooncake-excerpt.jsonl");
    let requests: Vec<Request> = bench::read_trace(&trace).unwrap();
    let mut settings = small(dir.path());
    settings.cpu_bytes = 1024 * 4096;
    // Room for every block of these requests: the hit ratio reaches the trace's prefix reuse.
    settings.tiers[0].capacity_bytes = 20_000 * 2 * 4096;
    let report = bench::run(&settings, &requests, &mut ()).unwrap();
    check(&report);
    assert_eq!(report.requests, 800);
    assert!(
        report.hit_ratio > 0.9 * report.optimal_hit_ratio,
        "{report}"
    );
}

/// ★6: a second run over the same file tier starts warm: it promotes what the first stored.
#[test]
fn a_persistent_tier_warms_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let requests = Synthetic {
        requests: 300,
        conversations: 100,
        ..Synthetic::default()
    }
    .generate();
    let first = bench::run(&small(dir.path()), &requests, &mut ()).unwrap();
    check(&first);
    let second = bench::run(&small(dir.path()), &requests, &mut ()).unwrap();
    // Warm, the second run may beat the cold optimum: only correctness is checked against it.
    assert_eq!(second.wrong_blocks, 0);
    assert!(second.hit_ratio > first.hit_ratio, "{first}\n{second}");
}

/// A hit on a block that another request was still storing is not a promotion: two identical
/// requests in one batch start no promotion, and the second one's hits are counted apart.
#[test]
fn hits_on_another_requests_store_are_not_promotions() {
    let dir = tempfile::tempdir().unwrap();
    let r = Request::new((0..6).collect());
    let report = bench::run(&small(dir.path()), &[r.clone(), r], &mut ()).unwrap();
    assert_eq!(report.promotions.started, 0, "{report}");
    assert_eq!(report.promoted_hits, 0, "{report}");
    assert_eq!(report.pending_hits, 6, "{report}");
    assert_eq!(report.primary_hits, 0, "{report}");
    assert!(report.to_string().contains("stored by another request"));
}
