//! A Mooncake-format trace replayed through `kvtier-core` with vLLM 0.33's scheduler call
//! sequence: the core alone, vLLM's own manager alone (through the oracle), or both in
//! lockstep with every answer compared.
//!
//! # The call sequence
//!
//! Requests run one at a time, each with the calls vLLM 0.33's `OffloadingConnectorScheduler`
//! makes for a request prefilled in one step that then finishes, every transfer completing
//! before the next step (the sequence of `model/oracle/replay.py`, documented in
//! `model/oracle/README.md`):
//!
//! 1. `new_request`, and `set_position(key, (i + 1) * block_tokens)` for every block `i`.
//! 2. Lookups from the first block, stopping after the first Miss. Any HitPending or Retry
//!    before it defers the request: the step ends (`end_step`, no new request) and the
//!    lookups run again in the next step.
//! 3. With `h` hits (the Hit/HitPending prefix): `prepare_load(h)`, `end_step`,
//!    `complete_load(h)`.
//! 4. For the rest: `prepare_store(rest)`, `end_step`, `complete_store(keys_to_store)` (a
//!    refused store completes nothing).
//! 5. `request_finished`, `end_step`.
//!
//! Every block id `id` is the key `id` as 8 big-endian bytes followed by group 0 in 4 bytes
//! ([`oracle::Key::block`]). With secondary tiers, the tiers' IO is played by the replay:
//! right after every `end_step`, every job the manager submitted is finished successfully,
//! tier by tier in tier order, each tier's jobs in submission order; both managers see the
//! results at their next collection (the step's first lookup, any `prepare_store`, or
//! `end_step`).
//!
//! # Block operations
//!
//! One *block operation* is one key passed to one of `lookup`, `prepare_load`,
//! `complete_load`, `prepare_store` or `complete_store` ([`Totals::block_ops`]).
//! `replay.py --time` counts them the same way, so the two timings divide by the same number.
//!
//! # Lockstep
//!
//! [`lockstep`] drives the core ([`CoreEngine`]) and vLLM's manager ([`OracleEngine`]) with
//! the same calls ([`Pair`]) and compares every answer: lookup answers, the slots of every
//! load, every prepared store (keys, slots, evicted keys in order), every primary event, and
//! with tiers every submitted job (kind, keys, slots). The first difference ends the replay
//! with a [`Difference`] naming the request and what differed, unless it is one of kvtier's
//! deliberate departures from vLLM (`docs/state-machine.md`), which are counted by name
//! ([`Report::exceptions`]):
//!
//! - [`RULE_T7`]: a cascade does not write again the blocks the tier already holds (vLLM
//!   writes every block to every tier). The jobs still agree on everything else; the replay
//!   goes on in lockstep.
//! - [`RULE_HIT_PROTECTION`] (★8): a promotion never evicts a block its own request was
//!   answered Hit for in the step; vLLM may. The signature: vLLM evicted such a hit and the
//!   core did not. Under LRU it is also checked victim by victim: on a copy of the core taken
//!   before the lookup pass, the core's policy, asked for its first idle victim at the
//!   eviction where the two differ, must name vLLM's victim when the hits are not protected
//!   and the core's when they are. The two primaries then hold different blocks, so the
//!   replay *resynchronizes*: both managers start again with empty primaries over the blocks
//!   the tiers hold, and the request runs again ([`Report::resyncs`]).
//!
//! [`replay_core`] is the core alone without any observation, for timing; its totals must
//! equal the lockstep's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use kvtier_core::{
    Config, Effect, EventKind, Job, JobKind, JobResult, Key, Lookup, Manager, Medium, Outcome,
    PolicyKind, RequestId, TierConfig, TierId, TierKind,
};

use crate::oracle::{
    self, CpuConfig, LookupResult, OracleError, Policy, ScriptedTier, TieringConfig, VllmOracle,
};

/// `model/oracle/replay.py`: the same replay through vLLM alone (`--time` times it).
pub const REPLAY_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/oracle/replay.py");

/// Tokens per block in the key positions (`set_position`), as `replay.py`'s default.
pub const BLOCK_TOKENS: u64 = 512;

/// Lookup passes of one request after which the replay gives up (`replay.py`'s bound).
pub const MAX_DEFERRALS: u64 = 1000;

/// The named exception: a cascade skips blocks the tier holds (rule T7); vLLM writes them.
pub const RULE_T7: &str = "T7 cascade skips blocks the tier holds";

/// The named exception: ★8, a promotion never evicts its own request's hits of the step.
pub const RULE_HIT_PROTECTION: &str = "★8 own hits never evicted by own promotions";

/// A trace: each request's block ids in prefix order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The requests, in trace order.
    pub requests: Vec<Vec<u64>>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A line is not a JSON object with `hash_ids`, a list of non-negative integers.
    #[error("line {line}: {reason}")]
    Line {
        /// The line number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

impl Trace {
    /// Parses Mooncake-format JSON lines: each non-blank line an object whose `hash_ids` is
    /// the request's block ids (other fields are ignored).
    pub fn parse(text: &str) -> Result<Self, TraceError> {
        let mut requests = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |reason: String| TraceError::Line {
                line: n + 1,
                reason,
            };
            let value: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
            let ids = value
                .get("hash_ids")
                .and_then(|v| v.as_array())
                .ok_or_else(|| bad("no hash_ids list".into()))?;
            let ids = ids
                .iter()
                .map(|i| i.as_u64())
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| bad("hash_ids holds something else than u64 integers".into()))?;
            requests.push(ids);
        }
        Ok(Trace { requests })
    }

    /// Reads and parses a trace file.
    pub fn read(path: &Path) -> Result<Self, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Blocks over all requests.
    pub fn blocks(&self) -> u64 {
        self.requests.iter().map(|r| r.len() as u64).sum()
    }

    /// Distinct block ids.
    pub fn distinct_blocks(&self) -> usize {
        self.requests.iter().flatten().collect::<HashSet<_>>().len()
    }

    /// `max(1, int(fraction * distinct))` blocks, as `replay.py` sizes the primary.
    pub fn capacity(&self, fraction: f64) -> u32 {
        ((fraction * self.distinct_blocks() as f64) as u32).max(1)
    }
}

/// What to replay on.
#[derive(Clone, Debug, PartialEq)]
pub struct Setup {
    /// The primary tier's policy under vLLM.
    pub policy: Policy,
    /// The primary tier's policy in the core: `policy`'s, unless a replay of the core alone
    /// names one vLLM does not have.
    pub core_policy: PolicyKind,
    /// Primary blocks.
    pub num_blocks: u32,
    /// The capacities of the secondary tiers, in tier order (authoritative tiers in the core,
    /// scripted tiers under vLLM's `TieringOffloadingManager`); empty: the primary alone
    /// (vLLM's `CPUOffloadingManager`).
    pub tiers: Vec<u32>,
    /// Tokens per block in the key positions.
    pub block_tokens: u64,
}

impl Setup {
    /// The primary alone, `num_blocks` blocks under `policy`.
    pub fn primary(policy: Policy, num_blocks: u32) -> Self {
        Setup {
            policy,
            core_policy: match policy {
                Policy::Lru => PolicyKind::Lru,
                Policy::Arc => PolicyKind::Arc,
            },
            num_blocks,
            tiers: Vec::new(),
            block_tokens: BLOCK_TOKENS,
        }
    }

    /// The core's configuration; `events` on for the lockstep, off for timing.
    pub fn core_config(&self, events: bool) -> Config {
        let mut config = Config::new(self.num_blocks);
        config.policy = self.core_policy;
        config.tiers = self
            .tiers
            .iter()
            .map(|&capacity| TierConfig::new(TierKind::Authoritative, capacity))
            .collect();
        config.events = events;
        config
    }
}

/// What a replay observed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Requests replayed.
    pub requests: u64,
    /// Blocks of the replayed requests.
    pub blocks: u64,
    /// Blocks answered Hit at the request's first lookup pass (primary hits).
    pub hits: u64,
    /// Blocks answered HitPending at the request's first lookup pass (with one request at a
    /// time: promotions started from a secondary tier).
    pub promoted: u64,
    /// Blocks loaded: the hit prefix once the request was no longer deferred.
    pub loaded: u64,
    /// Blocks stored (`keys_to_store` of the prepared stores).
    pub stored: u64,
    /// Stores refused (not enough evictable blocks).
    pub store_refused: u64,
    /// Blocks evicted from the primary (by stores and promotions).
    pub evicted: u64,
    /// Lookup passes deferred (a HitPending or Retry before the first Miss).
    pub deferrals: u64,
    /// Block operations: keys passed to lookup, prepare_load, complete_load, prepare_store
    /// and complete_store.
    pub block_ops: u64,
}

impl Totals {
    fn add(&mut self, o: &Totals) {
        self.requests += o.requests;
        self.blocks += o.blocks;
        self.hits += o.hits;
        self.promoted += o.promoted;
        self.loaded += o.loaded;
        self.stored += o.stored;
        self.store_refused += o.store_refused;
        self.evicted += o.evicted;
        self.deferrals += o.deferrals;
        self.block_ops += o.block_ops;
    }

    /// Primary hits per block.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.hits, self.blocks)
    }

    /// Promotions started per block.
    pub fn promoted_ratio(&self) -> f64 {
        ratio(self.promoted, self.blocks)
    }

    /// Loaded blocks per block.
    pub fn loaded_ratio(&self) -> f64 {
        ratio(self.loaded, self.blocks)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The first difference between the core and vLLM that no named rule explains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    /// The request's index in the trace.
    pub request: usize,
    /// The call or observation that differed.
    pub what: String,
    /// The core's answer.
    pub core: String,
    /// vLLM's answer.
    pub vllm: String,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request {}: {} differ\n  core: {}\n  vLLM: {}",
            self.request, self.what, self.core, self.vllm
        )
    }
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The core and vLLM answered differently, and no named rule explains it.
    #[error("{0}")]
    Differ(Box<Difference>),
    /// The core refused a call of the sequence.
    #[error("request {request}: the core refused {call}: {error}")]
    Core {
        /// The request.
        request: usize,
        /// The call.
        call: &'static str,
        /// The core's error.
        error: kvtier_core::Error,
    },
    /// The oracle failed or vLLM raised.
    #[error("request {request}: {error}")]
    Oracle {
        /// The request.
        request: usize,
        /// The oracle's error.
        error: OracleError,
    },
    /// A request stayed deferred for [`MAX_DEFERRALS`] passes.
    #[error("request {request}: lookups still deferred after {MAX_DEFERRALS} steps")]
    Stuck {
        /// The request.
        request: usize,
    },
    /// A difference a named rule explains, which leaves the two managers holding different
    /// blocks: the lockstep resynchronizes (internal to [`lockstep`]).
    #[error("request {request}: {rule}: {detail}")]
    Diverged {
        /// The request.
        request: usize,
        /// The rule.
        rule: &'static str,
        /// What happened.
        detail: String,
    },
}

/// A prepared store, as both managers report it (block ids for keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Store {
    /// The keys to store, in offer order.
    pub keys: Vec<u64>,
    /// Their slots.
    pub slots: Vec<i64>,
    /// The keys evicted, in eviction order.
    pub evicted: Vec<u64>,
}

/// A job submitted to a secondary tier, as both managers report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierJob {
    /// A promotion (tier to primary) rather than a cascade.
    pub promotion: bool,
    /// The keys moved.
    pub keys: Vec<u64>,
    /// The primary slots read or written.
    pub slots: Vec<i64>,
}

/// A primary event: removed (true) or stored, and its keys.
pub type PrimaryEvent = (bool, Vec<u64>);

/// One manager under the replay's call sequence. Each method is one call of the sequence
/// (keys given as block ids) with its answer in a form both managers share.
pub trait Engine {
    /// `new_request` and every key's position.
    fn begin(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError>;
    /// Lookups from the first key, stopping after the first Miss.
    fn lookups(&mut self, n: usize, ids: &[u64]) -> Result<Vec<LookupResult>, ReplayError>;
    /// `prepare_load`: the slots.
    fn prepare_load(&mut self, n: usize, ids: &[u64]) -> Result<Vec<i64>, ReplayError>;
    /// `complete_load`.
    fn complete_load(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError>;
    /// `prepare_store`: `None` when refused.
    fn prepare_store(&mut self, n: usize, ids: &[u64]) -> Result<Option<Store>, ReplayError>;
    /// `complete_store(ids, success)`.
    fn complete_store(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError>;
    /// `request_finished`.
    fn finished(&mut self, n: usize) -> Result<(), ReplayError>;
    /// `end_step` (with the request new in the step, if any), then every submitted job
    /// finished successfully.
    fn end_step(&mut self, n: usize, new: Option<usize>) -> Result<(), ReplayError>;
    /// The request is over (bookkeeping).
    fn end_request(&mut self, n: usize) -> Result<(), ReplayError>;
    /// Blocks evicted from the primary so far (since the manager was made).
    fn evicted(&mut self, n: usize) -> Result<u64, ReplayError>;
}

/// Replays request `n` through `e`, adding what it observed to `t`.
pub fn run_request<E: Engine>(
    e: &mut E,
    n: usize,
    ids: &[u64],
    t: &mut Totals,
) -> Result<(), ReplayError> {
    let evicted_before = e.evicted(n)?;
    e.begin(n, ids)?;
    let mut new = Some(n);
    let mut passes = 0;
    let hits = loop {
        let answers = e.lookups(n, ids)?;
        t.block_ops += answers.len() as u64;
        if passes == 0 {
            t.hits += count(&answers, LookupResult::Hit);
            t.promoted += count(&answers, LookupResult::HitPending);
        }
        let hits = answers
            .iter()
            .filter(|a| matches!(a, LookupResult::Hit | LookupResult::HitPending))
            .count();
        let deferred = answers
            .iter()
            .any(|a| matches!(a, LookupResult::HitPending | LookupResult::Retry));
        if !deferred {
            break hits;
        }
        t.deferrals += 1;
        passes += 1;
        if passes >= MAX_DEFERRALS {
            return Err(ReplayError::Stuck { request: n });
        }
        e.end_step(n, None)?;
    };
    if hits > 0 {
        e.prepare_load(n, &ids[..hits])?;
        e.end_step(n, new.take())?;
        e.complete_load(n, &ids[..hits])?;
        t.block_ops += 2 * hits as u64;
    }
    if hits < ids.len() {
        let rest = &ids[hits..];
        t.block_ops += rest.len() as u64;
        let store = e.prepare_store(n, rest)?;
        e.end_step(n, new.take())?;
        match store {
            None => t.store_refused += 1,
            Some(s) => {
                t.stored += s.keys.len() as u64;
                if !s.keys.is_empty() {
                    e.complete_store(n, &s.keys)?;
                    t.block_ops += s.keys.len() as u64;
                }
            }
        }
    }
    e.finished(n)?;
    e.end_step(n, new.take())?;
    e.end_request(n)?;
    t.requests += 1;
    t.blocks += ids.len() as u64;
    t.loaded += hits as u64;
    t.evicted += e.evicted(n)? - evicted_before;
    Ok(())
}

fn count(answers: &[LookupResult], what: LookupResult) -> u64 {
    answers.iter().filter(|a| **a == what).count() as u64
}

/// The core key of block `id`.
pub fn core_key(id: u64) -> Key {
    Key::new(&oracle::Key::block(id).0)
}

/// The block id of a key (its first 8 bytes, big-endian).
pub fn block_id(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = key.len().min(8);
    b[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(b)
}

fn answer(l: Lookup) -> LookupResult {
    match l {
        Lookup::Hit => LookupResult::Hit,
        Lookup::HitPending => LookupResult::HitPending,
        Lookup::Retry => LookupResult::Retry,
        _ => LookupResult::Miss,
    }
}

/// `kvtier-core`'s [`Manager`] as an [`Engine`], playing its tiers' IO.
pub struct CoreEngine {
    setup: Setup,
    m: Manager,
    keys: HashMap<u64, Key>,
    /// Jobs submitted since the last `end_step`, per tier, in submission order.
    jobs: Vec<Vec<Job>>,
    /// Deletes the core asked of its tiers since they were last taken.
    deletes: Vec<(usize, Vec<u64>)>,
}

impl CoreEngine {
    /// A manager for `setup`, events on.
    pub fn new(setup: &Setup) -> Self {
        CoreEngine {
            setup: setup.clone(),
            m: Manager::new(setup.core_config(true)).expect("a valid setup"),
            keys: HashMap::new(),
            jobs: vec![Vec::new(); setup.tiers.len()],
            deletes: Vec::new(),
        }
    }

    /// The manager.
    pub fn manager(&self) -> &Manager {
        &self.m
    }

    fn key(&mut self, id: u64) -> Key {
        self.keys.entry(id).or_insert_with(|| core_key(id)).clone()
    }

    fn ckeys(&mut self, ids: &[u64]) -> Vec<Key> {
        ids.iter().map(|&i| self.key(i)).collect()
    }

    /// `end_step` and the jobs it leaves submitted, per tier (not finished yet).
    fn end_step_only(&mut self) {
        self.m.end_step();
        while let Some(effect) = self.m.poll_effect() {
            match effect {
                Effect::Submit(job) => self.jobs[job.tier.index()].push(job),
                Effect::Delete { tier, keys } => self.deletes.push((
                    tier.index(),
                    keys.iter().map(|k| block_id(k.as_bytes())).collect(),
                )),
            }
        }
    }

    fn pending_jobs(&self, tier: usize) -> Vec<TierJob> {
        self.jobs[tier]
            .iter()
            .map(|job| TierJob {
                promotion: matches!(job.kind, JobKind::Load { .. }),
                keys: job
                    .blocks()
                    .iter()
                    .map(|b| block_id(b.key.as_bytes()))
                    .collect(),
                slots: job.blocks().iter().map(|b| i64::from(b.slot.0)).collect(),
            })
            .collect()
    }

    fn finish_jobs(&mut self, n: usize) -> Result<(), ReplayError> {
        for tier in &mut self.jobs {
            for job in tier.drain(..) {
                self.m
                    .handle_job_result(JobResult {
                        job: job.id,
                        outcome: Outcome::Ok,
                    })
                    .map_err(|error| ReplayError::Core {
                        request: n,
                        call: "handle_job_result",
                        error,
                    })?;
            }
        }
        Ok(())
    }

    /// The primary events since the last call.
    fn events(&mut self) -> Vec<PrimaryEvent> {
        self.m
            .take_events()
            .into_iter()
            .filter(|e| e.medium == Medium::Primary)
            .map(|e| {
                (
                    e.kind == EventKind::Removed,
                    e.keys.iter().map(|k| block_id(k.as_bytes())).collect(),
                )
            })
            .collect()
    }

    /// Starts again with an empty primary over tiers holding `tiers[t]`.
    fn restart(&mut self, tiers: &[Vec<u64>]) {
        self.m = Manager::new(self.setup.core_config(true)).expect("a valid setup");
        for (t, ids) in tiers.iter().enumerate() {
            let keys = self.ckeys(ids);
            let rejected = self
                .m
                .restore_tier(TierId(t as u16), keys)
                .expect("a configured tier");
            assert!(rejected.is_empty(), "the tier holds what it held");
        }
        self.jobs.iter_mut().for_each(Vec::clear);
        self.deletes.clear();
    }
}

impl Engine for CoreEngine {
    fn begin(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        let req = RequestId(n as u64);
        self.m.new_request(req);
        for (i, &id) in ids.iter().enumerate() {
            let k = self.key(id);
            self.m
                .set_position(req, &k, self.setup.block_tokens * (i as u64 + 1));
        }
        Ok(())
    }

    fn lookups(&mut self, n: usize, ids: &[u64]) -> Result<Vec<LookupResult>, ReplayError> {
        let mut out = Vec::new();
        for &id in ids {
            let k = self.key(id);
            let a = answer(self.m.lookup(RequestId(n as u64), &k));
            out.push(a);
            if a == LookupResult::Miss {
                break;
            }
        }
        Ok(out)
    }

    fn prepare_load(&mut self, n: usize, ids: &[u64]) -> Result<Vec<i64>, ReplayError> {
        let keys = self.ckeys(ids);
        let slots = self
            .m
            .prepare_load(RequestId(n as u64), &keys)
            .map_err(|error| ReplayError::Core {
                request: n,
                call: "prepare_load",
                error,
            })?;
        Ok(slots.iter().map(|s| i64::from(s.0)).collect())
    }

    fn complete_load(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        let keys = self.ckeys(ids);
        self.m
            .complete_load(&keys)
            .map_err(|error| ReplayError::Core {
                request: n,
                call: "complete_load",
                error,
            })
    }

    fn prepare_store(&mut self, n: usize, ids: &[u64]) -> Result<Option<Store>, ReplayError> {
        let keys = self.ckeys(ids);
        match self.m.prepare_store(RequestId(n as u64), &keys) {
            Ok(p) => Ok(Some(Store {
                keys: p.keys.iter().map(|k| block_id(k.as_bytes())).collect(),
                slots: p.slots.iter().map(|s| i64::from(s.0)).collect(),
                evicted: p.evicted.iter().map(|k| block_id(k.as_bytes())).collect(),
            })),
            Err(kvtier_core::Error::NoRoom { .. }) => Ok(None),
            Err(error) => Err(ReplayError::Core {
                request: n,
                call: "prepare_store",
                error,
            }),
        }
    }

    fn complete_store(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        let keys = self.ckeys(ids);
        self.m.complete_store(RequestId(n as u64), &keys, true);
        Ok(())
    }

    fn finished(&mut self, n: usize) -> Result<(), ReplayError> {
        self.m.request_finished(RequestId(n as u64));
        Ok(())
    }

    fn end_step(&mut self, n: usize, _new: Option<usize>) -> Result<(), ReplayError> {
        self.end_step_only();
        self.deletes.clear(); // alone, the core's tier index is the tier
        self.finish_jobs(n)
    }

    fn end_request(&mut self, _n: usize) -> Result<(), ReplayError> {
        self.m.take_events();
        Ok(())
    }

    fn evicted(&mut self, _n: usize) -> Result<u64, ReplayError> {
        Ok(self.m.stats().evictions)
    }
}

/// vLLM 0.33.0's manager (through the oracle) as an [`Engine`], playing its scripted tiers'
/// IO.
pub struct OracleEngine<'a> {
    setup: Setup,
    o: &'a mut VllmOracle,
    evicted: u64,
    /// Primary events taken and not yet handed out.
    events: Vec<PrimaryEvent>,
}

fn name(n: usize) -> String {
    format!("req-{n}")
}

fn vkeys(ids: &[u64]) -> Vec<oracle::Key> {
    ids.iter().map(|&i| oracle::Key::block(i)).collect()
}

fn ids_of(keys: &[oracle::Key]) -> Vec<u64> {
    keys.iter().map(|k| block_id(&k.0)).collect()
}

impl<'a> OracleEngine<'a> {
    /// Creates vLLM's manager for `setup` in the oracle: `CPUOffloadingManager` for the
    /// primary alone, else `TieringOffloadingManager` over scripted tiers.
    pub fn new(o: &'a mut VllmOracle, setup: &Setup) -> Result<Self, OracleError> {
        let mut e = OracleEngine {
            setup: setup.clone(),
            o,
            evicted: 0,
            events: Vec::new(),
        };
        e.create()?;
        Ok(e)
    }

    fn create(&mut self) -> Result<(), OracleError> {
        if self.setup.tiers.is_empty() {
            self.o
                .create_cpu(&CpuConfig::new(self.setup.num_blocks, self.setup.policy))
        } else {
            self.o.create_tiering(&TieringConfig::new(
                self.setup.num_blocks,
                self.setup.policy,
                vec![ScriptedTier::storage(); self.setup.tiers.len()],
            ))
        }
    }

    fn err(n: usize) -> impl Fn(OracleError) -> ReplayError {
        move |error| ReplayError::Oracle { request: n, error }
    }

    fn schedule_end(&mut self, n: usize, new: Option<usize>) -> Result<(), ReplayError> {
        let new: Vec<String> = new.into_iter().map(name).collect();
        let new: Vec<&str> = new.iter().map(String::as_str).collect();
        self.o.schedule_end(&new, &[]).map_err(Self::err(n))
    }

    fn pending_jobs(&mut self, n: usize, tier: usize) -> Result<Vec<(u64, TierJob)>, ReplayError> {
        Ok(self
            .o
            .tier_jobs(tier)
            .map_err(Self::err(n))?
            .into_iter()
            .map(|j| {
                (
                    j.job_id,
                    TierJob {
                        promotion: j.is_promotion,
                        keys: ids_of(&j.keys),
                        slots: j.block_ids,
                    },
                )
            })
            .collect())
    }

    fn finish_jobs(&mut self, n: usize) -> Result<(), ReplayError> {
        for tier in 0..self.setup.tiers.len() {
            for (id, _) in self.pending_jobs(n, tier)? {
                self.o
                    .tier_finish(tier, id, true, None)
                    .map_err(Self::err(n))?;
            }
        }
        Ok(())
    }

    /// Takes vLLM's primary events (counting evictions).
    fn take_events(&mut self, n: usize) -> Result<(), ReplayError> {
        for e in self.o.take_events().map_err(Self::err(n))? {
            if e.ownership.is_some() {
                continue;
            }
            if e.removed {
                self.evicted += e.keys.len() as u64;
            }
            self.events.push((e.removed, ids_of(&e.keys)));
        }
        Ok(())
    }

    fn events(&mut self, n: usize) -> Result<Vec<PrimaryEvent>, ReplayError> {
        self.take_events(n)?;
        Ok(std::mem::take(&mut self.events))
    }

    /// The keys each scripted tier holds, in insertion order.
    fn tier_contents(&mut self, n: usize) -> Result<Vec<Vec<u64>>, ReplayError> {
        (0..self.setup.tiers.len())
            .map(|t| Ok(ids_of(&self.o.tier_keys(t).map_err(Self::err(n))?)))
            .collect()
    }

    /// Starts again with an empty primary over tiers holding `tiers[t]`.
    fn restart(&mut self, n: usize, tiers: &[Vec<u64>]) -> Result<(), ReplayError> {
        self.create().map_err(Self::err(n))?;
        for (t, ids) in tiers.iter().enumerate() {
            self.o.tier_put(t, &vkeys(ids)).map_err(Self::err(n))?;
        }
        self.events.clear();
        self.evicted = 0;
        Ok(())
    }
}

impl Engine for OracleEngine<'_> {
    fn begin(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        let req = name(n);
        let positions: Vec<(oracle::Key, u64)> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                (
                    oracle::Key::block(id),
                    self.setup.block_tokens * (i as u64 + 1),
                )
            })
            .collect();
        self.o.new_request(&req).map_err(Self::err(n))?;
        self.o.set_positions(&req, &positions).map_err(Self::err(n))
    }

    fn lookups(&mut self, n: usize, ids: &[u64]) -> Result<Vec<LookupResult>, ReplayError> {
        self.o
            .lookup_many(&name(n), &vkeys(ids), true)
            .map_err(Self::err(n))
    }

    fn prepare_load(&mut self, n: usize, ids: &[u64]) -> Result<Vec<i64>, ReplayError> {
        self.o
            .prepare_load(&name(n), &vkeys(ids))
            .map_err(Self::err(n))
    }

    fn complete_load(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        self.o
            .complete_load(&name(n), &vkeys(ids))
            .map_err(Self::err(n))
    }

    fn prepare_store(&mut self, n: usize, ids: &[u64]) -> Result<Option<Store>, ReplayError> {
        Ok(self
            .o
            .prepare_store(&name(n), &vkeys(ids))
            .map_err(Self::err(n))?
            .map(|p| Store {
                keys: ids_of(&p.keys_to_store),
                slots: p.block_ids,
                evicted: ids_of(&p.evicted_keys),
            }))
    }

    fn complete_store(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        self.o
            .complete_store(&name(n), &vkeys(ids), true)
            .map_err(Self::err(n))
    }

    fn finished(&mut self, n: usize) -> Result<(), ReplayError> {
        self.o.request_finished(&name(n)).map_err(Self::err(n))
    }

    fn end_step(&mut self, n: usize, new: Option<usize>) -> Result<(), ReplayError> {
        self.schedule_end(n, new)?;
        self.finish_jobs(n)
    }

    fn end_request(&mut self, n: usize) -> Result<(), ReplayError> {
        self.o.drop_request(&name(n)).map_err(Self::err(n))?;
        self.take_events(n)?;
        self.events.clear();
        Ok(())
    }

    fn evicted(&mut self, _n: usize) -> Result<u64, ReplayError> {
        Ok(self.evicted)
    }
}

/// The core and vLLM's manager driven together, every answer compared.
pub struct Pair<'a> {
    /// The core.
    pub core: CoreEngine,
    /// vLLM.
    pub vllm: OracleEngine<'a>,
    /// Named exceptions: rule → how many times (blocks for [`RULE_T7`], occurrences else).
    pub exceptions: BTreeMap<&'static str, u64>,
    /// The keys the request was answered Hit for in the current step (★8's protected hits).
    step_hits: Vec<u64>,
    /// The core before the current lookup pass and the pass's keys, kept (LRU with tiers)
    /// when the pass could promote after a hit, to check a ★8 case victim by victim.
    snapshot: Option<(Manager, Vec<u64>)>,
}

fn differ<T: fmt::Debug>(n: usize, what: &str, core: &T, vllm: &T) -> ReplayError {
    ReplayError::Differ(Box::new(Difference {
        request: n,
        what: what.into(),
        core: format!("{core:?}"),
        vllm: format!("{vllm:?}"),
    }))
}

fn same<T: fmt::Debug + PartialEq>(
    n: usize,
    what: &str,
    core: T,
    vllm: T,
) -> Result<T, ReplayError> {
    if core == vllm {
        Ok(core)
    } else {
        Err(differ(n, what, &core, &vllm))
    }
}

impl<'a> Pair<'a> {
    /// Both managers for `setup` (vLLM's is created in the oracle).
    pub fn new(o: &'a mut VllmOracle, setup: &Setup) -> Result<Self, OracleError> {
        Ok(Self::of(
            CoreEngine::new(setup),
            OracleEngine::new(o, setup)?,
        ))
    }

    /// A pair of engines made separately (e.g. on different setups, to see a difference).
    pub fn of(core: CoreEngine, vllm: OracleEngine<'a>) -> Self {
        Pair {
            core,
            vllm,
            exceptions: BTreeMap::new(),
            step_hits: Vec::new(),
            snapshot: None,
        }
    }

    /// Compares the primary events since the last comparison. `removed_ok` explains vLLM
    /// evicting a protected hit (★8).
    fn compare_events(&mut self, n: usize, after: &str) -> Result<(), ReplayError> {
        let core = self.core.events();
        let vllm = self.vllm.events(n)?;
        if core == vllm {
            return Ok(());
        }
        // ★8 explains it when vLLM evicted a block the request was answered Hit for in this
        // step and the core did not.
        let flat = |events: &[PrimaryEvent]| -> Vec<u64> {
            events
                .iter()
                .filter(|(removed, _)| *removed)
                .flat_map(|(_, keys)| keys.iter().copied())
                .collect()
        };
        let (core_removed, vllm_removed) = (flat(&core), flat(&vllm));
        let vllm_evicted_hit = vllm_removed
            .iter()
            .find(|k| self.step_hits.contains(k) && !core_removed.contains(k));
        if let Some(k) = vllm_evicted_hit {
            // Under LRU, checked victim by victim (the snapshot is kept only then).
            let checked = match self.snapshot.take() {
                Some((before, ids)) => {
                    check_hit_protection(before, n, &ids, &core_removed, &vllm_removed)
                }
                None => Ok(()),
            };
            if let Err(why) = checked {
                return Err(differ(
                    n,
                    &format!("primary events after {after} (★8 does not explain them: {why})"),
                    &core,
                    &vllm,
                ));
            }
            return Err(ReplayError::Diverged {
                request: n,
                rule: RULE_HIT_PROTECTION,
                detail: format!(
                    "after {after}, vLLM evicted block {k}, a hit of the request in this step; \
                     core events {core:?}, vLLM events {vllm:?}"
                ),
            });
        }
        Err(differ(
            n,
            &format!("primary events after {after}"),
            &core,
            &vllm,
        ))
    }

    /// Compares the jobs both submitted in the step, tier by tier, then finishes them.
    fn compare_jobs(&mut self, n: usize) -> Result<(), ReplayError> {
        for (tier, ids) in std::mem::take(&mut self.core.deletes) {
            // The core's tier index chose what the tier drops; the scripted tier follows.
            self.vllm
                .o
                .tier_remove(tier, &vkeys(&ids))
                .map_err(OracleEngine::err(n))?;
        }
        for tier in 0..self.core.setup.tiers.len() {
            let core = self.core.pending_jobs(tier);
            let vllm: Vec<TierJob> = self
                .vllm
                .pending_jobs(n, tier)?
                .into_iter()
                .map(|(_, j)| j)
                .collect();
            let mut core_jobs = core.iter();
            let t = TierId(tier as u16);
            for v in &vllm {
                let expected = if v.promotion {
                    v.clone()
                } else {
                    // T7: the core writes only the blocks its tier did not hold.
                    let index = self.core.m.tier(t).expect("a configured tier");
                    let mut kept = TierJob {
                        promotion: false,
                        keys: Vec::new(),
                        slots: Vec::new(),
                    };
                    let mut skipped = 0;
                    let written: HashSet<u64> = core
                        .iter()
                        .filter(|c| !c.promotion)
                        .flat_map(|c| c.keys.iter().copied())
                        .collect();
                    for (&k, &s) in v.keys.iter().zip(&v.slots) {
                        if !written.contains(&k) && index.state_of(&core_key(k)).is_some() {
                            skipped += 1;
                        } else {
                            kept.keys.push(k);
                            kept.slots.push(s);
                        }
                    }
                    if skipped > 0 {
                        *self.exceptions.entry(RULE_T7).or_default() += skipped;
                    }
                    if kept.keys.is_empty() {
                        continue;
                    }
                    kept
                };
                match core_jobs.next() {
                    Some(c) => {
                        same(n, &format!("jobs of tier {tier}"), c, &expected)?;
                    }
                    None => return Err(differ(n, &format!("jobs of tier {tier}"), &core, &vllm)),
                }
            }
            if core_jobs.next().is_some() {
                return Err(differ(n, &format!("jobs of tier {tier}"), &core, &vllm));
            }
        }
        self.core.finish_jobs(n)?;
        self.vllm.finish_jobs(n)
    }

    /// Starts both again with empty primaries over what vLLM's tiers hold.
    fn resync(&mut self, n: usize) -> Result<(), ReplayError> {
        let tiers = self.vllm.tier_contents(n)?;
        self.core.restart(&tiers);
        self.vllm.restart(n, &tiers)?;
        self.step_hits.clear();
        Ok(())
    }
}

impl Engine for Pair<'_> {
    fn begin(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        self.core.begin(n, ids)?;
        self.vllm.begin(n, ids)
    }

    fn lookups(&mut self, n: usize, ids: &[u64]) -> Result<Vec<LookupResult>, ReplayError> {
        self.snapshot = (self.core.setup.policy == Policy::Lru
            && !self.core.setup.tiers.is_empty()
            && may_promote_after_a_hit(&self.core.m, ids))
        .then(|| (self.core.m.clone(), ids.to_vec()));
        let core = self.core.lookups(n, ids)?;
        let vllm = self.vllm.lookups(n, ids)?;
        // The hits before the first difference are the same in both.
        self.step_hits.extend(
            core.iter()
                .zip(&vllm)
                .take_while(|(c, v)| c == v)
                .zip(ids)
                .filter(|((c, _), _)| **c == LookupResult::Hit)
                .map(|(_, &id)| id),
        );
        // A promotion evicting a protected hit shows in the events first.
        self.compare_events(n, "lookups")?;
        same(n, "lookup answers", core, vllm)
    }

    fn prepare_load(&mut self, n: usize, ids: &[u64]) -> Result<Vec<i64>, ReplayError> {
        let core = self.core.prepare_load(n, ids)?;
        let vllm = self.vllm.prepare_load(n, ids)?;
        same(n, "prepare_load slots", core, vllm)
    }

    fn complete_load(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        self.core.complete_load(n, ids)?;
        self.vllm.complete_load(n, ids)
    }

    fn prepare_store(&mut self, n: usize, ids: &[u64]) -> Result<Option<Store>, ReplayError> {
        let core = self.core.prepare_store(n, ids)?;
        let vllm = self.vllm.prepare_store(n, ids)?;
        match (&core, &vllm) {
            (Some(c), Some(v)) => {
                same(n, "keys to store", &c.keys, &v.keys)?;
                same(n, "store slots", &c.slots, &v.slots)?;
                same(n, "evicted keys, in order", &c.evicted, &v.evicted)?;
            }
            _ => {
                same(n, "prepare_store (None = refused)", &core, &vllm)?;
            }
        }
        self.compare_events(n, "prepare_store")?;
        Ok(core)
    }

    fn complete_store(&mut self, n: usize, ids: &[u64]) -> Result<(), ReplayError> {
        self.core.complete_store(n, ids)?;
        self.vllm.complete_store(n, ids)?;
        self.compare_events(n, "complete_store")
    }

    fn finished(&mut self, n: usize) -> Result<(), ReplayError> {
        self.core.finished(n)?;
        self.vllm.finished(n)
    }

    fn end_step(&mut self, n: usize, new: Option<usize>) -> Result<(), ReplayError> {
        self.core.end_step_only();
        self.vllm.schedule_end(n, new)?;
        self.step_hits.clear();
        self.compare_events(n, "end_step")?;
        self.compare_jobs(n)
    }

    fn end_request(&mut self, n: usize) -> Result<(), ReplayError> {
        self.vllm
            .o
            .drop_request(&name(n))
            .map_err(OracleEngine::err(n))?;
        self.compare_events(n, "the request")
    }

    fn evicted(&mut self, n: usize) -> Result<u64, ReplayError> {
        let core = self.core.evicted(n)?;
        let vllm = self.vllm.evicted(n)?;
        same(n, "evicted block counts", core, vllm)
    }
}

/// Whether a lookup pass over `ids` could start a promotion after a primary hit (the case
/// ★8 is about): a Ready block followed, before the first block no tier holds, by a block
/// only a tier holds.
fn may_promote_after_a_hit(m: &Manager, ids: &[u64]) -> bool {
    let mut hit = false;
    for &id in ids {
        let k = core_key(id);
        if m.primary().state_of(&k).is_some() {
            hit = true;
            continue;
        }
        let held = (0..m.config().tiers.len()).any(|t| {
            m.tier(TierId(t as u16))
                .is_some_and(|i| i.state_of(&k).is_some())
        });
        if !held {
            return false;
        }
        if hit {
            return true;
        }
    }
    false
}

/// Checks a ★8 case under LRU victim by victim: replays the pass's lookups on `probe` (the
/// core before the pass) and, at the first eviction where the two managers differ, asks the
/// core's policy for its first victim among the idle Ready blocks with and without the
/// request's hits of the step: without protection it must be vLLM's victim (one of those
/// hits), with it the core's (or none when the core refused the promotion).
fn check_hit_protection(
    mut probe: Manager,
    n: usize,
    ids: &[u64],
    core: &[u64],
    vllm: &[u64],
) -> Result<(), String> {
    use kvtier_core::policy::EvictionPolicy;
    use kvtier_core::{BlockState, SlotId};

    let i = core.iter().zip(vllm).take_while(|(c, v)| c == v).count();
    let vllm_victim = *vllm.get(i).ok_or("vLLM evicted no more than the core")?;
    let core_victim = core.get(i).copied();
    let req = RequestId(n as u64);
    let mut hits: Vec<Key> = Vec::new();
    let mut evictions = 0usize;
    for &id in ids {
        let first_victim = |probe: &Manager, hits: &[Key], protect: bool| -> Option<u64> {
            let p = probe.primary();
            let mut out = Vec::new();
            p.policy().select(
                1,
                &mut |slot| {
                    p.key_at(SlotId(slot)).is_some_and(|k| {
                        matches!(
                            p.state_of(k),
                            Some((
                                _,
                                BlockState::Ready {
                                    load_pins: 0,
                                    job_pins: 0
                                }
                            ))
                        ) && !(protect && hits.contains(k))
                    })
                },
                &mut out,
            );
            out.first()
                .and_then(|&s| p.key_at(SlotId(s)))
                .map(|k| block_id(k.as_bytes()))
        };
        let unprotected = first_victim(&probe, &hits, false);
        let protected = first_victim(&probe, &hits, true);
        let before = probe.stats().evictions;
        let k = core_key(id);
        let a = probe.lookup(req, &k);
        let evicted = (probe.stats().evictions - before) as usize;
        // A promotion the core refused (no room once the hits are protected) is a Miss for a
        // block a tier holds.
        let refused = a == Lookup::Miss
            && evictions == i
            && core_victim.is_none()
            && (0..probe.config().tiers.len()).any(|t| {
                probe
                    .tier(TierId(t as u16))
                    .is_some_and(|x| x.state_of(&k).is_some())
            });
        if evicted > 0 && evictions + evicted > i || refused {
            let hit_ids: Vec<u64> = hits.iter().map(|k| block_id(k.as_bytes())).collect();
            return if unprotected == Some(vllm_victim)
                && hit_ids.contains(&vllm_victim)
                && protected == core_victim
            {
                Ok(())
            } else {
                Err(format!(
                    "at block {id}: first victim {unprotected:?} without protection, \
                     {protected:?} with it; vLLM evicted {vllm_victim}, the core {core_victim:?}; \
                     hits of the step {hit_ids:?}"
                ))
            };
        }
        evictions += evicted;
        match a {
            Lookup::Hit => hits.push(k),
            Lookup::Miss => break,
            _ => {}
        }
    }
    Err("the pass never reached the eviction where they differ".into())
}

/// What a lockstep replay found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// What both observed (equal in both, request by request).
    pub totals: Totals,
    /// Named exceptions: rule → count.
    pub exceptions: BTreeMap<&'static str, u64>,
    /// Requests after which both managers restarted with empty primaries over their tiers'
    /// blocks, because a named exception left them holding different blocks.
    pub resyncs: u64,
    /// What each resynchronized exception was.
    pub diverged: Vec<String>,
}

/// Replays `trace` through the core and vLLM (in `o`) in lockstep, comparing every answer.
/// Returns the first unexplained [`Difference`] as an error.
pub fn lockstep(o: &mut VllmOracle, trace: &Trace, setup: &Setup) -> Result<Report, ReplayError> {
    let pair = Pair::new(o, setup).map_err(|error| ReplayError::Oracle { request: 0, error })?;
    run_lockstep(pair, trace)
}

/// Replays `trace` through both engines of `pair`, comparing every answer (as [`lockstep`]).
pub fn run_lockstep(mut pair: Pair<'_>, trace: &Trace) -> Result<Report, ReplayError> {
    let mut report = Report::default();
    for (n, ids) in trace.requests.iter().enumerate() {
        let mut t = Totals::default();
        match run_request(&mut pair, n, ids, &mut t) {
            Ok(()) => {}
            Err(ReplayError::Diverged {
                request,
                rule,
                detail,
            }) => {
                *pair.exceptions.entry(rule).or_default() += 1;
                report
                    .diverged
                    .push(format!("request {request}: {rule}: {detail}"));
                report.resyncs += 1;
                pair.resync(n)?;
                // The request runs again from its start, on the restarted managers.
                t = Totals::default();
                run_request(&mut pair, n, ids, &mut t)?;
            }
            Err(e) => return Err(e),
        }
        report.totals.add(&t);
    }
    if let Err(v) = pair.core.m.check_invariants() {
        return Err(ReplayError::Differ(Box::new(Difference {
            request: trace.requests.len(),
            what: "the core's invariants at the end".into(),
            core: format!("{v:?}"),
            vllm: "-".into(),
        })));
    }
    report.exceptions = pair.exceptions;
    Ok(report)
}

/// Replays `trace` through one engine alone.
pub fn standalone<E: Engine>(e: &mut E, trace: &Trace) -> Result<Totals, ReplayError> {
    let mut t = Totals::default();
    for (n, ids) in trace.requests.iter().enumerate() {
        run_request(e, n, ids, &mut t)?;
    }
    Ok(t)
}

/// The trace's keys, built once (outside any timing).
pub fn core_keys(trace: &Trace) -> Vec<Vec<Key>> {
    let mut keys: HashMap<u64, Key> = HashMap::new();
    trace
        .requests
        .iter()
        .map(|ids| {
            ids.iter()
                .map(|&id| keys.entry(id).or_insert_with(|| core_key(id)).clone())
                .collect()
        })
        .collect()
}

/// The core alone on the primary of `setup` (no tiers, events off), the sequence of
/// [`run_request`] with nothing observed beyond the totals; returns them and the time spent
/// in the loop (the manager's construction and the keys are outside it).
pub fn replay_core(keys: &[Vec<Key>], setup: &Setup) -> (Totals, Duration) {
    let mut primary = setup.clone();
    primary.tiers.clear();
    let mut m = Manager::new(primary.core_config(false)).expect("a valid setup");
    let mut t = Totals::default();
    let start = Instant::now();
    for (n, keys) in keys.iter().enumerate() {
        let req = RequestId(n as u64);
        m.new_request(req);
        for (i, k) in keys.iter().enumerate() {
            m.set_position(req, k, setup.block_tokens * (i as u64 + 1));
        }
        let mut hits = 0;
        let mut deferred = false;
        let mut looked = 0;
        for k in keys {
            looked += 1;
            match m.lookup(req, k) {
                Lookup::Miss => break,
                Lookup::Retry => deferred = true,
                Lookup::HitPending => {
                    deferred = true;
                    hits += 1;
                }
                _ => hits += 1,
            }
        }
        assert!(
            !deferred,
            "the primary alone never defers one request at a time"
        );
        t.block_ops += looked;
        t.hits += hits as u64;
        if hits > 0 {
            let loaded = &keys[..hits];
            m.prepare_load(req, loaded).expect("hits are Ready");
            m.end_step();
            m.complete_load(loaded).expect("loads are pinned");
            t.block_ops += 2 * hits as u64;
        }
        if hits < keys.len() {
            let rest = &keys[hits..];
            t.block_ops += rest.len() as u64;
            let out = m.prepare_store(req, rest);
            m.end_step();
            match out {
                Ok(p) => {
                    t.stored += p.keys.len() as u64;
                    t.evicted += p.evicted.len() as u64;
                    if !p.keys.is_empty() {
                        m.complete_store(req, &p.keys, true);
                        t.block_ops += p.keys.len() as u64;
                    }
                }
                Err(_) => t.store_refused += 1,
            }
        }
        m.request_finished(req);
        m.end_step();
        t.requests += 1;
        t.blocks += keys.len() as u64;
        t.loaded += hits as u64;
    }
    let elapsed = start.elapsed();
    (t, elapsed)
}
