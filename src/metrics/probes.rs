//! `prober_probe_total` of the kubelet's `/metrics/probes`: readiness probe results counted per
//! pod as the probe manager settles them, and the family in the kubelet's labels.
//!
//! Shared between the loop (which counts) and the kubelet server (which renders) through one
//! cheap clone; a pod's series go when its probing stops, as the kubelet drops a stopped
//! worker's series.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use super::escape_label;

/// The kubelet's probe result label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The probe ran and the guest answered.
    Successful,
    /// The probe ran and the guest did not answer (or not in time).
    Failed,
    /// The probe could not run: no address yet, no VM, an unusable probe port.
    Unknown,
}

impl ProbeOutcome {
    fn index(self) -> usize {
        match self {
            ProbeOutcome::Successful => 0,
            ProbeOutcome::Failed => 1,
            ProbeOutcome::Unknown => 2,
        }
    }
}

const RESULTS: [&str; 3] = ["successful", "failed", "unknown"];

/// (namespace, pod) → (pod UID, counts by result).
type Table = BTreeMap<(String, String), (String, [u64; 3])>;

/// The counts of every probed pod. Clones share them.
#[derive(Clone, Debug, Default)]
pub struct ProbeCounts {
    inner: Arc<Mutex<Table>>,
}

impl ProbeCounts {
    /// One probe of `pod` ended with `outcome`. A new UID (the pod was recreated under its
    /// name) starts the counts afresh, as a new kubelet worker does.
    pub fn record(&self, namespace: &str, pod: &str, uid: &str, outcome: ProbeOutcome) {
        let mut t = lock(&self.inner);
        let entry = t
            .entry((namespace.to_string(), pod.to_string()))
            .or_insert_with(|| (uid.to_string(), [0; 3]));
        if entry.0 != uid && !uid.is_empty() {
            *entry = (uid.to_string(), [0; 3]);
        }
        entry.1[outcome.index()] += 1;
    }

    /// The pod is no longer probed: its series go.
    pub fn forget(&self, namespace: &str, pod: &str) {
        lock(&self.inner).remove(&(namespace.to_string(), pod.to_string()));
    }

    /// How many pods have series (for leak checks).
    pub fn pods(&self) -> usize {
        lock(&self.inner).len()
    }

    /// The `/metrics/probes` text (format 0.0.4). Every result of a probed pod has a series,
    /// zero included, so `rate()` sees a result's first occurrence.
    pub fn text(&self) -> String {
        let t = lock(&self.inner);
        let mut o = String::with_capacity(256 + t.len() * 3 * 200);
        o.push_str("# HELP prober_probe_total [ALPHA] Cumulative number of a liveness, readiness or startup probe for a container by result.\n");
        o.push_str("# TYPE prober_probe_total counter\n");
        for ((ns, pod), (uid, counts)) in t.iter() {
            for (result, count) in RESULTS.iter().zip(counts) {
                o.push_str("prober_probe_total{container=\"");
                o.push_str(super::cadvisor::CONTAINER);
                o.push_str("\",namespace=\"");
                escape_label(ns, &mut o);
                o.push_str("\",pod=\"");
                escape_label(pod, &mut o);
                o.push_str("\",pod_uid=\"");
                escape_label(uid, &mut o);
                let _ = writeln!(
                    o,
                    "\",probe_type=\"Readiness\",result=\"{result}\"}} {count}"
                );
            }
        }
        o
    }
}

fn lock(m: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    // Plain counters: a panic elsewhere cannot leave them inconsistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_result_and_forgets_stopped_pods() {
        let c = ProbeCounts::default();
        c.record("ns", "p", "u1", ProbeOutcome::Successful);
        c.record("ns", "p", "u1", ProbeOutcome::Successful);
        c.record("ns", "p", "u1", ProbeOutcome::Failed);
        let t = c.text();
        assert!(t.contains("prober_probe_total{container=\"agent\",namespace=\"ns\",pod=\"p\",pod_uid=\"u1\",probe_type=\"Readiness\",result=\"successful\"} 2\n"), "{t}");
        assert!(t.contains("result=\"failed\"} 1\n"), "{t}");
        assert!(t.contains("result=\"unknown\"} 0\n"), "{t}");
        c.record("ns", "p", "u2", ProbeOutcome::Unknown);
        let t = c.text();
        assert!(
            t.contains("pod_uid=\"u2\",probe_type=\"Readiness\",result=\"unknown\"} 1\n"),
            "{t}"
        );
        assert!(!t.contains("u1"), "a recreated pod starts afresh: {t}");
        c.forget("ns", "p");
        assert_eq!(c.pods(), 0);
        assert!(!c.text().contains("prober_probe_total{"));
    }
}
