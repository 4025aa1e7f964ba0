//! The kubelet server's Prometheus endpoints besides `/metrics/resource`: `/metrics` (the daemon's
//! own families), `/metrics/cadvisor` and `/metrics/probes`, and the certificate expiry gauge.
//!
//! The kube-prometheus kubelet ServiceMonitor scrapes these three paths; they sit behind the
//! same authorisation as every kubelet path (subresource `nodes/metrics`). The cAdvisor text
//! depends on the shared sample and the pods' facts only, so it is rendered once per sample.

use std::time::{SystemTime, UNIX_EPOCH};

use super::KubeletServer;
use crate::kubelet::routes;
use crate::kubelet::PodInfo;
use crate::metrics::cadvisor::{PodFacts, PodFactsMap};
use crate::metrics::probes::ProbeCounts;
use crate::metrics::Metrics;

/// What the server needs to answer `/metrics` and `/metrics/probes`.
#[derive(Clone)]
pub struct ServedMetrics {
    /// The daemon's registry (the text of the 9091 endpoint).
    pub metrics: Metrics,
    /// The probe manager's counts.
    pub probes: ProbeCounts,
}

const TEXT: &str = "text/plain; version=0.0.4";

/// The facts of one pod that its series need and the sample does not hold.
pub fn pod_facts(p: &PodInfo) -> PodFacts {
    let container = p
        .pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .filter(|i| !i.is_empty());
    let image = container.or_else(|| {
        p.pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::provider::spec::ANN_IMAGE))
            .filter(|i| !i.is_empty())
            .cloned()
    });
    let status = p.status.as_deref().or(p.pod.status.as_ref());
    let start_time = status.and_then(|s| s.start_time.as_ref()).and_then(|t| {
        let secs = u64::try_from(t.0.as_second()).ok()?;
        Some(UNIX_EPOCH + std::time::Duration::from_secs(secs))
    });
    let resources = crate::provider::spec::pod_resources(&p.pod).unwrap_or_default();
    let policy = resources.cpu_policy();
    PodFacts {
        image: image.unwrap_or_default(),
        start_time,
        // The VM is sized by the request, else the limit: it never holds more than that.
        memory_limit_bytes: resources.memory_bytes(),
        cpu_quota: (policy.quota_us > 0).then_some((policy.quota_us, policy.period_us)),
    }
}

impl KubeletServer {
    /// Serve `/metrics` and `/metrics/probes` from these (without, they answer 404), and keep
    /// the serving certificate's expiry gauge in the registry.
    pub fn serve_metrics(&mut self, served: ServedMetrics) {
        self.served = Some(served);
        self.export_cert_expiry();
    }

    /// Sets `certificate_expiry_timestamp_seconds{certificate="kubelet-serving"}` from the
    /// certificate in use (after start and after each reload).
    pub(super) fn export_cert_expiry(&self) {
        let (Some(s), Some(at)) = (&self.served, self.tls.not_after()) else {
            return;
        };
        set_expiry(
            &s.metrics,
            crate::metrics::families::CERT_KUBELET_SERVING,
            at,
        );
    }

    /// Rebuilds the facts of the pods with a VM (called with each new view).
    pub(super) fn refresh_facts(&mut self) {
        self.facts = self
            .view
            .pods
            .iter()
            .filter(|p| p.vm.is_some())
            .map(|p| ((p.namespace.clone(), p.name.clone()), pod_facts(p)))
            .collect::<PodFactsMap>()
            .into();
        self.facts_generation += 1;
    }

    pub(super) fn own_metrics_response(&self) -> Vec<u8> {
        match &self.served {
            Some(s) => routes::response(200, TEXT, s.metrics.encode().as_bytes(), false),
            None => routes::text(404, "404 request not found", false),
        }
    }

    pub(super) fn probes_response(&self) -> Vec<u8> {
        match &self.served {
            Some(s) => routes::response(200, TEXT, s.probes.text().as_bytes(), false),
            None => routes::text(404, "404 request not found", false),
        }
    }
}

/// Sets one certificate's expiry gauge.
pub fn set_expiry(metrics: &Metrics, certificate: &str, not_after: SystemTime) {
    let secs = not_after
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    metrics
        .certificate_expiry_timestamp_seconds
        .with_label_values(&[certificate])
        .set(secs);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn info(pod: serde_json::Value) -> PodInfo {
        PodInfo {
            namespace: "ns".into(),
            name: "p".into(),
            uid: "u".into(),
            vm: None,
            pod: Arc::new(serde_json::from_value(pod).unwrap()),
            status: None,
        }
    }

    #[test]
    fn facts_come_from_the_first_container_and_the_status() {
        let f = pod_facts(&info(serde_json::json!({
            "metadata": {"name": "p", "annotations": {"cocoonset.cocoonstack.io/image": "snap"}},
            "spec": {"containers": [{"name": "agent", "image": "img:1",
                "resources": {"requests": {"memory": "1Gi"}, "limits": {"cpu": "1500m", "memory": "2Gi"}}}]},
            "status": {"startTime": "2026-01-02T03:04:05Z"}
        })));
        assert_eq!(f.image, "img:1");
        assert_eq!(
            f.memory_limit_bytes,
            Some(1 << 30),
            "the VM is sized by the request"
        );
        assert_eq!(f.cpu_quota, Some((150_000, 100_000)));
        let start = f.start_time.unwrap().duration_since(UNIX_EPOCH).unwrap();
        assert_eq!(start.as_secs(), 1_767_323_045);

        // No container image: the annotation's; resources that do not parse: none known.
        let f = pod_facts(&info(serde_json::json!({
            "metadata": {"name": "p", "annotations": {"cocoonset.cocoonstack.io/image": "snap"}},
            "spec": {"containers": [{"name": "agent", "resources": {"limits": {"memory": "lots"}}}]}
        })));
        assert_eq!(f.image, "snap");
        assert_eq!(
            (f.memory_limit_bytes, f.cpu_quota, f.start_time),
            (None, None, None)
        );
    }
}
