//! Process tests of fork-from: the real vk-cocoon binary against the fake API server and the
//! fake cocoon. A fork sees the source's files; a daemon killed mid-fork converges.

use crate::daemon_support;

use std::time::Duration;

use daemon_support::{running_with_vm, tail, World, SETTLE_LIMIT};
use k8s_openapi::api::core::v1::Pod;
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::sandbox::fake_cocoon::VerbFault;

const SOURCE_VM: &str = "vk-default-main";

fn fork_pod(name: &str) -> Pod {
    let mut p = demo_pod("default", name, "clone", "base");
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.insert("vm.cocoonstack.io/fork-from".into(), SOURCE_VM.into());
    }
    p
}

/// Runs `sh -c <script>` in a VM through the fake cocoon; (success, output).
fn guest(w: &World, vm_id: &str, script: &str) -> (bool, String) {
    w.cocoon(&["vm", "exec", vm_id, "--", "sh", "-c", script])
}

/// The fake's snapshots named `name` (complete ones: pending saves are not listed).
fn snapshots_named(w: &World, name: &str) -> usize {
    let (ok, out) = w.cocoon(&["snapshot", "list", "-o", "json"]);
    assert!(ok, "{out}");
    let list: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap_or_default();
    list.iter().filter(|s| s["name"] == name).count()
}

/// Half-saved records (pending save markers) in the fake's state.
fn half_saved(w: &World) -> usize {
    std::fs::read_dir(w.path("state/snapshots"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(".pending-"))
                .count()
        })
        .unwrap_or(0)
}

/// Starts the source pod and writes a file in its guest; returns the source VM id.
fn running_source(w: &World) -> String {
    w.api
        .create_pod(&demo_pod("default", "main", "clone", "base"))
        .expect("create main");
    let (_, id) = w.wait("main Running", SETTLE_LIMIT, || running_with_vm(w, "main"));
    let (ok, out) = guest(w, &id, "echo written-in-main > /root/mark");
    assert!(ok, "{out}");
    id
}

#[test]
fn forks_of_a_running_vm_share_one_save_and_see_its_files() {
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    let main_id = running_source(&w);
    // Two sub-agents fork the main VM at once.
    for n in ["sub-a", "sub-b"] {
        w.api.create_pod(&fork_pod(n)).expect("create fork");
    }
    for n in ["sub-a", "sub-b"] {
        let (_, id) = w.wait(&format!("{n} Running"), SETTLE_LIMIT, || {
            running_with_vm(&w, n)
        });
        assert_ne!(id, main_id);
        let (ok, out) = guest(&w, &id, "cat /root/mark");
        assert!(ok, "{n}: {out}");
        assert_eq!(out, "written-in-main\n", "{n} sees the file of its source");
    }
    assert_eq!(snapshots_named(&w, &format!("fork-{SOURCE_VM}")), 1);
    // One save for both forks, timed and labelled with the forks' namespace.
    w.wait_metric("vk_cocoon_snapshot_save_total{result=\"ok\"}", 1.0);
    w.wait_metric(
        "vk_cocoon_snapshot_save_duration_seconds_count{namespace=\"default\"}",
        1.0,
    );
    // The source keeps running, untouched.
    assert_eq!(w.vms()[SOURCE_VM], (main_id, "running".to_string()));
}

#[test]
fn a_fork_of_a_missing_source_fails_clearly_and_creates_no_vm() {
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    w.api.create_pod(&fork_pod("orphan-sub")).expect("create");
    w.wait_event("orphan-sub", "CreateBringUpFailed", |m| {
        m.contains(&format!("source vm {SOURCE_VM}"))
    });
    assert!(!w.vms().contains_key("vk-default-orphan-sub"));
    assert_eq!(snapshots_named(&w, &format!("fork-{SOURCE_VM}")), 0);
}

/// Slows the fake's `verb` down by `slow_ms`, creates the fork pod `name`, and SIGKILLs the
/// daemon once `under_way` sees that step running; the fault is cleared after.
fn crash_while(
    w: &mut World,
    verb: &str,
    slow_ms: u64,
    name: &str,
    under_way: impl Fn(&World) -> bool,
) {
    w.set_fault(
        verb,
        VerbFault {
            slow_ms,
            ..Default::default()
        },
    );
    w.api.create_pod(&fork_pod(name)).expect("create fork");
    w.wait(&format!("{name}: {verb} under way"), SETTLE_LIMIT, || {
        under_way(w).then_some(())
    });
    w.kill_daemon();
    w.clear_faults();
}

/// The daemon is SIGKILLed while the fork snapshot is being saved (the save dies with it and
/// leaves a half-saved record), then while the fork's clone runs. After each restart the fork
/// converges: one VM per pod, the source untouched, one fork snapshot, no half-saved record.
#[test]
fn a_daemon_killed_mid_fork_resumes_without_a_lost_or_duplicate_vm_or_a_half_saved_snapshot() {
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    let main_id = running_source(&w);

    // 1. Killed during the save.
    crash_while(&mut w, "snapshot save", 60_000, "sub-a", |w| {
        half_saved(w) == 1
    });
    assert_eq!(half_saved(&w), 1, "the killed save left its record");
    w.start_daemon();
    let (_, sub_a) = w.wait("sub-a Running", SETTLE_LIMIT, || {
        running_with_vm(&w, "sub-a")
    });
    assert_eq!(half_saved(&w), 0, "the half-saved record was removed");
    assert!(
        w.log().contains("is held by an unfinished save"),
        "the restarted daemon found the name held and removed the holder\n{}",
        tail(&w.log(), 40)
    );
    assert_eq!(snapshots_named(&w, &format!("fork-{SOURCE_VM}")), 1);
    assert_eq!(guest(&w, &sub_a, "cat /root/mark").1, "written-in-main\n");

    // 2. Killed during the clone of a second fork (the snapshot exists by then).
    crash_while(&mut w, "vm clone", 3000, "sub-b", |w| {
        w.vms()
            .get("vk-default-sub-b")
            .is_some_and(|(_, state)| state == "creating")
    });
    w.start_daemon();
    let (_, sub_b) = w.wait("sub-b Running", Duration::from_secs(60), || {
        running_with_vm(&w, "sub-b")
    });
    assert_eq!(guest(&w, &sub_b, "cat /root/mark").1, "written-in-main\n");

    let vms = w.vms();
    let names: Vec<&String> = vms.keys().collect();
    assert_eq!(
        names,
        [SOURCE_VM, "vk-default-sub-a", "vk-default-sub-b"],
        "one VM per pod, no leftover\n{}",
        tail(&w.log(), 40)
    );
    assert_eq!(vms[SOURCE_VM], (main_id, "running".to_string()));
    assert_eq!(vms["vk-default-sub-a"].0, sub_a);
    assert_eq!(vms["vk-default-sub-b"].0, sub_b);
    assert_eq!(snapshots_named(&w, &format!("fork-{SOURCE_VM}")), 1);
    assert_eq!(half_saved(&w), 0);
}
