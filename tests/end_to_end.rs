//! The driver end to end over real parts: a shared region in a temporary directory, the host
//! transfer engine, and a file tier on disk. Each test names the contract rule it checks.

#[path = "support/rig.rs"]
mod rig;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Config, Health, Key, Lookup, RequestId};
use kvtier_hw::{
    DriverOptions, FaultHandle, Faults, FaultyStore, FileOptions, FileStore, HostEngine, Layout,
    PAGE, Region, SecondaryStore,
};
use rig::{Rig, Shape, key, within};

const SLOTS: u32 = 4;
const BLOCK: usize = 2 * PAGE;
const DEVICE_BLOCKS: usize = 16;

/// A block's content: every byte depends on the key and its position.
fn content(key: &Key) -> Vec<u8> {
    rig::content(key, BLOCK)
}

fn open_store(dir: &Path) -> Arc<FileStore> {
    Arc::new(
        FileStore::open(dir, BLOCK, 16 * (BLOCK + PAGE) as u64 + PAGE as u64)
            .expect("file tier opens"),
    )
}

fn rig(dir: &Path, store: Arc<dyn SecondaryStore>) -> Rig {
    rig_with(dir, vec![store], DriverOptions::default(), |_, _| {})
}

/// A rig over `stores`; `tune` sees the host engine and the core's configuration before the
/// driver owns them.
fn rig_with(
    dir: &Path,
    stores: Vec<Arc<dyn SecondaryStore>>,
    options: DriverOptions,
    tune: impl FnOnce(&HostEngine, &mut Config),
) -> Rig {
    let shape = Shape {
        slots: SLOTS,
        block: BLOCK,
        device_blocks: DEVICE_BLOCKS,
        threads: 2,
    };
    Rig::new(dir, shape, stores, options, |engine, config| {
        config.health.failures_to_down = 2;
        config.health.probe_interval_steps = 3;
        config.promotion_cooldown_steps = 4;
        tune(engine, config);
    })
}

/// Stores blocks 0..n, each at device block `i % 8`, a step after each.
fn fill(r: &mut Rig, n: u32) {
    for i in 0..n {
        r.store(&key(i), i as usize % 8);
        r.driver.settle(2);
    }
}

/// ★1, M4, M6: store → cascade → evicted from the primary → promoted from the file tier →
/// loaded to the device with the bytes that were stored.
#[test]
fn promotion_from_the_file_tier_returns_the_stored_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(dir.path(), open_store(&dir.path().join("tier")));
    fill(&mut r, 8);
    let tier = r.driver.manager().tier(kvtier_core::TierId(0)).unwrap();
    assert_eq!(tier.len(), 8, "every block cascaded");
    assert!(
        r.driver.manager().primary().state_of(&key(0)).is_none(),
        "key 0 evicted from the primary"
    );
    for i in 0..8 {
        assert_eq!(r.lookup(&key(i)), Lookup::Hit, "block {i}");
        assert_eq!(r.load(&key(i), 12), content(&key(i)), "block {i} bytes");
    }
    assert!(r.driver.manager().stats().promotions_succeeded >= 4);
    r.driver.manager().check_invariants().unwrap();
}

/// ★6: blocks survive a restart: a new driver over the reopened file tier finds them and
/// verifies them on promotion.
#[test]
fn restart_finds_every_block_again() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut r = rig(dir.path(), open_store(&dir.path().join("tier")));
        fill(&mut r, 8);
        let report = r.driver.shutdown();
        assert_eq!(report.abandoned, 0);
    }
    let store = open_store(&dir.path().join("tier"));
    assert_eq!(store.open_report().recovered, 8);
    assert_eq!(store.open_report().corrupt, 0);
    let mut r = rig(dir.path(), store);
    for i in 0..8 {
        assert_eq!(r.lookup(&key(i)), Lookup::Hit, "block {i} after restart");
        assert_eq!(r.load(&key(i), 9), content(&key(i)));
    }
}

fn damage(dir: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(dir.join("tier").join(kvtier_hw::DATA_FILE))
        .unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

/// ★1: a flipped byte on disk fails the promotion: the lookup ends Miss, never a Hit with
/// wrong bytes.
#[test]
fn a_corrupt_record_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(&dir.path().join("tier"));
    let mut r = rig(dir.path(), store.clone());
    fill(&mut r, 8);
    let at = store.record_offset(&key(1)).unwrap() + PAGE as u64 + 100;
    damage(dir.path(), at, &[0x5a]);
    assert_eq!(
        r.lookup(&key(1)),
        Lookup::Miss,
        "a failed promotion cools down to Miss (★2)"
    );
    let stats = r.driver.manager().stats();
    assert_eq!(stats.promotions_failed, 1);
    assert_eq!(stats.tiers[0].1.read_failures, 1);
    // The other blocks are intact and still served.
    assert_eq!(r.lookup(&key(2)), Lookup::Hit);
    assert_eq!(r.load(&key(2), 12), content(&key(2)));
}

/// ★6, ★1: a data file cut short drops the records past its end at open; a torn write (half a
/// record's payload never reached the disk) is found at the record's first read, which fails:
/// the lookup ends Miss, never a Hit with wrong bytes, and the read is counted. The other
/// blocks are found and served.
#[test]
fn torn_and_truncated_records_are_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let (torn, last) = {
        let store = open_store(&dir.path().join("tier"));
        let mut r = rig(dir.path(), store.clone());
        fill(&mut r, 8);
        let torn = store.record_offset(&key(3)).unwrap();
        let last = store.record_offset(&key(7)).unwrap();
        drop(r);
        (torn, last)
    };
    damage(
        dir.path(),
        torn + PAGE as u64 + BLOCK as u64 / 2,
        &vec![0; BLOCK / 2],
    );
    let data = dir.path().join("tier").join(kvtier_hw::DATA_FILE);
    OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(last + PAGE as u64 + 100)
        .unwrap();
    let store = open_store(&dir.path().join("tier"));
    assert_eq!(store.open_report().corrupt, 1, "{:?}", store.open_report());
    assert_eq!(store.open_report().recovered, 7);
    assert!(!store.contains(&key(7)).unwrap());
    let mut r = rig(dir.path(), store.clone());
    assert_eq!(r.lookup(&key(3)), Lookup::Miss);
    assert_eq!(store.corrupt_reads(), 1, "the torn payload failed its read");
    assert_eq!(r.lookup(&key(7)), Lookup::Miss);
    assert_eq!(r.lookup(&key(4)), Lookup::Hit);
    assert_eq!(r.load(&key(4), 10), content(&key(4)));
}

fn faulty(dir: &Path) -> (Arc<dyn SecondaryStore>, FaultHandle) {
    let f = FaultyStore::new(open_store(&dir.join("tier")));
    let h = f.faults();
    (Arc::new(f), h)
}

/// ★3, M9, H1–H6: a full disk fails the cascades; the tier goes Down, the primary keeps every
/// block (nothing lost), and a health probe brings the tier back once there is room again.
#[test]
fn a_full_disk_takes_the_tier_down_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty(dir.path());
    let mut r = rig(dir.path(), store);
    faults.set(Faults {
        space_left: Some(0),
        ..Faults::default()
    });
    fill(&mut r, 3);
    let stats = r.driver.manager().stats();
    assert!(
        matches!(stats.tiers[0].0, Health::Down { .. } | Health::Probing),
        "{:?}",
        stats.tiers[0]
    );
    assert_eq!(stats.tiers[0].1.went_down, 1);
    for i in 0..3 {
        assert_eq!(
            r.lookup(&key(i)),
            Lookup::Hit,
            "block {i} stays in the primary"
        );
        assert_eq!(r.load(&key(i), 12), content(&key(i)));
    }
    faults.set(Faults::default());
    for _ in 0..4 {
        r.driver.settle(1); // steps pass until the probe is due, then it runs
    }
    let stats = r.driver.manager().stats();
    assert_eq!(stats.tiers[0].0, Health::Up, "the probe found room again");
    assert_eq!(stats.tiers[0].1.came_up, 1);
    fill(&mut r, 8);
    // Blocks 0–2 were stored while the tier was Down: they stay primary-only (a cascade
    // happens once, at store time); 3–7 cascade normally.
    assert_eq!(
        r.driver
            .manager()
            .tier(kvtier_core::TierId(0))
            .unwrap()
            .len(),
        5
    );
}

/// ★1, ★2: a store that hands back corrupt bytes fails every promotion; lookups end Miss and
/// the primary's own blocks are unaffected.
#[test]
fn failed_reads_answer_miss_never_wrong_data() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty(dir.path());
    let mut r = rig(dir.path(), store);
    fill(&mut r, 8);
    faults.set(Faults {
        corrupt_gets: true,
        ..Faults::default()
    });
    assert_eq!(r.lookup(&key(0)), Lookup::Miss);
    assert_eq!(r.lookup(&key(7)), Lookup::Hit, "still in the primary");
    assert_eq!(r.load(&key(7), 3), content(&key(7)));
    assert!(faults.counts().injected >= 1);
}

/// M10: shutdown with jobs in flight ends every one of them and leaves the tier's blocks on
/// disk.
#[test]
fn shutdown_ends_every_job() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = rig(dir.path(), open_store(&dir.path().join("tier")));
    for i in 0..4 {
        r.store(&key(i), i as usize);
    }
    let report = r.driver.shutdown();
    assert_eq!(report.abandoned, 0);
    let store = open_store(&dir.path().join("tier"));
    assert_eq!(
        store.open_report().recovered,
        4,
        "the cascades in flight reached the disk"
    );
}

/// Region: a second process's view attaches with the same layout and refuses another one.
#[test]
fn region_attach_checks_the_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    let layout = Layout::new(8, 2, 3000).unwrap();
    // The parts follow one another; the row is padded to a page (vLLM's CPU tier's rows).
    assert_eq!(layout.sub_slot_bytes(), 3000);
    assert_eq!(layout.row_bytes(), 2 * PAGE);
    assert_eq!(layout.offset(kvtier_core::SlotId(1), 1), 2 * PAGE + 3000);
    assert_eq!(Layout::new(8, 3, 3000).unwrap().row_bytes(), 3 * PAGE);
    let owner = Region::create(&path, layout, 2).unwrap();
    let mode = std::fs::metadata(&path).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );
    assert!(matches!(
        Region::create(&path, layout, 1),
        Err(kvtier_hw::RegionError::Exists { .. })
    ));
    Region::attach(&path, layout, std::time::Duration::from_millis(10), 1).unwrap();
    let other = Layout::new(9, 2, 3000).unwrap();
    assert!(matches!(
        Region::attach(&path, other, std::time::Duration::from_millis(10), 1),
        Err(kvtier_hw::RegionError::SizeMismatch { .. })
    ));
    drop(owner);
    assert!(!path.exists(), "the owner removes the region");
    assert!(matches!(
        Region::attach(&path, layout, std::time::Duration::from_millis(20), 1),
        Err(kvtier_hw::RegionError::AttachTimeout { .. })
    ));
}

/// A file tier opened with another block size refuses instead of losing its blocks.
#[test]
fn a_file_tier_keeps_its_layout() {
    let dir = tempfile::tempdir().unwrap();
    drop(open_store(dir.path()));
    let err = FileStore::open(dir.path(), 2 * BLOCK, 1 << 20).unwrap_err();
    assert!(err.to_string().contains("8192-byte blocks"), "{err}");
    let err = FileStore::open(dir.path(), BLOCK, 4 * (BLOCK + PAGE) as u64).unwrap_err();
    assert!(err.to_string().contains("smaller capacity"), "{err}");
}

/// A region or a file tier larger than the free space is refused at once with a clear error,
/// leaving nothing behind that a later open would misread.
#[test]
fn no_room_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let free = kvtier_hw::free_bytes(dir.path()).unwrap();
    let rows = u32::try_from(free / (1 << 20) + 16).unwrap();
    let huge = Layout::new(rows, 1, 1 << 20).unwrap();
    let path = dir.path().join("region");
    let err = Region::create(&path, huge, 1).unwrap_err();
    assert!(
        matches!(err, kvtier_hw::RegionError::NoSpace { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("not enough room"), "{err}");
    assert!(!path.exists());
    let tier = dir.path().join("tier");
    let err = FileStore::open(&tier, BLOCK, free + (64 << 20)).unwrap_err();
    assert!(
        matches!(err, kvtier_hw::StoreError::NoSpace { .. }),
        "{err}"
    );
    let store = open_store(&tier);
    assert!(
        store.open_report().created,
        "the failed open left nothing to misread"
    );
}

/// The file tier bypasses the page cache by default; buffered IO (the fallback where a
/// filesystem refuses `O_DIRECT`, or by choice) stores and verifies the same way, and a tier
/// written one way reopens the other.
#[test]
fn direct_and_buffered_io_agree() {
    let dir = tempfile::tempdir().unwrap();
    let k = key(1);
    {
        let store = open_store(dir.path());
        assert!(
            store.open_report().direct_io,
            "a disk filesystem takes O_DIRECT"
        );
        store.put(&k, &content(&k)).unwrap();
    }
    let cap = 16 * (BLOCK + PAGE) as u64 + PAGE as u64;
    let buffered = FileStore::open_with(
        dir.path(),
        BLOCK,
        cap,
        FileOptions {
            direct_io: false,
            ..FileOptions::default()
        },
    )
    .unwrap();
    assert!(!buffered.open_report().direct_io);
    assert_eq!(buffered.open_report().recovered, 1);
    let mut back = vec![0; BLOCK];
    buffered.get(&k, &mut back).unwrap();
    assert_eq!(back, content(&k));
    let j = key(2);
    buffered.put(&j, &content(&j)).unwrap();
    drop(buffered);
    let direct = open_store(dir.path());
    direct.get(&j, &mut back).unwrap();
    assert_eq!(back, content(&j));
}

/// M10: a store that ends while shutdown waits starts cascades that were not in flight when
/// shutdown began; the report counts what ended and what was abandoned without underflowing.
#[test]
fn shutdown_counts_cascades_started_while_it_waits() {
    let dir = tempfile::tempdir().unwrap();
    // The copy ends well within the timeout; the cascades it starts take far longer.
    let slow = Faults {
        put_delay: Some(std::time::Duration::from_secs(20)),
        ..Faults::default()
    };
    let (a, fa) = faulty(&dir.path().join("a"));
    let (b, fb) = faulty(&dir.path().join("b"));
    fa.set(slow.clone());
    fb.set(slow);
    let options = DriverOptions {
        shutdown_timeout: std::time::Duration::from_secs(2),
        ..DriverOptions::default()
    };
    let mut r = rig_with(dir.path(), vec![a, b], options, |_, _| {});
    let k = key(1);
    r.device.write(0, &content(&k)).unwrap();
    let t = r.driver.store(RequestId(1), &[(k, 0)]).unwrap();
    assert!(t.is_some(), "the copy is in flight");
    let report = r.driver.shutdown();
    assert_eq!(
        report,
        kvtier_hw::ShutdownReport {
            drained: 1,
            ended_failed: 2,
            abandoned: 2
        },
        "the store ended; its two cascades were abandoned and ended as failed"
    );
}

/// J1: a store that panics ends its job as failed, like an IO error; the IO threads live on,
/// nothing waits forever, and the tier serves again once the fault is gone.
#[test]
fn a_panicking_store_fails_its_jobs_and_the_tier_lives_on() {
    within(Duration::from_secs(60), || {
        let dir = tempfile::tempdir().unwrap();
        let (store, faults) = faulty(dir.path());
        // One IO thread and a tier that stays Up: every cascade panics on the same thread,
        // which would leave the rest unrun if a panic ended it.
        let options = DriverOptions {
            io_threads_per_tier: 1,
            ..DriverOptions::default()
        };
        let mut r = rig_with(dir.path(), vec![store], options, |_, config| {
            config.health.failures_to_down = 100;
        });
        faults.set(Faults {
            panic: true,
            ..Faults::default()
        });
        for i in 0..5 {
            r.store(&key(i), i as usize);
            r.driver.settle(2);
        }
        let stats = r.driver.manager().stats();
        assert_eq!(stats.tiers[0].1.write_failures, 5, "{stats:?}");
        assert_eq!(r.driver.in_flight(), 0);
        assert_eq!(r.driver.manager().outstanding_jobs().count(), 0);
        faults.set(Faults::default());
        r.store(&key(10), 10);
        r.driver.settle(2);
        let tier = r.driver.manager().tier(kvtier_core::TierId(0)).unwrap();
        assert!(
            tier.state_of(&key(10)).is_some(),
            "the thread serves new cascades"
        );
        r.driver.manager().check_invariants().unwrap();
        let report = r.driver.shutdown();
        assert_eq!(report.abandoned, 0);
    });
}

/// P9, P13: a copy thread that panics ends its transfer as failed: the store's Pending slot
/// goes back, a load's pins are released, and the engine copies the next job.
#[test]
fn a_panicking_copy_fails_its_transfer() {
    within(Duration::from_secs(60), || {
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(&dir.path().join("tier"));
        let mut r = rig_with(
            dir.path(),
            vec![store],
            DriverOptions::default(),
            |engine, _| engine.inject_copy_panics(1),
        );
        let k = key(1);
        r.device.write(0, &content(&k)).unwrap();
        let t = r.driver.store(RequestId(1), &[(k.clone(), 0)]).unwrap();
        let err = r.driver.wait(t.unwrap()).unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
        assert!(r.driver.manager().primary().state_of(&k).is_none());
        r.store(&k, 0);
        assert_eq!(r.lookup(&k), Lookup::Hit);
        assert_eq!(r.load(&k, 5), content(&k));
        r.driver.manager().check_invariants().unwrap();
    });
}

/// Transfers nobody waits for do not grow the driver: past the bound the oldest result is
/// dropped, and waiting for it is a clear error.
#[test]
fn results_nobody_waits_for_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let options = DriverOptions {
        kept_results: 2,
        ..DriverOptions::default()
    };
    let mut r = rig_with(
        dir.path(),
        vec![open_store(&dir.path().join("tier"))],
        options,
        |_, _| {},
    );
    let mut ids = Vec::new();
    for i in 0..4 {
        let k = key(i);
        r.device.write(i as usize * BLOCK, &content(&k)).unwrap();
        let t = r.driver.store(RequestId(1), &[(k, i as usize * BLOCK)]);
        ids.push(t.unwrap().unwrap());
        r.driver.settle(2);
    }
    assert_eq!(r.driver.kept_results(), 2);
    let err = r.driver.wait(ids[0]).unwrap_err();
    assert!(matches!(err, kvtier_hw::HwError::ResultDropped(0)), "{err}");
    r.driver.wait(ids[3]).unwrap();
    assert_eq!(r.driver.kept_results(), 1);
}

/// M10: after a timed-out shutdown, tier jobs still queued are dropped unrun: the core has let
/// their slots go, so they must not touch them.
#[test]
fn shutdown_drops_queued_jobs_unrun() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty(dir.path());
    faults.set(Faults {
        put_delay: Some(std::time::Duration::from_millis(500)),
        ..Faults::default()
    });
    let options = DriverOptions {
        io_threads_per_tier: 1,
        shutdown_timeout: std::time::Duration::from_millis(100),
        ..DriverOptions::default()
    };
    let mut r = rig_with(dir.path(), vec![store], options, |_, config| {
        config.health.failures_to_down = 100;
    });
    r.store(&key(0), 0);
    // The first cascade is running (its put sleeps) before the other two are queued, so the
    // IO thread cannot take them with it as one batch.
    while faults.counts().puts_begun == 0 {
        r.driver.poll();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for i in 1..3 {
        r.store(&key(i), i as usize);
    }
    r.driver.poll(); // the copies' ends queue the other two cascades
    let report = r.driver.shutdown();
    assert_eq!(report.abandoned, 3, "{report:?}");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        faults.counts().puts <= 1,
        "only the cascade already running may write; the queued ones never run: {:?}",
        faults.counts()
    );
}

/// J1, M6: cascades queued behind one another are written as one batch, and each job still
/// ends with its own blocks' results: with room for three blocks, the fourth job alone fails.
#[test]
fn batched_cascades_end_each_job_with_its_own_results() {
    let dir = tempfile::tempdir().unwrap();
    let (store, faults) = faulty(dir.path());
    faults.set(Faults {
        put_delay: Some(std::time::Duration::from_millis(100)),
        space_left: Some(3 * BLOCK as u64),
        ..Faults::default()
    });
    let options = DriverOptions {
        io_threads_per_tier: 1,
        ..DriverOptions::default()
    };
    let mut r = rig_with(dir.path(), vec![store], options, |_, config| {
        config.health.failures_to_down = 100;
    });
    for i in 0..4 {
        r.store(&key(i), i as usize);
        r.driver.poll(); // the copy's end queues the cascade behind the one running
    }
    r.driver.settle(4);
    let tier = r.driver.manager().tier(kvtier_core::TierId(0)).unwrap();
    for i in 0..3 {
        assert!(tier.state_of(&key(i)).is_some(), "block {i} cascaded");
    }
    assert!(tier.state_of(&key(3)).is_none(), "block 3 found no room");
    let stats = r.driver.manager().stats();
    assert_eq!(stats.tiers[0].1.blocks, 3, "{stats:?}");
    assert_eq!(stats.tiers[0].1.write_failures, 1, "{stats:?}");
    assert_eq!(faults.counts().puts, 3);
    r.driver.manager().check_invariants().unwrap();
}
