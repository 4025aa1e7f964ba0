//! Process tests of a wedged cocoon: calls that never return. Every cocoon call the daemon
//! makes, on the loop (clone, inspect, snapshot save) or on a worker thread (image pull), is
//! killed at its deadline (`VK_COCOON_DEADLINES`, short here), the operation fails with a
//! Warning and is retried to completion; the loop keeps turning meanwhile; and a daemon
//! SIGKILLed while calls hang leaves none of them running.

use crate::daemon_support;

use std::time::{Duration, Instant};

use daemon_support::{
    assert_loop_turns, cocoon_children, hibernated, phase, running_with_vm, set_hibernate,
    wait_turning, wait_warning, World,
};
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::sandbox::fake_cocoon::{self, FaultFile, VerbFault};
use vk_cocoon::snapshots::manifest_info;

const LIMIT: Duration = Duration::from_secs(60);
const DEADLINES: &str = "query=3,control=8,create=4,transfer=4";

fn wedged_world() -> World {
    let mut w = World::new();
    w.extra_env
        .push(("VK_COCOON_DEADLINES".into(), DEADLINES.into()));
    w.seed_snapshot("base");
    w
}

/// The next `n` calls of `verb` hang (after their placeholder, for clone and save).
fn hang_next(w: &World, verb: &str, n: u64) {
    w.set_fault(
        verb,
        VerbFault {
            hang_count: n,
            ..Default::default()
        },
    );
}

/// Waits for this world's `cocoon <group> <verb>` to be running; returns its PIDs.
fn hanging(w: &World, group: &str, verb: &str) -> Vec<u32> {
    w.wait(&format!("a hung {group} {verb}"), LIMIT, || {
        Some(cocoon_children(w, group, verb)).filter(|p| !p.is_empty())
    })
}

/// Whether process `pid` still runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn vm_count(w: &World, name: &str) -> usize {
    fake_cocoon::stored_vms(&w.path("state"))
        .iter()
        .filter(|v| v.vm.config.name == name)
        .count()
}

#[test]
fn every_wedged_cocoon_call_is_killed_at_its_deadline_and_its_operation_completes() {
    let mut w = wedged_world();
    w.start_daemon();

    // 1. A worker thread's call: `cocoon image pull` of a mode=run pod hangs.
    hang_next(&w, "image pull", 1);
    let start = Instant::now();
    w.api
        .create_pod(&demo_pod("default", "pulled", "run", "ubuntu:24.04"))
        .expect("create pod");
    let hung = hanging(&w, "image", "pull");
    let msg = wait_warning(&w, "pulled", "CreateBringUpFailed", "deadline");
    assert!(
        msg.contains("image pull"),
        "the Warning names the call: {msg}"
    );
    assert!(
        !hung.iter().any(|p| alive(*p)),
        "the hung image pull still runs after its deadline"
    );
    let (_, pulled_id) = wait_turning(&w, "pulled Running", LIMIT, || {
        running_with_vm(&w, "pulled")
    });
    eprintln!(
        "wedged image pull: Running {:?} after the create",
        start.elapsed()
    );

    // 2. On the loop: `vm clone` hangs after writing its `creating` record.
    hang_next(&w, "vm clone", 1);
    let start = Instant::now();
    w.api
        .create_pod(&demo_pod("default", "cloned", "clone", "base"))
        .expect("create pod");
    let hung = hanging(&w, "vm", "clone");
    wait_warning(&w, "cloned", "CreateBringUpFailed", "timed out");
    wait_turning(&w, "cloned Running", LIMIT, || {
        running_with_vm(&w, "cloned")
    });
    eprintln!(
        "wedged vm clone: Running {:?} after the create",
        start.elapsed()
    );
    assert_eq!(
        vm_count(&w, "vk-default-cloned"),
        1,
        "one VM, no leftover record"
    );
    assert!(!hung.iter().any(|p| alive(*p)), "the hung clone still runs");

    // 3. `snapshot save` of a hibernate hangs: the VM is kept, the hibernate is retried.
    hang_next(&w, "snapshot save", 1);
    let start = Instant::now();
    set_hibernate(&w, "cloned", true);
    let hung = hanging(&w, "snapshot", "save");
    wait_warning(&w, "cloned", "HibernateSnapshotFailed", "timed out");
    assert_eq!(
        w.vms().get("vk-default-cloned").map(|(_, s)| s.clone()),
        Some("running".into()),
        "the VM is kept when its snapshot could not be saved"
    );
    wait_turning(&w, "cloned hibernated", LIMIT, || {
        hibernated(&w, "cloned", "vk-default-cloned")
    });
    eprintln!(
        "wedged snapshot save: hibernated {:?} after the request",
        start.elapsed()
    );
    let tag = manifest_info(&w.registry_client(), "vk-default-cloned", "hibernate")
        .expect("registry answers");
    assert!(tag.is_some(), "the hibernate tag was pushed");
    assert!(!hung.iter().any(|p| alive(*p)), "the hung save still runs");

    // 4. `vm inspect` of a VM-gone check hangs: killed, rechecked, the pod evicted.
    hang_next(&w, "vm inspect", 1);
    let start = Instant::now();
    let uid = w
        .pod("pulled")
        .and_then(|p| p.metadata.uid)
        .unwrap_or_default();
    let (ok, out) = w.cocoon(&["fake", "vanish", &pulled_id]);
    assert!(ok, "{out}");
    let hung = hanging(&w, "vm", "inspect");
    wait_turning(&w, "pulled evicted", LIMIT, || match w.pod("pulled") {
        None => Some(()),
        Some(p) if p.metadata.uid.as_deref() != Some(uid.as_str()) => Some(()),
        Some(p) if phase(&p) == "Failed" => Some(()),
        Some(_) => None,
    });
    eprintln!(
        "wedged vm inspect: pod evicted {:?} after the VM vanished",
        start.elapsed()
    );
    assert!(
        w.log().contains("vm inspect"),
        "the daemon inspected the vanished VM"
    );
    assert!(
        !hung.iter().any(|p| alive(*p)),
        "the hung inspect still runs"
    );
    assert_loop_turns(&w, 30.0);
}

/// The daemon is SIGKILLed while a clone (a child of the loop) and an image pull (a child of
/// a worker thread) hang: both die with it, and the restarted daemon brings both pods up
/// with one VM each.
#[test]
fn hung_cocoon_children_die_with_a_killed_daemon_and_the_restart_finishes_their_work() {
    let mut w = wedged_world();
    // Long deadlines: only the daemon's death may end these calls.
    w.extra_env.clear();
    let mut faults = FaultFile::new();
    for verb in ["vm clone", "image pull"] {
        faults.insert(
            verb.into(),
            VerbFault {
                hang: true,
                ..Default::default()
            },
        );
    }
    fake_cocoon::write_faults(&w.path("state"), &faults).expect("faults");
    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "cloning", "clone", "base"))
        .expect("create pod");
    w.api
        .create_pod(&demo_pod("default", "pulling", "run", "ubuntu:24.04"))
        .expect("create pod");
    let hung = w.wait("both calls hanging", LIMIT, || {
        let clone = cocoon_children(&w, "vm", "clone");
        let pull = cocoon_children(&w, "image", "pull");
        (!clone.is_empty() && !pull.is_empty()).then(|| [clone, pull].concat())
    });
    let killed = Instant::now();
    w.kill_daemon();
    w.wait("the hung children gone", Duration::from_secs(20), || {
        (!hung.iter().any(|p| alive(*p))).then_some(())
    });
    eprintln!(
        "hung children gone {:?} after the daemon's SIGKILL",
        killed.elapsed()
    );

    w.clear_faults();
    let restarted = Instant::now();
    w.start_daemon();
    for name in ["cloning", "pulling"] {
        wait_turning(&w, &format!("{name} Running"), LIMIT, || {
            running_with_vm(&w, name)
        });
        assert_eq!(
            vm_count(&w, &format!("vk-default-{name}")),
            1,
            "{name}: one VM"
        );
    }
    eprintln!(
        "both pods Running {:?} after the restart",
        restarted.elapsed()
    );
}
