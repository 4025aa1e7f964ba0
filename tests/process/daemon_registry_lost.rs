//! Process tests of a registry lost in the middle of a push: the daemon talks to the real
//! registry through a loopback proxy that cuts every connection after some bytes and closes
//! new ones until restored. A hibernate push and a snapshot-before-delete push that break
//! keep the VM, publish no tag, warn, and complete once the registry is back.

use crate::daemon_support;

use std::time::{Duration, Instant};

use daemon_support::registry_support::CutProxy;
use daemon_support::{
    hibernated, phase, running_with_vm, set_hibernate, wait_turning, wait_warning, warning_count,
    with_annotation, World,
};
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::snapshots::{manifest_info, pull_snapshot, PullRequest};

const LIMIT: Duration = Duration::from_secs(90);
/// The memory file of every snapshot the daemon saves: big enough to be cut mid-blob.
const SNAPSHOT_BYTES: &str = "8388608";
/// Request bytes let through before the registry is lost: inside the memory blob.
const CUT_AFTER: u64 = 2 << 20;

/// A world whose daemon reaches its registry only through a cut proxy.
fn world_behind_proxy() -> (World, CutProxy) {
    let mut w = World::new();
    let proxy = CutProxy::start(&w.registry.host());
    w.extra_env.extend([
        ("OCI_REGISTRY".to_string(), format!("{}/vk", proxy.host())),
        (
            "FAKE_COCOON_SNAPSHOT_BYTES".to_string(),
            SNAPSHOT_BYTES.to_string(),
        ),
    ]);
    w.seed_snapshot("base");
    w.start_daemon();
    (w, proxy)
}

/// The tag's manifest, as the registry itself (not the proxy) answers.
fn tag(w: &World, repo: &str, tag: &str) -> Option<String> {
    manifest_info(&w.registry_client(), repo, tag)
        .expect("the registry answers directly")
        .map(|i| i.snapshot_id.unwrap_or_default())
}

/// The pushed snapshot is whole: it pulls into the fake cocoon as a snapshot of its own.
fn pulls_whole(w: &World, repo: &str, tag: &str) {
    let local = format!("check-{tag}");
    let req = PullRequest::new(repo, tag, &local, w.path("bin/cocoon"));
    pull_snapshot(&w.registry_client(), &req).expect("the pushed snapshot pulls");
    let (ok, out) = w.cocoon(&["snapshot", "inspect", &local]);
    assert!(ok, "{out}");
}

#[test]
fn a_hibernate_push_cut_by_a_lost_registry_keeps_the_vm_and_completes_when_it_is_back() {
    let (w, proxy) = world_behind_proxy();
    w.api
        .create_pod(&demo_pod("default", "sleeper", "clone", "base"))
        .expect("create pod");
    let (_, id) = w.wait("sleeper Running", LIMIT, || running_with_vm(&w, "sleeper"));

    proxy.cut_after(CUT_AFTER);
    set_hibernate(&w, "sleeper", true);
    let msg = wait_warning(&w, "sleeper", "HibernatePushFailed", "");
    eprintln!("Warning HibernatePushFailed: {msg}");
    assert!(proxy.cuts() > 0, "the push was cut");
    let lost_at = Instant::now();
    // Kept: the same VM runs, the pod is Running and says why it is not hibernated.
    let p = w.pod("sleeper").expect("pod");
    assert_eq!(phase(&p), "Running");
    assert_eq!(
        w.vms()
            .get("vk-default-sleeper")
            .map(|(i, s)| (i.clone(), s.clone())),
        Some((id.clone(), "running".into())),
        "the VM is kept"
    );
    assert_eq!(
        tag(&w, "vk-default-sleeper", "hibernate"),
        None,
        "no tag for a cut push"
    );
    // While the registry stays lost the retries fail the same way and change nothing.
    wait_turning(&w, "a retried push failing too", LIMIT, || {
        (warning_count(&w, "sleeper", "HibernatePushFailed") >= 2).then_some(())
    });
    assert!(w.vms().contains_key("vk-default-sleeper"));
    assert_eq!(tag(&w, "vk-default-sleeper", "hibernate"), None);

    proxy.restore();
    let back = Instant::now();
    wait_turning(&w, "sleeper hibernated", LIMIT, || {
        hibernated(&w, "sleeper", "vk-default-sleeper")
    });
    eprintln!(
        "registry lost mid hibernate push: hibernated {:?} after the registry came back ({:?} after the loss)",
        back.elapsed(),
        lost_at.elapsed()
    );
    assert!(tag(&w, "vk-default-sleeper", "hibernate").is_some());
    pulls_whole(&w, "vk-default-sleeper", "hibernate");
}

#[test]
fn a_snapshot_before_delete_cut_by_a_lost_registry_keeps_the_vm_until_the_push_lands() {
    let (w, proxy) = world_behind_proxy();
    let pod = with_annotation(
        demo_pod("default", "keeper", "clone", "base"),
        "cocoonset.cocoonstack.io/snapshot-policy",
        "always",
    );
    w.api.create_pod(&pod).expect("create pod");
    let (_, id) = w.wait("keeper Running", LIMIT, || running_with_vm(&w, "keeper"));

    proxy.cut_after(CUT_AFTER);
    w.api
        .delete_pod("default", "keeper", Some(30))
        .expect("delete");
    let msg = wait_warning(&w, "keeper", "ProviderDeleteFailed", "before delete");
    eprintln!("Warning ProviderDeleteFailed: {msg}");
    assert!(msg.contains("VM kept"), "{msg}");
    let lost_at = Instant::now();
    assert_eq!(
        w.vms().get("vk-default-keeper").map(|(i, _)| i.clone()),
        Some(id),
        "no VM removed without its snapshot pushed"
    );
    let p = w.pod("keeper").expect("the object stays while its VM does");
    assert!(p.metadata.deletion_timestamp.is_some());
    assert_eq!(
        tag(&w, "vk-default-keeper", "latest"),
        None,
        "no tag for a cut push"
    );

    proxy.restore();
    let back = Instant::now();
    wait_turning(&w, "keeper gone", LIMIT, || {
        w.pod("keeper").is_none().then_some(())
    });
    eprintln!(
        "registry lost mid delete push: pod gone {:?} after the registry came back ({:?} after the loss)",
        back.elapsed(),
        lost_at.elapsed()
    );
    assert!(
        !w.vms().contains_key("vk-default-keeper"),
        "the VM went with its pod"
    );
    assert!(tag(&w, "vk-default-keeper", "latest").is_some());
    pulls_whole(&w, "vk-default-keeper", "latest");
}
