//! Process tests of hibernate, wake and restore: the real daemon, the fake cocoon and a real
//! registry. A VM keeps its name and its data across hibernate / wake; a pod whose hibernate
//! tag another daemon pushed is restored; a daemon killed at each step converges after restart.

use crate::daemon_support;

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use daemon_support::{
    annotation, execs, phase, running_with_vm, set_hibernate, with_annotation, World,
};
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::sandbox::fake_cocoon::VerbFault;
use vk_cocoon::snapshots::manifest_info;

const LIFECYCLE: &str = "vm.cocoonstack.io/lifecycle-state";
const LIMIT: Duration = Duration::from_secs(60);

/// The file of a VM's run dir that the fake cocoon treats as the guest's disk contents.
fn guest_data(w: &World, vm_id: &str) -> PathBuf {
    w.path("root/run/cloudhypervisor")
        .join(vm_id)
        .join("guest.data")
}

fn tag_snapshot_id(w: &World, vm: &str) -> Option<String> {
    manifest_info(&w.registry_client(), vm, "hibernate")
        .expect("registry answers")
        .and_then(|i| i.snapshot_id)
}

/// The pod is hibernated: lifecycle `hibernated`, no VM of its name, the tag in the registry.
fn hibernated(w: &World, name: &str, vm: &str) -> Option<()> {
    let p = w.pod(name)?;
    let done = annotation(&p, LIFECYCLE).as_deref() == Some("hibernated")
        && annotation(&p, "vm.cocoonstack.io/id").is_none()
        && !w.vms().contains_key(vm)
        && phase(&p) == "Pending";
    (done && tag_snapshot_id(w, vm).is_some()).then_some(())
}

/// Running with a VM of this name whose lifecycle says `ready`.
fn woken(w: &World, name: &str, vm: &str) -> Option<String> {
    let (p, id) = running_with_vm(w, name)?;
    let ready = annotation(&p, LIFECYCLE).as_deref() == Some("ready");
    let vms = w.vms();
    (ready && vms.get(vm).map(|(i, _)| i) == Some(&id)).then_some(id)
}

/// `World::wait` that reports the pod's Events and the provider's log lines on a timeout.
fn wait_for<T>(w: &World, pod: &str, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > LIMIT {
            let log: Vec<String> = w
                .log()
                .lines()
                .filter(|l| {
                    l.contains("provider") || l.contains(" event ") || l.contains("cocoon op")
                })
                .map(str::to_string)
                .collect();
            panic!(
                "timed out waiting for {what}\nevents: {:#?}\npod: {:?}\nlog:\n{}",
                w.events_for(pod),
                w.pod(pod).map(|p| p.metadata.annotations),
                log[log.len().saturating_sub(40)..].join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start_pod(w: &mut World, name: &str) -> String {
    w.seed_snapshot("base");
    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", name, "clone", "base"))
        .expect("create pod");
    w.wait("pod Running", LIMIT, || running_with_vm(w, name)).1
}

#[test]
fn hibernate_then_wake_keeps_the_vm_name_and_its_data() {
    let mut w = World::dhcp();
    let vm = "vk-default-p0";
    let id = start_pod(&mut w, "p0");
    fs::write(guest_data(&w, &id), b"written before hibernate\n").unwrap();

    set_hibernate(&w, "p0", true);
    wait_for(&w, "p0", "hibernated", || hibernated(&w, "p0", vm));
    w.wait_event("p0", "Hibernated", |m| m == "snapshot pushed to registry");
    w.wait_event("p0", "ProviderUpdateSuccess", |m| {
        m == "Update pod in provider successfully"
    });
    // The local snapshot the tag was pushed from is kept (the wake verifies it).
    let (ok, list) = w.cocoon(&["snapshot", "inspect", vm]);
    assert!(ok, "{list}");

    set_hibernate(&w, "p0", false);
    let new_id = wait_for(&w, "p0", "woken", || woken(&w, "p0", vm));
    assert_ne!(new_id, id, "a new VM under the same name");
    assert_eq!(
        fs::read(guest_data(&w, &new_id)).unwrap(),
        b"written before hibernate\n"
    );
    w.wait_event("p0", "Woken", |m| {
        m == format!("cloned from local snapshot {vm}")
    });
    assert!(
        tag_snapshot_id(&w, vm).is_some(),
        "a wake never deletes the tag"
    );
    for family in [
        "snapshot_save_total{result=\"ok\"}",
        "snapshot_verify_total{result=\"ok\"}",
        "wake_total{result=\"ok\"}",
        "hibernate_total{namespace=\"default\",phase=\"remove\",result=\"ok\"}",
    ] {
        w.wait_metric(&format!("vk_cocoon_{family}"), 1.0);
    }
}

#[test]
fn a_pod_whose_hibernate_tag_another_daemon_pushed_is_restored() {
    let mut w = World::dhcp();
    let vm = "vk-default-p1";
    w.seed_snapshot("base");
    // Another daemon's hibernation: a VM with data, saved and pushed, then removed with its
    // local snapshot, so only the registry holds it.
    let (ok, out) = w.cocoon(&["vm", "clone", "--output", "json", "--name", vm, "base"]);
    assert!(ok, "{out}");
    let other = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    fs::write(guest_data(&w, &other), b"from the other node\n").unwrap();
    assert!(w.cocoon(&["snapshot", "save", "--name", vm, &other]).0);
    w.push_snapshot(vm, "hibernate", "base");
    assert!(w.cocoon(&["vm", "rm", "--force", &other]).0);
    assert!(w.cocoon(&["snapshot", "rm", vm]).0);

    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "p1", "clone", "base"))
        .expect("create pod");
    let id = wait_for(&w, "p1", "restored", || woken(&w, "p1", vm));
    assert_eq!(
        fs::read(guest_data(&w, &id)).unwrap(),
        b"from the other node\n"
    );
    w.wait_event("p1", "HibernateSnapshotExists", |_| true);
    w.wait_event("p1", "Woken", |m| {
        m == format!("cloned from registry {vm}:hibernate")
    });
    // The import served its clone and is gone.
    let import = format!("{vm}-hibernate-import");
    w.wait("import removed", LIMIT, || {
        (!w.cocoon(&["snapshot", "inspect", &import]).0).then_some(())
    });
    w.wait_metric(
        "vk_cocoon_hibernate_evidence_total{verdict=\"restored\"}",
        1.0,
    );
}

/// The VM's NICs as the fake cocoon reports them.
fn nic_count(w: &World, vm_ref: &str) -> usize {
    let (ok, out) = w.cocoon(&["vm", "inspect", vm_ref]);
    assert!(ok, "{out}");
    let vm: serde_json::Value = serde_json::from_str(&out).expect("inspect JSON");
    vm["network_configs"].as_array().map_or(0, Vec::len)
}

/// The NICs a local snapshot recorded for its VM.
fn snapshot_nics(w: &World, name: &str) -> u64 {
    let (ok, out) = w.cocoon(&["snapshot", "inspect", name]);
    assert!(ok, "{out}");
    let snap: serde_json::Value = serde_json::from_str(&out).expect("snapshot JSON");
    snap["nics"].as_u64().unwrap_or(0)
}

/// Whether the fake cocoon ran this guest command in the VM.
fn guest_ran(w: &World, vm_id: &str, command: &[&str]) -> bool {
    execs(w).iter().any(|(vm, argv)| {
        vm == vm_id && argv.iter().map(String::as_str).eq(command.iter().copied())
    })
}

/// A Cloud Hypervisor Windows guest (DHCP): its hot-plugged NIC is dropped before the save and
/// the clone brings one back. A failed drop renews the guest's lease and keeps the VM; the op
/// retry then hibernates it; the wake waits for the lease and runs no fix-up on the new NIC.
#[test]
fn a_windows_guest_drops_its_nic_to_hibernate_and_gets_one_back_on_wake() {
    let mut w = World::dhcp();
    let (name, vm) = ("win", "vk-default-win");
    w.seed_snapshot("winbase");
    w.start_daemon();
    let p = with_annotation(
        with_annotation(
            demo_pod("default", name, "clone", "winbase"),
            "cocoonset.cocoonstack.io/os",
            "windows",
        ),
        "vm.cocoonstack.io/backend",
        "cloud-hypervisor",
    );
    w.api.create_pod(&p).expect("create pod");
    let id = wait_for(&w, name, "Running and ready", || {
        let (p, id) = running_with_vm(&w, name)?;
        (annotation(&p, LIFECYCLE).as_deref() == Some("ready")).then_some(id)
    });
    fs::write(guest_data(&w, &id), b"windows data\n").unwrap();
    assert_eq!(nic_count(&w, &id), 1);

    // 1. The NIC drop fails: the guest is told to renew its lease, the VM keeps running.
    w.set_fault(
        "vm net",
        VerbFault {
            fail_count: 1,
            fail_message: "net: hot-unplug refused by the guest".into(),
            ..Default::default()
        },
    );
    set_hibernate(&w, name, true);
    wait_for(&w, name, "HibernateNetResizeFailed", || {
        w.events_for(name)
            .iter()
            .any(|(r, m)| r == "HibernateNetResizeFailed" && m.contains("hot-unplug refused"))
            .then_some(())
    });
    wait_for(&w, name, "the detached ipconfig /renew", || {
        guest_ran(&w, &id, &["cmd", "/c", "ipconfig", "/renew"]).then_some(())
    });
    assert_eq!(w.vms().get(vm).map(|(i, _)| i.as_str()), Some(id.as_str()));
    assert_eq!(nic_count(&w, &id), 1, "the NIC stays");
    // The lifecycle `failed` is a pod write of its own, in no fixed order with the Event.
    wait_for(&w, name, "lifecycle failed", || {
        let p = w.pod(name)?;
        (annotation(&p, LIFECYCLE).as_deref() == Some("failed")).then_some(())
    });

    // 2. The op retry (15 s) hibernates it: release, NIC dropped, then the save.
    wait_for(&w, name, "hibernated on the retry", || {
        hibernated(&w, name, vm)
    });
    assert!(guest_ran(&w, &id, &["cmd", "/c", "ipconfig", "/release"]));
    // The snapshot records the NICs its VM had (the seed's VM had one; 0 is left out).
    assert_eq!(snapshot_nics(&w, "winbase"), 1);
    assert_eq!(snapshot_nics(&w, vm), 0, "saved without its NIC");
    for (phase, result, n) in [
        ("net_resize", "failed", 1.0),
        ("net_resize", "ok", 1.0),
        ("dhcp_release", "ok", 2.0),
    ] {
        w.wait_metric(
            &format!(
                "vk_cocoon_hibernate_total{{namespace=\"default\",phase=\"{phase}\",result=\"{result}\"}}"
            ),
            n,
        );
    }

    // 3. The wake clones with a NIC again and waits for its lease; the new NIC is not cycled.
    set_hibernate(&w, name, false);
    let new_id = wait_for(&w, name, "woken", || woken(&w, name, vm));
    assert_eq!(nic_count(&w, &new_id), 1);
    let pod = w.pod(name).expect("pod");
    let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
    assert!(ip.is_some_and(|ip| ip.starts_with("127.88.")), "{pod:?}");
    assert!(
        execs(&w).iter().all(|(vm, _)| *vm != new_id),
        "no guest command on the woken VM: {:?}",
        execs(&w)
    );
    assert_eq!(
        fs::read(guest_data(&w, &new_id)).unwrap(),
        b"windows data\n"
    );
    w.wait_metric("vk_cocoon_wake_total{result=\"ok\"}", 1.0);
}

/// A VM removed from outside after its hibernate's push failed (the hibernate rolled back:
/// id written back, lifecycle `failed`), then a restart. No hibernate tag exists, so the pod is
/// not taken for hibernated (its wake would boot a fresh VM): it is evicted as a lost VM.
#[test]
fn a_vm_lost_after_a_failed_push_is_evicted_after_a_restart_not_taken_for_hibernated() {
    let mut w = World::dhcp();
    let (name, vm) = ("p4", "vk-default-p4");
    let id = start_pod(&mut w, name);
    w.set_fault(
        "snapshot export",
        VerbFault {
            truncate_after: 4096,
            ..Default::default()
        },
    );
    set_hibernate(&w, name, true);
    wait_for(&w, name, "HibernatePushFailed", || {
        w.events_for(name)
            .iter()
            .any(|(r, _)| r == "HibernatePushFailed")
            .then_some(())
    });
    wait_for(&w, name, "the id written back", || {
        let p = w.pod(name)?;
        (annotation(&p, "vm.cocoonstack.io/id").as_deref() == Some(id.as_str())).then_some(())
    });
    w.kill_daemon();
    w.clear_faults();
    let (ok, out) = w.cocoon(&["fake", "vanish", &id]);
    assert!(ok, "{out}");
    assert!(tag_snapshot_id(&w, vm).is_none(), "the push never landed");

    w.start_daemon();
    wait_for(&w, name, "the pod evicted", || {
        let evicted = match w.pod(name) {
            None => true,
            Some(p) => {
                let st = p.status.unwrap_or_default();
                st.phase.as_deref() == Some("Failed") && st.reason.as_deref() == Some("VMGone")
            }
        };
        evicted.then_some(())
    });
    // Events go last in the kube lane: the Warning may land after the Failed status.
    wait_for(&w, name, "the HibernateVMLost Warning", || {
        w.events_for(name)
            .iter()
            .any(|(r, m)| {
                r == "HibernateVMLost" && m.contains(&format!("no {vm}:hibernate in the registry"))
            })
            .then_some(())
    });
    assert!(!w.vms().contains_key(vm), "no VM booted in its place");
    w.wait_metric(
        "vk_cocoon_pod_lifecycle_total{op=\"startup\",reason=\"hibernate_vm_lost\",result=\"failed\"}",
        1.0,
    );
}

/// Ask for `hibernate=on` with the cocoon verb `group verb` slowed down, SIGKILL the daemon
/// while that verb runs, then restart it without the fault.
fn crash_during(w: &mut World, name: &str, on: bool, group: &str, verb: &str) {
    w.set_fault(
        &format!("{group} {verb}"),
        VerbFault {
            slow_ms: 3000,
            ..Default::default()
        },
    );
    set_hibernate(w, name, on);
    wait_for(w, name, &format!("{group} {verb} running"), || {
        w.cocoon_running(group, verb).then_some(())
    });
    w.kill_daemon();
    w.clear_faults();
    // Whatever the killed daemon's child was doing finishes or dies before the restart.
    w.wait("the step's process gone", LIMIT, || {
        (!w.cocoon_running(group, verb)).then_some(())
    });
    w.start_daemon();
}

#[test]
fn a_daemon_killed_at_each_step_of_hibernate_and_wake_converges() {
    let mut w = World::dhcp();
    let (name, vm) = ("p2", "vk-default-p2");
    let id = start_pod(&mut w, name);
    let data = b"kept through every crash\n".to_vec();
    fs::write(guest_data(&w, &id), &data).unwrap();

    // The hibernate tag, once it exists, never disappears: a replacement overwrites it.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let tag_lost = std::sync::atomic::AtomicBool::new(false);
    let base = w.registry_base();
    std::thread::scope(|s| {
        s.spawn(|| {
            let client = vk_cocoon::snapshots::RegistryClient::from_env(&base, None).unwrap();
            let mut seen = false;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match manifest_info(&client, vm, "hibernate") {
                    Ok(Some(_)) => seen = true,
                    Ok(None) if seen => tag_lost.store(true, std::sync::atomic::Ordering::SeqCst),
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let steps: [(bool, &str, &str); 6] = [
            (true, "snapshot", "save"),
            (false, "snapshot", "inspect"),
            (true, "snapshot", "export"),
            (false, "vm", "clone"),
            (true, "vm", "rm"),
            (false, "snapshot", "import"),
        ];
        for (on, group, verb) in steps {
            if (group, verb) == ("snapshot", "import") {
                // This node lost its local copy: the wake pulls the tag.
                assert!(w.cocoon(&["snapshot", "rm", vm]).0);
            }
            crash_during(&mut w, name, on, group, verb);
            let step = format!("{group} {verb}");
            if on {
                wait_for(
                    &w,
                    name,
                    &format!("hibernated after a crash in {step}"),
                    || hibernated(&w, name, vm),
                );
            } else {
                let id = wait_for(&w, name, &format!("woken after a crash in {step}"), || {
                    woken(&w, name, vm)
                });
                assert_eq!(fs::read(guest_data(&w, &id)).unwrap(), data, "{step}");
            }
            // One VM at most, the pod's: nothing lost, nothing doubled.
            let vms = w.vms();
            assert!(
                vms.keys().all(|n| n == vm) && vms.len() == usize::from(!on),
                "{step}: {vms:?}"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    assert!(
        !tag_lost.load(std::sync::atomic::Ordering::SeqCst),
        "the hibernate tag vanished at some point"
    );
    w.wait_event(name, "ResumedAfterRestart", |m| m == "op=hibernate");
}
