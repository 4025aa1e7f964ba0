//! Process tests of the daemon's snapshot paths with the real registry: snapshot-before-delete
//! per snapshot policy (the `latest` tag is there before the VM goes), a daemon SIGKILLed in
//! the middle of that push, and the local snapshot reclaimer at start.

use crate::daemon_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use daemon_support::{cocoon_children, running_with_vm, snapshot_names, with_annotation, World};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::sandbox::fake_cocoon::VerbFault;
use vk_cocoon::snapshots::{manifest_info, pull_snapshot, PullRequest};

const LIMIT: Duration = Duration::from_secs(60);

fn tag_id(w: &World, repo: &str, tag: &str) -> Option<String> {
    manifest_info(&w.registry_client(), repo, tag)
        .expect("registry answers")
        .map(|i| i.snapshot_id.unwrap_or_default())
}

/// A pod of CocoonSet `cs` in slot `slot` (VM `vk-default-cs-<slot>`) with `policy`.
fn set_pod(name: &str, slot: u32, policy: &str) -> Pod {
    set_pod_with_vm(name, &format!("vk-default-cs-{slot}"), policy)
}

/// A pod of CocoonSet `cs` whose VM is named `vm`, with `policy`.
fn set_pod_with_vm(name: &str, vm: &str, policy: &str) -> Pod {
    let mut p = with_annotation(
        demo_pod("default", name, "clone", "base"),
        "cocoonset.cocoonstack.io/snapshot-policy",
        policy,
    );
    p = with_annotation(p, "vm.cocoonstack.io/name", vm);
    p.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "cocoonset.cocoonstack.io/v1".into(),
        kind: "CocoonSet".into(),
        name: "cs".into(),
        uid: "cs-uid".into(),
        ..Default::default()
    }]);
    p
}

/// Deletes pod `name` and waits until its object is gone, checking all along that its VM is
/// never gone while the `latest` tag is missing (when `pushed`). Returns the seconds it took.
fn delete_and_watch(w: &World, name: &str, vm: &str, pushed: bool) -> f64 {
    let start = Instant::now();
    w.api.delete_pod("default", name, Some(30)).expect("delete");
    w.wait(&format!("{name} gone"), LIMIT, || {
        let vm_gone = !w.vms().contains_key(vm);
        if vm_gone && pushed {
            assert!(
                tag_id(w, vm, "latest").is_some(),
                "{vm} removed before its snapshot was pushed"
            );
        }
        (vm_gone && w.pod(name).is_none()).then_some(())
    });
    start.elapsed().as_secs_f64()
}

#[test]
fn snapshot_before_delete_pushes_latest_before_the_vm_goes_as_the_policy_says() {
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    let pods = [
        (set_pod("always", 5, "always"), "vk-default-cs-5", true),
        (set_pod("main", 0, "main-only"), "vk-default-cs-0", true),
        (set_pod("sub", 1, "main-only"), "vk-default-cs-1", false),
        (set_pod("never", 2, "never"), "vk-default-cs-2", false),
    ];
    for (p, _, _) in &pods {
        w.api.create_pod(p).expect("create pod");
    }
    for (p, vm, pushed) in &pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        let (_, id) = w.wait(&format!("{name} Running"), LIMIT, || {
            running_with_vm(&w, &name)
        });
        // What the guest wrote must be in the pushed snapshot.
        let data = w
            .path("root/run/cloudhypervisor")
            .join(&id)
            .join("guest.data");
        std::fs::write(&data, format!("written by {name}")).expect("guest data");
        let took = delete_and_watch(&w, &name, vm, *pushed);
        eprintln!("delete of {name} ({vm}, pushed: {pushed}): {took:.2} s");
        assert_eq!(
            tag_id(&w, vm, "latest").is_some(),
            *pushed,
            "{name}: latest tag"
        );
        if *pushed {
            let local = format!("check-{name}");
            let req = PullRequest::new(vm, "latest", &local, w.path("bin/cocoon"));
            pull_snapshot(&w.registry_client(), &req).expect("latest pulls");
            let (ok, out) =
                w.cocoon(&["vm", "clone", "--output", "json", "--name", &local, &local]);
            assert!(ok, "{out}");
            let clone_id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let restored = w
                .path("root/run/cloudhypervisor")
                .join(&clone_id)
                .join("guest.data");
            assert_eq!(
                std::fs::read_to_string(restored).unwrap_or_default(),
                format!("written by {name}"),
                "the pushed snapshot holds the guest's data"
            );
            assert!(w.cocoon(&["vm", "rm", "--force", &clone_id]).0);
        }
    }
}

/// `main-only` recognises the main agent (slot 0) under each of the operator's naming schemes
/// and pushes it alone: not the sub-agents, not the toolboxes.
#[test]
fn main_only_pushes_the_main_agent_under_every_naming_scheme() {
    use vk_cocoon::provider::naming::{dotted_name, hashed_name, plain_name};
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    type NameOf = fn(&str, &str) -> String;
    let schemes: [(&str, NameOf); 3] = [
        ("plain", plain_name),
        ("dotted", dotted_name),
        ("hashed", hashed_name),
    ];
    for (scheme, name_of) in schemes {
        let pods = [("cs-0", true), ("cs-1", false), ("cs-shell", false)];
        for (pod, pushed) in pods {
            let vm = name_of("default", pod);
            w.api
                .create_pod(&set_pod_with_vm(pod, &vm, "main-only"))
                .expect("create pod");
            w.wait(&format!("{scheme} {pod} Running"), LIMIT, || {
                running_with_vm(&w, pod)
            });
            let took = delete_and_watch(&w, pod, &vm, pushed);
            eprintln!("{scheme}: delete of {pod} ({vm}): {took:.2} s");
            assert_eq!(
                tag_id(&w, &vm, "latest").is_some(),
                pushed,
                "{scheme} {pod} ({vm}): latest tag"
            );
        }
    }
    // Each save before a delete and each push is timed under the namespace of the pod it
    // was made for.
    let metrics = w.metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l == "vk_cocoon_snapshot_save_duration_seconds_count{namespace=\"default\"} 3"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("save_duration"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "vk_cocoon_snapshot_push_duration_seconds_count{namespace=\"default\"} 3"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("push_duration"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// `force-pull` on a clone: a tag re-pushed in the registry is pulled again (the local copy
/// is replaced), while a pod without it clones the local copy as it is.
#[test]
fn force_pull_clones_pull_a_re_pushed_tag_again() {
    let mut w = World::new();
    w.seed_snapshot("golden");
    w.push_base_snapshot("golden", "v1");
    w.start_daemon();
    let local_id = |w: &World| -> String {
        let (ok, out) = w.cocoon(&["snapshot", "inspect", "golden:v1"]);
        assert!(ok, "{out}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let run = |w: &World, name: &str, force: bool| {
        let mut p = demo_pod("default", name, "clone", "golden:v1");
        if force {
            p = with_annotation(p, "cocoonset.cocoonstack.io/force-pull", "true");
        }
        w.api.create_pod(&p).expect("create pod");
        w.wait(&format!("{name} Running"), LIMIT, || {
            running_with_vm(w, name)
        });
    };
    run(&w, "first", false);
    let first = local_id(&w);
    // The tag moves: a new golden snapshot is pushed under the same tag.
    assert!(w.cocoon(&["snapshot", "rm", "golden"]).0);
    w.seed_snapshot("golden");
    w.push_base_snapshot("golden", "v1");
    run(&w, "cached", false);
    assert_eq!(
        local_id(&w),
        first,
        "without force-pull the local copy is cloned"
    );
    run(&w, "forced", true);
    assert_ne!(
        local_id(&w),
        first,
        "force-pull pulled the re-pushed tag again"
    );
}

/// SIGKILL while the snapshot-before-delete push streams the export: the VM and the pod
/// object outlive the kill, no tag is left, and the restarted daemon pushes, removes the VM
/// and then the object: no orphan, no duplicate, one `latest`.
#[test]
fn a_daemon_killed_mid_snapshot_before_delete_pushes_and_removes_after_restart() {
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    w.api
        .create_pod(&set_pod("victim", 0, "always"))
        .expect("create pod");
    let (_, id) = w.wait("victim Running", LIMIT, || running_with_vm(&w, "victim"));
    w.set_fault(
        "snapshot export",
        VerbFault {
            slow_ms: 60_000,
            ..Default::default()
        },
    );
    w.api
        .delete_pod("default", "victim", Some(30))
        .expect("delete");
    w.wait("the push's export running", LIMIT, || {
        (!cocoon_children(&w, "snapshot", "export").is_empty()).then_some(())
    });
    w.kill_daemon();
    w.wait("the export died with the daemon", LIMIT, || {
        cocoon_children(&w, "snapshot", "export")
            .is_empty()
            .then_some(())
    });
    assert_eq!(
        w.vms().get("vk-default-cs-0").map(|(i, _)| i.clone()),
        Some(id),
        "the VM outlives a push that did not land"
    );
    assert!(w.pod("victim").is_some(), "the object outlives its VM");
    assert_eq!(tag_id(&w, "vk-default-cs-0", "latest"), None);

    w.clear_faults();
    let restarted = Instant::now();
    w.start_daemon();
    w.wait("victim gone", LIMIT, || {
        let vm_gone = !w.vms().contains_key("vk-default-cs-0");
        if vm_gone {
            assert!(tag_id(&w, "vk-default-cs-0", "latest").is_some());
        }
        (vm_gone && w.pod("victim").is_none()).then_some(())
    });
    eprintln!(
        "SIGKILL mid delete push: converged {:?} after the restart",
        restarted.elapsed()
    );
    assert!(w.vms().is_empty(), "no orphan: {:?}", w.vms());
}

/// At start the reclaimer removes wake imports, tagged base snapshots and `vk-` snapshots the
/// registry no longer vouches for (with their `fork-`), and keeps what a pod uses, what the
/// registry's hibernate tag names, and what is not the daemon's (`base`).
#[test]
fn the_snapshot_reclaimer_removes_what_nothing_vouches_for_and_keeps_the_rest() {
    let mut w = World::new();
    w.seed_snapshot("base");
    // A running pod uses the name vk-default-inuse (its VM's).
    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "inuse", "clone", "base"))
        .expect("create pod");
    w.wait("inuse Running", LIMIT, || running_with_vm(&w, "inuse"));
    w.kill_daemon();
    for name in [
        "vk-default-gone-hibernate-import",
        "vk-default-img:v2",
        "vk-default-stale",
        "fork-vk-default-stale",
        "vk-default-hib",
        "vk-default-inuse",
    ] {
        w.seed_snapshot(name);
    }
    // The registry vouches for vk-default-hib only (vk-default-stale has no hibernate tag).
    w.push_snapshot("vk-default-hib", "hibernate", "base");
    w.start_daemon();
    w.wait("the reclaimer's run at start", LIMIT, || {
        w.log()
            .contains("snapshot reclaimer: run done")
            .then_some(())
    });
    let expected: BTreeSet<String> = ["base", "vk-default-hib", "vk-default-inuse"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    // The run's removals are cocoon children that may still be running when it logs its
    // end: wait for them, then check that nothing vouched for goes afterwards.
    let settled = Instant::now() + Duration::from_secs(10);
    let mut left = snapshot_names(&w);
    while left != expected && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(50));
        left = snapshot_names(&w);
    }
    assert_eq!(left, expected, "{}", daemon_support::tail(&w.log(), 30));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(snapshot_names(&w), expected, "a kept snapshot went later");
    assert!(running_with_vm(&w, "inuse").is_some());
}
