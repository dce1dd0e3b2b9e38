//! `kvtier bench` as a user runs it, as a process: signals stop it cleanly, a killed run's
//! leftovers are swept by the next one, options size a run and override the file, and bad
//! input is a clear error before anything is created. `--nodes N`: N processes sharing a real
//! Redis server (started by the test on loopback) find each other's blocks, serve no wrong
//! data, and end together.

#[path = "support/redis.rs"]
mod redis_server;
#[path = "../../tests/support/s3_server.rs"]
mod s3_server;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvtier_hw::bench::TEMP_TIER_PREFIX;
use redis_server::RedisServer;
use s3_server::S3Server;

const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;

/// A bench command whose region and temporary tiers live in `dir` (`shm`, `tmp`).
fn kvtier(dir: &Path, args: &[&str]) -> Command {
    let shm = dir.join("shm");
    std::fs::create_dir_all(&shm).unwrap();
    let mut c = kvtier_anonymous(dir, &[]);
    c.arg("--region-dir").arg(&shm).args(args);
    c
}

/// A bench command with an anonymous region (the default) and temporary tiers in `dir/tmp`.
fn kvtier_anonymous(dir: &Path, args: &[&str]) -> Command {
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    c.arg("bench")
        .args(args)
        .env("TMPDIR", &tmp)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// A small run.
const SMALL: &[&str] = &[
    "--cpu-bytes",
    "8MiB",
    "--block-bytes",
    "16KiB",
    "--tier",
    ":16MiB",
];

/// A run long enough to be interrupted: small blocks, many requests.
const LONG: &[&str] = &[
    "--cpu-bytes",
    "8MiB",
    "--block-bytes",
    "16KiB",
    "--tier",
    ":64MiB",
    "--requests",
    "200000",
];

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// No region and no temporary tier is left in `dir`.
fn assert_clean(dir: &Path, what: &str) {
    assert_eq!(
        entries(&dir.join("shm")),
        Vec::<String>::new(),
        "{what}: region left"
    );
    assert_eq!(
        entries(&dir.join("tmp")),
        Vec::<String>::new(),
        "{what}: tier left"
    );
}

/// Waits until the run has created its region and temporary tier (it is replaying).
fn wait_running(child: &mut Child, dir: &Path) {
    let start = Instant::now();
    while entries(&dir.join("shm")).is_empty() || entries(&dir.join("tmp")).is_empty() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the run never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
}

/// `n` points spread over a run's first second by a fixed sequence: the same every time.
fn fixed_points(seed: u64, n: usize) -> Vec<Duration> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Duration::from_millis(x % 1000)
        })
        .collect()
}

fn signal(child: &Child, sig: i32) {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig}");
}

fn finish(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

#[test]
fn sigint_and_sigterm_stop_the_run_and_remove_its_files() {
    for sig in [SIGINT, SIGTERM] {
        let dir = tempfile::tempdir().unwrap();
        let mut child = kvtier(dir.path(), LONG).spawn().unwrap();
        wait_running(&mut child, dir.path());
        signal(&child, sig);
        let out = finish(child);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(128 + sig), "signal {sig}: {stderr}");
        assert!(
            stderr.contains("interrupted after"),
            "signal {sig}: {stderr}"
        );
        assert_clean(dir.path(), &format!("signal {sig}"));
    }
}

/// SIGINT or SIGTERM at any point of a run, from its start (before the handler is installed)
/// through creating the region and the tier to the replay, leaves nothing behind.
#[test]
fn a_signal_at_any_point_leaves_nothing_behind() {
    for (i, delay) in fixed_points(0x2545_f491_4f6c_dd1d, 8)
        .into_iter()
        .enumerate()
    {
        let sig = if i % 2 == 0 { SIGINT } else { SIGTERM };
        let dir = tempfile::tempdir().unwrap();
        let child = kvtier(dir.path(), LONG).spawn().unwrap();
        std::thread::sleep(delay);
        signal(&child, sig);
        let out = finish(child);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Stopped cleanly with 128 + the signal, or killed by that very signal when it came
        // before the handler was installed, when nothing had been created yet.
        assert!(
            out.status.code() == Some(128 + sig) || out.status.signal() == Some(sig),
            "signal {sig} after {delay:?}: {:?} {stderr}",
            out.status
        );
        assert_clean(dir.path(), &format!("signal {sig} after {delay:?}"));
    }
}

/// `kill -9` at any point of a run's first second, from its start through creating the region
/// and the tier to the replay: whatever it left, the next run sweeps it and succeeds.
#[test]
fn a_kill_at_any_point_is_swept_by_the_next_run() {
    for delay in fixed_points(0x9e37_79b9_7f4a_7c15, 6) {
        let dir = tempfile::tempdir().unwrap();
        let child = kvtier(dir.path(), LONG).spawn().unwrap();
        std::thread::sleep(delay);
        signal(&child, 9);
        let out = finish(child);
        assert_eq!(out.status.signal(), Some(9), "after {delay:?}");
        let next = kvtier(dir.path(), &[SMALL, &["--requests", "20"]].concat())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&next.stderr);
        assert!(next.status.success(), "after a kill at {delay:?}: {stderr}");
        assert_clean(dir.path(), &format!("the run after a kill at {delay:?}"));
    }
}

/// `Shmem` of `/proc/meminfo` in bytes (shared memory, anonymous regions included).
fn shmem() -> i64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = info.lines().find(|l| l.starts_with("Shmem:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<i64>()
        .unwrap()
        * 1024
}

/// By default the region is anonymous: a run killed with `kill -9` leaves no region file and
/// its memory is freed (`Shmem` falls by about the region's 256 MiB).
#[test]
fn a_killed_run_leaves_no_anonymous_region() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = LONG.to_vec();
    args[1] = "256MiB";
    let mut child = kvtier_anonymous(dir.path(), &args).spawn().unwrap();
    let label = format!("memfd:kvtier:kvtier-bench-{}", child.id());
    let maps = format!("/proc/{}/maps", child.id());
    let start = Instant::now();
    // Running: the region mapped and the temporary tier made after it.
    while entries(&dir.path().join("tmp")).is_empty()
        || !std::fs::read_to_string(&maps).is_ok_and(|m| m.contains(&label))
    {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(start.elapsed() < Duration::from_secs(60), "never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let during = shmem();
    signal(&child, 9);
    let out = finish(child);
    assert_eq!(out.status.signal(), Some(9), "killed by the signal");
    let freed = during - shmem();
    assert!(
        freed >= 192 << 20,
        "Shmem fell by {freed} bytes, not by about the region's 256 MiB"
    );
    let name = label.trim_start_matches("memfd:kvtier:");
    assert!(
        !entries(Path::new("/dev/shm"))
            .iter()
            .any(|n| n.contains(name)),
        "a region file was left"
    );
}

#[test]
fn a_killed_runs_region_and_temporary_tier_are_swept_by_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = kvtier(dir.path(), LONG).spawn().unwrap();
    wait_running(&mut child, dir.path());
    signal(&child, 9);
    let out = finish(child);
    assert_eq!(out.status.signal(), Some(9), "killed by the signal");
    let left = entries(&dir.path().join("tmp"));
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].starts_with(TEMP_TIER_PREFIX), "{left:?}");
    let regions = entries(&dir.path().join("shm"));
    assert!(!regions.is_empty(), "the killed run left its region");
    let out = kvtier(dir.path(), &[SMALL, &["--requests", "50"]].concat())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("removed the temporary tier of a run that died"),
        "{stderr}"
    );
    assert!(
        stderr.contains("removed what a run that died left of its region"),
        "{stderr}"
    );
    assert_clean(dir.path(), "after the next run");
}

fn fails_with(dir: &Path, args: &[&str], message: &str) {
    let out = kvtier(dir, args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(stderr.contains(message), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_clean(dir, &format!("{args:?}"));
}

#[test]
fn bad_input_is_a_clear_error_before_anything_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fails_with(d, &["--requests", "18446744073709551615"], "requests:");
    fails_with(d, &["--requests", "100000000000"], "requests:");
    fails_with(
        d,
        &["--requests", "0"],
        "requests (--requests): must be at least 1",
    );
    fails_with(
        d,
        &["--trace", "/dev/zero"],
        "/dev/zero:1: line longer than",
    );
    fails_with(
        d,
        &["--tier", ":1"],
        "secondary_tiers[0].capacity_bytes (--tier)",
    );
    fails_with(
        d,
        &["--cpu-bytes", "0"],
        "cpu_bytes_to_use (--cpu-bytes): 0 B holds no block",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "--region-dir", "/nonexistent/kvtier"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("region_dir (--region-dir): /nonexistent/kvtier is not a directory"),
        "{stderr}"
    );
    let out = kvtier(d, &["--policy", "FIFO"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "clap refuses an unknown policy");
    assert!(String::from_utf8_lossy(&out.stderr).contains("lru"));
}

#[test]
fn options_size_a_run_without_a_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    let spec = format!("{}:16MiB", tier.display());
    let out = kvtier(
        dir.path(),
        &[
            "--cpu-bytes",
            "8MiB",
            "--block-bytes",
            "5000",
            "--tier",
            &spec,
            "--policy",
            "ARC",
            "--requests",
            "100",
        ],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("requests        100 "), "{stdout}");
    assert!(stdout.contains("5000 B each"), "{stdout}");
    assert!(
        stdout.contains("blocks, arc,"),
        "the primary is ARC: {stdout}"
    );
    assert!(
        stdout.contains(" blocks, lru (cascade),"),
        "the tier keeps LRU, cascaded to as vLLM's: {stdout}"
    );
    assert!(
        tier.join(kvtier_hw::DATA_FILE).exists(),
        "the tier is where --tier says"
    );
    assert!(stderr.contains("file tier open"), "info logs on: {stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a pipe: {stderr}"
    );
}

/// Options override the file before anything is judged: a file whose primary holds no block
/// of the default size is fine with `--block-bytes` that makes it hold some.
#[test]
fn options_override_the_file_before_it_is_judged() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "cpu_bytes_to_use = 131072\n").unwrap();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
    )
    .unwrap();
    let out = kvtier(
        dir.path(),
        &[
            "--config",
            config.to_str().unwrap(),
            "--block-bytes",
            "4KiB",
            "--tier",
            ":1MiB",
            "--trace",
            trace.to_str().unwrap(),
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_clean(dir.path(), "after the run");
}

/// A tier the configuration file makes a victim tier (V1–V4) is written ahead of the
/// primary's evictions: the report names its admission and what it missed, blocks come back
/// from it, and every loaded block is verified.
#[test]
fn a_victim_tier_runs_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "cpu_bytes_to_use = 4194304\nsecondary_tiers = [{ type = \"file\", capacity_bytes = 33554432, victim_lookahead = 64 }]\n",
    )
    .unwrap();
    let out = kvtier(
        dir.path(),
        &[
            "--config",
            config.to_str().unwrap(),
            "--block-bytes",
            "16KiB",
            "--requests",
            "1500",
        ],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // A step of four requests stores up to 312 blocks here, more than the configured
    // look-ahead, which grows with the steps' evictions (V2); the report counts the blocks
    // evicted before they were written.
    assert!(
        stdout.contains("lru (victim, at least 64 ahead, "),
        "{stdout}"
    );
    assert!(
        stdout.contains("verified        0 loaded blocks differed"),
        "{stdout}"
    );
    let promoted = stdout
        .split(" promoted from secondary tiers")
        .next()
        .and_then(|s| s.rsplit("+ ").next())
        .and_then(|p| p.trim_end_matches('%').parse::<f64>().ok())
        .expect("a promoted share");
    assert!(
        promoted > 0.0,
        "the victim tier served blocks back: {stdout}"
    );
    assert_clean(dir.path(), "after the run");
}

/// A persistent tier remembers the block size it was made for: a run with another block size
/// of the same page-aligned row (5000 and 6000 bytes both fill 8 KiB) is refused, never
/// served the first run's blocks as its own.
#[test]
fn a_tier_of_another_block_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tier = format!("{}:16MiB", dir.path().join("tier").display());
    let run = |block: &str| {
        kvtier(
            dir.path(),
            &[
                "--cpu-bytes",
                "8MiB",
                "--block-bytes",
                block,
                "--tier",
                &tier,
                "--requests",
                "300",
            ],
        )
        .output()
        .unwrap()
    };
    let first = run("5000");
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = run("6000");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("5000-byte blocks"), "{stderr}");
    let again = run("5000");
    assert!(again.status.success(), "the tier was kept as it was");
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 loaded blocks differed"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
}

/// One very long request (16,000 blocks in one cascade and one promotion job) runs: a job's
/// rows are borrowed without recursion.
#[test]
fn a_long_request_runs() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 16_000u64;
    let ids: Vec<String> = (0..blocks).map(|i| i.to_string()).collect();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        format!(
            "{{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
            ids.join(",")
        ),
    )
    .unwrap();
    let cpu = (2 * blocks * 4096 + 4096).to_string();
    let tier = format!(":{}", 2 * blocks * 8192);
    let out = kvtier(
        dir.path(),
        &[
            "--block-bytes",
            "4KiB",
            "--cpu-bytes",
            &cpu,
            "--tier",
            &tier,
            "--trace",
            trace.to_str().unwrap(),
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
}

#[test]
fn a_trace_limited_by_requests_replays_its_first_requests() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let line = |i: u64| {
        format!(
            "{{\"timestamp\": {i}, \"input_length\": 1024, \"output_length\": 1, \"session_id\": \"s{i}\", \"hash_ids\": [1, 2, {}]}}\n",
            i + 10
        )
    };
    std::fs::write(&trace, (0..10).map(line).collect::<String>()).unwrap();
    let out = kvtier(
        dir.path(),
        &[
            SMALL,
            &["--trace", trace.to_str().unwrap(), "--requests", "4"],
        ]
        .concat(),
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("requests        4 "), "{stdout}");
}

const BLOCK: u64 = 16 << 10;

/// A configuration: a small primary, a file tier (at `tier`, or temporary), the shared Redis
/// tier at `redis`.
/// A shared tier on the Redis server at `url`, as a configuration's lines.
fn redis_tier(url: &str) -> String {
    format!(
        "[[secondary_tiers]]\ntype = \"redis\"\nurls = [\"{url}\"]\nnamespace = \"nodes-test\"\ncapacity_bytes = {}\n",
        4096 * BLOCK
    )
}

/// A configuration of a 512-block primary and a file tier (at `tier`, else temporary), then
/// the `shared` tier's lines if any.
fn config(dir: &Path, tier: Option<&Path>, shared: Option<String>) -> String {
    let mut text = format!(
        "cpu_bytes_to_use = {}\nblock_size = 32\nbytes_per_token = 512\n\
         [[secondary_tiers]]\ntype = \"file\"\ncapacity_bytes = {}\n",
        512 * BLOCK,
        1024 * 2 * BLOCK
    );
    if let Some(path) = tier {
        text += &format!("path = {:?}\n", path.to_str().unwrap());
    }
    if let Some(shared) = shared {
        text += &shared;
    }
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A Mooncake-format trace in which every document (a shared prefix of 8 blocks) is read by
/// one conversation early and by another conversation later, dealt to the other node:
/// conversations go round-robin by first appearance, and one filler conversation between the
/// two rounds shifts the second round's by one node. Each conversation has three turns, each
/// resending the conversation so far and adding two blocks. Block ids are prefix hashes:
/// documents, then conversations, in ranges of their own.
fn trace(dir: &Path, documents: u64) -> (String, usize) {
    let mut lines = Vec::new();
    let mut conversation = 0u64;
    let mut add = |lines: &mut Vec<String>, doc: Option<u64>| {
        let prefix: Vec<u64> = match doc {
            Some(d) => (0..8).map(|i| d * 100 + i).collect(),
            None => vec![],
        };
        let own = 1_000_000 + conversation * 100;
        conversation += 1;
        for turn in 1..=3u64 {
            let ids: Vec<String> = prefix
                .iter()
                .copied()
                .chain(own..own + 2 * turn)
                .map(|b| b.to_string())
                .collect();
            lines.push(format!(
                "{{\"timestamp\": 0, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": [{}]}}",
                ids.len() * 512,
                ids.join(", ")
            ));
        }
    };
    for d in 0..documents {
        add(&mut lines, Some(d));
    }
    add(&mut lines, None);
    for d in 0..documents {
        add(&mut lines, Some(d));
    }
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    (path.to_str().unwrap().to_owned(), lines.len())
}

/// `kvtier bench --nodes 2` over a file tier per node and the `shared` tier (a configuration's
/// lines): nothing wrong is served, a node promotes blocks the other stored, and each node's
/// report is whole. `env` goes to the nodes' environment.
fn two_nodes_share(shared: String, env: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    let config = config(dir.path(), Some(&tier), Some(shared));
    let (trace, requests) = trace(dir.path(), 40);
    let out = kvtier(
        dir.path(),
        &[
            "--config", &config, "--trace", &trace, "--nodes", "2", "--json",
        ],
    )
    .envs(env.iter().copied())
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stderr}\n{stdout}", out.status);
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("a JSON report");
    let total = &report["total"];
    assert_eq!(
        total["wrong_blocks"], 0,
        "★1: nothing wrong served: {stdout}"
    );
    assert!(
        total["cross_node_hits"].as_u64().unwrap() > 0,
        "a node promoted a block the other stored: {stdout}"
    );
    assert_eq!(total["requests"], requests as u64, "{stdout}");
    let nodes = report["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    for (i, n) in nodes.iter().enumerate() {
        assert!(n["requests"].as_u64().unwrap() > 0, "node {i}: {stdout}");
        assert_eq!(n["promotions_failed"], 0, "node {i}: {stdout}");
    }
    // Each node's own report, whole, with its region and tiers of its own.
    assert_eq!(report["reports"].as_array().unwrap().len(), 2);
    let sum: u64 = nodes
        .iter()
        .map(|n| n["cross_node_hits"].as_u64().unwrap())
        .sum();
    assert_eq!(sum, total["cross_node_hits"].as_u64().unwrap());
    assert_clean(dir.path(), "after two nodes");
    for node in ["node-0", "node-1"] {
        let data = tier.join(node).join(kvtier_hw::DATA_FILE);
        assert!(data.exists(), "each node has its own file tier: {data:?}");
    }
}

#[test]
fn two_nodes_find_each_others_blocks_in_the_shared_tier() {
    let server = RedisServer::start(&[]);
    two_nodes_share(redis_tier(&server.url()), &[]);
    let names: u64 = redis::cmd("DBSIZE").query(&mut server.connect()).unwrap();
    assert!(
        names > 0,
        "the nodes stored their blocks in the shared tier"
    );
}

/// The same over an S3 tier on a real SeaweedFS server, its credentials from the environment
/// variables the configuration names.
#[test]
fn two_nodes_find_each_others_blocks_in_an_s3_tier() {
    let server = S3Server::start(false);
    server.create_bucket("nodes-test");
    two_nodes_share(
        format!(
            "[[secondary_tiers]]\ntype = \"s3\"\nendpoint = \"{}\"\nbucket = \"nodes-test\"\n\
         access_key_id_env = \"KVTIER_TEST_S3_KEY\"\nsecret_access_key_env = \"KVTIER_TEST_S3_SECRET\"\n\
         capacity_bytes = {}\n",
            server.endpoint(),
            4096 * BLOCK
        ),
        &[
            ("KVTIER_TEST_S3_KEY", s3_server::ACCESS_KEY),
            ("KVTIER_TEST_S3_SECRET", s3_server::SECRET_KEY),
        ],
    );
}

#[test]
fn several_nodes_without_a_shared_tier_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), None, None);
    let args = ["--config", &config, "--nodes", "2"];
    fails_with(dir.path(), &args, "nodes (--nodes 2)");
    fails_with(dir.path(), &args, "type = \"redis\"");
    fails_with(
        dir.path(),
        &["--nodes", "0"],
        "nodes (--nodes): must be 1 to 64",
    );
}

/// Ctrl-C (SIGINT to the parent; the nodes are in process groups of their own, so only the
/// parent hears it) stops every node: each ends its jobs and removes its region and tier.
#[test]
fn an_interrupt_stops_every_node_and_leaves_nothing() {
    let server = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), None, Some(redis_tier(&server.url())));
    let mut child = kvtier(
        dir.path(),
        &["--config", &config, "--nodes", "2", "--requests", "200000"],
    )
    .spawn()
    .unwrap();
    let start = Instant::now();
    while entries(&dir.path().join("shm")).len() < 2 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the nodes never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&child, SIGINT);
    let out = finish(child);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + SIGINT), "{stderr}");
    assert!(stderr.contains("node 0: kvtier: interrupted"), "{stderr}");
    assert!(stderr.contains("node 1: kvtier: interrupted"), "{stderr}");
    assert_clean(dir.path(), "after an interrupt");
}
