//! Transition tests of the snapshot CPU-class gate at startup reconcile and on update (the
//! create gate is in `create`): the contract's messages, the counter, a Warning, no lost VM.

use super::*;

fn with_class(mut p: Pod, class: &str) -> Pod {
    p.spec.as_mut().unwrap().node_selector =
        Some([(SELECTOR_CPU_CLASS.to_string(), class.to_string())].into());
    p
}

fn node(class: Option<&str>) -> H {
    H {
        p: Provider::new(ProviderConfig {
            cpu_class: class.map(str::to_string),
            ..Default::default()
        }),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    }
}

fn gate_metric(op: &'static str) -> MetricUpdate {
    MetricUpdate::PodLifecycle {
        op,
        result: "failed",
        reason: "snapshot_cpu_class_mismatch",
    }
}

#[test]
fn startup_keeps_and_adopts_the_vm_of_a_mismatched_pod_and_reports_it() {
    // The node's class changed since the pod was placed here (VK_SNAPSHOT_CPU_CLASS edited).
    let mut h = node(Some("x86-v4"));
    let mut a = managed("a", "vk-ns-demo-0");
    a.push((ANN_VM_ID, "V1".into()));
    a.push((ANN_LIFECYCLE_STATE, "ready".into()));
    let pods = vec![
        with_class(mk("a", "u1", &a), "x86-v3"),
        with_class(mk("b", "u2", &managed("b", "vk-ns-demo-1")), "x86-v4"),
    ];
    let vms = vec![
        vm_info("V1", "vk-ns-demo-0", "running"),
        vm_info("V2", "vk-ns-demo-1", "running"),
    ];
    let e = h.feed(Input::StartupListed {
        pods,
        vms,
        owners: owned_vms(&[("vk-ns-demo-1", "ns")]),
    });
    assert!(h.p.is_started());
    // No VM destroyed, both adopted.
    assert!(
        !cocoon_ops(&e)
            .iter()
            .any(|(_, c)| argv(c).starts_with("vm rm")),
        "{e:?}"
    );
    assert_eq!(
        h.p.pod_vm(&PodKey::new("ns", "a")).map(|v| v.id.as_str()),
        Some("V1")
    );
    assert_eq!(
        h.p.pod_vm(&PodKey::new("ns", "b")).map(|v| v.id.as_str()),
        Some("V2")
    );
    // Reported once, for the mismatched pod only, in the contract's words.
    let warned: Vec<_> = events(&e)
        .into_iter()
        .filter(|(r, _)| *r == "SnapshotCPUClassMismatch")
        .collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].1.starts_with(
        r#"pod ns/a requires snapshot compatibility class "x86-v3" but node cocoon-pool provides "x86-v4""#
    ));
    let counted = e
        .iter()
        .filter(|x| matches!(x, Effect::Metric(m) if *m == gate_metric("startup")))
        .count();
    assert_eq!(counted, 1);
}

#[test]
fn startup_on_an_unclassified_node_reports_it_and_leaves_vmless_pods_to_the_create_gate() {
    let mut h = node(None);
    let mut a = managed("a", "vk-ns-demo-0");
    a.push((ANN_VM_ID, "V1".into()));
    let pods = vec![
        with_class(mk("a", "u1", &a), "x86-v3"),
        with_class(mk("c", "u3", &managed("c", "vk-ns-demo-2")), "x86-v3"),
    ];
    let e = h.feed(Input::StartupListed {
        pods,
        vms: vec![vm_info("V1", "vk-ns-demo-0", "running")],
        owners: Default::default(),
    });
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "SnapshotCPUClassMismatch"
            && m.contains(r#"class "x86-v3" but node cocoon-pool is unclassified"#)));
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_some());
    // The pod with no VM reaches its create, which refuses it without touching cocoon.
    assert!(has_metric(&e, &gate_metric("create")));
    assert!(!cocoon_ops(&e)
        .iter()
        .any(|(_, c)| argv(c).contains("vk-ns-demo-2")));
    assert!(h.p.pod_vm(&PodKey::new("ns", "c")).is_none());
}

#[test]
fn an_update_of_a_mismatched_pod_is_refused_with_a_warning_once_per_change() {
    let mut h = node(Some("x86-v4"));
    let mut a = managed("a", "vk-ns-demo-0");
    a.push((ANN_VM_ID, "V1".into()));
    a.push((ANN_LIFECYCLE_STATE, "ready".into()));
    let p = with_class(mk("a", "u1", &a), "x86-v3");
    h.feed(Input::StartupListed {
        pods: vec![p.clone()],
        vms: vec![vm_info("V1", "vk-ns-demo-0", "running")],
        owners: Default::default(),
    });
    // A hibernate request: refused, nothing started, the VM stays.
    let mut hib = p.clone();
    hib.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_HIBERNATE.into(), "true".into());
    let e = h.feed(Input::PodUpserted(Box::new(hib.clone())));
    assert!(has_metric(&e, &gate_metric("update")));
    assert!(events(&e).iter().any(|(r, m)| *r == "ProviderUpdateFailed"
        && m == r#"pod ns/a requires snapshot compatibility class "x86-v3" but node cocoon-pool provides "x86-v4""#));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert!(!events(&e).iter().any(|(r, _)| *r == "HibernateUnsupported"));
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_some());
    // The same copy again (a status write of ours coming back) is not refused twice.
    let e = h.feed(Input::PodUpserted(Box::new(hib)));
    assert!(!has_metric(&e, &gate_metric("update")), "{e:?}");

    // On a node of the right class the same update goes through the gate.
    let mut h = node(Some("x86-v3"));
    h.feed(Input::StartupListed {
        pods: vec![p.clone()],
        vms: vec![vm_info("V1", "vk-ns-demo-0", "running")],
        owners: Default::default(),
    });
    let mut gen = p;
    gen.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_GENERATION.into(), "2".into());
    let e = h.feed(Input::PodUpserted(Box::new(gen)));
    assert!(!has_metric(&e, &gate_metric("update")), "{e:?}");
}
