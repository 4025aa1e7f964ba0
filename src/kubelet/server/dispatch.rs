//! Request dispatch of the kubelet server: the route of an authorised request, answered at once
//! (health, pods, stats, metrics) or handed to `children` (logs, exec, attach) or `forward`
//! (port-forward).

use std::sync::Arc;

use mio::Token;
use serde_json::json;

use super::KubeletServer;
use crate::kubelet::routes::{self, Request, Route};
use crate::kubelet::stats::{build_summary, resource_metrics_text};
use crate::kubelet::PodInfo;
use crate::reactor::Reactor;

impl KubeletServer {
    fn find_pod(&self, ns: &str, name: &str) -> Option<&PodInfo> {
        self.index
            .get(&(ns.to_string(), name.to_string()))
            .and_then(|&i| self.view.pods.get(i))
    }

    fn pod_list<'a>(pods: impl Iterator<Item = &'a PodInfo>) -> Vec<u8> {
        let items: Vec<PodOut> = pods
            .map(|p| PodOut {
                api_version: "v1",
                kind: "Pod",
                metadata: &p.pod.metadata,
                spec: p.pod.spec.as_ref(),
                status: p.status.as_deref().or(p.pod.status.as_ref()),
            })
            .collect();
        json!({"kind":"PodList","apiVersion":"v1","metadata":{},"items":items})
            .to_string()
            .into_bytes()
    }

    /// Checks pod and container of a per-pod route: Err is a ready response.
    /// The container name is not looked up: a cocoon pod is one VM whatever its spec calls
    /// its containers, `kubectl logs` / `exec` send the pod's own container name, and the Go
    /// daemon ignores the name in these paths (an unknown one reaches the VM too).
    pub(super) fn pod_for(
        &self,
        ns: &str,
        pod: &str,
        _container: &str,
    ) -> Result<&PodInfo, Vec<u8>> {
        let Some(p) = self.find_pod(ns, pod) else {
            return Err(routes::text(
                404,
                &format!("pod {ns}/{pod} not found"),
                false,
            ));
        };
        Ok(p)
    }

    pub(super) fn dispatch<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: Request,
    ) {
        let close = req.wants_close();
        let now = r.now();
        let resp = match routes::route(&req.method, &req.path) {
            Route::Healthz => routes::text(200, "ok", false),
            Route::Pods => routes::response(
                200,
                "application/json",
                &Self::pod_list(self.view.pods.iter()),
                false,
            ),
            Route::RunningPods => routes::response(
                200,
                "application/json",
                &Self::pod_list(self.view.pods.iter().filter(|p| p.vm.is_some())),
                false,
            ),
            Route::StatsSummary => {
                let sample = self.stats.sample(now);
                let s = build_summary(
                    &sample,
                    &self.cfg.node_name,
                    self.stats.process_start(),
                    crate::wall_clock::now(),
                );
                match serde_json::to_vec(&s) {
                    Ok(b) => routes::response(200, "application/json", &b, false),
                    Err(e) => routes::text(500, &e.to_string(), false),
                }
            }
            Route::MetricsResource => {
                let sample = self.stats.sample(now);
                // The text depends on the sample alone: render it once per sample (every 2 s at
                // most), not once per scrape.
                let text = match &self.resource_text {
                    Some((of, text)) if Arc::ptr_eq(of, &sample) => text.clone(),
                    _ => {
                        let text = Arc::new(resource_metrics_text(&sample));
                        self.resource_text = Some((sample, text.clone()));
                        text
                    }
                };
                routes::response(200, "text/plain; version=0.0.4", text.as_bytes(), false)
            }
            Route::Metrics => self.own_metrics_response(),
            Route::MetricsCadvisor => match self.cadvisor_response(r, token, close) {
                Some(resp) => resp,
                None => return,
            },
            Route::MetricsProbes => self.probes_response(),
            Route::MethodNotAllowed => routes::text(405, "405 method not allowed", false),
            Route::NotFound => routes::text(404, "404 request not found", false),
            Route::ContainerLogs {
                namespace,
                pod,
                container,
            } => return self.start_logs(r, token, &req, &namespace, &pod, &container),
            Route::Exec {
                namespace,
                pod,
                container,
            } => return self.upgrade_exec(r, token, &req, &namespace, &pod, &container, false),
            Route::Attach {
                namespace,
                pod,
                container,
            } => return self.upgrade_exec(r, token, &req, &namespace, &pod, &container, true),
            Route::PortForward { namespace, pod } => {
                return self.upgrade_port_forward(r, token, &req, &namespace, &pod)
            }
        };
        self.respond(r, token, resp, close);
    }
}

/// A pod as /pods serves it: the shared API object with the status the daemon computed.
#[derive(serde::Serialize)]
struct PodOut<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    metadata: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    #[serde(skip_serializing_if = "Option::is_none")]
    spec: Option<&'a k8s_openapi::api::core::v1::PodSpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a k8s_openapi::api::core::v1::PodStatus>,
}
