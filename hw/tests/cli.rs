//! `kvtier bench` as a user runs it, as a process: signals stop it cleanly, a killed run's
//! leftovers are swept by the next one, and bad options are clear errors before anything is
//! allocated.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvtier_hw::bench::TEMP_TIER_PREFIX;

/// A bench command whose region and temporary tiers live in `dir` (`shm`, `tmp`).
fn kvtier(dir: &Path, args: &[&str]) -> Command {
    let (shm, tmp) = (dir.join("shm"), dir.join("tmp"));
    std::fs::create_dir_all(&shm).unwrap();
    std::fs::create_dir_all(&tmp).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!("region_dir = {:?}\n", shm.to_str().unwrap()),
    )
    .unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    c.arg("bench")
        .arg("--config")
        .arg(&config)
        .args(args)
        .env("TMPDIR", &tmp)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

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

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

fn finish(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

#[test]
fn sigint_and_sigterm_stop_the_run_and_remove_its_files() {
    for sig in ["-INT", "-TERM"] {
        let dir = tempfile::tempdir().unwrap();
        let mut child = kvtier(dir.path(), LONG).spawn().unwrap();
        wait_running(&mut child, dir.path());
        signal(&child, sig);
        let out = finish(child);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(130), "{sig}: {stderr}");
        assert!(stderr.contains("interrupted after"), "{sig}: {stderr}");
        assert_eq!(
            entries(&dir.path().join("shm")),
            Vec::<String>::new(),
            "{sig}: region left"
        );
        assert_eq!(
            entries(&dir.path().join("tmp")),
            Vec::<String>::new(),
            "{sig}: tier left"
        );
    }
}

/// SIGINT or SIGTERM at any point of a run, from its start (before the handler is installed)
/// through creating the region and the tier to the replay, leaves nothing behind.
#[test]
fn a_signal_at_any_point_leaves_nothing_behind() {
    // Spread over the first second of a run by a fixed sequence: the same points every time.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in 0..8 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let delay = Duration::from_millis(x % 1000);
        let sig = if i % 2 == 0 { "-INT" } else { "-TERM" };
        let dir = tempfile::tempdir().unwrap();
        let child = kvtier(dir.path(), LONG).spawn().unwrap();
        std::thread::sleep(delay);
        signal(&child, sig);
        let out = finish(child);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // 130: stopped cleanly; no code: the signal came before the handler, when nothing
        // had been created yet.
        assert!(
            matches!(out.status.code(), Some(130) | None),
            "{sig} after {delay:?}: {:?} {stderr}",
            out.status
        );
        assert_eq!(
            entries(&dir.path().join("shm")),
            Vec::<String>::new(),
            "{sig} after {delay:?}"
        );
        assert_eq!(
            entries(&dir.path().join("tmp")),
            Vec::<String>::new(),
            "{sig} after {delay:?}"
        );
    }
}

#[test]
fn a_killed_runs_region_and_temporary_tier_are_swept_by_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = kvtier(dir.path(), LONG).spawn().unwrap();
    wait_running(&mut child, dir.path());
    signal(&child, "-KILL");
    let out = finish(child);
    assert_eq!(out.status.code(), None, "killed by the signal");
    let left = entries(&dir.path().join("tmp"));
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].starts_with(TEMP_TIER_PREFIX), "{left:?}");
    let regions = entries(&dir.path().join("shm"));
    assert!(!regions.is_empty(), "the killed run left its region");
    let out = kvtier(
        dir.path(),
        &[
            "--cpu-bytes",
            "8MiB",
            "--block-bytes",
            "16KiB",
            "--tier",
            ":16MiB",
            "--requests",
            "50",
        ],
    )
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
    assert_eq!(entries(&dir.path().join("tmp")), Vec::<String>::new());
    assert_eq!(entries(&dir.path().join("shm")), Vec::<String>::new());
}

fn fails_with(dir: &Path, args: &[&str], message: &str) {
    let out = kvtier(dir, args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(stderr.contains(message), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
}

#[test]
fn bad_options_are_clear_errors_before_anything_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    fails_with(
        dir.path(),
        &["--requests", "18446744073709551615"],
        "requests:",
    );
    fails_with(dir.path(), &["--requests", "100000000000"], "requests:");
    fails_with(
        dir.path(),
        &["--trace", "/dev/zero"],
        "/dev/zero:1: line longer than",
    );
    let out = kvtier(dir.path(), &["--policy", "FIFO"]).output().unwrap();
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
    .stderr(Stdio::null())
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("requests        100 "), "{stdout}");
    assert!(stdout.contains("5000 B each"), "{stdout}");
    assert!(
        stdout.contains("blocks, arc,"),
        "the primary is ARC: {stdout}"
    );
    assert!(
        stdout.contains(" blocks, lru,"),
        "the tier keeps LRU: {stdout}"
    );
    assert!(
        tier.join(kvtier_hw::DATA_FILE).exists(),
        "the tier is where --tier says"
    );
    assert!(!stdout.contains('\u{1b}'), "no colour codes in a pipe");
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
            "--trace",
            trace.to_str().unwrap(),
            "--requests",
            "4",
            "--cpu-bytes",
            "8MiB",
            "--block-bytes",
            "16KiB",
            "--tier",
            ":16MiB",
        ],
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
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a pipe: {stderr}"
    );
}
