//! `kvtier bench`: replays a workload end to end through the driver (a shared region, the
//! host transfer engine, file tiers) and reports hit ratios against Belady's optimum, IO
//! bandwidth and latency per path; with `--nodes N`, across N processes sharing a tier
//! ([`run_nodes`]).

mod belady;
mod nodes;
mod run;
mod settings;
mod sweep;
mod temp;
mod workload;

use std::path::PathBuf;

pub use belady::optimal_hits;
pub use nodes::{
    Conversations, MAX_NODES, NodeProgress, NodeSummary, NodesReport, PARENT_ENV, STOP_GRACE,
    Tracked, conversations, follow_parent, node_share, nodes_of, run_nodes, send_report,
};
pub use run::{Progress, Promotions, Report, TierReport, run};
pub use settings::{
    BenchSettings, DEFAULT_VICTIM_LOOKAHEAD, FileSettings, FileTier, STORE_KINDS, SharedStore,
    TierSettings, check_store_keys, parse_bytes, parse_policy, tier_config, victim_lookahead,
};
pub use sweep::{SweepCell, SweepReport, SweepRow, SweepTier, sweep};
pub use temp::{TEMP_TIER_PREFIX, sweep_temporary_tiers};
pub use workload::{
    Request, Synthetic, TraceLimits, parse_trace, parse_trace_keeping, parse_trace_replayed,
    parse_trace_with, read_trace, read_trace_keeping, read_trace_replayed, read_trace_with,
};

/// An error of the bench: bad input, or the hardware layer failing.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A malformed trace line.
    #[error("{}:{line}: {reason}", path.display())]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// The line number (1-based; 0 for the file as a whole).
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A malformed or invalid configuration.
    #[error("{}", config_message(path, reason))]
    Config {
        /// The configuration file (or "-" for the settings as a whole: file and options).
        path: PathBuf,
        /// What is wrong, naming the field.
        reason: String,
    },
    /// A file could not be read.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The run was stopped (a signal) after `done` of `total` requests; every job is ended
    /// and the region and temporary tiers are removed as the run's parts are dropped.
    #[error("interrupted after {done} of {total} requests")]
    Interrupted {
        /// Requests finished.
        done: u64,
        /// Requests in the workload.
        total: u64,
    },
    /// Loaded blocks differed from what was stored: the run served wrong data.
    #[error("{0} loaded blocks differed from what was stored")]
    Wrong(u64),
    /// A node of a run of several (`--nodes`) failed.
    #[error("node {node} of {nodes} failed: {reason}")]
    Node {
        /// The node's index.
        node: u32,
        /// Nodes in the run.
        nodes: u32,
        /// How it ended.
        reason: String,
    },
    /// The hardware layer failed.
    #[error(transparent)]
    Hw(#[from] crate::HwError),
}

fn config_message(path: &std::path::Path, reason: &str) -> String {
    if path == std::path::Path::new("-") {
        format!("invalid settings: {reason}")
    } else {
        format!("config {}: {reason}", path.display())
    }
}

impl From<crate::RegionError> for BenchError {
    fn from(e: crate::RegionError) -> Self {
        BenchError::Hw(e.into())
    }
}

impl From<crate::StoreError> for BenchError {
    fn from(e: crate::StoreError) -> Self {
        BenchError::Hw(e.into())
    }
}

/// A field of a `/proc` file, in its first unit (`VmHWM` of `/proc/self/status` in KiB).
pub(crate) fn proc_field(file: &str, field: &str) -> Option<u64> {
    std::fs::read_to_string(file).ok().and_then(|s| {
        s.lines()
            .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
    })
}

/// Bytes of memory a bench run may plan to take for its requests and device memory: half of
/// what the system has available now (`MemAvailable`), or no bound where that is unknown.
pub fn memory_budget() -> u64 {
    proc_field("/proc/meminfo", "MemAvailable")
        .map_or(u64::MAX / 4, |kib| kib.saturating_mul(1024) / 2)
}

/// Whether files in `dir` live in memory (tmpfs, such as `/dev/shm`).
pub(crate) fn in_memory(dir: &std::path::Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];

/// A byte count, exactly: in the largest binary unit that divides it (`5000 B`, `4 KiB`,
/// `1536 MiB`).
pub fn fmt_bytes(n: u64) -> String {
    let mut unit = 0;
    let mut v = n;
    while unit + 1 < UNITS.len() && v >= 1024 && v.is_multiple_of(1024) {
        v /= 1024;
        unit += 1;
    }
    format!("{v} {}", UNITS[unit])
}

/// A byte count, rounded to one decimal in the largest binary unit below it (`11.5 GiB`).
pub fn approx_bytes(n: u64) -> String {
    let mut unit = 0;
    let mut v = n as f64;
    while unit + 1 < UNITS.len() && v >= 1024.0 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn byte_counts_read_exactly() {
        assert_eq!(super::fmt_bytes(5000), "5000 B");
        assert_eq!(super::fmt_bytes(4096), "4 KiB");
        assert_eq!(super::fmt_bytes(256 << 10), "256 KiB");
        assert_eq!(super::fmt_bytes(1536 << 20), "1536 MiB");
        assert_eq!(super::fmt_bytes(4 << 30), "4 GiB");
        assert_eq!(super::fmt_bytes((1 << 20) + 1), "1048577 B");
        assert_eq!(super::approx_bytes(23 << 29), "11.5 GiB");
        assert_eq!(super::approx_bytes(1000), "1000 B");
    }
}
