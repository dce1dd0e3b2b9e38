//! `kvtier-core`: the pure state machine of kvtier, a multi-tier KV-cache offloading engine.
//!
//! The core owns no threads, clocks, files or GPU handles. Inputs come in as calls on a
//! [`Manager`]; everything the outside world must do comes out as data: [`Effect`]s (jobs to
//! run, blocks to delete) and [`Event`]s (what was stored or removed). Time is the step
//! counter advanced by [`Manager::end_step`].
//!
//! The rules are in `docs/state-machine.md`; each is named in the code that implements it and
//! the tests that check it. [`Manager::check_invariants`] checks every invariant by id and runs
//! after every operation in debug builds.
//!
//! A primary of 4 slots and one local file tier, driven by hand (the IO layer's part is
//! played by the loop that answers every job):
//!
//! ```
//! use kvtier_core::{
//!     Config, Effect, JobResult, Key, Lookup, Manager, Outcome, RequestId, TierConfig, TierKind,
//! };
//!
//! let mut config = Config::new(4);
//! config.tiers = vec![TierConfig::new(TierKind::Authoritative, 64)];
//! let mut m = Manager::new(config)?;
//! let req = RequestId(1);
//! let key = Key::new(b"block-0");
//!
//! // Step 0: a miss; the engine stores the block, which cascades to the tier.
//! assert_eq!(m.lookup(req, &key), Lookup::Miss);
//! let prepared = m.prepare_store(req, &[key.clone()])?;
//! assert_eq!(prepared.slots[0].0, 0); // copy GPU -> slot 0, then:
//! m.complete_store(req, &[key.clone()], true);
//! let answer_all = |m: &mut Manager| {
//!     while let Some(effect) = m.poll_effect() {
//!         if let Effect::Submit(job) = effect {
//!             let done = JobResult { job: job.id, outcome: Outcome::Ok };
//!             m.handle_job_result(done).unwrap();
//!         }
//!     }
//! };
//! answer_all(&mut m);
//! m.end_step();
//!
//! // Step 1: four other blocks push it out of the primary; the tier still has it.
//! let others: Vec<Key> = (1..=4u8).map(|i| Key::new(&[i])).collect();
//! m.prepare_store(req, &others)?;
//! m.complete_store(req, &others, true);
//! answer_all(&mut m); // their cascades (pinned until their results are collected)
//! m.end_step();
//!
//! // Step 2: the lookup collects those results, then starts a promotion from the tier.
//! assert_eq!(m.lookup(req, &key), Lookup::HitPending);
//! m.end_step(); // the load job is submitted...
//! answer_all(&mut m); // ...and done
//! m.end_step(); // step 3 had no lookup: end_step collects the result
//!
//! // Step 4: the promoted block is Ready again.
//! assert_eq!(m.lookup(req, &key), Lookup::Hit);
//! # Ok::<(), Box<dyn core::error::Error>>(())
//! ```

#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;

mod config;
mod error;
mod event;
mod hosted;
mod key;
mod manager;
pub mod mutant;
pub mod policy;
mod primary;
mod stats;
mod table;
mod tier;

pub use config::{
    Admission, Config, ConfigError, HealthConfig, MAX_BLOCKS, MAX_HORIZON_MIN_GAPS, MAX_TIERS,
    PolicyKind, ReturnHorizon, ReuseFilter, TierConfig, TierKind,
};
pub use error::{Error, Violation};
pub use event::{
    Effect, Event, EventKind, Job, JobKind, JobResult, Lookup, Medium, Outcome, Transfer,
};
pub use hosted::{HostedConfig, HostedLookup, HostedResult, HostedStats, HostedTier};
pub use key::{JobId, Key, RequestId, SlotId, TierId};
pub use manager::Manager;
pub use primary::{BlockState, Metrics, PreparedStore, Primary};
pub use stats::{Health, Stats, TierStats};
pub use tier::{EntryState, TierAnswer, TierIndex};
