//! The fake's `vm status --event` stream: ADDED for every VM at start, then MODIFIED/DELETED by
//! the diff rules of cocoon-cli.md 3.7, woken by the journal (polled every 5 ms) and an interval.
//! With a `blank_lists` fault, listings after the first one come back empty (a failed listing).

use super::store::{display_state, Store, VerbFault};
use crate::vm::types::{EventLine, Vm};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::time::{Duration, Instant};

/// How often the journal's size is checked; keeps change-to-line latency in single-digit ms.
const JOURNAL_POLL: Duration = Duration::from_millis(5);

/// The fields whose change makes a `MODIFIED` (PID changes alone do not).
fn tuple(vm: &Vm) -> (String, String, String, u64, u64, String, String) {
    let ips: Vec<&str> = vm
        .network_configs
        .iter()
        .filter_map(|n| n.network.as_ref().map(|a| a.ip.as_str()))
        .collect();
    (
        vm.id.clone(),
        vm.config.name.clone(),
        vm.state.clone(),
        vm.config.cpu,
        vm.config.memory,
        ips.join(","),
        vm.config.image.clone(),
    )
}

type Tuple = (String, String, String, u64, u64, String, String);

fn emit(out: &mut impl Write, event: &str, vm: &Vm) -> io::Result<()> {
    let line = EventLine {
        event: event.to_string(),
        vm: vm.clone(),
    };
    let text = serde_json::to_string(&line).map_err(io::Error::other)?;
    out.write_all(text.as_bytes())?;
    out.write_all(b"\n")
}

/// Runs until killed, the state directory disappears, stdout closes, or a fault ends it.
pub fn run(store: &Store, interval: Duration, _json: bool, fault: &VerbFault) -> i32 {
    let started = Instant::now();
    let stdout = io::stdout();
    let mut out = stdout.lock();
    if fault.garbage_count > 0 {
        let _ = writeln!(out, "{}", fault.garbage);
        let _ = out.flush();
    }
    let mut known: BTreeMap<String, (Tuple, Vm)> = BTreeMap::new();
    let mut last_len: Option<u64> = None;
    let mut last_full = Instant::now();
    let mut blank_lists = fault.blank_lists;
    let parent = std::os::unix::process::parent_id();
    loop {
        // Stop when the state dir is gone or the reader died (we were re-parented): an orphaned
        // stream would otherwise poll forever.
        if !store.state.exists() || std::os::unix::process::parent_id() != parent {
            return 0;
        }
        let len = std::fs::metadata(store.journal_path())
            .map(|m| m.len())
            .unwrap_or(0);
        let due = last_len != Some(len) || last_full.elapsed() >= interval;
        if due {
            last_len = Some(len);
            last_full = Instant::now();
            let mut current: BTreeMap<String, (Tuple, Vm)> = BTreeMap::new();
            let listing = if blank_lists > 0 && !known.is_empty() {
                blank_lists -= 1;
                // Re-list on the next tick, as the real stream does on its next change/interval.
                last_len = None;
                Vec::new()
            } else {
                store.load_vms()
            };
            for sv in listing {
                let mut vm = sv.vm;
                vm.state = display_state(&vm);
                current.insert(vm.id.clone(), (tuple(&vm), vm));
            }
            let mut lines = Vec::new();
            for (id, (t, vm)) in &current {
                match known.get(id) {
                    None => lines.push(("ADDED", vm.clone())),
                    Some((old, _)) if old != t => lines.push(("MODIFIED", vm.clone())),
                    _ => {}
                }
            }
            for (id, (_, vm)) in &known {
                if !current.contains_key(id) {
                    lines.push(("DELETED", vm.clone()));
                }
            }
            known = current;
            for (event, vm) in lines {
                if emit(&mut out, event, &vm).is_err() {
                    return 0;
                }
            }
            if out.flush().is_err() {
                return 0;
            }
        }
        if fault.exit_after_ms > 0
            && started.elapsed() >= Duration::from_millis(fault.exit_after_ms)
        {
            return fault.exit_code;
        }
        std::thread::sleep(JOURNAL_POLL);
    }
}
