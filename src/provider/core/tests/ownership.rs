//! Transition tests of VM ownership: a VM named or identified by a pod that another live pod
//! holds is refused before anything runs, and the owner's VM is never touched.

use super::*;

fn in_namespace(mut p: Pod, ns: &str) -> Pod {
    p.metadata.namespace = Some(ns.into());
    p
}

fn refused(e: &[Effect]) -> bool {
    has_metric(
        e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: "vm_owned_by_another_pod",
        },
    ) && events(e)
        .iter()
        .any(|(r, m)| *r == "ProviderCreateFailed" && m.contains("owned by another pod"))
        && statuses(e)
            .iter()
            .any(|(_, s)| s.phase.as_deref() == Some("Failed"))
}

fn no_vm_command(e: &[Effect]) -> bool {
    cocoon_ops(e).is_empty()
}

#[test]
fn a_pod_naming_another_pods_vm_is_refused_and_its_delete_leaves_the_vm() {
    // `vk-team-b-app-0` reads as a VM name of `team` (pod `b-app-0`) and of `team-b`.
    let mut h = H::new(ProviderConfig::default());
    let victim = in_namespace(
        mk("victim", "u1", &managed("victim", "vk-team-b-app-0")),
        "team-b",
    );
    create_clone(&mut h, victim, "VM1");
    let attacker = in_namespace(
        mk("attacker", "u2", &managed("attacker", "vk-team-b-app-0")),
        "team",
    );
    let e = h.feed(Input::PodUpserted(Box::new(attacker.clone())));
    assert!(refused(&e), "{e:?}");
    assert!(no_vm_command(&e));
    assert!(h.p.pod_vm(&PodKey::new("team", "attacker")).is_none());
    // Deleting the refused pod runs nothing against the victim's VM.
    let mut gone = attacker;
    gone.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let mut all = h.feed(Input::PodUpserted(Box::new(gone.clone())));
    all.extend(h.feed(Input::PodDeleted(Box::new(gone))));
    assert!(no_vm_command(&all), "{all:?}");
    assert_eq!(
        h.p.pod_vm(&PodKey::new("team-b", "victim"))
            .map(|v| v.id.clone()),
        Some("VM1".to_string())
    );
}

#[test]
fn a_pod_in_the_same_namespace_with_another_uid_is_refused_too() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "b",
        "u2",
        &managed("b", "vk-ns-demo-0"),
    ))));
    assert!(refused(&e), "{e:?}");
    assert!(no_vm_command(&e));
}

#[test]
fn an_unmanaged_pod_carrying_another_pods_vm_id_is_refused() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(
        &mut h,
        mk("victim", "u1", &managed("victim", "vk-ns-v")),
        "VM1",
    );
    let thief = in_namespace(
        mk(
            "thief",
            "u2",
            &[
                (ANN_VM_NAME, "vk-evil-mine".into()),
                (ANN_VM_ID, "VM1".into()),
                (ANN_VM_IP, "10.9.9.9".into()),
            ],
        ),
        "evil",
    );
    let e = h.feed(Input::PodUpserted(Box::new(thief)));
    assert!(refused(&e), "{e:?}");
    assert!(h.p.pod_vm(&PodKey::new("evil", "thief")).is_none());
}

/// A daemon keeping orphans whose startup lists these VMs (each recorded for the namespace
/// its name is for, as this daemon records the VMs it creates) and pods.
fn started_with(vms: Vec<VmInfo>, pods: Vec<Pod>) -> (H, Vec<Effect>) {
    let owners: Vec<(String, &str)> = vms
        .iter()
        .map(|v| {
            let ns = ["team-b", "default", "evil"]
                .into_iter()
                .find(|ns| v.name.starts_with(&format!("vk-{ns}-")))
                .unwrap_or("");
            (v.name.clone(), ns)
        })
        .collect();
    let pairs: Vec<(&str, &str)> = owners.iter().map(|(n, ns)| (n.as_str(), *ns)).collect();
    let owners = owned_vms(&pairs);
    let mut h = H {
        p: Provider::new(ProviderConfig {
            orphan_policy: OrphanPolicy::Keep,
            ..Default::default()
        }),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let e = h.feed(Input::StartupListed { pods, vms, owners });
    (h, e)
}

#[test]
fn an_unmanaged_pod_naming_a_kept_vm_by_another_name_is_refused() {
    // The VM is known (kept for adoption by name) under another name: the id does not hand
    // it to a pod that names something else.
    let (mut h, _) = started_with(vec![vm_info("V9", "vk-default-db", "running")], vec![]);
    let thief = in_namespace(
        mk(
            "thief",
            "u2",
            &[
                (ANN_VM_NAME, "vk-evil-mine".into()),
                (ANN_VM_ID, "V9".into()),
                (ANN_VM_IP, "10.9.9.9".into()),
            ],
        ),
        "evil",
    );
    let e = h.feed(Input::PodUpserted(Box::new(thief)));
    assert!(no_vm_command(&e));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ProviderCreateFailed" && m.contains("belongs to a vm other than")));
    assert!(h.p.pod_vm(&PodKey::new("evil", "thief")).is_none());
}

#[test]
fn at_startup_the_older_pod_keeps_a_shared_vm_name_and_an_id_needs_its_name() {
    let at = |secs| {
        Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(secs).unwrap(),
        ))
    };
    let mut victim = in_namespace(
        mk("victim", "u1", &managed("victim", "vk-team-b-app-0")),
        "team-b",
    );
    victim.metadata.creation_timestamp = at(100);
    let mut attacker = in_namespace(
        mk("attacker", "u2", &managed("attacker", "vk-team-b-app-0")),
        "team",
    );
    attacker.metadata.creation_timestamp = at(200);
    let mut by_id = in_namespace(
        mk(
            "thief",
            "u3",
            &[
                (ANN_VM_NAME, "vk-evil-x".into()),
                (ANN_VM_ID, "V1".into()),
                (ANN_VM_IP, "10.9.9.9".into()),
            ],
        ),
        "evil",
    );
    by_id.metadata.creation_timestamp = at(50);
    let (h, _) = started_with(
        vec![vm_info("V1", "vk-team-b-app-0", "running")],
        vec![by_id, attacker, victim],
    );
    assert_eq!(
        h.p.pod_vm(&PodKey::new("team-b", "victim"))
            .map(|v| v.id.clone()),
        Some("V1".to_string())
    );
    assert!(h.p.pod_vm(&PodKey::new("team", "attacker")).is_none());
    assert!(h.p.pod_vm(&PodKey::new("evil", "thief")).is_none());
}

#[test]
fn a_kept_vm_is_adopted_only_from_the_namespace_its_name_is_for() {
    let kept = vec![
        vm_info("V1", "vk-default-db", "running"),
        vm_info("V2", "vk-evil-box", "running"),
    ];
    let (mut h, _) = started_with(kept, vec![]);
    let e = h.feed(Input::PodUpserted(Box::new(in_namespace(
        mk("x", "u1", &managed("x", "vk-default-db")),
        "evil",
    ))));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "VMNotInNamespace" && m.contains("not a VM name of namespace evil")));
    assert!(no_vm_command(&e));
    assert!(h.p.pod_vm(&PodKey::new("evil", "x")).is_none());
    let e = h.feed(Input::PodUpserted(Box::new(in_namespace(
        mk("y", "u2", &managed("y", "vk-evil-box")),
        "evil",
    ))));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
}

#[test]
fn a_recreated_pod_of_the_same_name_keeps_its_vm_whatever_the_name() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-shared")), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u2",
        &managed("a", "vk-ns-shared"),
    ))));
    assert!(no_vm_command(&e));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
}
