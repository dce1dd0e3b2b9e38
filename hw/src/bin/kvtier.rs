//! The `kvtier` command: `kvtier bench` replays a workload through real memory and disk tiers
//! and reports hit ratios, bandwidth and latency.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier_hw::bench::{self, BenchError, BenchSettings, FileSettings, Progress, Synthetic};

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
    /// A Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// A TOML or JSON configuration (cpu_bytes_to_use, block_size, bytes_per_token,
    /// eviction_policy, secondary_tiers = [{type = "file", path, capacity_bytes}]).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Bytes per block (overrides the configuration).
    #[arg(long)]
    block_bytes: Option<usize>,
    /// Eviction policy of every tier.
    #[arg(long, value_parser = ["lru", "arc"])]
    policy: Option<String>,
    /// Requests of the synthetic workload.
    #[arg(long)]
    requests: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

struct Bar(ProgressBar);

impl Progress for Bar {
    fn update(&mut self, done: u64, total: u64) {
        self.0.set_length(total);
        self.0.set_position(done);
    }
}

fn bench(args: BenchArgs) -> Result<(), BenchError> {
    let mut settings = BenchSettings::default();
    if let Some(path) = &args.config {
        FileSettings::read(path)?.apply(&mut settings, path)?;
    }
    if let Some(b) = args.block_bytes {
        settings.block_bytes = b;
    }
    if let Some(p) = &args.policy {
        settings.policy = bench::parse_policy(p).expect("clap checked the value");
    }
    settings.validate(args.config.as_deref().unwrap_or(Path::new("-")))?;
    let requests = match &args.trace {
        Some(t) => bench::read_trace(t)?,
        None => {
            let mut s = Synthetic::default();
            if let Some(n) = args.requests {
                s.requests = n;
            }
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
    let mut progress = Bar(bar);
    let report = bench::run(&settings, &requests, &mut progress)?;
    progress.0.finish_and_clear();
    let out = if args.json {
        serde_json::to_string_pretty(&report).expect("the report serializes")
    } else {
        report.to_string()
    };
    #[allow(clippy::print_stdout)]
    {
        println!("{out}");
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("kvtier: {e}");
            }
            ExitCode::FAILURE
        }
    }
}
