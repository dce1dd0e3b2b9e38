//! `Harness`: applies each [`Op`] to the core and to the [`RefModel`] and compares everything
//! observable: answers, errors, effects (jobs and deletions) and events. The core's
//! `check_invariants` runs after every op.

use std::fmt;

use kvtier_core::{
    BlockState, Config, Effect, Error, Event, Job, JobId, JobKind, JobResult, Key, Manager,
    Outcome, PreparedStore, SlotId, TierId, TierKind,
};

use crate::op::{Finish, Invalid, Op, key, keys, request};
use crate::reference::RefModel;

/// A difference between the core and the reference model, or a broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The op that revealed it (its index in the run, and the op).
    pub op: String,
    /// What differed.
    pub what: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "after {}: {}", self.op, self.what)
    }
}

impl std::error::Error for Mismatch {}

/// The core and its reference model side by side, plus the jobs the IO layer owes results.
#[derive(Clone, Debug)]
pub struct Harness {
    /// The real core.
    pub core: Manager,
    /// The reference model.
    pub model: RefModel,
    /// Submitted jobs not yet reported, in submission order.
    pub pending: Vec<Job>,
    /// Jobs reported (for duplicate-result ops).
    reported: Vec<JobId>,
    ops: usize,
}

fn compare<T: PartialEq + fmt::Debug>(what: &str, core: T, model: T) -> Result<T, String> {
    if core == model {
        Ok(core)
    } else {
        Err(format!("{what}: core {core:?}, model {model:?}"))
    }
}

impl Harness {
    /// A harness over a manager built from `config`.
    pub fn new(config: Config) -> Result<Self, kvtier_core::ConfigError> {
        Ok(Harness {
            core: Manager::new(config.clone())?,
            model: RefModel::new(config),
            pending: Vec::new(),
            reported: Vec::new(),
            ops: 0,
        })
    }

    /// Applies `op` to both sides and compares.
    pub fn apply(&mut self, op: &Op) -> Result<(), Mismatch> {
        self.ops += 1;
        let result = self.step(op).and_then(|()| self.compare_outputs());
        result.map_err(|what| Mismatch {
            op: format!("op {} {op:?}", self.ops),
            what,
        })
    }

    /// Applies every op in turn, stopping at the first mismatch.
    pub fn run(&mut self, ops: &[Op]) -> Result<(), Mismatch> {
        ops.iter().try_for_each(|op| self.apply(op))
    }

    fn report(&mut self, job: &Job, outcome: Outcome) -> Result<(), String> {
        let result = JobResult {
            job: job.id,
            outcome,
        };
        compare(
            "handle_job_result",
            self.core.handle_job_result(result.clone()),
            self.model.handle_job_result(result),
        )?
        .map_err(|e| format!("a valid result was refused: {e}"))?;
        self.reported.push(job.id);
        Ok(())
    }

    /// The result `how` gives `job`; `shared` says whether its tier is shared.
    fn outcome(job: &Job, how: Finish, shared: bool) -> Outcome {
        let blocks = job.blocks();
        let bit = |mask: u8, i: usize| mask >> (i % 8) & 1 == 1;
        let keys = |f: &dyn Fn(usize) -> bool| -> Vec<Key> {
            blocks
                .iter()
                .enumerate()
                .filter(|(i, _)| f(*i))
                .map(|(_, b)| b.key.clone())
                .collect()
        };
        let shared_load = shared && matches!(job.kind, JobKind::Load { .. });
        match (how, &job.kind) {
            (Finish::Ok, _) => Outcome::Ok,
            (Finish::Failed, _) => Outcome::Failed,
            (Finish::Partial(mask), JobKind::Store { .. } | JobKind::Load { .. }) => {
                Outcome::partial(keys(&|i| bit(mask, i)))
            }
            (Finish::Partial(_), _) => Outcome::Ok,
            (Finish::NotFound, JobKind::Exists { .. }) => Outcome::NotFound,
            (Finish::NotFound, _) if shared_load => Outcome::NotFound,
            (Finish::NotFound, _) => Outcome::Failed,
            // Set bits: gone from the store; of the others, every second one failed.
            (Finish::Missing(mask), _) if shared_load => Outcome::Partial {
                succeeded: keys(&|i| !bit(mask, i) && i % 2 == 0),
                missing: keys(&|i| bit(mask, i)),
            },
            (Finish::Missing(mask), JobKind::Store { .. } | JobKind::Load { .. }) => {
                Outcome::partial(keys(&|i| !bit(mask, i)))
            }
            (Finish::Missing(_), _) => Outcome::Ok,
        }
    }

    /// A store that fits after evicting every evictable block must succeed, whatever the
    /// policy (rule A6's fallback; P6, P7): after a refusal, fewer blocks than needed are
    /// Ready, unpinned and not offered.
    fn refusal_is_forced(
        core: &Manager,
        offered: &[Key],
        answer: &Result<PreparedStore, Error>,
    ) -> Result<(), String> {
        let Err(Error::NoRoom { needed, .. }) = answer else {
            return Ok(());
        };
        let p = core.primary();
        let evictable = (0..p.num_blocks())
            .filter_map(|s| p.key_at(SlotId(s)))
            .filter(|k| !offered.contains(k))
            .filter(|k| {
                matches!(
                    p.state_of(k),
                    Some((
                        _,
                        BlockState::Ready {
                            load_pins: 0,
                            job_pins: 0
                        }
                    ))
                )
            })
            .count();
        if evictable >= *needed {
            return Err(format!(
                "prepare_store refused {needed} blocks with {evictable} evictable"
            ));
        }
        Ok(())
    }

    /// Checks that a refused call left the core unchanged.
    fn unchanged(before: &str, core: &Manager, what: &str) -> Result<(), String> {
        if before == format!("{core:?}") {
            Ok(())
        } else {
            Err(format!("{what} was refused but changed the state"))
        }
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        let (core, model) = (&mut self.core, &mut self.model);
        match op {
            Op::Lookup { req, key: k } => {
                let (r, k) = (request(*req), key(*k));
                compare("lookup", core.lookup(r, &k), model.lookup(r, &k))?;
            }
            Op::PrepareStore { keys: ks } => {
                let ks = keys(ks);
                let answer = compare(
                    "prepare_store",
                    core.prepare_store(request(0), &ks),
                    model.prepare_store(request(0), &ks),
                )?;
                Self::refusal_is_forced(core, &ks, &answer)?;
            }
            Op::CompleteStore { req, keys: ks, ok } => {
                let ks = keys(ks);
                core.complete_store(request(*req), &ks, *ok);
                model.complete_store(request(*req), &ks, *ok);
            }
            Op::Store { req, keys: ks, ok } => {
                let ks = keys(ks);
                let prepared = compare(
                    "prepare_store",
                    core.prepare_store(request(*req), &ks),
                    model.prepare_store(request(*req), &ks),
                )?;
                Self::refusal_is_forced(core, &ks, &prepared)?;
                if let Ok(p) = prepared {
                    core.complete_store(request(*req), &p.keys, *ok);
                    model.complete_store(request(*req), &p.keys, *ok);
                }
            }
            Op::PrepareLoad { keys: ks } => {
                let ks = keys(ks);
                let _answer = compare(
                    "prepare_load",
                    core.prepare_load(request(0), &ks),
                    model.prepare_load(request(0), &ks),
                )?;
            }
            Op::CompleteLoad { keys: ks } => {
                let ks = keys(ks);
                let before = format!("{core:?}");
                let out = compare(
                    "complete_load",
                    core.complete_load(&ks),
                    model.complete_load(&ks),
                )?;
                if out.is_err() {
                    Self::unchanged(&before, core, "complete_load")?;
                }
            }
            Op::Touch { keys: ks } => {
                let ks = keys(ks);
                core.touch(&ks);
                model.touch(&ks);
            }
            Op::EndStep => {
                core.end_step();
                model.end_step();
            }
            Op::Clock { advance } => {
                let now = core.clock() + u64::from(*advance);
                core.set_clock(now);
                model.set_clock(now);
            }
            Op::Finish { pick, how } => {
                if !self.pending.is_empty() {
                    let job = self.pending.remove(usize::from(*pick) % self.pending.len());
                    let shared =
                        self.core.config().tiers[job.tier.index()].kind == TierKind::Shared;
                    let outcome = Self::outcome(&job, *how, shared);
                    self.report(&job, outcome)?;
                }
            }
            Op::TierDown { tier } => {
                let tier = TierId(u16::from(*tier));
                let (dead, alive): (Vec<Job>, Vec<Job>) =
                    self.pending.drain(..).partition(|j| j.tier == tier);
                self.pending = alive;
                for job in dead {
                    self.report(&job, Outcome::Failed)?;
                }
            }
            Op::Restore { tier, keys: ks } => {
                let tier = TierId(u16::from(*tier));
                let ks = keys(ks);
                let _answer = compare(
                    "restore_tier",
                    core.restore_tier(tier, ks.clone()),
                    model.restore_tier(tier, &ks),
                )?;
            }
            Op::Position { req, key: k, pos } => {
                let (r, k) = (request(*req), key(*k));
                core.set_position(r, &k, 16 * u64::from(*pos));
                model.set_position(r, &k, 16 * u64::from(*pos));
            }
            Op::RequestFinished { req } => {
                core.request_finished(request(*req));
                model.request_finished(request(*req));
            }
            Op::Shutdown => {
                core.shutdown();
                model.shutdown();
                self.pending.clear();
            }
            Op::Invalid { what, arg } => self.invalid(*what, *arg)?,
        }
        Ok(())
    }

    fn invalid(&mut self, what: Invalid, arg: u8) -> Result<(), String> {
        let before = format!("{:?}", self.core);
        let pick = |jobs: &[Job], f: &dyn Fn(&Job) -> bool| {
            jobs.iter()
                .filter(|j| f(j))
                .nth(usize::from(arg) % jobs.len().max(1))
                .cloned()
        };
        let result = match what {
            Invalid::UnknownJob => Some(JobResult {
                job: JobId(u64::MAX - u64::from(arg)),
                outcome: Outcome::Ok,
            }),
            Invalid::DuplicateResult => self
                .reported
                .iter()
                .rev()
                .nth(usize::from(arg) % self.reported.len().max(1))
                .map(|&job| JobResult {
                    job,
                    outcome: Outcome::Failed,
                }),
            Invalid::ForeignKey => {
                pick(&self.pending, &|j| !j.blocks().is_empty()).map(|j| JobResult {
                    job: j.id,
                    outcome: Outcome::partial(vec![Key::from([200u8])]),
                })
            }
            Invalid::WrongOutcome => pick(&self.pending, &|_| true).map(|j| JobResult {
                job: j.id,
                outcome: match &j.kind {
                    JobKind::Exists { .. } | JobKind::Health => Outcome::partial(Vec::new()),
                    JobKind::Store { .. } => Outcome::NotFound,
                    // Read and missing at once: wrong on any tier.
                    JobKind::Load { blocks, .. } => Outcome::Partial {
                        succeeded: vec![blocks[0].key.clone()],
                        missing: vec![blocks[0].key.clone()],
                    },
                },
            }),
            Invalid::UnpinnedLoad => {
                let k = vec![key(arg)];
                let out = compare(
                    "complete_load",
                    self.core.complete_load(&k),
                    self.model.complete_load(&k),
                )?;
                if out.is_err() {
                    Self::unchanged(&before, &self.core, "complete_load")?;
                }
                None
            }
            Invalid::UnknownTier => {
                let tier = TierId(1000 + u16::from(arg));
                let out = compare(
                    "restore_tier",
                    self.core.restore_tier(tier, keys(&[arg])),
                    self.model.restore_tier(tier, &keys(&[arg])),
                )?;
                if out != Err(Error::UnknownTier { tier }) {
                    return Err(format!("restore of {tier} accepted"));
                }
                Self::unchanged(&before, &self.core, "restore_tier")?;
                None
            }
        };
        if let Some(r) = result {
            let out = compare(
                "handle_job_result",
                self.core.handle_job_result(r.clone()),
                self.model.handle_job_result(r.clone()),
            )?;
            if out.is_ok() {
                return Err(format!("invalid result {r:?} accepted"));
            }
            Self::unchanged(&before, &self.core, "handle_job_result")?;
        }
        Ok(())
    }

    /// Effects and events must match; invariants must hold; the jobs the IO layer owes are
    /// those both sides submitted.
    fn compare_outputs(&mut self) -> Result<(), String> {
        let core_effects: Vec<Effect> = std::iter::from_fn(|| self.core.poll_effect()).collect();
        for e in &core_effects {
            if let Effect::Delete { tier, keys } = e
                && self.core.config().tiers[tier.index()].kind == TierKind::Shared
            {
                return Err(format!("T14: {keys:?} deleted from shared {tier}"));
            }
        }
        let effects = compare("effects", core_effects, self.model.take_effects())?;
        let events: Vec<Event> =
            compare("events", self.core.take_events(), self.model.take_events())?;
        drop(events);
        for e in effects {
            if let Effect::Submit(job) = e {
                self.pending.push(job);
            }
        }
        self.core
            .check_invariants()
            .map_err(|v| format!("core invariant: {v}"))?;
        let core_jobs: Vec<JobId> = self.core.outstanding_jobs().map(|j| j.id).collect();
        let model_jobs: Vec<JobId> = self.model.outstanding().map(|j| j.id).collect();
        compare("outstanding jobs", core_jobs, model_jobs)?;
        compare(
            "wait timeouts",
            self.core.stats().wait_timeouts,
            self.model.wait_timeouts(),
        )?;
        Ok(())
    }

    /// Quiescence: reports every job owed as succeeded and ends steps until nothing is
    /// outstanding; then nothing may be Pending, Promoting or pinned except by load pins the
    /// engine still holds.
    pub fn settle(&mut self) -> Result<(), Mismatch> {
        for _ in 0..8 {
            while !self.pending.is_empty() {
                self.apply(&Op::Finish {
                    pick: 0,
                    how: Finish::Ok,
                })?;
            }
            self.apply(&Op::EndStep)?;
            if self.core.outstanding_jobs().next().is_none() {
                break;
            }
        }
        let outstanding: Vec<&Job> = self.core.outstanding_jobs().collect();
        if !outstanding.is_empty() {
            return Err(Mismatch {
                op: "settle".into(),
                what: format!("jobs still outstanding: {outstanding:?}"),
            });
        }
        let stats = self.core.stats();
        if stats.job_pins != 0 || stats.jobs_outstanding != 0 {
            return Err(Mismatch {
                op: "settle".into(),
                what: format!("cascade pins {} left", stats.job_pins),
            });
        }
        Ok(())
    }
}
