//! Anonymous regions: memory with no name in any filesystem, which the kernel frees once the
//! last process holding it is gone, however the processes die.
//!
//! The owner makes the region's memory with `memfd_create` (shared memory that no directory
//! lists), reserves all of it at once and seals its size, so no process can shrink it under
//! another's mapping. Attachers find it through the owner: the owner listens on a Linux
//! abstract-namespace Unix socket, `kvtier/UID/NAME` for the region `@NAME` (a hash of the
//! name where that is too long), and a thread of its hands the memory's descriptor
//! (`SCM_RIGHTS`) to each process that connects, with a header that names the region's size.
//! An abstract socket is no file either: its name goes when the socket closes, that is when the
//! owner drops the region or dies.
//!
//! Neither side trusts a name: anyone may listen on or connect to an abstract socket. Each
//! checks the other's credentials (`SO_PEERCRED`, taken by the kernel at `connect` and
//! `listen`): the owner hands the memory only to processes of its own user, and an attacher
//! takes it only from one, and only memory whose size is sealed.
//!
//! What keeps the memory allocated is a reference to it: the owner's descriptor and mapping,
//! each attacher's mapping (an attacher closes its descriptor once mapped), and a descriptor
//! in flight in a socket's queue, which goes with the socket. When every process of an engine
//! is killed, all of them go, and the pages with them.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, Shutdown, SocketAddrUnix, SocketFlags, SocketType, UCred,
    sockopt,
};

use super::{RegionError, untrusted};

/// The first character of an anonymous region's name: `@NAME`, as `ss` shows abstract
/// sockets.
pub(super) const PREFIX: char = '@';

/// What the owner sends before the size: the protocol and its version.
const MAGIC: [u8; 8] = *b"kvtierR1";
/// The owner's answer: [`MAGIC`], then the region's size in bytes (little-endian), with the
/// descriptor attached.
const HEADER: usize = 16;
/// Connections an owner keeps waiting while its thread serves another.
const BACKLOG: i32 = 64;
/// The longest abstract socket name (`sun_path` less its leading zero byte).
const MAX_ADDRESS: usize = 107;
/// How long the owner waits to hand the descriptor to one attacher.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// The seals an attacher requires: nobody can change the memory's size under a mapping.
const SIZE_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// `io_err` for `rustix`'s errors.
fn sys_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> RegionError + 'a {
    move |e| super::io_err(what, path)(io::Error::from(e))
}

/// The name of the anonymous region `path` names (`@NAME`), or `None` for a file region.
pub(super) fn name_of(path: &Path) -> Option<&[u8]> {
    use std::os::unix::ffi::OsStrExt;
    path.as_os_str().as_bytes().strip_prefix(&[PREFIX as u8])
}

/// The abstract socket address of the anonymous region `name` of user `uid`:
/// `kvtier/UID/NAME`, or `kvtier/UID/#HASH` (XXH3-64 of the name) where that is too long.
pub(super) fn address(path: &Path, name: &[u8], uid: u32) -> Result<SocketAddrUnix, RegionError> {
    if name.is_empty() || name.contains(&0) {
        return Err(super::bad_name(
            path,
            "an anonymous region's name (after '@') must be non-empty and hold no NUL byte",
        ));
    }
    let mut text = format!("kvtier/{uid}/").into_bytes();
    if text.len() + name.len() <= MAX_ADDRESS {
        text.extend_from_slice(name);
    } else {
        text.extend_from_slice(format!("#{:016x}", xxhash_rust::xxh3::xxh3_64(name)).as_bytes());
    }
    SocketAddrUnix::new_abstract_name(&text).map_err(sys_err("name", path))
}

/// This process's effective user id, which the credentials of the other side must match.
pub(super) fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Why a peer with credentials `peer` is refused by a process of user `me` (`None`: it is
/// the same user). `role` says what the peer is to this process.
fn refusal(peer: &UCred, me: u32, role: &str) -> Option<String> {
    let uid = peer.uid.as_raw();
    (uid != me).then(|| {
        format!(
            "the {role}, process {}, belongs to uid {uid}, not to this process's uid {me}",
            peer.pid.as_raw_nonzero()
        )
    })
}

fn socket(path: &Path) -> Result<OwnedFd, RegionError> {
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(sys_err("make a socket for", path))
}

/// Makes the region's memory: `total` bytes of shared memory with no name in any
/// filesystem, reserved now (running out of memory is an error here, not a `SIGBUS` later)
/// and sealed at that size.
pub(super) fn memory(path: &Path, name: &[u8], total: u64) -> Result<File, RegionError> {
    // The name is only a label (`/memfd:kvtier:NAME` in /proc/PID/maps); it needs no NUL.
    let label: Vec<u8> = b"kvtier:".iter().chain(name).copied().take(200).collect();
    let label = std::ffi::CString::new(label)
        .map_err(|_| super::bad_name(path, "an anonymous region's name must hold no NUL byte"))?;
    let fd = rustix::fs::memfd_create(
        label.as_c_str(),
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(sys_err("memfd_create", path))?;
    rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, total).map_err(|e| {
        if e == Errno::NOSPC || e == Errno::NOMEM {
            RegionError::NoSpace {
                path: path.to_path_buf(),
                needed: total,
                available: available_memory().unwrap_or(0),
            }
        } else {
            sys_err("reserve", path)(e)
        }
    })?;
    rustix::fs::fcntl_add_seals(&fd, SIZE_SEALS | SealFlags::SEAL)
        .map_err(sys_err("seal", path))?;
    Ok(File::from(fd))
}

/// Bytes of memory the system has available now (`MemAvailable`), where it says.
pub(super) fn available_memory() -> Option<u64> {
    crate::bench::proc_field("/proc/meminfo", "MemAvailable").map(|kib| kib.saturating_mul(1024))
}

/// The owner's side: the socket attachers connect to, and the thread that answers them.
/// Dropping it stops the thread; the socket's name goes with the socket.
pub(super) struct Listener {
    socket: Arc<OwnedFd>,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Claims the region's name: listens on its address. A name another process listens on
    /// is [`RegionError::Exists`] when that process is of this user (its pid named), and
    /// [`RegionError::Untrusted`] otherwise. Attachers that connect now wait, queued, until
    /// [`serve`](Self::serve) answers them.
    pub(super) fn bind(path: &Path, addr: &SocketAddrUnix) -> Result<Self, RegionError> {
        let socket = socket(path)?;
        match rustix::net::bind(&socket, addr) {
            Ok(()) => {}
            Err(Errno::ADDRINUSE) => return Err(Self::held(path, addr)),
            Err(e) => return Err(sys_err("listen as", path)(e)),
        }
        rustix::net::listen(&socket, BACKLOG).map_err(sys_err("listen as", path))?;
        Ok(Listener {
            socket: Arc::new(socket),
            stopping: Arc::new(AtomicBool::new(false)),
            thread: None,
        })
    }

    /// Why the name `addr` cannot be claimed: who holds it.
    fn held(path: &Path, addr: &SocketAddrUnix) -> RegionError {
        let exists = |pid| RegionError::Exists {
            path: path.to_path_buf(),
            pid,
        };
        let Ok(probe) = socket(path) else {
            return exists(None);
        };
        if rustix::net::connect(&probe, addr).is_err() {
            return exists(None);
        }
        match sockopt::socket_peercred(&probe) {
            Ok(peer) => match refusal(&peer, me(), "process listening as its owner") {
                None => exists(u32::try_from(peer.pid.as_raw_nonzero().get()).ok()),
                Some(reason) => untrusted(path, reason),
            },
            Err(_) => exists(None),
        }
    }

    /// Starts the thread that hands `memory` (of `total` bytes) to every process of this
    /// user that connects, until the listener is dropped.
    pub(super) fn serve(&mut self, path: &Path, memory: File, total: u64) -> io::Result<()> {
        let socket = self.socket.clone();
        let stopping = self.stopping.clone();
        let name = path.display().to_string();
        let thread = std::thread::Builder::new()
            .name("kvtier-region".into())
            .spawn(move || {
                let memory = OwnedFd::from(memory);
                let me = me();
                while !stopping.load(Ordering::Acquire) {
                    match rustix::net::accept_with(&*socket, SocketFlags::CLOEXEC) {
                        Ok(conn) => answer(&name, &conn, &memory, total, me),
                        Err(Errno::INTR | Errno::CONNABORTED) => {}
                        Err(_) if stopping.load(Ordering::Acquire) => break,
                        Err(e) => {
                            // Out of descriptors, most likely: the attacher waits and tries
                            // again; this thread must not spin meanwhile.
                            tracing::warn!(region = %name, error = %e, "accept failed");
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
            })?;
        self.thread = Some(thread);
        Ok(())
    }
}

/// Answers one attacher: the memory if it is a process of this user, nothing otherwise.
fn answer(name: &str, conn: &OwnedFd, memory: &OwnedFd, total: u64, me: u32) {
    let peer = match sockopt::socket_peercred(conn) {
        Ok(peer) => peer,
        Err(e) => {
            tracing::warn!(region = %name, error = %e, "refused an attacher whose credentials cannot be read");
            return;
        }
    };
    if let Some(reason) = refusal(&peer, me, "attacher") {
        tracing::warn!(region = %name, %reason, "refused the region to a process of another user");
        return;
    }
    let mut header = [0u8; HEADER];
    header[..8].copy_from_slice(&MAGIC);
    header[8..].copy_from_slice(&total.to_le_bytes());
    let fds = [memory.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let pushed = control.push(SendAncillaryMessage::ScmRights(&fds));
    debug_assert!(pushed, "the buffer has room for one descriptor");
    let sent = sockopt::set_socket_timeout(conn, sockopt::Timeout::Send, Some(SEND_TIMEOUT))
        .and_then(|()| {
            rustix::net::sendmsg(
                conn,
                &[IoSlice::new(&header)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
        });
    if let Err(e) = sent {
        // The attacher went away: it tries again, or it has no more use for the region.
        tracing::debug!(region = %name, pid = peer.pid.as_raw_nonzero(), error = %e, "region not handed over");
    }
}

impl Listener {
    /// Stops answering: no process can attach any more, and the name is free again.
    pub(super) fn stop(self) {
        drop(self);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // Wakes the thread's `accept` (it fails) and refuses new connections; the name goes
        // when the socket closes, after the thread ends.
        let _ = rustix::net::shutdown(&*self.socket, Shutdown::Both);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The attacher's side: waits until `timeout` (from `start`) for an owner to listen at
/// `addr`, and receives the region's memory from it, checked: the owner must be of this
/// user, announce `expected` bytes ([`RegionError::SizeMismatch`] otherwise) and send memory
/// of that size, sealed.
pub(super) fn receive(
    path: &Path,
    addr: &SocketAddrUnix,
    expected: u64,
    start: Instant,
    timeout: Duration,
) -> Result<File, RegionError> {
    loop {
        if let Some(memory) = try_receive(path, addr, expected, start, timeout)? {
            return Ok(memory);
        }
        if start.elapsed() >= timeout {
            return Err(RegionError::AttachTimeout {
                path: path.to_path_buf(),
                waited: start.elapsed(),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One try of [`receive`]: `None` when no owner listens, or the one that did went away
/// before it answered.
fn try_receive(
    path: &Path,
    addr: &SocketAddrUnix,
    expected: u64,
    start: Instant,
    timeout: Duration,
) -> Result<Option<File>, RegionError> {
    let Some((sock, owner)) = connect(path, addr)? else {
        return Ok(None);
    };
    if let Some(reason) = refusal(&owner, me(), "process listening as its owner") {
        return Err(untrusted(path, reason));
    }
    // The owner answers once its memory is ready: wait for it until the timeout.
    let left = timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_millis(1));
    let answer = match read_answer(path, &sock, left)? {
        Answer::Gone => return Ok(None),
        Answer::Late => {
            return Err(RegionError::AttachTimeout {
                path: path.to_path_buf(),
                waited: start.elapsed(),
            });
        }
        Answer::Got { header, fd } => (header, fd),
    };
    let not_kvtier = || {
        untrusted(
            path,
            format!(
                "the process listening as its owner, process {}, did not answer as a kvtier region's owner",
                owner.pid.as_raw_nonzero()
            ),
        )
    };
    let (header, fd) = match answer {
        (Some(header), Some(fd)) => (header, fd),
        _ => return Err(not_kvtier()),
    };
    if header[..8] != MAGIC {
        return Err(not_kvtier());
    }
    let found = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    if found != expected {
        return Err(RegionError::SizeMismatch {
            path: path.to_path_buf(),
            expected,
            found,
        });
    }
    let seals = rustix::fs::fcntl_get_seals(&fd).map_err(sys_err("read the seals of", path))?;
    if !seals.contains(SIZE_SEALS) {
        return Err(untrusted(
            path,
            "its memory's size is not sealed: another process could shrink it under this one's mapping".into(),
        ));
    }
    Ok(Some(File::from(fd)))
}

/// Connects to the process listening at `addr`: the connection and its credentials, or
/// `None` when nobody listens.
fn connect(path: &Path, addr: &SocketAddrUnix) -> Result<Option<(OwnedFd, UCred)>, RegionError> {
    let sock = socket(path)?;
    match rustix::net::connect(&sock, addr) {
        Ok(()) => {}
        // Nobody listens (yet, or any more); a full queue is tried again too.
        Err(Errno::CONNREFUSED | Errno::NOENT | Errno::AGAIN | Errno::INTR) => return Ok(None),
        Err(e) => return Err(sys_err("connect to the owner of", path)(e)),
    }
    let peer = sockopt::socket_peercred(&sock).map_err(sys_err("read the owner of", path))?;
    Ok(Some((sock, peer)))
}

/// What an owner answered.
enum Answer {
    /// The connection closed without a word: the owner went away or refused.
    Gone,
    /// No answer within the time given.
    Late,
    /// A message.
    Got {
        /// The header, if the message had a header's length.
        header: Option<[u8; HEADER]>,
        /// The descriptor, if one came with it.
        fd: Option<OwnedFd>,
    },
}

/// Reads the owner's answer on `sock`, waiting up to `wait`.
fn read_answer(path: &Path, sock: &OwnedFd, wait: Duration) -> Result<Answer, RegionError> {
    sockopt::set_socket_timeout(sock, sockopt::Timeout::Recv, Some(wait))
        .map_err(sys_err("wait for the owner of", path))?;
    let mut header = [0u8; HEADER];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = match rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut header)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    ) {
        Ok(got) => got,
        Err(Errno::AGAIN) => return Ok(Answer::Late),
        Err(Errno::CONNRESET | Errno::INTR) => return Ok(Answer::Gone),
        Err(e) => return Err(sys_err("receive from the owner of", path)(e)),
    };
    // Every descriptor received is owned here (any others are closed with the iterator).
    let fd = control.drain().find_map(|m| match m {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    });
    if got.bytes == 0 && fd.is_none() {
        return Ok(Answer::Gone);
    }
    Ok(Answer::Got {
        header: (got.bytes == HEADER).then_some(header),
        fd,
    })
}

/// A client that skips its own check of the owner: whether the owner at `addr` hands it
/// anything (for the tests of the owner's check).
#[cfg(test)]
pub(super) fn handed_anything(path: &Path, addr: &SocketAddrUnix) -> bool {
    let (sock, _) = connect(path, addr).unwrap().expect("an owner listens");
    match read_answer(path, &sock, Duration::from_secs(5)).unwrap() {
        Answer::Gone => false,
        Answer::Late => panic!("the owner did not answer"),
        Answer::Got { .. } => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(pid: i32, uid: u32) -> UCred {
        UCred {
            pid: rustix::process::Pid::from_raw(pid).unwrap(),
            uid: rustix::process::Uid::from_raw(uid),
            gid: rustix::process::Gid::from_raw(uid),
        }
    }

    /// A peer of this user passes; one of any other user is refused, with its pid and uid.
    #[test]
    fn only_a_peer_of_the_same_user_passes() {
        assert_eq!(refusal(&cred(42, 1000), 1000, "attacher"), None);
        let why = refusal(&cred(42, 1001), 1000, "attacher").unwrap();
        assert!(
            why.contains("process 42") && why.contains("uid 1001"),
            "{why}"
        );
        assert!(why.contains("uid 1000"), "{why}");
        assert!(refusal(&cred(7, 0), 1000, "attacher").is_some());
        assert!(refusal(&cred(7, 1000), 0, "attacher").is_some());
    }

    /// A name fits the address whole; a long one is hashed, and two long names do not
    /// collide; an empty name or one with a NUL byte is refused.
    #[test]
    fn addresses_name_the_user_and_the_region() {
        let p = Path::new("@x");
        let a = address(p, b"kvtier-engine", 1000).unwrap();
        assert_eq!(a.abstract_name(), Some(&b"kvtier/1000/kvtier-engine"[..]));
        assert_ne!(address(p, b"kvtier-engine", 1001).unwrap(), a);
        let long = [b'a'; 200];
        let mut other = long;
        other[199] = b'b';
        let l = address(p, &long, 1000).unwrap();
        assert!(l.abstract_name().unwrap().len() <= MAX_ADDRESS);
        assert!(l.abstract_name().unwrap().starts_with(b"kvtier/1000/#"));
        assert_ne!(l, address(p, &other, 1000).unwrap());
        assert!(address(p, b"", 1000).is_err());
        assert!(address(p, b"a\0b", 1000).is_err());
        assert_eq!(name_of(Path::new("@kvtier-e")), Some(&b"kvtier-e"[..]));
        assert_eq!(name_of(Path::new("/dev/shm/kvtier-e")), None);
    }
}
