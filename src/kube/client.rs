//! The blocking Kubernetes API client on ureq: every call rate limited, timed out and classified.
//! It performs the calls vk-cocoon needs; it decides nothing about pods or nodes.

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::TokenReview;
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod, PodStatus};
use rustls::ClientConfig;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::auth::{AuthMaterial, Credentials};
use super::error::{parse_retry_after, KubeError};
use super::kubeconfig::{self, ClusterConfig, KubeConfigError, KubeOptions};
use super::ratelimit::TokenBucket;
use super::tls::{client_config, TlsParams};
use crate::http_client::{self, CallError};
use crate::percent;

/// Largest response body accepted (a big pod list).
const MAX_BODY: u64 = 256 << 20;

pub const CT_JSON: &str = "application/json";
pub const CT_MERGE_PATCH: &str = "application/merge-patch+json";
pub const CT_STRATEGIC_MERGE_PATCH: &str = "application/strategic-merge-patch+json";

/// Where the API server is, split out for the hand-driven watch connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTarget {
    pub https: bool,
    /// Host without IPv6 brackets.
    pub host: String,
    pub port: u16,
    /// Path prefix of the server URL ("" for most clusters), no trailing slash.
    pub base_path: String,
}

/// Why a kubeconfig's `server` URL is refused; the text names the URL as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerUrlError {
    /// Neither `https://` nor `http://`.
    Scheme(String),
    /// An IPv6 host whose `[` is not closed.
    UnclosedBracket(String),
    NoHost(String),
    /// The port, as written, is not a number up to 65535.
    BadPort {
        server: String,
        port: String,
    },
}

impl std::fmt::Display for ServerUrlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerUrlError::Scheme(server) => {
                write!(f, "server {server:?}: scheme must be https:// or http://")
            }
            ServerUrlError::UnclosedBracket(server) => write!(f, "server {server:?}: unclosed ["),
            ServerUrlError::NoHost(server) => write!(f, "server {server:?}: no host"),
            ServerUrlError::BadPort { server, port } => {
                write!(f, "server {server:?}: bad port {port:?}")
            }
        }
    }
}

impl ServerTarget {
    /// Parse `https://host[:port][/prefix]` (IPv6 hosts bracketed).
    pub fn parse(server: &str) -> Result<ServerTarget, ServerUrlError> {
        let (https, rest) = if let Some(r) = server.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = server.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(ServerUrlError::Scheme(server.to_string()));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = if let Some(r) = authority.strip_prefix('[') {
            let end = r
                .find(']')
                .ok_or_else(|| ServerUrlError::UnclosedBracket(server.to_string()))?;
            let host = &r[..end];
            let port = r[end + 1..].strip_prefix(':');
            (host, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(ServerUrlError::NoHost(server.to_string()));
        }
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| ServerUrlError::BadPort {
                server: server.to_string(),
                port: p.to_string(),
            })?,
            None if https => 443,
            None => 80,
        };
        Ok(ServerTarget {
            https,
            host: host.to_string(),
            port,
            base_path: path.trim_end_matches('/').to_string(),
        })
    }

    /// Value for the Host header.
    pub fn host_header(&self) -> String {
        let h = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let default = if self.https { 443 } else { 80 };
        if self.port == default {
            h
        } else {
            format!("{h}:{}", self.port)
        }
    }
}

/// What the watch needs to open its own connection with the client's TLS and credentials.
#[derive(Clone)]
pub struct WatchSession {
    pub target: ServerTarget,
    /// None for plain http servers.
    pub tls: Option<Arc<ClientConfig>>,
    pub authorization: Option<String>,
}

struct TlsState {
    cert: Option<(Vec<u8>, Vec<u8>)>,
    config: Option<Arc<ClientConfig>>,
    agent: ureq::Agent,
}

/// A page of pods and the list's resourceVersion (the point a watch starts from).
#[derive(Clone, Debug, Default)]
pub struct PodList {
    pub items: Vec<Pod>,
    pub resource_version: String,
}

/// The blocking client. Cheap to share behind an Arc; all methods take &self.
pub struct Client {
    cluster: ClusterConfig,
    target: ServerTarget,
    shared: Arc<Shared>,
    timeout: Duration,
    /// False for a handle whose caller takes each call's token itself (see `paced_by_caller`).
    throttled: bool,
}

/// What every handle of one client shares: credentials, the TLS agent and the rate limiter
/// (one QPS budget for all of the daemon's calls, like one client-go clientset).
struct Shared {
    creds: Credentials,
    tls: Mutex<TlsState>,
    limiter: Mutex<TokenBucket>,
}

// Err is the detail the callers wrap into KubeConfigError::Invalid or KubeError::Credentials.
fn build_state(
    cluster: &ClusterConfig,
    cert: Option<(Vec<u8>, Vec<u8>)>,
    https: bool,
    timeout: Duration,
) -> Result<TlsState, crate::kube::tls::TlsError> {
    let config = if https {
        Some(client_config(&TlsParams {
            ca_pem: cluster.ca_pem.as_deref(),
            insecure_skip_tls_verify: cluster.insecure_skip_tls_verify,
            tls_server_name: cluster.tls_server_name.as_deref(),
            client_cert: cert.as_ref().map(|(c, k)| (c.as_slice(), k.as_slice())),
        })?)
    } else {
        None
    };
    let agent_config = http_client::config()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(timeout.min(Duration::from_secs(5))))
        .user_agent(concat!("vk-cocoon/", env!("CARGO_PKG_VERSION")))
        // The daemon's kube lane runs up to ~20 calls at once: keep their connections (and
        // TLS sessions) for reuse instead of one handshake per call.
        .max_idle_connections(64)
        .max_idle_connections_per_host(32)
        // A redirect is answered to the caller as it came, never followed.
        .max_redirects(0)
        .max_redirects_will_error(false)
        .build();
    let agent = http_client::agent(agent_config, config.clone());
    Ok(TlsState {
        cert,
        config,
        agent,
    })
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, KubeError> {
    serde_json::to_vec(v).map_err(|e| KubeError::Decode(format!("encode request body: {e}")))
}

fn decode<T: DeserializeOwned>(what: &str, body: &[u8]) -> Result<T, KubeError> {
    serde_json::from_slice(body).map_err(|e| KubeError::Decode(format!("{what}: {e}")))
}

/// The first `InternalIP` address of a Node object (as JSON) that parses as an IP.
pub fn node_internal_ip_json(node: &serde_json::Value) -> Option<std::net::IpAddr> {
    node.pointer("/status/addresses")?
        .as_array()?
        .iter()
        .filter(|a| a.get("type").and_then(|t| t.as_str()) == Some("InternalIP"))
        .find_map(|a| a.get("address")?.as_str()?.trim().parse().ok())
}

fn pod_path(ns: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{ns}/pods/{name}")
}

fn lease_path(ns: &str) -> String {
    format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases")
}

impl Client {
    /// Find configuration (KUBECONFIG list, ~/.kube/config, in-cluster) and build the client.
    pub fn from_env(opts: &KubeOptions) -> Result<Client, KubeConfigError> {
        let cluster = kubeconfig::load(opts)?;
        Client::from_config(cluster, opts)
    }

    /// Build from an already-resolved configuration.
    pub fn from_config(
        cluster: ClusterConfig,
        opts: &KubeOptions,
    ) -> Result<Client, KubeConfigError> {
        let target = ServerTarget::parse(&cluster.server)
            .map_err(|e| KubeConfigError::Invalid(format!("{}: {e}", cluster.source)))?;
        let state = build_state(
            &cluster,
            cluster.client_cert.clone(),
            target.https,
            opts.timeout,
        )
        .map_err(|e| KubeConfigError::Invalid(format!("{}: {e}", cluster.source)))?;
        log::info!("kubernetes API {} ({})", cluster.server, cluster.source);
        Ok(Client {
            shared: Arc::new(Shared {
                creds: Credentials::new(&cluster.auth),
                tls: Mutex::new(state),
                limiter: Mutex::new(TokenBucket::new(opts.qps, opts.burst, Instant::now())),
            }),
            target,
            timeout: opts.timeout,
            cluster,
            throttled: true,
        })
    }

    /// A handle on the same connection, credentials and rate limiter whose calls do not wait
    /// for a token: for callers that take the token themselves before the call (the daemon's
    /// kube lane takes it with [`Client::with_limiter`] on the loop, then hands the call to a
    /// worker), so no thread ever sleeps on the limiter for them.
    pub fn paced_by_caller(&self) -> Client {
        Client {
            cluster: self.cluster.clone(),
            target: self.target.clone(),
            shared: self.shared.clone(),
            timeout: self.timeout,
            throttled: false,
        }
    }

    /// Runs `f` on the shared token bucket (e.g. a non-blocking `try_take`).
    pub fn with_limiter<R>(&self, f: impl FnOnce(&mut TokenBucket) -> R) -> R {
        f(&mut self
            .shared
            .limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner()))
    }

    pub fn server(&self) -> &str {
        &self.cluster.server
    }

    pub fn cluster(&self) -> &ClusterConfig {
        &self.cluster
    }

    /// PEM of the client certificate in use: the exec plugin's latest, else the kubeconfig's.
    pub fn client_cert_pem(&self) -> Option<Vec<u8>> {
        let st = self.shared.tls.lock().unwrap_or_else(|p| p.into_inner());
        st.cert
            .as_ref()
            .or(self.cluster.client_cert.as_ref())
            .map(|(cert, _)| cert.clone())
    }

    /// Current credentials, with the agent rebuilt if an exec plugin handed out a new client cert.
    fn material(
        &self,
    ) -> Result<(AuthMaterial, ureq::Agent, Option<Arc<ClientConfig>>), KubeError> {
        let m = self.shared.creds.current()?;
        let mut st = self.shared.tls.lock().unwrap_or_else(|p| p.into_inner());
        let want = m
            .client_cert
            .clone()
            .or_else(|| self.cluster.client_cert.clone());
        if st.cert != want {
            *st = build_state(&self.cluster, want, self.target.https, self.timeout)
                .map_err(|e| KubeError::Credentials(e.to_string()))?;
        }
        Ok((m, st.agent.clone(), st.config.clone()))
    }

    /// Connection parameters for the non-blocking watch (TLS config and Authorization header).
    pub fn watch_session(&self) -> Result<WatchSession, KubeError> {
        let (m, _, tls) = self.material()?;
        Ok(WatchSession {
            target: self.target.clone(),
            tls,
            authorization: m.authorization,
        })
    }

    /// Drop cached credentials (after the watch saw a 401).
    pub fn invalidate_credentials(&self) {
        self.shared.creds.invalidate();
    }

    fn throttle(&self) {
        if !self.throttled {
            return;
        }
        let wait = self
            .shared
            .limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reserve(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }

    /// One raw API call: returns the 2xx body or a classified error. A 401 with refreshable
    /// credentials (token file, exec plugin) is retried once with fresh credentials.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        query: &[(&str, &str)],
        body: Option<(&str, &[u8])>,
    ) -> Result<Vec<u8>, KubeError> {
        let mut refreshed = false;
        loop {
            self.throttle();
            let (m, agent, _) = self.material()?;
            let mut url = format!("{}{}", self.cluster.server, path);
            for (i, (k, v)) in query.iter().enumerate() {
                url.push(if i == 0 && !path.contains('?') {
                    '?'
                } else {
                    '&'
                });
                url.push_str(&percent::encode(k));
                url.push('=');
                url.push_str(&percent::encode(v));
            }
            let mut headers = vec![("Accept", CT_JSON)];
            if let Some(a) = &m.authorization {
                headers.push(("Authorization", a));
            }
            if let Some((ct, _)) = body {
                headers.push(("Content-Type", ct));
            }
            let req = http_client::request(method, &url, &headers);
            let result = match body {
                Some((_, bytes)) => req.body(bytes).map(|r| agent.run(r)),
                None => req.body(()).map(|r| agent.run(r)),
            }
            .map_err(|e| KubeError::Transport(format!("{method} {path}: {e}")))?;
            match http_client::checked(result) {
                Ok(resp) => {
                    let mut buf = Vec::new();
                    resp.into_body()
                        .into_reader()
                        .take(MAX_BODY)
                        .read_to_end(&mut buf)
                        .map_err(|e| {
                            KubeError::Transport(format!("{method} {path}: reading body: {e}"))
                        })?;
                    return Ok(buf);
                }
                Err(CallError::Status(code, resp)) => {
                    let retry_after = parse_retry_after(http_client::header(&resp, "Retry-After"));
                    let mut buf = Vec::new();
                    let _ = resp
                        .into_body()
                        .into_reader()
                        .take(1 << 20)
                        .read_to_end(&mut buf);
                    let err = KubeError::from_response(code, &buf, retry_after);
                    if code == 401 && !refreshed && self.shared.creds.refreshable() {
                        refreshed = true;
                        self.shared.creds.invalidate();
                        continue;
                    }
                    return Err(err);
                }
                Err(CallError::Transport(t)) => {
                    return Err(KubeError::Transport(format!("{method} {path}: {t}")));
                }
            }
        }
    }

    fn call_json<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        query: &[(&str, &str)],
        body: Option<(&str, &[u8])>,
    ) -> Result<T, KubeError> {
        let out = self.request(method, path, query, body)?;
        decode(&format!("{method} {path}"), &out)
    }

    // ---- pods ----

    pub fn get_pod(&self, ns: &str, name: &str) -> Result<Pod, KubeError> {
        self.call_json("GET", &pod_path(ns, name), &[], None)
    }

    /// List every pod bound to `node` (all namespaces), following `continue` pages.
    /// Pods that do not decode are logged and skipped.
    pub fn list_pods_on_node(&self, node: &str) -> Result<PodList, KubeError> {
        #[derive(serde::Deserialize)]
        struct Meta {
            #[serde(default, rename = "resourceVersion")]
            resource_version: Option<String>,
            #[serde(default, rename = "continue")]
            cont: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: Option<Meta>,
            #[serde(default)]
            items: Option<Vec<serde_json::Value>>,
        }
        let selector = format!("spec.nodeName={node}");
        let mut out = PodList::default();
        let mut cont = String::new();
        loop {
            let mut q: Vec<(&str, &str)> = vec![("fieldSelector", &selector), ("limit", "500")];
            if !cont.is_empty() {
                q.push(("continue", &cont));
            }
            let w: Wire = self.call_json("GET", "/api/v1/pods", &q, None)?;
            for item in w.items.unwrap_or_default() {
                match <Pod as serde::Deserialize>::deserialize(&item) {
                    Ok(p) => out.items.push(p),
                    Err(e) => log::error!(
                        "pod list: skipping pod {}/{} that does not decode: {e}",
                        item.pointer("/metadata/namespace")
                            .and_then(|v| v.as_str())
                            .unwrap_or("?"),
                        item.pointer("/metadata/name")
                            .and_then(|v| v.as_str())
                            .unwrap_or("?"),
                    ),
                }
            }
            let meta = w.metadata.unwrap_or(Meta {
                resource_version: None,
                cont: None,
            });
            out.resource_version = meta.resource_version.unwrap_or_default();
            match meta.cont.filter(|c| !c.is_empty()) {
                Some(c) => cont = c,
                None => return Ok(out),
            }
        }
    }

    /// Strategic-merge patch of a pod (annotations, labels). Put `metadata.uid` in `patch`
    /// to make it apply only to that incarnation. The answer's pod is not decoded (a few KB
    /// of JSON per write): the new copy comes back through the watch.
    pub fn patch_pod(
        &self,
        ns: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<(), KubeError> {
        let body = encode(patch)?;
        self.request(
            "PATCH",
            &pod_path(ns, name),
            &[],
            Some((CT_STRATEGIC_MERGE_PATCH, &body)),
        )
        .map(drop)
    }

    /// Merge patch of pods/status with body `{"metadata":{"uid":..},"status":..}`; the answer's
    /// pod is not decoded either.
    pub fn patch_pod_status(
        &self,
        ns: &str,
        name: &str,
        uid: Option<&str>,
        status: &PodStatus,
    ) -> Result<(), KubeError> {
        let mut body = serde_json::json!({ "status": status });
        if let Some(uid) = uid {
            body["metadata"] = serde_json::json!({ "uid": uid });
        }
        let body = encode(&body)?;
        self.request(
            "PATCH",
            &format!("{}/status", pod_path(ns, name)),
            &[],
            Some((CT_MERGE_PATCH, &body)),
        )
        .map(drop)
    }

    /// PUT pods/status with the pod's resourceVersion.
    pub fn update_pod_status(&self, pod: &Pod) -> Result<Pod, KubeError> {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let body = encode(pod)?;
        self.call_json(
            "PUT",
            &format!("{}/status", pod_path(ns, name)),
            &[],
            Some((CT_JSON, &body)),
        )
    }

    /// DELETE a pod with an optional grace period and UID precondition.
    pub fn delete_pod(
        &self,
        ns: &str,
        name: &str,
        grace_period_seconds: Option<i64>,
        uid: Option<&str>,
    ) -> Result<(), KubeError> {
        let mut opts = serde_json::json!({ "kind": "DeleteOptions", "apiVersion": "v1" });
        if let Some(g) = grace_period_seconds {
            opts["gracePeriodSeconds"] = g.into();
        }
        if let Some(uid) = uid {
            opts["preconditions"] = serde_json::json!({ "uid": uid });
        }
        let body = encode(&opts)?;
        self.request("DELETE", &pod_path(ns, name), &[], Some((CT_JSON, &body)))
            .map(|_| ())
    }

    // ---- nodes ----

    pub fn get_node(&self, name: &str) -> Result<Node, KubeError> {
        self.call_json("GET", &format!("/api/v1/nodes/{name}"), &[], None)
    }

    /// Node `name`'s InternalIP: `Ok(None)` when the Node has none that parses (a missing
    /// Node is `KubeError::NotFound`). One GET of one Node, not a list of the cluster.
    pub fn node_internal_ip(&self, name: &str) -> Result<Option<std::net::IpAddr>, KubeError> {
        let node: serde_json::Value =
            self.call_json("GET", &format!("/api/v1/nodes/{name}"), &[], None)?;
        Ok(node_internal_ip_json(&node))
    }

    pub fn create_node(&self, node: &Node) -> Result<Node, KubeError> {
        let body = encode(node)?;
        self.call_json("POST", "/api/v1/nodes", &[], Some((CT_JSON, &body)))
    }

    /// JSON merge patch of the node object (labels, taints): only the keys in `patch` change.
    pub fn patch_node(&self, name: &str, patch: &serde_json::Value) -> Result<Node, KubeError> {
        let body = encode(patch)?;
        self.call_json(
            "PATCH",
            &format!("/api/v1/nodes/{name}"),
            &[],
            Some((CT_MERGE_PATCH, &body)),
        )
    }

    /// Strategic-merge patch of nodes/<name>/status.
    pub fn patch_node_status(
        &self,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<Node, KubeError> {
        let body = encode(patch)?;
        self.call_json(
            "PATCH",
            &format!("/api/v1/nodes/{name}/status"),
            &[],
            Some((CT_STRATEGIC_MERGE_PATCH, &body)),
        )
    }

    // ---- leases ----

    pub fn get_lease(&self, ns: &str, name: &str) -> Result<Lease, KubeError> {
        self.call_json("GET", &format!("{}/{name}", lease_path(ns)), &[], None)
    }

    pub fn create_lease(&self, lease: &Lease) -> Result<Lease, KubeError> {
        let ns = lease
            .metadata
            .namespace
            .as_deref()
            .unwrap_or("kube-node-lease");
        let body = encode(lease)?;
        self.call_json("POST", &lease_path(ns), &[], Some((CT_JSON, &body)))
    }

    pub fn update_lease(&self, lease: &Lease) -> Result<Lease, KubeError> {
        let ns = lease
            .metadata
            .namespace
            .as_deref()
            .unwrap_or("kube-node-lease");
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        let body = encode(lease)?;
        self.call_json(
            "PUT",
            &format!("{}/{name}", lease_path(ns)),
            &[],
            Some((CT_JSON, &body)),
        )
    }

    // ---- events ----

    pub fn create_event(&self, event: &Event) -> Result<Event, KubeError> {
        let ns = event.metadata.namespace.as_deref().unwrap_or("default");
        let body = encode(event)?;
        self.call_json(
            "POST",
            &format!("/api/v1/namespaces/{ns}/events"),
            &[],
            Some((CT_JSON, &body)),
        )
    }

    /// Strategic-merge patch of an event (count / lastTimestamp aggregation).
    pub fn patch_event(
        &self,
        ns: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<Event, KubeError> {
        let body = encode(patch)?;
        self.call_json(
            "PATCH",
            &format!("/api/v1/namespaces/{ns}/events/{name}"),
            &[],
            Some((CT_STRATEGIC_MERGE_PATCH, &body)),
        )
    }

    // ---- authn / authz webhooks ----

    pub fn create_token_review(&self, review: &TokenReview) -> Result<TokenReview, KubeError> {
        let body = encode(review)?;
        self.call_json(
            "POST",
            "/apis/authentication.k8s.io/v1/tokenreviews",
            &[],
            Some((CT_JSON, &body)),
        )
    }

    pub fn create_subject_access_review(
        &self,
        review: &SubjectAccessReview,
    ) -> Result<SubjectAccessReview, KubeError> {
        let body = encode(review)?;
        self.call_json(
            "POST",
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            &[],
            Some((CT_JSON, &body)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_server_urls() {
        let t = ServerTarget::parse("https://127.0.0.1:6443").unwrap();
        assert_eq!(
            (t.https, t.host.as_str(), t.port, t.base_path.as_str()),
            (true, "127.0.0.1", 6443, "")
        );
        assert_eq!(t.host_header(), "127.0.0.1:6443");
        let t = ServerTarget::parse("https://[::1]/k8s/").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.base_path.as_str()),
            ("::1", 443, "/k8s")
        );
        assert_eq!(t.host_header(), "[::1]");
        let t = ServerTarget::parse("http://api").unwrap();
        assert_eq!((t.https, t.port), (false, 80));
        assert!(ServerTarget::parse("ftp://x").is_err());
        assert!(ServerTarget::parse("https://x:notaport").is_err());
        assert!(ServerTarget::parse("https://:1").is_err());
    }
}
