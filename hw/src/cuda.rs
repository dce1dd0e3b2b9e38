//! The CUDA transfer engine (feature `cuda`): the region is registered as pinned host memory,
//! copies are batched asynchronous `cuMemcpy` calls on one stream per direction, each
//! transfer ends with an event, and completion is learnt by polling the events.
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

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use crate::engine::{
    Completion, Completions, CopyJob, Direction, EngineError, TransferEngine, TransferId,
};
use crate::region::Region;
use api::Api;

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

struct InFlight {
    id: TransferId,
    event: sys::CUevent,
    bytes: u64,
    started: Instant,
}

/// Copies between GPU memory and one worker's sub-slots of the region with CUDA.
pub struct CudaEngine {
    api: Arc<dyn Api>,
    region: Arc<Region>,
    worker: u16,
    device_base: sys::CUdeviceptr,
    device_bytes: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    to_device: sys::CUstream,
    to_region: sys::CUstream,
    in_flight: VecDeque<InFlight>,
}

// SAFETY: CUDA driver handles are plain identifiers valid on any thread once the context is
// made current there, which every method does first.
unsafe impl Send for CudaEngine {}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("worker", &self.worker)
            .field("device_bytes", &self.device_bytes)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl CudaEngine {
    /// An engine for GPU `ordinal`, copying between the device memory
    /// `device_base..device_base + device_bytes` (the engine's KV cache, allocated by the
    /// inference engine) and `worker`'s sub-slots of `region`, which it registers as pinned
    /// host memory.
    pub fn new(
        region: Arc<Region>,
        worker: u16,
        ordinal: i32,
        device_base: u64,
        device_bytes: usize,
    ) -> Result<Self, EngineError> {
        let api = Arc::new(api::Real::load()?);
        Self::with_api(api, region, worker, ordinal, device_base, device_bytes)
    }

    fn with_api(
        api: Arc<dyn Api>,
        region: Arc<Region>,
        worker: u16,
        ordinal: i32,
        device_base: u64,
        device_bytes: usize,
    ) -> Result<Self, EngineError> {
        api.init().map_err(|e| gpu("cuInit", e))?;
        let dev = api.device(ordinal).map_err(|e| gpu("cuDeviceGet", e))?;
        // SAFETY: `dev` was just returned by the driver.
        let ctx = unsafe { api.retain_primary(dev) }
            .map_err(|e| gpu("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: `ctx` is the live primary context retained above.
        unsafe { api.set_current(ctx) }.map_err(|e| gpu("cuCtxSetCurrent", e))?;
        let (ptr, len) = region.raw_parts();
        // SAFETY: `ptr..ptr + len` is the region's live mapping, kept alive by the `Arc` this
        // engine holds until `drop` unregisters it.
        unsafe { api.register(ptr, len) }
            .map_err(|e| gpu("cuMemHostRegister (pinning the region)", e))?;
        let stream = || api.stream_create().map_err(|e| gpu("cuStreamCreate", e));
        Ok(CudaEngine {
            to_device: stream()?,
            to_region: stream()?,
            api,
            region,
            worker,
            device_base,
            device_bytes,
            dev,
            ctx,
            in_flight: VecDeque::new(),
        })
    }

    fn make_current(&self) -> Result<(), EngineError> {
        // SAFETY: `self.ctx` is retained until `drop`.
        unsafe { self.api.set_current(self.ctx) }.map_err(|e| gpu("cuCtxSetCurrent", e))
    }
}

impl TransferEngine for CudaEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn submit(&mut self, job: CopyJob, _done: &Completions) -> Result<(), EngineError> {
        self.make_current()?;
        let layout = self.region.layout();
        let len = layout.block_bytes_per_worker;
        let (base, region_len) = self.region.raw_parts();
        for c in &job.copies {
            let host = layout.offset(c.slot, self.worker);
            if host + len > region_len || c.device_offset + len > self.device_bytes {
                return Err(EngineError::Memory(
                    crate::region::RegionError::OutOfRange {
                        offset: c.device_offset as u64,
                        len: len as u64,
                        size: self.device_bytes as u64,
                    },
                ));
            }
        }
        let stream = match job.direction {
            Direction::ToRegion => self.to_region,
            Direction::ToDevice => self.to_device,
        };
        for c in &job.copies {
            // SAFETY: both ranges were checked above to lie inside the registered region and
            // the engine's device memory. The slot is owned by this transfer until its event
            // completes (Pending for a store, load-pinned for a load: I3, I6), so no one else
            // touches the host bytes while the DMA runs.
            let host = unsafe { base.add(layout.offset(c.slot, self.worker)) };
            let dptr = self.device_base + c.device_offset as u64;
            let r = match job.direction {
                // SAFETY: as above.
                Direction::ToRegion => unsafe { self.api.copy_to_host(host, dptr, len, stream) },
                // SAFETY: as above.
                Direction::ToDevice => unsafe {
                    self.api.copy_to_device(dptr, host, len, stream)
                },
            };
            r.map_err(|e| gpu("cuMemcpyAsync", e))?;
        }
        let event = self
            .api
            .event_create()
            .map_err(|e| gpu("cuEventCreate", e))?;
        // SAFETY: `event` and `stream` are live handles of the current context.
        unsafe { self.api.event_record(event, stream) }.map_err(|e| gpu("cuEventRecord", e))?;
        self.in_flight.push_back(InFlight {
            id: job.id,
            event,
            bytes: (len * job.copies.len()) as u64,
            started: Instant::now(),
        });
        Ok(())
    }

    fn poll(&mut self, done: &Completions) -> bool {
        if self.make_current().is_err() {
            return !self.in_flight.is_empty();
        }
        let mut i = 0;
        while i < self.in_flight.len() {
            let t = &self.in_flight[i];
            // SAFETY: `t.event` is live until destroyed below.
            let result = match unsafe { self.api.event_query(t.event) } {
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Ok(true) => Ok(()),
                Err(e) => Err(gpu("transfer", e)),
            };
            let t = self.in_flight.remove(i).expect("index checked");
            // SAFETY: the event has completed (or failed) and is not used again.
            let _ = unsafe { self.api.event_destroy(t.event) };
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
        if self.make_current().is_err() {
            return;
        }
        // SAFETY: the streams, events and registration are this engine's own live handles;
        // synchronizing first means no copy still uses the region when it is unregistered.
        unsafe {
            let _ = self.api.stream_synchronize(self.to_device);
            let _ = self.api.stream_synchronize(self.to_region);
            for t in self.in_flight.drain(..) {
                let _ = self.api.event_destroy(t.event);
            }
            let _ = self.api.stream_destroy(self.to_device);
            let _ = self.api.stream_destroy(self.to_region);
            let _ = self.api.unregister(self.region.raw_parts().0);
            let _ = self.api.release_primary(self.dev);
        }
    }
}
