//! Raw memory: the shared CPU region (the primary tier's bytes) and host buffers standing in
//! for GPU memory. Every `unsafe` block that touches kvtier's memory is in this module.
//!
//! The region is shared memory mapped `MAP_SHARED` by every worker process. It has one row
//! per primary slot, page-aligned; a row holds one sub-slot per worker (tensor-parallel rank),
//! so each worker writes only its own part and a secondary tier reads or writes a whole row in
//! one piece.
//!
//! A region is one of two kinds ([`RegionKind`]), chosen by its name:
//!
//! - **anonymous** (`@NAME`): memory with no name in any filesystem (`memfd_create`), which
//!   attachers receive from the owner over a Unix socket in Linux's abstract namespace. The
//!   kernel frees it once the last process holding it is gone: nothing is left behind however
//!   the processes die. The `anon` submodule describes the rendezvous and its checks.
//! - **file** (any other path, such as `/dev/shm/kvtier-x`): a file that attachers open by
//!   its path. It outlives processes that die; the next owner in its directory sweeps it.
//!
//! Who may touch a row is decided by the core, never by this module: the driver only asks for
//! rows of slots that a job owns (see the `SAFETY:` comments and the invariants they name).
//!
//! The process that creates a file region owns it: it holds a lock on the region's owner
//! record (`.NAME.kvtier-owner`, beside it) for the region's whole life and removes both when
//! done.
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

use crate::copy::copy_bulk;
use crate::sync::{Mutex, lock};

mod anon;
mod owner;

use owner::{Claim, FileId, Owner};

/// The kind of memory a region's name designates (see [`RegionKind::of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// A file at the path, opened by attachers through it (default under `/dev/shm`), with
    /// an owner record beside it. If every process using it dies, it stays until the next
    /// owner in its directory sweeps it ([`Region::sweep`]).
    File,
    /// Memory with no name in any filesystem, named `@NAME`: the owner hands it to attachers
    /// of its own user over the abstract Unix socket `kvtier/UID/NAME`. The kernel frees it
    /// once no process holds it, however they end; there is nothing to sweep.
    Anonymous,
}

impl RegionKind {
    /// The kind of region `path` names: a name that begins with `@` ([`ANONYMOUS_PREFIX`])
    /// is anonymous, any other path a file (a file whose name begins with `@` is written
    /// with its directory, as `./@x`).
    pub fn of(path: &Path) -> Self {
        if anon::name_of(path).is_some() {
            RegionKind::Anonymous
        } else {
            RegionKind::File
        }
    }
}

/// The first character of an anonymous region's name (`@NAME`, as `ss` writes an abstract
/// socket's).
pub const ANONYMOUS_PREFIX: char = anon::PREFIX;

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
    /// The filesystem holding a file region lacks room for it, or the system lacks the
    /// memory for an anonymous one.
    #[error(
        "not enough room for the region {path}: it needs {needed} bytes and {available} are free (for /dev/shm, raise its size; for an anonymous region, free memory; or lower cpu_bytes_to_use)"
    )]
    NoSpace {
        /// The region's path or name.
        path: PathBuf,
        /// Bytes the region needs.
        needed: u64,
        /// Bytes free on its filesystem (file), or memory available (anonymous).
        available: u64,
    },
    /// The file at the region's path is not one this process may map: a symbolic link, not a
    /// regular file, another user's, or open to other users (who could have planted it or
    /// could read the cache through it). For an anonymous region: its name is held by, or
    /// answered from, a process of another user or one that is not a kvtier region's owner,
    /// or its memory's size is not sealed.
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
    /// `attach` waited too long for the creator (for an anonymous region: for an owner to
    /// listen and answer).
    #[error("no region appeared at {path} within {waited:?}")]
    AttachTimeout {
        /// The region's path or name.
        path: PathBuf,
        /// How long it waited.
        waited: Duration,
    },
    /// The region that exists has another size than this process expects.
    #[error(
        "region {path} has {found} bytes, this process expects {expected} (a different layout)"
    )]
    SizeMismatch {
        /// The region's path or name.
        path: PathBuf,
        /// The size this process computed from its layout.
        expected: u64,
        /// The region's size (the file's, or what an anonymous region's owner announced).
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

/// The shape of a region: `rows` page-aligned rows of `workers` sub-slots each.
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
        block_bytes_per_worker
            .checked_mul(workers as usize)
            .and_then(|b| b.checked_add(PAGE))
            .ok_or(RegionError::Layout(
                "the region does not fit in the address space",
            ))?;
        l.row_bytes()
            .checked_mul(rows as usize)
            .and_then(|r| r.checked_add(page_align(rows as usize * workers as usize * 8)))
            .ok_or(RegionError::Layout(
                "the region does not fit in the address space",
            ))?;
        Ok(l)
    }

    /// Bytes of one sub-slot: a worker's part of a block. The parts of a row follow one
    /// another with no padding, as in vLLM 0.33's CPU tier.
    pub fn sub_slot_bytes(&self) -> usize {
        self.block_bytes_per_worker
    }

    /// Bytes of one row (every worker's sub-slot, then padding to a page): what a secondary
    /// tier moves per block. vLLM 0.33's CPU tier sizes its rows the same way, so the same
    /// `cpu_bytes_to_use` holds the same number of slots in both.
    pub fn row_bytes(&self) -> usize {
        page_align(self.block_bytes_per_worker * self.workers as usize)
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

/// The primary tier's memory: a shared mapping, one row per slot.
///
/// The creating process owns the region; other processes [`attach`](Region::attach). An
/// anonymous region ([`RegionKind`]) is found only while its owner holds it and is freed by
/// the kernel once no process maps it. A file region's owner removes its file when the region
/// is dropped; if the owner dies without dropping it, the next [`create`](Region::create) or
/// [`sweep`](Region::sweep) in the directory removes it.
pub struct Region {
    mapping: Mapping,
    layout: Layout,
    path: PathBuf,
    /// What the owning process holds for the region (`None` in an attached process).
    owner: Option<Ownership>,
}

/// What the process that created a region holds until it drops it.
enum Ownership {
    /// A file region's locked owner record and the region file's identity.
    File(Owner, FileId),
    /// An anonymous region's socket and the thread that hands the memory to attachers.
    Anonymous(anon::Listener),
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
    fn finish(mut self) -> Option<Ownership> {
        self.creating = None;
        let id = self.published.take()?;
        Some(Ownership::File(self.owner.take()?, id))
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
    /// Creates the region `path` names (its kind: [`RegionKind::of`]), reserves all of its
    /// memory, maps it and faults it in on `prefault_threads` threads. The new region is owned
    /// by this process until it is dropped.
    ///
    /// **Anonymous** (`@NAME`): the memory is a sealed `memfd`, refused with
    /// [`RegionError::NoSpace`] if the system has less memory available. The name is claimed
    /// by listening on the abstract socket `kvtier/UID/NAME`: a name a live process of this
    /// user holds is [`RegionError::Exists`] (naming its pid), one held by another user's
    /// process is [`RegionError::Untrusted`]. Attachers are answered once the memory is
    /// mapped and faulted in.
    ///
    /// **File**: the region file is made at `path` (mode 0600). It appears at `path` only
    /// once it has its full size, so a process attaching never maps a short file. Its owner
    /// record beside it (`.NAME.kvtier-owner`) is locked until the region is dropped, when the
    /// region and the record are removed. First, every region in the same directory whose
    /// owner died is swept (see [`Region::sweep`]), and a dead owner's region at `path` itself
    /// is replaced. A region at `path` whose owner is alive is [`RegionError::Exists`] (naming
    /// its pid); any other file there is [`RegionError::Foreign`] and is left alone.
    pub fn create(
        path: &Path,
        layout: Layout,
        prefault_threads: usize,
    ) -> Result<Self, RegionError> {
        match anon::name_of(path) {
            Some(name) => Self::create_anonymous(path, name, layout, prefault_threads),
            None => Self::create_file(path, layout, prefault_threads),
        }
    }

    fn create_anonymous(
        path: &Path,
        name: &[u8],
        layout: Layout,
        prefault_threads: usize,
    ) -> Result<Self, RegionError> {
        let total = layout.total_bytes() as u64;
        let addr = anon::address(path, name, anon::me())?;
        // The name first: a live owner's region is refused before any memory is taken.
        let mut listener = anon::Listener::bind(path, &addr)?;
        // Refuse at once what cannot fit: a reservation that runs out of memory would first
        // take every free page.
        if let Some(available) = anon::available_memory()
            && available < total
        {
            return Err(RegionError::NoSpace {
                path: path.to_path_buf(),
                needed: total,
                available,
            });
        }
        let memory = anon::memory(path, name, total)?;
        let served = memory.try_clone().map_err(io_err("duplicate", path))?;
        let mut region = Self::map(memory, path, layout)?;
        region.mapping.prefault(prefault_threads);
        listener
            .serve(path, served, total)
            .map_err(io_err("start the thread serving", path))?;
        region.owner = Some(Ownership::Anonymous(listener));
        tracing::info!(region = %path.display(), bytes = total, rows = layout.rows, "anonymous region created");
        Ok(region)
    }

    fn create_file(
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

    /// Attaches to a region another process created (its kind: [`RegionKind::of`]), waiting
    /// up to `timeout` for it to appear ([`RegionError::AttachTimeout`]); its size must match
    /// `layout` ([`RegionError::SizeMismatch`]).
    ///
    /// **Anonymous** (`@NAME`): the memory is received from the process listening as its
    /// owner, which must be of this process's user and send memory whose size is sealed;
    /// anything else is refused with [`RegionError::Untrusted`]. Once its owner dropped the
    /// region or died, nothing answers and an attach times out; processes already attached
    /// keep their mapping.
    ///
    /// **File**: the path must name a regular file (a symbolic link is not followed) owned by
    /// this process's user with no group or other permission bits; anything else is refused
    /// with [`RegionError::Untrusted`]. A file whose owner died is waited past, until a new
    /// owner replaces it ([`RegionError::NoLiveOwner`] at the timeout).
    pub fn attach(
        path: &Path,
        layout: Layout,
        timeout: Duration,
        prefault_threads: usize,
    ) -> Result<Self, RegionError> {
        let start = Instant::now();
        let file = match anon::name_of(path) {
            Some(name) => {
                let addr = anon::address(path, name, anon::me())?;
                let expected = layout.total_bytes() as u64;
                anon::receive(path, &addr, expected, start, timeout)?
            }
            None => Self::open_owned(path, start, timeout)?,
        };
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

    /// The region's path: its file, or `@NAME` for an anonymous region.
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
            .with_mut(offset, src.len(), |dst| copy_bulk(dst, src))
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
            .with(offset, dst.len(), |src| copy_bulk(dst, src))
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
        match self.owner.take() {
            Some(Ownership::File(owner, id)) => {
                // Only the file this process made: never one that replaced it by hand.
                if let Err(e) = owner::remove_if_same(&self.path, id, false) {
                    tracing::warn!(path = %self.path.display(), error = %e, "region file not removed");
                }
                if let Err(e) = owner.release() {
                    tracing::warn!(error = %e, "owner record not removed");
                }
            }
            // Nobody new can attach once the listener is stopped; the memory goes with the
            // last mapping (this one is unmapped next).
            Some(Ownership::Anonymous(listener)) => listener.stop(),
            None => {}
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

    /// The environment variable naming the user id a `squat` child claims a name for.
    const CHILD_UID: &str = "KVTIER_REGION_TEST_UID";

    /// The layout of the regions whose memory the tests measure: 256 MiB and a page of seals.
    fn big() -> Layout {
        Layout::new(64, 1, 4 << 20).unwrap()
    }

    /// Not a test: the entry point of the child processes that the tests below start (this
    /// binary run again with [`CHILD_ROLE`] set) and kill with `SIGKILL`. Role `own` creates
    /// a region and waits; role `creating` stops inside `create`, once the temporary file has
    /// its full size and before it is published, and waits. Role `attach` attaches, checks
    /// that slot 0 holds 5s, writes 9s into slot 1 and waits. Roles `own-big` and
    /// `attach-big` create and attach a region of [`big`] and wait. Role `squat` listens as
    /// the owner of an anonymous region of the user [`CHILD_UID`] and serves a memory of
    /// [`layout`]. Role `probe` connects to an anonymous region's owner without checking it
    /// and prints whether it was handed anything.
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
            "attach" => {
                let region = attach(&path).unwrap();
                let mut back = [0; 16];
                region.read_sub(SlotId(0), 0, &mut back).unwrap();
                assert_eq!(back, [5; 16]);
                region.write_sub(SlotId(1), 0, &[9; 16]).unwrap();
                ready_and_wait();
            }
            "own-big" => {
                let _region = Region::create(&path, big(), 2).unwrap();
                ready_and_wait();
            }
            "attach-big" => {
                let region = Region::attach(&path, big(), Duration::from_secs(10), 1).unwrap();
                region.write_sub(SlotId(63), 0, &[1; 16]).unwrap();
                ready_and_wait();
            }
            "squat" => {
                let uid = std::env::var(CHILD_UID).unwrap().parse().unwrap();
                let name = anon::name_of(&path).unwrap();
                let addr = anon::address(&path, name, uid).unwrap();
                let mut listener = anon::Listener::bind(&path, &addr).unwrap();
                let total = layout().total_bytes() as u64;
                let memory = anon::memory(&path, name, total).unwrap();
                listener.serve(&path, memory, total).unwrap();
                ready_and_wait();
            }
            "probe" => {
                let uid = std::env::var(CHILD_UID).unwrap().parse().unwrap();
                let addr = anon::address(&path, anon::name_of(&path).unwrap(), uid).unwrap();
                let handed = anon::handed_anything(&path, &addr);
                use std::io::Write;
                writeln!(io::stdout(), "handed: {handed}").unwrap();
                ready_and_wait();
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
            Self::start_with(role, path, |_| {}).0
        }

        /// [`start`](Self::start), with `setup` applied to the command first; also the lines
        /// the child printed before it was ready.
        fn start_with(
            role: &str,
            path: &Path,
            setup: impl FnOnce(&mut std::process::Command),
        ) -> (Child, Vec<String>) {
            use std::io::BufRead;
            let mut command = std::process::Command::new(std::env::current_exe().unwrap());
            command
                .args(["--exact", "region::tests::child_process", "--ignored"])
                .args(["--nocapture", "--test-threads=1", "-q"])
                .env(CHILD_ROLE, role)
                .env(CHILD_PATH, path)
                .stdout(std::process::Stdio::piped());
            setup(&mut command);
            let mut child = Child(command.spawn().unwrap());
            let out = child.0.stdout.take().unwrap();
            let mut before = Vec::new();
            for line in io::BufReader::new(out).lines() {
                let line = line.unwrap();
                if line.contains(READY) {
                    return (child, before);
                }
                before.push(line);
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

    /// A name for an anonymous region that no other test (in this process or another) uses.
    fn anonymous(tag: &str) -> PathBuf {
        PathBuf::from(format!("@kvtier-test-{}-{tag}", std::process::id()))
    }

    /// No entry of `/dev/shm` bears the name of the anonymous region `path`.
    fn assert_no_file_in_dev_shm(path: &Path) {
        let name = path.to_str().unwrap().trim_start_matches(ANONYMOUS_PREFIX);
        let files: Vec<String> = names(Path::new("/dev/shm"))
            .into_iter()
            .filter(|n| n.contains(name))
            .collect();
        assert_eq!(
            files,
            Vec::<String>::new(),
            "an anonymous region has a file"
        );
    }

    /// The name form decides the kind: `@NAME` is anonymous, any other path a file.
    #[test]
    fn the_name_decides_the_kind() {
        assert_eq!(
            RegionKind::of(Path::new("@kvtier-x")),
            RegionKind::Anonymous
        );
        assert_eq!(
            RegionKind::of(Path::new("/dev/shm/kvtier-x")),
            RegionKind::File
        );
        assert_eq!(RegionKind::of(Path::new("./@kvtier-x")), RegionKind::File);
        assert_eq!(RegionKind::of(Path::new("kvtier@x")), RegionKind::File);
        let err = Region::create(Path::new("@"), layout(), 1).unwrap_err();
        assert!(err.to_string().contains("non-empty"), "{err}");
    }

    /// An anonymous region is shared with another process: bytes written by the owner are
    /// read by the attacher, and bytes the attacher wrote are read by the owner. It leaves
    /// nothing in `/dev/shm`.
    #[test]
    fn an_anonymous_region_is_shared_with_another_process() {
        let path = anonymous("shared");
        let owner = Region::create(&path, layout(), 1).unwrap();
        assert_eq!(owner.path(), path);
        owner.write_sub(SlotId(0), 0, &[5; 16]).unwrap();
        let child = Child::start("attach", &path);
        let mut back = [0; 16];
        owner.read_sub(SlotId(1), 0, &mut back).unwrap();
        assert_eq!(back, [9; 16]);
        assert_no_file_in_dev_shm(&path);
        child.kill();
    }

    /// An attacher whose layout gives another size is refused with the sizes of both; one
    /// whose owner never comes times out; both are typed errors.
    #[test]
    fn an_anonymous_attach_checks_the_size_and_times_out() {
        let path = anonymous("size");
        let _owner = Region::create(&path, layout(), 1).unwrap();
        let other = Layout::new(5, 1, PAGE).unwrap();
        let err = Region::attach(&path, other, Duration::from_secs(1), 1).unwrap_err();
        assert!(
            matches!(err, RegionError::SizeMismatch { expected, found, .. }
                if expected == other.total_bytes() as u64 && found == layout().total_bytes() as u64),
            "{err:?}"
        );
        let nobody = anonymous("nobody");
        let start = Instant::now();
        let err = Region::attach(&nobody, layout(), Duration::from_millis(50), 1).unwrap_err();
        assert!(matches!(err, RegionError::AttachTimeout { .. }), "{err:?}");
        assert!(start.elapsed() >= Duration::from_millis(50));
    }

    /// An anonymous name is held while its owner lives: a second `create` is `Exists`
    /// naming the owner's pid (this process's, or a child's). Once the owner drops the
    /// region, a new attach finds no owner while an attached process keeps its mapping, and
    /// the name can be created again.
    #[test]
    fn an_anonymous_region_lives_with_its_owner_and_its_mappings() {
        let path = anonymous("life");
        let owner = Region::create(&path, layout(), 1).unwrap();
        let err = Region::create(&path, layout(), 1).unwrap_err();
        assert!(
            matches!(err, RegionError::Exists { pid: Some(p), .. } if p == std::process::id()),
            "{err:?}"
        );
        let attached = attach(&path).unwrap();
        attached.write_sub(SlotId(2), 0, &[3; 16]).unwrap();
        drop(owner);
        let err = attach(&path).unwrap_err();
        assert!(matches!(err, RegionError::AttachTimeout { .. }), "{err:?}");
        let mut back = [0; 16];
        attached.read_sub(SlotId(2), 0, &mut back).unwrap();
        assert_eq!(back, [3; 16]);
        attached.write_sub(SlotId(3), 0, &[4; 16]).unwrap();
        drop(Region::create(&path, layout(), 1).unwrap());

        let child = Child::start("own", &path);
        let err = Region::create(&path, layout(), 1).unwrap_err();
        assert!(
            matches!(err, RegionError::Exists { pid: Some(p), .. } if p == child.pid()),
            "{err:?}"
        );
        child.kill();
        drop(Region::create(&path, layout(), 1).unwrap());
    }

    /// `Shmem` of `/proc/meminfo`, in bytes: the memory of shared-memory files, `memfd`s
    /// included.
    fn shmem() -> u64 {
        crate::bench::proc_field("/proc/meminfo", "Shmem").unwrap() * 1024
    }

    /// Starts an owner and an attacher of a [`big`] region at `path` and kills both with
    /// `SIGKILL`: the `Shmem` bytes while they lived above the bytes once both are gone
    /// (waiting up to `patience` for most of the region to go).
    fn killed_owner_and_attacher_free(path: &Path, patience: Duration) -> i64 {
        let owner = Child::start("own-big", path);
        let attacher = Child::start("attach-big", path);
        let during = shmem() as i64;
        owner.kill();
        attacher.kill();
        let start = Instant::now();
        let region = big().total_bytes() as i64;
        loop {
            let freed = during - shmem() as i64;
            if freed >= region * 3 / 4 || start.elapsed() > patience {
                return freed;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The requirement: once every process of an anonymous region is killed (`SIGKILL`),
    /// its memory is gone: `Shmem` fell by about the region's 256 MiB, and no file is left
    /// in `/dev/shm`. Beside it, a file region in `/dev/shm` killed the same way stays
    /// allocated until a sweep: the measure tells the two apart.
    #[test]
    fn killing_every_process_of_an_anonymous_region_frees_its_memory() {
        let region = big().total_bytes() as i64;
        let path = anonymous("killed");
        let freed = killed_owner_and_attacher_free(&path, Duration::from_secs(5));
        assert!(
            freed >= region * 3 / 4,
            "Shmem fell by {freed} bytes, not by about the region's {region}"
        );
        assert_no_file_in_dev_shm(&path);
        let err = attach(&path).unwrap_err();
        assert!(matches!(err, RegionError::AttachTimeout { .. }), "{err:?}");

        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let file = dir.path().join("killed");
        let freed = killed_owner_and_attacher_free(&file, Duration::from_millis(500));
        assert!(
            freed < region / 4,
            "Shmem fell by {freed} bytes: a file region should stay allocated"
        );
        let before = shmem() as i64;
        assert_eq!(Region::sweep(dir.path()).unwrap().len(), 2);
        assert!(before - shmem() as i64 >= region * 3 / 4);
    }

    /// Across users (the test needs root to start a process of another uid): a process of
    /// another user listening as an anonymous region's owner is refused by attachers and
    /// holds the name against `create`; an owner hands nothing to a process of another user
    /// that asks.
    #[test]
    fn an_anonymous_region_is_kept_from_other_users() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        use std::os::unix::process::CommandExt;
        let me = anon::me().to_string();
        let path = anonymous("squatted");
        let (squatter, _) = Child::start_with("squat", &path, |c| {
            c.uid(65534).gid(65534).env(CHILD_UID, &me);
        });
        let reason = untrusted_reason(attach(&path));
        assert!(reason.contains("uid 65534"), "{reason}");
        assert!(reason.contains(&squatter.pid().to_string()), "{reason}");
        let reason = untrusted_reason(Region::create(&path, layout(), 1));
        assert!(reason.contains("uid 65534"), "{reason}");
        squatter.kill();

        let path = anonymous("probed");
        let _owner = Region::create(&path, layout(), 1).unwrap();
        let (probe, printed) = Child::start_with("probe", &path, |c| {
            c.uid(65534).gid(65534).env(CHILD_UID, &me);
        });
        assert!(printed.iter().any(|l| l == "handed: false"), "{printed:?}");
        probe.kill();
        // The same probe of this user is handed the memory: the refusal above is the check.
        let (probe, printed) = Child::start_with("probe", &path, |c| {
            c.env(CHILD_UID, &me);
        });
        assert!(printed.iter().any(|l| l == "handed: true"), "{printed:?}");
        probe.kill();
    }
}
