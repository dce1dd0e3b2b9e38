//! The handful of CUDA driver calls the engine makes, behind one trait: [`Real`] calls the
//! driver library (through cudarc), and the tests put a fake driver in its place that can be
//! told to fail any call.

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::engine::EngineError;

/// What a driver call answers.
pub(super) type Answer<T> = Result<T, DriverError>;

/// The driver calls of the engine. The methods taking handles or addresses are `unsafe`: the
/// caller guarantees that every handle is a live one of this driver (created and not yet
/// destroyed) and that every host or device range is memory the call may read or write
/// until the work it queues has ended.
pub(super) trait Api: Send + Sync {
    /// `cuInit`.
    fn init(&self) -> Answer<()>;
    /// `cuDeviceGet`.
    fn device(&self, ordinal: i32) -> Answer<sys::CUdevice>;
    /// `cuDevicePrimaryCtxRetain`.
    ///
    /// # Safety
    /// `dev` was returned by [`device`](Self::device).
    unsafe fn retain_primary(&self, dev: sys::CUdevice) -> Answer<sys::CUcontext>;
    /// `cuDevicePrimaryCtxRelease`.
    ///
    /// # Safety
    /// `dev`'s primary context was retained by the caller, and is not used by it afterwards.
    unsafe fn release_primary(&self, dev: sys::CUdevice) -> Answer<()>;
    /// `cuCtxPushCurrent`: makes `ctx` current on this thread, above the caller's.
    ///
    /// # Safety
    /// `ctx` is a live context.
    unsafe fn push(&self, ctx: sys::CUcontext) -> Answer<()>;
    /// `cuCtxPopCurrent`: restores the context that was current before the last push.
    fn pop(&self) -> Answer<()>;
    /// What the driver knows of the device address `dptr` (`cuMemGetAddressRange` and
    /// `cuPointerGetAttribute`): the allocation holding it, its kind and its device.
    fn pointer(&self, dptr: sys::CUdeviceptr) -> Answer<Allocation>;
    /// `cuMemHostRegister` (portable: usable from every context).
    ///
    /// # Safety
    /// `ptr..ptr + len` is mapped memory that stays mapped until it is unregistered.
    unsafe fn register(&self, ptr: *mut u8, len: usize) -> Answer<()>;
    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `ptr` was registered and no queued copy uses it any more.
    unsafe fn unregister(&self, ptr: *mut u8) -> Answer<()>;
    /// `cuStreamCreate` (non-blocking).
    fn stream_create(&self) -> Answer<sys::CUstream>;
    /// `cuStreamDestroy`.
    ///
    /// # Safety
    /// `stream` is live and not used afterwards.
    unsafe fn stream_destroy(&self, stream: sys::CUstream) -> Answer<()>;
    /// `cuStreamSynchronize`: returns once the work queued on `stream` has ended.
    ///
    /// # Safety
    /// `stream` is live.
    unsafe fn stream_synchronize(&self, stream: sys::CUstream) -> Answer<()>;
    /// `cuStreamWaitEvent`: work queued on `stream` from now on waits for the work `event`
    /// captured when it was last recorded.
    ///
    /// # Safety
    /// `stream` and `event` are live.
    unsafe fn stream_wait(&self, stream: sys::CUstream, event: sys::CUevent) -> Answer<()>;
    /// `cuEventCreate` (without timing).
    fn event_create(&self) -> Answer<sys::CUevent>;
    /// `cuEventRecord`.
    ///
    /// # Safety
    /// `event` and `stream` are live handles of the current context.
    unsafe fn event_record(&self, event: sys::CUevent, stream: sys::CUstream) -> Answer<()>;
    /// `cuEventQuery`: whether the work the event captured has ended.
    ///
    /// # Safety
    /// `event` is live.
    unsafe fn event_query(&self, event: sys::CUevent) -> Answer<bool>;
    /// `cuEventDestroy`.
    ///
    /// # Safety
    /// `event` is live and not used afterwards.
    unsafe fn event_destroy(&self, event: sys::CUevent) -> Answer<()>;
    /// `cuMemcpyDtoHAsync`: queues a copy of `len` bytes from `dev` to `host`.
    ///
    /// # Safety
    /// `stream` is live; `host..host + len` is registered memory nothing else touches and
    /// `dev..dev + len` device memory, both until the copy has ended.
    unsafe fn copy_to_host(
        &self,
        host: *mut u8,
        dev: sys::CUdeviceptr,
        len: usize,
        stream: sys::CUstream,
    ) -> Answer<()>;
    /// `cuMemcpyHtoDAsync`: queues a copy of `len` bytes from `host` to `dev`.
    ///
    /// # Safety
    /// As for [`copy_to_host`](Self::copy_to_host).
    unsafe fn copy_to_device(
        &self,
        dev: sys::CUdeviceptr,
        host: *const u8,
        len: usize,
        stream: sys::CUstream,
    ) -> Answer<()>;
    /// Whether [`copy_batch`](Self::copy_batch) is there: the driver has
    /// `cuMemcpyBatchAsync` (CUDA 12.8 and later).
    fn batch_available(&self) -> bool;
    /// `cuMemcpyBatchAsync`: queues every copy of `copies` (`(host, device, bytes)`, to the
    /// host when `to_host`, else to the device of ordinal `ordinal`) on `stream` in one
    /// call, each reading its source and writing its destination in stream order. After an
    /// error, any prefix of the copies may have been queued.
    ///
    /// # Safety
    /// As for [`copy_to_host`](Self::copy_to_host), for every copy.
    unsafe fn copy_batch(
        &self,
        to_host: bool,
        copies: &[(*mut u8, sys::CUdeviceptr, usize)],
        ordinal: i32,
        stream: sys::CUstream,
    ) -> Answer<()>;
}

/// A device allocation, as the driver describes the address it was asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Allocation {
    /// Its first address.
    pub(super) base: sys::CUdeviceptr,
    /// Its length in bytes.
    pub(super) bytes: usize,
    /// Whether it is device memory (not host memory the driver knows of).
    pub(super) device_memory: bool,
    /// Whether it is managed memory (also reachable from the CPU).
    pub(super) managed: bool,
    /// The GPU it lives on.
    pub(super) ordinal: i32,
}

/// One `cuPointerGetAttribute` answer, read as an integer. Each attribute asked here is
/// written as an integer of at most 8 bytes; the buffer is zeroed first, so a narrower
/// answer reads as its own value.
fn attribute(attr: sys::CUpointer_attribute, dptr: sys::CUdeviceptr) -> Answer<u64> {
    let mut data = 0u64;
    // SAFETY: `data` is 8 writable bytes, more than any of the attributes asked writes.
    unsafe { sys::cuPointerGetAttribute((&raw mut data).cast(), attr, dptr) }.result()?;
    Ok(data)
}

/// `cuMemcpyBatchAsync` as CUDA 12.8 declares it (the driver keeps this symbol and its
/// arguments in later releases).
type BatchFn = unsafe extern "C" fn(
    dsts: *mut sys::CUdeviceptr,
    srcs: *mut sys::CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut sys::CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: sys::CUstream,
) -> sys::CUresult;

/// The CUDA driver itself.
pub(super) struct Real {
    /// `cuMemcpyBatchAsync`, where the driver has it. Looked up here because cudarc's own
    /// binding panics on a driver without the symbol.
    batch: Option<BatchFn>,
}

impl Real {
    /// The driver, or a clear error where its library is absent (cudarc panics on the first
    /// call without it, so this is asked first).
    pub(super) fn load() -> Result<Self, EngineError> {
        if !super::driver_present() {
            return Err(EngineError::Gpu(
                "the CUDA driver library (libcuda.so) was not found: this machine has no NVIDIA driver; use the host engine".into(),
            ));
        }
        // SAFETY: the library is present (checked above); looking a symbol up calls nothing,
        // and the symbol, where found, has the type `BatchFn` (CUDA 12.8's declaration).
        let batch = unsafe { sys::culib().get::<BatchFn>(b"cuMemcpyBatchAsync\0") }
            .ok()
            .map(|f| *f);
        Ok(Real { batch })
    }
}

impl Api for Real {
    fn init(&self) -> Answer<()> {
        result::init()
    }

    fn device(&self, ordinal: i32) -> Answer<sys::CUdevice> {
        result::device::get(ordinal)
    }

    unsafe fn retain_primary(&self, dev: sys::CUdevice) -> Answer<sys::CUcontext> {
        // SAFETY: the caller's contract.
        unsafe { result::primary_ctx::retain(dev) }
    }

    unsafe fn release_primary(&self, dev: sys::CUdevice) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { result::primary_ctx::release(dev) }
    }

    unsafe fn push(&self, ctx: sys::CUcontext) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuCtxPushCurrent_v2(ctx) }.result()
    }

    fn pop(&self) -> Answer<()> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a writable out-parameter; popping touches no other memory.
        unsafe { sys::cuCtxPopCurrent_v2(&raw mut ctx) }.result()
    }

    fn pointer(&self, dptr: sys::CUdeviceptr) -> Answer<Allocation> {
        let mut base: sys::CUdeviceptr = 0;
        let mut bytes = 0usize;
        // SAFETY: both out-parameters are writable; the call only reads the driver's tables.
        unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut bytes, dptr) }.result()?;
        use sys::CUpointer_attribute as A;
        let kind = attribute(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr)?;
        let managed = attribute(A::CU_POINTER_ATTRIBUTE_IS_MANAGED, dptr)?;
        let ordinal = attribute(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dptr)?;
        Ok(Allocation {
            base,
            bytes,
            device_memory: kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64,
            managed: managed != 0,
            ordinal: ordinal as u32 as i32,
        })
    }

    unsafe fn register(&self, ptr: *mut u8, len: usize) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
    }

    unsafe fn unregister(&self, ptr: *mut u8) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemHostUnregister(ptr.cast()) }.result()
    }

    fn stream_create(&self) -> Answer<sys::CUstream> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
    }

    unsafe fn stream_destroy(&self, stream: sys::CUstream) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { result::stream::destroy(stream) }
    }

    unsafe fn stream_synchronize(&self, stream: sys::CUstream) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { result::stream::synchronize(stream) }
    }

    unsafe fn stream_wait(&self, stream: sys::CUstream, event: sys::CUevent) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe {
            result::stream::wait_event(
                stream,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
    }

    fn event_create(&self) -> Answer<sys::CUevent> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    unsafe fn event_record(&self, event: sys::CUevent, stream: sys::CUstream) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { result::event::record(event, stream) }
    }

    unsafe fn event_query(&self, event: sys::CUevent) -> Answer<bool> {
        // SAFETY: the caller's contract.
        match unsafe { result::event::query(event) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    unsafe fn event_destroy(&self, event: sys::CUevent) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { result::event::destroy(event) }
    }

    unsafe fn copy_to_host(
        &self,
        host: *mut u8,
        dev: sys::CUdeviceptr,
        len: usize,
        stream: sys::CUstream,
    ) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, len, stream) }.result()
    }

    unsafe fn copy_to_device(
        &self,
        dev: sys::CUdeviceptr,
        host: *const u8,
        len: usize,
        stream: sys::CUstream,
    ) -> Answer<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), len, stream) }.result()
    }

    fn batch_available(&self) -> bool {
        self.batch.is_some()
    }

    unsafe fn copy_batch(
        &self,
        to_host: bool,
        copies: &[(*mut u8, sys::CUdeviceptr, usize)],
        ordinal: i32,
        stream: sys::CUstream,
    ) -> Answer<()> {
        use sys::CUmemLocationType as L;
        let batch = self
            .batch
            .ok_or(DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_SUPPORTED))?;
        let host = sys::CUmemLocation {
            type_: L::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let device = sys::CUmemLocation {
            type_: L::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        };
        let (src_hint, dst_hint) = if to_host {
            (device, host)
        } else {
            (host, device)
        };
        // One set of attributes for every copy: each source is read in stream order, after
        // the work queued before it (for a store, the compute stream's kernels, through the
        // wait event). Letting a load read its source out of stream order
        // (`CU_MEMCPY_SRC_ACCESS_ORDER_ANY`) was measured no faster (docs/performance.md).
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: 0,
        };
        let mut attrs_idx = 0usize;
        let mut fail_idx = usize::MAX;
        let (mut dsts, mut srcs, mut sizes) = (
            Vec::with_capacity(copies.len()),
            Vec::with_capacity(copies.len()),
            Vec::with_capacity(copies.len()),
        );
        for &(h, d, len) in copies {
            // With unified addressing a registered host address is also a device address.
            let h = h as sys::CUdeviceptr;
            let (dst, src) = if to_host { (h, d) } else { (d, h) };
            dsts.push(dst);
            srcs.push(src);
            sizes.push(len);
        }
        // SAFETY: the arrays hold `copies.len()` entries each and outlive the call (the
        // driver reads them during it); the copies' memory is the caller's contract.
        unsafe {
            batch(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                &raw mut attrs,
                &raw mut attrs_idx,
                1,
                &raw mut fail_idx,
                stream,
            )
        }
        .result()
    }
}
