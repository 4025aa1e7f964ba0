//! The fake's `vm clone` and `vm run` / `vm create`: a new VM record, its disks and NICs.
//! Boots it (optionally behind a real backing process) when asked.

use std::fs;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::super::cli::{self, flag, val, val_s, Flag, Parsed};
use super::super::store::{
    new_id, new_mac, now_rfc3339, tap_name, RefError, Store, StoredVm, VerbFault,
};
use super::super::{guest_fs, CmdResult};
use super::{io_err, json_out, opt_num, parse_size, print_json, save_existing, valid_vm_name};
use crate::vm::types::{
    NetworkConfig, NicAddress, Snapshot, SnapshotEnvelope, StorageConfig, Vm, VmConfig,
};

pub(super) const CLONE_FLAGS: &[Flag] = &[
    val_s("output", 'o'),
    val("name"),
    val("cpu"),
    val("memory"),
    val("storage"),
    val("nics"),
    flag("on-demand"),
    val("restore-mode"),
    val("from-dir"),
    flag("pull"),
    val("network"),
    flag("no-direct-io"),
    val("cpu-weight"),
    val("cpu-quota-us"),
    val("cpu-period-us"),
];

pub(super) const RUN_FLAGS: &[Flag] = &[
    val_s("output", 'o'),
    val("name"),
    val("cpu"),
    val("memory"),
    val("storage"),
    val("nics"),
    val("network"),
    flag("windows"),
    flag("fc"),
    flag("no-direct-io"),
    val("cpu-weight"),
    val("cpu-quota-us"),
    val("cpu-period-us"),
];

pub(super) fn spawn_backing_process(store: &Store, id: &str, name: &str) -> Result<i64, String> {
    if !store.backs_with_process(name) {
        return Ok(0);
    }
    let exe = std::env::current_exe().map_err(io_err("locate own binary"))?;
    let child = Command::new(exe)
        .arg("fake-cocoon")
        .arg("__vm-process")
        .arg(store.vm_path(id))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(io_err("start hypervisor"))?;
    Ok(child.id() as i64)
}

/// Creates the run dir, the COW (or overlay) disk and the console log of a VM being started.
pub(super) fn prepare_disks(store: &Store, vm: &mut Vm) -> Result<(), String> {
    let run_dir = store.run_dir(vm);
    fs::create_dir_all(&run_dir).map_err(io_err("create run dir"))?;
    let (file, role, serial) = if vm.config.image_type == "cloudimg" {
        ("overlay.qcow2", "cow", "cocoon-cow")
    } else {
        ("cow.raw", "cow", "cocoon-cow")
    };
    let disk = run_dir.join(file);
    if !disk.exists() {
        let mut f = fs::File::create(&disk).map_err(io_err("create disk"))?;
        // A little real data so "allocated blocks" metrics are non-zero; the rest is sparse.
        f.write_all(&[0x5a; 64 << 10])
            .map_err(io_err("write disk"))?;
        let size = if vm.config.storage > 0 {
            vm.config.storage
        } else {
            10 << 30
        };
        f.set_len(size).map_err(io_err("size disk"))?;
    }
    vm.storage_configs = vec![StorageConfig {
        path: disk.display().to_string(),
        ro: false,
        serial: serial.into(),
        role: role.into(),
        ..Default::default()
    }];
    if !vm.is_firecracker() {
        vm.socket_path = run_dir.join("api.sock").display().to_string();
    } else {
        vm.socket_path = run_dir.join("fc.sock").display().to_string();
    }
    vm.vsock_socket = run_dir.join("vsock.sock").display().to_string();
    Ok(())
}

pub(super) fn append_console(store: &Store, vm: &Vm, line: &str) {
    let path = store.console_log(vm);
    if let Some(dir) = path.parent() {
        let _ = fs::create_dir_all(dir);
    }
    if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{} {line}", now_rfc3339());
    }
}

/// Starts a VM record: disks, backing process, `running`.
pub(super) fn boot(store: &Store, sv: &mut StoredVm, reason: &str) -> Result<(), String> {
    prepare_disks(store, &mut sv.vm)?;
    let pid = spawn_backing_process(store, &sv.vm.id, &sv.vm.config.name)?;
    let now = now_rfc3339();
    sv.vm.pid = pid;
    sv.vm.state = "running".into();
    sv.vm.first_booted = true;
    sv.vm.started_at = Some(now.clone());
    sv.vm.stopped_at = None;
    sv.vm.updated_at = now.clone();
    sv.vm.last_transition_reason = reason.into();
    sv.vm.last_transition_at = Some(now);
    sv.vm.transition_generation += 1;
    sv.owner_pid = 0;
    if store.backs_with_process(&sv.vm.config.name) {
        let _ = fs::write(
            store.run_dir(&sv.vm).join(if sv.vm.is_firecracker() {
                "fc.pid"
            } else {
                "ch.pid"
            }),
            pid.to_string(),
        );
    }
    append_console(
        store,
        &sv.vm,
        &format!(
            "fake hypervisor: booting {} ({})",
            sv.vm.id, sv.vm.config.name
        ),
    );
    append_console(store, &sv.vm, "fake guest: login prompt ready");
    Ok(())
}

pub(super) fn nics_for(store: &Store, id: &str, count: u64) -> Vec<NetworkConfig> {
    (0..count as usize)
        .map(|i| NetworkConfig {
            tap: tap_name(id, i),
            mac: new_mac(),
            num_queues: 2,
            queue_size: 256,
            backend: "cni".into(),
            netns_path: format!("/var/run/netns/cocoon-{id}"),
            // DHCP mode: the address comes from the lease file, as with cocoon-net.
            network: store.leases.is_none().then(|| NicAddress {
                ip: store.next_ip(),
                gateway: "127.88.0.1".into(),
                prefix: 16,
            }),
            bridge_dev: String::new(),
        })
        .collect()
}

/// Writes the `creating` placeholder under the lock (name must be free). Returns the record.
pub(super) fn placeholder(store: &Store, mut vm: Vm, nics: u64) -> Result<StoredVm, String> {
    let _guard = store.lock().map_err(io_err("lock"))?;
    if let Some(other) = store.vm_by_name(&vm.config.name) {
        return Err(format!(
            "vm name \"{}\" already exists (id: {})",
            vm.config.name, other.vm.id
        ));
    }
    let now = now_rfc3339();
    vm.state = "creating".into();
    vm.created_at = now.clone();
    vm.updated_at = now.clone();
    vm.last_transition_reason = "create".into();
    vm.last_transition_at = Some(now);
    vm.network_configs = nics_for(store, &vm.id, nics);
    let sv = StoredVm {
        vm,
        owner_pid: std::process::id(),
    };
    store.save_vm(&sv).map_err(io_err("save vm"))?;
    store.journal("ADDED", &sv.vm.id);
    Ok(sv)
}

pub(super) fn read_snapshot_dir(dir: &str) -> Result<Snapshot, String> {
    let path = Path::new(dir).join("snapshot.json");
    let bytes = fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
    let env: SnapshotEnvelope =
        serde_json::from_slice(&bytes).map_err(|e| format!("parse {}: {e}", path.display()))?;
    if env.version != 1 {
        return Err(format!(
            "unsupported snapshot envelope version {}",
            env.version
        ));
    }
    Ok(env.config)
}

/// The hypervisor a new VM runs under: firecracker when asked (`--fc`, or a firecracker snapshot).
fn hypervisor(fc: bool) -> String {
    if fc {
        "firecracker"
    } else {
        "cloud-hypervisor"
    }
    .into()
}

/// The snapshot a clone starts from (a stored one, or `--from-dir`) and the disk that
/// carries the guest's files.
fn clone_source(store: &Store, p: &Parsed) -> Result<(Snapshot, std::path::PathBuf), String> {
    let from_dir = p.get("from-dir").map(str::to_string);
    let snap = match (&from_dir, p.positionals.as_slice()) {
        (Some(_), [_, ..]) => {
            return Err("--from-dir cannot be combined with a snapshot argument".into())
        }
        (Some(dir), []) => read_snapshot_dir(dir)?,
        (None, [r]) => store.resolve_snapshot(r).map_err(|e| match e {
            RefError::NotFound => format!("clone: snapshot \"{r}\": snapshot not found"),
            RefError::Ambiguous => format!("ambiguous ref \"{r}\": multiple matches"),
        })?,
        (None, other) => return Err(format!("accepts 1 arg(s), received {}", other.len())),
    };
    // The disk the clone starts from: it carries the guest's files.
    let source_disk = match &from_dir {
        Some(dir) => std::path::PathBuf::from(dir),
        None => store.snap_data_dir(&snap.id),
    };
    Ok((snap, source_disk))
}

pub(super) fn clone(store: &Store, args: &[String], fault: &VerbFault) -> CmdResult {
    let p = cli::parse(args, CLONE_FLAGS)?;
    let (snap, source_disk) = clone_source(store, &p)?;
    let fc = snap.hypervisor == "firecracker";
    let cpu = opt_num(&p, "cpu")?;
    if cpu > 0 && snap.cpu > 0 {
        if fc && cpu != snap.cpu {
            return Err(format!(
                "--cpu {cpu} differs from snapshot cpu {} (firecracker)",
                snap.cpu
            ));
        }
        if cpu < snap.cpu {
            return Err(format!("--cpu {cpu} below snapshot minimum {}", snap.cpu));
        }
    }
    let memory = match p.get("memory") {
        Some(m) if fc => return Err(format!("--memory {m} not supported for firecracker clones")),
        Some(m) => parse_size(m)?,
        None => 0,
    };
    if memory > 0 && memory < snap.memory {
        return Err(format!(
            "--memory {memory} below snapshot minimum {}",
            snap.memory
        ));
    }
    let storage = match p.get("storage") {
        Some(s) => parse_size(s)?,
        None => 0,
    };
    let nics = match p.num("nics")? {
        Some(n) if fc && snap.nics > 0 && n != snap.nics => {
            return Err(format!(
                "--nics {n} differs from snapshot nics {} (firecracker)",
                snap.nics
            ))
        }
        Some(n) => n,
        None => snap.nics.max(1),
    };
    if let Some(mode) = p.get("restore-mode") {
        if !["copy", "ondemand", "mmap"].contains(&mode) {
            return Err(format!(
                "invalid --restore-mode {mode:?} (copy|ondemand|mmap)"
            ));
        }
    }
    let id = new_id();
    let name = match p.get("name") {
        Some(n) => n.to_string(),
        None => format!("cocoon-clone-{}", &id[..8]),
    };
    if !valid_vm_name(&name) {
        return Err(format!("invalid VM name {name:?}"));
    }
    let vm = Vm {
        id: id.clone(),
        hypervisor: hypervisor(fc),
        config: VmConfig {
            cpu: cpu.max(snap.cpu),
            memory: memory.max(snap.memory),
            storage: storage.max(snap.storage),
            image: snap.image.clone(),
            image_digest: snap.image_digest.clone(),
            image_type: snap.image_type.clone(),
            network: p
                .get("network")
                .map(str::to_string)
                .unwrap_or(snap.network.clone()),
            no_direct_io: p.has("no-direct-io"),
            windows: snap.windows,
            name,
            cpu_weight: opt_num(&p, "cpu-weight")?,
            cpu_quota_us: opt_num(&p, "cpu-quota-us")?,
            cpu_period_us: opt_num(&p, "cpu-period-us")?,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut sv = placeholder(store, vm, nics)?;
    if fault.placeholder_only {
        return Err("clone: injected crash after placeholder".into());
    }
    if fault.slow_ms > 0 {
        std::thread::sleep(Duration::from_millis(fault.slow_ms));
    }
    let booted = boot(store, &mut sv, "clone")
        .and_then(|()| guest_fs::copy(&source_disk, &store.run_dir(&sv.vm)));
    if let Err(e) = booted {
        // Rollback: a failed clone leaves nothing behind.
        let _guard = store.lock();
        store.delete_vm(&id);
        store.journal("DELETED", &id);
        return Err(format!("clone: {e}"));
    }
    save_existing(store, &sv, "MODIFIED")?;
    let mut printed = sv.vm.clone();
    printed.pid = 0;
    if json_out(&p, "output") {
        print_json(&printed)
    } else {
        println!("Cloned VM {} ({})", printed.id, printed.config.name);
        println!("Hint: cocoon vm console {}", printed.id);
        Ok(0)
    }
}

/// `cocoon-<repo>[-<tag>]`, sanitised to the name rules, at most 63 characters.
pub(super) fn default_run_name(image: &str) -> String {
    let last = image
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(image);
    let base = last.split('@').next().unwrap_or(last);
    let (repo, tag) = match base.split_once(':') {
        Some((r, t)) => (r, Some(t)),
        None => (base, None),
    };
    let mut name = format!("cocoon-{repo}");
    if let Some(t) = tag {
        name.push('-');
        name.push_str(t);
    }
    let mut clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    clean.truncate(63);
    clean
}

pub(super) fn run(store: &Store, args: &[String], fault: &VerbFault, start: bool) -> CmdResult {
    let p = cli::parse(args, RUN_FLAGS)?;
    let image_ref = p.one_positional()?;
    let image = store
        .resolve_image(image_ref)
        .ok_or_else(|| format!("image \"{image_ref}\": not found in any backend"))?;
    let cpu = p.num("cpu")?.unwrap_or(2);
    let memory = parse_size(p.get("memory").unwrap_or("1G"))?;
    let storage = parse_size(p.get("storage").unwrap_or("10G"))?;
    let windows = p.has("windows");
    let fc = p.has("fc");
    if cpu < 1 {
        return Err("--cpu must be at least 1".into());
    }
    if memory < 512 << 20 {
        return Err(format!("--memory {memory} below minimum 512M"));
    }
    if storage < 10 << 30 {
        return Err(format!("--storage {storage} below minimum 10G"));
    }
    if fc && windows {
        return Err("--fc cannot be combined with --windows".into());
    }
    if fc && image.kind != "oci" {
        return Err("--fc requires an OCI image".into());
    }
    if windows && image.kind != "cloudimg" {
        return Err("--windows requires a cloud image".into());
    }
    let name = p
        .get("name")
        .map(str::to_string)
        .unwrap_or_else(|| default_run_name(image_ref));
    if !valid_vm_name(&name) {
        return Err(format!("invalid VM name {name:?}"));
    }
    let vm = Vm {
        id: new_id(),
        hypervisor: hypervisor(fc),
        config: VmConfig {
            cpu,
            memory,
            storage,
            image: image.name.clone(),
            image_digest: image.id.clone(),
            image_type: image.kind.clone(),
            network: p.get("network").unwrap_or("").to_string(),
            no_direct_io: p.has("no-direct-io"),
            windows,
            name,
            cpu_weight: opt_num(&p, "cpu-weight")?,
            cpu_quota_us: opt_num(&p, "cpu-quota-us")?,
            cpu_period_us: opt_num(&p, "cpu-period-us")?,
            ..Default::default()
        },
        ..Default::default()
    };
    let nics = p.num("nics")?.unwrap_or(1);
    let mut sv = placeholder(store, vm, nics)?;
    if fault.placeholder_only {
        return Err("run: injected crash after placeholder".into());
    }
    if fault.slow_ms > 0 {
        std::thread::sleep(Duration::from_millis(fault.slow_ms));
    }
    sv.vm.state = "created".into();
    sv.owner_pid = 0;
    save_existing(store, &sv, "MODIFIED")?;
    let pre_start = sv.vm.clone();
    if start {
        if let Err(e) = boot(store, &mut sv, "boot") {
            sv.vm.state = "error".into();
            let _ = save_existing(store, &sv, "MODIFIED");
            return Err(format!("start: {e}"));
        }
        save_existing(store, &sv, "MODIFIED")?;
    }
    let printed = if fault.print_created {
        pre_start
    } else {
        sv.vm
    };
    if json_out(&p, "output") {
        print_json(&printed)
    } else {
        println!("Started VM {} ({})", printed.id, printed.config.name);
        Ok(0)
    }
}
