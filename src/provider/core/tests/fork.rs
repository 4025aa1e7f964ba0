//! Transition tests of fork-from: reuse of `fork-<source>`, the source found by the name index
//! or by inspect, failures, and one save shared by concurrent forks that outlives any one of them.

use super::*;

/// A source no pod here holds: its dotted name proves its namespace.
const SRC: &str = "vk-ns.main-0";

fn fork_pod(name: &str, uid: &str, vm: &str) -> Pod {
    let mut a = managed(name, vm);
    a.push((ANN_FORK_FROM, SRC.to_string()));
    mk(name, uid, &a)
}

/// Feed a fork pod up to the point where it waits on the fork-snapshot flight (evidence none,
/// its own `fork-<vm>` removed); returns the effects of that last step.
fn to_flight(h: &mut H, p: Pod) -> Vec<Effect> {
    let vm = p.metadata.annotations.as_ref().unwrap()[ANN_VM_NAME].clone();
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(h, &e);
    answer(
        h,
        &e,
        &format!("snapshot rm fork-{vm}"),
        Answer::failed("Error: rm: resolve \"x\": snapshot not found"),
    )
}

fn snap_json(name: &str) -> String {
    format!(r#"{{"id":"FS1","name":"{name}","hypervisor":"cloud-hypervisor"}}"#)
}

fn assert_clones_from_fork(cmd: &CocoonCmd, vm: &str) {
    let a = argv(cmd);
    assert!(a.starts_with("vm clone"), "{a}");
    assert!(a.contains(&format!("--name {vm} ")), "{a}");
    assert!(a.ends_with(&format!(" fork-{SRC}")), "{a}");
    // The source's base image is on this node already.
    assert!(!a.contains("--pull"), "{a}");
}

fn failed_create(e: &[Effect], want: &str) {
    assert!(
        events(e)
            .iter()
            .any(|(r, m)| *r == "CreateBringUpFailed" && m.contains(want)),
        "{:?}",
        events(e)
    );
    assert!(has_metric(
        e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: ""
        }
    ));
}

#[test]
fn an_existing_fork_snapshot_is_reused_without_a_save() {
    // Saved for this namespace by an earlier fork: its owner is on record.
    let mut owners = crate::provider::owners::Owners::default();
    owners.snapshots.insert(
        format!("fork-{SRC}"),
        crate::provider::owners::Owner::new("ns", ""),
    );
    let (mut h, _) = H::starting_with(ProviderConfig::default(), vec![], vec![], owners);
    let e = to_flight(&mut h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::ok(snap_json(&format!("fork-{SRC}"))),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_clones_from_fork(&cmd, "vk-ns-sub-0");
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM2",
            "vk-ns-sub-0",
            "running",
            "02:00:00:00:00:02",
        )),
    );
    assert!(!has_metric(
        &e,
        &MetricUpdate::SnapshotSave { result: "ok" }
    ));
    let lop = lookup(&e).expect("lease lookup");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.7".into())),
    });
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: ""
        }
    ));
    let vm = h.p.pod_vm(&PodKey::new("ns", "sub")).expect("tracked vm");
    assert_eq!(vm.id, "VM2");
}

#[test]
fn a_source_in_the_name_index_is_saved_by_its_id_without_an_inspect() {
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
    h.feed(Input::StartupListed {
        pods: vec![],
        vms: vec![vm_info("SRCID", SRC, "running")],
        owners: Default::default(),
    });
    let e = to_flight(&mut h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name fork-{SRC} SRCID"),
        Answer::ok(""),
    );
    assert!(has_metric(&e, &MetricUpdate::SnapshotSave { result: "ok" }));
    let (_, cmd) = one_cocoon(&e);
    assert_clones_from_fork(&cmd, "vk-ns-sub-0");
}

#[test]
fn a_source_not_indexed_is_found_by_inspect_then_saved() {
    let mut h = H::new(ProviderConfig::default());
    let e = to_flight(&mut h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name fork-{SRC} SRCID"),
        Answer::ok(""),
    );
    let (_, cmd) = one_cocoon(&e);
    assert_clones_from_fork(&cmd, "vk-ns-sub-0");
}

#[test]
fn a_missing_or_stopped_source_fails_the_create_and_retries_later() {
    let mut h = H::new(ProviderConfig::default());
    let e = to_flight(&mut h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::failed("Error: vm not found"),
    );
    failed_create(&e, &format!("source vm {SRC} not found"));
    assert!(cocoon_ops(&e).is_empty(), "no save, no clone: {e:?}");
    assert!(h.p.pod_vm(&PodKey::new("ns", "sub")).is_none());

    // The retry runs a new flight; a source that exists but is stopped cannot be saved.
    let e = h.advance(Duration::from_secs(60));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-sub-0",
        Answer::failed("Error: vm not found"),
    );
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-sub-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "stopped", "02:00:00:00:00:01")),
    );
    failed_create(&e, "is stopped, not running");
}

#[test]
fn a_failed_save_fails_every_waiting_create_and_counts_the_save() {
    let mut h = H::new(ProviderConfig::default());
    let e = to_flight(&mut h, fork_pod("a", "u1", "vk-ns-a-0"));
    let (inspect_op, _) = one_cocoon(&e);
    let e2 = to_flight(&mut h, fork_pod("b", "u2", "vk-ns-b-0"));
    assert!(cocoon_ops(&e2).is_empty(), "{e2:?}");
    let e = h.cocoon(
        inspect_op,
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name fork-{SRC} SRCID"),
        Answer::failed("Error: save: disk full"),
    );
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotSave { result: "failed" }
    ));
    let failed: Vec<_> = events(&e)
        .into_iter()
        .filter(|(r, m)| *r == "CreateBringUpFailed" && m.contains("disk full"))
        .collect();
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(cocoon_ops(&e).is_empty());
}

#[test]
fn concurrent_forks_of_one_source_share_one_save_that_outlives_a_deleted_caller() {
    let mut h = H::new(ProviderConfig::default());
    let pods = [("a", "u1"), ("b", "u2"), ("c", "u3")];
    let mut calls = Vec::new();
    for (name, uid) in pods {
        let e = to_flight(&mut h, fork_pod(name, uid, &format!("vk-ns-{name}-0")));
        calls.extend(cocoon_ops(&e));
    }
    // One inspect of the fork snapshot for the three of them.
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(argv(&calls[0].1), format!("snapshot inspect fork-{SRC}"));
    let e = h.cocoon(
        calls[0].0,
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")),
    );
    let (save_op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot save --name fork-{SRC} SRCID"));

    // The pod that started the flight is deleted while the save runs: its delete starts at
    // once (it need not wait for a save that may take long), and nothing is cancelled.
    let mut gone = fork_pod("a", "u1", "vk-ns-a-0");
    gone.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let e = h.feed(Input::PodUpserted(Box::new(gone)));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(
        argv(&cmd),
        "vm inspect vk-ns-a-0",
        "the delete looks its VM up"
    );

    let e = h.cocoon(save_op, Answer::ok(""));
    let clones: Vec<String> = cocoon_ops(&e)
        .iter()
        .map(|(_, c)| argv(c))
        .filter(|a| a.starts_with("vm clone"))
        .collect();
    assert_eq!(clones.len(), 2, "{clones:?}");
    assert!(clones.iter().any(|a| a.contains("--name vk-ns-b-0 ")));
    assert!(clones.iter().any(|a| a.contains("--name vk-ns-c-0 ")));
    assert!(!clones.iter().any(|a| a.contains("--name vk-ns-a-0 ")));
    let saves = e
        .iter()
        .filter(|x| matches!(x, Effect::Metric(MetricUpdate::SnapshotSave { .. })))
        .count();
    assert_eq!(saves, 1);

    // A fork arriving after the flight landed reuses the snapshot: a new inspect, no save.
    let e = to_flight(&mut h, fork_pod("d", "u4", "vk-ns-d-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::ok(snap_json(&format!("fork-{SRC}"))),
    );
    let (_, cmd) = one_cocoon(&e);
    assert_clones_from_fork(&cmd, "vk-ns-d-0");
}

#[test]
fn a_name_held_by_an_interrupted_save_is_removed_and_the_save_retried_once() {
    let mut h = H::new(ProviderConfig::default());
    let e = to_flight(&mut h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")),
    );
    let taken = format!("Error: snapshot name \"fork-{SRC}\" already in use by HALF7");
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name fork-{SRC} SRCID"),
        Answer::failed(taken.clone()),
    );
    // Not landed by another save (a complete one would be visible).
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(&mut h, &e, "snapshot rm HALF7", Answer::ok(""));
    // Retried once only: a second collision fails the create.
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name fork-{SRC} SRCID"),
        Answer::failed(taken),
    );
    failed_create(&e, "already in use by HALF7");
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotSave { result: "failed" }
    ));

    // A collision with a save that did land is a reuse.
    let e = h.advance(Duration::from_secs(60));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-sub-0",
        Answer::failed("Error: vm not found"),
    );
    let e = no_evidence(&mut h, &e);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-sub-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot save --name fork-{SRC} SRCID"),
        Answer::failed(format!(
            "Error: snapshot name \"fork-{SRC}\" already exists"
        )),
    );
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::ok(snap_json(&format!("fork-{SRC}"))),
    );
    let (_, cmd) = one_cocoon(&e);
    assert_clones_from_fork(&cmd, "vk-ns-sub-0");
}

#[test]
fn a_fork_from_value_that_is_not_a_vm_name_never_reaches_cocoon() {
    let mut h = H::new(ProviderConfig::default());
    for bad in ["--force", "a b", "x;rm", "../etc", &"v".repeat(59)] {
        let mut a = managed("sub", "vk-ns-sub-0");
        a.push((ANN_FORK_FROM, bad.to_string()));
        let e = h.feed(Input::PodUpserted(Box::new(mk("sub", bad, &a))));
        assert!(cocoon_ops(&e).is_empty(), "{bad}: {e:?}");
        assert!(has_metric(
            &e,
            &MetricUpdate::PodLifecycle {
                op: "create",
                result: "failed",
                reason: "bad_fork_from"
            }
        ));
        assert!(events(&e)
            .iter()
            .any(|(r, m)| *r == "ProviderCreateFailed" && m.contains(ANN_FORK_FROM)));
    }
}

#[test]
fn a_restore_fork_pod_with_hibernate_evidence_is_a_source_conflict_not_a_fork() {
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(fork_pod(
        "sub",
        "u1",
        "vk-ns-sub-0",
    ))));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect vk-ns-sub-0",
        Answer::ok(snap_json("vk-ns-sub-0")),
    );
    assert!(cocoon_ops(&e).is_empty());
    assert!(has_metric(
        &e,
        &MetricUpdate::HibernateEvidence {
            verdict: "source_conflict"
        }
    ));
}

#[test]
fn a_pod_forks_only_vms_of_its_own_namespace() {
    let mut h = H::new(ProviderConfig::default());
    // Another tenant's VM: refused before anything of it is inspected or saved.
    let mut a = managed("sub", "vk-ns-sub-0");
    a.push((ANN_FORK_FROM, "vk-other-main-0".to_string()));
    let e = to_flight(&mut h, mk("sub", "u1", &a));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "VMNotInNamespace" && m.contains("is not a VM of namespace ns")));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.phase.as_deref() == Some("Failed")));

    // A VM of another name that a pod of the namespace holds is its own.
    let mut h = H::new(ProviderConfig::default());
    let p = mk("main", "u0", &managed("main", "vk-ns-mainvm"));
    create_clone(&mut h, p, "VM0");
    let mut a = managed("sub", "vk-ns-sub-0");
    a.push((ANN_FORK_FROM, "vk-ns-mainvm".to_string()));
    let e = to_flight(&mut h, mk("sub", "u1", &a));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect fork-vk-ns-mainvm");
}

/// A Firecracker source forks into a Firecracker pod (whose clone then gets the post-clone
/// fix-up); into a pod of the default backend it is refused before any clone.
#[test]
fn a_firecracker_source_forks_only_into_a_firecracker_pod() {
    for (backend, clones) in [(Some("firecracker"), true), (None, false)] {
        let mut h = H::new(ProviderConfig::default());
        let mut a = managed("sub", "vk-ns-sub-0");
        a.push((ANN_FORK_FROM, SRC.to_string()));
        if let Some(b) = backend {
            a.push((ANN_BACKEND, b.to_string()));
        }
        let e = to_flight(&mut h, mk("sub", "u1", &a));
        let e = answer(
            &mut h,
            &e,
            &format!("snapshot inspect fork-{SRC}"),
            Answer::failed("Error: inspect: snapshot not found"),
        );
        let fc = vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")
            .replace("cloud-hypervisor", "firecracker");
        let e = answer(&mut h, &e, &format!("vm inspect {SRC}"), Answer::ok(fc));
        let e = answer(
            &mut h,
            &e,
            &format!("snapshot save --name fork-{SRC} SRCID"),
            Answer::ok(""),
        );
        if clones {
            let (_, cmd) = one_cocoon(&e);
            let a = argv(&cmd);
            assert!(a.starts_with("vm clone"), "{a}");
            assert!(a.contains(&format!("fork-{SRC}")), "{a}");
        } else {
            assert!(cocoon_ops(&e).is_empty(), "no clone: {e:?}");
            failed_create(
                &e,
                "was taken with firecracker but CocoonSet requests cloud-hypervisor",
            );
        }
    }
}

#[test]
fn a_source_deleted_while_its_fork_snapshot_is_saved_is_not_handed_out() {
    let mut h = H::new(ProviderConfig::default());
    let mut main = managed("main", SRC);
    main.push((ANN_SNAPSHOT_POLICY, "never".to_string()));
    let main = mk("main", "u0", &main);
    create_clone(&mut h, main.clone(), "SRCID");
    let e = to_flight(&mut h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        &mut h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let (save_op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot save --name fork-{SRC} SRCID"));

    // The source pod is deleted meanwhile: its delete removes the VM and fork-<source>.
    let mut gone = main;
    gone.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let mut e = h.feed(Input::PodUpserted(Box::new(gone)));
    let mut removed_fork = false;
    while let Some((op, cmd)) = cocoon_ops(&e).first().cloned() {
        let a = argv(&cmd);
        removed_fork |= a == format!("snapshot rm fork-{SRC}");
        let r = if a.starts_with("vm inspect") {
            Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01"))
        } else {
            Answer::ok("")
        };
        e = h.cocoon(op, r);
    }
    assert!(removed_fork);

    // The save lands after that: discarded, not cloned from.
    let e = h.cocoon(save_op, Answer::ok(""));
    let cmds: Vec<String> = cocoon_ops(&e).iter().map(|(_, c)| argv(c)).collect();
    assert_eq!(cmds, [format!("snapshot rm fork-{SRC}")], "{e:?}");
    failed_create(&e, "was deleted or re-created while it was being forked");
}

/// A fork of `sub` up to its flight's `snapshot save` (the source found by inspect); returns
/// the save's op and command.
fn to_fork_save(h: &mut H) -> (OpId, CocoonCmd) {
    let e = to_flight(h, fork_pod("sub", "u1", "vk-ns-sub-0"));
    let e = answer(
        h,
        &e,
        &format!("snapshot inspect fork-{SRC}"),
        Answer::failed("Error: inspect: snapshot not found"),
    );
    let e = answer(
        h,
        &e,
        &format!("vm inspect {SRC}"),
        Answer::ok(vm_json("SRCID", SRC, "running", "02:00:00:00:00:01")),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot save --name fork-{SRC} SRCID"));
    (op, cmd)
}

fn save_seconds(e: &[Effect]) -> Vec<(String, f64)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::Metric(MetricUpdate::SnapshotSaveDuration { namespace, seconds }) => {
                Some((namespace.clone(), *seconds))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn the_fork_save_is_timed_in_the_save_duration_histogram() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = to_fork_save(&mut h);
    h.now += Duration::from_secs(7);
    let e = h.cocoon(op, Answer::ok(""));
    // Labelled with the namespace of the forking pods (the source's own: forks stay in it).
    assert_eq!(save_seconds(&e), vec![("ns".to_string(), 7.0)]);

    // A failed save is timed too, as a hibernate's is.
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = to_fork_save(&mut h);
    h.now += Duration::from_secs(2);
    let e = h.cocoon(op, Answer::failed("Error: save: disk full"));
    assert_eq!(save_seconds(&e), vec![("ns".to_string(), 2.0)]);
    assert!(has_metric(
        &e,
        &MetricUpdate::SnapshotSave { result: "failed" }
    ));
}

#[test]
fn a_hung_fork_save_is_killed_at_the_create_deadline_not_the_transfer_one() {
    let mut h = H::new(ProviderConfig::default());
    let (op, cmd) = to_fork_save(&mut h);
    // The forking creates wait for this save: it is bounded by their create deadline class.
    assert_eq!(cmd.deadline(), Duration::from_secs(600));
    assert!(cmd.deadline() < crate::vm::Deadlines::default().transfer);
    // Another fork of the same source joins the same flight (no second save).
    let e = to_flight(&mut h, fork_pod("sub2", "u2", "vk-ns-sub2-0"));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    // The daemon kills the child at that deadline: both creates fail and retry.
    h.now += cmd.deadline();
    let killed = Answer::timed_out_call();
    let e = h.cocoon(op, killed);
    assert_eq!(save_seconds(&e), vec![("ns".to_string(), 600.0)]);
    let failures = events(&e)
        .iter()
        .filter(|(r, m)| *r == "CreateBringUpFailed" && m.contains("timed out"))
        .count();
    assert_eq!(failures, 2, "{:?}", events(&e));
}
