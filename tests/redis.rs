//! The shared tier on real Redis servers (started by the test, on loopback): blocks shared
//! between nodes, values checked before they are served, and every fault (a corrupt value, a
//! flushed database, a wrong password, a server that stops answering, a killed cluster
//! master) ending as a clear failure with no wrong data and no leaked pin. Each test names
//! the rule it checks.

#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::{Config, Health, Key, Lookup, RequestId, TierConfig, TierId, TierKind};
use kvtier_hw::{
    Driver, DriverOptions, HostEngine, HostMemory, Layout, PAGE, RedisOptions, RedisStore, Region,
    SecondaryStore, StoreError,
};
use redis_server::{Cluster, Server};

const SLOTS: u32 = 4;
const BLOCK: usize = PAGE;
const T0: TierId = TierId(0);

/// A block's content: every byte depends on the key and its position.
fn content(key: &Key) -> Vec<u8> {
    let seed = key.hash64();
    (0..BLOCK)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i / 64) as u8)
        .collect()
}

fn key(i: u32) -> Key {
    Key::new(format!("block-{i}").as_bytes())
}

fn options(urls: Vec<String>, namespace: &str) -> RedisOptions {
    RedisOptions {
        urls,
        namespace: namespace.into(),
        identity: "tests/redis.rs".into(),
        timeout: Duration::from_millis(500),
        ..RedisOptions::default()
    }
}

fn open(o: &RedisOptions) -> Arc<RedisStore> {
    Arc::new(RedisStore::open(o, BLOCK, 64 * BLOCK as u64).expect("the Redis tier opens"))
}

/// One kvtier node: a region of its own, the host engine, and the shared tier.
struct Node {
    driver: Driver,
    device: Arc<HostMemory>,
    _dir: tempfile::TempDir,
}

impl Node {
    fn new(store: Arc<RedisStore>) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(SLOTS, 1, BLOCK).unwrap();
        let region = Arc::new(Region::create(&dir.path().join("region"), layout, 1).unwrap());
        let device = Arc::new(HostMemory::new(16 * BLOCK).unwrap());
        let engine = HostEngine::new(region.clone(), device.clone(), 0, 1);
        let mut config = Config::new(SLOTS);
        let mut tier = TierConfig::new(TierKind::Shared, store.capacity_blocks());
        tier.absent_ttl_steps = 1;
        config.tiers = vec![tier];
        config.health.failures_to_down = 2;
        config.health.probe_interval_steps = 2;
        config.promotion_cooldown_steps = 2;
        let stores: Vec<Arc<dyn SecondaryStore>> = vec![store];
        let driver = Driver::new(
            config,
            region,
            Box::new(engine),
            stores,
            DriverOptions::default(),
        )
        .expect("driver starts");
        Node {
            driver,
            device,
            _dir: dir,
        }
    }

    /// Computes `k` at device block `at` and stores it; waits for the copy and its cascade.
    fn store(&mut self, k: &Key, at: usize) {
        self.device.write(at * BLOCK, &content(k)).unwrap();
        if let Some(t) = self
            .driver
            .store(RequestId(1), &[(k.clone(), at * BLOCK)])
            .unwrap()
        {
            self.driver.wait(t).unwrap();
        }
        self.driver.settle(4);
    }

    /// Looks `k` up step after step until the answer is neither HitPending nor Retry.
    fn lookup(&mut self, k: &Key) -> Lookup {
        for _ in 0..40 {
            match self.driver.lookup(RequestId(2), k) {
                Lookup::HitPending | Lookup::Retry => self.driver.settle(1),
                other => return other,
            }
        }
        panic!("{k} stayed HitPending or Retry for 40 steps");
    }

    /// Loads `k` into device block `at` and returns the bytes there.
    fn load(&mut self, k: &Key, at: usize) -> Vec<u8> {
        let t = self
            .driver
            .load(RequestId(2), &[(k.clone(), at * BLOCK)])
            .unwrap();
        self.driver.wait(t).unwrap();
        let mut out = vec![0; BLOCK];
        self.device.read(at * BLOCK, &mut out).unwrap();
        out
    }

    /// Ends steps until the tier is Up (health probes run every few steps).
    fn wait_up(&mut self) {
        for _ in 0..100 {
            self.driver.settle(1);
            if self.driver.manager().health(T0) == Some(Health::Up) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "the tier did not come back Up: {:?}",
            self.driver.manager().stats().tiers[0]
        );
    }

    /// No pin is left and no job is outstanding once the node settles.
    fn assert_settled(&mut self) {
        self.driver.settle(8);
        let stats = self.driver.manager().stats();
        assert_eq!((stats.job_pins, stats.load_pins), (0, 0), "{stats:?}");
        assert_eq!(stats.jobs_outstanding, 0, "{stats:?}");
        self.driver.manager().check_invariants().unwrap();
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
    let mut out = vec![vec![0u8; BLOCK]; 8];
    let mut gets: Vec<(&Key, &mut [u8])> = blocks
        .iter()
        .map(|(k, _)| k)
        .zip(out.iter_mut().map(|o| &mut o[..]))
        .collect();
    assert!(store.get_many(&mut gets).iter().all(Result::is_ok));
    for ((_, want), got) in blocks.iter().zip(&out) {
        assert_eq!(want, got);
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

/// T4–T6, T14, ★1: node A stores a block; node B, which never saw it, finds it by a probe,
/// promotes it and loads exactly the bytes A stored. Neither node deletes anything from the
/// shared store when its index evicts.
#[test]
fn a_block_stored_by_one_node_is_found_and_served_by_another() {
    let server = Server::start(&[]);
    let o = options(vec![server.url()], "sharing");
    let mut a = Node::new(open(&o));
    let mut b = Node::new(open(&o));
    for i in 0..6 {
        a.store(&key(i), i as usize);
    }
    // Six blocks written, more than A's primary holds: all are in the store.
    for i in 0..6 {
        assert!(
            a.driver
                .manager()
                .tier(T0)
                .unwrap()
                .state_of(&key(i))
                .is_some()
        );
    }
    for i in 0..6 {
        assert_eq!(b.lookup(&key(i)), Lookup::Hit, "block {i} on node B");
        assert_eq!(
            b.load(&key(i), 8),
            content(&key(i)),
            "block {i}'s bytes on B"
        );
    }
    assert!(b.driver.manager().stats().tiers[0].1.probes >= 6);
    a.assert_settled();
    b.assert_settled();
    let count = String::from_utf8(server.cli(&["DBSIZE"]).stdout).unwrap();
    assert_eq!(
        count.trim(),
        "6",
        "nothing was deleted from the shared store"
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
        b.lookup(&key(0)),
        Lookup::Miss,
        "a flipped byte is never served"
    );
    assert_eq!(
        b.lookup(&key(1)),
        Lookup::Miss,
        "a foreign value is never served"
    );
    assert_eq!(b.driver.manager().stats().tiers[0].1.read_failures, 2);
    assert_eq!(
        b.lookup(&key(2)),
        Lookup::Hit,
        "an intact block is still served"
    );
    assert_eq!(b.load(&key(2), 8), content(&key(2)));
    // Flushed: node A's index says blocks 0-2 are there. Their promotions find them missing
    // (J6): nothing is served, the blocks are forgotten, and the tier stays Up, since the
    // server answered (a flush, an expiry or the server's own eviction is no failure). The
    // blocks the primary holds are served as before.
    server.cli(&["FLUSHALL"]);
    for i in 0..3 {
        assert_eq!(a.lookup(&key(i)), Lookup::Miss, "block {i} after the flush");
    }
    let (health, tier) = &a.driver.manager().stats().tiers[0];
    assert_eq!((tier.read_missing, tier.read_failures), (3, 0));
    assert_eq!(*health, Health::Up);
    assert_eq!(a.lookup(&key(6)), Lookup::Hit);
    assert_eq!(a.load(&key(6), 8), content(&key(6)));
    a.assert_settled();
    b.assert_settled();
}

/// Credentials come from environment variables the configuration names (never from the
/// file): a variable that is not set is an error naming it; a wrong password is a clear
/// error when the tier opens, which does not print the password; the right one opens.
#[test]
fn credentials_come_from_the_environment() {
    let server = Server::start(&["--requirepass", "s3cret"]);
    let env = |v: &str| match v {
        "WRONG" => Some("guess".to_owned()),
        "RIGHT" => Some("s3cret".to_owned()),
        _ => None,
    };
    let mut o = options(vec![server.url()], "auth");
    let e = o.credentials_from(None, Some("UNSET"), env).unwrap_err();
    assert!(e.to_string().contains("UNSET"), "{e}");
    o.credentials_from(None, Some("WRONG"), env).unwrap();
    assert!(!format!("{o:?}").contains("guess"), "{o:?}");
    let e = RedisStore::open(&o, BLOCK, 64 * BLOCK as u64).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("WRONGPASS") || text.to_lowercase().contains("auth"),
        "{text}"
    );
    assert!(
        !text.contains("guess"),
        "the password is not in messages: {text}"
    );
    o.credentials_from(None, Some("RIGHT"), env).unwrap();
    let store = open(&o);
    assert!(store.put(&key(1), &content(&key(1))).is_ok());
    // No password at all: the server refuses, and says so.
    o.password = None;
    let e = RedisStore::open(&o, BLOCK, 64 * BLOCK as u64).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("NOAUTH") || text.to_lowercase().contains("auth"),
        "{text}"
    );
}

/// Tier health, ★3: a server that stops answering fails each call within the timeout (no
/// request waits longer), the tier goes Down after its failures, lookups skip it (Miss, not
/// a wait); once the server answers again a health probe brings the tier back Up and its
/// blocks are served. Nothing wrong is served and no pin is left.
#[test]
fn a_server_that_stops_answering_fails_within_the_timeout_and_comes_back() {
    let server = Server::start(&[]);
    let o = options(vec![server.url()], "frozen");
    let store = open(&o);
    let mut a = Node::new(store.clone());
    for i in 0..6 {
        a.store(&key(i), i as usize);
    }
    server.freeze();
    let started = Instant::now();
    let mut one = vec![0u8; BLOCK];
    let e = store.get(&key(0), &mut one).unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(e, StoreError::Unavailable(_)), "{e}");
    // A bound on a hang, not a speed target: the timeout is 500 ms.
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    // Blocks 0 and 1 left the primary: their promotions fail, the tier goes Down.
    let mut down = false;
    for _ in 0..10 {
        for i in 0..2 {
            assert_ne!(
                a.lookup(&key(i)),
                Lookup::Hit,
                "nothing is served from a frozen server"
            );
        }
        if matches!(a.driver.manager().health(T0), Some(Health::Down { .. })) {
            down = true;
            break;
        }
    }
    assert!(down, "the tier went Down");
    assert_eq!(a.lookup(&key(0)), Lookup::Miss, "a Down tier is skipped");
    server.thaw();
    a.wait_up();
    assert_eq!(a.lookup(&key(0)), Lookup::Hit, "served again once Up");
    assert_eq!(a.load(&key(0), 8), content(&key(0)));
    a.assert_settled();
}

/// A cluster of three masters and three replicas: node A stores through the cluster client
/// (slots and redirects are the client's), node B finds and serves the blocks; a master is
/// killed mid-run: jobs fail and nothing wrong is served; after the failover the tier is Up
/// and blocks on every slot are served again.
#[test]
fn a_cluster_shares_blocks_and_survives_a_master_failover() {
    let cluster = Cluster::start(3);
    let mut o = options(cluster.urls(), "cluster");
    o.cluster = true;
    let mut a = Node::new(open(&o));
    let mut b = Node::new(open(&o));
    for i in 0..12 {
        a.store(&key(i), (i % 8) as usize);
    }
    for i in 0..12 {
        assert_eq!(b.lookup(&key(i)), Lookup::Hit, "block {i} on node B");
        assert_eq!(b.load(&key(i), 8), content(&key(i)));
    }
    // Kill the master of block 20's slot, then store and read through the failover.
    let store = open(&o);
    let victim = cluster.master_of(&store.name_of(&key(20)));
    let mut cluster = cluster;
    cluster.nodes[victim].kill();
    let mut c = Node::new(store);
    // Nodes that start now are given the live servers' URLs.
    o.urls.remove(victim);
    for i in 20..28 {
        c.store(&key(i), (i % 8) as usize); // some cascades fail while the slot has no master
    }
    for i in 20..28 {
        if c.lookup(&key(i)) == Lookup::Hit {
            assert_eq!(c.load(&key(i), 8), content(&key(i)), "never wrong bytes");
        }
    }
    cluster.wait_ok(Duration::from_secs(30));
    // Node C's tier may have gone Down meanwhile: a health probe brings it back Up.
    c.wait_up();
    let mut d = Node::new(open(&o));
    for i in 30..36 {
        d.store(&key(i), (i % 8) as usize);
    }
    let mut e = Node::new(open(&o));
    for i in 30..36 {
        assert_eq!(
            e.lookup(&key(i)),
            Lookup::Hit,
            "block {i} after the failover; storing node {:?}; reading node {:?}",
            d.driver.manager().stats().tiers[0],
            e.driver.manager().stats().tiers[0]
        );
        assert_eq!(e.load(&key(i), 8), content(&key(i)));
    }
    for n in [&mut a, &mut b, &mut c, &mut d, &mut e] {
        n.assert_settled();
    }
}
