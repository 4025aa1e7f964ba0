//! Benchmark: scrapes with 1,000 tracked VMs — /stats/summary and /metrics/resource over HTTPS
//! (keep-alive, authorised), the 9091 /metrics endpoint over HTTP, a full sample refresh and
//! the /metrics/cadvisor rendering a helper thread does once per sample.
//! `cargo test --release --test benches stats_bench -- --ignored --nocapture`
//! Zero forks: run it under `strace -f -e trace=execve,fork,vfork -o trace.txt` and count execve.

use crate::kubelet_support;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kubelet_support::{Harness, Options};
use vk_cocoon::kubelet::{PodInfo, PodVm};
use vk_cocoon::metrics::collectors::VmCollector;
use vk_cocoon::metrics::http::MetricsServer;
use vk_cocoon::metrics::stats::{read_sample, StatsHub, TrackedVm};
use vk_cocoon::metrics::Metrics;
use vk_cocoon::reactor::{Event, Reactor};

fn p(samples: &mut [Duration], q: f64) -> f64 {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
    samples[i].as_secs_f64() * 1000.0
}

fn report(name: &str, mut s: Vec<Duration>) {
    let (p50, p99, max) = (p(&mut s, 0.5), p(&mut s, 0.99), p(&mut s, 1.0));
    println!(
        "{name:<44} n={:<4} p50 {p50:7.3} ms  p99 {p99:7.3} ms  max {max:7.3} ms",
        s.len()
    );
}

fn pods(n: usize) -> Vec<PodInfo> {
    // Every VM points at this process: real /proc/<pid>/stat and net/dev files to read.
    let pid = std::process::id();
    (0..n)
        .map(|i| {
            let mut p = kubelet_support::pod(&format!("ns{}", i % 20), &format!("pod-{i}"), None);
            p.vm = Some(PodVm {
                id: format!("vm{i:04}"),
                name: format!("vk-pod-{i}"),
                pid,
                tap: Some("lo".into()),
                backend: "cloud-hypervisor".into(),
                disk: String::new(),
            });
            p
        })
        .collect()
}

#[test]
#[ignore]
fn bench_scrapes_with_1000_vms() {
    const N: usize = 1000;
    let h = Harness::start(Options {
        pods: pods(N),
        ..Default::default()
    });
    // cgroup cpu.stat and COW files for every VM, like a busy host.
    let paths = h.stats.paths().clone();
    for i in 0..N {
        let scope = paths
            .cgroup_root
            .join(&paths.cgroup_parent)
            .join(format!("vm-vm{i:04}.scope"));
        std::fs::create_dir_all(&scope).unwrap();
        std::fs::write(
            scope.join("cpu.stat"),
            format!(
                "usage_usec {}\nnr_throttled 1\nthrottled_usec 5\n",
                i * 1000
            ),
        )
        .unwrap();
        let run = paths
            .cocoon_root
            .join("run/cloudhypervisor")
            .join(format!("vm{i:04}"));
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("cow.raw"), [1u8; 4096]).unwrap();
    }
    let vms: Vec<TrackedVm> = h.stats.vms().to_vec();
    assert_eq!(vms.len(), N);

    // Full refresh cost (what one scrape pays at most once per 2 s).
    let mut refresh = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        let s = read_sample(&paths, &vms, Instant::now());
        refresh.push(t.elapsed());
        assert_eq!(s.vms.len(), N);
    }
    report("sample refresh (1000 VMs, files read)", refresh);

    // HTTPS scrapes on one keep-alive connection, as Prometheus / metrics-server do.
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let mut s = h.connect(cfg).unwrap();
    for path in ["/stats/summary", "/metrics/resource"] {
        let mut lat = Vec::new();
        let mut bytes = 0;
        for i in 0..200 {
            let t = Instant::now();
            s.write_all(
                format!(
                    "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer admin-token\r\n\r\n"
                )
                .as_bytes(),
            )
            .unwrap();
            let body = read_response(&mut s);
            lat.push(t.elapsed());
            bytes = body;
            // Spread the scrapes over more than one TTL so refreshes are part of the figures.
            if i % 50 == 49 {
                std::thread::sleep(Duration::from_millis(700));
            }
        }
        report(&format!("HTTPS {path} ({bytes} bytes)"), lat);
    }

    // The cAdvisor text, rendered off the loop once per sample (the scrapes between reuse it):
    // what a scrape waits for, not what the loop spends.
    let sample = h.stats.sample(Instant::now());
    let facts: vk_cocoon::metrics::cadvisor::PodFactsMap = pods(N)
        .iter()
        .map(|p| {
            let key = (p.namespace.clone(), p.name.clone());
            (key, vk_cocoon::kubelet::server::pod_facts(p))
        })
        .collect();
    let mut lat = Vec::new();
    let mut size = 0;
    for _ in 0..30 {
        let t = Instant::now();
        let text = vk_cocoon::metrics::cadvisor::cadvisor_text(&sample, &facts, "cocoon.slice");
        lat.push(t.elapsed());
        size = text.len();
    }
    report(&format!("cadvisor_text render ({size} bytes)"), lat);

    // 9091: the daemon's whole /metrics answer (registry families + the per-VM text) over
    // plain HTTP, one connection per scrape as Prometheus does with Connection: close.
    let metrics = Metrics::new().unwrap();
    let hub: StatsHub = h.stats.clone();
    metrics
        .add_text_source(Arc::new(VmCollector::new(hub)))
        .unwrap();
    // The text alone, comparable with the former registry gather + encode of the collectors.
    let mut lat = Vec::new();
    let mut size = 0;
    for _ in 0..200 {
        let t = Instant::now();
        let text = metrics.encode();
        lat.push(t.elapsed());
        size = text.len();
    }
    report(&format!("9091 Metrics::encode ({size} bytes)"), lat);
    let server = MetricsThread::start(metrics);
    let mut lat = Vec::new();
    let mut size = 0;
    for i in 0..200 {
        let t = Instant::now();
        let mut c = std::net::TcpStream::connect(server.addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = Vec::new();
        c.read_to_end(&mut text).unwrap();
        lat.push(t.elapsed());
        assert!(text.starts_with(b"HTTP/1.1 200 OK"));
        size = text.len();
        if i % 50 == 49 {
            std::thread::sleep(Duration::from_millis(700));
        }
    }
    report(&format!("HTTP 9091 /metrics ({size} bytes)"), lat);
    println!("sample refreshes performed: {}", h.stats.refresh_count());
}

/// Reads one Content-Length response; returns the body size.
fn read_response(s: &mut impl Read) -> usize {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).unwrap(), 1);
        head.push(b[0]);
    }
    let text = String::from_utf8_lossy(&head);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let len: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match s.read(&mut body[got..]) {
            Ok(0) => panic!("closed after {got} of {len} bytes"),
            Ok(n) => got += n,
            Err(e) => panic!("{e} after {got} of {len} bytes"),
        }
    }
    len
}

/// The 9091 server on its own reactor thread, as the daemon runs it (minus the other rooms).
struct MetricsThread {
    addr: std::net::SocketAddr,
}

impl MetricsThread {
    fn start(metrics: Metrics) -> MetricsThread {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reactor: Reactor<()> = Reactor::new(1, 4).unwrap();
            let addr = vk_cocoon::config::ListenAddr {
                host: "127.0.0.1".into(),
                port: 0,
            };
            let mut server = MetricsServer::bind(&addr, metrics, &mut reactor).unwrap();
            tx.send(server.local_addr()).unwrap();
            let mut events = Vec::new();
            loop {
                events.clear();
                reactor.poll(&mut events).unwrap();
                for ev in events.drain(..) {
                    match ev {
                        Event::Io(ready) => {
                            server.handle_io(&mut reactor, &ready);
                        }
                        Event::Timer { id, .. } => {
                            server.handle_timer(&mut reactor, id);
                        }
                        _ => {}
                    }
                }
            }
        });
        MetricsThread {
            addr: rx.recv().unwrap(),
        }
    }
}
