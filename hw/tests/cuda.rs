//! The CUDA engine. Without a GPU driver it must refuse with a clear error, and bad arguments
//! are refused before the driver is asked (both checked on every machine built with
//! `--features cuda`); the copy test needs a GPU and runs only with `KVTIER_CUDA_TESTS=1`.
//! The engine's behaviour on driver failures is tested on a fake driver, in the crate's unit
//! tests (`cargo test -p kvtier-hw --features cuda --lib cuda`).
#![cfg(all(feature = "cuda", not(feature = "loom")))]
#![allow(unsafe_code)]

use std::sync::Arc;

use kvtier_hw::{CudaEngine, EngineError, Layout, Region, cuda_driver_present};

/// A directory in memory (`/dev/shm`) where there is one, as regions are placed: the kernel
/// may refuse to pin a file region elsewhere (see the test below).
fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

fn region(dir: &std::path::Path) -> Arc<Region> {
    Arc::new(Region::create(&dir.join("region"), Layout::new(4, 1, 4096).unwrap(), 1).unwrap())
}

#[test]
fn without_a_driver_the_engine_refuses_clearly() {
    if cuda_driver_present() {
        return; // a GPU machine: covered by the test below
    }
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: refused before any device memory is used.
    let err = unsafe { CudaEngine::new(region(dir.path()), 0, 0, 0x1000, 4096) }.unwrap_err();
    assert!(err.to_string().contains("CUDA driver library"), "{err}");
}

/// The region has one worker: worker 1 is refused, with or without a GPU.
#[test]
fn a_worker_the_region_lacks_is_refused_before_the_driver_is_asked() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: refused before any device memory is used.
    let err = unsafe { CudaEngine::new(region(dir.path()), 1, 0, 0x1000, 4096) }.unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::NoSuchWorker {
                worker: 1,
                workers: 1
            }
        ),
        "{err}"
    );
}

/// Blocks go GPU → region → GPU at other offsets, byte for byte: one block alone, and three
/// scattered on the GPU in one job (one batched call where the driver has
/// `cuMemcpyBatchAsync`), in both directions.
#[test]
fn copies_reach_the_gpu_and_back() {
    use cudarc::driver::result;
    use kvtier_core::SlotId;
    use kvtier_hw::{BlockCopy, Completion, CopyJob, Direction, Queue, TransferEngine, TransferId};
    if std::env::var("KVTIER_CUDA_TESTS").as_deref() != Ok("1") {
        return; // needs a GPU: set KVTIER_CUDA_TESTS=1
    }
    const B: usize = 4096;
    let dir = shm_dir();
    let pattern: Vec<u8> = (0..8 * B as u32)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    // SAFETY: the primary context of GPU 0 is made current before allocating on it.
    let dptr = unsafe {
        result::init().unwrap();
        let ctx = result::primary_ctx::retain(result::device::get(0).unwrap()).unwrap();
        result::ctx::set_current(ctx).unwrap();
        let dptr = result::malloc_sync(16 * B).unwrap();
        result::memcpy_htod_sync(dptr, &pattern).unwrap();
        dptr
    };
    // SAFETY: `dptr` holds 16 blocks of GPU 0, freed only when the process ends.
    let mut engine = unsafe { CudaEngine::new(region(dir.path()), 0, 0, dptr, 16 * B) }
        .expect("a GPU is present");
    let done = Arc::new(Queue::new());
    let job = |id: u64, direction, copies: &[(u32, usize)]| CopyJob {
        id: TransferId(id),
        direction,
        copies: copies
            .iter()
            .map(|&(slot, block)| BlockCopy {
                slot: SlotId(slot),
                device_offset: block * B,
            })
            .collect(),
    };
    // One block: device block 0 → slot 3 → device block 8.
    // Three: device blocks 5, 2, 7 → slots 0, 1, 2 → device blocks 12, 10, 14.
    let jobs = [
        job(0, Direction::ToRegion, &[(3, 0)]),
        job(1, Direction::ToDevice, &[(3, 8)]),
        job(2, Direction::ToRegion, &[(0, 5), (1, 2), (2, 7)]),
        job(3, Direction::ToDevice, &[(0, 12), (1, 10), (2, 14)]),
    ];
    for j in jobs {
        engine.submit(j, &done).unwrap();
        while engine.poll(&done) {}
    }
    let mut ends = Vec::new();
    done.drain_into(&mut ends);
    assert_eq!(ends.len(), 4);
    for end in &ends {
        assert!(
            matches!(end, Completion::Transfer { result: Ok(()), .. }),
            "{end:?}"
        );
    }
    let mut back = vec![0u8; 16 * B];
    // SAFETY: `dptr` holds 16 blocks, allocated above.
    unsafe { result::memcpy_dtoh_sync(&mut back, dptr).unwrap() };
    let block = |buf: &[u8], b: usize| buf[b * B..(b + 1) * B].to_vec();
    assert!(block(&back, 8) == block(&pattern, 0), "the single block");
    for (from, to) in [(5, 12), (2, 10), (7, 14)] {
        assert!(
            block(&back, to) == block(&pattern, from),
            "device block {from} came back at {to} changed"
        );
    }
}

/// A file region on a disk filesystem: where the kernel refuses to pin it, the engine's
/// error says why and what to do, not only the driver's error code.
#[test]
fn a_region_the_kernel_will_not_pin_is_refused_with_the_reason() {
    use cudarc::driver::result;
    if std::env::var("KVTIER_CUDA_TESTS").as_deref() != Ok("1") {
        return; // needs a GPU: set KVTIER_CUDA_TESTS=1
    }
    // The working directory: a disk filesystem on the machines this runs on.
    let dir = tempfile::tempdir_in(".").unwrap();
    let fs = nix::sys::statfs::statfs(dir.path())
        .unwrap()
        .filesystem_type();
    if fs == nix::sys::statfs::TMPFS_MAGIC {
        return; // nothing to check: the working directory is in memory
    }
    // SAFETY: the primary context of GPU 0 is made current before allocating on it.
    let dptr = unsafe {
        result::init().unwrap();
        let ctx = result::primary_ctx::retain(result::device::get(0).unwrap()).unwrap();
        result::ctx::set_current(ctx).unwrap();
        result::malloc_sync(4096).unwrap()
    };
    // SAFETY: `dptr` holds 4096 bytes of GPU 0, freed only when the process ends.
    match unsafe { CudaEngine::new(region(dir.path()), 0, 0, dptr, 4096) } {
        Ok(_) => {} // this kernel pins file mappings
        Err(e) => assert!(
            e.to_string().contains("put the region under /dev/shm"),
            "{e}"
        ),
    }
}
