//! The CUDA engine. Without a GPU driver it must refuse with a clear error (checked on every
//! machine built with `--features cuda`); the copy test needs a GPU and runs only with
//! `KVTIER_CUDA_TESTS=1`.
#![cfg(all(feature = "cuda", not(loom)))]

use std::sync::Arc;

use kvtier_hw::{CudaEngine, Layout, Region, cuda_driver_present};

fn region(dir: &std::path::Path) -> Arc<Region> {
    Arc::new(Region::create(&dir.join("region"), Layout::new(4, 1, 4096).unwrap(), 1).unwrap())
}

#[test]
fn without_a_driver_the_engine_refuses_clearly() {
    if cuda_driver_present() {
        return; // a GPU machine: covered by the test below
    }
    let dir = tempfile::tempdir().unwrap();
    let err = CudaEngine::new(region(dir.path()), 0, 0, 0, 0).unwrap_err();
    assert!(err.to_string().contains("CUDA driver library"), "{err}");
}

/// A block goes GPU → region slot 0 → GPU at another offset, byte for byte.
#[test]
#[allow(unsafe_code)]
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
    let mut engine =
        CudaEngine::new(region(dir.path()), 0, 0, dptr, 2 * 4096).expect("a GPU is present");
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
