//! The S3 tier's bandwidth against a bare loop of the same client crate (`object_store`), side
//! by side in one run, on a SeaweedFS server this bench starts on free loopback ports
//! (`KVTIER_WEED`, else `weed` on PATH; `scripts/seaweedfs-setup.sh` installs it):
//! - `S3Store::put_many` of a job's blocks (header, key and XXH3 checksum written with each
//!   block, a conditional `PUT` each, at most 32 in flight) against the same number of
//!   conditional `PUT`s of values of the same size, prepared before the loop, through the
//!   same client settings and concurrency;
//! - `S3Store::get_many` (every object's header, key and checksum checked, the block copied
//!   out) against plain `GET`s of the bare loop's objects.
//!
//! Every round writes new names on both sides (a conditional write of a name that exists is
//! answered without its body, which would measure nothing). Jobs of 16 blocks, at 256 KiB
//! and 4 MiB. The sides run in alternation, round by round, the order rotated every round;
//! a ratio is the median of the rounds' ratios, so that the drift of a shared machine hits
//! every side alike.
//!
//! `cargo bench -p kvtier-hw --bench s3_tier`; the figures go to docs/performance.md.
#![allow(missing_docs, clippy::print_stdout)]

#[path = "../../tests/support/s3_server.rs"]
mod s3_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvtier_core::Key;
use kvtier_hw::{S3Options, S3Store, SecondaryStore};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use s3_server::{ACCESS_KEY, S3Server, SECRET_KEY};

const JOB: usize = 16;
const SIZES: [usize; 2] = [256 << 10, 4 << 20];
const ROUNDS: usize = 15;
const BUCKET: &str = "kvtier-bench";
/// Bytes before a value's key (`store/value.rs`'s header).
const HEADER: usize = 32;
/// Requests in flight, as the tier's.
const CONCURRENCY: usize = 32;

/// The bare loop: the client the tier builds, without the tier.
struct Bare {
    client: Arc<dyn ObjectStore>,
    runtime: tokio::runtime::Runtime,
}

impl Bare {
    fn new(endpoint: &str) -> Bare {
        let client = AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_bucket_name(BUCKET)
            .with_region("us-east-1")
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(true)
                    .with_timeout(Duration::from_secs(30)),
            )
            .build()
            .unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Bare {
            client: Arc::new(client),
            runtime,
        }
    }

    fn put(&self, names: &[ObjectPath], values: &[bytes::Bytes]) {
        self.runtime.block_on(async {
            let results: Vec<_> =
                futures::stream::iter(names.iter().zip(values).map(|(name, value)| {
                    let options = PutOptions {
                        mode: PutMode::Create,
                        ..PutOptions::default()
                    };
                    self.client
                        .put_opts(name, PutPayload::from(value.clone()), options)
                }))
                .buffered(CONCURRENCY)
                .collect()
                .await;
            for r in results {
                r.unwrap();
            }
        });
    }

    fn get(&self, names: &[ObjectPath]) -> usize {
        self.runtime.block_on(async {
            let results: Vec<_> = futures::stream::iter(names.iter().map(|name| async move {
                self.client.get(name).await.unwrap().bytes().await.unwrap()
            }))
            .buffered(CONCURRENCY)
            .collect()
            .await;
            results.iter().map(|b| b.len()).sum()
        })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it once, quickly.
    let quick = !std::env::args().any(|a| a == "--bench");
    let server = S3Server::start(false);
    server.create_bucket(BUCKET);
    let bare = Bare::new(&server.endpoint());
    println!(
        "side by side, {} alternating rounds, jobs of {JOB} blocks, GiB/s of block bytes",
        if quick { 1 } else { ROUNDS }
    );
    println!("| job | kvtier | bare loop | ratio (median of rounds) |");
    println!("|---|---:|---:|---:|");
    let mut next = 0u64;
    for block in SIZES {
        let options = S3Options {
            endpoint: Some(server.endpoint()),
            bucket: BUCKET.into(),
            prefix: "bench".into(),
            identity: "hw/benches/s3_tier.rs".into(),
            access_key_id: Some(ACCESS_KEY.into()),
            secret_access_key: Some(SECRET_KEY.into()),
            timeout: Duration::from_secs(30),
            ..S3Options::default()
        };
        let store = S3Store::open(&options, block, 1 << 40).unwrap();
        let blocks: Vec<Vec<u8>> = (0..JOB)
            .map(|i| (0..block).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let value_len = HEADER + 36 + block;
        let values: Vec<bytes::Bytes> = (0..JOB)
            .map(|i| bytes::Bytes::from(vec![i as u8; value_len]))
            .collect();
        let mut out = vec![vec![0u8; block]; JOB];
        let job_bytes = (JOB * block) as f64;
        let gib = |d: Duration| job_bytes / d.as_secs_f64() / f64::from(1u32 << 30);
        // Per side: the GiB/s of every round.
        let mut rates = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        let rounds = if quick { 1 } else { ROUNDS };
        for round in 0..rounds {
            // 36-byte keys, as vLLM's; new ones every round.
            let keys: Vec<Key> = (0..JOB)
                .map(|_| {
                    next += 1;
                    Key::new(format!("{next:036}").as_bytes())
                })
                .collect();
            let names: Vec<ObjectPath> = keys
                .iter()
                .map(|k| ObjectPath::from(format!("bare/{block}/{}", store.name_of(k))))
                .collect();
            let puts: Vec<(&Key, &[u8])> =
                keys.iter().zip(&blocks).map(|(k, b)| (k, &b[..])).collect();
            for side in (0..2).map(|i| (i + round) % 2) {
                let start = Instant::now();
                if side == 0 {
                    assert!(store.put_many(&puts).iter().all(Result::is_ok));
                } else {
                    bare.put(&names, &values);
                }
                rates[side].push(gib(start.elapsed()));
            }
            for side in (0..2).map(|i| (i + round) % 2) {
                let start = Instant::now();
                if side == 0 {
                    let mut gets: Vec<(&Key, &mut [u8])> = keys
                        .iter()
                        .zip(out.iter_mut().map(|o| &mut o[..]))
                        .collect();
                    assert!(store.get_many(&mut gets).iter().all(Result::is_ok));
                } else {
                    assert_eq!(bare.get(&names), JOB * value_len);
                }
                rates[2 + side].push(gib(start.elapsed()));
            }
            for (o, b) in out.iter().zip(&blocks) {
                assert!(o == b, "the tier served the bytes it stored");
            }
        }
        let size = if block >= 1 << 20 {
            format!("{} MiB", block >> 20)
        } else {
            format!("{} KiB", block >> 10)
        };
        for (what, tier, loop_) in [("put_many", 0, 1), ("get_many", 2, 3)] {
            let ratios: Vec<f64> = rates[tier]
                .iter()
                .zip(&rates[loop_])
                .map(|(t, l)| t / l)
                .collect();
            println!(
                "| `{what}` {JOB} × {size} | {:.2} | {:.2} | **{:.2}** (rounds {:.2}–{:.2}) |",
                median(rates[tier].clone()),
                median(rates[loop_].clone()),
                median(ratios.clone()),
                ratios.iter().copied().fold(f64::INFINITY, f64::min),
                ratios.iter().copied().fold(0.0, f64::max),
            );
        }
    }
}
