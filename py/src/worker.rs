//! The worker side: one tensor-parallel rank's transfer handler.
//!
//! A rank's KV cache is a set of tensors; each KV cache group reads some of them, and a block
//! of a group is one page of each of its tensors (`base + block × stride`, `page` bytes). A
//! primary slot holds a chunk of `blocks_per_chunk` consecutive blocks of one group: in the
//! rank's sub-slot, the group's tensors follow one another, each with the chunk's pages in
//! order. The handler copies those pages between the tensors and its sub-slots of the shared
//! region, on a copy thread, so that `submit` never blocks.
//!
//! Host memory only: the tensors are the engine's CPU buffers, given by address. The engine
//! keeps them alive and does not write a block while it is being stored or read a block while
//! it is being loaded; vLLM's connector keeps that rule for its own handlers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use kvtier_core::SlotId;
use kvtier_hw::{Layout, Region};

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
    submitted: Instant,
}

/// A job's result: `(job_id, success, bytes, seconds)`.
type Finished = (i64, bool, u64, f64);

#[derive(Default)]
struct Done {
    running: BTreeSet<i64>,
    finished: Vec<Finished>,
    errors: BTreeMap<i64, String>,
}

struct Shared {
    done: Mutex<Done>,
    changed: Condvar,
    region_path: PathBuf,
    layout: Layout,
    rank: u16,
    attach_timeout: Duration,
    region: OnceLock<Result<Arc<Region>, String>>,
    groups: Vec<Vec<TensorRef>>,
    blocks_per_chunk: usize,
    /// A pause after each page copy, for tests that kill a rank in the middle of a job.
    page_delay_us: AtomicU64,
}

impl Shared {
    /// The region, attached at the first job: the scheduler, which creates it, may start
    /// after the workers.
    fn region(&self) -> Result<&Arc<Region>, String> {
        self.region
            .get_or_init(|| {
                Region::attach(&self.region_path, self.layout, self.attach_timeout, 1)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    fn run(&self, job: &Job) -> Result<u64, String> {
        let region = self.region()?;
        let mut bytes = 0u64;
        for c in &job.copies {
            for t in &self.groups[c.group] {
                if c.block >= t.blocks {
                    return Err(format!(
                        "block {} is outside a KV tensor of {} blocks",
                        c.block, t.blocks
                    ));
                }
                let addr = t.base + c.block * t.stride;
                let at = t.at + c.index * t.page;
                if job.store {
                    // SAFETY: `addr..addr + page` lies in a live tensor of the engine (checked
                    // against its block count above; the Python handler holds the tensors),
                    // which does not write the block until the store is reported.
                    let src = unsafe { std::slice::from_raw_parts(addr as *const u8, t.page) };
                    region
                        .write_part(SlotId(c.slot), self.rank, at, src)
                        .map_err(|e| e.to_string())?;
                } else {
                    // SAFETY: as above; the engine neither reads nor writes the block until
                    // the load is reported, so this is the only reference to those bytes.
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
                tracing::warn!(job = job.id, error = %e, "transfer failed");
                done.finished.push((job.id, false, 0, secs));
                done.errors.insert(job.id, e);
            }
        }
        self.changed.notify_all();
    }
}

/// One rank's transfer handler (host memory).
#[pyclass(module = "kvtier._native", frozen)]
pub(crate) struct Worker {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[pymethods]
impl Worker {
    /// A handler for rank `rank` of the region at `region_path` (`rows` slots, `workers`
    /// ranks, `block_bytes_per_worker` bytes of a slot per rank). `groups` lists, per KV cache
    /// group, its tensors as `(address, blocks, stride, page)`.
    #[new]
    #[pyo3(signature = (*, region_path, rows, workers, block_bytes_per_worker, rank, groups,
        blocks_per_chunk = 1, attach_timeout_s = 60.0))]
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
    ) -> PyResult<Self> {
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
        if !(attach_timeout_s.is_finite() && attach_timeout_s >= 0.0) {
            return Err(errors::config("attach_timeout_s", "must be non-negative"));
        }
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
            attach_timeout: Duration::from_secs_f64(attach_timeout_s),
            region: OnceLock::new(),
            groups: refs,
            blocks_per_chunk,
            page_delay_us: AtomicU64::new(0),
        });
        let (tx, rx) = channel::<Job>();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvtier-rank-{rank}"))
            .spawn(move || {
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
        Ok(Worker {
            shared,
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Starts job `job_id`: a store (tensors → region) or a load (region → tensors).
    /// `block_ids`, `group_sizes` and `block_indices` are vLLM's `GPULoadStoreSpec`; `slots`
    /// are the slots of the chunks, group by group. Answers whether the job was queued; a job
    /// that was not never appears in `get_finished`.
    fn submit(
        &self,
        job_id: i64,
        store: bool,
        block_ids: Vec<usize>,
        group_sizes: Vec<usize>,
        block_indices: Vec<usize>,
        slots: Vec<u32>,
    ) -> PyResult<bool> {
        let copies = self.plan(&block_ids, &group_sizes, &block_indices, &slots)?;
        let sender = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tx) = sender.as_ref() else {
            return Ok(false);
        };
        {
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
        }
        let job = Job {
            id: job_id,
            store,
            copies,
            submitted: Instant::now(),
        };
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
    fn get_finished(&self) -> Vec<Finished> {
        let mut done = self
            .shared
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::take(&mut done.finished)
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

    /// Lets the queued jobs finish (GIL released) and stops the copy thread.
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
        if group_sizes.iter().sum::<usize>() != block_ids.len() {
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
            for i in 0..n {
                let logical = first + i;
                let slot_index = next_slot + logical / bpc - first_chunk;
                let Some(&slot) = slots.get(slot_index) else {
                    return Err(bad(format!(
                        "{} chunk slots for the blocks given",
                        slots.len()
                    )));
                };
                copies.push(PageCopy {
                    block: block_ids[next_block + i],
                    group: g,
                    slot,
                    index: logical % bpc,
                });
            }
            next_block += n;
            next_slot += (first + n - 1) / bpc - first_chunk + 1;
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
