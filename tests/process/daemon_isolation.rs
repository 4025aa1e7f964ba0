//! Process tests of tenant isolation: each attack of another namespace's VM, snapshot or tag
//! through the real binary, the fake API server, the fake cocoon (which resolves ID prefixes
//! as cocoon does) and a real registry; and the operator's own flows under the three naming
//! schemes (plain, dotted, hashed), which must keep working.
//!
//! Waits poll until a condition holds; their deadlines are failure bounds.

use crate::daemon_support;

use std::collections::BTreeMap;
use std::time::Duration;

use daemon_support::{annotation, phase, tail, World};
use k8s_openapi::api::core::v1::Pod;
use vk_cocoon::provider::naming::hashed_name;
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::snapshots::manifest_info;

const LIMIT: Duration = Duration::from_secs(60);
const LIFECYCLE: &str = "vm.cocoonstack.io/lifecycle-state";

/// A managed clone pod of namespace `ns` whose VM is `vm`, cloned from `image`.
fn pod(ns: &str, name: &str, vm: &str, image: &str) -> Pod {
    let mut p = demo_pod(ns, name, "clone", image);
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.insert("vm.cocoonstack.io/name".into(), vm.into());
    }
    p
}

fn with(mut p: Pod, pairs: &[(&str, &str)]) -> Pod {
    let a = p.metadata.annotations.get_or_insert_with(Default::default);
    for (k, v) in pairs {
        a.insert(k.to_string(), v.to_string());
    }
    p
}

/// The pod's VM id once it runs (phase Running with an id annotation).
fn running(w: &World, ns: &str, name: &str) -> Option<String> {
    let p = w.api.get_pod(ns, name)?;
    let id = annotation(&p, "vm.cocoonstack.io/id")?;
    (phase(&p) == "Running" && !id.is_empty()).then_some(id)
}

fn wait_running(w: &World, ns: &str, name: &str) -> String {
    w.wait(&format!("{ns}/{name} Running"), LIMIT, || {
        running(w, ns, name)
    })
}

/// Sets annotation `key` of pod `ns/name`, retrying on a write conflict with the daemon.
fn set(w: &World, ns: &str, name: &str, key: &str, value: &str) {
    for _ in 0..200 {
        let mut p = w.api.get_pod(ns, name).expect("pod");
        p.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(key.into(), value.into());
        if w.api.update_pod(&p).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("could not set {key}={value} on {ns}/{name}");
}

/// The Warnings of pod `ns/name` with this reason.
fn warned(w: &World, ns: &str, name: &str, reason: &str) -> bool {
    w.api.list_objects("events").iter().any(|e| {
        e["involvedObject"]["name"] == name
            && e["involvedObject"]["namespace"] == ns
            && e["type"] == "Warning"
            && e["reason"] == reason
    })
}

/// The pod failed for good with a Warning of this reason, and holds no VM.
fn refused(w: &World, ns: &str, name: &str, reason: &str) -> Option<()> {
    let p = w.api.get_pod(ns, name)?;
    let no_vm = annotation(&p, "vm.cocoonstack.io/id").is_none();
    (phase(&p) == "Failed" && no_vm && warned(w, ns, name, reason)).then_some(())
}

fn wait_refused(w: &World, ns: &str, name: &str, reason: &str) {
    w.wait(&format!("{ns}/{name} refused ({reason})"), LIMIT, || {
        refused(w, ns, name, reason)
    });
}

/// The `snapshotId` of registry tag `repo:tag`, if it exists.
fn tag_id(w: &World, repo: &str, tag: &str) -> Option<String> {
    manifest_info(&w.registry_client(), repo, tag)
        .expect("registry answers")
        .and_then(|i| i.snapshot_id)
}

fn delete(w: &World, ns: &str, name: &str) {
    w.api.delete_pod(ns, name, Some(30)).expect("delete pod");
    w.wait(&format!("{ns}/{name} gone"), LIMIT, || {
        w.api.get_pod(ns, name).is_none().then_some(())
    });
}

/// Hibernates pod `ns/name` (VM `vm`) and waits until its VM is gone and its tag pushed.
fn hibernate(w: &World, ns: &str, name: &str, vm: &str) {
    set(w, ns, name, "vm.cocoonstack.io/hibernate", "true");
    w.wait(&format!("{ns}/{name} hibernated"), LIMIT, || {
        let p = w.api.get_pod(ns, name)?;
        let done =
            annotation(&p, LIFECYCLE).as_deref() == Some("hibernated") && !w.vms().contains_key(vm);
        (done && tag_id(w, vm, "hibernate").is_some()).then_some(())
    });
}

/// Runs `sh -c <script>` in a VM through the fake cocoon.
fn guest(w: &World, vm_id: &str, script: &str) -> String {
    let (ok, out) = w.cocoon(&["vm", "exec", vm_id, "--", "sh", "-c", script]);
    assert!(ok, "{out}");
    out
}

fn snapshot_exists(w: &World, name: &str) -> bool {
    w.cocoon(&["snapshot", "inspect", name]).0
}

fn started() -> World {
    let mut w = World::dhcp();
    w.seed_snapshot("base");
    w.start_daemon();
    w
}

/// The daemon log's tail, for a failed assertion.
fn log(w: &World) -> String {
    tail(&w.log(), 40)
}

// ----- attack 1: restoring another namespace's hibernated VM ---------------------------------

#[test]
fn a_pod_naming_another_namespaces_hibernated_vm_is_refused_by_the_name_rule() {
    let w = started();
    w.api
        .create_pod(&pod("teamb", "app-0", "vk-teamb-app-0", "base"))
        .expect("create");
    let id = wait_running(&w, "teamb", "app-0");
    guest(&w, &id, "echo teamb-secret > /root/secret");
    hibernate(&w, "teamb", "app-0", "vk-teamb-app-0");
    delete(&w, "teamb", "app-0");
    assert!(tag_id(&w, "vk-teamb-app-0", "hibernate").is_some());

    w.api
        .create_pod(&pod("evil", "x", "vk-teamb-app-0", "base"))
        .expect("create attacker");
    wait_refused(&w, "evil", "x", "VMNotInNamespace");
    assert!(!w.vms().contains_key("vk-teamb-app-0"), "{}", log(&w));
    assert!(!snapshot_exists(&w, "vk-teamb-app-0-hibernate-import"));
    assert!(w.metrics().contains("reason=\"vm_not_in_namespace\""));
    assert!(!w.log().contains("snapshot import"), "nothing pulled");
}

#[test]
fn a_pod_of_team_naming_a_team_b_vm_is_refused_by_the_ownership_record() {
    // `vk-team-b-app-0` is an operator name of `team` (pod `b-app-0`) as well as of `team-b`.
    let w = started();
    w.api
        .create_pod(&pod("team-b", "app-0", "vk-team-b-app-0", "base"))
        .expect("create");
    wait_running(&w, "team-b", "app-0");
    hibernate(&w, "team-b", "app-0", "vk-team-b-app-0");
    delete(&w, "team-b", "app-0");

    w.api
        .create_pod(&pod("team", "b-app-0", "vk-team-b-app-0", "base"))
        .expect("create attacker");
    wait_refused(&w, "team", "b-app-0", "SnapshotNotInNamespace");
    assert!(!w.vms().contains_key("vk-team-b-app-0"), "{}", log(&w));
    assert!(!snapshot_exists(&w, "vk-team-b-app-0-hibernate-import"));
    assert!(w.metrics().contains("reason=\"snapshot_not_in_namespace\""));
}

// ----- attack 2: cloning another namespace's deleted VM through `image` -----------------------

#[test]
fn a_pod_cloning_another_namespaces_deleted_vm_through_its_image_is_refused() {
    let w = started();
    let victim = with(
        pod("teamb", "app-0", "vk-teamb-app-0", "base"),
        &[("cocoonset.cocoonstack.io/snapshot-policy", "always")],
    );
    w.api.create_pod(&victim).expect("create");
    let id = wait_running(&w, "teamb", "app-0");
    guest(&w, &id, "echo teamb-secret > /root/secret");
    delete(&w, "teamb", "app-0");
    assert!(
        tag_id(&w, "vk-teamb-app-0", "latest").is_some(),
        "{}",
        log(&w)
    );

    w.api
        .create_pod(&pod("evil", "x", "vk-evil-x", "vk-teamb-app-0"))
        .expect("create attacker");
    wait_refused(&w, "evil", "x", "SnapshotNotInNamespace");
    assert!(!w.vms().contains_key("vk-evil-x"), "{}", log(&w));
    assert!(!snapshot_exists(&w, "vk-teamb-app-0"), "nothing pulled");
}

// ----- attack 3: references a pod gives --------------------------------------------------------

/// `default/victim` running; returns its VM id.
fn victim(w: &World) -> String {
    w.api
        .create_pod(&pod("default", "victim", "vk-default-victim", "base"))
        .expect("create victim");
    wait_running(w, "default", "victim")
}

fn victim_untouched(w: &World, id: &str) {
    assert_eq!(
        w.vms().get("vk-default-victim"),
        Some(&(id.to_string(), "running".to_string())),
        "{}",
        log(w)
    );
    assert_eq!(running(w, "default", "victim").as_deref(), Some(id));
}

#[test]
fn a_vm_name_that_is_another_vms_id_prefix_is_never_adopted() {
    let w = started();
    let id = victim(&w);
    // After a failed attempt the create looks its VM up by name; cocoon resolves an ID prefix.
    w.api
        .create_pod(&pod("evil", "x", &id[..6], "base"))
        .expect("create attacker");
    wait_refused(&w, "evil", "x", "VMNotInNamespace");
    std::thread::sleep(Duration::from_millis(500));
    let p = w.api.get_pod("evil", "x").expect("attacker");
    assert_eq!(annotation(&p, "vm.cocoonstack.io/id"), None);
    victim_untouched(&w, &id);
}

#[test]
fn a_managed_pods_id_annotation_never_makes_its_delete_remove_another_vm() {
    let w = started();
    let id = victim(&w);
    // The attacker's create fails (no such image), so its delete looks its VM up: by name,
    // then by the id annotation, which names the victim's VM.
    let attacker = with(
        pod("evil", "x", "vk-evil-x", "no-such-image"),
        &[("vm.cocoonstack.io/id", id.as_str())],
    );
    w.api.create_pod(&attacker).expect("create attacker");
    w.wait("the attacker's create failed", LIMIT, || {
        warned(&w, "evil", "x", "ProviderCreateFailed").then_some(())
    });
    delete(&w, "evil", "x");
    std::thread::sleep(Duration::from_millis(500));
    victim_untouched(&w, &id);
    assert!(
        !w.log().contains(&format!("vm rm --force -- {id}")),
        "{}",
        log(&w)
    );
}

#[test]
fn an_unmanaged_pods_id_prefix_never_adopts_another_vm() {
    let w = started();
    let id = victim(&w);
    let mut thief = pod("evil", "thief", "vk-evil-thief", "base");
    if let Some(a) = thief.metadata.annotations.as_mut() {
        a.remove("cocoonset.cocoonstack.io/managed");
        a.insert("vm.cocoonstack.io/id".into(), id[..6].to_string());
        a.insert("vm.cocoonstack.io/ip".into(), "127.88.0.200".into());
    }
    w.api.create_pod(&thief).expect("create thief");
    w.wait("thief refused", LIMIT, || {
        let p = w.api.get_pod("evil", "thief")?;
        (phase(&p) == "Failed" && warned(&w, "evil", "thief", "VMReferenceMismatch")).then_some(())
    });
    assert!(w.metrics().contains("reason=\"vm_reference_mismatch\""));
    victim_untouched(&w, &id);
}

#[test]
fn a_vm_name_changed_after_the_create_is_ignored_by_hibernate() {
    let w = started();
    let vid = victim(&w);
    guest(&w, &vid, "echo victim-data > /root/data");
    hibernate(&w, "default", "victim", "vk-default-victim");
    let victims_tag = tag_id(&w, "vk-default-victim", "hibernate").expect("victim's tag");
    assert!(snapshot_exists(&w, "vk-default-victim"));

    w.api
        .create_pod(&pod("evil", "x", "vk-evil-x", "base"))
        .expect("create attacker");
    wait_running(&w, "evil", "x");
    set(
        &w,
        "evil",
        "x",
        "vm.cocoonstack.io/name",
        "vk-default-victim",
    );
    w.wait("the rename refused", LIMIT, || {
        warned(&w, "evil", "x", "VMNameChangeRefused").then_some(())
    });
    hibernate(&w, "evil", "x", "vk-evil-x");
    assert_eq!(
        tag_id(&w, "vk-default-victim", "hibernate").as_deref(),
        Some(victims_tag.as_str()),
        "the victim's tag is not pushed over"
    );
    assert!(snapshot_exists(&w, "vk-default-victim"), "{}", log(&w));
    // The victim wakes to its own VM.
    set(
        &w,
        "default",
        "victim",
        "vm.cocoonstack.io/hibernate",
        "false",
    );
    let id = wait_running(&w, "default", "victim");
    assert_eq!(guest(&w, &id, "cat /root/data").trim(), "victim-data");
}

#[test]
fn fork_from_another_namespace_sharing_the_prefix_is_refused() {
    let w = started();
    w.api
        .create_pod(&pod("team-prod", "main-0", "vk-team-prod-main-0", "base"))
        .expect("create source");
    let src = wait_running(&w, "team-prod", "main-0");
    let sub = with(
        pod("team", "sub", "vk-team-sub", "base"),
        &[("vm.cocoonstack.io/fork-from", "vk-team-prod-main-0")],
    );
    w.api.create_pod(&sub).expect("create fork");
    wait_refused(&w, "team", "sub", "VMNotInNamespace");
    assert!(!w.vms().contains_key("vk-team-sub"), "{}", log(&w));
    assert!(!snapshot_exists(&w, "fork-vk-team-prod-main-0"));
    assert_eq!(running(&w, "team-prod", "main-0"), Some(src));
}

// ----- the operator's own flows, under each naming scheme ------------------------------------

/// The VM names of pods `app-0` and `app-1` of namespace `team-a` under a scheme.
fn names(scheme: &str) -> [String; 2] {
    ["app-0", "app-1"].map(|pod| match scheme {
        "plain" => format!("vk-team-a-{pod}"),
        "dotted" => format!("vk-team-a.{pod}"),
        _ => hashed_name("team-a", pod),
    })
}

/// Fork-from, hibernate and wake, adoption after a restart, and the re-creation of a slot
/// from its `latest` snapshot, all in namespace `team-a` (a namespace whose plain names read
/// as `team`'s too).
fn operator_flows(scheme: &str) {
    let [main, sub] = names(scheme);
    let mut w = started();
    w.api
        .create_pod(&pod("team-a", "app-0", &main, "base"))
        .expect("create main");
    let main_id = wait_running(&w, "team-a", "app-0");
    guest(&w, &main_id, "echo main-data > /root/data");

    // fork-from within the namespace.
    let fork = with(
        pod("team-a", "app-1", &sub, "base"),
        &[
            ("vm.cocoonstack.io/fork-from", main.as_str()),
            ("cocoonset.cocoonstack.io/snapshot-policy", "always"),
        ],
    );
    w.api.create_pod(&fork).expect("create fork");
    let sub_id = wait_running(&w, "team-a", "app-1");
    assert_eq!(guest(&w, &sub_id, "cat /root/data").trim(), "main-data");

    // Hibernate and wake.
    hibernate(&w, "team-a", "app-0", &main);
    set(
        &w,
        "team-a",
        "app-0",
        "vm.cocoonstack.io/hibernate",
        "false",
    );
    let main_id = wait_running(&w, "team-a", "app-0");
    assert_eq!(guest(&w, &main_id, "cat /root/data").trim(), "main-data");

    // Adoption after a restart: the same VMs, no new ones.
    let before: BTreeMap<String, (String, String)> = w.vms();
    w.kill_daemon();
    w.start_daemon();
    w.wait("the startup reconcile", LIMIT, || {
        // The provider's summary line, not the edge's earlier "startup reconcile: N pods
        // bound" line: the assertion below reads the summary.
        w.log().contains("orphan VMs").then_some(())
    });
    assert!(
        w.log().contains("2 pods adopted, 0 orphan VMs"),
        "{}",
        log(&w)
    );
    assert_eq!(w.vms(), before);
    assert_eq!(running(&w, "team-a", "app-0"), Some(main_id));

    // A slot re-created from its `latest`: the deleted pod's snapshot is pushed and cloned
    // back into the new incarnation.
    delete(&w, "team-a", "app-1");
    assert!(tag_id(&w, &sub, "latest").is_some(), "{}", log(&w));
    w.api
        .create_pod(&pod("team-a", "app-1", &sub, &sub))
        .expect("re-create the slot");
    let new_id = wait_running(&w, "team-a", "app-1");
    assert_ne!(new_id, sub_id);
    assert_eq!(guest(&w, &new_id, "cat /root/data").trim(), "main-data");
}

#[test]
fn the_operators_flows_work_under_plain_names() {
    operator_flows("plain");
}

#[test]
fn the_operators_flows_work_under_dotted_names() {
    operator_flows("dotted");
}

#[test]
fn the_operators_flows_work_under_hashed_names() {
    operator_flows("hashed");
}
