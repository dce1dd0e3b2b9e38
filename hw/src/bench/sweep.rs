//! `kvtier bench --policy a,b --fraction x,y`: the primary's hit ratio for several eviction
//! policies and capacities, in one table beside Belady's optimum.
//!
//! Each cell replays the workload through the core's [`Manager`] alone (no region, no IO), one
//! request at a time, with vLLM 0.33's scheduler call sequence: `new_request`, the positions
//! of its keys, lookups until the first miss, `prepare_load` and `complete_load` of the hit
//! prefix, `prepare_store` and `complete_store` of the rest, `request_finished`, `end_step`.
//! A hit is a block answered Hit at its request's lookup. The policy alone decides the
//! figures, so a sweep of 3 policies × 3 capacities over the 122k-block Mooncake trace takes
//! seconds.
//!
//! With a secondary tier ([`SweepTier`]), the primary's evictions cascade to it and its blocks
//! are promoted back, as in a run, but every job ends at once and succeeds, in the order the
//! core submits it: the figures are the policies' alone, with IO that always keeps up (a run's
//! figures also depend on the disk: cascades skipped for back-pressure, promotions that end
//! after the request gave up waiting).

use std::fmt;

use kvtier_core::{
    Config, Effect, JobResult, Key, Lookup, Manager, Outcome, PolicyKind, RequestId, TierConfig,
    TierKind,
};

use super::BenchError;
use super::belady::optimal_hits;
use super::run::{BLOCK_TOKENS, key, policy_name};
use super::workload::Request;

/// A policy at a capacity: its counts are those of the replay with the first naming of the
/// keys (a single replay's), and `by_seed` holds every naming's ([`SweepReport::seeds`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SweepCell {
    /// The primary's policy.
    pub policy: &'static str,
    /// Blocks answered Hit from the primary.
    pub hits: u64,
    /// Blocks promoted from the secondary tier and then read (0 without one).
    pub promoted: u64,
    /// Blocks the primary evicted.
    pub evicted: u64,
    /// Blocks written to the secondary tier (0 without one): its IO, beside the hits.
    pub tier_writes: u64,
    /// Each naming's replay: its hits and promoted blocks together (the overall hits), the
    /// first naming's first.
    pub by_seed: Vec<u64>,
}

/// One capacity of a sweep.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SweepRow {
    /// The capacity as a fraction of the workload's distinct blocks.
    pub fraction: f64,
    /// The capacity in blocks.
    pub blocks: u32,
    /// Belady's optimum at this capacity (blocks that could be hits).
    pub optimum: u64,
    /// The secondary tier's capacity in blocks (0 without one).
    pub tier_blocks: u32,
    /// Belady's optimum with the primary's and the tier's capacity together.
    pub optimum_all: u64,
    /// One cell per policy, in the order asked.
    pub cells: Vec<SweepCell>,
}

/// A whole sweep.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SweepReport {
    /// Requests replayed.
    pub requests: usize,
    /// Block references (the hit ratio's denominator).
    pub blocks: u64,
    /// Distinct blocks (what the fractions are of).
    pub distinct: usize,
    /// One row per capacity, in the order asked.
    pub rows: Vec<SweepRow>,
    /// The secondary tier, if one was asked for.
    pub tier: Option<SweepTier>,
    /// Replays of each cell, the keys named differently in each (the same workload: the
    /// first naming is the one a single replay uses). LRU's choices never read a key's hash
    /// (ARC's ghost keeps 64-bit hashes, which practically never collide), so their replays
    /// agree; the reuse policy's filters and samples hash the keys, so one replay is one
    /// draw among many.
    pub seeds: u32,
}

/// A file-like (authoritative) secondary tier below the primary in a sweep.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct SweepTier {
    /// Its capacity as a fraction of the workload's distinct blocks.
    pub fraction: f64,
    /// Its eviction policy (`Lru` or `Arc`).
    #[serde(serialize_with = "policy_by_name")]
    pub policy: PolicyKind,
    /// Blocks of the primary's next victims written ahead at each step (a victim tier,
    /// `Admission::Victim`); 0: the tier is written when a store completes (vLLM's).
    pub victim_lookahead: u32,
}

fn policy_by_name<S: serde::Serializer>(p: &PolicyKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(policy_name(*p))
}

/// Replays `requests` under every policy at every fraction of the distinct blocks, above
/// `tier` if one is given, `seeds` times with the keys named differently each time.
pub fn sweep(
    requests: &[Request],
    policies: &[PolicyKind],
    fractions: &[f64],
    tier: Option<SweepTier>,
    seeds: u32,
) -> Result<SweepReport, BenchError> {
    if seeds == 0 {
        return Err(bad(
            "seeds (--seeds): at least one replay of each cell, got 0".into(),
        ));
    }
    let refs: Vec<u64> = requests
        .iter()
        .flat_map(|r| r.blocks.iter().copied())
        .collect();
    let distinct = {
        let mut d = refs.clone();
        d.sort_unstable();
        d.dedup();
        d.len()
    };
    if let Some(t) = tier
        && !(t.fraction > 0.0 && t.fraction <= 1.0 && t.policy != PolicyKind::Reuse)
    {
        return Err(bad(format!(
            "tier (--tier-fraction, --tier-policy): a capacity above 0 and at most 1 and the policy lru or arc, got {} and {}",
            t.fraction,
            policy_name(t.policy)
        )));
    }
    let tier_blocks = tier.map_or(0, |t| ((distinct as f64 * t.fraction) as u32).max(1));
    let below = tier.map(|t| (t.policy, tier_blocks, t.victim_lookahead));
    let mut rows = Vec::new();
    for &fraction in fractions {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(bad(format!(
                "fraction (--fraction): each capacity must be above 0 and at most 1, got {fraction}"
            )));
        }
        let blocks = ((distinct as f64 * fraction) as u32).max(1);
        let optimum = optimal_hits(&refs, blocks as usize);
        rows.push(SweepRow {
            fraction,
            blocks,
            optimum,
            tier_blocks,
            optimum_all: if tier.is_some() {
                optimal_hits(&refs, blocks as usize + tier_blocks as usize)
            } else {
                optimum
            },
            // Filled below, by the first naming's replays.
            cells: Vec::with_capacity(policies.len()),
        });
    }
    for seed in 0..seeds {
        let keys: Vec<Vec<Key>> = requests
            .iter()
            .map(|r| r.blocks.iter().map(|&b| seeded_key(b, seed)).collect())
            .collect();
        for row in &mut rows {
            for (i, &p) in policies.iter().enumerate() {
                let one = replay(&keys, p, row.blocks, below)?;
                match row.cells.get_mut(i) {
                    // Later namings add their overall hits to the first's cell.
                    Some(cell) => cell.by_seed.extend(one.by_seed),
                    None => row.cells.push(one),
                }
            }
        }
    }
    Ok(SweepReport {
        requests: requests.len(),
        blocks: refs.len() as u64,
        distinct,
        rows,
        tier,
        seeds,
    })
}

/// Block `block`'s key in naming `seed`: the bench's own key for the first, the block and
/// the seed's bytes for the others (another hash, the same block).
fn seeded_key(block: u64, seed: u32) -> Key {
    if seed == 0 {
        return key(block);
    }
    let mut bytes = [0; 12];
    bytes[..8].copy_from_slice(&block.to_le_bytes());
    bytes[8..].copy_from_slice(&seed.to_le_bytes());
    Key::new(&bytes)
}

fn bad(reason: String) -> BenchError {
    BenchError::Config {
        path: "-".into(),
        reason,
    }
}

fn replay(
    requests: &[Vec<Key>],
    policy: PolicyKind,
    blocks: u32,
    tier: Option<(PolicyKind, u32, u32)>,
) -> Result<SweepCell, BenchError> {
    let mut config = Config::new(blocks);
    config.policy = policy;
    config.events = false;
    if let Some((tier_policy, capacity, lookahead)) = tier {
        let mut t = TierConfig::new(TierKind::Authoritative, capacity);
        t.policy = tier_policy;
        if lookahead > 0 {
            t.admission = kvtier_core::Admission::Victim { lookahead };
        }
        config.tiers.push(t);
    }
    let core = |e: kvtier_core::Error| bad(format!("the core refused a call: {e}"));
    let mut m = Manager::new(config).map_err(|e| bad(e.to_string()))?;
    let (mut hits, mut promoted) = (0, 0);
    for (n, keys) in requests.iter().enumerate() {
        let req = RequestId(n as u64);
        m.new_request(req);
        for (i, k) in keys.iter().enumerate() {
            m.set_position(req, k, BLOCK_TOKENS * (i as u64 + 1));
        }
        // vLLM 0.33's scheduler: lookups until the first Miss; a HitPending or Retry answer
        // (a promotion, started by the lookup) defers the request a step, after which the
        // promotion has ended (every job ends at once) and the block is a Hit.
        // A block answered HitPending or Retry at any lookup is a promoted hit if read.
        let mut waited_for = vec![false; keys.len()];
        let mut waited = 0;
        let hit = loop {
            let mut deferred = false;
            let mut hit = 0;
            for (i, k) in keys.iter().enumerate() {
                match m.lookup(req, k) {
                    Lookup::Hit => hit += usize::from(!deferred),
                    Lookup::HitPending | Lookup::Retry => {
                        deferred = true;
                        waited_for[i] = true;
                    }
                    _ => break, // Miss
                }
            }
            if !deferred || waited == MAX_WAIT_STEPS {
                break hit;
            }
            waited += 1;
            m.end_step();
            end_jobs(&mut m)?;
        };
        let from_tier = waited_for[..hit].iter().filter(|&&w| w).count();
        hits += (hit - from_tier) as u64;
        promoted += from_tier as u64;
        if hit > 0 {
            m.prepare_load(req, &keys[..hit]).map_err(core)?;
            m.end_step();
            end_jobs(&mut m)?;
            m.complete_load(&keys[..hit]).map_err(core)?;
        }
        if hit < keys.len() {
            match m.prepare_store(req, &keys[hit..]) {
                Ok(p) => {
                    m.end_step();
                    end_jobs(&mut m)?;
                    if !p.keys.is_empty() {
                        m.complete_store(req, &p.keys, true);
                    }
                }
                Err(kvtier_core::Error::NoRoom { .. }) => m.end_step(),
                Err(e) => return Err(core(e)),
            }
        }
        m.request_finished(req);
        m.end_step();
        end_jobs(&mut m)?;
    }
    Ok(SweepCell {
        policy: policy_name(policy),
        hits,
        promoted,
        by_seed: vec![hits + promoted],
        evicted: m.stats().evictions,
        tier_writes: m
            .stats()
            .tiers
            .first()
            .map_or(0, |(_, t)| t.blocks_cascaded),
    })
}

/// Steps a request waits for its promotions at most (one is enough when every job ends at
/// once; more only if the core defers again).
const MAX_WAIT_STEPS: u32 = 4;

/// Ends every job the core has submitted, successfully, in order; the results apply at the
/// core's next collection.
fn end_jobs(m: &mut Manager) -> Result<(), BenchError> {
    while let Some(effect) = m.poll_effect() {
        if let Effect::Submit(job) = effect {
            m.handle_job_result(JobResult {
                job: job.id,
                outcome: Outcome::Ok,
            })
            .map_err(|e| bad(format!("the core refused a job's result: {e}")))?;
        }
    }
    Ok(())
}

impl fmt::Display for SweepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ratio = |hits: u64| hits as f64 / self.blocks.max(1) as f64;
        let seeds = u64::from(self.seeds.max(1));
        // With several namings, each cell's mean and its range, in a wider column.
        let width = if seeds > 1 { 32 } else { 16 };
        let below = match self.tier {
            None => "the primary alone".to_string(),
            Some(t) => format!(
                "above a secondary tier of {:.1} % ({}{}), every job ending at once",
                t.fraction * 100.0,
                policy_name(t.policy),
                match t.victim_lookahead {
                    0 => String::new(),
                    n => format!(", a victim tier writing the next {n} victims ahead"),
                }
            ),
        };
        writeln!(
            f,
            "policy sweep: {} requests, {} blocks, {} distinct; {below}, vLLM 0.33's call sequence",
            self.requests, self.blocks, self.distinct
        )?;
        write!(f, "{:>9} {:>9} {:>8}", "capacity", "blocks", "optimum")?;
        if let Some(row) = self.rows.first() {
            for c in &row.cells {
                write!(f, " {:>width$}", c.policy)?;
            }
        }
        writeln!(f)?;
        for row in &self.rows {
            write!(
                f,
                "{:>8.1}% {:>9} {:>8.4}",
                row.fraction * 100.0,
                row.blocks,
                ratio(row.optimum_all)
            )?;
            // Every naming's overall hits, summed: the mean's numerator.
            let all = |c: &SweepCell| c.by_seed.iter().sum::<u64>();
            let first = row.cells.first().map_or(0, all);
            for (i, c) in row.cells.iter().enumerate() {
                let mut cell = format!("{:.4}", ratio(all(c)) / seeds as f64);
                if i > 0 {
                    let vs = all(c) as f64 / first.max(1) as f64;
                    cell += &format!(" ({vs:.3}×)");
                }
                if seeds > 1 {
                    let (lo, hi) = c
                        .by_seed
                        .iter()
                        .fold((u64::MAX, 0), |(lo, hi), &h| (lo.min(h), hi.max(h)));
                    cell += &format!(" {:.4}–{:.4}", ratio(lo), ratio(hi));
                }
                write!(f, " {cell:>width$}")?;
            }
            writeln!(f)?;
        }
        if let Some(first) = self.rows.first().and_then(|r| r.cells.first()) {
            let what = if self.tier.is_some() {
                "overall hit ratio (the primary's hits and the tier's promoted ones); the optimum with both capacities"
            } else {
                "hit ratio of the primary"
            };
            writeln!(
                f,
                "{what}; (n×) is the hits against the first policy, {}",
                first.policy
            )?;
            if seeds > 1 {
                writeln!(
                    f,
                    "each cell replayed {seeds} times, the keys named differently each time: the mean, (n×) of the sums, then the lowest and the highest replay"
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two conversations that return in turn, and one-off requests between them: at a
    /// capacity that holds one conversation, the reuse-aware LRU keeps a returning one where
    /// LRU has let the one-offs push it out.
    fn workload() -> Vec<Request> {
        let mut out = Vec::new();
        let mut next = 1000;
        for turn in 0..6u64 {
            for conv in 0..2u64 {
                let base = conv * 100;
                out.push(Request::new((base..base + 4 + turn).collect()));
                for _ in 0..2 {
                    out.push(Request::new((next..next + 3).collect()));
                    next += 3;
                }
            }
        }
        out
    }

    #[test]
    fn a_sweep_replays_every_policy_at_every_capacity() {
        let w = workload();
        let policies = [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::Reuse];
        let r = sweep(&w, &policies, &[0.1, 0.5], None, 1).unwrap();
        assert_eq!(r.requests, w.len());
        assert_eq!(r.rows.len(), 2);
        for row in &r.rows {
            let names: Vec<_> = row.cells.iter().map(|c| c.policy).collect();
            assert_eq!(names, ["lru", "arc", "reuse"]);
            for c in &row.cells {
                assert!(
                    c.hits <= row.optimum,
                    "{c:?} above the optimum {}",
                    row.optimum
                );
            }
        }
        let text = r.to_string();
        assert!(text.contains("optimum") && text.contains("reuse"), "{text}");
    }

    #[test]
    fn a_tier_below_catches_what_the_primary_evicted() {
        let w = workload();
        let policies = [PolicyKind::Lru, PolicyKind::Reuse];
        let alone = sweep(&w, &policies, &[0.1], None, 1).unwrap();
        let tier = SweepTier {
            fraction: 0.5,
            policy: PolicyKind::Lru,
            victim_lookahead: 0,
        };
        let tiered = sweep(&w, &policies, &[0.1], Some(tier), 1).unwrap();
        let (a, t) = (&alone.rows[0], &tiered.rows[0]);
        assert_eq!(a.tier_blocks, 0);
        assert_eq!(a.optimum_all, a.optimum);
        assert!(t.tier_blocks > 0 && t.optimum_all > t.optimum, "{t:?}");
        for (a, t) in a.cells.iter().zip(&t.cells) {
            assert_eq!(a.promoted, 0, "no tier, no promotion: {a:?}");
            // A primary of a tenth keeps neither conversation; the tier holds both, so every
            // turn after the first reads its prefix back through a promotion.
            assert!(t.promoted > 0, "{t:?}");
            assert!(
                t.hits + t.promoted > a.hits && t.hits + t.promoted <= tiered.rows[0].optimum_all,
                "{a:?} then {t:?}"
            );
        }
        let text = tiered.to_string();
        assert!(text.contains("secondary tier of 50.0 % (lru)"), "{text}");
    }

    #[test]
    fn a_tier_out_of_range_or_of_the_reuse_policy_is_refused() {
        for (fraction, policy) in [(0.0, PolicyKind::Lru), (0.5, PolicyKind::Reuse)] {
            let tier = SweepTier {
                fraction,
                policy,
                victim_lookahead: 0,
            };
            let err = sweep(&workload(), &[PolicyKind::Lru], &[0.1], Some(tier), 1).unwrap_err();
            assert!(err.to_string().contains("--tier-fraction"), "{err}");
        }
    }

    #[test]
    fn a_capacity_out_of_range_is_refused() {
        let err = sweep(&workload(), &[PolicyKind::Lru], &[0.0], None, 1).unwrap_err();
        assert!(err.to_string().contains("--fraction"), "{err}");
        let err = sweep(&workload(), &[PolicyKind::Lru], &[0.1], None, 0).unwrap_err();
        assert!(err.to_string().contains("--seeds"), "{err}");
    }

    /// Several namings: a cell's counts are the first naming's, which a single replay
    /// gives, and each naming's overall hits are kept; LRU never reads a key's hash, so its
    /// replays agree.
    #[test]
    fn seeds_replay_each_cell_with_the_keys_named_anew() {
        let w = workload();
        let policies = [PolicyKind::Lru, PolicyKind::Reuse];
        let one = sweep(&w, &policies, &[0.1, 0.3], None, 1).unwrap();
        let three = sweep(&w, &policies, &[0.1, 0.3], None, 3).unwrap();
        assert_eq!(three.seeds, 3);
        for (a, b) in one.rows.iter().zip(&three.rows) {
            for (a, b) in a.cells.iter().zip(&b.cells) {
                assert_eq!(a.by_seed, [a.hits + a.promoted]);
                assert_eq!(b.by_seed.len(), 3);
                assert_eq!(
                    (b.hits, b.promoted, b.evicted, b.by_seed[0]),
                    (a.hits, a.promoted, a.evicted, a.by_seed[0]),
                    "the first naming is a single replay's"
                );
                if b.policy == "lru" {
                    assert!(b.by_seed.iter().all(|&h| h == a.hits), "{b:?}");
                }
            }
        }
        let text = three.to_string();
        assert!(
            text.contains("replayed 3 times") && text.contains('–'),
            "{text}"
        );
        assert!(!one.to_string().contains("replayed"));
    }

    /// Each naming gives every block another key, and so another hash (what the reuse
    /// policy's filters and samples read), while the first is the bench's own.
    #[test]
    fn each_naming_gives_other_keys_and_hashes() {
        for block in [0, 1, 1 << 40] {
            assert!(seeded_key(block, 0) == key(block));
            let keys: Vec<Key> = (0..4).map(|s| seeded_key(block, s)).collect();
            for (i, a) in keys.iter().enumerate() {
                for b in &keys[i + 1..] {
                    assert!(a != b && a.hash64() != b.hash64(), "{block}");
                }
            }
        }
        assert!(seeded_key(1, 1) != seeded_key(2, 1));
    }
}
