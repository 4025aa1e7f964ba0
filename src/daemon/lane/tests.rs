//! Tests of the kube lane's scheduler: per-pod order, urgency, merging, slots, pacing and the
//! dead-VM credit.

use super::*;
use k8s_openapi::api::core::v1::PodStatus;

fn key(n: &str) -> PodKey {
    PodKey::new("ns", n)
}

/// Pod `pod`'s write of `kind` for op `op`, queued at `t`.
fn write(pod: &str, op: OpId, kind: WriteKind, t: Instant) -> PodWrite {
    PodWrite {
        key: key(pod),
        ops: vec![op],
        kind,
        queued_at: t,
    }
}

fn status_of(phase: &str, reason: Option<&str>) -> WriteKind {
    WriteKind::Status {
        uid: "u".into(),
        status: Arc::new(PodStatus {
            phase: Some(phase.into()),
            reason: reason.map(str::to_string),
            ..PodStatus::default()
        }),
    }
}

fn status(pod: &str, op: OpId, phase: &str, t: Instant) -> PodWrite {
    write(pod, op, status_of(phase, None), t)
}

fn annotate(pod: &str, op: OpId, k: &str, v: Option<&str>, t: Instant) -> PodWrite {
    let mut annotations = BTreeMap::new();
    annotations.insert(k.to_string(), v.map(str::to_string));
    let kind = WriteKind::Annotations {
        uid: Some("u".into()),
        annotations,
    };
    write(pod, op, kind, t)
}

fn delete(pod: &str, op: OpId, t: Instant) -> PodWrite {
    let kind = WriteKind::Delete {
        uid: "u".into(),
        grace: Some(0),
    };
    write(pod, op, kind, t)
}

/// The Failed status an eviction writes (its reason says the VM is gone).
fn evicted(pod: &str, op: OpId, t: Instant) -> PodWrite {
    let reason = EvictReason::RestartFailed.as_str();
    write(pod, op, status_of("Failed", Some(reason)), t)
}

fn unlimited(t: Instant) -> TokenBucket {
    TokenBucket::new(0.0, 1, t)
}

fn take(lane: &mut KubeLane, t: Instant, b: &mut TokenBucket) -> Vec<PodWrite> {
    let mut out = Vec::new();
    while let Some(job) = lane.dispatch(t, b, false) {
        match job {
            Job::Write(w) => out.push(w),
            Job::Event => panic!("no events were waiting"),
        }
    }
    out
}

fn ops(ws: &[PodWrite]) -> Vec<OpId> {
    ws.iter().flat_map(|w| w.ops.clone()).collect()
}

#[test]
fn one_write_in_flight_per_pod_in_fifo_order_and_pods_in_parallel() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    lane.push(annotate("a", 1, "k1", Some("v"), t));
    lane.push(status("a", 2, "Running", t));
    lane.push(annotate("a", 3, "k2", Some("v"), t));
    lane.push(annotate("b", 4, "k1", Some("v"), t));
    let first = take(&mut lane, t, &mut b);
    assert_eq!(ops(&first), vec![1, 4], "one per pod, both pods at once");
    assert_eq!(lane.queued(), 2);
    assert!(
        take(&mut lane, t, &mut b).is_empty(),
        "a is still in flight"
    );
    lane.finished(&first[0]);
    let second = take(&mut lane, t, &mut b);
    assert_eq!(ops(&second), vec![2]);
    lane.finished(&second[0]);
    lane.finished(&first[1]);
    let third = take(&mut lane, t, &mut b);
    assert_eq!(ops(&third), vec![3]);
    lane.finished(&third[0]);
    assert!(lane.idle());
    assert!(lane.pods.is_empty(), "finished pods leave no state behind");
}

#[test]
fn deletes_and_failure_statuses_overtake_the_backlog() {
    let t = Instant::now();
    let mut b = TokenBucket::new(10.0, 1, t);
    let mut lane = KubeLane::new(LaneLimits::default());
    for i in 0..50 {
        lane.push(status(&format!("p{i}"), i, "Running", t));
    }
    lane.push(status("gone", 100, "Failed", t));
    lane.push(delete("deleted", 101, t));
    // One token now: it goes to the failure status, the next to the delete.
    let got = take(&mut lane, t, &mut b);
    assert_eq!(ops(&got), vec![100]);
    let next = lane
        .wake_at(t, &b, false)
        .expect("more work waits for a token");
    assert!(next > t);
    let got = take(&mut lane, next, &mut b);
    assert_eq!(ops(&got), vec![101]);
    let next = lane.wake_at(next, &b, false).expect("backlog");
    assert_eq!(ops(&take(&mut lane, next, &mut b)), vec![0]);
}

#[test]
fn a_pod_with_an_urgent_write_queued_behind_others_jumps_ahead_but_keeps_its_order() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits {
        slots: 2,
        urgent_reserve: 1,
        event_slots: 1,
    });
    lane.push(annotate("x", 1, "k", Some("v"), t));
    lane.push(annotate("y", 2, "k", Some("v"), t));
    lane.push(annotate("z", 3, "k", Some("v"), t));
    lane.push(status("z", 4, "Failed", t));
    // z now holds a failure status: its annotation (first in its FIFO) goes first, ahead
    // of x and y; the reserve slot is for urgent pods only, so x must then wait.
    let got = take(&mut lane, t, &mut b);
    assert_eq!(ops(&got), vec![3]);
    lane.finished(&got[0]);
    let got = take(&mut lane, t, &mut b);
    assert_eq!(ops(&got), vec![4], "the failure status, before x and y");
}

#[test]
fn urgent_slots_stay_free_while_the_backlog_fills_the_rest() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let limits = LaneLimits {
        slots: 4,
        urgent_reserve: 1,
        event_slots: 1,
    };
    let mut lane = KubeLane::new(limits);
    for i in 0..10 {
        lane.push(status(&format!("p{i}"), i, "Running", t));
    }
    assert_eq!(take(&mut lane, t, &mut b).len(), 3);
    assert!(lane.dispatch(t, &mut b, true).is_none(), "events wait too");
    lane.push(status("dead", 99, "Failed", t));
    assert_eq!(ops(&take(&mut lane, t, &mut b)), vec![99]);
    assert_eq!(lane.urgent_in_flight(), 1);
    assert_eq!(
        lane.wake_at(t, &b, true),
        None,
        "only a finished job frees a slot"
    );
}

#[test]
fn a_newer_status_replaces_the_queued_one_and_answers_both_ops() {
    let t = Instant::now();
    let later = t + Duration::from_secs(1);
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    lane.push(annotate("a", 1, "k", Some("v"), t));
    let first = take(&mut lane, t, &mut b);
    lane.push(status("a", 2, "Pending", t));
    lane.push(annotate("a", 3, "k2", Some("v"), t));
    lane.push(status("a", 4, "Running", later));
    assert_eq!(lane.queued(), 2);
    assert_eq!(lane.stats.statuses_replaced, 1);
    lane.finished(&first[0]);
    let w = take(&mut lane, later, &mut b);
    assert_eq!(
        ops(&w),
        vec![3],
        "the annotation issued before the newer status goes first"
    );
    lane.finished(&w[0]);
    let w = take(&mut lane, later, &mut b);
    assert_eq!(w[0].ops, vec![2, 4]);
    assert_eq!(w[0].queued_at, t, "age counts from the oldest op");
    match &w[0].kind {
        WriteKind::Status { status, .. } => {
            assert_eq!(status.phase.as_deref(), Some("Running"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_status_of_another_incarnation_is_not_replaced() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    lane.push(delete("a", 1, t));
    let first = take(&mut lane, t, &mut b);
    lane.push(status("a", 2, "Running", t));
    let mut other = status("a", 3, "Running", t);
    if let WriteKind::Status { uid, .. } = &mut other.kind {
        *uid = "u2".into();
    }
    lane.push(other);
    assert_eq!(lane.queued(), 2);
    lane.finished(&first[0]);
    assert_eq!(ops(&take(&mut lane, t, &mut b)), vec![2]);
}

#[test]
fn adjacent_annotation_patches_merge_later_values_winning() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    lane.push(delete("a", 1, t));
    let first = take(&mut lane, t, &mut b);
    lane.push(annotate("a", 2, "k1", Some("old"), t));
    lane.push(annotate("a", 3, "k1", Some("new"), t));
    lane.push(annotate("a", 4, "k2", None, t));
    lane.push(status("a", 5, "Running", t));
    lane.push(annotate("a", 6, "k3", Some("v"), t));
    assert_eq!(
        lane.queued(),
        3,
        "the patch after the status does not jump over it"
    );
    assert_eq!(lane.stats.annotations_merged, 2);
    lane.finished(&first[0]);
    let w = take(&mut lane, t, &mut b);
    assert_eq!(w[0].ops, vec![2, 3, 4]);
    match &w[0].kind {
        WriteKind::Annotations { annotations, .. } => {
            assert_eq!(annotations.get("k1"), Some(&Some("new".to_string())));
            assert_eq!(annotations.get("k2"), Some(&None));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn every_op_is_answered_exactly_once() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    let mut rng = 7u64;
    let mut issued = Vec::new();
    let mut answered = Vec::new();
    for op in 0..2000u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let pod = format!("p{}", rng % 20);
        let w = match rng % 5 {
            0 => status(&pod, op, "Running", t),
            1 => status(&pod, op, "Failed", t),
            2 => annotate(&pod, op, &format!("k{}", rng % 3), Some("v"), t),
            3 => evicted(&pod, op, t),
            _ => delete(&pod, op, t),
        };
        issued.push(op);
        lane.push(w);
        if rng.is_multiple_of(3) {
            for w in take(&mut lane, t, &mut b) {
                answered.extend(w.ops.iter().copied());
                lane.finished(&w);
            }
        }
    }
    while !lane.idle() {
        for w in take(&mut lane, t, &mut b) {
            answered.extend(w.ops.iter().copied());
            lane.finished(&w);
        }
    }
    answered.sort_unstable();
    assert_eq!(answered, issued);
}

#[test]
fn events_go_last_and_within_their_slots() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits {
        slots: 8,
        urgent_reserve: 2,
        event_slots: 2,
    });
    lane.push(status("a", 1, "Running", t));
    assert!(matches!(
        lane.dispatch(t, &mut b, true),
        Some(Job::Write(_))
    ));
    assert_eq!(lane.dispatch(t, &mut b, true), Some(Job::Event));
    assert_eq!(lane.dispatch(t, &mut b, true), Some(Job::Event));
    assert_eq!(lane.dispatch(t, &mut b, true), None, "two event slots");
    lane.event_finished();
    assert_eq!(lane.dispatch(t, &mut b, true), Some(Job::Event));
    assert_eq!(lane.dispatch(t, &mut b, false), None);
}

#[test]
fn paced_by_tokens_never_faster_than_the_bucket() {
    let t0 = Instant::now();
    let mut b = TokenBucket::new(50.0, 5, t0);
    let mut lane = KubeLane::new(LaneLimits::default());
    for i in 0..100 {
        lane.push(status(&format!("p{i}"), i, "Running", t0));
    }
    // Drive it like the loop: dispatch until refused, finish at once, sleep to wake_at.
    let mut now = t0;
    let mut sent = 0;
    while !lane.idle() {
        while let Some(Job::Write(w)) = lane.dispatch(now, &mut b, false) {
            sent += 1;
            lane.finished(&w);
        }
        match lane.wake_at(now, &b, false) {
            Some(at) => {
                assert!(at > now, "wake_at must move forward when no token is there");
                now = at;
            }
            None => break,
        }
    }
    assert_eq!(sent, 100);
    // 5 at once (burst), then 95 at 50/s.
    let took = now.duration_since(t0).as_secs_f64();
    assert!((1.85..=1.95).contains(&took), "{took}");
}

#[test]
fn only_an_evictions_failed_status_is_a_vm_death() {
    let t = Instant::now();
    assert_eq!(evicted("a", 1, t).urgency(), Urgency::VmDeath);
    assert_eq!(status("a", 1, "Failed", t).urgency(), Urgency::Urgent);
    assert_eq!(delete("a", 1, t).urgency(), Urgency::Urgent);
    assert_eq!(status("a", 1, "Running", t).urgency(), Urgency::Normal);
}

/// The bucket is empty and a thousand creates' writes wait (some urgent): a dead VM's
/// status is handed out at once, on credit, before any of them; the backlog pays the debt.
#[test]
fn a_dead_vms_status_is_taken_before_every_queued_write_without_waiting_for_a_token() {
    let t = Instant::now();
    let mut b = TokenBucket::new(50.0, 1, t);
    let mut lane = KubeLane::new(LaneLimits::default());
    for i in 0..1000 {
        lane.push(annotate(&format!("c{i}"), i, "k", Some("v"), t));
        lane.push(status(&format!("c{i}"), 10_000 + i, "Running", t));
    }
    lane.push(delete("deleted", 20_000, t));
    lane.push(status("create-failed", 20_001, "Failed", t));
    assert_eq!(
        ops(&take(&mut lane, t, &mut b)),
        vec![20_000],
        "the one token"
    );
    lane.push(evicted("dead", 30_000, t));
    let next_token = b.next_token_at(t);
    assert!(next_token > t);
    assert_eq!(
        lane.wake_at(t, &b, false),
        Some(t),
        "the dead VM's status need not wait"
    );
    let got = take(&mut lane, t, &mut b);
    assert_eq!(
        ops(&got),
        vec![30_000],
        "before the other failure and the creates"
    );
    assert!(
        b.next_token_at(t) > next_token,
        "the credit taken is paid by the writes behind it"
    );
    let at = lane.wake_at(t, &b, false).expect("backlog");
    assert_eq!(ops(&take(&mut lane, at, &mut b)), vec![20_001]);
}

/// A pod holding a dead VM's status is served first, its writes in their order; the status
/// folds the pod's queued older status in; the write in flight finishes first.
#[test]
fn a_pod_with_a_dead_vms_status_is_served_first_in_its_own_order() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    lane.push(annotate("d", 1, "k0", Some("v"), t));
    let in_flight = take(&mut lane, t, &mut b);
    lane.push(status("other", 10, "Running", t));
    lane.push(annotate("d", 2, "k1", Some("v"), t));
    lane.push(status("d", 3, "Running", t));
    lane.push(evicted("d", 5, t));
    let got = take(&mut lane, t, &mut b);
    assert_eq!(ops(&got), vec![10], "d has a write in flight");
    lane.finished(&got[0]);
    lane.push(status("other", 11, "Running", t));
    lane.finished(&in_flight[0]);
    let got = take(&mut lane, t, &mut b);
    assert_eq!(got[0].ops, vec![2], "d first, its patch before its status");
    lane.finished(&got[0]);
    let got = take(&mut lane, t, &mut b);
    assert_eq!(
        got[0].ops,
        vec![3, 5],
        "the Running status rides on the Failed one"
    );
    assert_eq!(got[0].urgency(), Urgency::VmDeath);
}

#[test]
fn the_credit_of_dead_vms_is_bounded() {
    let t = Instant::now();
    let mut b = TokenBucket::new(10.0, 1, t);
    assert!(b.try_take(t));
    let mut lane = KubeLane::new(LaneLimits::default());
    for i in 0..10 {
        lane.push(evicted(&format!("d{i}"), i, t));
    }
    let got = take(&mut lane, t, &mut b);
    assert_eq!(got.len(), VM_DEATH_CREDIT as usize);
    let at = lane.wake_at(t, &b, false).expect("more deaths wait");
    assert!(at > t);
    assert_eq!(
        take(&mut lane, at, &mut b).len(),
        1,
        "one per token after that"
    );
}

/// A newer status of the same incarnation replaces a queued dead VM's status: the pod is
/// still served (its entry among the dead VMs no longer is valid).
#[test]
fn a_replaced_dead_vm_status_leaves_its_pod_served() {
    let t = Instant::now();
    let mut b = unlimited(t);
    let mut lane = KubeLane::new(LaneLimits::default());
    lane.push(evicted("d", 1, t));
    lane.push(status("d", 2, "Running", t));
    let got = take(&mut lane, t, &mut b);
    assert_eq!(ops(&got), vec![1, 2]);
    lane.finished(&got[0]);
    assert!(lane.idle());
}
