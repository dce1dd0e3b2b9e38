//! `PageCache`: kvtier's primary and secondary tiers as a page store that an engine's host
//! memory pool reads from and writes to by address (SGLang's HiCache storage backend,
//! `kvtier/sglang.py`).
//!
//! One `PageCache` per engine rank process: it owns a [`Driver`] over a primary region of its
//! own, and copies whole pages between the region's rows and the caller's memory itself (no
//! worker processes). A page is given as pieces: addresses and sizes, in order, whose bytes
//! make up the row (one piece per page in SGLang's `page_first` layouts, one per layer and
//! K/V in `layer_first`).
//!
//! What a call answers, under the core's rules:
//! - `exists`: the length of the leading run of keys Ready in the primary when it returns.
//!   Keys held by a secondary tier are promoted first and counted once their promotion has
//!   ended and the block is Ready (a promotion that fails is never counted); the wait is
//!   bounded.
//! - `get`: per key, whether its page was copied in full from a block that is Ready and
//!   pinned by the load (P11–P13): Ready blocks were written whole by a store or checked by a
//!   tier's read.
//! - `set`: per key, whether its block was Ready in the primary at the start or its copy into
//!   a Pending slot ended whole in this call (P4–P8). From there it cascades to the secondary
//!   tiers; like any cached block it may be evicted later, even by the same call's later keys
//!   when the batch is larger than the primary.
//!
//! Every call but the constructor releases the GIL. The driver sits behind one mutex, held
//! only to call the core: page copies run outside it (their slots are pinned, or Pending for
//! the copying call), and a call that waits for tier IO waits with it released, on the
//! driver's [`Waiter`]. So the calls of SGLang's threads (the backup thread's `set` beside
//! the prefetch thread's `exists`, the scheduler's `stats`) never wait for each other's IO.
//! `clear` resets the primary only while no copy is running and no block is pinned.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_core::{BlockState, Config, Error as CoreError, Key, Lookup, RequestId, SlotId};
use kvtier_hw::{Driver, HwError, Layout, Region, Waiter};

use crate::errors;
use crate::manager::{core_stats, key_of, open_driver, parse_policy, tier_settings};

/// The longest one wait for tier IO lasts before the caller looks again.
const WAIT_SLICE: Duration = Duration::from_millis(2);

/// Counters of the page calls since the start (the core's own are in `stats`).
#[derive(Clone, Copy, Default)]
struct Tally {
    pages_found: u64,
    pages_read: u64,
    pages_not_read: u64,
    pages_written: u64,
    pages_not_written: u64,
    wait_timeouts: u64,
}

struct Inner {
    driver: Option<Driver>,
    next_request: u64,
    /// Calls copying pages with the lock released (their slots pinned or Pending).
    copies: usize,
    tally: Tally,
}

impl Inner {
    fn driver(&mut self) -> PyResult<&mut Driver> {
        self.driver
            .as_mut()
            .ok_or_else(|| errors::StateError::new_err("the page cache was shut down"))
    }

    fn request(&mut self) -> RequestId {
        let r = RequestId(self.next_request);
        self.next_request += 1;
        r
    }
}

/// kvtier's tiers as a page store addressed by the caller's memory.
#[pyclass(module = "kvtier._native", frozen)]
pub(crate) struct PageCache {
    inner: Mutex<Inner>,
    /// Waits for the driver's next completion with the lock released.
    waiter: Waiter,
    /// Bytes of one page (the sum of its pieces).
    page_bytes: usize,
    num_blocks: u32,
    wait_timeout: Duration,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn is_ready(driver: &Driver, key: &Key) -> bool {
    matches!(
        driver.manager().primary().state_of(key),
        Some((_, BlockState::Ready { .. }))
    )
}

/// The pieces of each page: `addrs` and `sizes` in page order, `per_page` pieces a page.
struct Pieces {
    addrs: Vec<usize>,
    sizes: Vec<usize>,
    per_page: usize,
}

impl Pieces {
    /// Checks the shape against `pages` pages of `page_bytes` each: as many pieces for each
    /// page, none empty or null, each page's adding up to `page_bytes`.
    fn new(
        addrs: Vec<usize>,
        sizes: Vec<usize>,
        pages: usize,
        page_bytes: usize,
    ) -> PyResult<Self> {
        let refuse = |why: String| Err(errors::StateError::new_err(why));
        if addrs.len() != sizes.len() {
            return refuse(format!(
                "{} piece addresses for {} sizes",
                addrs.len(),
                sizes.len()
            ));
        }
        if pages == 0 {
            return if addrs.is_empty() {
                Ok(Pieces {
                    addrs,
                    sizes,
                    per_page: 0,
                })
            } else {
                refuse(format!("{} pieces for no page", addrs.len()))
            };
        }
        if addrs.is_empty() || !addrs.len().is_multiple_of(pages) {
            return refuse(format!(
                "{} pieces do not split evenly over {pages} pages",
                addrs.len()
            ));
        }
        let per_page = addrs.len() / pages;
        for (p, chunk) in sizes.chunks(per_page).enumerate() {
            let mut total = 0usize;
            for &len in chunk {
                if len == 0 || len > page_bytes {
                    return refuse(format!(
                        "page {p} has a piece of {len} bytes; a page here has {page_bytes}"
                    ));
                }
                total = total.saturating_add(len);
            }
            if total != page_bytes {
                return refuse(format!(
                    "page {p} has {total} bytes in its pieces; a page here has {page_bytes}"
                ));
            }
        }
        if addrs.contains(&0) {
            return refuse("a piece's address is null".into());
        }
        Ok(Pieces {
            addrs,
            sizes,
            per_page,
        })
    }

    fn of(&self, page: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let r = page * self.per_page..(page + 1) * self.per_page;
        self.addrs[r.clone()]
            .iter()
            .copied()
            .zip(self.sizes[r].iter().copied())
    }
}

/// Copies page `page` of `pieces` into the row of `slot`.
///
/// Only for a slot Pending for the calling store (P4, I6).
fn copy_in(region: &Region, slot: SlotId, pieces: &Pieces, page: usize) -> Result<(), String> {
    let mut at = 0;
    for (addr, len) in pieces.of(page) {
        // SAFETY: `PageCache`'s callers pass addresses of their own host memory that are
        // valid for `len` bytes and not written while the call runs (SGLang's host pool
        // pages, from its `get_page_buffer_meta`); null addresses and empty or oversized
        // pieces were refused in `Pieces::new`, so `len` is at most a page.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        region
            .write_part(slot, 0, at, src)
            .map_err(|e| e.to_string())?;
        at += len;
    }
    Ok(())
}

/// Copies the row of `slot` into page `page` of `pieces`.
///
/// Only for a slot pinned by `prepare_load` (P11, I3).
fn copy_out(region: &Region, slot: SlotId, pieces: &Pieces, page: usize) -> Result<(), String> {
    let mut at = 0;
    for (addr, len) in pieces.of(page) {
        // SAFETY: as in `copy_in`; the caller's pages are its own, read or written by nobody
        // else while the call runs (SGLang allocated them for this load).
        let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
        region
            .read_part(slot, 0, at, dst)
            .map_err(|e| e.to_string())?;
        at += len;
    }
    Ok(())
}

impl PageCache {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// Ends a step (promotions and probes go out, results are applied), then waits with the
    /// lock released for the next completion, at most one slice.
    fn wait_for_io(&self, mut inner: MutexGuard<'_, Inner>) -> PyResult<()> {
        inner.driver()?.end_step();
        drop(inner);
        self.waiter.wait(WAIT_SLICE);
        Ok(())
    }

    /// Runs `copy` with the lock released, counted in `copies` (which `clear` waits out).
    fn unlocked<'a, T>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        copy: impl FnOnce() -> T,
    ) -> (MutexGuard<'a, Inner>, T) {
        inner.copies += 1;
        drop(inner);
        let out = copy();
        let mut inner = self.lock();
        inner.copies -= 1;
        (inner, out)
    }

    /// Runs one page call as a request of its own, with the GIL released: `body`, then the
    /// request's end (R6) and the step's (the holds of its hits end with it), whatever
    /// `body` answered; then kvtier's warnings go to Python's logging.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        body: impl FnOnce(RequestId) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        let out = py.detach(|| {
            let req = self.lock().request();
            let out = body(req);
            if let Ok(d) = self.lock().driver() {
                d.request_finished(req);
                d.end_step();
            }
            out
        });
        crate::log::flush(py)?;
        out
    }

    /// Waits up to `timeout_s` (released between rounds, as `wait_for_io`) until `done`
    /// answers true under the lock: whether it did.
    fn wait_until(
        &self,
        py: Python<'_>,
        timeout_s: f64,
        mut done: impl FnMut(&mut Inner) -> PyResult<bool> + Send,
    ) -> PyResult<bool> {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::MAX);
        let deadline = Instant::now().checked_add(timeout);
        py.detach(|| {
            loop {
                let mut inner = self.lock();
                if done(&mut inner)? {
                    return Ok(true);
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
                }
                self.wait_for_io(inner)?;
            }
        })
    }

    /// Looks `keys` up for `req` until none of them is on its way (a promotion or probe in
    /// flight, or a promotion refused for want of a free slot while IO holds pins) or the
    /// deadline passes, waiting for IO between rounds. Answers each key's last answer. With
    /// `leading`, keys after the first Miss are not waited for, and answer Miss.
    ///
    /// Ready keys are looked up first in every round. With `pins`, each key is pinned for a
    /// load (P11) as soon as it answers Hit, its slot kept in `pins`: a block found cannot be
    /// evicted by the promotions of the others. The caller releases every pin it is given
    /// (P13). Without, every round looks up again every key answered Hit, as vLLM's scheduler
    /// does at every step: the core protects a request's hits from its promotions for one
    /// step (★8), and each round ends one.
    fn resolve(
        &self,
        req: RequestId,
        keys: &[Key],
        leading: bool,
        mut pins: Option<&mut Vec<Option<SlotId>>>,
    ) -> PyResult<Vec<Lookup>> {
        let deadline = Instant::now() + self.wait_timeout;
        let mut answers = vec![Lookup::Miss; keys.len()];
        let mut open: Vec<usize> = (0..keys.len()).collect();
        loop {
            let mut inner = self.lock();
            let driver = inner.driver()?;
            let mut still = Vec::new();
            // Ready keys first: each is pinned (with `pins`) or protected for this step (★8)
            // before any promotion of the others could evict it.
            open.sort_by_key(|&i| !is_ready(driver, &keys[i]));
            // Only a lookup answered Miss can have had its promotion refused: the counter is
            // read again after those alone.
            let mut refused = driver.manager().stats().promotions_refused;
            for &i in &open {
                let mut a = driver.lookup(req, &keys[i]);
                let was_refused = a == Lookup::Miss && {
                    let now = driver.manager().stats().promotions_refused;
                    std::mem::replace(&mut refused, now) < now
                };
                if was_refused && driver.has_pending_work() {
                    // Found below, but no slot is free now: IO in flight holds pins that
                    // its end lets go. Asked again after it, within the deadline. A job
                    // counted ended holds its pins until a step applies its result (M1): the
                    // core's outstanding jobs are asked, not the IO in flight alone.
                    answers[i] = Lookup::Retry;
                    still.push(i);
                    continue;
                }
                if a == Lookup::Hit
                    && let Some(pins) = pins.as_deref_mut()
                {
                    // Under the lock since the lookup: the block is still Ready.
                    match driver.prepare_load(req, std::slice::from_ref(&keys[i])) {
                        Ok(slots) => pins[i] = Some(slots[0]),
                        Err(_) => a = Lookup::Miss,
                    }
                }
                answers[i] = a;
                match a {
                    Lookup::Hit => {}
                    Lookup::HitPending | Lookup::Retry => still.push(i),
                    Lookup::Miss if leading => break,
                    // A Miss, or an answer this version of the core added: not counted.
                    _ => {}
                }
            }
            if leading && let Some(m) = answers.iter().position(|a| *a == Lookup::Miss) {
                // Keys past the first Miss are not counted: stop waiting for them.
                still.retain(|&i| i < m);
                for a in &mut answers[m + 1..] {
                    *a = Lookup::Miss;
                }
            }
            still.sort_unstable();
            if pins.is_none() && kvtier_core::mutant::active("sglang_count_pending") {
                // Seeded defect: promotions counted as found before they end.
                for &i in &still {
                    if answers[i] == Lookup::HitPending {
                        answers[i] = Lookup::Hit;
                    }
                }
                return Ok(answers);
            }
            if still.is_empty() {
                return Ok(answers);
            }
            if Instant::now() >= deadline {
                inner.tally.wait_timeouts += 1;
                for &i in &still {
                    answers[i] = Lookup::Miss;
                }
                return Ok(answers);
            }
            self.wait_for_io(inner)?;
            open = if pins.is_some() {
                still
            } else {
                (0..keys.len())
                    .filter(|&i| answers[i] == Lookup::Hit || still.binary_search(&i).is_ok())
                    .collect()
            };
        }
    }

    /// `exists` for `req`: the leading run of keys Ready when it returns.
    fn found(&self, req: RequestId, keys: &[Key]) -> PyResult<usize> {
        let answers = self.resolve(req, keys, true, None)?;
        let mut inner = self.lock();
        let driver = inner.driver()?;
        // A promotion that ended in a later round may have evicted a block found earlier.
        let n = (answers.iter().zip(keys))
            .take_while(|(a, k)| **a == Lookup::Hit && is_ready(driver, k))
            .count();
        inner.tally.pages_found += n as u64;
        Ok(n)
    }

    /// `get` for `req`: per key, whether its page was copied whole from a pinned Ready block.
    fn load(&self, req: RequestId, keys: &[Key], pieces: &Pieces) -> PyResult<Vec<bool>> {
        let mut pins = vec![None; keys.len()];
        let resolved = self.resolve(req, keys, false, Some(&mut pins));
        let inner = self.lock();
        let region = match &inner.driver {
            Some(d) => d.region().clone(),
            None => return resolved.map(|_| vec![false; keys.len()]),
        };
        // The pinned rows are not written or reused until their pins go (I3, I6).
        let (mut inner, mut read) = self.unlocked(inner, || {
            (0..keys.len())
                .map(|i| match pins[i] {
                    Some(slot) => match copy_out(&region, slot, pieces, i) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!(key = %keys[i], error = %e, "page copy out of the primary failed");
                            false
                        }
                    },
                    // Seeded defect: a page reported read that was not copied.
                    None => kvtier_core::mutant::active("sglang_report_unread"),
                })
                .collect::<Vec<bool>>()
        });
        if let Some(driver) = inner.driver.as_mut() {
            for (i, key) in keys.iter().enumerate() {
                if pins[i].is_some()
                    && let Err(e) = driver.complete_load(std::slice::from_ref(key))
                {
                    tracing::error!(%key, error = %e, "a load pin could not be released");
                    read[i] = false;
                }
            }
        }
        resolved?;
        let ok = read.iter().filter(|r| **r).count() as u64;
        inner.tally.pages_read += ok;
        inner.tally.pages_not_read += keys.len() as u64 - ok;
        Ok(read)
    }

    /// `set` for `req`: per key, whether it was Ready at the start or its copy into the
    /// primary ended whole (P8).
    fn store(&self, req: RequestId, keys: &[Key], pieces: &Pieces) -> PyResult<Vec<bool>> {
        let deadline = Instant::now() + self.wait_timeout;
        // A block being promoted is Ready soon, or gone: wait for it first.
        let mut inner = loop {
            let mut inner = self.lock();
            let driver = inner.driver()?;
            let moving = keys.iter().any(|k| {
                matches!(
                    driver.manager().primary().state_of(k),
                    Some((_, BlockState::Promoting | BlockState::Pending))
                )
            });
            if !moving || Instant::now() >= deadline {
                break inner;
            }
            self.wait_for_io(inner)?;
        };
        let index: HashMap<&Key, usize> = keys.iter().enumerate().map(|(i, k)| (k, i)).collect();
        let driver = inner.driver()?;
        let mut done: Vec<bool> = keys.iter().map(|k| is_ready(driver, k)).collect();
        let present: Vec<Key> = (keys.iter().zip(&done))
            .filter(|(_, d)| **d)
            .map(|(k, _)| k.clone())
            .collect();
        driver.touch(&present);
        // All or nothing in one call (P5); when there is no room for all, one at a time.
        let mut batches: Vec<Vec<Key>> = vec![keys.to_vec()];
        let mut one_by_one = false;
        while let Some(batch) = batches.pop() {
            let driver = inner.driver()?;
            match driver.prepare_store(req, &batch) {
                Ok(p) if p.keys.is_empty() => {
                    for k in &batch {
                        done[index[k]] |= is_ready(driver, k);
                    }
                }
                Ok(p) => {
                    let region = driver.region().clone();
                    // Pending slots are written by this call alone until it completes them
                    // (P4, I6).
                    let (back, copied) = self.unlocked(inner, || {
                        p.keys
                            .iter()
                            .zip(&p.slots)
                            .map(|(k, &slot)| copy_in(&region, slot, pieces, index[k]))
                            .collect::<Vec<_>>()
                    });
                    inner = back;
                    let (good, bad): (Vec<_>, Vec<_>) = p
                        .keys
                        .iter()
                        .cloned()
                        .zip(copied)
                        .partition(|(_, r)| r.is_ok());
                    for (k, r) in &bad {
                        if let Err(e) = r {
                            tracing::warn!(key = %k, error = %e, "page copy into the primary failed");
                        }
                    }
                    let good: Vec<Key> = good.into_iter().map(|(k, _)| k).collect();
                    let bad: Vec<Key> = bad.into_iter().map(|(k, _)| k).collect();
                    let driver = inner.driver()?;
                    if !good.is_empty() {
                        driver.complete_store(req, &good, true);
                    }
                    if !bad.is_empty() {
                        driver.complete_store(req, &bad, false);
                    }
                    for k in &good {
                        done[index[k]] = true;
                    }
                }
                Err(HwError::Core(CoreError::NoRoom { .. })) if !one_by_one => {
                    one_by_one = true;
                    batches = keys
                        .iter()
                        .rev()
                        .filter(|k| !done[index[k]])
                        .map(|k| vec![k.clone()])
                        .collect();
                }
                // The slots are pinned by IO in flight (the cascades of blocks just stored):
                // its end frees them, once a step applies its result. Tried again after it,
                // within the deadline.
                Err(HwError::Core(CoreError::NoRoom { .. }))
                    if driver.has_pending_work() && Instant::now() < deadline =>
                {
                    batches.push(batch);
                    self.wait_for_io(inner)?;
                    inner = self.lock();
                }
                Err(HwError::Core(CoreError::NoRoom { .. })) => {}
                Err(e) => return Err(errors::hw(e)),
            }
        }
        // A key named twice is marked at its last place.
        for (i, k) in keys.iter().enumerate() {
            done[i] |= done[index[k]];
        }
        let ok = done.iter().filter(|s| **s).count() as u64;
        inner.tally.pages_written += ok;
        inner.tally.pages_not_written += keys.len() as u64 - ok;
        Ok(done)
    }
}

fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    keys.try_iter()?.map(|k| key_of(&k?)).collect()
}

/// What `stats` reads under the lock.
struct Snapshot {
    tally: Tally,
    primary_blocks: usize,
    core: kvtier_core::Stats,
}

#[pymethods]
impl PageCache {
    /// A primary of `num_blocks` pages of `page_bytes` in an anonymous region named
    /// `region_path` (`@NAME`) or a file, and the secondary tiers `tiers` (the same settings
    /// as `kvtier.vllm`'s `secondary_tiers`), their blocks named by `identity`.
    #[new]
    #[pyo3(signature = (*, num_blocks, page_bytes, region_path, policy = "lru", tiers = Vec::new(),
        identity = String::new(), io_threads = 4, wait_timeout_s = 2.0, shutdown_timeout_s = 30.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: u32,
        page_bytes: usize,
        region_path: std::path::PathBuf,
        policy: &str,
        tiers: Vec<Bound<'_, PyDict>>,
        identity: String,
        io_threads: usize,
        wait_timeout_s: f64,
        shutdown_timeout_s: f64,
    ) -> PyResult<Self> {
        let positive = |key: &str, s: f64| {
            if s.is_finite() && s > 0.0 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(errors::config(
                    key,
                    format!("{s} is not a positive number of seconds"),
                ))
            }
        };
        let wait_timeout = positive("wait_timeout_s", wait_timeout_s)?;
        let shutdown_timeout = positive("shutdown_timeout_s", shutdown_timeout_s)?;
        if page_bytes == 0 {
            return Err(errors::config("page_bytes", "a page has at least one byte"));
        }
        let mut config = Config::new(num_blocks);
        config.policy = parse_policy("eviction_policy", policy)?;
        config.events = false;
        let layout =
            Layout::new(num_blocks, 1, page_bytes).map_err(|e| errors::config("cpu_bytes", e))?;
        let settings = tiers
            .iter()
            .enumerate()
            .map(|(i, d)| tier_settings(i, d))
            .collect::<PyResult<Vec<_>>>()?;
        let build = move || {
            let threads = (1, io_threads);
            open_driver(
                config,
                &settings,
                &identity,
                &region_path,
                layout,
                threads,
                shutdown_timeout,
            )
        };
        let driver = py.detach(build)?;
        let waiter = driver.waiter();
        Ok(PageCache {
            inner: Mutex::new(Inner {
                driver: Some(driver),
                next_request: 0,
                copies: 0,
                tally: Tally::default(),
            }),
            waiter,
            page_bytes,
            num_blocks,
            wait_timeout,
        })
    }

    /// Bytes of one page.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Pages the primary holds.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The length of the leading run of `keys` whose blocks are Ready in the primary when the
    /// call returns, after waiting (up to `wait_timeout_s`) for the promotions and probes
    /// their lookups start.
    fn exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        self.call(py, |req| self.found(req, &keys))
    }

    /// Copies the pages of `keys` into the caller's memory: page `i` is the pieces
    /// `addrs[i * per_page ..]` of `sizes` bytes (flattened, page by page, as many for each
    /// page). Per key, whether its page was written in full from a Ready block. Blocks held
    /// by a secondary tier are promoted first (bounded by `wait_timeout_s`).
    ///
    /// The addresses must be the caller's own memory, valid for their sizes and touched by
    /// nobody else until the call returns.
    fn get(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        addrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(keys)?;
        let pieces = Pieces::new(addrs, sizes, keys.len(), self.page_bytes)?;
        self.call(py, |req| self.load(req, &keys, &pieces))
    }

    /// Stores the pages of `keys` from the caller's memory (pieces as in `get`, under the
    /// same contract). Per key, whether its block was Ready in the primary at the start or
    /// its copy into the primary ended whole in this call; from there it cascades to the
    /// secondary tiers.
    fn set(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        addrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(keys)?;
        let pieces = Pieces::new(addrs, sizes, keys.len(), self.page_bytes)?;
        self.call(py, |req| self.store(req, &keys, &pieces))
    }

    /// Ends a step of the core: results of finished tier IO are applied and queued
    /// promotions and probes go out (the calls above do it as they go; an idle caller may).
    fn end_step(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            self.lock().driver()?.end_step();
            Ok(())
        })
    }

    /// Waits (up to `timeout_s`) until no tier IO is in flight: cascades and promotions
    /// started so far have ended. Whether nothing is left.
    fn drain(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        self.wait_until(py, timeout_s, |inner| {
            let driver = inner.driver()?;
            driver.end_step();
            Ok(!driver.has_pending_work())
        })
    }

    /// Forgets every page in the primary (M12) once no call is copying pages and no block
    /// is pinned, and tier IO in flight has ended, waiting up to `timeout_s` for both. The
    /// secondary tiers keep theirs. Whether the primary was reset (`False`: still busy at
    /// the timeout, nothing changed).
    fn clear(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        self.wait_until(py, timeout_s, |inner| {
            let copies = inner.copies;
            let driver = inner.driver()?;
            let idle =
                copies == 0 && driver.manager().stats().load_pins == 0 && driver.in_flight() == 0;
            if idle {
                // Nothing is in flight: the reset neither waits nor is refused as busy.
                driver.reset_cache(Duration::ZERO).map_err(errors::hw)?;
                // No copy runs (none can start while the lock is held): the slots the reset
                // freed are written by nobody, and promotions may resume (M14).
                driver.reset_flushed();
            }
            Ok(idle)
        })
    }

    /// The page calls' counters and the core's: a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snap = py.detach(|| {
            let mut inner = self.lock();
            let tally = inner.tally;
            let driver = inner.driver()?;
            Ok::<_, PyErr>(Snapshot {
                tally,
                primary_blocks: driver.manager().primary().len(),
                core: driver.manager().stats(),
            })
        })?;
        crate::log::flush(py)?;
        let d = core_stats(py, &snap.core)?;
        let t = &snap.tally;
        d.set_item("pages_found", t.pages_found)?;
        d.set_item("pages_read", t.pages_read)?;
        d.set_item("pages_not_read", t.pages_not_read)?;
        d.set_item("pages_written", t.pages_written)?;
        d.set_item("pages_not_written", t.pages_not_written)?;
        // The page calls' deadlines, beside the core's (requests' waits, W3).
        d.set_item("page_wait_timeouts", t.wait_timeouts)?;
        d.set_item("primary_blocks", snap.primary_blocks)?;
        Ok(d)
    }

    /// Checks the core's invariants (a test's assertion); raises on a violation.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            self.lock()
                .driver()?
                .manager()
                .check_invariants()
                .map_err(|e| errors::StateError::new_err(e.to_string()))
        })
    }

    /// Waits (up to the shutdown timeout) for tier IO in flight, stops the IO threads and
    /// frees the region. Later calls raise `StateError`; a second call does nothing.
    fn shutdown(&self, py: Python<'_>) {
        let driver = py.detach(|| self.lock().driver.take());
        if let Some(d) = driver {
            py.detach(|| {
                d.shutdown();
            });
        }
        let _ = crate::log::flush(py);
    }
}
