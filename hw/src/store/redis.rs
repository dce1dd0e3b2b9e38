//! A shared tier on Redis or Redis Cluster: one cache for many inference nodes.
//!
//! Every node that runs kvtier with the same store, namespace and identity shares the blocks:
//! a node writes what it cascades, and finds what others wrote through existence probes (the
//! core's shared-tier rules T4–T6, one pipeline per step). The store is shared, so this node
//! never deletes from it (T14): evicting forgets a block here, and the server's own memory
//! policy (`maxmemory` with `allkeys-lru`) bounds the space.
//!
//! **Values.** Each block is one string value in the remote stores' checked format (header,
//! full key, bytes; `store/value.rs`). A value that fails any check (magic, version, key,
//! length, checksum) is a failed read: counted, logged, and never served.
//!
//! **Names.** A block is stored under `{namespace}:{identity}:{key in hex}`, where the
//! identity is a hash of what makes blocks interchangeable (the model, its KV layout, the
//! block size): two deployments that differ in any of them never read each other's blocks.
//! A namespace may not contain `{` or `}`: in a cluster the part of a name between braces
//! (its hash tag) picks the slot, and every block would land on one master.
//!
//! **Connections.** The `redis` crate does the protocol, cluster routing (slots, failover)
//! and TLS (rustls). Each call is one pipeline (a job's `SET`s or `GET`s, a step's `EXISTS`),
//! run on a connection taken from a pool. Replies are kept per command: a server error that
//! concerns one command (another type of value under a block's name, say) fails that block
//! alone, and the connection goes back to the pool. A connection that failed (an IO error, a
//! timeout, a redirect) is dropped, and the next call connects anew.
//!
//! A pooled connection can be stale: its server closed it, or (a cluster) a failover moved
//! slots after it loaded its slot map. The crate's sync cluster pipelines hand `MOVED` back
//! as a reply instead of following it, so after a failover every pooled connection would
//! fail one batch. A call that fails so on a pooled connection (a closed or refused
//! connection, `MOVED`, `ASK`, `READONLY`; never a timeout) runs once more on a fresh
//! connection, which loads the slot map anew; the commands that failed so take its replies.
//! `ASK` (a slot being migrated) is not followed: those blocks fail until the migration ends.
//!
//! **Time.** A call (a job's `GET`s or `SET`s, a step's probes) has one deadline: its start
//! plus the timeout. Before each wait for a server (a connect, a write, the read of each
//! reply, the retry on a fresh connection after a stale pooled one) the socket is given the
//! time left, and a call with none left fails with a timeout. What the crate does inside one
//! of its own operations bounds how far past the deadline a call can go, against a server
//! that stops answering (a frozen process, a lost host):
//!
//! - single server: **about the deadline**. A connect shares the time left between the TCP
//!   connect and the setup (`AUTH`); replies are read one by one, each given the time left
//!   (the socket's read timeout is set again once it exceeds the time left by more than
//!   timeout / 64, so a read can end that much after the deadline: a system call before
//!   every reply slowed batches of small values). Commands are written in pieces of
//!   4 MiB (with Nagle's algorithm off: the end of a piece is not held back), each given a
//!   quarter of the time left: the crate's `write_all` waits once more after each part of a
//!   piece the server's kernel still takes while its buffers fill. Measured with a 500 ms timeout (debug build, loopback):
//!   a `GET` 0.52 s, 64 probes 0.51 s, 24 MiB of `SET`s 0.48–0.65 s.
//! - cluster, on a pooled connection: **about the deadline**, within the same limits. The crate
//!   reads every reply of a pipeline even after one timed out, so a batch runs in rounds of
//!   8 commands, each read of a round given an eighth of the time left (never `timeout / n`
//!   for the whole batch: a large batch needs no faster replies than a small one); a round
//!   that fails ends the call. Measured as above: 96 probes 0.14 s (a round on the frozen
//!   master timed out), 24 MiB of `SET`s to it 0.55 s. A pooled connection that could not
//!   reach a master when it loaded its slot map connects to it inside a later call, given
//!   the time that was left when the connection was made (at most one timeout).
//! - cluster, a call that connects (the pool is empty, or the retry after a stale
//!   connection): the crate's connect tries the seed URLs, then every node of the slot map,
//!   one after another, each given the time left when the connect began. With one frozen
//!   master the connect overruns the deadline and the call fails: measured 1.0–2.1 s (2 to 4
//!   timeouts) for an open or a call, until a replica takes over.
//!
//! Past the deadline by one client operation at most: the crate bounds each system call, not
//! its operations, so a write the server's kernel takes in more than four parts, a connect to
//! a name with several addresses (each given the time left; the lookup itself unbounded), a
//! read stalling inside a large reply (given the time left after its last byte) and the
//! `PING` the cluster client sends with no read timeout when it connects to a master inside
//! a call can each end later (`docs/configuration.md`).
//!
//! The retry after a stale connection never follows a timeout. A healthy but slow server
//! fails a call that it cannot finish by the deadline: keep the timeout above the time the
//! largest batch takes (a job's blocks, a step's probes), and above 8 round trips of a
//! cluster round.

use std::path::PathBuf;
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use kvtier_core::{Key, TierKind};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, ErrorKind, RedisError, RetryMethod, TlsCertificates, Value};

use crate::store::value::{HEADER_BYTES, decode, header};
use crate::store::{SecondaryStore, StoreError, credential_from_env};

/// How to reach a Redis store, and what this node keeps of it.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// Server URLs (`redis://host:port`, or `rediss://` for TLS): one for a single server,
    /// any nodes of a cluster (the others are discovered).
    pub urls: Vec<String>,
    /// Whether the servers form a Redis Cluster.
    pub cluster: bool,
    /// The first part of every name, shared by the nodes that share blocks. Not empty, and
    /// without `{` or `}` (a cluster would put every block in one slot).
    pub namespace: String,
    /// What makes blocks interchangeable (model, KV layout, block size): hashed into every
    /// name, so another deployment's blocks are never read. Not empty.
    pub identity: String,
    /// The deadline of one call (a job's reads or writes, a step's probes), counted from its
    /// start: every wait for a server within the call is given the time left; see the
    /// module's notes for what the client's own operations can add.
    pub timeout: Duration,
    /// Expiry of the values this node writes; `None` keeps them until the server evicts them.
    pub ttl: Option<Duration>,
    /// The ACL user name, if any.
    pub username: Option<String>,
    /// The password, if any (never printed: `Debug` shows whether there is one).
    pub password: Option<String>,
    /// Connect with TLS: `redis://` URLs are taken as `rediss://`. With `false`, a
    /// `rediss://` URL is an error (the two settings contradict each other).
    pub tls: bool,
    /// A PEM file with the certificate(s) of the CA that signs the servers' certificates (a
    /// private CA). `None`: the public roots compiled in (Mozilla's list). Needs `tls`.
    pub tls_ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field("cluster", &self.cluster)
            .field("namespace", &self.namespace)
            .field("identity", &self.identity)
            .field("timeout", &self.timeout)
            .field("ttl", &self.ttl)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "(set)"))
            .field("tls", &self.tls)
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

impl RedisOptions {
    /// Reads the user name and password from the environment variables a configuration
    /// names (credentials never live in configuration files): `lookup` is the environment
    /// (`|v| std::env::var(v).ok()`). A named variable that is not set is an error naming it
    /// and what it was to hold.
    pub fn credentials_from(
        &mut self,
        username_env: Option<&str>,
        password_env: Option<&str>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), StoreError> {
        self.username = credential_from_env(username_env, "Redis user name", &lookup)?;
        self.password = credential_from_env(password_env, "Redis password", &lookup)?;
        Ok(())
    }

    /// The URLs to connect to: with `tls`, `redis://` ones become `rediss://`; without it, a
    /// `rediss://` one is an error, as is a unix socket with `tls`.
    fn connect_urls(&self) -> Result<Vec<String>, StoreError> {
        self.urls
            .iter()
            .map(|url| {
                if let Some(rest) = url.strip_prefix("redis://").filter(|_| self.tls) {
                    Ok(format!("rediss://{rest}"))
                } else if url.starts_with("rediss://") && !self.tls {
                    Err(StoreError::BadInput(format!(
                        "Redis URL {} asks for TLS (rediss://) but tls = false: set tls = true, or use redis://",
                        redact(url)
                    )))
                } else if self.tls && !url.starts_with("rediss://") {
                    Err(StoreError::BadInput(format!(
                        "tls = true, but Redis URL {} is not a TCP one (redis:// or rediss://)",
                        redact(url)
                    )))
                } else {
                    Ok(url.clone())
                }
            })
            .collect()
    }

    /// The certificates of `tls_ca_file`, checked to be PEM certificates.
    fn ca_certificates(&self) -> Result<Option<TlsCertificates>, StoreError> {
        let Some(path) = &self.tls_ca_file else {
            return Ok(None);
        };
        if !self.tls {
            return Err(StoreError::BadInput(format!(
                "tls_ca_file {} is set but tls = false: set tls = true (and rediss:// URLs)",
                path.display()
            )));
        }
        let pem = std::fs::read(path)
            .map_err(|e| StoreError::BadInput(format!("tls_ca_file {}: {e}", path.display())))?;
        use rustls::pki_types::{CertificateDer, pem::PemObject};
        let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&pem).collect();
        match certs {
            Ok(certs) if !certs.is_empty() => Ok(Some(TlsCertificates {
                client_tls: None,
                root_cert: Some(pem),
            })),
            Ok(_) => Err(StoreError::BadInput(format!(
                "tls_ca_file {}: no PEM certificate in it",
                path.display()
            ))),
            Err(e) => Err(StoreError::BadInput(format!(
                "tls_ca_file {}: not PEM certificates: {e}",
                path.display()
            ))),
        }
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            urls: vec!["redis://127.0.0.1:6379".into()],
            cluster: false,
            namespace: "kvtier".into(),
            identity: String::new(),
            timeout: Duration::from_millis(1000),
            ttl: None,
            username: None,
            password: None,
            tls: false,
            tls_ca_file: None,
        }
    }
}

/// A client of one server or of a cluster.
enum Client {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

/// A connection taken from the pool.
enum Conn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

/// A call's commands, ready to run as one pipeline (not a transaction), as many times as
/// needed (the retry after a stale connection runs them again).
enum Batch {
    /// For a single server: the commands packed once, and how many they are.
    Packed(Vec<u8>, usize),
    /// For a cluster: rounds of at most [`ROUND`] commands; the client sends each command
    /// to its slot's master.
    Cluster(Vec<redis::cluster::ClusterPipeline>),
}

impl Batch {
    fn len(&self) -> usize {
        match self {
            Batch::Packed(_, n) => *n,
            Batch::Cluster(rounds) => rounds.iter().map(|p| p.cmd_iter().count()).sum(),
        }
    }
}

/// The commands of one round of a cluster batch. The cluster client reads every reply of a
/// round even after one timed out, so each read is given `1 / ROUND` of the time left: the
/// replies of a master that stopped answering cost at most the time left in all.
const ROUND: usize = 8;

/// A single server's commands are written in pieces of this many bytes, each with its own
/// write timeout (a quarter of the time left then), so a large batch cannot outlast its
/// deadline by more than one piece's wait. Pieces of 256 KiB cost a fifth of the bandwidth
/// of 16 × 256 KiB puts (0.75–0.77 of the bare loop against 0.91, `benches/redis_tier.rs`);
/// a job's batch is rarely above a few MiB, so most are one piece.
const WRITE_PIECE: usize = 4 << 20;

/// The end of one call: every wait for a server within the call ends by it (reads of a
/// single server's replies: within `slack` of it).
#[derive(Clone, Copy, Debug)]
struct Deadline {
    end: Instant,
    /// How far the read timeout of a single server's socket may exceed the time left before
    /// it is set again (a system call before every reply slowed batches of small values).
    slack: Duration,
}

impl Deadline {
    fn after(timeout: Duration) -> Self {
        Deadline {
            end: Instant::now() + timeout,
            slack: timeout / 64,
        }
    }

    /// The time left, or a timeout error when none is.
    fn left(&self) -> Result<Duration, RedisError> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the call's deadline passed (the tier's timeout)",
            )
            .into());
        }
        Ok(left)
    }

    /// The time given to one write of the crate's: a quarter of the time left. The crate
    /// writes a piece with `write_all`, which waits once more after each part the server's
    /// kernel takes (its buffers fill while the server is frozen): a piece whose bytes
    /// went out in up to four parts ends by the deadline.
    fn write_wait(&self) -> Result<Duration, RedisError> {
        Ok((self.left()? / 4).max(Duration::from_micros(1)))
    }
}

/// A command's reply, or why it has none.
type Reply = Result<Value, RedisError>;

/// A server error in a reply is that command's failure.
fn reply(value: Value) -> Reply {
    match value {
        Value::ServerError(e) => Err(e.into()),
        v => Ok(v),
    }
}

/// A failure that a stale pooled connection explains (the server closed it; a cluster's slot
/// map is out of date after a failover), so a fresh connection may succeed. Never a
/// timeout: a server that does not answer would not answer a fresh connection either.
fn stale(e: &RedisError) -> bool {
    !e.is_timeout()
        && (e.is_connection_dropped()
            || e.redirect_node().is_some()
            || matches!(
                e.retry_method(),
                RetryMethod::RefreshSlotsAndRetry | RetryMethod::ReconnectFromInitialConnections
            ))
}

/// Whether the connection that gave `e` must be dropped: anything but a server error that
/// concerns one command (a stale connection's errors included).
fn broken(e: &RedisError) -> bool {
    stale(e) || !matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

/// Whether the servers refused our credentials. The cluster client reports it inside an IO
/// error ("failed to connect to each cluster node (…: authentication failed …)"), so the
/// text is read too.
fn refused_credentials(e: &RedisError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    e.kind() == ErrorKind::AuthenticationFailed
        || [
            "authentication failed",
            "noauth",
            "wrongpass",
            "invalid password",
        ]
        .iter()
        .any(|t| text.contains(t))
}

/// Whether TLS failed on the server's certificate (an unknown CA, another host's name).
fn refused_certificate(e: &RedisError) -> bool {
    e.to_string().to_ascii_lowercase().contains("certificate")
}

impl Conn {
    /// Runs `batch` (built for this kind of connection) by `deadline`: one reply per command.
    fn pipeline(&mut self, batch: &Batch, deadline: Deadline) -> Vec<Reply> {
        match (self, batch) {
            (Conn::Single(c), Batch::Packed(bytes, n)) => single_pipeline(c, bytes, *n, deadline),
            (Conn::Cluster(c), Batch::Cluster(rounds)) => cluster_batch(c, rounds, deadline),
            _ => unreachable!("a batch is built for its store's kind of client"),
        }
    }

    /// Sets the read and write timeouts of every socket of the connection.
    fn set_timeouts(&self, read: Duration, write: Duration) -> Result<(), RedisError> {
        match self {
            Conn::Single(c) => {
                c.set_read_timeout(Some(read))?;
                c.set_write_timeout(Some(write))
            }
            Conn::Cluster(c) => {
                c.set_read_timeout(Some(read))?;
                c.set_write_timeout(Some(write))
            }
        }
    }

    /// Runs one command by `deadline`: `PING` (a cluster sends it to any node), or a
    /// cluster's `CLUSTER INFO` to every master (`route`). A cluster reads the masters one
    /// after another, each read given the time left when the command began.
    fn command(&mut self, cmd: &Cmd, route: Option<RoutingInfo>, deadline: Deadline) -> Reply {
        let left = deadline.left()?;
        self.set_timeouts(left, deadline.write_wait()?)?;
        match (self, route) {
            (Conn::Single(c), _) => cmd.query(c),
            (Conn::Cluster(c), None) => cmd.query(c.as_mut()),
            (Conn::Cluster(c), Some(route)) => c.route_command(cmd, route),
        }
        .and_then(reply)
    }

    fn is_open(&self) -> bool {
        use redis::ConnectionLike;
        match self {
            Conn::Single(c) => c.is_open(),
            Conn::Cluster(c) => c.is_open(),
        }
    }
}

/// Sends `bytes` (`n` packed commands) and reads the `n` replies by `deadline`: each piece
/// written is given a quarter of the time left, each reply read the time left (within the
/// deadline's slack). The first read or
/// write that fails ends the call and fails the commands that have no reply yet (the
/// crate's own pipeline would wait for each of them).
fn single_pipeline(
    c: &mut redis::Connection,
    bytes: &[u8],
    n: usize,
    deadline: Deadline,
) -> Vec<Reply> {
    for piece in bytes.chunks(WRITE_PIECE) {
        let sent = deadline
            .write_wait()
            .and_then(|wait| c.set_write_timeout(Some(wait)))
            .and_then(|()| c.send_packed_command(piece));
        if let Err(e) = sent {
            return vec![Err(e); n];
        }
    }
    let mut replies = Vec::with_capacity(n);
    // The socket's read timeout, once this call set it.
    let mut read_timeout: Option<Duration> = None;
    while replies.len() < n {
        let read = deadline
            .left()
            .and_then(|left| {
                if read_timeout.is_none_or(|t| t > left + deadline.slack) {
                    c.set_read_timeout(Some(left))?;
                    read_timeout = Some(left);
                }
                Ok(())
            })
            .and_then(|()| c.recv_response());
        match read {
            Ok(v) => replies.push(reply(v)),
            Err(e) => replies.resize(n, Err(e)),
        }
    }
    replies
}

/// `values` as one reply per command, if they are `n`.
fn replies(values: Vec<Value>, n: usize) -> Vec<Reply> {
    if values.len() == n {
        return values.into_iter().map(reply).collect();
    }
    let e = RedisError::from((
        ErrorKind::Client,
        "wrong number of replies",
        format!("{} replies to {n} commands", values.len()),
    ));
    vec![Err(e); n]
}

/// Runs a cluster batch round after round by `deadline`. A round that a connection failed
/// in (a timeout, an IO error, a stale slot map) ends the call: the commands after it fail
/// with the same error.
fn cluster_batch(
    c: &mut redis::cluster::ClusterConnection,
    rounds: &[redis::cluster::ClusterPipeline],
    deadline: Deadline,
) -> Vec<Reply> {
    let mut out = Vec::new();
    for p in rounds {
        let n = p.cmd_iter().count();
        if let Some(Err(e)) = out.iter().find(|r: &&Reply| r.as_ref().is_err_and(broken)) {
            let e = e.clone();
            out.extend((0..n).map(|_| Err(e.clone())));
            continue;
        }
        out.extend(cluster_pipeline(c, p, deadline));
    }
    out
}

/// Sets the timeouts of a cluster connection's sockets for one round of `n` commands: each
/// read is given `1 / n` of the time left (the crate reads every reply of the round, even
/// after one timed out), each write half of it.
fn round_timeouts(
    c: &redis::cluster::ClusterConnection,
    n: usize,
    deadline: Deadline,
) -> Result<(), RedisError> {
    let left = deadline.left()?;
    let share = u32::try_from(n).unwrap_or(u32::MAX).max(1);
    c.set_read_timeout(Some((left / share).max(Duration::from_micros(1))))?;
    c.set_write_timeout(Some(deadline.write_wait()?))
}

/// Runs one round of a cluster batch: the client sends each command to its slot's master
/// and reads the replies node by node.
fn cluster_pipeline(
    c: &mut redis::cluster::ClusterConnection,
    p: &redis::cluster::ClusterPipeline,
    deadline: Deadline,
) -> Vec<Reply> {
    let n = p.cmd_iter().count();
    let e = match round_timeouts(c, n, deadline).and_then(|()| p.query::<Vec<Value>>(c)) {
        Ok(values) => return replies(values, n),
        Err(e) => e,
    };
    // When a command got a server error, the crate returns the errors by index and drops
    // every reply.
    let Some(failed) = e
        .clone()
        .into_server_errors()
        .filter(|f| f.iter().all(|(i, _)| *i < n))
    else {
        return vec![Err(e); n];
    };
    let failed: Vec<(usize, RedisError)> = failed
        .iter()
        .map(|(i, se)| (*i, RedisError::from(se.clone())))
        .collect();
    if let Some((_, redirect)) = failed.iter().find(|(_, e)| stale(e)) {
        // The slot map is stale: every command is run again on a fresh connection.
        return vec![Err(redirect.clone()); n];
    }
    // The other commands were answered, but their replies are lost: run them once more.
    let mut out: Vec<Option<Reply>> = vec![None; n];
    for (i, e) in failed {
        out[i] = Some(Err(e));
    }
    let cmds: Vec<&Cmd> = p.cmd_iter().collect();
    let rest: Vec<usize> = (0..n).filter(|&i| out[i].is_none()).collect();
    if !rest.is_empty() {
        let mut again = redis::cluster::cluster_pipe();
        for &i in &rest {
            again.add_command(cmds[i].clone());
        }
        let answers = match round_timeouts(c, rest.len(), deadline)
            .and_then(|()| again.query::<Vec<Value>>(c))
        {
            Ok(values) => replies(values, rest.len()),
            Err(e) => vec![Err(e); rest.len()],
        };
        for (i, r) in rest.into_iter().zip(answers) {
            out[i] = Some(r);
        }
    }
    out.into_iter()
        .map(|r| r.expect("every command has a reply"))
        .collect()
}

/// Makes ring rustls's crypto provider, once per process (TLS connections need one).
fn install_tls_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Err: another part of the process installed one first; it serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A shared secondary tier on Redis or Redis Cluster.
pub struct RedisStore {
    client: Client,
    /// Idle connections, reused by the IO threads.
    pool: Mutex<Vec<Conn>>,
    /// `{namespace}:{identity hash}:`, the start of every name.
    prefix: String,
    block_bytes: usize,
    capacity_blocks: u32,
    ttl_s: Option<u64>,
    timeout: Duration,
    /// For messages: the first URL, without credentials.
    server: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.server)
            .field("prefix", &self.prefix)
            .field("block_bytes", &self.block_bytes)
            .field("capacity_blocks", &self.capacity_blocks)
            .finish()
    }
}

/// A URL without its credentials, for messages: no `user:password@`, and no value of a
/// `pass` or `password` query parameter (unix-socket URLs carry them there).
fn redact(url: &str) -> String {
    // The user information goes first, up to the last `@`, whatever it holds (a password may
    // hold `?` or `/`); an `@` in the query takes the host with it, which only hides more.
    let (scheme, rest) = match url.find("://") {
        Some(at) => url.split_at(at + 3),
        None => ("", url),
    };
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let mut out = format!("{scheme}{base}");
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((name, _))
                    if ["pass", "password"].contains(&name.to_ascii_lowercase().as_str()) =>
                {
                    format!("{name}=(redacted)")
                }
                _ => p.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

impl RedisStore {
    /// Opens the store: checks the settings, connects once (so that a wrong password or an
    /// unknown host is an error now, not a tier that is Down from its first job), and keeps
    /// that connection for the pool. `block_bytes` is the size of every block; this node
    /// tracks at most `capacity_bytes / block_bytes` of them.
    pub fn open(
        options: &RedisOptions,
        block_bytes: usize,
        capacity_bytes: u64,
    ) -> Result<Self, StoreError> {
        let bad = |m: String| Err(StoreError::BadInput(m));
        if options.urls.is_empty() {
            return bad("a Redis tier needs at least one URL".into());
        }
        if options.timeout.is_zero() {
            return bad("a Redis tier's timeout must be above zero".into());
        }
        if options.identity.is_empty() {
            return bad(
                "a Redis tier needs an identity (the model, its KV layout, the block size): \
                 without one, deployments of other models would read each other's blocks"
                    .into(),
            );
        }
        if options.namespace.is_empty() {
            return bad("a Redis tier's namespace must not be empty".into());
        }
        if options.namespace.contains(['{', '}']) {
            return bad(format!(
                "a Redis tier's namespace {:?} contains '{{' or '}}': in a cluster the part of a \
                 name between braces picks its slot, so every block would land on one master",
                options.namespace
            ));
        }
        if block_bytes == 0 {
            return bad("blocks of zero bytes".into());
        }
        let capacity_blocks = u32::try_from(capacity_bytes / block_bytes as u64)
            .unwrap_or(u32::MAX)
            .min(u32::MAX - 1);
        if capacity_blocks == 0 {
            return bad(format!(
                "capacity {capacity_bytes} bytes holds no {block_bytes}-byte block"
            ));
        }
        let urls = options.connect_urls()?;
        let certs = options.ca_certificates()?;
        if options.tls {
            install_tls_provider();
        }
        let (username, password) = (options.username.clone(), options.password.clone());
        let server = redact(&urls[0]);
        let bad_url = |e: RedisError| StoreError::BadInput(format!("Redis URL {server}: {e}"));
        let client = if options.cluster {
            let mut b = redis::cluster::ClusterClientBuilder::new(urls.clone())
                .connection_timeout(options.timeout)
                .response_timeout(options.timeout)
                // No retries inside the client: each would wait its own timeouts. A call is
                // retried once, by `run`, after a stale pooled connection only.
                .retries(0);
            if let Some(u) = username {
                b = b.username(u);
            }
            if let Some(p) = password {
                b = b.password(p);
            }
            if let Some(c) = certs {
                b = b.certs(c);
            }
            Client::Cluster(b.build().map_err(bad_url)?)
        } else {
            if urls.len() > 1 {
                return bad(
                    "several URLs are for a cluster: set cluster = true, or give one URL".into(),
                );
            }
            let mut info = redis::IntoConnectionInfo::into_connection_info(urls[0].as_str())
                .map_err(bad_url)?;
            // No Nagle: a call's commands go out in pieces, and the last part of one must
            // not wait for the server to acknowledge the data before it.
            let tcp = info.tcp_settings().clone().set_nodelay(true);
            info = info.set_tcp_settings(tcp);
            // No `CLIENT SETINFO` at connect: two more replies to wait for.
            let mut redis_info = info.redis_settings().clone().set_skip_set_lib_name();
            if let Some(u) = username {
                redis_info = redis_info.set_username(u);
            }
            if let Some(p) = password {
                redis_info = redis_info.set_password(p);
            }
            info = info.set_redis_settings(redis_info);
            Client::Single(match certs {
                Some(c) => redis::Client::build_with_tls(info, c).map_err(bad_url)?,
                None => redis::Client::open(info).map_err(bad_url)?,
            })
        };
        let identity =
            xxhash_rust::xxh3::xxh3_64(format!("{}\0{block_bytes}", options.identity).as_bytes());
        let store = RedisStore {
            client,
            pool: Mutex::new(Vec::new()),
            prefix: format!("{}:{identity:016x}:", options.namespace),
            block_bytes,
            capacity_blocks,
            ttl_s: options.ttl.map(|t| t.as_secs().max(1)),
            timeout: options.timeout,
            server,
        };
        // A server that cannot be reached now is a tier that starts Down-bound (its jobs fail
        // and health probes bring it Up later); refused credentials, or anything else the
        // server refuses, is a setting to fix, so the open fails.
        let deadline = Deadline::after(store.timeout);
        let ping = store.connect(deadline).and_then(|mut conn| {
            let pong = conn.command(&redis::cmd("PING"), None, deadline)?;
            Ok((conn, pong))
        });
        match ping {
            Ok((conn, pong)) => {
                tracing::info!(server = %store.server, prefix = %store.prefix, reply = ?pong, "redis tier open");
                store.put_back(conn);
            }
            Err(e) if refused_credentials(&e) => {
                return Err(StoreError::Unavailable(format!(
                    "redis {}: authentication failed; check the user name and the password \
                     (the variables username_env and password_env name): {e}",
                    store.server
                )));
            }
            Err(e) if refused_certificate(&e) => {
                return Err(StoreError::Unavailable(format!(
                    "redis {}: TLS: the server's certificate is not trusted; set tls_ca_file \
                     to the CA that signs it: {e}",
                    store.server
                )));
            }
            Err(e) if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() => {
                tracing::warn!(server = %store.server, error = %e, "redis tier opened, but its server does not answer yet");
            }
            Err(e) => return Err(store.error(&e)),
        }
        Ok(store)
    }

    /// The start of every name this store writes and reads.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The name of `key`'s value.
    pub fn name_of(&self, key: &Key) -> String {
        let mut name = String::with_capacity(self.prefix.len() + 2 * key.len());
        name.push_str(&self.prefix);
        for b in key.as_bytes() {
            name.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            name.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
        }
        name
    }

    /// A new connection, made by `deadline` as far as the client allows (see the module's
    /// notes); each later wait is given its timeout by the call that waits.
    fn connect(&self, deadline: Deadline) -> Result<Conn, RedisError> {
        let left = deadline.left()?;
        let conn = match &self.client {
            // The crate's connect shares `left` between the TCP connect and the setup
            // (`AUTH`).
            Client::Single(c) => Conn::Single(c.get_connection_with_timeout(left)?),
            Client::Cluster(c) => {
                // Each node the client connects to (a seed URL, then the masters of the slot
                // map) is given `left`, and so is each reply read while connecting.
                let config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(left)
                    .set_response_timeout(left);
                Conn::Cluster(Box::new(c.get_connection_with_config(config)?))
            }
        };
        // A connect that overran the deadline (it has no bound of its own) ends the call.
        deadline.left()?;
        Ok(conn)
    }

    /// A connection from the pool (`true`), or a new one (`false`).
    fn take(&self, deadline: Deadline) -> Result<(Conn, bool), RedisError> {
        let idle = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            Some(c) if c.is_open() => Ok((c, true)),
            _ => Ok((self.connect(deadline)?, false)),
        }
    }

    fn put_back(&self, conn: Conn) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(conn);
    }

    /// `cmds` as a batch for this store's kind of client.
    fn batch(&self, cmds: impl IntoIterator<Item = Cmd>) -> Batch {
        match &self.client {
            Client::Single(_) => {
                let mut bytes = Vec::new();
                let mut n = 0;
                for cmd in cmds {
                    cmd.write_packed_command(&mut bytes);
                    n += 1;
                }
                Batch::Packed(bytes, n)
            }
            Client::Cluster(_) => {
                let mut rounds: Vec<redis::cluster::ClusterPipeline> = Vec::new();
                for cmd in cmds {
                    match rounds.last_mut() {
                        Some(p) if p.cmd_iter().count() < ROUND => {
                            p.add_command(cmd);
                        }
                        _ => {
                            let mut p = redis::cluster::cluster_pipe();
                            p.add_command(cmd);
                            rounds.push(p);
                        }
                    }
                }
                Batch::Cluster(rounds)
            }
        }
    }

    /// Runs `batch` on a pooled connection (retried once on a fresh one if the pooled one
    /// was stale, see the module's notes), all by one deadline: one reply per command. The
    /// connection goes back to the pool unless it failed.
    fn run(&self, batch: &Batch) -> Vec<Result<Value, StoreError>> {
        let n = batch.len();
        let deadline = Deadline::after(self.timeout);
        let (mut conn, pooled) = match self.take(deadline) {
            Ok(c) => c,
            Err(e) => return (0..n).map(|_| Err(self.error(&e))).collect(),
        };
        let mut replies = conn.pipeline(batch, deadline);
        if pooled && replies.iter().any(|r| r.as_ref().is_err_and(stale)) {
            match self.connect(deadline) {
                Ok(fresh) => {
                    conn = fresh;
                    let again = conn.pipeline(batch, deadline);
                    for (old, new) in replies.iter_mut().zip(again) {
                        if old.as_ref().is_err_and(stale) {
                            *old = new;
                        }
                    }
                }
                Err(e) => {
                    for r in replies.iter_mut().filter(|r| r.as_ref().is_err_and(stale)) {
                        *r = Err(e.clone());
                    }
                }
            }
        }
        if !replies.iter().any(|r| r.as_ref().is_err_and(broken)) {
            self.put_back(conn);
        }
        replies
            .into_iter()
            .map(|r| r.map_err(|e| self.error(&e)))
            .collect()
    }

    /// Runs the commands that are `Ok` as one batch and reads each reply with `read` (given
    /// the command's index); a command that is already an error keeps it. One result per
    /// command, in order.
    fn call<T>(
        &self,
        cmds: Vec<Result<Cmd, StoreError>>,
        mut read: impl FnMut(usize, Value) -> Result<T, StoreError>,
    ) -> Vec<Result<T, StoreError>> {
        let mut results: Vec<Result<T, StoreError>> = Vec::with_capacity(cmds.len());
        let mut sent = Vec::new();
        let mut to_send = Vec::new();
        for (i, cmd) in cmds.into_iter().enumerate() {
            match cmd {
                Ok(cmd) => {
                    sent.push(i);
                    to_send.push(cmd);
                    // Replaced by the command's reply below.
                    results.push(Err(StoreError::Unavailable(String::new())));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if sent.is_empty() {
            return results;
        }
        let replies = self.run(&self.batch(to_send));
        for (i, reply) in sent.into_iter().zip(replies) {
            results[i] = reply.and_then(|v| read(i, v));
        }
        results
    }

    fn error(&self, e: &RedisError) -> StoreError {
        StoreError::Unavailable(format!("redis {}: {e}", self.server))
    }

    /// A reply that is not one the command can give.
    fn unexpected(&self, command: &str, v: &Value) -> StoreError {
        let mut text = format!("{v:?}");
        text.truncate(80);
        StoreError::Unavailable(format!(
            "redis {}: unexpected reply to {command}: {text}",
            self.server
        ))
    }

    /// `SET name value [EX ttl]` for `key`'s block.
    fn set_cmd(&self, key: &Key, block: &[u8]) -> Cmd {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.name_of(key)).arg(BlockValue { key, block });
        if let Some(ttl) = self.ttl_s {
            cmd.arg("EX").arg(ttl);
        }
        cmd
    }

    fn check_block(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        if block.len() != self.block_bytes {
            return Err(StoreError::BadInput(format!(
                "block {key} has {} bytes, the tier stores {}",
                block.len(),
                self.block_bytes
            )));
        }
        Ok(())
    }

    /// A cluster is healthy when every master says its state is `ok` (every slot served:
    /// after a failover, once a replica took over). Asked over a fresh connection, which
    /// loads the slot map anew: a pooled one may know a master that is gone.
    fn check_cluster(&self) -> Result<(), StoreError> {
        let deadline = Deadline::after(self.timeout);
        let mut conn = self.connect(deadline).map_err(|e| self.error(&e))?;
        let info = conn
            .command(
                redis::cmd("CLUSTER").arg("INFO"),
                Some(RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    None,
                ))),
                deadline,
            )
            .map_err(|e| self.error(&e))?;
        // One reply per master, by address.
        let Value::Map(replies) = info else {
            return Err(self.unexpected("CLUSTER INFO", &info));
        };
        for (node, text) in &replies {
            let node: String = redis::from_redis_value_ref(node).unwrap_or_default();
            let text: String = redis::from_redis_value_ref(text).unwrap_or_default();
            if !text.lines().any(|l| l.trim() == "cluster_state:ok") {
                return Err(StoreError::Unavailable(format!(
                    "redis cluster {}: node {node} says cluster_state is not ok",
                    self.server
                )));
            }
        }
        if replies.is_empty() {
            return Err(self.unexpected("CLUSTER INFO", &Value::Map(replies)));
        }
        self.put_back(conn);
        Ok(())
    }
}

/// A value as a command's argument: the header, the key and the block, written straight
/// into the command's buffer (a value assembled apart first would be one more copy of the
/// block, into freshly mapped memory).
struct BlockValue<'a> {
    key: &'a Key,
    block: &'a [u8],
}

impl redis::ToRedisArgs for BlockValue<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write;
        let k = self.key.as_bytes();
        let header = header(k, self.block);
        out.reserve_space_for_args([HEADER_BYTES + k.len() + self.block.len()]);
        let mut w = out.writer_for_next_arg();
        // Writes into memory: they cannot fail.
        for part in [&header[..], k, self.block] {
            w.write_all(part)
                .expect("a write into the command's buffer");
        }
    }
}

impl SecondaryStore for RedisStore {
    fn name(&self) -> &str {
        "redis"
    }

    fn kind(&self) -> TierKind {
        TierKind::Shared
    }

    fn capacity_blocks(&self) -> u32 {
        self.capacity_blocks
    }

    fn put(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        self.put_many(&[(key, block)])
            .pop()
            .expect("one result per block")
    }

    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        self.get_many(&mut [(key, block)])
            .pop()
            .expect("one result per block")
    }

    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        let cmds = blocks
            .iter()
            .map(|(k, b)| self.check_block(k, b).map(|()| self.set_cmd(k, b)))
            .collect();
        self.call(cmds, |_, v| match v {
            Value::Okay => Ok(()),
            v => Err(self.unexpected("SET", &v)),
        })
    }

    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        let cmds = blocks
            .iter()
            .map(|(k, out)| {
                self.check_block(k, out)
                    .map(|()| redis::cmd("GET").arg(self.name_of(k)).clone())
            })
            .collect();
        self.call(cmds, |i, v| {
            let (k, out) = &mut blocks[i];
            match v {
                Value::BulkString(value) => decode(k, &value, out),
                Value::Nil => Err(StoreError::NotFound { key: (*k).clone() }),
                v => Err(self.unexpected("GET", &v)),
            }
        })
    }

    /// A shared store never deletes (T14): other nodes may be reading the block. The core
    /// never asks; a call is logged and otherwise ignored.
    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        tracing::debug!(%key, "a shared tier does not delete; the block is forgotten here only");
        Ok(())
    }

    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        self.contains_many(&[key])
            .pop()
            .expect("one answer per key")
    }

    fn contains_many(&self, keys: &[&Key]) -> Vec<Result<bool, StoreError>> {
        let cmds = keys
            .iter()
            .map(|k| Ok(redis::cmd("EXISTS").arg(self.name_of(k)).clone()))
            .collect();
        self.call(cmds, |_, v| match v {
            Value::Int(n) => Ok(n > 0),
            v => Err(self.unexpected("EXISTS", &v)),
        })
    }

    /// A single server answers `PING`; a cluster is healthy when every master says its state
    /// is `ok`, asked over a fresh connection.
    fn check(&self) -> Result<(), StoreError> {
        match &self.client {
            Client::Single(_) => self
                .call(vec![Ok(redis::cmd("PING"))], |_, _| Ok(()))
                .pop()
                .expect("one result per command"),
            Client::Cluster(_) => self.check_cluster(),
        }
    }

    /// Nothing: a shared tier's blocks are found by probes, not by a listing at start.
    fn recovered(&self) -> Vec<Key> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> RedisOptions {
        RedisOptions {
            identity: "redis_store unit tests".into(),
            ..RedisOptions::default()
        }
    }

    fn refusal(o: &RedisOptions) -> String {
        match RedisStore::open(o, 4096, 1 << 20) {
            Err(StoreError::BadInput(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_value_round_trips_and_any_change_is_refused() {
        let key = Key::new(b"k");
        let block = vec![7u8; 64];
        let value = redis::ToRedisArgs::to_redis_args(&BlockValue {
            key: &key,
            block: &block,
        })
        .concat();
        let mut out = vec![0u8; 64];
        decode(&key, &value, &mut out).unwrap();
        assert_eq!(out, block);
        for at in [0, 8, 12, 16, 24, HEADER_BYTES, value.len() - 1] {
            let mut bad = value.clone();
            bad[at] ^= 1;
            assert!(
                matches!(
                    decode(&key, &bad, &mut out),
                    Err(StoreError::Corrupt { .. })
                ),
                "byte {at}"
            );
        }
        let other = Key::new(b"j");
        assert!(decode(&other, &value, &mut out).is_err(), "another key");
    }

    #[test]
    fn redis_errors_say_whether_to_retry_and_whether_to_keep_the_connection() {
        let server = |text: &str| {
            reply(redis::parse_redis_value(text.as_bytes()).unwrap()).expect_err("an error")
        };
        let io = |kind| RedisError::from(std::io::Error::from(kind));
        use std::io::ErrorKind as Io;
        // One command's failure: no retry, the connection is kept.
        let wrongtype = server("-WRONGTYPE Operation against a key holding the wrong kind\r\n");
        let oom = server("-OOM command not allowed\r\n");
        for e in [&wrongtype, &oom] {
            assert!(!stale(e) && !broken(e), "{e}");
        }
        // A stale connection: run again on a fresh one.
        let moved = server("-MOVED 3999 127.0.0.1:6381\r\n");
        let ask = server("-ASK 3999 127.0.0.1:6381\r\n");
        let readonly = server("-READONLY You can't write against a read only replica.\r\n");
        for e in [
            moved,
            ask,
            readonly,
            io(Io::ConnectionReset),
            io(Io::UnexpectedEof),
        ] {
            assert!(stale(&e) && broken(&e), "{e}");
        }
        // A server that does not answer: dropped, not retried.
        for e in [io(Io::TimedOut), io(Io::WouldBlock)] {
            assert!(!stale(&e) && broken(&e), "{e}");
        }
        assert!(refused_credentials(&server(
            "-WRONGPASS invalid username-password pair\r\n"
        )));
        assert!(refused_credentials(&server(
            "-NOAUTH Authentication required.\r\n"
        )));
        assert!(!refused_credentials(&wrongtype));
    }

    #[test]
    fn redact_hides_passwords_in_user_info_and_in_queries() {
        assert_eq!(redact("redis://u:secret@h:6379"), "redis://h:6379");
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=1&pass=secret"),
            "redis+unix:///run/redis.sock?db=1&pass=(redacted)"
        );
        assert_eq!(
            redact("unix:///run/redis.sock?password=secret&user=bob"),
            "unix:///run/redis.sock?password=(redacted)&user=bob"
        );
        assert_eq!(redact("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact("redis://:pa?ss/wd@h:6379"), "redis://h:6379");
        assert!(!redact("redis://u:x@y?pass=a@b").contains('x'));
        let o = RedisOptions {
            urls: vec!["unix:///s.sock?pass=secret".into()],
            password: Some("secret".into()),
            ..options()
        };
        assert!(!format!("{o:?}").contains("secret"), "{o:?}");
    }

    #[test]
    fn redis_credentials_name_the_variable_that_is_not_set() {
        let env = |v: &str| (v == "SET").then(|| "value".to_owned());
        let mut o = options();
        let e = o.credentials_from(Some("NO_USER"), None, env).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("NO_USER") && text.contains("user name"),
            "{text}"
        );
        let e = o
            .credentials_from(Some("SET"), Some("NO_PASS"), env)
            .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("NO_PASS") && text.contains("password"),
            "{text}"
        );
        o.credentials_from(Some("SET"), Some("SET"), env).unwrap();
        assert_eq!(
            (o.username.as_deref(), o.password.as_deref()),
            (Some("value"), Some("value"))
        );
    }

    #[test]
    fn a_redis_tier_refuses_an_empty_identity_and_braces_in_its_namespace() {
        let o = RedisOptions {
            identity: String::new(),
            ..options()
        };
        assert!(refusal(&o).contains("identity"));
        for ns in ["a{b", "}", "{tag}"] {
            let o = RedisOptions {
                namespace: ns.into(),
                ..options()
            };
            let m = refusal(&o);
            assert!(m.contains("slot"), "{ns}: {m}");
        }
        let o = RedisOptions {
            namespace: String::new(),
            ..options()
        };
        assert!(refusal(&o).contains("namespace"));
    }

    #[test]
    fn redis_tls_settings_agree_with_the_urls() {
        let mut o = RedisOptions {
            urls: vec!["redis://a:1".into(), "rediss://b:2".into()],
            tls: true,
            ..options()
        };
        assert_eq!(o.connect_urls().unwrap(), ["rediss://a:1", "rediss://b:2"]);
        o.tls = false;
        let m = refusal(&o);
        assert!(
            m.contains("tls = false") && m.contains("rediss://b:2"),
            "{m}"
        );
        let o = RedisOptions {
            urls: vec!["unix:///s.sock".into()],
            tls: true,
            ..options()
        };
        assert!(refusal(&o).contains("tls = true"));
        // A CA file needs TLS, must exist, and must hold PEM certificates.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ca.pem");
        let mut o = RedisOptions {
            tls_ca_file: Some(file.clone()),
            ..options()
        };
        assert!(refusal(&o).contains("tls = false"));
        o.tls = true;
        assert!(refusal(&o).contains("tls_ca_file"));
        std::fs::write(&file, "not a certificate").unwrap();
        let m = refusal(&o);
        assert!(m.contains("tls_ca_file") && m.contains("PEM"), "{m}");
    }
}
