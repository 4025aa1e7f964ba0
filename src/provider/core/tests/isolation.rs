//! Transition tests of tenant isolation: VM name admission, the VM name a tracked pod keeps,
//! exact references, the ownership ledger and the ownership checks of reads and writes.

use super::hibernate::{asking, hibernate_fully, key, registry};
use super::*;
use crate::provider::naming::hashed_name;

fn in_namespace(mut p: Pod, ns: &str) -> Pod {
    p.metadata.namespace = Some(ns.into());
    p
}

fn deleted(mut p: Pod) -> Pod {
    p.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
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
        e = h.cocoon(op, Answer::ok("{}"));
    }
    assert!(seen.iter().any(|a| a == "vm rm --force VM1"), "{seen:?}");
    assert!(
        seen.iter().all(|a| !a.contains("vk-ns-victim-0")),
        "nothing runs against the new name: {seen:?}"
    );
}

// ----- rule 3: exact references ---------------------------------------------------------------

/// Another VM whose ID a looked-up value prefixes, as cocoon answers such a lookup.
fn victim_json() -> String {
    vm_json(
        "VKNSDEMOVICTIM",
        "vk-other-victim-0",
        "running",
        "02:00:00:00:00:99",
    )
}

#[test]
fn a_failed_boots_lookup_answered_with_another_vm_neither_adopts_nor_removes_it() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let e = h.cocoon(op, Answer::failed("Error: clone: boom"));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-demo-0",
        Answer::ok(victim_json()),
    );
    assert!(cocoon_ops(&e).is_empty(), "no vm rm of the other VM: {e:?}");
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_none());
    assert!(events(&e).iter().any(|(r, _)| *r == "ProviderCreateFailed"));
    // The retry's lookup by name is held to the name too: it goes on to the evidence.
    let e = h.advance(Duration::from_secs(2));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-demo-0",
        Answer::ok(victim_json()),
    );
    assert!(cocoon_ops(&e)
        .iter()
        .all(|(_, c)| argv(c).starts_with("snapshot inspect vk-ns-demo-0")));
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_none());
}

#[test]
fn a_managed_pods_id_finds_a_vm_at_delete_only_under_the_pods_own_vm_name() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_VM_ID, "VKNSDEMOVICTIM".into()));
    let e = h.feed(Input::PodUpserted(Box::new(deleted(mk("a", "u1", &ann)))));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-demo-0",
        Answer::failed("Error: vm not found"),
    );
    // By ID: the VM of that exact ID carries another name, so it is not the pod's.
    let e = answer(
        &mut h,
        &e,
        "vm inspect VKNSDEMOVICTIM",
        Answer::ok(victim_json()),
    );
    let mut all = e.clone();
    let mut e = e;
    while let Some((op, _)) = cocoon_ops(&e).first().cloned() {
        e = h.cocoon(op, Answer::failed("Error: snapshot not found"));
        all.extend(e.clone());
    }
    for (_, c) in cocoon_ops(&all) {
        let a = argv(&c);
        assert!(
            !a.contains("VKNSDEMOVICTIM") && !a.contains("victim"),
            "{a}"
        );
    }
    assert!(!deletes(&all).is_empty(), "the pod object goes: {all:?}");
}

fn unmanaged(id: &str) -> Pod {
    mk(
        "s",
        "u1",
        &[
            (ANN_VM_NAME, "vk-ns-static".into()),
            (ANN_VM_ID, id.into()),
            (ANN_VM_IP, "10.9.9.9".into()),
        ],
    )
}

#[test]
fn an_unmanaged_pods_id_must_be_its_vms_exact_id_and_name() {
    for (id, answer_json) in [
        // An ID prefix: cocoon answers with the VM it resolves to.
        ("VKNS", victim_json()),
        // The exact ID of a VM of another name.
        ("VKNSDEMOVICTIM", victim_json()),
    ] {
        let mut h = H::new(ProviderConfig::default());
        let e = h.feed(Input::PodUpserted(Box::new(unmanaged(id))));
        let e = answer(
            &mut h,
            &e,
            &format!("vm inspect {id}"),
            Answer::ok(answer_json),
        );
        assert!(
            refused_as(&e, "VMReferenceMismatch", "vm_reference_mismatch"),
            "{id}: {e:?}"
        );
        assert!(
            events(&e).iter().all(|(_, m)| !m.contains("victim")),
            "nothing of the other VM is told: {e:?}"
        );
        assert!(cocoon_ops(&e).is_empty());
        assert!(h.p.pod_vm(&PodKey::new("ns", "s")).is_none(), "{id}");
        // Nothing more happens to it until it changes.
        let e = h.feed(Input::PodUpserted(Box::new(unmanaged(id))));
        assert!(cocoon_ops(&e).is_empty());
    }
    // A value that reads as an option never reaches the argv.
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(unmanaged("--all"))));
    assert!(refused_as(
        &e,
        "VMReferenceMismatch",
        "vm_reference_mismatch"
    ));
    assert!(cocoon_ops(&e).is_empty());
}

#[test]
fn a_vm_vanished_across_a_restart_is_not_replaced_by_the_vm_its_id_prefixes() {
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_VM_ID, "VKNS".into()));
    let mut p = mk("a", "u1", &ann);
    p.status = Some(status::running(
        "10.0.0.9",
        true,
        None,
        None,
        &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
    ));
    let (mut h, e) = H::starting(ProviderConfig::default(), vec![p], vec![]);
    let e = answer(&mut h, &e, "vm inspect VKNS", Answer::ok(victim_json()));
    // Evicted as gone: never tracked on the other VM, nothing started or removed.
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("VMGone")));
}

#[test]
fn a_snapshot_lookup_answered_with_another_snapshot_finds_none() {
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    // No registry: `snapshot inspect <vm>` is the hibernate evidence; another one is none.
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect vk-ns-demo-0",
        Answer::ok(r#"{"id":"vk-ns-demo-0X","name":"vk-other-x-0"}"#),
    );
    let e = answer(
        &mut h,
        &e,
        "snapshot rm fork-vk-ns-demo-0",
        Answer::failed("Error: snapshot not found"),
    );
    // The image's snapshot answered by another one: not cloned.
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(r#"{"id":"team/agent:v3X","name":"vk-other-x-0"}"#),
    );
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m.contains("not found locally")));
}

#[test]
fn a_fork_source_lookup_answered_with_another_vm_is_no_source() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("sub", "vk-ns-sub-0");
    ann.push((ANN_FORK_FROM, "vk-ns.main-0".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("sub", "u1", &ann))));
    let e = no_evidence(&mut h, &e);
    let e = answer(
        &mut h,
        &e,
        "snapshot rm fork-vk-ns-sub-0",
        Answer::failed("Error: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect fork-vk-ns.main-0",
        Answer::failed("Error: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns.main-0",
        Answer::ok(victim_json()),
    );
    assert!(cocoon_ops(&e).is_empty(), "nothing saved: {e:?}");
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m.contains("source vm vk-ns.main-0 not found")));
}

#[test]
fn a_pod_that_lost_its_vm_name_keeps_its_vm_at_startup_without_holding_it() {
    let p = mk(
        "a",
        "u1",
        &[(ANN_MANAGED, "true".into()), (ANN_VM_ID, "V1".into())],
    );
    let (h, e) = H::starting(
        ProviderConfig::default(),
        vec![p],
        vec![vm_info("V1", "vk-ns-demo-0", "running")],
    );
    assert!(
        cocoon_ops(&e).iter().all(|(_, c)| !argv(c).contains("rm")),
        "not destroyed as an orphan: {e:?}"
    );
    assert!(
        h.p.pod_vm(&PodKey::new("ns", "a")).is_none(),
        "an ID alone holds nothing"
    );
    // With the VM recorded for this very pod, its id still finds it (and only then).
    for (uid, held) in [("u1", true), ("u2", false)] {
        let mut owners = Owners::default();
        owners.apply(&set(Owned::Vm, "vk-ns-demo-0", "ns", uid));
        let p = mk(
            "a",
            "u1",
            &[(ANN_MANAGED, "true".into()), (ANN_VM_ID, "V1".into())],
        );
        let (h, e) = H::starting_with(
            ProviderConfig::default(),
            vec![p],
            vec![vm_info("V1", "vk-ns-demo-0", "running")],
            owners,
        );
        assert!(cocoon_ops(&e).iter().all(|(_, c)| !argv(c).contains("rm")));
        assert_eq!(h.p.pod_vm(&PodKey::new("ns", "a")).is_some(), held, "{uid}");
    }
}

// ----- the ownership ledger -----------------------------------------------------------------

use crate::provider::owners::{Owned, Owner, OwnerChange, Owners};

fn records(e: &[Effect]) -> Vec<(OpId, Vec<OwnerChange>)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::RecordOwners { op, changes } => Some((*op, changes.clone())),
            _ => None,
        })
        .collect()
}

fn set(kind: Owned, name: &str, ns: &str, uid: &str) -> OwnerChange {
    OwnerChange::Set {
        kind,
        name: name.into(),
        owner: Owner::new(ns, uid),
    }
}

#[test]
fn a_clone_runs_only_once_its_vms_owner_is_on_disk_and_not_when_the_write_fails() {
    for ok in [true, false] {
        let mut h = H::new(ProviderConfig::default());
        let first = h.feed(Input::PodUpserted(Box::new(mk(
            "a",
            "u1",
            &managed("a", "vk-ns-demo-0"),
        ))));
        let e = no_evidence(&mut h, &first);
        let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
        h.hold_ledger = true;
        let e = answer(
            &mut h,
            &e,
            "snapshot inspect team/agent:v3",
            Answer::ok(r#"{"id":"S","name":"team/agent:v3"}"#),
        );
        let rec = records(&e);
        assert_eq!(rec.len(), 1, "{e:?}");
        assert_eq!(rec[0].1, vec![set(Owned::Vm, "vk-ns-demo-0", "ns", "u1")]);
        assert!(
            cocoon_ops(&e).is_empty(),
            "no clone before the record: {e:?}"
        );
        let result = if ok {
            Ok(())
        } else {
            Err("disk full".to_string())
        };
        let e = h.feed(Input::OwnersRecorded {
            op: rec[0].0,
            result,
        });
        if ok {
            let (_, cmd) = one_cocoon(&e);
            assert!(argv(&cmd).starts_with("vm clone"), "{}", argv(&cmd));
        } else {
            // No clone; the record is undone on the edge's copy too, and the create fails
            // the way a failed clone does (its lookup, then a retry).
            assert!(cocoon_ops(&e)
                .iter()
                .all(|(_, c)| !argv(c).starts_with("vm clone")));
            let undo = records(&e);
            assert_eq!(
                undo.last().map(|(_, c)| c.clone()),
                Some(vec![OwnerChange::Remove {
                    kind: Owned::Vm,
                    name: "vk-ns-demo-0".into()
                }])
            );
        }
    }
}

#[test]
fn saves_and_pulls_run_once_their_snapshots_owner_is_on_disk() {
    // Hibernate: `<vm>` is the pod's before the save.
    let mut h = H::new(registry());
    create_clone(&mut h, asking(false), "VM1");
    h.hold_ledger = true;
    let e = h.feed(Input::PodUpserted(Box::new(asking(true))));
    let rec = records(&e);
    assert_eq!(rec.len(), 1, "{e:?}");
    assert_eq!(
        rec[0].1,
        vec![set(Owned::Snapshot, "vk-ns-demo-0", "ns", "u1")]
    );
    assert!(cocoon_ops(&e).is_empty());
    let e = h.feed(Input::OwnersRecorded {
        op: rec[0].0,
        result: Ok(()),
    });
    assert_eq!(
        argv(&one_cocoon(&e).1),
        "snapshot save --name vk-ns-demo-0 VM1"
    );
}

#[test]
fn the_ledger_follows_what_exists_vms_and_snapshots_go_with_their_removal() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, asking(false), "VM1");
    assert_eq!(
        h.ledger.get(Owned::Vm, "vk-ns-demo-0"),
        Some(&Owner::new("ns", "u1"))
    );
    let gone = deleted(asking(false));
    let mut e = h.feed(Input::PodUpserted(Box::new(gone)));
    while let Some((op, cmd)) = cocoon_ops(&e).first().cloned() {
        let r = if argv(&cmd).starts_with("snapshot rm") {
            Answer::failed("Error: snapshot not found")
        } else {
            Answer::ok("")
        };
        e = h.cocoon(op, r);
    }
    assert_eq!(h.ledger, Owners::default(), "{:?}", h.ledger);
}

#[test]
fn at_startup_records_of_vms_that_are_gone_go_and_an_adopted_vm_is_recorded() {
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Vm, "vk-ns-gone-0", "ns", "u9"));
    owners.apply(&set(Owned::Vm, "vk-ns-demo-0", "ns", "u1"));
    let mut ann = managed("b", "vk-ns-b-0");
    ann.push((ANN_VM_ID, "V2".into()));
    let keep = ProviderConfig {
        orphan_policy: OrphanPolicy::Keep,
        ..Default::default()
    };
    let (h, _) = H::starting_with(
        keep,
        vec![mk("b", "u2", &ann)],
        vec![
            vm_info("V1", "vk-ns-demo-0", "running"),
            vm_info("V2", "vk-ns-b-0", "running"),
        ],
        owners,
    );
    assert_eq!(h.ledger.get(Owned::Vm, "vk-ns-gone-0"), None);
    assert_eq!(
        h.ledger.get(Owned::Vm, "vk-ns-demo-0"),
        Some(&Owner::new("ns", "u1"))
    );
    assert_eq!(
        h.ledger.get(Owned::Vm, "vk-ns-b-0"),
        Some(&Owner::new("ns", "u2")),
        "an earlier daemon's VM is recorded for the pod that holds it"
    );
}

#[test]
fn a_snapshot_listing_trims_the_records_of_snapshots_that_are_gone() {
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Snapshot, "vk-ns-a-0", "ns", "u1"));
    owners.apply(&set(Owned::Snapshot, "vk-ns-gone-0", "ns", "u9"));
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: false,
        ledger: owners.clone(),
        hold_ledger: false,
    };
    let mut e = h.feed(Input::StartupListed {
        pods: vec![],
        vms: vec![],
        owners,
    });
    e.extend(h.feed(Input::Tick));
    let list = e
        .iter()
        .find_map(|x| match x {
            Effect::Cocoon {
                op,
                cmd: CocoonCmd::SnapshotList,
            } => Some(*op),
            _ => None,
        })
        .expect("snapshot list");
    h.cocoon(list, Answer::ok(r#"[{"id":"S1","name":"vk-ns-a-0"}]"#));
    assert!(h.ledger.get(Owned::Snapshot, "vk-ns-a-0").is_some());
    assert_eq!(h.ledger.get(Owned::Snapshot, "vk-ns-gone-0"), None);
}

// ----- rule 5: reads check ownership --------------------------------------------------------

fn evidence(e: &[Effect]) -> OpId {
    e.iter()
        .find_map(|x| match x {
            Effect::CheckHibernateEvidence { op, .. } => Some(*op),
            _ => None,
        })
        .expect("evidence lookup")
}

/// The op of the manifest read that precedes an image pull.
fn image_read(e: &[Effect]) -> OpId {
    e.iter()
        .find_map(|x| match x {
            Effect::ReadSnapshotTag { op, .. } => Some(*op),
            _ => None,
        })
        .expect("manifest read")
}

fn owned_tag(ns: &str) -> HibernateTag {
    HibernateTag {
        base_image: "team/agent:v3".into(),
        snapshot_id: "S1".into(),
        from_node: "node-b".into(),
        owner_namespace: ns.into(),
        digest: "sha256:0123".into(),
        ..Default::default()
    }
}

fn reads_nothing(e: &[Effect]) -> bool {
    cocoon_ops(e).is_empty()
        && !e.iter().any(|x| {
            matches!(
                x,
                Effect::PullSnapshot { .. }
                    | Effect::PeerRestore { .. }
                    | Effect::PushSnapshot { .. }
            )
        })
}

#[test]
fn a_hibernate_tag_of_another_namespace_is_never_restored() {
    // `vk-team-b-app-0` is admitted for `team` (pod `b-app-0`); the tag is team-b's.
    let mut h = H::new(registry());
    let p = in_namespace(
        mk("b-app-0", "u1", &managed("b-app-0", "vk-team-b-app-0")),
        "team",
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = h.feed(Input::HibernateEvidence {
        op: evidence(&e),
        result: Ok(Some(owned_tag("team-b"))),
    });
    assert!(
        refused_as(&e, "SnapshotNotInNamespace", "snapshot_not_in_namespace"),
        "{e:?}"
    );
    assert!(reads_nothing(&e), "{e:?}");
    assert!(
        events(&e).iter().all(|(_, m)| !m.contains("team-b:")),
        "{e:?}"
    );
    // An unrecorded tag (an older daemon's) is restored only when the name proves the
    // namespace: this plain name reads as two.
    let mut h = H::new(registry());
    let p = in_namespace(
        mk("b-app-0", "u1", &managed("b-app-0", "vk-team-b-app-0")),
        "team",
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = h.feed(Input::HibernateEvidence {
        op: evidence(&e),
        result: Ok(Some(owned_tag(""))),
    });
    assert!(refused_as(
        &e,
        "SnapshotNotInNamespace",
        "snapshot_not_in_namespace"
    ));
    // The namespace's own tag is restored: the wake starts (its VM's owner first).
    for (vm, owner) in [("vk-team-b-app-0", "team"), ("vk-team.b-app-0", "")] {
        let mut h = H::new(registry());
        let p = in_namespace(mk("b-app-0", "u1", &managed("b-app-0", vm)), "team");
        let e = h.feed(Input::PodUpserted(Box::new(p)));
        let e = h.feed(Input::HibernateEvidence {
            op: evidence(&e),
            result: Ok(Some(owned_tag(owner))),
        });
        let (_, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), format!("snapshot inspect {vm}"), "{vm}");
    }
}

#[test]
fn a_wake_never_reads_another_namespaces_tag_and_keeps_the_pod_hibernated() {
    let mut h = H::new(registry());
    hibernate_fully(&mut h);
    let e = h.feed(Input::PodUpserted(Box::new(asking(false))));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect vk-ns-demo-0",
        Answer::failed("Error: snapshot not found"),
    );
    let e = h.feed(Input::HibernateEvidence {
        op: evidence(&e),
        result: Ok(Some(owned_tag("other"))),
    });
    assert!(
        reads_nothing(&e),
        "no peer restore, pull, nor fresh boot: {e:?}"
    );
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "SnapshotNotInNamespace"));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "update",
            result: "failed",
            reason: "snapshot_not_in_namespace"
        }
    ));
    assert!(h.p.pod_vm(&key()).is_none());
    // The namespace's own tag is pulled by the digest that was checked.
    let e = h.advance(Duration::from_secs(16));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect vk-ns-demo-0",
        Answer::failed("Error: snapshot not found"),
    );
    let mut own = owned_tag("ns");
    own.from_node = String::new();
    let e = h.feed(Input::HibernateEvidence {
        op: evidence(&e),
        result: Ok(Some(own)),
    });
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::PullSnapshot { tag, local_name, .. }
            if tag == "sha256:0123" && local_name == "vk-ns-demo-0-hibernate-import")),
        "{e:?}"
    );
}

#[test]
fn a_wake_never_clones_a_local_snapshot_recorded_for_another_namespace() {
    for registry_on in [false, true] {
        let mut owners = Owners::default();
        owners.apply(&set(Owned::Snapshot, "vk-ns-demo-0", "other", "u9"));
        // A pod hibernated before a restart (no VM, its ids cleared).
        let mut ann = managed("a", "vk-ns-demo-0");
        ann.push((ANN_HIBERNATE, "true".into()));
        ann.push((ANN_LIFECYCLE_STATE, "hibernated".into()));
        let cfg = ProviderConfig {
            registry: registry_on,
            ..Default::default()
        };
        let (mut h, _) = H::starting_with(cfg, vec![mk("a", "u1", &ann)], vec![], owners);
        let e = h.feed(Input::PodUpserted(Box::new(asking(false))));
        let e = answer(
            &mut h,
            &e,
            "snapshot inspect vk-ns-demo-0",
            Answer::ok(r#"{"id":"S1","name":"vk-ns-demo-0"}"#),
        );
        assert!(reads_nothing(&e), "{e:?}");
        assert!(
            events(&e)
                .iter()
                .any(|(r, _)| *r == "SnapshotNotInNamespace"),
            "{e:?}"
        );
        assert!(h.p.pod_vm(&key()).is_none());
    }
}

#[test]
fn an_image_that_is_another_namespaces_vm_snapshot_is_never_pulled_nor_cloned() {
    let evil = |image: &str| {
        let mut ann = managed("x", "vk-evil-x");
        ann.retain(|(k, _)| *k != ANN_IMAGE);
        ann.push((ANN_IMAGE, image.to_string()));
        in_namespace(mk("x", "u1", &ann), "evil")
    };
    let to_image = |h: &mut H, image: &str| {
        let e = h.feed(Input::PodUpserted(Box::new(evil(image))));
        let e = h.feed(Input::HibernateEvidence {
            op: evidence(&e),
            result: Ok(None),
        });
        answer(h, &e, "snapshot rm fork-vk-evil-x", Answer::ok(""))
    };
    // Not on the node: its manifest says whose it is before any pull.
    for tag in [owned_tag("teamb"), owned_tag(""), {
        // A snapshot a daemon pushed (from-node) under a name that is no VM's.
        let mut t = owned_tag("");
        t.from_node = "node-b".into();
        t
    }] {
        for image in ["vk-teamb-app-0", "golden:v1"] {
            if image == "golden:v1" && tag.owner_namespace.is_empty() && tag.from_node.is_empty() {
                continue;
            }
            let mut h = H::new(registry());
            let e = to_image(&mut h, image);
            let e = answer(
                &mut h,
                &e,
                &format!(
                    "snapshot inspect {}",
                    crate::provider::spec::local_snapshot_name(image)
                ),
                Answer::failed("Error: snapshot not found"),
            );
            let read = image_read(&e);
            let e = h.feed(Input::HibernateEvidence {
                op: read,
                result: Ok(Some(tag.clone())),
            });
            assert!(
                refused_as(&e, "SnapshotNotInNamespace", "snapshot_not_in_namespace"),
                "{image} {tag:?}: {e:?}"
            );
            assert!(reads_nothing(&e), "{e:?}");
        }
    }
    // On the node: recorded for another namespace, or unrecorded under another's VM name.
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Snapshot, "golden:v1", "teamb", ""));
    for image in ["vk-teamb-app-0", "golden:v1"] {
        let (mut h, _) = H::starting_with(registry(), vec![], vec![], owners.clone());
        let e = to_image(&mut h, image);
        let e = answer(
            &mut h,
            &e,
            &format!("snapshot inspect {image}"),
            Answer::ok(format!(r#"{{"id":"S7","name":"{image}"}}"#)),
        );
        assert!(
            refused_as(&e, "SnapshotNotInNamespace", "snapshot_not_in_namespace"),
            "{image}: {e:?}"
        );
        assert!(reads_nothing(&e), "{e:?}");
    }
}

#[test]
fn a_base_image_is_pulled_by_its_digest_and_the_namespaces_own_vm_snapshot_with_its_owner() {
    let mut h = H::new(registry());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::failed("Error: snapshot not found"),
    );
    let read = e
        .iter()
        .find_map(|x| match x {
            Effect::ReadSnapshotTag { op, repo, tag } if repo == "team/agent" && tag == "v3" => {
                Some(*op)
            }
            _ => None,
        })
        .expect("manifest read");
    let base = HibernateTag {
        digest: "sha256:abcd".into(),
        ..Default::default()
    };
    let e = h.feed(Input::HibernateEvidence {
        op: read,
        result: Ok(Some(base)),
    });
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::PullSnapshot { tag, .. } if tag == "sha256:abcd")));
    assert_eq!(
        h.ledger.get(Owned::Snapshot, "team/agent:v3"),
        None,
        "base images stay shared"
    );

    // The namespace's own VM snapshot: recorded for its owner before the pull.
    let mut h = H::new(registry());
    let mut ann = managed("b", "vk-ns-b-0");
    ann.retain(|(k, _)| *k != ANN_IMAGE);
    ann.push((ANN_IMAGE, "vk-ns-demo-0".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("b", "u2", &ann))));
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-b-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect vk-ns-demo-0",
        Answer::failed("Error: snapshot not found"),
    );
    let read = image_read(&e);
    let mut own = owned_tag("ns");
    own.owner_pod_uid = "u1".into();
    let e = h.feed(Input::HibernateEvidence {
        op: read,
        result: Ok(Some(own)),
    });
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::PullSnapshot { tag, local_name, .. }
        if tag == "sha256:0123" && local_name == "vk-ns-demo-0")));
    assert_eq!(
        h.ledger.get(Owned::Snapshot, "vk-ns-demo-0"),
        Some(&Owner::new("ns", "u1"))
    );
}

#[test]
fn fork_from_across_team_and_team_prod_is_refused() {
    // A source a pod of team-prod holds: its `vk-team-` prefix does not make it team's.
    let mut h = H::new(ProviderConfig::default());
    let main = in_namespace(
        mk("main-0", "u0", &managed("main-0", "vk-team-prod-main-0")),
        "team-prod",
    );
    create_clone(&mut h, main, "VM0");
    let mut a = managed("sub", "vk-team-sub-0");
    a.push((ANN_FORK_FROM, "vk-team-prod-main-0".into()));
    let e = h.feed(Input::PodUpserted(Box::new(in_namespace(
        mk("sub", "u1", &a),
        "team",
    ))));
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-team-sub-0", Answer::ok(""));
    assert!(
        refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace"),
        "{e:?}"
    );
    assert!(cocoon_ops(&e).is_empty());
    // No pod holds it, but its record says team-prod.
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Vm, "vk-team-prod-main-0", "team-prod", "u0"));
    let keep = ProviderConfig {
        orphan_policy: OrphanPolicy::Keep,
        ..Default::default()
    };
    let kept = vec![vm_info("V0", "vk-team-prod-main-0", "running")];
    let (mut h, _) = H::starting_with(keep, vec![], kept, owners);
    let e = h.feed(Input::PodUpserted(Box::new(in_namespace(
        mk("sub", "u1", &a),
        "team",
    ))));
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-team-sub-0", Answer::ok(""));
    assert!(
        refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace"),
        "{e:?}"
    );
    // A fork snapshot of the namespace's own source recorded for another namespace is never
    // handed out.
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Snapshot, "fork-vk-ns.main-0", "other", ""));
    let (mut h, _) = H::starting_with(ProviderConfig::default(), vec![], vec![], owners);
    let mut a = managed("sub", "vk-ns-sub-0");
    a.push((ANN_FORK_FROM, "vk-ns.main-0".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("sub", "u1", &a))));
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-sub-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect fork-vk-ns.main-0",
        Answer::ok(r#"{"id":"F1","name":"fork-vk-ns.main-0"}"#),
    );
    assert!(cocoon_ops(&e).is_empty(), "no clone: {e:?}");
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m.contains("not recorded for namespace ns")));
}

#[test]
fn a_kept_vm_is_adopted_only_by_the_namespace_it_is_recorded_for_or_its_exact_id() {
    let keep = ProviderConfig {
        orphan_policy: OrphanPolicy::Keep,
        ..Default::default()
    };
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Vm, "vk-team-b-app-0", "team-b", "u0"));
    let vms = vec![
        vm_info("V1", "vk-team-b-app-0", "running"),
        vm_info("V2", "vk-team-web-0", "running"),
    ];
    let (mut h, _) = H::starting_with(keep, vec![], vms, owners);
    // Recorded for team-b: team's pod of that name is refused, nothing runs.
    let p = in_namespace(
        mk("b-app-0", "u1", &managed("b-app-0", "vk-team-b-app-0")),
        "team",
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(
        refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace"),
        "{e:?}"
    );
    assert!(cocoon_ops(&e).is_empty());
    // An earlier daemon's VM (no record, a name of two readings): adopted by the pod whose id
    // annotation is its exact ID, and then recorded for it.
    let mut ann = managed("web-0", "vk-team-web-0");
    ann.push((ANN_VM_ID, "V2".into()));
    let p = in_namespace(mk("web-0", "u2", &ann), "team");
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
    h.feed(Input::LeaseLooked {
        op: lookup(&e).expect("lease lookup"),
        result: Ok(Some("10.0.0.5".into())),
    });
    assert_eq!(
        h.ledger.get(Owned::Vm, "vk-team-web-0"),
        Some(&Owner::new("team", "u2"))
    );
}

/// Found by the simulation's attacker namespace: at startup a pod of `team` naming team-b's
/// VM (listed first) claimed it without taking it, which kept team-b's own pod from adopting
/// it; both were then created, and team's create recorded itself as the VM's owner over
/// team-b's record, cloned into the taken name, looked the VM up and adopted it.
#[test]
fn at_startup_a_pod_naming_another_namespaces_vm_neither_keeps_it_from_its_pod_nor_takes_it() {
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Vm, "vk-team-b-app-0", "team-b", "u0"));
    let vms = vec![vm_info("V1", "vk-team-b-app-0", "running")];
    // `team/...` sorts before `team-b/...`: the attacker is matched first.
    let attacker = in_namespace(
        mk("b-app-0", "u1", &managed("b-app-0", "vk-team-b-app-0")),
        "team",
    );
    let mut ann = managed("app-0", "vk-team-b-app-0");
    ann.push((ANN_VM_ID, "V1".into()));
    let victim = in_namespace(mk("app-0", "u0", &ann), "team-b");
    let cfg = ProviderConfig {
        registry: true,
        ..Default::default()
    };
    let (h, e) = H::starting_with(cfg, vec![attacker, victim], vms, owners);
    let victim_key = PodKey::new("team-b", "app-0");
    assert_eq!(
        h.p.pod_vm(&victim_key).map(|v| v.id.as_str()),
        Some("V1"),
        "{e:?}"
    );
    assert!(h.p.pod_vm(&PodKey::new("team", "b-app-0")).is_none());
    assert_eq!(
        h.ledger.get(Owned::Vm, "vk-team-b-app-0"),
        Some(&Owner::new("team-b", "u0"))
    );
    assert!(cocoon_ops(&e)
        .iter()
        .all(|(_, c)| !argv(c).starts_with("vm clone") && !argv(c).starts_with("vm rm")));
}

/// A create never records its VM's owner over another namespace's record (a VM of a name of
/// two readings that no live pod holds, listed at startup): it is refused before the clone.
#[test]
fn a_create_never_records_itself_as_the_owner_of_another_namespaces_vm() {
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Vm, "vk-team-b-app-0", "team-b", "u0"));
    let vms = vec![vm_info("V1", "vk-team-b-app-0", "running")];
    let attacker = in_namespace(
        mk("b-app-0", "u1", &managed("b-app-0", "vk-team-b-app-0")),
        "team",
    );
    let cfg = ProviderConfig {
        registry: true,
        ..Default::default()
    };
    let (mut h, e) = H::starting_with(cfg, vec![attacker], vms, owners);
    // Its create runs (the VM is only claimed, not known as held): no evidence, then the
    // image's snapshot; the clone is where it stops.
    let e = no_evidence(&mut h, &e);
    let mut e = e;
    for _ in 0..3 {
        let Some((op, cmd)) = cocoon_ops(&e).first().cloned() else {
            break;
        };
        let a = argv(&cmd);
        assert!(!a.starts_with("vm clone"), "{a}");
        let r = if a.starts_with("snapshot inspect") {
            Answer::ok(r#"{"id":"S","name":"team/agent:v3"}"#)
        } else {
            Answer::ok("")
        };
        e = h.cocoon(op, r);
        if refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace") {
            break;
        }
    }
    assert!(
        refused_as(&e, "VMNotInNamespace", "vm_not_in_namespace"),
        "{e:?}"
    );
    assert!(records(&e).is_empty(), "{e:?}");
    assert_eq!(
        h.ledger.get(Owned::Vm, "vk-team-b-app-0"),
        Some(&Owner::new("team-b", "u0"))
    );
}

#[test]
fn a_delete_never_removes_a_snapshot_of_its_vm_name_recorded_for_another_namespace() {
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Snapshot, "vk-team-b-app-0", "team-b", "u0"));
    owners.apply(&set(
        Owned::Snapshot,
        "fork-vk-team-b-app-0",
        "team-b",
        "u0",
    ));
    let (mut h, _) = H::starting_with(ProviderConfig::default(), vec![], vec![], owners);
    let p = in_namespace(
        mk("b-app-0", "u1", &managed("b-app-0", "vk-team-b-app-0")),
        "team",
    );
    let mut all = Vec::new();
    let mut e = h.feed(Input::PodUpserted(Box::new(deleted(p))));
    while let Some((op, _)) = cocoon_ops(&e).first().cloned() {
        all.extend(e.clone());
        e = h.cocoon(op, Answer::failed("Error: vm not found"));
    }
    all.extend(e);
    assert!(
        cocoon_ops(&all)
            .iter()
            .all(|(_, c)| !argv(c).starts_with("snapshot rm")),
        "{all:?}"
    );
    assert!(h.ledger.get(Owned::Snapshot, "vk-team-b-app-0").is_some());
}

// ----- rule 6: writes never replace another namespace's snapshot ---------------------------

fn tag_read(e: &[Effect], want_tag: &str) -> OpId {
    e.iter()
        .find_map(|x| match x {
            Effect::ReadSnapshotTag { op, repo, tag }
                if repo == "vk-ns-demo-0" && tag == want_tag =>
            {
                Some(*op)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("read of vk-ns-demo-0:{want_tag} before the push: {e:?}"))
}

#[test]
fn a_hibernate_never_pushes_over_another_namespaces_tag_and_keeps_the_vm() {
    let mut h = H::new(registry());
    create_clone(&mut h, asking(false), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(asking(true))));
    let e = answer(
        &mut h,
        &e,
        "snapshot save --name vk-ns-demo-0 VM1",
        Answer::ok(""),
    );
    let e = h.feed(Input::HibernateEvidence {
        op: tag_read(&e, "hibernate"),
        result: Ok(Some(owned_tag("other"))),
    });
    assert!(reads_nothing(&e), "no push, no vm rm: {e:?}");
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "SnapshotNotInNamespace"));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "update",
            result: "failed",
            reason: "snapshot_not_in_namespace"
        }
    ));
    assert_eq!(
        h.p.pod_vm(&key()).map(|v| v.id.clone()).as_deref(),
        Some("VM1")
    );
    // An unreadable registry fails closed the same way (the push is not attempted).
    let mut h = H::new(registry());
    create_clone(&mut h, asking(false), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(asking(true))));
    let e = answer(
        &mut h,
        &e,
        "snapshot save --name vk-ns-demo-0 VM1",
        Answer::ok(""),
    );
    let e = h.feed(Input::HibernateEvidence {
        op: tag_read(&e, "hibernate"),
        result: Err(TransferError::Transient("HTTP 503".into())),
    });
    assert!(reads_nothing(&e), "{e:?}");
}

#[test]
fn a_local_snapshot_of_another_namespace_is_neither_replaced_nor_re_recorded() {
    let mut owners = Owners::default();
    owners.apply(&set(Owned::Snapshot, "vk-ns-demo-0", "other", "u9"));
    let (mut h, _) = H::starting_with(registry(), vec![], vec![], owners);
    create_clone(&mut h, asking(false), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(asking(true))));
    assert!(reads_nothing(&e), "no save: {e:?}");
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "SnapshotNotInNamespace"));
    assert_eq!(
        h.ledger.get(Owned::Snapshot, "vk-ns-demo-0"),
        Some(&Owner::new("other", "u9"))
    );
}

#[test]
fn a_delete_never_pushes_over_another_namespaces_latest_and_still_removes_the_vm() {
    let mut h = H::new(registry());
    let p = super::delete::main_snapshotted_pod();
    create_clone(&mut h, p.clone(), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(super::delete::deleting_pod(
        p, true,
    ))));
    let running = vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = answer(&mut h, &e, "vm inspect VM1", Answer::ok(running));
    let e = answer(
        &mut h,
        &e,
        "snapshot save --name vk-ns-demo-0 VM1",
        Answer::ok(""),
    );
    let e = h.feed(Input::HibernateEvidence {
        op: tag_read(&e, "latest"),
        result: Ok(Some(owned_tag("other"))),
    });
    assert!(!e.iter().any(|x| matches!(x, Effect::PushSnapshot { .. })));
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "SnapshotNotInNamespace"));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "delete",
            result: "skipped",
            reason: "snapshot_not_in_namespace"
        }
    ));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
}
