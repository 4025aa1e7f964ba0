//! The fake's `vm status --event` stream: ADDED for every VM at start, then MODIFIED/DELETED by
//! cocoon's event-stream diff rules, woken by the journal (polled every 5 ms) and an interval.
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

/// What the stream last told its reader: VM ID → (diff tuple, VM as shown).
type Known = BTreeMap<String, (Tuple, Vm)>;

/// Runs until killed, the state directory disappears, stdout closes, or a fault ends it.
///
/// A full listing (every VM record read) happens at start, every `interval` and while a
/// `blank_lists` fault lasts; between them only the VMs the journal names are re-read, so one
/// change costs one record read however many VMs the host has, as cocoon's one-file index does.
pub fn run(store: &Store, interval: Duration, _json: bool, fault: &VerbFault) -> i32 {
    let started = Instant::now();
    let stdout = io::stdout();
    let mut out = stdout.lock();
    if fault.garbage_count > 0 {
        let _ = writeln!(out, "{}", fault.garbage);
        let _ = out.flush();
    }
    let mut known = Known::new();
    let mut journal_read: Option<u64> = None;
    let mut last_full: Option<Instant> = None;
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
        let full_due = last_full.is_none_or(|t| t.elapsed() >= interval)
            || journal_read.is_none_or(|r| len < r)
            || (blank_lists > 0 && journal_read != Some(len));
        let lines = if full_due {
            journal_read = Some(len);
            last_full = Some(Instant::now());
            let listing = if blank_lists > 0 && !known.is_empty() {
                blank_lists -= 1;
                // Re-list on the next tick, as the real stream does on its next change/interval.
                journal_read = None;
                Vec::new()
            } else {
                store.load_vms()
            };
            full_diff(&mut known, listing.into_iter().map(|sv| sv.vm).collect())
        } else if journal_read != Some(len) {
            let from = journal_read.unwrap_or(0);
            let (ids, read_to) = journal_ids(store, from);
            journal_read = Some(read_to);
            ids.iter()
                .filter_map(|id| record_diff(&mut known, id, store.load_vm(id).map(|sv| sv.vm)))
                .collect()
        } else {
            Vec::new()
        };
        for (event, vm) in lines {
            if emit(&mut out, event, &vm).is_err() {
                return 0;
            }
        }
        if out.flush().is_err() {
            return 0;
        }
        if fault.exit_after_ms > 0
            && started.elapsed() >= Duration::from_millis(fault.exit_after_ms)
        {
            return fault.exit_code;
        }
        std::thread::sleep(JOURNAL_POLL);
    }
}

/// The event-stream diff of a full listing against what was last told.
fn full_diff(known: &mut Known, listing: Vec<Vm>) -> Vec<(&'static str, Vm)> {
    let mut current = Known::new();
    for mut vm in listing {
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
    for (id, (_, vm)) in known.iter() {
        if !current.contains_key(id) {
            lines.push(("DELETED", vm.clone()));
        }
    }
    *known = current;
    lines
}

/// The same diff for one VM the journal named; `None` when nothing the reader sees changed.
fn record_diff(known: &mut Known, id: &str, now: Option<Vm>) -> Option<(&'static str, Vm)> {
    match now {
        Some(mut vm) => {
            vm.state = display_state(&vm);
            let t = tuple(&vm);
            let event = match known.get(id) {
                None => "ADDED",
                Some((old, _)) if *old != t => "MODIFIED",
                Some(_) => return None,
            };
            known.insert(id.to_string(), (t, vm.clone()));
            Some((event, vm))
        }
        None => known.remove(id).map(|(_, vm)| ("DELETED", vm)),
    }
}

/// The VM IDs named by whole journal lines from byte `from` on (each once, in order of first
/// mention), and the offset just past the last whole line.
fn journal_ids(store: &Store, from: u64) -> (Vec<String>, u64) {
    let mut bytes = Vec::new();
    if let Ok(mut f) = std::fs::File::open(store.journal_path()) {
        use std::io::{Read, Seek, SeekFrom};
        if f.seek(SeekFrom::Start(from)).is_ok() {
            let _ = f.read_to_end(&mut bytes);
        }
    }
    let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let mut ids: Vec<String> = Vec::new();
    for line in String::from_utf8_lossy(&bytes[..whole]).lines() {
        // `<time> <event> <ID>`
        if let Some(id) = line.split_whitespace().nth(2) {
            if !ids.iter().any(|i| i == id) {
                ids.push(id.to_string());
            }
        }
    }
    (ids, from + whole as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(id: &str, state: &str) -> Vm {
        let mut vm = Vm {
            id: id.into(),
            state: state.into(),
            ..Default::default()
        };
        vm.config.name = format!("vk-{id}");
        vm
    }

    #[test]
    fn journal_lines_are_read_whole_from_an_offset() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store {
            state: dir.path().to_path_buf(),
            root: dir.path().join("root"),
            log_dir: dir.path().join("log"),
            gen_b: false,
            spawn_process: false,
            process_names: None,
            leases: None,
        };
        let text = "t ADDED A\nt MODIFIED B\nt DELETED A\nt ADD";
        std::fs::write(store.journal_path(), text).unwrap();
        let (ids, to) = journal_ids(&store, 0);
        assert_eq!(ids, ["A", "B"]);
        assert_eq!(to as usize, text.len() - "t ADD".len());
        // The half-written line is read once it is whole.
        std::fs::write(store.journal_path(), format!("{text}ED C\n")).unwrap();
        assert_eq!(journal_ids(&store, to), (vec!["C".to_string()], to + 10));
    }

    #[test]
    fn one_record_diffs_like_a_full_listing() {
        let mut known = Known::new();
        let added = record_diff(&mut known, "A", Some(vm("A", "running")));
        assert_eq!(added.map(|(e, _)| e), Some("ADDED"));
        assert!(record_diff(&mut known, "A", Some(vm("A", "running"))).is_none());
        let stopped = record_diff(&mut known, "A", Some(vm("A", "stopped")));
        assert_eq!(
            stopped.map(|(e, v)| (e, v.state)),
            Some(("MODIFIED", "stopped".into()))
        );
        let gone = record_diff(&mut known, "A", None);
        assert_eq!(gone.map(|(e, v)| (e, v.id)), Some(("DELETED", "A".into())));
        assert!(record_diff(&mut known, "A", None).is_none());
        // A full listing after incremental updates diffs against the same memory.
        record_diff(&mut known, "B", Some(vm("B", "running")));
        let lines = full_diff(&mut known, vec![vm("B", "running"), vm("C", "running")]);
        assert_eq!(
            lines
                .iter()
                .map(|(e, v)| (*e, v.id.as_str()))
                .collect::<Vec<_>>(),
            [("ADDED", "C")]
        );
    }
}
