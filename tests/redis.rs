//! The shared tier on real Redis servers (started by the test, on loopback): blocks shared
//! between nodes, values checked before they are served, and every fault (a corrupt value, a
//! flushed database, a wrong password, a server that stops answering, a stale connection, a
//! killed cluster master) ending as a clear failure with no wrong data and no leaked pin.
//! Each test names the rule it checks.

#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/rig.rs"]
mod rig;
#[path = "support/shared.rs"]
mod shared;

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Health, Key, Lookup};
use kvtier_hw::{RedisOptions, RedisStore, SecondaryStore, StoreError};
use redis_server::{Cluster, Server, TlsFiles};
use rig::{key, within};
use shared::{BLOCK, Node, assert_served, content, fail_until_down, frozen_calls_fail, get_all};

/// Every test's timeout.
const TIMEOUT: Duration = Duration::from_millis(500);
/// A bound that one call on a pooled connection breaks only if it does not end near its
/// deadline (`TIMEOUT` after it starts): a hang check with room for a loaded machine, not a
/// speed target.
const CALL: Duration = Duration::from_millis(3 * 500 + 3000); // 3 × TIMEOUT + 3 s

fn options(urls: Vec<String>, namespace: &str) -> RedisOptions {
    RedisOptions {
        urls,
        namespace: namespace.into(),
        identity: "tests/redis.rs".into(),
        timeout: TIMEOUT,
        ..RedisOptions::default()
    }
}

/// A store that tracks up to `blocks` blocks of `BLOCK` bytes.
fn open_with(o: &RedisOptions, blocks: u64) -> Arc<RedisStore> {
    Arc::new(RedisStore::open(o, BLOCK, blocks * BLOCK as u64).expect("the Redis tier opens"))
}

fn open(o: &RedisOptions) -> Arc<RedisStore> {
    open_with(o, 64)
}

/// `results` (of `get_all(keys)`) are the blocks stored, but for `keys[bad]`, which failed
/// with the server's WRONGTYPE error.
fn assert_only_wrongtype(results: &[Result<Vec<u8>, StoreError>], keys: &[Key], bad: usize) {
    for (i, (r, k)) in results.iter().zip(keys).enumerate() {
        match r {
            Err(StoreError::Unavailable(m)) if i == bad && m.contains("WRONGTYPE") => {}
            Ok(bytes) if i != bad => assert_eq!(bytes, &content(k), "block {k}"),
            other => panic!("block {k}: {other:?}"),
        }
    }
}

/// Values round-trip through the store, checked; an absent block is NotFound; probes are
/// answered together, one per key.
#[test]
fn blocks_round_trip_and_probes_answer_in_order() {
    let server = Server::start(&[]);
    let store = open(&options(vec![server.url()], "roundtrip"));
    let blocks: Vec<(Key, Vec<u8>)> = (0..8).map(|i| (key(i), content(&key(i)))).collect();
    let puts: Vec<(&Key, &[u8])> = blocks.iter().map(|(k, b)| (k, &b[..])).collect();
    assert!(store.put_many(&puts).iter().all(Result::is_ok));
    let keys: Vec<Key> = blocks.iter().map(|(k, _)| k.clone()).collect();
    for (got, (_, want)) in get_all(store.as_ref(), &keys).into_iter().zip(&blocks) {
        assert_eq!(&got.unwrap(), want);
    }
    let absent = key(99);
    let answers = store.contains_many(&[&blocks[0].0, &absent, &blocks[7].0]);
    let answers: Vec<bool> = answers.into_iter().map(Result::unwrap).collect();
    assert_eq!(answers, [true, false, true]);
    let mut one = vec![0u8; BLOCK];
    assert!(matches!(
        store.get(&absent, &mut one),
        Err(StoreError::NotFound { .. })
    ));
    // The value is the header, the full key and the block.
    let raw = server.get_raw(&store.name_of(&blocks[0].0));
    assert_eq!(&raw[..8], b"KVTIERB\0");
    assert_eq!(raw.len(), 32 + blocks[0].0.len() + BLOCK);
}

/// A server error that concerns one command (here: a list, not a string, under a block's
/// name) fails that block alone: the other blocks of the batch are served, and the
/// connection goes back to the pool (the next calls open no new connection).
#[test]
fn one_failed_command_fails_its_block_alone_and_keeps_the_connection() {
    let server = Server::start(&[]);
    let store = open(&options(vec![server.url()], "percommand"));
    for i in 0..3 {
        store.put(&key(i), &content(&key(i))).unwrap();
    }
    let name = store.name_of(&key(1));
    server.cli(&["DEL", &name]);
    server.cli(&["LPUSH", &name, "not a block"]);
    let connections = server.info_number("total_connections_received");
    let keys = [key(0), key(1), key(2)];
    assert_only_wrongtype(&get_all(store.as_ref(), &keys), &keys, 1);
    assert_eq!(
        store.contains_many(&[&keys[0], &keys[1], &keys[2]]).len(),
        3
    );
    store.put(&key(3), &content(&key(3))).unwrap();
    assert_eq!(
        server.info_number("total_connections_received"),
        connections + 1, // the redis-cli that asks
        "the connection went back to the pool and was used again"
    );
}

/// A pooled connection that the server closed (`CLIENT KILL`, an idle timeout, a restart)
/// is not a failed call: it runs again on a fresh connection.
#[test]
fn a_stale_pooled_connection_is_replaced_without_failing_the_call() {
    let server = Server::start(&[]);
    let store = open(&options(vec![server.url()], "stale"));
    store.put(&key(0), &content(&key(0))).unwrap();
    let killed = server.cli(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    assert!(killed.stdout.starts_with(b"1"), "{killed:?}");
    let mut out = vec![0u8; BLOCK];
    store.get(&key(0), &mut out).unwrap();
    assert_eq!(out, content(&key(0)));
    server.cli(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    let answers = store.contains_many(&[&key(0), &key(1)]);
    assert!(
        matches!(answers.as_slice(), [Ok(true), Ok(false)]),
        "{answers:?}"
    );
}

/// T4–T6, T14, ★1: node A stores a block; node B, which never saw it, finds it by a probe,
/// promotes it and loads exactly the bytes A stored. Each node tracks two blocks only, so
/// its index evicts: neither deletes anything from the shared store.
#[test]
fn a_block_stored_by_one_node_is_found_and_served_by_another() {
    let server = Server::start(&[]);
    let o = options(vec![server.url()], "sharing");
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
    assert!(b.tier_stats().evictions > 0, "{:?}", b.tier_stats());
    a.rig.assert_settled();
    b.rig.assert_settled();
    let count = String::from_utf8(server.cli(&["DBSIZE"]).stdout).unwrap();
    assert_eq!(
        count.trim(),
        "6",
        "every block written is still in the shared store"
    );
}

/// ★1: a value overwritten by a raw `SET` (a flipped byte, or not a kvtier value at all) is a
/// failed promotion: the lookup ends Miss, never a Hit with wrong bytes, and the read failure
/// is counted. A flushed database is not a failure: the blocks are missing, nothing is served.
#[test]
fn corrupt_and_flushed_values_are_never_served() {
    let server = Server::start(&[]);
    let o = options(vec![server.url()], "faults");
    let store = open(&o);
    let mut a = Node::new(store.clone());
    // Seven blocks: the primary keeps the last four, the tier has all.
    for i in 0..7 {
        a.store(&key(i), i as usize);
    }
    let name = store.name_of(&key(0));
    let mut value = server.get_raw(&name);
    let last = value.len() - 1;
    value[last] ^= 0x5a;
    server.set_raw(&name, &value);
    server.set_raw(&store.name_of(&key(1)), b"not a kvtier block");
    let mut b = Node::new(open(&o));
    assert_eq!(
        b.rig.lookup(&key(0)),
        Lookup::Miss,
        "a flipped byte is never served"
    );
    assert_eq!(
        b.rig.lookup(&key(1)),
        Lookup::Miss,
        "a foreign value is never served"
    );
    assert_eq!(b.tier_stats().read_failures, 2);
    assert_served(&mut b, [2], 8, "intact, on node B");
    // Flushed: node A's index says blocks 0-2 are there. Their promotions find them missing
    // (J6): nothing is served, the blocks are forgotten, and the tier stays Up, since the
    // server answered (a flush, an expiry or the server's own eviction is no failure). The
    // blocks the primary holds are served as before.
    server.cli(&["FLUSHALL"]);
    for i in 0..3 {
        assert_eq!(
            a.rig.lookup(&key(i)),
            Lookup::Miss,
            "block {i} after the flush"
        );
    }
    let (health, tier) = &a.rig.driver.manager().stats().tiers[0];
    assert_eq!((tier.read_missing, tier.read_failures), (3, 0));
    assert_eq!(*health, Health::Up);
    assert_served(&mut a, [6], 8, "in A's primary");
    a.rig.assert_settled();
    b.rig.assert_settled();
}

/// Credentials come from environment variables the configuration names (never from the
/// file): a variable that is not set is an error naming it; a wrong password is a clear
/// error when the tier opens, which does not print the password; the right one opens.
#[test]
fn credentials_come_from_the_environment() {
    let server = Server::start(&["--requirepass", "s3cret"]);
    check_credentials(options(vec![server.url()], "auth"));
}

/// The same against a cluster, whose client reports refused credentials as an IO error: the
/// open still fails, and says that authentication failed.
#[test]
fn a_cluster_refuses_a_wrong_password_at_open() {
    let cluster = Cluster::start_with(3, &["--requirepass", "s3cret", "--masterauth", "s3cret"]);
    let mut o = options(cluster.urls(), "cluster-auth");
    o.cluster = true;
    check_credentials(o);
}

/// Opens `o` without, with a wrong and with the right password (`s3cret`).
fn check_credentials(mut o: RedisOptions) {
    let env = |v: &str| match v {
        "WRONG" => Some("guess".to_owned()),
        "RIGHT" => Some("s3cret".to_owned()),
        _ => None,
    };
    let e = o.credentials_from(None, Some("UNSET"), env).unwrap_err();
    assert!(e.to_string().contains("UNSET"), "{e}");
    o.credentials_from(None, Some("WRONG"), env).unwrap();
    assert!(!format!("{o:?}").contains("guess"), "{o:?}");
    let e = RedisStore::open(&o, BLOCK, 64 * BLOCK as u64).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("authentication failed"), "{text}");
    assert!(
        !text.contains("guess"),
        "the password is not in messages: {text}"
    );
    o.credentials_from(None, Some("RIGHT"), env).unwrap();
    let store = open(&o);
    store.put(&key(1), &content(&key(1))).unwrap();
    let mut out = vec![0u8; BLOCK];
    store.get(&key(1), &mut out).unwrap();
    assert_eq!(out, content(&key(1)));
    // No password at all: the server refuses, and the open says so.
    o.password = None;
    let e = RedisStore::open(&o, BLOCK, 64 * BLOCK as u64).unwrap_err();
    assert!(e.to_string().contains("authentication failed"), "{e}");
}

/// TLS: a server that speaks only TLS, its certificate signed by a private CA. A store given
/// that CA (`tls_ca_file`) round-trips blocks; one without it (only the public roots) fails
/// at open, saying the certificate is not trusted. `tls = true` takes a `redis://` URL as
/// `rediss://`.
#[test]
fn tls_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let files = TlsFiles::make(dir.path());
    let server = Server::start_tls(&files);
    assert!(server.url().starts_with("rediss://"));
    let mut o = options(vec![server.url()], "tls");
    o.tls = true;
    let e = RedisStore::open(&o, BLOCK, 64 * BLOCK as u64).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("certificate") && text.contains("tls_ca_file"),
        "{text}"
    );
    o.tls_ca_file = Some(files.ca.clone());
    o.urls = vec![server.url().replacen("rediss://", "redis://", 1)];
    let store = open(&o);
    let blocks: Vec<(Key, Vec<u8>)> = (0..4).map(|i| (key(i), content(&key(i)))).collect();
    let puts: Vec<(&Key, &[u8])> = blocks.iter().map(|(k, b)| (k, &b[..])).collect();
    assert!(store.put_many(&puts).iter().all(Result::is_ok));
    let mut out = vec![0u8; BLOCK];
    store.get(&key(3), &mut out).unwrap();
    assert_eq!(out, content(&key(3)));
    let answers = store.contains_many(&[&key(0), &key(9)]);
    assert!(
        matches!(answers.as_slice(), [Ok(true), Ok(false)]),
        "{answers:?}"
    );
    assert!(store.check().is_ok());
}

/// Tier health, ★3: a server that stops answering fails each call, however many commands it
/// has and however many bytes it sends, by the call's deadline (no request hangs); the tier
/// goes Down after its failures, lookups skip it (Miss, not a wait); once the server answers
/// again a health probe brings the tier back Up and its blocks are served. Nothing wrong is
/// served and no pin is left.
#[test]
fn a_server_that_stops_answering_fails_within_the_timeout_and_comes_back() {
    let server = Server::start(&[]);
    let o = options(vec![server.url()], "frozen");
    let store = open(&o);
    // 1 MiB blocks: 24 of them fill the socket buffers, so the write blocks.
    let big_block = 1 << 20;
    let big = Arc::new(
        RedisStore::open(&o, big_block, 64 * big_block as u64).expect("the Redis tier opens"),
    );
    let mut a = Node::new(store.clone());
    for i in 0..6 {
        a.store(&key(i), i as usize);
    }
    server.freeze();
    // One call; then a batch of 64 probes, which the crate's own pipeline would read one
    // timeout after another; then 24 MiB of writes. Each on a pooled connection.
    frozen_calls_fail(store.clone(), big, big_block, CALL);
    // Blocks 0 and 1 left the primary: their promotions fail, the tier goes Down.
    fail_until_down(&mut a, 0..2, "from a frozen server");
    assert_eq!(
        a.rig.lookup(&key(0)),
        Lookup::Miss,
        "a Down tier is skipped"
    );
    server.thaw();
    a.wait_up();
    assert_served(&mut a, [0], 8, "once Up again");
    a.rig.assert_settled();
}

/// A cluster of three masters and three replicas. Node A stores through the cluster client
/// (slots are the client's), node B finds and serves the blocks. Then a master stops
/// answering: a batch of probes and a batch of writes too large for the socket buffers both
/// end by their deadline (each call on a pooled connection). The
/// master is killed: jobs fail and nothing wrong is served; after the failover the tier is
/// Up, the nodes whose pooled connections knew the dead master serve blocks on every slot
/// again, and so do new nodes.
#[test]
fn a_cluster_shares_blocks_and_survives_a_master_failover() {
    let mut cluster = Cluster::start(3);
    let mut o = options(cluster.urls(), "cluster");
    o.cluster = true;
    let mut a = Node::new(open(&o));
    let mut b = Node::new(open(&o));
    for i in 0..12 {
        a.store(&key(i), (i % 8) as usize);
    }
    assert_served(&mut b, 0..12, 8, "on node B");
    // Blocks 40-51: stored by A, never seen by B, the victim's among them.
    for i in 40..52 {
        a.store(&key(i), (i % 8) as usize);
    }
    let store = open(&o);
    // A server error on one command of a cluster batch (a list under block 90's name)
    // fails that block alone.
    let list = store.name_of(&key(90));
    cluster.nodes[cluster.master_of(&list)].cli(&["LPUSH", &list, "not a block"]);
    let keys = [key(0), key(90), key(1)];
    assert_only_wrongtype(&get_all(store.as_ref(), &keys), &keys, 1);
    let victim = cluster.master_of(&store.name_of(&key(40)));
    cluster.nodes[victim].wait_replicated();
    // 1 MiB blocks, all on the victim: 24 MiB fill the socket buffers, so the write blocks.
    let big_block = 1 << 20;
    let big = Arc::new(
        RedisStore::open(&o, big_block, 64 * big_block as u64).expect("the Redis tier opens"),
    );
    let big_keys: Vec<Key> = (1000..)
        .map(key)
        .filter(|k| cluster.master_of(&big.name_of(k)) == victim)
        .take(24)
        .collect();
    assert!(store.contains(&key(0)).unwrap(), "a pooled connection");

    cluster.nodes[victim].freeze();
    let s = store.clone();
    let answers = within(CALL, move || {
        let keys: Vec<Key> = (0..96).map(key).collect();
        s.contains_many(&keys.iter().collect::<Vec<_>>())
    });
    assert!(
        answers.iter().any(Result::is_err),
        "the frozen master's probes fail"
    );
    let results = within(CALL, move || {
        let block = vec![7u8; big_block];
        let puts: Vec<(&Key, &[u8])> = big_keys.iter().map(|k| (k, &block[..])).collect();
        big.put_many(&puts)
    });
    assert!(results.iter().all(Result::is_err), "{results:?}");

    cluster.nodes[victim].kill();
    let mut c = Node::new(store);
    // Nodes that start now are given the live servers' URLs.
    o.urls.remove(victim);
    for i in 20..28 {
        c.store(&key(i), (i % 8) as usize); // some cascades fail while the slot has no master
    }
    for i in 20..28 {
        c.rig.lookup_and_verify(&key(i), 8); // a Hit is never wrong bytes
    }
    cluster.wait_ok(Duration::from_secs(30));
    // Node C's tier may have gone Down meanwhile: a health probe brings it back Up.
    c.wait_up();
    // B's pooled connections knew the dead master: its probes and reads still succeed, not
    // one of its jobs fails.
    let before = b.tier_stats();
    assert_served(&mut b, 40..52, 8, "on B, after the failover");
    assert_eq!(
        b.tier_stats().jobs_failed,
        before.jobs_failed,
        "{:?}",
        b.tier_stats()
    );
    // A's too: it stores, and a new node finds what it stored.
    let failed = a.tier_stats().write_failures;
    for i in 60..66 {
        a.store(&key(i), (i % 8) as usize);
    }
    assert_eq!(
        a.tier_stats().write_failures,
        failed,
        "{:?}",
        a.tier_stats()
    );
    let mut d = Node::new(open(&o));
    for i in 30..36 {
        d.store(&key(i), (i % 8) as usize);
    }
    let mut e = Node::new(open(&o));
    assert_served(&mut e, (30..36).chain(60..66), 8, "on a new node");
    for n in [&mut a, &mut b, &mut c, &mut d, &mut e] {
        n.rig.assert_settled();
    }
}
