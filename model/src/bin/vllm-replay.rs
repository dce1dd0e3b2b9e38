//! `vllm-replay`: a Mooncake-format trace through `kvtier-core` with vLLM 0.33's scheduler
//! call sequence (`kvtier_model::replay`), alone, in lockstep with vLLM's own manager
//! (`--compare`), or timed against it (`--time`).
//!
//! ```sh
//! cargo run --release -p kvtier-model --bin vllm-replay -- TRACE --policy lru --fraction 0.05 --compare
//! cargo run --release -p kvtier-model --bin vllm-replay -- TRACE --policy arc --time 5
//! ```
//!
//! Exit status: 0 when done (with `--compare`: every answer equal or explained by a named
//! rule), 1 on the first unexplained difference (printed with the request's index), 2 on any
//! other error.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kvtier_core::PolicyKind;
use kvtier_model::oracle::{self, Policy, VllmOracle};
use kvtier_model::replay::{
    self, CoreEngine, OracleEngine, ReplayError, Setup, Totals, Trace, core_keys, lockstep,
    replay_core, standalone,
};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    Lru,
    Arc,
    /// kvtier's reuse-aware LRU (the core alone: vLLM has no such policy).
    Reuse,
}

/// Replays a Mooncake-format trace (JSON lines with `hash_ids`) through kvtier-core with
/// vLLM 0.33's scheduler call sequence, one request at a time.
#[derive(Parser, Debug)]
#[command(name = "vllm-replay")]
struct Args {
    /// The trace.
    trace: PathBuf,
    /// The primary tier's eviction policy.
    #[arg(long, value_enum, default_value = "lru")]
    policy: PolicyArg,
    /// Primary capacity as a fraction of the trace's distinct blocks (as replay.py).
    #[arg(long, default_value_t = 0.05)]
    fraction: f64,
    /// Secondary tiers (authoritative in the core, scripted under vLLM's tiering manager).
    #[arg(long, default_value_t = 0)]
    tiers: usize,
    /// Each secondary tier's capacity as a fraction of the distinct blocks.
    #[arg(long, default_value_t = 1.0)]
    tier_fraction: f64,
    /// Tokens per block in the key positions.
    #[arg(long, default_value_t = replay::BLOCK_TOKENS)]
    block_tokens: u64,
    /// Replay in lockstep with vLLM's own manager, comparing every answer; exit 1 on the
    /// first unexplained difference.
    #[arg(long)]
    compare: bool,
    /// Time the core alone and vLLM's Python manager alone, RUNS runs each, and report ns
    /// per block operation and their ratio (primary only).
    #[arg(long, value_name = "RUNS")]
    time: Option<usize>,
}

fn out(line: impl std::fmt::Display) {
    let _ = writeln!(std::io::stdout(), "{line}");
}

fn totals_line(who: &str, t: &Totals) {
    out(format_args!(
        "{who:6} requests {} blocks {} hits {} ({:.4}) promoted {} ({:.4}) loaded {} ({:.4}) \
         stored {} refused {} evicted {} deferrals {} block_ops {}",
        t.requests,
        t.blocks,
        t.hits,
        t.hit_ratio(),
        t.promoted,
        t.promoted_ratio(),
        t.loaded,
        t.loaded_ratio(),
        t.stored,
        t.store_refused,
        t.evicted,
        t.deferrals,
        t.block_ops
    ));
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

fn run(args: &Args) -> Result<(), (u8, String)> {
    let fail = |e: String| (2u8, e);
    let trace = Trace::read(&args.trace).map_err(|e| fail(e.to_string()))?;
    let distinct = trace.distinct_blocks();
    let policy = match args.policy {
        PolicyArg::Lru => Policy::Lru,
        PolicyArg::Arc => Policy::Arc,
        PolicyArg::Reuse => Policy::Lru,
    };
    let mut setup = Setup::primary(policy, trace.capacity(args.fraction));
    if let PolicyArg::Reuse = args.policy {
        if args.compare || args.time.is_some() {
            return Err(fail(
                "vLLM has no reuse-aware LRU: --policy reuse replays the core alone".into(),
            ));
        }
        setup.core_policy = PolicyKind::Reuse;
    }
    setup.block_tokens = args.block_tokens;
    setup.tiers = vec![trace.capacity(args.tier_fraction); args.tiers];
    out(format_args!(
        "trace {}: {} requests, {} blocks, {} distinct; primary {:?} of {} blocks; tiers {:?}",
        args.trace.display(),
        trace.requests.len(),
        trace.blocks(),
        distinct,
        setup.core_policy,
        setup.num_blocks,
        setup.tiers
    ));

    if let Some(runs) = args.time {
        if !setup.tiers.is_empty() {
            return Err(fail(
                "--time replays the primary alone: drop --tiers".into(),
            ));
        }
        return time(args, &trace, &setup, runs.max(1));
    }

    if !args.compare {
        let mut core = CoreEngine::new(&setup);
        let t = standalone(&mut core, &trace).map_err(|e| fail(e.to_string()))?;
        totals_line("core", &t);
        return Ok(());
    }

    let mut o = VllmOracle::spawn().map_err(|e| fail(e.to_string()))?;
    let report = match lockstep(&mut o, &trace, &setup) {
        Ok(r) => r,
        Err(e @ ReplayError::Differ(_)) => return Err((1, format!("DIFFERENCE at {e}"))),
        Err(e) => return Err(fail(e.to_string())),
    };
    out("lockstep: every answer, slot, evicted key and event equal, or explained below");
    totals_line("both", &report.totals);
    for (rule, n) in &report.exceptions {
        out(format_args!("exception {rule}: {n}"));
    }
    out(format_args!("resyncs {}", report.resyncs));
    for d in &report.diverged {
        out(format_args!("  {d}"));
    }
    if setup.tiers.is_empty() {
        // The timed path must replay exactly what the lockstep did.
        let (t, _) = replay_core(&core_keys(&trace), &setup);
        let mut both = report.totals.clone();
        both.promoted = 0;
        if t != both {
            return Err(fail(format!(
                "the timed core replay disagrees with the lockstep: {t:?} vs {both:?}"
            )));
        }
    } else {
        let mut core = CoreEngine::new(&setup);
        let t = standalone(&mut core, &trace).map_err(|e| fail(e.to_string()))?;
        totals_line("core alone", &t);
        let mut vllm = OracleEngine::new(&mut o, &setup).map_err(|e| fail(e.to_string()))?;
        let t = standalone(&mut vllm, &trace).map_err(|e| fail(e.to_string()))?;
        totals_line("vLLM alone", &t);
    }
    Ok(())
}

fn time(args: &Args, trace: &Trace, setup: &Setup, runs: usize) -> Result<(), (u8, String)> {
    let fail = |e: String| (2u8, e);
    let keys = core_keys(trace);
    let mut core_times = Vec::new();
    let mut totals = None;
    for _ in 0..runs {
        let (t, d) = replay_core(&keys, setup);
        core_times.push(d);
        if totals.as_ref().is_some_and(|prev| *prev != t) {
            return Err(fail("two runs of the core disagree".into()));
        }
        totals = Some(t);
    }
    let t = totals.expect("at least one run");
    let dir = oracle::install_dir();
    let python = dir.join("venv").join("bin").join("python");
    let policy = match setup.policy {
        Policy::Lru => "lru",
        Policy::Arc => "arc",
    };
    let output = Command::new(&python)
        .arg(replay::REPLAY_SCRIPT)
        .arg("--vllm-dir")
        .arg(&dir)
        .args(["--policy", policy, "--fraction", &args.fraction.to_string()])
        .args(["--block-tokens", &setup.block_tokens.to_string()])
        .args(["--time", &runs.to_string(), "--json"])
        .arg(&args.trace)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .map_err(|e| {
            fail(format!(
                "cannot run {}: {e} ({})",
                python.display(),
                oracle::SETUP_HINT
            ))
        })?;
    if !output.status.success() {
        return Err(fail(format!(
            "replay.py failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    let py: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| fail(format!("replay.py: {e}")))?;
    let field = |name: &str| py[name].as_u64().unwrap_or(u64::MAX);
    for (name, core) in [
        ("capacity_blocks", u64::from(setup.num_blocks)),
        ("blocks", t.blocks),
        ("hits", t.loaded),
        ("stored", t.stored),
        ("store_refused", t.store_refused),
        ("block_ops", t.block_ops),
    ] {
        if field(name) != core {
            return Err(fail(format!(
                "vLLM's replay differs from the core's in {name}: {} vs {core}",
                field(name)
            )));
        }
    }
    let vllm_times: Vec<Duration> = py["manager_ns"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(Duration::from_nanos)
                .collect()
        })
        .unwrap_or_default();
    if vllm_times.is_empty() {
        return Err(fail("replay.py reported no timing".into()));
    }
    let ops = t.block_ops as f64;
    let per_op = |d: Duration| d.as_nanos() as f64 / ops;
    let min = |v: &[Duration]| v.iter().copied().min().expect("at least one run");
    let (core_med, vllm_med) = (
        per_op(median(core_times.clone())),
        per_op(median(vllm_times.clone())),
    );
    let (core_min, vllm_min) = (per_op(min(&core_times)), per_op(min(&vllm_times)));
    totals_line("both", &t);
    out(format_args!(
        "block operations: {} (keys passed to lookup, prepare_load, complete_load, \
         prepare_store, complete_store)",
        t.block_ops
    ));
    let ms = |v: &[Duration]| {
        v.iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
            .join(" ")
    };
    out(format_args!(
        "core  ns per block operation: median {core_med:7.1}, min {core_min:7.1} ({runs} runs, ms: {})",
        ms(&core_times)
    ));
    out(format_args!(
        "vLLM  ns per block operation: median {vllm_med:7.1}, min {vllm_min:7.1} ({runs} runs, ms: {})",
        ms(&vllm_times)
    ));
    out(format_args!(
        "ratio vLLM / core: median {:.1}x, min {:.1}x",
        vllm_med / core_med,
        vllm_min / core_min
    ));
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, message)) => {
            let _ = writeln!(std::io::stderr(), "vllm-replay: {message}");
            ExitCode::from(code)
        }
    }
}
