//! The file tier over the simulated directory: creation under crashes, and how many IO
//! operations a job costs.

use kvtier_core::Key;

use super::sim::{SimDir, Tear};
use super::{DATA_FILE, FileOptions, FileStore, FsyncPolicy, PageBuf, TEMP_FILE, file_len};
use crate::region::PAGE;
use crate::store::SecondaryStore;

const BLOCK: usize = PAGE;

fn options(fsync: FsyncPolicy) -> FileOptions {
    FileOptions {
        direct_io: false,
        identity: "test".into(),
        fsync,
        verify_at_open: false,
    }
}

/// Opens (or creates) a tier of `records` blocks in `dir` with the fsync policy `fsync`.
fn open(dir: &SimDir, records: u32, fsync: FsyncPolicy) -> Result<FileStore, crate::StoreError> {
    FileStore::open_in(dir, BLOCK, file_len(BLOCK, records), options(fsync))
}

/// How many IO operations creating and opening a fresh tier of `records` blocks takes (its
/// close not counted).
fn ops_to_open(records: u32, fsync: FsyncPolicy) -> u64 {
    let whole = SimDir::new(512, u64::MAX);
    let store = open(&whole, records, fsync).unwrap();
    let ops = whole.ops();
    drop(store);
    ops
}

fn block(i: u8) -> Vec<u8> {
    vec![i; BLOCK]
}

/// A process killed at any IO operation while it creates a tier (room reserved, superblock
/// not yet written or not yet synced, not yet published) leaves a directory the next open
/// accepts: a fresh tier, or the complete one. Before creation went through a temporary
/// name, the room was reserved under the data file's own name, so a crash right after the
/// reservation left a full-length file without a superblock that every later open refused.
#[test]
fn a_crash_while_creating_never_leaves_a_tier_that_is_refused() {
    let creation_ops = ops_to_open(8, FsyncPolicy::Batch);
    assert!(
        creation_ops >= 5,
        "create, reserve, sync, write, sync, rename, sync: {creation_ops}"
    );
    let mut removed = 0;
    for crash_at in 0..creation_ops {
        for tear in [Tear::DropAll, Tear::KeepAll, Tear::Sectors, Tear::Writes] {
            let dir = SimDir::new(512, crash_at);
            let opened = open(&dir, 8, FsyncPolicy::Batch);
            assert!(dir.crashed(), "crash at {crash_at} happens while opening");
            drop(opened);
            let mut flip = false;
            let after = dir.after_crash(tear, &mut || {
                flip = !flip;
                flip
            });
            let store = open(&after, 8, FsyncPolicy::Batch)
                .unwrap_or_else(|e| panic!("crash at {crash_at}, {tear:?}: {e}"));
            assert_eq!(store.capacity_blocks(), 8);
            assert_eq!(store.open_report().recovered, 0);
            removed += usize::from(store.open_report().removed_temporary);
            assert!(!after.names().iter().any(|n| n == TEMP_FILE));
            store.put(&Key::new(b"k"), &block(1)).unwrap();
        }
    }
    assert!(removed > 0, "some crash left a temporary that was removed");
}

/// A job's blocks land in adjacent records and are written with one IO (plus one sync under
/// `Batch`), and read back with one.
#[test]
fn a_job_of_adjacent_blocks_is_one_write_and_one_read() {
    for (fsync, per_job) in [
        (FsyncPolicy::None, 1),
        (FsyncPolicy::Batch, 2),
        (FsyncPolicy::Write, 2),
    ] {
        let dir = SimDir::new(512, u64::MAX);
        let store = open(&dir, 16, fsync).unwrap();
        // The first store writes a checkpoint reserving the records stored next.
        store.put(&Key::new(b"first"), &block(9)).unwrap();
        let keys: Vec<Key> = (0..4u8).map(|i| Key::new(&[i])).collect();
        let blocks: Vec<Vec<u8>> = (0..4u8).map(block).collect();
        let batch: Vec<(&Key, &[u8])> =
            keys.iter().zip(&blocks).map(|(k, b)| (k, &b[..])).collect();
        let before = dir.ops();
        assert!(store.put_many(&batch).iter().all(Result::is_ok));
        assert_eq!(dir.ops() - before, per_job, "{fsync}");
        // Aligned buffers, as primary rows are (others are read through a copy each).
        let mut out: Vec<PageBuf> = (0..4).map(|_| PageBuf::new(BLOCK)).collect();
        let reads = dir.reads();
        let mut want: Vec<(&Key, &mut [u8])> = keys
            .iter()
            .zip(out.iter_mut())
            .map(|(k, b)| (k, b.as_mut_slice()))
            .collect();
        assert!(store.get_many(&mut want).iter().all(Result::is_ok));
        assert_eq!(dir.reads() - reads, 1);
        for (o, b) in out.iter().zip(&blocks) {
            assert_eq!(o.as_slice(), &b[..]);
        }
    }
}

/// Under `Write`, each run is synced before the next is written: a job split across two runs
/// of records costs two writes and two syncs (besides the checkpoint that reserves them).
#[test]
fn write_policy_syncs_each_run() {
    let dir = SimDir::new(512, u64::MAX);
    let store = open(&dir, 4, FsyncPolicy::Write).unwrap();
    let keys: Vec<Key> = (0..4u8).map(|i| Key::new(&[i])).collect();
    for k in &keys {
        store.put(k, &block(0)).unwrap();
    }
    store.delete(&keys[0]).unwrap();
    store.delete(&keys[2]).unwrap();
    let fresh: Vec<Key> = (10..12u8).map(|i| Key::new(&[i])).collect();
    let before = dir.ops();
    let b = block(7);
    let batch: Vec<(&Key, &[u8])> = fresh.iter().map(|k| (k, &b[..])).collect();
    assert!(store.put_many(&batch).iter().all(Result::is_ok));
    assert_eq!(
        dir.ops() - before,
        6,
        "a checkpoint reserving records 0 and 2 (written, synced), then two runs, each written and synced"
    );
}

/// A failed sync under `Batch` fails every block of the job, and the tier forgets them (its
/// record count stays what the core believes).
#[test]
fn a_failed_sync_fails_the_whole_job() {
    let whole = SimDir::new(512, u64::MAX);
    let opened = open(&whole, 8, FsyncPolicy::Batch).unwrap();
    let first = Key::new(b"first");
    // The first store also writes the checkpoint that reserves records.
    opened.put(&first, &block(1)).unwrap();
    let open_ops = whole.ops();
    drop(opened);
    // Crash at the job's sync: its write (one op) went through.
    let dir = SimDir::new(512, open_ops + 1);
    let store = open(&dir, 8, FsyncPolicy::Batch).unwrap();
    store.put(&first, &block(1)).unwrap();
    let keys: Vec<Key> = (0..3u8).map(|i| Key::new(&[i])).collect();
    let b = block(3);
    let batch: Vec<(&Key, &[u8])> = keys.iter().map(|k| (k, &b[..])).collect();
    let results = store.put_many(&batch);
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert_eq!(store.len(), 1);
}

/// A seed that exercised every policy once, kept as a plain example of the checker.
#[test]
fn crash_scenarios_hold() {
    let mut crashed = 0;
    for seed in 0..64 {
        let run = super::crash::run_seed(seed).unwrap_or_else(|v| panic!("seed {seed}: {v}"));
        crashed += usize::from(run.crashed_mid_operation);
    }
    assert!(crashed > 0);
}

/// Under `Batch`, jobs of several threads share syncs (group commit): fewer syncs than jobs,
/// and every block acknowledged is durable, since the simulated sync covers only what was
/// written before it started. A job relying on a sync that was already running when its
/// writes completed would lose blocks here.
#[test]
fn concurrent_batch_jobs_share_syncs_and_every_acknowledged_block_is_durable() {
    const THREADS: u8 = 4;
    const JOBS: u8 = 40;
    let dir = SimDir::new(512, u64::MAX);
    let records = u32::from(THREADS) * u32::from(JOBS) * 2;
    let store = open(&dir, records, FsyncPolicy::Batch).unwrap();
    let syncs = dir.syncs();
    let acked: Vec<(Key, u8)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (store, dir) = (&store, &dir);
                s.spawn(move || {
                    let mut acked = Vec::new();
                    for j in 0..JOBS {
                        let keys = [Key::new(&[t, j, 0]), Key::new(&[t, j, 1])];
                        let b = block(t.wrapping_mul(JOBS).wrapping_add(j));
                        let batch: Vec<(&Key, &[u8])> = keys.iter().map(|k| (k, &b[..])).collect();
                        for (k, r) in keys.iter().zip(store.put_many(&batch)) {
                            r.unwrap();
                            // Durable as it returns, whatever later syncs do.
                            let at = store.record_offset(k).unwrap();
                            assert!(dir.durable_as_read(DATA_FILE, at, PAGE + BLOCK), "{k}");
                            acked.push((k.clone(), b[0]));
                        }
                    }
                    acked
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let jobs = u64::from(THREADS) * u64::from(JOBS);
    let used = dir.syncs() - syncs;
    assert!(used < jobs, "{used} syncs for {jobs} jobs");
    // A power loss now: nothing unsynced survives.
    dir.crash_now();
    store.abandon();
    let after = dir.after_crash(Tear::DropAll, &mut || false);
    let store = open(&after, records, FsyncPolicy::Batch).unwrap();
    assert_eq!(store.len(), acked.len());
    for (k, v) in acked {
        let mut out = PageBuf::new(BLOCK);
        store.get(&k, out.as_mut_slice()).unwrap();
        assert_eq!(out.as_slice(), &block(v)[..]);
    }
}

/// After a crash, opening reads the last checkpoint and only the headers of the records it
/// named as the next to be written, not every header; every block stored is found, and a
/// block deleted and stored again is found with its newest bytes.
#[test]
fn opening_after_a_crash_reads_the_checkpoint_and_few_headers() {
    const RECORDS: u32 = 2048;
    let dir = SimDir::new(512, u64::MAX);
    let open = |dir: &SimDir| {
        FileStore::open_in(
            dir,
            BLOCK,
            file_len(BLOCK, RECORDS),
            options(FsyncPolicy::Batch),
        )
        .unwrap()
    };
    let store = open(&dir);
    let keys: Vec<Key> = (0..100u8).map(|i| Key::new(&[i])).collect();
    for (i, k) in keys.iter().enumerate() {
        store.put(k, &block(i as u8)).unwrap();
    }
    store.delete(&keys[3]).unwrap();
    store.put(&keys[3], &block(200)).unwrap();
    dir.crash_now();
    store.abandon();
    let after = dir.after_crash(Tear::DropAll, &mut || false);
    let reads = after.reads();
    let store = open(&after);
    let report = store.open_report().clone();
    assert!(report.from_checkpoint && !report.from_index, "{report:?}");
    assert_eq!(report.recovered, keys.len());
    // The superblock (read, and read again to update it), the checkpoint (two reads) and at
    // most 128 headers (2048 / 16 records reserved), against 2048 read by a full scan.
    let read = after.reads() - reads;
    assert!(read <= 4 + 128, "{read} reads");
    for (i, k) in keys.iter().enumerate() {
        let mut out = PageBuf::new(BLOCK);
        store.get(k, out.as_mut_slice()).unwrap();
        let want = if i == 3 { 200 } else { i as u8 };
        assert_eq!(out.as_slice(), &block(want)[..], "block {i}");
    }
}

/// A read or write call that moves fewer bytes than asked (Linux moves at most `0x7ffff000`
/// bytes per `preadv`/`pwritev`, so every run over 2 GiB gets a short count) is called again
/// for the rest: the job is stored and read back whole. Before, a short write failed the job
/// (`WriteZero`) and a short read failed as a torn block.
#[test]
fn short_reads_and_writes_are_completed() {
    let dir = SimDir::new(512, u64::MAX);
    let store = open(&dir, 16, FsyncPolicy::Batch).unwrap();
    store.put(&Key::new(b"first"), &block(9)).unwrap();
    dir.cap_io(3 * 1000);
    let keys: Vec<Key> = (0..4u8).map(|i| Key::new(&[i])).collect();
    let blocks: Vec<Vec<u8>> = (0..4u8).map(block).collect();
    let batch: Vec<(&Key, &[u8])> = keys.iter().zip(&blocks).map(|(k, b)| (k, &b[..])).collect();
    let results = store.put_many(&batch);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let mut out: Vec<PageBuf> = (0..4).map(|_| PageBuf::new(BLOCK)).collect();
    let mut want: Vec<(&Key, &mut [u8])> = keys
        .iter()
        .zip(out.iter_mut())
        .map(|(k, b)| (k, b.as_mut_slice()))
        .collect();
    let results = store.get_many(&mut want);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    for (o, b) in out.iter().zip(&blocks) {
        assert_eq!(o.as_slice(), &b[..]);
    }
    assert_eq!(store.corrupt_reads(), 0);
    // Closed cleanly (index and superblock written in pieces) and opened again from the index.
    drop(store);
    let store = open(&dir, 16, FsyncPolicy::Batch).unwrap();
    assert!(store.open_report().from_index);
    assert_eq!(store.len(), 5);
}

/// A run holds at most 1 GiB as well as at most `MAX_RUN` records, so no single call is asked
/// to move more than Linux moves at once.
#[test]
fn a_run_holds_at_most_a_gibibyte() {
    let records: Vec<u32> = (0..10).collect();
    assert_eq!(super::runs(&records, super::max_run(PAGE)).len(), 1);
    let big = 256 << 20; // 256 MiB blocks: three records per run
    assert_eq!(super::max_run(big), 3);
    let runs = super::runs(&records, super::max_run(big));
    assert_eq!(runs, vec![0..3, 3..6, 6..9, 9..10]);
    assert_eq!(super::max_run(2 << 30), 1);
}

/// After a failed sync the tier acknowledges nothing: Linux reports a writeback error once,
/// to whichever sync comes first, so a later sync that succeeds proves nothing. The next job
/// fails, the health check fails, and no clean close is written (the next open reads the
/// headers). Before, the next job was acknowledged durable by a sync that succeeded.
#[test]
fn a_failed_sync_fails_the_tier() {
    let dir = SimDir::new(512, u64::MAX);
    let store = open(&dir, 8, FsyncPolicy::Batch).unwrap();
    store.put(&Key::new(b"first"), &block(1)).unwrap();
    store.check().unwrap();
    dir.fail_sync(dir.syncs());
    assert!(store.put(&Key::new(b"a"), &block(2)).is_err());
    assert!(store.failed());
    let second = store.put(&Key::new(b"b"), &block(3));
    assert!(second.is_err(), "{second:?}");
    assert!(!store.contains(&Key::new(b"b")).unwrap());
    assert!(store.check().is_err());
    assert!(store.sync().is_err());
    drop(store);
    let store = open(&dir, 8, FsyncPolicy::Batch).unwrap();
    assert!(
        !store.open_report().from_index,
        "no clean close was written"
    );
    assert!(!store.failed());
    assert!(store.contains(&Key::new(b"first")).unwrap());
}

/// A key named twice in one job gets its first occurrence's result for the second: when the
/// first one's write fails, both fail. Before, the second occurrence was answered `Ok` at
/// once, for a block the tier does not hold.
#[test]
fn a_key_named_twice_in_a_job_gets_its_first_occurrences_result() {
    let open_ops = ops_to_open(8, FsyncPolicy::Batch);
    // The job's first IO (the checkpoint that reserves its record) fails.
    let dir = SimDir::new(512, open_ops);
    let store = open(&dir, 8, FsyncPolicy::Batch).unwrap();
    let k = Key::new(b"k");
    let b = block(3);
    let results = store.put_many(&[(&k, &b[..]), (&k, &b[..])]);
    assert!(!store.contains(&k).unwrap());
    assert!(results.iter().all(Result::is_err), "{results:?}");
}
