//! `kvtier bench`: replays a workload end to end through the driver (a shared region, the
//! host transfer engine, file tiers) and reports hit ratios against Belady's optimum, IO
//! bandwidth and latency per path.

mod belady;
mod run;
mod settings;
mod workload;

use std::path::PathBuf;

pub use belady::optimal_hits;
pub use run::{Progress, Report, TierReport, run};
pub use settings::{BenchSettings, FileSettings, FileTier, TierSettings, parse_policy};
pub use workload::{Request, Synthetic, parse_trace, read_trace};

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
    #[error("config {}: {reason}", path.display())]
    Config {
        /// The configuration file (or "-" for options).
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
    /// The hardware layer failed.
    #[error(transparent)]
    Hw(#[from] crate::HwError),
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
