//! A kvtier store under a host's tiering manager (`HostedDriver`, rules G1–G16): blocks move
//! between the host's primary memory and a real file tier, byte for byte; the tier stays
//! within its bound; a reopened tier serves its blocks; a failed read is never a success.

// The host memory is a buffer of the test, handed over as vLLM hands over its own.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{HostedConfig, HostedLookup, Key, SlotId, TierConfig, TierKind};
use kvtier_hw::{
    FaultHandle, Faults, FaultyStore, FileStore, HostRows, HostedDone, HostedDriver, SecondaryStore,
};

const ROW: usize = 4096;
const SLOTS: usize = 8;

/// The host's primary memory; outlives every driver made over it in these tests.
struct Primary(Box<[u8]>);

impl Primary {
    fn new() -> Self {
        Primary(vec![0u8; ROW * SLOTS].into_boxed_slice())
    }
    fn rows(&mut self) -> HostRows {
        // SAFETY: the box outlives the driver (each test drops or shuts the driver first) and
        // the test touches a slot only while no job names it.
        unsafe { HostRows::new(self.0.as_mut_ptr(), self.0.len(), ROW).unwrap() }
    }
    fn fill(&mut self, slot: usize, byte: u8) {
        self.0[slot * ROW..(slot + 1) * ROW].fill(byte);
    }
    fn row(&self, slot: usize) -> &[u8] {
        &self.0[slot * ROW..(slot + 1) * ROW]
    }
}

fn key(i: u8) -> Key {
    Key::new(&[b'h', i])
}

fn driver(store: Arc<dyn SecondaryStore>, rows: HostRows) -> HostedDriver {
    let capacity = store.capacity_blocks();
    HostedDriver::new(
        store,
        HostedConfig::new(TierConfig::new(TierKind::Authoritative, capacity)),
        rows,
        2,
    )
    .unwrap()
}

/// The smallest byte bound of a file tier that holds `n` blocks of a row.
fn bytes_for(n: u32) -> u64 {
    (ROW as u64..)
        .step_by(512)
        .find(|&b| FileStore::capacity_for(ROW, b).is_ok_and(|c| c >= n))
        .unwrap()
}

/// A driver over a file tier whose faults the test sets.
fn faulty_driver(dir: &std::path::Path, primary: &mut Primary) -> (HostedDriver, FaultHandle) {
    let file = FileStore::open(dir, ROW, 8 * ROW as u64).unwrap();
    let faulty = FaultyStore::new(Arc::new(file));
    let faults = faulty.faults();
    (driver(Arc::new(faulty), primary.rows()), faults)
}

/// A faulty tier that holds block 0, and job 2 loading it into slot 3 while reads hang.
fn stored_then_hung(dir: &std::path::Path, primary: &mut Primary) -> (HostedDriver, FaultHandle) {
    let (mut d, faults) = faulty_driver(dir, primary);
    d.submit_store(1, &[(key(0), SlotId(0))]).unwrap();
    assert!(wait(&mut d)[0].success);
    faults.set(Faults {
        hang_gets: true,
        ..Faults::default()
    });
    d.submit_load(2, &[(key(0), SlotId(3))]).unwrap();
    (d, faults)
}

fn wait(d: &mut HostedDriver) -> Vec<HostedDone> {
    d.drain(Duration::from_secs(10)).unwrap();
    d.finished()
}

#[test]
fn blocks_round_trip_through_a_file_tier_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    for slot in 0..4 {
        primary.fill(slot, 0x10 + slot as u8);
    }
    let store = FileStore::open(dir.path(), ROW, 16 * ROW as u64).unwrap();
    let mut d = driver(Arc::new(store), primary.rows());
    let blocks: Vec<(Key, SlotId)> = (0..4).map(|i| (key(i), SlotId(u32::from(i)))).collect();
    d.submit_store(1, &blocks).unwrap();
    let done = wait(&mut d);
    assert_eq!(done.len(), 1);
    assert!(done[0].success && !done[0].load);
    assert_eq!(done[0].bytes, 4 * ROW as u64);
    // G1: present now.
    assert_eq!(d.lookup(&key(2)), HostedLookup::Hit);
    assert_eq!(d.lookup(&key(9)), HostedLookup::Miss);
    // Promote two blocks into other slots.
    d.submit_load(2, &[(key(2), SlotId(6)), (key(0), SlotId(7))])
        .unwrap();
    d.end_step();
    let done = wait(&mut d);
    assert!(done[0].success && done[0].load && done[0].bytes == 2 * ROW as u64);
    drop(d);
    assert!(primary.row(6).iter().all(|&b| b == 0x12));
    assert!(primary.row(7).iter().all(|&b| b == 0x10));
}

#[test]
fn the_tier_stays_within_its_bound_and_a_reopened_tier_serves_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    {
        let store = FileStore::open(dir.path(), ROW, bytes_for(3)).unwrap();
        let mut d = driver(Arc::new(store), primary.rows());
        for i in 0..6u8 {
            primary.fill(0, i);
            d.submit_store(u64::from(i), &[(key(i), SlotId(0))])
                .unwrap();
            assert!(wait(&mut d)[0].success);
            d.end_step();
        }
        assert_eq!(d.usage(), (3, 3));
        assert_eq!(d.stats().core.blocks_evicted, 3);
        d.shutdown(Duration::from_secs(5)).unwrap();
    }
    let store = FileStore::open(dir.path(), ROW, bytes_for(3)).unwrap();
    assert_eq!(
        store.len(),
        3,
        "the evicted blocks were deleted from the files"
    );
    let mut d = driver(Arc::new(store), primary.rows());
    for i in 0..3u8 {
        assert_eq!(d.lookup(&key(i)), HostedLookup::Miss, "evicted: {i}");
    }
    for i in 3..6u8 {
        assert_eq!(d.lookup(&key(i)), HostedLookup::Hit, "kept: {i}");
    }
    d.submit_load(9, &[(key(4), SlotId(5))]).unwrap();
    assert!(wait(&mut d)[0].success);
    drop(d);
    assert!(primary.row(5).iter().all(|&b| b == 4));
}

#[test]
fn a_read_that_fails_verification_is_a_failed_load_and_the_block_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    primary.fill(0, 0xAB);
    primary.fill(1, 0xCD);
    let (mut d, faults) = faulty_driver(dir.path(), &mut primary);
    d.submit_store(1, &[(key(0), SlotId(0)), (key(1), SlotId(1))])
        .unwrap();
    assert!(wait(&mut d)[0].success);
    faults.set(Faults {
        corrupt_gets: true,
        ..Faults::default()
    });
    assert_eq!(d.lookup(&key(0)), HostedLookup::Hit);
    d.submit_load(2, &[(key(0), SlotId(4)), (key(1), SlotId(5))])
        .unwrap();
    d.end_step();
    let done = wait(&mut d);
    assert!(!done[0].success, "a corrupt block is never a loaded block");
    assert_eq!(done[0].succeeded, None);
    assert_eq!(d.stats().corrupt_reads, 2);
    assert_eq!(
        d.lookup(&key(0)),
        HostedLookup::Miss,
        "T11: dropped after the failed read"
    );
    d.check_invariants().unwrap();
}

#[test]
fn a_hung_store_never_blocks_a_call_and_drain_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    let (mut d, faults) = stored_then_hung(dir.path(), &mut primary);
    // Calls return at once while the read hangs.
    assert_eq!(d.lookup(&key(0)), HostedLookup::Hit);
    assert!(d.finished().is_empty());
    assert!(d.has_pending_work());
    let err = d.drain(Duration::from_millis(200)).unwrap_err();
    assert!(err.to_string().contains("still running"), "{err}");
    // The store wakes up: the job ends exactly once.
    faults.set(Faults::default());
    let done = wait(&mut d);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].job, 2);
    d.end_step();
    d.check_invariants().unwrap();
}

#[test]
fn a_slot_outside_the_primary_fails_its_block_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    let store = FileStore::open(dir.path(), ROW, 8 * ROW as u64).unwrap();
    let mut d = driver(Arc::new(store), primary.rows());
    d.submit_store(1, &[(key(0), SlotId(0)), (key(1), SlotId(99))])
        .unwrap();
    let done = wait(&mut d);
    assert!(!done[0].success);
    assert_eq!(d.lookup(&key(0)), HostedLookup::Hit);
    assert_eq!(d.lookup(&key(1)), HostedLookup::Miss);
}

#[test]
fn a_shutdown_that_times_out_returns_and_leaves_the_hung_job_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    let (d, faults) = stored_then_hung(dir.path(), &mut primary);
    while faults.counts().gets_begun == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let begun = std::time::Instant::now();
    let err = d.shutdown(Duration::from_millis(100)).unwrap_err();
    assert!(begun.elapsed() < Duration::from_secs(5), "bounded");
    assert!(err.to_string().contains("still running"), "{err}");
    // The host keeps its memory until the hung read ends (here: the test's buffer).
    faults.set(Faults::default());
    while faults.counts().gets < faults.counts().gets_begun {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    drop(primary);
}

#[test]
fn a_lookup_of_a_block_written_past_the_deadline_misses() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    let file = FileStore::open(dir.path(), ROW, 8 * ROW as u64).unwrap();
    let faulty = FaultyStore::new(Arc::new(file));
    let faults = faulty.faults();
    faults.set(Faults {
        put_delay: Some(Duration::from_millis(400)),
        ..Faults::default()
    });
    let capacity = faulty.capacity_blocks();
    let mut config = HostedConfig::new(TierConfig::new(TierKind::Authoritative, capacity));
    config.wait_deadline = Some(50);
    let mut d = HostedDriver::new(Arc::new(faulty), config, primary.rows(), 2).unwrap();
    d.submit_store(1, &[(key(0), SlotId(0))]).unwrap();
    assert_eq!(d.lookup(&key(0)), HostedLookup::Retry);
    std::thread::sleep(Duration::from_millis(120));
    assert_eq!(d.lookup(&key(0)), HostedLookup::Miss, "past the deadline");
    let done = wait(&mut d);
    assert!(done[0].success, "the write went on and ended once");
    assert_eq!(d.lookup(&key(0)), HostedLookup::Hit);
    assert_eq!(d.stats().core.wait_timeouts, 1);
}

/// A tier under another manager is written as that manager decides: a victim admission
/// (rules V1–V4, kvtier's own manager) is refused with the reason, before anything starts.
#[test]
fn a_victim_admission_is_refused_under_another_manager() {
    let dir = tempfile::tempdir().unwrap();
    let mut primary = Primary::new();
    let file = FileStore::open(dir.path(), ROW, bytes_for(4)).unwrap();
    let mut tier = TierConfig::new(TierKind::Authoritative, file.capacity_blocks());
    tier.admission = kvtier_core::Admission::Victim { lookahead: 8 };
    let err = HostedDriver::new(Arc::new(file), HostedConfig::new(tier), primary.rows(), 1)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("victim tier"), "{err}");
}
