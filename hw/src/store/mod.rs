//! The secondary-store seam: put, get and delete of one block in a tier.
//!
//! A store is shared by the tier's IO threads (`put`, `get`, `contains`, `check` run on them,
//! concurrently) and the driver thread (`delete`, in effect order). Which block may be read,
//! written or deleted when is decided by the core's tier index: a store never evicts on its
//! own, and the core never deletes a block that a job reads or writes (I8).

pub(crate) mod file;
pub(crate) mod redis;
pub(crate) mod s3;
pub(crate) mod value;

use std::io;
use std::path::PathBuf;

use kvtier_core::{Key, TierKind};

/// Why a store operation failed. Inside the core every one of these is just a failed job
/// (`Outcome::Failed`); the kind is logged and counted.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store does not hold the key.
    #[error("block {key} not found")]
    NotFound {
        /// The block.
        key: Key,
    },
    /// What was read back is not what was written: never served.
    #[error("block {key} failed verification: {reason}")]
    Corrupt {
        /// The block.
        key: Key,
        /// What did not match.
        reason: &'static str,
    },
    /// No record is free (the core's index and the store disagree about capacity).
    #[error("store full: no free record for block {key}")]
    Full {
        /// The block.
        key: Key,
    },
    /// The disk has no room.
    #[error("no space left: {path} needs {needed} bytes, {available} are free")]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// Bytes needed.
        needed: u64,
        /// Bytes free.
        available: u64,
    },
    /// A block or key of the wrong size.
    #[error("bad block: {0}")]
    BadInput(String),
    /// An existing store was created with another layout; opening it would lose its blocks.
    #[error(
        "store at {path} has {found}, this configuration asks for {expected}; use the same settings or another path"
    )]
    Layout {
        /// The store's files.
        path: PathBuf,
        /// What is on disk.
        found: String,
        /// What the configuration asks for.
        expected: String,
    },
    /// Another open store holds the path (a second tier or process given the same path):
    /// sharing it would destroy each other's blocks.
    #[error(
        "store at {path} is already open in {}; give each tier its own path, or stop the other one first",
        holder.map_or_else(|| "another tier or process".to_string(), |p| if p == std::process::id() { format!("this process (pid {p}): two tiers share the path") } else { format!("process {p}") })
    )]
    Locked {
        /// The store's files.
        path: PathBuf,
        /// The holder's process id, as it wrote it in the lock file.
        holder: Option<u32>,
    },
    /// An existing store holds blocks of another model or KV layout than this configuration.
    #[error(
        "store at {path} holds blocks of {found:?}, this configuration is {expected:?}; use another path for another model or layout"
    )]
    Identity {
        /// The store's files.
        path: PathBuf,
        /// The identity recorded in the store.
        found: String,
        /// The identity asked for.
        expected: String,
    },
    /// An existing store was written in an on-disk format this build does not read.
    #[error(
        "store at {path} has on-disk format version {found}, this build reads version {supported} only; remove it (its blocks are a cache) or use another path"
    )]
    Version {
        /// The store's files.
        path: PathBuf,
        /// The version found.
        found: u32,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// An IO call failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The store cannot be reached (a dead server, an injected fault).
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// A credential from the environment variable `var` names, if a configuration names one
/// (credentials never live in configuration files); `lookup` is the environment. A named
/// variable that is not set is an error naming it and `what` it was to hold.
pub(crate) fn credential_from_env(
    var: Option<&str>,
    what: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, StoreError> {
    var.map(|v| {
        lookup(v).ok_or_else(|| {
            StoreError::BadInput(format!(
                "the {what} is to come from the environment variable {v}, which is not set"
            ))
        })
    })
    .transpose()
}

/// One secondary tier's storage of blocks, each a row of the primary region.
pub trait SecondaryStore: Send + Sync + 'static {
    /// A short name for logs and reports ("file", "remote").
    fn name(&self) -> &str;

    /// Authoritative (only this node writes it) or shared (other nodes write it too).
    fn kind(&self) -> TierKind;

    /// How many blocks it holds at most.
    fn capacity_blocks(&self) -> u32;

    /// Writes `block` under `key`. Called on an IO thread.
    fn put(&self, key: &Key, block: &[u8]) -> Result<(), StoreError>;

    /// Reads `key` into `block` and verifies it (key, length, checksum): on `Ok` the bytes
    /// are exactly the ones `put` wrote. Called on an IO thread.
    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError>;

    /// Writes a job's blocks (distinct keys); one result per block, in order, each as `put`
    /// would answer it. A store that can batch IO overrides it; by default, one `put` each.
    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        blocks.iter().map(|(k, b)| self.put(k, b)).collect()
    }

    /// Reads a job's blocks; one result per block, in order, each as `get` would answer it.
    /// A store that can batch IO overrides it; by default, one `get` each.
    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        blocks.iter_mut().map(|(k, b)| self.get(k, b)).collect()
    }

    /// Forgets `key`; its room may be reused by the next `put`. Called on the driver thread
    /// in effect order, before any later `put` of the same tier is submitted: it must not
    /// block for long.
    fn delete(&self, key: &Key) -> Result<(), StoreError>;

    /// Whether the store holds `key` (a shared tier's existence probe). Called on an IO thread.
    fn contains(&self, key: &Key) -> Result<bool, StoreError>;

    /// The existence probes of one step, together; one answer per key, in order, each as
    /// `contains` would give it. A remote store overrides it to ask in one round trip; by
    /// default, one `contains` each.
    fn contains_many(&self, keys: &[&Key]) -> Vec<Result<bool, StoreError>> {
        keys.iter().map(|k| self.contains(k)).collect()
    }

    /// A health probe: `Ok` when the store can serve again. Called on an IO thread.
    fn check(&self) -> Result<(), StoreError>;

    /// The keys the store held when it was opened, oldest first (durability, ★6).
    fn recovered(&self) -> Vec<Key>;
}

/// A boxed store is a store (the bench opens shared stores by their kind, as trait objects).
impl<S: SecondaryStore + ?Sized> SecondaryStore for Box<S> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn kind(&self) -> TierKind {
        (**self).kind()
    }
    fn capacity_blocks(&self) -> u32 {
        (**self).capacity_blocks()
    }
    fn put(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        (**self).put(key, block)
    }
    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        (**self).get(key, block)
    }
    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        (**self).put_many(blocks)
    }
    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        (**self).get_many(blocks)
    }
    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        (**self).delete(key)
    }
    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        (**self).contains(key)
    }
    fn contains_many(&self, keys: &[&Key]) -> Vec<Result<bool, StoreError>> {
        (**self).contains_many(keys)
    }
    fn check(&self) -> Result<(), StoreError> {
        (**self).check()
    }
    fn recovered(&self) -> Vec<Key> {
        (**self).recovered()
    }
}
