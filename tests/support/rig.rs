//! A kvtier node over real parts for the integration tests: a region in a temporary
//! directory, device memory on the host, the host transfer engine and the tiers a test gives;
//! and the steps the tests repeat (store a block, look it up until the answer is final, load
//! it, wait for a tier's health). Used by `end_to_end.rs`, `redis.rs` and `s3.rs`.

#![allow(dead_code)] // each test binary uses a part

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{Config, Health, Key, Lookup, RequestId, TierConfig, TierId};
use kvtier_hw::{Driver, DriverOptions, HostEngine, HostMemory, Layout, Region, SecondaryStore};

/// `len` bytes of `key`'s block: every byte depends on the key and its position.
pub(crate) fn content(key: &Key, len: usize) -> Vec<u8> {
    let seed = key.hash64();
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i / 64) as u8)
        .collect()
}

/// The `i`th test key.
pub(crate) fn key(i: u32) -> Key {
    Key::new(format!("block-{i}").as_bytes())
}

/// The sizes of a rig.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    /// Slots of the primary (the region).
    pub(crate) slots: u32,
    /// Bytes of a block.
    pub(crate) block: usize,
    /// Blocks of device memory.
    pub(crate) device_blocks: usize,
    /// Copy threads of the host engine (and threads that prefault the region).
    pub(crate) threads: usize,
}

/// A driver over real parts, and the device memory its blocks are copied from and to.
pub(crate) struct Rig {
    pub(crate) driver: Driver,
    pub(crate) device: Arc<HostMemory>,
    block: usize,
}

/// Steps a lookup may stay HitPending or Retry before the test fails.
const LOOKUP_STEPS: usize = 40;

impl Rig {
    /// A rig in `dir` over `stores`, one tier each, of the store's kind; `tune` sees the host
    /// engine and the core's configuration before the driver owns them.
    pub(crate) fn new(
        dir: &Path,
        shape: Shape,
        stores: Vec<Arc<dyn SecondaryStore>>,
        options: DriverOptions,
        tune: impl FnOnce(&HostEngine, &mut Config),
    ) -> Rig {
        let layout = Layout::new(shape.slots, 1, shape.block).unwrap();
        let region =
            Arc::new(Region::create(&dir.join("region"), layout, shape.threads).expect("region"));
        let device = Arc::new(HostMemory::new(shape.device_blocks * shape.block).unwrap());
        let engine = HostEngine::new(region.clone(), device.clone(), 0, shape.threads);
        let mut config = Config::new(shape.slots);
        config.tiers = stores
            .iter()
            .map(|s| TierConfig::new(s.kind(), s.capacity_blocks()))
            .collect();
        tune(&engine, &mut config);
        let driver =
            Driver::new(config, region, Box::new(engine), stores, options).expect("driver starts");
        Rig {
            driver,
            device,
            block: shape.block,
        }
    }

    /// `k`'s block, as this rig's blocks are sized.
    pub(crate) fn content(&self, k: &Key) -> Vec<u8> {
        content(k, self.block)
    }

    /// Computes `k` on the "GPU" at device block `at` and stores it; waits for the copy.
    pub(crate) fn store(&mut self, k: &Key, at: usize) {
        self.device
            .write(at * self.block, &self.content(k))
            .unwrap();
        if let Some(t) = self
            .driver
            .store(RequestId(1), &[(k.clone(), at * self.block)])
            .unwrap()
        {
            self.driver.wait(t).unwrap();
        }
    }

    /// Looks `k` up step after step until the answer is neither HitPending nor Retry.
    pub(crate) fn lookup(&mut self, k: &Key) -> Lookup {
        for _ in 0..LOOKUP_STEPS {
            match self.driver.lookup(RequestId(2), k) {
                Lookup::HitPending | Lookup::Retry => self.driver.settle(1),
                other => return other,
            }
        }
        panic!("{k} stayed HitPending or Retry for {LOOKUP_STEPS} steps");
    }

    /// Loads `k` into device block `at` and returns the bytes there.
    pub(crate) fn load(&mut self, k: &Key, at: usize) -> Vec<u8> {
        let t = self
            .driver
            .load(RequestId(2), &[(k.clone(), at * self.block)])
            .unwrap();
        self.driver.wait(t).unwrap();
        let mut out = vec![0; self.block];
        self.device.read(at * self.block, &mut out).unwrap();
        out
    }

    /// Looks `k` up and, on a Hit, loads it into device block `at` and checks its bytes:
    /// whatever is served is exactly what was stored. Returns the lookup's answer.
    pub(crate) fn lookup_and_verify(&mut self, k: &Key, at: usize) -> Lookup {
        let answer = self.lookup(k);
        if answer == Lookup::Hit {
            assert_eq!(self.load(k, at), self.content(k), "{k}'s bytes");
        }
        answer
    }

    /// Ends steps (at most `steps`, pausing `pause` after each) until tier `tier`'s health
    /// satisfies `want`; fails the test naming `what` otherwise.
    pub(crate) fn wait_health(
        &mut self,
        tier: TierId,
        what: &str,
        steps: usize,
        pause: Duration,
        want: impl Fn(&Health) -> bool,
    ) {
        for _ in 0..steps {
            self.driver.settle(1);
            if self
                .driver
                .manager()
                .health(tier)
                .as_ref()
                .is_some_and(&want)
            {
                return;
            }
            std::thread::sleep(pause);
        }
        panic!(
            "tier {tier:?} not {what} after {steps} steps: {:?}",
            self.driver.manager().stats().tiers[usize::from(tier.0)]
        );
    }

    /// No pin is left and no job is outstanding once the node settles; the core's
    /// invariants hold.
    pub(crate) fn assert_settled(&mut self) {
        self.driver.settle(8);
        let stats = self.driver.manager().stats();
        assert_eq!((stats.job_pins, stats.load_pins), (0, 0), "{stats:?}");
        assert_eq!(stats.jobs_outstanding, 0, "{stats:?}");
        self.driver.manager().check_invariants().unwrap();
    }
}

/// Runs `f` and returns what it returns, failing the test if it takes longer than `limit` (a
/// call or job that never ends would otherwise hang the test instead of failing it).
pub(crate) fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            t.join().unwrap();
            v
        }
        // The closure panicked: report its panic.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(t.join().unwrap_err())
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {limit:?}: a call or job never ended")
        }
    }
}
