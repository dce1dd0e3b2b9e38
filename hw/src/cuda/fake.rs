//! A fake CUDA driver for the engine's tests: a GPU with one device allocation, streams that
//! run their queued work only when something waits for it, and a fault plan that makes any
//! chosen call fail.
//!
//! Like the real driver, queued copies keep running after a later call fails: they run when
//! a stream is synchronized, an event on it is queried, or the test calls
//! [`run_all`](Fake::run_all). A copy that runs checks that its host bytes are still
//! registered, and every call that needs a context checks that the engine's is current.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use sys::cudaError_enum as E;

use super::api::{Allocation, Answer, Api};

/// The context that is current on the test's thread before the engine is created.
pub(super) const CALLER_CTX: usize = 0xCA11;
/// The fake GPU's primary context.
pub(super) const PRIMARY_CTX: usize = 0xC7C7;
/// Where the fake GPU's one allocation starts.
pub(super) const DEVICE_BASE: u64 = 0x7000_0000;

/// The driver calls, for the fault plan and the call counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Call {
    Init,
    Device,
    Retain,
    Release,
    Push,
    Pop,
    Pointer,
    Register,
    Unregister,
    StreamCreate,
    StreamDestroy,
    StreamSync,
    StreamWait,
    EventCreate,
    EventRecord,
    EventQuery,
    EventDestroy,
    CopyToHost,
    CopyToDevice,
    CopyBatch,
}

/// Work queued on a stream.
enum Op {
    /// A DMA between registered host memory and the device allocation.
    Copy {
        to_host: bool,
        host: usize,
        dev: u64,
        len: usize,
    },
    /// A kernel of the inference engine writing device memory.
    Kernel { dev: u64, bytes: Vec<u8> },
    /// Waits until `upto` operations of `stream` have run.
    Wait { stream: usize, upto: u64 },
}

#[derive(Default)]
struct Stream {
    ops: VecDeque<Op>,
    queued: u64,
    done: u64,
    /// Created by the engine (not a stream of the test's "inference engine").
    engine: bool,
}

struct State {
    calls: BTreeMap<Call, u32>,
    /// (call, first failing call number, last failing call number, error).
    faults: Vec<(Call, u32, u32, sys::CUresult)>,
    ctx_stack: Vec<usize>,
    retained: i64,
    registered: BTreeMap<usize, usize>,
    device: Vec<u8>,
    streams: BTreeMap<usize, Stream>,
    /// Live events and where they were last recorded (stream, ops queued before).
    events: BTreeMap<usize, Option<(usize, u64)>>,
    next_handle: usize,
    /// Whether event queries leave the queued work alone (a busy GPU).
    hold: bool,
    /// What the fake says of its allocation: (device memory, managed).
    kind: (bool, bool),
    /// Fail the next event record on one of the engine's streams with this error.
    fail_engine_record: Option<sys::CUresult>,
    /// Whether the driver has `cuMemcpyBatchAsync` (by default it does not: a driver older
    /// than CUDA 12.8).
    batch: bool,
    /// Make the next batch queue this many of its copies, then fail.
    batch_fails_after: Option<usize>,
}

/// The fake driver.
pub(super) struct Fake {
    state: Mutex<State>,
}

fn handle<T>(n: usize) -> *mut T {
    std::ptr::without_provenance_mut(n)
}

fn err(code: sys::CUresult) -> DriverError {
    DriverError(code)
}

impl Fake {
    /// A GPU whose one allocation has `device_bytes` bytes, each `0xEE`.
    pub(super) fn new(device_bytes: usize) -> Self {
        let mut streams = BTreeMap::new();
        streams.insert(0, Stream::default()); // the legacy default stream
        Fake {
            state: Mutex::new(State {
                calls: BTreeMap::new(),
                faults: Vec::new(),
                ctx_stack: vec![CALLER_CTX],
                retained: 0,
                registered: BTreeMap::new(),
                device: vec![0xEE; device_bytes],
                streams,
                events: BTreeMap::new(),
                next_handle: 0x1000,
                hold: false,
                kind: (true, false),
                fail_engine_record: None,
                batch: false,
                batch_fails_after: None,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives the driver `cuMemcpyBatchAsync` (CUDA 12.8 and later), or takes it away.
    pub(super) fn set_batch(&self, batch: bool) {
        self.state().batch = batch;
    }

    /// Makes the next batched copy queue its first `queued` copies and then fail, as a real
    /// driver may.
    pub(super) fn fail_next_batch_after(&self, queued: usize) {
        self.state().batch_fails_after = Some(queued);
    }

    /// Makes the `n`th call of `call` (counted from 1 since the fake was made) fail with `code`.
    pub(super) fn fail_nth(&self, call: Call, n: u32, code: sys::CUresult) {
        self.state().faults.push((call, n, n, code));
    }

    /// Makes the `n`th call of `call` and every later one fail with `code`.
    pub(super) fn fail_from(&self, call: Call, n: u32, code: sys::CUresult) {
        self.state().faults.push((call, n, u32::MAX, code));
    }

    /// Makes the next event record on one of the engine's own streams fail with `code`.
    pub(super) fn fail_next_engine_record(&self, code: sys::CUresult) {
        self.state().fail_engine_record = Some(code);
    }

    /// Says that the allocation is host memory (`device_memory` false) or managed memory.
    pub(super) fn set_kind(&self, device_memory: bool, managed: bool) {
        self.state().kind = (device_memory, managed);
    }

    /// How many times `call` was made.
    pub(super) fn calls(&self, call: Call) -> u32 {
        self.state().calls.get(&call).copied().unwrap_or(0)
    }

    /// Whether event queries leave queued work alone.
    pub(super) fn hold(&self, hold: bool) {
        self.state().hold = hold;
    }

    /// Runs every stream's queued work.
    pub(super) fn run_all(&self) {
        let mut s = self.state();
        let ids: Vec<usize> = s.streams.keys().copied().collect();
        for id in ids {
            let queued = s.streams[&id].queued;
            s.run(id, queued);
        }
    }

    /// Copies queued that have not run yet.
    pub(super) fn pending_copies(&self) -> usize {
        let s = self.state();
        s.streams
            .values()
            .flat_map(|st| &st.ops)
            .filter(|op| matches!(op, Op::Copy { .. }))
            .count()
    }

    /// The context current on the test's thread.
    pub(super) fn current(&self) -> Option<usize> {
        self.state().ctx_stack.last().copied()
    }

    /// Retains of the primary context not released yet.
    pub(super) fn retained(&self) -> i64 {
        self.state().retained
    }

    /// Registered host ranges (start, length).
    pub(super) fn registered(&self) -> Vec<(usize, usize)> {
        self.state()
            .registered
            .iter()
            .map(|(&a, &l)| (a, l))
            .collect()
    }

    /// Engine streams and events still alive.
    pub(super) fn live_handles(&self) -> usize {
        let s = self.state();
        s.streams.values().filter(|st| st.engine).count() + s.events.len()
    }

    /// Bytes of the device allocation.
    pub(super) fn device_len(&self) -> usize {
        self.state().device.len()
    }

    /// Device bytes `offset..offset + len` of the allocation, as they are now.
    pub(super) fn device_read(&self, offset: usize, len: usize) -> Vec<u8> {
        self.state().device[offset..offset + len].to_vec()
    }

    /// Writes device bytes at once (as a synchronous copy would).
    pub(super) fn device_write(&self, offset: usize, bytes: &[u8]) {
        self.state().device[offset..offset + bytes.len()].copy_from_slice(bytes);
    }

    /// A stream of the "inference engine".
    pub(super) fn user_stream(&self) -> sys::CUstream {
        let mut s = self.state();
        let h = s.new_handle();
        s.streams.insert(h, Stream::default());
        handle(h)
    }

    /// Queues a kernel on `stream` that writes `bytes` at device offset `offset`.
    pub(super) fn launch(&self, stream: sys::CUstream, offset: usize, bytes: &[u8]) {
        let mut s = self.state();
        let st = s
            .streams
            .get_mut(&(stream as usize))
            .expect("a live stream");
        st.ops.push_back(Op::Kernel {
            dev: DEVICE_BASE + offset as u64,
            bytes: bytes.to_vec(),
        });
        st.queued += 1;
    }
}

impl State {
    fn new_handle(&mut self) -> usize {
        self.next_handle += 0x10;
        self.next_handle
    }

    /// Counts the call and answers the fault planned for it, if any.
    fn enter(&mut self, call: Call) -> Answer<()> {
        let n = self.calls.entry(call).or_insert(0);
        *n += 1;
        let n = *n;
        match self
            .faults
            .iter()
            .find(|(c, first, last, _)| *c == call && (*first..=*last).contains(&n))
        {
            Some(&(_, _, _, code)) => Err(err(code)),
            None => Ok(()),
        }
    }

    /// Like [`enter`](Self::enter), for a call that needs the engine's context current.
    fn enter_in_ctx(&mut self, call: Call) -> Answer<()> {
        self.enter(call)?;
        if self.ctx_stack.last() != Some(&PRIMARY_CTX) {
            return Err(err(E::CUDA_ERROR_INVALID_CONTEXT));
        }
        Ok(())
    }

    fn stream(&mut self, stream: sys::CUstream) -> Answer<&mut Stream> {
        self.streams
            .get_mut(&(stream as usize))
            .ok_or(err(E::CUDA_ERROR_INVALID_HANDLE))
    }

    /// Runs `stream`'s work until `upto` of its operations have run.
    fn run(&mut self, stream: usize, upto: u64) {
        loop {
            let st = self.streams.get_mut(&stream).expect("a live stream");
            if st.done >= upto {
                return;
            }
            let op = st.ops.pop_front().expect("queued work");
            st.done += 1;
            self.execute(op);
        }
    }

    fn execute(&mut self, op: Op) {
        match op {
            Op::Copy {
                to_host,
                host,
                dev,
                len,
            } => {
                assert!(
                    self.registered
                        .iter()
                        .any(|(&a, &l)| a <= host && host + len <= a + l),
                    "a DMA ran on host memory that is no longer registered"
                );
                let off = (dev - DEVICE_BASE) as usize;
                let device = &mut self.device[off..off + len];
                // SAFETY: the range is registered host memory (checked above), which the
                // engine keeps mapped until it unregisters it after its streams drained.
                let host = std::ptr::with_exposed_provenance_mut::<u8>(host);
                unsafe {
                    if to_host {
                        std::ptr::copy_nonoverlapping(device.as_ptr(), host, len);
                    } else {
                        std::ptr::copy_nonoverlapping(host.cast_const(), device.as_mut_ptr(), len);
                    }
                }
            }
            Op::Kernel { dev, bytes } => {
                let off = (dev - DEVICE_BASE) as usize;
                self.device[off..off + bytes.len()].copy_from_slice(&bytes);
            }
            Op::Wait { stream, upto } => self.run(stream, upto),
        }
    }

    fn queue_copy(&mut self, stream: sys::CUstream, op: Op) -> Answer<()> {
        let (dev, len) = match &op {
            Op::Copy { dev, len, .. } => (*dev, *len),
            _ => unreachable!("only copies are queued this way"),
        };
        let end = DEVICE_BASE + self.device.len() as u64;
        if dev < DEVICE_BASE || dev + len as u64 > end {
            return Err(err(E::CUDA_ERROR_INVALID_VALUE));
        }
        let st = self.stream(stream)?;
        st.ops.push_back(op);
        st.queued += 1;
        Ok(())
    }
}

impl Api for Fake {
    fn init(&self) -> Answer<()> {
        self.state().enter(Call::Init)
    }

    fn device(&self, ordinal: i32) -> Answer<sys::CUdevice> {
        self.state().enter(Call::Device)?;
        if ordinal != 0 {
            return Err(err(E::CUDA_ERROR_INVALID_DEVICE));
        }
        Ok(0)
    }

    unsafe fn retain_primary(&self, _dev: sys::CUdevice) -> Answer<sys::CUcontext> {
        let mut s = self.state();
        s.enter(Call::Retain)?;
        s.retained += 1;
        Ok(handle(PRIMARY_CTX))
    }

    unsafe fn release_primary(&self, _dev: sys::CUdevice) -> Answer<()> {
        let mut s = self.state();
        s.enter(Call::Release)?;
        assert!(s.retained > 0, "released a primary context not retained");
        s.retained -= 1;
        Ok(())
    }

    unsafe fn push(&self, ctx: sys::CUcontext) -> Answer<()> {
        let mut s = self.state();
        s.enter(Call::Push)?;
        s.ctx_stack.push(ctx as usize);
        Ok(())
    }

    fn pop(&self) -> Answer<()> {
        let mut s = self.state();
        s.enter(Call::Pop)?;
        s.ctx_stack
            .pop()
            .map(|_| ())
            .ok_or(err(E::CUDA_ERROR_INVALID_CONTEXT))
    }

    fn pointer(&self, dptr: sys::CUdeviceptr) -> Answer<Allocation> {
        let mut s = self.state();
        s.enter(Call::Pointer)?;
        let bytes = s.device.len();
        if dptr < DEVICE_BASE || dptr >= DEVICE_BASE + bytes as u64 {
            return Err(err(E::CUDA_ERROR_INVALID_VALUE));
        }
        Ok(Allocation {
            base: DEVICE_BASE,
            bytes,
            device_memory: s.kind.0,
            managed: s.kind.1,
            ordinal: 0,
        })
    }

    unsafe fn register(&self, ptr: *mut u8, len: usize) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::Register)?;
        let start = ptr as usize;
        if s.registered
            .iter()
            .any(|(&a, &l)| a < start + len && start < a + l)
        {
            return Err(err(E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED));
        }
        s.registered.insert(start, len);
        Ok(())
    }

    unsafe fn unregister(&self, ptr: *mut u8) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::Unregister)?;
        s.registered
            .remove(&(ptr as usize))
            .map(|_| ())
            .ok_or(err(E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED))
    }

    fn stream_create(&self) -> Answer<sys::CUstream> {
        let mut s = self.state();
        s.enter_in_ctx(Call::StreamCreate)?;
        let h = s.new_handle();
        s.streams.insert(
            h,
            Stream {
                engine: true,
                ..Stream::default()
            },
        );
        Ok(handle(h))
    }

    unsafe fn stream_destroy(&self, stream: sys::CUstream) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::StreamDestroy)?;
        let st = s.stream(stream)?;
        // Work still queued completes before the stream's resources go.
        let queued = st.queued;
        s.run(stream as usize, queued);
        s.streams.remove(&(stream as usize));
        Ok(())
    }

    unsafe fn stream_synchronize(&self, stream: sys::CUstream) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::StreamSync)?;
        let queued = s.stream(stream)?.queued;
        s.run(stream as usize, queued);
        Ok(())
    }

    unsafe fn stream_wait(&self, stream: sys::CUstream, event: sys::CUevent) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::StreamWait)?;
        let Some(&at) = s.events.get(&(event as usize)) else {
            return Err(err(E::CUDA_ERROR_INVALID_HANDLE));
        };
        let st = s.stream(stream)?;
        if let Some((on, upto)) = at {
            st.ops.push_back(Op::Wait { stream: on, upto });
            st.queued += 1;
        }
        Ok(())
    }

    fn event_create(&self) -> Answer<sys::CUevent> {
        let mut s = self.state();
        s.enter_in_ctx(Call::EventCreate)?;
        let h = s.new_handle();
        s.events.insert(h, None);
        Ok(handle(h))
    }

    unsafe fn event_record(&self, event: sys::CUevent, stream: sys::CUstream) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::EventRecord)?;
        let st = s.stream(stream)?;
        let (queued, engine) = (st.queued, st.engine);
        if engine && let Some(code) = s.fail_engine_record.take() {
            return Err(err(code));
        }
        let e = s
            .events
            .get_mut(&(event as usize))
            .ok_or(err(E::CUDA_ERROR_INVALID_HANDLE))?;
        *e = Some((stream as usize, queued));
        Ok(())
    }

    unsafe fn event_query(&self, event: sys::CUevent) -> Answer<bool> {
        let mut s = self.state();
        s.enter_in_ctx(Call::EventQuery)?;
        let Some(&at) = s.events.get(&(event as usize)) else {
            return Err(err(E::CUDA_ERROR_INVALID_HANDLE));
        };
        let Some((stream, upto)) = at else {
            return Ok(true); // never recorded: nothing to wait for
        };
        if !s.hold {
            s.run(stream, upto);
        }
        Ok(s.streams[&stream].done >= upto)
    }

    unsafe fn event_destroy(&self, event: sys::CUevent) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::EventDestroy)?;
        s.events
            .remove(&(event as usize))
            .map(|_| ())
            .ok_or(err(E::CUDA_ERROR_INVALID_HANDLE))
    }

    unsafe fn copy_to_host(
        &self,
        host: *mut u8,
        dev: sys::CUdeviceptr,
        len: usize,
        stream: sys::CUstream,
    ) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::CopyToHost)?;
        s.queue_copy(
            stream,
            Op::Copy {
                to_host: true,
                host: host.expose_provenance(),
                dev,
                len,
            },
        )
    }

    unsafe fn copy_to_device(
        &self,
        dev: sys::CUdeviceptr,
        host: *const u8,
        len: usize,
        stream: sys::CUstream,
    ) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::CopyToDevice)?;
        s.queue_copy(
            stream,
            Op::Copy {
                to_host: false,
                host: host.expose_provenance(),
                dev,
                len,
            },
        )
    }

    fn batch_available(&self) -> bool {
        self.state().batch
    }

    unsafe fn copy_batch(
        &self,
        to_host: bool,
        copies: &[(*mut u8, sys::CUdeviceptr, usize)],
        _ordinal: i32,
        stream: sys::CUstream,
    ) -> Answer<()> {
        let mut s = self.state();
        s.enter_in_ctx(Call::CopyBatch)?;
        if !s.batch {
            return Err(err(E::CUDA_ERROR_NOT_SUPPORTED));
        }
        let fails_after = s.batch_fails_after.take();
        for (i, &(host, dev, len)) in copies.iter().enumerate() {
            if fails_after == Some(i) {
                return Err(err(E::CUDA_ERROR_INVALID_VALUE));
            }
            s.queue_copy(
                stream,
                Op::Copy {
                    to_host,
                    host: host.expose_provenance(),
                    dev,
                    len,
                },
            )?;
        }
        match fails_after {
            Some(_) => Err(err(E::CUDA_ERROR_INVALID_VALUE)),
            None => Ok(()),
        }
    }
}
