//! The scheduler side: vLLM 0.33's `OffloadingManager` calls on a [`Driver`] whose GPU ↔ CPU
//! copies are done by the engine's workers.
//!
//! The driver and its core sit behind one mutex. A call that may wait (for the secondary
//! tiers' IO: `reset_cache`, `shutdown`) waits with the GIL released; every other call is
//! short and takes the mutex without giving up the GIL unless another thread holds it.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyType};

use kvtier_core::{
    BlockState, Config, Error as CoreError, EventKind, Key, Lookup, Medium, PolicyKind, RequestId,
    ReuseFilter, TierKind,
};
use kvtier_hw::bench::{
    FileTier, STORE_KINDS, SharedStore, check_store_keys, tier_config, victim_lookahead,
};
use kvtier_hw::{
    Driver, DriverOptions, FileOptions, FileStore, FsyncPolicy, Layout, Region, SecondaryStore,
    StoreError,
};

use crate::errors;

/// Slot ids as packed native-endian `int32`s (numpy reads them without a Python list).
fn packed_slots<'py>(py: Python<'py>, slots: &[kvtier_core::SlotId]) -> Bound<'py, PyBytes> {
    let mut b = Vec::with_capacity(slots.len() * 4);
    for s in slots {
        b.extend_from_slice(&(s.0 as i32).to_ne_bytes());
    }
    PyBytes::new(py, &b)
}

/// The Python classes of the answers built here, and `object.__new__`.
struct Classes {
    output: Py<PyType>,
    spec: Py<PyType>,
    request: Py<PyType>,
    chunk_level: Py<PyAny>,
    new: Py<PyAny>,
}

impl Classes {
    fn new(
        py: Python<'_>,
        output: Bound<'_, PyType>,
        spec: Bound<'_, PyType>,
        request: Bound<'_, PyType>,
        chunk_level: Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(Classes {
            output: output.unbind(),
            spec: spec.unbind(),
            request: request.unbind(),
            chunk_level: chunk_level.unbind(),
            new: py
                .get_type::<pyo3::types::PyAny>()
                .getattr(intern!(py, "__new__"))?
                .unbind(),
        })
    }

    /// A new instance of `cls` with `attrs` set, as its dataclass `__init__` would set them
    /// (`object.__new__`, then the attributes: no Python frame runs).
    fn make<'py>(
        &self,
        py: Python<'py>,
        cls: &Py<PyType>,
        attrs: &[(&Bound<'py, PyString>, Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.new.bind(py).call1((cls.bind(py),))?;
        for (name, value) in attrs {
            obj.setattr(*name, value)?;
        }
        Ok(obj)
    }

    /// The spec of `slots` (packed, see `kvtier.vllm.KvtierLoadStoreSpec`) and a store's
    /// seal value.
    fn spec<'py>(
        &self,
        py: Python<'py>,
        slots: &[kvtier_core::SlotId],
        generation: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let packed = packed_slots(py, slots).into_any();
        let generation = generation.into_pyobject(py)?.into_any();
        self.make(
            py,
            &self.spec,
            &[
                (intern!(py, "_packed"), packed),
                (intern!(py, "generation"), generation),
            ],
        )
    }

    /// vLLM's `RequestOffloadingContext(policy=OffloadPolicy.CHUNK_LEVEL)`.
    fn request<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let policy = self.chunk_level.bind(py).clone();
        self.make(py, &self.request, &[(intern!(py, "policy"), policy)])
    }

    /// vLLM's `PrepareStoreOutput(keys_to_store, store_spec, evicted_keys)`.
    fn output<'py>(
        &self,
        py: Python<'py>,
        keys: Bound<'py, PyList>,
        spec: Bound<'py, PyAny>,
        evicted: Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.make(
            py,
            &self.output,
            &[
                (intern!(py, "keys_to_store"), keys.into_any()),
                (intern!(py, "store_spec"), spec),
                (intern!(py, "evicted_keys"), evicted.into_any()),
            ],
        )
    }
}

/// One event: the tier (-1 for the primary), the kind (0 stored, 1 removed, 2 discarded) and
/// the keys.
type EventTuple<'py> = (i32, u8, Vec<Bound<'py, PyBytes>>);

/// A secondary tier's settings, as `kvtier.vllm` passes them.
pub(crate) struct TierSettings {
    pub(crate) capacity_bytes: u64,
    pub(crate) policy: PolicyKind,
    /// `Some(n)`: a victim tier writing the primary's next `n` victims ahead (V1–V4).
    pub(crate) victim_lookahead: Option<u32>,
    pub(crate) store: StoreSettings,
}

/// What the tier stores its blocks in.
pub(crate) enum StoreSettings {
    /// A local, persistent file tier.
    File { path: PathBuf, fsync: FsyncPolicy },
    /// A tier shared by many nodes (Redis, S3); the identity is the manager's.
    Shared(SharedStore),
}

impl TierSettings {
    /// The kind of its store, as the configuration's `type` names it.
    pub(crate) fn kind(&self) -> &'static str {
        match &self.store {
            StoreSettings::File { .. } => "file",
            StoreSettings::Shared(s) => s.kind(),
        }
    }

    /// Opens tier `i`'s store for rows of `row` bytes, its blocks named by `identity`; the
    /// tier's kind for the core. Blocking: call it with the GIL released.
    pub(crate) fn open(
        &self,
        i: usize,
        identity: &str,
        row: usize,
    ) -> PyResult<(Arc<dyn SecondaryStore>, TierKind)> {
        match &self.store {
            StoreSettings::File { path, fsync } => {
                FileStore::capacity_for(row, self.capacity_bytes).map_err(|e| {
                    errors::config(&format!("secondary_tiers[{i}].capacity_bytes"), e)
                })?;
                std::fs::create_dir_all(path)
                    .map_err(|e| errors::TierError::new_err(format!("{}: {e}", path.display())))?;
                let options = FileOptions {
                    identity: identity.into(),
                    fsync: *fsync,
                    ..FileOptions::default()
                };
                let store = FileStore::open_with(path, row, self.capacity_bytes, options)
                    .map_err(errors::store)?;
                Ok((Arc::new(store), TierKind::Authoritative))
            }
            StoreSettings::Shared(s) => {
                let store = s
                    .open(identity, row, self.capacity_bytes)
                    .map_err(|e| match e {
                        StoreError::BadInput(why) => {
                            errors::config(&format!("secondary_tiers[{i}]"), why)
                        }
                        e => errors::store(e),
                    })?;
                Ok((Arc::new(store), TierKind::Shared))
            }
        }
    }
}

struct Inner {
    driver: Option<Driver>,
    /// vLLM's request ids (strings) to the core's.
    requests: HashMap<String, RequestId>,
    next_request: u64,
    /// Keys each request was answered HitPending for by a promotion (their load source is a
    /// secondary tier).
    promoted: HashMap<RequestId, HashSet<Key>>,
    keys: Vec<Key>,
    shutdown_timeout: Duration,
    /// Per slot, the key object its block was stored with (to answer evictions with it).
    objects: Vec<Option<Py<PyAny>>>,
    /// Per slot, the seal its last store's workers must set (see `complete_store`).
    sealed_with: Vec<u64>,
    /// The last seal value handed out (one per `prepare_store`).
    generation: u64,
    /// Whether `complete_store(success=True)` checks the workers' seals.
    verify: bool,
    /// Blocks of stores reported complete that a worker had not sealed, since the start.
    unsealed: u64,
    /// Ranks writing each slot.
    workers: u16,
    /// Whether there are secondary tiers (a lookup may start a promotion).
    tiers: bool,
    /// Keys a request named before vLLM recorded their positions: read again, through the
    /// request context's public accessor, when the request finishes.
    unpositioned: HashMap<RequestId, HashSet<Key>>,
    /// Scheduler steps left before a cache reset's fence ends without `on_reset_flushed`
    /// (for a vLLM that never calls it; see `reset_cache`).
    fence_steps: Option<u32>,
    /// The request context of the last call and its id: consecutive calls for one request
    /// (a lookup per block) skip reading and hashing its `req_id`. Holding the object keeps
    /// its address from being reused.
    last: Option<(Py<PyAny>, RequestId)>,
}

/// The driver, or the error of a manager that has shut down.
fn live(driver: &mut Option<Driver>) -> PyResult<&mut Driver> {
    driver
        .as_mut()
        .ok_or_else(|| errors::KvtierError::new_err("the manager has shut down"))
}

impl Inner {
    fn driver(&mut self) -> PyResult<&mut Driver> {
        live(&mut self.driver)
    }

    /// For a call that stores or loads `items`: their keys into `keys`, and the positions the
    /// request has for them given to the core (vLLM's policies read a key's position when
    /// the request stores or loads it). Answers the request's id.
    fn begin(
        &mut self,
        keys: &mut Vec<Key>,
        ctx: &Bound<'_, PyAny>,
        items: &[Bound<'_, PyAny>],
        positions: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<RequestId> {
        keys.clear();
        for item in items {
            keys.push(key_of(item)?);
        }
        let req = self.request_of(ctx)?;
        let driver = live(&mut self.driver)?;
        let mut missing = Vec::new();
        let positions = positions.filter(|_| !kvtier_core::mutant::active("no_store_positions"));
        for (item, key) in items.iter().zip(keys.iter()) {
            match position_of(positions, item)? {
                Some(end) => driver.set_position(req, key, end),
                None => missing.push(key.clone()),
            }
        }
        if !missing.is_empty() {
            self.unpositioned.entry(req).or_default().extend(missing);
        }
        Ok(req)
    }

    /// The core's id of the request of `ctx` (vLLM's `ReqContext`).
    fn request_of(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<RequestId> {
        if let Some((last, id)) = &self.last
            && last.as_ptr() == ctx.as_ptr()
        {
            return Ok(*id);
        }
        let id = self.request(req_id(ctx)?.to_str()?);
        self.last = Some((ctx.clone().unbind(), id));
        Ok(id)
    }

    /// The core's id of vLLM's request `req_id`, made at its first mention.
    fn request(&mut self, req_id: &str) -> RequestId {
        if let Some(&id) = self.requests.get(req_id) {
            return id;
        }
        let id = RequestId(self.next_request);
        self.next_request += 1;
        self.requests.insert(req_id.to_owned(), id);
        id
    }
}

/// The scheduler-side manager: the core, the shared region it owns, and the secondary tiers'
/// IO threads.
#[pyclass(module = "kvtier._native", frozen)]
pub(crate) struct Manager {
    inner: Mutex<Inner>,
    /// What `lookup` answers: the caller's Miss, Hit, HitPending and Retry objects.
    answers: [Py<PyAny>; 4],
    /// The classes of `prepare_store`'s answer and of a load or store spec (vLLM's
    /// `PrepareStoreOutput` and kvtier's spec), made here without a Python frame.
    classes: Classes,
    region_path: PathBuf,
    num_blocks: u32,
    row_bytes: usize,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panic inside a call is a bug; the state it left is still the core's last checked one.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn parse_policy(key: &str, name: &str) -> PyResult<PolicyKind> {
    match name {
        "lru" => Ok(PolicyKind::Lru),
        "arc" => Ok(PolicyKind::Arc),
        "reuse" => Ok(PolicyKind::Reuse),
        other => Err(errors::config(
            key,
            format!(
                "unknown eviction policy {other:?} (kvtier has \"lru\", \"arc\" and \"reuse\")"
            ),
        )),
    }
}

fn parse_fsync(key: &str, name: &str) -> PyResult<FsyncPolicy> {
    name.parse().map_err(|e: String| errors::config(key, e))
}

pub(crate) fn tier_settings(i: usize, d: &Bound<'_, PyDict>) -> PyResult<TierSettings> {
    let name = |k: &str| format!("secondary_tiers[{i}].{k}");
    let get = |k: &str| d.get_item(k);
    /// A required or optional value of type `T`, with an error naming the key. `None` (JSON's
    /// `null`) is absent, as in the bench's configuration file; a bool is not a number
    /// (Python's `True` is an int).
    fn value<'py, T: FromPyObjectOwned<'py>>(
        v: Option<Bound<'py, PyAny>>,
        key: &str,
        what: &str,
    ) -> PyResult<Option<T>> {
        v.filter(|v| !v.is_none())
            .map(|v| {
                let bool_for_number = v.is_instance_of::<PyBool>() && what != "true or false";
                if bool_for_number {
                    return Err(errors::config(key, format!("not {what}")));
                }
                v.extract()
                    .map_err(|_| errors::config(key, format!("not {what}")))
            })
            .transpose()
    }
    let kinds: Vec<String> = STORE_KINDS.iter().map(|(k, _)| format!("{k:?}")).collect();
    let kind: String = value(get("type")?, &name("type"), "a string")?
        .ok_or_else(|| errors::config(&name("type"), format!("missing ({})", kinds.join(", "))))?;
    // One table of store kinds and their keys, the bench's configuration file's.
    // Keys set to `None` are absent, as above.
    let mut keys: Vec<String> = Vec::new();
    for (k, v) in d.iter() {
        if !v.is_none() {
            keys.push(k.extract()?);
        }
    }
    check_store_keys(
        &kind,
        keys.iter().map(String::as_str).filter(|k| {
            ![
                "type",
                "capacity_bytes",
                "eviction_policy",
                "victim_lookahead",
            ]
            .contains(k)
        }),
        &name,
    )
    .map_err(errors::config_error)?;
    let capacity_bytes: u64 = value(
        get("capacity_bytes")?,
        &name("capacity_bytes"),
        "a positive integer",
    )?
    .ok_or_else(|| errors::config(&name("capacity_bytes"), "missing"))?;
    let policy = match value::<String>(
        get("eviction_policy")?,
        &name("eviction_policy"),
        "a string",
    )? {
        Some(v) => parse_policy(&name("eviction_policy"), &v)?,
        None => PolicyKind::Lru,
    };
    let store = if kind == "file" {
        let path: PathBuf = value(get("path")?, &name("path"), "a path")?
            .ok_or_else(|| errors::config(&name("path"), "missing"))?;
        let fsync = match value::<String>(get("fsync")?, &name("fsync"), "a string")? {
            Some(v) => parse_fsync(&name("fsync"), &v)?,
            None => FsyncPolicy::default(),
        };
        StoreSettings::File { path, fsync }
    } else {
        // The same keys and checks as the bench's configuration file.
        let keys = FileTier {
            kind: kind.clone(),
            capacity_bytes,
            eviction_policy: None,
            victim_lookahead: None,
            path: None,
            fsync: None,
            urls: value(get("urls")?, &name("urls"), "a list of URLs")?,
            cluster: value(get("cluster")?, &name("cluster"), "true or false")?,
            namespace: value(get("namespace")?, &name("namespace"), "a string")?,
            timeout_ms: value(
                get("timeout_ms")?,
                &name("timeout_ms"),
                "a number of milliseconds",
            )?,
            ttl_s: value(get("ttl_s")?, &name("ttl_s"), "a number of seconds")?,
            username_env: value(
                get("username_env")?,
                &name("username_env"),
                "a variable name",
            )?,
            password_env: value(
                get("password_env")?,
                &name("password_env"),
                "a variable name",
            )?,
            tls: value(get("tls")?, &name("tls"), "true or false")?,
            tls_ca_file: value(get("tls_ca_file")?, &name("tls_ca_file"), "a path")?,
            endpoint: value(get("endpoint")?, &name("endpoint"), "a URL")?,
            bucket: value(get("bucket")?, &name("bucket"), "a string")?,
            prefix: value(get("prefix")?, &name("prefix"), "a string")?,
            region: value(get("region")?, &name("region"), "a string")?,
            access_key_id_env: value(
                get("access_key_id_env")?,
                &name("access_key_id_env"),
                "a variable name",
            )?,
            secret_access_key_env: value(
                get("secret_access_key_env")?,
                &name("secret_access_key_env"),
                "a variable name",
            )?,
            session_token_env: value(
                get("session_token_env")?,
                &name("session_token_env"),
                "a variable name",
            )?,
            virtual_hosted: value(
                get("virtual_hosted")?,
                &name("virtual_hosted"),
                "true or false",
            )?,
            retries: value(get("retries")?, &name("retries"), "a number")?,
            conditional_put: value(
                get("conditional_put")?,
                &name("conditional_put"),
                "true or false",
            )?,
        };
        let env = |v: &str| std::env::var(v).ok();
        let shared = if kind == "s3" {
            SharedStore::S3(keys.s3_options(&name, &env).map_err(errors::config_error)?)
        } else {
            SharedStore::Redis(
                keys.redis_options(&name, &env)
                    .map_err(errors::config_error)?,
            )
        };
        StoreSettings::Shared(shared)
    };
    let lookahead = value(
        get("victim_lookahead")?,
        &name("victim_lookahead"),
        "a number of blocks",
    )?;
    let victim_lookahead =
        victim_lookahead(&name("victim_lookahead"), lookahead).map_err(errors::config_error)?;
    Ok(TierSettings {
        capacity_bytes,
        policy,
        victim_lookahead,
        store,
    })
}

/// Opens the secondary tiers of `settings` for blocks named by `identity` into `config`,
/// creates the region at `path` and starts a scheduler driver over both. `threads` are the
/// region's prefault threads and each tier's IO threads. Blocking: call it with the GIL
/// released.
pub(crate) fn open_driver(
    mut config: Config,
    settings: &[TierSettings],
    identity: &str,
    path: &std::path::Path,
    layout: Layout,
    (prefault_threads, io_threads): (usize, usize),
    shutdown_timeout: Duration,
) -> PyResult<Driver> {
    let mut stores: Vec<Arc<dyn SecondaryStore>> = Vec::new();
    for (i, t) in settings.iter().enumerate() {
        let (store, kind) = t.open(i, identity, layout.row_bytes())?;
        config.tiers.push(tier_config(
            kind,
            store.capacity_blocks(),
            t.policy,
            t.victim_lookahead,
        ));
        stores.push(store);
    }
    config
        .validate()
        .map_err(|e| errors::config_error(e.to_string()))?;
    let region = Region::create(path, layout, prefault_threads.max(1)).map_err(errors::region)?;
    let options = DriverOptions {
        io_threads_per_tier: io_threads.max(1),
        shutdown_timeout,
        ..DriverOptions::default()
    };
    Driver::scheduler(config, Arc::new(region), stores, options).map_err(errors::hw)
}

/// The core's counters, and per tier its blocks, reads and health, as a dict (the `stats`
/// of the Python classes, which add their own).
pub(crate) fn core_stats<'py>(
    py: Python<'py>,
    s: &kvtier_core::Stats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("lookups", s.lookups)?;
    d.set_item("hits", s.hits)?;
    d.set_item("hits_pending", s.hits_pending)?;
    d.set_item("wait_timeouts", s.wait_timeouts)?;
    d.set_item("misses", s.misses)?;
    d.set_item("retries", s.retries)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("evictions_past_horizon", s.evictions_past_horizon)?;
    d.set_item("promotions_started", s.promotions_started)?;
    d.set_item("promotions_refused", s.promotions_refused)?;
    d.set_item("promotions_failed", s.promotions_failed)?;
    d.set_item("promotions_missing", s.promotions_missing)?;
    d.set_item("load_pins", s.load_pins)?;
    d.set_item("job_pins", s.job_pins)?;
    d.set_item("jobs_outstanding", s.jobs_outstanding)?;
    d.set_item("step", s.step)?;
    let tiers = PyList::empty(py);
    for (health, t) in &s.tiers {
        let td = PyDict::new(py);
        td.set_item("blocks", t.blocks)?;
        td.set_item("hits", t.hits)?;
        td.set_item("blocks_cascaded", t.blocks_cascaded)?;
        td.set_item("evictions", t.evictions)?;
        td.set_item("jobs_failed", t.jobs_failed)?;
        td.set_item("read_failures", t.read_failures)?;
        td.set_item("read_missing", t.read_missing)?;
        td.set_item("victims_missed", t.victims_missed)?;
        td.set_item("probes", t.probes)?;
        td.set_item("health", format!("{health:?}"))?;
        tiers.append(td)?;
    }
    d.set_item("tiers", tiers)?;
    Ok(d)
}

/// The keys of an iterable of `bytes`, into `out`.
pub(crate) fn keys_into(keys: &Bound<'_, PyAny>, out: &mut Vec<Key>) -> PyResult<()> {
    out.clear();
    if let Ok(list) = keys.cast::<PyList>() {
        out.reserve(list.len());
        for k in list.iter() {
            out.push(key_of(&k)?);
        }
        return Ok(());
    }
    for k in keys.try_iter()? {
        out.push(key_of(&k?)?);
    }
    Ok(())
}

pub(crate) fn key_of(k: &Bound<'_, PyAny>) -> PyResult<Key> {
    match k.cast::<PyBytes>() {
        Ok(b) => Ok(Key::new(b.as_bytes())),
        Err(_) => Err(PyTypeError::new_err(format!(
            "a key must be bytes (vLLM's OffloadKey), not {}",
            k.get_type().name()?
        ))),
    }
}

/// The request context's public accessor of key positions (`get_offload_key_position`),
/// if it has one (a context of vLLM's; kvtier's spec refuses a vLLM whose context lacks it).
fn positions<'py>(ctx: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    ctx.getattr(intern!(ctx.py(), "get_offload_key_position"))
        .ok()
}

/// The position vLLM recorded for key `item` (the end token of its block), if any.
fn position_of(
    accessor: Option<&Bound<'_, PyAny>>,
    item: &Bound<'_, PyAny>,
) -> PyResult<Option<u64>> {
    let Some(get) = accessor else {
        return Ok(None);
    };
    let v = get.call1((item,))?;
    if v.is_none() {
        return Ok(None);
    }
    Ok(v.extract::<u64>().ok())
}

fn items<'py>(keys: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    match keys.cast::<PyList>() {
        Ok(l) => Ok(l.iter().collect()),
        Err(_) => keys.try_iter()?.collect(),
    }
}

fn req_id<'py>(ctx: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let id = ctx.getattr(intern!(ctx.py(), "req_id"))?;
    id.cast_into::<PyString>()
        .map_err(|_| PyTypeError::new_err("req_context.req_id must be a string"))
}

#[pymethods]
impl Manager {
    /// Creates the shared region `region_path` names (owned by this manager: `@NAME` for an
    /// anonymous region, any other path for a file) and opens the secondary tiers (blocks
    /// found on disk are restored).
    #[new]
    #[pyo3(signature = (*, num_blocks, policy, region_path, block_bytes_per_worker, workers,
        answers, output_class, spec_class, request_class, chunk_level, tiers = Vec::new(), events = true, store_threshold = 0,
        max_tracker_size = 64_000, identity = String::new(), io_threads = 4,
        shutdown_timeout_s = 30.0, prefault_threads = 4, verify_stores = false,
        hit_pending_timeout_s = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: u32,
        policy: &str,
        region_path: PathBuf,
        block_bytes_per_worker: usize,
        workers: u16,
        answers: [Py<PyAny>; 4],
        output_class: Bound<'_, PyType>,
        spec_class: Bound<'_, PyType>,
        request_class: Bound<'_, PyType>,
        chunk_level: Bound<'_, PyAny>,
        tiers: Vec<Bound<'_, PyDict>>,
        events: bool,
        store_threshold: u32,
        max_tracker_size: u32,
        identity: String,
        io_threads: usize,
        shutdown_timeout_s: f64,
        prefault_threads: usize,
        verify_stores: bool,
        hit_pending_timeout_s: Option<f64>,
    ) -> PyResult<Self> {
        let mut config = Config::new(num_blocks);
        // ★9: the driver's clock counts milliseconds; a deadline is at least one.
        config.wait_deadline = match hit_pending_timeout_s {
            None => None,
            Some(s) if s > 0.0 && s.is_finite() => Some(((s * 1e3 - 1e-6).ceil() as u64).max(1)),
            Some(s) => {
                return Err(errors::config(
                    "hit_pending_timeout_s",
                    format!("{s} is not a positive number of seconds (null: no deadline)"),
                ));
            }
        };
        config.policy = parse_policy("eviction_policy", policy)?;
        config.events = events;
        if store_threshold >= 2 {
            config.reuse = Some(ReuseFilter {
                store_threshold,
                max_tracker_size,
            });
        }
        let shutdown_timeout = Duration::try_from_secs_f64(shutdown_timeout_s).map_err(|_| {
            errors::config(
                "shutdown_timeout_s",
                "must be a non-negative number of seconds that a clock can hold",
            )
        })?;
        let layout = Layout::new(num_blocks, workers, block_bytes_per_worker)
            .map_err(|e| errors::config("cpu_bytes_to_use", e))?;
        let settings = tiers
            .iter()
            .enumerate()
            .map(|(i, d)| tier_settings(i, d))
            .collect::<PyResult<Vec<_>>>()?;
        let row = layout.row_bytes();
        let path = region_path.clone();
        let build = move || {
            let threads = (prefault_threads, io_threads);
            open_driver(
                config,
                &settings,
                &identity,
                &path,
                layout,
                threads,
                shutdown_timeout,
            )
        };
        // Opening tiers and faulting the region in may take a while: let other threads run.
        let driver = py.detach(build)?;
        Ok(Manager {
            inner: Mutex::new(Inner {
                driver: Some(driver),
                requests: HashMap::new(),
                next_request: 0,
                promoted: HashMap::new(),
                keys: Vec::new(),
                shutdown_timeout,
                last: None,
                unpositioned: HashMap::new(),
                fence_steps: None,
                objects: (0..num_blocks).map(|_| None).collect(),
                sealed_with: vec![0; num_blocks as usize],
                generation: 0,
                verify: verify_stores,
                unsealed: 0,
                workers,
                tiers: !tiers.is_empty(),
            }),
            answers,
            classes: Classes::new(py, output_class, spec_class, request_class, chunk_level)?,
            region_path,
            num_blocks,
            row_bytes: row,
        })
    }

    /// The shared region's path (`@NAME` for an anonymous region), which the workers attach
    /// to.
    #[getter]
    fn region_path(&self) -> PathBuf {
        self.region_path.clone()
    }

    /// Slots in the primary tier.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Bytes of one slot's row (every worker's part).
    #[getter]
    fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// vLLM's `lookup(key, req_context)`: answers one of the four `answers` objects.
    fn lookup(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyBytes>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let key_obj = key;
        let key = Key::new(key.as_bytes());
        let mut inner = self.lock(py);
        let req = inner.request_of(req_context)?;
        if inner.tiers {
            // A lookup may promote the block, inserting it for this request, ranked by its
            // position as a store's block is.
            match position_of(positions(req_context).as_ref(), key_obj)? {
                Some(end) => inner.driver()?.set_position(req, &key, end),
                None => {
                    inner
                        .unpositioned
                        .entry(req)
                        .or_default()
                        .insert(key.clone());
                }
            }
        }
        let driver = inner.driver()?;
        let answer = driver.lookup(req, &key);
        let i = match answer {
            Lookup::Miss => 0,
            Lookup::Hit => 1,
            Lookup::HitPending => {
                if let Some((_, BlockState::Promoting)) = driver.manager().primary().state_of(&key)
                {
                    inner.promoted.entry(req).or_default().insert(key);
                }
                2
            }
            _ => 3,
        };
        Ok(self.answers[i].clone_ref(py))
    }

    /// Whether `key`, answered Hit or HitPending for the request, was promoted from a
    /// secondary tier (vLLM's `get_load_source`: disk rather than host).
    fn promoted(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyBytes>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let id = req_id(req_context)?;
        let inner = self.lock(py);
        let Some(req) = inner.requests.get(id.to_str()?) else {
            return Ok(false);
        };
        Ok(inner
            .promoted
            .get(req)
            .is_some_and(|s| s.contains(&Key::new(key.as_bytes()))))
    }

    /// vLLM's `on_new_request`: answers a new `RequestOffloadingContext` (every block of the
    /// request offloaded as it is computed).
    fn on_new_request<'py>(
        &self,
        py: Python<'py>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        {
            let mut inner = self.lock(py);
            let req = inner.request_of(req_context)?;
            inner.driver()?.new_request(req);
        }
        self.classes.request(py)
    }

    /// vLLM's `prepare_load`: pins the blocks and answers the spec of their slots, in order.
    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let items = items(keys)?;
        let positions = positions(req_context);
        let mut inner = self.lock(py);
        let mut k = std::mem::take(&mut inner.keys);
        let out = inner
            .begin(&mut k, req_context, &items, positions.as_ref())
            .and_then(|req| inner.driver()?.prepare_load(req, &k).map_err(errors::hw));
        inner.keys = k;
        let slots = out?;
        drop(inner);
        self.classes.spec(py, &slots, None)
    }

    /// vLLM's `touch(keys, req_context)`.
    #[pyo3(signature = (keys, req_context = None))]
    fn touch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(py, keys, |driver, k| {
            driver.touch(k);
            Ok(())
        })
    }

    /// vLLM's `complete_load(keys, req_context)`: releases the pins of `prepare_load`.
    #[pyo3(signature = (keys, req_context = None))]
    fn complete_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        self.with_keys(py, keys, |driver, k| {
            driver.complete_load(k).map_err(errors::hw)
        })
    }

    /// vLLM's `prepare_store`: `None` when the blocks cannot be stored (no room), else a
    /// `PrepareStoreOutput` whose `keys_to_store` are the caller's own objects and whose
    /// `store_spec` carries the slots and the value each worker seals its copy of them with
    /// (see `complete_store`).
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let items = items(keys)?;
        let positions = positions(req_context);
        let mut inner = self.lock(py);
        let mut k = std::mem::take(&mut inner.keys);
        let out = inner
            .begin(&mut k, req_context, &items, positions.as_ref())
            .and_then(|req| Ok(inner.driver()?.prepare_store(req, &k)));
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                inner.keys = k;
                return Err(e);
            }
        };
        let prepared = match out {
            Ok(p) => p,
            Err(kvtier_hw::HwError::Core(CoreError::NoRoom { .. })) => {
                inner.keys = k;
                return Ok(None);
            }
            Err(e) => {
                inner.keys = k;
                return Err(errors::hw(e));
            }
        };
        // The keys to store are a subsequence of the input, in input order.
        let to_store = PyList::empty(py);
        let mut next = 0;
        let inner = &mut *inner;
        inner.generation += 1;
        let generation = inner.generation;
        for (key, slot) in prepared.keys.iter().zip(&prepared.slots) {
            while next < k.len() && &k[next] != key {
                next += 1;
            }
            let obj = match items.get(next) {
                Some(obj) => obj.clone(),
                None => PyBytes::new(py, key.as_bytes()).into_any(),
            };
            to_store.append(&obj)?;
            inner.objects[slot.index()] = Some(obj.unbind());
            inner.sealed_with[slot.index()] = generation;
            next += 1;
        }
        inner.keys = k;
        // An evicted key is answered with the object it was stored with, when the slot
        // still holds it (a promotion's slot holds none).
        let evicted = PyList::empty(py);
        let driver = inner.driver.as_ref().expect("checked by begin");
        let victims = driver.manager().primary().last_evicted_slots();
        let paired = victims.len() == prepared.evicted.len();
        for (key, slot) in prepared
            .evicted
            .iter()
            .zip(victims.map(Some).chain(std::iter::repeat(None)))
        {
            let kept = slot
                .filter(|_| paired)
                .and_then(|s| inner.objects[s.index()].as_ref())
                .map(|o| o.bind(py))
                .filter(|o| {
                    o.cast::<PyBytes>()
                        .is_ok_and(|b| b.as_bytes() == key.as_bytes())
                });
            match kept {
                Some(o) => evicted.append(o)?,
                None => evicted.append(PyBytes::new(py, key.as_bytes()))?,
            }
        }
        let spec = self.classes.spec(py, &prepared.slots, Some(generation))?;
        self.classes.output(py, to_store, spec, evicted).map(Some)
    }

    /// vLLM's `complete_store(keys, req_context, success=True)`.
    ///
    /// With `verify_stores`, a store reported successful is made readable only for the keys
    /// whose slot every worker sealed with the value `prepare_store` gave it: a copy that
    /// failed, or a worker that died, leaves its seal unset, and those keys end as failed
    /// stores (their slots go back, nothing is served), counted in `stats()["unsealed"]`.
    #[pyo3(signature = (keys, req_context, success = true))]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let id = req_id(req_context)?;
        let mut inner = self.lock(py);
        // A completion may come after the request finished: it names no record then.
        let req = inner
            .requests
            .get(id.to_str()?)
            .copied()
            .unwrap_or(RequestId(u64::MAX));
        let mut k = std::mem::take(&mut inner.keys);
        let out = keys_into(keys, &mut k).and_then(|()| {
            let inner = &mut *inner;
            let driver = live(&mut inner.driver)?;
            if !(inner.verify && success) || kvtier_core::mutant::active("skip_seal_check") {
                driver.complete_store(req, &k, success);
                return Ok(0);
            }
            let region = driver.region();
            let primary = driver.manager().primary();
            let is_sealed = |key: &Key| match primary.state_of(key) {
                Some((slot, BlockState::Pending)) => {
                    let want = inner.sealed_with[slot.index()];
                    (0..inner.workers).all(|w| region.seal(slot, w).is_ok_and(|v| v == want))
                }
                // Not this store's to check: the core decides (P8).
                _ => true,
            };
            // Usually every block is sealed: then the keys go on as they are.
            if k.iter().all(is_sealed) {
                driver.complete_store(req, &k, true);
                return Ok(0);
            }
            let (sealed, unsealed): (Vec<Key>, Vec<Key>) = k.iter().cloned().partition(is_sealed);
            driver.complete_store(req, &sealed, true);
            driver.complete_store(req, &unsealed, false);
            inner.unsealed += unsealed.len() as u64;
            Ok(unsealed.len())
        });
        inner.keys = k;
        let refused = out?;
        if refused > 0 {
            drop(inner);
            let msg = format!(
                "a store reported complete left {refused} blocks unsealed by a worker: their \
                 copy failed or never ran, so they are not cached"
            );
            py.import("logging")?
                .call_method1("getLogger", ("kvtier",))?
                .call_method1("warning", (msg,))?;
        }
        Ok(())
    }

    /// vLLM's `on_request_finished`: the request's key positions (from
    /// `req_context._offload_key_positions`, sent with its stores and loads) order its
    /// blocks' recency.
    fn on_request_finished(&self, py: Python<'_>, req_context: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = req_id(req_context)?;
        let positions = positions(req_context);
        let mut inner = self.lock(py);
        if inner
            .last
            .as_ref()
            .is_some_and(|(last, _)| last.as_ptr() == req_context.as_ptr())
        {
            inner.last = None;
        }
        let Some(req) = inner.requests.remove(id.to_str()?) else {
            return Ok(());
        };
        inner.promoted.remove(&req);
        // vLLM records a key's position when it makes the key, before any call names it, and
        // never changes it: the positions sent with the request's stores and loads are the
        // ones vLLM's policies read now. Only keys named before their position was recorded
        // are asked again.
        let reread = inner.unpositioned.remove(&req).unwrap_or_default();
        let driver = inner.driver()?;
        for key in reread {
            let item = PyBytes::new(py, key.as_bytes()).into_any();
            if let Some(end) = position_of(positions.as_ref(), &item)? {
                driver.set_position(req, &key, end);
            }
        }
        driver.request_finished(req);
        Ok(())
    }

    /// vLLM's `on_schedule_end`: ends the step (promotions are submitted, results collected).
    #[pyo3(signature = (context = None))]
    fn on_schedule_end(&self, py: Python<'_>, context: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = context;
        let mut inner = self.lock(py);
        if let Some(n) = inner.fence_steps {
            if n <= 1 {
                // Every job in flight at the reset has ended: promotions may take freed slots
                // again, from this step's on.
                inner.fence_steps = None;
                inner.driver()?.reset_flushed();
            } else {
                inner.fence_steps = Some(n - 1);
            }
        }
        inner.driver()?.end_step();
        drop(inner);
        // Once a step, the step's warnings (a failed tier job, say) reach Python's logging.
        crate::log::flush(py)
    }

    /// vLLM's `take_events`: `(tier, kind, keys)` with `tier` -1 for the primary and `kind`
    /// 0 stored, 1 removed, 2 discarded (a failed store's metadata-only removal).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<EventTuple<'py>>> {
        // After shutdown there is nothing to tell.
        let events = match self.lock(py).driver.as_mut() {
            Some(d) => d.take_events(),
            None => Vec::new(),
        };
        Ok(events
            .into_iter()
            .map(|e| {
                let tier = match e.medium {
                    Medium::Primary => -1,
                    Medium::Tier(t) => i32::from(t.0),
                };
                let kind = match e.kind {
                    EventKind::Stored => 0,
                    EventKind::Removed => 1,
                    EventKind::Discarded => 2,
                };
                let keys = e
                    .keys
                    .iter()
                    .map(|k| PyBytes::new(py, k.as_bytes()))
                    .collect();
                (tier, kind, keys)
            })
            .collect())
    }

    /// Whether the engine must keep stepping (tier IO in flight or promotions waiting); false
    /// after shutdown.
    fn has_pending_work(&self, py: Python<'_>) -> bool {
        // After shutdown nothing is pending.
        self.lock(py)
            .driver
            .as_ref()
            .is_some_and(|d| d.has_pending_work())
    }

    /// vLLM's `reset_cache`: waits (GIL released) for the tiers' IO in flight, then the
    /// primary forgets every block; promotions are held until `on_reset_flushed`, or, with
    /// `fence_steps = n`, until the `n`-th `on_schedule_end` from now (for a vLLM that never
    /// calls `on_reset_flushed`), whichever comes first.
    #[pyo3(signature = (fence_steps = None))]
    fn reset_cache(&self, py: Python<'_>, fence_steps: Option<u32>) -> PyResult<()> {
        py.detach(|| {
            let mut inner = lock(&self.inner);
            let timeout = inner.shutdown_timeout;
            let out = inner.driver().map(|d| d.reset_cache(timeout));
            if matches!(out, Ok(Ok(()))) {
                inner.promoted.clear();
                inner.fence_steps = fence_steps.map(|n| n.max(1));
            }
            out
        })
        .and_then(|r| r.map_err(errors::hw))
    }

    /// vLLM's `on_reset_flushed`.
    fn on_reset_flushed(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock(py);
        inner.fence_steps = None;
        inner.driver()?.reset_flushed();
        Ok(())
    }

    /// vLLM's `get_stats` data for the primary: `(usage, write_usage, read_usage,
    /// allocation_sizes, stores_skipped)`; `stores_skipped` is `None` without a reuse filter.
    #[allow(clippy::type_complexity)]
    fn take_metrics(&self, py: Python<'_>) -> PyResult<(f64, f64, f64, Vec<u32>, Option<u64>)> {
        let m = self.lock(py).driver()?.take_metrics();
        Ok((
            m.usage(),
            m.write_usage(),
            m.read_usage(),
            m.allocation_sizes.clone(),
            m.stores_skipped,
        ))
    }

    /// Per secondary tier, a dict of its figures for vLLM's `get_stats`: the gauges now
    /// (`capacity_blocks`, `capacity_bytes`, `blocks`, `bytes`, `up`), the counters since the
    /// previous call (`cascade_jobs`, `blocks_cascaded`, `bytes_written`, `promotions`,
    /// `bytes_read`, `skipped_backpressure`, `skipped_down`, `skipped_full`, `evictions`,
    /// `jobs_failed`, `write_failures`, `read_failures`, `verification_failures`,
    /// `read_missing`, `victims_missed`), and `promotion_latencies`: `(succeeded, seconds)` per promotion job
    /// ended meanwhile. An empty list after shutdown.
    fn take_tier_metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let tiers = match self.lock(py).driver.as_mut() {
            Some(d) => d.take_tier_metrics(),
            None => Vec::new(),
        };
        let row = self.row_bytes as u64;
        let out = PyList::empty(py);
        for t in tiers {
            let d = PyDict::new(py);
            d.set_item(intern!(py, "capacity_blocks"), t.capacity_blocks)?;
            d.set_item(intern!(py, "capacity_bytes"), t.capacity_blocks * row)?;
            d.set_item(intern!(py, "blocks"), t.blocks)?;
            d.set_item(intern!(py, "bytes"), t.blocks * row)?;
            d.set_item(intern!(py, "up"), t.up)?;
            for (name, value) in [
                (intern!(py, "cascade_jobs"), t.cascade_jobs),
                (intern!(py, "blocks_cascaded"), t.blocks_cascaded),
                (intern!(py, "bytes_written"), t.bytes_written),
                (intern!(py, "promotions"), t.promotions),
                (intern!(py, "bytes_read"), t.bytes_read),
                (intern!(py, "skipped_backpressure"), t.skipped_backpressure),
                (intern!(py, "skipped_down"), t.skipped_down),
                (intern!(py, "skipped_full"), t.skipped_full),
                (intern!(py, "evictions"), t.evictions),
                (intern!(py, "jobs_failed"), t.jobs_failed),
                (intern!(py, "write_failures"), t.write_failures),
                (intern!(py, "read_failures"), t.read_failures),
                (
                    intern!(py, "verification_failures"),
                    t.verification_failures,
                ),
                (intern!(py, "read_missing"), t.read_missing),
                (intern!(py, "victims_missed"), t.victims_missed),
            ] {
                d.set_item(name, value)?;
            }
            d.set_item(intern!(py, "promotion_latencies"), t.promotion_latencies)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Blocks each secondary tier can hold, in order (what its `capacity_bytes` gives).
    #[getter]
    fn tier_capacity_blocks(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let mut inner = self.lock(py);
        Ok(inner
            .driver()?
            .manager()
            .config()
            .tiers
            .iter()
            .map(|t| t.capacity_blocks)
            .collect())
    }

    /// The core's counters, and per tier its blocks and health, as a dict (for reports).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut inner = self.lock(py);
        let driver = inner.driver()?;
        let d = core_stats(py, &driver.manager().stats())?;
        d.set_item("unsealed", inner.unsealed)?;
        Ok(d)
    }

    /// Waits (GIL released, up to the configured timeout) for the tiers' IO, ends every
    /// job, stops the IO threads and removes the region. Later calls raise. Returns
    /// `(drained, ended_failed, abandoned)`; a second call returns zeros.
    fn shutdown(&self, py: Python<'_>) -> (u64, u64, u64) {
        let driver = py.detach(|| lock(&self.inner).driver.take());
        match driver {
            Some(d) => {
                let r = py.detach(move || d.shutdown());
                (r.drained, r.ended_failed, r.abandoned)
            }
            None => (0, 0, 0),
        }
    }
}

impl Manager {
    /// Runs `f` on the driver and the keys of `keys` (in the reused scratch vector).
    fn with_keys<R>(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut Driver, &[Key]) -> PyResult<R>,
    ) -> PyResult<R> {
        let mut inner = self.lock(py);
        let mut k = std::mem::take(&mut inner.keys);
        let inner = &mut *inner;
        let out = keys_into(keys, &mut k).and_then(|()| {
            let driver = live(&mut inner.driver)?;
            f(driver, &k)
        });
        inner.keys = k;
        out
    }

    /// The state, taken without releasing the GIL unless another thread holds it (that
    /// thread may be waiting for the GIL itself).
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Inner> {
        loop {
            match self.inner.try_lock() {
                Ok(g) => return g,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                // A guard cannot cross threads' GIL states: wait for the holder without the
                // GIL, then try again with it.
                Err(std::sync::TryLockError::WouldBlock) => py.detach(|| drop(lock(&self.inner))),
            }
        }
    }
}
