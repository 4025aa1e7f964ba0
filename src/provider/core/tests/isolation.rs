//! Transition tests of tenant isolation: VM name admission, the VM name a tracked pod keeps,
//! exact references, the ownership ledger and the ownership checks of reads and writes.

use super::hibernate::{asking, key, registry};
use super::*;
use crate::provider::naming::hashed_name;

fn in_namespace(mut p: Pod, ns: &str) -> Pod {
    p.metadata.namespace = Some(ns.into());
    p
}

fn deleted(mut p: Pod) -> Pod {
    p.metadata.deletion_timestamp = Some(Time(
        k8s_openapi::chrono::DateTime::from_timestamp(1, 0).unwrap(),
    ));
    p
}

/// The effects refuse a create by `event` / `reason` for good: Failed, Warning, counter.
fn refused_as(e: &[Effect], event: &str, reason: &'static str) -> bool {
    has_metric(
        e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason,
        },
    ) && events(e).iter().any(|(r, _)| *r == event)
        && statuses(e)
            .iter()
            .any(|(_, s)| s.phase.as_deref() == Some("Failed"))
}

// ----- rule 1: a pod's VM name is one of its namespace's ------------------------------------

#[test]
fn a_vm_name_of_another_namespace_or_none_is_refused_before_anything_runs() {
    for (ns, vm) in [
        ("evil", "vk-teamb-app-0"),
        ("ns", "ubuntu"),
        ("ns", "--all"),
        ("ns", "vk-ns"),
        ("team", &hashed_name("team-b", "app-0")),
    ] {
        let mut h = H::new(registry());
        let p = in_namespace(mk("a", "u1", &managed("a", vm)), ns);
        let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
        assert!(
            refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace"),
            "{vm}: {e:?}"
        );
        assert!(cocoon_ops(&e).is_empty(), "{vm}: {e:?}");
        assert!(
            !e.iter()
                .any(|x| matches!(x, Effect::CheckHibernateEvidence { .. })),
            "{vm}: no registry read either"
        );
        // The pod's update retries nothing, and its deletion runs nothing against the name.
        let mut later = h.feed(Input::PodUpserted(Box::new(p.clone())));
        later.extend(h.feed(Input::PodUpserted(Box::new(deleted(p.clone())))));
        later.extend(h.feed(Input::PodDeleted(Box::new(deleted(p)))));
        assert!(cocoon_ops(&later).is_empty(), "{vm}: {later:?}");
    }
}

#[test]
fn every_naming_scheme_of_the_pods_namespace_is_admitted() {
    for vm in [
        "vk-ns-a".to_string(),
        "vk-ns.a".to_string(),
        "vk-ns-other-0".to_string(),
        hashed_name("ns", "a"),
    ] {
        let mut h = H::new(registry());
        let e = h.feed(Input::PodUpserted(Box::new(mk(
            "a",
            "u1",
            &managed("a", &vm),
        ))));
        assert!(
            e.iter().any(
                |x| matches!(x, Effect::CheckHibernateEvidence { vm_name, .. } if *vm_name == vm)
            ),
            "{vm}: {e:?}"
        );
    }
}

#[test]
fn at_startup_a_pod_naming_another_namespaces_vm_is_not_adopted_nor_its_vm_destroyed() {
    let evil = in_namespace(mk("x", "u1", &managed("x", "vk-teamb-app-0")), "evil");
    let (mut h, e) = H::starting(
        ProviderConfig::default(),
        vec![evil.clone()],
        vec![vm_info("V1", "vk-teamb-app-0", "running")],
    );
    assert!(cocoon_ops(&e).is_empty(), "no orphan removal: {e:?}");
    assert!(
        refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace"),
        "{e:?}"
    );
    assert!(h.p.pod_vm(&PodKey::new("evil", "x")).is_none());
    let e = h.feed(Input::PodUpserted(Box::new(deleted(evil))));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
}

// ----- rule 2: a tracked pod keeps its VM name ----------------------------------------------

fn renamed(mut p: Pod, vm: &str) -> Pod {
    p.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANN_VM_NAME.into(), vm.into());
    p
}

#[test]
fn a_vm_name_change_is_refused_and_hibernate_acts_on_the_tracked_name() {
    let mut h = H::new(registry());
    create_clone(&mut h, asking(false), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(renamed(
        asking(false),
        "vk-ns-other-0",
    ))));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "VMNameChangeRefused" && m.contains("vk-ns-other-0")));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "update",
            result: "failed",
            reason: "vm_name_changed"
        }
    ));
    assert!(cocoon_ops(&e).is_empty());
    // The same copy again is not a new change: no second Warning.
    let again = h.feed(Input::PodUpserted(Box::new(renamed(
        asking(false),
        "vk-ns-other-0",
    ))));
    assert!(events(&again).is_empty(), "{again:?}");
    // Hibernate then saves and pushes under the tracked name.
    let e = h.feed(Input::PodUpserted(Box::new(renamed(
        asking(true),
        "vk-ns-other-0",
    ))));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot save --name vk-ns-demo-0 VM1");
    assert_eq!(
        h.p.pod_vm(&key()).map(|v| v.name.clone()).as_deref(),
        Some("vk-ns-demo-0")
    );
}

#[test]
fn a_vm_name_change_then_delete_removes_the_tracked_vm_and_its_snapshots_only() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, asking(false), "VM1");
    h.feed(Input::PodUpserted(Box::new(renamed(
        asking(false),
        "vk-ns-victim-0",
    ))));
    let gone = deleted(renamed(asking(false), "vk-ns-victim-0"));
    let e = h.feed(Input::PodUpserted(Box::new(gone)));
    let mut seen = Vec::new();
    let mut e = e;
    while let Some((op, cmd)) = cocoon_ops(&e).first().cloned() {
        seen.push(argv(&cmd));
        e = h.cocoon(op, CocoonResult::ok("{}"));
    }
    assert!(seen.iter().any(|a| a == "vm rm --force VM1"), "{seen:?}");
    assert!(
        seen.iter().all(|a| !a.contains("vk-ns-victim-0")),
        "nothing runs against the new name: {seen:?}"
    );
}
