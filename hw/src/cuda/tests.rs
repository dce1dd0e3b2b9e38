//! The engine on the fake driver: what it queues, when it reports, and what it gives back.

use std::sync::Arc;

use cudarc::driver::sys::cudaError_enum;
use kvtier_core::SlotId;

use super::fake::{CALLER_CTX, Call, DEVICE_BASE, Fake};
use super::{CudaEngine, Piece};
use crate::engine::{
    BlockCopy, Completion, Completions, CopyJob, Direction, EngineError, TransferEngine, TransferId,
};
use crate::queue::Queue;
use crate::region::{Layout, Region, RegionError};

const BLOCK: usize = 4096;

struct Rig {
    _dir: tempfile::TempDir,
    region: Arc<Region>,
    fake: Arc<Fake>,
    done: Completions,
}

/// A region of `rows` rows for `workers` workers, and a fake GPU with `device_blocks` blocks.
fn rig(rows: u32, workers: u16, device_blocks: usize) -> Rig {
    rig_in(tempfile::tempdir().unwrap(), rows, workers, device_blocks)
}

/// [`rig`] with its region in `dir`.
fn rig_in(dir: tempfile::TempDir, rows: u32, workers: u16, device_blocks: usize) -> Rig {
    let layout = Layout::new(rows, workers, BLOCK).unwrap();
    let region = Arc::new(Region::create(&dir.path().join("region"), layout, 1).unwrap());
    Rig {
        _dir: dir,
        region,
        fake: Arc::new(Fake::new(device_blocks * BLOCK)),
        done: Arc::new(Queue::new()),
    }
}

impl Rig {
    fn engine(&self, worker: u16) -> Result<CudaEngine, EngineError> {
        // SAFETY: the fake driver's memory, which lives as long as the fake.
        unsafe {
            CudaEngine::with_api(
                self.fake.clone(),
                self.region.clone(),
                worker,
                0,
                &[(DEVICE_BASE, self.device_bytes())],
            )
        }
    }

    fn device_bytes(&self) -> usize {
        self.fake.device_len()
    }

    /// Polls until nothing is in flight (failing the test if that never comes), and returns
    /// the completions in the order they came.
    fn settle(&self, engine: &mut CudaEngine) -> Vec<(TransferId, Result<(), EngineError>)> {
        let mut polls = 0;
        while engine.poll(&self.done) {
            polls += 1;
            assert!(
                polls < 1000,
                "poll keeps answering that transfers are in flight"
            );
        }
        let mut ends = Vec::new();
        self.done.drain_into(&mut ends);
        ends.into_iter()
            .map(|c| match c {
                Completion::Transfer { id, result, .. } => (id, result),
                Completion::Tier(_) => unreachable!("no tier here"),
            })
            .collect()
    }

    fn sub_slot(&self, slot: u32, worker: u16) -> Vec<u8> {
        let mut out = vec![0; BLOCK];
        self.region
            .read_sub(SlotId(slot), worker, &mut out)
            .unwrap();
        out
    }
}

fn job(id: u64, direction: Direction, copies: &[(u32, usize)]) -> CopyJob {
    CopyJob {
        id: TransferId(id),
        direction,
        copies: copies
            .iter()
            .map(|&(slot, device_offset)| BlockCopy {
                slot: SlotId(slot),
                device_offset,
            })
            .collect(),
    }
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u8).wrapping_mul(7) ^ seed)
        .collect()
}

/// A block goes device → region slot 1 → device at another offset, byte for byte.
#[test]
fn copies_go_to_the_region_and_back() {
    let r = rig(4, 1, 2);
    r.fake.device_write(0, &pattern(1));
    let mut engine = r.engine(0).unwrap();
    engine
        .submit(job(0, Direction::ToRegion, &[(1, 0)]), &r.done)
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(0), Ok(()))]), "{ends:?}");
    assert!(
        r.sub_slot(1, 0) == pattern(1),
        "the sub-slot holds other bytes"
    );
    engine
        .submit(job(1, Direction::ToDevice, &[(1, BLOCK)]), &r.done)
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(1), Ok(()))]), "{ends:?}");
    assert!(
        r.fake.device_read(BLOCK, BLOCK) == pattern(1),
        "the device holds other bytes"
    );
    assert_eq!(r.fake.calls(Call::CopyToHost), 1);
    assert_eq!(r.fake.calls(Call::CopyToDevice), 1);
}

/// The region has workers 0 and 1: an engine for worker 2 is refused with a clear error.
#[test]
fn a_worker_the_region_lacks_is_refused() {
    let r = rig(4, 2, 2);
    let err = r.engine(2).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::NoSuchWorker {
                worker: 2,
                workers: 2
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("the region has 2 workers"),
        "{err}"
    );
}

/// Copies naming memory outside the region or the device are refused before anything is
/// queued, even where the offsets would overflow.
#[test]
fn copies_outside_memory_are_refused_without_overflow() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    for (direction, slot, offset) in [
        (Direction::ToRegion, 0, usize::MAX - 100),
        (Direction::ToDevice, 0, 2 * BLOCK - 1),
        (Direction::ToRegion, 4, 0),
        (Direction::ToDevice, u32::MAX, 0),
    ] {
        let err = engine
            .submit(job(0, direction, &[(0, 0), (slot, offset)]), &r.done)
            .unwrap_err();
        assert!(
            matches!(err, EngineError::Memory(RegionError::OutOfRange { .. })),
            "{err}"
        );
    }
    assert_eq!(
        r.fake.calls(Call::CopyToHost) + r.fake.calls(Call::CopyToDevice),
        0
    );
    assert!(r.settle(&mut engine).is_empty());
}

/// The device range must be device memory the driver knows, inside its allocations.
#[test]
fn device_memory_the_driver_does_not_know_is_refused() {
    let r = rig(4, 1, 2);
    let len = r.device_bytes();
    let make = |base: u64, bytes: usize| {
        // SAFETY: the fake driver's memory; the engine is dropped at once.
        unsafe { CudaEngine::with_api(r.fake.clone(), r.region.clone(), 0, 0, &[(base, bytes)]) }
    };
    for (base, bytes, why) in [
        (DEVICE_BASE, len + 1, "is not in any allocation"),
        (DEVICE_BASE - 4096, len, "is not in any allocation"),
        (u64::MAX - 10, len, "past the end of the address space"),
        (DEVICE_BASE, 0, "no bytes"),
    ] {
        let err = make(base, bytes).unwrap_err();
        assert!(
            matches!(err, EngineError::DeviceMemory { .. }),
            "{base:#x}+{bytes}: {err}"
        );
        assert!(err.to_string().contains(why), "{err}");
    }
    r.fake.set_kind(false, false);
    let err = make(DEVICE_BASE, len).unwrap_err();
    assert!(err.to_string().contains("not device memory"), "{err}");
    r.fake.set_kind(true, true);
    let err = make(DEVICE_BASE, len).unwrap_err();
    assert!(err.to_string().contains("managed memory"), "{err}");
    r.fake.set_kind(true, false);
    assert!(make(DEVICE_BASE, len).is_ok());
}

/// Whatever context the caller had current is current again after every entry point.
#[test]
fn the_callers_context_is_current_again_after_every_call() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    assert_eq!(r.fake.current(), Some(CALLER_CTX), "after new");
    engine
        .submit(job(0, Direction::ToRegion, &[(0, 0)]), &r.done)
        .unwrap();
    assert_eq!(r.fake.current(), Some(CALLER_CTX), "after submit");
    let _ = r.settle(&mut engine);
    assert_eq!(r.fake.current(), Some(CALLER_CTX), "after poll");
    drop(engine);
    assert_eq!(r.fake.current(), Some(CALLER_CTX), "after drop");
}

/// Whichever step of `new` fails, the context retain, the registration and the streams it
/// had taken are given back.
#[test]
fn a_failed_new_leaves_nothing_behind() {
    for (call, n) in [
        (Call::Push, 1),
        (Call::Pointer, 1),
        (Call::Register, 1),
        (Call::StreamCreate, 1),
        (Call::StreamCreate, 2),
        (Call::EventCreate, 1),
    ] {
        let r = rig(4, 1, 2);
        r.fake
            .fail_nth(call, n, cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY);
        let err = r.engine(0).unwrap_err();
        assert!(
            err.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "{err}"
        );
        assert_eq!(r.fake.retained(), 0, "{call:?} {n}: context retained");
        assert_eq!(r.fake.registered(), [], "{call:?} {n}: region registered");
        assert_eq!(r.fake.live_handles(), 0, "{call:?} {n}: streams left");
        assert_eq!(r.fake.current(), Some(CALLER_CTX), "{call:?} {n}");
    }
}

/// The kernel refuses to pin a file region that is not in memory (the driver answers
/// `CUDA_ERROR_INVALID_VALUE`): the error names the region's file and what to do; for a
/// region in memory, or another error, it is the driver's error alone.
#[test]
fn a_refused_pin_says_why_where_the_regions_filesystem_explains_it() {
    use nix::sys::statfs::{TMPFS_MAGIC, statfs};
    let on_disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let in_memory = tempfile::tempdir_in("/dev/shm").ok();
    let disk_is_memory = statfs(on_disk.path()).unwrap().filesystem_type() == TMPFS_MAGIC;
    for (dir, hint) in [(Some(on_disk), !disk_is_memory), (in_memory, false)] {
        let Some(dir) = dir else { continue };
        let r = rig_in(dir, 4, 1, 2);
        r.fake
            .fail_nth(Call::Register, 1, cudaError_enum::CUDA_ERROR_INVALID_VALUE);
        let err = r.engine(0).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "GPU: cuMemHostRegister (pinning the region): CUDA_ERROR_INVALID_VALUE"
            ),
            "{err}"
        );
        assert_eq!(err.contains("put the region under /dev/shm"), hint, "{err}");
        if hint {
            assert!(
                err.contains(&r.region.path().display().to_string()),
                "{err}"
            );
        }
        // Another error is not the kernel's refusal: no reason is guessed.
        r.fake
            .fail_nth(Call::Register, 2, cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY);
        let err = r.engine(0).unwrap_err().to_string();
        assert!(err.ends_with("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
    }
}

/// Dropping an engine with copies still queued lets them end, then gives everything back.
#[test]
fn dropping_the_engine_gives_everything_back() {
    let r = rig(4, 1, 2);
    r.fake.device_write(0, &pattern(3));
    let mut engine = r.engine(0).unwrap();
    r.fake.hold(true);
    engine
        .submit(job(0, Direction::ToRegion, &[(2, 0)]), &r.done)
        .unwrap();
    assert_eq!(r.fake.pending_copies(), 1);
    drop(engine);
    assert_eq!(r.fake.pending_copies(), 0);
    assert!(
        r.sub_slot(2, 0) == pattern(3),
        "the sub-slot holds other bytes"
    );
    assert_eq!(r.fake.retained(), 0);
    assert_eq!(r.fake.registered(), []);
    assert_eq!(r.fake.live_handles(), 0);
    assert_eq!(r.fake.current(), Some(CALLER_CTX));
}

/// When the context can no longer be made current (it is gone, and its work with it), drop
/// still releases the context's retain.
#[test]
fn dropping_without_a_context_still_releases_it() {
    let r = rig(4, 1, 2);
    let engine = r.engine(0).unwrap();
    let code = cudaError_enum::CUDA_ERROR_INVALID_CONTEXT;
    r.fake
        .fail_from(Call::Push, r.fake.calls(Call::Push) + 1, code);
    drop(engine);
    assert_eq!(r.fake.retained(), 0);
    assert_eq!(r.fake.current(), Some(CALLER_CTX));
}

/// When the context can no longer be made current, poll ends the transfers in flight as
/// failed instead of answering forever that they are in flight.
#[test]
fn poll_without_a_context_ends_the_transfers() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    r.fake.hold(true);
    engine
        .submit(job(7, Direction::ToRegion, &[(0, 0)]), &r.done)
        .unwrap();
    let code = cudaError_enum::CUDA_ERROR_INVALID_CONTEXT;
    r.fake
        .fail_from(Call::Push, r.fake.calls(Call::Push) + 1, code);
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(7), Err(_))]), "{ends:?}");
}

/// Two engines (two workers) over one region in one process: one registration, kept until
/// the last engine goes.
#[test]
fn engines_over_one_region_share_its_registration() {
    let r = rig(4, 2, 2);
    r.fake.device_write(0, &pattern(5));
    let first = r.engine(0).unwrap();
    let mut second = r.engine(1).unwrap();
    assert_eq!(r.fake.registered().len(), 1);
    drop(first);
    assert_eq!(
        r.fake.registered().len(),
        1,
        "the second engine still copies"
    );
    second
        .submit(job(0, Direction::ToRegion, &[(3, 0)]), &r.done)
        .unwrap();
    let ends = r.settle(&mut second);
    assert!(matches!(ends[..], [(TransferId(0), Ok(()))]), "{ends:?}");
    assert!(
        r.sub_slot(3, 1) == pattern(5),
        "the sub-slot holds other bytes"
    );
    drop(second);
    assert_eq!(r.fake.registered(), []);
    assert_eq!(r.fake.retained(), 0);
}

/// A copy that fails after earlier ones were queued: submit accepts the job (its copies are
/// running), and poll reports it failed only once the queued copies have run, so the slots
/// it names are not reused under a late DMA.
#[test]
fn a_copy_failing_after_others_were_queued_ends_through_poll() {
    let r = rig_with_patterns();
    let mut engine = r.engine(0).unwrap();
    r.fake.hold(true);
    r.fake.fail_nth(
        Call::CopyToHost,
        2,
        cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS,
    );
    // Not adjacent on the device, so not merged into one copy.
    engine
        .submit(job(4, Direction::ToRegion, SCATTERED), &r.done)
        .expect("a job with queued copies ends through poll");
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(4), Err(_))]), "{ends:?}");
    assert!(format!("{:?}", ends[0].1).contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
    assert_eq!(
        r.fake.pending_copies(),
        0,
        "reported while a copy was queued"
    );
    assert!(
        r.sub_slot(0, 0) == pattern(1),
        "the queued copy ran before the report"
    );
}

/// Slots 0, 1 and 2 from device blocks 1, 0 and 2: adjacent in the region, not on the
/// device, so three copies.
const SCATTERED: &[(u32, usize)] = &[(0, BLOCK), (1, 0), (2, 2 * BLOCK)];

/// A rig of 4 slots and 3 device blocks, block `b` holding `pattern(b)`.
fn rig_with_patterns() -> Rig {
    let r = rig(4, 1, 3);
    for b in 0..3 {
        r.fake.device_write(b * BLOCK, &pattern(b as u8));
    }
    r
}

/// Submits `job` and settles the engine: the job's end, the only one, is a success.
fn run_ok(r: &Rig, engine: &mut CudaEngine, job: CopyJob) {
    let id = job.id;
    engine.submit(job, &r.done).unwrap();
    let ends = r.settle(engine);
    assert!(matches!(ends[..], [(end, Ok(()))] if end == id), "{ends:?}");
}

/// [`rig_with_patterns`] on a driver with `cuMemcpyBatchAsync`, and its engine.
fn batching_rig() -> (Rig, CudaEngine) {
    let r = rig_with_patterns();
    r.fake.set_batch(true);
    let engine = r.engine(0).unwrap();
    (r, engine)
}

/// Whether slots 0, 1 and 2 hold what `SCATTERED` copied into them.
fn holds_scattered(r: &Rig) -> bool {
    r.sub_slot(0, 0) == pattern(1)
        && r.sub_slot(1, 0) == pattern(0)
        && r.sub_slot(2, 0) == pattern(2)
}

/// Blocks adjacent both in the region and on the device are one copy, in either direction,
/// and the bytes land as if copied one by one.
#[test]
fn adjacent_blocks_are_one_copy() {
    let r = rig_with_patterns();
    let mut engine = r.engine(0).unwrap();
    engine
        .submit(
            job(
                1,
                Direction::ToRegion,
                &[(1, 0), (2, BLOCK), (3, 2 * BLOCK)],
            ),
            &r.done,
        )
        .unwrap();
    assert!(matches!(
        r.settle(&mut engine)[..],
        [(TransferId(1), Ok(()))]
    ));
    assert_eq!(
        r.fake.calls(Call::CopyToHost),
        1,
        "three adjacent blocks, one copy"
    );
    for b in 0..3u32 {
        assert!(r.sub_slot(b + 1, 0) == pattern(b as u8), "slot {}", b + 1);
    }
    r.fake.device_write(0, &vec![0; 3 * BLOCK]);
    // Adjacent pairs (1, 2) and (3 → block 0) are not: two copies.
    engine
        .submit(
            job(
                2,
                Direction::ToDevice,
                &[(1, BLOCK), (2, 2 * BLOCK), (3, 0)],
            ),
            &r.done,
        )
        .unwrap();
    assert!(matches!(
        r.settle(&mut engine)[..],
        [(TransferId(2), Ok(()))]
    ));
    assert_eq!(r.fake.calls(Call::CopyToDevice), 2);
    assert_eq!(
        r.fake.device_read(0, 3 * BLOCK),
        [pattern(2), pattern(0), pattern(1)].concat()
    );
    // Adjacent on the device (blocks 0, 1) but not in the region (slots 3, 1): two copies.
    let copies = r.fake.calls(Call::CopyToHost);
    run_ok(
        &r,
        &mut engine,
        job(3, Direction::ToRegion, &[(3, 0), (1, BLOCK)]),
    );
    assert_eq!(r.fake.calls(Call::CopyToHost), copies + 2);
    assert!(r.sub_slot(3, 0) == pattern(2) && r.sub_slot(1, 0) == pattern(0));
}

/// Where the driver has `cuMemcpyBatchAsync`, a transfer's copies go to it in batched calls
/// (of at most `BATCH_MAX`, two here: three copies take two calls), each direction, and the
/// bytes land as copied one by one.
#[test]
fn a_transfers_copies_go_in_batched_calls_where_the_driver_has_them() {
    let (r, mut engine) = batching_rig();
    run_ok(&r, &mut engine, job(1, Direction::ToRegion, SCATTERED));
    assert!(holds_scattered(&r));
    r.fake.device_write(0, &vec![0; 3 * BLOCK]);
    run_ok(&r, &mut engine, job(2, Direction::ToDevice, SCATTERED));
    for b in 0..3 {
        assert!(
            r.fake.device_read(b * BLOCK, BLOCK) == pattern(b as u8),
            "block {b}"
        );
    }
    assert_eq!(r.fake.calls(Call::CopyBatch), 4);
    assert_eq!(
        r.fake.calls(Call::CopyToHost) + r.fake.calls(Call::CopyToDevice),
        0
    );
}

/// The second batched call of a transfer fails (the first was queued): every copy is queued
/// again one by one and the bytes land.
#[test]
fn a_failing_second_batch_falls_back_to_single_copies() {
    let (r, mut engine) = batching_rig();
    r.fake
        .fail_nth(Call::CopyBatch, 2, cudaError_enum::CUDA_ERROR_INVALID_VALUE);
    run_ok(&r, &mut engine, job(1, Direction::ToRegion, SCATTERED));
    assert!(holds_scattered(&r));
    assert_eq!(r.fake.calls(Call::CopyToHost), 3);
}

/// Copies whose destinations overlap (which no caller should give) are not batched, whose
/// copies may run in any order: they run one by one, in order, and the last one wins.
#[test]
fn overlapping_destinations_are_copied_one_by_one_in_order() {
    let (r, mut engine) = batching_rig();
    engine
        .submit(job(1, Direction::ToRegion, SCATTERED), &r.done)
        .unwrap();
    assert_eq!(r.settle(&mut engine).len(), 1);
    let batches = r.fake.calls(Call::CopyBatch);
    // Slots 0 and 2 both to device block 1.
    engine
        .submit(
            job(2, Direction::ToDevice, &[(0, BLOCK), (2, BLOCK)]),
            &r.done,
        )
        .unwrap();
    assert!(matches!(
        r.settle(&mut engine)[..],
        [(TransferId(2), Ok(()))]
    ));
    assert_eq!(r.fake.calls(Call::CopyBatch), batches, "not batched");
    assert_eq!(r.fake.calls(Call::CopyToDevice), 2);
    assert!(
        r.fake.device_read(BLOCK, BLOCK) == pattern(2),
        "the last copy wins"
    );
}

/// `coalesce` merges a copy into the one before it only where both its region offset and
/// its device address continue that copy.
#[test]
fn coalesce_merges_only_copies_adjacent_on_both_sides() {
    use super::coalesce;
    let b = BLOCK;
    let d = DEVICE_BASE;
    let bu = b as u64;
    // Both sides adjacent: one copy.
    assert_eq!(coalesce(&[(0, d, b), (b, d + bu, b)]), [(0, d, 2 * b)]);
    // Adjacent on the device only, or in the region only: two copies.
    assert_eq!(
        coalesce(&[(2 * b, d, b), (0, d + bu, b)]),
        [(2 * b, d, b), (0, d + bu, b)]
    );
    assert_eq!(
        coalesce(&[(0, d + 2 * bu, b), (b, d, b)]),
        [(0, d + 2 * bu, b), (b, d, b)]
    );
    // Descending on both sides: the second does not continue the first.
    assert_eq!(
        coalesce(&[(b, d + bu, b), (0, d, b)]),
        [(b, d + bu, b), (0, d, b)]
    );
    // A run of three, then a break, then a run of two.
    assert_eq!(
        coalesce(&[
            (0, d, b),
            (b, d + bu, b),
            (2 * b, d + 2 * bu, b),
            (5 * b, d + 9 * bu, b),
            (6 * b, d + 10 * bu, b),
        ]),
        [(0, d, 3 * b), (5 * b, d + 9 * bu, 2 * b)]
    );
    assert_eq!(coalesce(&[]), []);
}

/// A batch that fails part way (some of its copies queued): the transfer's copies are all
/// queued again one by one (the same bytes to the same places, on the same stream), the
/// transfer succeeds, and later transfers copy one by one.
#[test]
fn a_batch_failing_part_way_falls_back_to_single_copies() {
    let (r, mut engine) = batching_rig();
    r.fake.hold(true);
    r.fake.fail_next_batch_after(1);
    engine
        .submit(job(1, Direction::ToRegion, SCATTERED), &r.done)
        .unwrap();
    assert_eq!(
        r.fake.pending_copies(),
        4,
        "the batch's first copy, then all three"
    );
    r.fake.hold(false);
    assert!(matches!(
        r.settle(&mut engine)[..],
        [(TransferId(1), Ok(()))]
    ));
    assert!(holds_scattered(&r));
    assert_eq!(r.fake.calls(Call::CopyToHost), 3);
    run_ok(&r, &mut engine, job(2, Direction::ToRegion, SCATTERED));
    assert_eq!(
        r.fake.calls(Call::CopyBatch),
        1,
        "batching stays off after a failure"
    );
    assert_eq!(r.fake.calls(Call::CopyToHost), 6);
}

/// A batch fails part way and then the first single copy fails too: copies of the job may
/// be queued, so it is not refused; it ends, failed, through poll once they have run.
#[test]
fn a_failed_batch_then_a_failed_copy_ends_through_poll() {
    let (r, mut engine) = batching_rig();
    r.fake.hold(true);
    r.fake.fail_next_batch_after(2);
    r.fake.fail_nth(
        Call::CopyToHost,
        1,
        cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS,
    );
    engine
        .submit(job(3, Direction::ToRegion, SCATTERED), &r.done)
        .expect("copies of the batch may be queued: the job ends through poll");
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(3), Err(_))]), "{ends:?}");
    assert_eq!(
        r.fake.pending_copies(),
        0,
        "reported while a copy was queued"
    );
}

/// A single copy never goes through the batch call.
#[test]
fn a_single_copy_is_not_batched() {
    let (r, mut engine) = batching_rig();
    run_ok(&r, &mut engine, job(1, Direction::ToRegion, &[(2, BLOCK)]));
    assert_eq!(r.fake.calls(Call::CopyBatch), 0);
    assert_eq!(r.fake.calls(Call::CopyToHost), 1);
    assert!(r.sub_slot(2, 0) == pattern(1));
}

/// The job's event cannot be recorded after its copies were queued: as above.
#[test]
fn an_event_failing_after_the_copies_were_queued_ends_through_poll() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    r.fake.hold(true);
    r.fake
        .fail_next_engine_record(cudaError_enum::CUDA_ERROR_LAUNCH_FAILED);
    engine
        .submit(job(5, Direction::ToDevice, &[(0, 0), (1, BLOCK)]), &r.done)
        .expect("a job with queued copies ends through poll");
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(5), Err(_))]), "{ends:?}");
    assert_eq!(
        r.fake.pending_copies(),
        0,
        "reported while a copy was queued"
    );
}

/// The first copy is refused: nothing was queued, so submit answers the error, no
/// completion follows and nothing is left behind.
#[test]
fn a_submit_refused_before_any_copy_was_queued_reports_nothing() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    let handles = r.fake.live_handles();
    r.fake.fail_nth(
        Call::CopyToDevice,
        1,
        cudaError_enum::CUDA_ERROR_INVALID_VALUE,
    );
    let err = engine
        .submit(job(6, Direction::ToDevice, &[(0, 0), (1, BLOCK)]), &r.done)
        .unwrap_err();
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_VALUE"),
        "{err}"
    );
    assert!(r.settle(&mut engine).is_empty());
    assert_eq!(r.fake.pending_copies(), 0);
    assert_eq!(r.fake.live_handles(), handles, "an event was left behind");
}

/// The driver answers an error for a job's event: the job is reported failed only once its
/// stream has drained.
#[test]
fn a_failed_event_query_reports_only_after_the_stream_drained() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    r.fake.hold(true);
    engine
        .submit(job(8, Direction::ToRegion, &[(0, 0)]), &r.done)
        .unwrap();
    r.fake.fail_nth(
        Call::EventQuery,
        r.fake.calls(Call::EventQuery) + 1,
        cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS,
    );
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(8), Err(_))]), "{ends:?}");
    assert_eq!(
        r.fake.pending_copies(),
        0,
        "reported while a copy was queued"
    );
}

/// By default the copies wait for the work queued on the legacy default stream: a store
/// reads the block the compute kernel queued there writes, not what was there before.
#[test]
fn a_store_waits_for_the_default_stream() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    r.fake.launch(std::ptr::null_mut(), 0, &pattern(9));
    engine
        .submit(job(0, Direction::ToRegion, &[(0, 0)]), &r.done)
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(0), Ok(()))]), "{ends:?}");
    assert!(
        r.sub_slot(0, 0) == pattern(9),
        "the sub-slot holds other bytes"
    );
}

/// With a compute stream set, a store reads the blocks only after the work queued there,
/// and a load overwrites its blocks only after it: a kernel still writing (or reading)
/// the old block cannot run after the load.
#[test]
fn copies_wait_for_the_compute_stream_set() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    let compute = r.fake.user_stream();
    // SAFETY: a stream of the fake driver, live as long as the fake.
    unsafe { engine.set_compute_stream(compute) };
    r.fake.launch(compute, 0, &pattern(4));
    engine
        .submit(job(0, Direction::ToRegion, &[(0, 0)]), &r.done)
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(0), Ok(()))]), "{ends:?}");
    assert!(
        r.sub_slot(0, 0) == pattern(4),
        "the sub-slot holds other bytes"
    );

    r.region.write_sub(SlotId(1), 0, &pattern(2)).unwrap();
    r.fake.launch(compute, BLOCK, &pattern(7));
    engine
        .submit(job(1, Direction::ToDevice, &[(1, BLOCK)]), &r.done)
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(1), Ok(()))]), "{ends:?}");
    r.fake.run_all();
    assert!(
        r.fake.device_read(BLOCK, BLOCK) == pattern(2),
        "the device holds other bytes"
    );
}

/// The copy stream cannot be made to wait for the compute stream: the job is refused with
/// nothing queued and nothing left behind.
#[test]
fn a_job_that_cannot_wait_for_the_compute_stream_is_refused() {
    let r = rig(4, 1, 2);
    let mut engine = r.engine(0).unwrap();
    let handles = r.fake.live_handles();
    r.fake.fail_nth(
        Call::StreamWait,
        1,
        cudaError_enum::CUDA_ERROR_INVALID_HANDLE,
    );
    let err = engine
        .submit(job(0, Direction::ToRegion, &[(0, 0)]), &r.done)
        .unwrap_err();
    assert!(err.to_string().contains("cuStreamWaitEvent"), "{err}");
    assert_eq!(r.fake.pending_copies(), 0);
    assert!(r.settle(&mut engine).is_empty());
    assert_eq!(r.fake.live_handles(), handles);
}

/// An engine over two device ranges (two KV tensors): a block made of one piece from each
/// goes into one sub-slot, side by side, and back to other addresses, byte for byte.
#[test]
fn pieces_from_several_ranges_fill_one_sub_slot() {
    let r = rig(4, 1, 8);
    let half = BLOCK / 2;
    let ranges = [
        (DEVICE_BASE + 4 * BLOCK as u64, 2 * BLOCK),
        (DEVICE_BASE, 2 * BLOCK),
    ];
    // SAFETY: the fake driver's memory, which lives as long as the fake.
    let mut engine =
        unsafe { CudaEngine::with_api(r.fake.clone(), r.region.clone(), 0, 0, &ranges) }.unwrap();
    r.fake.device_write(0, &pattern(3)[..half]);
    r.fake.device_write(4 * BLOCK, &pattern(4)[..half]);
    let piece = |device: u64, at: usize| Piece {
        slot: SlotId(2),
        at,
        device,
        len: half,
    };
    engine
        .submit_pieces(
            TransferId(0),
            Direction::ToRegion,
            &[
                piece(DEVICE_BASE, 0),
                piece(DEVICE_BASE + 4 * BLOCK as u64, half),
            ],
        )
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(0), Ok(()))]), "{ends:?}");
    let sub = r.sub_slot(2, 0);
    assert!(sub[..half] == pattern(3)[..half] && sub[half..] == pattern(4)[..half]);
    engine
        .submit_pieces(
            TransferId(1),
            Direction::ToDevice,
            &[
                piece(DEVICE_BASE + BLOCK as u64, 0),
                piece(DEVICE_BASE + 5 * BLOCK as u64, half),
            ],
        )
        .unwrap();
    let ends = r.settle(&mut engine);
    assert!(matches!(ends[..], [(TransferId(1), Ok(()))]), "{ends:?}");
    assert!(r.fake.device_read(BLOCK, half) == pattern(3)[..half]);
    assert!(r.fake.device_read(5 * BLOCK, half) == pattern(4)[..half]);
}

/// A piece in the gap between two ranges, one across a range's end, or one past its
/// sub-slot is refused before anything is queued; overlapping ranges are refused at once.
#[test]
fn pieces_outside_the_ranges_or_the_sub_slot_are_refused() {
    let r = rig(4, 1, 8);
    let ranges = [
        (DEVICE_BASE, BLOCK),
        (DEVICE_BASE + 4 * BLOCK as u64, BLOCK),
    ];
    // SAFETY: the fake driver's memory, which lives as long as the fake.
    let mut engine =
        unsafe { CudaEngine::with_api(r.fake.clone(), r.region.clone(), 0, 0, &ranges) }.unwrap();
    let good = Piece {
        slot: SlotId(0),
        at: 0,
        device: DEVICE_BASE,
        len: 64,
    };
    for (bad, device_memory) in [
        (
            Piece {
                device: DEVICE_BASE + 2 * BLOCK as u64,
                ..good
            },
            true,
        ),
        (
            Piece {
                device: DEVICE_BASE + BLOCK as u64 - 32,
                ..good
            },
            true,
        ),
        (
            Piece {
                device: u64::MAX - 10,
                ..good
            },
            true,
        ),
        (
            Piece {
                at: BLOCK - 32,
                ..good
            },
            false,
        ),
        (
            Piece {
                at: usize::MAX - 8,
                ..good
            },
            false,
        ),
        (
            Piece {
                slot: SlotId(4),
                ..good
            },
            false,
        ),
    ] {
        let err = engine
            .submit_pieces(TransferId(0), Direction::ToRegion, &[good, bad])
            .unwrap_err();
        if device_memory {
            assert!(matches!(err, EngineError::DeviceMemory { .. }), "{err}");
        } else {
            assert!(
                matches!(err, EngineError::Memory(RegionError::OutOfRange { .. })),
                "{err}"
            );
        }
    }
    assert_eq!(r.fake.calls(Call::CopyToHost), 0);
    assert!(r.settle(&mut engine).is_empty());
    let overlapping = [
        (DEVICE_BASE, 2 * BLOCK),
        (DEVICE_BASE + BLOCK as u64, BLOCK),
    ];
    // SAFETY: as above; the engine is refused.
    let err = unsafe { CudaEngine::with_api(r.fake.clone(), r.region.clone(), 0, 0, &overlapping) }
        .unwrap_err();
    assert!(err.to_string().contains("overlaps"), "{err}");
}
