//! Two real daemons in one cluster (one fake API server, one real registry, a fake cocoon per
//! node): node A hibernates a pod, the pod comes back on node B, and B restores it from A's
//! peer listener over TLS (B's node certificate, the tag's manifest digest) rather than the
//! registry, with the guest's data. B pulls the tag instead when A's copy is not what the tag
//! holds (right length, right CRCs, other bytes), when A refuses because the tag is no longer
//! the one A pushed, and when B has no client certificate to present.

use crate::daemon_support;

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use daemon_support::{annotation, free_ports, metric_value, phase, running_with_vm, World};
use vk_cocoon::sandbox::apiserver::KubeconfigAuth;
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::snapshots::manifest_info;

const HIBERNATE: &str = "vm.cocoonstack.io/hibernate";
const KEEP: &str = "vm.cocoonstack.io/keep-snapshot-on-delete";
const LIFECYCLE: &str = "vm.cocoonstack.io/lifecycle-state";
const LIMIT: Duration = Duration::from_secs(90);
const NODE_B: &str = "node-b";
const POD: &str = "p0";
const VM: &str = "vk-default-p0";
const DATA: &[u8] = b"written on node A before hibernate\n";

/// The file of a VM's run dir that the fake cocoon treats as the guest's disk contents.
fn guest_data(w: &World, vm_id: &str) -> PathBuf {
    w.path("root/run/cloudhypervisor")
        .join(vm_id)
        .join("guest.data")
}

/// Node A (the default node at 127.0.0.1) and node B (127.0.0.2), both with DHCP guests and
/// their peer listeners on one port, each on its own address. B runs first, so A's first Node
/// list already names B (A answers only cluster nodes).
fn cluster() -> (World, World) {
    cluster_where(|_| {})
}

/// `cluster()` with `prepare` run on B before it starts.
fn cluster_where(prepare: impl FnOnce(&World)) -> (World, World) {
    let [peer_port] = free_ports();
    let mut a = World::new();
    let mut b = a.beside(NODE_B, "127.0.0.2");
    prepare(&b);
    for w in [&mut a, &mut b] {
        let leases = w.path("net/leases.json").display().to_string();
        w.extra_env = vec![
            ("FAKE_COCOON_DHCP".into(), "1".into()),
            ("FAKE_COCOON_LEASES".into(), leases),
            ("VK_PEER_ADDR".into(), format!("{}:{peer_port}", w.node_ip)),
        ];
    }
    b.start_daemon();
    a.wait("node-b registered", LIMIT, || {
        a.api
            .list_objects("nodes")
            .iter()
            .any(|n| n["metadata"]["name"] == NODE_B)
            .then_some(())
    });
    a.seed_snapshot("base");
    a.start_daemon();
    (a, b)
}

fn set_hibernate(w: &World, on: bool) {
    // The daemon writes the pod too: retry on a resourceVersion conflict.
    for _ in 0..100 {
        let mut p = w.pod(POD).expect("pod");
        p.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(HIBERNATE.into(), on.to_string());
        if w.api.update_pod(&p).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("could not set {HIBERNATE}={on}");
}

/// On node A: the pod runs, the guest writes `DATA`, the pod hibernates (A pushes the tag
/// naming itself as from-node and keeps its local snapshot), and the pod is deleted with
/// keep-snapshot-on-delete, as a mover does before re-creating it elsewhere.
fn hibernate_on_a(a: &World) {
    let mut pod = demo_pod("default", POD, "clone", "base");
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(KEEP.into(), "true".into());
    a.api.create_pod(&pod).expect("create pod on A");
    let (_, id) = a.wait("pod Running on A", LIMIT, || running_with_vm(a, POD));
    fs::write(guest_data(a, &id), DATA).unwrap();

    set_hibernate(a, true);
    a.wait("hibernated on A", LIMIT, || {
        let p = a.pod(POD)?;
        let done = annotation(&p, LIFECYCLE).as_deref() == Some("hibernated")
            && phase(&p) == "Pending"
            && !a.vms().contains_key(VM);
        done.then_some(())
    });
    let tag = manifest_info(&a.registry_client(), VM, "hibernate")
        .expect("registry answers")
        .expect("the hibernate tag");
    assert_eq!(tag.from_node(), Some(a.node.as_str()));

    a.api
        .delete_pod("default", POD, Some(30))
        .expect("delete on A");
    a.wait("pod gone from A", LIMIT, || {
        a.pod(POD).is_none().then_some(())
    });
    let (ok, out) = a.cocoon(&["snapshot", "inspect", VM]);
    assert!(ok, "A keeps its local snapshot: {out}");
}

/// The same pod re-created bound to node B; returns B's VM id once it runs there, ready.
fn recreate_on_b(a: &World, b: &World) -> String {
    let mut pod = demo_pod("default", POD, "clone", "base");
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(NODE_B.into());
    }
    a.api.create_pod(&pod).expect("create pod on B");
    b.wait("pod woken on B", LIMIT, || {
        let (p, id) = running_with_vm(b, POD)?;
        let ready = annotation(&p, LIFECYCLE).as_deref() == Some("ready");
        (ready && b.vms().get(VM).map(|(i, _)| i) == Some(&id)).then_some(id)
    })
}

/// B tried A once, failed, pulled the tag and woke the pod from it.
fn woke_from_the_registry_after_the_peer_failed(b: &World) {
    assert_eq!(
        counter(
            b,
            "vk_cocoon_snapshot_peer_restore_total{result=\"failed\"}"
        ),
        1.0
    );
    assert_eq!(
        counter(b, "vk_cocoon_snapshot_pull_total{result=\"ok\"}"),
        1.0
    );
    let woken = format!("cloned from registry {VM}:hibernate");
    b.wait_event(POD, "Woken", |m| m == woken);
}

fn counter(w: &World, line: &str) -> f64 {
    metric_value(&w.metrics(), line).unwrap_or(0.0)
}

/// B's staging directory holds nothing once the clone answered (removed right after it).
fn staging_empties(b: &World) {
    b.wait("B's staging dir empty", LIMIT, || {
        let left = fs::read_dir(b.path("staging"))
            .map(|d| d.count())
            .unwrap_or(0);
        (left == 0).then_some(())
    });
}

#[test]
fn node_b_wakes_a_pod_hibernated_on_node_a_from_its_peer_listener() {
    let (a, b) = cluster();
    hibernate_on_a(&a);
    let id = recreate_on_b(&a, &b);

    assert_eq!(fs::read(guest_data(&b, &id)).unwrap(), DATA);
    let woken = format!("cloned from peer {}", a.node);
    b.wait_event(POD, "Woken", |m| m == woken);
    // The peer path, not the registry: B restored from A and pulled nothing.
    assert_eq!(
        counter(&b, "vk_cocoon_snapshot_peer_restore_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        counter(&b, "vk_cocoon_snapshot_pull_total{result=\"ok\"}"),
        0.0
    );
    let (imported, _) = b.cocoon(&["snapshot", "inspect", &format!("{VM}-hibernate-import")]);
    assert!(!imported, "no registry import on B");
    staging_empties(&b);
}

#[test]
fn a_peer_copy_that_is_not_the_tags_content_falls_back_to_the_registry() {
    let (a, b) = cluster();
    hibernate_on_a(&a);
    // A's local snapshot changes after the push: same length, so every size matches, and A
    // sends the CRC-32C of the bytes it holds, so every slice checks out.
    let (ok, out) = a.cocoon(&["snapshot", "inspect", VM]);
    assert!(ok, "{out}");
    let snap: serde_json::Value = serde_json::from_str(&out).unwrap();
    let served = a
        .path("state/snapshots")
        .join(snap["id"].as_str().unwrap())
        .join("guest.data");
    assert_eq!(fs::read(&served).unwrap(), DATA);
    fs::write(&served, DATA.to_ascii_uppercase()).unwrap();

    let id = recreate_on_b(&a, &b);
    assert_eq!(
        fs::read(guest_data(&b, &id)).unwrap(),
        DATA,
        "the registry's bytes, not A's"
    );
    woke_from_the_registry_after_the_peer_failed(&b);
    assert!(
        b.log().contains("sha256"),
        "the digest check refused A's copy"
    );
    staging_empties(&b);
}

/// The tag is pushed again after A's hibernate (same bytes, a new manifest, A still named as
/// its from-node): A recorded the digest of its own push, so it refuses B, and B pulls the tag.
#[test]
fn a_peer_that_did_not_push_the_tag_refuses_and_the_registry_serves_it() {
    let (a, b) = cluster();
    hibernate_on_a(&a);
    let pushed = manifest_info(&a.registry_client(), VM, "hibernate")
        .unwrap()
        .unwrap();
    a.push_snapshot(VM, "hibernate", pushed.base_image().unwrap_or(""));
    let now = manifest_info(&a.registry_client(), VM, "hibernate")
        .unwrap()
        .unwrap();
    assert_ne!(now.digest, pushed.digest, "a new manifest");
    assert_eq!(now.from_node(), Some(a.node.as_str()));

    let id = recreate_on_b(&a, &b);
    assert_eq!(fs::read(guest_data(&b, &id)).unwrap(), DATA);
    woke_from_the_registry_after_the_peer_failed(&b);
    assert!(b.log().contains("HTTP 404"), "A refused the digest");
    staging_empties(&b);
}

/// B's kubeconfig holds a bearer token, no client certificate: B says at start that it will
/// not restore from peers, never dials A, and wakes the pod from the registry.
#[test]
fn a_node_without_a_client_certificate_pulls_from_the_registry() {
    let (a, b) = cluster_where(|b| {
        b.api
            .write_kubeconfig(
                &b.path("kubeconfig"),
                &KubeconfigAuth::Token("node-b-token".into()),
            )
            .unwrap();
    });
    assert!(
        b.log()
            .contains("peer restore off: the kubeconfig has no client certificate"),
        "{}",
        b.log()
    );
    hibernate_on_a(&a);
    let id = recreate_on_b(&a, &b);
    assert_eq!(fs::read(guest_data(&b, &id)).unwrap(), DATA);
    assert_eq!(
        counter(&b, "vk_cocoon_snapshot_pull_total{result=\"ok\"}"),
        1.0
    );
    assert!(b.log().contains("peer restore of vk-default-p0: skipped"));
    assert_eq!(
        metric_value(
            &a.metrics(),
            "vk_cocoon_connections_refused_total{listener=\"peer\",reason=\"not_a_node_certificate\"}"
        )
        .unwrap_or(0.0),
        0.0,
        "B never dialled A"
    );
}
