//! The CUDA engine. Without a GPU driver it must refuse with a clear error, and bad arguments
//! are refused before the driver is asked (both checked on every machine built with
//! `--features cuda`); the copy test needs a GPU and runs only with `KVTIER_CUDA_TESTS=1`.
//! The engine's behaviour on driver failures is tested on a fake driver, in the crate's unit
//! tests (`cargo test -p kvtier-hw --features cuda --lib cuda`).
#![cfg(all(feature = "cuda", not(feature = "loom")))]
#![allow(unsafe_code)]

use std::sync::Arc;

use kvtier_hw::{CudaEngine, EngineError, Layout, Region, cuda_driver_present};

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

/// A block goes GPU → region slot 0 → GPU at another offset, byte for byte.
#[test]
fn copies_reach_the_gpu_and_back() {
    use cudarc::driver::result;
    use kvtier_core::SlotId;
    use kvtier_hw::{BlockCopy, CopyJob, Direction, Queue, TransferEngine, TransferId};
    if std::env::var("KVTIER_CUDA_TESTS").as_deref() != Ok("1") {
        return; // needs a GPU: set KVTIER_CUDA_TESTS=1
    }
    let dir = tempfile::tempdir().unwrap();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    // SAFETY: the primary context of GPU 0 is made current before allocating on it.
    let dptr = unsafe {
        result::init().unwrap();
        let ctx = result::primary_ctx::retain(result::device::get(0).unwrap()).unwrap();
        result::ctx::set_current(ctx).unwrap();
        let dptr = result::malloc_sync(2 * 4096).unwrap();
        result::memcpy_htod_sync(dptr, &pattern).unwrap();
        dptr
    };
    // SAFETY: `dptr` holds 2 * 4096 bytes of GPU 0, freed only when the process ends.
    let mut engine = unsafe { CudaEngine::new(region(dir.path()), 0, 0, dptr, 2 * 4096) }
        .expect("a GPU is present");
    let done = Arc::new(Queue::new());
    for (id, direction, offset) in [(0, Direction::ToRegion, 0), (1, Direction::ToDevice, 4096)] {
        let copies = vec![BlockCopy {
            slot: SlotId(0),
            device_offset: offset,
        }];
        engine
            .submit(
                CopyJob {
                    id: TransferId(id),
                    direction,
                    copies,
                },
                &done,
            )
            .unwrap();
        while engine.poll(&done) {}
    }
    let mut ends = Vec::new();
    done.drain_into(&mut ends);
    assert_eq!(ends.len(), 2);
    let mut back = vec![0u8; 4096];
    // SAFETY: `dptr + 4096` holds 4096 bytes allocated above.
    unsafe { result::memcpy_dtoh_sync(&mut back, dptr + 4096).unwrap() };
    assert_eq!(back, pattern);
}
