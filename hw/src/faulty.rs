//! A deterministic fault injector around any [`SecondaryStore`], for tests and for sizing
//! experiments with failing tiers.

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Key, TierKind};

use crate::store::{SecondaryStore, StoreError};
use crate::sync::{Mutex, lock};

/// The faults to inject, changeable while the store runs (see [`FaultyStore::faults`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Every `put` fails with an IO error.
    pub fail_puts: bool,
    /// Every `get` fails with an IO error.
    pub fail_gets: bool,
    /// Every `get` flips one byte of the block after the inner read: what a bad cable or a
    /// store without checksums would hand back. The wrapper then reports it as corrupt, the way
    /// a verifying tier must.
    pub corrupt_gets: bool,
    /// Health checks and existence probes fail (a dead server).
    pub unreachable: bool,
    /// After this many more bytes are written, every `put` fails with "no space left".
    pub space_left: Option<u64>,
    /// Every `put` first sleeps this long (a slow disk or a congested network).
    pub put_delay: Option<Duration>,
    /// Every `put` and `get` panics (a bug in a store): the job must still end, as failed.
    pub panic: bool,
    /// Every `get` blocks until this is cleared (a frozen network mount, a stuck disk, a
    /// stopped server): the read then goes on as if nothing happened.
    pub hang_gets: bool,
}

/// Counts of what the wrapper did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Operations failed on purpose.
    pub injected: u64,
    /// Blocks written through.
    pub puts: u64,
    /// `put` calls begun (counted on entry, before any injected delay).
    pub puts_begun: u64,
    /// Blocks read through.
    pub gets: u64,
    /// `get` calls begun (counted on entry, before any hang).
    pub gets_begun: u64,
}

#[derive(Default)]
struct Control {
    faults: Faults,
    counts: FaultCounts,
}

/// Wraps a store and fails its operations as [`Faults`] says.
pub struct FaultyStore {
    inner: Arc<dyn SecondaryStore>,
    control: Arc<Mutex<Control>>,
}

/// A handle to change a [`FaultyStore`]'s faults from a test while IO threads use it.
#[derive(Clone)]
pub struct FaultHandle {
    control: Arc<Mutex<Control>>,
}

impl FaultHandle {
    /// Replaces the faults.
    pub fn set(&self, faults: Faults) {
        lock(&self.control).faults = faults;
    }

    /// What was done so far.
    pub fn counts(&self) -> FaultCounts {
        lock(&self.control).counts.clone()
    }
}

impl FaultyStore {
    /// Wraps `inner` with no faults set.
    pub fn new(inner: Arc<dyn SecondaryStore>) -> Self {
        FaultyStore {
            inner,
            control: Arc::new(Mutex::new(Control::default())),
        }
    }

    /// A handle to set faults later.
    pub fn faults(&self) -> FaultHandle {
        FaultHandle {
            control: self.control.clone(),
        }
    }

    fn injected(&self, what: &str) -> StoreError {
        lock(&self.control).counts.injected += 1;
        StoreError::Unavailable(format!("injected fault: {what}"))
    }
}

impl SecondaryStore for FaultyStore {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn kind(&self) -> TierKind {
        self.inner.kind()
    }

    fn capacity_blocks(&self) -> u32 {
        self.inner.capacity_blocks()
    }

    fn put(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        let (delay, panic) = {
            let mut c = lock(&self.control);
            c.counts.puts_begun += 1;
            (c.faults.put_delay, c.faults.panic)
        };
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        assert!(!panic, "injected panic in put of {key}");
        {
            let mut c = lock(&self.control);
            if c.faults.fail_puts {
                c.counts.injected += 1;
                return Err(StoreError::Unavailable("injected fault: write".into()));
            }
            if let Some(left) = c.faults.space_left.as_mut() {
                if *left < block.len() as u64 {
                    let available = *left;
                    c.counts.injected += 1;
                    return Err(StoreError::NoSpace {
                        path: "(injected)".into(),
                        needed: block.len() as u64,
                        available,
                    });
                }
                *left -= block.len() as u64;
            }
            c.counts.puts += 1;
        }
        self.inner.put(key, block)
    }

    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        lock(&self.control).counts.gets_begun += 1;
        while lock(&self.control).faults.hang_gets {
            std::thread::sleep(Duration::from_millis(1));
        }
        let faults = lock(&self.control).faults.clone();
        assert!(!faults.panic, "injected panic in get of {key}");
        if faults.fail_gets {
            return Err(self.injected("read"));
        }
        self.inner.get(key, block)?;
        lock(&self.control).counts.gets += 1;
        if faults.corrupt_gets {
            if let Some(b) = block.first_mut() {
                *b ^= 0xff;
            }
            lock(&self.control).counts.injected += 1;
            return Err(StoreError::Corrupt {
                key: key.clone(),
                reason: "injected corruption",
            });
        }
        Ok(())
    }

    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        self.inner.delete(key)
    }

    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        if lock(&self.control).faults.unreachable {
            return Err(self.injected("probe"));
        }
        self.inner.contains(key)
    }

    fn check(&self) -> Result<(), StoreError> {
        let f = lock(&self.control).faults.clone();
        if f.unreachable || f.fail_puts || f.fail_gets {
            return Err(self.injected("health check"));
        }
        self.inner.check()
    }

    fn recovered(&self) -> Vec<Key> {
        self.inner.recovered()
    }
}
