//! The vLLM 0.33.0 differential oracle: vLLM's own offloading managers, driven from Rust.
//!
//! [`VllmOracle`] runs `model/oracle/vllm_oracle.py` under the Python of the install that
//! `scripts/vllm-oracle-setup.sh` makes outside the clone, and speaks its JSON-lines protocol
//! (documented in `model/oracle/README.md`): every method is one request and one typed
//! answer. The same call sequence sent to the oracle and to `kvtier-core` makes every answer
//! of vLLM comparable with the core's.
//!
//! Where the install is: `$KVTIER_VLLM_DIR`, else `${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm-0.33.0`
//! ([`install_dir`]). Without one, [`VllmOracle::spawn`] fails with
//! [`OracleError::NotInstalled`], whose message says to run the setup script.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Value, json};

/// The vLLM release the oracle runs.
pub const VLLM_VERSION: &str = "0.33.0";

/// What to do when the oracle is not installed.
pub const SETUP_HINT: &str = "run scripts/vllm-oracle-setup.sh";

/// The oracle's Python program, in this crate.
pub const ORACLE_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/oracle/vllm_oracle.py");

/// How much of the oracle's stderr is kept for error messages.
const STDERR_TAIL: usize = 16 * 1024;

/// Why the oracle could not answer.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// No complete install where the oracle looks.
    #[error("vLLM {VLLM_VERSION} oracle not installed at {}: {SETUP_HINT}", dir.display())]
    NotInstalled {
        /// The directory that was searched.
        dir: PathBuf,
    },
    /// The Python interpreter could not be started.
    #[error("cannot start the vLLM oracle ({}): {source}", program.display())]
    Spawn {
        /// The interpreter.
        program: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// Reading from or writing to the oracle failed.
    #[error("vLLM oracle I/O: {0}")]
    Io(#[from] io::Error),
    /// The oracle ended (or never started); its stderr's last lines say why.
    #[error("vLLM oracle exited{}: {stderr}", status.map(|s| format!(" with status {s}")).unwrap_or_default())]
    Exited {
        /// The exit status, when it was collected.
        status: Option<i32>,
        /// The end of what the oracle wrote to stderr, or its start-up error.
        stderr: String,
    },
    /// An answer that does not fit the protocol.
    #[error("vLLM oracle protocol: {0}")]
    Protocol(String),
    /// The oracle answered with an error: a malformed request (`kind` is `RequestError`) or
    /// an exception raised by vLLM itself, e.g. `AssertionError` of a misused manager.
    #[error("vLLM oracle refused {op}: {message}")]
    Refused {
        /// The op that failed.
        op: String,
        /// The Python exception class.
        kind: String,
        /// The exception's message.
        message: String,
    },
}

/// The install directory: `$KVTIER_VLLM_DIR`, else
/// `${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm-0.33.0`.
pub fn install_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVTIER_VLLM_DIR") {
        return dir.into();
    }
    let cache = std::env::var_os("KVTIER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache").join("kvtier")
        });
    cache.join(format!("vllm-{VLLM_VERSION}"))
}

/// An offload key: raw bytes, sent as lowercase hex. vLLM 0.33 builds one as the block hash
/// followed by the KV-cache group index in 4 big-endian bytes ([`Key::offload`]).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(pub Vec<u8>);

impl Key {
    /// vLLM's key layout: `block_hash` then `group_idx` as 4 big-endian bytes.
    pub fn offload(block_hash: &[u8], group_idx: u32) -> Self {
        let mut bytes = block_hash.to_vec();
        bytes.extend_from_slice(&group_idx.to_be_bytes());
        Key(bytes)
    }

    /// The key of block `id` in group 0, with the id as an 8-byte big-endian hash (the
    /// layout the Mooncake replay uses).
    pub fn block(id: u64) -> Self {
        Self::offload(&id.to_be_bytes(), 0)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", hex::encode(&self.0))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0))
    }
}

impl Serialize for Key {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        hex::decode(&text)
            .map(Key)
            .map_err(|e| serde::de::Error::custom(format!("bad hex key {text:?}: {e}")))
    }
}

/// The primary tier's eviction policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// vLLM's `LRUCachePolicy`.
    Lru,
    /// vLLM's `ARCCachePolicy`.
    Arc,
}

/// `LookupResult` of vLLM 0.33.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LookupResult {
    /// Not offloaded (or, in the tiering manager, the primary tier cannot take a promotion).
    Miss,
    /// Offloaded and ready to load.
    Hit,
    /// Present but not readable yet: a store or a promotion into the primary is in flight.
    HitPending,
    /// A secondary tier cannot answer yet: look up again later.
    Retry,
}

/// `OffloadPolicy` a manager asks for in `on_new_request`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadPolicy {
    /// Offload only newly computed chunks.
    ChunkLevel,
    /// Offload every chunk of the request, prefix hits included.
    RequestLevel,
}

/// Storage medium of a tier (`Medium`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Medium {
    /// Host memory.
    Cpu,
    /// Disks or remote storage.
    Storage,
}

/// Locality of a tier (`Locality`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Locality {
    /// On this node.
    Local,
    /// Elsewhere.
    Remote,
}

/// A `CPUOffloadingManager` to create.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CpuConfig {
    /// Chunks (blocks) of the CPU cache.
    pub num_blocks: u32,
    /// Eviction policy.
    pub policy: Policy,
    /// Collect `OffloadingEvent`s for [`VllmOracle::take_events`].
    pub events: bool,
    /// Store a new key only when offered this many times (vLLM's admission filter; below 2
    /// it is off).
    pub store_threshold: u32,
    /// Keys the admission filter tracks.
    pub max_tracker_size: u32,
}

impl CpuConfig {
    /// `num_blocks` chunks under `policy`, with events on and no admission filter.
    pub fn new(num_blocks: u32, policy: Policy) -> Self {
        CpuConfig {
            num_blocks,
            policy,
            events: true,
            store_threshold: 1,
            max_tracker_size: 64_000,
        }
    }
}

/// A scripted secondary tier of a [`TieringConfig`]: the client decides what it holds and
/// when its jobs finish ([`VllmOracle::tier_finish`] and friends).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ScriptedTier {
    /// The tier's medium (decides the cache-hit source vLLM reports for its hits).
    pub medium: Medium,
    /// The tier's locality (matched by a request's load-tier filter).
    pub locality: Option<Locality>,
    /// Ask for request-level offloading in `on_new_request`.
    pub request_level: bool,
    /// How `drain_jobs` (called by `reset_cache`) finishes the jobs still running.
    pub drain_success: bool,
}

impl ScriptedTier {
    /// A chunk-level storage tier whose drained jobs succeed.
    pub fn storage() -> Self {
        ScriptedTier {
            medium: Medium::Storage,
            locality: None,
            request_level: false,
            drain_success: true,
        }
    }
}

/// A `TieringOffloadingManager` to create: a CPU primary tier and scripted secondary tiers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TieringConfig {
    /// Chunks of the primary tier.
    pub num_blocks: u32,
    /// The primary tier's eviction policy.
    pub policy: Policy,
    /// Collect events.
    pub events: bool,
    /// Bytes per chunk of the primary tier's in-memory region (only the byte counters of
    /// the stats see it).
    pub block_bytes: u32,
    /// The secondary tiers, in order (tier `i` of the `tier_*` methods).
    pub tiers: Vec<ScriptedTier>,
}

impl TieringConfig {
    /// `num_blocks` primary chunks under `policy` over `tiers`, events on, 16-byte chunks.
    pub fn new(num_blocks: u32, policy: Policy, tiers: Vec<ScriptedTier>) -> Self {
        TieringConfig {
            num_blocks,
            policy,
            events: true,
            block_bytes: 16,
            tiers,
        }
    }
}

/// `prepare_store`'s answer when the store can go ahead (`PrepareStoreOutput`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct PreparedStore {
    /// The offered keys that need storing, in offer order.
    pub keys_to_store: Vec<Key>,
    /// The CPU chunk allocated to each of `keys_to_store`.
    pub block_ids: Vec<i64>,
    /// Keys evicted to make room, in eviction order.
    pub evicted_keys: Vec<Key>,
}

/// An `OffloadingEvent`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Event {
    /// The keys stored or removed.
    pub keys: Vec<Key>,
    /// The medium of the tier that owns them.
    pub medium: Medium,
    /// Removed (true) or stored (false).
    pub removed: bool,
    /// The tier's locality, when it has one.
    pub locality: Option<Locality>,
    /// The secondary tier that emitted it; `None` for the primary.
    pub ownership: Option<String>,
    /// A removal the consumer expected (set by some secondary tiers).
    pub removal_expected: bool,
    /// A failed store's metadata was released; no public eviction.
    pub metadata_only: bool,
}

/// The kind of a metric in `OffloadingConnectorStats`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    /// Summed across aggregations.
    Counter,
    /// The latest value.
    Gauge,
    /// A list of observations.
    Histogram,
}

/// A metric's value: a number, or a histogram's observations.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum MetricValue {
    /// A counter or gauge.
    Number(f64),
    /// A histogram's observations since the last `get_stats`.
    Samples(Vec<f64>),
}

/// One series of the stats payload.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Metric {
    /// The metric name, e.g. `vllm:kv_offload_cpu_cache_usage_perc`.
    pub name: String,
    /// Counter, gauge or histogram.
    #[serde(rename = "type")]
    pub kind: MetricKind,
    /// The label values (empty for an unlabelled metric).
    pub labels: Vec<String>,
    /// The value.
    pub value: MetricValue,
}

/// `get_stats`'s payload (`OffloadingConnectorStats`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Stats {
    /// Every (metric, label values) series, sorted by name.
    pub metrics: Vec<Metric>,
    /// The static config facts, when the manager put them on the payload.
    pub info: Option<Vec<BTreeMap<String, Value>>>,
}

impl Stats {
    /// The value of the series `name` with `labels`.
    pub fn get(&self, name: &str, labels: &[&str]) -> Option<&MetricValue> {
        self.metrics
            .iter()
            .find(|m| {
                m.name == name
                    && m.labels
                        .iter()
                        .map(String::as_str)
                        .eq(labels.iter().copied())
            })
            .map(|m| &m.value)
    }
}

/// A block of the primary tier, from [`VllmOracle::inspect`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct BlockState {
    /// Its key.
    pub key: Key,
    /// Its CPU chunk.
    pub block_id: i64,
    /// vLLM's reference count: -1 while its store is in flight, else the loads reading it.
    pub ref_cnt: i32,
}

/// The primary tier's policy state, from [`VllmOracle::inspect`].
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum PolicyState {
    /// `LRUCachePolicy`.
    Lru {
        /// Every block by rank, the next to evict first.
        order: Vec<Key>,
        /// The evictable blocks, in the same order.
        evictable: Vec<Key>,
    },
    /// `ARCCachePolicy`; each list least recent first.
    Arc {
        /// The adaptive target size of T1.
        target_t1_size: f64,
        /// Blocks seen once.
        t1: Vec<Key>,
        /// Blocks reused.
        t2: Vec<Key>,
        /// Ghosts evicted from T1.
        b1: Vec<Key>,
        /// Ghosts evicted from T2.
        b2: Vec<Key>,
    },
}

/// A transfer job between the primary and a secondary tier, from [`VllmOracle::inspect`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct JobState {
    /// vLLM's job id.
    pub job_id: u64,
    /// The secondary tier.
    pub tier: usize,
    /// Secondary to primary (true) or a cascade from the primary (false).
    pub is_promotion: bool,
    /// The keys moved.
    pub keys: Vec<Key>,
    /// The primary chunks read or written.
    pub block_ids: Vec<i64>,
    /// The request it was made for.
    pub req: String,
}

/// A promotion queued for the end of the step, from [`VllmOracle::inspect`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct PendingPromotion {
    /// The secondary tier it reads.
    pub tier: usize,
    /// The request whose lookup started it.
    pub req: String,
    /// The keys.
    pub keys: Vec<Key>,
    /// The primary chunks reserved for them.
    pub block_ids: Vec<i64>,
}

/// The tiering manager's per-request state, from [`VllmOracle::inspect`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TieringRequestState {
    /// GPU-to-primary stores prepared and not completed.
    pub pending_primary_stores: u32,
    /// `on_request_finished` was called.
    pub is_finished: bool,
    /// The tiers that asked for request-level offloading.
    pub request_level_tiers: Option<Vec<usize>>,
    /// Keys waiting for their primary write before a request-level cascade.
    pub pending_cascade_keys: Vec<Key>,
}

/// The tiering manager's own state, from [`VllmOracle::inspect`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TieringState {
    /// Submitted jobs not yet processed, by job id.
    pub jobs: Vec<JobState>,
    /// Promotions reserved in the primary, to be submitted at the end of the step.
    pub pending_promotions: Vec<PendingPromotion>,
    /// The requests it tracks.
    pub requests: BTreeMap<String, TieringRequestState>,
    /// Promotions are held after `reset_cache` until `reset_flushed`.
    pub promotions_held: bool,
}

/// A manager's private state (read from vLLM 0.33's attributes, for differential checks).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ManagerState {
    /// Chunks of the CPU cache.
    pub num_blocks: u32,
    /// Chunks handed out at least once.
    pub allocated: u32,
    /// Freed chunks, reused from the end.
    pub free_list: Vec<i64>,
    /// Blocks that can be evicted (stored and not being read).
    pub evictable: u32,
    /// Blocks whose store is in flight.
    pub write_pending: u32,
    /// Every block, in policy order (LRU: by rank; ARC: T1 then T2).
    pub blocks: Vec<BlockState>,
    /// The policy's own state.
    pub policy: PolicyState,
    /// The tiering manager's state (`None` for a plain CPU manager).
    #[serde(default)]
    pub tiering: Option<TieringState>,
}

/// A job a scripted tier holds until the client finishes it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TierJob {
    /// vLLM's job id.
    pub job_id: u64,
    /// The keys to move.
    pub keys: Vec<Key>,
    /// The primary chunks to read (store) or write (promotion).
    pub block_ids: Vec<i64>,
    /// A promotion (`submit_load`) rather than a cascade (`submit_store`).
    pub is_promotion: bool,
    /// The request it was made for.
    pub req: String,
}

/// A call the manager made into a scripted tier.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum TierCall {
    /// `lookup(key)`.
    Lookup {
        /// The key.
        key: Key,
        /// The request.
        req: String,
    },
    /// `submit_store(job)`.
    SubmitStore {
        /// The job.
        job_id: u64,
    },
    /// `submit_load(job)`.
    SubmitLoad {
        /// The job.
        job_id: u64,
    },
    /// `touch(keys)`.
    Touch {
        /// The keys.
        keys: Vec<Key>,
        /// The request.
        req: String,
    },
    /// `on_new_request`.
    OnNewRequest {
        /// The request.
        req: String,
    },
    /// `on_request_finished`.
    OnRequestFinished {
        /// The request.
        req: String,
    },
    /// `on_schedule_end`.
    OnScheduleEnd,
    /// `drain_jobs`.
    DrainJobs,
}

/// vLLM 0.33.0's offloading managers in a Python subprocess, one request at a time.
///
/// Holds one manager (created by [`create_cpu`](Self::create_cpu) or
/// [`create_tiering`](Self::create_tiering)) and one `ReqContext` per request name, kept
/// from [`new_request`](Self::new_request) until [`drop_request`](Self::drop_request).
pub struct VllmOracle {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<String>>,
    line: String,
}

#[derive(Deserialize)]
struct Ready {
    vllm: String,
}

impl VllmOracle {
    /// For tests: the oracle, or `None` after a loud message on stderr when it is not
    /// installed, except under `CI=true`, where a missing install panics with the setup
    /// message. Any other failure to start panics.
    pub fn spawn_or_skip() -> Option<Self> {
        match Self::spawn() {
            Ok(o) => Some(o),
            Err(e @ OracleError::NotInstalled { .. }) => {
                if std::env::var("CI").as_deref() == Ok("true") {
                    panic!("{e}");
                }
                // Straight to the process's stderr: the test harness captures `eprintln!`.
                let _ = writeln!(io::stderr(), "\n**********\nSKIPPED: {e}\n**********\n");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Starts the oracle from [`install_dir`].
    pub fn spawn() -> Result<Self, OracleError> {
        Self::spawn_in(&install_dir())
    }

    /// Starts the oracle from the install at `dir` (what the setup script printed).
    pub fn spawn_in(dir: &Path) -> Result<Self, OracleError> {
        let python = dir.join("venv").join("bin").join("python");
        if !dir.join(".ready").is_file() || !python.is_file() {
            return Err(OracleError::NotInstalled {
                dir: dir.to_path_buf(),
            });
        }
        let mut child = Command::new(&python)
            .arg(ORACLE_SCRIPT)
            .arg("--vllm-dir")
            .arg(dir)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| OracleError::Spawn {
                program: python.clone(),
                source,
            })?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(
            child
                .stdout
                .take()
                .ok_or_else(|| OracleError::Protocol("no stdout pipe".into()))?,
        );
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let tail = Arc::clone(&stderr);
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                    t.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if t.len() > STDERR_TAIL {
                        let mut cut = t.len() - STDERR_TAIL;
                        while !t.is_char_boundary(cut) {
                            cut += 1;
                        }
                        t.drain(..cut);
                    }
                }
            });
        }
        let mut oracle = VllmOracle {
            child,
            stdin,
            stdout,
            stderr,
            line: String::new(),
        };
        let hello = oracle.read_answer()?;
        if let Some(message) = hello.get("error").and_then(Value::as_str) {
            return Err(OracleError::Exited {
                status: oracle.wait_status(),
                stderr: message.to_string(),
            });
        }
        let ready: Ready = hello
            .get("ready")
            .cloned()
            .ok_or_else(|| OracleError::Protocol(format!("expected a ready line, got {hello}")))
            .and_then(|v| {
                serde_json::from_value(v).map_err(|e| OracleError::Protocol(e.to_string()))
            })?;
        if ready.vllm != VLLM_VERSION {
            return Err(OracleError::Protocol(format!(
                "the oracle runs vLLM {}, not {VLLM_VERSION}",
                ready.vllm
            )));
        }
        Ok(oracle)
    }

    fn stderr_tail(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .trim()
            .to_string()
    }

    fn wait_status(&mut self) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.code(),
                Ok(None) => thread::sleep(Duration::from_millis(10)),
                Err(_) => return None,
            }
        }
        None
    }

    fn exited(&mut self) -> OracleError {
        let status = self.wait_status();
        // Give the stderr reader a moment to collect the traceback.
        thread::sleep(Duration::from_millis(50));
        OracleError::Exited {
            status,
            stderr: self.stderr_tail(),
        }
    }

    fn read_answer(&mut self) -> Result<Value, OracleError> {
        self.line.clear();
        let n = self.stdout.read_line(&mut self.line)?;
        if n == 0 {
            return Err(self.exited());
        }
        serde_json::from_str(&self.line).map_err(|e| {
            OracleError::Protocol(format!("bad answer {:?}: {e}", self.line.trim_end()))
        })
    }

    /// Sends one request (`fields` plus `"op": op`) and returns the raw `result`. The typed
    /// methods are built on it; it also reaches ops they do not cover.
    pub fn call_raw(&mut self, op: &str, fields: Value) -> Result<Value, OracleError> {
        let mut request = match fields {
            Value::Object(map) => map,
            Value::Null => serde_json::Map::new(),
            other => {
                return Err(OracleError::Protocol(format!(
                    "request fields must be an object, got {other}"
                )));
            }
        };
        request.insert("op".into(), Value::String(op.into()));
        let mut text =
            serde_json::to_string(&request).map_err(|e| OracleError::Protocol(e.to_string()))?;
        text.push('\n');
        let write = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(text.as_bytes())
                .and_then(|()| stdin.flush()),
            None => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the oracle was shut down",
            )),
        };
        if let Err(e) = write {
            return Err(if e.kind() == io::ErrorKind::BrokenPipe {
                self.exited()
            } else {
                e.into()
            });
        }
        let mut answer = self.read_answer()?;
        if let Some(message) = answer.get("error").and_then(Value::as_str) {
            let kind = answer
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("Error")
                .to_string();
            return Err(OracleError::Refused {
                op: op.into(),
                kind,
                message: message.into(),
            });
        }
        match answer.get_mut("result") {
            Some(result) => Ok(result.take()),
            None => Err(OracleError::Protocol(format!(
                "answer to {op} has no result: {answer}"
            ))),
        }
    }

    fn call<T: DeserializeOwned>(&mut self, op: &str, fields: Value) -> Result<T, OracleError> {
        let result = self.call_raw(op, fields)?;
        serde_json::from_value(result.clone()).map_err(|e| {
            OracleError::Protocol(format!("answer to {op} ({result}) does not fit: {e}"))
        })
    }

    fn call_unit(&mut self, op: &str, fields: Value) -> Result<(), OracleError> {
        match self.call_raw(op, fields)? {
            Value::Null => Ok(()),
            other => Err(OracleError::Protocol(format!(
                "answer to {op} should be null, got {other}"
            ))),
        }
    }

    /// Creates a `CPUOffloadingManager`, dropping the previous manager and every request.
    pub fn create_cpu(&mut self, config: &CpuConfig) -> Result<(), OracleError> {
        self.call_unit("create_cpu", to_fields(config)?)
    }

    /// Creates a `TieringOffloadingManager` over a CPU primary tier and scripted tiers,
    /// dropping the previous manager and every request.
    pub fn create_tiering(&mut self, config: &TieringConfig) -> Result<(), OracleError> {
        self.call_unit("create_tiering", to_fields(config)?)
    }

    /// `on_new_request` for a new request context named `req`.
    pub fn new_request(&mut self, req: &str) -> Result<OffloadPolicy, OracleError> {
        self.call("new_request", json!({ "req": req }))
    }

    /// `on_new_request` with the request's `kv_transfer_params` and a load-tier filter
    /// (`(medium, locality)` matchers; `None` in a matcher matches anything).
    pub fn new_request_with(
        &mut self,
        req: &str,
        kv_transfer_params: Option<Value>,
        load_tiers: Option<&[(Option<Medium>, Option<Locality>)]>,
    ) -> Result<OffloadPolicy, OracleError> {
        let load_tiers = load_tiers.map(|ms| {
            ms.iter()
                .map(|(medium, locality)| json!({ "medium": medium, "locality": locality }))
                .collect::<Vec<_>>()
        });
        self.call(
            "new_request",
            json!({ "req": req, "kv_transfer_params": kv_transfer_params, "load_tiers": load_tiers }),
        )
    }

    /// Records each key's end-token position in the request context (vLLM's scheduler does
    /// so as soon as a block hash exists; the policies order a request's keys by it).
    pub fn set_positions(
        &mut self,
        req: &str,
        positions: &[(Key, u64)],
    ) -> Result<(), OracleError> {
        let positions: Vec<Value> = positions.iter().map(|(k, p)| json!([k, p])).collect();
        self.call_unit(
            "set_positions",
            json!({ "req": req, "positions": positions }),
        )
    }

    /// `lookup(key)`.
    pub fn lookup(&mut self, req: &str, key: &Key) -> Result<LookupResult, OracleError> {
        self.call("lookup", json!({ "req": req, "key": key }))
    }

    /// One `lookup` per key in order, stopping after the first MISS when `until_miss` (as
    /// the scheduler's prefix lookup does).
    pub fn lookup_many(
        &mut self,
        req: &str,
        keys: &[Key],
        until_miss: bool,
    ) -> Result<Vec<LookupResult>, OracleError> {
        self.call(
            "lookup_many",
            json!({ "req": req, "keys": keys, "until_miss": until_miss }),
        )
    }

    /// `get_load_source(key)`: the tier a hit came from (`host`, `disk`, `p2p`, ...).
    pub fn get_load_source(&mut self, req: &str, key: &Key) -> Result<String, OracleError> {
        self.call("get_load_source", json!({ "req": req, "key": key }))
    }

    /// `prepare_load(keys)`: the CPU chunks to read, in key order.
    pub fn prepare_load(&mut self, req: &str, keys: &[Key]) -> Result<Vec<i64>, OracleError> {
        #[derive(Deserialize)]
        struct Spec {
            block_ids: Vec<i64>,
        }
        let spec: Spec = self.call("prepare_load", json!({ "req": req, "keys": keys }))?;
        Ok(spec.block_ids)
    }

    /// `touch(keys)`.
    pub fn touch(&mut self, req: &str, keys: &[Key]) -> Result<(), OracleError> {
        self.call_unit("touch", json!({ "req": req, "keys": keys }))
    }

    /// `complete_load(keys)`.
    pub fn complete_load(&mut self, req: &str, keys: &[Key]) -> Result<(), OracleError> {
        self.call_unit("complete_load", json!({ "req": req, "keys": keys }))
    }

    /// `prepare_store(keys)`: `None` when not enough blocks can be evicted.
    pub fn prepare_store(
        &mut self,
        req: &str,
        keys: &[Key],
    ) -> Result<Option<PreparedStore>, OracleError> {
        self.call("prepare_store", json!({ "req": req, "keys": keys }))
    }

    /// `complete_store(keys, success)`.
    pub fn complete_store(
        &mut self,
        req: &str,
        keys: &[Key],
        success: bool,
    ) -> Result<(), OracleError> {
        self.call_unit(
            "complete_store",
            json!({ "req": req, "keys": keys, "success": success }),
        )
    }

    /// `on_request_finished` (the context is kept for completions that arrive later).
    pub fn request_finished(&mut self, req: &str) -> Result<(), OracleError> {
        self.call_unit("request_finished", json!({ "req": req }))
    }

    /// Forgets the request context (the oracle's bookkeeping only; no manager call).
    pub fn drop_request(&mut self, req: &str) -> Result<(), OracleError> {
        self.call_unit("drop_request", json!({ "req": req }))
    }

    /// `on_schedule_end(ScheduleEndContext(new_req_ids, preempted_req_ids))`.
    pub fn schedule_end(
        &mut self,
        new_req_ids: &[&str],
        preempted_req_ids: &[&str],
    ) -> Result<(), OracleError> {
        self.call_unit(
            "schedule_end",
            json!({ "new_req_ids": new_req_ids, "preempted_req_ids": preempted_req_ids }),
        )
    }

    /// `take_events()`, drained.
    pub fn take_events(&mut self) -> Result<Vec<Event>, OracleError> {
        self.call("take_events", Value::Null)
    }

    /// `get_stats()` (resets the per-interval parts, as in vLLM).
    pub fn get_stats(&mut self) -> Result<Option<Stats>, OracleError> {
        self.call("get_stats", Value::Null)
    }

    /// `has_pending_work()`.
    pub fn has_pending_work(&mut self) -> Result<bool, OracleError> {
        self.call("has_pending_work", Value::Null)
    }

    /// `reset_cache()`.
    pub fn reset_cache(&mut self) -> Result<(), OracleError> {
        self.call_unit("reset_cache", Value::Null)
    }

    /// `on_reset_flushed()`.
    pub fn reset_flushed(&mut self) -> Result<(), OracleError> {
        self.call_unit("reset_flushed", Value::Null)
    }

    /// `config_info()`: one label map per series.
    pub fn config_info(&mut self) -> Result<Vec<BTreeMap<String, Value>>, OracleError> {
        self.call("config_info", Value::Null)
    }

    /// The manager's private state (introspection of vLLM 0.33's attributes).
    pub fn inspect(&mut self) -> Result<ManagerState, OracleError> {
        self.call("inspect", Value::Null)
    }

    /// `shutdown()`; the oracle then has no manager until the next `create_*`.
    pub fn shutdown(&mut self) -> Result<(), OracleError> {
        self.call_unit("shutdown", Value::Null)
    }

    /// The jobs scripted tier `tier` holds (submitted, not finished), oldest first.
    pub fn tier_jobs(&mut self, tier: usize) -> Result<Vec<TierJob>, OracleError> {
        self.call("tier_jobs", json!({ "tier": tier }))
    }

    /// Finishes a job of scripted tier `tier`: its result reaches the manager at the
    /// manager's next poll. `successful_keys` reports a partly failed promotion.
    pub fn tier_finish(
        &mut self,
        tier: usize,
        job_id: u64,
        success: bool,
        successful_keys: Option<&[Key]>,
    ) -> Result<(), OracleError> {
        self.call_unit(
            "tier_finish",
            json!({ "tier": tier, "job_id": job_id, "success": success, "successful_keys": successful_keys }),
        )
    }

    /// Puts keys into scripted tier `tier`.
    pub fn tier_put(&mut self, tier: usize, keys: &[Key]) -> Result<(), OracleError> {
        self.call_unit("tier_put", json!({ "tier": tier, "keys": keys }))
    }

    /// Removes keys from scripted tier `tier`.
    pub fn tier_remove(&mut self, tier: usize, keys: &[Key]) -> Result<(), OracleError> {
        self.call_unit("tier_remove", json!({ "tier": tier, "keys": keys }))
    }

    /// Makes scripted tier `tier` answer RETRY (or stop doing so) for these keys.
    pub fn tier_retry(
        &mut self,
        tier: usize,
        keys: &[Key],
        retry: bool,
    ) -> Result<(), OracleError> {
        self.call_unit(
            "tier_retry",
            json!({ "tier": tier, "keys": keys, "retry": retry }),
        )
    }

    /// The keys scripted tier `tier` holds, in insertion order.
    pub fn tier_keys(&mut self, tier: usize) -> Result<Vec<Key>, OracleError> {
        self.call("tier_keys", json!({ "tier": tier }))
    }

    /// The calls the manager made into scripted tier `tier` since the last `tier_calls`.
    pub fn tier_calls(&mut self, tier: usize) -> Result<Vec<TierCall>, OracleError> {
        self.call("tier_calls", json!({ "tier": tier }))
    }
}

impl Drop for VllmOracle {
    fn drop(&mut self) {
        // End of input ends the oracle; kill it only if it does not go.
        drop(self.stdin.take());
        if self.wait_status().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn to_fields<T: Serialize>(value: &T) -> Result<Value, OracleError> {
    serde_json::to_value(value).map_err(|e| OracleError::Protocol(e.to_string()))
}
