//! The Redis tier's bandwidth against a bare loop of the same client crate, side by side in
//! one run, on a `redis-server` this bench starts on a free loopback port:
//! - `RedisStore::put_many` of a job's blocks (header, key and XXH3 checksum written with
//!   each block, one pipeline) against a pipeline of plain `SET`s of the same values (the
//!   tier's, read back once) under the same names, prepared before the loop;
//! - `RedisStore::get_many` (one pipeline of `GET`s, every value's header, key and checksum
//!   checked, the block copied out) against a pipeline of plain `GET`s of the same values.
//!
//! Reads are also compared with the bare loop that copies each block out of its value into
//! the caller's buffer, the least any store does to deliver a block.
//!
//! Jobs of 16 blocks, at 256 KiB (the bench's default block) and 16 KiB. Throughput counts
//! the blocks' bytes; both sides move the same values. After criterion's groups, a table of
//! the sides run in alternation, round by round (the order rotated every round), with the
//! median of the rounds' ratios: on a shared machine whose speed drifts between criterion's
//! benchmarks (run one after the other), alternation hits every side alike.
//!
//! Values of 256 KiB are above glibc's initial mmap threshold, which malloc then moves and
//! trims by the history of the process's allocations: the same loop measured alone ran 2.4
//! times faster or slower by what ran before it (a page fault per 4 KiB of every command's
//! buffer, or none). Fix the thresholds for figures that compare code rather than heap
//! histories:
//!
//! `MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=268435456 cargo bench -p kvtier-hw
//! --bench redis_tier`; the figures go to docs/performance.md.
#![allow(missing_docs, clippy::print_stdout)]

#[path = "../tests/support/redis.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use kvtier_core::Key;
use kvtier_hw::{RedisOptions, RedisStore, SecondaryStore};
use redis_server::RedisServer;

const JOB: usize = 16;
/// Bytes before a value's key (`store/redis.rs`'s header).
const HEADER: usize = 32;
const SIZES: [usize; 2] = [256 << 10, 16 << 10];

/// One block size's store, blocks, and the bare loop's names and values.
struct Setup {
    block: usize,
    store: RedisStore,
    conn: redis::Connection,
    keys: Vec<Key>,
    blocks: Vec<Vec<u8>>,
    names: Vec<String>,
    values: Vec<Vec<u8>>,
    out: Vec<Vec<u8>>,
}

impl Setup {
    fn new(server: &RedisServer, block: usize) -> Setup {
        let options = RedisOptions {
            urls: vec![server.url()],
            namespace: "bench".into(),
            identity: "hw/benches/redis_tier.rs".into(),
            timeout: Duration::from_secs(5),
            ..RedisOptions::default()
        };
        let store = RedisStore::open(&options, block, (1024 * block) as u64).unwrap();
        // 36-byte keys, as vLLM's.
        let keys: Vec<Key> = (0..JOB)
            .map(|i| Key::new(format!("{i:036}").as_bytes()))
            .collect();
        let blocks: Vec<Vec<u8>> = (0..JOB)
            .map(|i| (0..block).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let names = keys.iter().map(|k| store.name_of(k)).collect();
        let mut s = Setup {
            block,
            store,
            conn: server.connect(),
            keys,
            blocks,
            names,
            values: Vec::new(),
            out: vec![vec![0u8; block]; JOB],
        };
        // The bare loop's values: the tier's own (header, key, block), read back raw, so that
        // both sides write the same bytes and read values the tier accepts.
        s.tier_put();
        let mut p = redis::pipe();
        for n in &s.names {
            p.cmd("GET").arg(n);
        }
        s.values = p.query(&mut s.conn).unwrap();
        assert!(s.values.iter().all(|v| v.len() == HEADER + 36 + block));
        s.bare_set();
        s.tier_get();
        assert_eq!(s.out, s.blocks, "the tier reads back what it wrote");
        s
    }

    fn tier_put(&mut self) {
        let job: Vec<(&Key, &[u8])> = self
            .keys
            .iter()
            .zip(&self.blocks)
            .map(|(k, b)| (k, &b[..]))
            .collect();
        assert!(self.store.put_many(&job).iter().all(Result::is_ok));
    }

    fn bare_set(&mut self) {
        let mut p = redis::pipe();
        for (n, v) in self.names.iter().zip(&self.values) {
            p.cmd("SET").arg(n).arg(v).ignore();
        }
        p.query::<()>(&mut self.conn).unwrap();
    }

    fn tier_get(&mut self) {
        let mut job: Vec<(&Key, &mut [u8])> = self
            .keys
            .iter()
            .zip(self.out.iter_mut())
            .map(|(k, o)| (k, &mut o[..]))
            .collect();
        assert!(self.store.get_many(&mut job).iter().all(Result::is_ok));
    }

    fn bare_values(&mut self) -> Vec<Vec<u8>> {
        let mut p = redis::pipe();
        for n in &self.names {
            p.cmd("GET").arg(n);
        }
        let got: Vec<Vec<u8>> = p.query(&mut self.conn).unwrap();
        assert_eq!(got.len(), JOB);
        got
    }

    fn bare_get(&mut self) {
        let got = self.bare_values();
        std::hint::black_box(got);
    }

    /// The bare loop, and the least any store does besides: the blocks copied out of the
    /// values into the caller's buffers (no check).
    fn bare_get_copy(&mut self) {
        let got = self.bare_values();
        for (v, o) in got.iter().zip(self.out.iter_mut()) {
            o.copy_from_slice(&v[v.len() - self.block..]);
        }
        std::hint::black_box(&self.out);
    }
}

/// The comparisons: operation, the tier's side, the bare loop's side, and for reads the bare
/// loop that also copies the blocks out.
type Side = fn(&mut Setup);
const PAIRS: [(&str, Side, Side, Option<Side>); 2] = [
    ("put", Setup::tier_put, Setup::bare_set, None),
    (
        "get",
        Setup::tier_get,
        Setup::bare_get,
        Some(Setup::bare_get_copy),
    ),
];

fn criterion_groups(c: &mut Criterion, setups: &mut [Setup]) {
    for s in setups {
        for (op, tier, bare, copy) in PAIRS {
            let mut g = c.benchmark_group(format!("redis_{op}"));
            g.throughput(Throughput::Bytes((JOB * s.block) as u64));
            let (tier_name, bare_name) = match op {
                "put" => ("tier_put_many", "bare_set"),
                _ => ("tier_get_many", "bare_get"),
            };
            g.bench_function(BenchmarkId::new(tier_name, s.block), |b| b.iter(|| tier(s)));
            g.bench_function(BenchmarkId::new(bare_name, s.block), |b| b.iter(|| bare(s)));
            if let Some(copy) = copy {
                g.bench_function(BenchmarkId::new("bare_get_copy", s.block), |b| {
                    b.iter(|| copy(s))
                });
            }
            g.finish();
        }
    }
}

/// Seconds per call of `f`, over `n` calls.
fn time(s: &mut Setup, f: Side, n: u32) -> f64 {
    let start = Instant::now();
    for _ in 0..n {
        f(s);
    }
    start.elapsed().as_secs_f64() / f64::from(n)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The tier and the bare loop (and, for reads, the bare loop that copies the blocks out) in
/// alternation: 31 rounds of about 50 ms each side, the order rotated every round.
fn alternating(setups: &mut [Setup]) {
    const ROUNDS: usize = 31;
    println!("\nalternating rounds (median of {ROUNDS}), GiB/s of block bytes:");
    println!("| job | kvtier | bare loop | ratio | bare loop + copy out | ratio |");
    println!("|---|---:|---:|---:|---:|---:|");
    for s in setups {
        let bytes = (JOB * s.block) as f64;
        for (op, tier, bare, copy) in PAIRS {
            // Calls per side per round: about 50 ms of the bare loop.
            let n = ((0.05 / time(s, bare, 3)) as u32).clamp(1, 10_000);
            let sides: Vec<Side> = [Some(tier), Some(bare), copy]
                .into_iter()
                .flatten()
                .collect();
            let mut secs: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
            for round in 0..ROUNDS {
                for i in 0..sides.len() {
                    let side = (round + i) % sides.len();
                    secs[side].push(time(s, sides[side], n));
                }
            }
            let gib = |v: &[f64]| {
                median(
                    &mut v
                        .iter()
                        .map(|t| bytes / t / f64::from(1 << 30))
                        .collect::<Vec<_>>(),
                )
            };
            // The ratio of each round, then their median.
            let ratio = |other: &[f64]| {
                median(
                    &mut secs[0]
                        .iter()
                        .zip(other)
                        .map(|(t, o)| o / t)
                        .collect::<Vec<_>>(),
                )
            };
            let reference = secs.get(2).map_or("— | —".to_owned(), |c| {
                format!("{:.2} | {:.2}", gib(c), ratio(c))
            });
            println!(
                "| {op} {JOB} × {} KiB | {:.2} | {:.2} | {:.2} | {reference} |",
                s.block >> 10,
                gib(&secs[0]),
                gib(&secs[1]),
                ratio(&secs[1]),
            );
        }
    }
}

fn main() {
    let server = RedisServer::start(&[]);
    let mut setups: Vec<Setup> = SIZES.iter().map(|&b| Setup::new(&server, b)).collect();
    let mut c = Criterion::default().configure_from_args();
    criterion_groups(&mut c, &mut setups);
    c.final_summary();
    // `cargo bench` passes --bench; `cargo test --benches` does not (a quick check only). A
    // filter (a word that is not an option) skips the table unless it is "alternating".
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if args.iter().any(|a| a == "--bench") && words.iter().all(|w| *w == "alternating") {
        alternating(&mut setups);
    }
}
