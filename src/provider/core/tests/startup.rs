//! Transition tests of the startup reconcile: adoption by ID and name, the orphan policy,
//! pods an interrupted eviction left behind.

use super::*;

#[test]
fn startup_adopts_by_id_and_name_and_destroys_orphans() {
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let mut by_id = managed("a", "vk-ns-demo-0");
    by_id.push((ANN_VM_ID, "V1".into()));
    by_id.push((ANN_LIFECYCLE_STATE, "ready".into()));
    let by_name = managed("b", "vk-ns-demo-1");
    let pods = vec![mk("a", "u1", &by_id), mk("b", "u2", &by_name)];
    let vms = vec![
        vm_info("V1", "vk-ns-demo-0", "running"),
        vm_info("V2", "vk-ns-demo-1", "running"),
        vm_info("V3", "vk-ns-gone-0", "running"),
        vm_info("V4", "vk-ns-half-0", "creating"),
    ];
    // A pod event before startup is buffered.
    assert!(h
        .feed(Input::PodUpserted(Box::new(mk(
            "c",
            "u3",
            &managed("c", "vk-ns-demo-2")
        ))))
        .is_empty());
    // The VM adopted by name was created by this daemon: its owner is on record.
    let e = h.feed(Input::StartupListed {
        pods,
        vms,
        owners: owned_vms(&[("vk-ns-demo-1", "ns")]),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm reconcile-stale-create -o json V4");
    let e = h.cocoon(op, Answer::ok(r#"{"id":"V4","outcome":"collected"}"#));
    assert!(has_metric(
        &e,
        &MetricUpdate::StaleCreateReconcile {
            outcome: "collected".into()
        }
    ));
    assert!(has_metric(&e, &MetricUpdate::ReconcileAdoptByName));
    let cmds: Vec<String> = cocoon_ops(&e).iter().map(|(_, c)| argv(c)).collect();
    assert!(cmds.contains(&"vm rm --force V3".to_string()), "{cmds:?}");
    assert!(!cmds
        .iter()
        .any(|c| c.contains("V1") || c.contains("V2") || c.contains("V4")));
    // The buffered pod is created after the reconcile.
    assert!(
        cmds.contains(&"snapshot inspect vk-ns-demo-2".to_string()),
        "{cmds:?}"
    );
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some("V2".into()))));
    assert_eq!(
        e.iter()
            .filter(|x| matches!(x, Effect::StartProbe { .. }))
            .count(),
        2
    );
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_some());
    assert_eq!(h.p.vm_table_sizes().get("ns"), Some(&2));
}

#[test]
fn orphan_alert_counts_and_keeps_for_adoption() {
    let mut h = H {
        p: Provider::new(ProviderConfig {
            orphan_policy: OrphanPolicy::Alert,
            ..Default::default()
        }),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let e = h.feed(Input::StartupListed {
        pods: vec![],
        vms: vec![vm_info("V9", "vk-ns-demo-0", "running")],
        owners: owned_vms(&[("vk-ns-demo-0", "ns")]),
    });
    assert!(has_metric(&e, &MetricUpdate::OrphanVm));
    assert!(cocoon_ops(&e).is_empty());
    // A later create for that name adopts it, no clone.
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    assert!(cocoon_ops(&e).is_empty());
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
    let lop = lookup(&e).unwrap();
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.1".into())),
    });
    assert!(statuses(&e).iter().any(|(_, s)| published(s)));
}

#[test]
fn failed_pod_left_by_an_interrupted_eviction_is_deleted_after_restart() {
    let mut h = H::new(ProviderConfig::default());
    let mut p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    p.status = Some(status::evicted(
        "VMGone",
        "vm no longer exists",
        None,
        &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
    ));
    let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
    assert_eq!(deletes(&e), vec![(deletes(&e)[0].0, Some(0))]);
    assert!(cocoon_ops(&e).is_empty());

    // A Failed pod that is not ours to finish (a create rejected under restartPolicy Never)
    // stays as it is.
    let mut other = mk("b", "u2", &managed("b", "vk-ns-demo-1"));
    other.status = Some(PodStatus {
        phase: Some("Failed".into()),
        reason: Some("ProviderFailed".into()),
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(other)));
    assert!(e.is_empty(), "{e:?}");
}

/// A Running pod whose annotations stopped parsing (its name removed, a relative clone dir)
/// keeps its VM across a restart: claimed by its ID annotation, tracked, warned about; never
/// destroyed as an orphan nor failed. With its name gone, the ID finds the VM because the
/// ownership ledger records that VM for this very pod.
#[test]
fn a_restart_keeps_the_vm_of_a_pod_whose_annotations_no_longer_parse() {
    for (broken, owners) in [
        (
            vec![
                (ANN_MANAGED, "true".to_string()),
                (ANN_IMAGE, "team/agent:v3".into()),
            ],
            owned_vms(&[("vk-ns-demo-0", "ns")]),
        ),
        (
            vec![
                (ANN_VM_NAME, "vk-ns-demo-0".to_string()),
                (ANN_MANAGED, "true".into()),
                (ANN_CLONE_FROM_DIR, "rel/dir".into()),
            ],
            Default::default(),
        ),
    ] {
        let mut owners: crate::provider::owners::Owners = owners;
        if let Some(o) = owners.vms.get_mut("vk-ns-demo-0") {
            o.pod_uid = "u1".into();
        }
        let mut h = H {
            p: Provider::new(ProviderConfig::default()),
            now: Instant::now(),
            wall: SystemTime::UNIX_EPOCH,
            quiet_reclaimer: true,
            ledger: owners.clone(),
            hold_ledger: false,
        };
        let mut ann = broken.clone();
        ann.push((ANN_VM_ID, "V1".into()));
        ann.push((ANN_LIFECYCLE_STATE, "ready".into()));
        let mut p = mk("a", "u1", &ann);
        p.status = Some(status::running(
            "10.0.0.9",
            true,
            None,
            None,
            &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
        ));
        let e = h.feed(Input::StartupListed {
            pods: vec![p],
            vms: vec![vm_info("V1", "vk-ns-demo-0", "running")],
            owners,
        });
        assert!(
            cocoon_ops(&e).iter().all(|(_, c)| !argv(c).contains("rm")),
            "{e:?}"
        );
        assert!(
            events(&e).iter().any(|(r, _)| *r == "ProviderUpdateFailed"),
            "{e:?}"
        );
        assert!(
            statuses(&e)
                .iter()
                .all(|(_, s)| s.phase.as_deref() == Some("Running")),
            "{e:?}"
        );
        assert_eq!(
            h.p.pod_vm(&PodKey {
                namespace: "ns".into(),
                name: "a".into()
            })
            .map(|v| v.id.clone()),
            Some("V1".into())
        );
    }
}

/// A pod the cluster saw Running whose VM vanished while no daemon ran is evicted as a VM-gone
/// event would have it (inspect, not found, Failed `VMGone`, API delete); it is never
/// re-created in place, whose first failure would write Pending over Running. Its VM is
/// looked up by the ID it records, or by its name when the ID write was lost.
#[test]
fn a_running_pod_whose_vm_vanished_across_a_restart_is_evicted_not_recreated() {
    for (id, reference) in [(Some("V1"), "V1"), (None, "vk-ns-demo-0")] {
        let mut h = H {
            p: Provider::new(ProviderConfig::default()),
            now: Instant::now(),
            wall: SystemTime::UNIX_EPOCH,
            quiet_reclaimer: true,
            ledger: Default::default(),
            hold_ledger: false,
        };
        let mut ann = managed("a", "vk-ns-demo-0");
        if let Some(id) = id {
            ann.push((ANN_VM_ID, id.into()));
        }
        ann.push((ANN_LIFECYCLE_STATE, "ready".into()));
        let mut p = mk("a", "u1", &ann);
        p.status = Some(status::running(
            "10.0.0.9",
            true,
            None,
            None,
            &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
        ));
        let e = h.feed(Input::StartupListed {
            pods: vec![p],
            vms: vec![],
            owners: Default::default(),
        });
        let (op, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), format!("vm inspect {reference}"));
        assert!(statuses(&e).is_empty(), "{e:?}");
        let e = h.cocoon(op, Answer::failed("Error: inspect: VM not found"));
        assert!(cocoon_ops(&e).is_empty(), "no clone in place: {e:?}");
        let st = statuses(&e);
        assert_eq!(st.len(), 1, "{e:?}");
        assert_eq!(st[0].1.phase.as_deref(), Some("Failed"));
        let term = st[0].1.container_statuses.as_ref().unwrap()[0]
            .state
            .as_ref()
            .unwrap()
            .terminated
            .clone()
            .unwrap();
        assert_eq!(term.reason.as_deref(), Some("VMGone"));
        let e = h.kube_ok(st[0].0);
        assert_eq!(deletes(&e).len(), 1, "{e:?}");
    }
}

/// The contrast: a pod never seen Running whose recorded VM is gone is still created afresh.
#[test]
fn a_pending_pod_whose_recorded_vm_is_gone_is_created_at_startup() {
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_VM_ID, "V1".into()));
    let e = h.feed(Input::StartupListed {
        pods: vec![mk("a", "u1", &ann)],
        vms: vec![],
        owners: Default::default(),
    });
    let cmds: Vec<String> = cocoon_ops(&e).iter().map(|(_, c)| argv(c)).collect();
    assert!(
        !cmds.iter().any(|c| c.starts_with("vm inspect V1")),
        "{cmds:?}"
    );
    assert!(
        !cmds.is_empty()
            && statuses(&e)
                .iter()
                .all(|(_, s)| s.phase.as_deref() != Some("Failed")),
        "{e:?}"
    );
}

/// A restart with more pods than one chunk adopts them over several ticks (so no loop turn
/// adopts a whole node): every pod claims its VM before any VM is taken for an orphan, a VM
/// event that arrives between chunks waits until the pod that adopts its VM is tracked, and
/// pod events wait for the end.
#[test]
fn a_large_startup_adopts_in_chunks_and_decides_orphans_after_the_last() {
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let n = 150;
    let pods: Vec<Pod> = (0..n)
        .map(|i| {
            let name = format!("p{i}");
            let mut ann = managed(&name, &format!("vk-ns-p{i}-0"));
            ann.push((ANN_VM_ID, format!("V{i}")));
            ann.push((ANN_LIFECYCLE_STATE, "ready".into()));
            mk(&name, &format!("u{i}"), &ann)
        })
        .collect();
    let mut vms: Vec<VmInfo> = (0..n)
        .map(|i| vm_info(&format!("V{i}"), &format!("vk-ns-p{i}-0"), "running"))
        .collect();
    vms.push(vm_info("VX", "vk-ns-gone-0", "running"));
    let removals = |e: &[Effect]| -> Vec<String> {
        cocoon_ops(e)
            .iter()
            .map(|(_, c)| argv(c))
            .filter(|c| c.starts_with("vm rm"))
            .collect()
    };
    // Pods of one age are taken by key: "p99" comes last.
    let last = PodKey::new("ns", "p99");

    let e = h.feed(Input::StartupListed {
        pods,
        vms,
        owners: Default::default(),
    });
    assert!(h.p.pod_vm(&PodKey::new("ns", "p0")).is_some());
    assert!(h.p.pod_vm(&last).is_none(), "all pods adopted in one input");
    assert!(removals(&e).is_empty(), "{:?}", removals(&e));

    // Between chunks: the last pod's VM stops, and a new pod is added.
    let mut later = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("V99", "vk-ns-p99-0", "stopped"),
    });
    later.extend(h.feed(Input::PodUpserted(Box::new(mk(
        "new",
        "u-new",
        &managed("new", "vk-ns-new-0"),
    )))));
    assert!(
        cocoon_ops(&later).is_empty(),
        "events handled mid-adoption: {later:?}"
    );

    let mut ticks = 0;
    while h.p.pod_vm(&last).is_none() {
        ticks += 1;
        assert!(ticks < 20, "the adoption never finished");
        let e = h.advance(Duration::from_millis(1));
        if h.p.pod_vm(&last).is_none() {
            assert!(removals(&e).is_empty(), "orphans removed mid-adoption");
        }
        later.extend(e);
    }
    // Whatever chunks remain (the kicks) run too.
    for _ in 0..5 {
        later.extend(h.advance(Duration::from_millis(1)));
    }
    assert!(ticks >= 2, "150 pods adopted in {ticks} ticks");
    assert_eq!(removals(&later), vec!["vm rm --force VX".to_string()]);
    let cmds: Vec<String> = cocoon_ops(&later).iter().map(|(_, c)| argv(c)).collect();
    // The held VM event reached the pod that adopted the VM (a VM-gone check looks first),
    // and the held pod event started its create.
    assert!(
        cmds.iter()
            .any(|c| c.contains("V99") && c.starts_with("vm inspect")),
        "{cmds:?}"
    );
    assert!(
        cmds.contains(&"snapshot inspect vk-ns-new-0".to_string()),
        "{cmds:?}"
    );
    assert_eq!(
        later
            .iter()
            .chain(e.iter())
            .filter(|x| matches!(x, Effect::StartProbe { .. }))
            .count(),
        n
    );
}

/// A VM removed or stopped while the startup reconcile still settles a stale create: its
/// event arrives before any pod is tracked. It must still be looked at once the reconcile
/// adopted the pod from the (now stale) listing; dropping it leaves the pod Running on a VM
/// that is gone (evicted instead) or stopped (restarted instead), with no later event.
#[test]
fn a_vm_removed_or_stopped_during_the_startup_reconcile_is_checked_once_it_ends() {
    for (kind, state, found, next) in [
        (
            VmEventKind::Deleted,
            "running",
            Answer::failed("Error: inspect: vm V1: VM not found"),
            None,
        ),
        (
            VmEventKind::Modified,
            "stopped",
            Answer::ok(vm_json(
                "V1",
                "vk-ns-demo-0",
                "stopped",
                "02:00:00:00:00:01",
            )),
            Some("vm start V1"),
        ),
    ] {
        let mut h = H {
            p: Provider::new(ProviderConfig::default()),
            now: Instant::now(),
            wall: SystemTime::UNIX_EPOCH,
            quiet_reclaimer: true,
            ledger: Default::default(),
            hold_ledger: false,
        };
        let mut ann = managed("a", "vk-ns-demo-0");
        ann.push((ANN_VM_ID, "V1".into()));
        ann.push((ANN_LIFECYCLE_STATE, "ready".into()));
        let e = h.feed(Input::StartupListed {
            pods: vec![mk("a", "u1", &ann)],
            vms: vec![
                vm_info("V1", "vk-ns-demo-0", "running"),
                vm_info("V4", "vk-ns-half-0", "creating"),
            ],
            owners: Default::default(),
        });
        let (stale, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), "vm reconcile-stale-create -o json V4");
        let e = h.feed(Input::VmEvent {
            kind,
            vm: vm_info("V1", "vk-ns-demo-0", state),
        });
        assert!(e.is_empty(), "{e:?}");
        let e = h.cocoon(stale, Answer::ok(r#"{"id":"V4","outcome":"collected"}"#));
        let e = answer(&mut h, &e, "vm inspect V1", found);
        match next {
            Some(cmd) => assert_eq!(argv(&one_cocoon(&e).1), cmd, "{e:?}"),
            None => assert!(
                statuses(&e)
                    .iter()
                    .any(|(_, s)| s.phase.as_deref() == Some("Failed")),
                "the pod is evicted, not left Running on no VM: {e:?}"
            ),
        }
    }
}

/// A pod adopted at startup with no lifecycle record whose VM was stopped: the owed work
/// restarts the VM first, and Ready (owed to a pod adopted without a record) follows the
/// restart instead of never coming (the pod would stay Running but not Ready).
#[test]
fn an_unrecorded_pod_on_a_stopped_vm_is_published_ready_after_its_restart() {
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_VM_ID, "V1".into()));
    let mut p = mk("a", "u1", &ann);
    p.status = Some(status::running(
        "10.0.0.9",
        true,
        None,
        None,
        &Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()),
    ));
    let (mut h, e) = H::starting(
        ProviderConfig::default(),
        vec![p],
        vec![vm_info("V1", "vk-ns-demo-0", "stopped")],
    );
    let stopped = vm_json("V1", "vk-ns-demo-0", "stopped", "02:00:00:00:00:01");
    let e = answer(&mut h, &e, "vm inspect V1", Answer::ok(stopped));
    let e = answer(&mut h, &e, "vm start V1", Answer::ok(""));
    let running = vm_json("V1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = answer(&mut h, &e, "vm inspect V1", Answer::ok(running));
    let (op, st) = statuses(&e).pop().expect("Ready published");
    assert_eq!(st.phase.as_deref(), Some("Running"), "{st:?}");
    let e = h.kube_ok(op);
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("ready".into()))));
}

/// A stale create left to the background watch (busy at startup) keeps a delay record only
/// while it is watched: once the watch's reconcile finds the name free, or its inspect a
/// verdict, the record goes.
#[test]
fn a_stale_create_watch_that_ends_leaves_no_record() {
    for (outcome, inspect) in [("collected", None), ("not-creating", Some("running"))] {
        let (mut h, e) = H::starting(
            ProviderConfig::default(),
            vec![],
            vec![vm_info("V4", "vk-ns-half-0", "creating")],
        );
        let (op, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), "vm reconcile-stale-create -o json V4");
        h.cocoon(op, Answer::ok(r#"{"id":"V4","outcome":"busy"}"#));
        // The watch's first look comes after its first delay.
        let e = h.advance(Duration::from_secs(2));
        let (op, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), "vm reconcile-stale-create -o json V4");
        assert_eq!(h.p.table_sizes()["stale_watch_state"], 1);
        let e = h.cocoon(
            op,
            Answer::ok(format!(r#"{{"id":"V4","outcome":"{outcome}"}}"#)),
        );
        if let Some(state) = inspect {
            let (op, cmd) = one_cocoon(&e);
            assert_eq!(argv(&cmd), "vm inspect V4");
            h.cocoon(
                op,
                Answer::ok(vm_json("V4", "vk-ns-half-0", state, "02:00:00:00:00:04")),
            );
        }
        assert_eq!(h.p.table_sizes()["stale_watch_state"], 0, "{outcome}");
    }
}
