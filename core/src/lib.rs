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
//! ```
//! use kvtier_core::{Config, Key, Lookup, Manager, RequestId};
//!
//! let mut m = Manager::new(Config::new(4)).unwrap();
//! let req = RequestId(1);
//! let key = Key::from(*b"block-0");
//! assert_eq!(m.lookup(req, &key), Lookup::Miss);
//! let prepared = m.prepare_store(&[key.clone()]).unwrap();
//! assert_eq!(prepared.slots[0].0, 0);
//! m.complete_store(req, &[key.clone()], true);
//! assert_eq!(m.lookup(req, &key), Lookup::Hit);
//! ```

#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;

mod config;
mod error;
mod event;
mod key;
mod manager;
pub mod policy;
mod primary;
mod stats;
mod table;
mod tier;

pub use config::{
    Config, ConfigError, HealthConfig, MAX_BLOCKS, MAX_TIERS, PolicyKind, ReuseFilter, TierConfig,
    TierKind,
};
pub use error::{Error, Violation};
pub use event::{
    Effect, Event, EventKind, Job, JobKind, JobResult, Lookup, Medium, Outcome, Transfer,
};
pub use key::{JobId, Key, RequestId, SlotId, TierId};
pub use manager::Manager;
pub use primary::{BlockState, PreparedStore, Primary};
pub use stats::{Health, Stats, TierStats};
pub use tier::{EntryState, TierAnswer, TierIndex};
