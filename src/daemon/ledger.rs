//! The ownership ledger on disk: `owners.json` in VK_STATE_DIR (mode 0700), read once at
//! start and written by a thread of its own (write, fsync, rename), never by the loop.
//!
//! The loop hands the thread each change list of an [`Effect::RecordOwners`] (a channel send,
//! O(changes)); the thread applies every list waiting, writes the whole ledger once, and
//! answers each op with [`Work::OwnersRecorded`]. Serialising and syncing the file (O(ledger),
//! a disk flush) happen there, so the loop never waits on the disk however large the ledger
//! grows. Changes are applied in the order they were sent, so the file follows the core.
//!
//! [`Effect::RecordOwners`]: crate::provider::Effect::RecordOwners

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use super::Work;
use crate::provider::owners::{OwnerChange, Owners};
use crate::provider::OpId;
use crate::reactor::Notifier;

/// The ledger's file name in the state directory.
pub(super) const FILE: &str = "owners.json";

/// The loop's end of the writer thread.
pub(super) struct LedgerWriter {
    tx: mpsc::Sender<(OpId, Vec<OwnerChange>)>,
}

impl LedgerWriter {
    /// Queues a change list; its answer comes back as `Work::OwnersRecorded`. False when the
    /// thread is gone (the caller answers the op with an error).
    pub(super) fn send(&self, op: OpId, changes: Vec<OwnerChange>) -> bool {
        self.tx.send((op, changes)).is_ok()
    }
}

/// Why the ledger cannot be kept (the daemon does not start).
#[derive(Debug)]
pub(super) enum OpenError {
    /// The state directory cannot be made.
    Create(PathBuf, std::io::Error),
    /// Nor narrowed to 0700.
    Chmod(PathBuf, std::io::Error),
    /// The writer thread did not start.
    Writer(std::io::Error),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Create(dir, e) => write!(f, "create {}: {e}", dir.display()),
            OpenError::Chmod(dir, e) => write!(f, "chmod 0700 {}: {e}", dir.display()),
            OpenError::Writer(e) => write!(f, "start the ledger writer: {e}"),
        }
    }
}

/// Prepares the state directory, reads the ledger and starts its writer. An unreadable file
/// is set aside (renamed) and the ledger starts empty: a missing record only ever narrows what
/// a pod may read (the proof by name is stricter than any record). A directory that cannot be
/// made or a thread that cannot start is an error.
pub(super) fn open(
    dir: &Path,
    notifier: Notifier<Work>,
) -> Result<(Owners, LedgerWriter), OpenError> {
    fs::create_dir_all(dir).map_err(|e| OpenError::Create(dir.to_path_buf(), e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| OpenError::Chmod(dir.to_path_buf(), e))?;
    let owners = load(dir);
    let (tx, rx) = mpsc::channel::<(OpId, Vec<OwnerChange>)>();
    let (copy, dir) = (owners.clone(), dir.to_path_buf());
    std::thread::Builder::new()
        .name("vk-ledger".into())
        .spawn(move || writer(dir, copy, rx, notifier))
        .map_err(OpenError::Writer)?;
    Ok((owners, LedgerWriter { tx }))
}

fn load(dir: &Path) -> Owners {
    let path = dir.join(FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Owners::default(),
        Err(e) => {
            log::error!("ownership ledger {}: {e}; starting empty", path.display());
            return Owners::default();
        }
    };
    match serde_json::from_slice::<Owners>(&bytes) {
        Ok(o) => {
            log::info!(
                "ownership ledger {}: {} VMs, {} snapshots",
                path.display(),
                o.vms.len(),
                o.snapshots.len()
            );
            o
        }
        Err(e) => {
            let aside = dir.join(format!("{FILE}.unreadable"));
            let moved = fs::rename(&path, &aside);
            log::error!(
                "ownership ledger {} does not parse ({e}); set aside as {} ({moved:?}), \
                 starting empty",
                path.display(),
                aside.display()
            );
            Owners::default()
        }
    }
}

fn writer(
    dir: PathBuf,
    mut owners: Owners,
    rx: mpsc::Receiver<(OpId, Vec<OwnerChange>)>,
    notifier: Notifier<Work>,
) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        for (_, changes) in &batch {
            for c in changes {
                owners.apply(c);
            }
        }
        let result = write_atomic(&dir, &owners)
            .map_err(|e| format!("write {}: {e}", dir.join(FILE).display()));
        let ops = batch.into_iter().map(|(op, _)| op).collect();
        notifier.post(Work::OwnersRecorded { ops, result });
    }
}

/// The whole ledger into a temporary file (0600), synced, renamed over the ledger, and the
/// directory synced: a crash leaves the old ledger or the new one, never half of one.
fn write_atomic(dir: &Path, owners: &Owners) -> std::io::Result<()> {
    let text = serde_json::to_vec(owners).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    let mut f = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&text)?;
    f.sync_all()?;
    fs::rename(&tmp, dir.join(FILE))?;
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::owners::{Owned, Owner};

    #[test]
    fn the_ledger_is_written_whole_and_read_back_and_a_bad_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        fs::create_dir_all(&state).unwrap();
        let mut o = Owners::default();
        o.apply(&OwnerChange::Set {
            kind: Owned::Snapshot,
            name: "vk-a-b".into(),
            owner: Owner::new("a", "u"),
        });
        write_atomic(&state, &o).unwrap();
        let mode = fs::metadata(state.join(FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!state.join(format!("{FILE}.tmp")).exists());
        assert_eq!(load(&state), o);

        fs::write(state.join(FILE), b"{not json").unwrap();
        assert_eq!(load(&state), Owners::default());
        assert!(state.join(format!("{FILE}.unreadable")).exists());
        assert!(!state.join(FILE).exists());
        assert_eq!(load(&dir.path().join("missing")), Owners::default());
    }
}
