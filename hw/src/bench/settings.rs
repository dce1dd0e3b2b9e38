//! Bench settings: defaults, a TOML or JSON file with the keys vLLM users know, and options.

use std::path::{Path, PathBuf};

use kvtier_core::{Admission, PolicyKind, TierConfig, TierKind};

use crate::{
    FsyncPolicy, RedisOptions, RedisStore, S3Options, S3Store, SecondaryStore, StoreError,
};
use serde::Deserialize;

use super::BenchError;

/// One secondary tier of the bench.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierSettings {
    /// The tier's directory; `None`: a temporary directory removed afterwards. File tiers
    /// only.
    pub path: Option<PathBuf>,
    /// Its capacity in bytes: a file tier's, record headers included (see
    /// docs/configuration.md); for a shared tier, how much of the store this node tracks.
    pub capacity_bytes: u64,
    /// Its eviction policy (LRU unless the tier names one).
    pub policy: PolicyKind,
    /// When its writes are made durable (the file tier's default unless the tier names one).
    /// File tiers only.
    pub fsync: FsyncPolicy,
    /// `Some` for a tier shared by many nodes (Redis, S3): where it is and how to reach it
    /// (its identity is set by the run, from the block size).
    pub shared: Option<SharedStore>,
    /// `Some(n)`: a victim tier, written with the primary's next `n` victims at each step's
    /// end (rules V1–V4); `None`: every completed store is cascaded to it (vLLM's).
    pub victim_lookahead: Option<u32>,
}

impl TierSettings {
    /// The core's tier configuration for this tier's `kind` of store and `capacity_blocks`.
    pub fn tier_config(&self, kind: TierKind, capacity_blocks: u32) -> TierConfig {
        tier_config(kind, capacity_blocks, self.policy, self.victim_lookahead)
    }
}

/// The core's configuration of a tier of `kind` and `capacity_blocks` evicting by `policy`,
/// a victim tier writing `victim_lookahead` ahead when it is `Some` (the bench's settings and
/// the Python package's alike).
pub fn tier_config(
    kind: TierKind,
    capacity_blocks: u32,
    policy: PolicyKind,
    victim_lookahead: Option<u32>,
) -> TierConfig {
    let mut tc = TierConfig::new(kind, capacity_blocks);
    tc.policy = policy;
    if let Some(lookahead) = victim_lookahead {
        tc.admission = Admission::Victim { lookahead };
    }
    tc
}

/// A store shared by many nodes, and how to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedStore {
    /// Redis or Redis Cluster.
    Redis(RedisOptions),
    /// S3 object storage (AWS, or an S3-compatible server).
    S3(S3Options),
}

impl SharedStore {
    /// The store's kind, as a configuration's `type` names it.
    pub fn kind(&self) -> &'static str {
        match self {
            SharedStore::Redis(_) => "redis",
            SharedStore::S3(_) => "s3",
        }
    }

    /// Opens the store for blocks of `block_bytes` whose deployment is `identity` (what
    /// makes blocks interchangeable), tracking up to `capacity_bytes` of them on this node.
    pub fn open(
        &self,
        identity: &str,
        block_bytes: usize,
        capacity_bytes: u64,
    ) -> Result<Box<dyn SecondaryStore>, StoreError> {
        Ok(match self {
            SharedStore::Redis(o) => Box::new(RedisStore::open(
                &RedisOptions {
                    identity: identity.into(),
                    ..o.clone()
                },
                block_bytes,
                capacity_bytes,
            )?),
            SharedStore::S3(o) => Box::new(S3Store::open(
                &S3Options {
                    identity: identity.into(),
                    ..o.clone()
                },
                block_bytes,
                capacity_bytes,
            )?),
        })
    }
}

/// Every kind of secondary store a configuration's `type` can name, with the keys each takes
/// beside `type`, `capacity_bytes`, `eviction_policy` and `victim_lookahead`: the one table
/// that the bench's configuration file and the Python package check a tier's keys against.
pub const STORE_KINDS: &[(&str, &[&str])] = &[
    ("file", &["path", "fsync"]),
    (
        "redis",
        &[
            "urls",
            "cluster",
            "namespace",
            "timeout_ms",
            "ttl_s",
            "username_env",
            "password_env",
            "tls",
            "tls_ca_file",
        ],
    ),
    (
        "s3",
        &[
            "endpoint",
            "bucket",
            "prefix",
            "region",
            "access_key_id_env",
            "secret_access_key_env",
            "session_token_env",
            "virtual_hosted",
            "timeout_ms",
            "retries",
            "conditional_put",
        ],
    ),
];

/// Checks a tier's `type` and the keys it sets (beside `type`, `capacity_bytes` and
/// `eviction_policy`) against [`STORE_KINDS`]: an unknown type, and a key of another kind of
/// store or of none, are errors; `field` names a key in messages.
pub fn check_store_keys<'a>(
    kind: &str,
    set: impl IntoIterator<Item = &'a str>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), String> {
    let Some((_, own)) = STORE_KINDS.iter().find(|(k, _)| *k == kind) else {
        let kinds: Vec<String> = STORE_KINDS.iter().map(|(k, _)| format!("{k:?}")).collect();
        return Err(format!(
            "{}: expected {}, got {kind:?}",
            field("type"),
            kinds.join(", ")
        ));
    };
    for key in set {
        if !own.contains(&key) {
            let why = if STORE_KINDS.iter().any(|(_, keys)| keys.contains(&key)) {
                let article = if kind.starts_with(['a', 'e', 'i', 'o', 'u', 's']) {
                    "an"
                } else {
                    "a"
                };
                format!("not a setting of {article} {kind} tier")
            } else {
                "unknown setting".to_owned()
            };
            return Err(format!("{}: {why}", field(key)));
        }
    }
    Ok(())
}

impl TierSettings {
    /// A file tier at `path` (a temporary directory when `None`) of `capacity_bytes`, LRU.
    pub fn new(path: Option<PathBuf>, capacity_bytes: u64) -> Self {
        TierSettings {
            path,
            capacity_bytes,
            policy: PolicyKind::Lru,
            fsync: FsyncPolicy::default(),
            shared: None,
            victim_lookahead: None,
        }
    }

    /// A shared tier, tracking up to `capacity_bytes` of blocks on this node, LRU.
    pub fn shared(store: SharedStore, capacity_bytes: u64) -> Self {
        TierSettings {
            shared: Some(store),
            ..TierSettings::new(None, capacity_bytes)
        }
    }

    /// The kind of its store, as a configuration's `type` names it.
    pub fn kind(&self) -> &'static str {
        self.shared.as_ref().map_or("file", SharedStore::kind)
    }

    /// Parses `PATH:BYTES` (the `--tier` option); `BYTES` takes units (`64GiB`, `500M`), and
    /// an empty `PATH` means a temporary directory.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (path, bytes) = spec.rsplit_once(':').ok_or_else(|| {
            format!("expected PATH:BYTES (for example /mnt/nvme/kv:64GiB), got {spec:?}")
        })?;
        let capacity = parse_bytes(bytes)?;
        let path = (!path.is_empty()).then(|| PathBuf::from(path));
        Ok(TierSettings::new(path, capacity))
    }
}

/// Parses a byte count: a number with an optional unit (`4096`, `512KiB`, `1.5G`, `64GiB`).
/// Units are powers of 1024 (`K`, `KB` and `KiB` alike), as memory sizes are.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(text.trim())
        .map_err(|e| format!("{text:?} is not a byte count ({e})"))
}

/// Everything a bench run needs besides its workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchSettings {
    /// Bytes of the primary region.
    pub cpu_bytes: u64,
    /// Bytes of one block (one worker).
    pub block_bytes: usize,
    /// The primary's eviction policy (each tier has its own).
    pub policy: PolicyKind,
    /// Directory of the shared region's file; `None` (the default) for an anonymous region,
    /// which nothing outlives (see [`RegionKind`](crate::RegionKind)).
    pub region_dir: Option<PathBuf>,
    /// Secondary tiers, in cascade order.
    pub tiers: Vec<TierSettings>,
    /// Requests in flight at a time (a scheduler's batch).
    pub batch: usize,
    /// Copy threads of the host engine.
    pub copy_threads: usize,
    /// IO threads per tier.
    pub io_threads: usize,
    /// Steps a request waits for its promotions before it recomputes instead.
    pub max_wait_steps: u32,
    /// ★9: milliseconds one request may be answered "pending" or "retry" for one block
    /// before the core answers Miss (`Config::wait_deadline`); `None`: no deadline.
    pub hit_pending_timeout_ms: Option<u64>,
}

impl Default for BenchSettings {
    fn default() -> Self {
        BenchSettings {
            cpu_bytes: 1 << 30,
            block_bytes: 256 << 10,
            policy: PolicyKind::Lru,
            region_dir: None,
            tiers: vec![TierSettings {
                victim_lookahead: Some(DEFAULT_VICTIM_LOOKAHEAD),
                ..TierSettings::new(None, 4 << 30)
            }],
            batch: 4,
            copy_threads: 2,
            io_threads: 4,
            max_wait_steps: 64,
            hit_pending_timeout_ms: Some(5_000),
        }
    }
}

/// A configuration file, TOML or JSON (by extension; otherwise TOML is tried, then JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    /// Bytes of the primary region.
    pub cpu_bytes_to_use: Option<u64>,
    /// Tokens per block (with `bytes_per_token`, sets the block size).
    pub block_size: Option<u64>,
    /// KV-cache bytes per token for one worker.
    pub bytes_per_token: Option<u64>,
    /// The primary's policy: "lru", "arc" or "reuse" (any case).
    pub eviction_policy: Option<String>,
    /// Directory of the shared region.
    pub region_dir: Option<PathBuf>,
    /// Requests in flight at a time.
    pub batch: Option<usize>,
    /// Secondary tiers.
    pub secondary_tiers: Option<Vec<FileTier>>,
    /// Milliseconds a request waits for one block before it computes it (0: no deadline).
    pub hit_pending_timeout_ms: Option<u64>,
}

/// A secondary tier in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTier {
    /// "file" (a local, persistent tier), "redis" or "s3" (tiers shared by many nodes): see
    /// [`STORE_KINDS`].
    #[serde(rename = "type")]
    pub kind: String,
    /// Its capacity in bytes (for a shared tier: how much of the store this node tracks).
    pub capacity_bytes: u64,
    /// Its eviction policy: "lru" (the default), "arc" or "reuse" (any case).
    pub eviction_policy: Option<String>,
    /// A victim tier writing the primary's next N victims ahead (rules V1–V4); absent: every
    /// completed store is cascaded to it, as vLLM does.
    pub victim_lookahead: Option<u32>,
    /// File tier: its directory (a temporary one when absent).
    pub path: Option<PathBuf>,
    /// File tier: when its writes are made durable: "none", "batch" or "write".
    pub fsync: Option<String>,
    /// Redis tier: the server's URL, or any nodes' URLs of a cluster.
    pub urls: Option<Vec<String>>,
    /// Redis tier: whether the servers form a Redis Cluster (default false).
    pub cluster: Option<bool>,
    /// Redis tier: the first part of every name (default "kvtier").
    pub namespace: Option<String>,
    /// Redis tier: the bound on each wait for a server (a connect, each write of a call, each read
    /// of its replies), in milliseconds (default 1000). S3 tier: the deadline of one call (a
    /// job's reads or writes, a step's probes), retries included (default 5000).
    pub timeout_ms: Option<u64>,
    /// Redis tier: expiry of the values this node writes, in seconds (default none).
    pub ttl_s: Option<u64>,
    /// Redis tier: the environment variable holding the ACL user name.
    pub username_env: Option<String>,
    /// Redis tier: the environment variable holding the password.
    pub password_env: Option<String>,
    /// Redis tier: connect with TLS (`redis://` URLs are taken as `rediss://`); default: what
    /// the URLs say. `false` with a `rediss://` URL is an error.
    pub tls: Option<bool>,
    /// Redis tier: a PEM file with the CA certificate(s) that sign the servers' certificates
    /// (a private CA); needs TLS.
    pub tls_ca_file: Option<PathBuf>,
    /// S3 tier: the server's URL (`http://host:port`); absent: AWS S3 in `region`.
    pub endpoint: Option<String>,
    /// S3 tier: the bucket (it must exist).
    pub bucket: Option<String>,
    /// S3 tier: the first part of every object's name (default "kvtier").
    pub prefix: Option<String>,
    /// S3 tier: the region requests are signed for (default "us-east-1").
    pub region: Option<String>,
    /// S3 tier: the environment variable holding the access key id.
    pub access_key_id_env: Option<String>,
    /// S3 tier: the environment variable holding the secret access key.
    pub secret_access_key_env: Option<String>,
    /// S3 tier: the environment variable holding a session token (temporary credentials).
    pub session_token_env: Option<String>,
    /// S3 tier: virtual-hosted addressing (`bucket.host`) instead of path-style (default
    /// false: path-style, what most S3-compatible servers expect).
    pub virtual_hosted: Option<bool>,
    /// S3 tier: how many times a request that failed for a reason worth retrying is sent
    /// again, within the call's deadline (default 2).
    pub retries: Option<usize>,
    /// S3 tier: writes carry `If-None-Match: *`, so a block two nodes store is written once
    /// (default true; false for a server that rejects the header).
    pub conditional_put: Option<bool>,
}

impl FileTier {
    /// A Redis tier's connection settings from its keys (`urls`, `cluster`, `namespace`,
    /// `timeout_ms`, `ttl_s`, `username_env`, `password_env`, `tls`, `tls_ca_file`): every
    /// check of the configuration file, for any caller that takes the same keys (the Python
    /// package does). `field` names a key in messages; `lookup` reads the environment. The
    /// identity is left empty: it is the caller's (model, layout) to set.
    pub fn redis_options(
        &self,
        field: &dyn Fn(&str) -> String,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<RedisOptions, String> {
        let mut o = RedisOptions::default();
        match &self.urls {
            Some(urls) if !urls.is_empty() => o.urls = urls.clone(),
            _ => {
                return Err(format!(
                    "{}: a Redis tier needs its server's URL",
                    field("urls")
                ));
            }
        }
        o.cluster = self.cluster.unwrap_or(false);
        if let Some(n) = &self.namespace {
            if n.is_empty() {
                return Err(format!("{}: must not be empty", field("namespace")));
            }
            o.namespace = n.clone();
        }
        if let Some(ms) = self.timeout_ms {
            if ms == 0 {
                return Err(format!("{}: must be at least 1", field("timeout_ms")));
            }
            o.timeout = std::time::Duration::from_millis(ms);
        }
        if let Some(s) = self.ttl_s {
            if s == 0 {
                return Err(format!(
                    "{}: must be at least 1 (or absent)",
                    field("ttl_s")
                ));
            }
            o.ttl = Some(std::time::Duration::from_secs(s));
        }
        let any_tls_url = o.urls.iter().any(|u| u.starts_with("rediss://"));
        o.tls = self.tls.unwrap_or(any_tls_url);
        if !o.tls && any_tls_url {
            return Err(format!(
                "{}: false, but a URL is rediss:// (TLS): set tls = true, or use redis:// URLs",
                field("tls")
            ));
        }
        if let Some(ca) = &self.tls_ca_file {
            if !o.tls {
                return Err(format!(
                    "{}: a CA for TLS, but the tier does not use TLS: set tls = true",
                    field("tls_ca_file")
                ));
            }
            o.tls_ca_file = Some(ca.clone());
        }
        // A variable that is not set is reported under the key that names it.
        let unset = |var: &Option<String>| var.as_deref().is_some_and(|v| lookup(v).is_none());
        let key = if unset(&self.username_env) {
            "username_env"
        } else {
            "password_env"
        };
        o.credentials_from(
            self.username_env.as_deref(),
            self.password_env.as_deref(),
            lookup,
        )
        .map_err(|e| format!("{}: {e}", field(key)))?;
        Ok(o)
    }

    /// An S3 tier's settings from its keys (`endpoint`, `bucket`, `prefix`, `region`,
    /// `access_key_id_env`, `secret_access_key_env`, `session_token_env`, `virtual_hosted`,
    /// `timeout_ms`, `retries`, `conditional_put`): every check of the configuration file, for
    /// any caller that takes the same keys (the Python package does). `field` names a key in
    /// messages; `lookup` reads the environment. The identity is left empty: it is the
    /// caller's (model, layout) to set.
    pub fn s3_options(
        &self,
        field: &dyn Fn(&str) -> String,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<S3Options, String> {
        let mut o = S3Options::default();
        match &self.bucket {
            Some(b) if !b.is_empty() => o.bucket = b.clone(),
            _ => return Err(format!("{}: an S3 tier needs its bucket", field("bucket"))),
        }
        if let Some(e) = &self.endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!(
                    "{}: expected a URL starting with http:// or https://, got {e:?}",
                    field("endpoint")
                ));
            }
            o.endpoint = Some(e.clone());
        }
        if let Some(p) = &self.prefix {
            if p.is_empty() || p.starts_with('/') || p.ends_with('/') || p.contains("//") {
                return Err(format!(
                    "{}: expected names separated by single '/', got {p:?}",
                    field("prefix")
                ));
            }
            o.prefix = p.clone();
        }
        if let Some(r) = &self.region {
            if r.is_empty() {
                return Err(format!("{}: must not be empty", field("region")));
            }
            o.region = r.clone();
        }
        if let Some(ms) = self.timeout_ms {
            if ms == 0 {
                return Err(format!("{}: must be at least 1", field("timeout_ms")));
            }
            o.timeout = std::time::Duration::from_millis(ms);
        }
        o.virtual_hosted = self.virtual_hosted.unwrap_or(false);
        o.retries = self.retries.unwrap_or(o.retries);
        o.conditional_put = self.conditional_put.unwrap_or(true);
        // A variable that is not set is reported under the key that names it.
        let keys = [
            ("access_key_id_env", &self.access_key_id_env),
            ("secret_access_key_env", &self.secret_access_key_env),
            ("session_token_env", &self.session_token_env),
        ];
        // A key id without a secret (or the reverse) is reported under the one missing.
        let key = keys
            .iter()
            .find(|(_, var)| var.as_deref().is_some_and(|v| lookup(v).is_none()))
            .map(|(k, _)| *k)
            .unwrap_or(if self.access_key_id_env.is_some() {
                "secret_access_key_env"
            } else {
                "access_key_id_env"
            });
        o.credentials_from(
            self.access_key_id_env.as_deref(),
            self.secret_access_key_env.as_deref(),
            self.session_token_env.as_deref(),
            lookup,
        )
        .map_err(|e| format!("{}: {e}", field(key)))?;
        Ok(o)
    }

    /// The keys this tier sets beside `type`, `capacity_bytes` and `eviction_policy`.
    fn keys_set(&self) -> Vec<&'static str> {
        let set = [
            ("path", self.path.is_some()),
            ("fsync", self.fsync.is_some()),
            ("urls", self.urls.is_some()),
            ("cluster", self.cluster.is_some()),
            ("namespace", self.namespace.is_some()),
            ("timeout_ms", self.timeout_ms.is_some()),
            ("ttl_s", self.ttl_s.is_some()),
            ("username_env", self.username_env.is_some()),
            ("password_env", self.password_env.is_some()),
            ("tls", self.tls.is_some()),
            ("tls_ca_file", self.tls_ca_file.is_some()),
            ("endpoint", self.endpoint.is_some()),
            ("bucket", self.bucket.is_some()),
            ("prefix", self.prefix.is_some()),
            ("region", self.region.is_some()),
            ("access_key_id_env", self.access_key_id_env.is_some()),
            (
                "secret_access_key_env",
                self.secret_access_key_env.is_some(),
            ),
            ("session_token_env", self.session_token_env.is_some()),
            ("virtual_hosted", self.virtual_hosted.is_some()),
            ("retries", self.retries.is_some()),
            ("conditional_put", self.conditional_put.is_some()),
        ];
        set.iter().filter(|(_, s)| *s).map(|(k, _)| *k).collect()
    }

    /// The tier's settings; `lookup` reads the environment (credentials come from the
    /// variables the file names, never from the file).
    fn settings(
        &self,
        field: &dyn Fn(&str) -> String,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<TierSettings, String> {
        check_store_keys(&self.kind, self.keys_set(), field)?;
        let mut tier = match self.kind.as_str() {
            "redis" => TierSettings::shared(
                SharedStore::Redis(self.redis_options(field, lookup)?),
                self.capacity_bytes,
            ),
            "s3" => TierSettings::shared(
                SharedStore::S3(self.s3_options(field, lookup)?),
                self.capacity_bytes,
            ),
            _ => {
                let mut tier = TierSettings::new(self.path.clone(), self.capacity_bytes);
                if let Some(f) = &self.fsync {
                    tier.fsync = f
                        .to_ascii_lowercase()
                        .parse()
                        .map_err(|e| format!("{}: {e}", field("fsync")))?;
                }
                tier
            }
        };
        if let Some(p) = &self.eviction_policy {
            let name = field("eviction_policy");
            tier.policy = policy_named(&name, p)?;
            if tier.policy == PolicyKind::Reuse {
                return Err(format!(
                    "{name}: \"reuse\" is the primary's only (it learns from requests' \
                     finishes); a secondary tier takes \"lru\" or \"arc\""
                ));
            }
        }
        tier.victim_lookahead =
            victim_lookahead(&field("victim_lookahead"), self.victim_lookahead)?;
        Ok(tier)
    }
}

/// The look-ahead of the bench's default tier, a victim tier (V1–V4): chosen on the Mooncake
/// synthetic trace and a generated multi-turn trace, replayed one request a step (192 was
/// within 0.04 % of a cascaded tier at its worst and 8 % above it on average; a shorter
/// look-ahead misses evictions, docs/performance.md, "Victim tiers").
pub const DEFAULT_VICTIM_LOOKAHEAD: u32 = 192;

/// A tier's `victim_lookahead`, checked: at least one block.
pub fn victim_lookahead(field: &str, n: Option<u32>) -> Result<Option<u32>, String> {
    match n {
        Some(0) => Err(format!(
            "{field}: a victim tier writes at least 1 block ahead (leave it out for a tier \
             every store is cascaded to)"
        )),
        n => Ok(n),
    }
}

/// Parses a policy name.
pub fn parse_policy(s: &str) -> Option<PolicyKind> {
    match s.to_ascii_lowercase().as_str() {
        "lru" => Some(PolicyKind::Lru),
        "arc" => Some(PolicyKind::Arc),
        "reuse" => Some(PolicyKind::Reuse),
        _ => None,
    }
}

/// The policy `p` names, or an error naming `field`.
fn policy_named(field: &str, p: &str) -> Result<PolicyKind, String> {
    parse_policy(p)
        .ok_or_else(|| format!("{field}: expected \"lru\", \"arc\" or \"reuse\", got {p:?}"))
}

impl FileSettings {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::Io {
            what: "read config",
            path: path.to_path_buf(),
            source: e,
        })?;
        Self::parse(&text, path)
    }

    /// Parses `text`, read from `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Self, BenchError> {
        let bad = |reason: String| BenchError::Config {
            path: path.to_path_buf(),
            reason,
        };
        match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::from_str(text).map_err(|e| bad(e.to_string())),
            Some("toml") => toml::from_str(text).map_err(|e| bad(e.to_string())),
            _ => toml::from_str(text)
                .or_else(|t| serde_json::from_str(text).map_err(|_| bad(t.to_string()))),
        }
    }

    /// Applies the file over `s`, checking what only the file can get wrong (names, types);
    /// [`BenchSettings::validate`] checks the values once the options are applied too.
    pub fn apply(&self, s: &mut BenchSettings, path: &Path) -> Result<(), BenchError> {
        let bad = |reason: String| BenchError::Config {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(b) = self.cpu_bytes_to_use {
            s.cpu_bytes = b;
        }
        match (self.block_size, self.bytes_per_token) {
            (Some(t), Some(b)) => {
                s.block_bytes = usize::try_from(t.saturating_mul(b))
                    .map_err(|_| bad("block_size * bytes_per_token is too large".into()))?
            }
            (Some(t), None) => s.block_bytes = (t as usize).saturating_mul(512),
            (None, Some(_)) => return Err(bad("bytes_per_token needs block_size".into())),
            (None, None) => {}
        }
        if let Some(p) = &self.eviction_policy {
            s.policy = policy_named("eviction_policy", p).map_err(bad)?;
        }
        if let Some(d) = &self.region_dir {
            s.region_dir = Some(d.clone());
        }
        if let Some(b) = self.batch {
            s.batch = b;
        }
        if let Some(ms) = self.hit_pending_timeout_ms {
            s.hit_pending_timeout_ms = (ms > 0).then_some(ms);
        }
        if let Some(tiers) = &self.secondary_tiers {
            let env = |v: &str| std::env::var(v).ok();
            s.tiers = tiers
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let field = |k: &str| format!("secondary_tiers[{i}].{k}");
                    t.settings(&field, &env).map_err(bad)
                })
                .collect::<Result<_, _>>()?;
        }
        Ok(())
    }
}

impl BenchSettings {
    /// Checks the settings, once every source (defaults, file, options) is applied: the error
    /// names the setting by its file key and its option. Nothing is created before this.
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |reason: String| {
            Err(BenchError::Config {
                path: "-".into(),
                reason,
            })
        };
        if self.block_bytes == 0 || self.block_bytes > 1 << 30 {
            return bad("block bytes (block_size × bytes_per_token, --block-bytes): must be 1 byte to 1 GiB".into());
        }
        let row = crate::page_align(self.block_bytes);
        if self.cpu_bytes < row as u64 {
            return bad(format!(
                "cpu_bytes_to_use (--cpu-bytes): {} holds no block of {} (a block takes {} in the region)",
                super::fmt_bytes(self.cpu_bytes),
                super::fmt_bytes(self.block_bytes as u64),
                super::fmt_bytes(row as u64)
            ));
        }
        if self.batch == 0 || self.batch > 256 {
            return bad("batch: must be 1 to 256".into());
        }
        for (i, t) in self.tiers.iter().enumerate() {
            if t.shared.is_some() {
                if t.capacity_bytes < row as u64 {
                    return bad(format!(
                        "secondary_tiers[{i}].capacity_bytes: {} holds no block of {}",
                        super::fmt_bytes(t.capacity_bytes),
                        super::fmt_bytes(row as u64)
                    ));
                }
                continue;
            }
            if let Err(e) = crate::FileStore::capacity_for(row, t.capacity_bytes) {
                return bad(format!("secondary_tiers[{i}].capacity_bytes (--tier): {e}"));
            }
        }
        if let Some(dir) = &self.region_dir
            && !dir.is_dir()
        {
            return bad(format!(
                "region_dir (--region-dir): {} is not a directory",
                dir.display()
            ));
        }
        Ok(())
    }
}

impl BenchSettings {
    /// Whether the region is memory: anonymous, or a file in tmpfs (such as `/dev/shm`).
    pub(crate) fn region_in_memory(&self) -> bool {
        self.region_dir.as_deref().is_none_or(super::in_memory)
    }

    /// Where the region is, for messages: its directory, or "anonymous memory".
    pub(crate) fn region_place(&self) -> String {
        self.region_dir.as_deref().map_or_else(
            || "anonymous memory".to_string(),
            |d| d.display().to_string(),
        )
    }

    /// The region of the process `pid`: `@kvtier-bench-PID`, or `DIR/kvtier-bench-PID` in
    /// `region_dir`.
    pub(crate) fn region_path(&self, pid: u32) -> PathBuf {
        let name = format!("kvtier-bench-{pid}");
        match &self.region_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(format!("{}{name}", crate::ANONYMOUS_PREFIX)),
        }
    }
}

impl BenchSettings {
    /// Checks that the settings suit a run of `nodes` processes (`--nodes`): from 1 to
    /// [`MAX_NODES`](super::MAX_NODES), and more than one only with a shared tier, through
    /// which the nodes share blocks; their regions together, in memory (tmpfs), must fit in
    /// what the machine has available.
    pub fn check_nodes(&self, nodes: u32) -> Result<(), BenchError> {
        let bad = |reason: String| {
            Err(BenchError::Config {
                path: "-".into(),
                reason,
            })
        };
        if nodes == 0 || nodes > super::MAX_NODES {
            return bad(format!(
                "nodes (--nodes): must be 1 to {}, got {nodes}",
                super::MAX_NODES
            ));
        }
        if nodes > 1 && !self.tiers.iter().any(|t| t.shared.is_some()) {
            return bad(format!(
                "nodes (--nodes {nodes}): the nodes share blocks through a shared tier, and secondary_tiers has none; add one to the configuration, for example [[secondary_tiers]] type = \"redis\", urls = [\"redis://127.0.0.1:6379\"], capacity_bytes = 4294967296"
            ));
        }
        let region = u64::from(nodes).saturating_mul(self.cpu_bytes);
        if nodes > 1 && self.region_in_memory() && region > 2 * super::memory_budget() {
            return bad(format!(
                "cpu_bytes_to_use (--cpu-bytes): {nodes} nodes' regions of {} each in {} (memory) need more than the {} this machine has available",
                super::approx_bytes(self.cpu_bytes),
                self.region_place(),
                super::approx_bytes(2 * super::memory_budget())
            ));
        }
        Ok(())
    }

    /// The settings of node `node` of a run of `nodes`: the same, but a file tier with a
    /// path gets its own subdirectory `node-<node>` of it (a file tier is one process's:
    /// its store locks its path). One node keeps the paths as they are.
    pub fn for_node(&self, node: u32, nodes: u32) -> BenchSettings {
        let mut s = self.clone();
        if nodes > 1 {
            for t in &mut s.tiers {
                if let (None, Some(p)) = (&t.shared, &mut t.path) {
                    *p = p.join(format!("node-{node}"));
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_keys_in_toml_and_json() {
        let toml = r#"
cpu_bytes_to_use = 268435456
block_size = 256
bytes_per_token = 1024
eviction_policy = "arc"
secondary_tiers = [{ type = "file", capacity_bytes = 1073741824 }]
"#;
        let f = FileSettings::parse(toml, Path::new("c.toml")).unwrap();
        let mut s = BenchSettings::default();
        f.apply(&mut s, Path::new("c.toml")).unwrap();
        assert_eq!(
            (s.cpu_bytes, s.block_bytes, s.policy),
            (256 << 20, 256 << 10, PolicyKind::Arc)
        );
        assert_eq!(s.tiers.len(), 1);
        let json = r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": []}"#;
        let f = FileSettings::parse(json, Path::new("c.json")).unwrap();
        f.apply(&mut s, Path::new("c.json")).unwrap();
        assert!(s.tiers.is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        let err = FileSettings::parse("cpu_bytes = 1", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("cpu_bytes"), "{err}");
        let f = FileSettings::parse("eviction_policy = \"fifo\"", Path::new("c.toml")).unwrap();
        let err = f
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("eviction_policy"), "{err}");
        for (tier, field) in [
            ("type = \"tape\"", "secondary_tiers[0].type"),
            ("type = \"s3\"", "secondary_tiers[0].bucket"),
            (
                "type = \"s3\"\nbucket = \"b\"\nurls = [\"redis://h\"]",
                "secondary_tiers[0].urls",
            ),
            (
                "type = \"redis\"\nurls = [\"redis://h\"]\nbucket = \"b\"",
                "secondary_tiers[0].bucket",
            ),
            (
                "type = \"s3\"\nbucket = \"b\"\nendpoint = \"127.0.0.1:9000\"",
                "secondary_tiers[0].endpoint",
            ),
            (
                "type = \"s3\"\nbucket = \"b\"\nprefix = \"/a\"",
                "secondary_tiers[0].prefix",
            ),
            ("type = \"redis\"", "secondary_tiers[0].urls"),
            (
                "type = \"redis\"\nurls = [\"redis://h\"]\npath = \"/x\"",
                "secondary_tiers[0].path",
            ),
            (
                "type = \"file\"\nurls = [\"redis://h\"]",
                "secondary_tiers[0].urls",
            ),
            (
                "type = \"redis\"\nurls = [\"redis://h\"]\ntimeout_ms = 0",
                "secondary_tiers[0].timeout_ms",
            ),
        ] {
            let text = format!("[[secondary_tiers]]\ncapacity_bytes = 1\n{tier}");
            let f = FileSettings::parse(&text, Path::new("c.toml")).unwrap();
            let err = f
                .apply(&mut BenchSettings::default(), Path::new("c.toml"))
                .unwrap_err();
            assert!(err.to_string().contains(field), "{tier}: {err}");
        }
    }

    #[test]
    fn an_s3_tier_reads_its_keys_and_its_credentials_from_the_environment() {
        let toml = r#"
[[secondary_tiers]]
type = "s3"
endpoint = "http://127.0.0.1:8333"
bucket = "kv"
prefix = "fleet/a"
region = "eu-west-1"
capacity_bytes = 1073741824
timeout_ms = 2500
retries = 4
virtual_hosted = true
conditional_put = false
access_key_id_env = "KEY_VAR"
secret_access_key_env = "SECRET_VAR"
eviction_policy = "arc"
"#;
        let f = FileSettings::parse(toml, Path::new("c.toml")).unwrap();
        let tier = &f.secondary_tiers.as_ref().unwrap()[0];
        let field = |k: &str| format!("secondary_tiers[0].{k}");
        let env = |v: &str| match v {
            "KEY_VAR" => Some("AK".to_owned()),
            "SECRET_VAR" => Some("SK".to_owned()),
            _ => None,
        };
        let t = tier.settings(&field, &env).unwrap();
        assert_eq!(t.kind(), "s3");
        assert_eq!(t.policy, PolicyKind::Arc);
        let Some(SharedStore::S3(o)) = &t.shared else {
            panic!("an s3 tier: {t:?}");
        };
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        assert_eq!((o.bucket.as_str(), o.prefix.as_str()), ("kv", "fleet/a"));
        assert_eq!(o.region, "eu-west-1");
        assert_eq!(o.timeout, std::time::Duration::from_millis(2500));
        assert_eq!(o.retries, 4);
        assert!(o.virtual_hosted && !o.conditional_put);
        assert_eq!(o.access_key_id.as_deref(), Some("AK"));
        assert_eq!(o.secret_access_key.as_deref(), Some("SK"));
        // A named variable that is not set is reported under the key that names it.
        let err = tier.settings(&field, &|_| None).unwrap_err();
        assert!(
            err.contains("secondary_tiers[0].access_key_id_env"),
            "{err}"
        );
        assert!(err.contains("KEY_VAR"), "{err}");
        let only_key = |v: &str| (v == "KEY_VAR").then(|| "AK".to_owned());
        let err = tier.settings(&field, &only_key).unwrap_err();
        assert!(
            err.contains("secondary_tiers[0].secret_access_key_env"),
            "{err}"
        );
    }

    #[test]
    fn a_redis_tier_reads_its_keys_and_its_credentials_from_the_environment() {
        let toml = r#"
[[secondary_tiers]]
type = "redis"
urls = ["redis://10.0.0.5:6379", "redis://10.0.0.6:6379"]
cluster = true
namespace = "prod"
capacity_bytes = 1073741824
timeout_ms = 250
ttl_s = 3600
password_env = "KVTIER_SETTINGS_TEST_PASSWORD"
"#;
        let f = FileSettings::parse(toml, Path::new("c.toml")).unwrap();
        let tier = &f.secondary_tiers.as_ref().unwrap()[0];
        let field = |k: &str| format!("secondary_tiers[0].{k}");
        let env = |v: &str| (v == "KVTIER_SETTINGS_TEST_PASSWORD").then(|| "pw".to_owned());
        let t = tier.settings(&field, &env).unwrap();
        let Some(SharedStore::Redis(o)) = &t.shared else {
            panic!("a redis tier: {t:?}");
        };
        assert_eq!(o.urls.len(), 2);
        assert!(o.cluster);
        assert_eq!(o.namespace, "prod");
        assert_eq!(o.timeout, std::time::Duration::from_millis(250));
        assert_eq!(o.ttl, Some(std::time::Duration::from_secs(3600)));
        assert_eq!(o.password.as_deref(), Some("pw"));
        assert_eq!(t.capacity_bytes, 1 << 30);
        // The variable is named, not set: an error naming it, under its key.
        let err = tier.settings(&field, &|_| None).unwrap_err();
        assert!(err.contains("KVTIER_SETTINGS_TEST_PASSWORD"), "{err}");
        assert!(err.contains("secondary_tiers[0].password_env"), "{err}");
        let with_user = FileTier {
            username_env: Some("KVTIER_SETTINGS_TEST_USER".into()),
            ..tier.clone()
        };
        let err = with_user.settings(&field, &env).unwrap_err();
        assert!(
            err.contains("secondary_tiers[0].username_env")
                && err.contains("KVTIER_SETTINGS_TEST_USER")
                && err.contains("user name"),
            "{err}"
        );
    }

    #[test]
    fn a_redis_tier_takes_tls_from_its_key_or_its_urls() {
        let field = |k: &str| format!("secondary_tiers[0].{k}");
        let tier = |extra: &str, url: &str| {
            let text = format!(
                "[[secondary_tiers]]\ntype = \"redis\"\ncapacity_bytes = 1\nurls = [\"{url}\"]\n{extra}"
            );
            let f = FileSettings::parse(&text, Path::new("c.toml")).unwrap();
            f.secondary_tiers.unwrap().remove(0)
        };
        let none = |_: &str| None;
        let redis = |t: &TierSettings| match &t.shared {
            Some(SharedStore::Redis(o)) => o.clone(),
            other => panic!("a redis tier: {other:?}"),
        };
        let t = tier("", "rediss://h:1").settings(&field, &none).unwrap();
        assert!(redis(&t).tls, "a rediss:// URL means TLS");
        let t = tier("tls = true\ntls_ca_file = \"/etc/ca.pem\"", "redis://h:1")
            .settings(&field, &none)
            .unwrap();
        assert!(redis(&t).tls);
        assert_eq!(
            redis(&t).tls_ca_file.as_deref(),
            Some(Path::new("/etc/ca.pem"))
        );
        let t = tier("", "redis://h:1").settings(&field, &none).unwrap();
        assert!(!redis(&t).tls);
        let err = tier("tls = false", "rediss://h:1")
            .settings(&field, &none)
            .unwrap_err();
        assert!(err.contains("secondary_tiers[0].tls:"), "{err}");
        let err = tier("tls_ca_file = \"/etc/ca.pem\"", "redis://h:1")
            .settings(&field, &none)
            .unwrap_err();
        assert!(err.contains("secondary_tiers[0].tls_ca_file"), "{err}");
    }

    #[test]
    fn each_tier_has_its_own_policy() {
        let toml = r#"
eviction_policy = "ARC"
[[secondary_tiers]]
type = "file"
capacity_bytes = 1073741824
[[secondary_tiers]]
type = "file"
capacity_bytes = 1073741824
eviction_policy = "Arc"
fsync = "write"
"#;
        let mut s = BenchSettings::default();
        let f = FileSettings::parse(toml, Path::new("c.toml")).unwrap();
        f.apply(&mut s, Path::new("c.toml")).unwrap();
        assert_eq!(s.policy, PolicyKind::Arc, "the primary's policy, any case");
        let tiers: Vec<PolicyKind> = s.tiers.iter().map(|t| t.policy).collect();
        assert_eq!(tiers, [PolicyKind::Lru, PolicyKind::Arc]);
        assert_eq!(s.tiers[0].fsync, FsyncPolicy::default());
        assert_eq!(s.tiers[1].fsync, FsyncPolicy::Write);
        let bad =
            "[[secondary_tiers]]\ntype = \"file\"\ncapacity_bytes = 1\neviction_policy = \"mru\"";
        let err = FileSettings::parse(bad, Path::new("c.toml"))
            .unwrap()
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("secondary_tiers[0].eviction_policy"),
            "{err}"
        );
        let primary_only = bad.replace("mru", "reuse");
        let err = FileSettings::parse(&primary_only, Path::new("c.toml"))
            .unwrap()
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("secondary_tiers[0].eviction_policy") && err.contains("primary's only"),
            "{err}"
        );
    }

    #[test]
    fn several_nodes_need_a_shared_tier_and_get_their_own_file_tiers() {
        let mut s = BenchSettings {
            tiers: vec![TierSettings::new(Some("/mnt/kv".into()), 1 << 30)],
            ..BenchSettings::default()
        };
        s.check_nodes(1).unwrap();
        let err = s.check_nodes(2).unwrap_err().to_string();
        assert!(err.contains("nodes (--nodes 2)"), "{err}");
        assert!(err.contains("type = \"redis\""), "{err}");
        let err = s.check_nodes(0).unwrap_err().to_string();
        assert!(err.contains("must be 1 to"), "{err}");
        s.tiers.push(TierSettings::shared(
            SharedStore::Redis(RedisOptions::default()),
            1 << 30,
        ));
        s.check_nodes(2).unwrap();
        let node = s.for_node(1, 2);
        assert_eq!(
            node.tiers[0].path.as_deref(),
            Some(Path::new("/mnt/kv/node-1"))
        );
        assert_eq!(node.tiers[1], s.tiers[1], "the shared tier is the same");
        assert_eq!(s.for_node(0, 1), s, "one node: as it was");
        let temp = BenchSettings::default();
        assert_eq!(
            temp.for_node(1, 2).tiers[0].path,
            None,
            "a temporary tier each"
        );
    }

    #[test]
    fn tier_options_and_byte_counts_parse() {
        let t = TierSettings::parse("/mnt/nvme/kv:64GiB").unwrap();
        assert_eq!(t.path.as_deref(), Some(Path::new("/mnt/nvme/kv")));
        assert_eq!(t.capacity_bytes, 64 << 30);
        let t = TierSettings::parse(":512M").unwrap();
        assert_eq!((t.path, t.capacity_bytes), (None, 512 << 20));
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("16KiB").unwrap(), 16 << 10);
        assert_eq!(parse_bytes("16kb").unwrap(), 16 << 10);
        let err = TierSettings::parse("/mnt/nvme").unwrap_err();
        assert!(err.contains("PATH:BYTES"), "{err}");
        let err = parse_bytes("lots").unwrap_err();
        assert!(err.contains("not a byte count"), "{err}");
    }

    /// `victim_lookahead` makes a tier a victim tier (V1–V4) in the core's configuration; 0 is
    /// refused naming the key; absent, the tier is cascaded to (vLLM's).
    #[test]
    fn a_tier_victim_lookahead_sets_its_admission() {
        let toml = "[[secondary_tiers]]\ntype = \"file\"\ncapacity_bytes = 1048576\nvictim_lookahead = 192\n\n[[secondary_tiers]]\ntype = \"file\"\ncapacity_bytes = 1048576\n";
        let mut s = BenchSettings::default();
        FileSettings::parse(toml, Path::new("c.toml"))
            .unwrap()
            .apply(&mut s, Path::new("c.toml"))
            .unwrap();
        let admissions: Vec<Admission> = s
            .tiers
            .iter()
            .map(|t| t.tier_config(TierKind::Authoritative, 8).admission)
            .collect();
        assert_eq!(
            admissions,
            [Admission::Victim { lookahead: 192 }, Admission::Cascade]
        );
        let zero = toml.replace("192", "0");
        let err = FileSettings::parse(&zero, Path::new("c.toml"))
            .unwrap()
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("secondary_tiers[0].victim_lookahead"), "{err}");
    }
}
