//! `core_ops`: nanoseconds per block for the core's hot operations, on a primary of 100,000
//! slots with 2 secondary tiers, and the core's metadata bytes per slot.
//!
//! Run: `cargo bench -p kvtier-core --bench core_ops`. The memory figures are printed first.
#![allow(missing_docs, clippy::print_stderr)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvtier_core::{
    Config, Effect, JobResult, Key, Lookup, Manager, Outcome, PolicyKind, RequestId, TierConfig,
    TierKind,
};

/// Counts live heap bytes, to measure the core's metadata.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator and only counts sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const SLOTS: u32 = 100_000;
/// vLLM's key: a 32-byte block hash and a 4-byte KV-group index.
const KEY_BYTES: usize = 36;
const BATCH: u64 = 32;
const REQ: RequestId = RequestId(1);
/// Tokens per block, for the end-token positions the engine records.
const BLOCK_TOKENS: u64 = 16;

/// A new request for `ks`, with each block's end-token position recorded, as vLLM 0.33's
/// scheduler does.
fn request(m: &mut Manager, id: &mut u64, ks: &[Key]) -> RequestId {
    *id += 1;
    let req = RequestId(*id);
    m.new_request(req);
    for (i, k) in ks.iter().enumerate() {
        m.set_position(req, k, (i as u64 + 1) * BLOCK_TOKENS);
    }
    req
}

fn key(i: u64) -> Key {
    let mut b = [0u8; KEY_BYTES];
    b[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
    b[8..16].copy_from_slice(&i.to_be_bytes());
    Key::from(b)
}

fn batch(start: u64) -> Vec<Key> {
    (start..start + BATCH).map(key).collect()
}

fn config(policy: PolicyKind, tiers: bool) -> Config {
    let mut c = Config::new(SLOTS);
    c.policy = policy;
    // Nothing consumes events here: do not let them accumulate.
    c.events = false;
    if tiers {
        let mut t0 = TierConfig::new(TierKind::Authoritative, 4 * SLOTS);
        t0.max_outstanding_stores = 1 << 20;
        let mut t1 = TierConfig::new(TierKind::Authoritative, 8 * SLOTS);
        t1.max_outstanding_stores = 1 << 20;
        c.tiers = vec![t0, t1];
    }
    c
}

/// Completes every submitted job with `Ok` (the IO layer's part, done instantly).
fn complete_jobs(m: &mut Manager) {
    while let Some(e) = m.poll_effect() {
        if let Effect::Submit(job) = e {
            m.handle_job_result(JobResult {
                job: job.id,
                outcome: Outcome::Ok,
            })
            .expect("outstanding job");
        }
    }
}

/// A manager whose primary holds keys `0..SLOTS`, Ready and unpinned (and so do the tiers).
fn filled(policy: PolicyKind, tiers: bool) -> Manager {
    let mut m = Manager::new(config(policy, tiers)).expect("valid config");
    let mut id = 1 << 40;
    for start in (0..u64::from(SLOTS)).step_by(BATCH as usize) {
        let ks = batch(start);
        let req = request(&mut m, &mut id, &ks);
        m.prepare_store(req, &ks).expect("room");
        m.complete_store(req, &ks, true);
        m.request_finished(req);
        complete_jobs(&mut m);
        m.end_step();
    }
    m.end_step();
    m
}

fn memory_report() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc, PolicyKind::Reuse] {
        let before = LIVE.load(Ordering::Relaxed);
        let mut m = filled(policy, false);
        let after = LIVE.load(Ordering::Relaxed);
        let keys = SLOTS as isize * KEY_BYTES as isize;
        let per_slot = (after - before - keys) as f64 / f64::from(SLOTS);
        eprintln!(
            "memory {policy:?}: {per_slot:.1} bytes of metadata per occupied slot beyond {KEY_BYTES} key bytes"
        );
        if policy == PolicyKind::Arc {
            // Fill both ghost lists to the capacity, the worst case: churn touched blocks
            // (they reach T2 and are evicted to B2), then untouched ones (T1, evicted to B1).
            let mut next = u64::from(SLOTS);
            for touched in [true, false] {
                for _ in 0..(2 * u64::from(SLOTS) / BATCH) {
                    let ks = batch(next);
                    next += BATCH;
                    m.prepare_store(REQ, &ks).expect("room");
                    m.complete_store(REQ, &ks, true);
                    m.request_finished(REQ);
                    if touched {
                        m.touch(&ks);
                    }
                }
            }
            let lens = match m.primary().policy() {
                kvtier_core::policy::Policy::Arc(a) => a.list_lens(),
                _ => unreachable!("ARC configured"),
            };
            let full = LIVE.load(Ordering::Relaxed);
            let per_slot = (full - before - keys) as f64 / f64::from(SLOTS);
            eprintln!(
                "memory Arc with both ghost lists full (T1 T2 B1 B2 = {lens:?}): {per_slot:.1} bytes of metadata per slot beyond {KEY_BYTES} key bytes"
            );
        }
        if policy == PolicyKind::Reuse {
            // Fill both ghost generations, the worst case.
            let mut next = u64::from(SLOTS);
            let ghosts =
                2 * kvtier_core::policy::GHOST_GENERATION_CAPACITIES as u64 * u64::from(SLOTS);
            for _ in 0..(ghosts / BATCH) {
                let ks = batch(next);
                next += BATCH;
                m.prepare_store(REQ, &ks).expect("room");
                m.complete_store(REQ, &ks, true);
                m.request_finished(REQ);
            }
            let full = LIVE.load(Ordering::Relaxed);
            let per_slot = (full - before - keys) as f64 / f64::from(SLOTS);
            eprintln!(
                "memory Reuse with its ghost full ({ghosts} keys evicted): {per_slot:.1} bytes of metadata per slot beyond {KEY_BYTES} key bytes"
            );
        }
        drop(m);
    }
    let before = LIVE.load(Ordering::Relaxed);
    let m = filled(PolicyKind::Lru, true);
    let after = LIVE.load(Ordering::Relaxed);
    let primary_only = filled(PolicyKind::Lru, false);
    let primary = LIVE.load(Ordering::Relaxed) - after;
    drop(primary_only);
    let tiers = (after - before - primary) as f64 / f64::from(2 * SLOTS);
    eprintln!(
        "memory tier index (LRU): {tiers:.1} bytes per tier block, {:.1} beyond its copy of the {KEY_BYTES} key bytes",
        tiers - KEY_BYTES as f64
    );
    drop(m);
}

/// `store_evict_lru` and `store_evict_reuse` side by side: the two managers take turns of
/// `TURN` batches each (which goes first alternating), so that the machine's drift (this
/// benchmark's figures moved by up to 1.8× between criterion runs on the development VM)
/// falls on both alike, while each turn is long enough to run in its own steady state of the
/// caches.
/// Prints each policy's median turn per batch and the median of the rounds' ratios.
fn store_evict_side_by_side() {
    const TURN: usize = 64;
    const ROUNDS: usize = 400;
    let mut lru = filled(PolicyKind::Lru, false);
    let mut reuse = filled(PolicyKind::Reuse, false);
    let mut next = [u64::from(SLOTS); 2];
    let mut id = 0;
    let mut turn = |m: &mut Manager, next: &mut u64, batches: usize| {
        // The keys are made before the clock starts, as criterion's inputs are.
        let inputs: Vec<Vec<Key>> = (0..batches)
            .map(|_| {
                *next += BATCH;
                batch(*next)
            })
            .collect();
        // A benchmark times itself; the core it times reads no clock.
        #[allow(clippy::disallowed_methods)]
        let start = std::time::Instant::now();
        for ks in inputs {
            let req = request(m, &mut id, &ks);
            let p = m.prepare_store(req, &ks).expect("room");
            black_box(p.slots.len());
            m.complete_store(req, &ks, true);
            m.request_finished(req);
        }
        start.elapsed().as_nanos() as f64 / batches as f64
    };
    // Fill the reuse policy's ghost (its worst case, as in the criterion run's steady state)
    // and warm both.
    let ghosts = 2 * kvtier_core::policy::GHOST_GENERATION_CAPACITIES as u64 * u64::from(SLOTS);
    turn(&mut reuse, &mut next[1], (ghosts / BATCH) as usize);
    turn(&mut lru, &mut next[0], (ghosts / BATCH) as usize);
    let (mut a, mut b, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let (x, y) = if round % 2 == 0 {
            let x = turn(&mut lru, &mut next[0], TURN);
            (x, turn(&mut reuse, &mut next[1], TURN))
        } else {
            let y = turn(&mut reuse, &mut next[1], TURN);
            (turn(&mut lru, &mut next[0], TURN), y)
        };
        a.push(x);
        b.push(y);
        ratios.push(y / x);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ma, mb) = (median(&mut a), median(&mut b));
    eprintln!(
        "store_evict side by side ({ROUNDS} turns of {TURN} batches of {BATCH} blocks each): lru {:.2} µs, reuse {:.2} µs per batch; reuse ÷ lru {:.2} (medians), {:.2} (median of the turns' ratios)",
        ma / 1e3,
        mb / 1e3,
        mb / ma,
        median(&mut ratios)
    );
}

fn benches(c: &mut Criterion) {
    memory_report();
    store_evict_side_by_side();
    let mut g = c.benchmark_group("core_ops");
    g.sample_size(20);
    g.measurement_time(std::time::Duration::from_secs(3));
    g.warm_up_time(std::time::Duration::from_secs(1));
    g.throughput(Throughput::Elements(BATCH));

    // Key construction: 32 keys made from vLLM-sized byte strings (the bindings make a key
    // per block of every call).
    let raw: Vec<[u8; KEY_BYTES]> = (0..BATCH)
        .map(|i| {
            let mut b = [0u8; KEY_BYTES];
            b[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
            b
        })
        .collect();
    let mut made: Vec<Key> = Vec::with_capacity(BATCH as usize);
    g.bench_function("key_new", |b| {
        b.iter(|| {
            made.clear();
            made.extend(raw.iter().map(|r| Key::new(std::hint::black_box(&r[..]))));
            std::hint::black_box(&made);
        })
    });

    // Lookup hit: 32 lookups of Ready blocks by one request, then the step ends.
    let mut m = filled(PolicyKind::Lru, true);
    let mut i = 0u64;
    g.bench_function("lookup_hit", |b| {
        b.iter_batched_ref(
            || {
                i = (i + 7919 * BATCH) % u64::from(SLOTS);
                batch(i.min(u64::from(SLOTS) - BATCH))
            },
            |ks: &mut Vec<Key>| {
                for k in ks.iter() {
                    assert_eq!(m.lookup(REQ, k), Lookup::Hit);
                }
                m.end_step();
            },
            BatchSize::SmallInput,
        )
    });

    // Lookup miss: absent from the primary and both tiers.
    let mut next = 1u64 << 40;
    g.bench_function("lookup_miss", |b| {
        b.iter_batched_ref(
            || {
                next += BATCH;
                batch(next)
            },
            |ks: &mut Vec<Key>| {
                for k in ks.iter() {
                    assert_eq!(m.lookup(REQ, k), Lookup::Miss);
                }
                m.end_step();
            },
            BatchSize::SmallInput,
        )
    });
    drop(m);

    // Store + complete with eviction, primary alone: each new block evicts one.
    store_bench(
        &mut g,
        "store_evict_lru",
        filled(PolicyKind::Lru, false),
        |_| {},
    );
    store_bench(
        &mut g,
        "store_evict_arc",
        filled(PolicyKind::Arc, false),
        |_| {},
    );
    store_bench(
        &mut g,
        "store_evict_reuse",
        filled(PolicyKind::Reuse, false),
        |_| {},
    );
    // Cascade: store + complete (ok) to 2 tiers, their jobs' results, and the step's end.
    store_bench(
        &mut g,
        "store_cascade_2_tiers",
        filled(PolicyKind::Lru, true),
        |m| {
            complete_jobs(m);
            m.end_step();
            m.end_step();
        },
    );

    // Promotion round trip: lookup (tier hit, Promoting, evicts one), end_step (load job
    // submitted), result, next step's lookup collects it and answers Hit.
    let mut m = filled(PolicyKind::Lru, true);
    // Tier 0 also holds SLOTS..3*SLOTS; the primary holds the most recent SLOTS keys.
    let mut fill = u64::from(SLOTS);
    while fill < 3 * u64::from(SLOTS) {
        let ks = batch(fill);
        m.prepare_store(REQ, &ks).expect("room");
        m.complete_store(REQ, &ks, true);
        m.request_finished(REQ);
        complete_jobs(&mut m);
        m.end_step();
        fill += BATCH;
    }
    m.end_step();
    let span = 3 * u64::from(SLOTS);
    let mut next = 0u64;
    let mut id = 0;
    g.bench_function("promotion_round_trip", |b| {
        b.iter_batched_ref(
            || {
                let ks = batch(next);
                next = (next + BATCH) % (span - BATCH);
                ks
            },
            |ks: &mut Vec<Key>| {
                let req = request(&mut m, &mut id, ks);
                for k in ks.iter() {
                    assert_eq!(m.lookup(req, k), Lookup::HitPending);
                }
                m.end_step();
                complete_jobs(&mut m);
                m.end_step();
                for k in ks.iter() {
                    assert_eq!(m.lookup(req, k), Lookup::Hit);
                }
                m.request_finished(req);
                m.end_step();
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// Stores batches of new keys (each evicting as many) into `m`, then runs `after`.
fn store_bench(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mut m: Manager,
    after: impl Fn(&mut Manager),
) {
    let mut next = u64::from(SLOTS);
    let mut id = 0;
    g.bench_function(name, |b| {
        b.iter_batched_ref(
            || {
                next += BATCH;
                batch(next)
            },
            |ks: &mut Vec<Key>| {
                let req = request(&mut m, &mut id, ks);
                let p = m.prepare_store(req, ks).expect("room");
                black_box(p.slots.len());
                m.complete_store(req, ks, true);
                m.request_finished(req);
                after(&mut m);
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(core_ops, benches);
criterion_main!(core_ops);
