//! Transition tests of wake and CreatePod's restore: wake-source resolution (verified local
//! copy, stale copy, registry pull), clone, follow-up, and the failures of each step.

use super::hibernate::{asking, hibernate_fully, key, registry};
use super::*;

const VM: &str = "vk-ns-demo-0";
const IMPORT: &str = "vk-ns-demo-0-hibernate-import";

pub(super) fn tag(id: &str) -> HibernateTag {
    HibernateTag {
        base_image: "team/agent:v3".into(),
        snapshot_id: id.into(),
        from_node: "node-b".into(),
        owner_namespace: "ns".into(),
        owner_pod_uid: "u1".into(),
        ..Default::default()
    }
}

pub(super) fn evidence_op(e: &[Effect]) -> OpId {
    e.iter()
        .find_map(|x| match x {
            Effect::CheckHibernateEvidence { op, vm_name } if vm_name == VM => Some(*op),
            _ => None,
        })
        .expect("tag lookup")
}

fn peer_op(e: &[Effect]) -> Option<OpId> {
    e.iter().find_map(|x| match x {
        Effect::PeerRestore {
            op,
            vm_name,
            from_node,
            local_name,
            ..
        } if vm_name == VM && from_node == "node-b" && local_name == IMPORT => Some(*op),
        _ => None,
    })
}

/// The registry pull of the hibernate tag; a peer restore asked first (the tag names another
/// node) is answered with a failure, which falls through to the pull.
fn pull_op(h: &mut H, e: &[Effect]) -> OpId {
    let after_peer;
    let e = match peer_op(e) {
        Some(op) => {
            after_peer = h.feed(Input::TransferDone {
                op,
                result: Err(TransferError::Transient(
                    "peer node-b: connection refused".into(),
                )),
            });
            &after_peer[..]
        }
        None => e,
    };
    e.iter()
        .find_map(|x| match x {
            Effect::PullSnapshot {
                op,
                repo,
                tag,
                local_name,
            } if repo == VM && tag == "hibernate" && local_name == IMPORT => Some(*op),
            _ => None,
        })
        .expect("pull of the hibernate tag into the import")
}

/// No local snapshot of the VM: answers its inspect, then the registry lookup of the tag with
/// `found`; returns the effects after the lookup.
fn no_local_copy_then(
    h: &mut H,
    e: &[Effect],
    found: Result<Option<HibernateTag>, TransferError>,
) -> Vec<Effect> {
    let e = answer(
        h,
        e,
        &format!("snapshot inspect {VM}"),
        Answer::failed("Error: snapshot not found"),
    );
    let op = evidence_op(&e);
    h.feed(Input::HibernateEvidence { op, result: found })
}

fn local_snapshot(id: &str) -> Answer {
    Answer::ok(format!(
        r#"{{"id":"{id}","name":"{VM}","image":"team/agent:v3","hypervisor":"cloud-hypervisor"}}"#
    ))
}

/// A hibernated pod `a`, then `hibernate=false`: returns the effects of the wake's start.
fn ask_wake(h: &mut H) -> Vec<Effect> {
    hibernate_fully(h);
    let e = h.feed(Input::PodUpserted(Box::new(asking(false))));
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("creating".into()))));
    e
}

/// Answer a wake's clone from `source` and its lease lookup; returns the effects after both.
fn clone_answers(h: &mut H, e: &[Effect], source: &str) -> Vec<Effect> {
    let (op, cmd) = one_cocoon(e);
    let a = argv(&cmd);
    assert!(
        a.starts_with(&format!("vm clone --output json --name {VM}")),
        "{a}"
    );
    assert!(a.ends_with(&format!(" {source}")), "{a}");
    let e = h.cocoon(
        op,
        Answer::ok(vm_json("VM2", VM, "running", "02:00:00:00:00:02")),
    );
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::StartProbe { vm_id, .. } if vm_id == "VM2")));
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some("VM2".into()))));
    let lop = lookup(&e).expect("the follow-up waits for the lease");
    let mut all = e.clone();
    all.extend(h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.7".into())),
    }));
    all
}

#[test]
fn wake_clones_from_the_verified_local_snapshot_under_the_same_name() {
    let mut h = H::new(registry());
    let e = wake_to_verified_clone(&mut h);
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotVerify { result: "ok" }
    ));
    let e = clone_answers(&mut h, &e, VM);
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "Woken" && m == &format!("cloned from local snapshot {VM}")));
    assert!(has_metric(&e, &MetricUpdate::Wake { result: "ok" }));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "update",
            result: "ok",
            reason: ""
        }
    ));
    assert!(e.iter().any(|x| matches!(x, Effect::Metric(MetricUpdate::VmBootDuration { mode, .. }) if mode == "clone")));
    assert_eq!(h.p.pod_vm(&key()).unwrap().id, "VM2");
    // Ready once the probe answers; the hibernate tag is never deleted by a wake.
    let (sop, _) = statuses(&e)
        .into_iter()
        .rev()
        .find(|(_, s)| published(s))
        .expect("ready publication");
    let e = h.kube_ok(sop);
    assert!(!e
        .iter()
        .any(|x| matches!(x, Effect::DeleteSnapshotTag { .. })));
}

#[test]
fn a_stale_local_copy_is_removed_and_the_tag_pulled() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        local_snapshot("S-old"),
    );
    let op = evidence_op(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag("S-new"))),
    });
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotVerify { result: "stale" }
    ));
    let e = answer(&mut h, &e, &format!("snapshot rm {VM}"), Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot rm fork-{VM}"),
        Answer::ok(""),
    );
    let op = pull_op(&mut h, &e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {IMPORT}"),
        Answer::ok(format!(
            r#"{{"id":"S-new","name":"{IMPORT}","image":"team/agent:v3"}}"#
        )),
    );
    let (op, cmd) = one_cocoon(&e);
    let a = argv(&cmd);
    assert!(
        a.contains(" --pull ") && a.ends_with(&format!(" {IMPORT}")),
        "{a}"
    );
    let e = h.cocoon(
        op,
        Answer::ok(vm_json("VM2", VM, "running", "02:00:00:00:00:02")),
    );
    // The import is removed once it served the clone.
    assert!(cocoon_ops(&e)
        .iter()
        .any(|(_, c)| argv(c) == format!("snapshot rm {IMPORT}")));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "Woken" && m == &format!("cloned from registry {VM}:hibernate")));
}

#[test]
fn a_registry_down_during_wake_fails_closed_and_retries() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        local_snapshot("S1"),
    );
    let op = evidence_op(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Err(TransferError::Transient(
            "GET manifest: connection refused".into(),
        )),
    });
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotVerify { result: "error" }
    ));
    assert!(has_metric(&e, &MetricUpdate::Wake { result: "failed" }));
    assert!(
        cocoon_ops(&e).is_empty(),
        "the unverified copy is not cloned"
    );
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "WakePullFailed" && m.contains("connection refused")));
    assert!(h.p.pod_vm(&key()).is_none());
    // Retried after 15 s from the start.
    assert!(cocoon_ops(&h.advance(Duration::from_millis(14_900))).is_empty());
    let e = h.advance(Duration::from_millis(100));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot inspect {VM}"));
}

#[test]
fn a_failed_pull_or_clone_is_reported_as_such() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = no_local_copy_then(&mut h, &e, Ok(Some(tag("S1"))));
    let op = pull_op(&mut h, &e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Err(TransferError::Integrity(
            "blob sha256:ab: digest mismatch".into(),
        )),
    });
    assert!(events(&e).iter().any(|(r, _)| *r == "WakePullFailed"));

    let e = h.advance(Duration::from_secs(15));
    let e = no_local_copy_then(&mut h, &e, Ok(Some(tag("S1"))));
    let op = pull_op(&mut h, &e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {IMPORT}"),
        Answer::ok(format!(r#"{{"id":"S1","name":"{IMPORT}"}}"#)),
    );
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::failed("Error: clone: restore failed"));
    assert!(cocoon_ops(&e)
        .iter()
        .any(|(_, c)| argv(c) == format!("snapshot rm {IMPORT}")));
    let e = answer_leftover_lookup(&mut h, &e, Answer::failed("Error: vm not found"));
    assert!(events(&e).iter().any(|(r, _)| *r == "WakeCloneFailed"));
}

/// After a failed clone the wake looks for a record it left under the VM name (the import's
/// removal runs beside it): answers that `vm inspect` with `r`.
fn answer_leftover_lookup(h: &mut H, e: &[Effect], r: Answer) -> Vec<Effect> {
    let inspect = cocoon_ops(e)
        .into_iter()
        .filter(|(_, c)| !argv(c).starts_with("snapshot rm"))
        .collect::<Vec<_>>();
    assert_eq!(inspect.len(), 1, "{e:?}");
    assert_eq!(argv(&inspect[0].1), format!("vm inspect {VM}"));
    h.cocoon(inspect[0].0, r)
}

/// A wake of `a` whose local copy the tag verifies: returns the effects up to its clone.
fn wake_to_verified_clone(h: &mut H) -> Vec<Effect> {
    let e = ask_wake(h);
    let e = answer(
        h,
        &e,
        &format!("snapshot inspect {VM}"),
        local_snapshot("S1"),
    );
    let op = evidence_op(&e);
    h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag("S1"))),
    })
}

/// A wake of `a` whose clone is killed at its deadline; the lookup that follows finds a
/// record of the VM in `state`. Returns the effects after that lookup.
fn wake_clone_killed_leaving(h: &mut H, state: &str) -> Vec<Effect> {
    let e = wake_to_verified_clone(h);
    let (op, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm clone"));
    let killed = Answer::timed_out_call();
    let e = h.cocoon(op, killed);
    assert!(
        !events(&e).iter().any(|(r, _)| *r == "WakeCloneFailed"),
        "not reported before the lookup"
    );
    let leftover = vm_json("VM2", VM, state, "02:00:00:00:00:02");
    answer_leftover_lookup(h, &e, Answer::ok(leftover))
}

#[test]
fn a_failed_wake_clone_removes_the_record_it_left_before_the_retry() {
    let mut h = H::new(registry());
    let e = wake_clone_killed_leaving(&mut h, "created");
    let e = answer(&mut h, &e, "vm rm --force VM2", Answer::ok(""));
    assert!(events(&e).iter().any(|(r, _)| *r == "WakeCloneFailed"));
    assert!(has_metric(&e, &MetricUpdate::Wake { result: "failed" }));
    assert!(h.p.pod_vm(&key()).is_none());
    // The op retry clones again into the freed name.
    let e = h.advance(Duration::from_secs(15));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot inspect {VM}"));
}

#[test]
fn a_wake_clone_that_finished_past_its_deadline_is_taken() {
    let mut h = H::new(registry());
    let e = wake_clone_killed_leaving(&mut h, "running");
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "Woken" && m == &format!("cloned from local snapshot {VM}")));
    assert!(!events(&e).iter().any(|(r, _)| *r == "WakeCloneFailed"));
    assert!(cocoon_ops(&e).is_empty(), "nothing removed: {e:?}");
    assert_eq!(h.p.pod_vm(&key()).unwrap().id, "VM2");
}

#[test]
fn no_tag_and_no_local_copy_is_no_wake_source() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = no_local_copy_then(&mut h, &e, Ok(None));
    assert!(events(&e).iter().any(|(r, m)| *r == "WakePullFailed"
        && m.contains("no wake source")
        && m.ends_with("booting it fresh")));
    // No retry can find a source: the pod is created afresh (its evidence check opens it).
    let op = evidence_op(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(None),
    });
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot rm fork-{VM}"));
}

#[test]
fn a_pod_asking_for_hibernate_with_no_vm_settles_as_hibernated() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        local_snapshot("S1"),
    );
    let op = evidence_op(&e);
    h.feed(Input::HibernateEvidence {
        op,
        result: Err(TransferError::Transient("HTTP 503".into())),
    });
    // The wake failed; the operator asks for hibernate again: nothing to do but say so.
    let e = h.feed(Input::PodUpserted(Box::new(asking(true))));
    assert!(cocoon_ops(&e).is_empty());
    let last = annotation_patches(&e)
        .into_iter()
        .rev()
        .find_map(|(_, a)| a.get(ANN_LIFECYCLE_STATE).cloned().flatten());
    assert_eq!(last.as_deref(), Some("hibernated"));
    // And the wake's retry is dropped.
    assert!(cocoon_ops(&h.advance(Duration::from_secs(60))).is_empty());
}

#[test]
fn without_a_registry_the_local_snapshot_is_trusted() {
    let mut h = H::new(ProviderConfig::default());
    let e = ask_wake(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        local_snapshot("S1"),
    );
    assert!(!e
        .iter()
        .any(|x| matches!(x, Effect::CheckHibernateEvidence { .. })));
    clone_answers(&mut h, &e, VM);
}

#[test]
fn create_restores_a_pod_whose_tag_another_daemon_pushed() {
    let mut h = H::new(registry());
    let e = h.feed(Input::PodUpserted(Box::new(asking(false))));
    let op = evidence_op(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag("S9"))),
    });
    assert!(has_metric(
        &e,
        &MetricUpdate::HibernateEvidence {
            verdict: "restored"
        }
    ));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "HibernateSnapshotExists"
            && m == &format!(
                "restoring vm {VM} from its hibernate snapshot instead of fresh-booting"
            )));
    let e = no_local_copy_then(&mut h, &e, Ok(Some(tag("S9"))));
    let op = pull_op(&mut h, &e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {IMPORT}"),
        Answer::ok(format!(r#"{{"id":"S9","name":"{IMPORT}"}}"#)),
    );
    let e = clone_answers(&mut h, &e, IMPORT);
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: ""
        }
    ));
    assert!(has_metric(&e, &MetricUpdate::Wake { result: "ok" }));
}

#[test]
fn a_failed_restore_fails_the_create_and_counts_the_wake() {
    let mut h = H::new(registry());
    let e = h.feed(Input::PodUpserted(Box::new(asking(false))));
    let op = evidence_op(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag("S9"))),
    });
    let e = no_local_copy_then(&mut h, &e, Err(TransferError::Transient("HTTP 503".into())));
    assert!(has_metric(&e, &MetricUpdate::Wake { result: "failed" }));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: ""
        }
    ));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("ProviderFailed")));
    assert!(
        h.p.get_pod(&key()).is_none(),
        "the provisional row is dropped"
    );
}

#[test]
fn an_explicit_restore_without_evidence_still_looks_for_a_source() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", VM);
    ann.push((ANN_RESTORE, "true".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        Answer::failed("Error: snapshot not found"),
    );
    // No evidence; the restore still asks for the local snapshot and reports its absence.
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        Answer::failed("Error: snapshot not found"),
    );
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "WakePullFailed" && m.contains("no wake source")));
}

/// The tag names the node that pushed it: its peer listener serves the raw snapshot files into
/// the staging dir, and the VM is cloned `--from-dir` there; no registry pull happens.
#[test]
fn a_wake_restores_from_the_peer_that_pushed_the_tag() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = no_local_copy_then(&mut h, &e, Ok(Some(tag("S1"))));
    let op = peer_op(&e).expect("peer restore from node-b first");
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok("/var/lib/vk/staging/peer-1".into()),
    });
    assert!(!e.iter().any(|x| matches!(x, Effect::PullSnapshot { .. })));
    let (_, cmd) = one_cocoon(&e);
    let a = argv(&cmd);
    assert!(a.starts_with("vm clone"), "{a}");
    assert!(a.contains("--from-dir /var/lib/vk/staging/peer-1"), "{a}");
    assert!(a.contains(&format!("--name {VM}")), "{a}");
    assert!(
        staged_removals(&e).is_empty(),
        "the copy is kept until its clone answers"
    );
    let e = clone_answers(&mut h, &e, STAGED);
    assert_eq!(staged_removals(&e), vec![STAGED]);
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "Woken" && m == "cloned from peer node-b"));
}

const STAGED: &str = "/var/lib/vk/staging/peer-1";

fn staged_removals(e: &[Effect]) -> Vec<&str> {
    e.iter()
        .filter_map(|x| match x {
            Effect::RemoveStagedDir { dir } => Some(dir.as_str()),
            _ => None,
        })
        .collect()
}

/// A wake whose peer restore is in flight (its op returned).
fn waiting_on_the_peer(h: &mut H) -> OpId {
    let e = ask_wake(h);
    let e = no_local_copy_then(h, &e, Ok(Some(tag("S1"))));
    peer_op(&e).expect("peer restore from node-b first")
}

fn deleted_asking_wake() -> Pod {
    let mut p = asking(false);
    p.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    p
}

/// A clone from the staged copy that fails spends the copy too: a retry restores afresh.
#[test]
fn a_failed_clone_from_a_peer_copy_removes_the_copy() {
    let mut h = H::new(registry());
    let op = waiting_on_the_peer(&mut h);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(STAGED.into()),
    });
    let (cop, _) = one_cocoon(&e);
    let e = h.cocoon(cop, Answer::failed("Error: clone failed: disk full"));
    assert_eq!(staged_removals(&e), vec![STAGED]);
    let e = answer_leftover_lookup(&mut h, &e, Answer::failed("Error: vm not found"));
    assert!(events(&e).iter().any(|(r, _)| *r == "WakeCloneFailed"));
}

/// A pod deleted while its peer restore runs: the copy that arrives afterwards is removed at
/// once, and nothing clones from it.
#[test]
fn a_peer_copy_arriving_after_the_pods_delete_is_removed() {
    let mut h = H::new(registry());
    let op = waiting_on_the_peer(&mut h);
    h.feed(Input::PodUpserted(Box::new(deleted_asking_wake())));
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(STAGED.into()),
    });
    assert_eq!(staged_removals(&e), vec![STAGED]);
    assert!(!cocoon_ops(&e)
        .iter()
        .any(|(_, c)| argv(c).starts_with("vm clone")));
}

/// A pod deleted while the clone from the staged copy runs: the late clone answer still
/// removes the copy, though the wake is over.
#[test]
fn a_clone_answer_after_the_pods_delete_still_removes_the_copy() {
    let mut h = H::new(registry());
    let op = waiting_on_the_peer(&mut h);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(STAGED.into()),
    });
    let (cop, _) = one_cocoon(&e);
    let e = h.feed(Input::PodUpserted(Box::new(deleted_asking_wake())));
    assert!(staged_removals(&e).is_empty());
    let e = h.cocoon(
        cop,
        Answer::ok(vm_json("VM2", VM, "running", "02:00:00:00:00:02")),
    );
    assert_eq!(staged_removals(&e), vec![STAGED]);
}

/// A failed peer restore staged nothing (the client removed its partial copy): nothing to
/// remove, and the registry pull follows.
#[test]
fn a_failed_peer_restore_removes_nothing_and_pulls() {
    let mut h = H::new(registry());
    let op = waiting_on_the_peer(&mut h);
    let e = h.feed(Input::TransferDone {
        op,
        result: Err(TransferError::Transient("sha256 mismatch".into())),
    });
    assert!(staged_removals(&e).is_empty());
    assert!(e.iter().any(|x| matches!(x, Effect::PullSnapshot { .. })));
}

/// A tag this node pushed has no peer to ask: the registry pull is the source.
#[test]
fn a_tag_pushed_by_this_node_skips_the_peer() {
    let mut h = H::new(registry());
    let e = ask_wake(&mut h);
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {VM}"),
        Answer::failed("Error: snapshot not found"),
    );
    let op = evidence_op(&e);
    let own = HibernateTag {
        from_node: ProviderConfig::default().node_name,
        ..tag("S1")
    };
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(own)),
    });
    assert!(peer_op(&e).is_none());
    assert!(e.iter().any(|x| matches!(x, Effect::PullSnapshot { .. })));
}

#[test]
fn a_restore_whose_pod_was_edited_meanwhile_still_publishes_ready() {
    let mut h = H::new(registry());
    let with_generation = |g: &str| {
        let mut p = asking(false);
        let a = p.metadata.annotations.as_mut().unwrap();
        a.insert(ANN_GENERATION.into(), g.into());
        p
    };
    let e = h.feed(Input::PodUpserted(Box::new(with_generation("1"))));
    // The set's generation moves on while the evidence check is out: the `creating` the
    // restore writes observes generation 2, the tracked copy of the pod still says 1.
    h.feed(Input::PodUpserted(Box::new(with_generation("2"))));
    let op = evidence_op(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag("S9"))),
    });
    let e = no_local_copy_then(&mut h, &e, Ok(Some(tag("S9"))));
    let op = pull_op(&mut h, &e);
    let e = h.feed(Input::TransferDone {
        op,
        result: Ok(String::new()),
    });
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect {IMPORT}"),
        Answer::ok(format!(r#"{{"id":"S9","name":"{IMPORT}"}}"#)),
    );
    let mut e = clone_answers(&mut h, &e, IMPORT);
    e.extend(probe_ok(&mut h, "a", "u1"));
    assert!(
        statuses(&e).iter().any(|(_, s)| status::is_ready(s)),
        "Ready is published"
    );
    // Status first, then the lifecycle annotation.
    let acked: Vec<Effect> = statuses(&e)
        .into_iter()
        .flat_map(|(op, _)| h.kube_ok(op))
        .collect();
    assert!(annotation_patches(&acked)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("ready".into()))));
}
