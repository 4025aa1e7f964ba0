//! The fake's `vm inspect`, `list`, `rm`, `start`, `stop`, `status` and
//! `reconcile-stale-create`: reading and moving an existing VM record.

use std::fs;
use std::time::Duration;

use super::super::cli::{self, flag, flag_s, val, val_s};
use super::super::store::{
    display_state, kill_pid, now_rfc3339, pid_alive, RefError, Store, StoredVm, VerbFault,
};
use super::super::{stream, CmdResult};
use super::create::boot;
use super::{io_err, not_found_text, print_json, resolve, save_existing};
use crate::vm::types::Vm;

pub(super) fn shown(store: &Store, sv: &StoredVm, reconcile: bool) -> Vm {
    let mut vm = sv.vm.clone();
    if reconcile {
        vm.state = display_state(&vm);
    }
    let _ = store;
    vm
}

pub(super) fn inspect(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("format")])?;
    let r = p.one_positional()?;
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

pub(super) fn list(store: &Store, args: &[String]) -> CmdResult {
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

pub(super) fn remove_vm_files(store: &Store, vm: &Vm) {
    let _ = fs::remove_dir_all(store.run_dir(vm));
    if let Some(dir) = store.console_log(vm).parent() {
        let _ = fs::remove_dir_all(dir);
    }
}

pub(super) fn rm(store: &Store, args: &[String]) -> CmdResult {
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

pub(super) fn start(store: &Store, args: &[String]) -> CmdResult {
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

pub(super) fn mark_stopped(store: &Store, sv: &mut StoredVm, reason: &str) -> Result<(), String> {
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

pub(super) fn stop(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), flag_s("force", 'f')])?;
    for r in &p.positionals {
        let mut sv = resolve(store, r)?;
        mark_stopped(store, &mut sv, "stop-user")?;
    }
    Ok(0)
}

pub(super) fn status(store: &Store, args: &[String], fault: &VerbFault) -> CmdResult {
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

pub(super) fn is_running_alive(vm: &Vm) -> bool {
    display_state(vm) == "running" && (vm.pid == 0 || pid_alive(vm.pid))
}

pub(super) fn reconcile_stale_create(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    let r = p.one_positional()?;
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
