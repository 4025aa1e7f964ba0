//! The daemon binary's peer snapshot listener, end to end: the daemon hibernates a pod (it
//! pushes the tag and records the manifest digest), then serves the snapshot over TLS to
//! another cluster node that presents its node certificate and names that digest, also after
//! a restart; a caller without a node certificate, naming another digest, speaking plain HTTP
//! or at an address that is no Node's gets nothing, and each refusal is counted.

use crate::daemon_support;
use crate::peer_support;

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use daemon_support::{
    annotation, free_ports, metric_value, phase, running_with_vm, set_hibernate, World,
};
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use peer_support::{plain_get, tls_get, with_certificate, without_certificate};
use vk_cocoon::peer::client::SLICE_STREAMS;
use vk_cocoon::peer::{restore, PeerRestore};
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::snapshots::client::sha256_digest;
use vk_cocoon::snapshots::manifest_info;

const LIMIT: Duration = Duration::from_secs(90);
const POD: &str = "p0";
const VM: &str = "vk-default-p0";

fn node(name: &str, ip: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: ip.into(),
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn refused(a: &World, reason: &str) -> f64 {
    let line =
        format!("vk_cocoon_connections_refused_total{{listener=\"peer\",reason=\"{reason}\"}}");
    metric_value(&a.metrics(), &line).unwrap_or(0.0)
}

#[test]
fn another_node_restores_a_snapshot_the_daemon_pushed_from_its_peer_listener() {
    let [peer_port] = free_ports();
    let mut a = World::dhcp();
    a.extra_env
        .push(("VK_PEER_ADDR".into(), format!("127.0.0.1:{peer_port}")));
    // The cluster: node-b at 127.0.0.2 restores; 127.0.0.3 is no node.
    a.api.create_node(&node("node-b", "127.0.0.2")).unwrap();
    a.seed_snapshot("base");
    a.start_daemon();
    let listening = format!("peer snapshot listener on https://127.0.0.1:{peer_port}");
    let log = a.wait("the peer listener", LIMIT, || {
        let log = a.log();
        log.contains(&listening).then_some(log)
    });
    assert!(log.contains("TLS only") && log.contains("system:node:<node>"));

    // The daemon hibernates the pod: it pushes VM:hibernate and records its manifest digest.
    a.api
        .create_pod(&demo_pod("default", POD, "clone", "base"))
        .expect("create pod");
    a.wait("pod Running", LIMIT, || running_with_vm(&a, POD));
    set_hibernate(&a, POD, true);
    a.wait("hibernated", LIMIT, || {
        let p = a.pod(POD)?;
        let done = annotation(&p, "vm.cocoonstack.io/lifecycle-state").as_deref()
            == Some("hibernated")
            && phase(&p) == "Pending"
            && !a.vms().contains_key(VM);
        done.then_some(())
    });
    let (ok, out) = a.cocoon(&["snapshot", "inspect", VM]);
    assert!(ok, "{out}");
    let snap: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = snap["id"].as_str().unwrap().to_string();

    let b = tempfile::tempdir().unwrap();
    let staging = b.path().join("staging");
    let peer = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), peer_port);
    // What the registry says of the tag: the restore names its digest and is checked against
    // its config and layers.
    let tag = manifest_info(&a.registry_client(), VM, "hibernate")
        .unwrap()
        .unwrap();
    let expected = tag.config.clone().unwrap();
    assert_eq!(expected.snapshot_id, id);
    let node_b = a
        .api
        .issue_client_cert_with_groups("system:node:node-b", &["vk-cocoon:nodes"])
        .unwrap();
    let req = |source: [u8; 4], digest: &str| PeerRestore {
        peer,
        source: Some(IpAddr::from(source)),
        snapshot: VM.into(),
        local_name: VM.into(),
        expected: expected.clone(),
        layers: tag.layers.clone(),
        manifest_digest: digest.into(),
        tls: with_certificate(&node_b),
        staging_root: staging.clone(),
        streams: SLICE_STREAMS,
    };
    // The daemon looks node-b up when it first calls; the listener may take a moment to start.
    let staged = a.wait("the restore from node-b", LIMIT, || {
        restore(&req([127, 0, 0, 2], &tag.digest)).ok()
    });
    let served = a.path(&format!("state/snapshots/{id}"));
    for name in ["memory-ranges", "config.json", "cow.raw", "state.json"] {
        assert_eq!(
            std::fs::read(served.join(name)).unwrap(),
            std::fs::read(staged.dir.join(name)).unwrap(),
            "{name}"
        );
    }

    // node-b's cocoon clones from the staged directory.
    std::fs::create_dir_all(b.path().join("state")).unwrap();
    let out = Command::new(a.path("bin/cocoon"))
        .args([
            "vm",
            "clone",
            "--output",
            "json",
            "--name",
            VM,
            "--from-dir",
        ])
        .arg(&staged.dir)
        .env("FAKE_COCOON_STATE", b.path().join("state"))
        .env("COCOON_ROOT_DIR", b.path().join("root"))
        .env("FAKE_COCOON_NO_PROCESS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let vm: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(vm["state"], "running");

    // Refused callers: nothing staged, no snapshot byte answered, each counted.
    let before = std::fs::read_dir(&staging).unwrap().count();
    let other = sha256_digest(b"another manifest");
    let err = restore(&req([127, 0, 0, 2], &other))
        .unwrap_err()
        .to_string();
    assert!(err.contains("404"), "another digest: {err}");
    let err = restore(&req([127, 0, 0, 3], &tag.digest))
        .unwrap_err()
        .to_string();
    assert!(!err.is_empty(), "not a node's address");
    assert_eq!(std::fs::read_dir(&staging).unwrap().count(), before);
    let plan = format!("/v1/snapshot-plan?name={VM}&digest={}", tag.digest);
    let r = tls_get(peer, "127.0.0.2", &without_certificate(), &plan);
    assert!(r.starts_with("TLS error"), "no client certificate: {r}");
    let r = plain_get(peer, "127.0.0.2", &plan);
    assert!(
        r.starts_with("HTTP/1.1 400") && !r.contains(&id),
        "plain HTTP: {r}"
    );
    let r = tls_get(peer, "127.0.0.2", &with_certificate(&node_b), &plan);
    assert!(r.starts_with("HTTP/1.1 200") && r.contains(&id), "{r}");
    for reason in ["not_a_node", "not_a_node_certificate", "plain_http"] {
        a.wait(reason, LIMIT, || (refused(&a, reason) > 0.0).then_some(()));
    }

    // The record survives a restart: the snapshot is still served to the right digest only.
    a.kill_daemon();
    a.start_daemon();
    a.wait("the restore after a restart", LIMIT, || {
        restore(&req([127, 0, 0, 2], &tag.digest)).ok()
    });
    let r = tls_get(
        peer,
        "127.0.0.2",
        &with_certificate(&node_b),
        &format!("/v1/snapshot-plan?name={VM}&digest={other}"),
    );
    assert!(r.starts_with("HTTP/1.1 404") && !r.contains(&id), "{r}");
}
