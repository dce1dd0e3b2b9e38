//! Side-by-side bandwidth of kvtier's IO paths against their raw baselines:
//! - region copies through the host engine vs a plain `memcpy` of the same bytes;
//! - file tier writes and reads (header, checksum, O_DIRECT) vs raw sequential O_DIRECT IO.
//!
//! `cargo bench -p kvtier-hw --bench hw_io`; the figures go to docs/performance.md.
#![allow(missing_docs)]

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvtier_core::{Key, SlotId};
use kvtier_hw::{
    BlockCopy, CopyJob, Direction, FileStore, HostEngine, HostMemory, Layout, PAGE, Queue, Region,
    SecondaryStore, TransferEngine, TransferId,
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
    let store = FileStore::open(
        &dir.path().join("tier"),
        block,
        (BLOCKS * (block + PAGE) + PAGE) as u64,
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

criterion_group!(benches, copies, files);
criterion_main!(benches);
