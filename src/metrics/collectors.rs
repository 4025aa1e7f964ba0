//! Prometheus collectors for the per-VM and node families of behaviour spec §22.2 (prefix
//! `vk_cocoon_`), computed at scrape from the shared 2-second sample; never forks or calls cocoon.
//!
//! Register with `registry.register(Box::new(VmCollector::new(hub)))`. The other families of
//! §22.2 (lifecycle counters, histograms) belong to `metrics::families`, not here.

use std::collections::BTreeMap;
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

use super::stats::{StatsHub, VmSample};

const PREFIX: &str = "vk_cocoon_";

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

/// Collects the per-VM families, the node families and `vm_table_size` from a `StatsHub`.
pub struct VmCollector {
    hub: StatsHub,
    descs: Vec<Desc>,
}

impl VmCollector {
    pub fn new(hub: StatsHub) -> Self {
        let mut descs = Vec::new();
        for (name, help, _, _) in VM_FAMILIES {
            let labels = VM_LABELS.iter().map(|s| s.to_string()).collect();
            if let Ok(d) = Desc::new(
                format!("{PREFIX}{name}"),
                help.to_string(),
                labels,
                Default::default(),
            ) {
                descs.push(d);
            }
        }
        for (name, help) in NODE_FAMILIES {
            if let Ok(d) = Desc::new(
                format!("{PREFIX}{name}"),
                help.to_string(),
                vec![],
                Default::default(),
            ) {
                descs.push(d);
            }
        }
        if let Ok(d) = Desc::new(
            format!("{PREFIX}vm_table_size"),
            VM_TABLE_HELP.to_string(),
            vec!["namespace".to_string()],
            Default::default(),
        ) {
            descs.push(d);
        }
        VmCollector { hub, descs }
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

fn label(name: &str, value: &str) -> LabelPair {
    let mut l = LabelPair::default();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

fn family(name: &str, help: &str, counter: bool, metrics: Vec<Metric>) -> MetricFamily {
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

fn value_metric(labels: Vec<LabelPair>, counter: bool, v: f64) -> Metric {
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

impl Collector for VmCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let sample = self.hub.sample(Instant::now());
        let mut out = Vec::with_capacity(VM_FAMILIES.len() + NODE_FAMILIES.len() + 1);
        if !sample.vms.is_empty() {
            // The registry sorts each family by label values; handing it sorted input once
            // keeps that sort linear for every family.
            let mut order: Vec<&super::stats::VmSample> = sample.vms.iter().collect();
            order.sort_by(|a, b| {
                (&a.vm.backend, &a.vm.namespace, &a.vm.pod, &a.vm.vm_name).cmp(&(
                    &b.vm.backend,
                    &b.vm.namespace,
                    &b.vm.pod,
                    &b.vm.vm_name,
                ))
            });
            for (name, help, counter, value) in VM_FAMILIES {
                let metrics = order
                    .iter()
                    .map(|v| {
                        let labels = vec![
                            label("backend", &v.vm.backend),
                            label("namespace", &v.vm.namespace),
                            label("pod", &v.vm.pod),
                            label("vm", &v.vm.vm_name),
                        ];
                        value_metric(labels, counter, value(v))
                    })
                    .collect();
                out.push(family(name, help, counter, metrics));
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
            let counter = i == 0;
            out.push(family(
                name,
                help,
                counter,
                vec![value_metric(vec![], counter, node_values[i])],
            ));
        }
        // Every tracked VM counts, including those with PID 0 (stopped or hibernating VMs are
        // still in the table); the spec leaves this open.
        let mut per_ns: BTreeMap<String, u64> = BTreeMap::new();
        for vm in self.hub.vms().iter() {
            *per_ns.entry(vm.namespace.clone()).or_default() += 1;
        }
        if !per_ns.is_empty() {
            let metrics = per_ns
                .into_iter()
                .map(|(ns, c)| value_metric(vec![label("namespace", &ns)], false, c as f64))
                .collect();
            out.push(family("vm_table_size", VM_TABLE_HELP, false, metrics));
        }
        out
    }
}
