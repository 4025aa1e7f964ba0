//! The fake's `vm` verbs (clone, run, inspect, list, rm, start, stop, status, exec, logs, net,
//! reconcile-stale-create) and the test-only `fake` verbs. State access goes through `store`.
//!
//! create: clone and run; lifecycle: inspect, list, rm, start, stop, status and the
//! reconcile-stale-create verb; guest: exec, logs, net. Shared helpers stay here.

use super::cli::{self, flag, Parsed};
use super::store::{kill_pid, now_rfc3339, pid_alive, RefError, Store, StoredVm, VerbFault};
use super::{io_err, print_json, CmdResult};

use std::time::Duration;

mod create;
mod guest;
mod lifecycle;

use create::{clone, run};
use guest::{exec, logs, net};
use lifecycle::{inspect, list, mark_stopped, reconcile_stale_create, rm, start, status, stop};

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
            create::default_run_name("ghcr.io/example/ubuntu:24.04"),
            "cocoon-ubuntu-24.04"
        );
        assert_eq!(
            create::default_run_name("https://x/jammy.img"),
            "cocoon-jammy.img"
        );
    }
}
