//! How the file tier touches the filesystem: a small seam ([`Dir`], [`DataFile`]) with the real
//! implementation here and a simulated one that crashes (`sim.rs`), so that every IO the tier
//! does can be counted, cut short and torn in a test.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut, Read, Seek, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use super::PageBuf;
use crate::region::{PAGE, free_bytes, reserve};

/// One open file of the tier.
pub(crate) trait DataFile: Send + Sync {
    /// `preadv`: fills `bufs` from `offset`; fewer bytes at the end of the file (0 there) or
    /// past what one call moves (Linux: `0x7ffff000` bytes).
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize>;
    /// `pwritev`: writes `bufs` at `offset`; may write fewer bytes than asked.
    fn write_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize>;
    /// `fdatasync`: every write before it is durable when it returns.
    fn sync_data(&self) -> io::Result<()>;
    /// The file's length.
    fn len(&self) -> io::Result<u64>;
    /// Reserves room up to `len` bytes (`posix_fallocate`), growing the file.
    fn reserve(&self, len: u64) -> io::Result<()>;
}

/// Why the tier's lock was not taken.
pub(crate) enum LockError {
    /// Another open tier holds it; the process id written in the lock file, if readable.
    Held(Option<u32>),
    /// The lock file could not be opened or locked.
    Io(io::Error),
}

/// The tier's directory.
pub(crate) trait Dir: Send + Sync {
    /// The directory, for messages.
    fn path(&self) -> &Path;
    /// Opens `name` (creating it when `create`), with `O_DIRECT` when `direct` and the
    /// filesystem takes it; answers whether it did.
    fn open(&self, name: &str, create: bool, direct: bool)
    -> io::Result<(Box<dyn DataFile>, bool)>;
    /// Whether `name` exists.
    fn exists(&self, name: &str) -> io::Result<bool>;
    /// Renames `from` to `to`, replacing it.
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Removes `name`.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// `fsync` of the directory: creations, renames and removals before it are durable.
    fn sync(&self) -> io::Result<()>;
    /// Bytes free for new data.
    fn free_bytes(&self) -> io::Result<u64>;
    /// Takes the exclusive lock named `name` for as long as the guard lives.
    fn lock(&self, name: &str) -> Result<Box<dyn Send + Sync>, LockError>;
}

/// A directory of the real filesystem.
pub(crate) struct RealDir {
    path: PathBuf,
}

impl RealDir {
    pub(crate) fn new(path: &Path) -> Self {
        RealDir {
            path: path.to_path_buf(),
        }
    }
}

struct RealFile {
    file: File,
}

fn errno(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

impl DataFile for RealFile {
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        nix::sys::uio::preadv(&self.file, bufs, offset as i64).map_err(errno)
    }

    fn write_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        nix::sys::uio::pwritev(&self.file, bufs, offset as i64).map_err(errno)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn reserve(&self, len: u64) -> io::Result<()> {
        reserve(&self.file, len)
    }
}

/// The lock file's holder: the process id it wrote.
struct Holder {
    _lock: Flock<File>,
}

impl Dir for RealDir {
    fn path(&self) -> &Path {
        &self.path
    }

    fn open(
        &self,
        name: &str,
        create: bool,
        direct: bool,
    ) -> io::Result<(Box<dyn DataFile>, bool)> {
        let path = self.path.join(name);
        let open = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(create)
                .truncate(false)
                .mode(0o600)
                .custom_flags(flags)
                .open(&path)
        };
        let boxed = |file: File, direct: bool| -> (Box<dyn DataFile>, bool) {
            (Box::new(RealFile { file }), direct)
        };
        if !direct {
            return open(0).map(|f| boxed(f, false));
        }
        match open(libc::O_DIRECT) {
            Ok(f) => {
                // Some filesystems accept the flag and refuse the IO: try one aligned read.
                let mut page = PageBuf::new(PAGE);
                match f.read_at(page.as_mut_slice(), 0) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    _ => return Ok(boxed(f, true)),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
        tracing::info!(path = %path.display(), "O_DIRECT refused; using buffered IO");
        open(0).map(|f| boxed(f, false))
    }

    fn exists(&self, name: &str) -> io::Result<bool> {
        self.path.join(name).try_exists()
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        std::fs::rename(self.path.join(from), self.path.join(to))
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        std::fs::remove_file(self.path.join(name))
    }

    fn sync(&self) -> io::Result<()> {
        File::open(&self.path)?.sync_all()
    }

    fn free_bytes(&self) -> io::Result<u64> {
        free_bytes(&self.path)
    }

    fn lock(&self, name: &str) -> Result<Box<dyn Send + Sync>, LockError> {
        let path = self.path.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(LockError::Io)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                // Name the holder for whoever is refused next.
                let pid = format!("{}\n", std::process::id());
                lock.set_len(0)
                    .and_then(|()| lock.rewind())
                    .and_then(|()| lock.write_all(pid.as_bytes()))
                    .map_err(LockError::Io)?;
                Ok(Box::new(Holder { _lock: lock }))
            }
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let holder = file
                    .read_to_string(&mut text)
                    .ok()
                    .and_then(|_| text.trim().parse().ok());
                Err(LockError::Held(holder))
            }
            Err((_, e)) => Err(LockError::Io(errno(e))),
        }
    }
}
