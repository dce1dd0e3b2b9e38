//! The driver: owns the core on one thread and carries its effects out.
//!
//! Every input goes to the core first; then every effect it produced is drained into the
//! transfer engine or a tier's IO threads. IO threads never touch the core: they push
//! [`Completion`]s onto one queue, which the driver drains and hands to the core. This is
//! quinn's connection driver and str0m's run loop, with jobs instead of packets.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::{
    Config, Effect, Event, Health, Job, JobKind, JobResult, Key, Lookup, Manager, Metrics, Outcome,
    PreparedStore, RequestId, SlotId, TierId, TierKind,
};

use crate::HwError;
use crate::engine::{
    BlockCopy, Completion, Completions, CopyJob, Direction, EngineError, TransferEngine,
    TransferId, WorkerEngine,
};
use crate::io::{JobPath, TierDone, TierIo};
use crate::metrics::{IoMetrics, Path, TierMetrics, TierTally};
use crate::queue::Queue;
use crate::region::Region;
use crate::store::SecondaryStore;

/// Driver settings beyond the core's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverOptions {
    /// IO threads per secondary tier (jobs of one tier run this many at a time).
    pub io_threads_per_tier: usize,
    /// How long `shutdown` waits for IO in flight before ending the remaining jobs as failed.
    pub shutdown_timeout: Duration,
    /// How many ended transfers' results are kept for [`Driver::wait`] (at least 1). A caller
    /// that never waits for some transfers does not make the driver grow: past this bound the
    /// result that ended first is dropped (never the one a `wait` is waiting for), and waiting
    /// for it answers [`HwError::ResultDropped`].
    pub kept_results: usize,
}

impl Default for DriverOptions {
    fn default() -> Self {
        DriverOptions {
            io_threads_per_tier: 4,
            shutdown_timeout: Duration::from_secs(30),
            kept_results: 4096,
        }
    }
}

struct PendingTransfer {
    request: RequestId,
    direction: Direction,
    keys: Vec<Key>,
}

/// What `shutdown` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Tier jobs and transfers that ended while shutting down (a store that ends meanwhile
    /// may start cascades, which count here too when they end in time).
    pub drained: u64,
    /// Core jobs ended as failed by the shutdown (never reported by their tier in time).
    pub ended_failed: u64,
    /// IO still in flight when the timeout passed: jobs running were left to finish alone,
    /// jobs still queued were dropped unrun.
    pub abandoned: u64,
}

/// Waits for a [`Driver`]'s next completion without borrowing the driver (see
/// [`Driver::waiter`]).
#[derive(Clone)]
pub struct Waiter(Completions);

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiter")
    }
}

impl Waiter {
    /// Waits up to `timeout` until a completion is queued for the driver (or the driver has
    /// shut down): whether one is. It is applied by the driver's next
    /// [`poll`](Driver::poll), [`end_step`](Driver::end_step) or other call.
    pub fn wait(&self, timeout: Duration) -> bool {
        self.0.wait_for_item(timeout)
    }
}

/// Owns a [`Manager`], the primary region, a transfer engine and the secondary tiers.
pub struct Driver {
    manager: Manager,
    region: Arc<Region>,
    engine: Box<dyn TransferEngine>,
    tiers: Vec<TierIo>,
    done: Completions,
    transfers: BTreeMap<TransferId, PendingTransfer>,
    finished: BTreeMap<TransferId, Result<(), EngineError>>,
    /// The ids in `finished`, in the order their transfers ended (some may be taken already).
    ended: VecDeque<TransferId>,
    /// The transfer a `wait` is waiting for: its result is never dropped.
    awaited: Option<TransferId>,
    next_transfer: u64,
    /// Tier jobs submitted and not yet ended, including the probes held in `probes`.
    jobs_in_flight: usize,
    /// Per tier, the existence probes of this step: they go to the tier together at the
    /// step's end (one round trip to a remote store), or as soon as anything waits for IO.
    probes: Vec<Vec<Job>>,
    /// Completions applied so far (transfers and tier jobs).
    applied: u64,
    options: DriverOptions,
    metrics: IoMetrics,
    /// Per tier, what ended since the last [`take_tier_metrics`](Self::take_tier_metrics).
    tallies: Vec<TierTally>,
    closed: bool,
    /// The core's clock (W1) is the milliseconds since this instant.
    started: Instant,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("region", &self.region)
            .field("engine", &self.engine.name())
            .field("tiers", &self.tiers.len())
            .field("transfers", &self.transfers.len())
            .field("jobs_in_flight", &self.jobs_in_flight)
            .finish()
    }
}

impl Driver {
    /// Starts a driver. `config.num_blocks` must equal the region's rows and `config.tiers`
    /// must describe `stores` one to one (capacity at most the store's). Each store's
    /// recovered blocks are restored into the core's index (★6); blocks that no longer fit
    /// are deleted.
    pub fn new(
        config: Config,
        region: Arc<Region>,
        engine: Box<dyn TransferEngine>,
        stores: Vec<Arc<dyn SecondaryStore>>,
        options: DriverOptions,
    ) -> Result<Self, HwError> {
        if options.kept_results == 0 {
            return Err(HwError::Setup(
                "kept_results must be at least 1: a transfer's result must outlive its end until wait takes it".into(),
            ));
        }
        if config.num_blocks != region.layout().rows {
            return Err(HwError::Setup(format!(
                "the core has {} primary slots but the region has {} rows",
                config.num_blocks,
                region.layout().rows
            )));
        }
        if config.tiers.len() != stores.len() {
            return Err(HwError::Setup(format!(
                "{} tiers configured for {} stores",
                config.tiers.len(),
                stores.len()
            )));
        }
        for (i, (t, s)) in config.tiers.iter().zip(&stores).enumerate() {
            if t.capacity_blocks > s.capacity_blocks() || t.kind != s.kind() {
                return Err(HwError::Setup(format!(
                    "tier {i} ({}) is configured as {:?} with {} blocks; the store is {:?} with {}",
                    s.name(),
                    t.kind,
                    t.capacity_blocks,
                    s.kind(),
                    s.capacity_blocks()
                )));
            }
        }
        let mut manager = Manager::new(config)?;
        for (i, s) in stores.iter().enumerate() {
            let rejected = manager.restore_tier(TierId(i as u16), s.recovered())?;
            // Blocks beyond the tier's capacity: an authoritative tier frees their room; a
            // shared one only forgets them (T14: other nodes may be reading them).
            if s.kind() == TierKind::Authoritative {
                for key in &rejected {
                    s.delete(key)?;
                }
            }
            tracing::info!(
                tier = i,
                name = s.name(),
                restored = manager.tier(TierId(i as u16)).map_or(0, |t| t.len()),
                rejected = rejected.len(),
                "tier restored"
            );
        }
        let done: Completions = Arc::new(Queue::new());
        let tiers = stores
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                TierIo::start(
                    TierId(i as u16),
                    s,
                    region.clone(),
                    done.clone(),
                    options.io_threads_per_tier,
                )
                .map_err(|e| HwError::Setup(format!("cannot start tier {i}'s IO threads: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let probes = (0..tiers.len()).map(|_| Vec::new()).collect();
        let tallies = (0..tiers.len()).map(|_| TierTally::default()).collect();
        Ok(Driver {
            manager,
            region,
            engine,
            tiers,
            done,
            transfers: BTreeMap::new(),
            finished: BTreeMap::new(),
            ended: VecDeque::new(),
            awaited: None,
            next_transfer: 0,
            jobs_in_flight: 0,
            probes,
            applied: 0,
            options,
            metrics: IoMetrics::default(),
            tallies,
            closed: false,
            started: Instant::now(),
        })
    }

    /// A driver for an inference engine's scheduler, whose own workers copy blocks between
    /// the GPU and the region (vLLM's process layout): the engine's calls go through
    /// [`prepare_store`](Self::prepare_store), [`complete_store`](Self::complete_store),
    /// [`prepare_load`](Self::prepare_load) and [`complete_load`](Self::complete_load), and
    /// the driver carries out only the secondary tiers' IO. [`store`](Self::store) and
    /// [`load`](Self::load) are refused with [`EngineError::NoEngine`].
    pub fn scheduler(
        config: Config,
        region: Arc<Region>,
        stores: Vec<Arc<dyn SecondaryStore>>,
        options: DriverOptions,
    ) -> Result<Self, HwError> {
        Self::new(config, region, Box::new(WorkerEngine), stores, options)
    }

    /// The core (read only: every change goes through the driver).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// The primary region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// A handle that waits for this driver's next completion without borrowing it: a caller
    /// that keeps the driver behind a lock of its own waits with that lock released, then
    /// applies what arrived. Existence probes held for the step's end go out only at
    /// [`end_step`](Self::end_step) (or a [`wait_any`](Self::wait_any)): end the step before
    /// waiting on them. An engine that must be polled (CUDA) is not polled while waiting.
    pub fn waiter(&self) -> Waiter {
        Waiter(self.done.clone())
    }

    /// IO counters and latencies so far.
    pub fn metrics(&self) -> &IoMetrics {
        &self.metrics
    }

    /// Per secondary tier, its gauges now and its counters since the previous call, with the
    /// latencies of the promotion jobs that ended meanwhile (an engine's metrics, taken once
    /// a step: vLLM's `get_stats`).
    pub fn take_tier_metrics(&mut self) -> Vec<TierMetrics> {
        let stats = self.manager.stats();
        let config = self.manager.config();
        stats
            .tiers
            .iter()
            .zip(&mut self.tallies)
            .zip(&config.tiers)
            .map(|(((health, now), tally), tc)| {
                tally.take(now, *health == Health::Up, u64::from(tc.capacity_blocks))
            })
            .collect()
    }

    /// Tier jobs and transfers in flight.
    pub fn in_flight(&self) -> usize {
        self.jobs_in_flight + self.transfers.len()
    }

    /// Looks up one block for `req` (M2–M4); a promotion or probe it starts is submitted at
    /// the end of the step. The core's clock is first set to the milliseconds since the
    /// driver started, so that [`Config::wait_deadline`] counts milliseconds (★9).
    pub fn lookup(&mut self, req: RequestId, key: &Key) -> Lookup {
        self.poll();
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.manager.set_clock(now);
        let answer = self.manager.lookup(req, key);
        self.pump();
        answer
    }

    /// Starts `req`'s record (R1; optional: any call naming `req` starts it).
    pub fn new_request(&mut self, req: RequestId) {
        self.manager.new_request(req);
    }

    /// The end-token position of `key` in `req` (R2): the request's blocks are ranked by it.
    pub fn set_position(&mut self, req: RequestId, key: &Key, end_token: u64) {
        self.manager.set_position(req, key, end_token);
    }

    /// `req` finished (R6): its accesses set the recency of its blocks. Every request must
    /// end with this call, or its record stays.
    pub fn request_finished(&mut self, req: RequestId) {
        self.manager.request_finished(req);
    }

    /// Recency update for blocks the engine used (M8).
    pub fn touch(&mut self, keys: &[Key]) {
        self.manager.touch(keys);
    }

    /// vLLM's `prepare_store` (P4–P7): absent keys get Pending slots for the engine's workers
    /// to fill; every returned key must later be passed to
    /// [`complete_store`](Self::complete_store).
    pub fn prepare_store(
        &mut self,
        req: RequestId,
        keys: &[Key],
    ) -> Result<PreparedStore, HwError> {
        self.poll();
        let prepared = self.manager.prepare_store(req, keys);
        self.pump();
        Ok(prepared?)
    }

    /// vLLM's `complete_store` (P8, P9, M6): the workers' copies of `keys` ended; if `ok`
    /// the blocks become Ready and cascade to the secondary tiers, else their slots go back.
    pub fn complete_store(&mut self, req: RequestId, keys: &[Key], ok: bool) {
        self.poll();
        self.manager.complete_store(req, keys, ok);
        self.pump();
    }

    /// vLLM's `prepare_load` (P11): pins Ready blocks for the workers to copy out and
    /// answers their slots; [`complete_load`](Self::complete_load) releases the pins.
    pub fn prepare_load(&mut self, req: RequestId, keys: &[Key]) -> Result<Vec<SlotId>, HwError> {
        Ok(self.manager.prepare_load(req, keys)?)
    }

    /// vLLM's `complete_load` (P13): the workers' copies of `keys` ended.
    pub fn complete_load(&mut self, keys: &[Key]) -> Result<(), HwError> {
        Ok(self.manager.complete_load(keys)?)
    }

    /// The core's events since the last call (P16).
    pub fn take_events(&mut self) -> Vec<Event> {
        self.manager.take_events()
    }

    /// The primary's gauges now and what accumulated since the previous call (vLLM's
    /// `get_stats`).
    pub fn take_metrics(&mut self) -> Metrics {
        self.manager.take_metrics()
    }

    /// Whether the engine must keep stepping: a tier job or transfer is in flight, or the
    /// core holds work for a step's end (vLLM's `has_pending_work`).
    pub fn has_pending_work(&self) -> bool {
        self.in_flight() > 0 || self.manager.has_pending_work()
    }

    /// vLLM's `reset_cache` (M12): waits up to `timeout` for the secondary tiers' IO in
    /// flight, then the primary forgets every block. Refused with the core's
    /// [`Error::Busy`](kvtier_core::Error::Busy) if IO is still running at the timeout; the
    /// state is then unchanged.
    pub fn reset_cache(&mut self, timeout: Duration) -> Result<(), HwError> {
        let deadline = Instant::now().checked_add(timeout);
        while self.in_flight() > 0 && deadline.is_none_or(|d| Instant::now() < d) {
            self.wait_any(Duration::from_millis(20));
        }
        self.poll();
        self.manager.reset_cache()?;
        self.pump();
        Ok(())
    }

    /// vLLM's `on_reset_flushed` (M14): the workers no longer write the slots the reset
    /// freed; promotions resume.
    pub fn reset_flushed(&mut self) {
        self.manager.reset_flushed();
    }

    /// Stores the blocks the model just computed: `blocks` pairs each key with its offset in
    /// device memory. Absent keys get Pending slots and are copied device → region; when the
    /// copy ends the core makes them Ready and cascades them (M6). Returns the transfer to
    /// wait for, or `None` when every key was already stored. The device bytes must stay as
    /// they are until then; the transfer's result is kept until [`wait`](Self::wait) takes it.
    pub fn store(
        &mut self,
        req: RequestId,
        blocks: &[(Key, usize)],
    ) -> Result<Option<TransferId>, HwError> {
        self.poll();
        let keys: Vec<Key> = blocks.iter().map(|(k, _)| k.clone()).collect();
        let prepared = self.manager.prepare_store(req, &keys)?;
        self.pump();
        if prepared.keys.is_empty() {
            return Ok(None);
        }
        let offsets: BTreeMap<&Key, usize> = blocks.iter().map(|(k, o)| (k, *o)).collect();
        let copies = prepared
            .keys
            .iter()
            .zip(&prepared.slots)
            .map(|(k, &slot)| BlockCopy {
                slot,
                device_offset: offsets[k],
            })
            .collect();
        let id = self.start(req, Direction::ToRegion, prepared.keys.clone(), copies);
        if let Err(e) = id {
            // P9: the Pending slots go back; nothing was stored.
            self.manager.complete_store(req, &prepared.keys, false);
            self.pump();
            return Err(e);
        }
        id.map(Some)
    }

    /// Loads Ready blocks to device memory (P11): pins them and copies region → device.
    /// The pins are released when the copy ends (P13); the transfer's result is kept until
    /// [`wait`](Self::wait) takes it.
    pub fn load(&mut self, req: RequestId, blocks: &[(Key, usize)]) -> Result<TransferId, HwError> {
        self.poll();
        let keys: Vec<Key> = blocks.iter().map(|(k, _)| k.clone()).collect();
        let slots = self.manager.prepare_load(req, &keys)?;
        let copies = slots
            .iter()
            .zip(blocks)
            .map(|(&slot, (_, o))| BlockCopy {
                slot,
                device_offset: *o,
            })
            .collect();
        let id = self.start(req, Direction::ToDevice, keys.clone(), copies);
        if id.is_err() {
            self.manager
                .complete_load(&keys)
                .expect("the pins just taken are released");
        }
        id
    }

    fn start(
        &mut self,
        request: RequestId,
        direction: Direction,
        keys: Vec<Key>,
        copies: Vec<BlockCopy>,
    ) -> Result<TransferId, HwError> {
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.engine.submit(
            CopyJob {
                id,
                direction,
                copies,
            },
            &self.done,
        )?;
        self.transfers.insert(
            id,
            PendingTransfer {
                request,
                direction,
                keys,
            },
        );
        Ok(id)
    }

    /// Waits until transfer `id` ends, applying every completion that arrives meanwhile, and
    /// takes its result. Only the last [`DriverOptions::kept_results`] results are kept.
    pub fn wait(&mut self, id: TransferId) -> Result<(), HwError> {
        self.awaited = Some(id);
        let result = loop {
            if let Some(r) = self.finished.remove(&id) {
                break r.map_err(HwError::from);
            }
            if !self.transfers.contains_key(&id) {
                break Err(if id.0 < self.next_transfer {
                    HwError::ResultDropped(id.0)
                } else {
                    HwError::Setup(format!("unknown transfer {}", id.0))
                });
            }
            self.wait_any(Duration::from_millis(100));
        };
        self.awaited = None;
        result
    }

    /// Results of ended transfers that nobody has waited for yet.
    pub fn kept_results(&self) -> usize {
        self.finished.len()
    }

    /// Applies every completion that has arrived, without waiting.
    pub fn poll(&mut self) {
        if self.in_flight() == 0 {
            return; // nothing can complete (and the queue's lock is not taken)
        }
        self.engine.poll(&self.done);
        let mut batch = Vec::new();
        self.done.drain_into(&mut batch);
        for c in batch {
            self.apply(c);
        }
    }

    /// Waits up to `timeout` for at least one completion and applies it (and every other
    /// one queued). Returns at once when nothing is in flight.
    pub fn wait_any(&mut self, timeout: Duration) {
        // Held probes would never end while waited for: they go now.
        self.flush_probes();
        if self.in_flight() == 0 {
            return;
        }
        let polling = self.engine.poll(&self.done);
        let wait = if polling {
            timeout.min(Duration::from_micros(50))
        } else {
            timeout
        };
        if let Some(c) = self.done.pop_timeout(wait) {
            self.apply(c);
        }
        self.poll();
    }

    fn apply(&mut self, c: Completion) {
        self.applied += 1;
        match c {
            Completion::Transfer {
                id,
                result,
                bytes,
                elapsed,
                service,
            } => {
                let Some(t) = self.transfers.remove(&id) else {
                    tracing::error!(transfer = id.0, "completion of an unknown transfer");
                    return;
                };
                let ok = result.is_ok();
                let path = match t.direction {
                    Direction::ToRegion => Path::Store,
                    Direction::ToDevice => Path::Load,
                };
                self.metrics
                    .record(path, ok, t.keys.len() as u64, bytes, elapsed, service);
                if let Err(e) = &result {
                    tracing::warn!(transfer = id.0, error = %e, "transfer failed");
                }
                match t.direction {
                    // P8/P9: Ready and cascaded, or back to free.
                    Direction::ToRegion => self.manager.complete_store(t.request, &t.keys, ok),
                    // P13: the load pins go, whatever the copy's outcome.
                    Direction::ToDevice => self
                        .manager
                        .complete_load(&t.keys)
                        .expect("a load's own pins are held until its completion"),
                }
                self.finished.insert(id, result);
                self.ended.push_back(id);
                self.drop_old_results();
                self.pump();
            }
            Completion::Tier(d) => self.apply_tier(d),
        }
    }

    /// Keeps at most `kept_results` results, dropping those that ended first, never the one
    /// being waited for.
    fn drop_old_results(&mut self) {
        let mut kept = None;
        while self.finished.len() > self.options.kept_results {
            let Some(old) = self.ended.pop_front() else {
                break;
            };
            if Some(old) == self.awaited {
                kept = Some(old);
            } else if self.finished.remove(&old).is_some() {
                tracing::debug!(transfer = old.0, "result nobody waited for dropped");
            }
        }
        if let Some(id) = kept {
            self.ended.push_front(id);
        }
        // Ids whose results `wait` already took stay in `ended` until here: drop them once
        // they outnumber the kept results, so the order stays as bounded as the results.
        if self.ended.len() > 2 * self.finished.len() + 16 {
            let finished = &self.finished;
            self.ended.retain(|id| finished.contains_key(id));
        }
    }

    fn apply_tier(&mut self, d: TierDone) {
        self.jobs_in_flight -= 1;
        // A probe's "not found" is an answer, and so is a shared store's "no longer held" for
        // a load's blocks (J6): an op failed only when a block did.
        let ok = d.error.is_none() && d.result.outcome != Outcome::Failed;
        let blocks = match &d.result.outcome {
            Outcome::Partial { succeeded, .. } => succeeded.len() as u64,
            _ => d.bytes / self.region.layout().row_bytes() as u64,
        };
        let path = match d.path {
            JobPath::Cascade => Path::Cascade,
            JobPath::Promote => Path::Promote,
            JobPath::Probe => Path::Probe,
        };
        self.metrics
            .record(path, ok, blocks, d.bytes, d.elapsed, d.service);
        if let Some(t) = self.tallies.get_mut(d.tier.index()) {
            t.record(path, ok, d.bytes, d.corrupt, d.elapsed);
        }
        if let Some(e) = &d.error {
            tracing::debug!(tier = %d.tier, job = %d.result.job, error = %e, "tier job failed");
        }
        if let Err(e) = self.manager.handle_job_result(d.result) {
            // Only a closed manager or a driver bug gets here; the core's state is unchanged.
            tracing::error!(error = %e, "tier job result refused");
        }
    }

    /// Drains every effect of the core into the engine and the tiers.
    fn pump(&mut self) {
        while let Some(effect) = self.manager.poll_effect() {
            match effect {
                Effect::Submit(job) if matches!(job.kind, JobKind::Exists { .. }) => {
                    self.probes[job.tier.index()].push(job);
                    self.jobs_in_flight += 1;
                }
                Effect::Submit(job) => {
                    let tier = job.tier;
                    match self.tiers[tier.index()].submit(job) {
                        Ok(()) => self.jobs_in_flight += 1,
                        Err(job) => {
                            let _ = self.manager.handle_job_result(JobResult {
                                job: job.id,
                                outcome: Outcome::Failed,
                            });
                        }
                    }
                }
                Effect::Delete { tier, keys } => {
                    let store = &self.tiers[tier.index()].store;
                    for key in &keys {
                        if let Err(e) = store.delete(key) {
                            tracing::warn!(%tier, %key, error = %e, "delete failed");
                        }
                    }
                }
            }
        }
    }

    /// Sends each tier the existence probes held this step, as one piece of work. Probes a
    /// stopped tier hands back end as failed.
    fn flush_probes(&mut self) {
        for t in 0..self.probes.len() {
            if self.probes[t].is_empty() {
                continue;
            }
            let probes = std::mem::take(&mut self.probes[t]);
            if let Err(refused) = self.tiers[t].submit_probes(probes) {
                self.jobs_in_flight -= refused.len();
                for job in refused {
                    let _ = self.manager.handle_job_result(JobResult {
                        job: job.id,
                        outcome: Outcome::Failed,
                    });
                }
            }
        }
    }

    /// Ends the step (M5): applies completions, submits the step's promotions and due probes,
    /// and the existence probes its lookups started.
    pub fn end_step(&mut self) {
        self.poll();
        self.manager.end_step();
        self.pump();
        self.flush_probes();
    }

    /// Waits for all IO in flight and applies it, ending steps so that promotions are
    /// submitted and results collected, until nothing is outstanding or `max_steps` passed.
    pub fn settle(&mut self, max_steps: u32) {
        for _ in 0..max_steps {
            while self.in_flight() > 0 {
                self.wait_any(Duration::from_millis(100));
            }
            self.end_step();
            if self.in_flight() == 0 && self.manager.outstanding_jobs().next().is_none() {
                return;
            }
        }
    }

    /// M10: waits (up to the configured timeout) for IO in flight, then ends every job the
    /// core still counts as failed and stops the IO threads. Nothing stored in a persistent
    /// tier is lost: its blocks are on disk and found at the next open.
    pub fn shutdown(mut self) -> ShutdownReport {
        self.shutdown_inner()
    }

    fn shutdown_inner(&mut self) -> ShutdownReport {
        if self.closed {
            return ShutdownReport::default();
        }
        self.closed = true;
        let applied = self.applied;
        // No deadline for a timeout too long to add to the clock: wait as long as it takes.
        let deadline = Instant::now().checked_add(self.options.shutdown_timeout);
        while self.in_flight() > 0 && deadline.is_none_or(|d| Instant::now() < d) {
            self.wait_any(Duration::from_millis(50));
        }
        let abandoned = self.in_flight() as u64;
        let ended_failed = self
            .manager
            .outstanding_jobs()
            .filter(|j| !self.manager.is_reported(j.id))
            .count() as u64;
        // Queued jobs are dropped before the core lets their slots go.
        let mut handles = Vec::new();
        for t in &mut self.tiers {
            handles.extend(t.stop());
        }
        self.manager.shutdown();
        self.done.close();
        if abandoned == 0 {
            for h in handles {
                let _ = h.join();
            }
        }
        let report = ShutdownReport {
            drained: self.applied - applied,
            ended_failed,
            abandoned,
        };
        tracing::info!(?report, "driver shut down");
        report
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.shutdown_inner();
    }
}
