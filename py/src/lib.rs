//! `kvtier._native`: the Rust half of the Python package `kvtier`.
//!
//! - `Manager` (`src/manager.rs`): the scheduler side, a [`kvtier_hw::Driver`] whose GPU ↔
//!   CPU copies are done by the inference engine's workers; vLLM 0.33's `OffloadingManager`
//!   calls map one to one onto its methods (`kvtier/vllm.py` adapts the shapes).
//! - `Worker` (`src/worker.rs`): one tensor-parallel rank's transfer handler, copying between
//!   the engine's KV tensors and the rank's sub-slots of the shared region.
//!
//! - `PageCache` (`src/pages.rs`): kvtier's tiers as a page store that an engine's host
//!   memory pool reads from and writes to by address (SGLang's HiCache backend,
//!   `kvtier/sglang.py`).
//! - `HostedTier` (`src/hosted.rs`): one kvtier store as a secondary tier of vLLM 0.33's own
//!   `TieringOffloadingManager` (`kvtier/vllm_tiers.py`), over that manager's primary memory.
//!
//! Errors become the typed exceptions of `src/errors.rs`: a bad setting is a `ValueError` naming it,
//! a refused call leaves the state as it was.

mod errors;
#[allow(unsafe_code)]
mod hosted;
mod log;
mod manager;
#[allow(unsafe_code)]
mod pages;
#[allow(unsafe_code)]
mod worker;

use pyo3::prelude::*;

/// Whether the CUDA driver library can be loaded here (a GPU KV cache needs it).
#[pyfunction]
fn cuda_driver_present() -> bool {
    kvtier_hw::cuda_driver_present()
}

/// The module `kvtier._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    log::install();
    m.add_class::<manager::Manager>()?;
    m.add_class::<worker::Worker>()?;
    m.add_class::<hosted::HostedTier>()?;
    m.add_class::<pages::PageCache>()?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
