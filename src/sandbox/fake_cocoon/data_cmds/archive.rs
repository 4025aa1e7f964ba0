//! `snapshot import | export`: archives stream member by member through a staging directory
//! owned by the importing process; per-member modes and PAX records survive the round trip.

use super::super::cli::{self, val, val_s};
use super::super::store::{new_id, now_rfc3339, pid_alive, write_atomic, RefError, Store};
use super::super::{io_err, tar, CmdResult};
use super::snapshot::Lease;
use super::{drain, open_input, safe_member};
use crate::vm::types::SnapshotEnvelope;
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// Reads a whole tar stream, checking every header checksum, body length, padding and the
/// end-of-archive marker, and writes nothing. A snapshot archive must open with a parsable
/// `snapshot.json`. Returns (members, body bytes).
pub(super) fn discard_archive(input: &mut dyn Read, snapshot: bool) -> Result<(u64, u64), String> {
    let (mut members, mut bytes) = (0u64, 0u64);
    loop {
        let entry = match tar::next_header(input).map_err(|e| format!("import: {e}"))? {
            tar::Next::Entry(e) => e,
            tar::Next::End => break,
            tar::Next::Eof => {
                return Err("import: archive ends without its end-of-archive marker".into())
            }
        };
        if snapshot && members == 0 && entry.kind != b'x' {
            read_envelope(input, &entry)?;
        } else {
            tar::copy_body(input, entry.size, &mut io::sink())
                .map_err(|e| format!("import: {e}"))?;
        }
        // A PAX header belongs to the member after it.
        if entry.kind != b'x' && entry.kind != b'g' {
            members += 1;
            bytes += entry.size;
        }
    }
    if members == 0 {
        return Err("import: empty archive".into());
    }
    Ok((members, bytes))
}

pub(super) fn snap_import(store: &Store, args: &[String], discard: bool) -> CmdResult {
    let p = cli::parse(args, &[val("name"), val("description")])?;
    let mut input = open_input(p.positionals.first().map(String::as_str))?;
    let result = if discard {
        discard_archive(&mut *input, true).map(|(members, bytes)| {
            eprintln!("discarded snapshot archive: {members} members, {bytes} bytes");
            0
        })
    } else {
        import_archive(store, &mut *input, p.get("name"), p.get("description"))
    };
    // cocoon reads its input to EOF even when the archive is bad.
    drain(&mut *input);
    result
}

/// The `snapshot.json` envelope an archive must open with: member `first`, whose header was
/// just read, is checked and its body read and parsed.
fn read_envelope(input: &mut dyn Read, first: &tar::Entry) -> Result<SnapshotEnvelope, String> {
    if first.name.trim_start_matches("./") != "snapshot.json" {
        return Err(format!(
            "import: first member is {:?}, want snapshot.json",
            first.name
        ));
    }
    if first.size > 1 << 20 {
        return Err("import: snapshot.json too large".into());
    }
    let mut env_bytes = Vec::new();
    tar::copy_body(input, first.size, &mut env_bytes).map_err(|e| format!("import: {e}"))?;
    let env: SnapshotEnvelope = serde_json::from_slice(&env_bytes)
        .map_err(|e| format!("import: parse snapshot.json: {e}"))?;
    if env.version != 1 {
        return Err(format!(
            "import: unsupported envelope version {}",
            env.version
        ));
    }
    Ok(env)
}

fn import_archive(
    store: &Store,
    input: &mut dyn Read,
    name: Option<&str>,
    description: Option<&str>,
) -> CmdResult {
    let first = tar::next_entry(input)
        .map_err(|e| format!("import: {e}"))?
        .ok_or("import: empty archive")?;
    let mut snap = read_envelope(input, &first)?.config;
    if let Some(n) = name {
        snap.name = n.to_string();
    }
    if let Some(d) = description {
        snap.description = d.to_string();
    }
    let id = new_id();
    snap.id = id.clone();
    snap.created_at = Some(now_rfc3339());
    let staging = staging_dir(store, &id);
    fs::create_dir_all(&staging).map_err(io_err("create staging dir"))?;
    let mut meta: MemberMeta = BTreeMap::new();
    let copied = (|| -> Result<(), String> {
        let mut pax: Vec<(String, String)> = Vec::new();
        while let Some(entry) = tar::next_entry(input).map_err(|e| format!("import: {e}"))? {
            let member = entry.name.trim_start_matches("./").to_string();
            if entry.kind == b'x' && entry.size <= 1 << 20 {
                // Keep cocoon's own records (sparse map and size) for the next member.
                let mut body = Vec::new();
                tar::copy_body(input, entry.size, &mut body).map_err(|e| format!("import: {e}"))?;
                pax = tar::parse_pax(&body).map_err(|e| format!("import: {e}"))?;
                pax.retain(|(k, _)| k.starts_with("COCOON."));
                continue;
            }
            let regular = entry.kind == b'0' || entry.kind == 0;
            let records = std::mem::take(&mut pax);
            if regular && safe_member(&member) {
                meta.insert(
                    member.clone(),
                    StoredMember {
                        mode: entry.mode,
                        pax: records,
                    },
                );
            }
            if !regular || !safe_member(&member) {
                tar::copy_body(input, entry.size, &mut io::sink())
                    .map_err(|e| format!("import: {e}"))?;
                continue;
            }
            let mut f = fs::File::create(staging.join(&member)).map_err(io_err("write member"))?;
            tar::copy_body(input, entry.size, &mut f).map_err(|e| format!("import: {e}"))?;
        }
        Ok(())
    })();
    if let Err(e) = copied {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    let _guard = store.lock().map_err(io_err("lock"))?;
    if let Some(other) = store
        .load_snapshots()
        .into_iter()
        .find(|s| s.name == snap.name)
    {
        let _ = fs::remove_dir_all(&staging);
        return Err(format!(
            "snapshot name \"{}\" already in use by {}",
            snap.name, other.id
        ));
    }
    let meta_bytes = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
    write_atomic(&members_path(store, &id), &meta_bytes).map_err(io_err("save member modes"))?;
    fs::rename(&staging, store.snap_data_dir(&id)).map_err(io_err("commit import"))?;
    store
        .save_snapshot(&snap)
        .map_err(io_err("save snapshot"))?;
    eprintln!("imported snapshot {id} as {:?}", snap.name);
    Ok(0)
}

/// Prefix of an import's staging directory, `.import-<pid>-<start>-<ID>`: the importer's pid
/// and start time (`/proc/<pid>/stat` field 22, which tells a reused pid apart) name its owner.
const STAGING_PREFIX: &str = ".import-";

/// Start time of process `pid` in clock ticks since boot (`/proc/<pid>/stat` field 22).
fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // The fields after the parenthesised command name begin at field 3; field 22 is the 20th.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Where this process stages the members of import `id` before committing them.
fn staging_dir(store: &Store, id: &str) -> PathBuf {
    let pid = std::process::id();
    let start = proc_start_time(pid).unwrap_or(0);
    store
        .snaps_dir()
        .join(format!("{STAGING_PREFIX}{pid}-{start}-{id}"))
}

/// Whether the importer that owns staging directory `name` is gone (dead, a zombie, or its pid
/// now names another process). A name without a parsable owner counts as gone.
fn staging_owner_gone(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(STAGING_PREFIX) else {
        return false;
    };
    let mut parts = rest.splitn(3, '-');
    let (Some(pid), Some(start), Some(_id)) = (parts.next(), parts.next(), parts.next()) else {
        return true;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return true;
    };
    if !pid_alive(i64::from(pid)) {
        return true;
    }
    start != 0 && proc_start_time(pid).is_some_and(|now| now != start)
}

/// Removes the staging directories of imports whose process died mid-stream (e.g. SIGKILLed by
/// a failed pull), so no partial data outlives its importer; live imports are left alone.
pub(super) fn sweep_stale_imports(store: &Store) {
    let Ok(entries) = fs::read_dir(store.snaps_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(STAGING_PREFIX) && staging_owner_gone(&name) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// Per-member mode and `COCOON.*` PAX records of an imported snapshot, kept beside its record
/// (`snapshots/<ID>.members`) so an export gives back what the import received.
type MemberMeta = BTreeMap<String, StoredMember>;

#[derive(serde::Serialize, serde::Deserialize, Default)]
struct StoredMember {
    mode: u32,
    pax: Vec<(String, String)>,
}

pub(super) fn members_path(store: &Store, id: &str) -> PathBuf {
    store.snaps_dir().join(format!("{id}.members"))
}

pub(super) fn snap_export(store: &Store, args: &[String], truncate_after: u64) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("to-dir")])?;
    let r = p.one_positional()?;
    let snap = store.resolve_snapshot(r).map_err(|e| match e {
        RefError::NotFound => format!("export: snapshot \"{r}\": snapshot not found"),
        RefError::Ambiguous => format!("export: ambiguous ref \"{r}\": multiple matches"),
    })?;
    let _lease = Lease::take(store, &snap.id);
    let mut config = snap.clone();
    config.created_at = None;
    let envelope = SnapshotEnvelope { config, version: 1 };
    let mut env_bytes = serde_json::to_vec_pretty(&envelope).map_err(|e| e.to_string())?;
    env_bytes.push(b'\n');
    let data = store.snap_data_dir(&snap.id);
    let mut names: Vec<String> = fs::read_dir(&data)
        .map_err(io_err("read snapshot dir"))?
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    if let Some(dir) = p.get("to-dir") {
        let dir = Path::new(dir);
        fs::create_dir_all(dir).map_err(io_err("create dir"))?;
        write_atomic(&dir.join("snapshot.json"), &env_bytes).map_err(io_err("write envelope"))?;
        for n in &names {
            fs::copy(data.join(n), dir.join(n)).map_err(io_err("copy member"))?;
        }
        return Ok(0);
    }
    let target = p.get("output").ok_or("export: --output is required")?;
    // Modes and cocoon PAX records (sparse map) as imported; saved snapshots have none.
    let meta: MemberMeta = fs::read(members_path(store, &snap.id))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let mut out: Box<dyn Write> = if target == "-" {
        Box::new(io::BufWriter::with_capacity(256 << 10, io::stdout().lock()))
    } else {
        Box::new(io::BufWriter::new(
            fs::File::create(target).map_err(|e| format!("create {target}: {e}"))?,
        ))
    };
    if truncate_after > 0 {
        out = Box::new(Cut {
            inner: out,
            left: truncate_after,
        });
    }
    let write = (|| -> io::Result<()> {
        tar::write_member(&mut out, "snapshot.json", &env_bytes, 0o644)?;
        for n in &names {
            let mut f = fs::File::open(data.join(n))?;
            let size = f.metadata()?.len();
            let m = meta.get(n);
            if let Some(m) = m.filter(|m| !m.pax.is_empty()) {
                tar::write_pax(&mut out, n, &m.pax)?;
            }
            let mode = m.map(|m| m.mode).filter(|m| *m != 0).unwrap_or(0o644);
            tar::write_member_from(&mut out, n, size, mode, &mut f)?;
        }
        tar::finish(&mut out)?;
        out.flush()
    })();
    write.map_err(io_err("export"))?;
    Ok(0)
}

/// A writer that passes `left` bytes and then fails (the `truncate_after` fault).
struct Cut<W: Write> {
    inner: W,
    left: u64,
}

impl<W: Write> Write for Cut<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.left == 0 {
            let _ = self.inner.flush();
            return Err(io::Error::other("injected fault: export stream cut"));
        }
        let n = (buf.len() as u64).min(self.left) as usize;
        let n = self.inner.write(&buf[..n])?;
        self.left -= n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
