//! Every event-counted metric family the Go daemon exports, registered once.
//! Owns names, labels and buckets; the per-VM and node collectors (scrape-time) live elsewhere.

use std::sync::{Arc, RwLock};

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

/// Prefix of every family (spec README precedence rule 4: `vk_cocoon_`, not `cocoon_vk_`).
pub const PREFIX: &str = "vk_cocoon_";

/// Families computed at scrape time and written as text directly, without the registry's
/// protobuf families (which cost too much for thousands of series).
pub trait TextSource: Send + Sync {
    /// Appends whole families (`# HELP`, `# TYPE`, samples) in the text format 0.0.4.
    fn write_text(&self, out: &mut String);
    /// Full names of every family `write_text` may emit (checked against the registry's).
    fn family_names(&self) -> Vec<String>;
}

/// Escapes a label value for the text format: backslash, double quote and newline.
pub fn escape_label(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// All families other rooms increment. Cheap to clone (every field is an Arc
/// inside); clones share the same registry and values.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    text_sources: Arc<RwLock<Vec<Arc<dyn TextSource>>>>,
    /// op, result, reason
    pub pod_lifecycle_total: IntCounterVec,
    /// result
    pub snapshot_pull_total: IntCounterVec,
    pub snapshot_save_total: IntCounterVec,
    pub snapshot_push_total: IntCounterVec,
    pub snapshot_verify_total: IntCounterVec,
    pub snapshot_peer_restore_total: IntCounterVec,
    pub clone_from_dir_total: IntCounterVec,
    pub wake_total: IntCounterVec,
    pub wake_renew_nudge_total: IntCounterVec,
    pub lease_release_total: IntCounterVec,
    /// no labels
    pub orphan_vm_total: IntCounter,
    pub vm_inspect_transient_fail_total: IntCounter,
    pub pod_evict_failure_total: IntCounter,
    pub reconcile_adopt_by_name_total: IntCounter,
    /// outcome
    pub stale_create_reconcile_total: IntCounterVec,
    /// op
    pub startup_resume_total: IntCounterVec,
    /// verdict
    pub hibernate_evidence_total: IntCounterVec,
    /// namespace, phase, result
    pub hibernate_total: IntCounterVec,
    /// namespace, result
    pub wake_ip_wait_total: IntCounterVec,
    /// kind, result
    pub postclone_total: IntCounterVec,
    /// namespace, mode, backend
    pub vm_boot_duration_seconds: HistogramVec,
    /// namespace
    pub snapshot_save_duration_seconds: HistogramVec,
    /// namespace
    pub snapshot_push_duration_seconds: HistogramVec,
    /// no labels
    pub snapshot_pull_duration_seconds: Histogram,
    /// namespace
    pub snapshot_peer_restore_duration_seconds: HistogramVec,
    /// namespace
    pub probe_duration_seconds: HistogramVec,
    /// result
    pub postclone_retry_attempts: HistogramVec,
    /// namespace, pod: a stopped VM started again by the daemon (not in the Go daemon). Only
    /// pods whose VM restarted have a series, and it stays after the pod goes: the operator
    /// recreates an evicted pod under its name, whose restarts then keep adding up.
    pub vm_restarts_total: IntCounterVec,
    /// certificate (`kubelet-serving`, `kube-client`): NotAfter in unix seconds (not in the
    /// Go daemon).
    pub certificate_expiry_timestamp_seconds: GaugeVec,
}

/// `certificate` label of the kubelet API's serving certificate.
pub const CERT_KUBELET_SERVING: &str = "kubelet-serving";
/// `certificate` label of the kubeconfig's client certificate.
pub const CERT_KUBE_CLIENT: &str = "kube-client";

fn counter_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(format!("{PREFIX}{name}"), help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn counter(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::with_opts(Opts::new(format!("{PREFIX}{name}"), help))?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> prometheus::Result<HistogramVec> {
    let opts = HistogramOpts::new(format!("{PREFIX}{name}"), help).buckets(buckets.to_vec());
    let h = HistogramVec::new(opts, labels)?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

impl Metrics {
    /// A fresh registry with every family registered. Fails only on a
    /// programming error (duplicate or invalid name), which tests catch.
    pub fn new() -> prometheus::Result<Metrics> {
        let r = Registry::new();
        // Incremented by the HTTP listeners themselves (issue: connection-slot exhaustion).
        r.register(Box::new(super::admission::refused_total().clone()))?;
        let result = |name: &str, help: &str| counter_vec(&r, name, help, &["result"]);
        Ok(Metrics {
            pod_lifecycle_total: counter_vec(
                &r,
                "pod_lifecycle_total",
                "Pod lifecycle operations by op, result and reason.",
                &["op", "result", "reason"],
            )?,
            snapshot_pull_total: result(
                "snapshot_pull_total",
                "Snapshot pulls from the registry by result.",
            )?,
            snapshot_save_total: result("snapshot_save_total", "Local snapshot saves by result.")?,
            snapshot_push_total: result(
                "snapshot_push_total",
                "Snapshot pushes to the registry by result.",
            )?,
            snapshot_verify_total: result(
                "snapshot_verify_total",
                "Snapshot verifications by result.",
            )?,
            snapshot_peer_restore_total: result(
                "snapshot_peer_restore_total",
                "Restores from a peer node by result.",
            )?,
            clone_from_dir_total: result(
                "clone_from_dir_total",
                "Clones from a local snapshot directory by result.",
            )?,
            wake_total: result("wake_total", "Wakes of hibernated pods by result.")?,
            wake_renew_nudge_total: result(
                "wake_renew_nudge_total",
                "DHCP renew nudges during wake by result.",
            )?,
            lease_release_total: result(
                "lease_release_total",
                "cocoon-net lease releases by result.",
            )?,
            orphan_vm_total: counter(
                &r,
                "orphan_vm_total",
                "VMs found without a pod at startup reconcile.",
            )?,
            vm_inspect_transient_fail_total: counter(
                &r,
                "vm_inspect_transient_fail_total",
                "Transient failures of cocoon vm inspect.",
            )?,
            pod_evict_failure_total: counter(
                &r,
                "pod_evict_failure_total",
                "Pod evictions that failed.",
            )?,
            reconcile_adopt_by_name_total: counter(
                &r,
                "reconcile_adopt_by_name_total",
                "VMs adopted by name during startup reconcile.",
            )?,
            stale_create_reconcile_total: counter_vec(
                &r,
                "stale_create_reconcile_total",
                "VMs stuck in creating resolved at startup, by outcome.",
                &["outcome"],
            )?,
            startup_resume_total: counter_vec(
                &r,
                "startup_resume_total",
                "Interrupted work resumed after a restart, by op.",
                &["op"],
            )?,
            hibernate_evidence_total: counter_vec(
                &r,
                "hibernate_evidence_total",
                "Hibernate evidence checks by verdict.",
                &["verdict"],
            )?,
            hibernate_total: counter_vec(
                &r,
                "hibernate_total",
                "Hibernate operations by namespace, phase and result.",
                &["namespace", "phase", "result"],
            )?,
            wake_ip_wait_total: counter_vec(
                &r,
                "wake_ip_wait_total",
                "Waits for a woken VM's IP by namespace and result.",
                &["namespace", "result"],
            )?,
            postclone_total: counter_vec(
                &r,
                "postclone_total",
                "Post-clone network fix-ups by kind and result.",
                &["kind", "result"],
            )?,
            vm_boot_duration_seconds: histogram_vec(
                &r,
                "vm_boot_duration_seconds",
                "Time from create to running VM.",
                &["namespace", "mode", "backend"],
                &[0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0],
            )?,
            snapshot_save_duration_seconds: histogram_vec(
                &r,
                "snapshot_save_duration_seconds",
                "Duration of local snapshot saves.",
                &["namespace"],
                &[1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0],
            )?,
            snapshot_push_duration_seconds: histogram_vec(
                &r,
                "snapshot_push_duration_seconds",
                "Duration of snapshot pushes.",
                &["namespace"],
                &[1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0],
            )?,
            snapshot_pull_duration_seconds: {
                let opts = HistogramOpts::new(
                    format!("{PREFIX}snapshot_pull_duration_seconds"),
                    "Duration of snapshot pulls.",
                )
                .buckets(vec![1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]);
                let h = Histogram::with_opts(opts)?;
                r.register(Box::new(h.clone()))?;
                h
            },
            snapshot_peer_restore_duration_seconds: histogram_vec(
                &r,
                "snapshot_peer_restore_duration_seconds",
                "Duration of restores from a peer node.",
                &["namespace"],
                &[1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0],
            )?,
            probe_duration_seconds: histogram_vec(
                &r,
                "probe_duration_seconds",
                "Duration of readiness probes.",
                &["namespace"],
                &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0],
            )?,
            postclone_retry_attempts: histogram_vec(
                &r,
                "postclone_retry_attempts",
                "Attempts a post-clone fix-up took, by result.",
                &["result"],
                &[1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0],
            )?,
            vm_restarts_total: counter_vec(
                &r,
                "vm_restarts_total",
                "VMs found stopped and started again by the daemon, by namespace and pod.",
                &["namespace", "pod"],
            )?,
            certificate_expiry_timestamp_seconds: {
                let g = GaugeVec::new(
                    Opts::new(
                        format!("{PREFIX}certificate_expiry_timestamp_seconds"),
                        "NotAfter of the certificates the daemon presents, in unix seconds.",
                    ),
                    &["certificate"],
                )?;
                r.register(Box::new(g.clone()))?;
                g
            },
            registry: r,
            text_sources: Arc::new(RwLock::new(vec![
                Arc::new(super::process::ProcessCollector) as Arc<dyn TextSource>,
            ])),
        })
    }

    /// The registry, for rooms that register their own collectors (stats, vm_table_size).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Adds families written as text after the registry's. Fails when one of its family names
    /// is already registered or written by another source (the text would repeat a family).
    pub fn add_text_source(&self, source: Arc<dyn TextSource>) -> Result<(), DuplicateFamily> {
        let mut taken: Vec<String> = self
            .registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        let mut sources = self.text_sources.write().unwrap_or_else(|e| e.into_inner());
        for s in sources.iter() {
            taken.extend(s.family_names());
        }
        if let Some(dup) = source
            .family_names()
            .into_iter()
            .find(|n| taken.contains(n))
        {
            return Err(DuplicateFamily(dup));
        }
        sources.push(source);
        Ok(())
    }

    /// Everything registered plus every text source, in the Prometheus text format (version
    /// 0.0.4). A collector that fails to encode is logged and left out, never fatal.
    pub fn encode(&self) -> String {
        let families = self.registry.gather();
        let mut text = match prometheus::TextEncoder::new().encode_to_string(&families) {
            Ok(text) => text,
            Err(e) => {
                log::error!("metrics encoding failed: {e}");
                String::new()
            }
        };
        let sources = self.text_sources.read().unwrap_or_else(|e| e.into_inner());
        for s in sources.iter() {
            s.write_text(&mut text);
        }
        text
    }
}

/// A text source's family that is already exported: the text would repeat it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateFamily(pub String);

impl std::fmt::Display for DuplicateFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "metric family {} is already exported", self.0)
    }
}

impl std::error::Error for DuplicateFamily {}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::proto::MetricType;

    /// The Go daemon's families, transcribed: name, type, labels, buckets.
    const TABLE: &[(&str, MetricType, &[&str], &[f64])] = &[
        (
            "pod_lifecycle_total",
            MetricType::COUNTER,
            &["op", "result", "reason"],
            &[],
        ),
        (
            "connections_refused_total",
            MetricType::COUNTER,
            &["listener", "reason"],
            &[],
        ),
        ("snapshot_pull_total", MetricType::COUNTER, &["result"], &[]),
        ("snapshot_save_total", MetricType::COUNTER, &["result"], &[]),
        ("snapshot_push_total", MetricType::COUNTER, &["result"], &[]),
        (
            "snapshot_verify_total",
            MetricType::COUNTER,
            &["result"],
            &[],
        ),
        (
            "snapshot_peer_restore_total",
            MetricType::COUNTER,
            &["result"],
            &[],
        ),
        (
            "clone_from_dir_total",
            MetricType::COUNTER,
            &["result"],
            &[],
        ),
        ("wake_total", MetricType::COUNTER, &["result"], &[]),
        (
            "wake_renew_nudge_total",
            MetricType::COUNTER,
            &["result"],
            &[],
        ),
        ("lease_release_total", MetricType::COUNTER, &["result"], &[]),
        ("orphan_vm_total", MetricType::COUNTER, &[], &[]),
        (
            "vm_inspect_transient_fail_total",
            MetricType::COUNTER,
            &[],
            &[],
        ),
        ("pod_evict_failure_total", MetricType::COUNTER, &[], &[]),
        (
            "reconcile_adopt_by_name_total",
            MetricType::COUNTER,
            &[],
            &[],
        ),
        (
            "stale_create_reconcile_total",
            MetricType::COUNTER,
            &["outcome"],
            &[],
        ),
        ("startup_resume_total", MetricType::COUNTER, &["op"], &[]),
        (
            "hibernate_evidence_total",
            MetricType::COUNTER,
            &["verdict"],
            &[],
        ),
        (
            "hibernate_total",
            MetricType::COUNTER,
            &["namespace", "phase", "result"],
            &[],
        ),
        (
            "wake_ip_wait_total",
            MetricType::COUNTER,
            &["namespace", "result"],
            &[],
        ),
        (
            "postclone_total",
            MetricType::COUNTER,
            &["kind", "result"],
            &[],
        ),
        (
            "vm_boot_duration_seconds",
            MetricType::HISTOGRAM,
            &["namespace", "mode", "backend"],
            &[0.5, 1., 2., 5., 10., 30., 60., 120., 300.],
        ),
        (
            "snapshot_save_duration_seconds",
            MetricType::HISTOGRAM,
            &["namespace"],
            &[1., 2., 5., 10., 30., 60., 120.],
        ),
        (
            "snapshot_push_duration_seconds",
            MetricType::HISTOGRAM,
            &["namespace"],
            &[1., 5., 10., 30., 60., 120., 300.],
        ),
        (
            "snapshot_pull_duration_seconds",
            MetricType::HISTOGRAM,
            &[],
            &[1., 5., 10., 30., 60., 120., 300.],
        ),
        (
            "snapshot_peer_restore_duration_seconds",
            MetricType::HISTOGRAM,
            &["namespace"],
            &[1., 2.5, 5., 7.5, 10., 15., 30., 60., 120.],
        ),
        (
            "probe_duration_seconds",
            MetricType::HISTOGRAM,
            &["namespace"],
            &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1., 5.],
        ),
        (
            "postclone_retry_attempts",
            MetricType::HISTOGRAM,
            &["result"],
            &[1., 2., 5., 10., 20., 40., 60.],
        ),
        (
            "vm_restarts_total",
            MetricType::COUNTER,
            &["namespace", "pod"],
            &[],
        ),
        (
            "certificate_expiry_timestamp_seconds",
            MetricType::GAUGE,
            &["certificate"],
            &[],
        ),
    ];

    /// Touches one child of every family so that gather() reports it.
    fn touch_all(m: &Metrics) {
        for (name, kind, labels, _) in TABLE {
            let values: Vec<&str> = labels.iter().map(|_| "x").collect();
            let full = format!("{PREFIX}{name}");
            let touched = match (*kind, labels.is_empty()) {
                (MetricType::COUNTER, true) => {
                    let c = [
                        &m.orphan_vm_total,
                        &m.vm_inspect_transient_fail_total,
                        &m.pod_evict_failure_total,
                        &m.reconcile_adopt_by_name_total,
                    ];
                    c.iter().for_each(|c| c.inc());
                    true
                }
                (MetricType::HISTOGRAM, true) => {
                    m.snapshot_pull_duration_seconds.observe(0.5);
                    true
                }
                _ => false,
            };
            if !touched {
                let vecs_c = [
                    &m.pod_lifecycle_total,
                    &m.snapshot_pull_total,
                    &m.snapshot_save_total,
                    &m.snapshot_push_total,
                    &m.snapshot_verify_total,
                    &m.snapshot_peer_restore_total,
                    &m.clone_from_dir_total,
                    &m.wake_total,
                    &m.wake_renew_nudge_total,
                    &m.lease_release_total,
                    &m.stale_create_reconcile_total,
                    &m.startup_resume_total,
                    &m.hibernate_evidence_total,
                    &m.hibernate_total,
                    &m.wake_ip_wait_total,
                    &m.postclone_total,
                    &m.vm_restarts_total,
                    crate::metrics::admission::refused_total(),
                ];
                let vecs_h = [
                    &m.vm_boot_duration_seconds,
                    &m.snapshot_save_duration_seconds,
                    &m.snapshot_push_duration_seconds,
                    &m.snapshot_peer_restore_duration_seconds,
                    &m.probe_duration_seconds,
                    &m.postclone_retry_attempts,
                ];
                // Exactly one field accepts these label values under this name.
                let mut hits = 0;
                for c in vecs_c {
                    if let Ok(child) = c.get_metric_with_label_values(&values) {
                        if c.desc()[0].fq_name == full {
                            child.inc();
                            hits += 1;
                        }
                    }
                }
                for h in vecs_h {
                    if let Ok(child) = h.get_metric_with_label_values(&values) {
                        if h.desc()[0].fq_name == full {
                            child.observe(0.5);
                            hits += 1;
                        }
                    }
                }
                if full == m.certificate_expiry_timestamp_seconds.desc()[0].fq_name {
                    m.certificate_expiry_timestamp_seconds
                        .with_label_values(&values)
                        .set(1.0);
                    hits += 1;
                }
                assert_eq!(hits, 1, "{full}: field with that name and label arity");
            }
        }
    }

    use prometheus::core::Collector;

    #[test]
    fn every_family_of_section_22_2_with_exact_labels_and_buckets() {
        let m = Metrics::new().unwrap();
        touch_all(&m);
        let families = m.registry().gather();
        assert_eq!(families.len(), TABLE.len(), "no family missing, none extra");
        for (name, kind, labels, buckets) in TABLE {
            let full = format!("vk_cocoon_{name}");
            let fam = families
                .iter()
                .find(|f| f.name() == full)
                .unwrap_or_else(|| panic!("{full} missing"));
            assert_eq!(fam.get_field_type(), *kind, "{full} type");
            let metric = &fam.get_metric()[0];
            let got: Vec<&str> = metric.get_label().iter().map(|l| l.name()).collect();
            let mut want: Vec<&str> = labels.to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "{full} labels");
            if *kind == MetricType::HISTOGRAM {
                let bounds: Vec<f64> = metric
                    .get_histogram()
                    .get_bucket()
                    .iter()
                    .map(|b| b.upper_bound())
                    .collect();
                assert_eq!(bounds, buckets.to_vec(), "{full} buckets");
            }
        }
    }

    #[test]
    fn encode_emits_text_format_and_clones_share_values() {
        let m = Metrics::new().unwrap();
        let clone = m.clone();
        clone
            .pod_lifecycle_total
            .with_label_values(&["create", "success", ""])
            .inc();
        clone.orphan_vm_total.inc_by(3);
        let text = m.encode();
        assert!(
            text.contains("# TYPE vk_cocoon_pod_lifecycle_total counter"),
            "{text}"
        );
        assert!(
            text.contains(
                "vk_cocoon_pod_lifecycle_total{op=\"create\",reason=\"\",result=\"success\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("vk_cocoon_orphan_vm_total 3"), "{text}");
        assert!(!text.contains("cocoon_vk_"));
    }

    #[test]
    fn other_rooms_can_register_collectors() {
        let m = Metrics::new().unwrap();
        let g = prometheus::IntGauge::new("vk_cocoon_vm_table_size_test", "test gauge").unwrap();
        m.registry().register(Box::new(g.clone())).unwrap();
        g.set(5);
        assert!(m.encode().contains("vk_cocoon_vm_table_size_test 5"));
    }
}
