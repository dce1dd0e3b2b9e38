//! Crash consistency of the file tier, checked.
//!
//! A scenario of stores (one block or a job of several), deletes, reads, syncs and clean
//! restarts runs against a simulated directory that counts the tier's IO operations and
//! crashes at a chosen one; the writes that were not synced then reach the disk whole, in
//! part (sector by sector) or not at all. The tier reopened from what survived must:
//!
//! - serve only bytes that were stored under the key asked for (★1);
//! - keep every block its [`FsyncPolicy`] acknowledged durable, with exactly those bytes;
//! - account its records right: after the crash it takes new blocks until it is full, and
//!   serves them and the recovered ones back exactly.
//!
//! A scenario may go on after the reopen (verifying every payload at open or not) with more
//! work and a second crash, checked the same way.
//!
//! [`run`] reads a scenario from bytes (the `file_crash` fuzz target); [`run_seed`] from a
//! seed (the proptest in `hw/tests/file_crash.rs`).

use std::collections::{BTreeMap, BTreeSet};

use arbitrary::Unstructured;
use kvtier_core::Key;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use super::sim::{SimDir, Tear};
use super::{FileOptions, FileStore, FsyncPolicy, file_len};
use crate::region::PAGE;
use crate::store::{SecondaryStore, StoreError};

/// Distinct keys a scenario uses (more than the tier holds, so it fills up).
const KEYS: u32 = 12;

/// What one scenario did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CrashRun {
    /// The fsync policy it ran under.
    pub policy: FsyncPolicy,
    /// IO operations done before the crash.
    pub ops: u64,
    /// Whether the crash came in the middle of an operation (rather than after the last).
    pub crashed_mid_operation: bool,
    /// Blocks acknowledged durable at the crash.
    pub durable: usize,
    /// Blocks the reopened tier found.
    pub recovered: usize,
    /// Records dropped at reopen (torn headers).
    pub dropped_at_open: usize,
    /// Reads after the crash that failed verification (torn payloads, never served).
    pub torn_reads: u64,
    /// Whether the reopened tier read a checkpoint and the headers it named (rather than
    /// every header).
    pub from_checkpoint: bool,
    /// Whether the reopen after the (first) crash verified every payload.
    pub verified_at_open: bool,
    /// Whether the reopened tier did more work and crashed again (and was checked after
    /// both crashes).
    pub crashed_twice: bool,
    /// Whether the scenario ended with a process death (the tier reopened from the page
    /// cache, everything it served before checked) and then a power loss (what that open
    /// served checked again).
    pub process_died: bool,
}

/// A broken promise.
#[derive(Debug, thiserror::Error)]
pub enum Violation {
    /// A read returned bytes that were never stored under its key.
    #[error("block {key} was served bytes never stored under it")]
    WrongBytes {
        /// The key.
        key: Key,
    },
    /// A read returned an older version than the one acknowledged durable.
    #[error("block {key} was served an older version than the one acknowledged durable")]
    Stale {
        /// The key.
        key: Key,
    },
    /// A block acknowledged durable is gone after the crash.
    #[error(
        "block {key}, acknowledged durable under fsync policy {policy}, is lost after the crash: {reason}"
    )]
    Lost {
        /// The key.
        key: Key,
        /// The policy.
        policy: FsyncPolicy,
        /// How the read failed.
        reason: String,
    },
    /// The tier did not open again after the crash.
    #[error("the tier did not reopen after the crash: {0}")]
    Reopen(String),
    /// An operation failed, or answered wrong, with no crash to explain it.
    #[error("{0}")]
    Unexpected(String),
}

/// Block `i`'s key: short (its header fits in one sector) or long (its header spans sectors,
/// so a crash can tear the header itself).
fn key(i: u32, long: bool) -> Key {
    let mut k = format!("block-{i}").into_bytes();
    if long {
        k.resize(1500, b'.');
    }
    Key::new(&k)
}

/// The bytes of version `version` of block `k`.
fn content(k: u32, version: u32, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    SmallRng::seed_from_u64((u64::from(k) << 32) | u64::from(version)).fill_bytes(&mut out);
    out
}

/// What the scenario knows the tier holds.
#[derive(Default)]
struct Model {
    /// Every version ever handed to `put` under a key (whether it succeeded or not).
    ever: BTreeMap<u32, BTreeSet<u32>>,
    /// The version the tier holds now.
    held: BTreeMap<u32, u32>,
    /// The version acknowledged durable and not deleted since.
    durable: BTreeMap<u32, u32>,
    next_version: u32,
}

impl Model {
    fn fresh(&mut self, k: u32) -> u32 {
        self.next_version += 1;
        self.ever.entry(k).or_default().insert(self.next_version);
        self.next_version
    }

    /// Which version `bytes` is, if any.
    fn which(&self, k: u32, bytes: &[u8]) -> Option<u32> {
        self.ever
            .get(&k)?
            .iter()
            .copied()
            .find(|&v| content(k, v, bytes.len()) == bytes)
    }
}

fn unexpected(what: &str, e: impl std::fmt::Display) -> Violation {
    Violation::Unexpected(format!("{what}: {e}"))
}

/// Runs the scenario described by `seed`.
pub fn run_seed(seed: u64) -> Result<CrashRun, Violation> {
    let mut bytes = vec![0u8; 256];
    SmallRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    run(&bytes)
}

/// Runs the scenario described by `data` (any bytes are a scenario).
pub fn run(data: &[u8]) -> Result<CrashRun, Violation> {
    let mut u = Unstructured::new(data);
    let mut byte = || u.arbitrary::<u8>().unwrap_or(0);
    let policy = [FsyncPolicy::None, FsyncPolicy::Batch, FsyncPolicy::Write][byte() as usize % 3];
    let block = PAGE * (1 + byte() as usize % 2);
    let mut records = 2 + u32::from(byte()) % 7;
    let crash_at = u64::from(u16::from_le_bytes([byte(), byte()]) % 72);
    let sector = if byte() % 2 == 0 { 512 } else { PAGE };
    let tear = [
        Tear::Sectors,
        Tear::Sectors,
        Tear::Writes,
        Tear::KeepAll,
        Tear::DropAll,
    ][byte() as usize % 5];
    let tear_seed = u64::from_le_bytes(std::array::from_fn(|_| byte()));
    let steps = 1 + byte() % 48;
    let long = byte() % 3 == 0;
    let options = FileOptions {
        direct_io: false,
        identity: "crash-test".into(),
        fsync: policy,
        verify_at_open: false,
    };
    let cap = |records: u32| file_len(block, records);
    let dir = SimDir::new(sector, crash_at);
    let mut m = Model::default();
    let mut store = match FileStore::open_in(&dir, block, cap(records), options.clone()) {
        Ok(s) => Some(s),
        Err(_) if dir.crashed() => None,
        Err(e) => return Err(unexpected("open", e)),
    };
    play(
        &mut byte,
        &dir,
        &mut store,
        &mut m,
        steps,
        block,
        &mut records,
        &options,
        long,
    )?;
    // The power goes out here (if the crash point was not reached yet).
    let crashed_mid_operation = dir.crashed();
    let ops = dir.ops();
    dir.crash_now();
    drop(store.take());
    let mut rng = SmallRng::seed_from_u64(tear_seed);
    let after = dir.after_crash(tear, &mut || rng.random());
    // Read after the first phase, so that inputs written before these choices existed (they
    // read as 0 past the end) still describe the scenario they did.
    let verify_at_open = byte() % 2 == 1;
    let again = byte() % 2 == 1;
    let reopened = FileOptions {
        verify_at_open,
        ..options
    };
    let store = FileStore::open_in(&after, block, cap(records), reopened.clone())
        .map_err(|e| Violation::Reopen(e.to_string()))?;
    let mut outcome = CrashRun {
        policy,
        ops,
        crashed_mid_operation,
        durable: m.durable.len(),
        recovered: store.open_report().recovered,
        dropped_at_open: store.open_report().corrupt,
        torn_reads: 0,
        from_checkpoint: store.open_report().from_checkpoint,
        verified_at_open: verify_at_open,
        crashed_twice: false,
        process_died: false,
    };
    check_after_crash(&store, &m, block, policy, long)?;
    outcome.torn_reads = store.corrupt_reads();
    let (store, after, m) = if again {
        // More work on the reopened tier, and a second crash: what the first reopen did (the
        // records it dropped, the sequence numbers it chose) must hold up after another.
        let mut m = settle(&store, &m, block, long)?;
        let crash_at = u64::from(byte()) % 48;
        after.crash_after(crash_at);
        let steps = 1 + byte() % 24;
        let tear_seed = u64::from_le_bytes(std::array::from_fn(|_| byte()));
        let third = FileOptions {
            verify_at_open: byte() % 2 == 1,
            ..reopened.clone()
        };
        let mut store = Some(store);
        play(
            &mut byte,
            &after,
            &mut store,
            &mut m,
            steps,
            block,
            &mut records,
            &reopened,
            long,
        )?;
        after.crash_now();
        drop(store.take());
        let mut rng = SmallRng::seed_from_u64(tear_seed);
        let again = after.after_crash(tear, &mut || rng.random());
        let store = FileStore::open_in(&again, block, cap(records), third)
            .map_err(|e| Violation::Reopen(format!("after a second crash: {e}")))?;
        outcome.crashed_twice = true;
        outcome.dropped_at_open += store.open_report().corrupt;
        check_after_crash(&store, &m, block, policy, long)?;
        outcome.torn_reads += store.corrupt_reads();
        (store, again, m)
    } else {
        (store, after, m)
    };
    // A last phase, chosen by bytes read after all the others (so that an input written
    // before it existed, reading 0 past its end, skips it): the process dies with the power
    // on, the tier reopens from what the page cache holds, and then the power goes out.
    let (store, after, m) = if byte() % 2 == 1 {
        let verify_at_open = byte() % 2 == 1;
        let tear_seed = u64::from_le_bytes(std::array::from_fn(|_| byte()));
        // What it serves before the process dies: a process that dies loses none of it.
        let m = settle(&store, &m, block, long)?;
        after.crash_now();
        drop(store);
        let alive = after.after_process_death();
        let opened = FileOptions {
            verify_at_open,
            ..reopened.clone()
        };
        let store = FileStore::open_in(&alive, block, cap(records), opened.clone())
            .map_err(|e| Violation::Reopen(format!("after the process died: {e}")))?;
        check_after_crash(&store, &m, block, policy, long)?;
        // What that open serves is acknowledged durable: a power loss now keeps it.
        let m = settle(&store, &m, block, long)?;
        alive.crash_now();
        drop(store);
        let mut rng = SmallRng::seed_from_u64(tear_seed);
        let lost_power = alive.after_crash(tear, &mut || rng.random());
        let store = FileStore::open_in(&lost_power, block, cap(records), opened)
            .map_err(|e| Violation::Reopen(format!("after a power loss: {e}")))?;
        check_after_crash(&store, &m, block, policy, long)?;
        outcome.process_died = true;
        (store, lost_power, m)
    } else {
        (store, after, m)
    };
    fill_and_check(&store, &m, block, long)?;
    if after.names().iter().any(|n| n == super::TEMP_FILE) {
        return Err(Violation::Unexpected(
            "a half-created tier was left behind".into(),
        ));
    }
    Ok(outcome)
}

/// The model of a tier reopened after a crash, as the core would leave it: what it serves
/// (all of it durable: the crash left nothing unsynced), with every block that fails its read
/// deleted.
fn settle(s: &FileStore, m: &Model, block: usize, long: bool) -> Result<Model, Violation> {
    let mut out = Model {
        ever: m.ever.clone(),
        held: BTreeMap::new(),
        durable: BTreeMap::new(),
        next_version: m.next_version,
    };
    for k in 0..KEYS {
        let mut buf = vec![0u8; block];
        match s.get(&key(k, long), &mut buf) {
            Ok(()) => {
                let v = m
                    .which(k, &buf)
                    .ok_or(Violation::WrongBytes { key: key(k, long) })?;
                out.held.insert(k, v);
                out.durable.insert(k, v);
            }
            Err(StoreError::NotFound { .. }) => {}
            Err(StoreError::Corrupt { .. }) => s
                .delete(&key(k, long))
                .map_err(|e| unexpected("deleting a torn block", e))?,
            Err(e) => return Err(unexpected("get after the crash", e)),
        }
    }
    Ok(out)
}

/// Runs `steps` steps of the scenario against `store` in `dir`, keeping the model.
#[allow(clippy::too_many_arguments)]
fn play(
    byte: &mut dyn FnMut() -> u8,
    dir: &SimDir,
    store: &mut Option<FileStore>,
    m: &mut Model,
    steps: u8,
    block: usize,
    records: &mut u32,
    options: &FileOptions,
    long: bool,
) -> Result<(), Violation> {
    let policy = options.fsync;
    let cap = |records: u32| file_len(block, records);
    for _ in 0..steps {
        let Some(s) = store.as_ref() else { break };
        if dir.crashed() {
            break;
        }
        match byte() % 10 {
            op @ 0..=4 => {
                // One put, or a job of up to four distinct blocks.
                let n = if op < 3 { 1 } else { 1 + byte() as usize % 4 };
                let mut keys: Vec<u32> = Vec::new();
                while keys.len() < n {
                    let k = u32::from(byte()) % KEYS;
                    if keys.contains(&k) {
                        break;
                    }
                    keys.push(k);
                }
                let versions: Vec<u32> = keys.iter().map(|&k| m.fresh(k)).collect();
                let bytes: Vec<Vec<u8>> = keys
                    .iter()
                    .zip(&versions)
                    .map(|(&k, &v)| content(k, v, block))
                    .collect();
                let ks: Vec<Key> = keys.iter().map(|&k| key(k, long)).collect();
                let results = if n == 1 && op < 3 {
                    vec![s.put(&ks[0], &bytes[0])]
                } else {
                    let batch: Vec<(&Key, &[u8])> =
                        ks.iter().zip(&bytes).map(|(k, b)| (k, &b[..])).collect();
                    s.put_many(&batch)
                };
                // A job takes a free record per new block, in order: `Full` once none is left.
                let held_before = m.held.len();
                let mut allocated = 0;
                for ((&k, &v), r) in keys.iter().zip(&versions).zip(results) {
                    if m.held.contains_key(&k) {
                        if let Err(e) = r {
                            return Err(unexpected("put of a held block", e));
                        }
                        continue;
                    }
                    match r {
                        Err(StoreError::Full { .. })
                            if held_before + allocated >= *records as usize => {}
                        Err(StoreError::Full { .. }) => {
                            return Err(Violation::Unexpected(format!(
                                "put answered Full with {} of {} records used",
                                held_before + allocated,
                                *records
                            )));
                        }
                        Ok(()) => {
                            allocated += 1;
                            m.held.insert(k, v);
                            if policy != FsyncPolicy::None {
                                m.durable.insert(k, v);
                            }
                        }
                        Err(_) if dir.crashed() => allocated += 1,
                        Err(e) => return Err(unexpected("put", e)),
                    }
                }
            }
            5..=6 => {
                let k = u32::from(byte()) % KEYS;
                s.delete(&key(k, long))
                    .map_err(|e| unexpected("delete", e))?;
                m.held.remove(&k);
                m.durable.remove(&k);
            }
            7 => {
                let k = u32::from(byte()) % KEYS;
                let mut buf = vec![0u8; block];
                match (s.get(&key(k, long), &mut buf), m.held.get(&k)) {
                    (Ok(()), Some(&v)) if buf == content(k, v, block) => {}
                    (Ok(()), _) => return Err(Violation::WrongBytes { key: key(k, long) }),
                    (Err(StoreError::NotFound { .. }), None) => {}
                    (Err(_), _) if dir.crashed() => {}
                    (Err(e), _) => return Err(unexpected("get before the crash", e)),
                }
            }
            8 => {
                // A clean restart, sometimes with more room.
                drop(store.take());
                if dir.crashed() {
                    break;
                }
                m.durable = m.held.clone();
                if byte().is_multiple_of(2) {
                    *records += 1 + u32::from(byte()) % 3;
                }
                let s = match FileStore::open_in(dir, block, cap(*records), options.clone()) {
                    Ok(s) => s,
                    Err(_) if dir.crashed() => break,
                    Err(e) => return Err(unexpected("reopen", e)),
                };
                learn_resurrected(&s, m, block, long)?;
                *store = Some(s);
            }
            _ => match s.sync() {
                Ok(()) => m.durable = m.held.clone(),
                Err(_) if dir.crashed() => {}
                Err(e) => return Err(unexpected("sync", e)),
            },
        }
    }
    Ok(())
}

/// After a clean restart, deleted blocks may be found again: learn which versions.
fn learn_resurrected(
    s: &FileStore,
    m: &mut Model,
    block: usize,
    long: bool,
) -> Result<(), Violation> {
    for k in 0..KEYS {
        let mut buf = vec![0u8; block];
        match s.get(&key(k, long), &mut buf) {
            Ok(()) => {
                let v = m
                    .which(k, &buf)
                    .ok_or(Violation::WrongBytes { key: key(k, long) })?;
                match m.held.get(&k) {
                    Some(&held) if held != v => return Err(Violation::Stale { key: key(k, long) }),
                    _ => {
                        m.held.insert(k, v);
                    }
                }
            }
            Err(StoreError::NotFound { .. }) if !m.held.contains_key(&k) => {}
            Err(e) => return Err(unexpected("get after a clean restart", e)),
        }
    }
    if s.len() != m.held.len() {
        return Err(Violation::Unexpected(format!(
            "after a clean restart the tier holds {} blocks, {} readable",
            s.len(),
            m.held.len()
        )));
    }
    Ok(())
}

fn check_after_crash(
    s: &FileStore,
    m: &Model,
    block: usize,
    policy: FsyncPolicy,
    long: bool,
) -> Result<(), Violation> {
    for k in 0..KEYS {
        let mut buf = vec![0u8; block];
        let got = s.get(&key(k, long), &mut buf);
        if got.is_ok() != s.contains(&key(k, long)).unwrap_or(false)
            && !matches!(got, Err(StoreError::Corrupt { .. }))
        {
            return Err(Violation::Unexpected(format!(
                "block {k}: contains and get disagree"
            )));
        }
        match got {
            Ok(()) => {
                let v = m
                    .which(k, &buf)
                    .ok_or(Violation::WrongBytes { key: key(k, long) })?;
                if m.durable.get(&k).is_some_and(|&d| d != v) {
                    return Err(Violation::Stale { key: key(k, long) });
                }
            }
            Err(e @ (StoreError::NotFound { .. } | StoreError::Corrupt { .. })) => {
                if m.durable.contains_key(&k) {
                    return Err(Violation::Lost {
                        key: key(k, long),
                        policy,
                        reason: e.to_string(),
                    });
                }
            }
            Err(e) => return Err(unexpected("get after the crash", e)),
        }
    }
    let recovered: BTreeSet<Key> = s.recovered().into_iter().collect();
    let held: BTreeSet<Key> = (0..KEYS)
        .map(|k| key(k, long))
        .filter(|k| s.contains(k).unwrap_or(false))
        .collect();
    if recovered != held || s.len() != held.len() {
        return Err(Violation::Unexpected(format!(
            "recovered {} keys, the tier holds {} ({} counted)",
            recovered.len(),
            held.len(),
            s.len()
        )));
    }
    Ok(())
}

/// Fills every free record with new blocks, then reads everything back.
fn fill_and_check(s: &FileStore, m: &Model, block: usize, long: bool) -> Result<(), Violation> {
    let before: Vec<(u32, Vec<u8>)> = (0..KEYS)
        .filter_map(|k| {
            let mut buf = vec![0u8; block];
            s.get(&key(k, long), &mut buf).ok().map(|()| (k, buf))
        })
        .collect();
    let free = s.capacity_blocks() as usize - s.len();
    let fresh: Vec<u32> = (1000..1000 + free as u32 + 1).collect();
    for (n, &k) in fresh.iter().enumerate() {
        match s.put(&key(k, long), &content(k, 0, block)) {
            Ok(()) if n < free => {}
            Err(StoreError::Full { .. }) if n == free => {}
            other => {
                return Err(Violation::Unexpected(format!(
                    "filling {free} free records after the crash, block {n}: {other:?}"
                )));
            }
        }
    }
    for &k in &fresh[..free] {
        let mut buf = vec![0u8; block];
        s.get(&key(k, long), &mut buf)
            .map_err(|e| unexpected("reading a block stored after the crash", e))?;
        if buf != content(k, 0, block) {
            return Err(Violation::WrongBytes { key: key(k, long) });
        }
    }
    for (k, bytes) in before {
        let mut buf = vec![0u8; block];
        s.get(&key(k, long), &mut buf)
            .map_err(|e| unexpected("rereading a recovered block", e))?;
        if buf != bytes || m.which(k, &buf).is_none() {
            return Err(Violation::WrongBytes { key: key(k, long) });
        }
    }
    Ok(())
}
