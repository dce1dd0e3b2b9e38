//! GPU ↔ CPU transfer engines: one trait, a host engine (here), a CUDA engine (`cuda` feature).
//!
//! A transfer is a batch of block copies between "device" memory (GPU memory, or a host
//! buffer standing in for it) and one worker's sub-slots of the primary region. Its end is
//! reported as data, a [`Completion`] on the driver's queue, exactly once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::SlotId;

use crate::queue::{Countdown, Queue};
use crate::region::{HostMemory, Region, RegionError};

/// Identifies one transfer of one driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferId(pub u64);

/// Which way a transfer copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Device → region: a store of freshly computed blocks.
    ToRegion,
    /// Region → device: a load of hit blocks.
    ToDevice,
}

/// One block's copy: a primary slot and where the block lives in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    /// The primary slot (the worker's sub-slot of its row).
    pub slot: SlotId,
    /// Byte offset of the block in device memory.
    pub device_offset: usize,
}

/// A batch of copies in one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyJob {
    /// Its id, echoed in the completion.
    pub id: TransferId,
    /// Which way.
    pub direction: Direction,
    /// The copies, each of the region's block bytes per worker.
    pub copies: Vec<BlockCopy>,
}

/// Why a transfer failed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A copy named memory outside the region or the device, or device memory in use.
    #[error("transfer refused: {0}")]
    Memory(#[from] RegionError),
    /// The engine has shut down.
    #[error("the transfer engine has stopped")]
    Stopped,
    /// The GPU driver reported an error, or is absent.
    #[error("GPU: {0}")]
    Gpu(String),
    /// A copy thread panicked; the transfer failed and the thread serves the next one.
    #[error("a copy thread panicked: {0}")]
    Panicked(String),
    /// The engine was asked to serve a worker the region has no sub-slots for.
    #[error("worker {worker} does not exist: the region has {workers} workers")]
    NoSuchWorker {
        /// The worker asked for.
        worker: u16,
        /// Workers of the region (valid workers are `0..workers`).
        workers: u16,
    },
    /// The driver has no engine: the inference engine's own workers copy its blocks
    /// ([`Driver::scheduler`](crate::Driver::scheduler)).
    #[error("this driver does no GPU transfers: the inference engine's workers copy its blocks")]
    NoEngine,
    /// The device memory given to a GPU engine is not memory it may copy to and from.
    #[error("device memory {base:#x}+{bytes}: {reason}")]
    DeviceMemory {
        /// Its first address.
        base: u64,
        /// Its length.
        bytes: usize,
        /// What is wrong with it.
        reason: String,
    },
}

/// The end of one piece of IO, pushed by IO threads (or engine polling) to the driver.
#[derive(Debug)]
pub enum Completion {
    /// A transfer ended.
    Transfer {
        /// Which.
        id: TransferId,
        /// Whether every copy succeeded.
        result: Result<(), EngineError>,
        /// Bytes copied.
        bytes: u64,
        /// From submission to end (its latency).
        elapsed: Duration,
        /// From the start of its copies to end (its service time).
        service: Duration,
    },
    /// A tier job ended.
    Tier(crate::io::TierDone),
}

/// The completion queue of one driver.
pub type Completions = Arc<Queue<Completion>>;

/// Moves blocks between device memory and the primary region.
pub trait TransferEngine: Send {
    /// A short name for reports ("host", "cuda").
    fn name(&self) -> &'static str;

    /// Starts `job`. Its completion arrives on `done` (pushed by the engine's threads) or
    /// from [`poll`](Self::poll).
    ///
    /// An `Err` means the job was refused and nothing of it was queued: no copy touches
    /// memory for it and no completion follows, so the caller may give back at once what it
    /// reserved for the job (a store's Pending slots, a load's pins). Once any copy of a job
    /// is queued, `submit` answers `Ok` even if a later step fails: the job then ends through
    /// its completion, as failed, and only once every copy queued for it has stopped
    /// touching memory.
    fn submit(&mut self, job: CopyJob, done: &Completions) -> Result<(), EngineError>;

    /// Pushes the completions of transfers that ended since the last call, for engines that
    /// learn of them by polling. Returns whether transfers are still in flight.
    fn poll(&mut self, done: &Completions) -> bool;
}

/// The engine of a driver whose GPU ↔ CPU copies are done elsewhere, by the inference
/// engine's workers ([`Driver::scheduler`](crate::Driver::scheduler)): it refuses every job.
pub(crate) struct WorkerEngine;

impl TransferEngine for WorkerEngine {
    fn name(&self) -> &'static str {
        "workers"
    }

    fn submit(&mut self, _job: CopyJob, _done: &Completions) -> Result<(), EngineError> {
        Err(EngineError::NoEngine)
    }

    fn poll(&mut self, _done: &Completions) -> bool {
        false
    }
}

/// One job shared by the copy threads that run its parts.
struct SharedJob {
    id: TransferId,
    direction: Direction,
    started: Instant,
    ranges: Vec<(usize, usize)>,
    parts: Countdown<PartEnd>,
    done: Completions,
}

/// How one part of a job ended.
struct PartEnd {
    result: Result<(), EngineError>,
    bytes: u64,
    begun: Instant,
}

type Task = (Arc<SharedJob>, Vec<BlockCopy>);

/// The host engine: device memory is a [`HostMemory`] buffer; each job's copies are split
/// across a pool of copy threads (like the channels of a DMA engine).
pub struct HostEngine {
    tasks: Arc<Queue<Task>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    region: Arc<Region>,
    device: Arc<HostMemory>,
    panics: Arc<AtomicU32>,
}

impl HostEngine {
    /// An engine copying between `device` and `worker`'s sub-slots of `region` on `threads`
    /// threads.
    pub fn new(region: Arc<Region>, device: Arc<HostMemory>, worker: u16, threads: usize) -> Self {
        let tasks: Arc<Queue<Task>> = Arc::new(Queue::new());
        let panics = Arc::new(AtomicU32::new(0));
        let threads = (0..threads.max(1))
            .map(|i| {
                let tasks = tasks.clone();
                let region = region.clone();
                let device = device.clone();
                let panics = panics.clone();
                std::thread::Builder::new()
                    .name(format!("kvtier-copy-{i}"))
                    .spawn(move || {
                        while let Some((job, copies)) = tasks.pop() {
                            run_part(&region, &device, worker, &job, &copies, &panics);
                        }
                    })
                    .expect("spawn copy thread")
            })
            .collect();
        HostEngine {
            tasks,
            threads,
            region,
            device,
            panics,
        }
    }

    /// Makes the next `parts` job parts panic in their copy thread, as a bug in a copy
    /// would: for fault tests of the rule that such a job still reports, as failed.
    #[doc(hidden)]
    pub fn inject_copy_panics(&self, parts: u32) {
        self.panics.store(parts, Ordering::SeqCst);
    }

    /// The device memory this engine copies to and from.
    pub fn device(&self) -> &Arc<HostMemory> {
        &self.device
    }
}

/// Copies one part of a job; the part that ends last reports the job (Q5).
fn run_part(
    region: &Region,
    device: &HostMemory,
    worker: u16,
    job: &SharedJob,
    copies: &[BlockCopy],
    panics: &AtomicU32,
) {
    let begun = Instant::now();
    let len = region.layout().block_bytes_per_worker;
    // A panic in a copy ends this part as failed: the job still reports exactly once, so its
    // Pending slots or load pins are released, and the thread serves the next job.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if panics
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("injected copy panic");
        }
        copy_part(region, device, worker, job.direction, copies, len)
    }))
    .unwrap_or_else(|p| Err(EngineError::Panicked(crate::io::panic_message(&*p))));
    let bytes = if result.is_ok() {
        (len * copies.len()) as u64
    } else {
        0
    };
    let Some(parts) = job.parts.finish(PartEnd {
        result,
        bytes,
        begun,
    }) else {
        return;
    };
    device.release(&job.ranges);
    let begun = parts.iter().map(|p| p.begun).min().unwrap_or(begun);
    let bytes = parts.iter().map(|p| p.bytes).sum();
    let result = match parts.into_iter().find_map(|p| p.result.err()) {
        Some(e) => Err(e),
        None => Ok(()),
    };
    // A closed queue means the driver is gone; nobody waits for it.
    let _ = job.done.push(Completion::Transfer {
        id: job.id,
        bytes: if result.is_ok() { bytes } else { 0 },
        result,
        elapsed: job.started.elapsed(),
        service: begun.elapsed(),
    });
}

/// Copies `copies` one after the other; stops at the first failure.
fn copy_part(
    region: &Region,
    device: &HostMemory,
    worker: u16,
    direction: Direction,
    copies: &[BlockCopy],
    len: usize,
) -> Result<(), EngineError> {
    for c in copies {
        // The job's claim on these device bytes (taken at submit) and the core's ownership of
        // the slot (Pending for a store, pinned for a load) make both sides exclusive; the
        // parts of one job copy disjoint blocks.
        match direction {
            Direction::ToRegion => device
                .with_claimed(c.device_offset, len, |src| {
                    region.write_sub(c.slot, worker, src)
                })
                .and_then(|r| r)?,
            Direction::ToDevice => device
                .with_claimed_mut(c.device_offset, len, |dst| {
                    region.read_sub(c.slot, worker, dst)
                })
                .and_then(|r| r)?,
        }
    }
    Ok(())
}

impl TransferEngine for HostEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    fn submit(&mut self, job: CopyJob, done: &Completions) -> Result<(), EngineError> {
        let len = self.region.layout().block_bytes_per_worker;
        let ranges: Vec<(usize, usize)> =
            job.copies.iter().map(|c| (c.device_offset, len)).collect();
        self.device.claim(&ranges)?;
        let parts = self.threads.len().min(job.copies.len()).max(1);
        let per = job.copies.len().div_ceil(parts).max(1);
        let mut chunks: Vec<Vec<BlockCopy>> =
            job.copies.chunks(per).map(<[BlockCopy]>::to_vec).collect();
        if chunks.is_empty() {
            chunks.push(Vec::new()); // an empty job still ends with a completion
        }
        let shared = Arc::new(SharedJob {
            id: job.id,
            direction: job.direction,
            started: Instant::now(),
            ranges,
            parts: Countdown::new(chunks.len()),
            done: done.clone(),
        });
        for chunk in chunks {
            if self.tasks.push((shared.clone(), chunk)).is_err() {
                // Only after `drop` closed the queue, before any part was queued.
                self.device.release(&shared.ranges);
                return Err(EngineError::Stopped);
            }
        }
        Ok(())
    }

    fn poll(&mut self, _done: &Completions) -> bool {
        false
    }
}

impl Drop for HostEngine {
    fn drop(&mut self) {
        self.tasks.close();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
