//! The ownership ledger on disk in VK_STATE_DIR (mode 0700): `owners.json`, the whole ledger as
//! of its last compaction, and `owners.journal`, the changes since, one JSON line each.
//!
//! A thread of its own writes it, never the loop: the loop hands it each change list of an
//! [`Effect::RecordOwners`] (a channel send, O(changes)); the thread applies every list waiting,
//! appends their lines to the journal with one data sync, and answers each op with
//! [`Work::OwnersRecorded`]. A write costs the changes it carries, not the ledger: rewriting the
//! whole file per create was O(ledger) serialising and two flushes, 12 % of the daemon's CPU
//! in a 1,000-pod burst. Once the journal holds more lines than the ledger has entries (and at
//! least [`COMPACT_MIN`]), and at every start, the whole ledger is written anew (temporary file,
//! sync, rename, directory sync) and the journal emptied: replay stays O(ledger).
//!
//! Replaying a journal onto the ledger it was written after is idempotent (each change sets or
//! removes one entry, last one wins), so a crash between the rename and the truncation loses
//! nothing. A crash mid-append leaves at most a torn last line, which was never answered and is
//! dropped at start. Changes are applied in the order they were sent, so the files follow the
//! core.
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
/// The journal of changes since `FILE` was written.
const JOURNAL: &str = "owners.journal";
/// The journal is compacted into `FILE` once it holds this many lines and more than the
/// ledger's entries: a small ledger is not rewritten every few creates.
const COMPACT_MIN: usize = 4096;

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

/// Prepares the state directory, reads the ledger (the file, then the journal's changes),
/// compacts it and starts its writer. An unreadable file or journal is set aside (renamed) and
/// what could be read is kept: a missing record only ever narrows what a pod may read (the
/// proof by name is stricter than any record). A directory that cannot be made or a thread
/// that cannot start is an error; a compaction that fails is retried before the next write.
pub(super) fn open(
    dir: &Path,
    notifier: Notifier<Work>,
) -> Result<(Owners, LedgerWriter), OpenError> {
    fs::create_dir_all(dir).map_err(|e| OpenError::Create(dir.to_path_buf(), e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| OpenError::Chmod(dir.to_path_buf(), e))?;
    let owners = load(dir);
    let mut disk = Disk::new(dir);
    if let Err(e) = disk.compact(&owners) {
        log::error!("ownership ledger {}: {e}", dir.join(FILE).display());
    }
    let (tx, rx) = mpsc::channel::<(OpId, Vec<OwnerChange>)>();
    let copy = owners.clone();
    std::thread::Builder::new()
        .name("vk-ledger".into())
        .spawn(move || writer(disk, copy, rx, notifier))
        .map_err(OpenError::Writer)?;
    Ok((owners, LedgerWriter { tx }))
}

/// The ledger as the file and the journal after it say.
fn load(dir: &Path) -> Owners {
    let mut owners = load_file(dir);
    let path = dir.join(JOURNAL);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return owners,
        Err(e) => {
            log::error!("ownership ledger journal {}: {e}", path.display());
            return owners;
        }
    };
    let (mut applied, mut lines) = (0, bytes.split_inclusive(|b| *b == b'\n').peekable());
    while let Some(line) = lines.next() {
        let torn = !line.ends_with(b"\n");
        match serde_json::from_slice::<OwnerChange>(line) {
            Ok(l) if !torn => {
                owners.apply(&l);
                applied += 1;
            }
            // A crash mid-append: the change was never answered, so nothing relied on it.
            _ if torn && lines.peek().is_none() => {
                log::warn!(
                    "ownership ledger journal {}: dropped a torn last line",
                    path.display()
                );
            }
            _ => {
                let aside = dir.join(format!("{JOURNAL}.unreadable"));
                let moved = fs::rename(&path, &aside);
                log::error!(
                    "ownership ledger journal {}: line {} does not parse; the {applied} \
                     changes before it are kept, the rest set aside as {} ({moved:?})",
                    path.display(),
                    applied + 1,
                    aside.display()
                );
                break;
            }
        }
    }
    if applied > 0 {
        log::info!(
            "ownership ledger journal {}: {applied} changes replayed",
            path.display()
        );
    }
    owners
}

fn load_file(dir: &Path) -> Owners {
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
    mut disk: Disk,
    mut owners: Owners,
    rx: mpsc::Receiver<(OpId, Vec<OwnerChange>)>,
    notifier: Notifier<Work>,
) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        let changes: Vec<&OwnerChange> = batch.iter().flat_map(|(_, c)| c).collect();
        for c in &changes {
            owners.apply(c);
        }
        let result = disk
            .record(&owners, &changes)
            .map_err(|e| format!("write {}: {e}", disk.dir.join(JOURNAL).display()));
        let ops = batch.into_iter().map(|(op, _)| op).collect();
        notifier.post(Work::OwnersRecorded { ops, result });
    }
}

/// The writer's files: the journal open for appending, and how many lines it holds.
struct Disk {
    dir: PathBuf,
    journal: Option<fs::File>,
    lines: usize,
    /// `COMPACT_MIN`, smaller in tests.
    compact_min: usize,
}

impl Disk {
    fn new(dir: &Path) -> Disk {
        Disk {
            dir: dir.to_path_buf(),
            journal: None,
            lines: 0,
            compact_min: COMPACT_MIN,
        }
    }

    /// Makes `changes` (already applied to `owners`) durable: appended to the journal, or the
    /// whole ledger written when the journal is due for compaction or an append failed (a
    /// journal that may end in half a line takes no more lines after it).
    fn record(&mut self, owners: &Owners, changes: &[&OwnerChange]) -> std::io::Result<()> {
        let entries = owners.vms.len() + owners.snapshots.len();
        let Some(journal) = self.journal.as_mut() else {
            return self.compact(owners);
        };
        if self.lines + changes.len() > self.compact_min.max(entries) {
            return self.compact(owners);
        }
        let mut text = Vec::new();
        for c in changes {
            serde_json::to_writer(&mut text, c).map_err(std::io::Error::other)?;
            text.push(b'\n');
        }
        let written = journal.write_all(&text).and_then(|()| journal.sync_data());
        match written {
            Ok(()) => self.lines += changes.len(),
            Err(_) => self.journal = None,
        }
        written
    }

    /// The whole ledger into `FILE`, then the journal emptied (created when missing, the
    /// directory synced so its entry outlives a crash).
    fn compact(&mut self, owners: &Owners) -> std::io::Result<()> {
        self.journal = None;
        write_atomic(&self.dir, owners)?;
        let journal = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(self.dir.join(JOURNAL))?;
        journal.set_len(0)?;
        journal.sync_all()?;
        fs::File::open(&self.dir)?.sync_all()?;
        self.journal = Some(journal);
        self.lines = 0;
        Ok(())
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

    fn set(kind: Owned, name: &str, ns: &str) -> OwnerChange {
        OwnerChange::Set {
            kind,
            name: name.into(),
            owner: Owner::new(ns, "u"),
        }
    }

    fn remove(kind: Owned, name: &str) -> OwnerChange {
        OwnerChange::Remove {
            kind,
            name: name.into(),
        }
    }

    /// A started ledger in `state` holding `owners`, as `open` leaves it.
    fn started(state: &Path, owners: &Owners) -> Disk {
        let mut disk = Disk::new(state);
        disk.compact_min = 4;
        disk.compact(owners).unwrap();
        disk
    }

    fn record(disk: &mut Disk, owners: &mut Owners, changes: &[OwnerChange]) {
        changes.iter().for_each(|c| owners.apply(c));
        disk.record(owners, &changes.iter().collect::<Vec<_>>())
            .unwrap();
    }

    fn journal_lines(state: &Path) -> usize {
        fs::read_to_string(state.join(JOURNAL))
            .unwrap()
            .lines()
            .count()
    }

    #[test]
    fn changes_go_to_the_journal_and_read_back_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path();
        let mut owners = Owners::default();
        let mut disk = started(state, &owners);
        record(&mut disk, &mut owners, &[set(Owned::Vm, "vk-a-b", "a")]);
        record(
            &mut disk,
            &mut owners,
            &[
                set(Owned::Snapshot, "vk-a-b", "a"),
                remove(Owned::Vm, "vk-a-b"),
            ],
        );
        assert_eq!(journal_lines(state), 3, "appended, the file not rewritten");
        let text = fs::read_to_string(state.join(JOURNAL)).unwrap();
        assert_eq!(
            text.lines().take(2).collect::<Vec<_>>(),
            [
                r#"{"set":{"kind":"vm","name":"vk-a-b","owner":{"namespace":"a","pod_uid":"u"}}}"#,
                r#"{"set":{"kind":"snapshot","name":"vk-a-b","owner":{"namespace":"a","pod_uid":"u"}}}"#
            ]
        );
        assert_eq!(load_file(state), Owners::default());
        assert_eq!(load(state), owners);
        for file in [FILE, JOURNAL] {
            let mode = fs::metadata(state.join(file)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{file}");
        }
        assert!(!state.join(format!("{FILE}.tmp")).exists());
    }

    /// Past its bound (the ledger's entries, at least `compact_min`) the journal is folded into
    /// the file and emptied; what reads back is the same.
    #[test]
    fn a_long_journal_is_compacted_into_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path();
        let mut owners = Owners::default();
        let mut disk = started(state, &owners);
        for i in 0..4 {
            record(
                &mut disk,
                &mut owners,
                &[set(Owned::Vm, &format!("vk-a-{i}"), "a")],
            );
        }
        assert_eq!(journal_lines(state), 4);
        record(&mut disk, &mut owners, &[remove(Owned::Vm, "vk-a-0")]);
        assert_eq!(journal_lines(state), 0, "compacted");
        assert_eq!(load_file(state), owners);
        record(&mut disk, &mut owners, &[set(Owned::Vm, "vk-b-0", "b")]);
        assert_eq!(
            journal_lines(state),
            1,
            "appending again after the compaction"
        );
        assert_eq!(load(state), owners);
        assert_eq!(owners.vms.len(), 4);
    }

    /// A crash after a compaction's rename but before the journal was emptied: the journal's
    /// changes replay onto a file that already holds them, and the ledger is the same.
    #[test]
    fn a_journal_replayed_onto_the_file_it_was_folded_into_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path();
        let mut owners = Owners::default();
        let mut disk = started(state, &owners);
        let changes = [
            set(Owned::Vm, "vk-a-b", "a"),
            remove(Owned::Vm, "vk-a-b"),
            set(Owned::Vm, "vk-a-c", "a"),
            set(Owned::Vm, "vk-a-c", "b"),
        ];
        record(&mut disk, &mut owners, &changes);
        write_atomic(state, &owners).unwrap();
        assert_eq!(load(state), owners);
        assert_eq!(owners.get(Owned::Vm, "vk-a-c"), Some(&Owner::new("b", "u")));
        assert_eq!(owners.vms.len(), 1);
    }

    /// A torn last line (a crash mid-append, never answered) is dropped; a line that does not
    /// parse in the middle keeps the changes before it and sets the journal aside.
    #[test]
    fn a_torn_or_bad_journal_keeps_what_it_can() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path();
        let mut owners = Owners::default();
        let mut disk = started(state, &owners);
        record(&mut disk, &mut owners, &[set(Owned::Vm, "vk-a-b", "a")]);
        let good = fs::read(state.join(JOURNAL)).unwrap();
        let mut torn = good.clone();
        torn.extend_from_slice(br#"{"set":{"kind":"vm","name":"vk-a-c","own"#);
        fs::write(state.join(JOURNAL), &torn).unwrap();
        assert_eq!(load(state), owners);
        assert!(
            state.join(JOURNAL).exists(),
            "a torn tail is no reason to set it aside"
        );

        let mut bad = good.clone();
        bad.extend_from_slice(b"{not json\n");
        bad.extend_from_slice(&good);
        bad.extend_from_slice(
            format!(
                "{}\n",
                serde_json::to_string(&set(Owned::Vm, "vk-a-d", "a")).unwrap()
            )
            .as_bytes(),
        );
        fs::write(state.join(JOURNAL), &bad).unwrap();
        assert_eq!(load(state), owners, "nothing after the bad line");
        assert!(state.join(format!("{JOURNAL}.unreadable")).exists());
        assert!(!state.join(JOURNAL).exists());
    }

    #[test]
    fn an_unreadable_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        fs::create_dir_all(&state).unwrap();
        fs::write(state.join(FILE), b"{not json").unwrap();
        assert_eq!(load(&state), Owners::default());
        assert!(state.join(format!("{FILE}.unreadable")).exists());
        assert!(!state.join(FILE).exists());
        assert_eq!(load(&dir.path().join("missing")), Owners::default());
    }
}
