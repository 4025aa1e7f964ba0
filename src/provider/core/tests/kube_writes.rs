//! Transition tests of the kube writes: drift re-publication, readiness updates, lifecycle
//! retries that must not overwrite a newer state.

use super::*;

#[test]
fn drift_republishes_a_clobbered_status_and_readiness_updates_flow() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = create_clone(&mut h, p.clone(), "VM1");
    let (sop, _) = statuses(&e)
        .into_iter()
        .rev()
        .find(|(_, s)| published(s))
        .unwrap();
    let e = h.kube_ok(sop);
    for (op, _) in annotation_patches(&e) {
        h.kube_ok(op);
    }
    probe_ok(&mut h, "a", "u1");
    // Someone marks the API pod NotReady: the 10 s reconciler republishes.
    let mut q = p.clone();
    q.status = Some(status::running(
        "10.0.0.9",
        false,
        None,
        None,
        &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
    ));
    q.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_VM_IP.into(), "10.0.0.9".into());
    q.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_VM_ID.into(), "VM1".into());
    h.feed(Input::PodUpserted(Box::new(q)));
    let e = h.advance(Duration::from_secs(10));
    assert!(
        statuses(&e).iter().any(|(_, s)| status::is_ready(s)),
        "{e:?}"
    );
    // Probe says not ready ⇒ status flips.
    let e = h.feed(Input::Readiness {
        key: PodKey::new("ns", "a"),
        uid: "u1".into(),
        ready: false,
        message: "ping failed: timeout".into(),
        ip: None,
    });
    let st = statuses(&e);
    assert_eq!(st.len(), 1);
    assert!(!status::is_ready(&st[0].1));
    // Stale uid is ignored.
    let e = h.feed(Input::Readiness {
        key: PodKey::new("ns", "a"),
        uid: "old".into(),
        ready: true,
        message: "ping ok".into(),
        ip: None,
    });
    assert!(e.is_empty());
}

#[test]
fn a_lifecycle_retry_never_overwrites_a_newer_state() {
    let mut h = H::new(ProviderConfig::default());
    // An earlier attempt's `failed` is on the pod: this attempt writes its `creating` (a
    // fresh pod's is held in memory only, see `begin_creating`).
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_LIFECYCLE_STATE, "failed".into()));
    let (op, first) = drive_to_clone(&mut h, mk("a", "u1", &ann));
    let (creating, a) = annotation_patches(&first)[0].clone();
    assert_eq!(a[ANN_LIFECYCLE_STATE].as_deref(), Some("creating"));
    // The `creating` flush fails at once: its retry was due in 500 ms.
    h.feed(Input::KubeDone {
        op: creating,
        result: Err(KubeError::Other("500".into())),
    });
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let lop = lookup(&e).expect("lease lookup");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    });
    let (sop, _) = statuses(&e)
        .into_iter()
        .rev()
        .find(|(_, s)| published(s))
        .expect("ready status");
    let e = h.kube_ok(sop);
    let (rop, _) = annotation_patches(&e)[0].clone();
    h.kube_ok(rop);
    // Ready is published before the retry is due: the retry must not go out.
    let e = h.advance(Duration::from_secs(2));
    assert!(
        annotation_patches(&e)
            .iter()
            .all(|(_, a)| a.get(ANN_LIFECYCLE_STATE) != Some(&Some("creating".into()))),
        "{e:?}"
    );
}

#[test]
fn a_status_retry_never_overwrites_a_newer_status() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let lop = lookup(&e).expect("lease lookup");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    });
    for (op, _) in statuses(&e) {
        h.kube_ok(op);
    }
    let e = probe_ok(&mut h, "a", "u1");
    let (ready_op, _) = statuses(&e)
        .into_iter()
        .find(|(_, s)| status::is_ready(s))
        .expect("ready status");
    // The Ready write fails (a retry is due in 500 ms); before it is due the probe reports
    // the pod not ready, and that newer status is written.
    h.feed(Input::KubeDone {
        op: ready_op,
        result: Err(KubeError::Other("429".into())),
    });
    let e = h.feed(Input::Readiness {
        key: PodKey::new("ns", "a"),
        uid: "u1".into(),
        ready: false,
        message: "probe failed".into(),
        ip: None,
    });
    let (newer, st) = statuses(&e).into_iter().next().expect("the newer status");
    assert!(!status::is_ready(&st));
    h.kube_ok(newer);
    let e = h.advance(Duration::from_secs(2));
    assert!(
        statuses(&e).iter().all(|(_, s)| !status::is_ready(s)),
        "the stale Ready status was retried over the newer one: {e:?}"
    );
}

/// The lifecycle re-flush (every 15 s) leaves a `ready` whose patch is still queued or in
/// flight to that write: re-flushing it would write the pod's status a second time (a backlog
/// at the client's rate easily holds a write that long). A `ready` whose write failed for good
/// is re-flushed, status first.
#[test]
fn the_lifecycle_reflush_leaves_a_ready_whose_patch_is_still_being_written() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = create_clone(&mut h, p.clone(), "VM1");
    let (sop, st) = statuses(&e)
        .into_iter()
        .rev()
        .find(|(_, s)| published(s))
        .expect("ready status");
    let e = h.kube_ok(sop);
    let (rop, a) = annotation_patches(&e)[0].clone();
    assert_eq!(a[ANN_LIFECYCLE_STATE].as_deref(), Some("ready"));
    // The API copy shows the status and the id / ip, not yet the lifecycle state.
    let mut q = p;
    q.status = Some(st);
    let ann = q.metadata.annotations.get_or_insert_with(Default::default);
    for (k, v) in [(ANN_VM_ID, "VM1"), (ANN_VM_IP, "10.0.0.9")] {
        ann.insert(k.into(), v.into());
    }
    h.feed(Input::PodUpserted(Box::new(q)));
    // The `ready` patch waits in the lane past a re-flush tick: nothing is written again.
    let e = h.advance(Duration::from_secs(16));
    assert!(statuses(&e).is_empty(), "{e:?}");
    assert!(annotation_patches(&e).is_empty(), "{e:?}");
    // Its write fails on every attempt: the next tick re-flushes, status first.
    let mut op = rop;
    let mut e = Vec::new();
    for _ in 0..10 {
        h.feed(Input::KubeDone {
            op,
            result: Err(KubeError::Other("500".into())),
        });
        e = h.advance(Duration::from_secs(1));
        match annotation_patches(&e).first() {
            Some((retry, _)) => op = *retry,
            None => break,
        }
    }
    assert!(
        annotation_patches(&e).is_empty(),
        "the retries ran out: {e:?}"
    );
    let e = h.advance(Duration::from_secs(15));
    assert_eq!(statuses(&e).len(), 1, "a failed ready is re-flushed: {e:?}");
}
