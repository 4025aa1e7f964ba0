//! Process tier, VM ownership: the real binary refuses a pod that names or identifies another
//! live pod's VM, and nothing done to the refused pod reaches the owner's VM.
//!
//! Waits poll the fake API server until a condition holds; deadlines are failure bounds.

use crate::daemon_support;

use daemon_support::{annotation, phase, running_with_vm, World, SETTLE_LIMIT};
use k8s_openapi::api::core::v1::Pod;
use vk_cocoon::sandbox::demo_pod;

fn pod_in(ns: &str, name: &str, vm_name: &str) -> Pod {
    let mut p = demo_pod(ns, name, "clone", "base");
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.insert("vm.cocoonstack.io/name".into(), vm_name.into());
    }
    p
}

/// HTTP status and body of a kubelet API call (auth off, self-signed certificate). `extra`
/// adds curl arguments (headers for an upgrade).
fn kubelet_call(w: &World, path: &str, extra: &[&str]) -> (String, String) {
    let out = std::process::Command::new("curl")
        .args(["-sk", "--max-time", "3", "-o", "-", "-w", "\n%{http_code}"])
        .args(extra)
        .arg(format!("https://127.0.0.1:{}{path}", w.kubelet_port))
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.to_string(), body.to_string())
}

fn failed_with_warning(w: &World, ns: &str, name: &str) -> Option<()> {
    let p = w.api.get_pod(ns, name)?;
    let msg = p
        .status
        .as_ref()
        .and_then(|s| s.message.clone())
        .unwrap_or_default();
    let warned = w.api.list_objects("events").iter().any(|e| {
        e["involvedObject"]["name"] == name
            && e["involvedObject"]["namespace"] == ns
            && e["type"] == "Warning"
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains("owned by another pod"))
    });
    (phase(&p) == "Failed" && msg.contains("owned by another pod") && warned).then_some(())
}

#[test]
fn a_pod_naming_another_namespaces_vm_is_refused_and_cannot_reach_it() {
    let mut w = World::new();
    w.extra_env.push(("VK_KUBELET_AUTH".into(), "off".into()));
    w.seed_snapshot("base");
    w.start_daemon();
    // `vk-default-x-app` is a VM name of `default` (pod `x-app`) and of `default-x`.
    w.api
        .create_pod(&pod_in("default", "victim", "vk-default-x-app"))
        .expect("create victim");
    let (_, victim_vm) = w.wait("victim Running", SETTLE_LIMIT, || {
        running_with_vm(&w, "victim")
    });

    w.api
        .create_pod(&pod_in("default-x", "attacker", "vk-default-x-app"))
        .expect("create attacker");
    w.wait("attacker Failed with a Warning", SETTLE_LIMIT, || {
        failed_with_warning(&w, "default-x", "attacker")
    });
    let attacker = w
        .api
        .get_pod("default-x", "attacker")
        .expect("attacker pod");
    assert_eq!(annotation(&attacker, "vm.cocoonstack.io/id"), None);
    assert!(w.metrics().contains("reason=\"vm_owned_by_another_pod\""));

    // Logs and exec on the attacker do not reach the victim's VM.
    let (code, body) = kubelet_call(&w, "/containerLogs/default-x/attacker/agent", &[]);
    assert!(
        body.contains("no live VM") || code != "200",
        "logs: {code} {body}"
    );
    let (code, body) = kubelet_call(
        &w,
        "/exec/default-x/attacker/agent?command=cat&command=/etc/secret&stdout=1",
        &[
            "-H",
            "Connection: Upgrade",
            "-H",
            "Upgrade: websocket",
            "-H",
            "Sec-WebSocket-Version: 13",
            "-H",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            "-H",
            "Sec-WebSocket-Protocol: v4.channel.k8s.io",
        ],
    );
    assert_ne!(code, "101", "exec upgraded for the attacker: {body}");

    // Deleting the attacker leaves the victim's VM running and the victim in place.
    w.api
        .delete_pod("default-x", "attacker", Some(30))
        .expect("delete attacker");
    w.wait("attacker gone", SETTLE_LIMIT, || {
        w.api
            .get_pod("default-x", "attacker")
            .is_none()
            .then_some(())
    });
    let vms = w.vms();
    assert_eq!(
        vms.get("vk-default-x-app"),
        Some(&(victim_vm.clone(), "running".to_string())),
        "the victim's VM is untouched"
    );
    let victim = w.pod("victim").expect("victim still there");
    assert_eq!(phase(&victim), "Running");
    assert!(!w
        .log()
        .lines()
        .any(|l| l.contains("vm rm") && l.contains(&victim_vm)));
}

#[test]
fn an_unmanaged_pod_carrying_another_pods_vm_id_is_refused() {
    let mut w = World::new();
    w.extra_env.push(("VK_KUBELET_AUTH".into(), "off".into()));
    w.seed_snapshot("base");
    w.start_daemon();
    w.api
        .create_pod(&pod_in("default", "victim", "vk-default-victim"))
        .expect("create victim");
    let (_, victim_vm) = w.wait("victim Running", SETTLE_LIMIT, || {
        running_with_vm(&w, "victim")
    });
    let mut thief = pod_in("evil", "thief", "vk-evil-thief");
    if let Some(a) = thief.metadata.annotations.as_mut() {
        a.remove("cocoonset.cocoonstack.io/managed");
        a.insert("vm.cocoonstack.io/id".into(), victim_vm.clone());
        a.insert("vm.cocoonstack.io/ip".into(), "127.88.0.200".into());
    }
    w.api.create_pod(&thief).expect("create thief");
    w.wait("thief Failed with a Warning", SETTLE_LIMIT, || {
        failed_with_warning(&w, "evil", "thief")
    });
    let (code, body) = kubelet_call(&w, "/containerLogs/evil/thief/agent", &[]);
    assert!(
        body.contains("no live VM") || code != "200",
        "logs: {code} {body}"
    );
    w.api
        .delete_pod("evil", "thief", Some(30))
        .expect("delete thief");
    w.wait("thief gone", SETTLE_LIMIT, || {
        w.api.get_pod("evil", "thief").is_none().then_some(())
    });
    assert_eq!(
        w.vms().get("vk-default-victim").map(|v| v.0.clone()),
        Some(victim_vm)
    );
    assert_eq!(phase(&w.pod("victim").expect("victim")), "Running");
}
