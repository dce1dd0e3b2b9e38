//! The worker side: one tensor-parallel rank's transfer handler.
//!
//! A rank's KV cache is a set of tensors; each KV cache group reads some of them, and a block
//! of a group is one page of each of its tensors (`base + block × stride`, `page` bytes). A
//! primary slot holds a chunk of `blocks_per_chunk` consecutive blocks of one group: in the
//! rank's sub-slot, the group's tensors follow one another, each with the chunk's pages in
//! order. The handler copies those pages between the tensors and its sub-slots of the shared
//! region, on a copy thread, so that `submit` never blocks.
//!
//! The tensors are given by address, in host memory or on one GPU. Host tensors are copied on
//! a copy thread of the handler's own. GPU tensors are copied by kvtier-hw's CUDA engine,
//! made at the first job: asynchronous copies on the engine's streams, each job ordered after
//! the work queued on the caller's compute stream (a store waits for the kernels that write
//! its blocks, a load for those that read the blocks it overwrites), its end learnt from an
//! event. The engine keeps the tensors alive and does not write a block while it is being
//! stored or read a block while it is being loaded; vLLM's connector keeps that rule for its
//! own handlers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel, sync_channel};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use kvtier_core::SlotId;
use kvtier_hw::{
    Completion, Completions, Cpus, CudaEngine, CudaStream, Direction, Layout, Piece, Queue, Region,
    TransferEngine, TransferId,
};

use crate::errors;

/// One tensor that a KV cache group reads.
#[derive(Clone, Copy, Debug)]
struct TensorRef {
    /// Address of block 0.
    base: usize,
    /// Blocks in the tensor.
    blocks: usize,
    /// Bytes from one block to the next (the padded page).
    stride: usize,
    /// Bytes of a block that are copied (the page without padding).
    page: usize,
    /// Where the chunk's pages of this tensor start in the sub-slot.
    at: usize,
}

impl TensorRef {
    /// Where `c`'s page of this tensor lies: its address in the engine's tensor, and its
    /// offset in the slot's sub-slot.
    fn place(&self, c: &PageCopy) -> (usize, usize) {
        (
            self.base + c.block * self.stride,
            self.at + c.index * self.page,
        )
    }
}

/// One page copy: a block of a group's tensors and its place in a slot.
#[derive(Clone, Copy, Debug)]
struct PageCopy {
    block: usize,
    group: usize,
    slot: u32,
    /// The block's index in its chunk.
    index: usize,
}

struct Job {
    id: i64,
    store: bool,
    copies: Vec<PageCopy>,
    /// A store's seal: set on each of its slots once every page is copied.
    seal: Option<u64>,
    submitted: Instant,
}

impl Job {
    /// Seals the job's slots for this rank: its copies are complete.
    fn seal(&self, region: &Region, rank: u16) -> Result<(), String> {
        let Some(value) = self.seal.filter(|_| self.store) else {
            return Ok(());
        };
        for c in &self.copies {
            region
                .set_seal(SlotId(c.slot), rank, value)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// A job's result: `(job_id, success, bytes, seconds)`.
type Finished = (i64, bool, u64, f64);

#[derive(Default)]
struct Done {
    running: BTreeSet<i64>,
    finished: Vec<Finished>,
    errors: BTreeMap<i64, String>,
}

impl Done {
    /// Keeps why `job` failed, and only the last [`KEPT_ERRORS`] such reasons.
    fn keep_error(&mut self, job: i64, error: String) {
        self.errors.insert(job, error);
        while self.errors.len() > KEPT_ERRORS {
            self.errors.pop_first();
        }
    }
}

/// How many failed jobs' reasons a handler keeps for `error`.
const KEPT_ERRORS: usize = 1024;

/// The least bytes of a job that each of its copy threads takes: starting a thread (tens of
/// microseconds) is a few percent of copying 4 MiB (about 0.5 ms at 9 GiB/s).
const SPLIT_BYTES: usize = 4 << 20;

/// The bytes of two parts of a job, or the first error.
fn sum(a: Result<u64, String>, b: Result<u64, String>) -> Result<u64, String> {
    Ok(a? + b?)
}

struct Shared {
    done: Mutex<Done>,
    changed: Condvar,
    region_path: PathBuf,
    layout: Layout,
    /// The sub-slot this handler copies to and from: its rank, or 0 in a replicated layout.
    rank: u16,
    /// A replicated layout: `(this rank, ranks)`. Every rank holds the same bytes, the slots
    /// hold one copy, and a store's block is written (and sealed) by rank `slot % ranks` only.
    store_share: Option<(u16, u16)>,
    attach_timeout: Duration,
    /// Attached at the first job that succeeds in attaching (a failed attach is tried again
    /// by the next job).
    region: Mutex<Option<Arc<Region>>>,
    groups: Vec<Vec<TensorRef>>,
    blocks_per_chunk: usize,
    /// Threads a host job's copies are split across (the copy thread and scoped helpers),
    /// at most one per [`SPLIT_BYTES`] of the job.
    copy_threads: usize,
    /// A pause after each page copy, for tests that kill a rank in the middle of a job.
    page_delay_us: AtomicU64,
    /// Set when the handler is dropped: queued jobs end failed without copying.
    stopping: AtomicBool,
}

impl Shared {
    /// The region, attached at the first job: the scheduler, which creates it, may start
    /// after the workers.
    fn region(&self) -> Result<Arc<Region>, String> {
        let mut region = self.region.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = region.as_ref() {
            return Ok(r.clone());
        }
        let r = Region::attach(&self.region_path, self.layout, self.attach_timeout, 1)
            .map(Arc::new)
            .map_err(|e| e.to_string())?;
        *region = Some(r.clone());
        Ok(r)
    }

    /// Whether the region is attached (the next [`Shared::region`] returns at once).
    fn attached(&self) -> bool {
        self.region
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn run(&self, job: &Job) -> Result<u64, String> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err("the handler was dropped before the job ran".into());
        }
        let region = self.region()?;
        let region = &region;
        let parts = self.parts(job);
        let bytes = if parts <= 1 {
            self.copy(region, &job.copies, job.store)?
        } else {
            let per = job.copies.len().div_ceil(parts);
            std::thread::scope(|s| {
                let mut chunks = job.copies.chunks(per);
                let mine = chunks.next().unwrap_or_default();
                let mut total = Ok(0u64);
                let mut helpers = Vec::with_capacity(parts - 1);
                for chunk in chunks {
                    // A thread that cannot start leaves its share to this one.
                    match std::thread::Builder::new()
                        .name("kvtier-copy".into())
                        .spawn_scoped(s, move || self.copy(region, chunk, job.store))
                    {
                        Ok(h) => helpers.push(h),
                        Err(_) => total = sum(total, self.copy(region, chunk, job.store)),
                    }
                }
                total = sum(total, self.copy(region, mine, job.store));
                for h in helpers {
                    let part = h.join().unwrap_or_else(|_| Err("a copy panicked".into()));
                    total = sum(total, part);
                }
                total
            })?
        };
        job.seal(region, self.rank)?;
        Ok(bytes)
    }

    /// How many threads copy `job`: [`copy_threads`](Self::copy_threads), but no more than one
    /// per [`SPLIT_BYTES`] of the job (a small job is not slowed by starting threads) nor than
    /// the CPUs this thread may run on (the helpers share its binding), and one when two of
    /// its pages would be written to the same place: two threads must never write the same
    /// bytes (a job naming a block twice, or groups sharing a tensor).
    fn parts(&self, job: &Job) -> usize {
        if self.copy_threads <= 1 {
            return 1;
        }
        let bytes: usize = job
            .copies
            .iter()
            .map(|c| self.groups[c.group].iter().map(|t| t.page).sum::<usize>())
            .sum();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let parts = (bytes / SPLIT_BYTES).clamp(1, self.copy_threads.min(cpus));
        if parts > 1 && !self.disjoint(job) {
            return 1;
        }
        parts
    }

    /// Whether no two pages of `job` are written to the same place: for a store a slot's
    /// sub-slot offset, for a load an address in the engine's tensors.
    fn disjoint(&self, job: &Job) -> bool {
        let mut targets: Vec<(u64, usize)> = Vec::with_capacity(job.copies.len());
        for c in &job.copies {
            for t in &self.groups[c.group] {
                let (addr, at) = t.place(c);
                targets.push(if job.store {
                    (u64::from(c.slot), at)
                } else {
                    (u64::MAX, addr)
                });
            }
        }
        targets.sort_unstable();
        targets.windows(2).all(|w| w[0] != w[1])
    }

    /// Copies the pages of `copies` between the engine's tensors and the region: into the
    /// region for a store, out of it for a load. Returns the bytes copied.
    fn copy(&self, region: &Region, copies: &[PageCopy], store: bool) -> Result<u64, String> {
        let mut bytes = 0u64;
        for c in copies {
            for t in &self.groups[c.group] {
                if c.block >= t.blocks {
                    return Err(format!(
                        "block {} is outside a KV tensor of {} blocks",
                        c.block, t.blocks
                    ));
                }
                let (addr, at) = t.place(c);
                if store {
                    // SAFETY: `addr..addr + page` lies in a live tensor of the engine (checked
                    // against its block count above; the Python handler holds the tensors),
                    // which does not write the block until the store is reported.
                    let src = unsafe { std::slice::from_raw_parts(addr as *const u8, t.page) };
                    region
                        .write_part(SlotId(c.slot), self.rank, at, src)
                        .map_err(|e| e.to_string())?;
                } else {
                    // SAFETY: as above; the engine neither reads nor writes the block until
                    // the load is reported, and a job is split across threads only when no
                    // two of its pages share an address (`disjoint`), so this is the only
                    // reference to those bytes.
                    let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, t.page) };
                    region
                        .read_part(SlotId(c.slot), self.rank, at, dst)
                        .map_err(|e| e.to_string())?;
                }
                bytes += t.page as u64;
                let delay = self.page_delay_us.load(Ordering::Relaxed);
                if delay > 0 {
                    std::thread::sleep(Duration::from_micros(delay));
                }
            }
        }
        Ok(bytes)
    }

    fn finish(&self, job: &Job, result: Result<u64, String>) {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        done.running.remove(&job.id);
        let secs = job.submitted.elapsed().as_secs_f64();
        match result {
            Ok(bytes) => done.finished.push((job.id, true, bytes, secs)),
            Err(e) => {
                tracing::debug!(job = job.id, error = %e, "transfer failed");
                done.finished.push((job.id, false, 0, secs));
                done.keep_error(job.id, e);
            }
        }
        self.changed.notify_all();
    }
}

/// The CUDA side of a handler whose tensors are on a GPU.
struct Gpu {
    ordinal: i32,
    /// Made at the first job (the region may not exist before).
    engine: Mutex<Option<CudaEngine>>,
    done: Completions,
    /// The jobs in flight on the engine (to seal a store's slots when it ends).
    jobs: Mutex<BTreeMap<i64, Job>>,
}

/// One rank's transfer handler.
#[pyclass(module = "kvtier._native", frozen)]
pub(crate) struct Worker {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    gpu: Option<Gpu>,
    /// The tensors the addresses point into, held until the copies have stopped (fields drop
    /// after `Drop::drop`, which stops them).
    _tensors: Vec<Py<PyAny>>,
}

#[pymethods]
impl Worker {
    /// A handler for rank `rank` of the region at `region_path` (`rows` slots, `workers`
    /// ranks, `block_bytes_per_worker` bytes of a slot per rank). In a replicated layout
    /// (every rank's KV bytes the same, vLLM's `replicated_layout`) the region has one part per
    /// slot: `workers` and `rank` are 1 and 0, and `store_share` is `(rank, ranks)`: this rank
    /// writes only the slots `s` with `s % ranks == rank`, and reads every slot. `groups` lists, per KV cache
    /// group, its tensors as `(address, blocks, stride, page)`. `copy_cpus` is where the copy
    /// thread runs: `"any"` CPU the process may use (not the binding of the engine's thread
    /// that calls this), `"inherit"` that binding, or a list such as `"2,4-7"`; a job of
    /// host tensors is split across up to `copy_threads` threads there (one per 4 MiB).
    #[new]
    #[pyo3(signature = (*, region_path, rows, workers, block_bytes_per_worker, rank, groups,
        blocks_per_chunk = 1, attach_timeout_s = 60.0, device = None, tensors = Vec::new(),
        copy_cpus = "any", copy_threads = 2, store_share = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        region_path: PathBuf,
        rows: u32,
        workers: u16,
        block_bytes_per_worker: usize,
        rank: u16,
        groups: Vec<Vec<(usize, usize, usize, usize)>>,
        blocks_per_chunk: usize,
        attach_timeout_s: f64,
        device: Option<i32>,
        tensors: Vec<Py<PyAny>>,
        copy_cpus: &str,
        copy_threads: usize,
        store_share: Option<(u16, u16)>,
    ) -> PyResult<Self> {
        if let Some((r, n)) = store_share
            && (n == 0 || r >= n)
        {
            return Err(errors::config(
                "rank",
                format!("rank {r} of a replicated layout of {n} ranks"),
            ));
        }
        let copy_cpus: Cpus = copy_cpus
            .parse()
            .map_err(|e| errors::config("copy_cpus", e))?;
        if device.is_some() && !kvtier_hw::cuda_driver_present() {
            return Err(errors::TransferError::new_err(
                "the KV cache is in GPU memory, but no CUDA driver library (libcuda) can be \
                 loaded on this machine",
            ));
        }
        let layout = Layout::new(rows, workers, block_bytes_per_worker)
            .map_err(|e| errors::config("cpu_bytes_to_use", e))?;
        if rank >= workers {
            return Err(errors::config(
                "rank",
                format!("rank {rank} of a region with {workers} ranks"),
            ));
        }
        if blocks_per_chunk == 0 {
            return Err(errors::config("blocks_per_chunk", "must be at least 1"));
        }
        if copy_threads == 0 {
            return Err(errors::config("copy_threads", "must be at least 1"));
        }
        let attach_timeout = Duration::try_from_secs_f64(attach_timeout_s).map_err(|_| {
            errors::config(
                "attach_timeout_s",
                "must be a non-negative number of seconds that a clock can hold",
            )
        })?;
        let mut refs = Vec::with_capacity(groups.len());
        for (g, tensors) in groups.iter().enumerate() {
            let mut at = 0usize;
            let mut group = Vec::with_capacity(tensors.len());
            for &(base, blocks, stride, page) in tensors {
                if base == 0 || page == 0 || stride < page {
                    return Err(errors::config(
                        "kv_caches",
                        format!(
                            "group {g}: a tensor needs an address and a page no larger than its stride"
                        ),
                    ));
                }
                blocks
                    .checked_mul(stride)
                    .and_then(|n| base.checked_add(n))
                    .ok_or_else(|| {
                        errors::config("kv_caches", "a tensor overflows the address space")
                    })?;
                group.push(TensorRef {
                    base,
                    blocks,
                    stride,
                    page,
                    at,
                });
                at += page * blocks_per_chunk;
            }
            if at > block_bytes_per_worker {
                return Err(errors::config(
                    "kv_caches",
                    format!(
                        "group {g} needs {at} bytes per chunk and rank, the region holds {block_bytes_per_worker}"
                    ),
                ));
            }
            refs.push(group);
        }
        let shared = Arc::new(Shared {
            done: Mutex::new(Done::default()),
            changed: Condvar::new(),
            region_path,
            layout,
            rank,
            store_share,
            attach_timeout,
            region: Mutex::new(None),
            stopping: AtomicBool::new(false),
            groups: refs,
            blocks_per_chunk,
            copy_threads,
            page_delay_us: AtomicU64::new(0),
        });
        let (tx, rx) = channel::<Job>();
        let (bound_tx, bound_rx) = sync_channel(1);
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvtier-rank-{rank}"))
            .spawn(move || {
                let bound = copy_cpus.apply_to_current_thread();
                let refused = bound.is_err();
                let _ = bound_tx.send(bound);
                if refused {
                    return;
                }
                while let Ok(job) = rx.recv() {
                    let result =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.run(&job)))
                            .unwrap_or_else(|_| Err("the copy panicked".into()));
                    s.finish(&job, result);
                }
            })
            .map_err(|e| {
                errors::TransferError::new_err(format!("cannot start a copy thread: {e}"))
            })?;
        match bound_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(errors::config("copy_cpus", e)),
            Err(_) => {
                return Err(errors::TransferError::new_err(
                    "the copy thread ended as it started",
                ));
            }
        }
        Ok(Worker {
            shared,
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            _tensors: tensors,
            gpu: device.map(|ordinal| Gpu {
                ordinal,
                engine: Mutex::new(None),
                done: Arc::new(Queue::new()),
                jobs: Mutex::new(BTreeMap::new()),
            }),
        })
    }

    /// Starts job `job_id`: a store (tensors → region) or a load (region → tensors).
    /// `block_ids`, `group_sizes` and `block_indices` are vLLM's `GPULoadStoreSpec`; `slots`
    /// are the slots of the chunks, group by group. For GPU tensors, `stream` is the compute
    /// stream the job is ordered after (a `CUstream` as an integer; 0 or none: the legacy
    /// default stream). A store's `seal` is set on each of its slots for this rank once all
    /// its pages are copied (the manager checks it before it makes the blocks readable).
    /// Answers whether the job was queued (never after `shutdown`); a job that was not never
    /// appears in `get_finished`.
    #[pyo3(signature = (job_id, store, block_ids, group_sizes, block_indices, slots, stream = None,
        seal = None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        job_id: i64,
        store: bool,
        block_ids: Vec<usize>,
        group_sizes: Vec<usize>,
        block_indices: Vec<usize>,
        slots: Vec<u32>,
        stream: Option<usize>,
        seal: Option<u64>,
    ) -> PyResult<bool> {
        let mut copies = self.plan(&block_ids, &group_sizes, &block_indices, &slots)?;
        if let Some((rank, ranks)) = self.shared.store_share.filter(|_| store) {
            // One copy per slot: its writer copies and seals it; the others hold the same
            // bytes and leave it alone.
            copies.retain(|c| c.slot % u32::from(ranks) == u32::from(rank));
        }
        let job = Job {
            id: job_id,
            store,
            copies,
            seal,
            submitted: Instant::now(),
        };
        // A GPU handler's first job that copies attaches the region, which may wait (up to
        // `attach_timeout_s`) for the scheduler to create it: without the GIL, so that the
        // worker's other Python threads run meanwhile, and before the sender's lock (which
        // `shutdown` takes holding the GIL). Once attached, the GIL is kept.
        let moves_bytes = !(store && job.copies.is_empty());
        let attached = match &self.gpu {
            Some(_)
                if moves_bytes
                    && !self.shared.attached()
                    && self
                        .jobs
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_some() =>
            {
                Some(py.detach(|| self.shared.region()))
            }
            _ => None,
        };
        // Held to the end of the submission: `shutdown` takes the sender first, so a job is
        // either queued before it (and waited for, and reported) or refused, on the GPU as on
        // the CPU (a GPU job after it would make a new engine, outliving the shutdown).
        let sender = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tx) = sender.as_ref() else {
            return Ok(false);
        };
        if store && job.copies.is_empty() {
            // Nothing of it is this rank's to write (a replicated layout's other writers).
            self.start(job_id)?;
            self.shared.finish(&job, Ok(0));
            return Ok(true);
        }
        if let Some(gpu) = &self.gpu {
            self.start(job_id)?;
            match attached {
                Some(Err(e)) => self.shared.finish(&job, Err(e)),
                _ => self.submit_gpu(gpu, job, stream.unwrap_or(0)),
            }
            return Ok(true);
        }
        self.start(job_id)?;
        if tx.send(job).is_err() {
            let mut done = self
                .shared
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            done.running.remove(&job_id);
            return Ok(false);
        }
        Ok(true)
    }

    /// The jobs that ended since the last call: `(job_id, success, bytes, seconds)`.
    fn get_finished(&self, py: Python<'_>) -> PyResult<Vec<Finished>> {
        self.poll_gpu();
        crate::log::flush(py)?;
        let mut done = self
            .shared
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(std::mem::take(&mut done.finished))
    }

    /// Why job `job_id` failed, if it did (kept until the handler shuts down).
    fn error(&self, job_id: i64) -> Option<String> {
        let done = self
            .shared
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        done.errors.get(&job_id).cloned()
    }

    /// Waits (GIL released) until none of `job_ids` is running.
    fn wait(&self, py: Python<'_>, job_ids: Vec<i64>) {
        py.detach(|| {
            let running = |ids: &[i64]| {
                let done = self
                    .shared
                    .done
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                ids.iter().any(|id| done.running.contains(id))
            };
            if self.gpu.is_some() {
                // The GPU's copies end by event: poll them.
                while {
                    self.poll_gpu();
                    running(&job_ids)
                } {
                    std::thread::sleep(Duration::from_micros(20));
                }
                return;
            }
            let mut done = self
                .shared
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            while job_ids.iter().any(|id| done.running.contains(id)) {
                done = self
                    .shared
                    .changed
                    .wait(done)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        });
    }

    /// Lets the queued and in-flight jobs finish (GIL released; `get_finished` reports them),
    /// stops the copy thread and drops the CUDA engine. Later jobs are refused.
    fn shutdown(&self, py: Python<'_>) {
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            py.detach(move || {
                let _ = t.join();
            });
        }
        if let Some(gpu) = &self.gpu {
            let engine = gpu
                .engine
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            let done = &gpu.done;
            py.detach(move || {
                if let Some(mut engine) = engine {
                    // The jobs in flight end before the engine goes, and are reported (below,
                    // and by `get_finished`): dropped with them in flight, they would stay
                    // running for ever, and `wait` for them would never return. A context
                    // that is gone ends them as failed at once.
                    while engine.poll(done) {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                    // Dropping the engine waits for its streams' copies.
                    drop(engine);
                }
            });
            self.poll_gpu();
        }
    }

    /// Pauses `micros` after each page copy from now on: for fault tests that need a rank to
    /// die in the middle of a job.
    #[doc(hidden)]
    fn _inject_page_delay(&self, micros: u64) {
        self.shared.page_delay_us.store(micros, Ordering::Relaxed);
    }

    /// Bytes of a chunk of each group in this rank's sub-slot.
    #[getter]
    fn chunk_bytes(&self) -> Vec<usize> {
        self.shared
            .groups
            .iter()
            .map(|g| g.iter().map(|t| t.page).sum::<usize>() * self.shared.blocks_per_chunk)
            .collect()
    }
}

impl Worker {
    /// Marks `job_id` running; a job id already running is refused.
    fn start(&self, job_id: i64) -> PyResult<()> {
        let mut done = self
            .shared
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !done.running.insert(job_id) {
            return Err(errors::TransferError::new_err(format!(
                "job {job_id} is already running"
            )));
        }
        Ok(())
    }

    /// Queues `job` on the GPU's engine, made at the first job; a job that cannot be queued
    /// ends failed.
    fn submit_gpu(&self, gpu: &Gpu, job: Job, stream: usize) {
        let shared = &self.shared;
        let pieces = match self.pieces(&job) {
            Ok(p) => p,
            Err(e) => return shared.finish(&job, Err(e)),
        };
        let mut engine = gpu.engine.lock().unwrap_or_else(PoisonError::into_inner);
        if engine.is_none() {
            let region = match shared.region() {
                Ok(r) => r,
                Err(e) => return shared.finish(&job, Err(e)),
            };
            let mut ranges: Vec<(u64, usize)> = shared
                .groups
                .iter()
                .flatten()
                .map(|t| (t.base as u64, t.blocks * t.stride))
                .collect();
            ranges.sort_unstable();
            ranges.dedup();
            // SAFETY: the ranges are the engine's KV tensors, which this handler holds (and so
            // keeps allocated) until it is dropped, after this engine.
            match unsafe { CudaEngine::with_ranges(region, shared.rank, gpu.ordinal, &ranges) } {
                Ok(e) => *engine = Some(e),
                Err(e) => return shared.finish(&job, Err(format!("CUDA: {e}"))),
            }
        }
        let engine = engine.as_mut().expect("made above");
        // SAFETY: the caller passes the stream its kernels run on, live while it submits.
        unsafe { engine.set_compute_stream(stream as CudaStream) };
        let direction = if job.store {
            Direction::ToRegion
        } else {
            Direction::ToDevice
        };
        let (id, at) = (job.id, TransferId(job.id as u64));
        // Known before it is queued: its end (and its seals) may be polled at once.
        let mut jobs = gpu.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.insert(id, job);
        if let Err(e) = engine.submit_pieces(at, direction, &pieces) {
            let job = jobs.remove(&id).expect("inserted above");
            drop(jobs);
            shared.finish(&job, Err(e.to_string()));
        }
    }

    /// The GPU pieces of `job`: each page of each of its blocks' tensors.
    fn pieces(&self, job: &Job) -> Result<Vec<Piece>, String> {
        let mut pieces = Vec::with_capacity(job.copies.len());
        for c in &job.copies {
            for t in &self.shared.groups[c.group] {
                if c.block >= t.blocks {
                    return Err(format!(
                        "block {} is outside a KV tensor of {} blocks",
                        c.block, t.blocks
                    ));
                }
                let (device, at) = t.place(c);
                pieces.push(Piece {
                    slot: SlotId(c.slot),
                    at,
                    device: device as u64,
                    len: t.page,
                });
            }
        }
        Ok(pieces)
    }

    /// Records the GPU jobs that ended.
    fn poll_gpu(&self) {
        let Some(gpu) = &self.gpu else {
            return;
        };
        if let Some(engine) = gpu
            .engine
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            engine.poll(&gpu.done);
        }
        let mut ended = Vec::new();
        gpu.done.drain_into(&mut ended);
        for c in ended {
            if let Completion::Transfer {
                id,
                result,
                bytes,
                elapsed,
                ..
            } = c
            {
                let job = id.0 as i64;
                let sealed = gpu
                    .jobs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&job)
                    .map(|j| match (&result, self.shared.region()) {
                        (Ok(()), Ok(region)) => j.seal(&region, self.shared.rank),
                        _ => Ok(()),
                    });
                let result = match sealed {
                    Some(Err(e)) => Err(kvtier_hw::EngineError::Gpu(format!("sealing: {e}"))),
                    _ => result,
                };
                let mut done = self
                    .shared
                    .done
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                done.running.remove(&job);
                match result {
                    Ok(()) => done
                        .finished
                        .push((job, true, bytes, elapsed.as_secs_f64())),
                    Err(e) => {
                        tracing::debug!(job, error = %e, "GPU transfer failed");
                        done.finished.push((job, false, 0, elapsed.as_secs_f64()));
                        done.keep_error(job, e.to_string());
                    }
                }
                self.shared.changed.notify_all();
            }
        }
    }

    /// The page copies of a job: each block of each group goes to its chunk's slot, at its
    /// index in the chunk (a group's first block may start inside a chunk).
    fn plan(
        &self,
        block_ids: &[usize],
        group_sizes: &[usize],
        block_indices: &[usize],
        slots: &[u32],
    ) -> PyResult<Vec<PageCopy>> {
        let bad = |m: String| errors::TransferError::new_err(m);
        let groups = self.shared.groups.len();
        if group_sizes.len() != block_indices.len() || group_sizes.len() > groups {
            return Err(bad(format!(
                "{} group sizes and {} block indices for {groups} KV cache groups",
                group_sizes.len(),
                block_indices.len()
            )));
        }
        if group_sizes
            .iter()
            .try_fold(0usize, |a, &n| a.checked_add(n))
            != Some(block_ids.len())
        {
            return Err(bad("the group sizes do not add up to the block ids".into()));
        }
        let bpc = self.shared.blocks_per_chunk;
        let mut copies = Vec::with_capacity(block_ids.len());
        let mut next_block = 0;
        let mut next_slot = 0;
        for (g, (&n, &first)) in group_sizes.iter().zip(block_indices).enumerate() {
            if n == 0 {
                continue;
            }
            let first_chunk = first / bpc;
            let last = first
                .checked_add(n - 1)
                .ok_or_else(|| bad(format!("block index {first} is too large")))?;
            let Some(ids) = block_ids.get(next_block..next_block + n) else {
                return Err(bad("the group sizes do not add up to the block ids".into()));
            };
            for (i, &block) in ids.iter().enumerate() {
                let logical = first + i;
                let slot_index = next_slot + logical / bpc - first_chunk;
                let Some(&slot) = slots.get(slot_index) else {
                    return Err(bad(format!(
                        "{} chunk slots for the blocks given",
                        slots.len()
                    )));
                };
                copies.push(PageCopy {
                    block,
                    group: g,
                    slot,
                    index: logical % bpc,
                });
            }
            next_block += n;
            next_slot += last / bpc - first_chunk + 1;
        }
        if next_slot != slots.len() {
            return Err(bad(format!(
                "{} chunk slots for {next_slot} chunks",
                slots.len()
            )));
        }
        Ok(copies)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Queued jobs end failed without copying; the one running finishes.
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = t.join();
        }
    }
}
