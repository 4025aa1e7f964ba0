//! The kubelet `stats/v1alpha1.Summary` types and the two stats renderings of the kubelet API:
//! `/stats/summary` JSON and `/metrics/resource` Prometheus text, both from the shared sample.
//!
//! Reads nothing itself: it formats a `metrics::stats::Sample` in the kubelet's shapes.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::metrics::stats::Sample;

/// The only container name a cocoon pod has.
pub const CONTAINER_NAME: &str = "agent";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub node: NodeStats,
    pub pods: Vec<PodStats>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeStats {
    pub node_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_containers: Option<Vec<ContainerStats>>,
    pub start_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs: Option<FsStats>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodReference {
    pub name: String,
    pub namespace: String,
    pub uid: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodStats {
    pub pod_ref: PodReference,
    pub start_time: Option<String>,
    pub containers: Vec<ContainerStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkStats>,
    #[serde(
        default,
        rename = "ephemeral-storage",
        skip_serializing_if = "Option::is_none"
    )]
    pub ephemeral_storage: Option<FsStats>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStats {
    pub name: String,
    pub start_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<FsStats>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CpuStats {
    pub time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_nano_cores: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_core_nano_seconds: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStats {
    pub time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_faults: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major_page_faults: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InterfaceStats {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_errors: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_errors: Option<u64>,
}

/// The default interface's fields are inlined at the top level (Go embedded struct).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStats {
    pub time: Option<String>,
    #[serde(flatten)]
    pub default: InterfaceStats,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interfaces: Option<Vec<InterfaceStats>>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FsStats {
    pub time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
}

/// RFC3339Nano (kubelet log timestamps).
pub use crate::rfc3339::nanos as rfc3339_nano;
/// `metav1.Time` on the wire: RFC3339 with seconds, UTC `Z`.
pub use crate::rfc3339::seconds as rfc3339;

/// Builds the kubelet Summary: node CPU (cumulative) and memory working set; per pod one
/// container `agent` with CPU and memory; pod network only when rx or tx is non-zero.
pub fn build_summary(
    sample: &Sample,
    node_name: &str,
    process_start: SystemTime,
    now: SystemTime,
) -> Summary {
    let t = Some(rfc3339(sample.taken_at));
    let now_s = Some(rfc3339(now));
    let node = NodeStats {
        node_name: node_name.to_string(),
        system_containers: None,
        start_time: Some(rfc3339(process_start)),
        cpu: Some(CpuStats {
            time: t.clone(),
            usage_nano_cores: None,
            usage_core_nano_seconds: Some(sample.node.cpu_ticks.saturating_mul(10_000_000)),
        }),
        memory: Some(MemoryStats {
            time: t.clone(),
            available_bytes: Some(
                sample
                    .node
                    .memory_total_bytes
                    .saturating_sub(sample.node.memory_used_bytes),
            ),
            usage_bytes: Some(sample.node.memory_used_bytes),
            working_set_bytes: Some(sample.node.memory_used_bytes),
            rss_bytes: None,
            page_faults: None,
            major_page_faults: None,
        }),
        network: None,
        fs: Some(FsStats {
            time: t.clone(),
            available_bytes: Some(sample.node.storage_available_bytes),
            capacity_bytes: Some(sample.node.storage_total_bytes),
            used_bytes: Some(
                sample
                    .node
                    .storage_total_bytes
                    .saturating_sub(sample.node.storage_available_bytes),
            ),
        }),
    };
    let pods = sample
        .vms
        .iter()
        .map(|v| {
            let cpu = CpuStats {
                time: t.clone(),
                usage_nano_cores: None,
                usage_core_nano_seconds: Some(v.cpu_usage_usec.saturating_mul(1000)),
            };
            let mem = MemoryStats {
                time: t.clone(),
                available_bytes: None,
                usage_bytes: Some(v.rss_bytes),
                working_set_bytes: Some(v.rss_bytes),
                rss_bytes: Some(v.rss_bytes),
                page_faults: None,
                major_page_faults: None,
            };
            let network = match v.vm.tap.as_deref() {
                Some(tap) if v.rx_bytes > 0 || v.tx_bytes > 0 => Some(NetworkStats {
                    time: t.clone(),
                    default: InterfaceStats {
                        name: tap.to_string(),
                        rx_bytes: Some(v.rx_bytes),
                        rx_errors: None,
                        tx_bytes: Some(v.tx_bytes),
                        tx_errors: None,
                    },
                    interfaces: None,
                }),
                _ => None,
            };
            PodStats {
                pod_ref: PodReference {
                    name: v.vm.pod.clone(),
                    namespace: v.vm.namespace.clone(),
                    uid: v.vm.pod_uid.clone(),
                },
                start_time: now_s.clone(),
                containers: vec![ContainerStats {
                    name: CONTAINER_NAME.to_string(),
                    start_time: now_s.clone(),
                    cpu: Some(cpu.clone()),
                    memory: Some(mem.clone()),
                    rootfs: None,
                }],
                cpu: Some(cpu),
                memory: Some(mem),
                network,
                ephemeral_storage: (v.cow_bytes > 0).then(|| FsStats {
                    time: t.clone(),
                    available_bytes: None,
                    capacity_bytes: None,
                    used_bytes: Some(v.cow_bytes),
                }),
            }
        })
        .collect();
    Summary { node, pods }
}

/// (name, type, help, value of one VM) of a resource-metrics family.
type Family = (
    &'static str,
    &'static str,
    &'static str,
    fn(&crate::metrics::stats::VmSample) -> f64,
);

pub use crate::metrics::escape_label;

/// `/metrics/resource` in the text exposition format (version 0.0.4), every sample stamped with
/// the sample time in milliseconds, as the kubelet does.
pub fn resource_metrics_text(sample: &Sample) -> String {
    let ts = sample
        .taken_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let mut o = String::with_capacity(256 + sample.vms.len() * 900);
    let _ = writeln!(o, "# HELP node_cpu_usage_seconds_total Cumulative cpu time consumed by the node in core-seconds");
    let _ = writeln!(o, "# TYPE node_cpu_usage_seconds_total counter");
    let _ = writeln!(
        o,
        "node_cpu_usage_seconds_total {} {ts}",
        sample.node.cpu_seconds()
    );
    let _ = writeln!(
        o,
        "# HELP node_memory_working_set_bytes Current working set of the node in bytes"
    );
    let _ = writeln!(o, "# TYPE node_memory_working_set_bytes gauge");
    let _ = writeln!(
        o,
        "node_memory_working_set_bytes {} {ts}",
        sample.node.memory_used_bytes
    );
    if !sample.vms.is_empty() {
        let container_families: [Family; 4] = [
            (
                "container_cpu_usage_seconds_total",
                "counter",
                "Cumulative cpu time consumed by the container in core-seconds",
                |v| v.cpu_seconds(),
            ),
            (
                "container_memory_working_set_bytes",
                "gauge",
                "Current working set of the container in bytes",
                |v| v.rss_bytes as f64,
            ),
            (
                "container_cpu_cfs_throttled_seconds_total",
                "counter",
                "Total time duration the container has been throttled",
                |v| v.cpu_throttled_seconds(),
            ),
            (
                "container_cpu_cfs_throttled_periods_total",
                "counter",
                "Number of throttled period intervals",
                |v| v.cpu_throttled_periods as f64,
            ),
        ];
        write_vm_families(
            &mut o,
            &container_families,
            "container=\"agent\",",
            sample,
            ts,
        );
        let pod_families: [Family; 2] = [
            (
                "pod_cpu_usage_seconds_total",
                "counter",
                "Cumulative cpu time consumed by the pod in core-seconds",
                |v| v.cpu_seconds(),
            ),
            (
                "pod_memory_working_set_bytes",
                "gauge",
                "Current working set of the pod in bytes",
                |v| v.rss_bytes as f64,
            ),
        ];
        write_vm_families(&mut o, &pod_families, "", sample, ts);
    }
    let _ = writeln!(o, "# HELP resource_scrape_error 1 if there was an error while getting container metrics, 0 otherwise");
    let _ = writeln!(o, "# TYPE resource_scrape_error gauge");
    let _ = writeln!(o, "resource_scrape_error {}", u8::from(sample.errors > 0));
    o
}

/// One block per family: HELP, TYPE, then a line per VM labelled `{extra}namespace, pod`.
fn write_vm_families(o: &mut String, families: &[Family], extra: &str, sample: &Sample, ts: u128) {
    for (name, kind, help, value) in families {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for v in &sample.vms {
            o.push_str(name);
            o.push('{');
            o.push_str(extra);
            o.push_str("namespace=\"");
            escape_label(&v.vm.namespace, o);
            o.push_str("\",pod=\"");
            escape_label(&v.vm.pod, o);
            let _ = writeln!(o, "\"}} {} {ts}", value(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rfc3339_formats() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_798_761_599)),
            "2026-12-31T23:59:59Z"
        );
        assert_eq!(
            rfc3339_nano(UNIX_EPOCH + Duration::new(1, 120_000_000)),
            "1970-01-01T00:00:01.12Z"
        );
    }

    #[test]
    fn label_escaping() {
        let mut s = String::new();
        escape_label("a\"b\\c\nd", &mut s);
        assert_eq!(s, "a\\\"b\\\\c\\nd");
    }
}
