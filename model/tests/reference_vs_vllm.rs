//! `kvtier-core` and the reference model against vLLM 0.33.0's own `CPUOffloadingManager`:
//! random call sequences (the primary alone, LRU and ARC, 1–8 blocks, a dozen keys in three
//! KV-cache groups, up to three live requests with positions for most of their keys, requests
//! finishing and new ones starting, stores that succeed or fail, loads and their completions,
//! touches, the reuse filter on or off) go to the core's [`Manager`], to [`RefModel`] and,
//! through the oracle, to vLLM. Every answer of both is compared with vLLM's: lookups,
//! `prepare_store`'s keys, slots and victims (vLLM's `None` is kvtier's `Err(NoRoom)`),
//! `prepare_load`'s slots, the events (vLLM's `metadata_only` removal is kvtier's `Discarded`),
//! and after every call the stats (usage, write and read usage, allocation sizes, skipped
//! stores: the core's `take_metrics` against vLLM's `get_stats`) and the reference's whole
//! primary: slots handed out, the free stack, every block's slot and state, and the policy's
//! order (LRU: the blocks by rank; ARC: T1, T2, B1, B2, p).
//!
//! Only calls that are valid in vLLM are generated: loads of Ready blocks, load completions
//! of pinned blocks, no key twice in one call, nothing for a finished request but the
//! completions of its stores.
//!
//! Needs the install of `scripts/vllm-oracle-setup.sh`. Without it the test prints a loud
//! skip message and passes, except under `CI=true`, where it fails with the setup message.
//! `PROPTEST_CASES` sets the number of cases.

use std::cell::RefCell;
use std::io::Write;

use kvtier_core::{
    Config, Error, Event, EventKind, Key, Lookup, Manager, Medium, PolicyKind, PreparedStore,
    RequestId, ReuseFilter,
};
use kvtier_model::oracle::{
    self, CpuConfig, LookupResult, OracleError, Policy, PolicyState, VllmOracle,
};
use kvtier_model::{PolicyView, PrimaryView, RefModel};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestError, TestRunner};

/// Cases run when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 10_000;
/// Keys of the alphabet.
const KEYS: u8 = 12;
/// Most live requests at once.
const MAX_LIVE: usize = 3;

/// The oracle, or `None` (after a loud message) when it is not installed outside CI.
fn spawn_oracle() -> Option<VllmOracle> {
    VllmOracle::spawn_or_skip()
}

/// Key `i` of the alphabet: a one-byte block hash and vLLM's 4-byte big-endian group index
/// (three groups).
fn key_bytes(i: u8) -> Vec<u8> {
    let i = i % KEYS;
    let mut bytes = vec![0xb0 + i];
    bytes.extend_from_slice(&u32::from(i % 3).to_be_bytes());
    bytes
}

fn core_key(i: u8) -> Key {
    Key::new(&key_bytes(i))
}

fn oracle_key(k: &Key) -> oracle::Key {
    oracle::Key(k.as_bytes().to_vec())
}

fn core_of(k: &oracle::Key) -> Key {
    Key::new(&k.0)
}

/// The distinct keys of a list, in first-occurrence order.
fn distinct(ids: &[u8]) -> Vec<Key> {
    let mut out: Vec<Key> = Vec::new();
    for &i in ids {
        let k = core_key(i);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// One generated call; request and block choices are resolved against the state when it
/// runs, so every call is valid in vLLM.
#[derive(Clone, Debug)]
enum Action {
    /// A new request, with an end-token position (times 16) for the keys that have one.
    NewRequest { positions: Vec<Option<u8>> },
    /// A live request's position of a key changes (or is set).
    SetPosition { req: u8, key: u8, pos: u8 },
    /// A live request finishes.
    Finish { req: u8 },
    /// `lookup`.
    Lookup { req: u8, key: u8 },
    /// `prepare_store` of distinct keys.
    Store { req: u8, keys: Vec<u8> },
    /// `complete_store` of an outstanding store's keys (those whose bit is set).
    CompleteStore { pick: u8, mask: u8, ok: bool },
    /// `complete_store` of arbitrary keys (vLLM ignores those not being stored).
    CompleteAny { req: u8, keys: Vec<u8>, ok: bool },
    /// `prepare_load` of the listed keys that are Ready.
    Load { req: u8, keys: Vec<u8> },
    /// `complete_load` of an outstanding load's keys (those whose bit is set).
    CompleteLoad { pick: u8, mask: u8 },
    /// `touch`.
    Touch { req: u8, keys: Vec<u8> },
    /// `end_step` / `on_schedule_end`.
    EndStep,
}

fn key_list(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(0..KEYS, 1..=max)
}

/// A request's positions: most keys have one, end tokens 16..=128 (ties included).
fn positions() -> impl Strategy<Value = Vec<Option<u8>>> {
    proptest::collection::vec(
        prop_oneof![1 => Just(None), 6 => (1..=8u8).prop_map(Some)],
        KEYS as usize,
    )
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => positions().prop_map(|positions| Action::NewRequest { positions }),
        1 => (any::<u8>(), 0..KEYS, 1..=8u8)
            .prop_map(|(req, key, pos)| Action::SetPosition { req, key, pos }),
        3 => any::<u8>().prop_map(|req| Action::Finish { req }),
        3 => (any::<u8>(), 0..KEYS).prop_map(|(req, key)| Action::Lookup { req, key }),
        5 => (any::<u8>(), key_list(5)).prop_map(|(req, keys)| Action::Store { req, keys }),
        6 => (any::<u8>(), any::<u8>(), prop_oneof![6 => Just(true), 1 => Just(false)])
            .prop_map(|(pick, mask, ok)| Action::CompleteStore { pick, mask, ok }),
        1 => (any::<u8>(), key_list(3), any::<bool>())
            .prop_map(|(req, keys, ok)| Action::CompleteAny { req, keys, ok }),
        5 => (any::<u8>(), key_list(4)).prop_map(|(req, keys)| Action::Load { req, keys }),
        4 => (any::<u8>(), any::<u8>()).prop_map(|(pick, mask)| Action::CompleteLoad { pick, mask }),
        2 => (any::<u8>(), key_list(4)).prop_map(|(req, keys)| Action::Touch { req, keys }),
        1 => Just(Action::EndStep),
    ]
}

/// The primary's configuration: policy, blocks, reuse filter (threshold, tracker size).
#[derive(Clone, Debug)]
struct Setup {
    arc: bool,
    blocks: u32,
    reuse: Option<(u32, u32)>,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        any::<bool>(),
        1..=8u32,
        prop_oneof![3 => Just(None), 1 => (2..=3u32, 1..=8u32).prop_map(Some)],
    )
        .prop_map(|(arc, blocks, reuse)| Setup { arc, blocks, reuse })
}

/// One request's name on both sides.
fn name(req: RequestId) -> String {
    format!("r{}", req.0)
}

fn fail(step: usize, action: &str, what: String) -> TestCaseError {
    TestCaseError::fail(format!("call {step} ({action}): {what}"))
}

/// How often the interesting answers came up, over all cases (printed at the end, so a
/// generator that stops reaching them shows).
#[derive(Debug, Default)]
struct Coverage {
    lookups: [u64; 4],
    stores: u64,
    refused: u64,
    evicted: u64,
    skipped: u64,
    loads: u64,
    finished_with_keys: u64,
    ghost_hits: u64,
    arc_t2_victims: u64,
    lru_rank_ties: u64,
}

/// Both sides, and what the test tracks to keep every call valid.
struct Run<'a> {
    seen: &'a mut Coverage,
    o: &'a mut VllmOracle,
    m: RefModel,
    /// The core, driven with the same calls.
    c: Manager,
    next_req: u64,
    live: Vec<RequestId>,
    /// Prepared stores not yet completed in full: (request, keys).
    stores: Vec<(RequestId, Vec<Key>)>,
    /// Prepared loads not yet completed in full: (request, keys).
    loads: Vec<(RequestId, Vec<Key>)>,
    reuse: bool,
    /// vLLM's skipped-store counter, summed over `get_stats` calls.
    skipped: u64,
}

/// Turns an oracle error into a test failure.
fn oracle_err(e: OracleError) -> String {
    format!("the oracle failed: {e}")
}

impl Run<'_> {
    fn pick_live(&self, pick: u8) -> Option<RequestId> {
        (!self.live.is_empty()).then(|| self.live[usize::from(pick) % self.live.len()])
    }

    fn new_request(&mut self, positions: &[Option<u8>]) -> Result<(), String> {
        if self.live.len() >= MAX_LIVE {
            return Ok(());
        }
        let req = RequestId(self.next_req);
        self.next_req += 1;
        self.live.push(req);
        self.m.new_request(req);
        self.c.new_request(req);
        self.o.new_request(&name(req)).map_err(oracle_err)?;
        let mut set = Vec::new();
        for (i, pos) in positions.iter().enumerate() {
            if let Some(p) = pos {
                let k = core_key(i as u8);
                let end = 16 * u64::from(*p);
                self.m.set_position(req, &k, end);
                self.c.set_position(req, &k, end);
                set.push((oracle_key(&k), end));
            }
        }
        self.o.set_positions(&name(req), &set).map_err(oracle_err)
    }

    /// Runs one action and compares its answer.
    fn act(&mut self, action: &Action) -> Result<(), String> {
        match action {
            Action::NewRequest { positions } => self.new_request(positions)?,
            Action::SetPosition { req, key, pos } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                let k = core_key(*key);
                let end = 16 * u64::from(*pos);
                self.m.set_position(req, &k, end);
                self.c.set_position(req, &k, end);
                self.o
                    .set_positions(&name(req), &[(oracle_key(&k), end)])
                    .map_err(oracle_err)?;
            }
            Action::Finish { req } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                self.live.retain(|r| *r != req);
                let before = self.m.primary_view();
                self.m.request_finished(req);
                self.c.request_finished(req);
                if before != self.m.primary_view() {
                    self.seen.finished_with_keys += 1;
                }
                self.o.request_finished(&name(req)).map_err(oracle_err)?;
            }
            Action::Lookup { req, key } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                let k = core_key(*key);
                let model = self.m.lookup(req, &k);
                let core = self.c.lookup(req, &k);
                let vllm = self
                    .o
                    .lookup(&name(req), &oracle_key(&k))
                    .map_err(oracle_err)?;
                let expected = match vllm {
                    LookupResult::Hit => Lookup::Hit,
                    LookupResult::HitPending => Lookup::HitPending,
                    LookupResult::Retry => Lookup::Retry,
                    LookupResult::Miss => Lookup::Miss,
                };
                if model != expected {
                    return Err(format!("lookup: model {model:?}, vLLM {vllm:?}"));
                }
                if core != expected {
                    return Err(format!("lookup: core {core:?}, vLLM {vllm:?}"));
                }
                self.seen.lookups[vllm as usize] += 1;
            }
            Action::Store { req, keys } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                let keys = distinct(keys);
                let okeys: Vec<oracle::Key> = keys.iter().map(oracle_key).collect();
                let before = self.m.primary_view();
                let model = self.m.prepare_store(req, &keys);
                let core = self.c.prepare_store(req, &keys);
                if arc_p(&before) != arc_p(&self.m.primary_view()) {
                    self.seen.ghost_hits += 1;
                }
                let vllm = self
                    .o
                    .prepare_store(&name(req), &okeys)
                    .map_err(oracle_err)?;
                self.seen.stores += 1;
                same_store("core", &core, &vllm)?;
                match (&model, &vllm) {
                    (Err(Error::NoRoom { .. }), None) => self.seen.refused += 1,
                    (Ok(p), Some(v)) => {
                        let slots: Vec<i64> = p.slots.iter().map(|s| i64::from(s.0)).collect();
                        let v_keys: Vec<Key> = v.keys_to_store.iter().map(core_of).collect();
                        let v_evicted: Vec<Key> = v.evicted_keys.iter().map(core_of).collect();
                        if (&p.keys, &slots, &p.evicted) != (&v_keys, &v.block_ids, &v_evicted) {
                            return Err(format!("prepare_store: model {p:?}, vLLM {v:?}"));
                        }
                        if !p.keys.is_empty() {
                            self.stores.push((req, p.keys.clone()));
                        }
                        self.seen.evicted += p.evicted.len() as u64;
                        if let PolicyView::Arc { t2, .. } = before.policy {
                            let from_t2 = p.evicted.iter().filter(|k| t2.contains(k)).count();
                            self.seen.arc_t2_victims += from_t2 as u64;
                        }
                    }
                    _ => return Err(format!("prepare_store: model {model:?}, vLLM {vllm:?}")),
                }
            }
            Action::CompleteStore { pick, mask, ok } => {
                if self.stores.is_empty() {
                    return Ok(());
                }
                let i = usize::from(*pick) % self.stores.len();
                let (req, keys) = self.stores[i].clone();
                let (done, rest): (Vec<Key>, Vec<Key>) = keys
                    .iter()
                    .enumerate()
                    .partition_map(|(j, k)| (mask >> (j % 8) & 1 == 1, k.clone()));
                let done = if done.is_empty() { keys.clone() } else { done };
                if rest.is_empty() || done.len() == keys.len() {
                    self.stores.remove(i);
                } else {
                    self.stores[i].1 = rest;
                }
                self.m.complete_store(req, &done, *ok);
                self.c.complete_store(req, &done, *ok);
                let okeys: Vec<oracle::Key> = done.iter().map(oracle_key).collect();
                self.o
                    .complete_store(&name(req), &okeys, *ok)
                    .map_err(oracle_err)?;
            }
            Action::CompleteAny { req, keys, ok } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                let keys = distinct(keys);
                self.m.complete_store(req, &keys, *ok);
                self.c.complete_store(req, &keys, *ok);
                let okeys: Vec<oracle::Key> = keys.iter().map(oracle_key).collect();
                self.o
                    .complete_store(&name(req), &okeys, *ok)
                    .map_err(oracle_err)?;
            }
            Action::Load { req, keys } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                let view = self.m.primary_view();
                let keys: Vec<Key> = distinct(keys)
                    .into_iter()
                    .filter(|k| view.blocks.iter().any(|b| &b.key == k && b.ready))
                    .collect();
                if keys.is_empty() {
                    return Ok(());
                }
                let model = self
                    .m
                    .prepare_load(req, &keys)
                    .map_err(|e| format!("prepare_load of Ready blocks refused: {e}"))?;
                let core = self
                    .c
                    .prepare_load(req, &keys)
                    .map_err(|e| format!("core: prepare_load of Ready blocks refused: {e}"))?;
                let okeys: Vec<oracle::Key> = keys.iter().map(oracle_key).collect();
                let vllm = self
                    .o
                    .prepare_load(&name(req), &okeys)
                    .map_err(oracle_err)?;
                let slots: Vec<i64> = model.iter().map(|s| i64::from(s.0)).collect();
                if slots != vllm {
                    return Err(format!("prepare_load: model {slots:?}, vLLM {vllm:?}"));
                }
                let slots: Vec<i64> = core.iter().map(|s| i64::from(s.0)).collect();
                if slots != vllm {
                    return Err(format!("prepare_load: core {slots:?}, vLLM {vllm:?}"));
                }
                self.loads.push((req, keys));
                self.seen.loads += 1;
            }
            Action::CompleteLoad { pick, mask } => {
                if self.loads.is_empty() {
                    return Ok(());
                }
                let i = usize::from(*pick) % self.loads.len();
                let (req, keys) = self.loads[i].clone();
                let (done, rest): (Vec<Key>, Vec<Key>) = keys
                    .iter()
                    .enumerate()
                    .partition_map(|(j, k)| (mask >> (j % 8) & 1 == 1, k.clone()));
                let done = if done.is_empty() { keys.clone() } else { done };
                if rest.is_empty() || done.len() == keys.len() {
                    self.loads.remove(i);
                } else {
                    self.loads[i].1 = rest;
                }
                self.m
                    .complete_load(&done)
                    .map_err(|e| format!("complete_load of pinned blocks refused: {e}"))?;
                self.c
                    .complete_load(&done)
                    .map_err(|e| format!("core: complete_load of pinned blocks refused: {e}"))?;
                let okeys: Vec<oracle::Key> = done.iter().map(oracle_key).collect();
                self.o
                    .complete_load(&name(req), &okeys)
                    .map_err(oracle_err)?;
            }
            Action::Touch { req, keys } => {
                let Some(req) = self.pick_live(*req) else {
                    return Ok(());
                };
                let keys = distinct(keys);
                let p = arc_p(&self.m.primary_view());
                self.m.touch(&keys);
                self.c.touch(&keys);
                if p != arc_p(&self.m.primary_view()) {
                    self.seen.ghost_hits += 1;
                }
                let okeys: Vec<oracle::Key> = keys.iter().map(oracle_key).collect();
                self.o.touch(&name(req), &okeys).map_err(oracle_err)?;
            }
            Action::EndStep => {
                self.m.end_step();
                self.c.end_step();
                self.o.schedule_end(&[], &[]).map_err(oracle_err)?;
            }
        }
        Ok(())
    }

    /// The events and the whole primary must agree.
    fn compare_state(&mut self) -> Result<(), String> {
        let vllm: Vec<Shape> = self
            .o
            .take_events()
            .map_err(oracle_err)?
            .into_iter()
            .map(|e| {
                let kind = match (e.removed, e.metadata_only) {
                    (false, _) => EventKind::Stored,
                    (true, false) => EventKind::Removed,
                    (true, true) => EventKind::Discarded,
                };
                (kind, e.keys.iter().map(core_of).collect())
            })
            .collect();
        for (who, events) in [
            ("model", self.m.take_events()),
            ("core", self.c.take_events()),
        ] {
            let events = shapes(events);
            if events != vllm {
                return Err(format!("events: {who} {events:?}, vLLM {vllm:?}"));
            }
        }
        self.compare_stats()?;
        let state = self.o.inspect().map_err(oracle_err)?;
        let view: PrimaryView = self.m.primary_view();
        let free: Vec<i64> = view.free.iter().map(|s| i64::from(s.0)).collect();
        if (view.fresh_used, &free) != (state.allocated, &state.free_list) {
            return Err(format!(
                "slots (handed out, free stack): model {:?}, vLLM {:?}",
                (view.fresh_used, &free),
                (state.allocated, &state.free_list)
            ));
        }
        let model_blocks: Vec<(Key, i64, i32)> = view
            .blocks
            .iter()
            .map(|b| {
                let refs = if b.ready { b.pins as i32 } else { -1 };
                (b.key.clone(), i64::from(b.slot.0), refs)
            })
            .collect();
        let mut vllm_blocks: Vec<(Key, i64, i32)> = state
            .blocks
            .iter()
            .map(|b| (core_of(&b.key), b.block_id, b.ref_cnt))
            .collect();
        vllm_blocks.sort();
        if model_blocks != vllm_blocks {
            return Err(format!(
                "blocks (key, slot, ref count): model {model_blocks:?}, vLLM {vllm_blocks:?}"
            ));
        }
        match (&view.policy, &state.policy) {
            (PolicyView::Lru { order }, PolicyState::Lru { order: v, .. }) => {
                // vLLM lists blocks of equal rank in insertion order and evicts them in key
                // order; the model lists them in key order: compare each rank's set.
                let v: Vec<Key> = v.iter().map(core_of).collect();
                let mut at = 0;
                let mut same = order.iter().map(Vec::len).sum::<usize>() == v.len();
                for run in order {
                    if !same {
                        break;
                    }
                    let mut theirs = v[at..at + run.len()].to_vec();
                    theirs.sort();
                    same = &theirs == run;
                    at += run.len();
                }
                if !same {
                    return Err(format!(
                        "LRU order (grouped by rank): model {order:?}, vLLM {v:?}"
                    ));
                }
                self.seen.lru_rank_ties += order.iter().filter(|run| run.len() > 1).count() as u64;
            }
            (
                PolicyView::Arc { p, t1, t2, b1, b2 },
                PolicyState::Arc {
                    target_t1_size,
                    t1: vt1,
                    t2: vt2,
                    b1: vb1,
                    b2: vb2,
                },
            ) => {
                let conv = |l: &[oracle::Key]| l.iter().map(core_of).collect::<Vec<Key>>();
                let model = (*p, t1, t2, b1, b2);
                let theirs = (
                    *target_t1_size,
                    &conv(vt1),
                    &conv(vt2),
                    &conv(vb1),
                    &conv(vb2),
                );
                if model != theirs {
                    return Err(format!(
                        "ARC (p, T1, T2, B1, B2): model {model:?}, vLLM {theirs:?}"
                    ));
                }
            }
            (m, v) => return Err(format!("policies differ: model {m:?}, vLLM {v:?}")),
        }
        Ok(())
    }
}

/// An event as (kind, keys): the primary alone.
type Shape = (EventKind, Vec<Key>);

fn shapes(events: Vec<Event>) -> Vec<Shape> {
    events
        .into_iter()
        .map(|Event { medium, kind, keys }| {
            assert_eq!(medium, Medium::Primary, "the primary alone");
            (kind, keys)
        })
        .collect()
}

/// `prepare_store`'s answer against vLLM's (`None` is `Err(NoRoom)`).
fn same_store(
    who: &str,
    ours: &Result<PreparedStore, Error>,
    vllm: &Option<oracle::PreparedStore>,
) -> Result<(), String> {
    let same = match (ours, vllm) {
        (Err(Error::NoRoom { .. }), None) => true,
        (Ok(p), Some(v)) => {
            let slots: Vec<i64> = p.slots.iter().map(|s| i64::from(s.0)).collect();
            let v_keys: Vec<Key> = v.keys_to_store.iter().map(core_of).collect();
            let v_evicted: Vec<Key> = v.evicted_keys.iter().map(core_of).collect();
            (&p.keys, &slots, &p.evicted) == (&v_keys, &v.block_ids, &v_evicted)
        }
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(format!("prepare_store: {who} {ours:?}, vLLM {vllm:?}"))
    }
}

impl Run<'_> {
    /// vLLM's `get_stats` against the core's metrics and the model's skipped stores: the
    /// gauges exactly (the same division of the same counts), the allocation sizes since the
    /// last call, the skipped stores.
    fn compare_stats(&mut self) -> Result<(), String> {
        let stats = self
            .o
            .get_stats()
            .map_err(oracle_err)?
            .ok_or("vLLM's CPU manager always reports stats")?;
        let number = |name: &str| match stats.get(name, &[]) {
            Some(oracle::MetricValue::Number(n)) => Ok(*n),
            other => Err(format!("{name}: {other:?}")),
        };
        let ours = self.c.take_metrics();
        let gauges = (ours.usage(), ours.write_usage(), ours.read_usage());
        let theirs = (
            number("vllm:kv_offload_cpu_cache_usage_perc")?,
            number("vllm:kv_offload_cpu_cache_write_usage_perc")?,
            number("vllm:kv_offload_cpu_cache_read_usage_perc")?,
        );
        if gauges != theirs {
            return Err(format!(
                "usage (total, write, read): core {gauges:?}, vLLM {theirs:?}"
            ));
        }
        let sizes: Vec<f64> = ours
            .allocation_sizes
            .iter()
            .map(|&n| f64::from(n))
            .collect();
        let v_sizes = match stats.get("vllm:kv_offload_cpu_allocation_size", &[]) {
            None => Vec::new(),
            Some(oracle::MetricValue::Samples(v)) => v.clone(),
            Some(other) => return Err(format!("allocation sizes: {other:?}")),
        };
        if sizes != v_sizes {
            return Err(format!(
                "allocation sizes: core {sizes:?}, vLLM {v_sizes:?}"
            ));
        }
        if self.reuse {
            let n = number("vllm:kv_offload_stores_skipped")? as u64;
            self.skipped += n;
            self.seen.skipped += n;
            if ours.stores_skipped != Some(n) {
                return Err(format!(
                    "stores skipped since the last call: core {:?}, vLLM {n}",
                    ours.stores_skipped
                ));
            }
            if self.m.stores_skipped() != self.skipped {
                return Err(format!(
                    "stores skipped: model {}, vLLM {}",
                    self.m.stores_skipped(),
                    self.skipped
                ));
            }
        } else if stats.get("vllm:kv_offload_stores_skipped", &[]).is_some()
            || ours.stores_skipped.is_some()
        {
            return Err("a skipped-store counter without a reuse filter".into());
        }
        Ok(())
    }
}

/// ARC's `p` (none under the other policies).
fn arc_p(view: &PrimaryView) -> Option<f64> {
    match view.policy {
        PolicyView::Arc { p, .. } => Some(p),
        PolicyView::Lru { .. } | PolicyView::Reuse { .. } => None,
    }
}

/// `Iterator::partition` by a predicate computed together with the item.
trait PartitionMap<T> {
    fn partition_map(self, f: impl Fn(T) -> (bool, Key)) -> (Vec<Key>, Vec<Key>);
}

impl<T, I: Iterator<Item = T>> PartitionMap<T> for I {
    fn partition_map(self, f: impl Fn(T) -> (bool, Key)) -> (Vec<Key>, Vec<Key>) {
        let (mut yes, mut no) = (Vec::new(), Vec::new());
        for item in self {
            let (take, k) = f(item);
            if take { yes.push(k) } else { no.push(k) }
        }
        (yes, no)
    }
}

fn run_case(
    o: &mut VllmOracle,
    seen: &mut Coverage,
    setup: &Setup,
    first: &[Option<u8>],
    actions: &[Action],
) -> Result<(), TestCaseError> {
    let policy = if setup.arc { Policy::Arc } else { Policy::Lru };
    let mut cpu = CpuConfig::new(setup.blocks, policy);
    let mut config = Config::new(setup.blocks);
    config.policy = if setup.arc {
        PolicyKind::Arc
    } else {
        PolicyKind::Lru
    };
    if let Some((store_threshold, max_tracker_size)) = setup.reuse {
        cpu.store_threshold = store_threshold;
        cpu.max_tracker_size = max_tracker_size;
        config.reuse = Some(ReuseFilter {
            store_threshold,
            max_tracker_size,
        });
    }
    o.create_cpu(&cpu)
        .map_err(|e| TestCaseError::fail(oracle_err(e)))?;
    let mut run = Run {
        seen,
        o,
        c: Manager::new(config.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?,
        m: RefModel::new(config),
        next_req: 0,
        live: Vec::new(),
        stores: Vec::new(),
        loads: Vec::new(),
        reuse: setup.reuse.is_some(),
        skipped: 0,
    };
    run.new_request(first)
        .map_err(|e| fail(0, "first request", e))?;
    let finish_all: Vec<Action> = (0..MAX_LIVE).map(|_| Action::Finish { req: 0 }).collect();
    for (i, a) in actions.iter().chain(&finish_all).enumerate() {
        let label = format!("{a:?}");
        run.act(a).map_err(|e| fail(i + 1, &label, e))?;
        run.compare_state().map_err(|e| fail(i + 1, &label, e))?;
    }
    Ok(())
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "a release build: scripts/test.sh runs it with --release (121 s; 288 s in debug)"
)]
fn the_core_and_the_reference_model_answer_as_vllm_does() {
    let Some(o) = spawn_oracle() else { return };
    let o = RefCell::new(o);
    let seen = RefCell::new(Coverage::default());
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    let mut runner = TestRunner::new(RunnerConfig {
        cases,
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    let strategy = (
        setup(),
        positions(),
        proptest::collection::vec(action(), 1..80),
    );
    let started = std::time::Instant::now();
    let result = runner.run(&strategy, |(setup, first, actions)| {
        run_case(
            &mut o.borrow_mut(),
            &mut seen.borrow_mut(),
            &setup,
            &first,
            &actions,
        )
    });
    match result {
        Ok(()) => {
            let _ = writeln!(
                std::io::stderr(),
                "{cases} cases: the core and the model agreed with vLLM in {:.1} s; {:?}",
                started.elapsed().as_secs_f64(),
                seen.borrow()
            );
        }
        Err(TestError::Fail(why, (setup, first, actions))) => {
            panic!(
                "{why}\nsetup: {setup:?}\nfirst request's positions: {first:?}\nactions: {actions:#?}"
            )
        }
        Err(e) => panic!("{e}"),
    }
}
