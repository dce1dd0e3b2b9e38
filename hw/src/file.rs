//! The file tier: a persistent, authoritative secondary store in one data file.
//!
//! Layout (all little-endian, every part page-aligned so `O_DIRECT` works):
//!
//! ```text
//! offset 0           superblock page: magic "KVTIERFS", format version, block bytes,
//!                    record count, checksum of the fields
//! PAGE + i*record    record i: a header page, then the block (block bytes, page multiple)
//! header page        magic "KVTBLOCK", format version, key length, payload length,
//!                    sequence number, checksum (xxh3 of the fields, key and payload), key
//! ```
//!
//! Which record holds which key lives in memory and is rebuilt from the headers when the store
//! opens (★6): a record whose header or checksum does not verify (torn by a crash, corrupted on
//! disk) is dropped and counted. Every read verifies key, length and checksum before it
//! succeeds (★1). A deleted block's record is only forgotten, and reused by a later write; if
//! the process stops first, the block is found again at the next open, verified, as if it had
//! never been evicted.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use kvtier_core::{Key, TierKind};
use xxhash_rust::xxh3::Xxh3;

use crate::region::{PAGE, free_bytes, page_align, reserve};
use crate::store::{SecondaryStore, StoreError};
use crate::sync::{Mutex, lock};

const SUPER_MAGIC: &[u8; 8] = b"KVTIERFS";
const RECORD_MAGIC: &[u8; 8] = b"KVTBLOCK";
/// The on-disk format version.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of a record header before the key.
const HEADER_FIXED: usize = 40;
/// The longest key a record holds.
pub const MAX_KEY_BYTES: usize = PAGE - HEADER_FIXED;
/// The data file's name inside the tier directory.
pub const DATA_FILE: &str = "blocks.kvt";

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

/// How a file tier does its IO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileOptions {
    /// Bypass the page cache with `O_DIRECT` (the default; falls back to buffered IO where the
    /// filesystem refuses it). Buffered IO competes with the primary region for memory.
    pub direct_io: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions { direct_io: true }
    }
}

/// What opening a file tier found on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Verified blocks recovered.
    pub recovered: usize,
    /// Records dropped because their header or checksum did not verify (torn or corrupt).
    pub corrupt: usize,
    /// Older copies of a block found twice (the newest is kept).
    pub duplicates: usize,
    /// Whether IO bypasses the page cache (`O_DIRECT`); false where the filesystem refuses it.
    pub direct_io: bool,
    /// Whether the data file was created now.
    pub created: bool,
}

/// One record seen at open: its key and sequence number, empty, or why it was dropped.
type Scanned = (u32, Result<Option<(Key, u64)>, &'static str>);

struct Index {
    records: BTreeMap<Key, u32>,
    free: Vec<u32>,
    seq: u64,
}

/// A persistent file tier.
pub struct FileStore {
    file: File,
    path: PathBuf,
    block_bytes: usize,
    records: u32,
    index: Mutex<Index>,
    recovered: Vec<Key>,
    report: OpenReport,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.path)
            .field("block_bytes", &self.block_bytes)
            .field("records", &self.records)
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

fn checksum(seq: u64, key: &[u8], payload: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&FORMAT_VERSION.to_le_bytes());
    h.update(&(key.len() as u32).to_le_bytes());
    h.update(&(payload.len() as u64).to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.update(key);
    h.update(payload);
    h.digest()
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
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
        page[HEADER_FIXED..HEADER_FIXED + key.len()].copy_from_slice(key);
    }

    /// `Ok(None)`: an empty record; `Err`: a header that does not parse.
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
        Ok(Some(Header {
            key: &page[HEADER_FIXED..HEADER_FIXED + key_len],
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

impl FileStore {
    /// Opens (or creates) the file tier in `dir` for blocks of `block_bytes` (a page multiple:
    /// a primary row) with room for `capacity_bytes`, and rebuilds its index from disk.
    ///
    /// An existing tier keeps its blocks: opening it with another block size, or with less
    /// room than it has, is an error rather than a loss.
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
        if block_bytes == 0 || !block_bytes.is_multiple_of(PAGE) {
            return Err(StoreError::BadInput(format!(
                "file tier block bytes must be a positive multiple of {PAGE}, got {block_bytes}"
            )));
        }
        let records = capacity_bytes.saturating_sub(PAGE as u64) / record_bytes(block_bytes);
        if records == 0 || records > u64::from(kvtier_core::MAX_BLOCKS) {
            return Err(StoreError::BadInput(format!(
                "file tier capacity of {capacity_bytes} bytes holds {records} blocks of {block_bytes} bytes; it needs 1 to {}",
                kvtier_core::MAX_BLOCKS
            )));
        }
        let records = records as u32;
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        let path = dir.join(DATA_FILE);
        // A data file without a superblock yet (an open that failed while creating it) is new.
        let created = std::fs::metadata(&path).map_or(true, |m| m.len() == 0);
        let (file, direct_io) = Self::open_file(&path, options.direct_io)?;
        let mut report = OpenReport {
            direct_io,
            created,
            ..OpenReport::default()
        };
        let on_disk = if created {
            0
        } else {
            Self::read_super(&file, &path, block_bytes)?
        };
        if on_disk > records {
            return Err(StoreError::Layout {
                path,
                found: format!("{on_disk} records"),
                expected: format!("{records} records (a smaller capacity)"),
            });
        }
        let len = PAGE as u64 + u64::from(records) * record_bytes(block_bytes);
        let file_len = file.metadata().map_err(io_err("stat", &path))?.len();
        if on_disk < records || file_len < len {
            let available = free_bytes(dir).map_err(io_err("statvfs", dir))?;
            if available < len.saturating_sub(file_len) {
                return Err(StoreError::NoSpace {
                    path,
                    needed: len - file_len,
                    available,
                });
            }
            reserve(&file, len).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    StoreError::NoSpace {
                        path: path.clone(),
                        needed: len,
                        available: free_bytes(dir).unwrap_or(0),
                    }
                } else {
                    io_err("reserve", &path)(e)
                }
            })?;
            if on_disk < records {
                Self::write_super(&file, &path, block_bytes, records)?;
            }
        }
        let mut store = FileStore {
            file,
            path,
            block_bytes,
            records,
            index: Mutex::new(Index {
                records: BTreeMap::new(),
                free: Vec::new(),
                seq: 0,
            }),
            recovered: Vec::new(),
            report: OpenReport::default(),
        };
        store.rebuild(on_disk, &mut report)?;
        tracing::info!(
            path = %store.path.display(),
            records,
            recovered = report.recovered,
            corrupt = report.corrupt,
            direct_io,
            "file tier open"
        );
        if report.corrupt > 0 {
            tracing::warn!(path = %store.path.display(), dropped = report.corrupt, "torn or corrupt records dropped");
        }
        store.report = report;
        Ok(store)
    }

    /// Opens with `O_DIRECT`, or buffered where the filesystem refuses it (tmpfs).
    fn open_file(path: &Path, direct: bool) -> Result<(File, bool), StoreError> {
        let open = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(flags)
                .open(path)
        };
        if !direct {
            return open(0).map(|f| (f, false)).map_err(io_err("open", path));
        }
        match open(libc::O_DIRECT) {
            Ok(f) => {
                // Some filesystems accept the flag and refuse the IO: try one aligned read.
                let mut page = PageBuf::new(PAGE);
                match f.read_at(page.as_mut_slice(), 0) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    _ => return Ok((f, true)),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(io_err("open", path)(e)),
        }
        tracing::info!(path = %path.display(), "O_DIRECT refused; using buffered IO");
        open(0).map(|f| (f, false)).map_err(io_err("open", path))
    }

    fn read_super(file: &File, path: &Path, block_bytes: usize) -> Result<u32, StoreError> {
        let mut page = PageBuf::new(PAGE);
        file.read_exact_at(page.as_mut_slice(), 0)
            .map_err(io_err("read superblock", path))?;
        let p = page.as_slice();
        let layout = |found: String| StoreError::Layout {
            path: path.to_path_buf(),
            found,
            expected: format!(
                "a kvtier file tier (format {FORMAT_VERSION}) of {block_bytes}-byte blocks"
            ),
        };
        if &p[0..8] != SUPER_MAGIC || xxhash_rust::xxh3::xxh3_64(&p[0..32]) != le_u64(&p[32..]) {
            return Err(layout("no valid kvtier superblock".into()));
        }
        if le_u32(&p[8..]) != FORMAT_VERSION {
            return Err(layout(format!("format version {}", le_u32(&p[8..]))));
        }
        let found_block = le_u64(&p[16..]);
        if found_block != block_bytes as u64 {
            return Err(layout(format!("{found_block}-byte blocks")));
        }
        Ok(le_u64(&p[24..]) as u32)
    }

    fn write_super(
        file: &File,
        path: &Path,
        block_bytes: usize,
        records: u32,
    ) -> Result<(), StoreError> {
        let mut page = PageBuf::new(PAGE);
        let p = page.as_mut_slice();
        p[0..8].copy_from_slice(SUPER_MAGIC);
        p[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        p[16..24].copy_from_slice(&(block_bytes as u64).to_le_bytes());
        p[24..32].copy_from_slice(&u64::from(records).to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&p[0..32]);
        p[32..40].copy_from_slice(&sum.to_le_bytes());
        file.write_all_at(page.as_slice(), 0)
            .and_then(|()| file.sync_data())
            .map_err(io_err("write superblock", path))
    }

    fn offset(&self, record: u32) -> u64 {
        PAGE as u64 + u64::from(record) * record_bytes(self.block_bytes)
    }

    /// ★6: rebuilds the index from the first `on_disk` records, on a few threads.
    fn rebuild(&mut self, on_disk: u32, report: &mut OpenReport) -> Result<(), StoreError> {
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get() * 2)
            .min(8) as u32;
        let per = on_disk.div_ceil(threads.max(1)).max(1);
        let this = &*self;
        let scanned: Vec<Result<Vec<Scanned>, StoreError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..on_disk)
                .step_by(per as usize)
                .map(|start| s.spawn(move || this.scan(start..(start + per).min(on_disk))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("scan thread panicked"))
                .collect()
        });
        let mut found: Vec<(u64, Key, u32)> = Vec::new();
        let mut free = Vec::new();
        for part in scanned {
            for (record, outcome) in part? {
                match outcome {
                    Ok(Some((key, seq))) => found.push((seq, key, record)),
                    Ok(None) => free.push(record),
                    Err(reason) => {
                        tracing::debug!(record, reason, "record dropped at open");
                        report.corrupt += 1;
                        free.push(record);
                    }
                }
            }
        }
        found.sort_by_key(|(seq, _, _)| *seq);
        let mut latest: BTreeMap<Key, (u64, u32)> = BTreeMap::new();
        let mut seq = 0;
        for (s, key, record) in found {
            seq = seq.max(s);
            if let Some((_, older)) = latest.insert(key, (s, record)) {
                report.duplicates += 1;
                free.push(older);
            }
        }
        // Oldest first, so the core's index starts with the right recency order.
        let mut order: Vec<(u64, &Key)> = latest.iter().map(|(k, &(s, _))| (s, k)).collect();
        order.sort();
        self.recovered = order.into_iter().map(|(_, k)| k.clone()).collect();
        let records = latest.into_iter().map(|(k, (_, r))| (k, r)).collect();
        report.recovered = self.recovered.len();
        free.extend(on_disk..self.records);
        // Pop order: lowest record first, so a fresh tier is written sequentially.
        free.sort_unstable_by(|a, b| b.cmp(a));
        let index = self.index.get_mut().unwrap_or_else(|e| e.into_inner());
        *index = Index {
            records,
            free,
            seq: seq + 1,
        };
        Ok(())
    }

    fn scan(&self, records: std::ops::Range<u32>) -> Result<Vec<Scanned>, StoreError> {
        let mut out = Vec::with_capacity(records.len());
        let mut header = PageBuf::new(PAGE);
        let mut payload = PageBuf::new(self.block_bytes);
        // A file cut short (a crash while it grew, a truncation) holds torn records.
        let read = |buf: &mut [u8], offset: u64| match self.file.read_exact_at(buf, offset) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
            other => other.map(|()| true).map_err(io_err("scan", &self.path)),
        };
        for r in records {
            let outcome = if !read(header.as_mut_slice(), self.offset(r))? {
                Err("record cut short")
            } else {
                match Header::parse(header.as_slice()) {
                    Ok(Some(h)) if h.payload_len != self.block_bytes as u64 => {
                        Err("payload length differs")
                    }
                    Ok(Some(h)) => {
                        if read(payload.as_mut_slice(), self.offset(r) + PAGE as u64)? {
                            h.verify(None, payload.as_slice())
                                .map(|()| Some((Key::new(h.key), h.seq)))
                        } else {
                            Err("record cut short")
                        }
                    }
                    Ok(None) => Ok(None),
                    Err(e) => Err(e),
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
        lock(&self.index).records.get(key).map(|&r| self.offset(r))
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
        self.check_block(key, block.len())?;
        let (record, seq) = {
            let mut index = lock(&self.index);
            if index.records.contains_key(key) {
                return Ok(());
            }
            let record = index
                .free
                .pop()
                .ok_or_else(|| StoreError::Full { key: key.clone() })?;
            index.seq += 1;
            (record, index.seq)
        };
        // O_DIRECT needs aligned memory: primary rows are; anything else goes through a copy.
        let bounce;
        let block = if block.as_ptr().align_offset(PAGE) == 0 {
            block
        } else {
            let mut b = PageBuf::new(block.len());
            b.as_mut_slice().copy_from_slice(block);
            bounce = b;
            bounce.as_slice()
        };
        let mut header = PageBuf::new(PAGE);
        Header::write(header.as_mut_slice(), key.as_bytes(), block, seq);
        let written = nix::sys::uio::pwritev(
            &self.file,
            &[IoSlice::new(header.as_slice()), IoSlice::new(block)],
            self.offset(record) as i64,
        );
        let mut index = lock(&self.index);
        match written {
            Ok(n) if n == PAGE + block.len() => {
                index.records.insert(key.clone(), record);
                Ok(())
            }
            other => {
                index.free.push(record);
                Err(match other {
                    Err(e) => io_err("write", &self.path)(e.into()),
                    Ok(_) => io_err("write", &self.path)(std::io::ErrorKind::WriteZero.into()),
                })
            }
        }
    }

    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        self.check_block(key, block.len())?;
        if block.as_ptr().align_offset(PAGE) != 0 {
            // O_DIRECT needs aligned memory: read into an aligned copy.
            let mut b = PageBuf::new(block.len());
            self.get(key, b.as_mut_slice())?;
            block.copy_from_slice(b.as_slice());
            return Ok(());
        }
        let record = lock(&self.index)
            .records
            .get(key)
            .copied()
            .ok_or_else(|| StoreError::NotFound { key: key.clone() })?;
        let mut header = PageBuf::new(PAGE);
        let want = PAGE + block.len();
        let read = nix::sys::uio::preadv(
            &self.file,
            &mut [
                IoSliceMut::new(header.as_mut_slice()),
                IoSliceMut::new(block),
            ],
            self.offset(record) as i64,
        )
        .map_err(|e| io_err("read", &self.path)(e.into()))?;
        let corrupt = |reason| StoreError::Corrupt {
            key: key.clone(),
            reason,
        };
        if read != want {
            return Err(corrupt("short read"));
        }
        let h = Header::parse(header.as_slice())
            .map_err(corrupt)?
            .ok_or(corrupt("the record is empty"))?;
        h.verify(Some(key.as_bytes()), block).map_err(corrupt)
    }

    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        let mut index = lock(&self.index);
        if let Some(record) = index.records.remove(key) {
            index.free.push(record);
        }
        Ok(())
    }

    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        Ok(lock(&self.index).records.contains_key(key))
    }

    fn check(&self) -> Result<(), StoreError> {
        let mut page = PageBuf::new(PAGE);
        self.file
            .read_exact_at(page.as_mut_slice(), 0)
            .map_err(io_err("health check", &self.path))
    }

    fn recovered(&self) -> Vec<Key> {
        self.recovered.clone()
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        if let Err(e) = self.file.sync_data() {
            tracing::warn!(path = %self.path.display(), error = %e, "file tier not synced");
        }
    }
}
