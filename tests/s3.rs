//! The S3 tier on a real S3-compatible server (SeaweedFS, started by the test on loopback):
//! blocks shared between nodes through one bucket, objects checked before they are served,
//! and every fault (a corrupt or foreign object, wrong or missing credentials, a missing
//! bucket, a server that stops answering, a server killed and restarted) ending as a clear
//! failure with no wrong data and no leaked pin. Each test names the rule it checks.

#[path = "support/rig.rs"]
mod rig;
#[path = "support/s3_server.rs"]
mod s3_server;
#[path = "support/shared.rs"]
mod shared;

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Key, Lookup};
use kvtier_hw::{S3Options, S3Store, SecondaryStore, StoreError};
use rig::{key, within};
use s3_server::{ACCESS_KEY, S3Server, SECRET_KEY};
use shared::{BLOCK, Node, assert_served, content, fail_until_down, frozen_calls_fail, get_all};

const BUCKET: &str = "kvtier-tests";
/// Every test's timeout (the deadline of one call).
const TIMEOUT: Duration = Duration::from_millis(1500);
/// A bound that a call breaks only if it does not end near its deadline: a hang check with
/// room for a loaded machine, not a speed target.
const CALL: Duration = Duration::from_millis(3 * 1500 + 3000);

/// A server with the test bucket; unsigned requests allowed if `anonymous`.
fn server(anonymous: bool) -> S3Server {
    let s = S3Server::start(anonymous);
    s.create_bucket(BUCKET);
    s
}

fn options(server: &S3Server, prefix: &str) -> S3Options {
    S3Options {
        endpoint: Some(server.endpoint()),
        bucket: BUCKET.into(),
        prefix: prefix.into(),
        identity: "tests/s3.rs".into(),
        access_key_id: Some(ACCESS_KEY.into()),
        secret_access_key: Some(SECRET_KEY.into()),
        timeout: TIMEOUT,
        ..S3Options::default()
    }
}

/// A store that tracks up to `blocks` blocks of `BLOCK` bytes.
fn open_with(o: &S3Options, blocks: u64) -> Arc<S3Store> {
    Arc::new(S3Store::open(o, BLOCK, blocks * BLOCK as u64).expect("the S3 tier opens"))
}

fn open(o: &S3Options) -> Arc<S3Store> {
    open_with(o, 64)
}

fn put_all(store: &S3Store, keys: &[Key]) -> Vec<Result<(), StoreError>> {
    let blocks: Vec<Vec<u8>> = keys.iter().map(content).collect();
    let puts: Vec<(&Key, &[u8])> = keys.iter().zip(&blocks).map(|(k, b)| (k, &b[..])).collect();
    store.put_many(&puts)
}

/// Objects round-trip through the store, checked; an absent block is NotFound (J6: missing,
/// not failed); a step's probes are answered together, one per key, in order.
#[test]
fn blocks_round_trip_and_probes_answer_in_order() {
    let server = server(false);
    let store = open(&options(&server, "round-trip"));
    let keys: Vec<Key> = (0..3).map(key).collect();
    assert!(put_all(&store, &keys).iter().all(Result::is_ok));
    for (r, k) in get_all(store.as_ref(), &keys).into_iter().zip(&keys) {
        assert_eq!(r.expect("stored"), content(k), "block {k}");
    }
    let probe: Vec<Key> = [0, 100, 1, 101, 2].into_iter().map(key).collect();
    let answers: Vec<bool> = store
        .contains_many(&probe.iter().collect::<Vec<_>>())
        .into_iter()
        .map(|r| r.expect("answered"))
        .collect();
    assert_eq!(answers, [true, false, true, false, true]);
    let mut out = vec![0u8; BLOCK];
    assert!(matches!(
        store.get(&key(100), &mut out),
        Err(StoreError::NotFound { .. })
    ));
    assert!(out.iter().all(|&b| b == 0), "nothing was written out");
    // A block of the wrong size is refused before any request.
    assert!(matches!(
        store.put(&key(5), &[1, 2, 3]),
        Err(StoreError::BadInput(_))
    ));
    // T14: delete forgets here only; the object stays for the other nodes.
    store.delete(&key(0)).unwrap();
    assert!(store.contains(&key(0)).unwrap());
    store.check().unwrap();
}

/// T4–T6: node A cascades blocks it then evicts from its own index; node B, with its own
/// primary, finds them by probes and serves them, bytes checked. Two nodes writing one block
/// at once both succeed, and the object stays whole (a conditional put: the first stays).
#[test]
fn a_block_stored_by_one_node_is_found_and_served_by_another() {
    let server = server(false);
    let o = options(&server, "sharing");
    let mut a = Node::new(open_with(&o, 2));
    let mut b = Node::new(open_with(&o, 2));
    for i in 0..6 {
        a.store(&key(i), i as usize);
    }
    assert!(
        a.tier_stats().evictions >= 4,
        "A's index forgot blocks: {:?}",
        a.tier_stats()
    );
    assert_served(&mut b, 0..6, 8, "on node B");
    assert!(b.tier_stats().probes >= 6);
    a.rig.assert_settled();
    b.rig.assert_settled();
    let (x, y) = (open(&o), open(&o));
    let racers: Vec<_> = [x, y]
        .into_iter()
        .map(|s| {
            std::thread::spawn(move || {
                let keys: Vec<Key> = (200..216).map(key).collect();
                put_all(&s, &keys)
            })
        })
        .collect();
    for r in racers {
        assert!(r.join().unwrap().iter().all(Result::is_ok));
    }
    let keys: Vec<Key> = (200..216).map(key).collect();
    for (r, k) in get_all(open(&o).as_ref(), &keys).into_iter().zip(&keys) {
        assert_eq!(r.expect("stored once, whole"), content(k), "block {k}");
    }
}

/// ★1: an object overwritten by a raw `PUT` (a flipped byte, another block's object, not a
/// kvtier object at all) is a failed promotion: the lookup ends Miss, never a Hit with wrong
/// bytes, and read failures are counted. Another identity (another model or layout) never
/// sees this one's blocks.
#[test]
fn corrupt_and_foreign_objects_are_never_served() {
    let server = server(true);
    let o = options(&server, "corrupt");
    let store = open(&o);
    let keys: Vec<Key> = (0..4).map(key).collect();
    let puts = put_all(&store, &keys);
    assert!(puts.iter().all(Result::is_ok), "{puts:?}");
    // Block 0: one flipped byte of its block; block 1: block 3's whole object; block 2: text.
    let mut flipped = {
        let mut out = vec![0u8; BLOCK];
        store.get(&keys[0], &mut out).unwrap();
        let mut value = Vec::new();
        value.extend_from_slice(b"KVTIERB\0");
        value.extend_from_slice(&1u32.to_le_bytes());
        value.extend_from_slice(&(keys[0].len() as u32).to_le_bytes());
        value.extend_from_slice(&(BLOCK as u64).to_le_bytes());
        value.extend_from_slice(&0u64.to_le_bytes()); // a checksum that cannot match
        value.extend_from_slice(keys[0].as_bytes());
        value.extend_from_slice(&out);
        value
    };
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    server.put_raw(BUCKET, &store.name_of(&keys[0]), &flipped);
    let (code, foreign) = server
        .http(
            "GET",
            &format!("/{BUCKET}/{}", store.name_of(&keys[3])),
            &[],
        )
        .unwrap();
    assert_eq!(code, 200);
    server.put_raw(BUCKET, &store.name_of(&keys[1]), &foreign);
    server.put_raw(BUCKET, &store.name_of(&keys[2]), b"not a kvtier block");
    let results = get_all(store.as_ref(), &keys);
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (0..=2, Err(StoreError::Corrupt { .. })) => {}
            (3, Ok(bytes)) => assert_eq!(bytes, &content(&keys[3])),
            other => panic!("block {i}: {other:?}"),
        }
    }
    // Through a node: never a Hit for the three, and the failures are counted.
    let mut node = Node::new(store.clone());
    for i in 0..3 {
        assert_ne!(
            node.rig.lookup_and_verify(&key(i), 0),
            Lookup::Hit,
            "block {i} is never served"
        );
    }
    assert!(
        node.tier_stats().read_failures >= 1,
        "{:?}",
        node.tier_stats()
    );
    node.rig.assert_settled();
    // Another identity: none of these blocks exists for it.
    let other = open(&S3Options {
        identity: "another model".into(),
        ..o
    });
    let answers = other.contains_many(&keys.iter().collect::<Vec<_>>());
    assert!(
        answers.iter().all(|a| matches!(a, Ok(false))),
        "{answers:?}"
    );
}

/// Credentials come from the environment variables the configuration names; a variable that
/// is not set, a wrong secret and unsigned requests to a server that wants signed ones are
/// each refused at open with a message that says which; a missing bucket is never written.
#[test]
fn wrong_or_missing_credentials_and_a_missing_bucket_are_refused_at_open() {
    let server = server(false);
    let mut o = options(&server, "credentials");
    let env = |v: &str| match v {
        "KEY" => Some(ACCESS_KEY.to_owned()),
        "SECRET" => Some(SECRET_KEY.to_owned()),
        _ => None,
    };
    o.credentials_from(Some("KEY"), Some("SECRET"), None, env)
        .unwrap();
    assert_eq!(o.secret_access_key.as_deref(), Some(SECRET_KEY));
    assert!(
        !format!("{o:?}").contains(SECRET_KEY),
        "Debug hides the secret"
    );
    open(&o);
    let e = o
        .clone()
        .credentials_from(Some("KEY"), Some("UNSET_SECRET"), None, env)
        .unwrap_err();
    assert!(e.to_string().contains("UNSET_SECRET"), "{e}");
    let e = o
        .clone()
        .credentials_from(Some("KEY"), None, None, env)
        .unwrap_err();
    assert!(e.to_string().contains("together"), "{e}");
    let wrong = S3Options {
        secret_access_key: Some("not the secret".into()),
        ..o.clone()
    };
    let e = S3Store::open(&wrong, BLOCK, 64 * BLOCK as u64).unwrap_err();
    assert!(e.to_string().contains("refused the credentials"), "{e}");
    let unsigned = S3Options {
        access_key_id: None,
        secret_access_key: None,
        ..o.clone()
    };
    let e = S3Store::open(&unsigned, BLOCK, 64 * BLOCK as u64).unwrap_err();
    assert!(e.to_string().contains("refused the credentials"), "{e}");
    // A bucket that does not exist: AWS answers the listing at open with NoSuchBucket, and
    // the open fails naming it. SeaweedFS lists a missing bucket as empty and refuses the
    // write instead (it would make the bucket for an administrator): no block is reported
    // written, and the error names the bucket.
    let missing = S3Options {
        bucket: "no-such-bucket".into(),
        ..o
    };
    match S3Store::open(&missing, BLOCK, 64 * BLOCK as u64) {
        Err(e) => assert!(e.to_string().contains("bucket does not exist"), "{e}"),
        Ok(store) => {
            let e = store.put(&key(0), &content(&key(0))).unwrap_err();
            assert!(
                matches!(&e, StoreError::Unavailable(m) if m.contains("no-such-bucket")),
                "{e}"
            );
            assert!(!matches!(store.contains(&key(0)), Ok(true)));
        }
    }
}

/// ★3, H1–H4: a server that stops answering (SIGSTOP) fails every call by its deadline (a
/// get, a step of 64 probes, 24 MiB of writes); the node's promotions fail, nothing is
/// served, and the tier goes Down; once the server answers again the tier is Up and serves.
#[test]
fn a_server_that_stops_answering_fails_within_the_timeout_and_comes_back() {
    let server = server(false);
    let o = options(&server, "frozen");
    let store = open(&o);
    let big_block = 1 << 20;
    let big =
        Arc::new(S3Store::open(&o, big_block, 64 * big_block as u64).expect("the S3 tier opens"));
    let mut a = Node::new(store.clone());
    for i in 0..6 {
        a.store(&key(i), i as usize);
    }
    server.freeze();
    frozen_calls_fail(store.clone(), big, big_block, CALL);
    let s = store.clone();
    assert!(within(CALL, move || s.check()).is_err());
    // Blocks 0 and 1 left the primary: their promotions fail, the tier goes Down.
    fail_until_down(&mut a, 0..2, "from a frozen server");
    server.thaw();
    a.wait_up();
    assert_served(&mut a, [0], 8, "once Up again");
    a.rig.assert_settled();
}

/// A server killed (SIGKILL) fails calls at once (the connection is refused), and the tier goes
/// Down; started again on the same data it is Up, and the blocks written before are served.
#[test]
fn a_killed_server_fails_calls_and_serves_its_blocks_after_a_restart() {
    let mut server = server(false);
    let o = options(&server, "restart");
    let store = open(&o);
    let mut a = Node::new(store.clone());
    for i in 0..6 {
        a.store(&key(i), i as usize);
    }
    server.stop();
    let s = store.clone();
    let e = within(CALL, move || {
        let mut one = vec![0u8; BLOCK];
        s.get(&key(0), &mut one).unwrap_err()
    });
    assert!(matches!(e, StoreError::Unavailable(_)), "{e}");
    fail_until_down(&mut a, 0..2, "from a killed server");
    server.restart();
    a.wait_up();
    assert_served(&mut a, 0..2, 8, "after the restart");
    let keys: Vec<Key> = (0..6).map(key).collect();
    for (r, k) in get_all(store.as_ref(), &keys).into_iter().zip(&keys) {
        assert_eq!(r.expect("kept across the restart"), content(k), "block {k}");
    }
    a.rig.assert_settled();
}
