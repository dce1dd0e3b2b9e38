//! IO counters and latencies per path, for the bench report.

use std::time::Duration;

use serde::Serialize;

/// Where bytes moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// Device → primary region (a store).
    Store,
    /// Primary region → device (a load).
    Load,
    /// Primary → secondary tier (a cascade job).
    Cascade,
    /// Secondary tier → primary (a promotion job).
    Promote,
    /// Existence and health probes.
    Probe,
}

impl Path {
    /// Every path, in report order.
    pub const ALL: [Path; 5] = [
        Path::Store,
        Path::Load,
        Path::Cascade,
        Path::Promote,
        Path::Probe,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Path::Store => "store gpu->cpu",
            Path::Load => "load cpu->gpu",
            Path::Cascade => "cascade cpu->tier",
            Path::Promote => "promote tier->cpu",
            Path::Probe => "probe",
        }
    }
}

/// Counters of one path.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PathMetrics {
    /// Jobs or transfers ended.
    pub ops: u64,
    /// Of those, how many failed (wholly or partly).
    pub failed: u64,
    /// Blocks moved successfully.
    pub blocks: u64,
    /// Bytes moved successfully.
    pub bytes: u64,
    /// Sum of every op's service time (from the start of its IO to its end).
    pub busy: Duration,
    latencies_us: Vec<u32>,
}

/// A summary of one path for reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PathSummary {
    /// The path's name.
    pub path: &'static str,
    /// Ops ended.
    pub ops: u64,
    /// Ops failed.
    pub failed: u64,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Bytes per second of service time: one op's rate, averaged over the bytes (GB = 1e9).
    pub gb_per_s: f64,
    /// Median op latency (submission to end, queueing included) in microseconds.
    pub p50_us: u32,
    /// 99th percentile op latency in microseconds.
    pub p99_us: u32,
}

impl PathMetrics {
    /// The `q`-quantile (0..=1) of op latency in microseconds.
    pub fn quantile_us(&self, q: f64) -> u32 {
        if self.latencies_us.is_empty() {
            return 0;
        }
        let mut v = self.latencies_us.clone();
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        *v.select_nth_unstable(i).1
    }
}

/// Counters of every path.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IoMetrics {
    paths: [PathMetrics; 5],
}

impl IoMetrics {
    /// Records one op's end.
    /// `elapsed` is its latency (submission to end), `service` its time doing IO.
    pub fn record(
        &mut self,
        path: Path,
        ok: bool,
        blocks: u64,
        bytes: u64,
        elapsed: Duration,
        service: Duration,
    ) {
        let m = &mut self.paths[path as usize];
        m.ops += 1;
        m.failed += u64::from(!ok);
        m.blocks += blocks;
        m.bytes += bytes;
        m.busy += service;
        m.latencies_us
            .push(elapsed.as_micros().min(u128::from(u32::MAX)) as u32);
    }

    /// The counters of `path`.
    pub fn path(&self, path: Path) -> &PathMetrics {
        &self.paths[path as usize]
    }

    /// A summary of every path.
    pub fn summary(&self) -> Vec<PathSummary> {
        Path::ALL
            .iter()
            .map(|&p| {
                let m = self.path(p);
                let secs = m.busy.as_secs_f64();
                PathSummary {
                    path: p.name(),
                    ops: m.ops,
                    failed: m.failed,
                    blocks: m.blocks,
                    bytes: m.bytes,
                    gb_per_s: if secs > 0.0 {
                        m.bytes as f64 / secs / 1e9
                    } else {
                        0.0
                    },
                    p50_us: m.quantile_us(0.5),
                    p99_us: m.quantile_us(0.99),
                }
            })
            .collect()
    }
}
