//! kvtier's errors as Python exceptions.
//!
//! `KvtierError` is the base of all of them. A bad setting is `ConfigError`, which is also a
//! `ValueError`; a call the core refused is `StateError` (the state is unchanged); memory,
//! tier and transfer failures have their own classes.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use kvtier_hw::{EngineError, HwError, StoreError};

create_exception!(
    _native,
    KvtierError,
    PyException,
    "Base class of every error kvtier raises."
);
create_exception!(
    _native,
    ConfigError,
    PyValueError,
    "A setting is missing or invalid; the message names it."
);
create_exception!(
    _native,
    StateError,
    KvtierError,
    "The core refused a call that does not fit the blocks' states (for example loading a block that is not ready); nothing changed."
);
create_exception!(
    _native,
    RegionError,
    KvtierError,
    "The shared CPU region could not be created, attached or used."
);
create_exception!(
    _native,
    TierError,
    KvtierError,
    "A secondary tier could not be opened or used."
);
create_exception!(
    _native,
    TransferError,
    KvtierError,
    "A GPU <-> CPU transfer was refused or failed."
);

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("StateError", py.get_type::<StateError>())?;
    m.add("RegionError", py.get_type::<RegionError>())?;
    m.add("TierError", py.get_type::<TierError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    Ok(())
}

/// The exception for an error of the hardware layer.
pub(crate) fn hw(e: HwError) -> PyErr {
    match e {
        HwError::Core(e) => StateError::new_err(e.to_string()),
        HwError::Config(e) => ConfigError::new_err(e.to_string()),
        HwError::Region(e) => region(e),
        HwError::Store(e) => store(e),
        HwError::Engine(e) => engine(e),
        e @ (HwError::Setup(_) | HwError::ResultDropped(_)) => KvtierError::new_err(e.to_string()),
    }
}

/// The exception for a region error.
pub(crate) fn region(e: kvtier_hw::RegionError) -> PyErr {
    RegionError::new_err(e.to_string())
}

/// The exception for a secondary store's error.
pub(crate) fn store(e: StoreError) -> PyErr {
    TierError::new_err(e.to_string())
}

/// The exception for a transfer engine's error.
pub(crate) fn engine(e: EngineError) -> PyErr {
    TransferError::new_err(e.to_string())
}

/// A `ConfigError` naming the setting `key`.
pub(crate) fn config(key: &str, reason: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(format!("{key}: {reason}"))
}
