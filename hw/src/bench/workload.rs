//! Workloads for `kvtier bench`: a Mooncake-format trace, or the embedded synthetic chat mix.

use std::io::{BufRead, Read};
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
    /// Whether the prompt ends inside its last block (a trace line whose `input_length` is
    /// not a multiple of the trace's 512 tokens per block): the conversation's next turn
    /// appends to that block, so it comes back under another id. Conversations are told
    /// apart by it (see [`conversations`](super::conversations)).
    pub partial_last: bool,
}

impl Request {
    /// A request whose blocks are all full.
    pub fn new(blocks: Vec<u64>) -> Self {
        Request {
            blocks,
            partial_last: false,
        }
    }

    /// The request as vLLM caches it: its whole blocks alone. vLLM neither stores nor looks
    /// up a block the prompt ends inside, so a trace line's partial last block is dropped
    /// (its id names the block only up to the prompt's end: the next turn's prompt goes on
    /// inside it, under another id). The conversation's next turn finds this request's last
    /// block all the same ([`Conversations`](super::Conversations) keys it by its whole
    /// blocks).
    #[must_use]
    pub fn whole_blocks(mut self) -> Self {
        self.blocks.truncate(self.whole_len());
        self.partial_last = false;
        self
    }

    /// How many of its blocks are whole: all but a partial last one.
    pub fn whole_len(&self) -> usize {
        self.blocks.len() - usize::from(self.partial_last && !self.blocks.is_empty())
    }
}

/// Tokens per block in the trace format (Mooncake's 512).
pub(crate) const TRACE_BLOCK_TOKENS: u64 = 512;

/// A Mooncake trace line. Fields beyond these (a session id, a model name) are ignored.
#[derive(Deserialize)]
struct TraceLine {
    #[allow(dead_code)]
    timestamp: u64,
    input_length: u64,
    #[allow(dead_code)]
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Bounds on what reading a trace may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceLimits {
    /// Requests to read at most (the rest of the trace is not read).
    pub max_requests: usize,
    /// Bytes of one line at most: a longer line is an error, not an unbounded allocation.
    pub max_line_bytes: usize,
    /// Bytes of memory the requests kept (every request read, unless a filter keeps fewer:
    /// [`read_trace_keeping`]) may take at most.
    pub max_memory_bytes: u64,
}

impl Default for TraceLimits {
    fn default() -> Self {
        TraceLimits {
            max_requests: usize::MAX,
            max_line_bytes: 1 << 20,
            max_memory_bytes: super::memory_budget(),
        }
    }
}

/// Reads a Mooncake-format JSONL trace (`timestamp`, `input_length`, `output_length`,
/// `hash_ids`; one hash id per block; other fields are ignored). Blank lines are skipped; a
/// malformed or overlong line is an error naming its number.
/// Every line's blocks are kept as the trace gives them, a partial last one too
/// ([`read_trace_replayed`] replays them as vLLM caches them).
pub fn read_trace(path: &Path) -> Result<Vec<Request>, BenchError> {
    read_trace_with(path, TraceLimits::default())
}

/// [`read_trace`] within `limits`.
pub fn read_trace_with(path: &Path, limits: TraceLimits) -> Result<Vec<Request>, BenchError> {
    read_trace_keeping(path, limits, |_| true)
}

/// [`read_trace_with`], keeping only the requests `keep` accepts (it is given every request
/// read, in order): a node of a run of several keeps its own share alone.
pub fn read_trace_keeping(
    path: &Path,
    limits: TraceLimits,
    keep: impl FnMut(&Request) -> bool,
) -> Result<Vec<Request>, BenchError> {
    parse_trace_keeping(open_trace(path)?, path, limits, keep)
}

/// The requests of a trace that a run replays. Unless `partial`, each as vLLM caches it
/// ([`Request::whole_blocks`]), a line with no whole block dropped; with `node = Some((n,
/// nodes))`, node `n`'s share alone, dealt by conversation over the requests replayed (as
/// [`node_share`](super::node_share) deals them): a dropped line takes no conversation.
pub fn read_trace_replayed(
    path: &Path,
    limits: TraceLimits,
    partial: bool,
    node: Option<(u32, u32)>,
) -> Result<Vec<Request>, BenchError> {
    parse_trace_replayed(open_trace(path)?, path, limits, partial, node)
}

/// [`read_trace_replayed`] from `reader` (`path` names it in errors).
pub fn parse_trace_replayed(
    reader: impl BufRead,
    path: &Path,
    limits: TraceLimits,
    partial: bool,
    node: Option<(u32, u32)>,
) -> Result<Vec<Request>, BenchError> {
    let mut conversations = super::Conversations::default();
    parse_trace_selecting(reader, path, limits, |r| {
        let r = if partial { r } else { r.whole_blocks() };
        (!r.blocks.is_empty() && node.is_none_or(|(n, nodes)| conversations.is_nodes(&r, n, nodes)))
            .then_some(r)
    })
}

/// The trace at `path`, opened for reading.
fn open_trace(path: &Path) -> Result<std::io::BufReader<std::fs::File>, BenchError> {
    let file = std::fs::File::open(path).map_err(|e| BenchError::Io {
        what: "open trace",
        path: path.to_path_buf(),
        source: e,
    })?;
    Ok(std::io::BufReader::new(file))
}

/// Parses trace lines from `reader` (`path` names it in errors).
pub fn parse_trace(reader: impl BufRead, path: &Path) -> Result<Vec<Request>, BenchError> {
    parse_trace_with(reader, path, TraceLimits::default())
}

/// [`parse_trace`] within `limits`.
pub fn parse_trace_with(
    reader: impl BufRead,
    path: &Path,
    limits: TraceLimits,
) -> Result<Vec<Request>, BenchError> {
    parse_trace_keeping(reader, path, limits, |_| true)
}

/// [`parse_trace_with`], keeping only the requests `keep` accepts (see
/// [`read_trace_keeping`]); `limits.max_requests` counts every request read.
pub fn parse_trace_keeping(
    reader: impl BufRead,
    path: &Path,
    limits: TraceLimits,
    mut keep: impl FnMut(&Request) -> bool,
) -> Result<Vec<Request>, BenchError> {
    parse_trace_selecting(reader, path, limits, |r| keep(&r).then_some(r))
}

/// Parses trace lines from `reader`, each request given to `select`, which returns what to
/// keep of it (or nothing); `limits.max_requests` counts every request read, and the memory
/// bound what is kept.
fn parse_trace_selecting(
    mut reader: impl BufRead,
    path: &Path,
    limits: TraceLimits,
    mut select: impl FnMut(Request) -> Option<Request>,
) -> Result<Vec<Request>, BenchError> {
    let mut out = Vec::new();
    let mut read = 0usize;
    let mut line = Vec::new();
    let mut memory = 0u64;
    let bad = |line: usize, reason: String| BenchError::Trace {
        path: path.to_path_buf(),
        line,
        reason,
    };
    for i in 1.. {
        if read >= limits.max_requests {
            break;
        }
        line.clear();
        // One byte past the bound tells an overlong line from one of exactly the bound.
        let n = (&mut reader)
            .take(limits.max_line_bytes as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| BenchError::Io {
                what: "read trace",
                path: path.to_path_buf(),
                source: e,
            })?;
        if n == 0 {
            break;
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if n > limits.max_line_bytes {
            return Err(bad(
                i,
                format!(
                    "line longer than {} bytes (is this a JSONL trace?)",
                    limits.max_line_bytes
                ),
            ));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let t: TraceLine = serde_json::from_slice(&line).map_err(|e| bad(i, e.to_string()))?;
        read += 1;
        let request = Request {
            blocks: t.hash_ids,
            partial_last: !t.input_length.is_multiple_of(TRACE_BLOCK_TOKENS),
        };
        let Some(request) = select(request) else {
            continue;
        };
        memory += request_bytes(request.blocks.len());
        if memory > limits.max_memory_bytes {
            return Err(bad(
                i,
                format!(
                    "the trace up to here needs more than {} of memory; replay fewer requests (--requests)",
                    super::approx_bytes(limits.max_memory_bytes)
                ),
            ));
        }
        out.push(request);
    }
    if read == 0 {
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

/// Bytes of memory a request of `blocks` blocks takes, with its share of the bench's
/// bookkeeping of it (the list of references and Belady's index over them).
pub(crate) fn request_bytes(blocks: usize) -> u64 {
    // 8 bytes per id in the request, 8 in the served order, and Belady's maps over them.
    (blocks as u64).saturating_mul(128).saturating_add(64)
}

impl Synthetic {
    /// Bytes of memory the requests will take at most.
    pub fn memory_bytes(&self) -> u64 {
        let longest =
            self.system_blocks as usize + self.max_blocks as usize + self.turn_blocks as usize;
        request_bytes(longest).saturating_mul(self.requests as u64)
    }

    /// Checks that generating fits in `budget` bytes of memory, before anything is allocated.
    pub fn check(&self, budget: u64) -> Result<(), BenchError> {
        if self.memory_bytes() > budget {
            return Err(BenchError::Config {
                path: "-".into(),
                reason: format!(
                    "requests: {} requests need up to {} of memory, more than the {} this machine can spare",
                    self.requests,
                    super::approx_bytes(self.memory_bytes()),
                    super::approx_bytes(budget)
                ),
            });
        }
        Ok(())
    }

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
            out.push(Request::new(sys_ids.chain(conv_ids).collect()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM caches whole blocks alone: a line's partial last block is dropped, a whole one
    /// kept.
    #[test]
    fn whole_blocks_drop_a_partial_last_block_only() {
        let text = "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [1, 2]}\n{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 3]}\n{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [4]}\n";
        let whole: Vec<Vec<u64>> = parse_trace(text.as_bytes(), Path::new("t.jsonl"))
            .unwrap()
            .into_iter()
            .map(|r| {
                let r = r.whole_blocks();
                assert!(!r.partial_last);
                r.blocks
            })
            .collect();
        assert_eq!(whole, [vec![1], vec![1, 3], vec![]]);
    }

    #[test]
    fn a_malformed_line_names_its_number() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\n{\"timestamp\": 1, \"hash_ids\": \"x\"}\n";
        let err = parse_trace(text.as_bytes(), Path::new("t.jsonl")).unwrap_err();
        assert!(err.to_string().contains("t.jsonl:3"), "{err}");
        let first = text.lines().next().unwrap();
        let ok = parse_trace(first.as_bytes(), Path::new("t.jsonl")).unwrap();
        assert_eq!(
            ok,
            vec![Request {
                blocks: vec![1, 2],
                partial_last: true
            }]
        );
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"session_id\": \"a\", \"hash_ids\": [4]}\n";
        let ok = parse_trace(text.as_bytes(), Path::new("t.jsonl")).unwrap();
        assert_eq!(
            ok,
            vec![Request {
                blocks: vec![4],
                partial_last: true
            }]
        );
    }

    #[test]
    fn an_overlong_line_is_an_error_not_an_allocation() {
        let limits = TraceLimits {
            max_line_bytes: 64,
            ..TraceLimits::default()
        };
        let line =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}";
        assert!(line.len() > 64);
        let err = parse_trace_with(line.as_bytes(), Path::new("t"), limits).unwrap_err();
        assert!(
            err.to_string().contains("t:1: line longer than 64 bytes"),
            "{err}"
        );
        // An endless stream without newlines (`--trace /dev/zero`) stops at the bound.
        let zeros = std::io::BufReader::new(std::io::repeat(0));
        let err = parse_trace_with(zeros, Path::new("z"), limits).unwrap_err();
        assert!(err.to_string().contains("line longer"), "{err}");
        // Exactly at the bound is fine.
        let fits = TraceLimits {
            max_line_bytes: line.len(),
            ..limits
        };
        assert_eq!(
            parse_trace_with(line.as_bytes(), Path::new("t"), fits)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn reading_stops_at_the_request_and_memory_bounds() {
        let line =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1, 2]}\n";
        let text = line.repeat(10);
        let first = TraceLimits {
            max_requests: 3,
            ..TraceLimits::default()
        };
        assert_eq!(
            parse_trace_with(text.as_bytes(), Path::new("t"), first)
                .unwrap()
                .len(),
            3
        );
        let small = TraceLimits {
            max_memory_bytes: 4 * request_bytes(2),
            ..TraceLimits::default()
        };
        let err = parse_trace_with(text.as_bytes(), Path::new("t"), small).unwrap_err();
        assert!(
            err.to_string()
                .contains("t:5: the trace up to here needs more than"),
            "{err}"
        );
    }

    #[test]
    fn a_huge_request_count_is_refused_before_allocating() {
        for requests in [usize::MAX, 100_000_000_000] {
            let s = Synthetic {
                requests,
                ..Synthetic::default()
            };
            let err = s.check(1 << 34).unwrap_err();
            assert!(err.to_string().contains("requests:"), "{err}");
        }
        Synthetic::default().check(1 << 30).unwrap();
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
