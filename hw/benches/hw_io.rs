//! Side-by-side bandwidth of kvtier's IO paths against their raw baselines:
//! - region copies through the host engine vs a plain `memcpy` of the same bytes;
//! - 256 MiB copied in pieces (one per layer and block, as a job copies them) with
//!   `copy_bulk` and with `copy_from_slice`, against one `memcpy` of the whole;
//! - file tier writes and reads (header, checksum, O_DIRECT) vs raw sequential O_DIRECT IO;
//! - the file tier's put bandwidth under each fsync policy, for jobs of 1 and 16 blocks, and
//!   for jobs of 4 from 4 threads at once (group commit under `Batch`);
//! - opening a 1 GiB file tier after a clean close (its index), after a crash (its last
//!   checkpoint and the headers it names; every record header when the session that crashed
//!   stored nothing) and verifying every payload (the full scan every open did before), with the page
//!   cache dropped before each open.
//!
//! `cargo bench -p kvtier-hw --bench hw_io`; the figures go to docs/performance.md.
#![allow(missing_docs)]

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvtier_core::{Key, SlotId};
use kvtier_hw::{
    BlockCopy, CopyJob, Direction, FileOptions, FileStore, FsyncPolicy, HostEngine, HostMemory,
    Layout, PAGE, Queue, Region, SecondaryStore, TransferEngine, TransferId,
};

const BLOCKS: usize = 64;

fn copies(c: &mut Criterion) {
    let mut g = c.benchmark_group("region_copy");
    for block in [256 << 10, 1 << 20] {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(
            Region::create(
                &dir.path().join("r"),
                Layout::new(BLOCKS as u32, 1, block).unwrap(),
                2,
            )
            .unwrap(),
        );
        let device = Arc::new(HostMemory::new(BLOCKS * block).unwrap());
        let done = Arc::new(Queue::new());
        let mut id = 0;
        g.throughput(Throughput::Bytes((BLOCKS * block) as u64));
        // One copy thread, and two (the bench's default: a job's copies split across them).
        for threads in [1, 2] {
            let mut engine = HostEngine::new(region.clone(), device.clone(), 0, threads);
            let name = format!("engine_{threads}_thread");
            g.bench_with_input(BenchmarkId::new(name, block), &block, |b, &block| {
                b.iter(|| {
                    id += 1;
                    let copies = (0..BLOCKS)
                        .map(|i| BlockCopy {
                            slot: SlotId(i as u32),
                            device_offset: i * block,
                        })
                        .collect();
                    let job = CopyJob {
                        id: TransferId(id),
                        direction: Direction::ToRegion,
                        copies,
                    };
                    engine.submit(job, &done).unwrap();
                    done.pop().unwrap();
                })
            });
        }
        let src = vec![1u8; BLOCKS * block];
        let mut dst = vec![0u8; BLOCKS * block];
        g.bench_with_input(BenchmarkId::new("memcpy", block), &block, |b, &block| {
            b.iter(|| {
                for i in 0..BLOCKS {
                    dst[i * block..(i + 1) * block]
                        .copy_from_slice(&src[i * block..(i + 1) * block]);
                }
                std::hint::black_box(&dst);
            })
        });
    }
    g.finish();
}

/// 256 MiB, larger than the caches as a load worth offloading is, copied in pieces of 16 KiB
/// to 4 MiB.
fn pieces(c: &mut Criterion) {
    const TOTAL: usize = 256 << 20;
    let mut g = c.benchmark_group("piece_copy_256MiB");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(TOTAL as u64));
    let src = aligned(TOTAL);
    let mut dst = aligned(TOTAL);
    g.bench_function("memcpy_whole", |b| {
        b.iter(|| {
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
        })
    });
    for piece in [16 << 10, 192 << 10, 4 << 20] {
        g.bench_with_input(BenchmarkId::new("copy_bulk", piece), &piece, |b, &piece| {
            b.iter(|| {
                for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                    kvtier_hw::copy_bulk(d, s);
                }
                std::hint::black_box(&dst);
            })
        });
        g.bench_with_input(BenchmarkId::new("memcpy", piece), &piece, |b, &piece| {
            b.iter(|| {
                for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                    d.copy_from_slice(s);
                }
                std::hint::black_box(&dst);
            })
        });
    }
    g.finish();
}

fn aligned(len: usize) -> memmap2::MmapMut {
    let mut m = memmap2::MmapMut::map_anon(len).unwrap();
    m.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    m
}

fn files(c: &mut Criterion) {
    let mut g = c.benchmark_group("file_tier");
    g.sample_size(10);
    let block = 256 << 10;
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    // No syncs: the same work as the raw writes it is compared with (see `fsync` below).
    let store = FileStore::open_with(
        &dir.path().join("tier"),
        block,
        (BLOCKS * (block + PAGE) + PAGE) as u64,
        FileOptions {
            fsync: FsyncPolicy::None,
            ..FileOptions::default()
        },
    )
    .unwrap();
    let buf = aligned(block);
    let mut out = aligned(block);
    let keys: Vec<Key> = (0..BLOCKS as u64)
        .map(|i| Key::new(&i.to_le_bytes()))
        .collect();
    g.throughput(Throughput::Bytes((BLOCKS * block) as u64));
    g.bench_function("store_put", |b| {
        b.iter(|| {
            for k in &keys {
                store.delete(k).unwrap();
                store.put(k, &buf).unwrap();
            }
        })
    });
    g.bench_function("store_put_many_64", |b| {
        b.iter(|| {
            for k in &keys {
                store.delete(k).unwrap();
            }
            let batch: Vec<(&Key, &[u8])> = keys.iter().map(|k| (k, &buf[..])).collect();
            assert!(store.put_many(&batch).iter().all(Result::is_ok));
        })
    });
    g.bench_function("store_get", |b| {
        b.iter(|| {
            for k in &keys {
                store.get(k, &mut out).unwrap();
            }
        })
    });
    let raw = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("raw"))
        .unwrap();
    g.bench_function("raw_write", |b| {
        b.iter(|| {
            for i in 0..BLOCKS {
                raw.write_all_at(&buf, (i * block) as u64).unwrap();
            }
        })
    });
    g.bench_function("raw_read", |b| {
        b.iter(|| {
            for i in 0..BLOCKS {
                raw.read_exact_at(&mut out, (i * block) as u64).unwrap();
            }
        })
    });
    g.finish();
}

/// Put bandwidth under each fsync policy: 64 blocks of 256 KiB per iteration, as jobs of 1
/// block (one `put` each) and of 16 (`put_many`).
fn fsync(c: &mut Criterion) {
    let mut g = c.benchmark_group("file_fsync");
    g.sample_size(10);
    let block = 256 << 10;
    let buf = aligned(block);
    let keys: Vec<Key> = (0..BLOCKS as u64)
        .map(|i| Key::new(&i.to_le_bytes()))
        .collect();
    g.throughput(Throughput::Bytes((BLOCKS * block) as u64));
    for policy in [FsyncPolicy::None, FsyncPolicy::Batch, FsyncPolicy::Write] {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let store = FileStore::open_with(
            dir.path(),
            block,
            (BLOCKS * (block + PAGE) + PAGE) as u64,
            FileOptions {
                fsync: policy,
                ..FileOptions::default()
            },
        )
        .unwrap();
        for job in [1, 16] {
            let name = format!("{policy}_job_{job}");
            g.bench_function(BenchmarkId::new(name, block), |b| {
                b.iter(|| {
                    for k in &keys {
                        store.delete(k).unwrap();
                    }
                    for chunk in keys.chunks(job) {
                        let batch: Vec<(&Key, &[u8])> =
                            chunk.iter().map(|k| (k, &buf[..])).collect();
                        assert!(store.put_many(&batch).iter().all(Result::is_ok));
                    }
                })
            });
        }
        // As a tier's IO threads do: 4 threads storing jobs of 4 at once.
        let name = format!("{policy}_4_threads_job_4");
        g.bench_function(BenchmarkId::new(name, block), |b| {
            b.iter(|| {
                for k in &keys {
                    store.delete(k).unwrap();
                }
                std::thread::scope(|s| {
                    for part in keys.chunks(BLOCKS / 4) {
                        let (store, buf) = (&store, &buf);
                        s.spawn(move || {
                            for chunk in part.chunks(4) {
                                let batch: Vec<(&Key, &[u8])> =
                                    chunk.iter().map(|k| (k, &buf[..])).collect();
                                assert!(store.put_many(&batch).iter().all(Result::is_ok));
                            }
                        });
                    }
                });
            })
        });
    }
    g.finish();
}

/// Drops `path`'s pages from the page cache (what a cold open finds).
fn drop_cache(path: &std::path::Path) {
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    nix::fcntl::posix_fadvise(
        &f,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
}

/// Opening a 1 GiB tier full of blocks: after a clean close (its index), after a crash
/// (every header) and with every payload verified (the full scan).
fn open(c: &mut Criterion) {
    let mut g = c.benchmark_group("file_open_1GiB");
    g.sample_size(10);
    for block in [256usize << 10, 16 << 10] {
        let blocks = (1usize << 30) / block;
        let cap = (PAGE + blocks * (PAGE + block)) as u64;
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        {
            let store = FileStore::open(dir.path(), block, cap).unwrap();
            let buf = aligned(block);
            let keys: Vec<Key> = (0..blocks as u64)
                .map(|i| Key::new(&i.to_le_bytes()))
                .collect();
            for chunk in keys.chunks(64) {
                let batch: Vec<(&Key, &[u8])> = chunk.iter().map(|k| (k, &buf[..])).collect();
                assert!(store.put_many(&batch).iter().all(Result::is_ok));
            }
        }
        let data = dir.path().join(kvtier_hw::DATA_FILE);
        let opened = |options: &FileOptions| {
            drop_cache(&data);
            let t = std::time::Instant::now();
            let store = FileStore::open_with(dir.path(), block, cap, options.clone()).unwrap();
            let took = t.elapsed();
            assert_eq!(store.open_report().recovered, blocks);
            (store, took)
        };
        // After a clean close: the index written at close.
        g.bench_with_input(BenchmarkId::new("clean_close", block), &block, |b, _| {
            b.iter_custom(|n| {
                (0..n)
                    .map(|_| {
                        let (store, took) = opened(&FileOptions::default());
                        assert!(store.open_report().from_index);
                        took
                    })
                    .sum()
            })
        });
        // After a crash of a session that stored blocks (so it wrote a checkpoint): the
        // checkpoint and the headers of the records it reserved. The session deletes and
        // stores again 1/16 of the blocks, as many as a checkpoint reserves: the most headers
        // an open after a crash reads.
        let again: Vec<Key> = (0..(blocks / 16) as u64)
            .map(|i| Key::new(&i.to_le_bytes()))
            .collect();
        let buf = aligned(block);
        let crash_after_a_store = |store: FileStore| {
            for k in &again {
                store.delete(k).unwrap();
            }
            for chunk in again.chunks(64) {
                let batch: Vec<(&Key, &[u8])> = chunk.iter().map(|k| (k, &buf[..])).collect();
                assert!(store.put_many(&batch).iter().all(Result::is_ok));
            }
            store.abandon();
        };
        crash_after_a_store(opened(&FileOptions::default()).0);
        g.bench_with_input(BenchmarkId::new("after_crash", block), &block, |b, _| {
            b.iter_custom(|n| {
                (0..n)
                    .map(|_| {
                        let (store, took) = opened(&FileOptions::default());
                        assert!(store.open_report().from_checkpoint);
                        crash_after_a_store(store);
                        took
                    })
                    .sum()
            })
        });
        // After a crash of a session that stored nothing: the checkpoint it wrote at open.
        g.bench_with_input(
            BenchmarkId::new("after_crash_no_store", block),
            &block,
            |b, _| {
                b.iter_custom(|n| {
                    (0..n)
                        .map(|_| {
                            let (store, took) = opened(&FileOptions::default());
                            assert!(store.open_report().from_checkpoint);
                            store.abandon();
                            took
                        })
                        .sum()
                })
            },
        );
        // Every payload verified: the full scan every open did before.
        let verify = FileOptions {
            verify_at_open: true,
            ..FileOptions::default()
        };
        g.bench_with_input(BenchmarkId::new("full_scan", block), &block, |b, _| {
            b.iter_custom(|n| (0..n).map(|_| opened(&verify).1).sum())
        });
    }
    g.finish();
}

criterion_group!(benches, copies, pieces, files, fsync, open);
criterion_main!(benches);
