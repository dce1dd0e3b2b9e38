//! kvtier's errors as Python exceptions.
//!
//! `KvtierError` is the base of all of them. A bad setting is `ConfigError`, which is also a
//! `ValueError`; a call the core refused is `StateError` (the blocks' states are unchanged);
//! memory, tier and transfer failures have their own classes.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use kvtier_hw::{EngineError, HwError, StoreError};

create_exception!(
    _native,
    KvtierError,
    PyException,
    "Base class of every error kvtier raises."
);
/// `ConfigError(KvtierError, ValueError)`: two bases, which `create_exception!` cannot give,
/// so the class is made with `type()` when the module is first imported.
static CONFIG_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn config_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    CONFIG_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<KvtierError>().into_any(),
                    py.get_type::<pyo3::exceptions::PyValueError>().into_any(),
                ],
            )?;
            let attrs = PyDict::new(py);
            attrs.set_item(
                "__doc__",
                "A setting is missing or invalid; the message names it.",
            )?;
            attrs.set_item("__module__", "kvtier._native")?;
            let cls = py
                .get_type::<PyType>()
                .call1(("ConfigError", bases, attrs))?
                .cast_into::<PyType>()?;
            Ok(cls.unbind())
        })
        .map(|t| t.bind(py))
}
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
    m.add("ConfigError", config_error_type(py)?)?;
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
        HwError::Config(e) => config_error(e.to_string()),
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
    config_error(format!("{key}: {reason}"))
}

/// A `ConfigError` with `message`.
pub(crate) fn config_error(message: String) -> PyErr {
    Python::attach(|py| match config_error_type(py) {
        Ok(cls) => PyErr::from_type(cls.clone(), message),
        Err(e) => e,
    })
}
