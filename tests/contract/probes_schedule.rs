//! The readiness schedule of the pure probe manager, driven in virtual time: the test plays the
//! event loop (a timer wheel and a network whose reachability it controls) and checks when
//! probes run, when readiness flips and that nothing is left armed after a pod is forgotten.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use vk_cocoon::network::leases::LeaseFile;
use vk_cocoon::probes::{
    ProbeAction, ProbeConfig, ProbeEvent, ProbeId, ProbeKind, ProbeManager, ProbeTarget, TimerKey,
};

const POD: &str = "ns1/pod-a";
const MAC: &str = "02:00:0a:00:00:05";

/// A virtual event loop: timers ordered by due time, probes answered after a fixed delay
/// when the network is up, never when it is down (so they run into their timeout).
struct World {
    t0: Instant,
    now: Instant,
    timers: BTreeMap<(Instant, u64), TimerKey>,
    armed: HashMap<TimerKey, Instant>,
    /// Probes in flight and when their answer arrives (None: never).
    probes: HashMap<ProbeId, Option<Instant>>,
    reachable: bool,
    rtt: Duration,
    started: Vec<(Duration, ProbeKind)>,
    readiness: Vec<(Duration, bool, bool)>,
    /// IP changes with the readiness they carry.
    ip_changes: Vec<(Option<Ipv4Addr>, bool)>,
}

impl World {
    fn new() -> World {
        let t0 = Instant::now();
        World {
            t0,
            now: t0,
            timers: BTreeMap::new(),
            armed: HashMap::new(),
            probes: HashMap::new(),
            reachable: true,
            rtt: Duration::from_millis(2),
            started: Vec::new(),
            readiness: Vec::new(),
            ip_changes: Vec::new(),
        }
    }

    fn at(&self) -> Duration {
        self.now - self.t0
    }

    fn apply(&mut self, actions: Vec<ProbeAction>) {
        for a in actions {
            match a {
                ProbeAction::ArmTimer { key, at } => {
                    assert!(at >= self.now, "timer armed in the past");
                    assert!(self.armed.insert(key, at).is_none(), "timer key reused");
                    self.timers.insert((at, key.0), key);
                }
                ProbeAction::CancelTimer { key } => {
                    let at = self
                        .armed
                        .remove(&key)
                        .expect("cancel of a timer not armed");
                    self.timers.remove(&(at, key.0));
                }
                ProbeAction::StartProbe { id, kind } => {
                    self.started.push((self.at(), kind));
                    let done = self.reachable.then_some(self.now + self.rtt);
                    self.probes.insert(id, done);
                }
                ProbeAction::AbortProbe { id } => {
                    self.probes
                        .remove(&id)
                        .expect("abort of a probe not running");
                }
                ProbeAction::Notify(ProbeEvent::IpChanged { ip, uid, ready, .. }) => {
                    assert_eq!(uid, "uid-1");
                    self.ip_changes.push((ip, ready))
                }
                ProbeAction::Notify(ProbeEvent::Readiness {
                    pod,
                    ready,
                    first,
                    uid,
                    message,
                    ..
                }) => {
                    // A pod started without a VM has no target and so no UID to echo.
                    let want = if pod == "ns1/gone" { "" } else { "uid-1" };
                    assert_eq!(uid, want);
                    assert!(!message.is_empty());
                    self.readiness.push((self.at(), ready, first))
                }
            }
        }
    }

    /// Run the loop until virtual time `until` (relative to t0).
    fn run(&mut self, m: &mut ProbeManager, until: Duration) {
        loop {
            let next_timer = self.timers.keys().next().map(|(at, _)| *at);
            let next_reply = self
                .probes
                .iter()
                .filter_map(|(id, at)| at.map(|at| (at, *id)))
                .min();
            let next = match (next_timer, next_reply) {
                (Some(t), Some((r, _))) => t.min(r),
                (Some(t), None) => t,
                (None, Some((r, _))) => r,
                (None, None) => break,
            };
            if next > self.t0 + until {
                break;
            }
            self.now = next;
            if let Some((r, id)) = next_reply.filter(|(r, _)| *r == next) {
                let _ = r;
                self.probes.remove(&id);
                let actions = m.on_result(id, Ok(()), self.now);
                self.apply(actions);
                continue;
            }
            let (&(at, k), &key) = self.timers.iter().next().unwrap();
            self.timers.remove(&(at, k));
            self.armed.remove(&key);
            let actions = m.on_timer(key, self.now, SystemTime::now());
            self.apply(actions);
        }
        self.now = self.t0 + until;
    }

    fn starts_between(&self, from: Duration, to: Duration) -> Vec<Duration> {
        self.started
            .iter()
            .map(|(t, _)| *t)
            .filter(|t| *t >= from && *t <= to)
            .collect()
    }
}

fn target(ip: Option<Ipv4Addr>) -> ProbeTarget {
    ProbeTarget {
        namespace: "ns1".into(),
        uid: "uid-1".into(),
        vm_id: "vm-1".into(),
        ip,
        mac: None,
        static_ip: false,
        probe_port: None,
        ssh_banner: false,
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn gaps(times: &[Duration]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

fn write_leases(path: &Path, rows: &[(&str, &str)]) {
    let body: Vec<String> = rows
        .iter()
        .map(|(mac, ip)| {
            format!(r#"{{"mac":"{mac}","ip":"{ip}","expiry":"2099-01-01T00:00:00Z"}}"#)
        })
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("[{}]", body.join(","))).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn first_probe_at_once_and_first_result_is_not_a_notification() {
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    let actions = m.start(
        POD,
        Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
        w.now,
        SystemTime::now(),
    );
    w.apply(actions);
    assert_eq!(w.started.len(), 1, "first probe starts inside start()");
    assert_eq!(w.started[0].0, Duration::ZERO);
    w.run(&mut m, ms(10));
    assert_eq!(
        w.readiness,
        vec![(ms(2), true, true)],
        "first result is marked first"
    );
    assert_eq!(m.result(POD).map(|r| r.message.as_str()), Some("ping ok"));
    // Ready from the first probe: every 5 s measured from the end of the previous probe.
    w.run(&mut m, Duration::from_secs(21));
    let starts: Vec<Duration> = w.started.iter().map(|(t, _)| *t).collect();
    assert_eq!(gaps(&starts), vec![ms(5002); 4]);
    assert_eq!(
        w.readiness.len(),
        1,
        "no notification while readiness does not change"
    );
}

#[test]
fn not_ready_backoff_grows_by_half_to_one_second_then_ready_switches_to_five() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    write_leases(&path, &[]);
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), Some(LeaseFile::new(&path)));
    let mut t = target(None);
    t.mac = Some(MAC.to_uppercase());
    let actions = m.start(POD, Some(t), w.now, SystemTime::now());
    w.apply(actions);
    // No lease: every probe settles at once as "waiting for dhcp lease"; no packets.
    w.run(&mut m, ms(4100));
    assert!(w.started.is_empty());
    assert_eq!(w.readiness, vec![(Duration::ZERO, false, true)]);
    let r = m.result(POD).unwrap();
    assert!(!r.ready);
    assert_eq!(r.message, "waiting for dhcp lease");
    let probe_times: Vec<Duration> = {
        // Reconstruct probe times from the stored results' timestamps by stepping again.
        let mut times = vec![Duration::ZERO];
        let mut sleep = 100.0f64;
        let mut t = 0.0f64;
        while t + sleep <= 4100.0 {
            t += sleep;
            times.push(Duration::from_secs_f64(t / 1000.0));
            sleep = (sleep * 1.5).min(1000.0);
        }
        times
    };
    // 0, 100, 250, 475, 812.5, 1318.75, 2078.125, 3078.125, 4078.125 ms
    assert_eq!(probe_times.len(), 9);
    assert_eq!(
        r.at - w.t0,
        *probe_times.last().unwrap(),
        "last probe ran exactly on schedule"
    );

    // cocoon-net hands out a lease: the next probe (at 5078.125 ms) finds it and pings.
    write_leases(&path, &[(MAC, "10.88.0.5")]);
    w.run(&mut m, ms(5100));
    assert_eq!(
        w.ip_changes,
        vec![(Some(Ipv4Addr::new(10, 88, 0, 5)), false)]
    );
    assert_eq!(w.started.len(), 1);
    assert_eq!(w.started[0].0, Duration::from_micros(5_078_125));
    assert_eq!(w.started[0].1, ProbeKind::Ping(Ipv4Addr::new(10, 88, 0, 5)));
    assert_eq!(
        w.readiness.last(),
        Some(&(Duration::from_micros(5_080_125), true, false)),
        "not-ready -> ready notifies at once"
    );
    w.run(&mut m, ms(16_000));
    let starts = w.starts_between(Duration::ZERO, ms(16_000));
    assert_eq!(gaps(&starts), vec![ms(5002); 2], "ready cadence is 5 s");
}

#[test]
fn three_consecutive_failures_flip_ready_and_reset_the_interval() {
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    let actions = m.start(
        POD,
        Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
        w.now,
        SystemTime::now(),
    );
    w.apply(actions);
    w.run(&mut m, ms(100));
    assert_eq!(m.is_ready(POD), Some(true));

    // The guest goes away just after the probe at 5.002 s.
    w.run(&mut m, ms(5010));
    w.reachable = false;
    // Failure 1: probe at 10.004 s, times out at 13.004 s.
    w.run(&mut m, ms(13_004));
    let r = m.result(POD).unwrap();
    assert!(!r.ready, "the stored result turns at the first failure");
    assert!(
        r.message.starts_with("ping failed: timeout"),
        "{}",
        r.message
    );
    assert_eq!(m.is_ready(POD), Some(true), "but readiness holds");
    assert_eq!(w.readiness.len(), 1, "and nothing is notified");
    // Failure 2 at 18.004 -> 21.004; failure 3 at 26.004 -> 29.004 flips.
    w.run(&mut m, ms(29_003));
    assert_eq!(w.readiness.len(), 1);
    w.run(&mut m, ms(29_004));
    assert_eq!(w.readiness.last(), Some(&(ms(29_004), false, false)));
    assert_eq!(m.is_ready(POD), Some(false));
    // Not ready again: back to 100 ms after the failure.
    w.run(&mut m, ms(29_200));
    assert_eq!(w.starts_between(ms(29_005), ms(29_200)), vec![ms(29_104)]);

    let starts = w.starts_between(ms(5_000), ms(29_000));
    assert_eq!(starts, vec![ms(5_002), ms(10_004), ms(18_004), ms(26_004)]);
}

#[test]
fn a_success_between_failures_resets_the_count() {
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    let actions = m.start(
        POD,
        Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
        w.now,
        SystemTime::now(),
    );
    w.apply(actions);
    w.run(&mut m, ms(100));
    // fail, fail, ok, fail, fail: never three in a row.
    let plan = [false, false, true, false, false];
    for up in plan {
        w.reachable = up;
        let before = w.started.len();
        let mut horizon = w.at();
        while w.started.len() == before {
            horizon += ms(500);
            w.run(&mut m, horizon);
        }
        w.run(&mut m, w.at() + ms(3_001));
    }
    assert_eq!(m.is_ready(POD), Some(true));
    assert_eq!(w.readiness.len(), 1);
    assert!(!m.result(POD).unwrap().ready);
}

#[test]
fn forgetting_mid_probe_leaves_no_timer_or_probe_behind() {
    let mut w = World::new();
    w.reachable = false;
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    for i in 0..50 {
        let pod = format!("ns1/p{i}");
        let actions = m.start(
            &pod,
            Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
            w.now,
            SystemTime::now(),
        );
        w.apply(actions);
    }
    w.run(&mut m, ms(1_000));
    assert_eq!(m.probes_in_flight(), 50);
    assert_eq!(w.armed.len(), 50);
    for i in 0..50 {
        let actions = m.forget(&format!("ns1/p{i}"));
        w.apply(actions);
    }
    assert_eq!(m.agents(), 0);
    assert_eq!(m.armed_timers(), 0);
    assert_eq!(m.probes_in_flight(), 0);
    assert!(w.armed.is_empty(), "every timer was cancelled");
    assert!(w.probes.is_empty(), "every probe was aborted");
    assert!(m.result("ns1/p0").is_none());
    // A restart replaces the agent; late results of the old incarnation are ignored.
    let actions = m.start(
        POD,
        Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
        w.now,
        SystemTime::now(),
    );
    let old = actions.iter().find_map(|a| match a {
        ProbeAction::StartProbe { id, .. } => Some(*id),
        _ => None,
    });
    w.apply(actions);
    let actions = m.start(
        POD,
        Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
        w.now,
        SystemTime::now(),
    );
    w.apply(actions);
    assert_eq!(w.armed.len(), 1);
    assert!(m.on_result(old.unwrap(), Ok(()), w.now).is_empty());
    assert!(m.result(POD).is_none());
}

#[test]
fn settled_results_without_network_probe() {
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    let actions = m.start("ns1/gone", None, w.now, SystemTime::now());
    w.apply(actions);
    assert_eq!(m.result("ns1/gone").unwrap().message, "vm gone");
    let mut t = target(Some(Ipv4Addr::new(10, 0, 0, 2)));
    t.probe_port = Some("ssh".into());
    let actions = m.start("ns1/badport", Some(t.clone()), w.now, SystemTime::now());
    w.apply(actions);
    let r = m.result("ns1/badport").unwrap();
    assert!(!r.ready);
    assert_eq!(r.message, "invalid probe-port \"ssh\"");
    // Fixing the annotation switches to a TCP probe at the next run.
    t.probe_port = Some("2222".into());
    m.update_target("ns1/badport", Some(t));
    w.run(&mut m, ms(150));
    assert!(w
        .started
        .iter()
        .any(|(_, k)| matches!(k, ProbeKind::Tcp(a) if a.port() == 2222)));
    assert!(w
        .started
        .iter()
        .all(|(_, k)| !matches!(k, ProbeKind::Ping(_))));
}

#[test]
fn static_nic_and_lease_errors_keep_the_tracked_ip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    std::fs::write(&path, "[{\"mac\":").unwrap();
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), Some(LeaseFile::new(&path)));
    let mut t = target(Some(Ipv4Addr::new(10, 0, 0, 9)));
    t.mac = Some(MAC.into());
    let actions = m.start(POD, Some(t.clone()), w.now, SystemTime::now());
    w.apply(actions);
    assert_eq!(w.started[0].1, ProbeKind::Ping(Ipv4Addr::new(10, 0, 0, 9)));
    // Without a tracked IP a broken file leaves the pod waiting, with the reason.
    t.ip = None;
    let actions = m.start("ns1/b", Some(t.clone()), w.now, SystemTime::now());
    w.apply(actions);
    let r = m.result("ns1/b").unwrap();
    assert!(
        r.message.starts_with("waiting for dhcp lease (lease file"),
        "{}",
        r.message
    );
    // A static NIC never consults the lease file, even when a lease exists.
    write_leases(&path, &[(MAC, "10.88.0.5")]);
    t.ip = Some(Ipv4Addr::new(10, 0, 0, 7));
    t.static_ip = true;
    let actions = m.start("ns1/c", Some(t), w.now, SystemTime::now());
    w.apply(actions);
    assert_eq!(
        w.started.last().unwrap().1,
        ProbeKind::Ping(Ipv4Addr::new(10, 0, 0, 7))
    );
}

/// A lease missing for fewer probes than flip a ready pod: the IP changes it causes carry the
/// readiness last notified (ready), not the failed probe's result. Publishing not-ready there
/// would never be undone: the probes that follow succeed, and a ready agent notifies nothing.
#[test]
fn a_lease_missing_for_one_probe_keeps_a_ready_pod_ready() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    write_leases(&path, &[(MAC, "10.88.0.5")]);
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), Some(LeaseFile::new(&path)));
    let mut t = target(None);
    t.mac = Some(MAC.into());
    let actions = m.start(POD, Some(t), w.now, SystemTime::now());
    w.apply(actions);
    w.run(&mut m, ms(100));
    assert_eq!(m.is_ready(POD), Some(true));
    // The lease goes away for one probe (5 s later), then comes back.
    write_leases(&path, &[]);
    w.run(&mut m, ms(5_100));
    assert_eq!(
        m.result(POD).map(|r| r.ready),
        Some(false),
        "the probe saw no lease"
    );
    write_leases(&path, &[(MAC, "10.88.0.5")]);
    w.run(&mut m, ms(20_000));
    let ip = Ipv4Addr::new(10, 88, 0, 5);
    assert_eq!(
        w.ip_changes,
        vec![(Some(ip), false), (None, true), (Some(ip), true)]
    );
    assert_eq!(m.is_ready(POD), Some(true));
    assert!(
        w.readiness.iter().all(|(_, ready, _)| *ready),
        "{:?}",
        w.readiness
    );
}

#[test]
fn durations_are_observed_per_namespace() {
    let h = vk_cocoon::probes::probe_duration_histogram();
    let mut w = World::new();
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    m.set_duration_histogram(h.clone());
    let actions = m.start(
        POD,
        Some(target(Some(Ipv4Addr::new(10, 0, 0, 2)))),
        w.now,
        SystemTime::now(),
    );
    w.apply(actions);
    w.run(&mut m, ms(10_100));
    let hist = h.with_label_values(&["ns1"]);
    assert_eq!(hist.get_sample_count(), 3);
    assert!((hist.get_sample_sum() - 0.006).abs() < 1e-9);
}
