//! A fake Kubernetes API server on loopback HTTPS: enough of the API for vk-cocoon and kubectl.
//! Test and sandbox infrastructure only; keeps objects in memory.
//!
//! Start one with [`ApiServer::start`]; the returned [`ApiServerHandle`] writes kubeconfigs,
//! gives tests direct access to the objects, and turns the fault knobs.

mod accounting;
mod discovery;
mod faults;
mod handlers;
mod http;
mod meta;
mod metrics;
mod patch;
mod proxy;
mod resources;
mod select;
mod server;
mod store;
mod table;
mod tls;
mod watch;

pub use accounting::RequestCount;
pub use faults::{Fault, FaultMatch};
pub use handlers::DeleteOptions;
pub use meta::ApiError;
pub use patch::PatchType;

use base64::Engine;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which bearer tokens the server accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenPolicy {
    /// Any non-empty token.
    Any,
    /// Only these tokens.
    Only(Vec<String>),
    /// No token is accepted (client certificates only).
    Reject,
}

#[derive(Debug, Clone)]
pub struct ApiServerOptions {
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    pub tokens: TokenPolicy,
    /// Accept client certificates (from the fake's CA or `extra_client_ca_pems`).
    pub client_certs: bool,
    /// More CAs whose client certificates are accepted (PEM).
    pub extra_client_ca_pems: Vec<String>,
    /// Serve requests that carry no credentials (as system:anonymous).
    pub anonymous: bool,
    /// Watch history kept, in changes; a watch from before it gets 410 Expired.
    pub history_limit: usize,
    /// Interval between BOOKMARK events on watches that allow them.
    pub bookmark_interval: Duration,
    /// Watch length when the client sends no timeoutSeconds.
    pub default_watch_timeout: Duration,
}

impl Default for ApiServerOptions {
    fn default() -> Self {
        ApiServerOptions {
            port: 0,
            tokens: TokenPolicy::Any,
            client_certs: true,
            extra_client_ca_pems: Vec::new(),
            anonymous: false,
            history_limit: 10_000,
            bookmark_interval: Duration::from_secs(2),
            default_watch_timeout: Duration::from_secs(1800),
        }
    }
}

/// How the user in a written kubeconfig authenticates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeconfigAuth {
    /// `token:` inline.
    Token(String),
    /// `tokenFile:` pointing at a file the caller maintains.
    TokenFile(PathBuf),
    /// A client certificate issued by the fake's CA for this user and groups (inline -data).
    ClientCert { user: String, groups: Vec<String> },
    /// No credentials (only useful with `anonymous`).
    None,
}

/// The identity a TokenReview returns for a token (also used to name token users).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReviewUser {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
}

/// One served request, for tests that assert on what a client sent.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    pub query: Vec<(String, String)>,
    /// API verb: get, list, watch, create, update, patch, delete, deletecollection.
    pub verb: String,
    /// "pods", "pods/status", "leases", ... ("" for discovery).
    pub resource: String,
    pub user: String,
    pub status: u16,
    pub content_type: Option<String>,
    pub user_agent: Option<String>,
    pub duration: Duration,
}

/// Decides a SubjectAccessReview from its `spec`: (allowed, reason).
pub type AccessReviewer = Arc<dyn Fn(&Value) -> (bool, String) + Send + Sync>;

#[derive(Debug, Clone)]
struct AuthSettings {
    tokens: TokenPolicy,
    client_certs: bool,
    anonymous: bool,
}

const REQUEST_LOG_LIMIT: usize = 20_000;

/// State shared by the handle and every connection thread.
pub(crate) struct Shared {
    store: store::Store,
    faults: faults::Faults,
    authority: tls::Authority,
    tls: Arc<rustls::ServerConfig>,
    auth: Mutex<AuthSettings>,
    bookmark_interval: Mutex<Duration>,
    default_watch_timeout: Duration,
    token_users: Mutex<HashMap<String, ReviewUser>>,
    access_reviewer: Mutex<Option<AccessReviewer>>,
    /// (verb, resource) pairs RBAC denies every user: requests get 403 and
    /// SelfSubjectAccessReviews answer not allowed. Resource as RBAC names it ("pods/status").
    denied: Mutex<Vec<(String, String)>>,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    open_watches: AtomicUsize,
    requests: Mutex<VecDeque<RequestRecord>>,
    /// Counters of every request by second, identity, verb and resource (never trimmed).
    tally: accounting::Tally,
    addr: Mutex<SocketAddr>,
    /// TLS to kubelets with the fake's kubelet client certificate, made on first use.
    kubelet_client: std::sync::OnceLock<Result<Arc<rustls::ClientConfig>, String>>,
    /// The last CPU counters read from each node, to turn them into usage rates.
    cpu_samples: Mutex<metrics::CpuSamples>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Decrements the open-watch count when a watch ends.
pub(crate) struct WatchGuard<'a>(&'a AtomicUsize);

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    fn auth(&self) -> AuthSettings {
        lock(&self.auth).clone()
    }

    fn token_user(&self, token: &str) -> Option<ReviewUser> {
        lock(&self.token_users).get(token).cloned()
    }

    fn review_access(&self, spec: &Value) -> (bool, String) {
        let reviewer = lock(&self.access_reviewer).clone();
        match reviewer {
            Some(f) => f(spec),
            None => (true, "the fake API server allows everything".to_string()),
        }
    }

    /// Whether the RBAC knob denies `verb` on `resource` ("pods", "pods/status").
    fn denies(&self, verb: &str, resource: &str) -> bool {
        lock(&self.denied)
            .iter()
            .any(|(v, r)| v == verb && r == resource)
    }

    /// The client configuration for kubelet connections (kube-apiserver's kubelet client cert).
    fn kubelet_client(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        self.kubelet_client
            .get_or_init(|| {
                let (cert, key) = self
                    .authority
                    .issue_client_cert(proxy::KUBELET_CLIENT_USER, &["system:masters"])
                    .map_err(|e| e.to_string())?;
                // kube-apiserver without --kubelet-certificate-authority does not verify the
                // kubelet's serving certificate either.
                crate::kube::tls::unverified_client_config(cert.as_bytes(), key.as_bytes())
                    .map_err(|e| e.to_string())
            })
            .clone()
    }

    fn bookmark_interval(&self) -> Duration {
        *lock(&self.bookmark_interval)
    }

    fn default_watch_timeout(&self) -> Duration {
        self.default_watch_timeout
    }

    fn addr_string(&self) -> String {
        lock(&self.addr).to_string()
    }

    fn watch_opened(&self) -> WatchGuard<'_> {
        self.open_watches.fetch_add(1, Ordering::SeqCst);
        WatchGuard(&self.open_watches)
    }

    fn register_conn(&self, tcp: &TcpStream) -> u64 {
        let id = self.next_conn.fetch_add(1, Ordering::SeqCst);
        if let Ok(clone) = tcp.try_clone() {
            lock(&self.conns).insert(id, clone);
        }
        id
    }

    fn unregister_conn(&self, id: u64) {
        lock(&self.conns).remove(&id);
    }

    fn close_all_conns(&self) {
        for (_, tcp) in lock(&self.conns).drain() {
            let _ = tcp.shutdown(std::net::Shutdown::Both);
        }
    }

    fn record(&self, r: RequestRecord) {
        self.tally
            .count(Instant::now(), &r.user, &r.verb, &r.resource);
        let mut log = lock(&self.requests);
        if log.len() >= REQUEST_LOG_LIMIT {
            log.pop_front();
        }
        log.push_back(r);
    }
}

/// Entry point: `ApiServer::start(ApiServerOptions::default())`.
pub struct ApiServer;

impl ApiServer {
    pub fn start(opts: ApiServerOptions) -> io::Result<ApiServerHandle> {
        let authority = tls::Authority::generate()?;
        let tls = authority.server_config(&opts.extra_client_ca_pems)?;
        let requested = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, opts.port));
        let shared = Arc::new(Shared {
            store: store::Store::new(opts.history_limit),
            faults: faults::Faults::default(),
            authority,
            tls,
            auth: Mutex::new(AuthSettings {
                tokens: opts.tokens.clone(),
                client_certs: opts.client_certs,
                anonymous: opts.anonymous,
            }),
            bookmark_interval: Mutex::new(opts.bookmark_interval),
            default_watch_timeout: opts.default_watch_timeout,
            token_users: Mutex::new(HashMap::new()),
            access_reviewer: Mutex::new(None),
            denied: Mutex::new(Vec::new()),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            open_watches: AtomicUsize::new(0),
            requests: Mutex::new(VecDeque::new()),
            tally: accounting::Tally::new(),
            addr: Mutex::new(requested),
            kubelet_client: std::sync::OnceLock::new(),
            cpu_samples: Mutex::new(metrics::CpuSamples::default()),
        });
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            ensure_namespace(&shared, ns);
        }
        let listener = server::Listener::start(shared.clone(), requested)?;
        let addr = listener.addr();
        *lock(&shared.addr) = addr;
        Ok(ApiServerHandle {
            inner: Arc::new(HandleInner {
                shared,
                addr,
                listener: Mutex::new(Some(listener)),
            }),
        })
    }
}

fn ensure_namespace(shared: &Shared, ns: &str) {
    if shared.store.get(resources::namespaces(), "", ns).is_none() {
        let obj = serde_json::json!({"metadata": {"name": ns}});
        let _ = handlers::create_object(shared, resources::namespaces(), "", obj);
    }
}

struct HandleInner {
    shared: Arc<Shared>,
    addr: SocketAddr,
    listener: Mutex<Option<server::Listener>>,
}

impl HandleInner {
    fn stop(&self) {
        if let Some(l) = lock(&self.listener).take() {
            l.stop();
        }
        self.shared.store.drop_watches();
        self.shared.close_all_conns();
    }
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Control of a running fake API server. Cloning shares the server; it stops when the last
/// clone is dropped.
#[derive(Clone)]
pub struct ApiServerHandle {
    inner: Arc<HandleInner>,
}

fn typed<T: DeserializeOwned>(v: &Value) -> Option<T> {
    serde_json::from_value(v.clone()).ok()
}

fn to_value<T: serde::Serialize>(obj: &T) -> Result<Value, ApiError> {
    serde_json::to_value(obj).map_err(|e| ApiError::bad_request(format!("cannot encode: {e}")))
}

fn resource(name: &str) -> Result<&'static resources::ResourceDef, ApiError> {
    resources::RESOURCES
        .iter()
        .find(|r| r.plural == name || r.key() == name)
        .ok_or_else(|| ApiError::new(404, "NotFound", format!("unknown resource {name:?}")))
}

fn from_api<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_json::from_value(v).map_err(|e| ApiError::internal(format!("cannot decode: {e}")))
}

fn pod_key(pod: &Pod) -> (String, String) {
    (
        pod.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string()),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

impl ApiServerHandle {
    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    // ----- lifecycle and credentials -----

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// "https://127.0.0.1:<port>".
    pub fn url(&self) -> String {
        format!("https://{}", self.inner.addr)
    }

    /// The CA that signed the serving certificate (and issued client certificates), PEM.
    pub fn ca_pem(&self) -> String {
        self.shared().authority.ca_pem()
    }

    /// A client certificate for user `cn` (no groups): (certificate PEM, key PEM).
    pub fn issue_client_cert(&self, cn: &str) -> io::Result<(String, String)> {
        self.shared().authority.issue_client_cert(cn, &[])
    }

    /// A client certificate for user `cn` in `groups` (O fields): (certificate PEM, key PEM).
    pub fn issue_client_cert_with_groups(
        &self,
        cn: &str,
        groups: &[&str],
    ) -> io::Result<(String, String)> {
        self.shared().authority.issue_client_cert(cn, groups)
    }

    /// A kubeconfig (YAML) for this server: certificate-authority-data, server URL, the auth.
    pub fn kubeconfig(&self, auth: &KubeconfigAuth) -> io::Result<String> {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
        let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let user = match auth {
            KubeconfigAuth::Token(t) => format!("    token: {}\n", q(t)),
            KubeconfigAuth::TokenFile(p) => {
                format!("    tokenFile: {}\n", q(&p.to_string_lossy()))
            }
            KubeconfigAuth::ClientCert { user, groups } => {
                let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
                let (cert, key) = self.shared().authority.issue_client_cert(user, &groups)?;
                format!(
                    "    client-certificate-data: {}\n    client-key-data: {}\n",
                    b64(&cert),
                    b64(&key)
                )
            }
            KubeconfigAuth::None => "    {}\n".to_string(),
        };
        let user = if matches!(auth, KubeconfigAuth::None) {
            "  user: {}\n".to_string()
        } else {
            format!("  user:\n{user}")
        };
        Ok(format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: {}\n  name: fake\n\
             contexts:\n- context:\n    cluster: fake\n    namespace: default\n    user: fake-user\n  name: fake\n\
             current-context: fake\npreferences: {{}}\nusers:\n- name: fake-user\n{user}",
            b64(&self.ca_pem()),
            q(&self.url()),
        ))
    }

    pub fn write_kubeconfig(&self, path: &Path, auth: &KubeconfigAuth) -> io::Result<()> {
        std::fs::write(path, self.kubeconfig(auth)?)
    }

    /// Goes away: stops listening and cuts every open connection and watch. Data is kept.
    pub fn stop(&self) {
        self.inner.stop();
    }

    /// Comes back on the same port with the same data and CA. No-op when running.
    pub fn restart(&self) -> io::Result<()> {
        let mut guard = lock(&self.inner.listener);
        if guard.is_none() {
            *guard = Some(server::Listener::start(
                self.inner.shared.clone(),
                self.inner.addr,
            )?);
        }
        Ok(())
    }

    /// Stops, then comes back with its data but a new watch cache: every watch resumed from
    /// a version the daemon saw before gets 410 Gone and must relist. `while_down` runs in
    /// between (writes through the direct object API that no watch will ever deliver).
    pub fn restart_losing_watch_cache(&self, while_down: impl FnOnce()) -> io::Result<()> {
        self.stop();
        while_down();
        self.shared().store.new_watch_cache();
        self.restart()
    }

    pub fn is_running(&self) -> bool {
        lock(&self.inner.listener).is_some()
    }

    // ----- authentication and review answers -----

    pub fn set_token_policy(&self, tokens: TokenPolicy) {
        lock(&self.shared().auth).tokens = tokens;
    }

    pub fn set_anonymous(&self, allowed: bool) {
        lock(&self.shared().auth).anonymous = allowed;
    }

    /// TokenReviews for `token` answer authenticated as `user` (and requests with it run as them).
    pub fn add_token_user(&self, token: &str, user: ReviewUser) {
        lock(&self.shared().token_users).insert(token.to_string(), user);
    }

    /// SubjectAccessReviews are answered by `f(spec)`; the default allows everything.
    pub fn set_access_reviewer(
        &self,
        f: impl Fn(&Value) -> (bool, String) + Send + Sync + 'static,
    ) {
        *lock(&self.shared().access_reviewer) = Some(Arc::new(f));
    }

    /// RBAC as if the ClusterRole lacked `verb` on `resource` ("pods/status", "leases"): every
    /// such request gets 403 Forbidden and a SelfSubjectAccessReview of it answers not allowed.
    pub fn deny(&self, verb: &str, resource: &str) {
        lock(&self.shared().denied).push((verb.to_string(), resource.to_string()));
    }

    // ----- fault knobs -----

    /// Answer the next `count` requests matching `on` with `fault`.
    pub fn fail_next(&self, count: u32, on: FaultMatch, fault: Fault) {
        self.shared().faults.fail_next(count, on, fault);
    }

    /// How many injected faults have been answered.
    pub fn faults_injected(&self) -> u64 {
        self.shared().faults.injected()
    }

    /// Clears armed faults, latencies and periodic watch drops.
    pub fn clear_faults(&self) {
        self.shared().faults.clear();
    }

    /// Adds this delay before every request is served.
    pub fn set_latency(&self, d: Duration) {
        self.shared().faults.set_latency(d);
    }

    /// Adds this delay before every pod write (create, update, patch, delete of pods and
    /// pods/status) is served: a slow API server under a pod backlog.
    pub fn set_pod_write_latency(&self, d: Duration) {
        self.shared().faults.set_pod_write_latency(d);
    }

    /// Cuts every open watch now (TCP closed mid-stream, no final chunk).
    pub fn drop_watches(&self) {
        self.shared().store.drop_watches();
    }

    /// Cuts every watch this long after it opened (None turns it off).
    pub fn drop_watches_every(&self, every: Option<Duration>) {
        self.shared().faults.set_drop_watches_every(every);
        // Wake running watches so they pick up the new deadline.
        self.shared().store.compact_noop_wake();
    }

    /// Forgets the change history: watches from any earlier resourceVersion get 410 Expired.
    pub fn compact_history(&self) {
        self.shared().store.compact();
    }

    pub fn set_history_limit(&self, changes: usize) {
        self.shared().store.set_history_limit(changes);
    }

    pub fn set_bookmark_interval(&self, d: Duration) {
        *lock(&self.shared().bookmark_interval) = d;
    }

    // ----- observation -----

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared().store.current_rv()
    }

    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared().requests).iter().cloned().collect()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared().requests).clear();
    }

    pub fn open_watches(&self) -> usize {
        self.shared().open_watches.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` watches are open; false on timeout.
    pub fn wait_for_watches(&self, n: usize, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while self.open_watches() < n {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    // ----- direct object access (same rules as the HTTP API) -----

    /// Any stored object by resource ("pods", "leases", ...), namespace ("" if cluster-scoped).
    pub fn get_object(&self, resource_name: &str, namespace: &str, name: &str) -> Option<Value> {
        let def = resource(resource_name).ok()?;
        self.shared()
            .store
            .get(def, namespace, name)
            .map(|v| (*v).clone())
    }

    /// All objects of a resource, sorted by namespace/name.
    pub fn list_objects(&self, resource_name: &str) -> Vec<Value> {
        self.scan_objects(resource_name, |v| Some(v.clone()))
    }

    /// What `f` picks out of each stored object of a resource, without copying the objects
    /// (a poll over a thousand pods stays cheap).
    pub fn scan_objects<T>(
        &self,
        resource_name: &str,
        mut f: impl FnMut(&Value) -> Option<T>,
    ) -> Vec<T> {
        match resource(resource_name) {
            Ok(def) => self
                .shared()
                .store
                .list(def, None)
                .0
                .iter()
                .filter_map(|v| f(v))
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    pub fn create_object(
        &self,
        resource_name: &str,
        namespace: &str,
        obj: Value,
    ) -> Result<Value, ApiError> {
        let def = resource(resource_name)?;
        handlers::create_object(self.shared(), def, namespace, obj)
    }

    /// Edits an object bypassing API rules (as a controller with full access might), e.g. to
    /// bind a pod or set fields no verb allows. Bumps resourceVersion and notifies watches.
    pub fn edit_object(
        &self,
        resource_name: &str,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Result<Value, ApiError> {
        let def = resource(resource_name)?;
        let out = self.shared().store.mutate(def, namespace, name, |cur| {
            let mut new = cur.clone();
            f(&mut new);
            Ok(store::Mutation::Replace(new))
        })?;
        Ok(out)
    }

    /// PATCH through the API rules (`status` true for the status subresource).
    pub fn patch_object(
        &self,
        resource_name: &str,
        namespace: &str,
        name: &str,
        status: bool,
        kind: PatchType,
        patch: &Value,
    ) -> Result<Value, ApiError> {
        let def = resource(resource_name)?;
        let sub = status.then_some("status");
        handlers::patch_object(self.shared(), def, namespace, name, sub, kind, patch)
    }

    pub fn pods(&self) -> Vec<Pod> {
        self.list_objects("pods").iter().filter_map(typed).collect()
    }

    pub fn get_pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        typed(&self.get_object("pods", namespace, name)?)
    }

    /// Creates a pod (namespace from metadata, else "default"), with the API's defaulting.
    pub fn create_pod(&self, pod: &Pod) -> Result<Pod, ApiError> {
        let (ns, _) = pod_key(pod);
        from_api(handlers::create_object(
            self.shared(),
            resources::pods(),
            &ns,
            to_value(pod)?,
        )?)
    }

    /// PUT on the pod (spec and metadata; status is kept, as on the real server).
    pub fn update_pod(&self, pod: &Pod) -> Result<Pod, ApiError> {
        let (ns, name) = pod_key(pod);
        from_api(handlers::update_object(
            self.shared(),
            resources::pods(),
            &ns,
            &name,
            None,
            to_value(pod)?,
        )?)
    }

    /// PUT on pods/status.
    pub fn update_pod_status(&self, pod: &Pod) -> Result<Pod, ApiError> {
        let (ns, name) = pod_key(pod);
        from_api(handlers::update_object(
            self.shared(),
            resources::pods(),
            &ns,
            &name,
            Some("status"),
            to_value(pod)?,
        )?)
    }

    /// DELETE with an optional grace period: a bound pod with grace > 0 is only marked.
    /// Returns the pod as left (marked) or its final state.
    pub fn delete_pod(
        &self,
        namespace: &str,
        name: &str,
        grace: Option<i64>,
    ) -> Result<Pod, ApiError> {
        let opts = DeleteOptions {
            grace_period_seconds: grace,
            ..Default::default()
        };
        self.delete_pod_with(namespace, name, &opts)
    }

    pub fn delete_pod_with(
        &self,
        namespace: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<Pod, ApiError> {
        from_api(handlers::delete_object(
            self.shared(),
            resources::pods(),
            namespace,
            name,
            opts,
        )?)
    }

    pub fn nodes(&self) -> Vec<Node> {
        self.list_objects("nodes")
            .iter()
            .filter_map(typed)
            .collect()
    }

    pub fn get_node(&self, name: &str) -> Option<Node> {
        typed(&self.get_object("nodes", "", name)?)
    }

    pub fn create_node(&self, node: &Node) -> Result<Node, ApiError> {
        from_api(handlers::create_object(
            self.shared(),
            resources::nodes(),
            "",
            to_value(node)?,
        )?)
    }

    pub fn delete_node(&self, name: &str) -> Result<Node, ApiError> {
        from_api(handlers::delete_object(
            self.shared(),
            resources::nodes(),
            "",
            name,
            &DeleteOptions::default(),
        )?)
    }

    /// The node Lease `name` in kube-node-lease.
    pub fn lease(&self, name: &str) -> Option<Lease> {
        typed(&self.get_object("leases", "kube-node-lease", name)?)
    }

    pub fn leases(&self) -> Vec<Lease> {
        self.list_objects("leases")
            .iter()
            .filter_map(typed)
            .collect()
    }

    /// core/v1 Events in every namespace.
    pub fn events(&self) -> Vec<Event> {
        self.list_objects("events")
            .iter()
            .filter_map(typed)
            .collect()
    }
}
