//! Workloads for `kvtier bench`: a Mooncake-format trace, or the embedded synthetic chat mix.

use std::io::BufRead;
use std::path::Path;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::Deserialize;

use super::BenchError;

/// One request: the blocks of its prompt, a prefix chain (block `i` depends on blocks `..i`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Block ids in prompt order.
    pub blocks: Vec<u64>,
}

/// A Mooncake trace line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    #[allow(dead_code)]
    timestamp: u64,
    #[allow(dead_code)]
    input_length: u64,
    #[allow(dead_code)]
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake-format JSONL trace (`timestamp`, `input_length`, `output_length`,
/// `hash_ids`; one hash id per block). Blank lines are skipped; a malformed line is an error
/// naming its number.
pub fn read_trace(path: &Path) -> Result<Vec<Request>, BenchError> {
    let file = std::fs::File::open(path).map_err(|e| BenchError::Io {
        what: "open trace",
        path: path.to_path_buf(),
        source: e,
    })?;
    parse_trace(std::io::BufReader::new(file), path)
}

/// Parses trace lines from `reader` (`path` names it in errors).
pub fn parse_trace(reader: impl BufRead, path: &Path) -> Result<Vec<Request>, BenchError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| BenchError::Io {
            what: "read trace",
            path: path.to_path_buf(),
            source: e,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let t: TraceLine = serde_json::from_str(&line).map_err(|e| BenchError::Trace {
            path: path.to_path_buf(),
            line: i + 1,
            reason: e.to_string(),
        })?;
        out.push(Request { blocks: t.hash_ids });
    }
    if out.is_empty() {
        return Err(BenchError::Trace {
            path: path.to_path_buf(),
            line: 0,
            reason: "the trace has no requests".into(),
        });
    }
    Ok(out)
}

/// The embedded default: multi-turn chat sessions sharing a few system prompts.
#[derive(Clone, Debug, PartialEq)]
pub struct Synthetic {
    /// Requests to generate.
    pub requests: usize,
    /// Distinct system prompts.
    pub system_prompts: u32,
    /// Blocks of a system prompt.
    pub system_blocks: u32,
    /// Conversations; which one the next request continues is Zipf-distributed.
    pub conversations: u32,
    /// The Zipf exponent of conversation popularity.
    pub zipf: f64,
    /// Blocks a turn adds to its conversation (user message and answer), at most.
    pub turn_blocks: u32,
    /// A conversation longer than this many blocks starts over (a new session).
    pub max_blocks: u32,
    /// The random seed: the same settings give the same requests.
    pub seed: u64,
}

impl Default for Synthetic {
    fn default() -> Self {
        Synthetic {
            requests: 12000,
            system_prompts: 8,
            system_blocks: 6,
            conversations: 8000,
            zipf: 0.9,
            turn_blocks: 4,
            max_blocks: 96,
            seed: 7,
        }
    }
}

impl Synthetic {
    /// Generates the requests.
    pub fn generate(&self) -> Vec<Request> {
        let mut rng = SmallRng::seed_from_u64(self.seed);
        let zipf = Zipf::new(f64::from(self.conversations.max(1)), self.zipf)
            .expect("valid Zipf parameters");
        // Per conversation: its system prompt, its session number and its length in blocks.
        let mut convs: Vec<(u32, u32, u32)> = (0..self.conversations)
            .map(|_| (rng.random_range(0..self.system_prompts.max(1)), 0, 0))
            .collect();
        let mut out = Vec::with_capacity(self.requests);
        for _ in 0..self.requests {
            let c = (zipf.sample(&mut rng) as usize - 1).min(convs.len() - 1);
            let (sys, session, len) = &mut convs[c];
            *len += rng.random_range(1..=self.turn_blocks.max(1));
            if *len > self.max_blocks {
                *session += 1;
                *len = rng.random_range(1..=self.turn_blocks.max(1));
            }
            let sys_ids = (0..self.system_blocks)
                .map(|i| (1u64 << 62) | (u64::from(*sys) << 20) | u64::from(i));
            let conv_ids = (0..*len)
                .map(|i| (u64::from(c as u32) << 40) | (u64::from(*session) << 20) | u64::from(i));
            out.push(Request {
                blocks: sys_ids.chain(conv_ids).collect(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_line_names_its_number() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\n{\"timestamp\": 1, \"hash_ids\": \"x\"}\n";
        let err = parse_trace(text.as_bytes(), Path::new("t.jsonl")).unwrap_err();
        assert!(err.to_string().contains("t.jsonl:3"), "{err}");
        let first = text.lines().next().unwrap();
        let ok = parse_trace(first.as_bytes(), Path::new("t.jsonl")).unwrap();
        assert_eq!(ok, vec![Request { blocks: vec![1, 2] }]);
    }

    #[test]
    fn the_synthetic_mix_is_deterministic_and_shares_prefixes() {
        let s = Synthetic {
            requests: 500,
            ..Synthetic::default()
        };
        let a = s.generate();
        assert_eq!(a, s.generate());
        let refs: usize = a.iter().map(|r| r.blocks.len()).sum();
        let distinct: std::collections::BTreeSet<u64> =
            a.iter().flat_map(|r| r.blocks.iter().copied()).collect();
        assert!(
            distinct.len() * 2 < refs,
            "{} distinct of {refs}",
            distinct.len()
        );
    }
}
