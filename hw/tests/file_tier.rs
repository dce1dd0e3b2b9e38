//! The file tier on a real filesystem: one opener at a time (in this process or another),
//! identity and format checks, a half-created tier left by a dead creator, where torn
//! payloads are caught, and per-block results of a job.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

use kvtier_core::Key;
use kvtier_hw::{
    DATA_FILE, FileOptions, FileStore, FsyncPolicy, PAGE, SecondaryStore, StoreError, TEMP_FILE,
};

const BLOCK: usize = 2 * PAGE;
const CAP: u64 = (PAGE + 8 * (PAGE + BLOCK)) as u64;

fn content(i: u8) -> Vec<u8> {
    (0..BLOCK).map(|b| (b as u8).wrapping_mul(31) ^ i).collect()
}

fn key(i: u8) -> Key {
    Key::new(format!("block-{i}").as_bytes())
}

fn with_identity(identity: &str) -> FileOptions {
    FileOptions {
        identity: identity.into(),
        ..FileOptions::default()
    }
}

/// Two tiers of one configuration given the same path: the second is refused with a typed
/// error naming this process, instead of both writing over each other's records. Once the
/// first is closed, the path opens again.
#[test]
fn a_second_opener_in_this_process_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = FileStore::open(dir.path(), BLOCK, CAP).unwrap();
    let err = FileStore::open(dir.path(), BLOCK, CAP).unwrap_err();
    match &err {
        StoreError::Locked { holder, .. } => assert_eq!(*holder, Some(std::process::id())),
        other => panic!("{other}"),
    }
    assert!(
        err.to_string().contains("two tiers share the path"),
        "{err}"
    );
    drop(first);
    FileStore::open(dir.path(), BLOCK, CAP).unwrap();
}

/// The second process of `a_second_process_is_refused_with_the_holders_pid`: holds the tier
/// open until its standard input closes. Does nothing when run on its own.
#[test]
fn lock_holder_child() {
    let Ok(dir) = std::env::var("KVTIER_TEST_LOCK_HOLDER") else {
        return;
    };
    let _store = FileStore::open(Path::new(&dir), BLOCK, CAP).unwrap();
    let mut out = std::io::stdout();
    writeln!(out, "\nHOLDING-THE-TIER").unwrap();
    out.flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Another process holding the tier: refused with its process id; once it exits (its lock
/// goes with it), the path opens.
#[test]
fn a_second_process_is_refused_with_the_holders_pid() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "lock_holder_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVTIER_TEST_LOCK_HOLDER", dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.unwrap().contains("HOLDING-THE-TIER")),
        "the child opened the tier"
    );
    let err = FileStore::open(dir.path(), BLOCK, CAP).unwrap_err();
    match &err {
        StoreError::Locked { holder, .. } => assert_eq!(*holder, Some(child.id())),
        other => panic!("{other}"),
    }
    assert!(
        err.to_string().contains(&format!("process {}", child.id())),
        "{err}"
    );
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    FileStore::open(dir.path(), BLOCK, CAP).unwrap();
}

/// A tier records the identity of its blocks (model and KV layout): a fine-tuned model with
/// the same layout is refused instead of served the old model's blocks.
#[test]
fn another_identity_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store =
            FileStore::open_with(dir.path(), BLOCK, CAP, with_identity("llama-8b/bf16")).unwrap();
        store.put(&key(1), &content(1)).unwrap();
    }
    let err = FileStore::open_with(dir.path(), BLOCK, CAP, with_identity("llama-8b-ft/bf16"))
        .unwrap_err();
    assert!(matches!(err, StoreError::Identity { .. }), "{err}");
    assert!(err.to_string().contains("\"llama-8b/bf16\""), "{err}");
    let err = FileStore::open(dir.path(), BLOCK, CAP).unwrap_err();
    assert!(matches!(err, StoreError::Identity { .. }), "{err}");
    let store =
        FileStore::open_with(dir.path(), BLOCK, CAP, with_identity("llama-8b/bf16")).unwrap();
    assert_eq!(store.open_report().recovered, 1);
    let long = "x".repeat(kvtier_hw::MAX_IDENTITY_BYTES + 1);
    drop(store);
    let err = FileStore::open_with(dir.path(), BLOCK, CAP, with_identity(&long)).unwrap_err();
    assert!(matches!(err, StoreError::BadInput(_)), "{err}");
}

/// A tier written by the first on-disk format is refused with the versions named, not
/// misread and not called a layout mismatch.
#[test]
fn a_version_1_tier_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // Format 1's superblock: magic, version, block bytes, record count, xxh3 of those.
    let mut page = vec![0u8; PAGE];
    page[0..8].copy_from_slice(b"KVTIERFS");
    page[8..12].copy_from_slice(&1u32.to_le_bytes());
    page[16..24].copy_from_slice(&(BLOCK as u64).to_le_bytes());
    page[24..32].copy_from_slice(&8u64.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&page[0..32]);
    page[32..40].copy_from_slice(&sum.to_le_bytes());
    let file = std::fs::File::create(dir.path().join(DATA_FILE)).unwrap();
    file.write_all_at(&page, 0).unwrap();
    file.set_len(CAP).unwrap();
    let err = FileStore::open(dir.path(), BLOCK, CAP).unwrap_err();
    match &err {
        StoreError::Version {
            found, supported, ..
        } => assert_eq!((*found, *supported), (1, kvtier_hw::FORMAT_VERSION)),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("format version 1"), "{err}");
}

/// A creator killed between reserving the room and publishing the tier leaves only its
/// temporary; the next open removes it and creates the tier.
#[test]
fn a_leftover_temporary_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let temp = dir.path().join(TEMP_FILE);
    std::fs::write(&temp, vec![0u8; 3 * PAGE]).unwrap();
    let store = FileStore::open(dir.path(), BLOCK, CAP).unwrap();
    assert!(store.open_report().removed_temporary);
    assert!(store.open_report().created);
    assert!(!temp.exists());
    store.put(&key(1), &content(1)).unwrap();
}

fn damage_payload(dir: &Path, offset: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(DATA_FILE))
        .unwrap();
    f.write_all_at(&[0xa5; 64], offset + PAGE as u64 + 512)
        .unwrap();
}

/// Opening reads headers only: a payload torn behind a valid header is recovered, then fails
/// its first read (never served) and is counted. With `verify_at_open` it is dropped at open.
#[test]
fn torn_payloads_fail_at_read_or_at_open_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let at = {
        let store = FileStore::open(dir.path(), BLOCK, CAP).unwrap();
        for i in 0..3 {
            store.put(&key(i), &content(i)).unwrap();
        }
        store.record_offset(&key(1)).unwrap()
    };
    damage_payload(dir.path(), at);
    {
        let store = FileStore::open(dir.path(), BLOCK, CAP).unwrap();
        assert_eq!(store.open_report().recovered, 3);
        assert_eq!(store.open_report().corrupt, 0);
        let mut out = vec![0u8; BLOCK];
        let err = store.get(&key(1), &mut out).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(store.corrupt_reads(), 1);
        store.get(&key(2), &mut out).unwrap();
        assert_eq!(out, content(2));
    }
    let verify = FileOptions {
        verify_at_open: true,
        ..FileOptions::default()
    };
    let store = FileStore::open_with(dir.path(), BLOCK, CAP, verify).unwrap();
    assert_eq!(store.open_report().recovered, 2);
    assert_eq!(store.open_report().corrupt, 1);
    assert!(!store.contains(&key(1)).unwrap());
}

/// A tier opened with more room grows and keeps its blocks; reopened with the larger room it
/// stays as it is.
#[test]
fn a_tier_grows_and_keeps_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = FileStore::open(dir.path(), BLOCK, CAP).unwrap();
        store.put(&key(1), &content(1)).unwrap();
    }
    let bigger = CAP + 4 * (PAGE + BLOCK) as u64;
    for _ in 0..2 {
        let store = FileStore::open(dir.path(), BLOCK, bigger).unwrap();
        assert_eq!(store.capacity_blocks(), 12);
        assert_eq!(store.open_report().recovered, 1);
        let mut out = vec![0u8; BLOCK];
        store.get(&key(1), &mut out).unwrap();
        assert_eq!(out, content(1));
    }
    let err = FileStore::open(dir.path(), BLOCK, CAP).unwrap_err();
    assert!(err.to_string().contains("smaller capacity"), "{err}");
}

/// A job's results stay per block: a bad block, a full tier and a missing key fail alone.
#[test]
fn a_job_answers_per_block() {
    let dir = tempfile::tempdir().unwrap();
    let cap = (PAGE + 3 * (PAGE + BLOCK)) as u64;
    let store = FileStore::open(dir.path(), BLOCK, cap).unwrap();
    let keys: Vec<Key> = (0..5).map(key).collect();
    let blocks: Vec<Vec<u8>> = (0..5).map(content).collect();
    let short = vec![0u8; PAGE];
    let batch: Vec<(&Key, &[u8])> = vec![
        (&keys[0], &blocks[0]),
        (&keys[1], &short),
        (&keys[2], &blocks[2]),
        (&keys[3], &blocks[3]),
        (&keys[4], &blocks[4]),
    ];
    let results = store.put_many(&batch);
    assert!(results[0].is_ok());
    assert!(matches!(results[1], Err(StoreError::BadInput(_))));
    assert!(results[2].is_ok() && results[3].is_ok());
    assert!(matches!(results[4], Err(StoreError::Full { .. })));
    let mut out: Vec<Vec<u8>> = vec![vec![0u8; BLOCK]; 3];
    let mut want: Vec<(&Key, &mut [u8])> = vec![&keys[3], &keys[1], &keys[0]]
        .into_iter()
        .zip(out.iter_mut().map(|b| &mut b[..]))
        .collect();
    let results = store.get_many(&mut want);
    assert!(results[0].is_ok() && results[2].is_ok());
    assert!(matches!(results[1], Err(StoreError::NotFound { .. })));
    assert_eq!(out[0], blocks[3]);
    assert_eq!(out[2], blocks[0]);
}

/// The policies by name, as a configuration spells them.
#[test]
fn fsync_policies_parse() {
    for p in [FsyncPolicy::None, FsyncPolicy::Batch, FsyncPolicy::Write] {
        assert_eq!(p.to_string().parse::<FsyncPolicy>(), Ok(p));
    }
    assert_eq!(FsyncPolicy::default(), FsyncPolicy::None);
    assert!(
        "always"
            .parse::<FsyncPolicy>()
            .unwrap_err()
            .contains("\"batch\"")
    );
}

/// A record dropped by a verifying open (its header verified, its payload did not) never
/// shadows a later write of its key: the later write gets a higher sequence number, and the
/// dropped record's header is cleared at open. Before, the dropped record's sequence number
/// was left out of the next one and its header stayed valid, so a block stored again under
/// its key and acknowledged durable lost to the torn copy at the open after the next crash.
#[test]
fn a_record_dropped_at_a_verifying_open_never_shadows_a_later_write() {
    const ONE: usize = PAGE;
    const SIX: u64 = (PAGE + 6 * (PAGE + ONE)) as u64;
    let opts = |verify_at_open| FileOptions {
        direct_io: false,
        verify_at_open,
        ..FileOptions::default()
    };
    let damage = |dir: &Path, offset: u64| {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(DATA_FILE))
            .unwrap();
        f.write_all_at(&[0xa5; 8], offset).unwrap();
    };
    let dir = tempfile::tempdir().unwrap();
    let k = Key::new(b"K");
    let (a, b, kat) = {
        let s = FileStore::open_with(dir.path(), ONE, SIX, opts(false)).unwrap();
        s.put(&Key::new(b"X"), &[1u8; ONE]).unwrap(); // record 0, seq 1
        s.put(&Key::new(b"A"), &[2u8; ONE]).unwrap(); // record 1, seq 2
        s.put(&Key::new(b"B"), &[3u8; ONE]).unwrap(); // record 2, seq 3
        s.put(&k, &[4u8; ONE]).unwrap(); // record 3, seq 4
        let at = |key: &[u8]| s.record_offset(&Key::new(key)).unwrap();
        let r = (at(b"A"), at(b"B"), at(b"K"));
        s.abandon(); // a crash
        r
    };
    // What a crash could tear: the headers of A and B, the payload of K behind its header.
    damage(dir.path(), a + 40);
    damage(dir.path(), b + 40);
    damage(dir.path(), kat + PAGE as u64 + 100);
    {
        let s = FileStore::open_with(dir.path(), ONE, SIX, opts(true)).unwrap();
        assert_eq!(s.open_report().corrupt, 3);
        assert!(!s.contains(&k).unwrap());
        // The dropped records' headers are cleared.
        let f = std::fs::File::open(dir.path().join(DATA_FILE)).unwrap();
        for at in [a, b, kat] {
            let mut head = [0xffu8; 48];
            f.read_exact_at(&mut head, at).unwrap();
            assert_eq!(head, [0u8; 48], "the header at {at} is cleared");
        }
        // Stored again: a process that dies (`abandon`) keeps what it wrote, under any policy
        // (the default, `None`, here).
        s.put(&k, &[5u8; ONE]).unwrap();
        s.abandon(); // another crash
    }
    let s = FileStore::open_with(dir.path(), ONE, SIX, opts(false)).unwrap();
    let mut out = vec![0u8; ONE];
    s.get(&k, &mut out)
        .expect("the block stored again before the crash is served after it");
    assert_eq!(out, vec![5u8; ONE]);
}
