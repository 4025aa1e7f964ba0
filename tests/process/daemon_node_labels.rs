//! The Node's labels as others see them across a restart: a label set with the real kubectl
//! survives the daemon's restart and its label update, which goes out as a JSON merge patch.

use std::process::Command;
use std::time::Duration;

use crate::daemon_support::{World, NODE};

const KUBECTL: &str = "/usr/bin/kubectl";

fn node_label(w: &World, key: &str) -> Option<String> {
    w.api.get_node(NODE)?.metadata.labels?.get(key).cloned()
}

#[test]
fn a_label_set_with_kubectl_survives_a_restart_that_changes_the_pool() {
    if !std::path::Path::new(KUBECTL).exists() {
        eprintln!("SKIP: {KUBECTL} missing (.ci/run installs it)");
        return;
    }
    let mut w = World::new();
    w.start_daemon();
    w.wait("node registered", Duration::from_secs(30), || {
        node_label(&w, "cocoonstack.io/pool").filter(|p| p == "default")
    });
    let out = Command::new(KUBECTL)
        .arg("--kubeconfig")
        .arg(w.path("kubeconfig"))
        .args([
            "--request-timeout",
            "30s",
            "label",
            "node",
            NODE,
            "team=blue",
        ])
        .output()
        .expect("run kubectl");
    assert!(out.status.success(), "kubectl label: {out:?}");
    assert_eq!(node_label(&w, "team").as_deref(), Some("blue"));

    w.kill_daemon();
    w.api.clear_requests();
    w.extra_env.push(("VK_NODE_POOL".into(), "pool-b".into()));
    w.start_daemon();
    w.wait("pool label updated", Duration::from_secs(30), || {
        node_label(&w, "cocoonstack.io/pool").filter(|p| p == "pool-b")
    });
    assert_eq!(
        node_label(&w, "team").as_deref(),
        Some("blue"),
        "kubectl's label kept"
    );
    let node_writes: Vec<(String, Option<String>)> = w
        .api
        .requests()
        .into_iter()
        .filter(|r| r.resource == "nodes" && r.method != "GET")
        .map(|r| (r.method, r.content_type))
        .collect();
    assert!(
        !node_writes.is_empty()
            && node_writes.iter().all(
                |(m, ct)| m == "PATCH" && ct.as_deref() == Some("application/merge-patch+json")
            ),
        "node writes: {node_writes:?}"
    );
}
