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

use std::fmt;

use kvtier_core::{Config, Key, Lookup, Manager, PolicyKind, RequestId};

use super::BenchError;
use super::belady::optimal_hits;
use super::run::{BLOCK_TOKENS, key, policy_name};
use super::workload::Request;

/// One replay: a policy at a capacity.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SweepCell {
    /// The primary's policy.
    pub policy: &'static str,
    /// Blocks answered Hit.
    pub hits: u64,
    /// Blocks the primary evicted.
    pub evicted: u64,
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
}

/// Replays `requests` under every policy at every fraction of the distinct blocks.
pub fn sweep(
    requests: &[Request],
    policies: &[PolicyKind],
    fractions: &[f64],
) -> Result<SweepReport, BenchError> {
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
    let keys: Vec<Vec<Key>> = requests
        .iter()
        .map(|r| r.blocks.iter().map(|&b| key(b)).collect())
        .collect();
    let mut rows = Vec::new();
    for &fraction in fractions {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(bad(format!(
                "fraction (--fraction): each capacity must be above 0 and at most 1, got {fraction}"
            )));
        }
        let blocks = ((distinct as f64 * fraction) as u32).max(1);
        let cells = policies
            .iter()
            .map(|&p| replay(&keys, p, blocks))
            .collect::<Result<_, _>>()?;
        rows.push(SweepRow {
            fraction,
            blocks,
            optimum: optimal_hits(&refs, blocks as usize),
            cells,
        });
    }
    Ok(SweepReport {
        requests: requests.len(),
        blocks: refs.len() as u64,
        distinct,
        rows,
    })
}

fn bad(reason: String) -> BenchError {
    BenchError::Config {
        path: "-".into(),
        reason,
    }
}

fn replay(requests: &[Vec<Key>], policy: PolicyKind, blocks: u32) -> Result<SweepCell, BenchError> {
    let mut config = Config::new(blocks);
    config.policy = policy;
    config.events = false;
    let core = |e: kvtier_core::Error| bad(format!("the core refused a call: {e}"));
    let mut m = Manager::new(config).map_err(|e| bad(e.to_string()))?;
    let mut hits = 0;
    for (n, keys) in requests.iter().enumerate() {
        let req = RequestId(n as u64);
        m.new_request(req);
        for (i, k) in keys.iter().enumerate() {
            m.set_position(req, k, BLOCK_TOKENS * (i as u64 + 1));
        }
        let hit = keys
            .iter()
            .take_while(|k| m.lookup(req, k) == Lookup::Hit)
            .count();
        hits += hit as u64;
        if hit > 0 {
            m.prepare_load(req, &keys[..hit]).map_err(core)?;
            m.end_step();
            m.complete_load(&keys[..hit]).map_err(core)?;
        }
        if hit < keys.len() {
            match m.prepare_store(req, &keys[hit..]) {
                Ok(p) => {
                    m.end_step();
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
    }
    Ok(SweepCell {
        policy: policy_name(policy),
        hits,
        evicted: m.stats().evictions,
    })
}

impl fmt::Display for SweepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ratio = |hits: u64| hits as f64 / self.blocks.max(1) as f64;
        writeln!(
            f,
            "policy sweep: {} requests, {} blocks, {} distinct; the primary alone, vLLM 0.33's call sequence",
            self.requests, self.blocks, self.distinct
        )?;
        write!(f, "{:>9} {:>9} {:>8}", "capacity", "blocks", "optimum")?;
        if let Some(row) = self.rows.first() {
            for c in &row.cells {
                write!(f, " {:>16}", c.policy)?;
            }
        }
        writeln!(f)?;
        for row in &self.rows {
            write!(
                f,
                "{:>8.1}% {:>9} {:>8.4}",
                row.fraction * 100.0,
                row.blocks,
                ratio(row.optimum)
            )?;
            let first = row.cells.first().map_or(0, |c| c.hits);
            for (i, c) in row.cells.iter().enumerate() {
                if i == 0 {
                    write!(f, " {:>16.4}", ratio(c.hits))?;
                } else {
                    let vs = c.hits as f64 / first.max(1) as f64;
                    write!(f, " {:>16}", format!("{:.4} ({vs:.3}×)", ratio(c.hits)))?;
                }
            }
            writeln!(f)?;
        }
        if let Some(first) = self.rows.first().and_then(|r| r.cells.first()) {
            writeln!(
                f,
                "hit ratio of the primary; (n×) is the hits against the first policy, {}",
                first.policy
            )?;
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
        let r = sweep(&w, &policies, &[0.1, 0.5]).unwrap();
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
    fn a_capacity_out_of_range_is_refused() {
        let err = sweep(&workload(), &[PolicyKind::Lru], &[0.0]).unwrap_err();
        assert!(err.to_string().contains("--fraction"), "{err}");
    }
}
