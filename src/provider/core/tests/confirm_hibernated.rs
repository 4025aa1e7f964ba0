//! Transition tests of startup's hibernate confirmation: a pod asking for hibernate whose VM is
//! gone is hibernated only with its snapshot as evidence, else evicted as a lost VM; a lookup
//! that fails decides nothing and is retried.

use super::hibernate::{key, lifecycle_written, registry};
use super::wake::{evidence_op, tag};
use super::*;

const VM: &str = "vk-ns-demo-0";

/// The pod `a` asking for hibernate with these extra annotations (Running: it had a VM).
fn hibernate_pod(extra: &[(&'static str, &str)]) -> Pod {
    let mut ann = managed("a", VM);
    ann.push((ANN_HIBERNATE, "true".into()));
    ann.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    let mut p = mk("a", "u1", &ann);
    if let Some(st) = p.status.as_mut() {
        st.phase = Some("Running".into());
    }
    p
}

/// A daemon starting with `p` listed and no VM at all.
fn restart(cfg: ProviderConfig, p: Pod) -> (H, Vec<Effect>) {
    H::starting(cfg, vec![p], vec![])
}

/// A pod whose hibernate was under way (push failed, rolled back, VM id written back) when its
/// VM went: the record a VM removed from outside mid-hibernate leaves.
fn failed_push_pod() -> Pod {
    hibernate_pod(&[
        (ANN_VM_ID, "VM1"),
        (ANN_VM_IP, "10.0.0.9"),
        (ANN_LIFECYCLE_STATE, "failed"),
        (
            ANN_LIFECYCLE_MSG,
            "hibernate: push vk-ns-demo-0:hibernate: broken pipe",
        ),
    ])
}

fn snapshot(id: &str) -> Answer {
    Answer::ok(format!(r#"{{"id":"{id}","name":"{VM}"}}"#))
}

fn no_snapshot() -> Answer {
    Answer::failed("Error: snapshot not found")
}

fn registry_down() -> Result<Option<HibernateTag>, TransferError> {
    Err(TransferError::Transient(
        "registry: connection refused".into(),
    ))
}

/// Answers the confirmation's `snapshot inspect <vm>` with `local`; returns the effects.
fn local(h: &mut H, e: &[Effect], local: Answer) -> Vec<Effect> {
    answer(h, e, &format!("snapshot inspect {VM}"), local)
}

/// `local`, then the tag lookup answered with `found`; returns the effects after the lookup.
fn local_then(
    h: &mut H,
    e: &[Effect],
    snap: Answer,
    found: Result<Option<HibernateTag>, TransferError>,
) -> Vec<Effect> {
    let e = local(h, e, snap);
    let op = evidence_op(&e);
    h.feed(Input::HibernateEvidence { op, result: found })
}

/// The lost-VM verdict: Warning, metric, status Failed `VMGone`, then the pod's delete.
fn assert_evicted_as_lost(h: &mut H, e: &[Effect], why: &str) {
    let warnings: Vec<_> = events(e)
        .into_iter()
        .filter(|(r, _)| *r == "HibernateVMLost")
        .collect();
    assert_eq!(warnings.len(), 1, "{e:?}");
    assert!(warnings[0].1.contains(why), "{warnings:?}");
    assert!(has_metric(
        e,
        &MetricUpdate::PodLifecycle {
            op: "startup",
            result: "failed",
            reason: "hibernate_vm_lost",
        }
    ));
    assert!(!lifecycle_written(e, "hibernated"), "{e:?}");
    let (op, st) = statuses(e).pop().expect("eviction status");
    assert_eq!(st.phase.as_deref(), Some("Failed"));
    assert_eq!(st.reason.as_deref(), Some("VMGone"));
    let e = h.kube_ok(op);
    assert_eq!(deletes(&e).len(), 1, "the lost pod is deleted: {e:?}");
}

/// Hibernated: the record says so and nothing is evicted.
fn assert_hibernated(e: &[Effect]) {
    assert!(lifecycle_written(e, "hibernated"), "{e:?}");
    assert!(deletes(e).is_empty());
    assert!(statuses(e)
        .iter()
        .all(|(_, s)| s.phase.as_deref() == Some("Pending")));
}

/// Nothing was decided: no write of any kind.
fn assert_undecided(e: &[Effect]) {
    assert!(annotation_patches(e).is_empty(), "{e:?}");
    assert!(statuses(e).is_empty() && deletes(e).is_empty(), "{e:?}");
}

#[test]
fn a_restart_after_the_removal_finishes_as_hibernated() {
    // The hibernate removed the VM; the restart came before the id-clearing write landed.
    let (mut h, e) = restart(
        registry(),
        hibernate_pod(&[(ANN_VM_ID, "VM1"), (ANN_LIFECYCLE_STATE, "hibernating")]),
    );
    assert_undecided(&e);
    assert!(has_metric(
        &e,
        &MetricUpdate::StartupResume {
            op: "confirm_hibernated"
        }
    ));
    let e = local_then(&mut h, &e, snapshot("S1"), Ok(Some(tag("S1"))));
    assert_hibernated(&e);
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&None)));
    assert!(h.p.get_pod(&key()).is_some(), "tracked without a VM");
    assert!(h.p.pod_vm(&key()).is_none());
}

#[test]
fn a_tag_without_a_local_copy_is_evidence_too() {
    // The local copy may be gone (a stale-copy removal of an earlier wake): the tag stands.
    let (mut h, e) = restart(registry(), failed_push_pod());
    let e = local_then(&mut h, &e, no_snapshot(), Ok(Some(tag("S1"))));
    assert_hibernated(&e);
}

#[test]
fn a_vm_removed_mid_hibernate_is_evicted_not_taken_for_hibernated() {
    // The push failed, the VM was removed from outside, then the restart: no tag exists.
    let (mut h, e) = restart(registry(), failed_push_pod());
    let e = local_then(&mut h, &e, snapshot("S2"), Ok(None));
    assert_evicted_as_lost(&mut h, &e, "no vk-ns-demo-0:hibernate in the registry");
}

#[test]
fn an_earlier_hibernations_tag_is_not_evidence_for_a_newer_save() {
    // The tag is from the hibernation before (it stays after a wake); this hibernate's save
    // (S2) never got pushed. Waking from S1 would bring an older VM back as this one.
    let (mut h, e) = restart(registry(), failed_push_pod());
    let e = local_then(&mut h, &e, snapshot("S2"), Ok(Some(tag("S1"))));
    assert_evicted_as_lost(&mut h, &e, "that save was never pushed");
}

#[test]
fn an_unreadable_registry_keeps_the_pod_as_it_is_and_looks_again() {
    let (mut h, e) = restart(registry(), failed_push_pod());
    let e = local_then(&mut h, &e, snapshot("S1"), registry_down());
    assert_undecided(&e);
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "HibernateEvidenceUnavailable" && m.contains("connection refused")));
    assert!(has_metric(
        &e,
        &MetricUpdate::HibernateEvidence {
            verdict: "unavailable"
        }
    ));
    // Nothing before the backoff; the lookup starts over after it (1 s, then 2 s).
    assert!(cocoon_ops(&h.advance(Duration::from_millis(900))).is_empty());
    let e = h.advance(Duration::from_millis(100));
    let e = local_then(&mut h, &e, snapshot("S1"), registry_down());
    assert!(events(&e).is_empty(), "the Warning is said once: {e:?}");
    assert!(cocoon_ops(&h.advance(Duration::from_millis(1900))).is_empty());
    let e = h.advance(Duration::from_millis(100));
    // A cocoon that cannot answer decides nothing either.
    let e = local(&mut h, &e, Answer::failed("Error: database is locked"));
    assert_undecided(&e);
    let e = h.advance(Duration::from_secs(4));
    let e = local_then(&mut h, &e, snapshot("S1"), Ok(Some(tag("S1"))));
    assert_hibernated(&e);
}

#[test]
fn without_a_registry_the_local_snapshot_decides() {
    let cfg = ProviderConfig::default();
    let (mut h, e) = restart(cfg.clone(), failed_push_pod());
    let e = local(&mut h, &e, snapshot("S1"));
    assert_hibernated(&e);
    assert!(!e
        .iter()
        .any(|x| matches!(x, Effect::CheckHibernateEvidence { .. })));

    let (mut h, e) = restart(cfg, failed_push_pod());
    let e = local(&mut h, &e, no_snapshot());
    assert_evicted_as_lost(&mut h, &e, "no local snapshot");
}

#[test]
fn a_pod_recording_no_vm_is_hibernated_without_a_lookup() {
    // Settled `hibernated` with its ids cleared: nothing ran that could have been lost.
    let (_, e) = restart(
        registry(),
        hibernate_pod(&[(ANN_LIFECYCLE_STATE, "hibernated")]),
    );
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert!(!e
        .iter()
        .any(|x| matches!(x, Effect::CheckHibernateEvidence { .. })));
    // Already recorded `hibernated`: only its Pending status is shown.
    assert!(deletes(&e).is_empty() && annotation_patches(&e).is_empty());
    let shown = statuses(&e);
    assert!(
        !shown.is_empty()
            && shown
                .iter()
                .all(|(_, s)| s.phase.as_deref() == Some("Pending"))
    );
}

#[test]
fn a_wake_asked_during_the_lookup_resolves_its_own_source() {
    let (mut h, e) = restart(registry(), failed_push_pod());
    let e = local(&mut h, &e, snapshot("S1"));
    let lookup = evidence_op(&e);
    // The operator un-hibernates while the registry is being asked: the wake takes over.
    let mut p = failed_push_pod();
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.insert(ANN_HIBERNATE.into(), "false".into());
    }
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(
        argv(&cmd),
        format!("snapshot inspect {VM}"),
        "the wake's own lookup"
    );
    // The confirmation's late answer is dropped.
    let e = h.feed(Input::HibernateEvidence {
        op: lookup,
        result: Ok(None),
    });
    assert!(events(&e).is_empty() && statuses(&e).is_empty(), "{e:?}");
}

#[test]
fn a_delete_during_a_retried_lookup_does_not_wait_for_the_registry() {
    let (mut h, e) = restart(registry(), failed_push_pod());
    local_then(&mut h, &e, snapshot("S1"), registry_down());
    let mut p = failed_push_pod();
    p.metadata.deletion_timestamp = Some(Time(
        k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap(),
    ));
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    // The delete looks the VM up (by name) right away.
    let (_, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm inspect"), "{}", argv(&cmd));
}

#[test]
fn a_macos_guest_is_never_looked_up() {
    // macOS guests cannot hibernate (nor are their VMs cocoon's): their record is not a lost VM.
    let mut p = failed_push_pod();
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.insert(ANN_OS.into(), "macos".into());
    }
    let (_, e) = restart(registry(), p);
    // Its create looks it up through cocoon-macos, never through cocoon.
    assert!(
        cocoon_ops(&e)
            .iter()
            .all(|(_, cmd)| matches!(cmd, CocoonCmd::Macos(_))),
        "{e:?}"
    );
    assert!(!e
        .iter()
        .any(|x| matches!(x, Effect::CheckHibernateEvidence { .. })));
    assert!(deletes(&e).is_empty() && events(&e).is_empty(), "{e:?}");
}
