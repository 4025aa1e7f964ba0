//! A fake `cocoon` CLI that keeps VMs, snapshots and images as files under a state directory.
//! Run when the `vk-cocoon-sandbox` binary is invoked as `cocoon` (its argv 0) or as
//! `vk-cocoon-sandbox fake-cocoon ...`; the daemon binary never contains it.
//!
//! It follows the cocoon CLI contract: the command lines of both cocoon generations (the union of
//! their flags), JSON on stdout only, `Error: <msg>` on stderr with exit 1, cocoon's VM states,
//! its ID, MAC and TAP name formats, and a `vm status --event --format json` stream fed by a
//! journal of changes. Many copies may run at once: every read-modify-write holds an `flock` on
//! `<state>/lock`, and records are replaced by atomic renames so readers need no lock.
//!
//! # Environment
//! - `FAKE_COCOON_STATE`: the state directory (required unless `COCOON_ROOT_DIR`/`--root-dir` is
//!   set, in which case `<root>/fake-cocoon` is used, or the binary runs as a `cocoon` symlink
//!   with a `fake-cocoon-state` directory beside it, which is then used: callers that spawn
//!   `cocoon` with the inherited environment, e.g. the snapshot transfers, get their own state).
//! - `COCOON_ROOT_DIR` / `--root-dir`: where run dirs go (`<root>/run/<cloudhypervisor|firecracker>/<ID>/`
//!   with `cow.raw` or `overlay.qcow2`); default `<state>/root`. A `guest.data` file a test
//!   writes into a run dir stands for the guest's disk contents: `snapshot save` captures it
//!   (so export / import carry it) and a clone restores it into the new VM's run dir.
//! - `COCOON_LOG_DIR` / `--log-dir`: console logs (`<log>/<backend dir>/<ID>/cloud-hypervisor.log`);
//!   default `<state>/log`.
//! - `FAKE_COCOON_GENERATION=B`: B quirks (`No VMs found.` for an empty `vm list -o json`, B's
//!   `VM not found` text, no `vm reconcile-stale-create`). Default is N.
//! - `FAKE_COCOON_NO_PROCESS=1`: do not back running VMs with a process (pid 0, always "alive");
//!   the fastest mode, for benchmarks. By default each running VM is a sleeping re-exec of this
//!   binary (`fake-cocoon __vm-process <record>`), detached in its own process group, so /proc
//!   stats are real; it exits by itself once its record is gone, and `vm rm`/`vm stop` kill it.
//!   For a Cloud Hypervisor VM it also serves `<run dir>/console.sock` as a Windows SAC console
//!   (`sandbox::fake_sac`) whose interfaces are the VM's NICs.
//! - `FAKE_COCOON_PROCESS_NAMES=<prefix>`: with `FAKE_COCOON_NO_PROCESS=1`, VMs whose name
//!   starts with the prefix still get their process (a bench kills a few among thousands).
//! - `FAKE_COCOON_DHCP=1` with `FAKE_COCOON_LEASES=<path>`: DHCP mode, as with cocoon-net. NICs
//!   have no static `network` address; after every invocation the fake rewrites the lease file
//!   (cocoon-net's JSON lease format, atomic rename, 0644) with one row per NIC of each running VM (127.88.x.y,
//!   expiry now + 1 h) and drops rows of VMs that stopped, were removed or vanished. The mode is
//!   remembered in `<state>/dhcp_leases`, so later invocations without the env keep it.
//! - `FAKE_COCOON_SNAPSHOT_BYTES`: size of the memory file of a saved snapshot (default 256 KiB).
//! - `FAKE_COCOON_IMPORT_DISCARD=1`: `snapshot import` / `image import` read the whole stream,
//!   check its tar framing (header checksums, member lengths, padding, end-of-archive marker; a
//!   `snapshot.json` first for snapshots; a qcow2 image is only read) and store or register
//!   nothing: exit 0 on a well-formed stream, 1 on a truncated or corrupt one (benchmarks).
//!
//! # State directory
//! `vms/<ID>.json`, `snapshots/<ID>.json` + `snapshots/<ID>/` (data files), `images/<hex>.json`,
//! `snapshots/.import-<pid>-<start>-<ID>/` (an import's staging, renamed into place on success;
//! every `snapshot` command first removes those whose importer is gone, e.g. SIGKILLed),
//! `journal` (one line per change: `<time> <ADDED|MODIFIED|DELETED> <ID>`), `exec.log` (one JSON
//! line per `vm exec`: `{"vm","argv","env","stdin"}`), `faults.json`, `lock`, `next_ip`.
//!
//! # Fault injection: `<state>/faults.json`
//! A JSON object from verb (`"vm clone"`, `"vm inspect"`, `"vm status"`, `"snapshot save"`, ...)
//! to a fault object (all fields optional; see [`VerbFault`]):
//! ```json
//! {"vm clone":   {"fail_count": 2, "fail_message": "clone: boom", "fail_exit": 1},
//!  "vm inspect": {"hang": true},
//!  "vm list":    {"garbage_count": 1, "garbage": "{not json"},
//!  "vm run":     {"slow_ms": 500, "print_created": true},
//!  "vm status":  {"garbage_count": 1, "garbage": "junk line", "exit_after_ms": 300, "exit_code": 0}}
//! ```
//! `"snapshot export": {"truncate_after": N}` cuts the export stream after N bytes and fails.
//! `fail_count`/`garbage_count`/`hang_count` are decremented per call (under the lock); `hang`
//! sleeps forever (every call), `hang_count: N` only the next N calls (clone/run/create/save
//! hang after their placeholder or name reservation is written, as a wedged cocoon would);
//! `slow_ms` delays the work (clone/run: after the `creating` placeholder is written, so a
//! concurrent `vm reconcile-stale-create` reports `busy`); `placeholder_only` leaves a
//! `creating` record and exits 1 like a crashed create (reconcile then reports `collected`).
//! For `vm status` the garbage is printed as one line at start, `exit_after_ms` ends the stream,
//! and `blank_lists: N` makes the N refreshes after the first see an empty (failed) listing, so
//! every VM goes `DELETED` then `ADDED` again. The stream exits when its parent dies.
//!
//! # Test-only verbs (`cocoon fake ...`) and library helpers
//! `fake stop-vm REF [--stale]` (kill the backing process; N: state `stopped` with reason
//! `unexpected-exit`; `--stale`: keep the stored `running`, so readers see `stopped (stale)`),
//! `fake vanish REF` (the record disappears: `DELETED`), `fake set-state REF STATE`.
//! The same operations are [`stop_vm`], [`vanish_vm`], [`set_state`], and [`write_faults`].
//!
//! # `vm exec`
//! Runs nothing real and never a shell. The command (after `--`, one further leading `--`
//! stripped) is interpreted: `cat` copies stdin to stdout (stdin is empty without `-i`);
//! `echo ARGS` prints them; `true`/`false`; `exit N`; `sh|bash|/bin/sh -c SCRIPT` interprets
//! SCRIPT's words the same way (so `sh -c 'exit 3'` exits 3); `env` prints the `-e` variables;
//! `hostname` prints the VM name; `uname [-a]`; `powershell ARGS` succeeds silently (the
//! Windows fix-up); `sleep SECS`; `stderr TEXT` prints TEXT to
//! stderr; anything else prints `<cmd>: command not found` to stderr and exits 127, as a shell
//! does (so `kubectl cp`, which needs `tar`, fails clearly). The VM must be running.
//! Guest files: `echo WORDS > /path` (alone or as an `sh -c` script) writes a file on the VM's
//! disk and `cat /path` prints it back (exit 1 when missing). `snapshot save` captures them and
//! a clone of the snapshot has them, so a fork or a wake sees what its source wrote.
//!
//! # Half-saved snapshots
//! `snapshot save` reserves its name with `snapshots/.pending-<hex name>` (`<ID> <saver pid>`)
//! until it finishes. A save that dies half-way (killed, e.g. with the daemon that ran it)
//! leaves that record: invisible to inspect and list, it makes a later save of the name fail
//! with `snapshot name "<n>" already in use by <ID>` until `snapshot rm <ID>` removes it (while
//! its saver still runs, rm answers `is in use by an active save`). `"snapshot save":
//! {"slow_ms": N}` makes a save sleep N ms after reserving its name.

pub mod cli;
mod data_cmds;
pub mod dhcp;
mod guest_fs;
pub mod store;
mod stream;
pub mod tar;
mod vm_cmds;

pub use store::{FaultFile, StoredVm, VerbFault};

use std::path::{Path, PathBuf};
use std::time::Duration;
use store::Store;

/// Result of a command: an exit status, or an error message printed as `Error: <msg>` (exit 1).
pub(crate) type CmdResult = Result<i32, String>;

/// An I/O error as a command error: `<what>: <error>`.
fn io_err(what: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Prints `v` as cocoon's `--output json` does (pretty, one document).
fn print_json<T: serde::Serialize>(v: &T) -> CmdResult {
    use std::io::Write;
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
    Ok(0)
}

const VM_HELP: &str = "Manage virtual machines\n\nUsage:\n  cocoon vm [command]\n\nAvailable Commands:\n  clone, create, exec, inspect, list, logs, net, reconcile-stale-create, rm, run, start, status, stop\n";
const SNAPSHOT_HELP: &str = "Manage snapshots\n\nUsage:\n  cocoon snapshot [command]\n\nAvailable Commands:\n  export, import, inspect, list, rm, save\n";
const IMAGE_HELP: &str = "Manage images\n\nUsage:\n  cocoon image [command]\n\nAvailable Commands:\n  import, inspect, list, pull, rm\n";

/// State directory found beside the `cocoon` symlink (see the module docs).
static STATE_BESIDE_BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Entry point when the binary runs as `cocoon` (argv[0] = `program`): a `fake-cocoon-state`
/// directory next to `program` is the state directory when the environment names none.
pub fn main_as_cocoon(program: &Path, args: Vec<String>) -> i32 {
    if let Some(dir) = program.parent() {
        let beside = dir.join("fake-cocoon-state");
        if beside.is_dir() {
            let _ = STATE_BESIDE_BINARY.set(beside);
        }
    }
    main(args)
}

/// Entry point of the fake: `args` are the arguments after the program name. Returns the exit code.
pub fn main(args: Vec<String>) -> i32 {
    let mut args = args;
    if args.first().map(String::as_str) == Some("fake-cocoon") {
        args.remove(0);
    }
    if args.first().map(String::as_str) == Some("__vm-process") {
        return vm_process(args.get(1).map(PathBuf::from));
    }
    match run(&args) {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("Error: {msg}");
            1
        }
    }
}

/// A running VM's stand-in process: serves the VM's serial console (a fake SAC) and sleeps
/// until its record file is gone.
fn vm_process(record: Option<PathBuf>) -> i32 {
    let Some(record) = record else { return 2 };
    let rec = record.clone();
    std::thread::spawn(move || serve_console(&rec));
    while record.exists() {
        std::thread::sleep(Duration::from_millis(200));
    }
    0
}

/// Cloud Hypervisor VMs get `console.sock` beside their API socket, answered by a fake SAC
/// whose interfaces are the VM's NICs (`Net: 10+i, Ip=169.254.<i>.1` until set). The record
/// may not be written yet when this process starts: it is read for up to 5 s.
fn serve_console(record: &Path) {
    for _ in 0..50 {
        let stored = std::fs::read(record)
            .ok()
            .and_then(|b| serde_json::from_slice::<StoredVm>(&b).ok());
        if let Some(sv) = stored.filter(|sv| !sv.vm.socket_path.is_empty()) {
            if sv.vm.is_firecracker() {
                return;
            }
            let Some(dir) = Path::new(&sv.vm.socket_path).parent() else {
                return;
            };
            let sock = dir.join("console.sock");
            let _ = std::fs::remove_file(&sock);
            let Ok(listener) = std::os::unix::net::UnixListener::bind(&sock) else {
                return;
            };
            let nets = (0..sv.vm.network_configs.len())
                .map(|i| (10 + i as u32, format!("169.254.{i}.1")))
                .collect();
            crate::sandbox::fake_sac::serve(
                listener,
                crate::sandbox::fake_sac::SacBehaviour {
                    nets,
                    ..Default::default()
                },
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The first value of a global flag anywhere before `--`.
fn global_value(args: &[String], long: &str) -> Option<String> {
    let eq = format!("--{long}=");
    let plain = format!("--{long}");
    let mut it = args.iter().take_while(|a| *a != "--");
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix(&eq) {
            return Some(v.to_string());
        }
        if *a == plain {
            return it.next().cloned();
        }
    }
    None
}

fn env_nonempty(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

fn store_from_env(args: &[String]) -> Result<Store, String> {
    let root_flag = global_value(args, "root-dir").or_else(|| env_nonempty("COCOON_ROOT_DIR"));
    let state = match env_nonempty("FAKE_COCOON_STATE") {
        Some(s) => PathBuf::from(s),
        None => match &root_flag {
            Some(r) => Path::new(r).join("fake-cocoon"),
            None => match STATE_BESIDE_BINARY.get() {
                Some(s) => s.clone(),
                None => return Err(
                    "fake cocoon: set FAKE_COCOON_STATE (or COCOON_ROOT_DIR) to a state directory"
                        .into(),
                ),
            },
        },
    };
    let root = root_flag
        .map(PathBuf::from)
        .unwrap_or_else(|| state.join("root"));
    let log_dir = global_value(args, "log-dir")
        .or_else(|| env_nonempty("COCOON_LOG_DIR"))
        .map(PathBuf::from)
        .unwrap_or_else(|| state.join("log"));
    let store = Store {
        state,
        root,
        log_dir,
        gen_b: env_nonempty("FAKE_COCOON_GENERATION").as_deref() == Some("B"),
        spawn_process: env_nonempty("FAKE_COCOON_NO_PROCESS").as_deref() != Some("1"),
        process_names: env_nonempty("FAKE_COCOON_PROCESS_NAMES"),
        leases: None,
    };
    store
        .init()
        .map_err(|e| format!("init state dir {}: {e}", store.state.display()))?;
    let leases = dhcp::configure(&store.state)?;
    Ok(Store { leases, ..store })
}

/// A store for library callers (tests) that only touch records and faults.
fn store_at(state_dir: &Path) -> Store {
    Store {
        state: state_dir.to_path_buf(),
        root: state_dir.join("root"),
        log_dir: state_dir.join("log"),
        gen_b: false,
        spawn_process: false,
        process_names: None,
        leases: dhcp::remembered(state_dir),
    }
}

/// DHCP mode: brings the lease file in step with the records (under the state lock).
fn sync_leases(store: &Store) {
    if store.leases.is_none() {
        return;
    }
    if let Ok(_guard) = store.lock() {
        if let Err(e) = dhcp::sync(store) {
            eprintln!("fake cocoon: lease file: {e}");
        }
    }
}

fn run(args: &[String]) -> CmdResult {
    let (_, words) = cli::split_leading_globals(args);
    let Some(group) = words.first().cloned() else {
        println!("cocoon: MicroVM manager (fake)\n\nUsage:\n  cocoon [command]\n\nAvailable Commands:\n  vm, snapshot, image, version");
        return Ok(0);
    };
    let known_groups = ["vm", "snapshot", "image", "fake", "version", "gc"];
    if group.starts_with('-') || !known_groups.contains(&group.as_str()) {
        if group.starts_with('-') {
            cli::parse(&words, &[])?;
        }
        eprintln!("Error: unknown command \"{group}\" for \"cocoon\"");
        eprintln!("Run 'cocoon --help' for usage.");
        return Ok(1);
    }
    if group == "version" {
        println!("cocoon fake (vk-cocoon {})", env!("CARGO_PKG_VERSION"));
        return Ok(0);
    }
    let verb = words.get(1).cloned().unwrap_or_default();
    let rest: Vec<String> = words.iter().skip(2).cloned().collect();
    let store = store_from_env(args)?;
    let key = format!("{group} {verb}");

    let known = match group.as_str() {
        "vm" => vm_cmds::VERBS.contains(&verb.as_str()),
        "snapshot" => data_cmds::SNAPSHOT_VERBS.contains(&verb.as_str()),
        "image" => data_cmds::IMAGE_VERBS.contains(&verb.as_str()),
        "fake" => ["stop-vm", "vanish", "set-state"].contains(&verb.as_str()),
        _ => verb.is_empty(),
    };
    let gen_b_missing = store.gen_b
        && group == "vm"
        && ["reconcile-stale-create", "exec", "logs", "net"].contains(&verb.as_str());
    if !known || gen_b_missing {
        // The framework: undefined flags fail first; otherwise the group help, exit 0.
        cli::parse(&rest, &[])?;
        let help = match group.as_str() {
            "vm" => VM_HELP,
            "snapshot" => SNAPSHOT_HELP,
            _ => IMAGE_HELP,
        };
        print!("{help}");
        return Ok(0);
    }

    let mut fault = store.take_fault(&key);
    let delay_inside = matches!(
        key.as_str(),
        "vm clone" | "vm run" | "vm create" | "snapshot save"
    );
    if fault.hang || fault.hang_count > 0 {
        if !delay_inside {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        // A create or save wedged half-way: its placeholder or name reservation is there.
        fault.slow_ms = u64::MAX;
    }
    if fault.fail_count > 0 {
        let msg = if fault.fail_message.is_empty() {
            format!("{key}: injected failure")
        } else {
            fault.fail_message.clone()
        };
        eprintln!("Error: {msg}");
        return Ok(if fault.fail_exit == 0 {
            1
        } else {
            fault.fail_exit
        });
    }
    if fault.garbage_count > 0 && key != "vm status" {
        println!("{}", fault.garbage);
        return Ok(0);
    }
    if fault.slow_ms > 0 && !delay_inside {
        std::thread::sleep(Duration::from_millis(fault.slow_ms));
    }
    let result = match group.as_str() {
        "vm" => vm_cmds::dispatch(&store, &verb, &rest, &fault),
        "snapshot" => data_cmds::snapshot(&store, &verb, &rest, &fault),
        "image" => data_cmds::image(&store, &verb, &rest),
        "fake" => vm_cmds::fake(&store, &verb, &rest),
        _ => Ok(0),
    };
    sync_leases(&store);
    result
}

/// Writes `<state>/faults.json` (replacing it) under the state lock.
pub fn write_faults(state_dir: &Path, faults: &FaultFile) -> std::io::Result<()> {
    let store = store_at(state_dir);
    store.init()?;
    let _guard = store.lock()?;
    let bytes = serde_json::to_vec_pretty(faults).map_err(std::io::Error::other)?;
    store::write_atomic(&store.faults_path(), &bytes)
}

/// Makes a VM stop on its own (kills its process). `stale`: keep stored `running` (B behaviour,
/// readers see `stopped (stale)`); otherwise stored `stopped` with reason `unexpected-exit` (N).
pub fn stop_vm(state_dir: &Path, vm_ref: &str, stale: bool) -> Result<(), String> {
    let store = store_at(state_dir);
    let result = vm_cmds::stop_on_its_own(&store, vm_ref, stale);
    sync_leases(&store);
    result
}

/// Makes a VM record disappear without `vm rm` (the stream emits `DELETED`).
pub fn vanish_vm(state_dir: &Path, vm_ref: &str) -> Result<(), String> {
    let store = store_at(state_dir);
    let result = vm_cmds::vanish(&store, vm_ref);
    sync_leases(&store);
    result
}

/// Overwrites a VM's stored state (e.g. `error`), emitting `MODIFIED`.
pub fn set_state(state_dir: &Path, vm_ref: &str, state: &str) -> Result<(), String> {
    let store = store_at(state_dir);
    let result = vm_cmds::set_state(&store, vm_ref, state);
    sync_leases(&store);
    result
}

/// All stored VM records (stored states, not reconciled).
pub fn stored_vms(state_dir: &Path) -> Vec<StoredVm> {
    store_at(state_dir).load_vms()
}
