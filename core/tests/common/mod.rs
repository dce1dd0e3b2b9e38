//! Helpers shared by the scenario tests.
#![allow(dead_code, unreachable_pub)]

use kvtier_core::{
    Config, Effect, Job, JobKind, JobResult, Key, Manager, Outcome, PolicyKind, RequestId,
    TierConfig, TierId, TierKind,
};

pub const R1: RequestId = RequestId(1);
pub const R2: RequestId = RequestId(2);

pub fn key(i: u32) -> Key {
    Key::from(i.to_be_bytes())
}

pub fn keys(ids: impl IntoIterator<Item = u32>) -> Vec<Key> {
    ids.into_iter().map(key).collect()
}

/// A manager with a primary of `num_blocks` and authoritative tiers of the given capacities.
pub fn manager(num_blocks: u32, tiers: &[u32]) -> Manager {
    let mut c = Config::new(num_blocks);
    c.tiers = tiers
        .iter()
        .map(|&cap| TierConfig::new(TierKind::Authoritative, cap))
        .collect();
    Manager::new(c).unwrap()
}

pub fn manager_with(c: Config) -> Manager {
    Manager::new(c).unwrap()
}

pub fn arc_config(num_blocks: u32) -> Config {
    let mut c = Config::new(num_blocks);
    c.policy = PolicyKind::Arc;
    c
}

/// Every effect polled so far.
pub fn drain(m: &mut Manager) -> Vec<Effect> {
    std::iter::from_fn(|| m.poll_effect()).collect()
}

/// The jobs among `effects`.
pub fn jobs(effects: &[Effect]) -> Vec<Job> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Submit(j) => Some(j.clone()),
            Effect::Delete { .. } => None,
        })
        .collect()
}

/// The deletes among `effects`, as (tier, keys).
pub fn deletes(effects: &[Effect]) -> Vec<(TierId, Vec<Key>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Delete { tier, keys } => Some((*tier, keys.clone())),
            Effect::Submit(_) => None,
        })
        .collect()
}

/// Reports `outcome` for every job.
pub fn report(m: &mut Manager, jobs: &[Job], outcome: Outcome) {
    for j in jobs {
        m.handle_job_result(JobResult {
            job: j.id,
            outcome: outcome.clone(),
        })
        .unwrap();
    }
}

/// Drains the effects and reports every job Ok; returns the jobs.
pub fn complete_all(m: &mut Manager) -> Vec<Job> {
    let js = jobs(&drain(m));
    report(m, &js, Outcome::Ok);
    js
}

/// prepare_store + complete_store(ok) of `ks` for `req`.
pub fn store(m: &mut Manager, req: RequestId, ks: &[Key]) {
    m.prepare_store(req, ks).unwrap();
    m.complete_store(req, ks, true);
}

/// Stores `ks`, completes the cascade jobs and ends two steps: `prepare_store` collected in
/// this step already, so the results are applied at the next step's collection (M1).
pub fn store_and_settle(m: &mut Manager, req: RequestId, ks: &[Key]) {
    store(m, req, ks);
    complete_all(m);
    m.end_step();
    m.end_step();
}

/// A deterministic fingerprint of the whole state (BTreeMaps and Vecs only).
pub fn fingerprint(m: &Manager) -> String {
    format!("{m:?}")
}

pub fn load_keys(job: &Job) -> Vec<Key> {
    match &job.kind {
        JobKind::Load { blocks, .. } | JobKind::Store { blocks, .. } => {
            blocks.iter().map(|b| b.key.clone()).collect()
        }
        _ => Vec::new(),
    }
}

/// xorshift64*: deterministic, seeded, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
