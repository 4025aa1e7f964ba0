//! Process tests of a full disk: a small tmpfs (root only; skipped with a message otherwise)
//! under the fake cocoon's snapshot store while a snapshot is pulled and imported, and under
//! the daemon's push spool while a hibernate pushes. Nothing is half-imported
//! or half-pushed, a Warning says the disk is full, other pods keep being served, and once
//! space is freed the operation completes.

use crate::daemon_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use daemon_support::{
    hibernated, running_with_vm, set_hibernate, snapshot_names, wait_turning, wait_warning, World,
};
use vk_cocoon::sandbox::demo_pod;
use vk_cocoon::snapshots::manifest_info;

const LIMIT: Duration = Duration::from_secs(90);
const BIG: &str = "8388608";

/// A tmpfs of `size` mounted on `dir` for the test's life (lazily unmounted on drop).
struct SmallDisk {
    dir: PathBuf,
}

impl SmallDisk {
    /// None (after saying why) when this host cannot mount one: not root, or no mount rights.
    fn mount(dir: &Path, size: &str) -> Option<SmallDisk> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("SKIPPED: mounting a small tmpfs needs root");
            return None;
        }
        std::fs::create_dir_all(dir).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        if !out.status.success() {
            eprintln!(
                "SKIPPED: cannot mount a tmpfs here: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        Some(SmallDisk {
            dir: dir.to_path_buf(),
        })
    }

    /// Frees space: the same filesystem, grown.
    fn grow(&self, size: &str) {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.dir)
            .output()
            .expect("run mount");
        assert!(out.status.success(), "{out:?}");
    }

    /// Entries directly in the mount.
    fn entries(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

#[test]
fn a_pull_onto_a_full_disk_imports_nothing_warns_and_completes_once_space_is_freed() {
    let mut w = World::new();
    let Some(disk) = SmallDisk::mount(&w.path("state/snapshots"), "1m") else {
        return;
    };
    w.seed_snapshot("base");
    // An 8 MiB snapshot in the registry, pushed from another node's store.
    let other = w.beside("other-node", "127.0.0.2");
    let (ok, out) = other.cocoon(&["image", "pull", "ubuntu:24.04"]);
    assert!(ok, "{out}");
    let out = Command::new(other.path("bin/cocoon"))
        .args([
            "vm",
            "run",
            "--output",
            "json",
            "--name",
            "big",
            "ubuntu:24.04",
        ])
        .env("FAKE_COCOON_STATE", other.path("state"))
        .output()
        .expect("vm run");
    let id = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default()["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let saved = Command::new(other.path("bin/cocoon"))
        .args(["snapshot", "save", "--name", "bigimg", &id])
        .env("FAKE_COCOON_STATE", other.path("state"))
        .env("FAKE_COCOON_SNAPSHOT_BYTES", BIG)
        .status()
        .expect("snapshot save");
    assert!(saved.success());
    other.push_base_snapshot("bigimg", "latest");

    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "big", "clone", "bigimg"))
        .expect("create pod");
    let start = Instant::now();
    let msg = wait_warning(&w, "big", "CreateBringUpFailed", "No space left on device");
    eprintln!("Warning CreateBringUpFailed: {msg}");
    // Nothing half-imported: no snapshot of the name, no import staging left on the disk.
    assert!(!snapshot_names(&w).iter().any(|n| n.contains("bigimg")));
    let left: Vec<String> = disk
        .entries()
        .into_iter()
        .filter(|e| e.starts_with(".import"))
        .collect();
    assert!(left.is_empty(), "import staging left behind: {left:?}");
    assert!(!w.vms().contains_key("vk-default-big"));

    // The node keeps serving: a pod from the local snapshot comes up meanwhile.
    w.api
        .create_pod(&demo_pod("default", "small", "clone", "base"))
        .expect("create pod");
    wait_turning(&w, "small Running", LIMIT, || running_with_vm(&w, "small"));

    disk.grow("64m");
    let freed = Instant::now();
    wait_turning(&w, "big Running", LIMIT, || running_with_vm(&w, "big"));
    eprintln!(
        "full disk during a pull: Running {:?} after space was freed ({:?} after the create)",
        freed.elapsed(),
        start.elapsed()
    );
}

#[test]
fn a_full_push_spool_keeps_the_vm_warns_and_hibernates_once_space_is_freed() {
    let mut w = World::new();
    // The daemon's push spool: `vk-spool` beside its staging directory.
    let spool = w.path("vk-spool");
    let Some(disk) = SmallDisk::mount(&spool, "1m") else {
        return;
    };
    w.extra_env
        .push(("FAKE_COCOON_SNAPSHOT_BYTES".to_string(), BIG.to_string()));
    w.seed_snapshot("base");
    w.start_daemon();
    for name in ["sleeper", "other"] {
        w.api
            .create_pod(&demo_pod("default", name, "clone", "base"))
            .expect("create pod");
    }
    let (_, id) = w.wait("sleeper Running", LIMIT, || running_with_vm(&w, "sleeper"));
    w.wait("other Running", LIMIT, || running_with_vm(&w, "other"));

    set_hibernate(&w, "sleeper", true);
    let start = Instant::now();
    let msg = wait_warning(
        &w,
        "sleeper",
        "HibernatePushFailed",
        "No space left on device",
    );
    eprintln!("Warning HibernatePushFailed: {msg}");
    assert!(
        msg.contains("spool"),
        "the Warning says the spool is what is full: {msg}"
    );
    assert_eq!(
        w.vms()
            .get("vk-default-sleeper")
            .map(|(i, s)| (i.clone(), s.clone())),
        Some((id, "running".into())),
        "the VM is kept"
    );
    assert!(
        manifest_info(&w.registry_client(), "vk-default-sleeper", "hibernate")
            .expect("registry answers")
            .is_none(),
        "no tag for a push that did not finish"
    );
    assert!(
        disk.entries().is_empty(),
        "spool files left: {:?}",
        disk.entries()
    );
    // Other pods are still served: one is deleted and goes.
    w.api
        .delete_pod("default", "other", Some(30))
        .expect("delete");
    wait_turning(&w, "other gone", LIMIT, || {
        w.pod("other").is_none().then_some(())
    });

    disk.grow("64m");
    let freed = Instant::now();
    wait_turning(&w, "sleeper hibernated", LIMIT, || {
        hibernated(&w, "sleeper", "vk-default-sleeper")
    });
    eprintln!(
        "full push spool: hibernated {:?} after space was freed ({:?} after the request)",
        freed.elapsed(),
        start.elapsed()
    );
}
