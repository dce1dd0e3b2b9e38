//! Raw memory: the shared CPU region (the primary tier's bytes) and host buffers standing in
//! for GPU memory. Every `unsafe` block that touches kvtier's memory is in this module.
//!
//! The region is one file under `/dev/shm` (by default) mapped `MAP_SHARED` by every worker
//! process. It has one row per primary slot; a row holds one page-aligned sub-slot per worker
//! (tensor-parallel rank), so each worker writes only its own part and a secondary tier reads
//! or writes a whole row in one piece.
//!
//! Who may touch a row is decided by the core, never by this module: the driver only asks for
//! rows of slots that a job owns (see the `SAFETY:` comments and the invariants they name).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtier_core::SlotId;
use memmap2::{MmapOptions, MmapRaw};

use crate::sync::{Mutex, lock};

/// The page size every sub-slot and row is aligned to.
pub const PAGE: usize = 4096;

/// Rounds `n` up to a multiple of [`PAGE`].
pub const fn page_align(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// An error creating, attaching or using a memory region.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The region file already exists (another process created it): attach instead.
    #[error("region {path} already exists; attach to it or remove it")]
    Exists {
        /// The region file.
        path: PathBuf,
    },
    /// The filesystem holding the region lacks room for it.
    #[error(
        "not enough room for the region {path}: it needs {needed} bytes and {available} are free (for /dev/shm, raise its size or lower cpu_bytes_to_use)"
    )]
    NoSpace {
        /// The region file.
        path: PathBuf,
        /// Bytes the region needs.
        needed: u64,
        /// Bytes free on its filesystem.
        available: u64,
    },
    /// The file at the region's path is not one this process may map: a symbolic link, not a
    /// regular file, another user's, or open to other users (who could have planted it or
    /// could read the cache through it).
    #[error("refusing the region {path}: {reason}")]
    Untrusted {
        /// The region file.
        path: PathBuf,
        /// Why it is refused.
        reason: String,
    },
    /// `attach` waited too long for the creator.
    #[error("no region appeared at {path} within {waited:?}")]
    AttachTimeout {
        /// The region file.
        path: PathBuf,
        /// How long it waited.
        waited: Duration,
    },
    /// The region that exists has another size than this process expects.
    #[error(
        "region {path} has {found} bytes, this process expects {expected} (a different layout)"
    )]
    SizeMismatch {
        /// The region file.
        path: PathBuf,
        /// The size this process computed from its layout.
        expected: u64,
        /// The file's size.
        found: u64,
    },
    /// The layout asks for nothing or for too much.
    #[error("invalid region layout: {0}")]
    Layout(&'static str),
    /// A range outside the memory, or a worker out of range.
    #[error("range {offset}+{len} is outside memory of {size} bytes")]
    OutOfRange {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// Bytes in the memory.
        size: u64,
    },
    /// The range overlaps a transfer in flight.
    #[error("range {offset}+{len} overlaps a transfer in flight")]
    Busy {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// An operating system call failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// The shape of a region: `rows` rows of `workers` page-aligned sub-slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Rows, one per primary slot.
    pub rows: u32,
    /// Sub-slots per row, one per worker (tensor-parallel rank).
    pub workers: u16,
    /// Bytes of a block that one worker holds.
    pub block_bytes_per_worker: usize,
}

impl Layout {
    /// A layout, checked: at least one row, one worker and one byte.
    pub fn new(
        rows: u32,
        workers: u16,
        block_bytes_per_worker: usize,
    ) -> Result<Self, RegionError> {
        if rows == 0 || workers == 0 || block_bytes_per_worker == 0 {
            return Err(RegionError::Layout(
                "rows, workers and block bytes must be positive",
            ));
        }
        let l = Layout {
            rows,
            workers,
            block_bytes_per_worker,
        };
        l.row_bytes()
            .checked_mul(rows as usize)
            .ok_or(RegionError::Layout(
                "the region does not fit in the address space",
            ))?;
        Ok(l)
    }

    /// Bytes of one sub-slot: a worker's part of a block, rounded up to a page.
    pub fn sub_slot_bytes(&self) -> usize {
        page_align(self.block_bytes_per_worker)
    }

    /// Bytes of one row (every worker's sub-slot): what a secondary tier moves per block.
    pub fn row_bytes(&self) -> usize {
        self.sub_slot_bytes() * self.workers as usize
    }

    /// Bytes of the whole region.
    pub fn total_bytes(&self) -> usize {
        self.row_bytes() * self.rows as usize
    }

    /// Offset of `slot`'s sub-slot for `worker`.
    pub fn offset(&self, slot: SlotId, worker: u16) -> usize {
        slot.index() * self.row_bytes() + worker as usize * self.sub_slot_bytes()
    }
}

/// A mapping and its bounds checks.
struct Mapping {
    map: MmapRaw,
}

impl Mapping {
    fn len(&self) -> usize {
        self.map.len()
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), RegionError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(RegionError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: self.len() as u64,
            }),
        }
    }

    /// Runs `f` on the bytes `offset..offset + len`.
    ///
    /// The caller guarantees that no other thread or process writes these bytes meanwhile
    /// (each caller names the rule that gives it).
    fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionError> {
        self.check(offset, len)?;
        // SAFETY: the range is inside the live mapping (checked above), which outlives the
        // call; the caller guarantees no concurrent writer of the range.
        let bytes = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) };
        Ok(f(bytes))
    }

    /// Runs `f` on the bytes `offset..offset + len`, writable.
    ///
    /// The caller guarantees that no other thread or process reads or writes these bytes
    /// meanwhile (each caller names the rule that gives it).
    fn with_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RegionError> {
        self.check(offset, len)?;
        // SAFETY: the range is inside the live mapping (checked above), which outlives the
        // call; the caller guarantees exclusive access to the range for the call.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) };
        Ok(f(bytes))
    }

    /// Faults every page in, from `threads` threads, without changing its content.
    fn prefault(&self, threads: usize) {
        let len = self.len();
        let threads = threads.clamp(1, 16);
        let chunk = page_align(len.div_ceil(threads)).max(PAGE);
        let base = self.map.as_mut_ptr() as usize;
        std::thread::scope(|s| {
            for start in (0..len).step_by(chunk) {
                let n = chunk.min(len - start);
                s.spawn(move || {
                    let p = (base + start) as *mut libc::c_void;
                    // SAFETY: `p..p + n` lies inside the mapping, which outlives the scope.
                    // MADV_POPULATE_WRITE only allocates and maps the pages; it changes no
                    // byte, so it races with nothing.
                    let rc = unsafe { libc::madvise(p, n, libc::MADV_POPULATE_WRITE) };
                    if rc != 0 {
                        // Older kernels: read one byte per page, which maps it.
                        for off in (0..n).step_by(PAGE) {
                            // SAFETY: inside the mapping; a volatile read changes nothing.
                            unsafe { std::ptr::read_volatile((base + start + off) as *const u8) };
                        }
                    }
                });
            }
        });
    }
}

/// The primary tier's memory: a shared mapping of a file, one row per slot.
///
/// The creating process owns the file and removes it when the region is dropped; other
/// processes [`attach`](Region::attach).
pub struct Region {
    mapping: Mapping,
    layout: Layout,
    path: PathBuf,
    owner: bool,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("path", &self.path)
            .field("layout", &self.layout)
            .field("owner", &self.owner)
            .finish()
    }
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> RegionError + 'a {
    move |source| RegionError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn untrusted(path: &Path, reason: String) -> RegionError {
    RegionError::Untrusted {
        path: path.to_path_buf(),
        reason,
    }
}

/// Checks that `file` (opened from `path` without following a symbolic link) is a regular
/// file of this process's user that nobody else may read or write.
fn check_trusted(file: &File, path: &Path) -> Result<(), RegionError> {
    use std::os::unix::fs::MetadataExt;
    let md = file.metadata().map_err(io_err("stat", path))?;
    if !md.file_type().is_file() {
        return Err(untrusted(path, "it is not a regular file".into()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if md.uid() != me {
        return Err(untrusted(
            path,
            format!(
                "it belongs to uid {}, not to this process's uid {me}",
                md.uid()
            ),
        ));
    }
    let mode = md.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(untrusted(
            path,
            format!(
                "its mode is {mode:04o}: a region must be readable and writable by its owner alone (0600)"
            ),
        ));
    }
    Ok(())
}

/// Bytes free on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `statvfs` is plain old data; zeroed is a valid value of it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `st` a valid out-pointer for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Reserves `len` bytes of `file` on disk (or in tmpfs) now, so that running out of room is
/// an error here and not a `SIGBUS` or a failed write later.
pub(crate) fn reserve(file: &File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on an open descriptor.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    match rc {
        0 => Ok(()),
        // Filesystems without fallocate: fall back to a sparse size.
        libc::EOPNOTSUPP => file.set_len(len),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

impl Region {
    /// Creates the region file at `path` exclusively (mode 0600), reserves its room, maps it
    /// and faults it in on `prefault_threads` threads.
    ///
    /// The file appears at `path` only once it has its full size, so a process attaching
    /// never maps a short file.
    pub fn create(
        path: &Path,
        layout: Layout,
        prefault_threads: usize,
    ) -> Result<Self, RegionError> {
        let total = layout.total_bytes() as u64;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if path.exists() {
            return Err(RegionError::Exists {
                path: path.to_path_buf(),
            });
        }
        let tmp = path.with_file_name(format!(
            ".{}.creating-{}",
            path.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("region"),
            std::process::id()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        let cleanup = |e: RegionError| {
            let _ = std::fs::remove_file(&tmp);
            e
        };
        // Refuse at once what cannot fit: on tmpfs, a reservation that runs out of room
        // would first take every free page.
        let available = free_bytes(dir).map_err(io_err("statvfs", dir))?;
        if available < total {
            return Err(cleanup(RegionError::NoSpace {
                path: path.to_path_buf(),
                needed: total,
                available,
            }));
        }
        reserve(&file, total).map_err(|e| {
            cleanup(if e.raw_os_error() == Some(libc::ENOSPC) {
                RegionError::NoSpace {
                    path: path.to_path_buf(),
                    needed: total,
                    available: free_bytes(dir).unwrap_or(0),
                }
            } else {
                io_err("reserve", path)(e)
            })
        })?;
        #[cfg(test)]
        if let Some(hook) = tests::AFTER_RESERVE.get() {
            hook(&file, &tmp);
        }
        // Publish under the final name atomically: a link fails if another creator won.
        if let Err(e) = std::fs::hard_link(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(if e.kind() == io::ErrorKind::AlreadyExists {
                RegionError::Exists {
                    path: path.to_path_buf(),
                }
            } else {
                io_err("publish", path)(e)
            });
        }
        let _ = std::fs::remove_file(&tmp);
        let region = Self::map(file, path, layout, true).inspect_err(|_| {
            // Published but unusable: nobody may attach to it.
            let _ = std::fs::remove_file(path);
        })?;
        region.mapping.prefault(prefault_threads);
        tracing::info!(path = %path.display(), bytes = total, rows = layout.rows, "region created");
        Ok(region)
    }

    /// Attaches to a region another process created, waiting up to `timeout` for it to
    /// appear; its size must match `layout`.
    ///
    /// The path must name a regular file (a symbolic link is not followed) owned by this
    /// process's user with no group or other permission bits; anything else is refused with
    /// [`RegionError::Untrusted`].
    pub fn attach(
        path: &Path,
        layout: Layout,
        timeout: Duration,
        prefault_threads: usize,
    ) -> Result<Self, RegionError> {
        let start = Instant::now();
        let file = loop {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
            {
                Ok(f) => break f,
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                    return Err(untrusted(path, "it is a symbolic link".into()));
                }
                Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
                    return Err(untrusted(path, "it is not a regular file".into()));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if start.elapsed() >= timeout {
                        return Err(RegionError::AttachTimeout {
                            path: path.to_path_buf(),
                            waited: start.elapsed(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io_err("open", path)(e)),
            }
        };
        check_trusted(&file, path)?;
        let region = Self::map(file, path, layout, false)?;
        region.mapping.prefault(prefault_threads);
        Ok(region)
    }

    fn map(file: File, path: &Path, layout: Layout, owner: bool) -> Result<Self, RegionError> {
        let expected = layout.total_bytes() as u64;
        let found = file.metadata().map_err(io_err("stat", path))?.len();
        if found != expected {
            return Err(RegionError::SizeMismatch {
                path: path.to_path_buf(),
                expected,
                found,
            });
        }
        let map = MmapOptions::new()
            .len(expected as usize)
            .map_raw(&file)
            .map_err(io_err("map", path))?;
        Ok(Region {
            mapping: Mapping { map },
            layout,
            path: path.to_path_buf(),
            owner,
        })
    }

    /// The region's shape.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The region file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn row_range(&self, slot: SlotId) -> Result<(usize, usize), RegionError> {
        if slot.0 >= self.layout.rows {
            return Err(RegionError::OutOfRange {
                offset: self.layout.offset(slot, 0) as u64,
                len: self.layout.row_bytes() as u64,
                size: self.layout.total_bytes() as u64,
            });
        }
        Ok((self.layout.offset(slot, 0), self.layout.row_bytes()))
    }

    fn sub_range(&self, slot: SlotId, worker: u16, len: usize) -> Result<usize, RegionError> {
        let (row, _) = self.row_range(slot)?;
        if worker >= self.layout.workers || len > self.layout.sub_slot_bytes() {
            return Err(RegionError::OutOfRange {
                offset: self.layout.offset(slot, worker) as u64,
                len: len as u64,
                size: self.layout.total_bytes() as u64,
            });
        }
        Ok(row + worker as usize * self.layout.sub_slot_bytes())
    }

    /// Reads `slot`'s whole row (a secondary tier's write of a cascaded block).
    ///
    /// Only for a slot whose block is Ready and held by the calling job's pin (I3, I4): a
    /// Ready block is never written, and a pinned slot is never reused (I6).
    pub(crate) fn with_row<R>(
        &self,
        slot: SlotId,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionError> {
        let (offset, len) = self.row_range(slot)?;
        self.mapping.with(offset, len, f)
    }

    /// Writes `slot`'s whole row (a secondary tier's read of a promoted block).
    ///
    /// Only for a slot that is Promoting for the calling load job (I5): nobody else reads or
    /// writes a Promoting slot, and it is not freed while the job runs (I6).
    pub(crate) fn with_row_mut<R>(
        &self,
        slot: SlotId,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RegionError> {
        let (offset, len) = self.row_range(slot)?;
        self.mapping.with_mut(offset, len, f)
    }

    /// Copies `src` into `worker`'s sub-slot of `slot` (the GPU → CPU copy of a store).
    ///
    /// Only for a slot that is Pending for the calling store (P4): the engine alone writes a
    /// Pending slot, each worker its own sub-slot, and the slot is not reused until
    /// `complete_store` (I6).
    pub(crate) fn write_sub(
        &self,
        slot: SlotId,
        worker: u16,
        src: &[u8],
    ) -> Result<(), RegionError> {
        let offset = self.sub_range(slot, worker, src.len())?;
        self.mapping
            .with_mut(offset, src.len(), |dst| dst.copy_from_slice(src))
    }

    /// Copies `worker`'s sub-slot of `slot` into `dst` (the CPU → GPU copy of a load).
    ///
    /// Only for a slot pinned by `prepare_load` (P11): a pinned Ready block is never written
    /// or reused until `complete_load` (I3, I6).
    pub(crate) fn read_sub(
        &self,
        slot: SlotId,
        worker: u16,
        dst: &mut [u8],
    ) -> Result<(), RegionError> {
        let offset = self.sub_range(slot, worker, dst.len())?;
        self.mapping
            .with(offset, dst.len(), |src| dst.copy_from_slice(src))
    }

    /// The address and length of the whole mapping (to register it with a GPU driver).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn raw_parts(&self) -> (*mut u8, usize) {
        (self.mapping.map.as_mut_ptr(), self.mapping.len())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.owner {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "region file not removed");
            }
        }
    }
}

fn busy(offset: usize, len: usize) -> RegionError {
    RegionError::Busy {
        offset: offset as u64,
        len: len as u64,
    }
}

/// Host memory standing in for GPU memory (the host transfer engine's "device").
///
/// Transfers claim the ranges they copy; reading or writing a claimed range from outside is
/// refused with [`RegionError::Busy`], so the buffer is safe to share with the engine.
pub struct HostMemory {
    mapping: Mapping,
    claims: Mutex<BTreeMap<usize, usize>>,
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("bytes", &self.len())
            .finish()
    }
}

impl HostMemory {
    /// `bytes` of zeroed, pre-faulted anonymous memory.
    pub fn new(bytes: usize) -> Result<Self, RegionError> {
        if bytes == 0 {
            return Err(RegionError::Layout(
                "host memory must have at least one byte",
            ));
        }
        let map = MmapOptions::new()
            .len(bytes)
            .map_anon()
            .map_err(io_err("map anonymous memory", Path::new("-")))?;
        let mapping = Mapping { map: map.into() };
        mapping.prefault(std::thread::available_parallelism().map_or(1, |n| n.get()));
        Ok(HostMemory {
            mapping,
            claims: Mutex::new(BTreeMap::new()),
        })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Whether it has no bytes (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn overlaps(claims: &BTreeMap<usize, usize>, offset: usize, len: usize) -> bool {
        let end = offset + len;
        claims
            .range(..end)
            .next_back()
            .is_some_and(|(&s, &l)| s + l > offset)
    }

    /// Claims every range of `ranges` for a transfer, all or none.
    pub(crate) fn claim(&self, ranges: &[(usize, usize)]) -> Result<(), RegionError> {
        let mut claims = lock(&self.claims);
        for (i, &(offset, len)) in ranges.iter().enumerate() {
            let refused = self.mapping.check(offset, len).err().or_else(|| {
                (len == 0 || Self::overlaps(&claims, offset, len)).then(|| busy(offset, len))
            });
            if let Some(e) = refused {
                for &(o, _) in &ranges[..i] {
                    claims.remove(&o);
                }
                return Err(e);
            }
            claims.insert(offset, len);
        }
        Ok(())
    }

    /// Releases the ranges a transfer claimed.
    pub(crate) fn release(&self, ranges: &[(usize, usize)]) {
        let mut claims = lock(&self.claims);
        for (offset, _) in ranges {
            claims.remove(offset);
        }
    }

    /// Copies `src` to `offset` (what a model's forward pass would write).
    ///
    /// Refused while a transfer claims any of those bytes.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        let claims = lock(&self.claims);
        if Self::overlaps(&claims, offset, src.len()) {
            return Err(busy(offset, src.len()));
        }
        // No claim covers the range, and none can be taken while the lock is held: nobody
        // else touches these bytes during the copy.
        self.mapping
            .with_mut(offset, src.len(), |dst| dst.copy_from_slice(src))
    }

    /// Copies the bytes at `offset` into `dst`. Refused while a transfer claims any of them.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        let claims = lock(&self.claims);
        if Self::overlaps(&claims, offset, dst.len()) {
            return Err(busy(offset, dst.len()));
        }
        // As in `write`: no writer can claim the range while the lock is held.
        self.mapping
            .with(offset, dst.len(), |src| dst.copy_from_slice(src))
    }

    /// Runs `f` on `len` bytes at `offset` that the calling transfer has claimed.
    pub(crate) fn with_claimed<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionError> {
        // The transfer's claim excludes every other reader and writer of the range.
        self.mapping.with(offset, len, f)
    }

    /// Runs `f` on `len` writable bytes at `offset` that the calling transfer has claimed.
    pub(crate) fn with_claimed_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RegionError> {
        // The transfer's claim excludes every other reader and writer of the range.
        self.mapping.with_mut(offset, len, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A hook `create` calls with the temporary file and its path.
    pub(super) type Hook = fn(&File, &Path);

    thread_local! {
        /// Called by `create` on this thread once the temporary file has its full size,
        /// before it is published.
        pub(super) static AFTER_RESERVE: std::cell::Cell<Option<Hook>> =
            const { std::cell::Cell::new(None) };
    }

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    /// A failure after the region is published (here: a mapping of the wrong size, because
    /// the file shrank before it was published) removes the published file and everything
    /// else `create` made.
    #[test]
    fn a_failure_after_publishing_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        AFTER_RESERVE.set(Some(|file, _| file.set_len(PAGE as u64).unwrap()));
        let r = Region::create(&path, layout(), 1);
        AFTER_RESERVE.set(None);
        assert!(matches!(r, Err(RegionError::SizeMismatch { .. })), "{r:?}");
        assert_eq!(names(dir.path()), Vec::<String>::new());
        Region::create(&path, layout(), 1).unwrap();
    }

    fn layout() -> Layout {
        Layout::new(4, 1, PAGE).unwrap()
    }

    fn attach(path: &Path) -> Result<Region, RegionError> {
        Region::attach(path, layout(), Duration::from_millis(20), 1)
    }

    fn untrusted_reason(r: Result<Region, RegionError>) -> String {
        match r {
            Err(RegionError::Untrusted { reason, .. }) => reason,
            other => panic!("expected an untrusted-file refusal, got {other:?}"),
        }
    }

    /// A symbolic link at the region's path is refused, even to a real region.
    #[test]
    fn attach_refuses_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        let _owner = Region::create(&real, layout(), 1).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let reason = untrusted_reason(attach(&link));
        assert!(reason.contains("symbolic link"), "{reason}");
        attach(&real).unwrap();
    }

    /// A file other users may read or write is refused: another user could have planted it,
    /// or could read the cache through it.
    #[test]
    fn attach_refuses_a_file_open_to_others() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let _owner = Region::create(&path, layout(), 1).unwrap();
        for mode in [0o666, 0o640, 0o602] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let reason = untrusted_reason(attach(&path));
            assert!(reason.contains(&format!("{mode:04o}")), "{reason}");
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        attach(&path).unwrap();
        // A planted file of the right size, world-writable, is refused the same way.
        let planted = dir.path().join("planted");
        let f = File::create(&planted).unwrap();
        f.set_len(layout().total_bytes() as u64).unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o666)).unwrap();
        untrusted_reason(attach(&planted));
    }

    /// A directory (or anything but a regular file) at the path is refused.
    #[test]
    fn attach_refuses_what_is_not_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        let reason = untrusted_reason(attach(&path));
        assert!(reason.contains("not a regular file"), "{reason}");
    }

    /// Another user's file is refused (the check needs root to hand a file to another uid).
    #[test]
    fn attach_refuses_another_users_file() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let _owner = Region::create(&path, layout(), 1).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        let reason = untrusted_reason(attach(&path));
        assert!(reason.contains("uid 65534"), "{reason}");
    }
}
