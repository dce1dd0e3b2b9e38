//! Who owns a region file, and the sweep of regions whose owner died.
//!
//! Beside a region `DIR/NAME`, kvtier keeps two kinds of files of its own, recognisable by
//! name:
//!
//! - `DIR/.NAME.kvtier-owner`, the **owner record**: a few lines of text (a version line, the
//!   owner's pid, the identity of the region file: device, inode and size). The owner holds
//!   `flock(LOCK_EX)` on it from before it creates anything until after it has removed
//!   everything, so the lock is held exactly while a live process owns the name. The kernel
//!   drops the lock when the process dies, however it dies, so a lock that can be taken means
//!   the owner is dead; a reused process id changes nothing.
//! - `DIR/.NAME.kvtier-creating-PID`: the file being created, which holds the whole reserved
//!   region until it is published at `DIR/NAME` by a hard link.
//!
//! Whoever takes the lock of a record whose owner died may remove that owner's files: the
//! creating files of `NAME`, and `DIR/NAME` only if it is the very file the record names
//! (same device, inode and size), so a file kvtier did not make is never removed. Files that
//! belong to another user, symbolic links and records whose text is not kvtier's are left
//! alone.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::{RegionError, io_err};

/// The end of an owner record's name: `.NAME` then this.
const RECORD_SUFFIX: &[u8] = b".kvtier-owner";
/// The middle of a creating file's name: `.NAME`, this, then the creator's pid.
const CREATING: &[u8] = b".kvtier-creating-";
/// The first line of an owner record.
const RECORD_VERSION: &str = "kvtier region owner 1";

/// The name of the owner record of the region `name`.
fn record_name(name: &OsStr) -> OsString {
    let mut s = OsString::from(".");
    s.push(name);
    s.push(OsStr::from_bytes(RECORD_SUFFIX));
    s
}

/// The name of the file that process `pid` creates the region `name` in.
pub(super) fn creating_name(name: &OsStr, pid: u32) -> OsString {
    let mut s = OsString::from(".");
    s.push(name);
    s.push(OsStr::from_bytes(CREATING));
    s.push(pid.to_string());
    s
}

/// What a directory entry is to kvtier.
#[derive(Debug, PartialEq, Eq)]
enum Kind<'a> {
    /// The owner record of the region named.
    Record(&'a OsStr),
    /// A creating file of the region named.
    Creating(&'a OsStr),
    /// Anything else.
    Other,
}

fn classify(file_name: &OsStr) -> Kind<'_> {
    let Some(rest) = file_name.as_bytes().strip_prefix(b".") else {
        return Kind::Other;
    };
    if let Some(name) = rest.strip_suffix(RECORD_SUFFIX)
        && !name.is_empty()
    {
        return Kind::Record(OsStr::from_bytes(name));
    }
    if let Some(i) = rest.windows(CREATING.len()).rposition(|w| w == CREATING) {
        let (name, pid) = (&rest[..i], &rest[i + CREATING.len()..]);
        if !name.is_empty() && !pid.is_empty() && pid.iter().all(u8::is_ascii_digit) {
            return Kind::Creating(OsStr::from_bytes(name));
        }
    }
    Kind::Other
}

/// Whether `name` may name a region: not one of the names kvtier gives its own files.
pub(super) fn is_region_name(name: &OsStr) -> bool {
    classify(name) == Kind::Other
}

/// The identity of a file: its device and inode, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
}

impl FileId {
    pub(super) fn of(md: &Metadata) -> Self {
        FileId {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
        }
    }

    /// The identity of the file `md` describes, once it has `len` bytes.
    pub(super) fn with_len(md: &Metadata, len: u64) -> Self {
        FileId {
            len,
            ..FileId::of(md)
        }
    }

    fn same_file(&self, md: &Metadata) -> bool {
        self.dev == md.dev() && self.ino == md.ino()
    }
}

/// The effective user id of this process.
fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// `lstat`, with a missing file as `None`.
fn lstat(path: &Path) -> Result<Option<Metadata>, RegionError> {
    match std::fs::symlink_metadata(path) {
        Ok(md) => Ok(Some(md)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("stat", path)(e)),
    }
}

/// Removes `path` if it is still the file `id` names (same device and inode, and the same
/// size when `check_len`); whether it did.
pub(super) fn remove_if_same(
    path: &Path,
    id: FileId,
    check_len: bool,
) -> Result<bool, RegionError> {
    match lstat(path)? {
        Some(md) if id.same_file(&md) && (!check_len || md.len() == id.len) => {
            match std::fs::remove_file(path) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(io_err("remove", path)(e)),
            }
        }
        _ => Ok(false),
    }
}

/// What an owner record says.
#[derive(Debug, Default)]
struct Record {
    pid: Option<u32>,
    region: Option<FileId>,
}

impl Record {
    /// Parses a record's text; `None` if it is not kvtier's. An empty record is kvtier's: its
    /// owner died before writing it.
    fn parse(bytes: &[u8]) -> Option<Record> {
        let mut r = Record::default();
        if bytes.is_empty() {
            return Some(r);
        }
        let mut lines = std::str::from_utf8(bytes).ok()?.lines();
        if lines.next()? != RECORD_VERSION {
            return None;
        }
        for line in lines {
            let words: Vec<&str> = line.split(' ').collect();
            match words[..] {
                ["pid", pid] => r.pid = pid.parse().ok(),
                ["region", dev, ino, len] => {
                    r.region = (|| {
                        Some(FileId {
                            dev: dev.parse().ok()?,
                            ino: ino.parse().ok()?,
                            len: len.parse().ok()?,
                        })
                    })();
                }
                _ => {}
            }
        }
        Some(r)
    }

    fn read(file: &File) -> io::Result<Option<Record>> {
        let mut buf = [0u8; 512];
        let n = file.read_at(&mut buf, 0)?;
        Ok(Record::parse(&buf[..n]))
    }
}

/// Whether the region `dir/name`, opened as `region`, belongs to a live owner: its owner
/// record is locked (its owner lives) and names this very file. A region whose owner died is
/// about to be swept and replaced; attaching to it would share memory with nobody.
pub(super) fn has_live_owner(
    dir: &Path,
    name: &OsStr,
    region: &Metadata,
) -> Result<bool, RegionError> {
    let path = dir.join(record_name(name));
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(super::untrusted(&path, "it is a symbolic link".into()));
        }
        Err(e) => return Err(io_err("open", &path)(e)),
    };
    super::check_trusted(&file, &path)?;
    let names_this_file = Record::read(&file)
        .map_err(io_err("read", &path))?
        .and_then(|r| r.region)
        .is_some_and(|id| id.same_file(region));
    // A shared lock is refused while the owner holds its exclusive one: refused means alive.
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Err((_, Errno::EWOULDBLOCK)) => Ok(names_this_file),
        Ok(_unlocked_on_drop) => Ok(false),
        Err((_, e)) => Err(io_err("lock", &path)(e.into())),
    }
}

/// The outcome of trying to own a region name.
pub(super) enum Claim {
    /// This process holds the record's lock.
    Owned(Owner),
    /// A live process holds it (its pid, if its record says).
    Live(Option<u32>),
    /// There is no record (only when not asked to create one).
    Gone,
}

/// The owner record of a region name, locked by this process: while it is held no other
/// process creates, removes or sweeps that name.
pub(super) struct Owner {
    dir: PathBuf,
    name: OsString,
    path: PathBuf,
    id: FileId,
    file: Flock<File>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner").field("record", &self.path).finish()
    }
}

impl Owner {
    /// Tries to own the region `dir/name` without waiting: opens its record (creating it if
    /// `create`) and takes the record's lock. A record kvtier may not use (a symbolic link,
    /// another user's, open to others, or not kvtier's text) is [`RegionError::Untrusted`].
    pub(super) fn claim(dir: &Path, name: &OsStr, create: bool) -> Result<Claim, RegionError> {
        let path = dir.join(record_name(name));
        loop {
            let mut options = OpenOptions::new();
            options
                .read(true)
                .write(true)
                .create(create)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW);
            let file = match options.open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound && !create => {
                    return Ok(Claim::Gone);
                }
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                    return Err(super::untrusted(&path, "it is a symbolic link".into()));
                }
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                    return Err(super::untrusted(&path, "this user may not open it".into()));
                }
                Err(e) => return Err(io_err("open", &path)(e)),
            };
            super::check_trusted(&file, &path)?;
            let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(locked) => locked,
                Err((file, Errno::EWOULDBLOCK)) => {
                    let pid = Record::read(&file).ok().flatten().and_then(|r| r.pid);
                    return Ok(Claim::Live(pid));
                }
                Err((_, e)) => return Err(io_err("lock", &path)(e.into())),
            };
            let id = FileId::of(&file.metadata().map_err(io_err("stat", &path))?);
            // The previous holder may have removed the record before letting go of its lock:
            // a lock on a removed file owns nothing, so start again.
            match lstat(&path)? {
                Some(md) if id.same_file(&md) => {}
                _ => continue,
            }
            if Record::read(&file)
                .map_err(io_err("read", &path))?
                .is_none()
            {
                return Err(super::untrusted(
                    &path,
                    "its content is not a kvtier owner record".into(),
                ));
            }
            return Ok(Claim::Owned(Owner {
                dir: dir.to_path_buf(),
                name: name.to_os_string(),
                path,
                id,
                file,
            }));
        }
    }

    /// Writes this process as the owner, and the region file's identity once it has one.
    pub(super) fn write(&self, region: Option<FileId>) -> Result<(), RegionError> {
        let mut text = format!("{RECORD_VERSION}\npid {}\n", std::process::id());
        if let Some(r) = region {
            text.push_str(&format!("region {} {} {}\n", r.dev, r.ino, r.len));
        }
        // Emptied first: a record cut short by a kill is empty, which reads as "no region".
        self.file
            .set_len(0)
            .and_then(|()| self.file.write_all_at(text.as_bytes(), 0))
            .map_err(io_err("write", &self.path))
    }

    /// Removes what a dead owner of this name left: the region file its record names, and
    /// the name's creating files. Returns the files removed.
    pub(super) fn remove_leftovers(&self) -> Result<Vec<PathBuf>, RegionError> {
        let mut removed = Vec::new();
        let record = Record::read(&self.file)
            .map_err(io_err("read", &self.path))?
            .unwrap_or_default();
        if let Some(region) = record.region {
            let path = self.dir.join(&self.name);
            if remove_if_same(&path, region, true)? {
                removed.push(path);
            }
        }
        for entry in list(&self.dir)? {
            if classify(&entry) != Kind::Creating(self.name.as_os_str()) {
                continue;
            }
            let path = self.dir.join(&entry);
            if let Some(md) = lstat(&path)?
                && md.file_type().is_file()
                && md.uid() == me()
                && remove_if_same(&path, FileId::of(&md), false)?
            {
                removed.push(path);
            }
        }
        Ok(removed)
    }

    /// Removes the record and lets go of its lock; the record's path if it removed it.
    pub(super) fn release(self) -> Result<Option<PathBuf>, RegionError> {
        let removed = remove_if_same(&self.path, self.id, false)?;
        drop(self.file);
        Ok(removed.then_some(self.path))
    }
}

/// The names in `dir`.
fn list(dir: &Path) -> Result<Vec<OsString>, RegionError> {
    let what = "read the directory";
    std::fs::read_dir(dir)
        .map_err(io_err(what, dir))?
        .map(|e| e.map(|e| e.file_name()).map_err(io_err(what, dir)))
        .collect()
}

/// Removes every region of `dir` whose owner is dead, with its record and creating files;
/// returns the files removed. See the module's documentation.
pub(super) fn sweep(dir: &Path) -> Result<Vec<PathBuf>, RegionError> {
    let mut records = BTreeSet::new();
    let mut creating = BTreeSet::new();
    for entry in list(dir)? {
        match classify(&entry) {
            Kind::Record(name) => records.insert(name.to_os_string()),
            Kind::Creating(name) => creating.insert(name.to_os_string()),
            Kind::Other => false,
        };
    }
    let mut removed = Vec::new();
    for name in records.union(&creating) {
        // A creating file without a record lost it by hand: a record is made (and removed)
        // to claim the name, so that a creator that is still alive is never disturbed.
        let create = !records.contains(name);
        match Owner::claim(dir, name, create) {
            Ok(Claim::Owned(owner)) => {
                let leftovers = owner.remove_leftovers();
                let record = owner.release();
                removed.extend(leftovers?);
                removed.extend(record?);
            }
            // Alive, gone meanwhile, or not kvtier's to remove.
            Ok(Claim::Live(_) | Claim::Gone) | Err(RegionError::Untrusted { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_recognised() {
        let name = OsStr::new("kvtier-bench-12");
        assert_eq!(classify(&record_name(name)), Kind::Record(name));
        assert_eq!(classify(&creating_name(name, 34)), Kind::Creating(name));
        for other in [
            "kvtier-bench-12",
            ".kvtier-owner",
            ".a.kvtier-creating-",
            ".a.kvtier-creating-1x",
            ".a.creating-12",
            "a.kvtier-owner",
        ] {
            assert_eq!(classify(OsStr::new(other)), Kind::Other, "{other}");
        }
        assert!(is_region_name(name));
        assert!(!is_region_name(&record_name(name)));
    }

    #[test]
    fn records_parse() {
        let r = Record::parse(b"kvtier region owner 1\npid 7\nregion 1 2 3\n").unwrap();
        assert_eq!(r.pid, Some(7));
        assert_eq!(
            r.region,
            Some(FileId {
                dev: 1,
                ino: 2,
                len: 3
            })
        );
        assert!(Record::parse(b"").unwrap().region.is_none());
        assert!(Record::parse(b"something else\npid 7\n").is_none());
        assert!(Record::parse(&[0xff, 0xfe]).is_none());
    }
}
