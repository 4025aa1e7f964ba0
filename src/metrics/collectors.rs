//! Prometheus collectors for the per-VM and node families (prefix
//! `vk_cocoon_`), computed at scrape from the shared 2-second sample; never forks or calls cocoon.
//!
//! Add with `metrics.add_text_source(Arc::new(VmCollector::new(hub)))`: the families are written
//! as text directly, next to the registry's. The other families (lifecycle counters,
//! histograms) belong to `metrics::families`, not here.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::families::{escape_label, TextSource, PREFIX};
use super::stats::{Sample, StatsHub, TrackedVm, VmSample};

/// Per-VM label names, in the order they are emitted (sorted).
const VM_LABELS: [&str; 4] = ["backend", "namespace", "pod", "vm"];

type VmValue = fn(&VmSample) -> f64;

/// (name without prefix, help, is_counter, value)
const VM_FAMILIES: [(&str, &str, bool, VmValue); 7] = [
    (
        "vm_cpu_seconds_total",
        "Cumulative CPU seconds of the VM's cgroup (cpu.stat usage_usec).",
        true,
        |v| v.cpu_seconds(),
    ),
    (
        "vm_cpu_throttled_seconds_total",
        "Cumulative seconds the VM's cgroup was throttled (cpu.stat throttled_usec).",
        true,
        |v| v.cpu_throttled_seconds(),
    ),
    (
        "vm_cpu_throttled_periods_total",
        "Number of throttled periods of the VM's cgroup (cpu.stat nr_throttled).",
        true,
        |v| v.cpu_throttled_periods as f64,
    ),
    (
        "vm_network_rx_bytes_total",
        "Bytes received on the VM's tap device.",
        true,
        |v| v.rx_bytes as f64,
    ),
    (
        "vm_network_tx_bytes_total",
        "Bytes transmitted on the VM's tap device.",
        true,
        |v| v.tx_bytes as f64,
    ),
    (
        "vm_memory_rss_bytes",
        "Resident set size of the VM's hypervisor process.",
        false,
        |v| v.rss_bytes as f64,
    ),
    (
        "vm_disk_cow_bytes",
        "Allocated bytes of the VM's copy-on-write disk.",
        false,
        |v| v.cow_bytes as f64,
    ),
];

/// Writes the per-VM families, the node families and `vm_table_size` from a `StatsHub`.
pub struct VmCollector {
    hub: StatsHub,
    /// The text last written and the sample and VM list it was made of: scrapes between two
    /// samples (2 s) copy it instead of formatting thousands of series again.
    cache: Mutex<Option<Rendered>>,
}

struct Rendered {
    sample: Arc<Sample>,
    vms: Arc<Vec<TrackedVm>>,
    text: String,
}

impl VmCollector {
    pub fn new(hub: StatsHub) -> Self {
        VmCollector {
            hub,
            cache: Mutex::new(None),
        }
    }
}

const NODE_FAMILIES: [(&str, &str); 4] = [
    (
        "node_cpu_seconds_total",
        "Cumulative CPU seconds of the host (/proc/stat cpu line / 100).",
    ),
    (
        "node_memory_used_bytes",
        "Host memory in use (MemTotal - MemAvailable).",
    ),
    (
        "node_storage_available_bytes",
        "Available bytes on the filesystem of COCOON_ROOT_DIR.",
    ),
    (
        "node_storage_total_bytes",
        "Total bytes of the filesystem of COCOON_ROOT_DIR.",
    ),
];
const VM_TABLE_HELP: &str = "Number of VMs tracked by the daemon, per namespace.";

/// Appends `# HELP` and `# TYPE` lines of one family.
fn family_head(out: &mut String, name: &str, help: &str, counter: bool) {
    let kind = if counter { "counter" } else { "gauge" };
    let _ = writeln!(out, "# HELP {PREFIX}{name} {help}");
    let _ = writeln!(out, "# TYPE {PREFIX}{name} {kind}");
}

/// Appends one label pair `name="value"` with the value escaped as the text format requires.
fn label(out: &mut String, name: &str, value: &str) {
    out.push_str(name);
    out.push_str("=\"");
    escape_label(value, out);
    out.push('"');
}

/// Appends the families of `write_text` for one sample and VM list.
fn render(sample: &Sample, vms: &[TrackedVm], out: &mut String) {
    if !sample.vms.is_empty() {
        let mut order: Vec<&VmSample> = sample.vms.iter().collect();
        order.sort_by(|a, b| {
            (&a.vm.backend, &a.vm.namespace, &a.vm.pod, &a.vm.vm_name).cmp(&(
                &b.vm.backend,
                &b.vm.namespace,
                &b.vm.pod,
                &b.vm.vm_name,
            ))
        });
        // The label set of each VM, escaped once and reused by all seven families.
        let mut labels = Vec::with_capacity(order.len());
        for v in &order {
            let mut l = String::with_capacity(96);
            l.push('{');
            for (i, (name, value)) in VM_LABELS
                .iter()
                .zip([&v.vm.backend, &v.vm.namespace, &v.vm.pod, &v.vm.vm_name])
                .enumerate()
            {
                if i > 0 {
                    l.push(',');
                }
                label(&mut l, name, value);
            }
            l.push_str("} ");
            labels.push(l);
        }
        out.reserve(order.len() * VM_FAMILIES.len() * 128);
        for (name, help, counter, value) in VM_FAMILIES {
            family_head(out, name, help, counter);
            for (v, l) in order.iter().zip(&labels) {
                out.push_str(PREFIX);
                out.push_str(name);
                out.push_str(l);
                let _ = writeln!(out, "{}", value(v));
            }
        }
    }
    let n = &sample.node;
    let node_values = [
        n.cpu_seconds(),
        n.memory_used_bytes as f64,
        n.storage_available_bytes as f64,
        n.storage_total_bytes as f64,
    ];
    for (i, (name, help)) in NODE_FAMILIES.iter().enumerate() {
        family_head(out, name, help, i == 0);
        let _ = writeln!(out, "{PREFIX}{name} {}", node_values[i]);
    }
    // Every tracked VM counts, including those with PID 0 (stopped or hibernating VMs are
    // still in the table); the spec leaves this open.
    let mut per_ns: BTreeMap<&str, u64> = BTreeMap::new();
    for vm in vms.iter() {
        *per_ns.entry(vm.namespace.as_str()).or_default() += 1;
    }
    if !per_ns.is_empty() {
        family_head(out, "vm_table_size", VM_TABLE_HELP, false);
        for (ns, c) in per_ns {
            out.push_str(PREFIX);
            out.push_str("vm_table_size{");
            label(out, "namespace", ns);
            let _ = writeln!(out, "}} {}", c as f64);
        }
    }
}

impl TextSource for VmCollector {
    /// The per-VM families (series sorted by backend, namespace, pod, vm), the node families and
    /// `vm_table_size`, written straight from the sample: 1,000 VMs are ~7,000 series, and
    /// building protobuf families for them and encoding those cost more than a scrape may.
    fn write_text(&self, out: &mut String) {
        let sample = self.hub.sample(Instant::now());
        let vms = self.hub.vms();
        // A panic while holding the lock leaves at worst a stale cache entry, which the pointer
        // checks below never serve for another sample.
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        match cache.as_ref() {
            Some(r) if Arc::ptr_eq(&r.sample, &sample) && Arc::ptr_eq(&r.vms, &vms) => {}
            _ => {
                let mut text = String::new();
                render(&sample, &vms, &mut text);
                *cache = Some(Rendered { sample, vms, text });
            }
        }
        if let Some(r) = cache.as_ref() {
            out.push_str(&r.text);
        }
    }

    fn family_names(&self) -> Vec<String> {
        VM_FAMILIES
            .iter()
            .map(|f| f.0)
            .chain(NODE_FAMILIES.iter().map(|f| f.0))
            .chain(["vm_table_size"])
            .map(|n| format!("{PREFIX}{n}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::stats::{StatsPaths, TrackedVm};
    use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

    fn vm(id: &str, ns: &str, pod: &str, backend: &str, pid: u32) -> TrackedVm {
        TrackedVm {
            vm_id: id.into(),
            vm_name: format!("vk-{id}"),
            namespace: ns.into(),
            pod: pod.into(),
            pod_uid: "u".into(),
            pid,
            tap: Some("lo".into()),
            backend: backend.into(),
            disk: None,
        }
    }

    fn pair(name: &str, value: &str) -> LabelPair {
        let mut l = LabelPair::default();
        l.set_name(name.to_string());
        l.set_value(value.to_string());
        l
    }

    fn metric(labels: Vec<LabelPair>, counter: bool, v: f64) -> Metric {
        let mut m = Metric::default();
        m.set_label(labels);
        if counter {
            let mut c = Counter::default();
            c.set_value(v);
            m.set_counter(c);
        } else {
            let mut g = Gauge::default();
            g.set_value(v);
            m.set_gauge(g);
        }
        m
    }

    fn fam(name: &str, help: &str, counter: bool, metrics: Vec<Metric>) -> MetricFamily {
        let mut mf = MetricFamily::default();
        mf.set_name(format!("{PREFIX}{name}"));
        mf.set_help(help.to_string());
        mf.set_field_type(if counter {
            MetricType::COUNTER
        } else {
            MetricType::GAUGE
        });
        mf.set_metric(metrics);
        mf
    }

    /// The same sample as protobuf families, encoded by the prometheus crate: the text written
    /// directly must be byte-for-byte what the crate's encoder makes of it.
    fn reference_text(hub: &StatsHub) -> String {
        let sample = hub.sample(Instant::now());
        let mut order: Vec<&VmSample> = sample.vms.iter().collect();
        order.sort_by_key(|v| {
            (
                v.vm.backend.clone(),
                v.vm.namespace.clone(),
                v.vm.pod.clone(),
                v.vm.vm_name.clone(),
            )
        });
        let mut fams = Vec::new();
        if !order.is_empty() {
            for (name, help, counter, value) in VM_FAMILIES {
                let ms = order
                    .iter()
                    .map(|v| {
                        let labels = vec![
                            pair("backend", &v.vm.backend),
                            pair("namespace", &v.vm.namespace),
                            pair("pod", &v.vm.pod),
                            pair("vm", &v.vm.vm_name),
                        ];
                        metric(labels, counter, value(v))
                    })
                    .collect();
                fams.push(fam(name, help, counter, ms));
            }
        }
        let n = &sample.node;
        let values = [
            n.cpu_seconds(),
            n.memory_used_bytes as f64,
            n.storage_available_bytes as f64,
            n.storage_total_bytes as f64,
        ];
        for (i, (name, help)) in NODE_FAMILIES.iter().enumerate() {
            fams.push(fam(
                name,
                help,
                i == 0,
                vec![metric(vec![], i == 0, values[i])],
            ));
        }
        let mut per_ns: BTreeMap<String, u64> = BTreeMap::new();
        for v in hub.vms().iter() {
            *per_ns.entry(v.namespace.clone()).or_default() += 1;
        }
        if !per_ns.is_empty() {
            let ms = per_ns
                .into_iter()
                .map(|(ns, c)| metric(vec![pair("namespace", &ns)], false, c as f64))
                .collect();
            fams.push(fam("vm_table_size", VM_TABLE_HELP, false, ms));
        }
        prometheus::TextEncoder::new()
            .encode_to_string(&fams)
            .unwrap()
    }

    #[test]
    fn direct_text_equals_the_prometheus_encoder_output() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("proc/42")).unwrap();
        std::fs::write(root.join("proc/stat"), "cpu  150 0 100 0 0 0 0 0 0 0\n").unwrap();
        std::fs::write(
            root.join("proc/meminfo"),
            "MemTotal: 2000 kB\nMemAvailable: 500 kB\n",
        )
        .unwrap();
        let fields: Vec<String> = (3..=30)
            .map(|i| if i == 24 { "10".into() } else { "0".into() })
            .collect();
        std::fs::write(
            root.join("proc/42/stat"),
            format!("42 (hv) {}\n", fields.join(" ")),
        )
        .unwrap();
        for (id, usage) in [("a", 1_234_567u64), ("b", 3), ("c", 2_000_000)] {
            let scope = root.join(format!("cg/cocoon.slice/vm-{id}.scope"));
            std::fs::create_dir_all(&scope).unwrap();
            std::fs::write(
                scope.join("cpu.stat"),
                format!("usage_usec {usage}\nnr_throttled 2\nthrottled_usec 1500\n"),
            )
            .unwrap();
        }
        std::fs::create_dir_all(root.join("cocoon")).unwrap();
        let hub = StatsHub::new(StatsPaths {
            proc_root: root.join("proc"),
            cgroup_root: root.join("cg"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: root.join("cocoon"),
        });
        let c = VmCollector::new(hub.clone());
        let mut empty = String::new();
        c.write_text(&mut empty);
        assert_eq!(empty, reference_text(&hub), "no VMs: node families only");
        assert!(!empty.contains("vm_cpu_seconds_total"));

        // Unsorted input, a label value that needs escaping, both backends, a stopped VM.
        hub.set_vms(vec![
            vm("c", "ns\"q\\\nx", "pod-c", "firecracker", 42),
            vm("b", "ns1", "pod-b", "cloud-hypervisor", 42),
            vm("a", "ns1", "pod-a", "cloud-hypervisor", 42),
            vm("z", "ns2", "pod-z", "cloud-hypervisor", 0),
        ]);
        let mut text = String::new();
        c.write_text(&mut text);
        assert_eq!(text, reference_text(&hub));
        assert!(text.contains(
            "vk_cocoon_vm_cpu_seconds_total{backend=\"cloud-hypervisor\",namespace=\"ns1\",pod=\"pod-a\",vm=\"vk-a\"} 1.234567\n"
        ), "{text}");
        assert!(text.contains("namespace=\"ns\\\"q\\\\\\nx\""), "{text}");
        assert!(text.contains("vk_cocoon_vm_table_size{namespace=\"ns2\"} 1\n"));
        assert_eq!(text.matches("# TYPE ").count(), 12, "each family once");
        // Within the sample's lifetime the rendered text is reused; a new VM list re-renders.
        let mut again = String::from("head\n");
        c.write_text(&mut again);
        assert_eq!(again, format!("head\n{text}"));
        hub.set_vms(vec![vm("a", "ns1", "pod-a", "cloud-hypervisor", 42)]);
        let mut one = String::new();
        c.write_text(&mut one);
        assert_eq!(one, reference_text(&hub));
        assert!(!one.contains("pod-b"));
    }

    #[test]
    fn family_names_cover_what_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let hub = StatsHub::new(StatsPaths {
            proc_root: dir.path().join("proc"),
            cgroup_root: dir.path().join("cg"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: dir.path().to_path_buf(),
        });
        hub.set_vms(vec![vm("a", "ns", "p", "cloud-hypervisor", 1)]);
        let c = VmCollector::new(hub);
        let mut text = String::new();
        c.write_text(&mut text);
        let written: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        let mut names = c.family_names();
        names.sort();
        let mut w: Vec<String> = written.iter().map(|s| s.to_string()).collect();
        w.sort();
        assert_eq!(w, names);
    }
}
