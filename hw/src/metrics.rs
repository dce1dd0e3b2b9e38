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

/// Promotion latencies one tier keeps between two [`Driver::take_tier_metrics`] calls; the
/// ones past it are not kept (the counters still count their promotions). An engine takes
/// them once a step, and a step ends far fewer promotion jobs than this.
///
/// [`Driver::take_tier_metrics`]: crate::Driver::take_tier_metrics
pub const PROMOTION_LATENCIES_KEPT: usize = 4096;

/// One secondary tier's figures for an engine's metrics (vLLM's `get_stats`): gauges as they
/// are now, counters as increments since the previous take.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierMetrics {
    /// Gauge: blocks the tier can hold.
    pub capacity_blocks: u64,
    /// Gauge: blocks held or being written.
    pub blocks: u64,
    /// Gauge: whether the tier is Up (lookups and cascades use it).
    pub up: bool,
    /// Cascade jobs submitted.
    pub cascade_jobs: u64,
    /// Blocks those jobs set out to write.
    pub blocks_cascaded: u64,
    /// Bytes cascade jobs wrote successfully.
    pub bytes_written: u64,
    /// Promotions started from the tier (lookups that found the block there).
    pub promotions: u64,
    /// Bytes promotion jobs read successfully.
    pub bytes_read: u64,
    /// Cascaded blocks skipped by the back-pressure bound.
    pub skipped_backpressure: u64,
    /// Cascaded blocks skipped because the tier was not Up.
    pub skipped_down: u64,
    /// Cascaded blocks skipped because no room could be made.
    pub skipped_full: u64,
    /// Blocks evicted from the tier.
    pub evictions: u64,
    /// Jobs that ended with at least one failed block.
    pub jobs_failed: u64,
    /// Blocks whose write failed.
    pub write_failures: u64,
    /// Blocks whose read failed (verification failures included).
    pub read_failures: u64,
    /// Blocks whose read failed verification (what was read is not what was written).
    pub verification_failures: u64,
    /// Blocks a promotion found gone from a shared store (evicted or expired there).
    pub read_missing: u64,
    /// A victim tier: blocks the primary evicted before this tier held them (V3).
    pub victims_missed: u64,
    /// Promotion jobs ended: whether each succeeded and its latency in seconds, from its
    /// submission to the tier to its end (queueing included); at most
    /// [`PROMOTION_LATENCIES_KEPT`].
    pub promotion_latencies: Vec<(bool, f64)>,
}

/// What the driver tallies per tier between two takes, beyond the core's counters.
#[derive(Clone, Debug, Default)]
pub(crate) struct TierTally {
    /// The core's counters at the previous take.
    pub(crate) taken: kvtier_core::TierStats,
    pub(crate) bytes_written: u64,
    pub(crate) bytes_read: u64,
    pub(crate) verification_failures: u64,
    pub(crate) promotion_latencies: Vec<(bool, f64)>,
}

impl TierTally {
    /// Records one tier job's end.
    pub(crate) fn record(
        &mut self,
        path: Path,
        ok: bool,
        bytes: u64,
        corrupt: u64,
        elapsed: Duration,
    ) {
        self.verification_failures += corrupt;
        match path {
            Path::Cascade => self.bytes_written += bytes,
            Path::Promote => {
                self.bytes_read += bytes;
                if self.promotion_latencies.len() < PROMOTION_LATENCIES_KEPT {
                    self.promotion_latencies.push((ok, elapsed.as_secs_f64()));
                }
            }
            _ => {}
        }
    }

    /// The figures since the previous take, given the core's counters and gauges now; starts
    /// the next interval.
    pub(crate) fn take(
        &mut self,
        now: &kvtier_core::TierStats,
        up: bool,
        capacity_blocks: u64,
    ) -> TierMetrics {
        let was = std::mem::replace(&mut self.taken, now.clone());
        // The core's counters only grow; saturating keeps a surprise from wrapping.
        let d = |now: u64, was: u64| now.saturating_sub(was);
        TierMetrics {
            capacity_blocks,
            blocks: now.blocks,
            up,
            cascade_jobs: d(now.cascades_submitted, was.cascades_submitted),
            blocks_cascaded: d(now.blocks_cascaded, was.blocks_cascaded),
            bytes_written: std::mem::take(&mut self.bytes_written),
            promotions: d(now.hits, was.hits),
            bytes_read: std::mem::take(&mut self.bytes_read),
            skipped_backpressure: d(now.skipped_backpressure, was.skipped_backpressure),
            skipped_down: d(now.skipped_down, was.skipped_down),
            skipped_full: d(now.skipped_full, was.skipped_full),
            evictions: d(now.evictions, was.evictions),
            jobs_failed: d(now.jobs_failed, was.jobs_failed),
            write_failures: d(now.write_failures, was.write_failures),
            read_failures: d(now.read_failures, was.read_failures),
            verification_failures: std::mem::take(&mut self.verification_failures),
            read_missing: d(now.read_missing, was.read_missing),
            victims_missed: d(now.victims_missed, was.victims_missed),
            promotion_latencies: std::mem::take(&mut self.promotion_latencies),
        }
    }
}
