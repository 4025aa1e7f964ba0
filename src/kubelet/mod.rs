//! The kubelet HTTPS API on 10250: authentication, logs, exec and attach, port-forward, stats.
//! Serves from the event loop; the VM facts it needs come from the daemon.
//!
//! Wiring (what the daemon does):
//! * build `KubeletServer::new(config, TlsState::new(settings)?, stats_hub)` and `listen(&mut reactor, addr)`;
//! * give it the pod/VM facts with `set_view` whenever they change (this also feeds the stats hub);
//! * route `Event::Io` whose token `owns_token`, `Event::Timer` whose id `owns_timer`,
//!   `Event::ChildOutput` / `Event::ChildExit` whose child `owns_child` to the matching `on_*`;
//! * after each call, drain `take_auth_requests()`: run TokenReview / SubjectAccessReview (blocking
//!   API calls, on the worker pool) and feed the verdict back with `on_auth_answer`.

pub mod auth;
pub mod exec;
pub mod logs;
pub mod portforward;
pub mod routes;
pub mod server;
pub mod stats;
pub mod streams;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

pub use auth::{AuthAnswer, AuthRequest, ResourceAttributes, UserInfo};
pub use server::{AuthId, KubeletServer};

/// Settings of the kubelet API server.
#[derive(Clone, Debug)]
pub struct KubeletConfig {
    pub node_name: String,
    /// argv prefix that runs cocoon: normally `[VK_COCOON_BIN]`; the sandbox uses
    /// `[<vk-cocoon-sandbox>, "fake-cocoon"]`.
    pub cocoon: Vec<String>,
    /// Extra environment for cocoon children (the sandbox passes its fake's state directory).
    pub cocoon_env: Vec<(String, String)>,
    /// Authentication and authorisation (default on; VK_KUBELET_AUTH=off turns it off).
    pub auth_enabled: bool,
    /// Time to receive a complete request head (and the TLS handshake), and keep-alive idle time.
    pub head_timeout: Duration,
    /// Time for the daemon to answer an authorisation request.
    pub auth_timeout: Duration,
    /// Time for a SPDY client to create its streams.
    pub stream_setup_timeout: Duration,
    /// An exec or attach session with no traffic in either direction for this long is closed.
    pub stream_idle_timeout: Duration,
    /// Connections beyond this are accepted and closed at once (unless an unauthenticated
    /// one can make room).
    pub max_connections: usize,
    /// Connections from one address (IPv6: one /64) at most. The API server proxies every
    /// kubectl exec / logs through its own address, so this stays generous.
    pub max_connections_per_peer: usize,
    /// Connections that have not authenticated yet, in total: beyond it the oldest makes room.
    pub max_unauthenticated: usize,
    /// Connections that have not authenticated yet, from one address.
    pub max_unauthenticated_per_peer: usize,
    /// TokenReview / SubjectAccessReview calls in flight for one address; more get 429.
    pub max_reviews_per_peer: usize,
    /// TLS handshake and request head of a connection that has not authenticated (and its
    /// keep-alive idle time): short, so idle sockets give their slot back quickly.
    pub unauthenticated_timeout: Duration,
    /// Output queued for one connection above which its socket is no longer read (no new
    /// requests, stdin or pings are taken) and its child's output is no longer read (the child
    /// blocks); both resume below half of it.
    pub output_pause_at: usize,
    /// Exec stdin queued for the child above which the socket is no longer read; SPDY stdin
    /// window is granted as the child consumes what was queued.
    pub max_queued_stdin: usize,
    /// A connection whose queued output stays above `output_pause_at` with nothing delivered
    /// for this long is closed (a client that does not read).
    pub write_stall_timeout: Duration,
    /// Output queued for a slow client beyond this ends the request (the child is killed).
    pub max_buffered_output: usize,
}

impl KubeletConfig {
    pub fn new(node_name: &str, cocoon_bin: &str) -> Self {
        KubeletConfig {
            node_name: node_name.to_string(),
            cocoon: vec![cocoon_bin.to_string()],
            cocoon_env: Vec::new(),
            auth_enabled: true,
            head_timeout: Duration::from_secs(30),
            auth_timeout: Duration::from_secs(30),
            stream_setup_timeout: Duration::from_secs(30),
            stream_idle_timeout: Duration::from_secs(4 * 3600),
            max_connections: 1024,
            max_connections_per_peer: 512,
            max_unauthenticated: 256,
            max_unauthenticated_per_peer: 64,
            max_reviews_per_peer: 4,
            unauthenticated_timeout: Duration::from_secs(5),
            output_pause_at: 256 * 1024,
            max_queued_stdin: 256 * 1024,
            write_stall_timeout: Duration::from_secs(60),
            max_buffered_output: 8 * 1024 * 1024,
        }
    }
}

impl KubeletConfig {
    /// From the daemon's validated configuration (VK_COCOON_BIN, VK_KUBELET_AUTH).
    pub fn from_config(c: &crate::config::Config) -> Self {
        let mut k = KubeletConfig::new(&c.node_name, &c.cocoon_bin.to_string_lossy());
        k.auth_enabled = c.kubelet_auth == crate::config::KubeletAuth::On;
        k
    }
}

/// TLS settings from the daemon's configuration: VK_TLS_CERT / VK_TLS_KEY, and for client
/// certificates VK_CLIENT_CA_FILE or else the kubeconfig's cluster CA (`cluster_ca_pem`).
/// With authentication off no client certificate is verified.
pub fn tls_settings(
    c: &crate::config::Config,
    node_ip: Option<std::net::IpAddr>,
    cluster_ca_pem: Option<Vec<u8>>,
) -> std::io::Result<tls::TlsSettings> {
    let client_ca_pem = if c.kubelet_auth == crate::config::KubeletAuth::Off {
        None
    } else {
        match &c.client_ca_file {
            Some(p) => Some(std::fs::read(p)?),
            None => cluster_ca_pem,
        }
    };
    Ok(tls::TlsSettings {
        cert_path: c.tls_cert.clone(),
        key_path: c.tls_key.clone(),
        node_name: c.node_name.clone(),
        node_ip: node_ip.or(c.node_ip),
        client_ca_pem,
    })
}

/// The shared stats paths from the daemon's configuration.
pub fn stats_paths(c: &crate::config::Config) -> crate::metrics::stats::StatsPaths {
    crate::metrics::stats::StatsPaths {
        cgroup_parent: c.cocoon_cgroup_parent.clone(),
        cocoon_root: c.cocoon_root_dir.clone(),
        ..Default::default()
    }
}

/// The VM behind a pod, as the kubelet API needs it (the core's reading of a cocoon record
/// is `vm::VmInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodVm {
    pub id: String,
    pub name: String,
    /// Hypervisor PID (0 = not running).
    pub pid: u32,
    pub tap: Option<String>,
    /// cocoon `hypervisor` value.
    pub backend: String,
    /// A macOS guest's disk file (empty for cocoon's VMs).
    pub disk: String,
}

/// One pod as the kubelet API sees it.
#[derive(Clone, Debug)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// None when the pod has no live VM (hibernated, not yet created, failed).
    pub vm: Option<PodVm>,
    /// The pod object (serialised on demand by /pods and /runningpods/: a JSON tree per pod
    /// would cost several times the struct's memory on a dense node). Shared with the
    /// provider; its own status is the API's copy.
    pub pod: Arc<k8s_openapi::api::core::v1::Pod>,
    /// The status to serve instead of the pod's own (the provider's current view).
    pub status: Option<Arc<k8s_openapi::api::core::v1::PodStatus>>,
}

/// The facts the daemon gives the server.
#[derive(Clone, Debug, Default)]
pub struct KubeletView {
    /// Every pod bound to this node.
    pub pods: Vec<PodInfo>,
}
