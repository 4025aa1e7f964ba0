//! The shared stats sample against the real /proc of real processes, the Summary JSON built from
//! it, and promtool on both Prometheus renderings (/metrics/resource and the 9091 collectors).

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use crate::kubelet_support::{promtool_check, Sleeper};
use vk_cocoon::kubelet::stats::{build_summary, resource_metrics_text, Summary};
use vk_cocoon::metrics::collectors::VmCollector;
use vk_cocoon::metrics::stats::{StatsHub, StatsPaths, TrackedVm};
use vk_cocoon::metrics::Metrics;

/// Field 24 (rss pages) of /proc/<pid>/stat × page size, parsed here independently of the
/// sampler (the spec's source; on recent kernels it is the fast, approximate per-cpu counter).
fn statm_rss_bytes(pid: u32) -> u64 {
    let t = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_comm = &t[t.rfind(')').unwrap() + 2..];
    let pages: u64 = after_comm.split(' ').nth(21).unwrap().parse().unwrap();
    pages * procfs::page_size()
}

/// VmRSS of /proc/<pid>/status (the exact counter), bytes.
fn status_rss_bytes(pid: u32) -> u64 {
    let t = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = t
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    kib * 1024
}

fn vm(id: &str, pid: u32, ns: &str, tap: &str) -> TrackedVm {
    TrackedVm {
        vm_id: id.to_string(),
        vm_name: format!("vk-{ns}-{id}"),
        namespace: ns.to_string(),
        pod: format!("pod-{id}"),
        pod_uid: format!("uid-{id}"),
        pid,
        tap: Some(tap.to_string()),
        backend: "cloud-hypervisor".to_string(),
        disk: None,
    }
}

fn paths(tmp: &Path) -> StatsPaths {
    StatsPaths {
        proc_root: "/proc".into(),
        cgroup_root: tmp.join("cgroup"),
        cgroup_parent: "cocoon.slice".into(),
        cocoon_root: tmp.join("cocoon"),
    }
}

#[test]
fn sample_matches_real_proc_of_child_processes() {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("cocoon")).unwrap();
    // cgroup v2 cpu accounting is not available on every test host; the cpu.stat file format is
    // what matters, so the cgroup tree is a directory the test writes.
    let scope = tmp.path().join("cgroup/cocoon.slice/vm-a.scope");
    fs::create_dir_all(&scope).unwrap();
    fs::write(scope.join("cpu.stat"), "usage_usec 3250000\nuser_usec 3000000\nsystem_usec 250000\nnr_periods 10\nnr_throttled 2\nthrottled_usec 125000\n").unwrap();

    // Generate some loopback traffic so `lo` counters in the child's netns (ours) are non-zero.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s, _) = l.accept().unwrap();
    c.write_all(&[7u8; 4096]).unwrap();
    let mut got = [0u8; 4096];
    s.read_exact(&mut got).unwrap();

    let a = Sleeper::start();
    let b = Sleeper::start();
    let (pa, pb) = (a.pid(), b.pid());
    // Wait until both children are asleep in nanosleep: after exec the dynamic loader is still
    // mapping pages (comm already says `sleep`), so the RSS moves until the process blocks.
    for pid in [pa, pb] {
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while !fs::read_to_string(format!("/proc/{pid}/wchan"))
            .map(|w| w.contains("nanosleep"))
            .unwrap_or(false)
        {
            assert!(
                Instant::now() < deadline,
                "child {pid} did not reach its sleep"
            );
            std::thread::yield_now();
        }
    }
    let hub = StatsHub::new(paths(tmp.path()));
    hub.set_vms(vec![
        vm("a", pa, "ns1", "lo"),
        vm("b", pb, "ns2", "nosuchtap"),
        vm("c", 0, "ns2", "lo"),
    ]);
    let sample = stable_sample(&hub, &[pa, pb]);
    assert_eq!(sample.vms.len(), 2);
    let (sa, sb) = (&sample.vms[0], &sample.vms[1]);
    assert_eq!(sa.rss_bytes, statm_rss_bytes(pa), "rss of child a");
    assert_eq!(sb.rss_bytes, statm_rss_bytes(pb), "rss of child b");
    assert!(sa.rss_bytes > 0);
    assert!(
        sa.rss_bytes.abs_diff(status_rss_bytes(pa)) < 1 << 20,
        "close to VmRSS"
    );
    assert_eq!(sa.cpu_usage_usec, 3_250_000);
    assert_eq!(sa.cpu_throttled_usec, 125_000);
    assert_eq!(sa.cpu_throttled_periods, 2);
    assert_eq!(sb.cpu_usage_usec, 0, "no cgroup scope ⇒ 0");
    let lo_rx_after: u64 = fs::read_to_string(format!("/proc/{pa}/net/dev"))
        .unwrap()
        .lines()
        .find(|l| l.trim_start().starts_with("lo:"))
        .and_then(|l| {
            l.split_once(':')
                .unwrap()
                .1
                .split_whitespace()
                .next()
                .map(|v| v.parse().unwrap())
        })
        .unwrap();
    assert!(
        sa.rx_bytes >= 4096 && sa.rx_bytes <= lo_rx_after,
        "lo rx {} vs {}",
        sa.rx_bytes,
        lo_rx_after
    );
    assert_eq!((sb.rx_bytes, sb.tx_bytes), (0, 0));

    // Node figures against /proc/meminfo and statfs read independently.
    let mi = fs::read_to_string("/proc/meminfo").unwrap();
    let kib = |k: &str| -> u64 {
        mi.lines()
            .find(|l| l.starts_with(k))
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(sample.node.memory_total_bytes, kib("MemTotal:") * 1024);
    let used_now = (kib("MemTotal:") - kib("MemAvailable:")) * 1024;
    let diff = used_now.abs_diff(sample.node.memory_used_bytes);
    assert!(
        diff < 512 * 1024 * 1024,
        "used memory {} vs {}",
        sample.node.memory_used_bytes,
        used_now
    );
    assert!(sample.node.cpu_ticks > 0);
    assert!(sample.node.storage_total_bytes >= sample.node.storage_available_bytes);
    assert!(sample.node.storage_total_bytes > 0);

    // Summary JSON round-trips through the kubelet stats types with the same numbers.
    let summary = build_summary(&sample, "node-x", hub.process_start(), SystemTime::now());
    let text = serde_json::to_string(&summary).unwrap();
    let back: Summary = serde_json::from_str(&text).unwrap();
    assert_eq!(back, summary);
    assert_eq!(back.node.node_name, "node-x");
    assert_eq!(back.pods.len(), 2);
    let pa_stats = &back.pods[0];
    assert_eq!(pa_stats.pod_ref.name, "pod-a");
    assert_eq!(pa_stats.containers.len(), 1);
    assert_eq!(pa_stats.containers[0].name, "agent");
    let mem = pa_stats.containers[0].memory.as_ref().unwrap();
    assert_eq!(mem.working_set_bytes, Some(statm_rss_bytes(pa)));
    assert_eq!(
        pa_stats.cpu.as_ref().unwrap().usage_core_nano_seconds,
        Some(3_250_000_000)
    );
    assert_eq!(pa_stats.network.as_ref().unwrap().default.name, "lo");
    assert!(
        back.pods[1].network.is_none(),
        "no traffic ⇒ no network block"
    );
    // Field names on the wire are the kubelet's.
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["node"]["cpu"]["usageCoreNanoSeconds"].is_u64());
    assert!(v["pods"][0]["podRef"]["namespace"].is_string());
    assert!(v["pods"][0]["network"]["rxBytes"].is_u64());
}

/// A freshly exec'd `sleep` is still faulting in pages for a moment; take samples until the
/// children's RSS (read independently from statm) is the same before and after the sample.
fn stable_sample(
    hub: &StatsHub,
    pids: &[u32],
) -> std::sync::Arc<vk_cocoon::metrics::stats::Sample> {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    for round in 1u64.. {
        let before: Vec<u64> = pids.iter().map(|p| statm_rss_bytes(*p)).collect();
        // Each round asks for a time past the previous sample's TTL, forcing a refresh.
        let s = hub.sample(Instant::now() + std::time::Duration::from_secs(3 * round));
        let after: Vec<u64> = pids.iter().map(|p| statm_rss_bytes(*p)).collect();
        let sampled: Vec<u64> = pids
            .iter()
            .map(|p| {
                s.vms
                    .iter()
                    .find(|v| v.vm.pid == *p)
                    .map(|v| v.rss_bytes)
                    .unwrap_or(0)
            })
            .collect();
        if (before == after && after == sampled) || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    unreachable!()
}

#[test]
fn both_metrics_texts_pass_promtool() {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("cocoon")).unwrap();
    let a = Sleeper::start();
    let hub = StatsHub::new(paths(tmp.path()));
    hub.set_vms(vec![
        vm("a", a.pid(), "ns\"quoted", "lo"),
        vm("b", a.pid(), "ns2", "lo"),
        vm("c", 0, "ns2", "lo"),
    ]);
    let sample = stable_sample(&hub, &[a.pid()]);
    let resource = resource_metrics_text(&sample);
    assert!(resource.contains("container_cpu_usage_seconds_total{container=\"agent\",namespace=\"ns\\\"quoted\",pod=\"pod-a\"}"));
    assert!(resource.contains("pod_memory_working_set_bytes{namespace=\"ns2\",pod=\"pod-b\"}"));
    promtool_check(&resource);

    // The daemon's 9091 text: the registry's families, then the collector's written directly.
    let metrics = Metrics::new().unwrap();
    metrics.orphan_vm_total.inc();
    metrics
        .add_text_source(Arc::new(VmCollector::new(hub.clone())))
        .unwrap();
    assert!(
        metrics
            .add_text_source(Arc::new(VmCollector::new(hub.clone())))
            .is_err(),
        "a second source with the same families is refused"
    );
    let text = metrics.encode();
    assert!(text.contains("vk_cocoon_orphan_vm_total 1"), "{text}");
    // The daemon's own process families and build info, as every Prometheus client has them.
    for family in [
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_max_fds ",
        "process_start_time_seconds ",
        "vk_cocoon_build_info{revision=",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(family)),
            "{family}: {text}"
        );
    }
    // The collector serves the same shared sample (checked against /proc by stable_sample).
    let rss = sample.vms[1].rss_bytes;
    assert!(
        text.contains(&format!("vk_cocoon_vm_memory_rss_bytes{{backend=\"cloud-hypervisor\",namespace=\"ns2\",pod=\"pod-b\",vm=\"vk-ns2-b\"}} {rss}")),
        "{text}"
    );
    assert!(
        text.contains("vk_cocoon_vm_table_size{namespace=\"ns2\"} 2"),
        "{text}"
    );
    assert!(text.contains("vk_cocoon_node_storage_total_bytes "));
    promtool_check(&text);
    // Empty VM table: node families only, still valid.
    hub.set_vms(vec![]);
    let empty = resource_metrics_text(&hub.sample(Instant::now()));
    assert!(!empty.contains("container_"));
    promtool_check(&empty);
}
