//! Blocking OCI distribution client: ping, scheme choice, auth sessions,
//! manifests, verified blob reads, uploads and retries. Knows nothing about snapshot layouts.

mod gate;
mod http;
mod reads;
mod session;
mod uploads;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::auth::{AuthSettings, Challenge};
use super::reference::{allows_plain_http, Reference, RegistryBase};
use super::trust::{certificate_problem, RegistryTrust};
use super::TransferError;
use crate::http_client::{header, Response};

pub use gate::{Gate, GatePermit};
pub use http::{Body, HttpFailure, RetryPolicy};
pub use reads::{sha256_digest, BlobCheck, BlobReader, RangeAnswer};
use session::{ping_challenge, Session};

/// Accept header for manifest GET / HEAD.
pub const MANIFEST_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v1+json,application/vnd.docker.distribution.manifest.v1+prettyjws,application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.list.v2+json,application/vnd.oci.image.index.v1+json";
/// Manifest bodies above this are refused.
pub const MANIFEST_LIMIT: u64 = 100 << 20;
/// Open blob downloads per client (the pull session's job count).
pub const MAX_DOWNLOADS: usize = 4;
/// Node-wide: registry pulls of v2 snapshots (or of image indexes) at once.
pub const MAX_V2_PULLS: usize = 2;
/// Node-wide: pushes with zstd or chunking enabled at once.
pub const MAX_PIPELINED_PUSHES: usize = 1;
const USER_AGENT: &str = "go-containerregistry/v0.21.7";
/// Statuses the transport retry treats as transient.
const RETRY_STATUSES: [u16; 8] = [408, 429, 499, 500, 502, 503, 504, 522];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking holder cannot leave these maps half-updated in a harmful way.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Auth sessions (one per repository and scope) kept for reuse.
const SESSION_CACHE: usize = 256;
/// How long a host's `GET /v2/` answer (its auth challenge) serves new sessions. Every VM is a
/// repository of its own, so without it each create's hibernate-evidence lookup paid a ping.
const PING_TTL: Duration = Duration::from_secs(60);

/// The registry client. Share one per daemon (`Arc`); all methods block.
pub struct RegistryClient {
    pub base: RegistryBase,
    agent: ureq::Agent,
    auth: AuthSettings,
    retry: RetryPolicy,
    schemes: Mutex<HashMap<String, &'static str>>,
    sessions: Mutex<HashMap<(String, &'static str), Arc<Session>>>,
    /// Host → (when pinged, its challenge; None when `/v2/` answered without one).
    pings: Mutex<HashMap<String, (Instant, Option<Challenge>)>>,
    downloads: Arc<Gate>,
    v2_pulls: Arc<Gate>,
    pipelined_pushes: Arc<Gate>,
    uploaded: Mutex<HashSet<(String, String)>>,
    ranged: AtomicU64,
}

impl RegistryClient {
    /// A client for `base` with explicit auth settings and retry policy, trusting the host's
    /// certificate authorities.
    pub fn new(base: RegistryBase, auth: AuthSettings, retry: RetryPolicy) -> Self {
        Self::with_trust(base, auth, retry, &RegistryTrust::host())
    }

    /// A client for `base` whose TLS trusts `trust` (the registry, its token realm, redirects).
    pub fn with_trust(
        base: RegistryBase,
        auth: AuthSettings,
        retry: RetryPolicy,
        trust: &RegistryTrust,
    ) -> Self {
        let agent_config = crate::http_client::config()
            .timeout_connect(Some(Duration::from_secs(30)))
            // No overall timeout, but a stalled socket must not pin a worker forever.
            .timeout_per_read(Some(Duration::from_secs(300)))
            .timeout_per_write(Some(Duration::from_secs(300)))
            .max_idle_connections(100)
            .max_idle_connections_per_host(32)
            // Four redirects followed, the fifth an error (what the client always allowed).
            .max_redirects(4)
            // A redirect (a blob served from storage elsewhere) never carries the registry's
            // credentials, to whatever host or scheme it points.
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::Never)
            .user_agent(USER_AGENT)
            .build();
        let agent = crate::http_client::agent(agent_config, Some(trust.tls.clone()));
        RegistryClient {
            base,
            agent,
            auth,
            retry,
            schemes: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            pings: Mutex::new(HashMap::new()),
            downloads: Gate::new(MAX_DOWNLOADS),
            v2_pulls: Gate::new(MAX_V2_PULLS),
            pipelined_pushes: Gate::new(MAX_PIPELINED_PUSHES),
            uploaded: Mutex::new(HashSet::new()),
            ranged: AtomicU64::new(0),
        }
    }

    /// `OCI_REGISTRY` plus the environment's credentials, the host's trust store with
    /// `ca_file` (`OCI_REGISTRY_CA_FILE`) added, and the spec's retry policy.
    pub fn from_env(oci_registry: &str, ca_file: Option<&Path>) -> Result<Self, TransferError> {
        let base =
            RegistryBase::parse(oci_registry).map_err(|e| TransferError::Invalid(e.to_string()))?;
        let trust =
            RegistryTrust::load(ca_file).map_err(|e| TransferError::Invalid(e.to_string()))?;
        log::info!("registry TLS trusts {}", trust.source);
        Ok(Self::with_trust(
            base,
            AuthSettings::from_env(),
            RetryPolicy::default(),
            &trust,
        ))
    }

    /// `<base>/<name>:<tag>` validated.
    pub fn reference(&self, name: &str, tag: &str) -> Result<Reference, TransferError> {
        self.base
            .reference(name, tag)
            .map_err(|e| TransferError::Invalid(e.to_string()))
    }

    /// The shared HTTP agent (token endpoints, tests).
    pub fn agent(&self) -> &ureq::Agent {
        &self.agent
    }

    fn scheme_for(&self, host: &str) -> Result<&'static str, TransferError> {
        if let Some(s) = lock(&self.schemes).get(host) {
            return Ok(s);
        }
        // HTTPS first; plain HTTP only for loopback / private hosts.
        let https = self
            .agent
            .get(&format!("https://{host}/v2/"))
            .header("User-Agent", "Go-http-client/1.1")
            .call();
        // Any answer, whatever its status, shows the scheme is spoken.
        let (scheme, resp) = match https {
            Ok(r) => ("https", r),
            Err(e) => {
                // The host speaks TLS with a certificate we do not trust: plain HTTP would only
                // hide that behind a 400, so say what is wrong and how to fix it.
                if let Some(why) = certificate_problem(&e) {
                    return Err(TransferError::Transient(format!(
                        "ping {host}: TLS certificate of https://{host}/ not accepted: {why} \
                         (a registry with a private CA needs OCI_REGISTRY_CA_FILE)"
                    )));
                }
                if !allows_plain_http(host) {
                    return Err(TransferError::Transient(format!("ping {host}: {e}")));
                }
                match self.agent.get(&format!("http://{host}/v2/")).call() {
                    Ok(r) => ("http", r),
                    Err(e2) => {
                        return Err(TransferError::Transient(format!(
                            "ping {host}: https: {e}; http: {e2}"
                        )))
                    }
                }
            }
        };
        lock(&self.schemes).insert(host.to_string(), scheme);
        // The probe was a ping: its answer serves the sessions that follow.
        let status = resp.status().as_u16();
        if status < 300 || status == 401 {
            if let Ok(ch) = ping_challenge(host, &resp) {
                lock(&self.pings).insert(host.to_string(), (Instant::now(), ch));
            }
        }
        Ok(scheme)
    }

    fn url(&self, host: &str, path: &str) -> Result<String, TransferError> {
        Ok(format!("{}://{host}{path}", self.scheme_for(host)?))
    }

    /// `<scheme>://<host>/v2/<repository>/manifests/<tag or digest>` of a reference.
    fn manifest_url(&self, r: &Reference) -> Result<String, TransferError> {
        self.url(
            &r.host,
            &format!("/v2/{}/manifests/{}", r.repository, r.target.as_str()),
        )
    }

    /// Pings the registry host (`GET /v2/`) through a pull session of `repository`.
    pub fn ping(&self, repository: &str) -> Result<(), TransferError> {
        let sess = self.session(&self.base.host, repository, "pull");
        let mut st = lock(&sess.state);
        self.prepare(&sess, &mut st)
    }

    /// `GET /v2/` with the configured credentials, a bearer challenge followed with a pull
    /// token for `repository` (what `check-config --online` reports): how the registry was
    /// reached and authenticated, or why not.
    pub fn check_access(&self, repository: &str) -> Result<String, TransferError> {
        let host = self.base.host.clone();
        let sess = self.session(&host, repository, "pull");
        let url = self.url(&host, "/v2/")?;
        let resp = self
            .exchange(&sess, "GET", &url, &[], http::Body::Empty)
            .map_err(|f| f.into_error(&format!("GET {url}")))?;
        let st = lock(&sess.state);
        let scheme = st.challenge.as_ref().map(|c| c.scheme.clone());
        let how = match (scheme.as_deref(), &st.credential) {
            (None, _) => "no authentication asked".to_string(),
            (Some(s), Some(c)) if *c != crate::snapshots::auth::Credential::Anonymous => {
                format!("{s} challenge answered with {c:?} credentials")
            }
            (Some(s), _) => format!("{s} challenge answered anonymously"),
        };
        Ok(format!(
            "GET {url} answered {} ({how})",
            resp.status().as_u16()
        ))
    }

    /// Ranged GETs answered 206 so far (observability for tests and logs).
    pub fn ranged_pieces(&self) -> u64 {
        self.ranged.load(Ordering::Relaxed)
    }

    fn acquire_download(&self) -> GatePermit {
        self.downloads.acquire()
    }

    /// The node-wide gate of v2 snapshot (and image-index) pulls: at most [`MAX_V2_PULLS`]
    /// at once. One client per daemon makes it node-wide; the pull takes it after the
    /// manifest is classified and before the import child starts.
    pub fn v2_pull_gate(&self) -> &Arc<Gate> {
        &self.v2_pulls
    }

    /// The node-wide gate of pushes with zstd or chunking on: [`MAX_PIPELINED_PUSHES`] at once.
    pub fn pipelined_push_gate(&self) -> &Arc<Gate> {
        &self.pipelined_pushes
    }
}
