//! Temporary tiers of bench runs, and the sweep of those whose run died.
//!
//! A run that is killed (`kill -9`, a crash) cannot remove its temporary tier. Each one is a
//! directory `kvtier-bench-tier-<pid>-<random>` in the system's temporary directory, locked
//! (`flock`) by its run for as long as the run lives. The next run removes every such
//! directory whose lock it can take and whose process is gone: never a live run's tier.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::BenchError;

/// The name every temporary tier directory starts with.
pub const TEMP_TIER_PREFIX: &str = "kvtier-bench-tier-";

/// A temporary tier directory, locked while it lives and removed when dropped.
#[derive(Debug)]
pub(crate) struct TempTier {
    dir: tempfile::TempDir,
    _lock: File,
}

impl TempTier {
    /// Creates and locks a new temporary tier directory in `parent`.
    pub(crate) fn new(parent: &Path) -> Result<Self, BenchError> {
        let io = |what, source| BenchError::Io {
            what,
            path: parent.to_path_buf(),
            source,
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("{TEMP_TIER_PREFIX}{}-", std::process::id()))
            .tempdir_in(parent)
            .map_err(|e| io("create temporary tier directory", e))?;
        let lock = File::open(dir.path()).map_err(|e| io("open temporary tier directory", e))?;
        lock.try_lock()
            .map_err(|e| io("lock temporary tier directory", e.into()))?;
        Ok(TempTier { dir, _lock: lock })
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// The process id in a temporary tier's name.
fn owner(name: &str) -> Option<u32> {
    name.strip_prefix(TEMP_TIER_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Removes the temporary tiers in `parent` left by runs that died; returns what it removed.
/// A tier whose process lives, or whose lock is held, is left alone.
pub fn sweep_temporary_tiers(parent: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(owner) else {
            continue;
        };
        let path = entry.path();
        if pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists() {
            continue; // a live process (or one that reused the id): leave it
        }
        let Ok(dir) = File::open(&path) else { continue };
        if dir.try_lock().is_err() {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::debug!(path = %path.display(), pid, "temporary tier of a dead run removed");
                removed.push(path);
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "temporary tier not removed")
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_runs_tier_is_swept_and_a_live_one_kept() {
        let parent = tempfile::tempdir().unwrap();
        let live = TempTier::new(parent.path()).unwrap();
        // A process id that is not running: the largest the kernel can hand out, plus one.
        let dead = parent.path().join(format!("{TEMP_TIER_PREFIX}4194305-abc"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("blocks.kvt"), b"left behind").unwrap();
        let other = parent.path().join("kvtier-something-else");
        std::fs::create_dir(&other).unwrap();
        assert_eq!(sweep_temporary_tiers(parent.path()), vec![dead.clone()]);
        assert!(!dead.exists());
        assert!(live.path().exists(), "a live run's tier is never swept");
        assert!(other.exists(), "only temporary tiers are swept");
        // Locked by a live holder, even one whose name says its process died: kept.
        let held = parent.path().join(format!("{TEMP_TIER_PREFIX}4194306-abc"));
        std::fs::create_dir(&held).unwrap();
        let lock = File::open(&held).unwrap();
        lock.try_lock().unwrap();
        assert!(sweep_temporary_tiers(parent.path()).is_empty());
        drop(lock);
        assert_eq!(sweep_temporary_tiers(parent.path()), vec![held]);
    }
}
