//! Process test of the wall clock stepped forward and back by an hour. The machine's clock is
//! shared, so the daemon's is stepped through its test-only hook
//! (`VK_TEST_WALL_CLOCK_OFFSET_FILE`, every wall-clock read of the daemon and its TLS checks
//! go through it). The Lease keeps its 10 s cadence and its renewTime follows the step, a
//! cached kubelet API token is not expired by it, a restart cooldown still fires within its
//! 30 s, Events carry the stepped time, the daemon logs the step, and new pods come up.

use crate::daemon_support;

use std::time::{Duration, Instant, SystemTime};

use daemon_support::{
    kill_hypervisor, kubelet_status, phase, running_with_vm, token_reviews, World, NODE,
};
use k8s_openapi::api::coordination::v1::Lease;
use vk_cocoon::sandbox::apiserver::ReviewUser;
use vk_cocoon::sandbox::demo_pod;

const LIMIT: Duration = Duration::from_secs(60);
const HOUR: i64 = 3600;

fn step_to(w: &World, offset_secs: i64) {
    std::fs::write(w.path("clock-offset"), offset_secs.to_string()).expect("offset file");
}

/// (resourceVersion, renewTime as seconds since the epoch) of the node Lease.
fn lease(w: &World) -> Option<(String, i64)> {
    let v = w.api.get_object("leases", "kube-node-lease", NODE)?;
    let l: Lease = serde_json::from_value(v).ok()?;
    let rv = l.metadata.resource_version?;
    Some((rv, l.spec?.renew_time?.0.as_second()))
}

fn real_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Waits for a renewal whose renewTime is `offset` (± a minute) off the real clock; returns
/// how long that took. Then two more renewals must follow on the 10 s cadence.
fn lease_follows(w: &World, offset: i64) -> Duration {
    let start = Instant::now();
    let (mut rv, _) = w.wait("a renewal in the stepped clock", LIMIT, || {
        lease(w).filter(|(_, t)| (t - real_now() - offset).abs() < 60)
    });
    let took = start.elapsed();
    for _ in 0..2 {
        let since = Instant::now();
        let (next, t) = w.wait("the next renewal", Duration::from_secs(40), || {
            lease(w).filter(|(r, _)| *r != rv)
        });
        let gap = since.elapsed();
        // Cadence 10 s; the bound is what matters to the cluster: under the 40 s duration.
        assert!(
            gap < Duration::from_secs(30),
            "renewals {gap:?} apart after the step (cadence 10 s, duration 40 s)"
        );
        assert!(
            (t - real_now() - offset).abs() < 60,
            "renewTime {t} off the step"
        );
        rv = next;
    }
    took
}

fn vm_pid(w: &World, id: &str) -> Option<i64> {
    let (ok, out) = w.cocoon(&["vm", "inspect", id]);
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    (ok && v["state"] == "running").then(|| v["pid"].as_i64().unwrap_or(0))
}

#[test]
fn a_wall_clock_stepped_an_hour_either_way_stalls_nothing_and_expires_nothing() {
    let mut w = World::new();
    step_to(&w, 0);
    w.extra_env.push((
        "VK_TEST_WALL_CLOCK_OFFSET_FILE".into(),
        w.path("clock-offset").display().to_string(),
    ));
    w.api.add_token_user(
        "ops-token",
        ReviewUser {
            username: "ops".into(),
            uid: "7".into(),
            groups: vec![],
        },
    );
    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "tick", "run", "ubuntu:24.04"))
        .expect("create pod");
    let (pod, id) = w.wait("tick Running", LIMIT, || running_with_vm(&w, "tick"));
    let uid = pod.metadata.uid.unwrap_or_default();
    assert_eq!(kubelet_status(&w, "ops-token"), "200");
    let reviews = token_reviews(&w);

    // A hypervisor dies: restarted (the cooldown starts now, by the monotonic clock).
    let old_pid = kill_hypervisor(&w, &id);
    w.wait("the VM restarted", LIMIT, || {
        vm_pid(&w, &id).filter(|p| *p != 0 && *p != i64::from(old_pid))
    });

    // Forward an hour. The hypervisor dies again within the 30 s cooldown: the pod is
    // evicted (RestartCooldown), not restarted as a wall-clock cooldown would.
    step_to(&w, HOUR);
    kill_hypervisor(&w, &id);
    w.wait("tick evicted for the cooldown", LIMIT, || {
        match w.pod("tick") {
            None => Some(()),
            Some(p) if p.metadata.uid.as_deref() != Some(uid.as_str()) => Some(()),
            Some(p) if phase(&p) == "Failed" => Some(()),
            Some(_) => None,
        }
    });
    let log = w.log();
    let starts = log
        .lines()
        .filter(|l| l.contains("cocoon op") && l.contains(&format!("vm start -- {id}")))
        .count();
    assert_eq!(starts, 1, "restarted once, then the cooldown held");
    assert!(
        log.contains(&format!("vm rm --force -- {id}")),
        "removed, then evicted"
    );
    let took = lease_follows(&w, HOUR);
    eprintln!("clock +1 h: Lease renewed in the stepped time {took:?} after the step");
    w.wait("the step logged", LIMIT, || {
        w.log()
            .contains("the wall clock stepped by +3600 s")
            .then_some(())
    });
    assert_eq!(kubelet_status(&w, "ops-token"), "200");
    assert_eq!(
        token_reviews(&w),
        reviews,
        "the cached token outlived a +1 h step"
    );

    // Back two hours (an hour behind the real clock): no stall, no expiry either.
    step_to(&w, -HOUR);
    let took = lease_follows(&w, -HOUR);
    eprintln!("clock -1 h: Lease renewed in the stepped time {took:?} after the step");
    w.wait("the step logged", LIMIT, || {
        w.log()
            .contains("the wall clock stepped by -7200 s")
            .then_some(())
    });
    assert_eq!(kubelet_status(&w, "ops-token"), "200");
    assert_eq!(
        token_reviews(&w),
        reviews,
        "the cached token outlived a -1 h step"
    );
    w.api
        .create_pod(&demo_pod("default", "after", "run", "ubuntu:24.04"))
        .expect("create pod");
    w.wait("after Running", LIMIT, || running_with_vm(&w, "after"));
    // Events are stamped by the (stepped) wall clock.
    let stamp = w.wait("after's Event", LIMIT, || {
        w.api
            .list_objects("events")
            .iter()
            .find(|e| e["involvedObject"]["name"] == "after")
            .and_then(|e| e["lastTimestamp"].as_str().map(str::to_string))
    });
    let t = stamp
        .parse::<k8s_openapi::jiff::Timestamp>()
        .expect("an RFC 3339 time")
        .as_second();
    assert!(
        (t - real_now() + HOUR).abs() < 120,
        "Event time {stamp} is not an hour behind"
    );
    let m = ureq::get(&format!("http://127.0.0.1:{}/metrics", w.metrics_port)).call();
    assert!(m.is_ok(), "/metrics answers");
}
