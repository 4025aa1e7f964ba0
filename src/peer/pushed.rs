//! What this node pushed: per local snapshot and tag, the manifest digest the push published
//! and the snapshot id it held, kept in one small file under `VK_STATE_DIR`.
//!
//! The peer listener serves a snapshot only to a caller naming one of its exact digests (only
//! registry readers know them), and only while the snapshot still has that id. Written
//! atomically (temporary file, fsync, rename), so a crash leaves the old record or the new one.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use serde::{Deserialize, Serialize};

/// The record's file name under the state directory.
pub const FILE_NAME: &str = "peer-pushed.json";
/// Largest record file read at start (a few hundred bytes per push).
const FILE_LIMIT: u64 = 16 << 20;

/// One push this node completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pushed {
    /// The local snapshot's name (the VM name, also the repository).
    pub name: String,
    /// The tag it was pushed to (`hibernate`, `latest`).
    pub tag: String,
    /// `sha256:<hex>` of the manifest bytes published.
    pub manifest_digest: String,
    /// The local snapshot's id (its directory under `VK_COCOON_SNAPSHOT_DIR`).
    pub snapshot_id: String,
}

/// The records, in memory and on disk.
#[derive(Debug)]
pub struct PushedSnapshots {
    /// None: kept in memory only (no state directory could be used).
    path: Option<PathBuf>,
    records: RwLock<Vec<Pushed>>,
    /// One writer of the file at a time, in the order the records changed.
    writing: Mutex<()>,
}

impl PushedSnapshots {
    /// Creates `dir` (mode 0700) when missing and reads its record file. A missing or
    /// unparsable file is an empty record (nothing is served until the next push rewrites it).
    pub fn open(dir: &Path) -> io::Result<PushedSnapshots> {
        DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        // An existing directory keeps its mode from `create`: the record is the daemon's own.
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        let path = dir.join(FILE_NAME);
        let records = match fs::File::open(&path) {
            Ok(f) => {
                let mut text = Vec::new();
                io::Read::read_to_end(&mut io::Read::take(f, FILE_LIMIT), &mut text)?;
                serde_json::from_slice(&text).unwrap_or_else(|e| {
                    log::warn!(
                        "{}: {e}; no snapshot is served to peers until the next push",
                        path.display()
                    );
                    Vec::new()
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        Ok(PushedSnapshots {
            path: Some(path),
            records: RwLock::new(records),
            writing: Mutex::new(()),
        })
    }

    /// A record that is never written to disk.
    pub fn in_memory() -> PushedSnapshots {
        PushedSnapshots {
            path: None,
            records: RwLock::new(Vec::new()),
            writing: Mutex::new(()),
        }
    }

    /// Records that snapshot `name` (id `snapshot_id`) was pushed as `tag` with manifest
    /// `digest`, replacing what was recorded for that name and tag.
    pub fn record(&self, name: &str, tag: &str, digest: &str, snapshot_id: &str) -> io::Result<()> {
        let entry = Pushed {
            name: name.to_string(),
            tag: tag_or_latest(tag).to_string(),
            manifest_digest: digest.to_string(),
            snapshot_id: snapshot_id.to_string(),
        };
        self.change(|m| {
            m.retain(|p| !(p.name == entry.name && p.tag == entry.tag));
            m.push(entry);
            true
        })
    }

    /// Forgets the push of `name` as `tag` (the tag was deleted).
    pub fn forget_tag(&self, name: &str, tag: &str) -> io::Result<()> {
        let tag = tag_or_latest(tag);
        self.retain(|p| !(p.name == name && p.tag == tag))
    }

    /// Keeps only the records `keep` says yes to.
    pub fn retain(&self, keep: impl FnMut(&Pushed) -> bool) -> io::Result<()> {
        self.change(|m| {
            let before = m.len();
            m.retain(keep);
            m.len() != before
        })
    }

    /// The push of snapshot `name` whose manifest digest is `digest`.
    pub fn find(&self, name: &str, digest: &str) -> Option<Pushed> {
        let m = self.records.read().ok()?;
        // Every record's digest is compared, so the timing does not tell which one matched.
        m.iter().fold(None, |found, p| {
            let same = same_secret(&p.manifest_digest, digest);
            if same && p.name == name {
                Some(p.clone())
            } else {
                found
            }
        })
    }

    /// Whether some push was of snapshot id `snapshot_id` with manifest digest `digest`.
    pub fn vouches_for(&self, snapshot_id: &str, digest: &str) -> bool {
        let Ok(m) = self.records.read() else {
            return false;
        };
        m.iter().fold(false, |found, p| {
            let same = same_secret(&p.manifest_digest, digest) & (p.snapshot_id == snapshot_id);
            found | same
        })
    }

    pub fn len(&self) -> usize {
        self.records.read().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies `edit` (which says whether it changed anything) and writes the file.
    fn change(&self, edit: impl FnOnce(&mut Vec<Pushed>) -> bool) -> io::Result<()> {
        let _writer = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        let snapshot = {
            let mut m = self.records.write().unwrap_or_else(|e| e.into_inner());
            if !edit(&mut m) {
                return Ok(());
            }
            m.clone()
        };
        match &self.path {
            Some(path) => write_atomically(path, &snapshot),
            None => Ok(()),
        }
    }
}

/// A push or delete of tag "" is of `latest`.
fn tag_or_latest(tag: &str) -> &str {
    if tag.is_empty() {
        "latest"
    } else {
        tag
    }
}

/// Whether `a` equals `b`, in time that depends on their lengths only.
pub fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn write_atomically(path: &Path, records: &[Pushed]) -> io::Result<()> {
    let body = serde_json::to_vec_pretty(records).map_err(io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&body)?;
    f.sync_all()?;
    drop(f);
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";
    const D3: &str = "sha256:3333333333333333333333333333333333333333333333333333333333333333";

    #[test]
    fn a_record_survives_a_reopen_and_only_its_exact_pair_is_vouched_for() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let r = PushedSnapshots::open(&state).unwrap();
        r.record("vk-a", "hibernate", D1, "01A").unwrap();
        r.record("vk-b", "", D2, "01B").unwrap();
        let again = PushedSnapshots::open(&state).unwrap();
        assert_eq!(again.find("vk-a", D1).unwrap().snapshot_id, "01A");
        assert_eq!(again.find("vk-b", D2).unwrap().tag, "latest");
        assert_eq!(again.find("vk-a", D2), None, "another snapshot's digest");
        assert_eq!(again.find("vk-c", D1), None);
        assert!(again.vouches_for("01A", D1));
        assert!(!again.vouches_for("01A", D2));
        assert!(!again.vouches_for("01B", D1));
        assert!(!again.vouches_for("01A", ""));
        let mode = fs::metadata(&state).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let mode = fs::metadata(state.join(FILE_NAME))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        assert!(!state.join("peer-pushed.json.tmp").exists());
    }

    #[test]
    fn each_tag_keeps_its_push_a_new_push_replaces_it_and_a_deleted_tag_forgets_it() {
        let dir = tempfile::tempdir().unwrap();
        let r = PushedSnapshots::open(dir.path()).unwrap();
        r.record("vk-a", "hibernate", D1, "01A").unwrap();
        r.record("vk-a", "latest", D2, "01A").unwrap();
        assert!(r.find("vk-a", D1).is_some() && r.find("vk-a", D2).is_some());
        r.record("vk-a", "hibernate", D3, "01C").unwrap();
        assert_eq!(r.find("vk-a", D1), None, "replaced by the newer push");
        assert!(r.vouches_for("01C", D3));
        r.forget_tag("vk-a", "hibernate").unwrap();
        assert_eq!(r.find("vk-a", D3), None);
        assert!(r.find("vk-a", D2).is_some(), "the latest push stays");
        r.forget_tag("vk-a", "").unwrap();
        assert!(PushedSnapshots::open(dir.path()).unwrap().is_empty());
    }

    #[test]
    fn an_unparsable_record_vouches_for_nothing_until_the_next_push() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(FILE_NAME), format!("[{{\"name\": \"{D1}")).unwrap();
        let r = PushedSnapshots::open(dir.path()).unwrap();
        assert!(r.is_empty() && !r.vouches_for("01A", D1));
        r.record("vk-a", "hibernate", D1, "01A").unwrap();
        assert!(PushedSnapshots::open(dir.path())
            .unwrap()
            .vouches_for("01A", D1));
    }

    #[test]
    fn secrets_compare_exactly() {
        assert!(same_secret(D1, D1));
        assert!(!same_secret(D1, D2));
        assert!(!same_secret(D1, &D1[..70]));
        assert!(same_secret("", ""));
    }
}
