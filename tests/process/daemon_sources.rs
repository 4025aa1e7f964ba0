//! Process tier, sources a pod names that the host would reach: an http(s) image URL is judged
//! (its host name resolved off the event loop) before cocoon fetches anything; a refused pod
//! fails for good with a Warning naming the rule and the setting, and the lifecycle counter.

use crate::daemon_support;

use std::time::Duration;

use daemon_support::{metric_value, phase, running_with_vm, tail, World};
use vk_cocoon::sandbox::demo_pod;

/// The pod's Warning of `reason`, once it failed with phase Failed.
fn refused(w: &World, name: &str, reason: &str) -> String {
    w.wait(
        &format!("{name} Failed with a {reason} Warning"),
        Duration::from_secs(60),
        || {
            let failed = w.pod(name).is_some_and(|p| phase(&p) == "Failed");
            let warning = w
                .events_for(name)
                .into_iter()
                .find(|(r, _)| r == reason)
                .map(|(_, m)| m);
            warning.filter(|_| failed)
        },
    )
}

/// Whether the daemon ever asked cocoon to pull this image.
fn pulled(w: &World, image: &str) -> bool {
    w.log()
        .lines()
        .any(|l| l.contains("cocoon op ") && l.contains("image pull") && l.contains(image))
}

#[test]
fn image_urls_of_internal_hosts_are_refused_unless_allowed() {
    let mut w = World::new();
    w.extra_env
        .push(("VK_IMAGE_URL_ALLOW_HOSTS".into(), "127.0.0.1".into()));
    w.start_daemon();
    let metadata = "http://169.254.169.254/latest/meta-data/iam";
    // Not an address literal: resolved by the daemon (libc reads it as 127.0.0.2).
    let numeric = "http://2130706434:8080/img.qcow2";
    let allowed = "http://127.0.0.1:9/noble.qcow2";
    for (name, image) in [
        ("meta", metadata),
        ("numeric", numeric),
        ("mirror", allowed),
    ] {
        w.api
            .create_pod(&demo_pod("default", name, "run", image))
            .expect("create pod");
    }

    let m = refused(&w, "meta", "ImageURLRefused");
    assert!(
        m.contains("the cloud metadata address") && m.contains("VK_IMAGE_URL_ALLOW_HOSTS"),
        "{m}"
    );
    let m = refused(&w, "numeric", "ImageURLRefused");
    assert!(
        m.contains("resolves to 127.0.0.2, a loopback address"),
        "{m}"
    );
    // The operator's allow-list lets an internal mirror through.
    w.wait(
        "the allowed image's pod Running",
        Duration::from_secs(60),
        || running_with_vm(&w, "mirror"),
    );
    assert!(pulled(&w, allowed));
    assert!(
        !pulled(&w, metadata) && !pulled(&w, numeric),
        "a refused URL reached cocoon\n{}",
        tail(&w.log(), 40)
    );
    let count = metric_value(
        &w.metrics(),
        "vk_cocoon_pod_lifecycle_total{op=\"create\",reason=\"image_url_refused\",result=\"failed\"}",
    );
    assert_eq!(count, Some(2.0));
    let vms = w.vms();
    assert!(
        vms.contains_key("vk-default-mirror") && vms.len() == 1,
        "{vms:?}"
    );
}

/// A pod cloning from `dir`.
fn from_dir_pod(name: &str, dir: &std::path::Path) -> k8s_openapi::api::core::v1::Pod {
    daemon_support::with_annotation(
        demo_pod("default", name, "clone", "base"),
        "vm.cocoonstack.io/clone-from-dir",
        &dir.display().to_string(),
    )
}

#[test]
fn clone_from_dir_only_below_the_root_and_never_through_a_symlink() {
    let mut w = World::new();
    let root = w.path("exports");
    let evil = w.path("exports-evil");
    w.extra_env
        .push(("VK_CLONE_FROM_DIR_ROOT".into(), root.display().to_string()));
    w.seed_snapshot("base");
    // The same exported snapshot below the root, beside it (a string prefix of the root) and
    // behind a symlink below the root that leads beside it.
    for dir in [root.join("team/base"), evil.join("base")] {
        let (ok, out) = w.cocoon(&[
            "snapshot",
            "export",
            "--to-dir",
            &dir.display().to_string(),
            "--",
            "base",
        ]);
        assert!(ok, "{out}");
    }
    std::os::unix::fs::symlink(&evil, root.join("link")).expect("symlink");
    w.start_daemon();
    w.api
        .create_pod(&from_dir_pod("exported", &root.join("team/base")))
        .expect("create");
    w.api
        .create_pod(&from_dir_pod("beside", &evil.join("base")))
        .expect("create");
    w.api
        .create_pod(&from_dir_pod("linked", &root.join("link/base")))
        .expect("create");

    w.wait(
        "the exported snapshot's pod Running",
        Duration::from_secs(60),
        || running_with_vm(&w, "exported"),
    );
    let m = refused(&w, "beside", "CloneFromDirRefused");
    assert!(
        m.contains(&format!(
            "not below VK_CLONE_FROM_DIR_ROOT ({})",
            root.display()
        )),
        "{m}"
    );
    let m = refused(&w, "linked", "CloneFromDirRefused");
    assert!(
        m.contains(&format!("{} is a symlink", root.join("link").display())),
        "{m}"
    );
    let count = metric_value(
        &w.metrics(),
        "vk_cocoon_pod_lifecycle_total{op=\"create\",reason=\"clone_dir_refused\",result=\"failed\"}",
    );
    assert_eq!(count, Some(2.0));
    let vms = w.vms();
    assert!(
        vms.contains_key("vk-default-exported") && vms.len() == 1,
        "{vms:?}\n{}",
        tail(&w.log(), 30)
    );

    // A node without a root takes no clone-from-dir at all, and says which setting to set.
    let mut bare = World::new();
    bare.start_daemon();
    bare.api
        .create_pod(&from_dir_pod("exported", &root.join("team/base")))
        .expect("create");
    let m = refused(&bare, "exported", "CloneFromDirRefused");
    assert!(
        m.contains("VK_CLONE_FROM_DIR_ROOT, which is not set"),
        "{m}"
    );
    assert!(bare.vms().is_empty());
}
