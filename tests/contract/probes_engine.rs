//! The probe engine on real sockets, driven by a reactor-style loop (mio poll, timer heap,
//! clock read once per wake-up): TCP probes on loopback, and ICMP to a guest address behind a
//! veth pair inside namespaces the test creates, whose link the test takes down and up.

use crate::load_support;
use crate::probes_support;

use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant, SystemTime};

use probes_support::{is_child, TestLoop, VethPair, GUEST_SIDE};
use vk_cocoon::network::icmp::{Pinger, PingerMode};
use vk_cocoon::probes::{ProbeConfig, ProbeEngine, ProbeEvent, ProbeManager, ProbeTarget};

/// The readiness schedule scaled down ×~10 so that three failures take about two seconds.
fn fast() -> ProbeConfig {
    ProbeConfig {
        timeout: Duration::from_millis(300),
        first_retry: Duration::from_millis(50),
        retry_growth: 1.5,
        max_retry: Duration::from_millis(200),
        ready_interval: Duration::from_millis(400),
        failures_to_unready: 3,
    }
}

fn target(ip: Ipv4Addr, port: Option<u16>) -> Option<ProbeTarget> {
    Some(ProbeTarget {
        namespace: "ns1".into(),
        uid: "uid-1".into(),
        vm_id: "vm-1".into(),
        ip: Some(ip),
        mac: None,
        static_ip: false,
        probe_port: port.map(|p| p.to_string()),
        ssh_banner: false,
    })
}

/// Everything the loop showed: stored results as they changed, and provider events.
#[derive(Default)]
struct Trace {
    results: Vec<(Instant, bool, String)>,
    events: Vec<(Instant, ProbeEvent)>,
}

impl Trace {
    fn see<T: Copy>(
        &mut self,
        pod: &str,
        now: Instant,
        ev: Option<&ProbeEvent>,
        engine: &ProbeEngine<T>,
    ) {
        if let Some(r) = engine.manager().result(pod) {
            if self.results.last().is_none_or(|(at, _, _)| *at != r.at) {
                self.results.push((r.at, r.ready, r.message.clone()));
            }
        }
        if let Some(ev) = ev {
            self.events.push((now, ev.clone()));
        }
    }
}

/// The host's load over this binary's measurements (started by the first wait): the cadence
/// bars below hold only when a woken thread gets a CPU at once; their lower bounds (timers
/// never early) hold whatever the load.
static LOAD: std::sync::OnceLock<load_support::WakeupProbe> = std::sync::OnceLock::new();

fn quiet_host() -> bool {
    LOAD.get_or_init(load_support::WakeupProbe::start).quiet()
}

fn readiness(ev: Option<&ProbeEvent>) -> Option<(bool, bool)> {
    match ev {
        Some(ProbeEvent::Readiness { ready, first, .. }) => Some((*ready, *first)),
        _ => None,
    }
}

/// Run until the pod's readiness event `want` (ready, first) or fail after `limit`.
fn until_readiness<T: Copy>(
    lp: &mut TestLoop,
    engine: &mut ProbeEngine<T>,
    trace: &mut Trace,
    pod: &str,
    want: (bool, bool),
    limit: Duration,
) -> Instant
where
    TestLoop: vk_cocoon::probes::ProbeHost<TimerId = T>,
{
    LOAD.get_or_init(load_support::WakeupProbe::start);
    let mut at = None;
    let found = lp.run(engine, Instant::now() + limit, |now, ev, engine| {
        trace.see(pod, now, ev, engine);
        if readiness(ev) == Some(want) {
            at = Some(now);
            return true;
        }
        false
    });
    assert!(
        found,
        "no readiness {want:?} within {limit:?}; results: {:?}",
        trace.results
    );
    at.unwrap()
}

/// Check the failures between `from` and `flip`: exactly `n`, the flip on the last one, and
/// consecutive failing probes `ready_interval` apart (end of one to start of the next).
fn assert_flip_after_failures(
    trace: &Trace,
    from: Instant,
    flip: Instant,
    n: usize,
    cfg: &ProbeConfig,
) {
    let failures: Vec<&(Instant, bool, String)> = trace
        .results
        .iter()
        .filter(|(at, ready, _)| *at > from && *at <= flip && !*ready)
        .collect();
    assert_eq!(
        failures.len(),
        n,
        "failures before the flip: {:?}",
        trace.results
    );
    assert_eq!(
        failures.last().map(|f| f.0),
        Some(flip),
        "the flip comes with the last failure"
    );
    for w in failures.windows(2) {
        let gap = w[1].0 - w[0].0;
        // The next probe starts ready_interval after the previous result, then takes up to
        // its timeout; timers never fire early.
        assert!(
            gap >= cfg.ready_interval,
            "gap {gap:?} shorter than the ready interval"
        );
        assert!(
            gap <= cfg.ready_interval + cfg.timeout + Duration::from_millis(250) || !quiet_host(),
            "gap {gap:?}"
        );
    }
}

#[test]
fn tcp_probe_flips_ready_on_listener_and_back_after_three_refusals() {
    let mut lp = TestLoop::new();
    let manager = ProbeManager::new(fast(), None);
    let mut engine = ProbeEngine::new(manager, Pinger::open(), &mut lp).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let pod = "ns1/tcp";
    let mut trace = Trace::default();
    let t0 = Instant::now();
    let events = engine.start(
        &mut lp,
        pod,
        target(Ipv4Addr::LOCALHOST, Some(port)),
        t0,
        SystemTime::now(),
    );
    assert!(
        events.is_empty(),
        "a TCP connect never completes inside start"
    );
    let first = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (true, true),
        Duration::from_secs(30),
    );
    assert!(first - t0 < Duration::from_millis(200) || !quiet_host());
    assert_eq!(engine.manager().result(pod).unwrap().message, "tcp ok");

    drop(listener);
    let down = Instant::now();
    let cfg = fast();
    let flip = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (false, false),
        Duration::from_secs(30),
    );
    assert_flip_after_failures(&trace, down, flip, 3, &cfg);
    let msg = &trace.results.last().unwrap().2;
    assert!(msg.starts_with(&format!("tcp probe {port}: ")), "{msg}");

    // After the flip the pre-ready cadence restarts at first_retry.
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let back = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (true, false),
        Duration::from_secs(30),
    );
    assert!(back - flip >= cfg.first_retry);
    assert!(
        back - flip < cfg.first_retry + Duration::from_millis(200) || !quiet_host(),
        "{:?}",
        back - flip
    );
    drop(listener);

    engine.forget(&mut lp, pod);
    assert_eq!(engine.host_timers(), 0);
    assert_eq!(lp.armed(), 0);
    assert_eq!(engine.sockets_in_flight(), 0);
}

/// A loopback server that greets each connection with `greeting` (nothing when empty) and
/// keeps it open for a while.
fn greeter(greeting: &'static [u8]) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                use std::io::Write;
                let _ = conn.write_all(greeting);
                std::thread::sleep(Duration::from_secs(5));
            });
        }
    });
    port
}

#[test]
fn ssh_banner_probe_wants_an_ssh_greeting_not_just_an_open_port() {
    let mut lp = TestLoop::new();
    let manager = ProbeManager::new(fast(), None);
    let mut engine = ProbeEngine::new(manager, Pinger::open(), &mut lp).unwrap();
    let cases: [(&str, &'static [u8], bool, &str); 3] = [
        ("ns1/sshd", b"SSH-2.0-OpenSSH_9.6\r\n", true, "ssh ok"),
        (
            "ns1/http",
            b"HTTP/1.1 400 Bad Request\r\n\r\n",
            false,
            "no SSH banner",
        ),
        // Accepts and stays silent: the probe times out.
        ("ns1/mute", b"", false, "ssh probe"),
    ];
    for (pod, greeting, want_ready, want_msg) in cases {
        let port = greeter(greeting);
        let mut t = target(Ipv4Addr::LOCALHOST, Some(port));
        if let Some(t) = t.as_mut() {
            t.ssh_banner = true;
        }
        let mut trace = Trace::default();
        engine.start(&mut lp, pod, t, Instant::now(), SystemTime::now());
        let done = lp.run(
            &mut engine,
            Instant::now() + Duration::from_secs(30),
            |now, ev, e| {
                trace.see(pod, now, ev, e);
                !trace.results.is_empty()
            },
        );
        assert!(done, "{pod}: no probe result");
        let (_, ready, msg) = trace.results[0].clone();
        assert_eq!(ready, want_ready, "{pod}: {msg}");
        assert!(msg.contains(want_msg), "{pod}: {msg}");
        engine.forget(&mut lp, pod);
    }
    assert_eq!(engine.sockets_in_flight(), 0);
}

#[test]
fn icmp_loopback_is_ready_on_the_first_probe_with_the_spec_schedule() {
    let mut lp = TestLoop::new();
    let manager = ProbeManager::new(ProbeConfig::default(), None);
    let mut engine = ProbeEngine::new(manager, Pinger::open(), &mut lp).unwrap();
    if engine.pinger_mode() == PingerMode::AssumeReachable {
        println!("SKIP: no ICMP socket available to this test process");
        return;
    }
    let mut trace = Trace::default();
    let pod = "ns1/lo";
    let t0 = Instant::now();
    let ev = engine.start(
        &mut lp,
        pod,
        target(Ipv4Addr::LOCALHOST, None),
        t0,
        SystemTime::now(),
    );
    assert!(ev.is_empty());
    let first = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (true, true),
        Duration::from_secs(30),
    );
    assert!(first - t0 < Duration::from_millis(100) || !quiet_host());
    assert_eq!(engine.manager().result(pod).unwrap().message, "ping ok");
    // One timer armed: the next probe, 5 s after this result.
    assert_eq!(lp.armed(), 1);
    assert_eq!(engine.host_timers(), 1);
    engine.forget(&mut lp, pod);
    assert_eq!(lp.armed(), 0);
}

#[test]
fn icmp_guest_behind_veth_flips_ready_with_link_state() {
    let Some(pair) = VethPair::create() else {
        return;
    };
    let out = pair.probe.run_child(
        "probes_engine::child_veth_guest",
        false,
        &[("VK_PROBES_GUEST_NS", &pair.guest.name)],
    );
    assert!(out.status.success(), "child failed");
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}

#[test]
#[ignore = "helper: run by icmp_guest_behind_veth_flips_ready_with_link_state inside the probe namespace"]
fn child_veth_guest() {
    if !is_child("child_veth_guest") {
        return;
    }
    let guest_ns = std::env::var("VK_PROBES_GUEST_NS").unwrap();
    let set_guest_link = |up: bool| {
        let st = std::process::Command::new("ip")
            .args([
                "-n",
                &guest_ns,
                "link",
                "set",
                "vg",
                if up { "up" } else { "down" },
            ])
            .status()
            .unwrap();
        assert!(st.success());
    };
    let cfg = fast();
    let mut lp = TestLoop::new();
    let mut engine = ProbeEngine::new(
        ProbeManager::new(cfg.clone(), None),
        Pinger::open(),
        &mut lp,
    )
    .unwrap();
    assert_eq!(engine.pinger_mode(), PingerMode::Raw);
    let guest: Ipv4Addr = GUEST_SIDE.parse().unwrap();
    let pod = "ns1/vm";
    let mut trace = Trace::default();

    // Reachable: Ready from the first probe (marked first: the provider publishes it).
    let t0 = Instant::now();
    engine.start(&mut lp, pod, target(guest, None), t0, SystemTime::now());
    let first = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (true, true),
        Duration::from_secs(30),
    );
    assert!(
        first - t0 < Duration::from_millis(250) || !quiet_host(),
        "{:?}",
        first - t0
    );

    // The guest's link goes down: three failed probes, the third one flips.
    set_guest_link(false);
    let down = Instant::now();
    let flip = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (false, false),
        Duration::from_secs(30),
    );
    assert_flip_after_failures(&trace, down, flip, 3, &cfg);
    assert!(
        flip - down >= cfg.ready_interval * 2 + cfg.timeout,
        "{:?}",
        flip - down
    );

    // Still down: probes continue on the not-ready cadence and stay failed.
    lp.run(
        &mut engine,
        Instant::now() + Duration::from_millis(800),
        |now, ev, e| {
            trace.see(pod, now, ev, e);
            assert!(readiness(ev).is_none(), "no readiness change while down");
            false
        },
    );
    assert!(!engine.manager().result(pod).unwrap().ready);

    // Link back up: Ready again without waiting for the ready cadence.
    set_guest_link(true);
    let up = Instant::now();
    let back = until_readiness(
        &mut lp,
        &mut engine,
        &mut trace,
        pod,
        (true, false),
        Duration::from_secs(30),
    );
    assert!(
        back - up <= cfg.timeout + cfg.max_retry + Duration::from_millis(500) || !quiet_host(),
        "{:?}",
        back - up
    );

    // A pod deleted while its echo is in flight (10.77.0.3 has no host: ARP never answers)
    // leaves no timer and no echo behind.
    engine.start(
        &mut lp,
        "ns1/gone",
        target(Ipv4Addr::new(10, 77, 0, 3), None),
        Instant::now(),
        SystemTime::now(),
    );
    lp.run(
        &mut engine,
        Instant::now() + Duration::from_millis(50),
        |_, _, _| false,
    );
    assert_eq!(
        engine.sockets_in_flight(),
        1,
        "the echo to 10.77.0.3 is in flight"
    );
    assert_eq!(
        engine.host_timers(),
        2,
        "its timeout timer and the first pod's next probe"
    );
    engine.forget(&mut lp, "ns1/gone");
    assert_eq!(engine.sockets_in_flight(), 0);
    assert_eq!(engine.host_timers(), 1);
    engine.forget(&mut lp, pod);
    assert_eq!(engine.host_timers(), 0);
    assert_eq!(lp.armed(), 0, "the loop holds no timer for a forgotten pod");
    assert_eq!(engine.manager().agents(), 0);
}

#[test]
fn engine_runs_on_the_real_reactor() {
    use vk_cocoon::reactor::Reactor;
    let mut reactor: Reactor<()> = Reactor::new(1, 4).unwrap();
    let baseline = reactor.timers_armed();
    let cfg = fast();
    let manager = ProbeManager::new(cfg.clone(), None);
    let mut engine = ProbeEngine::new(manager, Pinger::open(), &mut reactor).unwrap();
    let mut listener = Some(TcpListener::bind("127.0.0.1:0").unwrap());
    let port = listener.as_ref().unwrap().local_addr().unwrap().port();
    let pod = "ns1/r";
    let now = reactor.now();
    let t = target(Ipv4Addr::LOCALHOST, Some(port));
    assert!(engine
        .start(&mut reactor, pod, t, now, SystemTime::now())
        .is_empty());
    let mut seen = Vec::new();
    let mut out = Vec::new();
    let end = Instant::now() + Duration::from_secs(30);
    // Ready on the first connect; then the listener closes and three refusals flip it back.
    while seen.len() < 2 && Instant::now() < end {
        out.clear();
        reactor.poll(&mut out).unwrap();
        for ev in &out {
            let Some(events) = engine.handle_event(&mut reactor, ev, SystemTime::now()) else {
                continue;
            };
            for e in events {
                if let ProbeEvent::Readiness { ready, first, .. } = e {
                    seen.push((reactor.now(), ready, first));
                    if ready {
                        listener = None;
                    }
                }
            }
        }
    }
    assert!(listener.is_none());
    let kinds: Vec<(bool, bool)> = seen.iter().map(|s| (s.1, s.2)).collect();
    assert_eq!(kinds, vec![(true, true), (false, false)]);
    let flip = seen[1].0 - seen[0].0;
    assert!(flip >= cfg.ready_interval * 3, "flip after {flip:?}");
    engine.forget(&mut reactor, pod);
    assert_eq!(
        reactor.timers_armed(),
        baseline,
        "no probe timer left in the reactor"
    );
}
