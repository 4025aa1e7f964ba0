//! The kubelet's Prometheus scrape paths over real TLS: `/metrics/cadvisor` against a real
//! process's /proc, `/metrics/probes` from the probe manager's results, `/metrics` as on 9091.
//!
//! The caller is metrics-server's token of the harness's RBAC table (get on nodes/stats and
//! nodes/metrics only), so every answer here also shows the paths are nodes/metrics.

use crate::kubelet_support;

use std::time::{Duration, Instant, SystemTime};

use kubelet_support::{pod, promtool_check, Harness, Options, Sleeper};
use vk_cocoon::probes::{ProbeAction, ProbeConfig, ProbeManager, ProbeTarget};

const METRICS_SERVER: (&str, &str) = ("Authorization", "Bearer stats-token");

fn get(h: &Harness, path: &str) -> String {
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let r = h.request(cfg, "GET", path, &[METRICS_SERVER]).unwrap();
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4"));
    r.text()
}

/// The value of the sample whose line starts with `series` (name and labels as written).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn cadvisor_series_match_proc_with_container_and_pod_level_labels() {
    let sleeper = Sleeper::start();
    let pid = sleeper.pid();
    let h = Harness::start(Options {
        pods: vec![
            pod("ns1", "web", Some(("vm-web", pid))),
            pod("ns1", "cold", None),
        ],
        ..Default::default()
    });
    let text = get(&h, "/metrics/cadvisor");
    promtool_check(&text);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rss_pages: f64 = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .nth(21)
        .unwrap()
        .parse()
        .unwrap();
    let container = "{container=\"agent\",id=\"/cocoon.slice/vm-vm-web.scope\",image=\"vk-ns1-web\",name=\"vk-ns1-web\",namespace=\"ns1\",pod=\"web\"}";
    let pod_level = "{container=\"\",id=\"/cocoon.slice/vm-vm-web.scope\",image=\"\",name=\"\",namespace=\"ns1\",pod=\"web\"}";
    for family in [
        "container_memory_working_set_bytes",
        "container_memory_rss",
        "container_memory_usage_bytes",
    ] {
        for labels in [container, pod_level] {
            let v = value(&text, &format!("{family}{labels}"))
                .unwrap_or_else(|| panic!("{family}{labels} missing:\n{text}"));
            let want = rss_pages * procfs::page_size() as f64;
            assert!(
                (v - want).abs() <= 64.0 * 4096.0,
                "{family}{labels} {v} vs {want}"
            );
        }
    }
    // The harness's stand-in tap is `lo`, which the sleeper's network namespace (the host's)
    // has: its counters are read from /proc/<pid>/net/dev.
    let rx = "container_network_receive_packets_total{container=\"\",id=\"/cocoon.slice/vm-vm-web.scope\",image=\"\",interface=\"lo\",name=\"\",namespace=\"ns1\",pod=\"web\"}";
    assert!(value(&text, rx).is_some_and(|v| v > 0.0), "{text}");
    let cpu = format!("container_cpu_usage_seconds_total{container}");
    assert!(value(&text, &cpu).is_some(), "{text}");
    assert!(
        !text.contains("pod=\"cold\""),
        "a pod without a VM has no series"
    );
    let cores = value(&text, "machine_cpu_cores ").unwrap_or(0.0);
    let online = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    assert!(cores >= online, "{cores} cores, {online} usable");
    assert!(value(&text, "machine_memory_bytes ").unwrap_or(0.0) > 0.0);
    drop(sleeper);
}

#[test]
fn probe_results_are_counted_per_pod_and_dropped_when_probing_stops() {
    let h = Harness::start(Options {
        pods: vec![pod("ns1", "web", Some(("vm-web", 0)))],
        ..Default::default()
    });
    let mut m = ProbeManager::new(ProbeConfig::default(), None);
    m.set_probe_counts(h.probe_counts.clone());
    let target = ProbeTarget::from_parts("ns1", "uid-web", "vm-web", "127.0.0.1", "", None);
    let now = Instant::now();
    let wall = SystemTime::now();
    let started = m.start("ns1/web", Some(target), now, wall);
    let ping = started
        .iter()
        .find_map(|a| match a {
            ProbeAction::StartProbe { id, .. } => Some(*id),
            _ => None,
        })
        .expect("a probe started");
    m.on_result(ping, Ok(()), now + Duration::from_millis(1));
    // A pod whose VM is gone settles without probing: unknown.
    m.start("ns1/gone", None, now, wall);

    let text = get(&h, "/metrics/probes");
    promtool_check(&text);
    let series = |pod: &str, uid: &str, result: &str| {
        format!("prober_probe_total{{container=\"agent\",namespace=\"ns1\",pod=\"{pod}\",pod_uid=\"{uid}\",probe_type=\"Readiness\",result=\"{result}\"}}")
    };
    assert_eq!(
        value(&text, &series("web", "uid-web", "successful")),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, &series("web", "uid-web", "failed")),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(&text, &series("gone", "", "unknown")),
        Some(1.0),
        "{text}"
    );

    m.forget("ns1/web");
    let text = get(&h, "/metrics/probes");
    assert!(!text.contains("pod=\"web\""), "{text}");
    assert!(text.contains("pod=\"gone\""), "{text}");
}

#[test]
fn own_families_are_the_registry_text() {
    let h = Harness::start(Options::default());
    h.metrics
        .pod_lifecycle_total
        .with_label_values(&["create", "success", ""])
        .inc();
    let text = get(&h, "/metrics");
    promtool_check(&text);
    assert_eq!(
        value(
            &text,
            "vk_cocoon_pod_lifecycle_total{op=\"create\",reason=\"\",result=\"success\"}"
        ),
        Some(1.0),
        "{text}"
    );
    let serving = value(
        &text,
        "vk_cocoon_certificate_expiry_timestamp_seconds{certificate=\"kubelet-serving\"}",
    )
    .expect("the serving certificate's expiry");
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(serving > now, "{serving}");
    // The trailing-slash twins answer the same.
    assert!(get(&h, "/metrics/cadvisor/").contains("# TYPE machine_cpu_cores gauge"));
    assert!(get(&h, "/metrics/probes/").contains("# TYPE prober_probe_total counter"));
}

/// `/metrics/cadvisor` is rendered on a helper thread while the scrape waits on its connection:
/// concurrent scrapes all get the whole text, and a keep-alive client pipelining a scrape
/// between two other requests gets its three answers in order.
#[test]
fn cadvisor_scrapes_wait_for_the_render_off_the_loop_and_keep_their_order() {
    let sleeper = Sleeper::start();
    let pid = sleeper.pid();
    let pods: Vec<_> = (0..300)
        .map(|i| pod("ns1", &format!("p{i}"), Some((&format!("vm-{i}"), pid))))
        .collect();
    let h = Harness::start(Options {
        pods,
        ..Default::default()
    });
    let texts: Vec<String> = std::thread::scope(|s| {
        let scrapes: Vec<_> = (0..6)
            .map(|_| s.spawn(|| get(&h, "/metrics/cadvisor")))
            .collect();
        scrapes.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for text in &texts {
        for i in [0, 150, 299] {
            let series = format!("container_memory_working_set_bytes{{container=\"agent\",id=\"/cocoon.slice/vm-vm-{i}.scope\"");
            assert!(text.contains(&series), "p{i} missing");
        }
    }

    let cfg = h.client_config(None, &h.pki.ca_pem);
    let mut s = h.connect(cfg).unwrap();
    let auth = "Authorization: Bearer stats-token\r\n";
    let pipelined = format!(
        "GET /metrics/probes HTTP/1.1\r\nHost: x\r\n{auth}\r\n\
         GET /metrics/cadvisor HTTP/1.1\r\nHost: x\r\n{auth}\r\n\
         GET /metrics/probes HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    );
    std::io::Write::write_all(&mut s, pipelined.as_bytes()).unwrap();
    let mut raw = Vec::new();
    match std::io::Read::read_to_end(&mut s, &mut raw) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => panic!("{e}"),
    }
    let raw = String::from_utf8_lossy(&raw);
    let probes_type = "# TYPE prober_probe_total counter";
    let first = raw.find(probes_type).expect("first /metrics/probes");
    let cadvisor = raw
        .find("# TYPE machine_cpu_cores gauge")
        .expect("the scrape");
    let last = raw.rfind(probes_type).expect("last /metrics/probes");
    assert!(first < cadvisor && cadvisor < last, "answers out of order");
    assert_eq!(raw.matches("HTTP/1.1 200").count(), 3);
    drop(sleeper);
}
