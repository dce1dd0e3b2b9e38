//! The CUDA transfer engine (feature `cuda`): the region is registered as pinned host memory,
//! copies are asynchronous on one stream per direction, each transfer ends with an event, and
//! completion is learnt by polling the events. A transfer's blocks that are adjacent both in
//! the region and on the device are merged into one copy, and its copies go to the driver in
//! one `cuMemcpyBatchAsync` call where the driver has it (CUDA 12.8 and later); otherwise,
//! and for good once a batch has failed, one `cuMemcpyAsync` per copy.
//!
//! Every transfer is ordered after the work queued on the inference engine's compute stream
//! when it is submitted ([`CudaEngine::set_compute_stream`]). A transfer whose copies were
//! queued ends only through [`poll`](TransferEngine::poll), once they have run, even when a
//! later driver call failed: `submit` answers `Err` only when nothing was queued.
//!
//! The CUDA driver library is loaded at run time: this builds without a CUDA toolkit, and
//! [`CudaEngine::new`] answers a clear error on a machine without a GPU driver. Every driver
//! call goes through a small internal trait, so that the tests can run the engine on a fake
//! driver that fails any chosen call.

mod api;
#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use crate::engine::{
    BlockCopy, Completion, Completions, CopyJob, Direction, EngineError, TransferEngine, TransferId,
};
use crate::region::{Region, RegionError};
use api::Api;
use kvtier_core::SlotId;

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; it calls nothing in it.
    unsafe { sys::is_culib_present() }
}

/// A driver error as an engine error. The error's name is enough to say what happened, and
/// naming it needs no call into the driver.
fn gpu(what: &str, e: DriverError) -> EngineError {
    EngineError::Gpu(format!("{what}: {:?}", e.0))
}

/// The checks of [`CudaEngine::new`] that need no driver: `worker` is one of the region's,
/// and the device ranges are non-empty, do not overflow and do not overlap. Answers the
/// ranges sorted by address.
fn check_arguments(
    region: &Region,
    worker: u16,
    ranges: &[(u64, usize)],
) -> Result<Vec<(u64, usize)>, EngineError> {
    let workers = region.layout().workers;
    if worker >= workers {
        return Err(EngineError::NoSuchWorker { worker, workers });
    }
    if ranges.is_empty() {
        return Err(EngineError::DeviceMemory {
            base: 0,
            bytes: 0,
            reason: "an engine needs device memory, and no range was given".into(),
        });
    }
    for &(base, bytes) in ranges {
        let refuse = |reason: &str| EngineError::DeviceMemory {
            base,
            bytes,
            reason: reason.into(),
        };
        if bytes == 0 {
            return Err(refuse(
                "an engine needs device memory, and this range has no bytes",
            ));
        }
        if base.checked_add(bytes as u64).is_none() {
            return Err(refuse("the range runs past the end of the address space"));
        }
    }
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    for w in sorted.windows(2) {
        let ((a, n), (b, m)) = (w[0], w[1]);
        if a + n as u64 > b {
            return Err(EngineError::DeviceMemory {
                base: b,
                bytes: m,
                reason: format!("the range overlaps the range {a:#x}+{n}"),
            });
        }
    }
    Ok(sorted)
}

/// Checks with the driver that `base..base + bytes` is device memory of GPU `ordinal`: every
/// byte in one of its allocations, none of them host or managed memory.
fn check_device_memory(
    api: &dyn Api,
    ordinal: i32,
    base: u64,
    bytes: usize,
) -> Result<(), EngineError> {
    let refuse = |reason: String| EngineError::DeviceMemory {
        base,
        bytes,
        reason,
    };
    let end = base + bytes as u64; // checked by `check_arguments`
    let mut at = base;
    while at < end {
        let a = api.pointer(at).map_err(|e| {
            refuse(format!(
                "address {at:#x} is not in any allocation of the CUDA driver ({:?})",
                e.0
            ))
        })?;
        if !a.device_memory {
            return Err(refuse(format!(
                "address {at:#x} is not device memory (host memory the driver knows of)"
            )));
        }
        if a.managed {
            return Err(refuse(format!(
                "address {at:#x} is managed memory, which the CPU reaches too; give the engine device memory"
            )));
        }
        if a.ordinal != ordinal {
            return Err(refuse(format!(
                "address {at:#x} is memory of GPU {}, not of GPU {ordinal}",
                a.ordinal
            )));
        }
        let next = a.base.saturating_add(a.bytes as u64);
        if next <= at {
            return Err(refuse(format!(
                "the driver describes address {at:#x} as an allocation that ends before it"
            )));
        }
        at = next;
    }
    Ok(())
}

/// The most copies handed to one `cuMemcpyBatchAsync` call (two in the unit tests, so that
/// their transfers of three copies take two calls).
const BATCH_MAX: usize = if cfg!(test) { 2 } else { 4096 };

/// `copies` (`(region offset, device address, bytes)`) with each run of copies that are
/// adjacent on both sides (the next starts where the last ended, in the region and on the
/// device) merged into one. Blocks of consecutive slots and consecutive device blocks are
/// then one copy, whichever way they were listed.
fn coalesce(copies: &[(usize, sys::CUdeviceptr, usize)]) -> Vec<(usize, sys::CUdeviceptr, usize)> {
    let mut out: Vec<(usize, sys::CUdeviceptr, usize)> = Vec::with_capacity(copies.len());
    for &(host, dptr, len) in copies {
        if let Some(last) = out.last_mut()
            && last.0 + last.2 == host
            && last.1 + last.2 as u64 == dptr
        {
            last.2 += len;
            continue;
        }
        out.push((host, dptr, len));
    }
    out
}

/// Whether two of `copies` write overlapping bytes (region bytes for a copy to the region,
/// device bytes for a copy to the device).
fn destinations_overlap(copies: &[(usize, sys::CUdeviceptr, usize)], direction: Direction) -> bool {
    let mut ranges: Vec<(u64, u64)> = copies
        .iter()
        .map(|&(host, dptr, len)| {
            let start = match direction {
                Direction::ToRegion => host as u64,
                Direction::ToDevice => dptr,
            };
            (start, start + len as u64)
        })
        .collect();
    ranges.sort_unstable();
    ranges.windows(2).any(|w| w[1].0 < w[0].1)
}

/// A retained primary context, released when the last holder drops it.
struct Retained {
    api: Arc<dyn Api>,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a context handle is a plain identifier, valid on any thread; it is only used after
// being pushed current on the calling thread (`enter`).
unsafe impl Send for Retained {}
// SAFETY: as above; `Retained` has no interior mutability.
unsafe impl Sync for Retained {}

impl Retained {
    fn new(api: Arc<dyn Api>, dev: sys::CUdevice) -> Result<Arc<Self>, EngineError> {
        // SAFETY: `dev` was returned by the driver.
        let ctx =
            unsafe { api.retain_primary(dev) }.map_err(|e| gpu("cuDevicePrimaryCtxRetain", e))?;
        Ok(Arc::new(Retained { api, dev, ctx }))
    }

    /// Makes the context current on this thread, above whatever context the caller had,
    /// until the guard is dropped.
    fn enter(&self) -> Result<Current, EngineError> {
        self.try_enter().map_err(|e| gpu("cuCtxPushCurrent", e))
    }

    /// [`enter`](Self::enter), answering the driver's error.
    fn try_enter(&self) -> Result<Current, DriverError> {
        // SAFETY: `self.ctx` is retained until `self` drops.
        unsafe { self.api.push(self.ctx) }?;
        Ok(Current {
            api: self.api.clone(),
        })
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: this retain is the holder's own, and nothing uses the context through it
        // any more.
        if let Err(e) = unsafe { self.api.release_primary(self.dev) } {
            tracing::warn!(error = ?e.0, "releasing the CUDA primary context failed");
        }
    }
}

/// The engine's context made current; dropping it makes the caller's current again.
struct Current {
    api: Arc<dyn Api>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if let Err(e) = self.api.pop() {
            tracing::warn!(error = ?e.0, "restoring the caller's CUDA context failed");
        }
    }
}

/// The process's registrations of host memory with the driver, by start address. A range
/// can be registered only once per process, and every engine over it needs it registered:
/// the first engine registers it, the last one to go unregisters it.
static REGISTRY: Mutex<BTreeMap<usize, Registered>> = Mutex::new(BTreeMap::new());

struct Registered {
    len: usize,
    engines: usize,
    /// The context the range was registered in, kept to unregister it.
    ctx: Arc<Retained>,
}

fn registry() -> std::sync::MutexGuard<'static, BTreeMap<usize, Registered>> {
    // The map is consistent at every unlock: a panic cannot leave it half changed.
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why the region at `path` may not be pinnable, where its filesystem explains it: Linux (6.5
/// and later) refuses to pin writable shared mappings of files for DMA unless they need no
/// writeback (tmpfs, hugetlbfs, ramfs). An anonymous region (`@NAME`, a memfd) is always
/// pinnable.
fn unpinnable(path: &std::path::Path) -> Option<String> {
    use nix::sys::statfs::{FsType, HUGETLBFS_MAGIC, TMPFS_MAGIC, statfs};
    const RAMFS_MAGIC: FsType = FsType(0x8584_58f6);
    if path.as_os_str().as_encoded_bytes().starts_with(b"@") {
        return None;
    }
    let fs = statfs(path).ok()?.filesystem_type();
    (![TMPFS_MAGIC, HUGETLBFS_MAGIC, RAMFS_MAGIC].contains(&fs)).then(|| {
        format!(
            "the region's file {} is not on tmpfs, hugetlbfs or ramfs, which may be why: Linux 6.5 and \
             later refuse to pin shared file mappings of other filesystems for DMA; put the \
             region under /dev/shm, or use an anonymous region",
            path.display()
        )
    })
}

/// One engine's share of the registration of its region as pinned host memory.
struct Registration {
    region: Arc<Region>,
}

impl Registration {
    fn acquire(region: &Arc<Region>, ctx: &Arc<Retained>) -> Result<Self, EngineError> {
        let (ptr, len) = region.raw_parts();
        let mut registry = registry();
        match registry.get_mut(&ptr.addr()) {
            Some(r) if r.len == len => r.engines += 1,
            Some(r) => {
                return Err(EngineError::Gpu(format!(
                    "the region's memory at {ptr:p} is registered with {} bytes, not {len}",
                    r.len
                )));
            }
            None => {
                let _current = ctx.enter()?;
                // SAFETY: `ptr..ptr + len` is the region's live mapping, kept alive by the
                // `Arc` every `Registration` holds until the last one unregisters it.
                unsafe { ctx.api.register(ptr, len) }.map_err(|e| {
                    let why = (e.0 == sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE)
                        .then(|| unpinnable(region.path()))
                        .flatten();
                    let mut error = gpu("cuMemHostRegister (pinning the region)", e);
                    if let (EngineError::Gpu(message), Some(why)) = (&mut error, why) {
                        message.push_str(": ");
                        message.push_str(&why);
                    }
                    error
                })?;
                registry.insert(
                    ptr.addr(),
                    Registered {
                        len,
                        engines: 1,
                        ctx: ctx.clone(),
                    },
                );
            }
        }
        Ok(Registration {
            region: region.clone(),
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let ptr = self.region.raw_parts().0;
        let mut registry = registry();
        let Some(r) = registry.get_mut(&ptr.addr()) else {
            return;
        };
        r.engines -= 1;
        if r.engines > 0 {
            return;
        }
        let r = registry.remove(&ptr.addr()).expect("just found");
        match r.ctx.enter() {
            Ok(_current) => {
                // SAFETY: every engine that copied to or from the region has dropped its
                // share, each after its streams drained: no queued copy uses the range.
                if let Err(e) = unsafe { r.ctx.api.unregister(ptr) } {
                    tracing::warn!(error = ?e.0, "unregistering the region from CUDA failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "the region could not be unregistered"),
        }
    }
}

/// A transfer whose copies were queued.
struct InFlight {
    id: TransferId,
    end: End,
    bytes: u64,
    started: Instant,
}

/// How a transfer in flight learns its end.
enum End {
    /// Its event, recorded on `stream` after its copies.
    Event {
        event: sys::CUevent,
        stream: sys::CUstream,
    },
    /// It failed after some of its copies were queued, and those have run since: it is
    /// reported at the next poll.
    Failed(EngineError),
}

/// Copies between GPU memory and one worker's sub-slots of the region with CUDA.
///
/// Every entry point (`new`, `submit`, `poll`, `drop`) pushes the engine's context (the
/// device's primary context) on the calling thread and pops it before returning, so the
/// caller's current context is left as it was.
pub struct CudaEngine {
    in_flight: VecDeque<InFlight>,
    /// `None` only while `new` builds the engine (and after a failure there).
    to_device: Option<sys::CUstream>,
    to_region: Option<sys::CUstream>,
    /// Recorded on `compute` and waited for by the copy stream at every submit.
    order: Option<sys::CUevent>,
    /// The inference engine's compute stream (null: the legacy default stream).
    compute: sys::CUstream,
    worker: u16,
    /// The device memory copies may touch: `(base, bytes)` ranges, sorted by address. A
    /// [`BlockCopy`]'s offset is relative to the first one given.
    device: Vec<(sys::CUdeviceptr, usize)>,
    /// The range [`BlockCopy`] offsets are relative to.
    blocks: (sys::CUdeviceptr, usize),
    /// Dropped after `drop` drained the streams, and before `ctx`.
    registration: Option<Registration>,
    /// The GPU's ordinal.
    ordinal: i32,
    /// Whether a transfer's copies go to the driver in one `cuMemcpyBatchAsync`: where the
    /// driver has it, until a batch fails (then one `cuMemcpyAsync` per copy, for good).
    batch: bool,
    ctx: Arc<Retained>,
    region: Arc<Region>,
    api: Arc<dyn Api>,
}

// SAFETY: CUDA driver handles are plain identifiers valid on any thread once the context is
// current there, which every method makes it first.
unsafe impl Send for CudaEngine {}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("worker", &self.worker)
            .field("device", &self.device)
            .field("in_flight", &self.in_flight.len())
            .field("batch", &self.batch)
            .finish()
    }
}

impl CudaEngine {
    /// An engine for GPU `ordinal`, copying between the device memory
    /// `device_base..device_base + device_bytes` (the engine's KV cache, allocated by the
    /// inference engine) and `worker`'s sub-slots of `region`, which it registers as pinned
    /// host memory.
    ///
    /// What can be checked is: `worker` must be one of the region's workers, and the device
    /// range must be device memory of GPU `ordinal` that the driver has allocated (not host
    /// or managed memory), with no gap, or the answer is a typed error
    /// ([`EngineError::NoSuchWorker`], [`EngineError::DeviceMemory`]).
    ///
    /// # Safety
    ///
    /// The driver can only say what the device range is now. The caller guarantees that it
    /// stays allocated, as device memory of GPU `ordinal`, until the engine is dropped, and
    /// that the engine's copies may read and write it: stores read the blocks they name,
    /// loads overwrite them (ordered after the compute stream's work, see
    /// [`set_compute_stream`](Self::set_compute_stream)).
    pub unsafe fn new(
        region: Arc<Region>,
        worker: u16,
        ordinal: i32,
        device_base: u64,
        device_bytes: usize,
    ) -> Result<Self, EngineError> {
        check_arguments(&region, worker, &[(device_base, device_bytes)])?;
        let api = Arc::new(api::Real::load()?);
        // SAFETY: the caller's contract.
        unsafe { Self::with_api(api, region, worker, ordinal, &[(device_base, device_bytes)]) }
    }

    /// An engine for GPU `ordinal` over several device ranges, `(base, bytes)` each: an
    /// inference engine's KV cache made of several tensors (one per layer or group of
    /// layers, as vLLM allocates them). Copies name their device bytes by address
    /// ([`submit_pieces`](Self::submit_pieces)); a [`BlockCopy`]'s offset is relative to the
    /// first range. The checks of [`new`](Self::new) apply to every range, and ranges may not
    /// overlap.
    ///
    /// # Safety
    ///
    /// As for [`new`](Self::new), for every range.
    pub unsafe fn with_ranges(
        region: Arc<Region>,
        worker: u16,
        ordinal: i32,
        ranges: &[(u64, usize)],
    ) -> Result<Self, EngineError> {
        check_arguments(&region, worker, ranges)?;
        let api = Arc::new(api::Real::load()?);
        // SAFETY: the caller's contract.
        unsafe { Self::with_api(api, region, worker, ordinal, ranges) }
    }

    /// [`with_ranges`](Self::with_ranges) on the driver `api`.
    ///
    /// # Safety
    /// As for [`new`](Self::new).
    unsafe fn with_api(
        api: Arc<dyn Api>,
        region: Arc<Region>,
        worker: u16,
        ordinal: i32,
        ranges: &[(u64, usize)],
    ) -> Result<Self, EngineError> {
        let device = check_arguments(&region, worker, ranges)?;
        api.init().map_err(|e| gpu("cuInit", e))?;
        let dev = api.device(ordinal).map_err(|e| gpu("cuDeviceGet", e))?;
        let ctx = Retained::new(api.clone(), dev)?;
        // From here on, a failure drops the engine built so far, whose `drop` gives back
        // what it holds.
        let mut engine = CudaEngine {
            in_flight: VecDeque::new(),
            to_device: None,
            to_region: None,
            order: None,
            compute: std::ptr::null_mut(),
            worker,
            device,
            blocks: ranges[0],
            registration: None,
            ordinal,
            batch: api.batch_available(),
            ctx,
            region,
            api,
        };
        {
            let _current = engine.ctx.enter()?;
            for &(base, bytes) in &engine.device {
                check_device_memory(&*engine.api, ordinal, base, bytes)?;
            }
            engine.registration = Some(Registration::acquire(&engine.region, &engine.ctx)?);
            let stream = || {
                engine
                    .api
                    .stream_create()
                    .map_err(|e| gpu("cuStreamCreate", e))
            };
            engine.to_device = Some(stream()?);
            engine.to_region = Some(stream()?);
            engine.order = Some(
                engine
                    .api
                    .event_create()
                    .map_err(|e| gpu("cuEventCreate", e))?,
            );
        }
        Ok(engine)
    }

    /// Orders the work queued on the inference engine's compute stream before every
    /// transfer submitted from now on: a store reads its device blocks, and a load
    /// overwrites them, only after the kernels queued there so far have ended. At each
    /// submit the engine records an event on this stream and makes its copy stream wait
    /// for it (`cuEventRecord` + `cuStreamWaitEvent`: the CPU does not wait), as vLLM's
    /// offloading handlers make their transfer stream wait for the current stream.
    ///
    /// Until this is called the compute stream is the legacy default stream (the null
    /// stream), which the engine's own streams, being non-blocking, would otherwise not
    /// wait for. Pass the stream the model's kernels run on (with PyTorch,
    /// `torch.cuda.current_stream().cuda_stream` cast to a `CUstream`). The other way round
    /// is the caller's: the device blocks of a store must stay unchanged, and those of a
    /// load unread, until the transfer's completion.
    ///
    /// # Safety
    ///
    /// `stream` is the null stream or a live stream of GPU `ordinal`'s primary context, and
    /// stays live until another is set or the engine is dropped.
    pub unsafe fn set_compute_stream(&mut self, stream: sys::CUstream) {
        self.compute = stream;
    }

    /// Makes `stream` wait for the work queued on the compute stream so far. The context must
    /// be current. Queues no copy.
    fn order_after_compute(&self, stream: sys::CUstream) -> Result<(), EngineError> {
        let order = self.order.expect("made by new");
        // SAFETY: `order` is this engine's live event; `self.compute` is the null stream or a
        // live stream of this context (`set_compute_stream`'s contract).
        unsafe { self.api.event_record(order, self.compute) }
            .map_err(|e| gpu("cuEventRecord (on the compute stream)", e))?;
        // SAFETY: `stream` and `order` are this engine's live handles.
        unsafe { self.api.stream_wait(stream, order) }.map_err(|e| gpu("cuStreamWaitEvent", e))
    }

    /// Waits until the work queued on `stream` has ended. The context must be current.
    ///
    /// `cuStreamSynchronize` returns once the stream's work has ended, or with the error of a
    /// context that failed for good (after which the driver runs none of its work): either
    /// way no copy of the stream touches memory afterwards.
    fn drain(&self, stream: sys::CUstream) -> Result<(), EngineError> {
        // SAFETY: `stream` is one of this engine's live streams.
        unsafe { self.api.stream_synchronize(stream) }.map_err(|e| gpu("cuStreamSynchronize", e))
    }

    /// Destroys an event of this engine that nothing uses any more. The context must be
    /// current.
    fn destroy_event(&self, event: sys::CUevent) {
        // SAFETY: `event` is live and, as the caller says, not used again.
        if let Err(e) = unsafe { self.api.event_destroy(event) } {
            tracing::warn!(error = ?e.0, "destroying a CUDA event failed");
        }
    }

    /// Where a piece of `len` bytes at byte `at` of `slot`'s sub-slot lies in the region,
    /// checked to lie inside the sub-slot (with no overflow on the way).
    fn locate_host(&self, slot: SlotId, at: usize, len: usize) -> Result<usize, EngineError> {
        let layout = self.region.layout();
        let region_len = self.region.raw_parts().1;
        (slot.index() < layout.rows as usize)
            .then(|| slot.index().checked_mul(layout.row_bytes()))
            .flatten()
            .and_then(|row| row.checked_add(self.worker as usize * layout.sub_slot_bytes()))
            .filter(|_| {
                at.checked_add(len)
                    .is_some_and(|end| end <= layout.sub_slot_bytes())
            })
            .and_then(|sub| sub.checked_add(at))
            .filter(|h| h.checked_add(len).is_some_and(|end| end <= region_len))
            .ok_or_else(|| {
                EngineError::Memory(RegionError::OutOfRange {
                    offset: (slot.index() as u64)
                        .saturating_mul(layout.row_bytes() as u64)
                        .saturating_add(at as u64),
                    len: len as u64,
                    size: region_len as u64,
                })
            })
    }

    /// Whether `device..device + len` lies inside one of the engine's device ranges.
    fn check_device(&self, device: u64, len: usize) -> Result<(), EngineError> {
        let inside = self.device.iter().any(|&(base, bytes)| {
            device >= base
                && device
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= base + bytes as u64)
        });
        if inside {
            return Ok(());
        }
        Err(EngineError::DeviceMemory {
            base: device,
            bytes: len,
            reason: "the copy reaches outside the engine's device memory".into(),
        })
    }

    /// Where `copy` reads and writes: the offset of its sub-slot in the region and its device
    /// address, each checked to lie inside its memory (with no overflow on the way).
    fn locate(&self, copy: &BlockCopy) -> Result<(usize, sys::CUdeviceptr, usize), EngineError> {
        let len = self.region.layout().block_bytes_per_worker;
        let host = self.locate_host(copy.slot, 0, len)?;
        let (base, bytes) = self.blocks;
        if copy
            .device_offset
            .checked_add(len)
            .is_none_or(|end| end > bytes)
        {
            return Err(EngineError::Memory(RegionError::OutOfRange {
                offset: copy.device_offset as u64,
                len: len as u64,
                size: bytes as u64,
            }));
        }
        // `base + bytes` was checked not to overflow in `new`.
        Ok((host, base + copy.device_offset as u64, len))
    }

    /// Starts transfer `id` of `pieces`: each copies `len` bytes between device address
    /// `device` and byte `at` of `slot`'s sub-slot for this engine's worker (a block of a
    /// KV cache spread over several tensors is one piece per tensor). Every piece is checked
    /// to lie inside the engine's device ranges and inside the sub-slot before anything is
    /// queued; the rest is as [`TransferEngine::submit`].
    pub fn submit_pieces(
        &mut self,
        id: TransferId,
        direction: Direction,
        pieces: &[Piece],
    ) -> Result<(), EngineError> {
        let copies = pieces
            .iter()
            .map(|p| {
                let host = self.locate_host(p.slot, p.at, p.len)?;
                self.check_device(p.device, p.len)?;
                Ok((host, p.device, p.len))
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        self.queue(id, direction, &copies)
    }

    /// Queues `copies` (`(region offset, device address, bytes)`, each checked) on the
    /// direction's stream after the compute stream's work, and an event after them.
    fn queue(
        &mut self,
        id: TransferId,
        direction: Direction,
        copies: &[(usize, sys::CUdeviceptr, usize)],
    ) -> Result<(), EngineError> {
        let started = Instant::now();
        let base = self.region.raw_parts().0;
        let stream = match direction {
            Direction::ToRegion => self.to_region,
            Direction::ToDevice => self.to_device,
        }
        .expect("made by new");
        let _current = self.ctx.enter()?;
        // Made first: a failure here has queued nothing.
        let event = self
            .api
            .event_create()
            .map_err(|e| gpu("cuEventCreate", e))?;
        if let Err(e) = self.order_after_compute(stream) {
            self.destroy_event(event);
            return Err(e);
        }
        let copies = coalesce(copies);
        let mut failure = None;
        // Whether copies of this job may already be queued (by a batch that failed part way).
        let mut queued = false;
        let mut sent = false;
        // The copies of one batch may run in any order: destinations that overlap (which no
        // caller should give) are copied one by one, in order, as before batching.
        if self.batch && copies.len() > 1 && !destinations_overlap(&copies, direction) {
            match self.queue_batch(direction, &copies, stream) {
                Ok(()) => sent = true,
                Err(e) => {
                    // Copies are idempotent and ordered on one stream: queuing them all again
                    // one by one below gives the same bytes, whatever prefix the batch queued.
                    tracing::warn!(
                        error = %e,
                        "cuMemcpyBatchAsync failed: copying one block at a time from now on"
                    );
                    self.batch = false;
                    queued = true;
                }
            }
        }
        // After a batch, nothing is left to queue one by one.
        let singles = if sent { &[][..] } else { &copies[..] };
        for (i, &(host, dptr, len)) in singles.iter().enumerate() {
            // SAFETY: both ranges were checked by the caller to lie inside the registered
            // region and the engine's device memory. The slot is owned by this transfer until
            // it is reported (Pending for a store, load-pinned for a load: I3, I6), which
            // happens only after its copies ran, so no one else touches the host bytes
            // meanwhile.
            let host = unsafe { base.add(host) };
            let r = match direction {
                // SAFETY: as above.
                Direction::ToRegion => unsafe { self.api.copy_to_host(host, dptr, len, stream) },
                // SAFETY: as above.
                Direction::ToDevice => unsafe { self.api.copy_to_device(dptr, host, len, stream) },
            };
            if let Err(e) = r {
                if i == 0 && !queued {
                    // Nothing queued: the job is refused.
                    self.destroy_event(event);
                    return Err(gpu("cuMemcpyAsync", e));
                }
                failure = Some(gpu("cuMemcpyAsync", e));
                break;
            }
        }
        if failure.is_none() {
            // SAFETY: `event` and `stream` are live handles of the current context.
            match unsafe { self.api.event_record(event, stream) } {
                Ok(()) => {
                    self.in_flight.push_back(InFlight {
                        id,
                        end: End::Event { event, stream },
                        bytes: copies.iter().map(|c| c.2 as u64).sum(),
                        started,
                    });
                    return Ok(());
                }
                Err(e) if copies.is_empty() => {
                    self.destroy_event(event);
                    return Err(gpu("cuEventRecord", e));
                }
                Err(e) => failure = Some(gpu("cuEventRecord", e)),
            }
        }
        self.destroy_event(event);
        // Copies of this job are queued and run whatever happens now: the job may end only
        // once they have, or the driver would free its slots (or release its pins) under a
        // running DMA. Waiting here is the error path only.
        let mut error = failure.expect("set on every path that reaches here");
        if let Err(e) = self.drain(stream) {
            error = EngineError::Gpu(format!("{error}; then {e}"));
        }
        self.in_flight.push_back(InFlight {
            id,
            end: End::Failed(error),
            bytes: 0,
            started,
        });
        Ok(())
    }

    /// Queues `copies` in batches of at most [`BATCH_MAX`] copies each.
    fn queue_batch(
        &self,
        direction: Direction,
        copies: &[(usize, sys::CUdeviceptr, usize)],
        stream: sys::CUstream,
    ) -> Result<(), EngineError> {
        let base = self.region.raw_parts().0;
        let mut batch = Vec::with_capacity(copies.len().min(BATCH_MAX));
        for chunk in copies.chunks(BATCH_MAX) {
            batch.clear();
            // SAFETY: the offsets were checked by the caller to lie inside the region.
            batch.extend(
                chunk
                    .iter()
                    .map(|&(host, dptr, len)| (unsafe { base.add(host) }, dptr, len)),
            );
            let to_host = direction == Direction::ToRegion;
            // SAFETY: as for the single copies in `queue`.
            unsafe {
                self.api
                    .copy_batch(to_host, &batch, self.ordinal, stream)
                    .map_err(|e| gpu("cuMemcpyBatchAsync", e))?;
            }
        }
        Ok(())
    }

    /// Whether transfers are still in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

/// One piece of a [`CudaEngine::submit_pieces`] transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The primary slot (this engine's worker's sub-slot of its row).
    pub slot: SlotId,
    /// Byte offset in the sub-slot.
    pub at: usize,
    /// Device address.
    pub device: u64,
    /// Bytes to copy.
    pub len: usize,
}

impl TransferEngine for CudaEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn submit(&mut self, job: CopyJob, _done: &Completions) -> Result<(), EngineError> {
        let copies = job
            .copies
            .iter()
            .map(|c| self.locate(c))
            .collect::<Result<Vec<_>, _>>()?;
        self.queue(job.id, job.direction, &copies)
    }

    fn poll(&mut self, done: &Completions) -> bool {
        if self.in_flight.is_empty() {
            return false;
        }
        let _current = match self.ctx.try_enter() {
            Ok(current) => current,
            Err(e) => {
                // The context cannot be made current only once it is gone (destroyed, or the
                // driver shut down), and its queued copies went with it: the transfers end
                // as failed rather than being reported in flight for ever.
                for t in self.in_flight.drain(..) {
                    let result = match t.end {
                        End::Failed(failure) => Err(failure),
                        End::Event { .. } => {
                            Err(gpu("cuCtxPushCurrent (the engine's context is gone)", e))
                        }
                    };
                    let _ = done.push(Completion::Transfer {
                        id: t.id,
                        result,
                        bytes: 0,
                        elapsed: t.started.elapsed(),
                        service: t.started.elapsed(),
                    });
                }
                return false;
            }
        };
        let mut i = 0;
        while i < self.in_flight.len() {
            let result = match &self.in_flight[i].end {
                End::Failed(_) => None,
                // SAFETY: the event is live until the transfer is removed below.
                &End::Event { event, stream } => match unsafe { self.api.event_query(event) } {
                    Ok(false) => {
                        i += 1;
                        continue;
                    }
                    Ok(true) => Some(Ok(())),
                    Err(e) => {
                        // Only ended once the stream has drained what it queued.
                        let error = gpu("transfer", e);
                        Some(match self.drain(stream) {
                            Ok(()) => Err(error),
                            Err(d) => Err(EngineError::Gpu(format!("{error}; then {d}"))),
                        })
                    }
                },
            };
            let t = self.in_flight.remove(i).expect("index checked");
            let result = match (t.end, result) {
                (End::Failed(e), _) => Err(e),
                (End::Event { event, .. }, result) => {
                    self.destroy_event(event);
                    result.expect("an event's result is set above")
                }
            };
            let _ = done.push(Completion::Transfer {
                id: t.id,
                bytes: if result.is_ok() { t.bytes } else { 0 },
                result,
                elapsed: t.started.elapsed(),
                // The copies run on the GPU's copy engine from submission on.
                service: t.started.elapsed(),
            });
        }
        !self.in_flight.is_empty()
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        // The registration and the context retain are given back after this, by their own
        // `drop`, whatever happens here.
        let _current = match self.ctx.enter() {
            Ok(current) => current,
            Err(e) => {
                // The context is gone, and its streams, events and queued copies with it.
                tracing::warn!(error = %e, "the CUDA engine's context is gone");
                return;
            }
        };
        let streams = [self.to_device.take(), self.to_region.take()];
        // SAFETY: the streams and events are this engine's own live handles, not used after
        // this. Synchronizing first means no copy still uses the region when the
        // registration is given back.
        unsafe {
            for &s in streams.iter().flatten() {
                if let Err(e) = self.api.stream_synchronize(s) {
                    tracing::warn!(error = ?e.0, "a CUDA stream failed while draining");
                }
            }
            for t in self.in_flight.drain(..) {
                if let End::Event { event, .. } = t.end {
                    let _ = self.api.event_destroy(event);
                }
            }
            if let Some(order) = self.order.take() {
                let _ = self.api.event_destroy(order);
            }
            for &s in streams.iter().flatten() {
                let _ = self.api.stream_destroy(s);
            }
        }
    }
}
