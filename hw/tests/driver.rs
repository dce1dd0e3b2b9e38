//! The driver against scripted transfer engines: which results it keeps for `wait`, and
//! timeouts without a bound.

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Config, Key, Lookup, RequestId, SlotId, TierConfig, TierKind};
use kvtier_hw::{
    Completion, Completions, CopyJob, Driver, DriverOptions, EngineError, FaultHandle, Faults,
    FaultyStore, FileStore, HwError, Layout, PAGE, Region, SecondaryStore, TierMetrics,
    TransferEngine,
};

/// An engine that holds jobs until three are queued, then completes them all, newest first
/// (as short copies submitted after a long one end before it).
struct NewestFirst {
    held: Vec<CopyJob>,
}

impl TransferEngine for NewestFirst {
    fn name(&self) -> &'static str {
        "newest-first"
    }

    fn submit(&mut self, job: CopyJob, _done: &Completions) -> Result<(), EngineError> {
        self.held.push(job);
        Ok(())
    }

    fn poll(&mut self, done: &Completions) -> bool {
        if self.held.len() < 3 {
            return !self.held.is_empty();
        }
        for job in self.held.drain(..).rev() {
            let _ = done.push(Completion::Transfer {
                id: job.id,
                result: Ok(()),
                bytes: 0,
                elapsed: Duration::ZERO,
                service: Duration::ZERO,
            });
        }
        false
    }
}

/// A driver of 8 one-page slots and no tiers over `engine`; the directory holds its region.
fn driver(
    dir: &std::path::Path,
    engine: impl TransferEngine + 'static,
    options: DriverOptions,
) -> Result<Driver, HwError> {
    let layout = Layout::new(8, 1, PAGE).unwrap();
    let region = Arc::new(Region::create(&dir.join("region"), layout, 1).unwrap());
    Driver::new(
        Config::new(8),
        region,
        Box::new(engine),
        Vec::new(),
        options,
    )
}

/// `kept_results` drops the results that ended first, never the one a `wait` is waiting for.
#[test]
fn the_result_being_waited_for_is_not_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let options = DriverOptions {
        kept_results: 2,
        ..DriverOptions::default()
    };
    let mut driver = driver(dir.path(), NewestFirst { held: Vec::new() }, options).unwrap();
    let ids: Vec<_> = (0..3u8)
        .map(|i| {
            driver
                .store(RequestId(1), &[(Key::new(&[i]), usize::from(i) * PAGE)])
                .unwrap()
                .unwrap()
        })
        .collect();
    // All three end while the first is waited for, newest first: the one waited for is kept,
    // and of the other two the one that ended first is dropped.
    driver.wait(ids[0]).unwrap();
    driver.wait(ids[1]).unwrap();
    let err = driver.wait(ids[2]).unwrap_err();
    assert!(matches!(err, HwError::ResultDropped(2)), "{err}");
    assert_eq!(driver.kept_results(), 0);
}

/// An engine whose every job has ended by the time `submit` returns.
struct Immediate;

impl TransferEngine for Immediate {
    fn name(&self) -> &'static str {
        "immediate"
    }

    fn submit(&mut self, job: CopyJob, done: &Completions) -> Result<(), EngineError> {
        let _ = done.push(Completion::Transfer {
            id: job.id,
            result: Ok(()),
            bytes: 0,
            elapsed: Duration::ZERO,
            service: Duration::ZERO,
        });
        Ok(())
    }

    fn poll(&mut self, _done: &Completions) -> bool {
        false
    }
}

/// "Wait as long as it takes" (`Duration::MAX`) as `shutdown_timeout` or `wait_any`'s timeout
/// waits; it does not overflow the clock and panic (in `Drop`, during a panic, an abort).
#[test]
fn an_unbounded_timeout_does_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let options = DriverOptions {
        shutdown_timeout: Duration::MAX,
        ..DriverOptions::default()
    };
    let mut driver = driver(dir.path(), Immediate, options).unwrap();
    driver
        .store(RequestId(1), &[(Key::new(b"k"), 0)])
        .unwrap()
        .unwrap();
    // The transfer's completion is queued: the wait ends at once.
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        driver.wait_any(Duration::MAX);
    }));
    let shut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.shutdown()));
    assert!(waited.is_ok(), "wait_any(Duration::MAX) panicked");
    assert!(
        shut.is_ok(),
        "shutdown with shutdown_timeout = Duration::MAX panicked"
    );
}

#[test]
fn kept_results_must_keep_one() {
    let dir = tempfile::tempdir().unwrap();
    let options = DriverOptions {
        kept_results: 0,
        ..DriverOptions::default()
    };
    let err = driver(dir.path(), Immediate, options).unwrap_err();
    assert!(matches!(err, HwError::Setup(_)), "{err}");
    assert!(err.to_string().contains("kept_results"), "{err}");
}

/// A driver of 8 one-page slots over the scripted [`Immediate`] engine, with one file tier of
/// 16 blocks behind a [`FaultyStore`]; `dir` holds the region and the tier.
struct FaultyTier {
    driver: Driver,
    region: Arc<Region>,
    faults: FaultHandle,
    capacity: u32,
    layout: Layout,
}

fn faulty_tier(dir: &std::path::Path, wait_deadline: Option<u64>) -> FaultyTier {
    let layout = Layout::new(8, 1, PAGE).unwrap();
    let row = layout.row_bytes() as u64;
    let region = Arc::new(Region::create(&dir.join("region"), layout, 1).unwrap());
    let file = FileStore::open(&dir.join("tier"), layout.row_bytes(), 16 * row).unwrap();
    let store = FaultyStore::new(Arc::new(file));
    let faults = store.faults();
    let capacity = store.capacity_blocks();
    let mut config = Config::new(8);
    config
        .tiers
        .push(TierConfig::new(TierKind::Authoritative, capacity));
    config.wait_deadline = wait_deadline;
    let stores: Vec<Arc<dyn SecondaryStore>> = vec![Arc::new(store)];
    let driver = Driver::new(
        config,
        region.clone(),
        Box::new(Immediate),
        stores,
        DriverOptions::default(),
    )
    .unwrap();
    FaultyTier {
        driver,
        region,
        faults,
        capacity,
        layout,
    }
}

/// `take_tier_metrics`: gauges as they are, counters since the previous take (zero when
/// nothing happened), and a read that fails verification counted as such, with its
/// promotion's latency marked failed.
#[test]
fn tier_metrics_are_increments_since_the_last_take() {
    let dir = tempfile::tempdir().unwrap();
    let FaultyTier {
        mut driver,
        faults,
        capacity,
        layout,
        ..
    } = faulty_tier(dir.path(), None);
    let row = layout.row_bytes() as u64;
    let quiet = |blocks| TierMetrics {
        capacity_blocks: u64::from(capacity),
        blocks,
        up: true,
        ..TierMetrics::default()
    };
    assert_eq!(driver.take_tier_metrics(), vec![quiet(0)]);

    for i in 0..2u8 {
        let key = Key::new(&[i]);
        driver
            .store(RequestId(1), &[(key, usize::from(i) * PAGE)])
            .unwrap()
            .unwrap();
    }
    driver.settle(16);
    let [m] = &driver.take_tier_metrics()[..] else {
        panic!("one tier")
    };
    assert_eq!(
        (m.cascade_jobs, m.blocks_cascaded, m.bytes_written, m.blocks),
        (2, 2, 2 * row, 2)
    );
    assert_eq!(driver.take_tier_metrics(), vec![quiet(2)]);

    // The primary forgets; the tier's copy of block 0 reads back corrupt.
    driver.reset_cache(Duration::from_secs(10)).unwrap();
    driver.reset_flushed();
    faults.set(Faults {
        corrupt_gets: true,
        ..Faults::default()
    });
    assert_eq!(
        driver.lookup(RequestId(2), &Key::new(&[0])),
        Lookup::HitPending
    );
    driver.end_step();
    driver.settle(16);
    let [m] = &driver.take_tier_metrics()[..] else {
        panic!("one tier")
    };
    assert_eq!(
        (
            m.promotions,
            m.read_failures,
            m.verification_failures,
            m.jobs_failed,
            m.bytes_read
        ),
        (1, 1, 1, 1, 0)
    );
    assert!(
        matches!(&m.promotion_latencies[..], [(false, s)] if *s >= 0.0),
        "{:?}",
        m.promotion_latencies
    );
    driver.shutdown();
}

/// ★9 (W3, W4) through the driver: a tier whose reads hang holds a returning request for the
/// wait deadline (milliseconds on the driver's clock), then the request computes the block;
/// once the tier wakes up, its read ends in exactly one result, the block is served to a new
/// request, and nothing is left pinned or in flight.
#[test]
fn a_hung_tier_holds_a_request_only_until_the_wait_deadline() {
    const DEADLINE_MS: u64 = 200;
    let dir = tempfile::tempdir().unwrap();
    let FaultyTier {
        mut driver,
        region,
        faults,
        layout,
        ..
    } = faulty_tier(dir.path(), Some(DEADLINE_MS));
    let key = Key::new(b"returning");
    // The engine's copy (the scripted engine copies nothing): the block's bytes in the slot
    // its store takes, the first fresh one.
    region
        .write_part(SlotId(0), 0, 0, &vec![0x5a; layout.sub_slot_bytes()])
        .unwrap();
    driver
        .store(RequestId(1), &[(key.clone(), 0)])
        .unwrap()
        .unwrap();
    driver.settle(16);
    // The primary forgets the block; only the tier has it, and the tier's reads hang.
    driver.reset_cache(Duration::from_secs(10)).unwrap();
    driver.reset_flushed();
    faults.set(Faults {
        hang_gets: true,
        ..Faults::default()
    });

    let waiting = RequestId(2);
    let started = std::time::Instant::now();
    let mut answers = Vec::new();
    let gave_up = loop {
        let answer = driver.lookup(waiting, &key);
        answers.push(answer);
        if answer == Lookup::Miss {
            break started.elapsed();
        }
        assert_eq!(answer, Lookup::HitPending, "{answers:?}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "still held after a minute: {} lookups",
            answers.len()
        );
        driver.end_step();
        std::thread::sleep(Duration::from_millis(5));
    };
    // W3 is strict on the driver's whole milliseconds: the real wait is longer than them.
    assert!(gave_up > Duration::from_millis(DEADLINE_MS), "{gave_up:?}");
    assert!(
        faults.counts().gets_begun >= 1,
        "the read was started and hangs"
    );
    let stats = driver.manager().stats();
    assert_eq!((stats.wait_timeouts, stats.promotions_succeeded), (1, 0));
    // W4: the request that gave up keeps computing the block.
    assert_eq!(driver.lookup(waiting, &key), Lookup::Miss);

    // The tier wakes up: the read ends once, and the block is Ready for a new request.
    faults.set(Faults::default());
    driver.settle(16);
    let stats = driver.manager().stats();
    assert_eq!(
        (
            stats.promotions_succeeded,
            stats.jobs_outstanding,
            stats.load_pins,
            stats.job_pins
        ),
        (1, 0, 0, 0)
    );
    assert_eq!(driver.lookup(RequestId(3), &key), Lookup::Hit);
    assert_eq!(
        driver.lookup(waiting, &key),
        Lookup::Miss,
        "W4 until it finishes"
    );
    driver.request_finished(waiting);
    assert_eq!(driver.lookup(waiting, &key), Lookup::Hit);
    let (slot, _) = driver.manager().primary().state_of(&key).unwrap();
    let mut promoted = vec![0u8; layout.sub_slot_bytes()];
    region.read_part(slot, 0, 0, &mut promoted).unwrap();
    assert!(promoted.iter().all(|&x| x == 0x5a), "the promoted bytes");
    driver.shutdown();
}
