//! Which CPUs the threads kvtier starts inside an engine may run on.
//!
//! A thread starts with the CPU mask of the thread that spawned it. Engines bind their compute
//! threads: vLLM's CPU worker pins the thread that builds kvtier's transfer handler to one
//! core of its OpenMP team, so a copy thread that inherited that mask would share one core
//! with the model's main thread while the other cores idle, and every load would take about
//! twice its memory-bandwidth time. [`Cpus::Any`], the default, undoes that: the thread may
//! run on any CPU the process's cpuset allows (the kernel intersects the mask with it).

use core::fmt;
use core::str::FromStr;

use rustix::thread::{CpuSet, sched_setaffinity};

/// The CPUs a thread may run on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Cpus {
    /// Every CPU the process's cpuset allows (`"any"`).
    #[default]
    Any,
    /// The mask of the thread that starts it, unchanged (`"inherit"`).
    Inherit,
    /// These CPUs (`"2,4-7"`), sorted, without repeats.
    List(Vec<usize>),
}

/// Why a CPU set was not parsed or not applied.
#[derive(Debug, thiserror::Error)]
pub enum AffinityError {
    /// The text is not `any`, `inherit` or a CPU list.
    #[error(
        "{text:?} is not a CPU set: give \"any\", \"inherit\" or a list such as \"2,4-7\" \
         (CPUs below {max})"
    )]
    Parse {
        /// The text given.
        text: String,
        /// The number of CPUs a mask can name.
        max: usize,
    },
    /// The kernel refused the mask: none of its CPUs is online and allowed to this process.
    #[error("cannot run a thread on CPUs {cpus:?}: {source}")]
    Apply {
        /// The CPUs asked for.
        cpus: Vec<usize>,
        /// The kernel's answer.
        source: std::io::Error,
    },
}

impl FromStr for Cpus {
    type Err = AffinityError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || AffinityError::Parse {
            text: text.to_owned(),
            max: CpuSet::MAX_CPU,
        };
        match text.trim() {
            "any" => return Ok(Cpus::Any),
            "inherit" => return Ok(Cpus::Inherit),
            _ => {}
        }
        let cpu = |s: &str| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&c| c < CpuSet::MAX_CPU)
        };
        let mut cpus = Vec::new();
        for part in text.split(',') {
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (cpu(lo).ok_or_else(bad)?, cpu(hi).ok_or_else(bad)?);
                    if lo > hi {
                        return Err(bad());
                    }
                    cpus.extend(lo..=hi);
                }
                None => cpus.push(cpu(part).ok_or_else(bad)?),
            }
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(Cpus::List(cpus))
    }
}

impl fmt::Display for Cpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cpus::Any => f.write_str("any"),
            Cpus::Inherit => f.write_str("inherit"),
            Cpus::List(cpus) => {
                for (i, c) in cpus.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{c}")?;
                }
                Ok(())
            }
        }
    }
}

impl Cpus {
    /// Sets the calling thread's CPU mask. `Any` asks for every CPU and gets those the
    /// process's cpuset allows; `Inherit` changes nothing.
    pub fn apply_to_current_thread(&self) -> Result<(), AffinityError> {
        let mut set = CpuSet::new();
        match self {
            Cpus::Inherit => return Ok(()),
            Cpus::Any => (0..CpuSet::MAX_CPU).for_each(|c| set.set(c)),
            Cpus::List(cpus) => cpus.iter().for_each(|&c| set.set(c)),
        }
        sched_setaffinity(None, &set).map_err(|e| AffinityError::Apply {
            cpus: match self {
                Cpus::List(cpus) => cpus.clone(),
                _ => Vec::new(),
            },
            source: e.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::thread::sched_getaffinity;

    #[test]
    fn parses_words_and_lists() {
        assert_eq!("any".parse::<Cpus>().unwrap(), Cpus::Any);
        assert_eq!(" inherit ".parse::<Cpus>().unwrap(), Cpus::Inherit);
        assert_eq!(
            "5,0-2,1".parse::<Cpus>().unwrap(),
            Cpus::List(vec![0, 1, 2, 5])
        );
        assert_eq!(Cpus::List(vec![0, 1, 2, 5]).to_string(), "0,1,2,5");
        for bad in ["", "all", "1,", "3-1", "-1", "1-", "99999", "a-b"] {
            let err = bad.parse::<Cpus>().unwrap_err();
            assert!(err.to_string().contains("is not a CPU set"), "{bad}: {err}");
        }
    }

    /// A thread bound to one CPU starts threads bound to it; `Any` widens such a thread to
    /// every CPU the process had.
    #[test]
    fn any_undoes_an_inherited_binding() {
        let all = sched_getaffinity(None).unwrap();
        let first = (0..CpuSet::MAX_CPU).find(|&c| all.is_set(c)).unwrap();
        std::thread::spawn(move || {
            Cpus::List(vec![first]).apply_to_current_thread().unwrap();
            let inner = std::thread::spawn(|| {
                let inherited = sched_getaffinity(None).unwrap().count();
                Cpus::Inherit.apply_to_current_thread().unwrap();
                assert_eq!(sched_getaffinity(None).unwrap().count(), inherited);
                Cpus::Any.apply_to_current_thread().unwrap();
                (inherited, sched_getaffinity(None).unwrap())
            });
            let (inherited, widened) = inner.join().unwrap();
            assert_eq!(inherited, 1);
            assert_eq!(widened, all);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_list_of_no_usable_cpu_is_refused() {
        let err =
            std::thread::spawn(|| Cpus::List(vec![CpuSet::MAX_CPU - 1]).apply_to_current_thread())
                .join()
                .unwrap()
                .unwrap_err();
        let want = format!("cannot run a thread on CPUs [{}]", CpuSet::MAX_CPU - 1);
        assert!(err.to_string().contains(&want), "{err}");
    }
}
