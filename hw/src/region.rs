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
//!
//! The process that creates a region owns it: it holds a lock on the region's owner record
//! (`.NAME.kvtier-owner`, beside it) for the region's whole life and removes both when done.
//! An owner that dies leaves its files with the lock free, and the next owner in the directory
//! sweeps them (the `owner` submodule describes the files and the rules). Attaching
//! processes take no lock, and map only a regular file of their own user that nobody else
//! may open.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::SlotId;
use memmap2::{MmapOptions, MmapRaw};

use crate::sync::{Mutex, lock};

mod owner;

use owner::{Claim, FileId, Owner};

/// The page size every sub-slot and row is aligned to.
pub const PAGE: usize = 4096;

/// Rounds `n` up to a multiple of [`PAGE`].
pub const fn page_align(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// An error creating, attaching or using a memory region.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The region exists and its owner is alive: attach instead.
    #[error("region {path} already exists and its owner{} is alive; attach to it, or stop that process first", pid.map_or(String::new(), |p| format!(", process {p},")))]
    Exists {
        /// The region file.
        path: PathBuf,
        /// The owner's process id, as its owner record says (`None` while a new owner has
        /// not written it yet).
        pid: Option<u32>,
    },
    /// A file kvtier does not own is at the region's path: it is never removed.
    #[error(
        "{path} exists and is not a region left by a kvtier process that died; remove it or choose another path"
    )]
    Foreign {
        /// The file.
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
    /// The region's owner died: its file is left for a new owner to sweep and replace, and
    /// `attach` waited for one until its timeout.
    #[error("region {path} has no live owner (its creator died); start the owner again")]
    NoLiveOwner {
        /// The region file.
        path: PathBuf,
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
            .and_then(|r| r.checked_add(page_align(rows as usize * workers as usize * 8)))
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

    /// Bytes of the rows: every slot's block.
    pub fn rows_bytes(&self) -> usize {
        self.row_bytes() * self.rows as usize
    }

    /// Bytes of the seals after the rows: one 8-byte word per sub-slot (see
    /// [`Region::seal`]), rounded up to a page.
    pub fn seal_bytes(&self) -> usize {
        page_align(self.rows as usize * self.workers as usize * 8)
    }

    /// Bytes of the whole region: the rows, then the seals.
    pub fn total_bytes(&self) -> usize {
        self.rows_bytes() + self.seal_bytes()
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
/// processes [`attach`](Region::attach). If the owner dies without dropping it, the next
/// [`create`](Region::create) or [`sweep`](Region::sweep) in the directory removes it.
pub struct Region {
    mapping: Mapping,
    layout: Layout,
    path: PathBuf,
    /// The locked owner record and the region file's identity, in the owning process.
    owner: Option<(Owner, FileId)>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("path", &self.path)
            .field("layout", &self.layout)
            .field("owner", &self.owner.is_some())
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

fn bad_name(path: &Path, why: &'static str) -> RegionError {
    RegionError::Io {
        what: "use as a region",
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, why),
    }
}

/// Whether a process with this id exists.
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Ok(()) | Err(nix::errno::Errno::EPERM)
    )
}

/// Claims the name of the region `path` (in `dir`) for a new region.
///
/// A lock held without a live process's id in the record is most likely a moment's: a new
/// owner that has not written its pid yet, or a sweep looking at a dead owner's record. It
/// is tried again for a short while before the region is said to exist.
fn claim_to_create(dir: &Path, name: &std::ffi::OsStr, path: &Path) -> Result<Owner, RegionError> {
    const PATIENCE: Duration = Duration::from_millis(100);
    let start = Instant::now();
    loop {
        match Owner::claim(dir, name, true)? {
            Claim::Owned(owner) => return Ok(owner),
            Claim::Live(pid) => {
                if pid.is_some_and(process_alive) || start.elapsed() >= PATIENCE {
                    return Err(RegionError::Exists {
                        path: path.to_path_buf(),
                        pid,
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // Removed between the open and the lock: open (create) it again.
            Claim::Gone => {}
        }
    }
}

/// A creation in progress: on an error (or a panic) it removes what it made, the creating
/// file, the published region and the owner record, and lets go of the record's lock.
struct Creation<'a> {
    owner: Option<Owner>,
    region: &'a Path,
    creating: Option<PathBuf>,
    published: Option<FileId>,
}

impl Creation<'_> {
    /// The creation succeeded: the owner record and the region's identity, for the region.
    fn finish(mut self) -> Option<(Owner, FileId)> {
        self.creating = None;
        let id = self.published.take()?;
        Some((self.owner.take()?, id))
    }
}

impl Drop for Creation<'_> {
    fn drop(&mut self) {
        if let Some(tmp) = self.creating.take() {
            let _ = std::fs::remove_file(tmp);
        }
        if let Some(id) = self.published.take()
            && let Err(e) = owner::remove_if_same(self.region, id, false)
        {
            tracing::warn!(error = %e, "region file not removed");
        }
        if let Some(owner) = self.owner.take()
            && let Err(e) = owner.release()
        {
            tracing::warn!(error = %e, "owner record not removed");
        }
    }
}

/// The directory and the file name of a region's path; a name kvtier keeps for its own files
/// (owner records, files being created) is refused.
fn split(path: &Path) -> Result<(&Path, &std::ffi::OsStr), RegionError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match path.file_name() {
        Some(n) if owner::is_region_name(n) => Ok((dir, n)),
        Some(_) => Err(bad_name(path, "the name is kept for kvtier's own files")),
        None => Err(bad_name(path, "the path has no file name")),
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
    /// Creates the region file at `path` (mode 0600), reserves its room, maps it and faults it
    /// in on `prefault_threads` threads.
    ///
    /// The file appears at `path` only once it has its full size, so a process attaching
    /// never maps a short file.
    ///
    /// The new region is owned by this process: its owner record beside it
    /// (`.NAME.kvtier-owner`) is locked until the region is dropped, when the region and the
    /// record are removed. First, every region in the same directory whose owner died is
    /// swept (see [`Region::sweep`]), and a dead owner's region at `path` itself is replaced.
    /// A region at `path` whose owner is alive is [`RegionError::Exists`] (naming its pid);
    /// any other file there is [`RegionError::Foreign`] and is left alone.
    pub fn create(
        path: &Path,
        layout: Layout,
        prefault_threads: usize,
    ) -> Result<Self, RegionError> {
        let total = layout.total_bytes() as u64;
        let (dir, name) = split(path)?;
        match Self::sweep(dir) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "removed the regions of processes that died");
            }
            Ok(_) => {}
            // The sweep is a courtesy to the directory; this region's own name is claimed
            // (and its leftovers removed) below regardless.
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "sweep failed"),
        }
        let owner = claim_to_create(dir, name, path)?;
        let mut creation = Creation {
            owner: Some(owner),
            region: path,
            creating: None,
            published: None,
        };
        let owner = creation.owner.as_ref().expect("set above");
        owner.remove_leftovers()?;
        if std::fs::symlink_metadata(path).is_ok() {
            return Err(RegionError::Foreign {
                path: path.to_path_buf(),
            });
        }
        owner.write(None)?;
        let tmp = dir.join(owner::creating_name(name, std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        creation.creating = Some(tmp.clone());
        // Whatever the umask: attachers require the owner's read and write bits.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io_err("chmod", &tmp))?;
        let id = |file: &File| -> Result<FileId, RegionError> {
            let md = file.metadata().map_err(io_err("stat", &tmp))?;
            Ok(FileId::with_len(&md, total))
        };
        // Recorded before the room is taken: if this process dies from here on, the next
        // owner of the name knows which file was its region.
        owner.write(Some(id(&file)?))?;
        // Refuse at once what cannot fit: on tmpfs, a reservation that runs out of room
        // would first take every free page.
        let available = free_bytes(dir).map_err(io_err("statvfs", dir))?;
        if available < total {
            return Err(RegionError::NoSpace {
                path: path.to_path_buf(),
                needed: total,
                available,
            });
        }
        reserve(&file, total).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOSPC) {
                RegionError::NoSpace {
                    path: path.to_path_buf(),
                    needed: total,
                    available: free_bytes(dir).unwrap_or(0),
                }
            } else {
                io_err("reserve", path)(e)
            }
        })?;
        #[cfg(test)]
        if let Some(hook) = tests::AFTER_RESERVE.get() {
            hook(&file, &tmp);
        }
        // Publish under the final name atomically. No kvtier process makes a file there
        // without the record's lock, so one that appeared meanwhile is not kvtier's.
        if let Err(e) = std::fs::hard_link(&tmp, path) {
            return Err(if e.kind() == io::ErrorKind::AlreadyExists {
                RegionError::Foreign {
                    path: path.to_path_buf(),
                }
            } else {
                io_err("publish", path)(e)
            });
        }
        creation.published = Some(id(&file)?);
        let _ = std::fs::remove_file(&tmp);
        creation.creating = None;
        let mut region = Self::map(file, path, layout)?;
        region.mapping.prefault(prefault_threads);
        region.owner = creation.finish();
        tracing::info!(path = %path.display(), bytes = total, rows = layout.rows, "region created");
        Ok(region)
    }

    /// Removes every region in `dir` whose owner died, with its owner record and any file a
    /// creator that died was filling; returns the files removed. A region whose owner is
    /// alive, and every file that is not kvtier's, another user's or a symbolic link, is left
    /// alone.
    ///
    /// A region's owner holds `flock(LOCK_EX)` on its owner record (`.NAME.kvtier-owner`)
    /// for the region's whole life; the kernel lets go of the lock when the owner dies, so a
    /// lock that can be taken means a dead owner, whatever became of its process id. The
    /// files of a dead owner are: the region file its record names (same device, inode and
    /// size), the record, and the name's creating files (`.NAME.kvtier-creating-PID`).
    /// Processes that merely attached hold no lock: a region is swept once its owner died,
    /// and those processes keep their mapping, but the name is gone.
    ///
    /// [`Region::create`] sweeps its directory first; calling this before creating is only
    /// needed to report what was removed.
    pub fn sweep(dir: &Path) -> Result<Vec<PathBuf>, RegionError> {
        owner::sweep(dir)
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
        let file = Self::open_owned(path, start, timeout)?;
        let region = Self::map(file, path, layout)?;
        region.mapping.prefault(prefault_threads);
        Ok(region)
    }

    /// Opens the file at `path` for reading and writing, waiting for it to appear until
    /// `timeout`; a symbolic link or a directory is refused.
    fn open_untrusted(path: &Path, start: Instant, timeout: Duration) -> Result<File, RegionError> {
        loop {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
            {
                Ok(f) => return Ok(f),
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
        }
    }

    /// Opens the region at `path` once a live owner holds it: a file left by an owner that
    /// died is waited past (a new owner sweeps and replaces it) until `timeout`.
    fn open_owned(path: &Path, start: Instant, timeout: Duration) -> Result<File, RegionError> {
        let (dir, name) = split(path)?;
        loop {
            let file = Self::open_untrusted(path, start, timeout)?;
            check_trusted(&file, path)?;
            let md = file.metadata().map_err(io_err("stat", path))?;
            if owner::has_live_owner(dir, name, &md)? {
                return Ok(file);
            }
            if start.elapsed() >= timeout {
                return Err(RegionError::NoLiveOwner {
                    path: path.to_path_buf(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn map(file: File, path: &Path, layout: Layout) -> Result<Self, RegionError> {
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
            owner: None,
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

    /// Runs `f` on the rows of `slots`, all borrowed at once (a secondary tier's batched write
    /// of a cascade job's blocks).
    ///
    /// Only for slots whose blocks are Ready and held by the calling job's pins (I3, I4), as
    /// [`with_row`](Self::with_row).
    pub(crate) fn with_rows<R>(
        &self,
        slots: &[SlotId],
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, RegionError> {
        let mut rows = Vec::with_capacity(slots.len());
        for &slot in slots {
            let (offset, len) = self.row_range(slot)?;
            self.mapping.check(offset, len)?;
            // SAFETY: the range is inside the live mapping (checked above), which outlives
            // `f`; no one writes a Ready row pinned by the calling job (I3, I4).
            rows.push(unsafe {
                std::slice::from_raw_parts(self.mapping.map.as_ptr().add(offset), len)
            });
        }
        Ok(f(&rows))
    }

    /// Runs `f` on the rows of `slots`, writable and all borrowed at once (a secondary tier's
    /// batched read of a promotion job's blocks). Refused if a slot is named twice.
    ///
    /// Only for slots that are Promoting for the calling load job (I5), as
    /// [`with_row_mut`](Self::with_row_mut).
    pub(crate) fn with_rows_mut<R>(
        &self,
        slots: &[SlotId],
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R, RegionError> {
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            let (offset, len) = self.row_range(w[0])?;
            return Err(busy(offset, len));
        }
        let mut rows = Vec::with_capacity(slots.len());
        for &slot in slots {
            let (offset, len) = self.row_range(slot)?;
            self.mapping.check(offset, len)?;
            // SAFETY: the range is inside the live mapping (checked above), which outlives
            // `f`; the slots are distinct (checked above), so the rows do not overlap; no one
            // else reads or writes a row Promoting for the calling job (I5).
            rows.push(unsafe {
                std::slice::from_raw_parts_mut(self.mapping.map.as_mut_ptr().add(offset), len)
            });
        }
        Ok(f(&mut rows))
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
        self.write_part(slot, worker, 0, src)
    }

    /// Copies `src` into `worker`'s sub-slot of `slot` from byte `at` of the sub-slot: one
    /// piece of a store whose block is spread over several device tensors (a worker handler
    /// of an inference engine).
    ///
    /// Only for a slot that is Pending for the calling store, under the same rule as
    /// `write_sub`: the engine alone writes a Pending slot, each worker its own sub-slot, and
    /// the slot is not reused until `complete_store` (P4, I6). Bytes beyond the sub-slot are
    /// refused.
    pub fn write_part(
        &self,
        slot: SlotId,
        worker: u16,
        at: usize,
        src: &[u8],
    ) -> Result<(), RegionError> {
        let offset = self.part_range(slot, worker, at, src.len())?;
        self.mapping
            .with_mut(offset, src.len(), |dst| dst.copy_from_slice(src))
    }

    /// Copies bytes of `worker`'s sub-slot of `slot`, from byte `at`, into `dst`: one piece
    /// of a load (see [`write_part`](Self::write_part)).
    ///
    /// Only for a slot pinned by `prepare_load`: a pinned Ready block is never written or
    /// reused until `complete_load` (P11, I3, I6). Bytes beyond the sub-slot are refused.
    pub fn read_part(
        &self,
        slot: SlotId,
        worker: u16,
        at: usize,
        dst: &mut [u8],
    ) -> Result<(), RegionError> {
        let offset = self.part_range(slot, worker, at, dst.len())?;
        self.mapping
            .with(offset, dst.len(), |src| dst.copy_from_slice(src))
    }

    /// The seal of `worker`'s sub-slot of `slot`: a word that the worker sets, with
    /// [`set_seal`](Self::set_seal), once a store's copy into the sub-slot is complete. The
    /// process that hands out the slot writes a fresh value first, and reads the seals back
    /// before it lets the block be read: a store is complete only if every worker set the
    /// value it was given for it. Seals are atomic words, written with release and read with
    /// acquire ordering, so a seal seen set means the sub-slot's bytes before it are seen too.
    pub fn seal(&self, slot: SlotId, worker: u16) -> Result<u64, RegionError> {
        Ok(self.seal_word(slot, worker)?.load(Ordering::Acquire))
    }

    /// Sets the seal of `worker`'s sub-slot of `slot` (see [`seal`](Self::seal)).
    pub fn set_seal(&self, slot: SlotId, worker: u16, value: u64) -> Result<(), RegionError> {
        self.seal_word(slot, worker)?
            .store(value, Ordering::Release);
        Ok(())
    }

    fn seal_word(&self, slot: SlotId, worker: u16) -> Result<&AtomicU64, RegionError> {
        let l = self.layout;
        if slot.0 >= l.rows || worker >= l.workers {
            return Err(RegionError::OutOfRange {
                offset: l.rows_bytes() as u64,
                len: 8,
                size: l.total_bytes() as u64,
            });
        }
        let offset = l.rows_bytes() + (slot.index() * l.workers as usize + worker as usize) * 8;
        self.mapping.check(offset, 8)?;
        // SAFETY: the word lies inside the live mapping (checked above), which lives as long
        // as `self`; it is 8-byte aligned (the mapping is page-aligned, `rows_bytes` a
        // multiple of a page); seals are only ever accessed as atomics, by every process.
        Ok(unsafe { &*(self.mapping.map.as_ptr().add(offset) as *const AtomicU64) })
    }

    fn part_range(
        &self,
        slot: SlotId,
        worker: u16,
        at: usize,
        len: usize,
    ) -> Result<usize, RegionError> {
        let end = at.checked_add(len).ok_or(RegionError::OutOfRange {
            offset: at as u64,
            len: len as u64,
            size: self.layout.total_bytes() as u64,
        })?;
        Ok(self.sub_range(slot, worker, end)? + at)
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
        self.read_part(slot, worker, 0, dst)
    }

    /// The address and length of the whole mapping (to register it with a GPU driver).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn raw_parts(&self) -> (*mut u8, usize) {
        (self.mapping.map.as_mut_ptr(), self.mapping.len())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some((owner, id)) = self.owner.take() {
            // Only the file this process made: never one that replaced it by hand.
            if let Err(e) = owner::remove_if_same(&self.path, id, false) {
                tracing::warn!(path = %self.path.display(), error = %e, "region file not removed");
            }
            if let Err(e) = owner.release() {
                tracing::warn!(error = %e, "owner record not removed");
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

    /// Seals live after the rows, one word per sub-slot: a seal set through one mapping is
    /// read through another, it changes no byte of any row, and seals outside the region are
    /// refused.
    #[test]
    fn seals_are_shared_and_kept_apart_from_the_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let l = Layout::new(3, 2, PAGE).unwrap();
        assert_eq!(l.total_bytes(), l.rows_bytes() + PAGE);
        let owner = Region::create(&path, l, 1).unwrap();
        let other = Region::attach(&path, l, Duration::from_millis(20), 1).unwrap();
        for slot in 0..3 {
            for worker in 0..2 {
                assert_eq!(owner.seal(SlotId(slot), worker).unwrap(), 0);
                owner
                    .set_seal(
                        SlotId(slot),
                        worker,
                        u64::from(slot) * 10 + u64::from(worker) + 1,
                    )
                    .unwrap();
            }
        }
        for slot in 0..3 {
            for worker in 0..2 {
                let want = u64::from(slot) * 10 + u64::from(worker) + 1;
                assert_eq!(other.seal(SlotId(slot), worker).unwrap(), want);
                let mut row = vec![1u8; PAGE];
                other.read_sub(SlotId(slot), worker, &mut row).unwrap();
                assert!(row.iter().all(|&b| b == 0), "a seal wrote into a row");
            }
        }
        for (slot, worker) in [(3, 0), (0, 2), (u32::MAX, 0)] {
            assert!(matches!(
                owner.seal(SlotId(slot), worker),
                Err(RegionError::OutOfRange { .. })
            ));
            assert!(owner.set_seal(SlotId(slot), worker, 1).is_err());
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

    /// The environment variable that makes [`child_process`] play a role.
    const CHILD_ROLE: &str = "KVTIER_REGION_TEST_CHILD";
    /// The environment variable naming the child's region.
    const CHILD_PATH: &str = "KVTIER_REGION_TEST_PATH";
    /// What the child prints once it is where the test kills it.
    const READY: &str = "kvtier-region-child-ready";

    /// Not a test: the entry point of the child processes that the tests below start (this
    /// binary run again with [`CHILD_ROLE`] set) and kill with `SIGKILL`. Role `own` creates
    /// a region and waits; role `creating` stops inside `create`, once the temporary file has
    /// its full size and before it is published, and waits.
    #[test]
    #[ignore = "the entry point of a child process, started by the tests that kill it"]
    fn child_process() {
        fn ready_and_wait() -> ! {
            use std::io::Write;
            let mut out = io::stdout();
            writeln!(out, "{READY}").unwrap();
            out.flush().unwrap();
            loop {
                std::thread::park();
            }
        }
        let (Ok(role), Some(path)) = (std::env::var(CHILD_ROLE), std::env::var_os(CHILD_PATH))
        else {
            return;
        };
        let path = PathBuf::from(path);
        match role.as_str() {
            "own" => {
                let _region = Region::create(&path, layout(), 1).unwrap();
                ready_and_wait();
            }
            "creating" => {
                AFTER_RESERVE.set(Some(|_, _| ready_and_wait()));
                let r = Region::create(&path, layout(), 1);
                panic!("the hook did not stop the creation: {r:?}");
            }
            other => panic!("unknown child role {other}"),
        }
    }

    /// A child process in a role of [`child_process`], killed (`SIGKILL`) and reaped when
    /// dropped.
    struct Child(std::process::Child);

    impl Child {
        /// Starts a child in `role` on the region `path` and waits until it is ready.
        fn start(role: &str, path: &Path) -> Child {
            use std::io::BufRead;
            let mut child = Child(
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "region::tests::child_process", "--ignored"])
                    .args(["--nocapture", "--test-threads=1", "-q"])
                    .env(CHILD_ROLE, role)
                    .env(CHILD_PATH, path)
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap(),
            );
            let out = child.0.stdout.take().unwrap();
            for line in io::BufReader::new(out).lines() {
                if line.unwrap().contains(READY) {
                    return child;
                }
            }
            panic!("the child ({role}) ended before it was ready");
        }

        fn pid(&self) -> u32 {
            self.0.id()
        }

        /// `kill -9`, and waits until the process is gone.
        fn kill(mut self) {
            self.0.kill().unwrap();
            self.0.wait().unwrap();
        }
    }

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// An owner killed with `SIGKILL` leaves its region behind; a new `create` at the same
    /// path removes it and succeeds, and the new owner leaves nothing when dropped.
    #[test]
    fn a_killed_owners_region_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a");
        Child::start("own", &path).kill();
        assert!(path.exists(), "the killed owner left its region");
        let region = Region::create(&path, layout(), 1).unwrap();
        drop(region);
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    /// A creator killed while its temporary file holds the whole reserved region leaves that
    /// file behind; the next `create` in the directory removes it.
    #[test]
    fn a_creator_killed_while_reserving_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c");
        let child = Child::start("creating", &path);
        let temp = names(dir.path())
            .into_iter()
            .find(|n| n.contains("creating"))
            .expect("the creator's temporary file");
        let size = std::fs::metadata(dir.path().join(&temp)).unwrap().len();
        assert_eq!(size, layout().total_bytes() as u64);
        assert!(!path.exists());
        child.kill();
        let region = Region::create(&path, layout(), 1).unwrap();
        assert!(
            !names(dir.path()).iter().any(|n| n.contains("creating")),
            "{:?}",
            names(dir.path())
        );
        drop(region);
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    /// A worker never attaches to a region whose owner died: it waits for a live owner, and
    /// attaches to the new owner's region once it exists.
    #[test]
    fn attach_waits_past_a_dead_owners_region() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        Child::start("own", &path).kill();
        assert!(path.exists(), "the killed owner left its region");
        let err = Region::attach(&path, layout(), Duration::from_millis(50), 1).unwrap_err();
        assert!(matches!(err, RegionError::NoLiveOwner { .. }), "{err}");
        let owner = Region::create(&path, layout(), 1).unwrap();
        Region::attach(&path, layout(), Duration::from_millis(50), 1).unwrap();
        drop(owner);
    }

    fn sorted(mut v: Vec<PathBuf>) -> Vec<PathBuf> {
        v.sort();
        v
    }

    /// A live owner's region is never swept nor replaced: `create` names the owner's pid,
    /// and others attach. Once the owner is killed, a sweep removes the region and its
    /// record, and the path can be created again.
    #[test]
    fn a_live_owners_region_is_never_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b");
        let child = Child::start("own", &path);
        let err = Region::create(&path, layout(), 1).unwrap_err();
        assert!(
            matches!(err, RegionError::Exists { pid: Some(p), .. } if p == child.pid()),
            "{err:?}"
        );
        assert!(err.to_string().contains(&child.pid().to_string()), "{err}");
        assert_eq!(Region::sweep(dir.path()).unwrap(), Vec::<PathBuf>::new());
        let attached = attach(&path).unwrap();
        attached.write_sub(SlotId(0), 0, &[7; 16]).unwrap();
        child.kill();
        assert_eq!(
            sorted(Region::sweep(dir.path()).unwrap()),
            vec![dir.path().join(".b.kvtier-owner"), path.clone()]
        );
        assert_eq!(names(dir.path()), Vec::<String>::new());
        // The attached process keeps its mapping; only the name is gone.
        let mut back = [0; 16];
        attached.read_sub(SlotId(0), 0, &mut back).unwrap();
        assert_eq!(back, [7; 16]);
        drop(attached);
        drop(Region::create(&path, layout(), 1).unwrap());
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    /// In one directory, a sweep removes exactly the files of owners that were killed (after
    /// creating, and while creating) and leaves live regions, this process's region and
    /// every file that is not kvtier's alone.
    #[test]
    fn a_sweep_removes_dead_owners_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // (Each `create` sweeps the directory: the owners die after the last one.)
        let mine = Region::create(&d.join("mine"), layout(), 1).unwrap();
        let live = Child::start("own", &d.join("live"));
        let creator = Child::start("creating", &d.join("half"));
        let creating = d.join(format!(".half.kvtier-creating-{}", creator.pid()));
        assert!(creating.exists());
        Child::start("own", &d.join("dead")).kill();
        creator.kill();
        // Not kvtier's: a plain file, a record-like file with other text, a record-like
        // symbolic link, and an older kind of temporary name.
        std::fs::write(d.join("plain"), b"x").unwrap();
        std::fs::write(d.join(".other.kvtier-owner"), b"not a record").unwrap();
        std::fs::set_permissions(
            d.join(".other.kvtier-owner"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink(d.join("plain"), d.join(".link.kvtier-owner")).unwrap();
        std::fs::write(d.join(".old.creating-1"), b"x").unwrap();
        let before = names(d);
        assert!(before.contains(&"dead".to_string()), "{before:?}");

        let removed = sorted(Region::sweep(d).unwrap());
        assert_eq!(
            removed,
            vec![
                d.join(".dead.kvtier-owner"),
                creating.clone(),
                d.join(".half.kvtier-owner"),
                d.join("dead"),
            ]
        );
        let after: Vec<String> = before
            .into_iter()
            .filter(|n| !removed.contains(&d.join(n)))
            .collect();
        assert_eq!(names(d), after);
        assert_eq!(
            after,
            [
                ".link.kvtier-owner",
                ".live.kvtier-owner",
                ".mine.kvtier-owner",
                ".old.creating-1",
                ".other.kvtier-owner",
                "live",
                "mine",
                "plain",
            ]
        );
        assert_eq!(Region::sweep(d).unwrap(), Vec::<PathBuf>::new());

        // A file that is not kvtier's is never replaced.
        let err = Region::create(&d.join("plain"), layout(), 1).unwrap_err();
        assert!(matches!(err, RegionError::Foreign { .. }), "{err:?}");
        assert_eq!(std::fs::read(d.join("plain")).unwrap(), b"x");
        let err = Region::create(&d.join("other"), layout(), 1).unwrap_err();
        assert!(matches!(err, RegionError::Untrusted { .. }), "{err:?}");
        let err = Region::create(&d.join(".x.kvtier-owner"), layout(), 1).unwrap_err();
        assert!(err.to_string().contains("kvtier's own files"), "{err}");
        // This process's own region is alive.
        let err = Region::create(&d.join("mine"), layout(), 1).unwrap_err();
        assert!(
            matches!(err, RegionError::Exists { pid: Some(p), .. } if p == std::process::id()),
            "{err:?}"
        );
        drop(mine);
        drop(live);
        assert_eq!(
            sorted(Region::sweep(d).unwrap()),
            vec![d.join(".live.kvtier-owner"), d.join("live")]
        );
    }

    /// A killed creator's file is swept even when its owner record was removed by hand.
    #[test]
    fn a_creating_file_without_its_record_is_swept() {
        let dir = tempfile::tempdir().unwrap();
        let creator = Child::start("creating", &dir.path().join("r"));
        let creating = dir
            .path()
            .join(format!(".r.kvtier-creating-{}", creator.pid()));
        creator.kill();
        std::fs::remove_file(dir.path().join(".r.kvtier-owner")).unwrap();
        assert_eq!(names(dir.path()).len(), 1);
        let removed = Region::sweep(dir.path()).unwrap();
        assert!(removed.contains(&creating), "{removed:?}");
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    /// A dead owner's files that belong to another user are not this user's to sweep (the
    /// check needs root to hand files to another uid).
    #[test]
    fn a_sweep_leaves_other_users_files_alone() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("theirs");
        Child::start("own", &path).kill();
        let record = dir.path().join(".theirs.kvtier-owner");
        std::os::unix::fs::chown(&record, Some(65534), None).unwrap();
        assert_eq!(Region::sweep(dir.path()).unwrap(), Vec::<PathBuf>::new());
        assert!(path.exists() && record.exists());
        let err = Region::create(&path, layout(), 1).unwrap_err();
        assert!(
            matches!(&err, RegionError::Untrusted { reason, .. } if reason.contains("uid 65534")),
            "{err:?}"
        );
        std::os::unix::fs::chown(&record, Some(0), None).unwrap();
        assert_eq!(
            sorted(Region::sweep(dir.path()).unwrap()),
            vec![record, path]
        );
    }
}
