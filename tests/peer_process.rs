//! The daemon binary's peer snapshot listener, end to end: a daemon serves a snapshot its
//! (fake) cocoon saved to another cluster node, whose restore stages it for
//! `cocoon vm clone --from-dir`; an address that is no Node's InternalIP is refused and counted.

mod daemon_support;

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use daemon_support::{free_ports, World, SETTLE_LIMIT};
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use vk_cocoon::peer::client::SLICE_STREAMS;
use vk_cocoon::peer::{restore, PeerRestore};
use vk_cocoon::snapshots::manifest_info;

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

#[test]
fn another_node_restores_a_snapshot_from_the_daemons_peer_listener() {
    let [peer_port] = free_ports();
    let mut a = World::new();
    a.extra_env
        .push(("VK_PEER_ADDR".into(), format!("127.0.0.1:{peer_port}")));
    // The cluster: node-b at 127.0.0.2 restores; 127.0.0.3 is no node.
    a.api.create_node(&node("node-b", "127.0.0.2")).unwrap();
    a.seed_snapshot("vk-demo-hib");
    // Hibernated and pushed: the registry vouches for it, so the reclaimer keeps it.
    a.push_snapshot("vk-demo-hib", "hibernate", "");
    let (ok, out) = a.cocoon(&["snapshot", "inspect", "vk-demo-hib"]);
    assert!(ok, "{out}");
    let snap: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = snap["id"].as_str().unwrap().to_string();
    a.start_daemon();
    // Logged by the start-up beside the kubelet's listener, not necessarily before it.
    let listening = format!("peer snapshot listener on http://127.0.0.1:{peer_port}");
    a.wait("the peer listener", SETTLE_LIMIT, || {
        a.log().contains(&listening).then_some(())
    });

    let b = tempfile::tempdir().unwrap();
    let staging = b.path().join("staging");
    let peer = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), peer_port);
    // What the registry says of the tag: the restore is checked against its config and layers.
    let tag = manifest_info(&a.registry_client(), "vk-demo-hib", "hibernate")
        .unwrap()
        .unwrap();
    let expected = tag.config.clone().unwrap();
    assert_eq!(expected.snapshot_id, id);
    let req = |source: [u8; 4]| PeerRestore {
        peer,
        source: Some(IpAddr::from(source)),
        snapshot: "vk-demo-hib".into(),
        local_name: "vk-demo-hib".into(),
        expected: expected.clone(),
        layers: tag.layers.clone(),
        staging_root: staging.clone(),
        streams: SLICE_STREAMS,
    };
    // The daemon lists Nodes as it starts; node-b may take a moment to be allowed.
    let staged = a.wait("the restore from node-b", Duration::from_secs(40), || {
        restore(&req([127, 0, 0, 2])).ok()
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
            "vk-demo-hib",
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

    // Not a node: refused, nothing staged, counted.
    let before = std::fs::read_dir(&staging).unwrap().count();
    let err = restore(&req([127, 0, 0, 3])).unwrap_err();
    assert!(err.contains("403"), "{err}");
    assert_eq!(std::fs::read_dir(&staging).unwrap().count(), before);
    // Counted by the listener's thread, which may answer first.
    a.wait("the refusal counted", SETTLE_LIMIT, || {
        a.metrics()
            .lines()
            .find(|l| {
                l.starts_with("vk_cocoon_connections_refused_total")
                    && l.contains("listener=\"peer\"")
            })
            .filter(|l| l.contains("not_a_node") && !l.ends_with(" 0"))
            .map(|_| ())
    });
}
