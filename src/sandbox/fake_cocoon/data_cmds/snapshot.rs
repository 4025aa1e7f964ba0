//! `snapshot save | inspect | rm | list`: a save reserves its name with a pending marker, an
//! export holds a lease that `rm` respects.

use super::super::cli::{self, flag_s, val, val_s};
use super::super::store::{display_state, new_id, now_rfc3339, pid_alive, RefError, Store};
use super::super::{guest_fs, io_err, print_json, CmdResult, VerbFault};
use super::archive::members_path;
use super::memory_file_size;
use crate::vm::types::Snapshot;
use std::fs;
use std::path::{Path, PathBuf};

pub(super) fn save(store: &Store, args: &[String], fault: &VerbFault) -> CmdResult {
    let p = cli::parse(args, &[val("name"), val("description")])?;
    let vm_ref = p.one_positional()?;
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

pub(super) fn snap_inspect(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    let r = p.one_positional()?;
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
pub(super) struct Lease(PathBuf);

impl Lease {
    pub(super) fn take(store: &Store, id: &str) -> Lease {
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

pub(super) fn snap_rm(store: &Store, args: &[String]) -> CmdResult {
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

pub(super) fn snap_list(store: &Store, args: &[String]) -> CmdResult {
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
