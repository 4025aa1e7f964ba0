//! Process test of the snapshot CPU-class gate through the real binary: a pod that needs
//! another class is refused at create and gets no VM; after a restart with another node class
//! a running pod of the old class is adopted (its VM kept) with a Warning
//! `SnapshotCPUClassMismatch`, and its updates are refused until the class is fixed.

use crate::daemon_support;

use std::time::Duration;

use daemon_support::{
    annotation, metric_value, phase, running_with_vm, set_hibernate, wait_warning, World,
};
use k8s_openapi::api::core::v1::Pod;
use vk_cocoon::sandbox::demo_pod;

const LIMIT: Duration = Duration::from_secs(60);
const SELECTOR: &str = "cocoonstack.io/snapshot-cpu-class";

fn pod_of_class(name: &str, class: &str) -> Pod {
    let mut p = demo_pod("default", name, "clone", "base");
    if let Some(spec) = p.spec.as_mut() {
        spec.node_selector = Some([(SELECTOR.to_string(), class.to_string())].into());
    }
    p
}

fn set_class(w: &mut World, class: &str) {
    w.extra_env.retain(|(k, _)| k != "VK_SNAPSHOT_CPU_CLASS");
    w.extra_env
        .push(("VK_SNAPSHOT_CPU_CLASS".into(), class.into()));
}

#[test]
fn the_cpu_class_gate_refuses_creates_and_updates_and_adopts_mismatched_vms_at_start() {
    let mut w = World::new();
    w.seed_snapshot("base");
    set_class(&mut w, "epyc-a");
    w.start_daemon();
    w.api
        .create_pod(&pod_of_class("foreign", "epyc-b"))
        .expect("create pod");
    w.api
        .create_pod(&pod_of_class("native", "epyc-a"))
        .expect("create pod");
    let (_, native_id) = w.wait("native Running", LIMIT, || running_with_vm(&w, "native"));
    let status = w.wait("foreign refused", LIMIT, || {
        let s = w.pod("foreign")?.status?;
        (s.reason.as_deref() == Some("ProviderFailed")).then_some(s)
    });
    let msg = status.message.unwrap_or_default();
    assert!(
        msg.contains("epyc-b") && msg.contains("epyc-a"),
        "the refusal names both classes: {msg}"
    );
    wait_warning(&w, "foreign", "ProviderCreateFailed", "epyc-b");
    assert!(
        !w.vms().contains_key("vk-default-foreign"),
        "no VM for a refused pod"
    );
    let refused = metric_value(
        &w.metrics(),
        "vk_cocoon_pod_lifecycle_total{op=\"create\",reason=\"snapshot_cpu_class_mismatch\",result=\"failed\"}",
    );
    assert!(refused.unwrap_or(0.0) >= 1.0, "counted: {refused:?}");

    // The node's class changes under a running pod: kept and adopted, loudly.
    w.kill_daemon();
    set_class(&mut w, "epyc-c");
    w.start_daemon();
    let msg = wait_warning(&w, "native", "SnapshotCPUClassMismatch", "epyc-c");
    eprintln!("Warning SnapshotCPUClassMismatch: {msg}");
    let (p, id) = running_with_vm(&w, "native").expect("native still Running");
    assert_eq!(id, native_id, "the VM is adopted, not replaced");
    assert_eq!(phase(&p), "Running");
    assert!(
        w.log().contains("1 pods adopted"),
        "{}",
        daemon_support::tail(&w.log(), 20)
    );

    // Its updates are refused: a hibernate request leaves the VM running.
    set_hibernate(&w, "native", true);
    wait_warning(&w, "native", "ProviderUpdateFailed", "epyc-c");
    assert_eq!(
        w.vms()
            .get("vk-default-native")
            .map(|(i, s)| (i.clone(), s.clone())),
        Some((native_id, "running".into())),
        "no hibernate on a node of another class"
    );
    let p = w.pod("native").expect("pod");
    assert_ne!(
        annotation(&p, "vm.cocoonstack.io/lifecycle-state").as_deref(),
        Some("hibernated")
    );
}
