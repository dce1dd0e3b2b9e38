//! kvtier-hw binds the pure `kvtier-core` state machine to real memory, GPUs and disks.
//!
//! - [`Region`]: the primary tier's bytes, shared memory mapped by every worker process:
//!   anonymous (freed with the last process that holds it) or a file.
//! - [`TransferEngine`]: GPU ↔ CPU copies; [`HostEngine`] here, `CudaEngine` with the `cuda`
//!   feature.
//! - [`SecondaryStore`]: a tier's block storage; [`FileStore`] is the persistent file tier,
//!   [`RedisStore`] is the shared tier on Redis or Redis Cluster, [`FaultyStore`] injects
//!   faults into any store; [`crash`] checks the file tier's crash
//!   consistency against a simulated disk that crashes and tears writes.
//! - [`HostedDriver`]: one store as a secondary tier of another engine's tiering manager
//!   (vLLM 0.33's `TieringOffloadingSpec`), over that engine's primary memory ([`HostRows`]).
//! - [`Driver`]: owns the core on one thread, drains its effects into the engine and the
//!   tiers, and feeds completions back.
//! - [`bench`](mod@bench): the `kvtier bench` workload, trace reader, Belady's optimum and report.
//!
//! Architecture invariant: only the driver thread calls the core; IO threads only push
//! completions onto a [`Queue`].

mod affinity;
mod checksum;
#[allow(unsafe_code)]
mod copy;
mod driver;
mod engine;
mod faulty;
#[allow(unsafe_code)]
mod hosted;
mod io;
mod metrics;
mod queue;
#[allow(unsafe_code)]
mod region;
mod store;
mod sync;

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;

pub mod bench;

pub use affinity::{AffinityError, Cpus};
pub use copy::{STREAM_MIN, copy_bulk};
pub use driver::{Driver, DriverOptions, ShutdownReport, Waiter};
pub use engine::{
    BlockCopy, Completion, Completions, CopyJob, Direction, EngineError, HostEngine,
    TransferEngine, TransferId,
};
pub use faulty::{FaultCounts, FaultHandle, Faults, FaultyStore};
pub use hosted::{HostRows, HostedDone, HostedDriver, HostedIoStats};
pub use io::{JobPath, TierDone};
pub use metrics::{
    IoMetrics, PROMOTION_LATENCIES_KEPT, Path, PathMetrics, PathSummary, TierMetrics,
};
pub use queue::{Countdown, Queue};
pub use region::{
    ANONYMOUS_PREFIX, HostMemory, Layout, PAGE, Region, RegionError, RegionKind, free_bytes,
    page_align,
};
pub use store::file::{
    CHECKPOINT_FILE, DATA_FILE, FORMAT_VERSION, FileOptions, FileStore, FsyncPolicy, INDEX_FILE,
    LOCK_FILE, MAX_IDENTITY_BYTES, MAX_KEY_BYTES, OpenReport, TEMP_FILE, crash,
};
pub use store::redis::{RedisOptions, RedisStore};
pub use store::s3::{S3Options, S3Store};
pub use store::{SecondaryStore, StoreError};

#[cfg(feature = "cuda")]
pub use cuda::{CudaEngine, Piece, driver_present as cuda_driver_present};
/// A CUDA stream handle (the driver's `CUstream`), as [`CudaEngine::set_compute_stream`] takes it.
#[cfg(feature = "cuda")]
pub use cudarc::driver::sys::CUstream as CudaStream;

/// An error of the hardware layer.
#[derive(Debug, thiserror::Error)]
pub enum HwError {
    /// The core refused a call (its state is unchanged).
    #[error(transparent)]
    Core(#[from] kvtier_core::Error),
    /// The core's configuration is invalid.
    #[error(transparent)]
    Config(#[from] kvtier_core::ConfigError),
    /// The memory region could not be set up or used.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// A secondary store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A transfer failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The parts given to the driver do not fit together.
    #[error("setup: {0}")]
    Setup(String),
    /// The transfer ended, but its result was dropped before anyone waited for it (see
    /// `DriverOptions::kept_results`).
    #[error(
        "transfer {0} ended and its result was dropped: more than `kept_results` results of ended transfers were waiting to be taken"
    )]
    ResultDropped(u64),
}
