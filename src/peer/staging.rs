//! The staging directory's housekeeping: entries left by an earlier daemon process (a crash
//! mid-restore) and entries this process forgot for too long are removed.
//!
//! Entry names end in `.<pid>-<nanos>` (see `client.rs`); anything else in the directory is
//! not ours to judge by name, so only its age decides.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

/// A staged directory older than this is stale even if this process made it: a clone from
/// it has long finished or failed.
pub const STAGING_MAX_AGE: Duration = Duration::from_secs(3600);
/// How often the sweep runs after the one at start.
pub const SWEEP_EVERY: Duration = Duration::from_secs(600);

/// The pid encoded in a staged entry's name, if it has the client's shape.
fn creator_pid(name: &str) -> Option<u32> {
    let (_, tail) = name.rsplit_once('.')?;
    let (pid, nanos) = tail.split_once('-')?;
    nanos.parse::<u128>().ok()?;
    pid.parse().ok()
}

/// The sweeper's memory of this process's own entries: when it first saw each (monotonic).
/// An own entry's age is never read from the wall clock: a clock stepped forward by an hour
/// must not make a restore that is still copying look an hour old.
#[derive(Debug, Default)]
pub struct Sweeper {
    first_seen: HashMap<String, Instant>,
}

impl Sweeper {
    /// Whether entry `name`, last modified at `mtime` (wall), is stale for process `me`:
    /// another process's entry always; one of ours once it was seen `STAGING_MAX_AGE` ago
    /// (monotonic `mono`); an entry not named by us once its mtime is that old (`wall`).
    pub fn is_stale(
        &mut self,
        name: &str,
        mtime: SystemTime,
        me: u32,
        wall: SystemTime,
        mono: Instant,
    ) -> bool {
        match creator_pid(name) {
            Some(pid) if pid != me => true,
            Some(_) => {
                let first = *self.first_seen.entry(name.to_string()).or_insert(mono);
                mono.saturating_duration_since(first) >= STAGING_MAX_AGE
            }
            None => wall.duration_since(mtime).unwrap_or_default() >= STAGING_MAX_AGE,
        }
    }

    /// Removes the stale entries under `root`; returns how many were removed. A missing root
    /// is empty.
    pub fn sweep(&mut self, root: &Path, wall: SystemTime, mono: Instant) -> usize {
        let Ok(entries) = std::fs::read_dir(root) else {
            return 0;
        };
        let me = std::process::id();
        let mut removed = 0;
        let mut present = std::collections::HashSet::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            present.insert(name.to_string());
            // symlink_metadata: a symlink is judged (and removed) itself, never followed.
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            let mtime = meta.modified().unwrap_or(wall);
            if !self.is_stale(name, mtime, me, wall, mono) {
                continue;
            }
            let path = entry.path();
            let res = if meta.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match res {
                Ok(()) => removed += 1,
                Err(e) => log::warn!("staging sweep: remove {}: {e}", path.display()),
            }
        }
        self.first_seen.retain(|n, _| present.contains(n));
        if removed > 0 {
            log::info!(
                "staging sweep: removed {removed} stale entr(ies) under {}",
                root.display()
            );
        }
        removed
    }
}

/// Removes the staged entry `dir` once its clone has answered. Only an entry directly under
/// `root` is touched (a symlink there is removed itself, never followed); anything else is
/// refused and logged. A missing entry is already gone.
pub fn remove_entry(root: &Path, dir: &Path) {
    let inside = dir.parent() == Some(root)
        && dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(super::wire::plain_component);
    if !inside {
        log::warn!(
            "staging: {} is not an entry of {}; not removed",
            dir.display(),
            root.display()
        );
        return;
    }
    let res = match dir.symlink_metadata() {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(dir),
        Ok(_) => std::fs::remove_file(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    match res {
        Ok(()) => log::info!("staging: removed {} after its clone", dir.display()),
        Err(e) => log::warn!("staging: remove {}: {e}; the sweep retries", dir.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_entries_are_other_processes_or_too_old_and_our_own_age_is_monotonic() {
        let wall = SystemTime::now();
        let mono = Instant::now();
        let me = 4242;
        let mut s = Sweeper::default();
        assert!(!s.is_stale("vk-a.4242-17", wall, me, wall, mono));
        assert!(s.is_stale("vk-a.4241-17", wall, me, wall, mono));
        assert!(!s.is_stale("operator-file", wall, me, wall, mono));
        assert!(s.is_stale("operator-file", wall - STAGING_MAX_AGE, me, wall, mono));
        // Our own entry, with the wall clock stepped forward two hours: still young.
        let stepped = wall + 2 * STAGING_MAX_AGE;
        assert!(!s.is_stale("vk-a.4242-17", wall, me, stepped, mono));
        // An hour later by the monotonic clock it is stale, whatever the wall clock says.
        assert!(s.is_stale(
            "vk-a.4242-17",
            wall,
            me,
            wall - STAGING_MAX_AGE,
            mono + STAGING_MAX_AGE
        ));
    }

    #[test]
    fn sweep_removes_other_processes_entries_and_never_follows_symlinks() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"x").unwrap();
        let dead = root.path().join("vk-a.1-5");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("mem"), b"x").unwrap();
        let mine = root.path().join(format!("vk-b.{}-5", std::process::id()));
        std::fs::create_dir(&mine).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("vk-c.1-5")).unwrap();

        let mut sweeper = Sweeper::default();
        assert_eq!(
            sweeper.sweep(root.path(), SystemTime::now(), Instant::now()),
            2
        );
        assert!(!dead.exists());
        assert!(mine.exists());
        assert!(outside.path().join("keep").exists());
        assert_eq!(
            sweeper.sweep(
                &root.path().join("absent"),
                SystemTime::now(),
                Instant::now()
            ),
            0
        );
    }

    #[test]
    fn remove_entry_removes_only_direct_entries_of_the_root() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"x").unwrap();
        let staged = root.path().join("vk-a.1-5");
        std::fs::create_dir(&staged).unwrap();
        std::fs::write(staged.join("memory-ranges"), b"x").unwrap();
        let link = root.path().join("vk-b.1-5");
        std::os::unix::fs::symlink(outside.path(), &link).unwrap();

        // Not directly under the root: refused, whatever the path says.
        remove_entry(root.path(), outside.path());
        remove_entry(root.path(), &root.path().join("vk-a.1-5/../../x"));
        remove_entry(root.path(), &staged.join("memory-ranges"));
        assert!(outside.path().join("keep").exists());
        assert!(staged.join("memory-ranges").exists());

        remove_entry(root.path(), &staged);
        assert!(!staged.exists());
        remove_entry(root.path(), &link);
        assert!(link.symlink_metadata().is_err());
        assert!(outside.path().join("keep").exists());
        remove_entry(root.path(), &staged);
    }
}
