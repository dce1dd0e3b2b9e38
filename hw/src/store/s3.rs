//! A shared tier on S3 object storage (AWS S3, or any S3-compatible server: SeaweedFS,
//! MinIO, Ceph RGW): one cache for a fleet, in the object store it already runs.
//!
//! Like the Redis tier it is *shared*: every node with the same bucket, prefix and identity
//! reads what the others wrote, found through existence probes (the core's rules T4–T6), and
//! this node never deletes (T14): evicting forgets a block here; the bucket's own lifecycle
//! rules bound its space. A block the store no longer holds is missing, not a failure (J6,
//! T15).
//!
//! **Objects.** Each block is one object in the remote stores' checked format (header, full
//! key, bytes; `store/value.rs`), verified before anything is served: magic, version, key,
//! length and XXH3-64. An object that fails a check (torn by hand, another tool's object under
//! a block's name, a block of another identity) is a failed read, counted and never served.
//!
//! **Names.** `{prefix}/{identity hash}/{key in hex}` in the bucket, where the identity hash
//! covers the model, its KV layout and the block size (as for Redis): two deployments that
//! differ in any of them never read each other's blocks. A key longer than 256 bytes is named
//! by its XXH3-128 (S3 names end at 1024 bytes); the object carries the full key either way.
//!
//! **Writes** are conditional where the server supports it (`If-None-Match: *`, the default):
//! when two nodes store one block, the first object stays whole and the second write is
//! answered "already exists", which is a success (the block is there). A server that ignores
//! the condition replaces the object whole: an S3 `PUT` is atomic, so a reader sees one
//! writer's object or the other's, never a mix. A bad object under a block's name (torn by
//! hand, another tool's) therefore stays until the bucket's lifecycle removes it, a miss on
//! every node; never served.
//!
//! **Time.** The `object_store` crate does the protocol: signing (SigV4), retries with backoff,
//! connection pooling. Its calls are async; the store keeps a small tokio runtime, and a call
//! from an IO thread (a job's puts or gets, a step's probes) blocks on it. Every call has one
//! deadline, its start plus the tier's timeout: each request of the call (they run
//! concurrently, at most [`CONCURRENCY`] at a time) is cut at the deadline, and the client's
//! own timeout and retries stay within it. A frozen server therefore fails the call at its
//! deadline; the core marks the tier Down and probes it with `check` until it answers.
//!
//! **Credentials** come from environment variables the configuration names (never from the
//! configuration file). With none named the requests are unsigned (a public or anonymous
//! bucket); instance-profile and web-identity credentials are not read.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvtier_core::{Key, TierKind};
use object_store::aws::{AmazonS3, AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig,
};
use tokio::time::Instant;

use crate::store::value::{HEADER_BYTES, decode, encode};
use crate::store::{SecondaryStore, StoreError, credential_from_env};

/// Requests of one call in flight at a time.
pub(crate) const CONCURRENCY: usize = 32;

/// The name probed by `check` (never written): an answer, found or not, means the server
/// is up and takes the credentials.
const HEALTH_PROBE: &str = "health-probe";

/// How to reach an S3 bucket, and how this node uses it.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Options {
    /// The server's URL (`http://127.0.0.1:8333`, `https://minio.example:9000`); `None`
    /// reaches AWS S3 in `region`.
    pub endpoint: Option<String>,
    /// The bucket (it must exist: the tier never creates one).
    pub bucket: String,
    /// The first part of every object's name, shared by the nodes that share blocks; `/`
    /// separates its parts. Not empty.
    pub prefix: String,
    /// The region requests are signed for (S3-compatible servers mostly accept any).
    pub region: String,
    /// What makes blocks interchangeable (model, KV layout, block size): hashed into every
    /// name, so another deployment's blocks are never read. Not empty.
    pub identity: String,
    /// The access key id, if requests are signed.
    pub access_key_id: Option<String>,
    /// The secret access key (never printed: `Debug` shows whether there is one).
    pub secret_access_key: Option<String>,
    /// A session token, with temporary credentials.
    pub session_token: Option<String>,
    /// Virtual-hosted addressing (`bucket.host/name`, AWS's default) instead of path-style
    /// (`host/bucket/name`, what most S3-compatible servers expect).
    pub virtual_hosted: bool,
    /// The deadline of one call (a job's reads or writes, a step's probes), counted from its
    /// start; each request's retries stay within it.
    pub timeout: Duration,
    /// How many times a request that failed for a reason worth retrying (a 5xx, a dropped
    /// connection) is sent again, within the call's deadline.
    pub retries: usize,
    /// Writes carry `If-None-Match: *`, so a block two nodes store is written once.
    pub conditional_put: bool,
}

impl std::fmt::Debug for S3Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Options")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("identity", &self.identity)
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "(set)"),
            )
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "(set)"),
            )
            .field("virtual_hosted", &self.virtual_hosted)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .field("conditional_put", &self.conditional_put)
            .finish()
    }
}

impl Default for S3Options {
    fn default() -> Self {
        S3Options {
            endpoint: None,
            bucket: String::new(),
            prefix: "kvtier".into(),
            region: "us-east-1".into(),
            identity: String::new(),
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            virtual_hosted: false,
            timeout: Duration::from_secs(5),
            retries: 2,
            conditional_put: true,
        }
    }
}

impl S3Options {
    /// Reads the credentials from the environment variables a configuration names: `lookup`
    /// is the environment (`|v| std::env::var(v).ok()`). A named variable that is not set is
    /// an error naming it; a key id without a secret (or the reverse) is an error too.
    pub fn credentials_from(
        &mut self,
        access_key_id_env: Option<&str>,
        secret_access_key_env: Option<&str>,
        session_token_env: Option<&str>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), StoreError> {
        let read = |var, what| credential_from_env(var, what, &lookup);
        self.access_key_id = read(access_key_id_env, "S3 access key id")?;
        self.secret_access_key = read(secret_access_key_env, "S3 secret access key")?;
        self.session_token = read(session_token_env, "S3 session token")?;
        if self.access_key_id.is_some() != self.secret_access_key.is_some() {
            return Err(StoreError::BadInput(
                "an S3 tier signs with an access key id and a secret access key together: \
                 name both variables, or neither (unsigned requests)"
                    .into(),
            ));
        }
        if self.session_token.is_some() && self.access_key_id.is_none() {
            return Err(StoreError::BadInput(
                "an S3 session token needs an access key id and a secret access key".into(),
            ));
        }
        Ok(())
    }
}

/// The S3 tier.
pub struct S3Store {
    client: Arc<AmazonS3>,
    /// Always `Some` but in `drop`, which shuts it down without waiting for its threads.
    runtime: Option<tokio::runtime::Runtime>,
    /// `{prefix}/{identity hash}`.
    prefix: ObjectPath,
    block_bytes: usize,
    capacity_blocks: u32,
    timeout: Duration,
    put_mode: PutMode,
    /// `s3://bucket` and the endpoint, for messages.
    server: String,
}

impl std::fmt::Debug for S3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Store")
            .field("server", &self.server)
            .field("prefix", &self.prefix.as_ref())
            .field("block_bytes", &self.block_bytes)
            .field("capacity_blocks", &self.capacity_blocks)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Whether an error says the credentials were refused: a 401 or a 403 (the client maps them
/// to these variants for single objects, and wraps them as generic errors for listings).
fn refused(e: &object_store::Error) -> bool {
    matches!(
        e,
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }
    ) || matches!(http_status(e), Some(401 | 403))
}

/// The HTTP status a server answered with, if the error is an answer (the client's retry
/// error, which it does not export, says "non-2xx status code: NNN").
fn http_status(e: &object_store::Error) -> Option<u16> {
    let text = e.to_string();
    let at = text.find("non-2xx status code: ")? + "non-2xx status code: ".len();
    text.get(at..at + 3)?.parse().ok()
}

/// Whether `name` is a valid S3 bucket name: 3 to 63 lowercase letters, digits, dots and
/// hyphens, beginning and ending with a letter or a digit.
fn valid_bucket(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    (3..=63).contains(&name.len())
        && name.chars().all(|c| alnum(c) || c == '.' || c == '-')
        && name.starts_with(alnum)
        && name.ends_with(alnum)
}

/// Whether `prefix` is names separated by single `/`, none empty.
fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty() && prefix.split('/').all(|part| !part.is_empty())
}

/// Keys longer than this are named by a hash (S3 names hold at most 1024 bytes; the object
/// carries the full key, which a read checks).
const MAX_HEX_KEY: usize = 256;

impl S3Store {
    /// Opens the store: checks the settings, builds the client, and asks the server once (a
    /// listing under the tier's names), so that a missing bucket or refused credentials are an
    /// error now, not a tier that is Down from its first job. A server that does not answer
    /// yet gives a tier that starts Down-bound (its health probes bring it Up). `block_bytes`
    /// is the size of every block; this node tracks at most `capacity_bytes / block_bytes`.
    pub fn open(
        options: &S3Options,
        block_bytes: usize,
        capacity_bytes: u64,
    ) -> Result<Self, StoreError> {
        let bad = |m: String| Err(StoreError::BadInput(m));
        if !valid_bucket(&options.bucket) {
            return bad(format!(
                "S3 bucket {:?}: expected 3 to 63 lowercase letters, digits, dots and hyphens",
                options.bucket
            ));
        }
        if options.identity.is_empty() {
            return bad(
                "an S3 tier needs an identity (the model, its KV layout, the block size): \
                 without one, deployments of other models would read each other's blocks"
                    .into(),
            );
        }
        if options.timeout.is_zero() {
            return bad("an S3 tier's timeout must be above zero".into());
        }
        let prefix = match ObjectPath::parse(&options.prefix) {
            Ok(p) if valid_prefix(&options.prefix) => p,
            Ok(_) => {
                return bad(format!(
                    "S3 prefix {:?}: expected names separated by single '/', none empty",
                    options.prefix
                ));
            }
            Err(e) => return bad(format!("S3 prefix {:?}: {e}", options.prefix)),
        };
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
        let endpoint = options.endpoint.as_deref();
        if let Some(e) = endpoint
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return bad(format!(
                "S3 endpoint {e:?}: expected a URL starting with http:// or https://"
            ));
        }
        let client_options = ClientOptions::new()
            .with_timeout(options.timeout)
            .with_connect_timeout(options.timeout)
            .with_allow_http(endpoint.is_some_and(|e| e.starts_with("http://")));
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(20),
                max_backoff: (options.timeout / 4).max(Duration::from_millis(20)),
                base: 2.0,
            },
            max_retries: options.retries,
            retry_timeout: options.timeout,
        };
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&options.bucket)
            .with_region(&options.region)
            .with_virtual_hosted_style_request(options.virtual_hosted)
            .with_client_options(client_options)
            .with_retry(retry)
            .with_conditional_put(if options.conditional_put {
                S3ConditionalPut::ETagMatch
            } else {
                S3ConditionalPut::Disabled
            });
        if let Some(e) = endpoint {
            builder = builder.with_endpoint(e);
        }
        match (&options.access_key_id, &options.secret_access_key) {
            (Some(id), Some(secret)) => {
                builder = builder
                    .with_access_key_id(id)
                    .with_secret_access_key(secret);
                if let Some(t) = &options.session_token {
                    builder = builder.with_token(t);
                }
            }
            (None, None) => builder = builder.with_skip_signature(true),
            _ => {
                return bad(
                    "an S3 tier signs with an access key id and a secret access key together"
                        .into(),
                );
            }
        }
        let server = format!(
            "s3://{} at {}",
            options.bucket,
            endpoint.unwrap_or("AWS S3")
        );
        let client = builder
            .build()
            .map_err(|e| StoreError::BadInput(format!("S3 tier {server}: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-s3")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Unavailable(format!("S3 tier {server}: a runtime: {e}")))?;
        let identity =
            xxhash_rust::xxh3::xxh3_64(format!("{}\0{block_bytes}", options.identity).as_bytes());
        let store = S3Store {
            client: Arc::new(client),
            runtime: Some(runtime),
            prefix: prefix.join(format!("{identity:016x}")),
            block_bytes,
            capacity_blocks,
            timeout: options.timeout,
            put_mode: if options.conditional_put {
                PutMode::Create
            } else {
                PutMode::Overwrite
            },
            server,
        };
        let listed = store.list_probe();
        match listed {
            Ok(()) => {
                tracing::info!(server = %store.server, prefix = %store.prefix, "s3 tier open");
            }
            Err(Failure::Client(e)) if refused(&e) => {
                return Err(StoreError::Unavailable(format!(
                    "{}: the server refused the credentials; check the access key id and the \
                     secret (the variables access_key_id_env and secret_access_key_env name): {e}",
                    store.server
                )));
            }
            Err(Failure::Client(e @ object_store::Error::NotFound { .. })) => {
                return Err(StoreError::BadInput(format!(
                    "{}: the bucket does not exist (the tier never creates one): {e}",
                    store.server
                )));
            }
            // Any other answer of the server's but a 5xx (one starting up, overloaded) is a
            // setting to fix (a wrong region, an endpoint that is not S3): the open fails.
            Err(Failure::Client(e)) if http_status(&e).is_some_and(|s| s < 500) => {
                return Err(StoreError::BadInput(format!(
                    "{}: the server refused the tier's first request; check the endpoint, \
                     the region and the addressing (virtual_hosted): {e}",
                    store.server
                )));
            }
            Err(e) => {
                tracing::warn!(server = %store.server, error = %store.failure(&e), "s3 tier opened, but its server does not answer yet");
            }
        }
        Ok(store)
    }

    /// The start of every name this store writes and reads (`{prefix}/{identity hash}`).
    pub fn prefix(&self) -> &str {
        self.prefix.as_ref()
    }

    /// The name of `key`'s object.
    pub fn name_of(&self, key: &Key) -> String {
        self.path_of(key).to_string()
    }

    fn path_of(&self, key: &Key) -> ObjectPath {
        if key.len() > MAX_HEX_KEY {
            let h = xxhash_rust::xxh3::xxh3_128(key.as_bytes());
            return self.prefix.clone().join(format!("h{h:032x}"));
        }
        let mut hex = String::with_capacity(2 * key.len());
        for b in key.as_bytes() {
            hex.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            hex.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
        }
        self.prefix.clone().join(hex)
    }

    /// A listing under a name that is never written (at open, and in each health probe):
    /// empty when the server answers, the bucket exists and the credentials are taken (a
    /// `HEAD` would answer a missing bucket as a missing object). One call, by its deadline.
    fn list_probe(&self) -> Result<(), Failure> {
        let probe = self.prefix.clone().join(HEALTH_PROBE);
        let listing = async {
            self.client
                .list_with_delimiter(Some(&probe))
                .await
                .map(|_| ())
                .map_err(Failure::Client)
        };
        self.run_each(std::iter::once(listing))
            .pop()
            .expect("one answer")
    }

    /// The requests of one call, each cut at the call's deadline, at most [`CONCURRENCY`] in
    /// flight; one answer each, in order.
    fn run_each<'a, T: 'a, F>(
        &self,
        requests: impl Iterator<Item = F> + 'a,
    ) -> Vec<Result<T, Failure>>
    where
        F: Future<Output = Result<T, Failure>> + 'a,
    {
        let runtime = match self.runtime() {
            Ok(r) => r,
            Err(f) => {
                return requests
                    .map(|_| Err(Failure::Store(self.failure(&f))))
                    .collect();
            }
        };
        runtime.block_on(async {
            let deadline = Instant::now() + self.timeout;
            futures::stream::iter(requests.map(|r| async move {
                match tokio::time::timeout_at(deadline, r).await {
                    Ok(r) => r,
                    Err(_) => Err(Failure::Deadline),
                }
            }))
            .buffered(CONCURRENCY)
            .collect()
            .await
        })
    }

    /// The runtime to block on; a caller inside a tokio runtime cannot block (a store's calls
    /// belong on IO threads), which is a failure, not a panic.
    fn runtime(&self) -> Result<&tokio::runtime::Runtime, Failure> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Failure::InRuntime);
        }
        Ok(self.runtime.as_ref().expect("the runtime lives until drop"))
    }

    fn failure(&self, f: &Failure) -> StoreError {
        match f {
            Failure::Deadline => StoreError::Unavailable(format!(
                "{}: no answer within the tier's timeout of {} ms",
                self.server,
                self.timeout.as_millis()
            )),
            Failure::Client(e) => StoreError::Unavailable(format!("{}: {e}", self.server)),
            Failure::InRuntime => StoreError::Unavailable(format!(
                "{}: called from inside a tokio runtime; call the store from a thread of its own",
                self.server
            )),
            Failure::Store(e) => StoreError::Unavailable(e.to_string()),
        }
    }

    fn error(&self, f: Failure) -> StoreError {
        match f {
            Failure::Store(e) => e,
            f => self.failure(&f),
        }
    }

    /// A block of the wrong size or a key that names no object is refused before any request.
    fn check_block(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        if block.len() != self.block_bytes {
            return Err(StoreError::BadInput(format!(
                "block of {} bytes for key {key}, the S3 tier stores {}-byte blocks",
                block.len(),
                self.block_bytes
            )));
        }
        if key.is_empty() {
            return Err(StoreError::BadInput("an empty key".into()));
        }
        Ok(())
    }
}

/// Why a request of a call failed.
#[derive(Debug)]
enum Failure {
    /// The call's deadline passed first.
    Deadline,
    /// The client's error.
    Client(object_store::Error),
    /// A check of ours (the value's verification, a bad block).
    Store(StoreError),
    /// The caller runs inside a tokio runtime, where blocking on ours would panic.
    InRuntime,
}

impl Drop for S3Store {
    /// Shuts the runtime down without waiting for its threads (one may be inside a name
    /// lookup), and without blocking a caller that runs inside a runtime.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl SecondaryStore for S3Store {
    fn name(&self) -> &str {
        "s3"
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

    /// One `PUT` per block, concurrently; with conditional puts, a block another node wrote
    /// first is there already, which is a success.
    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        let requests = blocks.iter().map(|&(key, block)| async move {
            self.check_block(key, block).map_err(Failure::Store)?;
            let payload = PutPayload::from(encode(key, block));
            let options = PutOptions {
                mode: self.put_mode.clone(),
                ..PutOptions::default()
            };
            match self
                .client
                .put_opts(&self.path_of(key), payload, options)
                .await
            {
                Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
                Err(e) => Err(Failure::Client(e)),
            }
        });
        self.run_each(requests)
            .into_iter()
            .map(|r| r.map_err(|f| self.error(f)))
            .collect()
    }

    /// One `GET` per block, concurrently, each verified before it is copied out.
    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        let requests = blocks.iter_mut().map(|(key, out)| async move {
            self.check_block(key, out).map_err(Failure::Store)?;
            let value = match self.client.get(&self.path_of(key)).await {
                // An object of another size is not this block's: not read any further.
                Ok(r) if r.meta.size != (HEADER_BYTES + key.len() + out.len()) as u64 => {
                    return Err(Failure::Store(StoreError::Corrupt {
                        key: (*key).clone(),
                        reason: "value length",
                    }));
                }
                Ok(r) => r.bytes().await.map_err(Failure::Client)?,
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(Failure::Store(StoreError::NotFound {
                        key: (*key).clone(),
                    }));
                }
                Err(e) => return Err(Failure::Client(e)),
            };
            decode(key, &value, out).map_err(Failure::Store)
        });
        self.run_each(requests)
            .into_iter()
            .map(|r| r.map_err(|f| self.error(f)))
            .collect()
    }

    /// A shared store never deletes (T14): other nodes may be reading the block.
    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        tracing::debug!(%key, "a shared tier does not delete; the block is forgotten here only");
        Ok(())
    }

    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        self.contains_many(&[key])
            .pop()
            .expect("one answer per key")
    }

    /// One `HEAD` per key, concurrently.
    fn contains_many(&self, keys: &[&Key]) -> Vec<Result<bool, StoreError>> {
        let requests = keys.iter().map(|&key| async move {
            if key.is_empty() {
                return Err(Failure::Store(StoreError::BadInput("an empty key".into())));
            }
            match self.client.head(&self.path_of(key)).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(Failure::Client(e)),
            }
        });
        self.run_each(requests)
            .into_iter()
            .map(|r| r.map_err(|f| self.error(f)))
            .collect()
    }

    /// The listing of `open` (`list_probe`).
    fn check(&self) -> Result<(), StoreError> {
        self.list_probe().map_err(|f| self.error(f))
    }

    /// Nothing: a shared tier's blocks are found by probes, not by a listing at start.
    fn recovered(&self) -> Vec<Key> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> S3Options {
        S3Options {
            endpoint: Some("http://127.0.0.1:9".into()),
            bucket: "kv-cache".into(),
            identity: "store/s3.rs unit tests".into(),
            timeout: Duration::from_millis(200),
            retries: 0,
            ..S3Options::default()
        }
    }

    fn refused_at_open(o: &S3Options) -> String {
        S3Store::open(o, 4096, 1 << 20).unwrap_err().to_string()
    }

    #[test]
    fn settings_are_checked_before_any_request() {
        for (bucket, ok) in [
            ("kv-cache", true),
            ("a.b-c9", true),
            ("ab", false),
            ("Upper", false),
            ("a/b", false),
            ("-ab", false),
            ("ab-", false),
        ] {
            assert_eq!(valid_bucket(bucket), ok, "{bucket}");
        }
        for (prefix, ok) in [
            ("kvtier", true),
            ("fleet/a", true),
            ("", false),
            ("/", false),
            ("/a/", false),
            ("a//b", false),
        ] {
            assert_eq!(valid_prefix(prefix), ok, "{prefix:?}");
        }
        let e = refused_at_open(&S3Options {
            bucket: "a/b".into(),
            ..options()
        });
        assert!(e.contains("bucket"), "{e}");
        let e = refused_at_open(&S3Options {
            prefix: "/".into(),
            ..options()
        });
        assert!(e.contains("prefix"), "{e}");
        let e = refused_at_open(&S3Options {
            identity: String::new(),
            ..options()
        });
        assert!(e.contains("identity"), "{e}");
        let e = refused_at_open(&S3Options {
            endpoint: Some("127.0.0.1:9000".into()),
            ..options()
        });
        assert!(e.contains("http://"), "{e}");
        let e = refused_at_open(&S3Options {
            access_key_id: Some("k".into()),
            ..options()
        });
        assert!(e.contains("together"), "{e}");
    }

    /// A server that does not answer (nothing listens on the discard port) gives a store that
    /// opens, Down-bound: its calls fail, each within its deadline, and never as NotFound.
    #[test]
    fn an_unreachable_server_opens_and_every_call_fails() {
        let store = S3Store::open(&options(), 4096, 1 << 20).expect("opens, Down-bound");
        let key = Key::new(b"k");
        let start = std::time::Instant::now();
        assert!(matches!(store.check(), Err(StoreError::Unavailable(_))));
        assert!(matches!(
            store.contains(&key),
            Err(StoreError::Unavailable(_))
        ));
        let mut out = vec![0u8; 4096];
        assert!(matches!(
            store.get(&key, &mut out),
            Err(StoreError::Unavailable(_))
        ));
        assert!(store.put(&key, &[0u8; 4096]).is_err());
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn long_keys_get_short_names_and_empty_keys_are_refused() {
        let store = S3Store::open(&options(), 4096, 1 << 20).unwrap();
        let short = Key::new(&[0xab; 8]);
        assert!(store.name_of(&short).ends_with(&"ab".repeat(8)));
        let long = Key::new(&[7u8; 600]);
        let name = store.name_of(&long);
        assert!(name.len() < 100, "{name}");
        assert_ne!(name, store.name_of(&Key::new(&[8u8; 600])));
        let empty = Key::new(b"");
        assert!(matches!(
            store.contains(&empty),
            Err(StoreError::BadInput(_))
        ));
    }

    #[test]
    fn a_store_called_inside_a_runtime_fails_instead_of_panicking() {
        let store = S3Store::open(&options(), 4096, 1 << 20).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let e = rt.block_on(async { store.check().unwrap_err() });
        assert!(e.to_string().contains("inside a tokio runtime"), "{e}");
        // Dropped inside a runtime: no panic.
        rt.block_on(async { drop(store) });
    }
}
