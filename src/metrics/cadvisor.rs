//! The cAdvisor families of the kubelet's `/metrics/cadvisor`, rendered from the shared sample:
//! the names, types, help and labels the kube-prometheus dashboards and recording rules read.
//!
//! Pure: a `Sample` and the pods' facts in, text format 0.0.4 out. Each VM is one pod with one
//! container; like cAdvisor, it gets container-level series (`container`, `image` and `name`
//! set) and pod-level ones (`container=""`, `image=""`, `name=""`), network at pod level only,
//! since the network namespace belongs to the pod. Every figure is one the sample already read
//! from /proc and cgroupfs: the memory families are the hypervisor's RSS, which is what a VM
//! holds of the host's memory.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use super::escape_label;
use super::stats::{Sample, VmSample};

/// The container name every cocoon pod's status reports (its one container is the VM).
pub const CONTAINER: &str = "agent";

/// What the pod object says about its VM, beyond what the sample read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    /// The container's image (cAdvisor's `image` label; never empty on a container series,
    /// since the recording rules pick container series with `image!=""`).
    pub image: String,
    /// When the pod started (status.startTime).
    pub start_time: Option<SystemTime>,
    /// The VM's memory size in bytes: the most it can hold.
    pub memory_limit_bytes: Option<u64>,
    /// The cgroup CPU quota and period in µs, when the pod has a CPU limit.
    pub cpu_quota: Option<(u64, u64)>,
}

/// Facts by (namespace, pod).
pub type PodFactsMap = HashMap<(String, String), PodFacts>;

/// Every family name this module may write (the dashboards' and rules' check reads it).
pub const FAMILIES: [&str; 23] = [
    "container_cpu_usage_seconds_total",
    "container_cpu_cfs_throttled_seconds_total",
    "container_cpu_cfs_throttled_periods_total",
    "container_memory_working_set_bytes",
    "container_memory_rss",
    "container_memory_usage_bytes",
    "container_spec_memory_limit_bytes",
    "container_spec_cpu_quota",
    "container_spec_cpu_period",
    "container_start_time_seconds",
    "container_network_receive_bytes_total",
    "container_network_transmit_bytes_total",
    "container_network_receive_packets_total",
    "container_network_transmit_packets_total",
    "container_network_receive_errors_total",
    "container_network_transmit_errors_total",
    "container_network_receive_packets_dropped_total",
    "container_network_transmit_packets_dropped_total",
    "container_fs_usage_bytes",
    "machine_cpu_cores",
    "machine_memory_bytes",
    "container_scrape_error",
    "container_last_seen",
];

/// Which series of a VM a family has.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Level {
    /// One container series and one pod series.
    Both,
    /// One pod series per interface.
    Network,
}

/// A per-VM family: name, type, help, which series, and the value (None = no series).
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    level: Level,
    value: fn(&VmSample, &PodFacts, f64) -> Option<f64>,
}

const PER_VM: [Family; 20] = [
    Family {
        name: "container_cpu_usage_seconds_total",
        kind: "counter",
        help: "Cumulative cpu time consumed in seconds.",
        level: Level::Both,
        value: |v, _, _| Some(v.cpu_seconds()),
    },
    Family {
        name: "container_cpu_cfs_throttled_seconds_total",
        kind: "counter",
        help: "Total time duration the container has been throttled.",
        level: Level::Both,
        value: |v, _, _| Some(v.cpu_throttled_seconds()),
    },
    Family {
        name: "container_cpu_cfs_throttled_periods_total",
        kind: "counter",
        help: "Number of throttled period intervals.",
        level: Level::Both,
        value: |v, _, _| Some(v.cpu_throttled_periods as f64),
    },
    Family {
        name: "container_memory_working_set_bytes",
        kind: "gauge",
        help: "Current working set in bytes.",
        level: Level::Both,
        value: |v, _, _| Some(v.rss_bytes as f64),
    },
    Family {
        name: "container_memory_rss",
        kind: "gauge",
        help: "Size of RSS in bytes.",
        level: Level::Both,
        value: |v, _, _| Some(v.rss_bytes as f64),
    },
    Family {
        name: "container_memory_usage_bytes",
        kind: "gauge",
        help: "Current memory usage in bytes, including all memory regardless of when it was accessed.",
        level: Level::Both,
        value: |v, _, _| Some(v.rss_bytes as f64),
    },
    Family {
        name: "container_spec_memory_limit_bytes",
        kind: "gauge",
        help: "Memory limit for the container.",
        level: Level::Both,
        value: |_, f, _| Some(f.memory_limit_bytes.unwrap_or(0) as f64),
    },
    Family {
        name: "container_spec_cpu_quota",
        kind: "gauge",
        help: "CPU quota of the container.",
        level: Level::Both,
        value: |_, f, _| f.cpu_quota.map(|(q, _)| q as f64),
    },
    Family {
        name: "container_spec_cpu_period",
        kind: "gauge",
        help: "CPU period of the container.",
        level: Level::Both,
        value: |_, f, _| f.cpu_quota.map(|(_, p)| p as f64),
    },
    Family {
        name: "container_start_time_seconds",
        kind: "gauge",
        help: "Start time of the container since unix epoch in seconds.",
        level: Level::Both,
        value: |_, f, _| f.start_time.map(unix_seconds),
    },
    Family {
        name: "container_fs_usage_bytes",
        kind: "gauge",
        help: "Number of bytes that are consumed by the container on this filesystem.",
        level: Level::Both,
        value: |v, _, _| Some(v.cow_bytes as f64),
    },
    Family {
        name: "container_last_seen",
        kind: "gauge",
        help: "Last time a container was seen by the exporter",
        level: Level::Both,
        value: |_, _, now| Some(now),
    },
    Family {
        name: "container_network_receive_bytes_total",
        kind: "counter",
        help: "Cumulative count of bytes received",
        level: Level::Network,
        value: |v, _, _| Some(v.rx_bytes as f64),
    },
    Family {
        name: "container_network_transmit_bytes_total",
        kind: "counter",
        help: "Cumulative count of bytes transmitted",
        level: Level::Network,
        value: |v, _, _| Some(v.tx_bytes as f64),
    },
    Family {
        name: "container_network_receive_packets_total",
        kind: "counter",
        help: "Cumulative count of packets received",
        level: Level::Network,
        value: |v, _, _| Some(v.net.rx_packets as f64),
    },
    Family {
        name: "container_network_transmit_packets_total",
        kind: "counter",
        help: "Cumulative count of packets transmitted",
        level: Level::Network,
        value: |v, _, _| Some(v.net.tx_packets as f64),
    },
    Family {
        name: "container_network_receive_errors_total",
        kind: "counter",
        help: "Cumulative count of errors encountered while receiving",
        level: Level::Network,
        value: |v, _, _| Some(v.net.rx_errors as f64),
    },
    Family {
        name: "container_network_transmit_errors_total",
        kind: "counter",
        help: "Cumulative count of errors encountered while transmitting",
        level: Level::Network,
        value: |v, _, _| Some(v.net.tx_errors as f64),
    },
    Family {
        name: "container_network_receive_packets_dropped_total",
        kind: "counter",
        help: "Cumulative count of packets dropped while receiving",
        level: Level::Network,
        value: |v, _, _| Some(v.net.rx_dropped as f64),
    },
    Family {
        name: "container_network_transmit_packets_dropped_total",
        kind: "counter",
        help: "Cumulative count of packets dropped while transmitting",
        level: Level::Network,
        value: |v, _, _| Some(v.net.tx_dropped as f64),
    },
];

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The cgroup path cAdvisor would name the VM by: the scope cocoon puts it in.
pub fn cgroup_id(cgroup_parent: &str, vm_id: &str) -> String {
    format!("/{}/vm-{vm_id}.scope", cgroup_parent.trim_matches('/'))
}

/// Writes `name{labels} value timestamp` with the labels in cAdvisor's (sorted) order.
fn series(o: &mut String, name: &str, labels: &[(&str, &str)], value: f64, ts_ms: u128) {
    o.push_str(name);
    o.push('{');
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        o.push_str(k);
        o.push_str("=\"");
        escape_label(v, o);
        o.push('"');
    }
    let _ = writeln!(o, "}} {value} {ts_ms}");
}

/// `/metrics/cadvisor` of one sample. `cgroup_parent` is COCOON_CGROUP_PARENT. A pod missing
/// from `facts` (or with no image) gets the VM's name as its image, so that its container
/// series stay container series for the rules that select them by `image!=""`.
pub fn cadvisor_text(sample: &Sample, facts: &PodFactsMap, cgroup_parent: &str) -> String {
    let ts = sample
        .taken_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let now = unix_seconds(sample.taken_at);
    let none = PodFacts::default();
    let rows: Vec<(&VmSample, &PodFacts, String)> = sample
        .vms
        .iter()
        .map(|v| {
            let f = facts
                .get(&(v.vm.namespace.clone(), v.vm.pod.clone()))
                .unwrap_or(&none);
            (v, f, cgroup_id(cgroup_parent, &v.vm.vm_id))
        })
        .collect();
    let mut o = String::with_capacity(2048 + rows.len() * 6000);
    for fam in &PER_VM {
        let _ = writeln!(o, "# HELP {} {}", fam.name, fam.help);
        let _ = writeln!(o, "# TYPE {} {}", fam.name, fam.kind);
        for (v, f, id) in &rows {
            let Some(value) = (fam.value)(v, f, now) else {
                continue;
            };
            let (ns, pod) = (v.vm.namespace.as_str(), v.vm.pod.as_str());
            match fam.level {
                Level::Both => {
                    let image = if f.image.is_empty() {
                        v.vm.vm_name.as_str()
                    } else {
                        f.image.as_str()
                    };
                    let container = [
                        ("container", CONTAINER),
                        ("id", id.as_str()),
                        ("image", image),
                        ("name", v.vm.vm_name.as_str()),
                        ("namespace", ns),
                        ("pod", pod),
                    ];
                    series(&mut o, fam.name, &container, value, ts);
                    let pod_level = [
                        ("container", ""),
                        ("id", id.as_str()),
                        ("image", ""),
                        ("name", ""),
                        ("namespace", ns),
                        ("pod", pod),
                    ];
                    series(&mut o, fam.name, &pod_level, value, ts);
                }
                Level::Network => {
                    let Some(tap) = v.vm.tap.as_deref().filter(|t| !t.is_empty()) else {
                        continue;
                    };
                    let labels = [
                        ("container", ""),
                        ("id", id.as_str()),
                        ("image", ""),
                        ("interface", tap),
                        ("name", ""),
                        ("namespace", ns),
                        ("pod", pod),
                    ];
                    series(&mut o, fam.name, &labels, value, ts);
                }
            }
        }
    }
    let _ = writeln!(o, "# HELP machine_cpu_cores Number of logical CPU cores.");
    let _ = writeln!(o, "# TYPE machine_cpu_cores gauge");
    let _ = writeln!(o, "machine_cpu_cores {}", sample.node.cpu_cores);
    let _ = writeln!(
        o,
        "# HELP machine_memory_bytes Amount of memory installed on the machine."
    );
    let _ = writeln!(o, "# TYPE machine_memory_bytes gauge");
    let _ = writeln!(o, "machine_memory_bytes {}", sample.node.memory_total_bytes);
    let _ = writeln!(
        o,
        "# HELP container_scrape_error 1 if there was an error while getting container metrics, 0 otherwise"
    );
    let _ = writeln!(o, "# TYPE container_scrape_error gauge");
    let _ = writeln!(o, "container_scrape_error {}", u8::from(sample.errors > 0));
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::stats::{NetCounters, NodeSample, TrackedVm};
    use std::time::{Duration, Instant};

    fn sample() -> Sample {
        let vm = TrackedVm {
            vm_id: "abc".into(),
            vm_name: "vk-ns-p".into(),
            namespace: "ns".into(),
            pod: "p".into(),
            pod_uid: "u".into(),
            pid: 1,
            tap: Some("tap0".into()),
            backend: "cloud-hypervisor".into(),
            disk: None,
        };
        Sample {
            taken_at: UNIX_EPOCH + Duration::from_secs(1_000),
            taken_mono: Instant::now(),
            node: NodeSample {
                cpu_cores: 4,
                memory_total_bytes: 8 << 30,
                ..Default::default()
            },
            vms: vec![VmSample {
                vm,
                cpu_usage_usec: 2_500_000,
                cpu_throttled_usec: 0,
                cpu_throttled_periods: 0,
                rss_bytes: 4096,
                cow_bytes: 0,
                rx_bytes: 10,
                tx_bytes: 20,
                net: NetCounters {
                    rx_packets: 3,
                    ..Default::default()
                },
            }],
            errors: 0,
        }
    }

    #[test]
    fn container_and_pod_series_carry_cadvisors_labels() {
        let mut facts = PodFactsMap::new();
        facts.insert(
            ("ns".into(), "p".into()),
            PodFacts {
                image: "img:1".into(),
                start_time: Some(UNIX_EPOCH + Duration::from_secs(900)),
                memory_limit_bytes: Some(1 << 30),
                cpu_quota: None,
            },
        );
        let t = cadvisor_text(&sample(), &facts, "cocoon.slice");
        assert!(t.contains("container_cpu_usage_seconds_total{container=\"agent\",id=\"/cocoon.slice/vm-abc.scope\",image=\"img:1\",name=\"vk-ns-p\",namespace=\"ns\",pod=\"p\"} 2.5 1000000\n"), "{t}");
        assert!(t.contains("container_memory_rss{container=\"\",id=\"/cocoon.slice/vm-abc.scope\",image=\"\",name=\"\",namespace=\"ns\",pod=\"p\"} 4096 1000000\n"), "{t}");
        assert!(t.contains("container_network_receive_packets_total{container=\"\",id=\"/cocoon.slice/vm-abc.scope\",image=\"\",interface=\"tap0\",name=\"\",namespace=\"ns\",pod=\"p\"} 3 "), "{t}");
        assert!(t.contains("container_start_time_seconds{container=\"agent\""));
        assert!(t.contains("container_spec_memory_limit_bytes{container=\"agent\""));
        assert!(
            !t.contains("container_spec_cpu_quota{"),
            "no CPU limit, no quota"
        );
        assert!(t.contains("machine_cpu_cores 4\n"));
        assert!(t.contains(&format!("machine_memory_bytes {}\n", 8u64 << 30)));
        for name in FAMILIES {
            assert!(t.contains(&format!("# TYPE {name} ")), "{name}");
        }
    }

    #[test]
    fn a_pod_without_facts_still_gets_an_image() {
        let t = cadvisor_text(&sample(), &PodFactsMap::new(), "/cocoon.slice/");
        assert!(t.contains("image=\"vk-ns-p\""), "{t}");
        assert!(
            !t.contains("container_start_time_seconds{"),
            "unknown start time"
        );
    }
}
