//! The `kvtier` command: `kvtier bench` replays a workload through real memory and disk tiers
//! and reports hit ratios, bandwidth and latency.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier_hw::bench::{
    self, BenchError, BenchSettings, FileSettings, Progress, Synthetic, TierSettings, TraceLimits,
};

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "Multi-tier KV-cache offloading engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a workload end to end: a shared-memory primary tier, a file tier, the host
    /// transfer engine. With no options: about 1 GiB of /dev/shm, a 4 GiB file tier in a
    /// temporary directory and a synthetic multi-turn chat workload.
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
    /// A Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids;
    /// other fields are ignored).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// A TOML or JSON configuration (cpu_bytes_to_use, block_size, bytes_per_token,
    /// eviction_policy, secondary_tiers = [{type = "file", path, capacity_bytes,
    /// eviction_policy}]).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Bytes of the primary region, with units (`2GiB`); overrides the configuration.
    #[arg(long, value_parser = bench::parse_bytes)]
    cpu_bytes: Option<u64>,
    /// Directory of the primary region's shared-memory file (default `/dev/shm`).
    #[arg(long)]
    region_dir: Option<PathBuf>,
    /// A secondary file tier, `PATH:BYTES` (`/mnt/nvme/kv:64GiB`; an empty PATH is a
    /// temporary directory). Repeat for more tiers, in cascade order; replaces the
    /// configuration's tiers.
    #[arg(long = "tier", value_name = "PATH:BYTES", value_parser = TierSettings::parse)]
    tiers: Vec<TierSettings>,
    /// Bytes per block, with units (`16KiB`); overrides the configuration.
    #[arg(long, value_parser = bench::parse_bytes)]
    block_bytes: Option<u64>,
    /// Eviction policy of the primary tier (secondary tiers take theirs from the
    /// configuration, LRU by default).
    #[arg(long, ignore_case = true, value_parser = ["lru", "arc"])]
    policy: Option<String>,
    /// Requests to replay: of the synthetic workload, or the first N of the trace.
    #[arg(long)]
    requests: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

struct Bar {
    bar: ProgressBar,
    /// The signal that asked the run to stop, 0 for none.
    stop: Arc<AtomicUsize>,
}

impl Progress for Bar {
    fn update(&mut self, done: u64, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(done);
    }

    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Relaxed) != 0
    }
}

fn bench(args: BenchArgs, stop: Arc<AtomicUsize>) -> Result<(), BenchError> {
    let mut settings = BenchSettings::default();
    if let Some(path) = &args.config {
        FileSettings::read(path)?.apply(&mut settings, path)?;
    }
    if let Some(b) = args.cpu_bytes {
        settings.cpu_bytes = b;
    }
    if let Some(d) = &args.region_dir {
        settings.region_dir = d.clone();
    }
    if !args.tiers.is_empty() {
        settings.tiers = args.tiers.clone();
    }
    if let Some(b) = args.block_bytes {
        settings.block_bytes = usize::try_from(b).unwrap_or(usize::MAX);
    }
    if let Some(p) = &args.policy {
        settings.policy = bench::parse_policy(p).expect("clap checked the value");
    }
    settings.validate()?;
    if args.requests == Some(0) {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: "requests (--requests): must be at least 1".into(),
        });
    }
    let budget = bench::memory_budget();
    let requests = match &args.trace {
        Some(t) => {
            let limits = TraceLimits {
                max_requests: args.requests.unwrap_or(usize::MAX),
                max_memory_bytes: budget,
                ..TraceLimits::default()
            };
            bench::read_trace_with(t, limits)?
        }
        None => {
            let mut s = Synthetic::default();
            if let Some(n) = args.requests {
                s.requests = n;
            }
            s.check(budget)?;
            s.generate()
        }
    };
    let bar = ProgressBar::new(requests.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({eta} left)",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut progress = Bar { bar, stop };
    let report = bench::run(&settings, &requests, &mut progress);
    progress.bar.finish_and_clear();
    let report = report?;
    let out = if args.json {
        serde_json::to_string_pretty(&report).expect("the report serializes")
    } else {
        report.to_string()
    };
    #[allow(clippy::print_stdout)]
    {
        println!("{out}");
    }
    if report.wrong_blocks > 0 {
        return Err(BenchError::Wrong(report.wrong_blocks));
    }
    Ok(())
}

fn main() -> ExitCode {
    // Colour only for a person at a terminal who has not asked for none (NO_COLOR).
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
    let cli = Cli::parse();
    // SIGINT and SIGTERM ask the run to stop: it ends its jobs and removes its region and
    // temporary tiers, then exits with 128 + the signal's number. A second signal exits at
    // once, leaving them for the next run to sweep.
    let stop = Arc::new(AtomicUsize::new(0));
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Handlers run in the order registered: the exit checks `armed`, which the first
        // signal sets only after it.
        let registered =
            signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, armed.clone())
                .and_then(|_| signal_hook::flag::register(sig, armed.clone()))
                .and_then(|_| signal_hook::flag::register_usize(sig, stop.clone(), sig as usize));
        if let Err(e) = registered {
            tracing::warn!(error = %e, "no signal handler: an interrupted run leaves its files behind");
        }
    }
    let result = match cli.command {
        Command::Bench(args) => bench(args, stop.clone()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("kvtier: {e}");
            }
            match (&e, stop.load(Ordering::Relaxed)) {
                (BenchError::Interrupted { .. }, sig) if sig > 0 => ExitCode::from(128 + sig as u8),
                _ => ExitCode::FAILURE,
            }
        }
    }
}
