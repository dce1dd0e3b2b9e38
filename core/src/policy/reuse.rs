//! Reuse-aware LRU (rules U1–U10): recency, with a head start for blocks that came back.
//!
//! Multi-turn traffic sorts blocks into kinds, which LRU treats alike:
//! - a block seen for the first time: some return (a conversation continues), many do not,
//!   and how many depends on the request: on Mooncake's conversation trace the new blocks of
//!   requests of 64 blocks or more (long documents) return least. New blocks are classed by
//!   their request's length in powers of four (1–3, 4–15, 16–63, 64 or more blocks);
//! - a block a request has already reused, or that comes back after an eviction, and the
//!   blocks before it in its request: it belongs to a conversation or document that returns,
//!   and is likely to return again.
//!
//! Every entry has a *due* time on a clock that ticks once per key a request's finish (or a
//! touch) walks: when it was last walked plus its class's *bonus*, never before the latest
//! entry of its class (a reused one: of any class). A request's last stored block is placed
//! like its other new blocks: vLLM stores whole blocks only, and the next turn reads the last
//! one (rule U3, which evicted it first, is retired; docs/performance.md measures why). The
//! reused class's bonus starts at two turnovers of the cache (`2 × capacity` ticks; chosen
//! on generated multi-turn traces, the bench's workload and Mooncake's synthetic trace,
//! docs/performance.md), the new classes' at 0, and all adapt (U9): victims that come back soon
//! after their eviction tell which class needed more room. A victim of a class back lengthens
//! that class's bonus by a step weighed by one over its class's share of the recent victims,
//! and every class's shortens by a fifth of the step, so the classes settle where a victim of
//! any of them is about as likely to come back soon. A new class passing the reused one takes
//! it along. How much likelier a reused block is to return than a new one differs between
//! workloads: on Mooncake's conversation trace a fixed four turnovers fell below LRU at 10 %
//! capacity (0.2706 against 0.2789); adapted, 0.2910.
//!
//! Victims are taken in due order. A request walks its keys tail to head, its new blocks
//! share one class, a block walked after a reused one is reused too, and a reused entry is
//! never due before the latest entry of any class: so once every request holding a
//! block has finished, its ancestors are never due before it, and eviction takes a prefix's
//! deepest blocks first (unless those cannot be evicted: pinned or protected) rather than
//! strand a block behind a missing parent (lookups stop at the first miss).
//!
//! Which blocks came back after an eviction is remembered by a *ghost* of two generations:
//! keys evicted go into the current one unless either holds them; when the current one has
//! taken `4 × capacity` keys, the older is forgotten and a new one starts, so the ghost holds
//! the last 4 to 8 capacities of distinct evicted keys (more than the two turnovers the
//! bonus starts at). Each generation is a blocked Bloom filter (24 bits per key, 6 bits set
//! in one 64-byte block): a false positive makes a new block look reused, so it stays a bonus longer
//! and crowds out others (or, when a key is evicted, keeps it out of the current generation).
//! That is costly enough on multi-turn traffic (at 10 bits per key, about 1 % false
//! positives, the Mooncake synthetic trace kept a third of the policy's gain at 5 % capacity:
//! 0.1593 against 0.1652, LRU 0.1566) that the filters are sized for about one
//! false positive in 7,000 lookups of a full generation. They never hold fewer than 4,096
//! bits, so a small cache (a few dozen keys) practically never sees one. The recent victims of
//! U9 are filters of the same kind. A filter's two generations sit side by side, block by
//! block, in one aligned pair of cache lines: a lookup asks both, and the policy's cost is
//! mostly these lookups' cache misses.
//!
//! A head start pays only while the blocks it keeps may still come back (U10). One key in
//! 16 (by its hash) is sampled: a direct-mapped table of `capacity` positions remembers a
//! sampled key's last walk, and each walk that finds it there counts the gap in a histogram
//! of 8 buckets an octave. The 95th percentile of those gaps is the workload's *return
//! horizon*, in ticks: how long after its last walk a block is still likely to be read.
//! An entry idle past it goes before any other, the longest idle first. The horizon is a
//! property of the traffic (how long people pause), not of the cache, so it binds where
//! the cache is large: on Mooncake's conversation trace, at 20 % capacity, the bonuses kept
//! blocks of conversations long over while LRU kept almost every block that came back
//! (0.970× LRU before U10, 1.003× with it); at 5 % the horizon lies beyond what any bonus
//! keeps and changes little (docs/performance.md).
//!
//! Each class is an intrusive list in due order (and so in the order its entries were
//! placed), so every operation is O(1) but `select`, which merges the five lists' heads.
//! Metadata: 16 bytes per entry (links and due), 8 of when it was placed (U10),
//! 2 × 4 × 24 bits = 24 bytes of ghost per block of capacity, up to 18 bytes of recent
//! victims (2 generations × 5 classes × 24 bits × three fifths of a capacity), and 16 bytes of
//! sampled walks (a tag and a tick per block of capacity, allocated at the first sampled
//! key), beside a histogram of 1.5 KiB whatever the capacity.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use super::{EvictionPolicy, Lists, Run, Use};
use crate::config::{MAX_HORIZON_MIN_GAPS, ReturnHorizon};
use crate::key::Key;

/// Blocks reused, or back after an eviction.
const REUSED: usize = 0;
/// The first class of blocks seen by one request only; one class per request length (U4).
const NEW: usize = 1;
/// Classes of new blocks, by the length of the request that stored them.
const NEW_CLASSES: usize = 4;
/// Every class: reused, and the new ones.
const CLASSES: usize = NEW + NEW_CLASSES;
/// The shortest request, in blocks, of each new class after the first: requests of 1–3,
/// 4–15, 16–63 and 64 or more blocks (powers of four).
const NEW_CLASS_LENGTHS: [usize; NEW_CLASSES - 1] = [4, 16, 64];
/// Each class's name in canonical forms.
const CLASS_NAMES: [&str; CLASSES] = ["r", "n0", "n1", "n2", "n3"];
/// The new class of a block inserted before its request finishes: the longest requests'
/// (U1; the finish, U4, gives it its request's).
const NEW_UNFINISHED: usize = CLASSES - 1;

/// How many cache turnovers (capacity ticks) a reused block outlives a new one at first
/// (U2, U4); U9 then adapts it, and the bonuses of the new classes, which start at 0.
pub const REUSE_BONUS_TURNOVERS: u64 = 2;
/// How many capacities of evicted keys a ghost generation takes (U6): the ghost remembers
/// between one and two times this many.
pub const GHOST_GENERATION_CAPACITIES: usize = 4;
/// No class's bonus exceeds this many turnovers (U9).
pub const MAX_BONUS_TURNOVERS: u64 = 8;
/// U10: the percentile of the sampled return gaps that sets the horizon.
pub const HORIZON_PERCENTILE: u64 = 95;
/// U10: the gap counts are halved when they reach this many, so that the horizon follows
/// the workload.
const HORIZON_HALVE_AT: u32 = 4096;
/// U10: the gap histogram's last bucket, of gaps of `2^48` ticks or more (8 buckets an
/// octave below it).
const GAP_OVERFLOW: usize = 48 * 8;
/// U10: the fewest entries of the table of sampled keys' last walks.
const MIN_GAP_TABLE: usize = 64;

/// The new class of a block a request of `length` keys stored (U4).
fn new_class(length: usize) -> usize {
    NEW + NEW_CLASS_LENGTHS.iter().filter(|&&l| length >= l).count()
}

/// The reuse-aware LRU over resident ids.
#[derive(Clone, Debug)]
pub struct ReusePolicy {
    /// One list per class, each in due order.
    lists: Lists<CLASSES>,
    /// The due time of every id in `lists`, and when it was placed (U10), side by side.
    times: Vec<Times>,
    clock: u64,
    /// How long each class's blocks outlive the clock, in ticks. Reused:
    /// `REUSE_BONUS_TURNOVERS × capacity` at first, new: 0; then adapted (U9) within
    /// `0..=MAX_BONUS_TURNOVERS × capacity`, a new class's never above the reused one's.
    bonus: [u64; CLASSES],
    /// U9: the steps' remainder, in fifths of a tick, not yet taken from every class.
    fifths: u64,
    /// The capacity the policy was made for.
    capacity: u64,
    /// The new class of the request finishing (U4: by its length).
    finishing: usize,
    /// The finishing request's walk has placed a key reused (U4: the keys after it, its
    /// ancestors, are reused too).
    walked_reused: bool,
    ghost: Ghost,
    /// The last victims and their classes, for U9.
    recent: Recent,
    /// The workload's return horizon (U10).
    horizon: Horizon,
    /// Entries evicted while idle past the horizon (U10), since the policy was made.
    evicted_past_horizon: u64,
}

/// An entry's due time (U4, U9) and the clock when it was placed (U10): read together when
/// victims are chosen, so kept in one place.
#[derive(Clone, Copy, Debug, Default)]
struct Times {
    due: u64,
    last: u64,
}

/// U10: the workload's return horizon, learned from a sample of the keys walked: how long
/// after its last walk a key is still likely to come back. A bonus keeps a block past it
/// for nothing (the blocks that come back have come back), so an entry idle for longer goes
/// before any other.
#[derive(Clone, Debug)]
struct Horizon {
    /// Direct-mapped by a sampled key's hash: its tag (0: none) and the clock at its last
    /// walk; empty until the first sampled key.
    walks: Vec<Walk>,
    /// Entries of the table: the capacity, at least [`MIN_GAP_TABLE`].
    len: usize,
    /// A key is sampled when its hash has no bit of this mask set (one in `sample`, a power
    /// of two; `None`: U10 off); gaps needed before there is a horizon.
    sample: Option<u64>,
    min_gaps: u32,
    /// Sampled return gaps, 8 buckets an octave ([`gap_bucket`]).
    counts: Vec<u32>,
    /// Their sum.
    total: u32,
    /// The bucket the percentile was last found in, and the counts below it (kept as gaps
    /// are counted, so that finding the percentile again moves from there, not from 0).
    at: usize,
    below_at: u32,
    /// Idle ticks past which an entry is expired (`u64::MAX`: none yet, or beyond the
    /// histogram).
    ticks_past: u64,
}

/// U10: a sampled key's last walk in the table: its tag (0: none) and the clock then, in one
/// place (one cache line touched).
#[derive(Clone, Copy, Debug, Default)]
struct Walk {
    tag: u32,
    tick: u64,
}

/// U10: the histogram bucket of a gap of `gap ≥ 1` ticks: `8·⌊log2 gap⌋` plus the three bits
/// after the leading one, at most [`GAP_OVERFLOW`].
fn gap_bucket(gap: u64) -> usize {
    let l = 63 - gap.max(1).leading_zeros() as usize;
    let frac = if l >= 3 {
        (gap >> (l - 3)) & 7
    } else {
        (gap << (3 - l)) & 7
    };
    (8 * l + frac as usize).min(GAP_OVERFLOW)
}

/// U10: the upper end of bucket `b < GAP_OVERFLOW`, `⌊2^l · (9 + f) / 8⌋` with `l = b / 8` and
/// `f = b % 8`: the horizon a percentile in it gives.
fn bucket_end(b: usize) -> u64 {
    let (l, f) = (b / 8, (b % 8) as u64);
    ((1u64 << l) * (9 + f)) / 8
}

impl Horizon {
    /// A horizon learned as `config` says: its sample rounded up to a power of two and its
    /// `min_gaps` held within `1..=MAX_HORIZON_MIN_GAPS` (what `Config::validate` asks).
    fn new(capacity: usize, config: Option<ReturnHorizon>) -> Self {
        Horizon {
            walks: Vec::new(),
            len: capacity.max(MIN_GAP_TABLE),
            sample: config.map(|c| u64::from(c.sample.max(1)).next_power_of_two() - 1),
            min_gaps: config.map_or(u32::MAX, |c| c.min_gaps.clamp(1, MAX_HORIZON_MIN_GAPS)),
            // The histogram is small (1.5 KiB) and wanted by every sampled return: made here.
            counts: if config.is_some() {
                alloc::vec![0; GAP_OVERFLOW + 1]
            } else {
                Vec::new()
            },
            total: 0,
            at: 0,
            below_at: 0,
            ticks_past: u64::MAX,
        }
    }

    /// U10: `key` walked at `clock`: if it is sampled and the table holds its last walk,
    /// the gap is counted; then the table holds this walk.
    fn walked(&mut self, key: &Key, clock: u64) {
        let h = key.hash64();
        // A power of two: a mask, not a division, on every walked key.
        if self.sample.is_none_or(|mask| h & mask != 0) {
            return;
        }
        if self.walks.is_empty() {
            self.walks.resize(self.len, Walk::default());
        }
        let i = ((h >> 32) % self.len as u64) as usize;
        let tag = (h >> 8) as u32 | 1;
        let walk = &mut self.walks[i];
        let before = core::mem::replace(walk, Walk { tag, tick: clock });
        if before.tag == tag {
            self.count(clock - before.tick);
        }
    }

    /// U10: one gap counted; the counts halved at [`HORIZON_HALVE_AT`]; the horizon is the
    /// upper end of the bucket of the [`HORIZON_PERCENTILE`]th percentile once `min_gaps`
    /// are counted (none while it is the last bucket).
    fn count(&mut self, gap: u64) {
        let g = gap_bucket(gap);
        self.counts[g] += 1;
        self.total += 1;
        if g < self.at {
            self.below_at += 1;
        }
        if self.total == HORIZON_HALVE_AT {
            for c in &mut self.counts {
                *c /= 2;
            }
            self.total = self.counts.iter().sum();
            self.below_at = self.counts[..self.at].iter().sum();
        }
        if self.total < self.min_gaps {
            return;
        }
        // The percentile's bucket: the first whose counts up to and including it pass
        // `below`. Each gap moves `below` and the counts by one, so the bucket moves little:
        // down while the counts below it pass `below`, up while its own do not.
        let below = u64::from(self.total) * HORIZON_PERCENTILE / 100;
        while self.at > 0 && u64::from(self.below_at) > below {
            self.at -= 1;
            self.below_at -= self.counts[self.at];
        }
        while self.at < GAP_OVERFLOW && u64::from(self.below_at + self.counts[self.at]) <= below {
            self.below_at += self.counts[self.at];
            self.at += 1;
        }
        self.ticks_past = if self.at >= GAP_OVERFLOW {
            u64::MAX
        } else {
            bucket_end(self.at)
        };
    }
}

/// Bits of a filter block (one cache line).
const BLOCK_BITS: usize = 512;
/// Filter bits per key a generation takes.
const BITS_PER_KEY: usize = 24;
/// Bits set per key, all in one block.
const PROBES: u32 = 6;
/// The fewest blocks of a generation (4,096 bits).
const MIN_BLOCKS: usize = 8;

/// A block of each of a filter's two generations (the ghost's, or a class's recent victims'),
/// side by side in one aligned pair of lines: a lookup asks both generations, and the caches'
/// prefetcher usually fetches two adjacent lines together.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(128))]
struct Pair([Line; 2]);

/// Two generations of one blocked Bloom filter, block by block (`pairs[b].0[g]`: generation
/// `g`'s block `b`); empty until the first key.
#[derive(Clone, Debug, Default)]
struct Generations {
    pairs: Vec<Pair>,
}

impl Generations {
    /// Whether either generation has every bit of a key's probes.
    fn holds(&self, block: usize, bits: &[u32]) -> bool {
        self.pairs
            .get(block)
            .is_some_and(|pair| pair.0.iter().any(|line| line_holds(line, bits)))
    }

    /// Sets a key's probes in generation `g`, first sizing the filter to `blocks`.
    fn set(&mut self, g: usize, blocks: usize, block: usize, bits: &[u32]) {
        if self.pairs.is_empty() {
            self.pairs.resize(blocks, Pair::default());
        }
        filter_set_line(&mut self.pairs[block].0[g], bits);
    }

    /// Clears generation `g`.
    fn clear(&mut self, g: usize) {
        for pair in &mut self.pairs {
            pair.0[g] = Line::default();
        }
    }

    /// Generation `g`'s lines, in block order (none while empty).
    fn generation(&self, g: usize) -> impl Iterator<Item = &Line> {
        self.pairs.iter().map(move |pair| &pair.0[g])
    }

    /// Blocks per generation, 0 while empty.
    fn blocks(&self) -> usize {
        self.pairs.len()
    }
}

/// Two generations of evicted keys (U6), each a blocked Bloom filter.
#[derive(Clone, Debug)]
struct Ghost {
    /// The generations, side by side.
    gens: Generations,
    /// The generation keys go into.
    current: usize,
    /// Keys the current generation has taken.
    taken: usize,
    /// Keys a generation takes before the older is forgotten (0: no ghost).
    limit: usize,
    /// Blocks per generation.
    blocks: usize,
}

/// The block and the bits in it that stand for `key`.
fn probes(key: &Key, blocks: usize) -> (usize, [u32; PROBES as usize]) {
    let h = key.hash64();
    let block = ((u128::from(h) * blocks as u128) >> 64) as usize;
    // A second, independent-looking hash for the bits (a SplitMix64 finish of `h`).
    let mut x = h ^ (h >> 30);
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    let mut bits = [0; PROBES as usize];
    for (i, b) in bits.iter_mut().enumerate() {
        *b = ((x >> (9 * i)) as u32) & (BLOCK_BITS as u32 - 1);
    }
    (block, bits)
}

/// One block of a filter: a cache line, aligned as one, so that a key's probes touch one
/// line of memory (a `Vec<u64>` is aligned to 8 or 16 bytes only, and its 64-byte blocks
/// straddled two lines: a lookup that missed the caches paid two misses).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Line([u64; 8]);

/// Whether `line` has every bit of a key's probes.
fn line_holds(line: &Line, bits: &[u32]) -> bool {
    bits.iter()
        .all(|&b| line.0[(b as usize >> 6) & 7] & (1 << (b & 63)) != 0)
}

/// Sets a key's probes in its block's `line`.
fn filter_set_line(line: &mut Line, bits: &[u32]) {
    for &b in bits {
        line.0[(b as usize >> 6) & 7] |= 1 << (b & 63);
    }
}

/// The bits set in `filter`.
fn filter_bits_set<'a>(filter: impl IntoIterator<Item = &'a Line>) -> u64 {
    filter
        .into_iter()
        .flat_map(|line| line.0)
        .map(|w| u64::from(w.count_ones()))
        .sum()
}

/// Writes `filter`'s nonzero words as `index:bits,` (canonical forms: few in a model's
/// small states).
fn write_filter<'a>(out: &mut String, filter: impl IntoIterator<Item = &'a Line>) {
    let words = filter.into_iter().flat_map(|line| line.0);
    for (w, bits) in words.enumerate().filter(|(_, b)| *b != 0) {
        let _ = write!(out, "{w}:{bits:x},");
    }
}

/// Filter blocks for `keys` keys: 24 bits per key, at least 4,096 bits.
fn filter_blocks(keys: usize) -> usize {
    let bits = keys as u64 * BITS_PER_KEY as u64;
    (bits.div_ceil(BLOCK_BITS as u64) as usize).max(MIN_BLOCKS)
}

/// The fraction of the capacity, in 40ths, each generation of the recent victims takes
/// (U9): the two generations remember the last 60 % to 120 % of a capacity of victims, so a
/// victim that comes back later than a tenth of a capacity still tells of its class (with a
/// window of a tenth of a capacity, Mooncake's synthetic trace fell to 0.985× LRU at 2 %
/// capacity and 0.988× at 5 %; 24 rather than 16 was chosen with the steps' limit,
/// [`MAX_STEP_DIVISOR`], on the means of eight and sixteen namings of the keys:
/// docs/performance.md).
const RECENT_WINDOW_40THS: usize = 24;

/// U9: a step is at most this fraction of a turnover (`capacity / 10` ticks). With a
/// fiftieth, the bonuses followed a change of the traffic five times slower, and more cells
/// of the sweep fell below LRU (docs/performance.md).
const MAX_STEP_DIVISOR: u64 = 10;

/// The last victims of every class (U9), in two generations; each generation is
/// one blocked Bloom filter per class. Unlike the ghost it keeps every victim, repeated or
/// not: it counts victims, not keys.
#[derive(Clone, Debug)]
struct Recent {
    /// One filter per class, its two generations side by side.
    filters: [Generations; CLASSES],
    /// Victims each filter took.
    counts: [[u64; CLASSES]; 2],
    /// The generation victims go into.
    current: usize,
    /// Victims a generation takes before the older is forgotten (0: never adapt).
    limit: u64,
    /// Blocks per filter.
    blocks: usize,
}

impl Recent {
    fn new(capacity: usize) -> Self {
        let limit = (capacity * RECENT_WINDOW_40THS).div_ceil(40);
        Recent {
            filters: Default::default(),
            counts: [[0; CLASSES]; 2],
            current: 0,
            limit: limit as u64,
            blocks: filter_blocks(limit),
        }
    }

    /// U9: remembers a victim of `class`.
    fn push(&mut self, key: &Key, class: usize) {
        if self.limit == 0 {
            return;
        }
        let (block, bits) = probes(key, self.blocks);
        let g = self.current;
        self.filters[class].set(g, self.blocks, block, &bits);
        self.counts[g][class] += 1;
        if self.counts[g].iter().sum::<u64>() == self.limit {
            self.current = 1 - g;
            for f in &mut self.filters {
                f.clear(self.current);
            }
            self.counts[self.current] = [0; CLASSES];
        }
    }

    /// U9: the class a generation remembers `key` as a victim of: reused first, then the
    /// new classes, shortest requests first.
    fn class_of(&self, key: &Key) -> Option<usize> {
        if self.limit == 0 {
            return None;
        }
        let (block, bits) = probes(key, self.blocks);
        (REUSED..CLASSES).find(|&c| self.filters[c].holds(block, &bits))
    }

    /// Victims of `class` both generations hold.
    fn held(&self, class: usize) -> u64 {
        self.counts[0][class] + self.counts[1][class]
    }

    /// Victims both generations hold.
    fn held_all(&self) -> u64 {
        self.counts.iter().flatten().sum()
    }
}

impl Ghost {
    fn new(limit: usize) -> Self {
        Ghost {
            gens: Generations::default(),
            current: 0,
            taken: 0,
            limit,
            blocks: filter_blocks(limit),
        }
    }

    fn contains(&self, key: &Key) -> bool {
        let (block, bits) = probes(key, self.blocks);
        self.gens.holds(block, &bits)
    }

    /// U6: remembers `key` unless a generation holds it; a full generation makes the older
    /// one forgotten and a new one start.
    fn push(&mut self, key: &Key) {
        if self.limit == 0 {
            return;
        }
        let (block, bits) = probes(key, self.blocks);
        if self.gens.holds(block, &bits) {
            return;
        }
        self.gens.set(self.current, self.blocks, block, &bits);
        self.taken += 1;
        if self.taken == self.limit {
            self.current = 1 - self.current;
            self.gens.clear(self.current);
            self.taken = 0;
        }
    }
}

impl ReusePolicy {
    /// An empty policy for a tier of `capacity` entries, with the default return horizon.
    pub fn new(capacity: usize) -> Self {
        Self::with_horizon(capacity, Some(ReturnHorizon::default()))
    }

    /// An empty policy for a tier of `capacity` entries that learns its return horizon
    /// (U10) as `horizon` says (`None`: never). A sample that is not a power of two is
    /// rounded up to one, and `min_gaps` is held within `1..=1,024`: values
    /// [`Config::validate`](crate::Config::validate) refuses.
    pub fn with_horizon(capacity: usize, horizon: Option<ReturnHorizon>) -> Self {
        let mut bonus = [0; CLASSES];
        bonus[REUSED] = REUSE_BONUS_TURNOVERS * capacity as u64;
        ReusePolicy {
            lists: Lists::with_capacity(capacity),
            // Ids are below the capacity: reserved once, not grown by doubling.
            times: Vec::with_capacity(capacity),
            clock: 0,
            bonus,
            fifths: 0,
            capacity: capacity as u64,
            finishing: NEW,
            walked_reused: false,
            ghost: Ghost::new(GHOST_GENERATION_CAPACITIES * capacity),
            recent: Recent::new(capacity),
            horizon: Horizon::new(capacity, horizon),
            evicted_past_horizon: 0,
        }
    }

    /// Entries evicted while idle past the return horizon (U10), since the policy was made:
    /// blocks U10 let go before their due time, or that were due anyway.
    pub fn evicted_past_horizon(&self) -> u64 {
        self.evicted_past_horizon
    }

    /// U9: an inserted key was a recent victim of `class`: that class's bonus lengthens by a
    /// step of `capacity / 500` ticks times the recent victims over those of its class (one
    /// over its class's share), at most `capacity / 10` (a tenth of a turnover) and at
    /// least one tick; then every class's (that one's too) shortens by a fifth of the step
    /// (the remainder carried to the next step), so the classes move against each other; a
    /// new class's that passes the reused one's takes the reused one's with it.
    fn adapt(&mut self, class: usize) {
        let total = self.recent.held_all();
        let own = self.recent.held(class).max(1);
        let step = (self.capacity.saturating_mul(total) / (500 * own))
            .min(self.capacity / MAX_STEP_DIVISOR)
            .max(1);
        let max = MAX_BONUS_TURNOVERS * self.capacity;
        self.bonus[class] = (self.bonus[class] + step).min(max);
        // A fifth of the step (one share per adapted class: the bonuses' sum stays put but for
        // their bounds), the remainder carried to the next (small caches' steps are one tick).
        let fifths = self.fifths + step;
        let shrink = fifths / CLASSES as u64;
        self.fifths = fifths % CLASSES as u64;
        for b in &mut self.bonus {
            *b = b.saturating_sub(shrink);
        }
        // Only `class` can have passed the reused bonus: reused blocks keep up with it.
        self.bonus[REUSED] = self.bonus[REUSED].max(self.bonus[class]);
    }

    /// Places `id` at the end of `class` with due time `due`.
    fn place(&mut self, id: u32, class: usize, due: u64) {
        let i = id as usize;
        if i >= self.times.len() {
            self.times.resize(i + 1, Times::default());
        }
        self.times[i] = Times {
            due,
            last: self.clock,
        };
        self.lists.move_to_back(class, id);
    }

    /// The due time of the last entry of `class`, 0 if none.
    fn latest(&self, class: usize) -> u64 {
        self.lists
            .back(class)
            .map_or(0, |b| self.times[b as usize].due)
    }

    /// U2/U4: a reused block, walked now: due the reused bonus ahead, and never before the
    /// latest entry of any class (U9: a shrinking bonus takes effect as the clock
    /// catches up, and a reused block is never due before a new one placed earlier).
    fn reuse(&mut self, id: u32) {
        let latest = (REUSED..CLASSES).map(|c| self.latest(c)).max().unwrap_or(0);
        self.place(id, REUSED, (self.clock + self.bonus[REUSED]).max(latest));
    }

    /// U1/U4: a new block of `class`, walked now: due its class's bonus ahead, and never
    /// before the latest entry of its class.
    fn place_new(&mut self, id: u32, class: usize) {
        let due = (self.clock + self.bonus[class]).max(self.latest(class));
        self.place(id, class, due);
    }

    /// See `Policy::write_canonical`: the lists in eviction order, each entry with its due
    /// time relative to the clock (with U10 off, times before the clock are all alike to
    /// anything placed later, so they are written as 0: the order keeps their difference;
    /// with U10 on, an entry past the horizon may come back within it when the horizon grows,
    /// and is then merged by its due time again, so the difference is written), then the
    /// ghost's generations.
    pub(crate) fn write_canonical(&self, out: &mut String, name: &dyn Fn(&mut String, u32)) {
        out.push_str("reuse[");
        let mut victims = Vec::new();
        self.select(self.len(), &mut |_| true, &mut victims);
        for id in victims {
            let class = CLASS_NAMES[self.lists.list_of(id).expect("resident")];
            // At or after the clock: entries placed later compare to it (1 + the difference).
            // Before it, with U10 off: below anything placed later (0); with U10 on: the
            // difference, for an expired entry is merged by its due time again when the
            // horizon grows.
            let due = self.times[id as usize].due;
            let rel = if due >= self.clock {
                (1 + due - self.clock) as i128
            } else if self.horizon.sample.is_some() {
                due as i128 - self.clock as i128
            } else {
                0
            };
            name(out, id);
            let _ = write!(out, "/{class}{rel}");
            // U10: how long it has been idle (never compared while U10 is off).
            if self.horizon.sample.is_some() {
                let _ = write!(out, "@{}", self.clock - self.times[id as usize].last);
            }
            out.push(',');
        }
        // The ghost: which generation is current, how many keys it took, and each
        // generation's set bits (few in a model's small states).
        let _ = write!(out, "|ghost{}/{}", self.ghost.current, self.ghost.taken);
        for g in 0..2 {
            out.push(';');
            write_filter(out, self.ghost.gens.generation(g));
        }
        // U9: the bonuses, then the recent victims: the current generation, each filter's
        // count and set bits.
        let r = &self.recent;
        let _ = write!(
            out,
            "|bonus{:?}/{}|recent{}",
            &self.bonus, self.fifths, r.current
        );
        for (g, counts) in r.counts.iter().enumerate() {
            for (filter, count) in r.filters.iter().zip(counts) {
                let _ = write!(out, ";{count}:");
                write_filter(out, filter.generation(g));
            }
        }
        // U10: the horizon, the gap counts, and the table's sampled walks (ages).
        let h = &self.horizon;
        let _ = write!(out, "|horizon{}/{}", h.ticks_past, h.total);
        for (b, c) in h.counts.iter().enumerate().filter(|(_, c)| **c != 0) {
            let _ = write!(out, ";{b}:{c}");
        }
        out.push('|');
        for (i, w) in h.walks.iter().enumerate().filter(|(_, w)| w.tag != 0) {
            let _ = write!(out, "{i}:{:x}@{},", w.tag, self.clock - w.tick);
        }
        out.push(']');
    }
}

impl EvictionPolicy for ReusePolicy {
    fn insert(&mut self, id: u32, key: &Key) {
        if let Some(class) = self.recent.class_of(key) {
            self.adapt(class); // U9
        }
        // U1: a block back after an eviction is reused at once; any other starts new, in the
        // longest requests' class until its request finishes.
        if self.ghost.contains(key) {
            self.reuse(id);
        } else {
            self.place_new(id, NEW_UNFINISHED);
        }
    }

    fn open_run(&mut self) -> Option<Run> {
        // No ranks, but the accesses of U8 (the primary passes them within a run).
        Some(Run {
            sentinel: u32::MAX,
            rank: 0,
        })
    }

    fn access(&mut self, id: u32, _run: Run, _position: u64, _key_of: &dyn Fn(u32) -> Key) {
        // U8: a request is reading the block, so it is reused now: it outlives the request's
        // own stores, which evict before the request finishes.
        self.reuse(id);
    }

    fn begin_finish(&mut self, keys: usize) {
        self.finishing = new_class(keys);
        self.walked_reused = false;
    }

    fn finish(&mut self, key: &Key, resident: Option<u32>, used: Use) {
        self.clock += 1; // U4: every walked key ticks
        self.horizon.walked(key, self.clock); // U10
        let Some(id) = resident else {
            return;
        };
        match used {
            // A stored block is new unless it is reused already or a block walked before it
            // (a descendant) was placed reused: then it is reused too, so that it is not due
            // before that descendant.
            Use::Inserted if !self.walked_reused && self.lists.list_of(id) != Some(REUSED) => {
                self.place_new(id, self.finishing);
            }
            _ => {
                self.reuse(id);
                self.walked_reused = true;
            }
        }
    }

    fn touch(&mut self, key: &Key, resident: Option<(u32, bool)>) {
        self.clock += 1; // U2
        self.horizon.walked(key, self.clock); // U10
        if let Some((id, _)) = resident {
            self.reuse(id);
        }
    }

    fn remove(&mut self, id: u32) {
        self.lists.remove(id); // U7: no ghost
    }

    fn select(&self, n: usize, eligible: &mut dyn FnMut(u32) -> bool, out: &mut Vec<u32>) {
        // U5: the classes merged by due time: on a tie new before reused, the shorter
        // requests' class first.
        let mut found = 0;
        if n == 0 {
            return;
        }
        let mut heads: [Option<u32>; CLASSES] = core::array::from_fn(|c| self.lists.front(c));
        // U10: a head idle past the horizon goes first (placed before `expired_before`).
        let mut expired_before = self.clock.saturating_sub(self.horizon.ticks_past);
        if crate::mutant::active("no_return_horizon") {
            expired_before = 0;
        }
        let expiring = expired_before > 0;
        loop {
            // One pass over the heads: the longest idle past the horizon, and the first due.
            let mut expired: Option<(u64, usize)> = None;
            let mut due_first: Option<(u64, usize)> = None;
            // On a tie the first class tried wins: the new ones in order, then reused.
            for class in (NEW..CLASSES).chain([REUSED]) {
                if let Some(id) = heads[class] {
                    let t = self.times[id as usize];
                    if expiring
                        && t.last < expired_before
                        && expired.is_none_or(|(l, _)| t.last < l)
                    {
                        expired = Some((t.last, class));
                    }
                    if due_first.is_none_or(|(d, _)| t.due < d) {
                        due_first = Some((t.due, class));
                    }
                }
            }
            let best = expired.or(due_first);
            let Some((_, class)) = best else {
                return;
            };
            let id = heads[class].expect("a head");
            heads[class] = self.lists.next(id);
            if eligible(id) {
                out.push(id);
                found += 1;
                if found == n {
                    return;
                }
            }
        }
    }

    fn evict(&mut self, id: u32, key: &Key) {
        if let Some(class) = self.lists.remove(id) {
            let idle = self.clock - self.times[id as usize].last;
            if idle > self.horizon.ticks_past {
                self.evicted_past_horizon += 1;
            }
            self.recent.push(key, class); // U9
            self.ghost.push(key); // U6
        }
    }

    fn contains(&self, id: u32) -> bool {
        self.lists.list_of(id).is_some()
    }

    fn len(&self) -> usize {
        (0..CLASSES).map(|c| self.lists.len(c)).sum()
    }

    fn check(&self) -> Result<(), String> {
        self.lists.check()?;
        let max = MAX_BONUS_TURNOVERS * self.capacity;
        for class in 0..CLASSES {
            let mut last = 0;
            let mut last_placed = 0;
            for id in self.lists.iter(class) {
                let due = self.times[id as usize].due;
                if due < last {
                    return Err(format!("class {class}: id {id} due before its predecessor"));
                }
                if due > self.clock + max {
                    return Err(format!("id {id} due after the clock's reach"));
                }
                let placed = self.times[id as usize].last;
                if placed > self.clock || placed < last_placed {
                    return Err(format!(
                        "class {class}: id {id} placed at {placed}, before its predecessor \
                         ({last_placed}) or after the clock"
                    ));
                }
                last_placed = placed;
                last = due;
            }
        }
        let g = &self.ghost;
        let blocks = g.blocks;
        if g.current > 1
            || (g.limit > 0 && g.taken >= g.limit)
            || (g.gens.blocks() != 0 && g.gens.blocks() != blocks)
        {
            return Err(format!(
                "ghost: generation {}, {} taken of {}, {} blocks of {blocks}",
                g.current,
                g.taken,
                g.limit,
                g.gens.blocks()
            ));
        }
        let r = &self.recent;
        let blocks = r.blocks;
        let bits_ok = r
            .filters
            .iter()
            .all(|f| f.blocks() == 0 || f.blocks() == blocks)
            && r.counts.iter().enumerate().all(|(g, counts)| {
                r.filters
                    .iter()
                    .zip(counts)
                    .all(|(f, &n)| filter_bits_set(f.generation(g)) <= n * u64::from(PROBES))
            });
        let full = |g: usize| r.counts[g].iter().sum::<u64>();
        let reused = self.bonus[REUSED];
        if self.fifths >= CLASSES as u64
            || reused > max
            || self.bonus[NEW..].iter().any(|&b| b > reused)
            || r.current > 1
            || (r.limit > 0 && (full(r.current) >= r.limit || full(1 - r.current) > r.limit))
            || !bits_ok
        {
            return Err(format!(
                "bonuses {:?} and {} fifths (reused at most {max}, new at most reused); recent generation {}, counts {:?} of {}, bits fit: {bits_ok}",
                self.bonus, self.fifths, r.current, r.counts, r.limit
            ));
        }
        let h = &self.horizon;
        if h.counts.iter().sum::<u32>() != h.total
            || h.total >= HORIZON_HALVE_AT
            || h.walks.iter().any(|w| w.tick > self.clock)
            || (h.total < h.min_gaps && h.ticks_past != u64::MAX)
        {
            return Err(format!(
                "horizon: {} gaps counted, {} in the buckets, horizon {}",
                h.total,
                h.counts.iter().sum::<u32>(),
                h.ticks_past
            ));
        }
        let set = filter_bits_set(g.gens.generation(g.current));
        if set > g.taken as u64 * u64::from(PROBES) {
            return Err(format!(
                "ghost: {set} bits set by {} keys of {PROBES} bits",
                g.taken
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> Key {
        Key::from([i])
    }

    fn order(p: &ReusePolicy) -> Vec<u32> {
        let mut out = Vec::new();
        p.select(p.len(), &mut |_| true, &mut out);
        out
    }

    /// A request's finish, keys head to tail, all resident with ids = key bytes.
    fn finish(p: &mut ReusePolicy, head_to_tail: &[(u8, Use)]) {
        p.begin_finish(head_to_tail.len());
        for &(i, used) in head_to_tail.iter().rev() {
            p.finish(&k(i), Some(u32::from(i)), used);
        }
        p.check().unwrap();
    }

    /// U4, U5: new blocks go deepest first, the tail with them (U3 retired); reused blocks
    /// outlive new ones walked later.
    #[test]
    fn new_blocks_go_deepest_first_reused_blocks_last() {
        let mut p = ReusePolicy::new(4);
        for i in 0..3 {
            p.insert(u32::from(i), &k(i));
        }
        finish(
            &mut p,
            &[(0, Use::Inserted), (1, Use::Inserted), (2, Use::Inserted)],
        );
        assert_eq!(
            p.lists.list_of(2),
            Some(NEW),
            "the tail is new like the others"
        );
        assert_eq!(order(&p), [2, 1, 0], "deepest first");
        // A second request reuses 0, promotes 1 back from a tier (read back: reused too) and
        // stores 3 (its tail).
        p.insert(3, &k(3));
        finish(
            &mut p,
            &[(0, Use::Reused), (1, Use::Promoted), (3, Use::Inserted)],
        );
        assert_eq!(p.lists.list_of(3), Some(NEW));
        assert_eq!(order(&p), [2, 3, 1, 0], "new oldest first, reused last");
    }

    /// U1, U6: a block back after an eviction starts reused; one removed leaves no ghost.
    #[test]
    fn ghosts_remember_evictions_not_removals() {
        let mut p = ReusePolicy::new(2);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.evict(0, &k(0));
        p.remove(1);
        p.check().unwrap();
        // U9: the victim is remembered with its class; the removal is not a victim.
        assert_eq!(p.recent.held(NEW_UNFINISHED), 1);
        assert_eq!(p.recent.held_all(), 1);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        assert_eq!(p.lists.list_of(0), Some(REUSED));
        assert_eq!(p.lists.list_of(1), Some(NEW_UNFINISHED));
        assert_eq!(order(&p), [1, 0]);
    }

    /// U6: a generation takes `4 × capacity` distinct keys; then the older is forgotten.
    #[test]
    fn the_ghost_forgets_its_older_generation() {
        let mut p = ReusePolicy::new(1);
        let evict = |p: &mut ReusePolicy, i: u8| {
            p.insert(0, &k(i));
            p.evict(0, &k(i));
            p.evict(0, &k(i)); // not resident any more: no second ghost
            p.check().unwrap();
        };
        for i in 0..4u8 {
            evict(&mut p, i);
        }
        assert_eq!(
            (p.ghost.current, p.ghost.taken),
            (1, 0),
            "the first one is full"
        );
        evict(&mut p, 0); // held by the older generation: not taken again
        assert_eq!(p.ghost.taken, 0);
        for i in 4..8u8 {
            evict(&mut p, i);
        }
        assert_eq!((p.ghost.current, p.ghost.taken), (0, 0));
        assert!(
            (0..4).all(|i| !p.ghost.contains(&k(i))),
            "keys 0..4 forgotten"
        );
        assert!((4..8).all(|i| p.ghost.contains(&k(i))), "keys 4..8 held");
    }

    /// U1, U4: a new block waits in the longest requests' class until its request
    /// finishes, then takes the class of its request's length (1–3, 4–15, 16–63, 64+).
    #[test]
    fn new_blocks_take_their_request_length_class() {
        for (keys, class) in [
            (1, NEW),
            (3, NEW),
            (4, NEW + 1),
            (15, NEW + 1),
            (16, NEW + 2),
        ]
        .into_iter()
        .chain([(63, NEW + 2), (64, NEW + 3), (1000, NEW + 3)])
        {
            let mut p = ReusePolicy::new(4);
            p.insert(0, &k(0));
            p.insert(1, &k(1));
            assert_eq!(p.lists.list_of(0), Some(NEW_UNFINISHED));
            p.begin_finish(keys);
            p.finish(&k(1), Some(1), Use::Inserted); // the tail: new like the others
            p.finish(&k(0), Some(0), Use::Inserted);
            for id in [0, 1] {
                assert_eq!(p.lists.list_of(id), Some(class), "a request of {keys} keys");
            }
            // Placed by the finish, tail first (inserted with due 0, the longest requests'
            // class alike: without the finish, 64 keys or more would pass unplaced).
            assert_eq!(
                (p.times[1].due, p.times[0].due),
                (1, 2),
                "a request of {keys} keys"
            );
            p.check().unwrap();
        }
    }

    /// U9: a victim of a class coming back lengthens that class's bonus by `capacity / 500`
    /// times the victims over its class's, within `1..=capacity / 10`, then shortens every
    /// class's by a fifth of that; a key held as both counts as reused; the older generation
    /// is forgotten.
    #[test]
    fn recent_victims_adapt_the_bonuses() {
        let kk = |i: u16| Key::from(i.to_le_bytes());
        let mut p = ReusePolicy::new(1000); // generations of 600 victims, steps of at most 100
        let start = REUSE_BONUS_TURNOVERS * 1000;
        let bonuses = |p: &ReusePolicy| p.bonus[REUSED..].to_vec();
        for i in 10..14 {
            p.recent.push(&kk(i), NEW + 1);
        }
        p.recent.push(&kk(20), REUSED);
        p.insert(0, &kk(20)); // 5 victims, 1 reused: + 1000 × 5 / 500 = 10, all − 2
        assert_eq!(bonuses(&p), [start + 8, 0, 0, 0, 0]);
        p.insert(1, &kk(10)); // 4 of the class: + 1000 × 5 / (500 × 4) = 2, all − 0
        assert_eq!(bonuses(&p), [start + 8, 0, 2, 0, 0]);
        for i in 30..70 {
            p.recent.push(&kk(i), NEW);
        }
        p.insert(2, &kk(20)); // 45 victims, 1 reused: + 90; all − 18 (2 fifths carried)
        assert_eq!(bonuses(&p), [start + 80, 0, 0, 0, 0]);
        p.recent.push(&kk(10), REUSED); // 10 is now held as both: reused first
        p.insert(3, &kk(10)); // 46 victims, 2 reused: + 46; all − 9 (3 fifths carried)
        assert_eq!(bonuses(&p), [start + 117, 0, 0, 0, 0]);
        p.insert(4, &kk(99)); // never a victim
        assert_eq!(bonuses(&p), [start + 117, 0, 0, 0, 0]);
        // 46 victims so far: 554 more fill the generation, 600 more the next, which forgets
        // the first.
        for i in 100..654 {
            p.recent.push(&kk(i), NEW + 2);
        }
        assert_eq!((p.recent.current, p.recent.held_all()), (1, 600));
        p.insert(5, &kk(20)); // still held by the older generation: + 600, at most 100; − 20
        assert_eq!(bonuses(&p), [start + 197, 0, 0, 0, 0]);
        for i in 700..1300 {
            p.recent.push(&kk(i), NEW + 3);
        }
        assert_eq!((p.recent.current, p.recent.held(REUSED)), (0, 0));
        p.insert(6, &kk(20));
        assert_eq!(bonuses(&p), [start + 197, 0, 0, 0, 0], "forgotten");
        p.check().unwrap();
    }

    /// U9: a small cache's steps are one tick; the fifths taken from every class add up
    /// over five of them.
    #[test]
    fn fifths_of_small_steps_add_up() {
        let mut p = ReusePolicy::new(10); // 20 ticks of reused bonus, 6 victims a generation
        for i in 0..5u8 {
            p.recent.push(&k(i), NEW);
            p.insert(u32::from(i), &k(i));
            assert_eq!(p.fifths, u64::from(i + 1) % 5);
        }
        assert_eq!(p.bonus[REUSED..], [19, 4, 0, 0, 0]);
        p.check().unwrap();
    }

    /// U9: a new class's bonus passing the reused one's takes it along.
    #[test]
    fn a_new_class_never_outlives_reused_blocks() {
        let kk = |i: u16| Key::from(i.to_le_bytes());
        let mut p = ReusePolicy::new(1000);
        p.bonus[REUSED] = 5;
        for i in 0..20 {
            p.recent.push(&kk(i), NEW + 3);
        }
        p.recent.push(&kk(100), NEW);
        p.insert(0, &kk(100)); // + min(1000 × 21 / 500, 100) = 42, all − 8: 34, reused 0 → 34
        assert_eq!(p.bonus[REUSED..], [34, 34, 0, 0, 0]);
        p.check().unwrap();
    }

    /// U4: a stored block walked after one placed reused (its descendant, back after an
    /// eviction) is reused too, so that it is not due before it; a stored tail back after an
    /// eviction is reused, and so are the blocks after it.
    #[test]
    fn ancestors_of_a_reused_block_are_reused() {
        let mut p = ReusePolicy::new(4);
        p.insert(1, &k(1));
        p.evict(1, &k(1)); // 1 is in the ghost
        for i in 0..3 {
            p.insert(u32::from(i), &k(i));
        }
        finish(
            &mut p,
            &[(0, Use::Inserted), (1, Use::Inserted), (2, Use::Inserted)],
        );
        let classes = |p: &ReusePolicy| [0, 1, 2].map(|i| p.lists.list_of(i).expect("held"));
        assert_eq!(classes(&p), [REUSED, REUSED, NEW]);
        assert!(p.times[0].due >= p.times[1].due);
        assert_eq!(order(&p), [2, 1, 0]);
        let mut p = ReusePolicy::new(4);
        p.insert(2, &k(2));
        p.evict(2, &k(2)); // the tail is in the ghost
        for i in 0..3 {
            p.insert(u32::from(i), &k(i));
        }
        finish(
            &mut p,
            &[(0, Use::Inserted), (1, Use::Inserted), (2, Use::Inserted)],
        );
        assert_eq!(classes(&p), [REUSED; 3]);
        assert_eq!(order(&p), [2, 1, 0]);
    }

    /// U2, U9: a shorter bonus places a reused entry no earlier than the latest reused one.
    #[test]
    fn a_shorter_bonus_keeps_the_due_order() {
        let mut p = ReusePolicy::new(4);
        for i in 0..3 {
            p.insert(u32::from(i), &k(i));
        }
        finish(
            &mut p,
            &[(0, Use::Reused), (1, Use::Reused), (2, Use::Inserted)],
        );
        // 0 is the latest reused entry (walked last), 1 the one before it.
        let latest = p.times[0].due;
        assert_eq!(p.lists.back(REUSED), Some(0));
        p.bonus[REUSED] = 0;
        finish(&mut p, &[(1, Use::Reused)]);
        assert!(p.clock < latest);
        assert_eq!(
            p.times[1].due, latest,
            "at the latest reused entry, not at the clock"
        );
        assert_eq!(order(&p), [2, 0, 1]);
    }

    /// U1, U2, U5: a new class's bonus places its blocks ahead of the clock and never before
    /// the class's latest; a reused block is never due before the latest new one; on a tie
    /// the shorter requests' class goes first, reused last.
    #[test]
    fn new_bonuses_keep_every_class_in_order() {
        let mut p = ReusePolicy::new(4); // reused bonus 8
        p.bonus[NEW_UNFINISHED] = 10;
        p.insert(0, &k(0)); // due 0 + 10
        p.bonus[NEW_UNFINISHED] = 0;
        p.insert(1, &k(1)); // due 10, not 0: the class's latest
        assert_eq!((p.times[0].due, p.times[1].due), (10, 10));
        p.bonus[REUSED] = 0;
        p.insert(2, &k(2));
        p.touch(&k(2), Some((2, true))); // clock 1: due 10, the latest new, not 1
        assert_eq!(p.times[2].due, 10);
        p.bonus[REUSED] = 7;
        p.bonus[NEW] = 7;
        p.insert(3, &k(3));
        p.begin_finish(2);
        p.finish(&k(9), None, Use::Inserted); // the last key, not resident: clock 2
        p.finish(&k(3), Some(3), Use::Inserted); // clock 3: requests of 1–3, due 3 + 7
        assert_eq!((p.lists.list_of(3), p.times[3].due), (Some(NEW), 10));
        p.check().unwrap();
        assert_eq!(
            order(&p),
            [3, 0, 1, 2],
            "ties: shortest class first, reused last"
        );
    }

    /// A full generation of a large cache keeps false positives rare (15 in 100,000 measured).
    #[test]
    fn false_positives_are_rare() {
        let mut g = Ghost::new(40_000);
        for i in 0..39_999u32 {
            g.push(&Key::new(&i.to_le_bytes()));
        }
        let fp = (1_000_000..1_100_000u32)
            .filter(|i| g.contains(&Key::new(&i.to_le_bytes())))
            .count();
        assert!(fp < 100, "{fp} false positives in 100,000 lookups"); // 15 measured
    }

    /// U5: only eligible ids, and a merge that keeps due order across the lists.
    #[test]
    fn select_merges_by_due_time() {
        let mut p = ReusePolicy::new(1); // bonus of 2 ticks
        for i in 0..4 {
            p.insert(u32::from(i), &k(i));
        }
        p.touch(&k(0), Some((0, true))); // clock 1, due 3
        for i in 1..4u8 {
            p.finish(&k(i), Some(u32::from(i)), Use::Inserted); // clocks 2..4
        }
        p.clock += 3;
        p.finish(&k(3), Some(3), Use::Inserted); // clock 8: due after 0's
        assert_eq!(order(&p), [1, 2, 0, 3]);
        let mut out = Vec::new();
        p.select(2, &mut |id| id != 1, &mut out);
        assert_eq!(out, [2, 0]);
        // A new block due when a reused one is goes first.
        let mut p = ReusePolicy::new(1);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.touch(&k(0), Some((0, true))); // clock 1, due 3
        p.clock += 1;
        p.finish(&k(1), Some(1), Use::Inserted); // clock 3, due 3
        assert_eq!(order(&p), [1, 0]);
        p.check().unwrap();
    }

    #[test]
    fn check_sees_a_broken_order() {
        let mut p = ReusePolicy::new(4);
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.times[0].due = 3;
        assert!(p.check().is_err());
    }

    /// U10: 8 buckets an octave, each gap below its bucket's upper end, the ends rising.
    #[test]
    fn u10_gap_buckets_and_their_ends() {
        for (gap, bucket) in [
            (1, 0),
            (2, 8),
            (3, 12),
            (8, 24),
            (9, 25),
            (15, 31),
            (16, 32),
        ] {
            assert_eq!(gap_bucket(gap), bucket, "gap {gap}");
        }
        assert_eq!(gap_bucket(1000), 8 * 9 + 7); // 512 + 7 · 64 ≤ 1000 < 1024
        assert_eq!(gap_bucket(u64::MAX), GAP_OVERFLOW);
        let mut end = 0;
        for gap in 1..5000u64 {
            let b = gap_bucket(gap);
            assert!(bucket_end(b) >= gap, "gap {gap} past its bucket's end");
            assert!(bucket_end(b) >= end, "ends fall at {gap}");
            end = bucket_end(b);
        }
    }

    /// U10: a sampled key's gaps are counted once the table holds its last walk; the
    /// horizon is the 95th percentile's bucket end, none before `min_gaps`; counts are halved
    /// at 4,096.
    #[test]
    fn u10_the_horizon_is_a_percentile_of_the_sampled_gaps() {
        let mut h = Horizon::new(
            4,
            Some(ReturnHorizon {
                sample: 1,
                min_gaps: 20,
            }),
        );
        let mut clock = 0;
        let mut walk = |h: &mut Horizon, key: u8, gap: u64| {
            clock += gap;
            h.walked(&k(key), clock);
        };
        walk(&mut h, 0, 1); // the first walk: no gap yet
        assert_eq!(h.total, 0);
        for _ in 0..19 {
            walk(&mut h, 0, 10); // nineteen gaps of 10
        }
        assert_eq!((h.total, h.ticks_past), (19, u64::MAX), "below min_gaps");
        walk(&mut h, 0, 1000); // the twentieth: 95 % of 20 = 19 below it
        assert_eq!(h.total, 20);
        assert_eq!(h.ticks_past, bucket_end(gap_bucket(1000)));
        walk(&mut h, 0, 10); // now 20 of 21 are 10s: the percentile is 10's bucket
        assert_eq!(h.ticks_past, bucket_end(gap_bucket(10)));
        for _ in 0..(HORIZON_HALVE_AT - 22) {
            walk(&mut h, 0, 10);
        }
        assert_eq!(h.total, HORIZON_HALVE_AT - 1);
        walk(&mut h, 0, 10);
        let tens = (HORIZON_HALVE_AT - 1) / 2; // 4,095 tens halved; the one 1000 is gone
        assert_eq!((h.total, h.counts[gap_bucket(10)]), (tens, tens));
        assert_eq!(h.counts[gap_bucket(1000)], 0);
        // Only sampled keys count: with one in 16, keys whose hash is not a multiple of 16
        // never reach the table.
        let mut h = Horizon::new(4, Some(ReturnHorizon::default()));
        let unsampled = (0..=255u8)
            .find(|&i| !k(i).hash64().is_multiple_of(16))
            .expect("a key");
        h.walked(&k(unsampled), 1);
        h.walked(&k(unsampled), 2);
        assert_eq!((h.total, h.walks.len()), (0, 0));
    }

    /// U10: the percentile found from where it was last is the one a scan of every bucket
    /// finds, gap after gap: over gaps spread across the histogram, a shift of the workload
    /// to longer and then shorter gaps, and the halvings at `HORIZON_HALVE_AT`.
    #[test]
    fn u10_the_percentile_kept_as_gaps_come_is_the_scanned_one() {
        let scanned = |h: &Horizon| {
            let below = u64::from(h.total) * HORIZON_PERCENTILE / 100;
            let mut seen = 0;
            let b = h
                .counts
                .iter()
                .position(|&c| {
                    seen += u64::from(c);
                    seen > below
                })
                .unwrap_or(GAP_OVERFLOW);
            if b >= GAP_OVERFLOW {
                u64::MAX
            } else {
                bucket_end(b)
            }
        };
        for min_gaps in [1, 7, 128] {
            let mut h = Horizon::new(
                4,
                Some(ReturnHorizon {
                    sample: 1,
                    min_gaps,
                }),
            );
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            let mut checked = 0;
            for n in 0..3 * HORIZON_HALVE_AT {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Three phases: gaps up to 2^12, then up to 2^40 (past the histogram's end at
                // times), then up to 2^6.
                let bits = match n / HORIZON_HALVE_AT {
                    0 => 12,
                    1 => 40,
                    _ => 6,
                };
                h.count(1 + (x >> (64 - bits)));
                if h.total >= h.min_gaps {
                    assert_eq!(h.ticks_past, scanned(&h), "gap {n}");
                    checked += 1;
                }
            }
            assert!(checked > 2 * HORIZON_HALVE_AT, "{checked}");
        }
    }

    /// U10: a horizon made from values `Config::validate` refuses still samples at a power
    /// of two (rounded up) and counts at least one gap and at most `MAX_HORIZON_MIN_GAPS`.
    #[test]
    fn u10_unchecked_values_are_rounded_into_range() {
        let h = Horizon::new(
            4,
            Some(ReturnHorizon {
                sample: 12,
                min_gaps: 0,
            }),
        );
        assert_eq!((h.sample, h.min_gaps), (Some(15), 1));
        let h = Horizon::new(
            4,
            Some(ReturnHorizon {
                sample: u32::MAX,
                min_gaps: u32::MAX,
            }),
        );
        assert_eq!(
            (h.sample, h.min_gaps),
            (Some((1 << 32) - 1), MAX_HORIZON_MIN_GAPS)
        );
        let h = Horizon::new(4, Some(ReturnHorizon::default()));
        assert_eq!((h.sample, h.min_gaps), (Some(15), 128));
        assert_eq!(
            h.counts.len(),
            GAP_OVERFLOW + 1,
            "the histogram is made at once"
        );
        assert!(Horizon::new(4, None).counts.is_empty(), "none without U10");
    }

    /// U10, U5: an entry idle past the horizon goes before every other, the longest idle
    /// first, whatever its due time; until there is a horizon, due order alone. (The horizon
    /// is set here; the test above learns one.)
    #[test]
    fn u10_an_entry_idle_past_the_horizon_goes_first() {
        // Practically no key is sampled (one in 2^31): the gaps are counted by hand.
        let never = ReturnHorizon {
            sample: 1 << 31,
            min_gaps: 1,
        };
        let mut p = ReusePolicy::with_horizon(4, Some(never));
        p.insert(0, &k(0));
        p.insert(1, &k(1));
        p.touch(&k(0), Some((0, true))); // clock 1: 0 reused, due 1 + 8
        finish(&mut p, &[(1, Use::Inserted)]); // clock 2: 1 new, due 2
        assert_eq!(order(&p), [1, 0], "no horizon: due order");
        p.horizon.count(2);
        assert_eq!(p.horizon.ticks_past, 2);
        p.clock = 5;
        // Entry 0 has been idle 4 ticks and 1 idle 3: both past the horizon, 0 longest.
        assert_eq!(order(&p), [0, 1]);
        finish(&mut p, &[(1, Use::Inserted)]); // clock 6: 1 fresh, due 6
        assert_eq!(order(&p), [0, 1], "0 expired, due after 1");
        p.touch(&k(0), Some((0, true))); // clock 7: 0 fresh, due 7 + 8
        assert_eq!(order(&p), [1, 0], "nothing past the horizon: due order");
        p.clock = 9; // 1 idle 3 (past), 0 idle 2
        assert_eq!(order(&p), [1, 0]);
        p.clock = 11; // 1 idle 5, 0 idle 4: both past, 1 longest
        assert_eq!(order(&p), [1, 0]);
        p.horizon.count(4); // gaps 2 and 4: a horizon of 4, which 0 (idle 4) is not past
        assert_eq!(p.horizon.ticks_past, 4);
        let mut out = Vec::new();
        p.select(1, &mut |id| id != 1, &mut out);
        assert_eq!(out, [0], "an ineligible expired entry is passed over");
        p.check().unwrap();
    }

    /// U10: an eviction counts in `evicted_past_horizon` only when the victim has been idle
    /// for longer than the horizon, whichever order chose it.
    #[test]
    fn u10_evictions_past_the_horizon_are_counted() {
        let never = ReturnHorizon {
            sample: 1 << 31,
            min_gaps: 1,
        };
        let mut p = ReusePolicy::with_horizon(4, Some(never));
        for id in 0..3 {
            p.insert(id, &k(id as u8));
        }
        finish(
            &mut p,
            &[(0, Use::Inserted), (1, Use::Inserted), (2, Use::Inserted)],
        );
        p.clock = 10;
        p.evict(0, &k(0));
        assert_eq!(p.evicted_past_horizon(), 0, "no horizon yet");
        p.horizon.count(4);
        assert_eq!(p.horizon.ticks_past, 4);
        // The walk went tail first: 2 placed at tick 1, 1 at tick 2.
        p.clock = 6;
        p.evict(1, &k(1)); // idle 4
        assert_eq!(p.evicted_past_horizon(), 0, "idle as long as the horizon");
        p.evict(2, &k(2)); // idle 5
        assert_eq!(p.evicted_past_horizon(), 1);
        p.check().unwrap();
    }
}
