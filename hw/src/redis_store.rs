//! A shared tier on Redis or Redis Cluster: one cache for many inference nodes.
//!
//! Every node that runs kvtier with the same store, namespace and identity shares the blocks:
//! a node writes what it cascades, and finds what others wrote through existence probes (the
//! core's shared-tier rules T4–T6, one pipeline per step). The store is shared, so this node
//! never deletes from it (T14): evicting forgets a block here, and the server's own memory
//! policy (`maxmemory` with `allkeys-lru`) bounds the space.
//!
//! **Values.** Each block is one string value: a fixed header, the block's full key, then its
//! bytes.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "KVTIERB\0"
//!      8     4  format version (1), little-endian
//!     12     4  key length
//!     16     8  block length
//!     24     8  XXH3-64 of the key and the block bytes
//!     32     k  the key
//!   32+k     n  the block
//! ```
//!
//! A value that fails any check (magic, version, key, length, checksum) is a failed read:
//! counted, logged, and never served.
//!
//! **Names.** A block is stored under `{namespace}:{identity}:{key in hex}`, where the
//! identity is a hash of what makes blocks interchangeable (the model, its KV layout, the
//! block size): two deployments that differ in any of them never read each other's blocks.
//!
//! **Connections.** The `redis` crate does the protocol, cluster routing (slots, `MOVED`,
//! `ASK`, failover) and pipelining. Connections are reused: each IO thread takes one from a
//! pool and puts it back after a successful call; a connection that failed is dropped, and
//! the next call connects again. Every connect, read and write is bounded by the configured
//! timeout, so a server that stops answering fails the job instead of holding it.

use std::sync::Mutex;
use std::time::Duration;

use kvtier_core::{Key, TierKind};
use redis::{Cmd, ConnectionLike, FromRedisValue, RedisError};
use xxhash_rust::xxh3::Xxh3;

use crate::store::{SecondaryStore, StoreError};

/// The first bytes of every value.
pub(crate) const MAGIC: [u8; 8] = *b"KVTIERB\0";
/// The value format this build reads and writes.
pub(crate) const FORMAT_VERSION: u32 = 1;
/// Bytes before a value's key.
pub(crate) const HEADER_BYTES: usize = 32;

/// How to reach a Redis store, and what this node keeps of it.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// Server URLs (`redis://host:port`, or `rediss://` for TLS): one for a single server,
    /// any nodes of a cluster (the others are discovered).
    pub urls: Vec<String>,
    /// Whether the servers form a Redis Cluster.
    pub cluster: bool,
    /// The first part of every name, shared by the nodes that share blocks.
    pub namespace: String,
    /// What makes blocks interchangeable (model, KV layout, block size): hashed into every
    /// name, so another deployment's blocks are never read.
    pub identity: String,
    /// The bound on every connect, read and write.
    pub timeout: Duration,
    /// Expiry of the values this node writes; `None` keeps them until the server evicts them.
    pub ttl: Option<Duration>,
    /// The ACL user name, if any.
    pub username: Option<String>,
    /// The password, if any (never printed: `Debug` shows whether there is one).
    pub password: Option<String>,
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
            .finish()
    }
}

impl RedisOptions {
    /// Reads the user name and password from the environment variables a configuration
    /// names (credentials never live in configuration files): `lookup` is the environment
    /// (`|v| std::env::var(v).ok()`). A named variable that is not set is an error naming it.
    pub fn credentials_from(
        &mut self,
        username_env: Option<&str>,
        password_env: Option<&str>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), StoreError> {
        let read = |var: Option<&str>, what: &str| -> Result<Option<String>, StoreError> {
            var.map(|v| {
                lookup(v).ok_or_else(|| {
                    StoreError::BadInput(format!(
                        "the Redis {what} is to come from the environment variable {v}, which is not set"
                    ))
                })
            })
            .transpose()
        };
        self.username = read(username_env, "user name")?;
        self.password = read(password_env, "password")?;
        Ok(())
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

impl Conn {
    /// Runs `cmds` as one pipeline (not a transaction): one answer per command.
    fn pipeline<T: FromRedisValue>(&mut self, cmds: Vec<Cmd>) -> Result<Vec<T>, RedisError> {
        match self {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
            Conn::Cluster(c) => {
                let mut p = redis::cluster::cluster_pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
        }
    }

    /// Runs one command.
    fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> Result<T, RedisError> {
        match self {
            Conn::Single(c) => cmd.query(c),
            Conn::Cluster(c) => cmd.query(c),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Conn::Single(c) => c.is_open(),
            Conn::Cluster(c) => c.is_open(),
        }
    }
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

/// A URL without its user and password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
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
        if options.urls.is_empty() {
            return Err(StoreError::BadInput(
                "a Redis tier needs at least one URL".into(),
            ));
        }
        if options.timeout.is_zero() {
            return Err(StoreError::BadInput(
                "a Redis tier's timeout must be above zero".into(),
            ));
        }
        if block_bytes == 0 {
            return Err(StoreError::BadInput("blocks of zero bytes".into()));
        }
        let capacity_blocks = u32::try_from(capacity_bytes / block_bytes as u64)
            .unwrap_or(u32::MAX)
            .min(u32::MAX - 1);
        if capacity_blocks == 0 {
            return Err(StoreError::BadInput(format!(
                "capacity {capacity_bytes} bytes holds no {block_bytes}-byte block"
            )));
        }
        let (username, password) = (options.username.clone(), options.password.clone());
        let server = redact(&options.urls[0]);
        let bad_url = |e: RedisError| StoreError::BadInput(format!("Redis URL {server}: {e}"));
        let client = if options.cluster {
            let mut b = redis::cluster::ClusterClientBuilder::new(options.urls.clone())
                .connection_timeout(options.timeout)
                .response_timeout(options.timeout)
                .retries(2)
                .min_retry_wait(10)
                .max_retry_wait(100);
            if let Some(u) = username {
                b = b.username(u);
            }
            if let Some(p) = password {
                b = b.password(p);
            }
            Client::Cluster(b.build().map_err(bad_url)?)
        } else {
            if options.urls.len() > 1 {
                return Err(StoreError::BadInput(
                    "several URLs are for a cluster: set cluster = true, or give one URL".into(),
                ));
            }
            let mut info =
                redis::IntoConnectionInfo::into_connection_info(options.urls[0].as_str())
                    .map_err(bad_url)?;
            let mut redis_info = info.redis_settings().clone();
            if let Some(u) = username {
                redis_info = redis_info.set_username(u);
            }
            if let Some(p) = password {
                redis_info = redis_info.set_password(p);
            }
            info = info.set_redis_settings(redis_info);
            Client::Single(redis::Client::open(info).map_err(bad_url)?)
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
        // and health probes bring it Up later); anything else (a wrong password, a refused
        // command) is a setting to fix, so the open fails.
        let ping = store.connect_raw().and_then(|mut conn| {
            let pong: String = conn.query(&redis::cmd("PING"))?;
            Ok((conn, pong))
        });
        match ping {
            Ok((conn, pong)) => {
                tracing::info!(server = %store.server, prefix = %store.prefix, reply = %pong, "redis tier open");
                store.put_back(conn);
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

    fn connect_raw(&self) -> Result<Conn, RedisError> {
        Ok(match &self.client {
            Client::Single(c) => {
                let conn = c.get_connection_with_timeout(self.timeout)?;
                conn.set_read_timeout(Some(self.timeout))?;
                conn.set_write_timeout(Some(self.timeout))?;
                Conn::Single(conn)
            }
            Client::Cluster(c) => Conn::Cluster(Box::new(c.get_connection()?)),
        })
    }

    fn connect(&self) -> Result<Conn, StoreError> {
        self.connect_raw().map_err(|e| self.error(&e))
    }

    /// A connection from the pool, or a new one.
    fn take(&self) -> Result<Conn, StoreError> {
        let idle = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            Some(c) if c.is_open() => Ok(c),
            _ => self.connect(),
        }
    }

    fn put_back(&self, conn: Conn) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(conn);
    }

    /// Runs `f` on a pooled connection; the connection goes back only if `f` succeeded (a
    /// failed one may be half-read or dead).
    fn with_conn<T>(
        &self,
        f: impl FnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.take()?;
        match f(&mut conn) {
            Ok(v) => {
                self.put_back(conn);
                Ok(v)
            }
            Err(e) => Err(self.error(&e)),
        }
    }

    fn error(&self, e: &RedisError) -> StoreError {
        StoreError::Unavailable(format!("redis {}: {e}", self.server))
    }

    /// `SET name value [EX ttl]` for `key`'s block.
    fn set_cmd(&self, key: &Key, block: &[u8]) -> Cmd {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.name_of(key)).arg(Value { key, block });
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
}

/// `n` failures with one message (a pipeline that failed as a whole fails each of its calls).
fn all_failed<T>(n: usize, message: &str) -> Vec<Result<T, StoreError>> {
    (0..n)
        .map(|_| Err(StoreError::Unavailable(message.to_owned())))
        .collect()
}

/// A value as a command's argument: the header, the key and the block, written straight
/// into the command's buffer (a value assembled apart first would be one more copy of the
/// block, into freshly mapped memory).
struct Value<'a> {
    key: &'a Key,
    block: &'a [u8],
}

impl redis::ToRedisArgs for Value<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write;
        let k = self.key.as_bytes();
        let mut header = [0u8; HEADER_BYTES];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(k.len() as u32).to_le_bytes());
        header[16..24].copy_from_slice(&(self.block.len() as u64).to_le_bytes());
        header[24..32].copy_from_slice(&checksum(k, self.block).to_le_bytes());
        out.reserve_space_for_args([HEADER_BYTES + k.len() + self.block.len()]);
        let mut w = out.writer_for_next_arg();
        // Writes into memory: they cannot fail.
        for part in [&header[..], k, self.block] {
            w.write_all(part)
                .expect("a write into the command's buffer");
        }
    }
}

/// XXH3-64 of a key and its block.
fn checksum(key: &[u8], block: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(key);
    h.update(block);
    h.digest()
}

/// Checks `value` as `key`'s block and copies the block into `out`.
pub(crate) fn decode(key: &Key, value: &[u8], out: &mut [u8]) -> Result<(), StoreError> {
    let corrupt = |reason| StoreError::Corrupt {
        key: key.clone(),
        reason,
    };
    if value.len() < HEADER_BYTES || value[..8] != MAGIC {
        return Err(corrupt("not a kvtier block (magic)"));
    }
    let u32_at = |at: usize| u32::from_le_bytes(value[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(value[at..at + 8].try_into().expect("8 bytes"));
    if u32_at(8) != FORMAT_VERSION {
        return Err(corrupt("another format version"));
    }
    let k = key.as_bytes();
    let key_len = u32_at(12) as usize;
    let block_len = u64_at(16);
    if key_len != k.len() || block_len != out.len() as u64 {
        return Err(corrupt("length"));
    }
    if value.len() != HEADER_BYTES + key_len + out.len() {
        return Err(corrupt("value length"));
    }
    let (stored_key, block) = value[HEADER_BYTES..].split_at(key_len);
    if stored_key != k {
        return Err(corrupt("another key"));
    }
    if checksum(stored_key, block) != u64_at(24) {
        return Err(corrupt("checksum"));
    }
    out.copy_from_slice(block);
    Ok(())
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
        self.check_block(key, block)?;
        let cmd = self.set_cmd(key, block);
        self.with_conn(|c| c.query::<()>(&cmd))
    }

    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        self.check_block(key, block)?;
        let cmd = redis::cmd("GET").arg(self.name_of(key)).clone();
        match self.with_conn(|c| c.query::<Option<Vec<u8>>>(&cmd))? {
            Some(value) => decode(key, &value, block),
            None => Err(StoreError::NotFound { key: key.clone() }),
        }
    }

    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        let mut results: Vec<Result<(), StoreError>> =
            blocks.iter().map(|(k, b)| self.check_block(k, b)).collect();
        let cmds: Vec<Cmd> = blocks
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|((k, b), _)| self.set_cmd(k, b))
            .collect();
        if cmds.is_empty() {
            return results;
        }
        if let Err(e) = self.with_conn(|c| c.pipeline::<redis::Value>(cmds)) {
            let message = e.to_string();
            for r in results.iter_mut().filter(|r| r.is_ok()) {
                *r = Err(StoreError::Unavailable(message.clone()));
            }
        }
        results
    }

    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        let cmds: Vec<Cmd> = blocks
            .iter()
            .map(|(k, _)| redis::cmd("GET").arg(self.name_of(k)).clone())
            .collect();
        match self.with_conn(|c| c.pipeline::<Option<Vec<u8>>>(cmds)) {
            Ok(values) if values.len() == blocks.len() => blocks
                .iter_mut()
                .zip(values)
                .map(|((k, out), value)| {
                    self.check_block(k, out)?;
                    match value {
                        Some(v) => decode(k, &v, out),
                        None => Err(StoreError::NotFound { key: (*k).clone() }),
                    }
                })
                .collect(),
            Ok(values) => all_failed(
                blocks.len(),
                &format!(
                    "redis {}: {} answers to {} reads",
                    self.server,
                    values.len(),
                    blocks.len()
                ),
            ),
            Err(e) => all_failed(blocks.len(), &e.to_string()),
        }
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
        if keys.is_empty() {
            return Vec::new();
        }
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| redis::cmd("EXISTS").arg(self.name_of(k)).clone())
            .collect();
        match self.with_conn(|c| c.pipeline::<bool>(cmds)) {
            Ok(found) if found.len() == keys.len() => found.into_iter().map(Ok).collect(),
            Ok(found) => all_failed(
                keys.len(),
                &format!(
                    "redis {}: {} answers to {} probes",
                    self.server,
                    found.len(),
                    keys.len()
                ),
            ),
            Err(e) => all_failed(keys.len(), &e.to_string()),
        }
    }

    /// A single server answers `PING`; a cluster is healthy when it says its state is `ok`
    /// (every slot served: after a failover, once a replica took over).
    fn check(&self) -> Result<(), StoreError> {
        match &self.client {
            Client::Single(_) => {
                self.with_conn(|c| c.query::<String>(&redis::cmd("PING")).map(drop))
            }
            Client::Cluster(_) => {
                let info: String =
                    self.with_conn(|c| c.query(&redis::cmd("CLUSTER").arg("INFO").clone()))?;
                if info.lines().any(|l| l.trim() == "cluster_state:ok") {
                    Ok(())
                } else {
                    Err(StoreError::Unavailable(format!(
                        "redis cluster {}: cluster_state is not ok",
                        self.server
                    )))
                }
            }
        }
    }

    /// Nothing: a shared tier's blocks are found by probes, not by a listing at start.
    fn recovered(&self) -> Vec<Key> {
        Vec::new()
    }
}
