//! A simulated directory that crashes: it counts the file tier's IO operations, fails the
//! one at a chosen count and every one after it (the process died there), and then yields
//! the state a power loss could leave: what was synced, plus any part of what was not, at
//! sector granularity.
//!
//! The model: a file's writes and size changes are durable once a `sync_data` of that file
//! that started after they completed returns (a sync takes time: what is written while it
//! runs is not covered by it); before that, each sector a write touched independently keeps its new bytes or
//! not (so a later write to a sector may survive while an earlier one does not: a sector ends
//! up with one of the versions written to it). Creations, renames and removals are durable
//! once the directory is synced; before that, a prefix of them survives, in order.

use std::collections::BTreeMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::disk::{DataFile, Dir, LockError};
use crate::sync::{Mutex, lock};

/// A change to a file not yet synced.
#[derive(Clone, Debug)]
enum FileOp {
    Write { offset: u64, bytes: Vec<u8> },
    Resize(u64),
}

#[derive(Clone, Debug, Default)]
struct Inode {
    /// What reads see.
    data: Vec<u8>,
    /// What survives a crash for sure.
    durable: Vec<u8>,
    /// Changes not yet synced, in order.
    unsynced: Vec<FileOp>,
    /// Changes synced so far (counted as they left `unsynced`).
    synced: u64,
}

/// A change to the directory not yet synced.
#[derive(Clone, Debug)]
enum DirOp {
    Link(String, usize),
    Rename(String, String),
    Remove(String),
}

fn apply(names: &mut BTreeMap<String, usize>, op: &DirOp) {
    match op {
        DirOp::Link(name, inode) => {
            names.insert(name.clone(), *inode);
        }
        DirOp::Rename(from, to) => {
            if let Some(i) = names.remove(from) {
                names.insert(to.clone(), i);
            }
        }
        DirOp::Remove(name) => {
            names.remove(name);
        }
    }
}

#[derive(Debug)]
struct State {
    /// Mutating operations done so far.
    ops: u64,
    /// The operation that crashes (counted from 0).
    crash_at: u64,
    crashed: bool,
    inodes: Vec<Inode>,
    names: BTreeMap<String, usize>,
    durable_names: BTreeMap<String, usize>,
    dir_log: Vec<DirOp>,
    locked: bool,
    /// Read calls so far (not counted as operations: they change nothing).
    reads: u64,
    /// `sync_data` calls so far.
    syncs: u64,
    /// Bytes one read or write call moves at most (a short count past them), as Linux caps
    /// one `preadv`/`pwritev` at `0x7ffff000` bytes.
    io_cap: usize,
    /// The `sync_data` call (counted from 0) that fails with `EIO`, making nothing durable,
    /// without a crash.
    failing_sync: Option<u64>,
}

impl State {
    /// Counts one mutating operation: `Err` if the process is dead, or dies at this one.
    fn step(&mut self) -> io::Result<()> {
        if self.crashed {
            return Err(dead());
        }
        self.ops += 1;
        if self.ops > self.crash_at {
            self.crashed = true;
            return Err(dead());
        }
        Ok(())
    }
}

fn dead() -> io::Error {
    io::Error::other("simulated crash")
}

/// How a crash treats the writes that were not synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tear {
    /// None of them reached the disk.
    DropAll,
    /// All of them did.
    KeepAll,
    /// Each sector of each write did or did not, by the random source.
    Sectors,
    /// Each write as a whole did or did not.
    Writes,
}

/// The shared state of a simulated directory; cheap to clone.
#[derive(Clone)]
pub(crate) struct SimDir {
    path: PathBuf,
    sector: usize,
    state: Arc<Mutex<State>>,
}

impl SimDir {
    /// An empty directory whose `crash_at`-th mutating operation (from 0) crashes.
    pub(crate) fn new(sector: usize, crash_at: u64) -> Self {
        SimDir {
            path: PathBuf::from("/simulated"),
            sector,
            state: Arc::new(Mutex::new(State {
                ops: 0,
                crash_at,
                crashed: false,
                inodes: Vec::new(),
                names: BTreeMap::new(),
                durable_names: BTreeMap::new(),
                dir_log: Vec::new(),
                locked: false,
                reads: 0,
                syncs: 0,
                io_cap: usize::MAX,
                failing_sync: None,
            })),
        }
    }

    /// Read calls so far.
    #[cfg(test)]
    pub(crate) fn reads(&self) -> u64 {
        lock(&self.state).reads
    }

    /// `sync_data` calls so far.
    #[cfg(test)]
    pub(crate) fn syncs(&self) -> u64 {
        lock(&self.state).syncs
    }

    /// Whether the bytes `name` holds at `offset..offset + len` are durable as they read now.
    #[cfg(test)]
    pub(crate) fn durable_as_read(&self, name: &str, offset: u64, len: usize) -> bool {
        let s = lock(&self.state);
        let ino = &s.inodes[s.names[name]];
        let range = offset as usize..offset as usize + len;
        ino.durable.get(range.clone()) == ino.data.get(range)
    }

    /// Makes every read and write call move at most `bytes` (a short count past them).
    #[cfg(test)]
    pub(crate) fn cap_io(&self, bytes: usize) {
        lock(&self.state).io_cap = bytes;
    }

    /// Makes the `n`-th `sync_data` call (counted from 0, as [`syncs`](Self::syncs) counts)
    /// fail with `EIO` and make nothing durable; the process lives on.
    #[cfg(test)]
    pub(crate) fn fail_sync(&self, n: u64) {
        lock(&self.state).failing_sync = Some(n);
    }

    /// Whether the process died.
    pub(crate) fn crashed(&self) -> bool {
        lock(&self.state).crashed
    }

    /// Mutating operations counted so far.
    pub(crate) fn ops(&self) -> u64 {
        lock(&self.state).ops
    }

    /// Makes the `n`-th mutating operation from now (from 0) crash.
    pub(crate) fn crash_after(&self, n: u64) {
        let mut s = lock(&self.state);
        s.crash_at = s.ops + n;
    }

    /// Kills the process now (a power loss between two operations).
    pub(crate) fn crash_now(&self) {
        lock(&self.state).crashed = true;
    }

    /// The directory a power loss now could leave, which never crashes; `coin` decides what
    /// of the unsynced state survives where `tear` asks it to.
    pub(crate) fn after_crash(&self, tear: Tear, coin: &mut dyn FnMut() -> bool) -> SimDir {
        let s = lock(&self.state);
        let mut names = s.durable_names.clone();
        let keep = match tear {
            Tear::DropAll => 0,
            Tear::KeepAll => s.dir_log.len(),
            Tear::Sectors | Tear::Writes => (0..s.dir_log.len()).take_while(|_| coin()).count(),
        };
        for op in &s.dir_log[..keep] {
            apply(&mut names, op);
        }
        let inodes = s
            .inodes
            .iter()
            .map(|ino| {
                let mut img = ino.durable.clone();
                for op in &ino.unsynced {
                    match op {
                        FileOp::Resize(len) => {
                            let kept = match tear {
                                Tear::DropAll => false,
                                Tear::KeepAll => true,
                                Tear::Sectors | Tear::Writes => coin(),
                            };
                            if kept {
                                img.resize(*len as usize, 0);
                            }
                        }
                        FileOp::Write { offset, bytes } => {
                            let whole = match tear {
                                Tear::DropAll => Some(false),
                                Tear::KeepAll => Some(true),
                                Tear::Writes => Some(coin()),
                                Tear::Sectors => None,
                            };
                            let start = *offset as usize;
                            let end = start + bytes.len();
                            let mut at = start;
                            while at < end {
                                let next = ((at / self.sector + 1) * self.sector).min(end);
                                if whole.unwrap_or_else(&mut *coin) {
                                    if img.len() < next {
                                        img.resize(next, 0);
                                    }
                                    img[at..next].copy_from_slice(&bytes[at - start..next - start]);
                                }
                                at = next;
                            }
                        }
                    }
                }
                Inode {
                    data: img.clone(),
                    durable: img,
                    unsynced: Vec::new(),
                    synced: 0,
                }
            })
            .collect();
        self.restarted(inodes, names.clone(), names, Vec::new())
    }

    /// A directory of these files and names, as a restarted machine or process finds it:
    /// nothing crashes, nothing is locked, no count has started.
    fn restarted(
        &self,
        inodes: Vec<Inode>,
        names: BTreeMap<String, usize>,
        durable_names: BTreeMap<String, usize>,
        dir_log: Vec<DirOp>,
    ) -> SimDir {
        SimDir {
            path: self.path.clone(),
            sector: self.sector,
            state: Arc::new(Mutex::new(State {
                ops: 0,
                crash_at: u64::MAX,
                crashed: false,
                inodes,
                names,
                durable_names,
                dir_log,
                locked: false,
                reads: 0,
                syncs: 0,
                io_cap: usize::MAX,
                failing_sync: None,
            })),
        }
    }

    /// The directory a process death now leaves, the power on: every write and name change
    /// is seen (the page cache holds them) and none is the more durable for it: what was not
    /// synced stays unsynced, for a later power loss to tear. The lock is released.
    pub(crate) fn after_process_death(&self) -> SimDir {
        let s = lock(&self.state);
        let inodes = s
            .inodes
            .iter()
            .map(|ino| Inode {
                data: ino.data.clone(),
                durable: ino.durable.clone(),
                unsynced: ino.unsynced.clone(),
                synced: 0,
            })
            .collect();
        self.restarted(
            inodes,
            s.names.clone(),
            s.durable_names.clone(),
            s.dir_log.clone(),
        )
    }

    /// Names in the directory now.
    pub(crate) fn names(&self) -> Vec<String> {
        lock(&self.state).names.keys().cloned().collect()
    }
}

struct SimFile {
    state: Arc<Mutex<State>>,
    inode: usize,
}

impl DataFile for SimFile {
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        let mut s = lock(&self.state);
        if s.crashed {
            return Err(dead());
        }
        s.reads += 1;
        let cap = s.io_cap;
        let data = &s.inodes[self.inode].data;
        let mut at = offset as usize;
        let mut n = 0;
        for b in bufs.iter_mut() {
            let take = b.len().min(data.len().saturating_sub(at)).min(cap - n);
            b[..take].copy_from_slice(&data[at..at + take]);
            n += take;
            at += take;
            if take < b.len() {
                break;
            }
        }
        Ok(n)
    }

    fn write_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        let mut s = lock(&self.state);
        if s.crashed {
            return Err(dead());
        }
        let mut bytes: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        bytes.truncate(s.io_cap);
        // The write reaches the cache even when the process dies right after issuing it.
        let dies = s.step().is_err();
        let ino = &mut s.inodes[self.inode];
        let start = offset as usize;
        let end = start + bytes.len();
        if ino.data.len() < end {
            ino.data.resize(end, 0);
        }
        ino.data[start..end].copy_from_slice(&bytes);
        ino.unsynced.push(FileOp::Write { offset, bytes });
        if dies {
            return Err(dead());
        }
        Ok(end - start)
    }

    fn sync_data(&self) -> io::Result<()> {
        // A sync covers the changes made before it started; it takes time, and what other
        // threads write meanwhile stays unsynced.
        let covered = {
            let mut s = lock(&self.state);
            s.step()?;
            s.syncs += 1;
            if s.failing_sync == Some(s.syncs - 1) {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            let ino = &s.inodes[self.inode];
            ino.synced + ino.unsynced.len() as u64
        };
        std::thread::yield_now();
        let mut s = lock(&self.state);
        if s.crashed {
            return Err(dead());
        }
        let ino = &mut s.inodes[self.inode];
        // Syncs may overlap: another may have made some of them durable already.
        let n = covered.saturating_sub(ino.synced) as usize;
        ino.synced += n as u64;
        let done: Vec<FileOp> = ino.unsynced.drain(..n).collect();
        for op in done {
            match op {
                FileOp::Resize(len) => {
                    let len = len as usize;
                    if ino.durable.len() < len {
                        ino.durable.resize(len, 0);
                    }
                }
                FileOp::Write { offset, bytes } => {
                    let start = offset as usize;
                    let end = start + bytes.len();
                    if ino.durable.len() < end {
                        ino.durable.resize(end, 0);
                    }
                    ino.durable[start..end].copy_from_slice(&bytes);
                }
            }
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let s = lock(&self.state);
        if s.crashed {
            return Err(dead());
        }
        Ok(s.inodes[self.inode].data.len() as u64)
    }

    fn reserve(&self, len: u64) -> io::Result<()> {
        let mut s = lock(&self.state);
        s.step()?;
        let ino = &mut s.inodes[self.inode];
        if (ino.data.len() as u64) < len {
            ino.data.resize(len as usize, 0);
            ino.unsynced.push(FileOp::Resize(len));
        }
        Ok(())
    }
}

struct SimLock {
    state: Arc<Mutex<State>>,
}

impl Drop for SimLock {
    fn drop(&mut self) {
        lock(&self.state).locked = false;
    }
}

impl Dir for SimDir {
    fn path(&self) -> &Path {
        &self.path
    }

    fn open(
        &self,
        name: &str,
        create: bool,
        _direct: bool,
    ) -> io::Result<(Box<dyn DataFile>, bool)> {
        let mut s = lock(&self.state);
        let inode = match s.names.get(name) {
            Some(&i) => {
                if s.crashed {
                    return Err(dead());
                }
                i
            }
            None if create => {
                s.step()?;
                let i = s.inodes.len();
                s.inodes.push(Inode::default());
                s.names.insert(name.to_string(), i);
                s.dir_log.push(DirOp::Link(name.to_string(), i));
                i
            }
            None => return Err(io::ErrorKind::NotFound.into()),
        };
        let file = SimFile {
            state: self.state.clone(),
            inode,
        };
        Ok((Box::new(file), false))
    }

    fn exists(&self, name: &str) -> io::Result<bool> {
        let s = lock(&self.state);
        if s.crashed {
            return Err(dead());
        }
        Ok(s.names.contains_key(name))
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut s = lock(&self.state);
        s.step()?;
        if !s.names.contains_key(from) {
            return Err(io::ErrorKind::NotFound.into());
        }
        let op = DirOp::Rename(from.to_string(), to.to_string());
        apply(&mut s.names, &op);
        s.dir_log.push(op);
        Ok(())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        let mut s = lock(&self.state);
        s.step()?;
        if !s.names.contains_key(name) {
            return Err(io::ErrorKind::NotFound.into());
        }
        let op = DirOp::Remove(name.to_string());
        apply(&mut s.names, &op);
        s.dir_log.push(op);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut s = lock(&self.state);
        s.step()?;
        s.durable_names = s.names.clone();
        s.dir_log.clear();
        Ok(())
    }

    fn free_bytes(&self) -> io::Result<u64> {
        Ok(u64::MAX / 4)
    }

    fn lock(&self, _name: &str) -> Result<Box<dyn Send + Sync>, LockError> {
        let mut s = lock(&self.state);
        if s.locked {
            return Err(LockError::Held(Some(std::process::id())));
        }
        s.locked = true;
        Ok(Box::new(SimLock {
            state: self.state.clone(),
        }))
    }
}
