//! The fake's `snapshot` and `image` verbs: save/inspect/rm/list/import/export, pull/inspect/import.
//! Archives use the 4.6 layout (`snapshot.json` envelope first); data streams are never buffered whole.

use super::cli::{self, flag, flag_s, val, val_s};
use super::store::{display_state, new_id, now_rfc3339, pid_alive, write_atomic, RefError, Store};
use super::{guest_fs, tar, CmdResult, VerbFault};
use crate::vm::types::{Image, Snapshot, SnapshotEnvelope};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

pub const SNAPSHOT_VERBS: &[&str] = &["save", "inspect", "rm", "list", "ls", "import", "export"];
pub const IMAGE_VERBS: &[&str] = &["pull", "inspect", "import", "list", "ls", "rm"];

fn io_err(what: &str) -> impl Fn(io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn print_json<T: serde::Serialize>(v: &T) -> CmdResult {
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    println!("{text}");
    Ok(0)
}

pub fn snapshot(store: &Store, verb: &str, args: &[String], fault: &VerbFault) -> CmdResult {
    sweep_stale_imports(store);
    match verb {
        "save" => save(store, args, fault),
        "inspect" => snap_inspect(store, args),
        "rm" => snap_rm(store, args),
        "list" | "ls" => snap_list(store, args),
        "import" => snap_import(store, args, discard_mode()),
        "export" => snap_export(store, args, fault.truncate_after),
        _ => Ok(0),
    }
}

pub fn image(store: &Store, verb: &str, args: &[String]) -> CmdResult {
    match verb {
        "pull" => pull(store, args),
        "inspect" => image_inspect(store, args),
        "import" => image_import(store, args, discard_mode()),
        "list" | "ls" => image_list(store, args),
        "rm" => image_rm(store, args),
        _ => Ok(0),
    }
}

fn memory_file_size() -> usize {
    std::env::var("FAKE_COCOON_SNAPSHOT_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256 << 10)
}

/// A name must be a plain file name inside an archive or snapshot directory.
fn safe_member(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

fn save(store: &Store, args: &[String], fault: &VerbFault) -> CmdResult {
    let p = cli::parse(args, &[val("name"), val("description")])?;
    let [vm_ref] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let mut sv = store.resolve_vm(vm_ref).map_err(|e| match e {
        RefError::NotFound => format!("save: vm {vm_ref}: VM not found"),
        RefError::Ambiguous => format!("ambiguous ref \"{vm_ref}\": multiple matches"),
    })?;
    if display_state(&sv.vm) != "running" {
        return Err(format!("save: vm {} is not running", sv.vm.id));
    }
    let id = new_id();
    let name = p.get("name").unwrap_or(&id).to_string();
    {
        let _guard = store.lock().map_err(io_err("lock"))?;
        if let Some(other) = store.load_snapshots().into_iter().find(|s| s.name == name) {
            let _ = other;
            return Err(format!("snapshot name \"{name}\" already exists"));
        }
        // Reserve the name with a pending marker (`<ID> <saver pid>`) so concurrent saves
        // collide. A save that dies half-way leaves it: the half-saved record, invisible to
        // inspect and list, holds the name until `snapshot rm <ID>` removes it.
        let pending = store
            .snaps_dir()
            .join(format!(".pending-{}", hex_name(&name)));
        if let Some((holder, _)) = read_pending(&pending) {
            return Err(format!(
                "snapshot name \"{name}\" already in use by {holder}"
            ));
        }
        fs::write(&pending, format!("{id} {}", std::process::id()))
            .map_err(io_err("reserve name"))?;
    }
    let data = store.snap_data_dir(&id);
    let result = (|| -> Result<(), String> {
        fs::create_dir_all(&data).map_err(io_err("create snapshot dir"))?;
        if fault.slow_ms > 0 {
            // A long save (a big memory image): the window in which a killed save is cut short.
            std::thread::sleep(std::time::Duration::from_millis(fault.slow_ms));
        }
        guest_fs::copy(&store.run_dir(&sv.vm), &data)?;
        let mem = vec![0xa5u8; memory_file_size()];
        let files: Vec<(&str, Vec<u8>)> = if sv.vm.is_firecracker() {
            vec![
                ("vmstate", b"fake firecracker vmstate\n".to_vec()),
                ("mem", mem),
                ("cow.raw", vec![0x5a; 64 << 10]),
                ("cocoon.json", b"{\"storage\":[]}\n".to_vec()),
            ]
        } else {
            let disk = if sv.vm.config.image_type == "cloudimg" {
                "overlay.qcow2"
            } else {
                "cow.raw"
            };
            vec![
                (
                    "config.json",
                    serde_json::to_vec_pretty(&sv.vm.config).unwrap_or_default(),
                ),
                ("state.json", b"{\"fake\":true}\n".to_vec()),
                ("memory-ranges", mem),
                ("cocoon.json", b"{\"storage\":[]}\n".to_vec()),
                (disk, vec![0x5a; 64 << 10]),
            ]
        };
        for (f, bytes) in files {
            fs::write(data.join(f), bytes).map_err(io_err("write snapshot data"))?;
        }
        Ok(())
    })();
    let pending = store
        .snaps_dir()
        .join(format!(".pending-{}", hex_name(&name)));
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&data);
        let _ = fs::remove_file(&pending);
        return Err(e);
    }
    let c = &sv.vm.config;
    let mut blobs = std::collections::BTreeMap::new();
    if let Some(hex) = c.image_digest.strip_prefix("sha256:") {
        blobs.insert(hex.to_string(), serde_json::json!({}));
    }
    let snap = Snapshot {
        cpu: c.cpu,
        memory: c.memory,
        storage: c.storage,
        image: c.image.clone(),
        image_digest: c.image_digest.clone(),
        image_type: c.image_type.clone(),
        network: c.network.clone(),
        no_direct_io: c.no_direct_io,
        windows: c.windows,
        id: id.clone(),
        name: name.clone(),
        description: p.get("description").unwrap_or("").to_string(),
        image_blob_ids: blobs,
        hypervisor: sv.vm.hypervisor.clone(),
        nics: sv.vm.network_configs.len() as u64,
        created_at: Some(now_rfc3339()),
        ..Default::default()
    };
    {
        let _guard = store.lock().map_err(io_err("lock"))?;
        store
            .save_snapshot(&snap)
            .map_err(io_err("save snapshot"))?;
        let _ = fs::remove_file(&pending);
        if store.vm_path(&sv.vm.id).exists() {
            if let Ok(fresh) = store.resolve_vm(&sv.vm.id) {
                sv = fresh;
            }
            sv.vm.snapshot_ids.insert(id.clone(), serde_json::json!({}));
            let _ = store.save_vm(&sv);
        }
    }
    eprintln!("snapshot {id} saved as {name:?}");
    Ok(0)
}

/// A pending save marker: the ID it reserved and the pid of its saver.
fn read_pending(path: &Path) -> Option<(String, i64)> {
    let text = fs::read_to_string(path).ok()?;
    let mut words = text.split_whitespace();
    let id = words.next()?.to_string();
    let pid = words.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    Some((id, pid))
}

/// `snapshot rm <ID>` of a half-saved record: removed once its saver is gone; while the save
/// still runs the record is in use. None: no pending record has this ID.
fn rm_half_saved(store: &Store, r: &str) -> Option<Result<(), String>> {
    let entries = fs::read_dir(store.snaps_dir()).ok()?;
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with(".pending-") {
            continue;
        }
        let Some((id, pid)) = read_pending(&e.path()) else {
            continue;
        };
        if id != r {
            continue;
        }
        if pid > 0 && pid_alive(pid) {
            return Some(Err(format!(
                "rm: snapshot {id} is in use by an active save"
            )));
        }
        let _ = fs::remove_dir_all(store.snap_data_dir(&id));
        let _ = fs::remove_file(e.path());
        eprintln!("removed half-saved snapshot {id}");
        return Some(Ok(()));
    }
    None
}

fn hex_name(name: &str) -> String {
    name.bytes().map(|b| format!("{b:02x}")).collect()
}

fn snap_inspect(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let s = store.resolve_snapshot(r).map_err(|e| match e {
        RefError::NotFound => "inspect: snapshot not found".to_string(),
        RefError::Ambiguous => format!("inspect: ambiguous ref \"{r}\": multiple matches"),
    })?;
    print_json(&s)
}

fn leases_dir(store: &Store) -> PathBuf {
    store.state.join("leases")
}

/// A read lease on a snapshot held while this process exports it.
struct Lease(PathBuf);

impl Lease {
    fn take(store: &Store, id: &str) -> Lease {
        let dir = leases_dir(store);
        let _ = fs::create_dir_all(&dir);
        let path = dir.join(format!("{id}.{}", std::process::id()));
        let _ = fs::write(&path, b"export");
        Lease(path)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

fn lease_held(store: &Store, id: &str) -> bool {
    let Ok(entries) = fs::read_dir(leases_dir(store)) else {
        return false;
    };
    entries.flatten().any(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        match name.rsplit_once('.') {
            Some((sid, pid)) if sid == id => pid.parse::<i64>().map(pid_alive).unwrap_or(false),
            _ => false,
        }
    })
}

fn snap_rm(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag_s("force", 'f')])?;
    if p.positionals.is_empty() {
        return Err("requires at least 1 arg(s), only received 0".into());
    }
    let _guard = store.lock().map_err(io_err("lock"))?;
    let mut targets = Vec::new();
    for r in &p.positionals {
        if store.resolve_snapshot(r).is_err() {
            if let Some(done) = rm_half_saved(store, r) {
                done?;
                continue;
            }
        }
        let s = store.resolve_snapshot(r).map_err(|e| match e {
            RefError::NotFound => format!("rm: resolve \"{r}\": snapshot not found"),
            RefError::Ambiguous => format!("rm: ambiguous ref \"{r}\": multiple matches"),
        })?;
        if lease_held(store, &s.id) {
            return Err(format!(
                "rm: snapshot {} is in use by an active clone/restore/export",
                s.id
            ));
        }
        targets.push(s);
    }
    for s in targets {
        let _ = fs::remove_file(store.snap_path(&s.id));
        let _ = fs::remove_file(members_path(store, &s.id));
        let _ = fs::remove_dir_all(store.snap_data_dir(&s.id));
        eprintln!("removed snapshot {}", s.id);
    }
    Ok(0)
}

fn snap_list(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("format")])?;
    let snaps = store.load_snapshots();
    if p.get("output") == Some("json") || p.get("format") == Some("json") {
        return print_json(&snaps);
    }
    if snaps.is_empty() {
        println!("No snapshots found.");
        return Ok(0);
    }
    for s in snaps {
        println!("{:<28} {}", s.id, s.name);
    }
    Ok(0)
}

/// Opens the import input: a file or stdin, transparently gunzipped (magic `1f 8b`).
fn open_input(file: Option<&str>) -> Result<Box<dyn Read>, String> {
    let raw: Box<dyn Read> = match file {
        Some(f) if f != "-" => Box::new(fs::File::open(f).map_err(|e| format!("open {f}: {e}"))?),
        _ => Box::new(io::stdin().lock()),
    };
    let mut buffered = BufReader::with_capacity(64 << 10, raw);
    let head = buffered.fill_buf().map_err(io_err("read input"))?;
    if head.len() >= 2 && head[0] == 0x1f && head[1] == 0x8b {
        Ok(Box::new(flate2::read::MultiGzDecoder::new(buffered)))
    } else {
        Ok(Box::new(buffered))
    }
}

fn drain(input: &mut dyn Read) {
    let _ = io::copy(input, &mut io::sink());
}

/// `FAKE_COCOON_IMPORT_DISCARD=1`: `snapshot import` and `image import` check the stream's
/// framing and keep nothing, so a benchmark measures the transport rather than the disk.
fn discard_mode() -> bool {
    std::env::var("FAKE_COCOON_IMPORT_DISCARD").as_deref() == Ok("1")
}

/// Reads a whole tar stream, checking every header checksum, body length, padding and the
/// end-of-archive marker, and writes nothing. A snapshot archive must open with a parsable
/// `snapshot.json`. Returns (members, body bytes).
fn discard_archive(input: &mut dyn Read, snapshot: bool) -> Result<(u64, u64), String> {
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

fn snap_import(store: &Store, args: &[String], discard: bool) -> CmdResult {
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
fn sweep_stale_imports(store: &Store) {
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

fn members_path(store: &Store, id: &str) -> PathBuf {
    store.snaps_dir().join(format!("{id}.members"))
}

fn snap_export(store: &Store, args: &[String], truncate_after: u64) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("to-dir")])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
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

fn image_id_for(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn pull(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag("force"), val_s("output", 'o')])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let cloud = r.starts_with("http://") || r.starts_with("https://");
    if store.resolve_image(r).is_some() && !p.has("force") {
        println!("{r}: up to date");
        return Ok(0);
    }
    if cloud {
        print!("\rDownloading {r}:  50%");
        print!("\rDownloading {r}: 100%\n");
    }
    let img = Image {
        id: image_id_for(r.as_bytes()),
        name: r.clone(),
        kind: if cloud { "cloudimg" } else { "oci" }.into(),
        size: 64 << 20,
        created_at: Some(now_rfc3339()),
    };
    let _guard = store.lock().map_err(io_err("lock"))?;
    store.save_image(&img).map_err(io_err("save image"))?;
    Ok(0)
}

fn image_inspect(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let img = store
        .resolve_image(r)
        .ok_or_else(|| format!("image \"{r}\": not found in any backend"))?;
    print_json(&img)
}

/// `image import` in discard mode: a tar (OCI) image has its framing checked, a qcow2 image is
/// read to EOF; nothing is stored or registered.
fn discard_image(input: &mut dyn Read) -> CmdResult {
    let mut head = Vec::with_capacity(512);
    input
        .take(512)
        .read_to_end(&mut head)
        .map_err(io_err("import: read input"))?;
    let mut whole = io::Cursor::new(head.clone()).chain(input);
    if head.len() >= 262 && &head[257..262] == b"ustar" {
        let (members, bytes) = discard_archive(&mut whole, false)?;
        drain(&mut whole);
        eprintln!("discarded image archive: {members} members, {bytes} bytes");
        return Ok(0);
    }
    if !head.starts_with(b"QFI\xfb") {
        return Err("import: unrecognised image format (want qcow2 or tar)".into());
    }
    let total = io::copy(&mut whole, &mut io::sink()).map_err(io_err("import: read input"))?;
    eprintln!("discarded qcow2 image: {total} bytes");
    Ok(0)
}

fn image_import(store: &Store, args: &[String], discard: bool) -> CmdResult {
    let p = cli::parse(args, &[val("type")])?;
    let Some(name) = p.positionals.first().cloned() else {
        return Err("requires at least 1 arg(s), only received 0".into());
    };
    let mut input = open_input(p.positionals.get(1).map(String::as_str))?;
    if discard {
        return discard_image(&mut *input);
    }
    let mut hasher = Sha256::new();
    let mut head = Vec::with_capacity(512);
    let mut total: u64 = 0;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("import: read input: {e}")),
        };
        if head.len() < 512 {
            let take = (512 - head.len()).min(n);
            head.extend_from_slice(&buf[..take]);
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    if total == 0 {
        return Err("import: empty input".into());
    }
    let kind = if head.starts_with(b"QFI\xfb") {
        "cloudimg"
    } else if head.len() >= 262 && &head[257..262] == b"ustar" {
        "oci"
    } else {
        return Err("import: unrecognised image format (want qcow2 or tar)".into());
    };
    let hex: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let img = Image {
        id: format!("sha256:{hex}"),
        name,
        kind: kind.into(),
        size: total,
        created_at: Some(now_rfc3339()),
    };
    let _guard = store.lock().map_err(io_err("lock"))?;
    // Re-importing a name replaces the older record.
    for old in store
        .load_images()
        .into_iter()
        .filter(|i| i.name == img.name)
    {
        let _ = fs::remove_file(
            store
                .images_dir()
                .join(format!("{}.json", old.id.trim_start_matches("sha256:"))),
        );
    }
    store.save_image(&img).map_err(io_err("save image"))?;
    Ok(0)
}

fn image_list(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("format")])?;
    let imgs = store.load_images();
    if p.get("output") == Some("json") || p.get("format") == Some("json") {
        return print_json(&imgs);
    }
    if imgs.is_empty() {
        println!("No images found.");
    }
    for i in imgs {
        println!("{:<72} {:<9} {}", i.id, i.kind, i.name);
    }
    Ok(0)
}

fn image_rm(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag_s("force", 'f')])?;
    let _guard = store.lock().map_err(io_err("lock"))?;
    for r in &p.positionals {
        let img = store
            .resolve_image(r)
            .ok_or_else(|| format!("image \"{r}\": not found in any backend"))?;
        let _ = fs::remove_file(
            store
                .images_dir()
                .join(format!("{}.json", img.id.trim_start_matches("sha256:"))),
        );
    }
    Ok(0)
}
