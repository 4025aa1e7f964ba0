//! Process tier for managed macOS guests: the real daemon, the fake API server and the fake
//! `cocoon-macos` (each guest's QEMU a real `sleep`), with a TCP probe on loopback.

use crate::daemon_support;

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use daemon_support::{annotation, metric_value, tail, World, BIN, SANDBOX_BIN, SETTLE_LIMIT};
use k8s_openapi::api::core::v1::Pod;
use vk_cocoon::sandbox::fake_cocoon_macos::MacosRecord;

const PASSWORD: &str = "vncpw1";

fn macos_world() -> World {
    let mut w = World::new();
    std::fs::create_dir_all(w.path("macos-state")).expect("mkdir");
    std::os::unix::fs::symlink(SANDBOX_BIN, w.path("bin/cocoon-macos")).expect("symlink");
    let env = [
        ("VK_COCOON_MACOS_BIN", w.path("bin/cocoon-macos")),
        ("FAKE_COCOON_MACOS_STATE", w.path("macos-state")),
        ("FAKE_COCOON_MACOS_LEASES", w.path("net/leases.json")),
    ];
    w.extra_env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.display().to_string()))
        .collect();
    w.extra_env
        .push(("COCOON_MACOS_VNC_PASSWORD".into(), PASSWORD.into()));
    w
}

/// A guest's VNC password the operator's way: `vk-cocoon vnc-password VM` with the secret.
fn vnc_password_of(vm: &str) -> String {
    let out = std::process::Command::new(BIN)
        .args(["vnc-password", vm])
        .env_clear()
        .env("COCOON_MACOS_VNC_PASSWORD", PASSWORD)
        .output()
        .expect("run vk-cocoon vnc-password");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn macos_pod(name: &str, probe_port: u16) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "annotations": {
                "vm.cocoonstack.io/name": format!("vk-default-{name}"),
                "cocoonset.cocoonstack.io/image": "ghcr.io/org/sonoma:14",
                "cocoonset.cocoonstack.io/os": "macos",
                "cocoonset.cocoonstack.io/managed": "true",
                "vm.cocoonstack.io/probe-port": probe_port.to_string()
            }
        },
        "spec": {
            "nodeName": "cocoon-sandbox",
            "containers": [{
                "name": "agent",
                "image": "ghcr.io/org/sonoma:14",
                "resources": {"requests": {"cpu": "1", "memory": "6Gi"}, "limits": {"cpu": "3"}}
            }],
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]
        }
    }))
    .expect("pod JSON")
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn record(w: &World, vm: &str) -> Option<MacosRecord> {
    let path = w.path("macos-state/vms").join(format!("{vm}.json"));
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Alive and not a zombie (a killed QEMU nobody reaped yet is dead).
fn alive(pid: i64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .and_then(|r| r.split_whitespace().next());
    !matches!(state, Some("Z" | "X") | None)
}

fn kill(pid: i64) {
    assert!(pid > 0 && alive(pid), "QEMU {pid} is running");
    // SAFETY: kill(2) of a process id we read from the fake's record; no memory involved.
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}");
}

/// The fake's calls, as (unix ms, argv) lines.
fn calls(w: &World) -> Vec<(u128, String)> {
    std::fs::read_to_string(w.path("macos-state/calls.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (ms, argv) = l.split_once(' ')?;
            Some((ms.parse().ok()?, argv.to_string()))
        })
        .collect()
}

/// When the daemon decided to start a dead QEMU of `vm` again, in ms of the UTC day, from its
/// log: the loop's own clock, where a child's start would add the host's fork and exec delay.
fn restart_decisions(w: &World, vm: &str) -> Vec<u64> {
    let needle = format!("QEMU of {vm} is dead; starting it");
    w.log()
        .lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| {
            // `2026-01-02T03:04:05.678Z WARN ...`
            let time = l.split_once('T')?.1.split_once('Z')?.0;
            let (hms, ms) = time.split_once('.')?;
            let mut parts = hms.split(':').map(|p| p.parse::<u64>().ok());
            let (h, m, s) = (parts.next()??, parts.next()??, parts.next()??);
            Some(((h * 60 + m) * 60 + s) * 1000 + ms.parse::<u64>().ok()?)
        })
        .collect()
}

/// Kills the QEMU and waits until the daemon started another one; returns the new pid.
fn kill_and_await_restart(w: &World, vm: &str, limit: Duration) -> i64 {
    let old = record(w, vm).expect("record").pid;
    kill(old);
    w.wait("the dead QEMU restarted", limit, || {
        record(w, vm)
            .map(|r| r.pid)
            .filter(|p| *p != old && alive(*p))
    })
}

/// Kills every QEMU the fake recorded when the test ends, passed or not: `sleep infinity`
/// would outlive a failed test.
struct Reaper(std::path::PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        let Ok(dir) = std::fs::read_dir(&self.0) else {
            return;
        };
        for e in dir.flatten() {
            let r: Option<MacosRecord> = std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            if let Some(pid) = r.map(|r| r.pid).filter(|p| *p > 0 && alive(*p)) {
                // SAFETY: kill(2) of a process id from the fake's own record; no memory involved.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
    }
}

#[test]
fn a_macos_pod_runs_restarts_its_qemu_is_adopted_after_a_restart_and_is_deleted() {
    let mut w = macos_world();
    let _reaper = Reaper(w.path("macos-state/vms"));
    // The first guest's address (the fake's lease) on loopback: the probe-port target.
    let probe = TcpListener::bind("127.89.0.1:0").expect("bind probe target");
    let port = probe.local_addr().expect("addr").port();
    w.start_daemon();
    let created = std::time::Instant::now();
    w.api
        .create_pod(&macos_pod("mac", port))
        .expect("create pod");
    let vm = "vk-default-mac";
    // The id comes with the annotation patch after the Ready status.
    let pod = w.wait("macOS pod Ready with its VM id", SETTLE_LIMIT, || {
        w.pod("mac")
            .filter(|p| ready(p) && annotation(p, "vm.cocoonstack.io/id").is_some())
    });
    println!("macOS pod: created to Ready in {:?}", created.elapsed());
    assert_eq!(
        annotation(&pod, "vm.cocoonstack.io/id").as_deref(),
        Some("qemu-vk-default-mac")
    );
    assert_eq!(
        annotation(&pod, "vm.cocoonstack.io/vnc-port").as_deref(),
        Some("5900")
    );
    assert_eq!(
        annotation(&pod, "vm.cocoonstack.io/ip").as_deref(),
        Some("127.89.0.1")
    );
    let r = record(&w, vm).expect("the guest's record");
    // 3 CPUs asked: an even 4; 6 GiB: 6144 MiB; VNC display 0 with the guest's own password,
    // which came in cocoon-macos's environment: no command line ever carried it.
    assert_eq!((r.cpus, r.memory_mib), (4, 6144));
    let own = vnc_password_of(vm);
    assert_eq!((r.vnc, r.vnc_password.as_str()), (Some(0), own.as_str()));
    assert_ne!(own, PASSWORD, "a password of its own, not the secret");
    let launches: Vec<String> = calls(&w).into_iter().map(|(_, a)| a).collect();
    assert!(
        launches
            .iter()
            .any(|a| a.starts_with("vm run") && a.contains("--vnc 0"))
            && !launches.iter().any(|a| a.contains("--vnc-password")),
        "{launches:?}"
    );
    let log = w.log();
    assert!(
        !log.contains(PASSWORD) && !log.contains(&own),
        "the VNC secret and password must not reach the log"
    );

    // Stats: the QEMU's RSS from /proc/<pid>/stat and the disk file's size (1 GiB sparse).
    let line = w.wait("macOS guest stats", SETTLE_LIMIT, || {
        let m = w.metrics();
        let rss = m.lines().find(|l| {
            l.starts_with("vk_cocoon_vm_memory_rss_bytes{") && l.contains("backend=\"qemu\"")
        })?;
        let rss: f64 = rss.rsplit(' ').next()?.parse().ok()?;
        (rss > 0.0).then_some(())?;
        m.lines()
            .find(|l| {
                l.starts_with("vk_cocoon_vm_disk_cow_bytes{") && l.contains("backend=\"qemu\"")
            })
            .map(str::to_string)
    });
    assert!(line.ends_with(" 1073741824"), "{line}");

    // A killed QEMU is started again by the watch, and never twice within 10 s.
    let killed = std::time::Instant::now();
    let first = kill_and_await_restart(&w, vm, SETTLE_LIMIT);
    println!("dead QEMU restarted after {:?}", killed.elapsed());
    let second = kill_and_await_restart(&w, vm, SETTLE_LIMIT);
    assert_ne!(first, second);
    let s = restart_decisions(&w, vm);
    assert!(s.len() >= 2, "{s:?}");
    // The decisions are 10 s apart on the daemon's clock (a day's rollover between them
    // aside); their log lines may be written a little apart from that.
    let gap = (s[s.len() - 1] + 86_400_000 - s[s.len() - 2]) % 86_400_000;
    assert!(gap >= 9_500, "restarts {gap} ms apart: {s:?}");
    let r = record(&w, vm).expect("record");
    assert_eq!(r.vnc, Some(0), "restarted on its own display");
    w.wait("Ready again", SETTLE_LIMIT, || w.pod("mac").filter(ready));

    // A daemon restart adopts the running guest: no second `vm run`, same QEMU.
    let runs_before = calls(&w)
        .iter()
        .filter(|(_, a)| a.starts_with("vm run"))
        .count();
    w.kill_daemon();
    w.start_daemon();
    w.wait("adoption counted", SETTLE_LIMIT, || {
        metric_value(
            &w.metrics(),
            "vk_cocoon_pod_lifecycle_total{op=\"create\",reason=\"adopted\",result=\"ok\"}",
        )
        .filter(|v| *v >= 1.0)
    });
    let runs_after = calls(&w)
        .iter()
        .filter(|(_, a)| a.starts_with("vm run"))
        .count();
    assert_eq!(runs_before, runs_after, "adopted, not run again");
    assert_eq!(record(&w, vm).expect("record").pid, second);

    // Delete: the guest and its QEMU go, and its VNC port is free for the next guest.
    w.api
        .delete_pod("default", "mac", Some(30))
        .expect("delete pod");
    w.wait("pod gone", SETTLE_LIMIT, || {
        w.pod("mac").is_none().then_some(())
    });
    assert!(record(&w, vm).is_none(), "record removed");
    w.wait("QEMU gone", SETTLE_LIMIT, || (!alive(second)).then_some(()));
    w.api
        .create_pod(&macos_pod("mac2", port))
        .expect("create pod");
    let p2 = w.wait("second guest Running", SETTLE_LIMIT, || {
        w.pod("mac2")
            .filter(|p| annotation(p, "vm.cocoonstack.io/vnc-port").is_some())
    });
    assert_eq!(
        annotation(&p2, "vm.cocoonstack.io/vnc-port").as_deref(),
        Some("5900"),
        "the freed port is reused\n{}",
        tail(&w.log(), 40)
    );
    // Another guest, another password: knowing one's own tells nothing about it.
    let other = record(&w, "vk-default-mac2").expect("second guest's record");
    assert_eq!(other.vnc_password, vnc_password_of("vk-default-mac2"));
    assert_ne!(other.vnc_password, own);
    w.api
        .delete_pod("default", "mac2", Some(30))
        .expect("delete pod");
    w.wait("second pod gone", SETTLE_LIMIT, || {
        w.pod("mac2").is_none().then_some(())
    });
    drop(probe);
    assert!(Path::new(&w.path("macos-state/vms"))
        .read_dir()
        .is_ok_and(|mut d| d.next().is_none()));
}
