//! The bench loop and its report.

use std::collections::{BTreeMap, BTreeSet};

use std::sync::Arc;
use std::time::Instant;

use kvtier_core::{BlockState, Config, Key, Lookup, PolicyKind, RequestId};
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::belady::optimal_hits;
use super::nodes::Tracked;
use super::settings::BenchSettings;
use super::temp::{TempTier, sweep_temporary_tiers};
use super::workload::Request;
use crate::{
    Driver, DriverOptions, FileOptions, FileStore, HostEngine, HostMemory, Layout, OpenReport,
    PathSummary, Region, SecondaryStore, TransferId, page_align,
};

/// Receives progress (requests finished) while the bench runs, and may stop it.
pub trait Progress {
    /// `done` of `total` requests have finished.
    fn update(&mut self, done: u64, total: u64);

    /// Whether the run should stop now (a signal came): it then ends every job, removes its
    /// region and temporary tiers, and answers [`BenchError::Interrupted`].
    fn stop_requested(&self) -> bool {
        false
    }

    /// A line for the person watching (a node's log line in a run of several nodes); by
    /// default, to stderr.
    fn log(&mut self, line: &str) {
        use std::io::Write;
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }
}

impl Progress for () {
    fn update(&mut self, _: u64, _: u64) {}
}

/// One secondary tier in the report.
#[derive(Clone, Debug, Serialize)]
pub struct TierReport {
    /// Its capacity in blocks.
    pub capacity_blocks: u32,
    /// Blocks it held at the end.
    pub blocks: u64,
    /// Promotions started from it.
    pub promotions: u64,
    /// Blocks cascaded into it.
    pub cascaded: u64,
    /// Blocks evicted from it.
    pub evictions: u64,
    /// Failed reads and writes.
    pub failures: u64,
    /// Cascades not started because the tier's queue was full (back-pressure): blocks that
    /// never reached the tier.
    pub skipped_backpressure: u64,
    /// Cascades not started because the tier was down.
    pub skipped_down: u64,
    /// Cascades not started because the tier had no evictable room.
    pub skipped_full: u64,
    /// Its health at the end.
    pub health: String,
    /// Blocks found on disk at start (a persistent tier reused from an earlier run).
    pub recovered: u64,
    /// Records dropped at open because they did not verify (torn or corrupt).
    pub dropped_at_open: u64,
    /// Its eviction policy.
    pub policy: String,
    /// `Some(n)`: a victim tier writing at least `n` ahead (rules V1–V4); `None`: every
    /// completed store is cascaded to it (vLLM's).
    pub victim_lookahead: Option<u32>,
    /// A victim tier: blocks the primary evicted before the tier held them (lost to the
    /// hierarchy).
    pub victims_missed: u64,
    /// "file", "redis" or "s3".
    pub kind: String,
    /// When its writes are made durable (a file tier's setting).
    pub fsync: String,
    /// Whether its IO bypasses the page cache (`O_DIRECT`).
    pub direct_io: bool,
}

impl TierReport {
    /// How the tier is written, for the report: a victim tier with the blocks it missed.
    fn admission_text(&self) -> String {
        match self.victim_lookahead {
            None => "cascade".into(),
            Some(n) => format!("victim, at least {n} ahead, {} missed", self.victims_missed),
        }
    }
}

/// What a bench run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Requests replayed.
    pub requests: u64,
    /// Block references (prompt blocks over all requests).
    pub blocks: u64,
    /// Distinct blocks.
    pub distinct_blocks: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Primary capacity in blocks.
    pub primary_blocks: u32,
    /// The primary's eviction policy.
    pub primary_policy: String,
    /// Blocks served from the primary at the first lookup.
    pub primary_hits: u64,
    /// Blocks served by a promotion from a secondary tier (the request waited for it).
    pub promoted_hits: u64,
    /// Blocks served after waiting for another request's store of them to end.
    pub pending_hits: u64,
    /// Promoted hits on blocks this process read from a shared tier and never wrote there
    /// itself: blocks another node (another process sharing the tier) stored.
    pub cross_node_hits: u64,
    /// Hit ratio of the primary (primary hits / blocks).
    pub primary_hit_ratio: f64,
    /// Hit ratio of the secondary tiers (promoted hits / blocks).
    pub secondary_hit_ratio: f64,
    /// Hits on blocks another request was storing (pending hits / blocks).
    pub pending_hit_ratio: f64,
    /// Overall hit ratio.
    pub hit_ratio: f64,
    /// Belady's optimum for a cache of the primary's capacity.
    pub optimal_primary_hit_ratio: f64,
    /// Belady's optimum for a cache of every tier's capacity together.
    pub optimal_hit_ratio: f64,
    /// Promotions from the secondary tiers.
    pub promotions: Promotions,
    /// Blocks evicted from the primary.
    pub primary_evictions: u64,
    /// Requests that stopped waiting for promotions and recomputed.
    pub gave_up_waiting: u64,
    /// Lookups answered Miss because their request had waited for the block past
    /// `hit_pending_timeout_ms` (★9, W3): a hung or slow tier's blocks computed instead.
    pub timed_out_waiting: u64,
    /// Stores refused for lack of primary room (recomputed next time).
    pub stores_refused: u64,
    /// Loaded blocks whose bytes differed from what was stored (must be 0).
    pub wrong_blocks: u64,
    /// Steps run.
    pub steps: u64,
    /// Per secondary tier.
    pub tiers: Vec<TierReport>,
    /// Per IO path.
    pub paths: Vec<PathSummary>,
    /// Wall time in seconds.
    pub wall_s: f64,
    /// Peak resident memory of the process in bytes (the region counts once touched).
    pub peak_rss_bytes: u64,
}

/// What became of the promotions a run started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promotions {
    /// Promotions started.
    pub started: u64,
    /// Promotions whose block reached the primary, verified.
    pub succeeded: u64,
    /// Promotions that failed (the block was recomputed).
    pub failed: u64,
    /// Promotions from a shared tier whose block the server no longer held (its memory
    /// policy evicted it, or it expired): recomputed, and no failure of the tier.
    #[serde(default)]
    pub missing: u64,
}

/// Tokens per block in the trace format (Mooncake's 512): a block's end-token position is its
/// index plus one, times this.
pub(super) const BLOCK_TOKENS: u64 = super::workload::TRACE_BLOCK_TOKENS;

pub(super) fn key(block: u64) -> Key {
    Key::new(&block.to_le_bytes())
}

/// A block's bytes: derived from its id, so a load can be checked against it.
fn fill(block: u64, out: &mut [u8]) {
    let mut x = block.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

struct Active {
    index: usize,
    id: RequestId,
    device_slot: usize,
    waited: u32,
    /// Blocks answered Retry, each with whether a promotion was what it waited for.
    retried: BTreeMap<u64, bool>,
}

pub(super) fn policy_name(p: PolicyKind) -> &'static str {
    match p {
        PolicyKind::Lru => "lru",
        PolicyKind::Arc => "arc",
        PolicyKind::Reuse => "reuse",
    }
}

fn peak_rss() -> u64 {
    super::proc_field("/proc/self/status", "VmHWM").map_or(0, |kib| kib * 1024)
}

/// Replays `requests` through a driver built from `settings`.
///
/// Per step, each request in flight looks up its prompt's blocks in order. A Retry (a
/// promotion started) makes it wait for the next step, up to `max_wait_steps`; then its hit
/// prefix is loaded to the device, the rest is "computed" (written to device memory) and
/// stored, and every loaded block is compared with what was stored.
pub fn run(
    settings: &BenchSettings,
    requests: &[Request],
    progress: &mut dyn Progress,
) -> Result<Report, BenchError> {
    settings.validate()?;
    if requests.is_empty() {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: "requests: the workload has none".into(),
        });
    }
    let start = Instant::now();
    let bb = settings.block_bytes;
    let row = page_align(bb);
    let rows = u32::try_from(settings.cpu_bytes / row as u64)
        .ok()
        .filter(|&r| r <= kvtier_core::MAX_BLOCKS)
        .ok_or_else(|| BenchError::Config {
            path: "-".into(),
            reason: "cpu_bytes_to_use: too many blocks for one region".into(),
        })?;
    let longest = requests
        .iter()
        .map(|r| r.blocks.len())
        .max()
        .unwrap_or(1)
        .max(1);
    if longest > rows as usize / 2 {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: format!(
                "cpu_bytes_to_use: a request of {longest} blocks needs a primary of at least {} blocks, it has {rows}",
                longest * 2
            ),
        });
    }
    let device_bytes = settings
        .batch
        .checked_mul(longest)
        .and_then(|n| n.checked_mul(bb))
        .unwrap_or(usize::MAX);
    // The requests, the bench's bookkeeping of them and the device stand-in share one budget.
    let request_bytes: u64 = requests
        .iter()
        .map(|r| super::workload::request_bytes(r.blocks.len()))
        .sum();
    let budget = super::memory_budget();
    let needed = request_bytes.saturating_add(device_bytes as u64);
    if needed > budget {
        return Err(BenchError::Config {
            path: "-".into(),
            reason: format!(
                "batch: {} requests in flight of up to {longest} blocks of {} need {} of device memory, and the {} requests {} more: more than the {} this machine can spare",
                settings.batch,
                super::fmt_bytes(bb as u64),
                super::approx_bytes(device_bytes as u64),
                requests.len(),
                super::approx_bytes(request_bytes),
                super::approx_bytes(budget)
            ),
        });
    }
    let region_bytes = u64::from(rows) * row as u64;
    if settings.region_in_memory() && region_bytes.saturating_add(needed) > 2 * budget {
        // A region in tmpfs, or anonymous, is memory: with the rest it must fit in what is
        // available.
        return Err(BenchError::Config {
            path: "-".into(),
            reason: format!(
                "cpu_bytes_to_use: a region of {} in {} (memory) with {} for requests and device needs more than the {} this machine has available",
                super::approx_bytes(region_bytes),
                settings.region_place(),
                super::approx_bytes(needed),
                super::approx_bytes(2 * budget)
            ),
        });
    }
    for path in sweep_temporary_tiers(&std::env::temp_dir()) {
        tracing::warn!(path = %path.display(), "removed the temporary tier of a run that died");
    }
    // An anonymous region leaves nothing to sweep.
    if let Some(dir) = &settings.region_dir {
        match Region::sweep(dir) {
            Ok(removed) => {
                for path in removed {
                    tracing::warn!(path = %path.display(), "removed what a run that died left of its region");
                }
            }
            // Creating the region sweeps again and reports what stops it.
            Err(e) => tracing::warn!(error = %e, "regions of dead runs not swept"),
        }
    }
    let region_path = settings.region_path(std::process::id());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let region = Arc::new(Region::create(
        &region_path,
        Layout::new(rows, 1, bb)?,
        threads,
    )?);
    let mut temp_dirs = Vec::new();
    let mut stores: Vec<Arc<dyn SecondaryStore>> = Vec::new();
    // The shared tiers, which remember what this process wrote to them and read from them.
    let mut shared: Vec<Arc<Tracked<Box<dyn SecondaryStore>>>> = Vec::new();
    let mut opened = Vec::new();
    let mut config = Config::new(rows);
    config.policy = settings.policy;
    config.events = false;
    config.wait_deadline = settings.hit_pending_timeout_ms;
    // The identity names the block size itself, not the page-aligned row: a tier of
    // 5000-byte blocks is not one of 6000-byte blocks, though both fill 8 KiB rows.
    let identity = format!("kvtier bench, {bb}-byte blocks");
    for t in &settings.tiers {
        if let Some(s) = &t.shared {
            let store = s.open(&identity, row, t.capacity_bytes)?;
            opened.push(OpenReport::default());
            config
                .tiers
                .push(t.tier_config(store.kind(), store.capacity_blocks()));
            let store = Arc::new(Tracked::new(store));
            shared.push(store.clone());
            stores.push(store);
            continue;
        }
        let dir = match &t.path {
            Some(p) => p.clone(),
            None => {
                let d = TempTier::new(&std::env::temp_dir())?;
                let p = d.path().to_path_buf();
                temp_dirs.push(d);
                p
            }
        };
        let options = FileOptions {
            identity: identity.clone(),
            fsync: t.fsync,
            ..FileOptions::default()
        };
        let store = FileStore::open_with(&dir, row, t.capacity_bytes, options)?;
        opened.push(store.open_report().clone());
        config
            .tiers
            .push(t.tier_config(store.kind(), store.capacity_blocks()));
        stores.push(Arc::new(store));
    }
    let device = Arc::new(HostMemory::new(device_bytes)?);
    let engine = HostEngine::new(region.clone(), device.clone(), 0, settings.copy_threads);
    let options = DriverOptions {
        io_threads_per_tier: settings.io_threads,
        ..DriverOptions::default()
    };
    let tier_capacity: u64 = config
        .tiers
        .iter()
        .map(|t| u64::from(t.capacity_blocks))
        .sum();
    let mut driver = Driver::new(config, region, Box::new(engine), stores, options)?;

    let total = requests.len() as u64;
    let mut next = 0usize;
    let mut active: Vec<Active> = Vec::new();
    let mut free_device: Vec<usize> = (0..settings.batch).rev().collect();
    let (mut primary_hits, mut promoted_hits, mut pending_hits) = (0u64, 0u64, 0u64);
    let mut cross_node_hits = 0u64;
    let (mut gave_up, mut refused, mut wrong, mut done) = (0u64, 0u64, 0u64, 0u64);
    let mut block = vec![0u8; bb];
    let mut expect = vec![0u8; bb];
    let mut steps = 0u64;
    // Blocks stored in this step, and every request's blocks in the order they were served.
    let mut stored_now: BTreeSet<u64> = BTreeSet::new();
    let mut served: Vec<u64> = Vec::with_capacity(requests.iter().map(|r| r.blocks.len()).sum());
    while next < requests.len() || !active.is_empty() {
        if progress.stop_requested() {
            // Dropping the driver ends every job; the region and temporary tiers go with it.
            return Err(BenchError::Interrupted { done, total });
        }
        while active.len() < settings.batch && next < requests.len() {
            // R2: each block's end-token position, as vLLM's scheduler records it.
            for (i, &b) in requests[next].blocks.iter().enumerate() {
                driver.set_position(
                    RequestId(next as u64),
                    &key(b),
                    (i as u64 + 1) * BLOCK_TOKENS,
                );
            }
            active.push(Active {
                index: next,
                id: RequestId(next as u64),
                device_slot: free_device.pop().expect("a device slot per active request"),
                waited: 0,
                retried: BTreeMap::new(),
            });
            next += 1;
        }
        // Each transfer with the blocks it loads (none for a store) and their device base.
        let mut transfers: Vec<(TransferId, &[u64], usize)> = Vec::new();
        stored_now.clear();
        let mut finished = Vec::new();
        for (ai, a) in active.iter_mut().enumerate() {
            let blocks = &requests[a.index].blocks;
            let mut hits = 0;
            let mut retry = false;
            // vLLM 0.33's scheduler: hits count up to the first other answer; the lookups go
            // on through HitPending and Retry answers (both defer the request) so that one
            // step starts every promotion the prefix needs (batched into one job per tier),
            // and stop at the first Miss.
            for &b in blocks {
                match driver.lookup(a.id, &key(b)) {
                    Lookup::Hit => {
                        hits += usize::from(!retry);
                        // Stored by another request this very step: whether its copy has
                        // ended yet (even in the middle of these lookups) is a matter of
                        // timing, so it is a hit on that store, now or when the request is
                        // served after its wait.
                        if stored_now.contains(&b) {
                            a.retried.entry(b).or_default();
                        }
                    }
                    Lookup::HitPending | Lookup::Retry => {
                        retry = true;
                        // Promoting: a promotion serves it. Pending: another request's store.
                        let promoting = matches!(
                            driver.manager().primary().state_of(&key(b)),
                            Some((_, BlockState::Promoting))
                        );
                        *a.retried.entry(b).or_default() |= promoting;
                    }
                    _ => break,
                }
            }
            if retry && a.waited < settings.max_wait_steps {
                a.waited += 1;
                continue;
            }
            gave_up += u64::from(retry);
            let base = a.device_slot * longest * bb;
            let loaded = &blocks[..hits];
            if !loaded.is_empty() {
                let keys: Vec<Key> = loaded.iter().map(|&b| key(b)).collect();
                let at: Vec<(Key, usize)> = keys
                    .iter()
                    .cloned()
                    .zip((0..).map(|i| base + i * bb))
                    .collect();
                transfers.push((driver.load(a.id, &at)?, loaded, base));
            }
            for b in &blocks[..hits] {
                match a.retried.get(b) {
                    Some(true) => {
                        promoted_hits += 1;
                        let k = key(*b);
                        cross_node_hits += u64::from(shared.iter().any(|s| s.take_foreign(&k)));
                    }
                    Some(false) => pending_hits += 1,
                    None => primary_hits += 1,
                }
            }
            let mut computed = Vec::with_capacity(blocks.len() - hits);
            for (i, &b) in blocks.iter().enumerate().skip(hits) {
                fill(b, &mut block);
                device.write(base + i * bb, &block)?;
                computed.push((key(b), base + i * bb));
                stored_now.insert(b);
            }
            served.extend_from_slice(blocks);
            match driver.store(a.id, &computed) {
                Ok(Some(t)) => transfers.push((t, &[], base)),
                Ok(None) => {}
                Err(crate::HwError::Core(kvtier_core::Error::NoRoom { .. })) => refused += 1,
                Err(e) => return Err(e.into()),
            }
            // R6: the request is done; its accesses set its blocks' recency.
            driver.request_finished(a.id);
            finished.push(ai);
        }
        for (t, loaded, base) in transfers {
            driver.wait(t)?;
            for (i, &b) in loaded.iter().enumerate() {
                device.read(base + i * bb, &mut block)?;
                fill(b, &mut expect);
                wrong += u64::from(block != expect);
            }
        }
        if finished.is_empty() {
            // Every request waits for promotions: idle until some IO ends, as an engine with
            // nothing to schedule would, instead of spinning through empty steps.
            driver.wait_any(std::time::Duration::from_millis(50));
        }
        for ai in finished.into_iter().rev() {
            let a = active.swap_remove(ai);
            free_device.push(a.device_slot);
            done += 1;
        }
        driver.end_step();
        steps += 1;
        if steps.is_multiple_of(16) {
            progress.update(done, total);
        }
    }
    if progress.stop_requested() {
        return Err(BenchError::Interrupted { done, total });
    }
    driver.settle(64);
    progress.update(done, total);
    let stats = driver.manager().stats();
    let metrics = driver.metrics().summary();
    let report_tiers = stats
        .tiers
        .iter()
        .enumerate()
        .map(|(i, (health, t))| TierReport {
            capacity_blocks: driver.manager().config().tiers[i].capacity_blocks,
            blocks: t.blocks,
            promotions: t.hits,
            cascaded: t.blocks_cascaded,
            evictions: t.evictions,
            failures: t.write_failures + t.read_failures,
            skipped_backpressure: t.skipped_backpressure,
            skipped_down: t.skipped_down,
            skipped_full: t.skipped_full,
            health: format!("{health:?}"),
            recovered: opened[i].recovered as u64,
            dropped_at_open: opened[i].corrupt as u64,
            policy: policy_name(settings.tiers[i].policy).into(),
            victim_lookahead: settings.tiers[i].victim_lookahead,
            victims_missed: t.victims_missed,
            kind: settings.tiers[i].kind().into(),
            fsync: settings.tiers[i].fsync.to_string(),
            direct_io: opened[i].direct_io,
        })
        .collect();
    driver.shutdown();
    drop(temp_dirs);

    // Belady over the blocks in the order they were served: requests that waited were
    // served after others, so this, not the trace's order, bounds what the run could hit.
    let refs = served;
    let distinct: BTreeSet<u64> = refs.iter().copied().collect();
    let n = refs.len().max(1) as f64;
    Ok(Report {
        requests: total,
        blocks: refs.len() as u64,
        distinct_blocks: distinct.len() as u64,
        block_bytes: bb as u64,
        primary_blocks: rows,
        primary_policy: policy_name(settings.policy).into(),
        primary_hits,
        promoted_hits,
        pending_hits,
        cross_node_hits,
        primary_hit_ratio: primary_hits as f64 / n,
        secondary_hit_ratio: promoted_hits as f64 / n,
        pending_hit_ratio: pending_hits as f64 / n,
        hit_ratio: (primary_hits + promoted_hits + pending_hits) as f64 / n,
        optimal_primary_hit_ratio: optimal_hits(&refs, rows as usize) as f64 / n,
        optimal_hit_ratio: optimal_hits(&refs, (u64::from(rows) + tier_capacity) as usize) as f64
            / n,
        promotions: Promotions {
            started: stats.promotions_started,
            succeeded: stats.promotions_succeeded,
            failed: stats.promotions_failed,
            missing: stats.promotions_missing,
        },
        primary_evictions: stats.evictions,
        gave_up_waiting: gave_up,
        timed_out_waiting: stats.wait_timeouts,
        stores_refused: refused,
        wrong_blocks: wrong,
        steps,
        tiers: report_tiers,
        paths: metrics,
        wall_s: start.elapsed().as_secs_f64(),
        peak_rss_bytes: peak_rss(),
    })
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        writeln!(
            f,
            "requests        {}   blocks {} ({} distinct, {} each)   steps {}",
            self.requests,
            self.blocks,
            self.distinct_blocks,
            super::fmt_bytes(self.block_bytes),
            self.steps
        )?;
        writeln!(
            f,
            "hit ratio       {} overall = {} primary + {} promoted from secondary tiers + {} stored by another request",
            pct(self.hit_ratio),
            pct(self.primary_hit_ratio),
            pct(self.secondary_hit_ratio),
            pct(self.pending_hit_ratio)
        )?;
        if self.tiers.iter().any(|t| t.kind != "file") {
            let hits = self.primary_hits + self.promoted_hits + self.pending_hits;
            writeln!(
                f,
                "cross-node      {} hits ({} of hits) promoted from blocks another node stored in the shared tier",
                self.cross_node_hits,
                pct(self.cross_node_hits as f64 / hits.max(1) as f64)
            )?;
        }
        writeln!(
            f,
            "optimum         {} with every tier's capacity, {} with the primary's alone (Belady, offline)",
            pct(self.optimal_hit_ratio),
            pct(self.optimal_primary_hit_ratio)
        )?;
        writeln!(
            f,
            "promotions      {} started, {} succeeded, {} failed, {} gone from the shared tier; {} requests gave up waiting, {} lookups timed out waiting",
            self.promotions.started,
            self.promotions.succeeded,
            self.promotions.failed,
            self.promotions.missing,
            self.gave_up_waiting,
            self.timed_out_waiting
        )?;
        writeln!(
            f,
            "primary         {} blocks, {}, {} evictions, {} stores refused",
            self.primary_blocks, self.primary_policy, self.primary_evictions, self.stores_refused
        )?;
        for (i, t) in self.tiers.iter().enumerate() {
            if t.kind != "file" {
                writeln!(
                    f,
                    "tier {i}          {} (shared), {} / {} blocks tracked here, {} ({}), {} cascaded, {} forgotten, {} failures, {}",
                    t.kind,
                    t.blocks,
                    t.capacity_blocks,
                    t.policy,
                    t.admission_text(),
                    t.cascaded,
                    t.evictions,
                    t.failures,
                    t.health,
                )?;
                writeln!(
                    f,
                    "                skipped cascades: {} back-pressure, {} tier down, {} tier full",
                    t.skipped_backpressure, t.skipped_down, t.skipped_full,
                )?;
                continue;
            }
            writeln!(
                f,
                "tier {i}          {} / {} blocks, {} ({}), fsync {}, {} cascaded, {} evictions, {} failures, {}, {}",
                t.blocks,
                t.capacity_blocks,
                t.policy,
                t.admission_text(),
                t.fsync,
                t.cascaded,
                t.evictions,
                t.failures,
                t.health,
                if t.direct_io { "O_DIRECT" } else { "buffered" }
            )?;
            writeln!(
                f,
                "                skipped cascades: {} back-pressure, {} tier down, {} tier full; at open: {} blocks found, {} records dropped",
                t.skipped_backpressure,
                t.skipped_down,
                t.skipped_full,
                t.recovered,
                t.dropped_at_open
            )?;
        }
        writeln!(
            f,
            "{:<20} {:>8} {:>7} {:>10} {:>9} {:>8} {:>8}",
            "path", "ops", "failed", "MiB", "GB/s/op", "p50 µs", "p99 µs"
        )?;
        for p in &self.paths {
            writeln!(
                f,
                "{:<20} {:>8} {:>7} {:>10.0} {:>9.2} {:>8} {:>8}",
                p.path,
                p.ops,
                p.failed,
                p.bytes as f64 / (1u64 << 20) as f64,
                p.gb_per_s,
                p.p50_us,
                p.p99_us
            )?;
        }
        writeln!(
            f,
            "verified        {} loaded blocks differed from what was stored",
            self.wrong_blocks
        )?;
        write!(
            f,
            "wall time       {:.1} s, peak RSS {} MiB",
            self.wall_s,
            self.peak_rss_bytes >> 20
        )
    }
}
