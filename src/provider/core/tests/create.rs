//! Transition tests of create: spec checks, evidence, snapshot and image steps, clone / run,
//! bring-up failures, adoption of a preassigned VM.

use super::*;
use crate::vm::PidFile;

/// The plain create writes one status (Running, with the pod IP) and, once it landed, one
/// annotation patch: id, ip and lifecycle `ready` together. No `creating` (the ledger record
/// stands for it) and no Running-not-Ready (held, and Ready came first).
#[test]
fn clone_create_writes_one_status_then_one_annotation_with_id_ip_and_ready() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = create_clone(&mut h, p, "VM1");
    assert!(annotation_patches(&e).is_empty(), "{e:?}");
    assert_eq!(statuses(&e).len(), 1, "{e:?}");
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::StartProbe { ip, .. } if ip == "10.0.0.9")));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: ""
        }
    ));
    // Ready publication: status patch first, the lifecycle=ready annotation only after it landed.
    let st = statuses(&e);
    let (sop, ready) = st
        .iter()
        .rev()
        .find(|(_, s)| published(s))
        .cloned()
        .expect("ready publication");
    assert_eq!(ready.pod_ip.as_deref(), Some("10.0.0.9"));
    assert_eq!(ready.phase.as_deref(), Some("Running"));
    assert!(!annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("ready".into()))));
    let e = h.kube_ok(sop);
    let ann = annotation_patches(&e);
    assert_eq!(ann.len(), 1);
    assert_eq!(ann[0].1[ANN_LIFECYCLE_STATE].as_deref(), Some("ready"));
    assert_eq!(ann[0].1[ANN_VM_ID].as_deref(), Some("VM1"));
    assert_eq!(ann[0].1[ANN_VM_IP].as_deref(), Some("10.0.0.9"));
    // Ready only once a probe succeeded: a resolved IP is not enough.
    assert!(!status::is_ready(&ready), "{ready:?}");
    let got = h.p.get_pod(&PodKey::new("ns", "a")).unwrap();
    assert!(!status::is_ready(got.status.as_ref().unwrap()));
    let e = probe_ok(&mut h, "a", "u1");
    assert!(
        statuses(&e).iter().any(|(_, s)| status::is_ready(s)),
        "{e:?}"
    );
    let got = h.p.get_pod(&PodKey::new("ns", "a")).unwrap();
    assert!(status::is_ready(got.status.as_ref().unwrap()));
}

#[test]
fn clone_waits_for_the_lease_before_ready() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let (op, _) = drive_to_clone(&mut h, p);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let lop = lookup(&e).unwrap();
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(None),
    });
    // Running but not ready, waiting for the lease: that status is held (a lease that comes
    // within the hold writes only the final status).
    assert!(statuses(&e).is_empty(), "{e:?}");
    assert!(lookup(&e).is_none());
    let e = h.advance(Duration::from_millis(200));
    let lop = lookup(&e).expect("polls the lease again");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.1.1.1".into())),
    });
    let st = statuses(&e);
    assert_eq!(st.len(), 1, "{e:?}");
    assert!(published(&st[0].1));
    // The lease never coming: 45 s later it fails clearly.
    let mut h = H::new(ProviderConfig::default());
    let p = mk("b", "u2", &managed("b", "vk-ns-demo-1"));
    let (op, _) = drive_to_clone(&mut h, p);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM2",
            "vk-ns-demo-1",
            "running",
            "02:00:00:00:00:02",
        )),
    );
    let all_lookups = |e: &[Effect]| -> Vec<OpId> {
        e.iter()
            .filter_map(|x| match x {
                Effect::LookupLease { op, .. } => Some(*op),
                _ => None,
            })
            .collect()
    };
    let mut lops = all_lookups(&e);
    let mut all = Vec::new();
    for _ in 0..300 {
        for op in std::mem::take(&mut lops) {
            all.extend(h.feed(Input::LeaseLooked {
                op,
                result: Ok(None),
            }));
        }
        let e = h.advance(Duration::from_millis(200));
        lops = all_lookups(&e);
        all.extend(e);
    }
    // A slow one shows its progress once the hold ends: Running, not Ready.
    let first = statuses(&all)
        .into_iter()
        .next()
        .expect("a status after the hold");
    assert_eq!(first.1.phase.as_deref(), Some("Running"));
    assert!(!status::is_ready(&first.1));
    assert!(events(&all)
        .iter()
        .any(|(r, _)| *r == "PostCloneIPWaitTimeout"));
    assert!(annotation_patches(&all)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("failed".into()))));
}

#[test]
fn bad_input_fails_clearly_without_touching_cocoon() {
    let cases: Vec<(Vec<(&'static str, String)>, &str)> = vec![
        (vec![(ANN_MANAGED, "true".into())], "missing_vmname"),
        (
            vec![
                (ANN_VM_NAME, "v".into()),
                (ANN_MODE, "run".into()),
                (ANN_CLONE_FROM_DIR, "/x".into()),
            ],
            "conflicting_annotations",
        ),
        (
            vec![
                (ANN_VM_NAME, "v".into()),
                (ANN_CLONE_FROM_DIR, "rel/dir".into()),
            ],
            "bad_clone_from_dir",
        ),
        (
            vec![
                (ANN_VM_NAME, "v".into()),
                (ANN_CLONE_FROM_DIR, "/a/./b".into()),
            ],
            "bad_clone_from_dir",
        ),
    ];
    for (ann, reason) in cases {
        let mut h = H::new(ProviderConfig::default());
        let p = mk("a", "u1", &ann);
        let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
        assert!(cocoon_ops(&e).is_empty(), "{reason}: {e:?}");
        let st = statuses(&e);
        assert_eq!(st.len(), 1, "{reason}");
        assert_eq!(st[0].1.reason.as_deref(), Some("ProviderFailed"));
        assert!(
            events(&e).iter().any(|(r, _)| *r == "ProviderCreateFailed"),
            "{reason}"
        );
        let result = if reason == "missing_vmname" {
            "skipped"
        } else {
            "failed"
        };
        assert!(
            has_metric(
                &e,
                &MetricUpdate::PodLifecycle {
                    op: "create",
                    result,
                    reason
                }
            ),
            "{reason}: {e:?}"
        );
        // The same pod again changes nothing; no retry storm either.
        assert!(h.feed(Input::PodUpserted(Box::new(p))).is_empty());
        assert!(h
            .advance(Duration::from_secs(60))
            .iter()
            .all(|e| !matches!(e, Effect::Cocoon { .. })));
    }
}

#[test]
fn missing_snapshot_is_pulled_with_registry_and_fails_without() {
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::failed("Error: inspect: snapshot not found"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "CreateBringUpFailed" && m.contains("no registry")));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("ProviderFailed")));
    // Retried with backoff: 5 ms later the create runs again (first inspecting the name).
    let e = h.advance(Duration::from_millis(5));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect vk-ns-demo-0");

    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::failed("snapshot not found"));
    let e = base_manifest(&mut h, &e);
    let pull = e.iter().find_map(|x| match x {
        Effect::PullSnapshot {
            op,
            repo,
            tag,
            local_name,
        } => Some((*op, repo.clone(), tag.clone(), local_name.clone())),
        _ => None,
    });
    let (pop, repo, tag, local) = pull.expect("pull");
    assert_eq!(
        (repo.as_str(), tag.as_str(), local.as_str()),
        ("team/agent", "v3", "team/agent:v3")
    );
    let e = h.feed(Input::TransferDone {
        op: pop,
        result: Ok(String::new()),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    // Recorded OCI base image whose digest is present ⇒ clone with --pull.
    let e = h.cocoon(
        op,
        Answer::ok(
            r#"{"id":"S","name":"team/agent:v3","image":"ubuntu:24.04","image_digest":"sha256:ab"}"#,
        ),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "image inspect sha256:ab");
    let e = h.cocoon(op, Answer::ok("{}"));
    let (_, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).contains(" --pull "), "{}", argv(&cmd));
}

#[test]
fn backend_mismatch_refuses_to_clone() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_BACKEND, "cloud-hypervisor".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        Answer::ok(r#"{"id":"S","name":"team/agent:v3","hypervisor":"firecracker"}"#),
    );
    assert!(cocoon_ops(&e).is_empty());
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m
            .contains("was taken with firecracker but CocoonSet requests cloud-hypervisor")));
}

#[test]
fn run_mode_pulls_the_image_then_runs_with_resources() {
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-tb-shell");
    ann.push((ANN_MODE, "run".into()));
    ann.push((ANN_FORCE_PULL, "true".into()));
    ann.push((ANN_STORAGE, "20Gi".into()));
    let mut p = mk("a", "u1", &ann);
    p.spec.as_mut().unwrap().containers[0].resources = Some(ResourceRequirements {
        limits: Some([("cpu".to_string(), Quantity("2".into()))].into()),
        requests: Some([("memory".to_string(), Quantity("4Gi".into()))].into()),
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "image pull --force team/agent:v3");
    let e = h.cocoon(op, Answer::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(
        argv(&cmd),
        "vm run --output json --name vk-ns-tb-shell --cpu 2 --cpu-weight 79 --cpu-quota-us 200000 \
         --cpu-period-us 100000 --memory 4294967296 --storage 21474836480 team/agent:v3"
    );
    // Not running / pid 0 ⇒ one extra inspect.
    let e = h.cocoon(op, Answer::ok(r#"{"id":"R1","state":"created","pid":0}"#));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect R1");
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "R1",
            "vk-ns-tb-shell",
            "running",
            "02:00:00:00:00:09",
        )),
    );
    let lop = lookup(&e).unwrap();
    assert!(e.iter().any(
        |x| matches!(x, Effect::Metric(MetricUpdate::VmBootDuration { mode, .. }) if mode == "run")
    ));
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.3".into())),
    });
    // Not cloned ⇒ Ready published at once.
    assert!(statuses(&e).iter().any(|(_, s)| published(s)));
}

/// Values the Go daemon reads leniently run here too: an unknown mode is a clone, unparsable
/// storage is left to cocoon's default and never reaches the command line, each with a
/// Warning and a counter.
#[test]
fn values_outside_the_contract_run_as_the_go_daemon_reads_them_with_a_warning() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-tb-shell");
    ann.push((ANN_MODE, "Run".into()));
    ann.push((ANN_STORAGE, "--all".into()));
    ann.push((ANN_OS, "plan9".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    assert!(!events(&e).iter().any(|(r, _)| *r == "ProviderCreateFailed"));
    let warned: Vec<String> = events(&e)
        .into_iter()
        .filter(|(r, _)| *r == "AnnotationFallback")
        .map(|(_, m)| m)
        .collect();
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(warned
        .iter()
        .any(|m| m.contains(ANN_STORAGE) && m.contains("--all")));
    assert!(warned
        .iter()
        .any(|m| m.contains(ANN_OS) && m.contains("plan9")));
    for reason in ["bad_storage", "bad_os"] {
        assert!(has_metric(
            &e,
            &MetricUpdate::PodLifecycle {
                op: "create",
                result: "lenient",
                reason
            }
        ));
    }
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "image pull team/agent:v3");
    let e = h.cocoon(op, Answer::ok(""));
    let (_, cmd) = one_cocoon(&e);
    let run = argv(&cmd);
    assert!(
        run.starts_with("vm run ") && !run.contains("--storage"),
        "{run}"
    );
}

/// force-pull on a clone: a local copy older than the create is pulled again (the pull
/// replaces it), a copy pulled after the create began is cloned as it is.
#[test]
fn force_pull_clones_a_copy_pulled_after_the_create_began() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let local = r#"{"id":"S","name":"team/agent:v3"}"#;
    let pulled = |h: &mut H, e: &[Effect]| -> Vec<Effect> {
        let e = base_manifest(h, e);
        let pop = e
            .iter()
            .find_map(|x| match x {
                Effect::PullSnapshot { op, .. } => Some(*op),
                _ => None,
            })
            .expect("the local copy is pulled again");
        h.feed(Input::TransferDone {
            op: pop,
            result: Ok(String::new()),
        })
    };
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_FORCE_PULL, "true".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    // The copy is there, but from before this create: read the tag and pull.
    let e = h.cocoon(op, Answer::ok(local));
    assert!(cocoon_ops(&e).is_empty(), "no clone of the old copy: {e:?}");
    let e = pulled(&mut h, &e);
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    let e = h.cocoon(op, Answer::ok(local));
    let (_, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm clone "), "{}", argv(&cmd));

    // Without force-pull the same local copy is cloned at once.
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(local));
    let (_, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm clone "), "{}", argv(&cmd));
}

#[test]
fn clone_from_dir_uses_from_dir_and_counts() {
    let mut h = H::new(ProviderConfig {
        clone_from_dir_root: Some("/srv".into()),
        ..Default::default()
    });
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_CLONE_FROM_DIR, "/srv/snap".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    // The daemon walked the directory (`source_check`).
    let op = e
        .iter()
        .find_map(|x| match x {
            Effect::CheckSource { op, .. } => Some(*op),
            _ => None,
        })
        .expect("the directory is checked first");
    let verdict = SourceVerdict::Allowed;
    let e = h.feed(Input::SourceChecked { op, verdict });
    let (op, cmd) = one_cocoon(&e);
    let a = argv(&cmd);
    assert!(a.ends_with("--from-dir /srv/snap"), "{a}");
    assert!(a.contains("--pull"));
    let e = h.cocoon(op, Answer::failed("boom"));
    assert!(has_metric(
        &e,
        &MetricUpdate::CloneFromDir { result: "failed" }
    ));
}

/// An unmanaged pod adopts the VM its id names once cocoon confirms that exact ID and name
/// (nothing is created or changed; the IP is the pod's).
#[test]
fn unmanaged_pod_adopts_preassigned_vm_found_by_its_exact_id() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk(
        "s",
        "u1",
        &[
            (ANN_VM_NAME, "vk-ns-static".into()),
            (ANN_VM_ID, "PRE".into()),
            (ANN_VM_IP, "10.9.9.9".into()),
        ],
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = answer(
        &mut h,
        &e,
        "vm inspect PRE",
        Answer::ok(vm_json(
            "PRE",
            "vk-ns-static",
            "running",
            "02:00:00:00:00:07",
        )),
    );
    assert!(cocoon_ops(&e).is_empty());
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| published(s) && s.pod_ip.as_deref() == Some("10.9.9.9")));
    // Missing IP ⇒ error.
    let mut h = H::new(ProviderConfig::default());
    let p = mk(
        "s",
        "u1",
        &[
            (ANN_VM_NAME, "vk-ns-static".into()),
            (ANN_VM_ID, "PRE".into()),
        ],
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m.contains("missing pre-assigned IP/VMID")));
}

#[test]
fn same_name_recreate_adopts_the_vm_for_the_new_incarnation() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u2",
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
    // Counted once: an adoption is not also a create.
    assert!(!has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: ""
        }
    ));
}

#[test]
fn cpu_class_mismatch_is_rejected() {
    let mut h = H::new(ProviderConfig {
        cpu_class: Some("x86-v3".into()),
        ..Default::default()
    });
    let mut p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    p.spec.as_mut().unwrap().node_selector =
        Some([(SELECTOR_CPU_CLASS.to_string(), "arm-v9".to_string())].into());
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(cocoon_ops(&e).is_empty());
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: "snapshot_cpu_class_mismatch"
        }
    ));
    assert!(events(&e).iter().any(|(r, m)| *r == "ProviderCreateFailed"
        && m == r#"pod ns/a requires snapshot compatibility class "arm-v9" but node cocoon-pool provides "x86-v3""#));
}

#[test]
fn failed_bring_up_removes_the_record_it_left_or_adopts_a_finished_one() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let timed_out = Answer::timed_out_call();
    let e = h.cocoon(op, timed_out.clone());
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect vk-ns-demo-0");
    assert!(
        statuses(&e).is_empty(),
        "failure reported only after the look"
    );
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM7",
            "vk-ns-demo-0",
            "creating",
            "02:00:00:00:00:01",
        )),
    );
    let e = answer(&mut h, &e, "vm rm --force VM7", Answer::ok(""));
    let st = statuses(&e);
    assert_eq!(st[0].1.reason.as_deref(), Some("ProviderFailed"));
    assert!(events(&e).iter().any(|(r, _)| *r == "ProviderCreateFailed"));

    // Second pod: the clone timed out but finished anyway: adopted, no second clone.
    let (op, _) = drive_to_clone(&mut h, mk("b", "u2", &managed("b", "vk-ns-demo-1")));
    let e = h.cocoon(op, timed_out);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(
            "VM8",
            "vk-ns-demo-1",
            "running",
            "02:00:00:00:00:02",
        )),
    );
    let lop = lookup(&e).expect("lease lookup of the adopted VM");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.8".into())),
    });
    assert!(cocoon_ops(&e).is_empty());
    // The adopted VM's id rides on the lifecycle `ready` that follows the Ready status.
    let (sop, _) = statuses(&e)
        .into_iter()
        .find(|(_, s)| published(s))
        .expect("ready publication");
    let e = h.kube_ok(sop);
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some("VM8".into()))));
}

/// The effects of a fresh managed create of `ann` up to its evidence check, and that check's op.
fn evidence_check(h: &mut H, ann: &[(&'static str, String)]) -> OpId {
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", ann))));
    assert!(
        cocoon_ops(&e).is_empty(),
        "nothing runs before the evidence"
    );
    e.iter()
        .find_map(|x| match x {
            Effect::CheckHibernateEvidence { op, vm_name } if vm_name == "vk-ns-demo-0" => {
                Some(*op)
            }
            _ => None,
        })
        .expect("evidence check")
}

fn evidence_failed(e: &[Effect], verdict: &'static str, says: &str) {
    assert!(cocoon_ops(e).is_empty(), "no VM is touched: {e:?}");
    assert!(has_metric(e, &MetricUpdate::HibernateEvidence { verdict }));
    assert!(
        events(e)
            .iter()
            .any(|(r, m)| *r == "HibernateEvidenceFailed" && m.contains(says)),
        "{:?}",
        events(e)
    );
    assert!(!events(e).iter().any(|(r, _)| *r == "CreateBringUpFailed"));
    assert!(statuses(e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("ProviderFailed")));
}

#[test]
fn a_conflicting_hibernate_tag_fails_the_create_closed() {
    let registry = ProviderConfig {
        registry: true,
        ..Default::default()
    };
    let tag = |base: &str| HibernateTag {
        base_image: base.into(),
        snapshot_id: "S1".into(),
        owner_namespace: "ns".into(),
        ..Default::default()
    };
    // Another base image: image_conflict.
    let mut h = H::new(registry.clone());
    let op = evidence_check(&mut h, &managed("a", "vk-ns-demo-0"));
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag("team/agent:v2"))),
    });
    evidence_failed(
        &e,
        "image_conflict",
        "of image team/agent:v2 but the pod asks for team/agent:v3",
    );
    // Retried with backoff; once the tag is gone the fresh bring-up starts.
    let e = h.advance(Duration::from_millis(5));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-demo-0",
        Answer::failed("Error: vm not found"),
    );
    let e = no_evidence(&mut h, &e);
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm fork-vk-ns-demo-0");

    // An explicit clone source: source_conflict.
    let mut h = H::new(registry.clone());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_CLONE_FROM_DIR, "/srv/snap".into()));
    let op = evidence_check(&mut h, &ann);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag(""))),
    });
    evidence_failed(&e, "source_conflict", "explicit clone source");

    // The registry cannot answer: fail closed.
    let mut h = H::new(registry);
    let op = evidence_check(&mut h, &managed("a", "vk-ns-demo-0"));
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Err(TransferError::Transient(
            "get manifest vk-ns-demo-0:hibernate: HTTP 503".into(),
        )),
    });
    evidence_failed(&e, "unavailable", "HTTP 503");
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "HibernateEvidenceUnavailable"));
}

#[test]
fn without_a_registry_an_unreadable_local_snapshot_fails_closed() {
    // An inspect that hangs says nothing either way: fail closed.
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let hung = Answer::timed_out_call();
    let e = answer(&mut h, &e, "snapshot inspect vk-ns-demo-0", hung);
    evidence_failed(&e, "unavailable", "timed out");
}

/// Pods cloning one snapshot at the same time share one `snapshot inspect` (and one image
/// inspect): the later pods wait on the running read and all go on with its answer.
#[test]
fn concurrent_clones_of_one_snapshot_share_the_source_inspect() {
    let mut h = H::new(ProviderConfig::default());
    let mut at_inspect = Vec::new();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let vm = format!("vk-ns-demo-{i}");
        let e = h.feed(Input::PodUpserted(Box::new(mk(
            name,
            &format!("u{i}"),
            &managed(name, &vm),
        ))));
        let e = no_evidence(&mut h, &e);
        let (op, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), format!("snapshot rm fork-{vm}"));
        at_inspect.push(h.cocoon(op, Answer::failed("snapshot not found")));
    }
    // One inspect process for the three pods.
    let (inspect, cmd) = one_cocoon(&at_inspect[0]);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    assert!(cocoon_ops(&at_inspect[1]).is_empty());
    assert!(cocoon_ops(&at_inspect[2]).is_empty());

    let snap = r#"{"id":"S","name":"team/agent:v3","hypervisor":"cloud-hypervisor",
        "image":"ubuntu:24.04","image_digest":"sha256:ab"}"#;
    let e = h.cocoon(inspect, Answer::ok(snap));
    let image_inspects: Vec<_> = cocoon_ops(&e)
        .into_iter()
        .filter(|(_, c)| argv(c) == "image inspect sha256:ab")
        .collect();
    assert_eq!(image_inspects.len(), 1, "{e:?}");
    let e = h.cocoon(image_inspects[0].0, Answer::ok("{}"));
    let mut clones: Vec<String> = cocoon_ops(&e)
        .iter()
        .map(|(_, c)| argv(c))
        .filter(|a| a.starts_with("vm clone"))
        .map(|a| a.split(' ').nth(5).unwrap_or_default().to_string())
        .collect();
    clones.sort();
    assert_eq!(clones, ["vk-ns-demo-0", "vk-ns-demo-1", "vk-ns-demo-2"]);
    // The next pod after the read ended takes the kept answers (nothing changed them): it
    // clones at once. Once they aged out it reads again.
    for (name, uid, vm, wait, first) in [
        ("d", "u3", "vk-ns-demo-3", 0, "vm clone"),
        (
            "e",
            "u4",
            "vk-ns-demo-4",
            31,
            "snapshot inspect team/agent:v3",
        ),
    ] {
        h.now += Duration::from_secs(wait);
        h.wall += Duration::from_secs(wait);
        let e = h.feed(Input::PodUpserted(Box::new(mk(
            name,
            uid,
            &managed(name, vm),
        ))));
        let e = no_evidence(&mut h, &e);
        let (op, _) = one_cocoon(&e);
        let e = h.cocoon(op, Answer::ok(""));
        let (_, cmd) = one_cocoon(&e);
        assert!(argv(&cmd).starts_with(first), "{}", argv(&cmd));
    }
}

#[test]
fn an_answer_the_create_step_does_not_expect_fails_it_with_a_warning_and_a_retry() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(&mut h, &e);
    // The step waits on `snapshot rm fork-*`; a lease answer arrives under its op id instead.
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm fork-vk-ns-demo-0");
    let e = h.feed(Input::LeaseLooked {
        op,
        result: Ok(None),
    });
    let warned = events(&e);
    assert!(
        warned
            .iter()
            .any(|(r, m)| *r == "UnexpectedAnswer" && m.contains("RmFork")),
        "{warned:?}"
    );
    assert!(cocoon_ops(&e).is_empty(), "no step runs on a wrong answer");
    // The create is retried on the pod's backoff: it begins again with the evidence check.
    let e = h.advance(Duration::from_secs(2));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect vk-ns-demo-0");
}

/// A pod with only a VM name is unmanaged without its pre-assigned ID / IP: rejected. Our own
/// lifecycle writes coming back as MODIFIED are not a change, so it stays rejected with one
/// Warning until its spec really changes.
#[test]
fn a_rejected_pod_stays_rejected_through_its_own_annotation_writes() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &[(ANN_VM_NAME, "vk-ns-v".into())]);
    let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
    let warnings = |e: &[Effect]| {
        events(e)
            .iter()
            .filter(|(r, _)| *r == "ProviderCreateFailed")
            .count()
    };
    assert_eq!(warnings(&e), 1, "{e:?}");
    // Play our annotation writes back as the API would, a few rounds.
    let mut seen = p;
    let mut e = e;
    for _ in 0..5 {
        for (op, ann) in annotation_patches(&e) {
            let a = seen
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            for (k, v) in ann {
                match v {
                    Some(v) => a.insert(k, v),
                    None => a.remove(&k),
                };
            }
            h.kube_ok(op);
        }
        for (op, _) in statuses(&e) {
            h.kube_ok(op);
        }
        e = h.feed(Input::PodUpserted(Box::new(seen.clone())));
        assert_eq!(warnings(&e), 0, "a rejected pod is warned once: {e:?}");
        assert!(
            annotation_patches(&e).is_empty(),
            "no lifecycle flip: {e:?}"
        );
    }
    // A real change (the pre-assigned ID and IP) is looked at again.
    let a = seen
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    a.insert(ANN_VM_ID.into(), "vm-1".into());
    a.insert(ANN_VM_IP.into(), "10.0.0.5".into());
    let e = h.feed(Input::PodUpserted(Box::new(seen)));
    assert_eq!(warnings(&e), 0, "{e:?}");
    assert!(
        statuses(&e)
            .iter()
            .all(|(_, s)| s.reason.as_deref() != Some("ProviderFailed")),
        "{e:?}"
    );
}

/// Two pods cloning one snapshot the node lacks: one pull at a time (each pull replaces the
/// local snapshot); the second pod waits and clones from the snapshot the first pulled.
#[test]
fn one_pull_per_snapshot_at_a_time_later_pods_wait_for_it() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let pulls = |e: &[Effect]| {
        e.iter()
            .filter_map(|x| match x {
                Effect::PullSnapshot { op, .. } => Some(*op),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // Drive each pod to its snapshot inspect, answered "not found".
    let mut first_pull = None;
    for (name, vm) in [("a", "vk-ns-demo-0"), ("b", "vk-ns-demo-1")] {
        let e = h.feed(Input::PodUpserted(Box::new(mk(
            name,
            &format!("u-{name}"),
            &managed(name, vm),
        ))));
        let e = no_evidence(&mut h, &e);
        let e = answer(
            &mut h,
            &e,
            &format!("snapshot rm fork-{vm}"),
            Answer::ok(""),
        );
        let e = answer(
            &mut h,
            &e,
            "snapshot inspect team/agent:v3",
            Answer::failed("snapshot not found"),
        );
        let e = if name == "a" {
            base_manifest(&mut h, &e)
        } else {
            e
        };
        let p = pulls(&e);
        if name == "a" {
            assert_eq!(p.len(), 1, "{e:?}");
            first_pull = p.first().copied();
        } else {
            assert!(p.is_empty(), "a second pull of the same snapshot: {e:?}");
        }
    }
    // While the pull runs, the waiting pod looks again and waits on.
    let e = h.advance(Duration::from_millis(500));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::failed("snapshot not found"),
    );
    assert!(pulls(&e).is_empty(), "{e:?}");
    // The pull lands: the puller inspects, the waiter's next look finds it and clones.
    let e = h.feed(Input::TransferDone {
        op: first_pull.expect("first pull"),
        result: Ok(String::new()),
    });
    let snap = r#"{"id":"S","name":"team/agent:v3","hypervisor":"cloud-hypervisor"}"#;
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(snap),
    );
    assert!(argv(&one_cocoon(&e).1).starts_with("vm clone --output json --name vk-ns-demo-0"));
    let e = h.advance(Duration::from_millis(500));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(snap),
    );
    assert!(pulls(&e).is_empty());
    assert!(argv(&one_cocoon(&e).1).starts_with("vm clone --output json --name vk-ns-demo-1"));
}

fn pid_file_read(e: &[Effect]) -> Option<(OpId, String, bool)> {
    e.iter().find_map(|x| match x {
        Effect::ReadVmPid {
            op,
            vm_id,
            firecracker,
        } => Some((*op, vm_id.clone(), *firecracker)),
        _ => None,
    })
}

/// A clone answering PID 0 as cocoon's does; the create's effects after that answer.
fn clone_with_pid_0(h: &mut H) -> Vec<Effect> {
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let (op, _) = drive_to_clone(h, p);
    let json = vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01")
        .replace(r#""pid":42"#, r#""pid":0"#);
    h.cocoon(op, Answer::ok(json))
}

#[test]
fn a_clone_answered_with_pid_0_takes_the_pid_from_the_hypervisor_pid_file() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_with_pid_0(&mut h);
    assert!(cocoon_ops(&e).is_empty(), "no vm inspect: {e:?}");
    let (op, vm_id, firecracker) = pid_file_read(&e).expect("a pid file read");
    assert_eq!((vm_id.as_str(), firecracker), ("VM1", false));
    let e = h.feed(Input::VmPidRead {
        op,
        pid: PidFile::Live(4242),
    });
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    let op = lookup(&e).expect("the bring-up goes on");
    h.feed(Input::LeaseLooked {
        op,
        result: Ok(Some("10.0.0.9".into())),
    });
    let key = PodKey::new("ns", "a");
    assert_eq!(h.p.pod_vm(&key).map(|v| v.pid), Some(4242));
}

#[test]
fn without_the_vms_run_directory_cocoon_is_asked_once() {
    for answer_of_file in [PidFile::NoRunDir, PidFile::Dead] {
        let mut h = H::new(ProviderConfig::default());
        let e = clone_with_pid_0(&mut h);
        let (op, _, _) = pid_file_read(&e).expect("a pid file read");
        let e = h.feed(Input::VmPidRead {
            op,
            pid: answer_of_file,
        });
        let e = answer(
            &mut h,
            &e,
            "vm inspect VM1",
            Answer::ok(vm_json(
                "VM1",
                "vk-ns-demo-0",
                "running",
                "02:00:00:00:00:01",
            )),
        );
        assert!(cocoon_ops(&e).is_empty(), "one inspect only: {e:?}");
        let op = lookup(&e).expect("the bring-up goes on");
        h.feed(Input::LeaseLooked {
            op,
            result: Ok(Some("10.0.0.9".into())),
        });
        let key = PodKey::new("ns", "a");
        assert_eq!(h.p.pod_vm(&key).map(|v| v.pid), Some(42));
    }
}

/// cocoon's `pid` comes from the PID file: with the run directory there and no file in it, an
/// inspect would say pid 0 as well, so none is run.
#[test]
fn with_the_run_directory_but_no_pid_file_no_inspect_runs() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_with_pid_0(&mut h);
    let (op, _, _) = pid_file_read(&e).expect("a pid file read");
    let e = h.feed(Input::VmPidRead {
        op,
        pid: PidFile::NoFile,
    });
    assert!(cocoon_ops(&e).is_empty(), "no vm inspect: {e:?}");
    let op = lookup(&e).expect("the bring-up goes on");
    h.feed(Input::LeaseLooked {
        op,
        result: Ok(Some("10.0.0.9".into())),
    });
    let key = PodKey::new("ns", "a");
    assert_eq!(h.p.pod_vm(&key).map(|v| v.pid), Some(0));
    assert_eq!(
        h.p.pod_vm(&key).map(|v| v.id.clone()).as_deref(),
        Some("VM1")
    );
}

/// A clone that exits 0 with no VM record (no id) is looked up by name once: the VM it made is
/// the pod's when it runs.
#[test]
fn a_clone_answer_without_an_id_falls_back_to_one_inspect_by_name() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let (op, _) = drive_to_clone(&mut h, p);
    let e = h.cocoon(op, Answer::ok(r#"{"id":"","state":"running","pid":0}"#));
    let e = answer(
        &mut h,
        &e,
        "vm inspect vk-ns-demo-0",
        Answer::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    assert!(cocoon_ops(&e).is_empty(), "one inspect only: {e:?}");
    let op = lookup(&e).expect("the bring-up goes on");
    h.feed(Input::LeaseLooked {
        op,
        result: Ok(Some("10.0.0.9".into())),
    });
    let key = PodKey::new("ns", "a");
    assert_eq!(
        h.p.pod_vm(&key).map(|v| v.id.clone()).as_deref(),
        Some("VM1")
    );
    assert_eq!(h.p.pod_vm(&key).map(|v| v.pid), Some(42));
}
