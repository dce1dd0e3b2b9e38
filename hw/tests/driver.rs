//! The driver against scripted transfer engines: which results it keeps for `wait`, and
//! timeouts without a bound.

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Config, Key, Lookup, RequestId, TierConfig, TierKind};
use kvtier_hw::{
    Completion, Completions, CopyJob, Driver, DriverOptions, EngineError, Faults, FaultyStore,
    FileStore, HwError, Layout, PAGE, Region, SecondaryStore, TierMetrics, TransferEngine,
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

/// `take_tier_metrics`: gauges as they are, counters since the previous take (zero when
/// nothing happened), and a read that fails verification counted as such, with its
/// promotion's latency marked failed.
#[test]
fn tier_metrics_are_increments_since_the_last_take() {
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout::new(8, 1, PAGE).unwrap();
    let row = layout.row_bytes() as u64;
    let region = Arc::new(Region::create(&dir.path().join("region"), layout, 1).unwrap());
    let file = FileStore::open(&dir.path().join("tier"), layout.row_bytes(), 16 * row).unwrap();
    let store = FaultyStore::new(Arc::new(file));
    let faults = store.faults();
    let capacity = store.capacity_blocks();
    let mut config = Config::new(8);
    config
        .tiers
        .push(TierConfig::new(TierKind::Authoritative, capacity));
    let stores: Vec<Arc<dyn SecondaryStore>> = vec![Arc::new(store)];
    let mut driver = Driver::new(
        config,
        region,
        Box::new(Immediate),
        stores,
        DriverOptions::default(),
    )
    .unwrap();
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
