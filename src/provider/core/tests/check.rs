//! Transition tests of check and evict: VM gone, restart and cooldown, deferred rechecks,
//! VM events that arrive during a create.

use super::*;

#[test]
fn vm_gone_evicts_with_failed_status_then_deletes() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.cocoon(op, Answer::failed("vm not found"));
    assert!(e.iter().any(|x| matches!(x, Effect::ReleaseLeases { .. })));
    let st = statuses(&e);
    assert_eq!(st.len(), 1);
    let s = &st[0].1;
    assert_eq!(s.phase.as_deref(), Some("Failed"));
    let term = s.container_statuses.as_ref().unwrap()[0]
        .state
        .as_ref()
        .unwrap()
        .terminated
        .clone()
        .unwrap();
    assert_eq!(
        (term.exit_code, term.reason.as_deref()),
        (1, Some("VMGone"))
    );
    assert!(
        deletes(&e).is_empty(),
        "status is written before the delete"
    );
    let e = h.kube_ok(st[0].0);
    let d = deletes(&e);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].1, None);
    let e = h.feed(Input::KubeDone {
        op: d[0].0,
        result: Err(KubeError::Other("500".into())),
    });
    assert!(has_metric(&e, &MetricUpdate::PodEvictFailure));
    let e = h.advance(Duration::from_millis(200));
    let d = deletes(&e);
    assert_eq!(d.len(), 1, "eviction delete retried");
    h.kube_ok(d[0].0);
    assert!(h.p.get_pod(&PodKey::new("ns", "a")).is_none());
}

/// A pod whose deletion began while its eviction ran (or whose delete was held up when its
/// VM went) is ended by the eviction with grace 0: a DELETE with no grace would only restate
/// the deletion, and the object would stay terminating. Nothing deletes it a second time.
#[test]
fn an_eviction_of_a_pod_being_deleted_ends_it_with_grace_zero() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p.clone(), "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::failed("vm not found"));
    let st = statuses(&e);
    assert_eq!(st.len(), 1);
    let mut q = p.clone();
    q.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let e = h.feed(Input::PodUpserted(Box::new(q)));
    assert!(deletes(&e).is_empty(), "{e:?}");
    let e = h.kube_ok(st[0].0);
    let d = deletes(&e);
    assert_eq!(d.len(), 1, "{e:?}");
    assert_eq!(d[0].1, Some(0));
    let e = h.kube_ok(d[0].0);
    assert!(deletes(&e).is_empty(), "{e:?}");
    assert!(deletes(&h.advance(Duration::from_secs(5))).is_empty());
}

#[test]
fn stopped_vm_is_restarted_then_cooldown_evicts() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    let stopped = vm_info("VM1", "vk-ns-demo-0", "stopped");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: stopped.clone(),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "stopped",
            "02:00:00:00:00:01",
        )),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm start VM1");
    // The restart is counted for the pod (vm_restarts_total).
    let restart = MetricUpdate::VmRestart {
        namespace: "ns".into(),
        pod: "a".into(),
    };
    assert!(has_metric(&e, &restart), "{e:?}");
    let e = h.cocoon(op, Answer::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    h.advance(Duration::from_secs(10));
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: stopped,
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json("VM1", "vk-ns-demo-0", "error", "02:00:00:00:00:01")),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
    assert!(!has_metric(&e, &restart), "no restart within the cooldown");
    let e = h.cocoon(op, Answer::ok(""));
    let st = statuses(&e);
    assert_eq!(st[0].1.reason.as_deref(), Some("RestartCooldown"));
}

#[test]
fn an_event_stream_restart_forgets_restarts_older_than_a_minute() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "stopped",
            "02:00:00:00:00:01",
        )),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm start VM1");
    h.cocoon(op, Answer::ok(""));
    assert_eq!(h.p.restart_records(), 1);
    // Within the minute the record stays (it may still hold a cooldown).
    h.advance(Duration::from_secs(59));
    h.feed(Input::EventStreamRestarted);
    assert_eq!(h.p.restart_records(), 1);
    h.advance(Duration::from_secs(2));
    h.feed(Input::EventStreamRestarted);
    assert_eq!(h.p.restart_records(), 0);
}

/// Restarts `vm` of a running pod through a stopped event: inspect, then `vm start`.
fn restart_once(h: &mut H, id: &str, name: &str) {
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info(id, name, "stopped"),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(id, name, "stopped", "02:00:00:00:00:01")),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("vm start {id}"));
    h.cocoon(op, Answer::ok(""));
}

/// A restart record outlives its cooldown only until the next restart anywhere: records of
/// VMs restarted once and gone since do not pile up while the event stream stays up.
#[test]
fn a_restart_drops_the_records_older_than_a_minute() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    create_clone(&mut h, mk("b", "u2", &managed("b", "vk-ns-demo-1")), "VM2");
    restart_once(&mut h, "VM1", "vk-ns-demo-0");
    assert_eq!(h.p.restart_records(), 1);
    h.advance(Duration::from_secs(61));
    restart_once(&mut h, "VM2", "vk-ns-demo-1");
    assert_eq!(h.p.restart_records(), 1, "VM1's record went with its age");
}

#[test]
fn transient_inspect_errors_defer_a_recheck() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "", ""),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::failed("connection refused"));
    assert!(cocoon_ops(&e).is_empty());
    let e = h.advance(Duration::from_millis(200));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::failed("connection refused"));
    assert!(has_metric(&e, &MetricUpdate::VmInspectTransientFail));
    let e = h.advance(Duration::from_secs(1));
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
    assert!(statuses(&e).is_empty());
    assert!(h
        .advance(Duration::from_secs(5))
        .iter()
        .all(|x| !matches!(x, Effect::Cocoon { .. })));
}

#[test]
fn failed_rm_before_eviction_rechecks_instead_of_giving_up() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let stopped = || vm_json("VM1", "vk-ns-demo-0", "stopped", "02:00:00:00:00:01");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(stopped()));
    let e = answer(&mut h, &e, "vm start VM1", Answer::failed("backend busy"));
    let e = answer(
        &mut h,
        &e,
        "vm rm --force VM1",
        Answer::failed("backend busy"),
    );
    assert!(statuses(&e).is_empty(), "no eviction while the VM is kept");
    // One second later the deferred recheck looks again; the cooldown now removes and evicts.
    let e = h.advance(Duration::from_secs(1));
    let e = answer(&mut h, &e, "vm inspect VM1", Answer::ok(stopped()));
    let e = answer(&mut h, &e, "vm rm --force VM1", Answer::ok(""));
    assert_eq!(statuses(&e)[0].1.reason.as_deref(), Some("RestartCooldown"));
}

#[test]
fn vm_event_during_a_create_is_looked_at_once_the_create_is_done() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let running = || vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = h.cocoon(op, Answer::ok(running()));
    let lop = lookup(&e).expect("lease lookup");
    // The fresh VM crashes while the lease lookup is in flight: nothing to look at yet.
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    assert!(cocoon_ops(&e).is_empty());
    // No lease yet: the create settles into its wait for Ready, then the event is looked at.
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(None),
    });
    assert!(statuses(&e).iter().all(|(_, s)| !status::is_ready(s)));
    let e = answer(
        &mut h,
        &e,
        "vm inspect VM1",
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "stopped",
            "02:00:00:00:00:01",
        )),
    );
    let e = answer(&mut h, &e, "vm start VM1", Answer::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(running()));
    // The check preempted the wait for Ready; it resumes, and the lease brings Ready.
    let lop = lookup(&e).expect("the wait for Ready resumed");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    });
    let (_, st) = statuses(&e)
        .into_iter()
        .rev()
        .find(|(_, s)| published(s))
        .expect("ready published after the restart");
    assert_eq!(st.pod_ip.as_deref(), Some("10.0.0.9"));
}

#[test]
fn an_answer_the_check_does_not_expect_defers_a_recheck_instead_of_stalling() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.feed(Input::KubeDone { op, result: Ok(()) });
    assert!(events(&e).iter().any(|(r, _)| *r == "UnexpectedAnswer"));
    assert!(statuses(&e).is_empty(), "no eviction on a wrong answer");
    // The deferred recheck inspects again after its first delay.
    let e = h.advance(Duration::from_secs(1));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
}

/// A VM removed right after its restart: the event comes while the check still runs (its
/// re-inspect may have looked before the removal). The check looks again instead of dropping
/// the event, and the pod is evicted rather than left Running on a VM that is gone.
#[test]
fn a_vm_gone_event_during_a_restart_is_looked_at_before_the_check_ends() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let stopped = Answer::ok(vm_json(
        "VM1",
        "vk-ns-demo-0",
        "stopped",
        "02:00:00:00:00:01",
    ));
    let e = answer(&mut h, &e, "vm inspect VM1", stopped);
    let e = answer(&mut h, &e, "vm start VM1", Answer::ok(""));
    let (refresh, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "vk-ns-demo-0", "running"),
    });
    assert!(e.is_empty(), "the check in flight holds the pod: {e:?}");
    let running = Answer::ok(vm_json(
        "VM1",
        "vk-ns-demo-0",
        "running",
        "02:00:00:00:00:01",
    ));
    let e = h.cocoon(refresh, running);
    let e = answer(&mut h, &e, "vm inspect VM1", Answer::failed("VM not found"));
    let st = statuses(&e);
    assert_eq!(st.len(), 1, "{e:?}");
    assert_eq!(st[0].1.phase.as_deref(), Some("Failed"));
}

/// The re-inspect after a restart finds no VM: evicted `VMGone` at once.
#[test]
fn a_vm_missing_at_the_re_inspect_after_its_restart_is_evicted() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let stopped = Answer::ok(vm_json(
        "VM1",
        "vk-ns-demo-0",
        "stopped",
        "02:00:00:00:00:01",
    ));
    let e = answer(&mut h, &e, "vm inspect VM1", stopped);
    let e = answer(&mut h, &e, "vm start VM1", Answer::ok(""));
    let e = answer(&mut h, &e, "vm inspect VM1", Answer::failed("VM not found"));
    let st = statuses(&e);
    assert_eq!(st.len(), 1, "{e:?}");
    assert_eq!(st[0].1.phase.as_deref(), Some("Failed"));
}

/// A `vm start` that gives no answer in time may still have started the VM: it is inspected,
/// kept when it runs, and removed (RestartFailed) only when it does not.
#[test]
fn an_unanswered_restart_is_looked_at_before_the_vm_is_removed() {
    for (after, removed) in [("running", false), ("stopped", true)] {
        let mut h = H::new(ProviderConfig::default());
        create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
        let e = h.feed(Input::VmEvent {
            kind: VmEventKind::Modified,
            vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
        });
        let stopped = vm_json("VM1", "vk-ns-demo-0", "stopped", "02:00:00:00:00:01");
        let e = answer(&mut h, &e, "vm inspect VM1", Answer::ok(stopped));
        let unanswered = Answer::timed_out_call();
        let e = answer(&mut h, &e, "vm start VM1", unanswered);
        let now = vm_json("VM1", "vk-ns-demo-0", after, "02:00:00:00:00:01");
        let e = answer(&mut h, &e, "vm inspect VM1", Answer::ok(now));
        let cmds: Vec<String> = cocoon_ops(&e).iter().map(|(_, c)| argv(c)).collect();
        if removed {
            assert_eq!(cmds, vec!["vm rm --force VM1".to_string()]);
            let (op, _) = one_cocoon(&e);
            let e = h.cocoon(op, Answer::ok(""));
            let st = statuses(&e);
            let term = st[0].1.container_statuses.as_ref().unwrap()[0]
                .state
                .as_ref()
                .unwrap()
                .terminated
                .clone()
                .unwrap();
            assert_eq!(term.reason.as_deref(), Some("RestartFailed"));
        } else {
            assert!(cmds.is_empty(), "{cmds:?}");
            assert!(statuses(&e)
                .iter()
                .all(|(_, s)| s.phase.as_deref() != Some("Failed")));
            assert_eq!(
                h.p.pod_vm(&PodKey::new("ns", "a")).map(|v| v.id.clone()),
                Some("VM1".into())
            );
        }
    }
}
