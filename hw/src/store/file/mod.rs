//! The file tier: a persistent, authoritative secondary store in one data file.
//!
//! Layout (all little-endian, every part page-aligned so `O_DIRECT` works):
//!
//! ```text
//! offset 0           superblock page: two copies of 2 KiB, each: magic "KVTIERFS", format
//!                    version, identity length, generation, block bytes, record count,
//!                    length and xxh3 of the clean-close index (0 while open), checksum of
//!                    the fields and the identity, identity; the valid copy of the highest
//!                    generation is in force, and each update writes the other copy
//! PAGE + i*record    record i: a header page, then the block (block bytes, page multiple)
//! header page        magic "KVTBLOCK", format version, key length, payload length,
//!                    sequence number, payload checksum (xxh3 of the fields, key and payload),
//!                    header checksum (xxh3 of the fields before it and the key), key
//! ```
//!
//! `blocks.kvt.index` holds the index as the last clean close left it (key, record and
//! sequence number of each block). `blocks.kvt.checkpoint` holds the last checkpoint of the
//! index written while open: the same, the generation of the superblock the session's open
//! wrote, and the records that may be written before the next checkpoint; a length and an
//! xxh3 of it come first.
//!
//! **Creation is atomic.** A new tier is built under a temporary name in the same directory
//! (room reserved, superblock written, synced) and published by a rename, then the directory
//! is synced: a path holds a complete tier or nothing. A temporary left by a creator that died
//! is removed by the next open.
//!
//! **One opener.** An open tier holds an exclusive `flock` on `blocks.kvt.lock` (which names
//! the holder's process id) for as long as it lives; a second opener, in this process or
//! another, gets [`StoreError::Locked`].
//!
//! **Identity.** The superblock records the block size and an opaque identity given by the
//! caller (the model and its KV layout); opening with another is [`StoreError::Identity`], so
//! a tier never serves blocks of another model with the same layout.
//!
//! **Opening** (★6) after a clean close reads the index that close wrote (the superblock
//! names it by length and checksum). Opening marks the superblock dirty before any write, so
//! after a crash the superblock names no index. Opening then reads the last checkpoint of the
//! session that crashed and the headers of the records it names, and of no other: a store
//! takes only records a checkpoint reserved (the next free ones: a sixteenth of the records,
//! at least 64),
//! and when none is left it writes and syncs a new checkpoint (the index, the next reserved
//! records and those of jobs still writing) before it writes a block; records freed meanwhile
//! wait for the next checkpoint. A block found in a named record replaces the checkpoint's if
//! its sequence number is higher. With no checkpoint of that session (it crashed before its
//! first store, or while writing one), opening reads every record header. A record whose
//! header does not verify (torn by a crash, corrupted on disk) is dropped and counted in
//! [`OpenReport::corrupt`], and so, at an open with [`FileOptions::verify_at_open`], is one
//! whose payload does not; the header of each is cleared and synced, whatever the policy, so
//! no later open finds it again (a torn payload behind a valid header may have hidden an older
//! copy of its key, which the open then serves: a crash that undid the clearing would bring
//! the torn copy, newer, back over it); the next sequence number is above
//! that of every header that verified, dropped records included; every read checks that the header names the key and the sequence
//! number the index holds, so a record holding another write is never served. Either way the payload is verified by every read (★1):
//! a payload torn behind a valid header is found at its first read, fails that read (never
//! served) and is counted in [`FileStore::corrupt_reads`]. [`FileOptions::verify_at_open`]
//! verifies every payload at open instead (reading the whole file). A deleted block's record
//! is only forgotten, and reused by a later write; after a crash, a deleted block whose record
//! was not reused yet may be found again (when the checkpoint in force still names it, or the
//! open read every header), verified, as if it had never been evicted.
//!
//! **Durability** follows [`FsyncPolicy`]. A failed sync (under any policy, or of
//! [`FileStore::sync`]) marks the tier failed ([`FileStore::failed`]): Linux reports a
//! writeback error once, to whichever sync comes first, so no later sync proves anything
//! durable. From then on every job fails, the health check fails, and closing writes no
//! clean-close index (the next open reads the headers and verifies what it serves).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IoSlice, IoSliceMut};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvtier_core::{Key, TierKind};

use crate::region::{PAGE, page_align};
use crate::store::{SecondaryStore, StoreError};
use crate::sync::{Mutex, lock};

pub mod crash;
mod disk;
mod group;
mod sim;
#[cfg(test)]
mod tests;

use disk::{DataFile, Dir, LockError, RealDir};
use group::GroupCommit;

const SUPER_MAGIC: &[u8; 8] = b"KVTIERFS";
const RECORD_MAGIC: &[u8; 8] = b"KVTBLOCK";
/// The on-disk format version. Version 1 had no identity, no header checksum and one
/// superblock copy; a version 1 tier is refused with [`StoreError::Version`].
pub const FORMAT_VERSION: u32 = 2;
/// Bytes of a record header before the key.
const HEADER_FIXED: usize = 48;
/// The longest key a record holds.
pub const MAX_KEY_BYTES: usize = PAGE - HEADER_FIXED;
/// Bytes of one superblock copy (two per superblock page).
const SUPER_COPY: usize = PAGE / 2;
/// Bytes of a superblock copy before the identity.
const SUPER_FIXED: usize = 64;
/// The longest identity a tier records.
pub const MAX_IDENTITY_BYTES: usize = 1024;
/// The data file's name inside the tier directory.
pub const DATA_FILE: &str = "blocks.kvt";
/// The lock file's name inside the tier directory; it holds the holder's process id.
pub const LOCK_FILE: &str = "blocks.kvt.lock";
/// The name a new tier is built under before it is published as [`DATA_FILE`].
pub const TEMP_FILE: &str = "blocks.kvt.new";
/// The index written at a clean close, read by the next open instead of every header.
pub const INDEX_FILE: &str = "blocks.kvt.index";
const INDEX_MAGIC: &[u8; 8] = b"KVTINDEX";
/// The checkpoint of the index written while the tier is open, read by an open after a crash.
pub const CHECKPOINT_FILE: &str = "blocks.kvt.checkpoint";
const CHECKPOINT_MAGIC: &[u8; 8] = b"KVTCHKPT";
/// Bytes of the checkpoint's header: magic, generation, body length, body checksum.
const CHECKPOINT_HEADER: usize = 32;
/// Records written by one `pwritev` at most (two IO vectors each, under `IOV_MAX`).
const MAX_RUN: usize = 256;
/// Bytes of one run at most (Linux moves at most `0x7ffff000` bytes per `preadv`/`pwritev`;
/// longer runs are moved by several calls anyway, so nothing is gained past this).
const MAX_RUN_BYTES: u64 = 1 << 30;

/// A page of memory aligned for `O_DIRECT`.
pub(crate) struct PageBuf {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

impl PageBuf {
    pub(crate) fn new(len: usize) -> Self {
        let len = page_align(len.max(1));
        let buf = vec![0u8; len + PAGE];
        let off = buf.as_ptr().align_offset(PAGE);
        PageBuf { buf, off, len }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// When the file tier makes what it wrote durable (`fdatasync`), and so which blocks survive a
/// power loss. A block is **acknowledged durable** once the call named below returned `Ok`
/// for it: after a power loss the reopened tier serves it, with exactly the bytes stored.
/// Whatever the policy, a block is never served wrong (★1): a write cut short by a crash is
/// dropped at open or fails its first read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Never sync while open; the OS writes back when it decides (with `O_DIRECT`, as the
    /// write returns, but the device may still hold it in a volatile cache). Acknowledged
    /// durable: the blocks held when the tier is closed (dropped) cleanly, and those an open
    /// after a power loss served (what it repaired is synced before it serves). A process
    /// that dies loses nothing (its writes reached the device, or the page cache); a power
    /// loss may lose any block stored since the tier was opened, and never serves one wrong.
    /// The default: a cache tier's blocks can always be recomputed, and a sync per job bounds
    /// small blocks' cascades (vLLM's file tier does not sync either).
    #[default]
    None,
    /// One `fdatasync` per job at most, shared between concurrent jobs (group commit):
    /// `put_many` (and `put`, a job of one), after all its writes, waits for a sync that
    /// started after they completed, and starts one if none is running; jobs that finish
    /// their writes while a sync runs share the next. A failed sync fails every block of
    /// every job that relied on it. Acknowledged durable: every block `put`/`put_many`
    /// returned `Ok` for.
    Batch,
    /// Every write is synced before the call goes on: `put` syncs its block, `put_many` syncs
    /// each run of adjacent blocks before it writes the next. Acknowledged durable: as for
    /// `Batch`; besides, a crash in the middle of a job keeps the runs written before it.
    Write,
}

impl std::str::FromStr for FsyncPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(FsyncPolicy::None),
            "batch" => Ok(FsyncPolicy::Batch),
            "write" => Ok(FsyncPolicy::Write),
            other => Err(format!(
                "unknown fsync policy {other:?}: expected \"none\", \"batch\" or \"write\""
            )),
        }
    }
}

impl std::fmt::Display for FsyncPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FsyncPolicy::None => "none",
            FsyncPolicy::Batch => "batch",
            FsyncPolicy::Write => "write",
        })
    }
}

/// How a file tier is identified and does its IO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOptions {
    /// Bypass the page cache with `O_DIRECT` (the default; falls back to buffered IO where the
    /// filesystem refuses it). Buffered IO competes with the primary region for memory.
    pub direct_io: bool,
    /// What the blocks are: an opaque string naming the model and its KV cache layout (for
    /// example `"meta-llama/Llama-3.1-8B-Instruct/bf16/tp1/block16"`), at most
    /// [`MAX_IDENTITY_BYTES`]. Recorded when the tier is created; opening it with another
    /// identity is [`StoreError::Identity`]. Empty by default (a tier of unnamed blocks).
    pub identity: String,
    /// When writes are made durable.
    pub fsync: FsyncPolicy,
    /// Verify every payload at open (reads the whole file) instead of at its first read.
    pub verify_at_open: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            direct_io: true,
            identity: String::new(),
            fsync: FsyncPolicy::default(),
            verify_at_open: false,
        }
    }
}

/// What opening a file tier found on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Blocks recovered (their headers verified; payloads too with
    /// [`FileOptions::verify_at_open`]).
    pub recovered: usize,
    /// Records dropped because their header (or, verifying at open, their payload) did not
    /// verify: torn or corrupt.
    pub corrupt: usize,
    /// Older copies of a block found twice (the newest is kept).
    pub duplicates: usize,
    /// Whether IO bypasses the page cache (`O_DIRECT`); false where the filesystem refuses it.
    pub direct_io: bool,
    /// Whether the data file was created now.
    pub created: bool,
    /// Whether a temporary left by a creator that died was removed.
    pub removed_temporary: bool,
    /// Whether the index came from the one written at the last clean close (no header was
    /// read); otherwise every record header was read (after a crash, or verifying at open).
    pub from_index: bool,
    /// Whether, after a crash, the index came from the last checkpoint written while the tier
    /// was open, and only the records it named as the next to be written were read.
    pub from_checkpoint: bool,
}

/// A clean-close index: (key, record, sequence number) of each block, and the next sequence
/// number.
type Snapshot = (Vec<(Key, u32, u64)>, u64);

/// A checkpoint: the index as a clean-close snapshot, and the records to read after a crash.
type Checkpoint = (Snapshot, Vec<u32>);

/// One record seen at open: its key and sequence number, empty, or why it was dropped (with
/// the sequence number its header carries when the header verified and the payload did not).
type Scanned = (u32, Result<Option<(Key, u64)>, Dropped>);

/// Why a record was dropped at open, and its sequence number if its header verified.
type Dropped = (&'static str, Option<u64>);

struct Index {
    /// Where each block is: its record and sequence number.
    records: BTreeMap<Key, (u32, u64)>,
    /// Free records, besides the reserved ones.
    free: BTreeSet<u32>,
    /// Free records the last checkpoint named as the ones written next: allocation takes
    /// only these, in order; when none is left, a new checkpoint reserves more.
    reserved: std::collections::VecDeque<u32>,
    /// Records taken by jobs not yet settled.
    inflight: BTreeSet<u32>,
    /// Where the next allocation looks first (next fit: runs of free records are reused in
    /// order, so a job's blocks land side by side).
    cursor: u32,
    seq: u64,
}

impl Index {
    fn new(records: BTreeMap<Key, (u32, u64)>, free: BTreeSet<u32>, seq: u64) -> Self {
        Index {
            records,
            free,
            reserved: Default::default(),
            inflight: BTreeSet::new(),
            cursor: 0,
            seq,
        }
    }

    /// The next free record at or after the cursor, wrapping around.
    fn take_free(&mut self) -> Option<u32> {
        let r = self
            .free
            .range(self.cursor..)
            .next()
            .or_else(|| self.free.iter().next())
            .copied()?;
        self.free.remove(&r);
        self.cursor = r + 1;
        Some(r)
    }

    /// Moves up to `n` free records, in allocation order, to the reserved ones.
    fn reserve(&mut self, n: usize) {
        while self.reserved.len() < n {
            let Some(r) = self.take_free() else { break };
            self.reserved.push_back(r);
        }
    }

    /// Gives back a record taken by a job.
    fn release(&mut self, record: u32) {
        self.inflight.remove(&record);
        self.free.insert(record);
    }
}

/// A persistent file tier.
pub struct FileStore {
    file: Box<dyn DataFile>,
    path: PathBuf,
    block_bytes: usize,
    records: u32,
    fsync: FsyncPolicy,
    index: Mutex<Index>,
    recovered: Vec<Key>,
    report: OpenReport,
    corrupt_reads: AtomicU64,
    /// Shares the syncs of concurrent jobs under [`FsyncPolicy::Batch`], and runs one sync of
    /// the data file at a time under every policy.
    group: GroupCommit,
    /// A sync failed: Linux reports a writeback error once, to whichever sync comes first, so
    /// no later sync proves anything durable. No job is acknowledged any more, the health
    /// check fails, and no clean close is written.
    failed: AtomicBool,
    /// Where a clean close writes the index.
    index_file: Box<dyn DataFile>,
    /// Where the index is checkpointed while open.
    checkpoint_file: Box<dyn DataFile>,
    /// The superblock in force, and its copy.
    sup: Super,
    slot: usize,
    /// Closed as a crash would: no sync, no index.
    abandoned: bool,
    /// Held for as long as the tier is open; released after the file is closed.
    _lock: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.path)
            .field("block_bytes", &self.block_bytes)
            .field("records", &self.records)
            .field("fsync", &self.fsync)
            .finish()
    }
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn record_bytes(block_bytes: usize) -> u64 {
    (PAGE + block_bytes) as u64
}

fn file_len(block_bytes: usize, records: u32) -> u64 {
    PAGE as u64 + u64::from(records) * record_bytes(block_bytes)
}

fn checksum(seq: u64, key: &[u8], payload: &[u8]) -> u64 {
    crate::checksum::xxh3_64(&[
        &FORMAT_VERSION.to_le_bytes(),
        &(key.len() as u32).to_le_bytes(),
        &(payload.len() as u64).to_le_bytes(),
        &seq.to_le_bytes(),
        key,
        payload,
    ])
}

fn header_checksum(fixed: &[u8], key: &[u8]) -> u64 {
    crate::checksum::xxh3_64(&[fixed, key])
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Reads `bufs` at `offset` in full, calling `preadv` again after a short count (Linux
/// moves at most `0x7ffff000` bytes per call): `Ok(false)` when the file ends first.
fn read_full(
    file: &dyn DataFile,
    mut bufs: &mut [IoSliceMut<'_>],
    offset: u64,
) -> std::io::Result<bool> {
    let mut at = offset;
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = match file.read_at(bufs, at) {
            Ok(0) => return Ok(false),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        at += n as u64;
        IoSliceMut::advance_slices(&mut bufs, n);
    }
    Ok(true)
}

/// Writes `bufs` at `offset` in full, calling `pwritev` again after a short count; a call
/// that writes nothing is [`std::io::ErrorKind::WriteZero`].
fn write_full(file: &dyn DataFile, bufs: &[IoSlice<'_>], offset: u64) -> std::io::Result<()> {
    let mut owned: Vec<IoSlice<'_>> = bufs.to_vec();
    let mut bufs = &mut owned[..];
    let mut at = offset;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = match file.write_at(bufs, at) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        at += n as u64;
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// A parsed record header.
struct Header<'a> {
    key: &'a [u8],
    payload_len: u64,
    seq: u64,
    checksum: u64,
}

impl<'a> Header<'a> {
    fn write(page: &mut [u8], key: &[u8], payload: &[u8], seq: u64) {
        page.fill(0);
        page[0..8].copy_from_slice(RECORD_MAGIC);
        page[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        page[12..16].copy_from_slice(&(key.len() as u32).to_le_bytes());
        page[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        page[24..32].copy_from_slice(&seq.to_le_bytes());
        page[32..40].copy_from_slice(&checksum(seq, key, payload).to_le_bytes());
        let sum = header_checksum(&page[0..40], key);
        page[40..48].copy_from_slice(&sum.to_le_bytes());
        page[HEADER_FIXED..HEADER_FIXED + key.len()].copy_from_slice(key);
    }

    /// `Ok(None)`: an empty record; `Err`: a header that does not verify.
    fn parse(page: &'a [u8]) -> Result<Option<Self>, &'static str> {
        if &page[0..8] != RECORD_MAGIC {
            return if page[0..8].iter().all(|&b| b == 0) {
                Ok(None)
            } else {
                Err("bad record magic")
            };
        }
        if le_u32(&page[8..]) != FORMAT_VERSION {
            return Err("unknown record format version");
        }
        let key_len = le_u32(&page[12..]) as usize;
        if key_len == 0 || key_len > MAX_KEY_BYTES {
            return Err("key length out of range");
        }
        let key = &page[HEADER_FIXED..HEADER_FIXED + key_len];
        if header_checksum(&page[0..40], key) != le_u64(&page[40..]) {
            return Err("header checksum mismatch");
        }
        Ok(Some(Header {
            key,
            payload_len: le_u64(&page[16..]),
            seq: le_u64(&page[24..]),
            checksum: le_u64(&page[32..]),
        }))
    }

    /// ★1: the header names `key`, the payload has the expected length and the checksum holds.
    fn verify(&self, key: Option<&[u8]>, payload: &[u8]) -> Result<(), &'static str> {
        if key.is_some_and(|k| k != self.key) {
            return Err("the record holds another key");
        }
        if self.payload_len != payload.len() as u64 {
            return Err("payload length differs");
        }
        if checksum(self.seq, self.key, payload) != self.checksum {
            return Err("checksum mismatch");
        }
        Ok(())
    }
}

/// One copy of the superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Super {
    generation: u64,
    block_bytes: u64,
    records: u64,
    /// Bytes of the clean-close index in [`INDEX_FILE`]; 0 while the tier is open (the index
    /// file is then stale) or after a crash.
    index_len: u64,
    /// xxh3 of those bytes.
    index_sum: u64,
    identity: Vec<u8>,
}

impl Super {
    fn write(&self, copy: &mut [u8]) {
        copy.fill(0);
        copy[0..8].copy_from_slice(SUPER_MAGIC);
        copy[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        copy[12..16].copy_from_slice(&(self.identity.len() as u32).to_le_bytes());
        copy[16..24].copy_from_slice(&self.generation.to_le_bytes());
        copy[24..32].copy_from_slice(&self.block_bytes.to_le_bytes());
        copy[32..40].copy_from_slice(&self.records.to_le_bytes());
        copy[40..48].copy_from_slice(&self.index_len.to_le_bytes());
        copy[48..56].copy_from_slice(&self.index_sum.to_le_bytes());
        copy[SUPER_FIXED..SUPER_FIXED + self.identity.len()].copy_from_slice(&self.identity);
        let sum = header_checksum(&copy[0..56], &self.identity);
        copy[56..64].copy_from_slice(&sum.to_le_bytes());
    }

    /// `Err(Some(version))`: another format version; `Err(None)`: not a valid copy.
    fn parse(copy: &[u8]) -> Result<Self, Option<u32>> {
        if &copy[0..8] != SUPER_MAGIC {
            return Err(None);
        }
        let version = le_u32(&copy[8..]);
        if version != FORMAT_VERSION {
            return Err(Some(version));
        }
        let len = le_u32(&copy[12..]) as usize;
        if len > MAX_IDENTITY_BYTES {
            return Err(None);
        }
        let identity = &copy[SUPER_FIXED..SUPER_FIXED + len];
        if header_checksum(&copy[0..56], identity) != le_u64(&copy[56..]) {
            return Err(None);
        }
        Ok(Super {
            generation: le_u64(&copy[16..]),
            block_bytes: le_u64(&copy[24..]),
            records: le_u64(&copy[32..]),
            index_len: le_u64(&copy[40..]),
            index_sum: le_u64(&copy[48..]),
            identity: identity.to_vec(),
        })
    }
}

impl FileStore {
    /// Opens (or creates) the file tier in `dir` for blocks of `block_bytes` (a page multiple:
    /// a primary row) with room for `capacity_bytes`, with the default [`FileOptions`], and
    /// rebuilds its index from disk.
    ///
    /// An existing tier keeps its blocks: opening it with another block size or identity, or
    /// with less room than it has, is an error rather than a loss.
    pub fn open(dir: &Path, block_bytes: usize, capacity_bytes: u64) -> Result<Self, StoreError> {
        Self::open_with(dir, block_bytes, capacity_bytes, FileOptions::default())
    }

    /// [`open`](Self::open) with options.
    pub fn open_with(
        dir: &Path,
        block_bytes: usize,
        capacity_bytes: u64,
        options: FileOptions,
    ) -> Result<Self, StoreError> {
        Self::check_options(block_bytes, capacity_bytes, &options)?;
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        Self::open_in(&RealDir::new(dir), block_bytes, capacity_bytes, options)
    }

    /// How many blocks of `block_bytes` a tier of `capacity_bytes` holds: each block takes a
    /// record of one header page and its bytes, after one superblock page. An error says why
    /// no tier can be made of these sizes.
    pub fn capacity_for(block_bytes: usize, capacity_bytes: u64) -> Result<u32, StoreError> {
        Self::check_options(block_bytes, capacity_bytes, &FileOptions::default())
    }

    /// The record count `capacity_bytes` holds, or why the arguments are refused.
    fn check_options(
        block_bytes: usize,
        capacity_bytes: u64,
        options: &FileOptions,
    ) -> Result<u32, StoreError> {
        if block_bytes == 0 || !block_bytes.is_multiple_of(PAGE) {
            return Err(StoreError::BadInput(format!(
                "file tier block bytes must be a positive multiple of {PAGE}, got {block_bytes}"
            )));
        }
        if options.identity.len() > MAX_IDENTITY_BYTES {
            return Err(StoreError::BadInput(format!(
                "file tier identity has {} bytes, at most {MAX_IDENTITY_BYTES}",
                options.identity.len()
            )));
        }
        let records = capacity_bytes.saturating_sub(PAGE as u64) / record_bytes(block_bytes);
        if records == 0 || records > u64::from(kvtier_core::MAX_BLOCKS) {
            return Err(StoreError::BadInput(format!(
                "file tier capacity of {capacity_bytes} bytes holds {records} blocks of {block_bytes} bytes; it needs 1 to {}",
                kvtier_core::MAX_BLOCKS
            )));
        }
        Ok(records as u32)
    }

    /// Opens the tier in `dir` (the real directory or a simulated one).
    fn open_in(
        dir: &dyn Dir,
        block_bytes: usize,
        capacity_bytes: u64,
        options: FileOptions,
    ) -> Result<Self, StoreError> {
        let records = Self::check_options(block_bytes, capacity_bytes, &options)?;
        let path = dir.path().join(DATA_FILE);
        let lock = dir.lock(LOCK_FILE).map_err(|e| match e {
            LockError::Held(holder) => StoreError::Locked {
                path: path.clone(),
                holder,
            },
            LockError::Io(e) => io_err("lock", &dir.path().join(LOCK_FILE))(e),
        })?;
        let mut report = OpenReport::default();
        // Holding the lock, a temporary is a dead creator's.
        if dir.exists(TEMP_FILE).map_err(io_err("stat", dir.path()))? {
            tracing::info!(dir = %dir.path().display(), "removing a tier left half-created");
            dir.remove(TEMP_FILE)
                .and_then(|()| dir.sync())
                .map_err(io_err("remove", &dir.path().join(TEMP_FILE)))?;
            report.removed_temporary = true;
        }
        let wanted = Super {
            generation: 1,
            block_bytes: block_bytes as u64,
            records: u64::from(records),
            index_len: 0,
            index_sum: 0,
            identity: options.identity.as_bytes().to_vec(),
        };
        report.created = !dir.exists(DATA_FILE).map_err(io_err("stat", &path))?;
        if report.created {
            Self::create(dir, &wanted)?;
        }
        let (file, direct_io) = dir
            .open(DATA_FILE, false, options.direct_io)
            .map_err(io_err("open", &path))?;
        report.direct_io = direct_io;
        let (on_disk, slot) = Self::read_super(&*file, &path, &wanted)?;
        if on_disk.records > u64::from(records) {
            return Err(StoreError::Layout {
                path,
                found: format!("{} records", on_disk.records),
                expected: format!("{records} records (a smaller capacity)"),
            });
        }
        let on_disk_records = on_disk.records as u32;
        // Records past the end of a file cut short (a truncation) are torn: note where it
        // ends before room is reserved again.
        let found_len = file.len().map_err(io_err("stat", &path))?;
        // Grow (or restore a file cut short): room first (synced), then the superblock.
        Self::reserve(dir, &*file, &path, file_len(block_bytes, records))?;
        let index_path = dir.path().join(INDEX_FILE);
        let index_existed = dir
            .exists(INDEX_FILE)
            .map_err(io_err("stat", &index_path))?;
        let (index_file, _) = dir
            .open(INDEX_FILE, true, false)
            .map_err(io_err("open", &index_path))?;
        if !index_existed {
            dir.sync().map_err(io_err("create", &index_path))?;
        }
        let checkpoint_path = dir.path().join(CHECKPOINT_FILE);
        let checkpoint_existed = dir
            .exists(CHECKPOINT_FILE)
            .map_err(io_err("stat", &checkpoint_path))?;
        let (checkpoint_file, _) = dir
            .open(CHECKPOINT_FILE, true, false)
            .map_err(io_err("open", &checkpoint_path))?;
        if !checkpoint_existed {
            dir.sync().map_err(io_err("create", &checkpoint_path))?;
        }
        let snapshot = if options.verify_at_open || on_disk.index_len == 0 {
            None
        } else {
            Self::read_index(&*index_file, &on_disk)
        };
        // After a crash, the last checkpoint of the session that crashed, if it wrote one.
        let checkpoint = if options.verify_at_open || on_disk.index_len != 0 {
            None
        } else {
            Self::read_checkpoint(&*checkpoint_file, &on_disk)
        };
        // Before any write, the superblock copy not in use says the tier is open (the index
        // file is about to go stale) and, when it grows, the new record count: a crash
        // before it is synced leaves the old copy, still valid.
        let current = Super {
            generation: on_disk.generation + 1,
            ..wanted
        };
        Self::write_super(&*file, &path, &current, 1 - slot)?;
        let mut store = FileStore {
            file,
            path,
            block_bytes,
            records,
            fsync: options.fsync,
            index: Mutex::new(Index::new(BTreeMap::new(), BTreeSet::new(), 0)),
            recovered: Vec::new(),
            report: OpenReport::default(),
            corrupt_reads: AtomicU64::new(0),
            group: GroupCommit::default(),
            failed: AtomicBool::new(false),
            index_file,
            checkpoint_file,
            sup: current,
            slot: 1 - slot,
            // Until the index is built, a failed open must not write it at close.
            abandoned: true,
            _lock: lock,
        };
        match (snapshot, checkpoint) {
            (Some(snapshot), _) => {
                report.from_index = true;
                store.load_index(snapshot, on_disk_records, found_len, &mut report);
            }
            (None, Some(checkpoint)) => {
                report.from_checkpoint = true;
                store.load_checkpoint(checkpoint, on_disk_records, found_len, &mut report)?;
            }
            (None, None) => store.rebuild(
                on_disk_records,
                found_len,
                options.verify_at_open,
                &mut report,
            )?,
        }
        tracing::info!(
            path = %store.path.display(),
            records,
            recovered = report.recovered,
            corrupt = report.corrupt,
            from_index = report.from_index,
            from_checkpoint = report.from_checkpoint,
            direct_io,
            fsync = %store.fsync,
            "file tier open"
        );
        if report.corrupt > 0 {
            tracing::warn!(path = %store.path.display(), dropped = report.corrupt, "torn or corrupt records dropped");
        }
        store.report = report;
        // A checkpoint now, before any store: a crash of this session at any point, even
        // one that stores nothing, is then opened from a checkpoint, not from every header.
        {
            let mut index = crate::sync::lock(&store.index);
            // Also when no record is free (a full tier): the checkpoint then names none, and
            // the first store after a delete writes the next one.
            if index.reserved.is_empty() {
                store
                    .checkpoint(&mut index)
                    .map_err(io_err("checkpoint", &store.path))?;
            }
        }
        store.abandoned = false;
        Ok(store)
    }

    /// Builds a new tier under [`TEMP_FILE`] and publishes it as [`DATA_FILE`].
    fn create(dir: &dyn Dir, sup: &Super) -> Result<(), StoreError> {
        let temp = dir.path().join(TEMP_FILE);
        let len = file_len(sup.block_bytes as usize, sup.records as u32);
        let available = dir.free_bytes().map_err(io_err("statvfs", dir.path()))?;
        if available < len {
            return Err(StoreError::NoSpace {
                path: dir.path().join(DATA_FILE),
                needed: len,
                available,
            });
        }
        let built = (|| {
            let (file, _) = dir
                .open(TEMP_FILE, true, false)
                .map_err(io_err("create", &temp))?;
            Self::reserve(dir, &*file, &temp, len)?;
            let mut page = PageBuf::new(PAGE);
            sup.write(&mut page.as_mut_slice()[..SUPER_COPY]);
            sup.write(&mut page.as_mut_slice()[SUPER_COPY..]);
            write_full(&*file, &[IoSlice::new(page.as_slice())], 0)
                .and_then(|()| file.sync_data())
                .map_err(io_err("write superblock", &temp))
        })();
        if let Err(e) = built {
            // Leave nothing a later open would misread.
            let _ = dir.remove(TEMP_FILE);
            return Err(e);
        }
        dir.rename(TEMP_FILE, DATA_FILE)
            .and_then(|()| dir.sync())
            .map_err(io_err("publish", &dir.path().join(DATA_FILE)))
    }

    /// Reserves room for `len` bytes and syncs it, or says there is none.
    fn reserve(
        dir: &dyn Dir,
        file: &dyn DataFile,
        path: &Path,
        len: u64,
    ) -> Result<(), StoreError> {
        let have = file.len().map_err(io_err("stat", path))?;
        if have >= len {
            return Ok(());
        }
        let available = dir.free_bytes().map_err(io_err("statvfs", dir.path()))?;
        if available < len - have {
            return Err(StoreError::NoSpace {
                path: path.to_path_buf(),
                needed: len - have,
                available,
            });
        }
        file.reserve(len)
            .and_then(|()| file.sync_data())
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    StoreError::NoSpace {
                        path: path.to_path_buf(),
                        needed: len - have,
                        available: dir.free_bytes().unwrap_or(0),
                    }
                } else {
                    io_err("reserve", path)(e)
                }
            })
    }

    /// The valid superblock copy with the highest generation, and its slot; checked against
    /// what this configuration asks for.
    fn read_super(
        file: &dyn DataFile,
        path: &Path,
        wanted: &Super,
    ) -> Result<(Super, usize), StoreError> {
        let mut page = PageBuf::new(PAGE);
        if !read_full(file, &mut [IoSliceMut::new(page.as_mut_slice())], 0)
            .map_err(io_err("read superblock", path))?
        {
            return Err(StoreError::Layout {
                path: path.to_path_buf(),
                found: "a file shorter than a superblock".into(),
                expected: "a kvtier file tier".into(),
            });
        }
        let p = page.as_slice();
        let copies = [
            Super::parse(&p[..SUPER_COPY]),
            Super::parse(&p[SUPER_COPY..]),
        ];
        let best = copies
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().ok().map(|s| (s.generation, i)))
            .max();
        let Some((_, slot)) = best else {
            // A version 1 superblock: the version field sits where it always did.
            let version = copies
                .iter()
                .find_map(|c| c.as_ref().err().copied().flatten());
            return Err(match version {
                Some(found) => StoreError::Version {
                    path: path.to_path_buf(),
                    found,
                    supported: FORMAT_VERSION,
                },
                None => StoreError::Layout {
                    path: path.to_path_buf(),
                    found: "no valid kvtier superblock".into(),
                    expected: format!("a kvtier file tier (format {FORMAT_VERSION})"),
                },
            });
        };
        let [a, b] = copies;
        let found = if slot == 0 { a } else { b }.expect("the chosen copy is valid");
        if found.block_bytes != wanted.block_bytes {
            return Err(StoreError::Layout {
                path: path.to_path_buf(),
                found: format!("{}-byte blocks", found.block_bytes),
                expected: format!("{}-byte blocks", wanted.block_bytes),
            });
        }
        if found.identity != wanted.identity {
            return Err(StoreError::Identity {
                path: path.to_path_buf(),
                found: String::from_utf8_lossy(&found.identity).into_owned(),
                expected: String::from_utf8_lossy(&wanted.identity).into_owned(),
            });
        }
        Ok((found, slot))
    }

    /// Writes `sup` into copy `slot` of the superblock page and syncs it.
    fn write_super(
        file: &dyn DataFile,
        path: &Path,
        sup: &Super,
        slot: usize,
    ) -> Result<(), StoreError> {
        let mut page = PageBuf::new(PAGE);
        read_full(file, &mut [IoSliceMut::new(page.as_mut_slice())], 0)
            .map_err(io_err("read superblock", path))?;
        sup.write(&mut page.as_mut_slice()[slot * SUPER_COPY..(slot + 1) * SUPER_COPY]);
        write_full(file, &[IoSlice::new(page.as_slice())], 0)
            .and_then(|()| file.sync_data())
            .map_err(io_err("write superblock", path))
    }

    /// The clean-close index the superblock names, if it verifies: (key, record, sequence
    /// number) of each block, and the next sequence number.
    fn read_index(file: &dyn DataFile, sup: &Super) -> Option<Snapshot> {
        let mut bytes = vec![0u8; usize::try_from(sup.index_len).ok()?];
        if !read_full(file, &mut [IoSliceMut::new(&mut bytes)], 0).ok()?
            || xxhash_rust::xxh3::xxh3_64(&bytes) != sup.index_sum
        {
            tracing::warn!("the clean-close index does not verify; reading every header");
            return None;
        }
        Self::parse_snapshot(&bytes, sup).map(|(snapshot, _)| snapshot)
    }

    /// A snapshot as [`snapshot_bytes`](Self::snapshot_bytes) wrote it, and the bytes it took.
    fn parse_snapshot(bytes: &[u8], sup: &Super) -> Option<(Snapshot, usize)> {
        if bytes.len() < 24 || &bytes[0..8] != INDEX_MAGIC {
            return None;
        }
        let count = le_u64(&bytes[8..]) as usize;
        let next_seq = le_u64(&bytes[16..]);
        let mut at = 24;
        let mut out = Vec::with_capacity(count.min(1 << 20));
        let mut seen = BTreeSet::new();
        for _ in 0..count {
            let fixed = bytes.get(at..at + 16)?;
            let (record, len, seq) = (
                le_u32(fixed),
                le_u32(&fixed[4..]) as usize,
                le_u64(&fixed[8..]),
            );
            let key = bytes.get(at + 16..at + 16 + len)?;
            if u64::from(record) >= sup.records
                || len == 0
                || len > MAX_KEY_BYTES
                || !seen.insert(record)
            {
                return None;
            }
            out.push((Key::new(key), record, seq));
            at += 16 + len;
        }
        Some(((out, next_seq), at))
    }

    /// The last checkpoint written by the session that crashed (the superblock in force was
    /// written by its open: same generation), if it verifies.
    fn read_checkpoint(file: &dyn DataFile, sup: &Super) -> Option<Checkpoint> {
        let mut head = [0u8; CHECKPOINT_HEADER];
        if !read_full(file, &mut [IoSliceMut::new(&mut head)], 0).ok()?
            || &head[0..8] != CHECKPOINT_MAGIC
            || le_u64(&head[8..]) != sup.generation
        {
            return None;
        }
        let mut body = vec![0u8; usize::try_from(le_u64(&head[16..])).ok()?];
        if !read_full(
            file,
            &mut [IoSliceMut::new(&mut body)],
            CHECKPOINT_HEADER as u64,
        )
        .ok()?
            || xxhash_rust::xxh3::xxh3_64(&body) != le_u64(&head[24..])
        {
            tracing::warn!("the checkpoint does not verify; reading every header");
            return None;
        }
        let (snapshot, at) = Self::parse_snapshot(&body, sup)?;
        let count = le_u64(body.get(at..at + 8)?) as usize;
        let list = body.get(at + 8..at + 8 + count.checked_mul(4)?)?;
        let scan: Vec<u32> = list.chunks(4).map(le_u32).collect();
        if scan.iter().any(|&r| u64::from(r) >= sup.records) {
            return None;
        }
        Some((snapshot, scan))
    }

    /// Records reserved by a checkpoint: enough that checkpoints are rare, few enough that
    /// reading their headers after a crash is a small part of reading every header.
    fn reserve_count(&self) -> usize {
        (self.records as usize / 16).max(64)
    }

    /// Reserves the next free records and writes a checkpoint naming them, with the records of
    /// jobs not settled yet: until the next checkpoint, only those records are written, so
    /// after a crash they are the only ones whose headers need reading. Synced before any of
    /// them is written.
    fn checkpoint(&self, index: &mut Index) -> std::io::Result<()> {
        index.reserve(self.reserve_count());
        let mut body = Self::snapshot_bytes(index);
        let scan: BTreeSet<u32> = index
            .reserved
            .iter()
            .chain(index.inflight.iter())
            .copied()
            .collect();
        body.extend_from_slice(&(scan.len() as u64).to_le_bytes());
        for r in scan {
            body.extend_from_slice(&r.to_le_bytes());
        }
        let mut bytes = Vec::with_capacity(CHECKPOINT_HEADER + body.len());
        bytes.extend_from_slice(CHECKPOINT_MAGIC);
        bytes.extend_from_slice(&self.sup.generation.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&body).to_le_bytes());
        bytes.extend_from_slice(&body);
        write_full(&*self.checkpoint_file, &[IoSlice::new(&bytes)], 0)?;
        self.noting_failure(self.checkpoint_file.sync_data())
    }

    /// `result` of a sync; an error marks the tier failed (see [`FileStore::failed`]).
    fn noting_failure(&self, result: std::io::Result<()>) -> std::io::Result<()> {
        if let Err(e) = &result
            && !self.failed.swap(true, Ordering::SeqCst)
        {
            tracing::error!(
                path = %self.path.display(),
                error = %e,
                "a sync failed: no write is acknowledged any more; reopen the tier"
            );
        }
        result
    }

    /// Syncs the data file (one sync at a time, shared between concurrent callers); an error
    /// marks the tier failed.
    fn sync_data(&self) -> std::io::Result<()> {
        self.group
            .sync(&|| self.noting_failure(self.file.sync_data()))
    }

    /// Whether a sync failed since the tier was opened: it then acknowledges no write, its
    /// health check fails and it is not closed cleanly (the next open reads the headers).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The error of a job or check refused because a sync failed earlier.
    fn failed_error(&self, what: &'static str) -> StoreError {
        io_err(what, &self.path)(std::io::Error::other(
            "an earlier sync of the data file failed, so writes since may not be durable; reopen the tier",
        ))
    }

    /// ★6 after a crash: the index from the last checkpoint, and the headers of the records it
    /// named as the next to be written (the newest copy of a block wins).
    fn load_checkpoint(
        &mut self,
        checkpoint: Checkpoint,
        on_disk: u32,
        found_len: u64,
        report: &mut OpenReport,
    ) -> Result<(), StoreError> {
        let ((entries, next_seq), scan) = checkpoint;
        let scan: BTreeSet<u32> = scan.into_iter().filter(|&r| r < on_disk).collect();
        let mut latest: BTreeMap<Key, (u64, u32)> = BTreeMap::new();
        for (key, record, seq) in entries {
            if scan.contains(&record) {
                continue;
            }
            if record >= on_disk || self.offset(record) + record_bytes(self.block_bytes) > found_len
            {
                // A file cut short since lost the records past its end.
                report.corrupt += 1;
                continue;
            }
            latest.insert(key, (seq, record));
        }
        let mut seq = next_seq;
        let mut dropped = Vec::new();
        let scan: Vec<u32> = scan.into_iter().collect();
        // Header reads are small and independent: more threads keep the device busy.
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get() * 8)
            .clamp(2, 16);
        let this = &*self;
        let scanned: Vec<Result<Vec<Scanned>, StoreError>> = std::thread::scope(|s| {
            let handles: Vec<_> = scan
                .chunks(scan.len().div_ceil(threads).max(1))
                .map(|part| {
                    s.spawn(move || {
                        let mut out = Vec::with_capacity(part.len());
                        for &r in part {
                            out.extend(this.scan(r..r + 1, found_len, false)?);
                        }
                        Ok(out)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("scan thread panicked"))
                .collect()
        });
        for part in scanned {
            for (record, outcome) in part? {
                match outcome {
                    Ok(Some((key, s))) => {
                        seq = seq.max(s + 1);
                        match latest.get(&key) {
                            Some(&(older, _)) if older >= s => report.duplicates += 1,
                            Some(_) => {
                                report.duplicates += 1;
                                latest.insert(key, (s, record));
                            }
                            None => {
                                latest.insert(key, (s, record));
                            }
                        }
                    }
                    Ok(None) => {}
                    Err((reason, s)) => {
                        tracing::debug!(record, reason, "record dropped at open");
                        report.corrupt += 1;
                        // A later write of its key must win over it.
                        if let Some(s) = s {
                            seq = seq.max(s + 1);
                        }
                        dropped.push(record);
                    }
                }
            }
        }
        self.forget(&dropped)?;
        let mut order: Vec<(u64, &Key)> = latest.iter().map(|(k, &(s, _))| (s, k)).collect();
        order.sort();
        self.recovered = order.into_iter().map(|(_, k)| k.clone()).collect();
        report.recovered = self.recovered.len();
        let held: BTreeSet<u32> = latest.values().map(|&(_, r)| r).collect();
        let free = (0..self.records).filter(|r| !held.contains(r)).collect();
        let records = latest.into_iter().map(|(k, (s, r))| (k, (r, s))).collect();
        let index = self.index.get_mut().unwrap_or_else(|e| e.into_inner());
        *index = Index::new(records, free, seq);
        Ok(())
    }

    /// The index as a clean close writes it.
    fn index_bytes(&self) -> Vec<u8> {
        Self::snapshot_bytes(&lock(&self.index))
    }

    /// `index` as a clean close writes it.
    fn snapshot_bytes(index: &Index) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + index.records.len() * 64);
        out.extend_from_slice(INDEX_MAGIC);
        out.extend_from_slice(&(index.records.len() as u64).to_le_bytes());
        out.extend_from_slice(&index.seq.to_le_bytes());
        // In key order: open recovers the order of writes (oldest first, for the core's
        // recency) from the sequence numbers.
        for (key, &(record, seq)) in index.records.iter() {
            out.extend_from_slice(&record.to_le_bytes());
            out.extend_from_slice(&(key.len() as u32).to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        out
    }

    /// A clean close: everything synced, the index written and synced, then the superblock
    /// that names it (so a crash anywhere before leaves a superblock that says "read the
    /// headers").
    fn close(&mut self) -> std::io::Result<()> {
        if self.failed() {
            return Err(std::io::Error::other(
                "a sync failed while the tier was open",
            ));
        }
        self.sync_data()?;
        let bytes = self.index_bytes();
        write_full(&*self.index_file, &[IoSlice::new(&bytes)], 0)?;
        self.noting_failure(self.index_file.sync_data())?;
        let closed = Super {
            generation: self.sup.generation + 1,
            index_len: bytes.len() as u64,
            index_sum: xxhash_rust::xxh3::xxh3_64(&bytes),
            ..self.sup.clone()
        };
        Self::write_super(&*self.file, &self.path, &closed, 1 - self.slot)
            .map_err(std::io::Error::other)
    }

    /// Closes the tier as a crash would: nothing is synced and no index is written, so the
    /// next open reads every record header. For tests and benchmarks of recovery.
    pub fn abandon(mut self) {
        self.abandoned = true;
    }

    /// Takes the index from a clean-close snapshot.
    fn load_index(
        &mut self,
        snapshot: Snapshot,
        on_disk: u32,
        found_len: u64,
        report: &mut OpenReport,
    ) {
        let (mut entries, next_seq) = snapshot;
        // A file cut short since (a truncation) lost the records past its end.
        let before = entries.len();
        entries.retain(|e| {
            e.1 < on_disk && self.offset(e.1) + record_bytes(self.block_bytes) <= found_len
        });
        report.corrupt += before - entries.len();
        entries.sort_by_key(|e| e.2);
        let held: BTreeSet<u32> = entries.iter().map(|e| e.1).collect();
        let free = (0..self.records)
            .filter(|r| !held.contains(r) || *r >= on_disk)
            .collect();
        self.recovered = entries.iter().map(|e| e.0.clone()).collect();
        report.recovered = entries.len();
        let index = self.index.get_mut().unwrap_or_else(|e| e.into_inner());
        *index = Index::new(
            entries.into_iter().map(|(k, r, s)| (k, (r, s))).collect(),
            free,
            next_seq,
        );
    }

    fn offset(&self, record: u32) -> u64 {
        PAGE as u64 + u64::from(record) * record_bytes(self.block_bytes)
    }

    /// ★6: rebuilds the index from the first `on_disk` records, on a few threads.
    fn rebuild(
        &mut self,
        on_disk: u32,
        found_len: u64,
        verify: bool,
        report: &mut OpenReport,
    ) -> Result<(), StoreError> {
        // Header reads are small and independent: more threads keep the device busy.
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get() * if verify { 2 } else { 8 })
            .clamp(2, 16) as u32;
        let per = on_disk.div_ceil(threads).max(1);
        let this = &*self;
        let scanned: Vec<Result<Vec<Scanned>, StoreError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..on_disk)
                .step_by(per as usize)
                .map(|start| {
                    s.spawn(move || this.scan(start..(start + per).min(on_disk), found_len, verify))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("scan thread panicked"))
                .collect()
        });
        let mut found: Vec<(u64, Key, u32)> = Vec::new();
        let mut free = BTreeSet::new();
        let mut dropped = Vec::new();
        // The highest sequence number of any header that verified, dropped records included:
        // a later write of a dropped record's key must win over it.
        let mut seq = 0;
        for part in scanned {
            for (record, outcome) in part? {
                match outcome {
                    Ok(Some((key, seq))) => found.push((seq, key, record)),
                    Ok(None) => {
                        free.insert(record);
                    }
                    Err((reason, s)) => {
                        tracing::debug!(record, reason, "record dropped at open");
                        report.corrupt += 1;
                        seq = seq.max(s.unwrap_or(0));
                        free.insert(record);
                        dropped.push(record);
                    }
                }
            }
        }
        self.forget(&dropped)?;
        found.sort_by_key(|(seq, _, _)| *seq);
        let mut latest: BTreeMap<Key, (u64, u32)> = BTreeMap::new();
        for (s, key, record) in found {
            seq = seq.max(s);
            if let Some((_, older)) = latest.insert(key, (s, record)) {
                report.duplicates += 1;
                free.insert(older);
            }
        }
        // Oldest first, so the core's index starts with the right recency order.
        let mut order: Vec<(u64, &Key)> = latest.iter().map(|(k, &(s, _))| (s, k)).collect();
        order.sort();
        self.recovered = order.into_iter().map(|(_, k)| k.clone()).collect();
        let records = latest.into_iter().map(|(k, (s, r))| (k, (r, s))).collect();
        report.recovered = self.recovered.len();
        free.extend(on_disk..self.records);
        let index = self.index.get_mut().unwrap_or_else(|e| e.into_inner());
        *index = Index::new(records, free, seq + 1);
        Ok(())
    }

    /// Zeroes the headers of records dropped at open, so that no later open finds one of them
    /// again: a dropped record whose header verified (its payload did not) would otherwise
    /// come back as a block. Synced whatever the policy, before the tier serves anything:
    /// a dropped copy may have hidden an older one of its key that the open now serves, and
    /// a crash that undid an unsynced clearing would bring the torn copy back over it (its
    /// sequence number is higher), losing a block the device held.
    fn forget(&self, dropped: &[u32]) -> Result<(), StoreError> {
        if dropped.is_empty() {
            return Ok(());
        }
        let zero = PageBuf::new(PAGE);
        for &r in dropped {
            write_full(
                &*self.file,
                &[IoSlice::new(zero.as_slice())],
                self.offset(r),
            )
            .map_err(io_err("clear a dropped record", &self.path))?;
        }
        self.sync_data()
            .map_err(io_err("clear a dropped record", &self.path))
    }

    fn scan(
        &self,
        records: std::ops::Range<u32>,
        found_len: u64,
        verify: bool,
    ) -> Result<Vec<Scanned>, StoreError> {
        let mut out = Vec::with_capacity(records.len());
        let mut header = PageBuf::new(PAGE);
        let mut payload = PageBuf::new(if verify { self.block_bytes } else { PAGE });
        // A file cut short (a crash while it grew, a truncation) holds torn records.
        let read = |buf: &mut [u8], offset: u64| {
            read_full(&*self.file, &mut [IoSliceMut::new(buf)], offset)
                .map_err(io_err("scan", &self.path))
        };
        for r in records {
            let end = self.offset(r) + record_bytes(self.block_bytes);
            let outcome = if self.offset(r) >= found_len {
                // Nothing of it is left: an empty record.
                Ok(None)
            } else if end > found_len || !read(header.as_mut_slice(), self.offset(r))? {
                Err(("record cut short", None))
            } else {
                match Header::parse(header.as_slice()) {
                    Ok(Some(h)) if h.payload_len != self.block_bytes as u64 => {
                        Err(("payload length differs", Some(h.seq)))
                    }
                    Ok(Some(h)) if !verify => Ok(Some((Key::new(h.key), h.seq))),
                    Ok(Some(h)) => {
                        if read(payload.as_mut_slice(), self.offset(r) + PAGE as u64)? {
                            h.verify(None, payload.as_slice())
                                .map(|()| Some((Key::new(h.key), h.seq)))
                                .map_err(|e| (e, Some(h.seq)))
                        } else {
                            Err(("record cut short", Some(h.seq)))
                        }
                    }
                    Ok(None) => Ok(None),
                    Err(e) => Err((e, None)),
                }
            };
            out.push((r, outcome));
        }
        Ok(out)
    }

    /// What opening found.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// Reads that failed verification since the tier was opened (torn or corrupt payloads,
    /// never served). A payload torn by a crash is found here, at its first read, unless
    /// [`FileOptions::verify_at_open`] dropped it at open.
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads.load(Ordering::Relaxed)
    }

    /// The fsync policy in force.
    pub fn fsync_policy(&self) -> FsyncPolicy {
        self.fsync
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        lock(&self.index).records.len()
    }

    /// Whether it holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where `key`'s record starts in the data file, if it is held (for tests that damage it).
    pub fn record_offset(&self, key: &Key) -> Option<u64> {
        lock(&self.index)
            .records
            .get(key)
            .map(|&(r, _)| self.offset(r))
    }

    /// Makes every write so far durable (`fdatasync`), whatever the policy.
    pub fn sync(&self) -> Result<(), StoreError> {
        if self.failed() {
            return Err(self.failed_error("sync"));
        }
        self.sync_data().map_err(io_err("sync", &self.path))
    }

    fn check_block(&self, key: &Key, len: usize) -> Result<(), StoreError> {
        if len != self.block_bytes {
            return Err(StoreError::BadInput(format!(
                "block {key} has {len} bytes, the tier stores {}",
                self.block_bytes
            )));
        }
        if key.len() > MAX_KEY_BYTES || key.is_empty() {
            return Err(StoreError::BadInput(format!(
                "key {key} has {} bytes, at most {MAX_KEY_BYTES}",
                key.len()
            )));
        }
        Ok(())
    }

    /// Writes one run of blocks into adjacent records starting at `first` with one `pwritev`.
    fn write_run(&self, first: u32, headers: &[u8], blocks: &[&[u8]]) -> std::io::Result<()> {
        let mut iov = Vec::with_capacity(2 * blocks.len());
        for (i, b) in blocks.iter().enumerate() {
            iov.push(IoSlice::new(&headers[i * PAGE..(i + 1) * PAGE]));
            iov.push(IoSlice::new(b));
        }
        write_full(&*self.file, &iov, self.offset(first))?;
        if self.fsync == FsyncPolicy::Write {
            self.sync_data()?;
        }
        Ok(())
    }

    fn corrupt(&self, key: &Key, reason: &'static str) -> StoreError {
        self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(path = %self.path.display(), %key, reason, "a read failed verification");
        StoreError::Corrupt {
            key: key.clone(),
            reason,
        }
    }
}

/// Records of `block_bytes` one run holds at most: [`MAX_RUN`], and [`MAX_RUN_BYTES`] (at
/// least one record).
fn max_run(block_bytes: usize) -> usize {
    let fit = (MAX_RUN_BYTES / record_bytes(block_bytes)).max(1);
    MAX_RUN.min(usize::try_from(fit).unwrap_or(MAX_RUN))
}

/// Splits `records` (sorted) into runs of adjacent records, at most `max` each.
fn runs(records: &[u32], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=records.len() {
        if i == records.len() || records[i] != records[i - 1] + 1 || i - start == max {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// The error a job's first occurrence of a key got, for a repeat of that key.
fn same_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Io { what, path, source } => StoreError::Io {
            what,
            path: path.clone(),
            source: std::io::Error::new(source.kind(), source.to_string()),
        },
        StoreError::Full { key } => StoreError::Full { key: key.clone() },
        StoreError::NotFound { key } => StoreError::NotFound { key: key.clone() },
        StoreError::Corrupt { key, reason } => StoreError::Corrupt {
            key: key.clone(),
            reason,
        },
        other => StoreError::BadInput(other.to_string()),
    }
}

impl SecondaryStore for FileStore {
    fn name(&self) -> &str {
        "file"
    }

    fn kind(&self) -> TierKind {
        TierKind::Authoritative
    }

    fn capacity_blocks(&self) -> u32 {
        self.records
    }

    fn put(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        self.put_many(&[(key, block)])
            .pop()
            .expect("one result per block")
    }

    /// Writes the blocks into adjacent free records where there are, one `pwritev` per run
    /// of adjacent records, then syncs as [`FsyncPolicy`] says.
    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        if self.failed() {
            return blocks
                .iter()
                .map(|_| Err(self.failed_error("write")))
                .collect();
        }
        let mut results: Vec<Option<Result<(), StoreError>>> = blocks
            .iter()
            .map(|(k, b)| self.check_block(k, b.len()).err().map(Err))
            .collect();
        // (record, position, sequence number) of each block to write.
        let mut todo: Vec<(u32, usize, u64)> = Vec::with_capacity(blocks.len());
        // A key named again in the job gets the result of its first occurrence: (position,
        // first occurrence).
        let mut again: Vec<(usize, usize)> = Vec::new();
        {
            let mut index = lock(&self.index);
            let mut seen: BTreeMap<&Key, usize> = BTreeMap::new();
            for (i, (key, _)) in blocks.iter().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                if let Some(&first) = seen.get(*key) {
                    again.push((i, first));
                    continue;
                }
                seen.insert(*key, i);
                if index.records.contains_key(*key) {
                    results[i] = Some(Ok(()));
                    continue;
                }
                if index.reserved.is_empty()
                    && !index.free.is_empty()
                    && let Err(e) = self.checkpoint(&mut index)
                {
                    results[i] = Some(Err(io_err("checkpoint", &self.path)(e)));
                    continue;
                }
                match index.reserved.pop_front() {
                    Some(r) => {
                        index.seq += 1;
                        index.inflight.insert(r);
                        todo.push((r, i, index.seq));
                    }
                    None => {
                        results[i] = Some(Err(StoreError::Full {
                            key: (*key).clone(),
                        }))
                    }
                }
            }
        }
        todo.sort_unstable();
        // O_DIRECT needs aligned memory: primary rows are; anything else goes through a copy.
        let bounced: Vec<Option<PageBuf>> = todo
            .iter()
            .map(|&(_, i, _)| {
                let b = blocks[i].1;
                (b.as_ptr().align_offset(PAGE) != 0).then(|| {
                    let mut c = PageBuf::new(b.len());
                    c.as_mut_slice().copy_from_slice(b);
                    c
                })
            })
            .collect();
        let payload = |n: usize| -> &[u8] {
            bounced[n]
                .as_ref()
                .map_or(blocks[todo[n].1].1, PageBuf::as_slice)
        };
        let mut headers = PageBuf::new(todo.len() * PAGE);
        for (n, &(_, i, seq)) in todo.iter().enumerate() {
            let page = &mut headers.as_mut_slice()[n * PAGE..(n + 1) * PAGE];
            Header::write(page, blocks[i].0.as_bytes(), payload(n), seq);
        }
        let items: Vec<u32> = todo.iter().map(|t| t.0).collect();
        let mut failed: Vec<Option<std::io::Error>> = todo.iter().map(|_| None).collect();
        for run in runs(&items, max_run(self.block_bytes)) {
            let data: Vec<&[u8]> = run.clone().map(payload).collect();
            let hdr = &headers.as_slice()[run.start * PAGE..run.end * PAGE];
            if let Err(e) = self.write_run(items[run.start], hdr, &data) {
                for n in run {
                    failed[n] = Some(std::io::Error::new(e.kind(), e.to_string()));
                }
            }
        }
        if self.fsync == FsyncPolicy::Batch
            && failed.iter().any(Option::is_none)
            && let Err(e) = self.sync_data()
        {
            // What was written may not be durable: none of it is acknowledged.
            for f in failed.iter_mut().filter(|f| f.is_none()) {
                *f = Some(std::io::Error::new(e.kind(), format!("sync: {e}")));
            }
        }
        // A sync failed (this job's or another's): what was written may not be durable, and
        // no later sync would say so.
        if self.failed() {
            for f in failed.iter_mut().filter(|f| f.is_none()) {
                *f = Some(std::io::Error::other(
                    "an earlier sync of the data file failed, so writes since may not be durable; reopen the tier",
                ));
            }
        }
        let mut index = lock(&self.index);
        for (&(record, i, seq), fail) in todo.iter().zip(failed) {
            let key = blocks[i].0;
            results[i] = Some(match fail {
                None if !index.records.contains_key(key) => {
                    index.inflight.remove(&record);
                    index.records.insert(key.clone(), (record, seq));
                    Ok(())
                }
                None => {
                    // Stored meanwhile by another job: keep that one.
                    index.release(record);
                    Ok(())
                }
                Some(e) => {
                    index.release(record);
                    Err(io_err("write", &self.path)(e))
                }
            });
        }
        drop(index);
        for (i, first) in again {
            results[i] = Some(match &results[first] {
                Some(Ok(())) => Ok(()),
                Some(Err(e)) => Err(same_error(e)),
                None => unreachable!("a first occurrence is settled before its repeats"),
            });
        }
        results
            .into_iter()
            .map(|r| r.expect("every block has a result"))
            .collect()
    }

    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        self.get_many(&mut [(key, block)])
            .pop()
            .expect("one result per block")
    }

    /// Reads the blocks with one `preadv` per run of adjacent records and verifies each.
    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        let mut results: Vec<Option<Result<(), StoreError>>> = blocks
            .iter()
            .map(|(k, b)| self.check_block(k, b.len()).err().map(Err))
            .collect();
        for (i, (key, block)) in blocks.iter_mut().enumerate() {
            if results[i].is_none() && block.as_ptr().align_offset(PAGE) != 0 {
                // O_DIRECT needs aligned memory: read into an aligned copy.
                let mut b = PageBuf::new(block.len());
                let r = self.get(key, b.as_mut_slice());
                if r.is_ok() {
                    block.copy_from_slice(b.as_slice());
                }
                results[i] = Some(r);
            }
        }
        let keys: Vec<&Key> = blocks.iter().map(|b| b.0).collect();
        let mut items: Vec<(u32, usize)> = Vec::with_capacity(blocks.len());
        // The sequence number each block's header must carry.
        let mut seqs = vec![0u64; blocks.len()];
        {
            let index = lock(&self.index);
            for (i, key) in keys.iter().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                match index.records.get(*key) {
                    Some(&(r, seq)) => {
                        seqs[i] = seq;
                        items.push((r, i));
                    }
                    None => {
                        results[i] = Some(Err(StoreError::NotFound {
                            key: (*key).clone(),
                        }))
                    }
                }
            }
        }
        items.sort_unstable();
        let records: Vec<u32> = items.iter().map(|t| t.0).collect();
        let mut bufs: Vec<&mut [u8]> = blocks.iter_mut().map(|(_, b)| &mut **b).collect();
        let mut headers = PageBuf::new(items.len() * PAGE);
        for run in runs(&records, max_run(self.block_bytes)) {
            let mut hdrs: Vec<&mut [u8]> = headers.as_mut_slice()[run.start * PAGE..run.end * PAGE]
                .chunks_mut(PAGE)
                .collect();
            let mut taken: Vec<&mut [u8]> = items[run.clone()]
                .iter()
                .map(|&(_, i)| std::mem::take(&mut bufs[i]))
                .collect();
            let read = {
                let mut iov: Vec<IoSliceMut<'_>> = hdrs
                    .iter_mut()
                    .zip(taken.iter_mut())
                    .flat_map(|(h, b)| [IoSliceMut::new(h), IoSliceMut::new(b)])
                    .collect();
                read_full(&*self.file, &mut iov, self.offset(records[run.start]))
            };
            for ((h, b), &(_, i)) in hdrs.iter().zip(&taken).zip(&items[run.clone()]) {
                let key = keys[i];
                results[i] = Some(match &read {
                    Err(e) => Err(io_err("read", &self.path)(std::io::Error::new(
                        e.kind(),
                        e.to_string(),
                    ))),
                    Ok(false) => Err(self.corrupt(key, "short read")),
                    Ok(true) => match Header::parse(h) {
                        Err(reason) => Err(self.corrupt(key, reason)),
                        Ok(None) => Err(self.corrupt(key, "the record is empty")),
                        // A record that holds another write of the block (an older one a
                        // crash left where the index says the newer one is) is never served.
                        Ok(Some(hd)) if hd.seq != seqs[i] => {
                            Err(self.corrupt(key, "the record holds another write"))
                        }
                        Ok(Some(hd)) => hd
                            .verify(Some(key.as_bytes()), b)
                            .map_err(|reason| self.corrupt(key, reason)),
                    },
                });
            }
            for (b, &(_, i)) in taken.into_iter().zip(&items[run]) {
                bufs[i] = b;
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every block has a result"))
            .collect()
    }

    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        let mut index = lock(&self.index);
        if let Some((record, _)) = index.records.remove(key) {
            index.free.insert(record);
        }
        Ok(())
    }

    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        Ok(lock(&self.index).records.contains_key(key))
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.failed() {
            return Err(self.failed_error("health check"));
        }
        let mut page = PageBuf::new(PAGE);
        read_full(&*self.file, &mut [IoSliceMut::new(page.as_mut_slice())], 0)
            .map_err(io_err("health check", &self.path))
            .map(drop)
    }

    fn recovered(&self) -> Vec<Key> {
        self.recovered.clone()
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        if self.abandoned {
            return;
        }
        if let Err(e) = self.close() {
            tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "file tier not closed cleanly; the next open reads every record header"
            );
        }
    }
}
