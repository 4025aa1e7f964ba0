//! Transition tests of delete: snapshot save / push / rm, the API-first and API-last steps,
//! deletes that arrive while the watch was down.

use super::*;

pub(super) fn deleting_pod(mut p: Pod, running: bool) -> Pod {
    p.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    p.metadata.deletion_grace_period_seconds = Some(30);
    if running {
        p.status = Some(status::running(
            "10.0.0.9",
            true,
            None,
            None,
            &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
        ));
    }
    p
}

/// Pod `a` (VM `vk-ns-demo-0`), the main VM of CocoonSet `demo` with snapshot policy
/// `main-only`: its delete saves and pushes a snapshot first.
pub(super) fn main_snapshotted_pod() -> Pod {
    let mut p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    p.metadata.owner_references = Some(vec![OwnerReference {
        kind: "CocoonSet".into(),
        name: "demo".into(),
        ..Default::default()
    }]);
    let mut ann = p.metadata.annotations.clone().unwrap_or_default();
    ann.insert(ANN_SNAPSHOT_POLICY.into(), "main-only".into());
    p.metadata.annotations = Some(ann);
    p
}

#[test]
fn delete_snapshots_pushes_removes_then_deletes_the_object() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let p = main_snapshotted_pod();
    create_clone(&mut h, p.clone(), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, true))));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot save --name vk-ns-demo-0 VM1");
    let e = h.cocoon(op, Answer::ok(""));
    let e = no_tag_yet(&mut h, e);
    let push = e.iter().find_map(|x| match x {
        Effect::PushSnapshot {
            op,
            repo,
            tag,
            base_image,
            ..
        } => Some((*op, repo.clone(), tag.clone(), base_image.clone())),
        _ => None,
    });
    let (pop, repo, tag, base) = push.unwrap();
    assert_eq!(
        (repo.as_str(), tag.as_str(), base.as_str()),
        ("vk-ns-demo-0", "latest", "team/agent:v3")
    );
    let e = h.feed(Input::TransferDone {
        op: pop,
        result: Ok(String::new()),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
    let e = h.cocoon(op, Answer::ok(""));
    assert!(e.iter().any(|x| matches!(x, Effect::ReleaseLeases { macs } if macs == &vec!["02:00:00:00:00:01".to_string()])));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm vk-ns-demo-0");
    let e = h.cocoon(op, Answer::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm fork-vk-ns-demo-0");
    let e = h.cocoon(op, Answer::ok(""));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.phase.as_deref() == Some("Succeeded")));
    assert_eq!(deletes(&e).len(), 1);
    assert_eq!(deletes(&e)[0].1, Some(0));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "delete",
            result: "ok",
            reason: ""
        }
    ));
    assert!(h.p.get_pod(&PodKey::new("ns", "a")).is_none());
}

#[test]
fn delete_of_sub_agent_under_main_only_skips_snapshot_and_failure_keeps_vm_and_retries() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let mut ann = managed("b", "vk-ns-demo-2");
    ann.push((ANN_SNAPSHOT_POLICY, "main-only".into()));
    let mut p = mk("b", "u2", &ann);
    p.metadata.owner_references = Some(vec![OwnerReference {
        kind: "CocoonSet".into(),
        name: "demo".into(),
        ..Default::default()
    }]);
    create_clone(&mut h, p.clone(), "VM2");
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, true))));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM2");
    let e = h.cocoon(op, Answer::failed("device busy"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ProviderDeleteFailed" && m.contains("VM kept")));
    assert!(deletes(&e).is_empty());
    let e = h.advance(Duration::from_millis(5));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM2");
    // Already absent counts as removed.
    let e = h.cocoon(op, Answer::failed("Error: vm VM2: VM not found"));
    // Its snapshots go (`<vm>` only when one is recorded for the namespace; none was saved).
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm fork-vk-ns-demo-2");
}

#[test]
fn pod_deleted_while_watch_was_down_still_loses_its_vm() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    // Relist without the pod.
    let e = h.feed(Input::PodsRelisted(vec![]));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
}

#[test]
fn not_running_pod_being_deleted_is_force_deleted_at_once() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &[(ANN_MANAGED, "true".into())]); // bad pod, never tracked
    h.feed(Input::PodUpserted(Box::new(p.clone())));
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, false))));
    assert_eq!(deletes(&e).len(), 1);
    assert_eq!(deletes(&e)[0].1, Some(0));
    assert!(cocoon_ops(&e).is_empty());
}

#[test]
fn an_answer_the_delete_step_does_not_expect_keeps_the_vm_and_retries() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p.clone(), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, true))));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    let warned: Vec<&str> = events(&e).iter().map(|(r, _)| *r).collect();
    assert!(warned.contains(&"UnexpectedAnswer"), "{warned:?}");
    assert!(warned.contains(&"ProviderDeleteFailed"), "{warned:?}");
    assert!(
        deletes(&e).is_empty(),
        "the pod object stays while its VM may run"
    );
    let e = h.advance(Duration::from_secs(2));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
}

/// A pod we never tracked (a restart while a killed daemon's `vm clone` still ran) is being
/// deleted: its VM is looked up by name and removed before the object goes; a VM still
/// being created is waited for.
#[test]
fn an_untracked_pod_being_deleted_loses_the_vm_a_killed_daemon_was_cloning() {
    let mut h = H::new(ProviderConfig::default());
    let p = deleting_pod(mk("a", "u1", &managed("a", "vk-ns-demo-0")), false);
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(deletes(&e).is_empty(), "no force-delete before the lookup");
    let creating = vm_json("VM1", "vk-ns-demo-0", "creating", "02:00:00:00:00:01");
    let e = answer(&mut h, &e, "vm inspect vk-ns-demo-0", Answer::ok(creating));
    // The clone still runs (its record is busy): wait, then look again.
    let e = answer(
        &mut h,
        &e,
        "vm reconcile-stale-create -o json VM1",
        Answer::ok(r#"{"id":"VM1","outcome":"busy"}"#),
    );
    assert!(cocoon_ops(&e).is_empty() && deletes(&e).is_empty(), "{e:?}");
    let e = h.advance(Duration::from_secs(1));
    let running = vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = answer(&mut h, &e, "vm inspect vk-ns-demo-0", Answer::ok(running));
    assert!(deletes(&e).is_empty());
    let e = answer(&mut h, &e, "vm rm --force VM1", Answer::ok(""));
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
    assert_eq!(deletes(&e).len(), 1, "the object goes after its VM: {e:?}");
}

/// Found by neither name nor ID annotation: nothing to remove, the object goes.
#[test]
fn an_untracked_deleting_pod_with_no_vm_is_deleted_after_both_lookups() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_VM_ID, "VM9".into()));
    let p = deleting_pod(mk("a", "u1", &ann), false);
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let gone = || Answer::failed("Error: vm x: VM not found");
    let e = answer(&mut h, &e, "vm inspect vk-ns-demo-0", gone());
    let e = answer(&mut h, &e, "vm inspect VM9", gone());
    // No `snapshot rm vk-ns-demo-0`: no snapshot of that name is recorded for the namespace
    // (nor does the name prove it); the fork cache goes.
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
    assert_eq!(deletes(&e).len(), 1, "{e:?}");
}

/// A create whose pod gets a deletionTimestamp stops at its next answer; the VM that answer
/// reports is found by name and removed, never brought up.
#[test]
fn a_create_stops_when_its_pod_is_being_deleted() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let (clone_op, _) = drive_to_clone(&mut h, p.clone());
    assert!(h
        .feed(Input::PodUpserted(Box::new(deleting_pod(p, false))))
        .is_empty());
    let vm = vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = h.cocoon(clone_op, Answer::ok(vm.clone()));
    assert!(lookup(&e).is_none(), "no bring-up: {e:?}");
    let e = answer(&mut h, &e, "vm inspect vk-ns-demo-0", Answer::ok(vm));
    let e = answer(&mut h, &e, "vm rm --force VM1", Answer::ok(""));
    assert!(deletes(&e).is_empty());
}

/// A tracked pod with no running container being deleted: the VM goes before the object (a
/// crash between the two must not leave a VM no pod names).
#[test]
fn the_vm_is_removed_before_the_object_even_with_no_running_container() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p.clone(), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, false))));
    assert!(deletes(&e).is_empty(), "{e:?}");
    let e = answer(&mut h, &e, "vm rm --force VM1", Answer::ok(""));
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
    assert_eq!(deletes(&e).len(), 1, "{e:?}");
}

/// A bad pod's Failed status meets a 500 and its retry is due; the pod is then deleted and
/// force-deleted (grace 0) at once. The retry falls due while that DELETE is on its way: it
/// must not be sent, the object it would patch is gone.
#[test]
fn a_status_retry_due_during_a_bad_pods_grace_0_delete_is_dropped() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &[(ANN_MANAGED, "true".into())]); // bad pod, never tracked
    let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
    let (failed, _) = statuses(&e)[0].clone();
    h.feed(Input::KubeDone {
        op: failed,
        result: Err(KubeError::Other("500 Internal Server Error".into())),
    });
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, false))));
    assert_eq!(deletes(&e).len(), 1);
    let e = h.advance(Duration::from_secs(5));
    assert!(
        statuses(&e).is_empty(),
        "status after the grace-0 delete: {e:?}"
    );
    assert!(annotation_patches(&e).is_empty(), "{e:?}");
}
