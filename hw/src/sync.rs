//! The synchronisation primitives shared between threads, swapped for loom's under the `loom`
//! feature so that the loom tests explore every interleaving of the code that uses them.

#[cfg(feature = "loom")]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(feature = "loom"))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning: every critical section in this crate leaves the data
/// consistent before anything in it can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
