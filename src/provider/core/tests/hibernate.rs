//! Transition tests of hibernate: save, push, id clearing, removal, the rollback of each
//! failure, the Windows NIC drop, the op retry, owed hibernate after a restart.

use super::*;

const VM: &str = "vk-ns-demo-0";

pub(super) fn registry() -> ProviderConfig {
    ProviderConfig {
        registry: true,
        ..Default::default()
    }
}

/// The pod `a` with `hibernate` set to `on`.
pub(super) fn asking(on: bool) -> Pod {
    let mut ann = managed("a", VM);
    ann.push((ANN_HIBERNATE, if on { "true" } else { "false" }.into()));
    mk("a", "u1", &ann)
}

pub(super) fn key() -> PodKey {
    PodKey::new("ns", "a")
}

fn push_op(e: &[Effect]) -> OpId {
    e.iter()
        .find_map(|x| match x {
            Effect::PushSnapshot {
                op,
                local_name,
                repo,
                tag,
                base_image,
                owner,
            } => {
                assert_eq!((local_name.as_str(), repo.as_str()), (VM, VM));
                assert_eq!(tag, "hibernate");
                assert_eq!(base_image, "team/agent:v3");
                assert_eq!(owner, &crate::provider::owners::Owner::new("ns", "u1"));
                Some(*op)
            }
            _ => None,
        })
        .expect("push of the hibernate tag")
}

fn ids_cleared_op(e: &[Effect]) -> OpId {
    e.iter()
        .find_map(|x| match x {
            Effect::PatchPodAnnotations {
                op,
                uid,
                annotations,
                ..
            } if annotations.get(ANN_VM_ID) == Some(&None) => {
                assert_eq!(uid.as_deref(), Some("u1"), "guarded by the uid");
                assert_eq!(annotations.get(ANN_VM_IP), Some(&None));
                assert_eq!(annotations.get(ANN_POST_CLONE_STATE), Some(&None));
                Some(*op)
            }
            _ => None,
        })
        .expect("id / ip cleared")
}

pub(super) fn lifecycle_written(e: &[Effect], state: &str) -> bool {
    annotation_patches(e)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some(state.into())))
}

fn ids_rewritten(e: &[Effect], id: &str) -> bool {
    annotation_patches(e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some(id.into())))
}

/// A running pod `a` (VM1) then `hibernate=true`: returns the effects up to the save.
pub(super) fn ask_hibernate(h: &mut H) -> Vec<Effect> {
    create_clone(h, asking(false), "VM1");
    probe_ok(h, "a", "u1");
    let e = h.feed(Input::PodUpserted(Box::new(asking(true))));
    assert!(lifecycle_written(&e, "hibernating"), "{e:?}");
    e
}

/// Drive a hibernate to its end (the push only with a registry): the pod is tracked with no VM.
pub(super) fn hibernate_fully(h: &mut H) -> Vec<Effect> {
    let e = ask_hibernate(h);
    let e = answer(
        h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::ok(""),
    );
    let mut e = no_tag_yet(h, e);
    if e.iter().any(|x| matches!(x, Effect::PushSnapshot { .. })) {
        let op = push_op(&e);
        e = h.feed(Input::TransferDone {
            op,
            result: Ok(String::new()),
        });
    }
    let op = ids_cleared_op(&e);
    assert!(
        cocoon_ops(&e).is_empty(),
        "nothing removed before the ids are cleared"
    );
    let e = h.kube_ok(op);
    answer(h, &e, "vm rm --force VM1", Answer::ok(""))
}

#[test]
fn hibernate_saves_pushes_clears_ids_then_removes_the_vm() {
    let mut h = H::new(registry());
    let e = hibernate_fully(&mut h);
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::ReleaseLeases { macs } if macs == &["02:00:00:00:00:01"])));
    assert!(e.iter().any(|x| matches!(x, Effect::StopProbe { .. })));
    assert!(lifecycle_written(&e, "hibernated"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "Hibernated" && m == "snapshot pushed to registry"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ProviderUpdateSuccess" && m == "Update pod in provider successfully"));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "update",
            result: "ok",
            reason: ""
        }
    ));
    assert!(has_metric(
        &e,
        &MetricUpdate::Hibernate {
            namespace: "ns".into(),
            phase: "remove",
            result: "ok"
        }
    ));
    // Pending with no VM, still tracked (GetPod answers; a wake is an update).
    let st = statuses(&e);
    assert_eq!(st.last().unwrap().1.phase.as_deref(), Some("Pending"));
    assert!(h.p.pod_vm(&key()).is_none());
    assert!(h.p.get_pod(&key()).is_some());
    // Nothing more happens while the pod asks for hibernate.
    let e = h.advance(Duration::from_secs(600));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
}

#[test]
fn the_save_counts_its_metrics_and_a_taken_name_has_its_holder_removed() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    h.now += Duration::from_secs(3);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::failed(format!(
            "Error: snapshot name \"{VM}\" already in use by SNAPOLD"
        )),
    );
    let e = answer(
        &mut h,
        &e,
        "snapshot rm SNAPOLD",
        Answer::failed("Error: rm: snapshot SNAPOLD is in use by an active clone/restore/export"),
    );
    assert!(cocoon_ops(&e).is_empty(), "waits 500 ms");
    let e = h.advance(Duration::from_millis(500));
    let e = answer(&mut h, &e, &format!("snapshot rm {VM}"), Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::ok(""),
    );
    assert!(has_metric(&e, &MetricUpdate::SnapshotSave { result: "ok" }));
    assert!(
        e.iter().any(|x| matches!(x,
        Effect::Metric(MetricUpdate::SnapshotSaveDuration { namespace, .. }) if namespace == "ns"))
    );
    let e = no_tag_yet(&mut h, e);
    push_op(&e);
}

#[test]
fn a_failed_push_keeps_the_vm_and_retries_on_the_op_schedule() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::ok(""),
    );
    let e = no_tag_yet(&mut h, e);
    let op = push_op(&e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Err(TransferError::Transient("put blob: HTTP 503".into())),
    });
    assert!(cocoon_ops(&e).is_empty(), "the VM is not removed: {e:?}");
    assert!(ids_rewritten(&e, "VM1"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "HibernatePushFailed" && m.starts_with("update: hibernate: push")));
    assert!(annotation_patches(&e).iter().any(|(_, a)| {
        a.get(ANN_LIFECYCLE_STATE) == Some(&Some("failed".into()))
            && a.get(ANN_LIFECYCLE_MSG)
                .and_then(|m| m.as_deref())
                .is_some_and(|m| m.starts_with("hibernate: "))
    }));
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotPush { result: "failed" }
    ));
    assert!(h.p.pod_vm(&key()).is_some());
    // Nothing before 15 s, then the whole hibernate again; the next failure waits 30 s.
    assert!(cocoon_ops(&h.advance(Duration::from_millis(14_900))).is_empty());
    let e = h.advance(Duration::from_millis(100));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::failed("Error: save: vm VM1: disk full"),
    );
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "HibernateSnapshotFailed"));
    assert!(cocoon_ops(&h.advance(Duration::from_millis(29_900))).is_empty());
    let e = h.advance(Duration::from_millis(100));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot save --name {VM} VM1"));
}

#[test]
fn a_failed_removal_deletes_the_pushed_tag_and_keeps_the_vm() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::ok(""),
    );
    let e = no_tag_yet(&mut h, e);
    let op = push_op(&e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    let op = ids_cleared_op(&e);
    let e = h.kube_ok(op);
    let e = answer(
        &mut h,
        &e,
        "vm rm --force VM1",
        Answer::failed("Error: rm: vm VM1: device busy"),
    );
    let op = e
        .iter()
        .find_map(|x| match x {
            Effect::DeleteSnapshotTag { op, repo, tag } if repo == VM && tag == "hibernate" => {
                Some(*op)
            }
            _ => None,
        })
        .expect("the pushed tag is deleted");
    assert!(
        !ids_rewritten(&e, "VM1"),
        "ids come back after the tag is gone"
    );
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    assert!(ids_rewritten(&e, "VM1"));
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "HibernateRemoveFailed"));
    assert!(!e.iter().any(|x| matches!(x, Effect::ReleaseLeases { .. })));
    assert!(h.p.pod_vm(&key()).is_some());
}

#[test]
fn without_a_registry_the_snapshot_stays_local() {
    let mut h = H::new(ProviderConfig::default());
    let e = ask_hibernate(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::ok(""),
    );
    let e = no_tag_yet(&mut h, e);
    assert!(!e.iter().any(|x| matches!(x, Effect::PushSnapshot { .. })));
    let op = ids_cleared_op(&e);
    let e = h.kube_ok(op);
    let e = answer(&mut h, &e, "vm rm --force VM1", Answer::ok(""));
    assert!(events(&e).iter().any(|(r, m)| *r == "Hibernated"
        && m == "snapshot saved locally (no registry pusher configured)"));
}

#[test]
fn withdrawing_a_failed_hibernate_lifts_the_failure() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::failed("Error: save: vm VM1: disk full"),
    );
    let e = h.feed(Input::PodUpserted(Box::new(asking(false))));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert!(lifecycle_written(&e, "creating"));
    let (sop, _) = statuses(&e)
        .into_iter()
        .rev()
        .find(|(_, s)| published(s))
        .expect("ready publication");
    let e = h.kube_ok(sop);
    assert!(lifecycle_written(&e, "ready"));
    // The retry no longer hibernates.
    assert!(cocoon_ops(&h.advance(Duration::from_secs(60))).is_empty());
}

#[test]
fn a_vm_event_during_the_hibernate_is_looked_at_after_a_rollback() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    let (save, _) = one_cocoon(&e);
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", VM, "stopped"),
    });
    assert!(
        cocoon_ops(&e).is_empty(),
        "the hibernate owns the VM now: {e:?}"
    );
    let e = h.cocoon(save, Answer::failed("Error: save: vm VM1 is not running"));
    assert!(cocoon_ops(&e).is_empty());
    // The deferred recheck finds the VM stopped and restarts it like any crash.
    let e = h.advance(Duration::from_secs(1));
    let e = answer(
        &mut h,
        &e,
        "vm inspect VM1",
        Answer::ok(vm_json("VM1", VM, "stopped", "02:00:00:00:00:01")),
    );
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm start VM1");
}

#[test]
fn a_crashed_vm_under_a_pod_asking_for_hibernate_is_restarted() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::failed("Error: save: vm VM1: disk full"),
    );
    // Waiting for its retry, the VM dies: restarted as for any pod.
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", VM, "stopped"),
    });
    let e = answer(
        &mut h,
        &e,
        "vm inspect VM1",
        Answer::ok(vm_json("VM1", VM, "stopped", "02:00:00:00:00:01")),
    );
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm start VM1");
}

/// A Windows CH pod adopted at startup with `hibernate=true` (and its VM `state`).
fn windows_resumed(state: &str) -> (H, Vec<Effect>) {
    let mut h = H {
        p: Provider::new(registry()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let mut ann = managed("a", VM);
    ann.extend([
        (ANN_OS, "windows".to_string()),
        (ANN_BACKEND, "cloud-hypervisor".to_string()),
        (ANN_HIBERNATE, "true".to_string()),
        (ANN_VM_ID, "VM1".to_string()),
        (ANN_LIFECYCLE_STATE, "ready".to_string()),
    ]);
    let e = h.feed(Input::StartupListed {
        pods: vec![mk("a", "u1", &ann)],
        vms: vec![vm_info("VM1", VM, state)],
        owners: Default::default(),
    });
    assert!(has_metric(
        &e,
        &MetricUpdate::StartupResume { op: "hibernate" }
    ));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ResumedAfterRestart" && m == "op=hibernate"));
    (h, e)
}

#[test]
fn windows_drops_its_nic_and_gets_it_back_on_rollback() {
    let (mut h, e) = windows_resumed("running");
    let e = answer(
        &mut h,
        &e,
        "vm exec VM1 -- cmd /c ipconfig /release",
        Answer::failed("exec: guest agent not answering"),
    );
    let e = answer(&mut h, &e, "vm net --nics 0 VM1", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::failed("Error: save: disk full"),
    );
    let e = answer(&mut h, &e, "vm net --nics 1 VM1", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        "vm inspect VM1",
        Answer::ok(vm_json("VM1", VM, "running", "02:00:00:00:00:07")),
    );
    // The renew is detached: nobody waits for it.
    let renew = cocoon_ops(&e)
        .into_iter()
        .any(|(_, c)| argv(&c) == "vm exec VM1 -- cmd /c ipconfig /renew");
    assert!(renew, "{e:?}");
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "HibernateSnapshotFailed"));
    let vm = h.p.pod_vm(&key()).unwrap();
    assert_eq!(vm.primary_mac(), "02:00:00:00:00:07", "NIC list refreshed");
}

#[test]
fn windows_net_resize_failure_renews_and_fails() {
    let (mut h, e) = windows_resumed("running");
    let e = answer(
        &mut h,
        &e,
        "vm exec VM1 -- cmd /c ipconfig /release",
        Answer::ok(""),
    );
    let e = answer(
        &mut h,
        &e,
        "vm net --nics 0 VM1",
        Answer::failed("Error: net: hotplug refused"),
    );
    let ops = cocoon_ops(&e);
    assert_eq!(ops.len(), 1, "only the renew: {e:?}");
    assert_eq!(argv(&ops[0].1), "vm exec VM1 -- cmd /c ipconfig /renew");
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "HibernateNetResizeFailed"));
    assert!(has_metric(
        &e,
        &MetricUpdate::Hibernate {
            namespace: "ns".into(),
            phase: "net_resize",
            result: "failed"
        }
    ));
}

#[test]
fn owed_hibernate_starts_a_stopped_vm_first() {
    let (mut h, e) = windows_resumed("stopped");
    let e = answer(
        &mut h,
        &e,
        "vm start VM1",
        Answer::failed("Error: start: vm VM1: no such kernel"),
    );
    assert!(events(&e).iter().any(|(r, _)| *r == "ResumeStartFailed"));
    // The op retry starts it again in 15 s.
    let e = h.advance(Duration::from_secs(15));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm start VM1");
}

#[test]
fn a_hibernate_withdrawn_before_the_removal_keeps_the_vm_and_drops_the_tag() {
    let mut h = H::new(registry());
    let e = ask_hibernate(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name {VM} VM1"),
        Answer::ok(""),
    );
    let e = no_tag_yet(&mut h, e);
    let op = push_op(&e);
    // The operator changes its mind while the push runs: the op finishes its step first.
    let e2 = h.feed(Input::PodUpserted(Box::new(asking(false))));
    assert!(cocoon_ops(&e2).is_empty());
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    assert!(cocoon_ops(&e).is_empty(), "the VM stays: {e:?}");
    let op = e
        .iter()
        .find_map(|x| match x {
            Effect::DeleteSnapshotTag { op, .. } => Some(*op),
            _ => None,
        })
        .expect("the tag of a hibernation that did not happen is deleted");
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    assert!(ids_rewritten(&e, "VM1"));
    assert!(lifecycle_written(&e, "creating"));
    assert!(!events(&e).iter().any(|(r, _)| r.starts_with("Hibernate")));
    assert!(h.p.pod_vm(&key()).is_some());
}
