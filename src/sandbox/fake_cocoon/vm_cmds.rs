//! The fake's `vm` verbs (clone, run, inspect, list, rm, start, stop, status, exec, logs, net,
//! reconcile-stale-create) and the test-only `fake` verbs. State access goes through `store`.

use super::cli::{self, flag, flag_s, val, val_s, Flag, Parsed};
use super::store::{
    display_state, kill_pid, new_id, new_mac, now_rfc3339, pid_alive, tap_name, RefError, Store,
    StoredVm, VerbFault,
};
use super::{guest_fs, stream, CmdResult};
use crate::vm::types::{
    NetworkConfig, NicAddress, Snapshot, SnapshotEnvelope, StorageConfig, Vm, VmConfig,
};
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

pub const VERBS: &[&str] = &[
    "clone",
    "run",
    "create",
    "inspect",
    "list",
    "ls",
    "rm",
    "start",
    "stop",
    "status",
    "exec",
    "logs",
    "net",
    "reconcile-stale-create",
];

const CLONE_FLAGS: &[Flag] = &[
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

const RUN_FLAGS: &[Flag] = &[
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

pub fn dispatch(store: &Store, verb: &str, args: &[String], fault: &VerbFault) -> CmdResult {
    match verb {
        "clone" => clone(store, args, fault),
        "run" | "create" => run(store, args, fault, verb == "run"),
        "inspect" => inspect(store, args),
        "list" | "ls" => list(store, args),
        "rm" => rm(store, args),
        "start" => start(store, args),
        "stop" => stop(store, args),
        "status" => status(store, args, fault),
        "exec" => exec(store, args),
        "logs" => logs(store, args),
        "net" => net(store, args),
        "reconcile-stale-create" => reconcile_stale_create(store, args),
        _ => Ok(0),
    }
}

fn json_out(p: &Parsed, key: &str) -> bool {
    p.get(key) == Some("json")
}

fn print_json<T: serde::Serialize>(v: &T) -> CmdResult {
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
    Ok(0)
}

fn io_err(what: &str) -> impl Fn(io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$`
fn valid_vm_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

/// cocoon size strings: plain bytes or binary suffixes (`512M`, `4G`, `4GiB`).
fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    let n: u64 = num.parse().map_err(|_| format!("invalid size {text:?}"))?;
    let shift = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KI" | "KIB" => 10,
        "M" | "MB" | "MI" | "MIB" => 20,
        "G" | "GB" | "GI" | "GIB" => 30,
        "T" | "TB" | "TI" | "TIB" => 40,
        _ => return Err(format!("invalid size {text:?}")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("invalid size {text:?}"))
}

fn opt_num(p: &Parsed, key: &str) -> Result<u64, String> {
    Ok(p.num(key)?.unwrap_or(0))
}

fn not_found_text(store: &Store, r: &str) -> String {
    if store.gen_b {
        format!("vm {r}: VM not found")
    } else {
        format!("vm {r}: vm not found")
    }
}

fn resolve(store: &Store, r: &str) -> Result<StoredVm, String> {
    store.resolve_vm(r).map_err(|e| match e {
        RefError::NotFound => not_found_text(store, r),
        RefError::Ambiguous => format!("ambiguous ref \"{r}\": multiple matches"),
    })
}

fn spawn_backing_process(store: &Store, id: &str, name: &str) -> Result<i64, String> {
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
fn prepare_disks(store: &Store, vm: &mut Vm) -> Result<(), String> {
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

fn append_console(store: &Store, vm: &Vm, line: &str) {
    let path = store.console_log(vm);
    if let Some(dir) = path.parent() {
        let _ = fs::create_dir_all(dir);
    }
    if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{} {line}", now_rfc3339());
    }
}

/// Starts a VM record: disks, backing process, `running`.
fn boot(store: &Store, sv: &mut StoredVm, reason: &str) -> Result<(), String> {
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

fn nics_for(store: &Store, id: &str, count: u64) -> Vec<NetworkConfig> {
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
fn placeholder(store: &Store, mut vm: Vm, nics: u64) -> Result<StoredVm, String> {
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

/// Saves a record under the lock unless it was removed meanwhile.
fn save_existing(store: &Store, sv: &StoredVm, event: &str) -> Result<(), String> {
    let _guard = store.lock().map_err(io_err("lock"))?;
    if !store.vm_path(&sv.vm.id).exists() {
        kill_pid(sv.vm.pid);
        return Err(format!("vm {}: removed during operation", sv.vm.id));
    }
    store.save_vm(sv).map_err(io_err("save vm"))?;
    store.journal(event, &sv.vm.id);
    Ok(())
}

fn read_snapshot_dir(dir: &str) -> Result<Snapshot, String> {
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

fn clone(store: &Store, args: &[String], fault: &VerbFault) -> CmdResult {
    let p = cli::parse(args, CLONE_FLAGS)?;
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
        hypervisor: if fc {
            "firecracker"
        } else {
            "cloud-hypervisor"
        }
        .into(),
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
fn default_run_name(image: &str) -> String {
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

fn run(store: &Store, args: &[String], fault: &VerbFault, start: bool) -> CmdResult {
    let p = cli::parse(args, RUN_FLAGS)?;
    let [image_ref] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
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
        hypervisor: if fc {
            "firecracker"
        } else {
            "cloud-hypervisor"
        }
        .into(),
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

fn shown(store: &Store, sv: &StoredVm, reconcile: bool) -> Vm {
    let mut vm = sv.vm.clone();
    if reconcile {
        vm.state = display_state(&vm);
    }
    let _ = store;
    vm
}

fn inspect(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("format")])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let sv = store.resolve_vm(r).map_err(|e| match e {
        RefError::NotFound => format!("inspect: {}", not_found_text(store, r)),
        RefError::Ambiguous => format!("inspect: ambiguous ref \"{r}\": multiple matches"),
    })?;
    let mut vm = shown(store, &sv, true);
    if !store.gen_b && vm.state == "running" {
        vm.attached_devices = Some(serde_json::json!({"fs": [], "devices": [], "disks": []}));
    }
    print_json(&vm)
}

fn list(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("format", 'o'), flag_s("quiet", 'q')])?;
    let vms: Vec<Vm> = store
        .load_vms()
        .iter()
        .map(|sv| shown(store, sv, !store.gen_b))
        .collect();
    if p.get("format") == Some("json") {
        if vms.is_empty() && store.gen_b {
            println!("No VMs found.");
            return Ok(0);
        }
        return print_json(&vms);
    }
    if vms.is_empty() {
        println!("No VMs found.");
        return Ok(0);
    }
    println!("{:<28} {:<24} {:<16} {:>8}", "ID", "NAME", "STATE", "PID");
    for v in vms {
        if p.has("quiet") {
            println!("{}", v.id);
        } else {
            println!(
                "{:<28} {:<24} {:<16} {:>8}",
                v.id, v.config.name, v.state, v.pid
            );
        }
    }
    Ok(0)
}

fn remove_vm_files(store: &Store, vm: &Vm) {
    let _ = fs::remove_dir_all(store.run_dir(vm));
    if let Some(dir) = store.console_log(vm).parent() {
        let _ = fs::remove_dir_all(dir);
    }
}

fn rm(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag_s("force", 'f'), val_s("output", 'o')])?;
    if p.positionals.is_empty() {
        return Err("requires at least 1 arg(s), only received 0".into());
    }
    let mut targets = Vec::new();
    for r in &p.positionals {
        targets.push(resolve(store, r)?);
    }
    let mut removed = Vec::new();
    {
        let _guard = store.lock().map_err(io_err("lock"))?;
        for sv in &targets {
            let running = display_state(&sv.vm) == "running";
            if running && !p.has("force") {
                return Err(format!("vm {}: running (force required)", sv.vm.id));
            }
        }
        for sv in targets {
            kill_pid(sv.vm.pid);
            store.delete_vm(&sv.vm.id);
            store.journal("DELETED", &sv.vm.id);
            removed.push(sv.vm);
        }
    }
    for vm in &removed {
        remove_vm_files(store, vm);
        eprintln!("removed VM {}", vm.id);
    }
    if p.get("output") == Some("json") {
        let ids: Vec<&str> = removed.iter().map(|v| v.id.as_str()).collect();
        return print_json(&serde_json::json!({ "succeeded": ids }));
    }
    Ok(0)
}

fn start(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    if p.positionals.is_empty() {
        return Err("requires at least 1 arg(s), only received 0".into());
    }
    let mut started = Vec::new();
    for r in &p.positionals {
        let mut sv = resolve(store, r)?;
        if display_state(&sv.vm) == "running" {
            started.push(sv.vm.id.clone());
            continue;
        }
        if sv.vm.state == "creating" {
            return Err(format!("vm {}: still creating", sv.vm.id));
        }
        kill_pid(sv.vm.pid);
        match boot(store, &mut sv, "restart") {
            Ok(()) => save_existing(store, &sv, "MODIFIED")?,
            Err(e) => {
                sv.vm.state = "error".into();
                sv.vm.last_transition_reason = "error".into();
                let _ = save_existing(store, &sv, "MODIFIED");
                return Err(format!("start {}: {e}", sv.vm.id));
            }
        }
        started.push(sv.vm.id.clone());
    }
    if p.get("output") == Some("json") {
        return print_json(&serde_json::json!({ "succeeded": started }));
    }
    Ok(0)
}

fn mark_stopped(store: &Store, sv: &mut StoredVm, reason: &str) -> Result<(), String> {
    kill_pid(sv.vm.pid);
    let now = now_rfc3339();
    sv.vm.state = "stopped".into();
    sv.vm.pid = 0;
    sv.vm.socket_path.clear();
    sv.vm.stopped_at = Some(now.clone());
    sv.vm.updated_at = now.clone();
    sv.vm.last_transition_reason = reason.into();
    sv.vm.last_transition_at = Some(now);
    sv.vm.transition_generation += 1;
    save_existing(store, sv, "MODIFIED")
}

fn stop(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), flag_s("force", 'f')])?;
    for r in &p.positionals {
        let mut sv = resolve(store, r)?;
        mark_stopped(store, &mut sv, "stop-user")?;
    }
    Ok(0)
}

fn status(store: &Store, args: &[String], fault: &VerbFault) -> CmdResult {
    let p = cli::parse(
        args,
        &[flag("event"), val("format"), val_s("interval", 'n')],
    )?;
    let interval = Duration::from_secs(p.num("interval")?.unwrap_or(5).max(1));
    if p.has("event") {
        return Ok(stream::run(
            store,
            interval,
            p.get("format") == Some("json"),
            fault,
        ));
    }
    let vms: Vec<Vm> = store
        .load_vms()
        .iter()
        .map(|sv| shown(store, sv, true))
        .collect();
    print_json(&vms)
}

fn is_running_alive(vm: &Vm) -> bool {
    display_state(vm) == "running" && (vm.pid == 0 || pid_alive(vm.pid))
}

fn exec(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(
        args,
        &[
            flag_s("interactive", 'i'),
            val_s("env", 'e'),
            flag_s("tty", 't'),
        ],
    )?;
    // As cocoon: the first positional is the VM, the rest the command, less one leading `--`
    // (the first `--` already ended the flags, wherever it stood).
    let Some((vm_ref, command)) = p.positionals.split_first() else {
        return Err("exec: requires a VM argument".into());
    };
    let (vm_ref, mut command) = (vm_ref.clone(), command.to_vec());
    if command.first().map(String::as_str) == Some("--") {
        command.remove(0);
    }
    if command.is_empty() {
        return Err("exec: no command given".into());
    }
    let sv = resolve(store, &vm_ref)?;
    if !is_running_alive(&sv.vm) {
        return Err(format!("exec: vm {} is not running", sv.vm.id));
    }
    let mut env: Vec<String> = p.all("env").to_vec();
    env.sort();
    let interactive = p.has("interactive");
    let entry = serde_json::json!({
        "time": now_rfc3339(), "vm": sv.vm.id, "argv": command, "env": env, "stdin": interactive,
    });
    if let Ok(mut f) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(store.exec_log_path())
    {
        let _ = writeln!(f, "{entry}");
    }
    if let Some(code) = guest_fs::exec(&store.run_dir(&sv.vm), &command) {
        return Ok(code);
    }
    Ok(guest_command(
        &command,
        &env,
        interactive,
        &sv.vm.config.name,
        0,
    ))
}

/// Interprets a guest command without running anything (see the module doc).
fn guest_command(
    argv: &[String],
    env: &[String],
    interactive: bool,
    hostname: &str,
    depth: u32,
) -> i32 {
    let mut out = io::stdout().lock();
    let prog = argv.first().map(String::as_str).unwrap_or("");
    let base = prog.rsplit('/').next().unwrap_or(prog);
    let args = &argv[1.min(argv.len())..];
    let code = match base {
        "cat" if args.is_empty() => {
            if interactive {
                let _ = io::copy(&mut io::stdin().lock(), &mut out);
            }
            0
        }
        "echo" => {
            let _ = writeln!(out, "{}", args.join(" "));
            0
        }
        "true" | ":" => 0,
        "false" => 1,
        "exit" => {
            args.first()
                .and_then(|a| a.parse::<i32>().ok())
                .unwrap_or(0)
                & 0xff
        }
        "env" => {
            for e in env {
                let _ = writeln!(out, "{e}");
            }
            0
        }
        "hostname" => {
            let _ = writeln!(out, "{hostname}");
            0
        }
        "uname" => {
            let line = if args.iter().any(|a| a == "-a") {
                format!("Linux {hostname} 6.1.0-cocoon #1 SMP x86_64 GNU/Linux")
            } else {
                "Linux".to_string()
            };
            let _ = writeln!(out, "{line}");
            0
        }
        "sleep" => {
            let secs: f64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(0.0);
            if secs.is_finite() && secs > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(secs.min(86_400.0)));
            }
            0
        }
        "stderr" => {
            eprintln!("{}", args.join(" "));
            0
        }
        // A Windows guest's shells: their scripts (the post-clone NIC reset, `ipconfig /release`
        // before hibernate, `/renew` after wake) are taken as run.
        "powershell" | "cmd" if !args.is_empty() => 0,
        "sh" | "bash" | "ash" | "dash"
            if args.first().map(String::as_str) == Some("-c") && depth < 4 =>
        {
            let script = args.get(1).cloned().unwrap_or_default();
            let words: Vec<String> = script
                .split_whitespace()
                .map(|w| w.trim_matches(['\'', '"']).to_string())
                .collect();
            drop(out);
            return if words.is_empty() {
                0
            } else {
                guest_command(&words, env, interactive, hostname, depth + 1)
            };
        }
        // As a shell answers for a program it cannot find: what kubectl cp (tar) and other
        // tools then report is a clear failure, not an empty success.
        _ => {
            drop(out);
            eprintln!("{prog}: command not found");
            return 127;
        }
    };
    let _ = out.flush();
    code
}

fn logs(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val("tail"), flag_s("follow", 'f')])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let sv = resolve(store, r)?;
    let path = store.console_log(&sv.vm);
    let mut file = fs::File::open(&path).map_err(|_| {
        format!(
            "open log {}: VM may not have been started yet",
            path.display()
        )
    })?;
    let mut out = io::stdout().lock();
    let tail = p.num("tail")?.unwrap_or(0);
    let mut pos;
    if tail > 0 {
        let mut text = Vec::new();
        file.read_to_end(&mut text).map_err(io_err("read log"))?;
        pos = text.len() as u64;
        let lines: Vec<&[u8]> = text.split_inclusive(|b| *b == b'\n').collect();
        let start = lines.len().saturating_sub(tail as usize);
        for l in &lines[start..] {
            let _ = out.write_all(l);
        }
    } else {
        pos = io::copy(&mut file, &mut out).map_err(io_err("read log"))?;
    }
    let _ = out.flush();
    if p.has("follow") {
        let parent = std::os::unix::process::parent_id();
        while store.vm_path(&sv.vm.id).exists() && std::os::unix::process::parent_id() == parent {
            std::thread::sleep(Duration::from_millis(100));
            let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            if len > pos {
                if let Ok(mut f) = fs::File::open(&path) {
                    use std::io::Seek;
                    if f.seek(io::SeekFrom::Start(pos)).is_ok() {
                        pos += io::copy(&mut f.take(len - pos), &mut out).unwrap_or(0);
                        if out.flush().is_err() {
                            return Ok(0);
                        }
                    }
                }
            }
        }
    }
    Ok(0)
}

fn net(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val("nics"), val_s("output", 'o')])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let want = p.num("nics")?.ok_or("--nics is required")?;
    let mut sv = resolve(store, r)?;
    if sv.vm.is_firecracker() {
        return Err("net: backend does not support net resize".into());
    }
    let before = sv.vm.network_configs.len() as u64;
    let mut added = Vec::new();
    let mut removed = Vec::new();
    {
        let _guard = store.lock().map_err(io_err("lock"))?;
        while (sv.vm.network_configs.len() as u64) > want {
            if let Some(n) = sv.vm.network_configs.pop() {
                removed.push(n.tap);
            }
        }
        while (sv.vm.network_configs.len() as u64) < want {
            let i = sv.vm.network_configs.len();
            let mut nic = nics_for(store, &sv.vm.id, 1).remove(0);
            nic.tap = tap_name(&sv.vm.id, i);
            added.push(nic.tap.clone());
            sv.vm.network_configs.push(nic);
        }
        sv.vm.updated_at = now_rfc3339();
        store.save_vm(&sv).map_err(io_err("save vm"))?;
        store.journal("MODIFIED", &sv.vm.id);
    }
    if p.get("output") == Some("json") {
        return print_json(&serde_json::json!({
            "before": before, "after": want, "added": added, "removed": removed,
            "warnings": [], "hints": [],
        }));
    }
    Ok(0)
}

fn reconcile_stale_create(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    let [r] = p.positionals.as_slice() else {
        return Err(format!(
            "accepts 1 arg(s), received {}",
            p.positionals.len()
        ));
    };
    let (id, outcome) = {
        let _guard = store.lock().map_err(io_err("lock"))?;
        match store.resolve_vm(r) {
            Err(_) => (String::new(), "not-found"),
            Ok(sv) if sv.vm.state != "creating" => (sv.vm.id, "not-creating"),
            Ok(sv) if sv.owner_pid > 0 && pid_alive(sv.owner_pid as i64) => (sv.vm.id, "busy"),
            Ok(sv) => {
                store.delete_vm(&sv.vm.id);
                store.journal("DELETED", &sv.vm.id);
                remove_vm_files(store, &sv.vm);
                (sv.vm.id, "collected")
            }
        }
    };
    if p.get("output") == Some("json") {
        let mut obj = serde_json::Map::new();
        if !id.is_empty() {
            obj.insert("id".into(), id.into());
        }
        obj.insert("outcome".into(), outcome.into());
        return print_json(&obj);
    }
    println!("{r}: {outcome}");
    Ok(0)
}

/// `fake stop-vm`: the hypervisor dies on its own.
pub fn stop_on_its_own(store: &Store, r: &str, stale: bool) -> Result<(), String> {
    let mut sv = resolve(store, r)?;
    if stale {
        kill_pid(sv.vm.pid);
        // SIGKILL lands asynchronously: on a loaded host the process can still read alive a
        // moment later, and the "stale" record would show running. Wait (bounded) until it
        // reads dead, as a crashed hypervisor would by the time anyone looks.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while pid_alive(sv.vm.pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Make sure the dead PID reads dead even when process backing is off.
        if sv.vm.pid == 0 {
            sv.vm.pid = i32::MAX as i64;
        }
        return save_existing(store, &sv, "MODIFIED");
    }
    mark_stopped(store, &mut sv, "unexpected-exit")
}

/// `fake vanish`: the record disappears.
pub fn vanish(store: &Store, r: &str) -> Result<(), String> {
    let sv = resolve(store, r)?;
    let _guard = store.lock().map_err(io_err("lock"))?;
    kill_pid(sv.vm.pid);
    store.delete_vm(&sv.vm.id);
    store.journal("DELETED", &sv.vm.id);
    Ok(())
}

/// `fake set-state`.
pub fn set_state(store: &Store, r: &str, state: &str) -> Result<(), String> {
    let mut sv = resolve(store, r)?;
    sv.vm.state = state.to_string();
    sv.vm.updated_at = now_rfc3339();
    save_existing(store, &sv, "MODIFIED")
}

pub fn fake(store: &Store, verb: &str, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag("stale")])?;
    match (verb, p.positionals.as_slice()) {
        ("stop-vm", [r]) => stop_on_its_own(store, r, p.has("stale")).map(|_| 0),
        ("vanish", [r]) => vanish(store, r).map(|_| 0),
        ("set-state", [r, s]) => set_state(store, r, s).map(|_| 0),
        _ => Err(format!("fake {verb}: bad arguments")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sizes() {
        assert!(valid_vm_name("vk-ns-demo-0"));
        assert!(!valid_vm_name("-x"));
        assert!(!valid_vm_name(&"a".repeat(64)));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("4294967296"), Ok(4 << 30));
        assert!(parse_size("x").is_err());
        assert_eq!(
            default_run_name("ghcr.io/example/ubuntu:24.04"),
            "cocoon-ubuntu-24.04"
        );
        assert_eq!(default_run_name("https://x/jammy.img"), "cocoon-jammy.img");
    }
}
