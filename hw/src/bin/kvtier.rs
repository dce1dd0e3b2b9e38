//! The `kvtier` command: `kvtier bench` replays a workload through real memory and disk tiers
//! and reports hit ratios, bandwidth and latency.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier_core::PolicyKind;
use kvtier_hw::bench::{
    self, BenchError, BenchSettings, FileSettings, NodeProgress, Progress, Request, Synthetic,
    TierSettings, TraceLimits,
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
    /// other fields are ignored), replayed in whole blocks as vLLM caches it.
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
    /// Directory of the primary region's shared-memory file (`/dev/shm`, for example).
    /// Without it the region is anonymous memory, which nothing outlives, not even a run
    /// that was killed.
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
    /// configuration, LRU by default). Several, comma-separated (`lru,arc,reuse`): a policy
    /// sweep, as with --fraction.
    #[arg(long, ignore_case = true, value_delimiter = ',', value_parser = ["lru", "arc", "reuse"])]
    policy: Vec<String>,
    /// A policy sweep: replay the workload through the core's primary alone (no IO) with
    /// vLLM 0.33's call sequence, for each --policy (default all three) at each capacity,
    /// given as fractions of the workload's distinct blocks (`0.025,0.05,0.1`; by default
    /// seven from 1 % to 50 %: 0.01,0.02,0.05,0.1,0.2,0.3,0.5), and print the hit ratios as
    /// a table beside Belady's optimum.
    #[arg(long, value_delimiter = ',', value_name = "F,..")]
    fraction: Vec<f64>,
    /// With a policy sweep: a secondary tier below the primary, its capacity a fraction of
    /// the distinct blocks (`0.25`); evictions cascade to it and its blocks are promoted back,
    /// every job ending at once, and the table shows the overall hit ratio.
    #[arg(long, value_name = "F")]
    tier_fraction: Option<f64>,
    /// The eviction policy of the sweep's secondary tier (--tier-fraction).
    #[arg(long, ignore_case = true, value_parser = ["lru", "arc"], default_value = "lru")]
    tier_policy: String,
    /// Make the sweep's secondary tier a victim tier that writes the primary's next N
    /// victims at each step's end (0: written when a store completes, as vLLM).
    #[arg(long, value_name = "N", default_value_t = 0)]
    tier_victims: u32,
    /// With a policy sweep: replay each cell N times, the keys named differently each time
    /// (the same blocks and requests). The reuse policy's filters and samples hash the keys,
    /// so one replay's figure is one draw among many; the table shows each cell's mean and
    /// its lowest and highest replay. LRU's replays agree (it never reads a key's hash).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    seeds: u32,
    /// Requests to replay: of the synthetic workload, or the first N of the trace.
    #[arg(long)]
    requests: Option<usize>,
    /// Replay each trace line's partial last block too, as if it were cached. By default a
    /// trace is replayed as vLLM caches it, whole blocks alone: a line whose prompt ends
    /// inside a block loses that block, and a line with no whole block is not replayed.
    #[arg(long)]
    partial_blocks: bool,
    /// Replay the workload across N kvtier processes (nodes) that share the configuration's
    /// Redis tier: each replays the requests of its conversations (dealt round-robin) through
    /// its own region and file tiers. The report shows each node's hits, the totals, and the
    /// hits on blocks another node stored.
    #[arg(long, default_value_t = 1, value_name = "N")]
    nodes: u32,
    /// This process is node I of --nodes N, started by the parent run (internal).
    #[arg(long, hide = true, value_name = "I", requires = "nodes")]
    node: Option<u32>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

impl BenchArgs {
    /// The command of node `node`: this executable, with this run's settings and workload.
    fn node_command(&self, program: &Path, node: u32) -> Process {
        // Every field, so that a new option cannot be forgotten here.
        let BenchArgs {
            trace,
            config,
            cpu_bytes,
            region_dir,
            tiers,
            block_bytes,
            policy,
            fraction: _,
            tier_fraction: _,
            tier_policy: _,
            tier_victims: _,
            seeds: _,
            requests,
            partial_blocks,
            nodes,
            node: _,
            json: _,
        } = self;
        let mut c = Process::new(program);
        c.arg("bench");
        if let Some(t) = trace {
            c.arg("--trace").arg(t);
        }
        if let Some(p) = config {
            c.arg("--config").arg(p);
        }
        if let Some(b) = cpu_bytes {
            c.arg("--cpu-bytes").arg(b.to_string());
        }
        if let Some(d) = region_dir {
            c.arg("--region-dir").arg(d);
        }
        for t in tiers {
            let mut spec = t.path.clone().unwrap_or_default().into_os_string();
            spec.push(format!(":{}", t.capacity_bytes));
            c.arg("--tier").arg(spec);
        }
        if let Some(b) = block_bytes {
            c.arg("--block-bytes").arg(b.to_string());
        }
        if let Some(p) = policy.first() {
            c.arg("--policy").arg(p);
        }
        if let Some(n) = requests {
            c.arg("--requests").arg(n.to_string());
        }
        if *partial_blocks {
            c.arg("--partial-blocks");
        }
        c.arg("--nodes").arg(nodes.to_string());
        c.arg("--node").arg(node.to_string());
        c
    }
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

    fn log(&mut self, line: &str) {
        #[allow(clippy::print_stderr)]
        self.bar.suspend(|| eprintln!("{line}"));
    }
}

fn bar(total: u64, stop: Arc<AtomicUsize>) -> Bar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({eta} left)",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    Bar { bar, stop }
}

/// Prints `report` (as JSON with `json`); a run that served `wrong` blocks is an error.
fn output(
    report: &(impl serde::Serialize + std::fmt::Display),
    json: bool,
    wrong: u64,
) -> Result<(), BenchError> {
    let text = if json {
        serde_json::to_string_pretty(report).expect("the report serializes")
    } else {
        report.to_string()
    };
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    if wrong > 0 {
        return Err(BenchError::Wrong(wrong));
    }
    Ok(())
}

fn settings(args: &BenchArgs) -> Result<BenchSettings, BenchError> {
    let mut settings = BenchSettings::default();
    if let Some(path) = &args.config {
        FileSettings::read(path)?.apply(&mut settings, path)?;
    }
    if let Some(b) = args.cpu_bytes {
        settings.cpu_bytes = b;
    }
    if let Some(d) = &args.region_dir {
        settings.region_dir = Some(d.clone());
    }
    if !args.tiers.is_empty() {
        settings.tiers = args.tiers.clone();
    }
    if let Some(b) = args.block_bytes {
        settings.block_bytes = usize::try_from(b).unwrap_or(usize::MAX);
    }
    if let Some(p) = args.policy.first() {
        settings.policy = bench::parse_policy(p).expect("clap checked the value");
    }
    settings.validate()?;
    if args.requests == Some(0) {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: "requests (--requests): must be at least 1".into(),
        });
    }
    Ok(settings)
}

/// The requests to replay: all of them, or with `node`, that node's share alone (a trace's
/// other requests are not kept).
fn workload(args: &BenchArgs, node: Option<u32>) -> Result<Vec<Request>, BenchError> {
    let budget = bench::memory_budget();
    match &args.trace {
        Some(t) => {
            let limits = TraceLimits {
                max_requests: args.requests.unwrap_or(usize::MAX),
                max_memory_bytes: budget,
                ..TraceLimits::default()
            };
            let node = node.map(|n| (n, args.nodes));
            bench::read_trace_replayed(t, limits, args.partial_blocks, node)
        }
        None => {
            let mut s = Synthetic::default();
            if let Some(n) = args.requests {
                s.requests = n;
            }
            // The parent checked the whole workload against the memory available before
            // its nodes started; a node would see what its siblings have taken since.
            if node.is_none() {
                s.check(budget)?;
            }
            let requests = s.generate();
            Ok(match node {
                Some(node) => bench::node_share(&requests, node, args.nodes),
                None => requests,
            })
        }
    }
}

fn bench(args: BenchArgs, stop: Arc<AtomicUsize>) -> Result<(), BenchError> {
    let settings = settings(&args)?;
    if let Some(node) = args.node {
        return node_run(&args, &settings, node, stop);
    }
    if !args.fraction.is_empty() || args.policy.len() > 1 || args.tier_fraction.is_some() {
        return sweep_run(&args, &workload(&args, None)?);
    }
    if args.seeds != 1 {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: "--seeds: replays of a policy sweep's cells, so only with --fraction, several --policy or --tier-fraction".into(),
        });
    }
    // The parent's check alone: a node would measure memory its siblings already took.
    settings.check_nodes(args.nodes)?;
    let requests = workload(&args, None)?;
    if args.nodes > 1 {
        return nodes_run(&args, &requests, stop);
    }
    let mut progress = bar(requests.len() as u64, stop);
    let report = bench::run(&settings, &requests, &mut progress);
    progress.bar.finish_and_clear();
    let report = report?;
    output(&report, args.json, report.wrong_blocks)
}

/// The sweep's capacities when none are given: from 1 % to 50 % of the distinct blocks, so
/// that a policy that wins at small capacities and loses at large ones shows both.
const DEFAULT_FRACTIONS: [f64; 7] = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5];

/// `--policy a,b --fraction x,y`: the policy sweep's table.
fn sweep_run(args: &BenchArgs, requests: &[Request]) -> Result<(), BenchError> {
    if args.nodes > 1 {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: "--nodes: a policy sweep replays the primary alone, on one node".into(),
        });
    }
    let policies: Vec<_> = if args.policy.is_empty() {
        vec![PolicyKind::Lru, PolicyKind::Arc, PolicyKind::Reuse]
    } else {
        let named = args.policy.iter();
        named
            .map(|p| bench::parse_policy(p).expect("clap checked the value"))
            .collect()
    };
    let fractions = if args.fraction.is_empty() {
        DEFAULT_FRACTIONS.to_vec()
    } else {
        args.fraction.clone()
    };
    let tier = args.tier_fraction.map(|fraction| bench::SweepTier {
        fraction,
        policy: bench::parse_policy(&args.tier_policy).expect("clap checked the value"),
        victim_lookahead: args.tier_victims,
    });
    let report = bench::sweep(requests, &policies, &fractions, tier, args.seeds)?;
    output(&report, args.json, 0)
}

/// The parent of a run of several nodes: starts them, prints their combined report.
fn nodes_run(
    args: &BenchArgs,
    requests: &[Request],
    stop: Arc<AtomicUsize>,
) -> Result<(), BenchError> {
    let nodes = args.nodes;
    let counts = bench::nodes_of(requests, nodes).into_iter().fold(
        vec![0usize; nodes as usize],
        |mut c, n| {
            c[n as usize] += 1;
            c
        },
    );
    if let Some(idle) = counts.iter().position(|&c| c == 0) {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: format!(
                "nodes (--nodes {nodes}): the workload's {} requests have fewer conversations than nodes (node {idle} would have none)",
                requests.len()
            ),
        });
    }
    let program = std::env::current_exe().map_err(|e| BenchError::Io {
        what: "find the kvtier executable",
        path: "kvtier".into(),
        source: e,
    })?;
    let mut progress = bar(requests.len() as u64, stop);
    let report = bench::run_nodes(nodes, &|i| args.node_command(&program, i), &mut progress);
    progress.bar.finish_and_clear();
    let report = report?;
    output(&report, args.json, report.total.wrong_blocks)
}

/// Node `node` of a run of several: replays its share, reports to the parent on stdout.
fn node_run(
    args: &BenchArgs,
    settings: &BenchSettings,
    node: u32,
    stop: Arc<AtomicUsize>,
) -> Result<(), BenchError> {
    bench::follow_parent()?;
    if node >= args.nodes {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: format!("node (--node): {node} is not below --nodes {}", args.nodes),
        });
    }
    let requests = workload(args, Some(node))?;
    let report = bench::run(
        &settings.for_node(node, args.nodes),
        &requests,
        &mut NodeProgress::new(stop),
    )?;
    bench::send_report(&report);
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
    // once, leaving them for the next run to sweep; not in a node of a run of several, whose
    // signals come from its parent (which forwards one) or from the parent's death (one per
    // thread of the parent that it is handed to as it dies).
    let Command::Bench(args) = &cli.command;
    let second_exits = args.node.is_none();
    let stop = Arc::new(AtomicUsize::new(0));
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Handlers run in the order registered: the exit checks `armed`, which the first
        // signal sets only after it.
        let exit = if second_exits {
            signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, armed.clone())
                .map(drop)
        } else {
            Ok(())
        };
        let registered = exit
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
