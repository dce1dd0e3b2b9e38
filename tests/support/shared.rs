//! A kvtier node over one shared tier (Redis, S3) for the shared tiers' tests, and the
//! checks those tests repeat: blocks served with the bytes stored, a batch read back.

#![allow(dead_code)] // each test binary uses a part

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Health, Key, Lookup, TierId};
use kvtier_hw::{DriverOptions, PAGE, SecondaryStore, StoreError};

use crate::rig::{self, Rig, Shape, key, within};

/// Slots of a node's primary.
pub(crate) const SLOTS: u32 = 4;
/// Bytes of a block.
pub(crate) const BLOCK: usize = PAGE;
/// The shared tier.
pub(crate) const T0: TierId = TierId(0);

/// The bytes stored for `key`.
pub(crate) fn content(key: &Key) -> Vec<u8> {
    rig::content(key, BLOCK)
}

/// One kvtier node: a primary of its own, the host engine, and the shared tier.
pub(crate) struct Node {
    pub(crate) rig: Rig,
    _dir: tempfile::TempDir,
}

impl Node {
    pub(crate) fn new(store: Arc<dyn SecondaryStore>) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let shape = Shape {
            slots: SLOTS,
            block: BLOCK,
            device_blocks: 16,
            threads: 1,
        };
        let stores = vec![store];
        let rig = Rig::new(
            dir.path(),
            shape,
            stores,
            DriverOptions::default(),
            |_, config| {
                config.tiers[0].absent_ttl_steps = 1;
                config.health.failures_to_down = 2;
                config.health.probe_interval_steps = 2;
                config.promotion_cooldown_steps = 2;
            },
        );
        Node { rig, _dir: dir }
    }

    /// Stores `k` from device block `at`; waits for the copy and its cascade.
    pub(crate) fn store(&mut self, k: &Key, at: usize) {
        self.rig.store(k, at);
        self.rig.driver.settle(4);
    }

    /// Ends steps until the tier is Up (health probes run every few steps).
    pub(crate) fn wait_up(&mut self) {
        self.rig
            .wait_health(T0, "Up", 200, Duration::from_millis(50), |h| {
                *h == Health::Up
            });
    }

    pub(crate) fn tier_stats(&self) -> kvtier_core::TierStats {
        self.rig.driver.manager().stats().tiers[0].1.clone()
    }
}

/// Looks up each of `keys` on `node`, expecting a Hit with the bytes that were stored.
pub(crate) fn assert_served(
    node: &mut Node,
    keys: impl IntoIterator<Item = u32>,
    at: usize,
    what: &str,
) {
    for i in keys {
        assert_eq!(
            node.rig.lookup_and_verify(&key(i), at),
            Lookup::Hit,
            "block {i} {what}: {:?}",
            node.rig.driver.manager().stats().tiers[0]
        );
    }
}

/// Reads `keys` in one batch: each key's bytes, or why not.
pub(crate) fn get_all(
    store: &dyn SecondaryStore,
    keys: &[Key],
) -> Vec<Result<Vec<u8>, StoreError>> {
    let mut out = vec![vec![0u8; BLOCK]; keys.len()];
    let mut gets: Vec<(&Key, &mut [u8])> = keys
        .iter()
        .zip(out.iter_mut().map(|o| &mut o[..]))
        .collect();
    let results = store.get_many(&mut gets);
    results
        .into_iter()
        .zip(out)
        .map(|(r, bytes)| r.map(|()| bytes))
        .collect()
}

/// Looks up `keys` (which have left the node's primary) until the shared tier is Down: their
/// promotions fail and none is served. Fails the test if the tier is not Down after ten
/// rounds.
pub(crate) fn fail_until_down(node: &mut Node, keys: std::ops::Range<u32>, what: &str) {
    for _ in 0..10 {
        for i in keys.clone() {
            assert_ne!(
                node.rig.lookup(&key(i)),
                Lookup::Hit,
                "nothing is served {what}"
            );
        }
        if matches!(
            node.rig.driver.manager().health(T0),
            Some(Health::Down { .. })
        ) {
            return;
        }
    }
    panic!("the tier did not go Down {what}: {:?}", node.tier_stats());
}

/// Calls to a store whose server stopped answering: a get, a step of 64 probes, then 24
/// blocks of `big`'s size (1 MiB: enough to fill the socket buffers, so the writes block).
/// Each must fail, within `limit`.
pub(crate) fn frozen_calls_fail(
    store: Arc<dyn SecondaryStore>,
    big: Arc<dyn SecondaryStore>,
    big_block: usize,
    limit: Duration,
) {
    let s = store.clone();
    let e = within(limit, move || {
        let mut one = vec![0u8; BLOCK];
        s.get(&key(0), &mut one).unwrap_err()
    });
    assert!(matches!(e, StoreError::Unavailable(_)), "{e}");
    let answers = within(limit, move || {
        let keys: Vec<Key> = (0..64).map(key).collect();
        store.contains_many(&keys.iter().collect::<Vec<_>>())
    });
    assert!(answers.iter().all(Result::is_err), "{answers:?}");
    let results = within(limit, move || {
        let block = vec![7u8; big_block];
        let keys: Vec<Key> = (1000..1024).map(key).collect();
        let puts: Vec<(&Key, &[u8])> = keys.iter().map(|k| (k, &block[..])).collect();
        big.put_many(&puts)
    });
    assert!(results.iter().all(Result::is_err), "{results:?}");
}
