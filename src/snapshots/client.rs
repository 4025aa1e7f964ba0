//! Blocking OCI distribution client: ping, scheme choice, auth sessions,
//! manifests, verified blob reads, uploads and retries. Knows nothing about snapshot layouts.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest as _, Sha256};

use super::auth::{self, AuthSettings, Challenge, Credential};
use super::reference::{allows_plain_http, hex_lower, strip_port, Reference, RegistryBase};
use super::TransferError;

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

/// Attempts and sleeps between them (±10 % jitter is added).
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub delays: Vec<Duration>,
}

impl Default for RetryPolicy {
    /// Three attempts sleeping ≈1 s then ≈3 s.
    fn default() -> Self {
        RetryPolicy {
            delays: vec![Duration::from_secs(1), Duration::from_secs(3)],
        }
    }
}

impl RetryPolicy {
    fn sleep(&self, attempt: usize) {
        let Some(base) = self.delays.get(attempt) else {
            return;
        };
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // ±10 % jitter from the clock's sub-second noise (no RNG needed for this).
        let factor = 0.9 + (nanos % 1000) as f64 / 5000.0;
        std::thread::sleep(base.mul_f64(factor));
    }
}

/// Request body that can be re-sent on retry.
#[derive(Clone, Copy)]
pub enum Body<'a> {
    Empty,
    Bytes(&'a [u8]),
    /// The first `len` bytes of a file (read with positional reads; the handle is not moved).
    File {
        file: &'a File,
        len: u64,
    },
}

impl Body<'_> {
    fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::Bytes(b) => b.len() as u64,
            Body::File { len, .. } => *len,
        }
    }
}

struct FileBody<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for FileBody<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.end {
            return Ok(0);
        }
        let want = buf.len().min((self.end - self.pos) as usize);
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "spool file shorter than expected",
            ));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

/// What went wrong with one HTTP exchange, before it becomes a [`TransferError`].
pub enum HttpFailure {
    Status(u16, Box<ureq::Response>),
    Transport(String),
    Auth(TransferError),
}

impl HttpFailure {
    fn is_transient_transport(&self) -> bool {
        match self {
            HttpFailure::Transport(_) => true,
            HttpFailure::Status(code, _) => RETRY_STATUSES.contains(code),
            HttpFailure::Auth(_) => false,
        }
    }

    /// Converts to a typed error whose message starts with `what`.
    pub fn into_error(self, what: &str) -> TransferError {
        match self {
            HttpFailure::Transport(m) => TransferError::Transient(format!("{what}: {m}")),
            HttpFailure::Auth(e) => e,
            HttpFailure::Status(code, resp) => {
                let body = read_error_body(*resp);
                let msg = format!(
                    "{what}: HTTP {code}{}",
                    if body.is_empty() {
                        String::new()
                    } else {
                        format!(": {body}")
                    }
                );
                match code {
                    401 | 403 => TransferError::Unauthorized(msg),
                    404 => TransferError::NotFound(msg),
                    c if RETRY_STATUSES.contains(&c) => TransferError::Transient(msg),
                    _ => TransferError::Registry(msg),
                }
            }
        }
    }
}

fn read_error_body(resp: ureq::Response) -> String {
    let mut s = String::new();
    let _ = resp.into_reader().take(4096).read_to_string(&mut s);
    s.trim().chars().take(300).collect()
}

/// The challenge of a `GET /v2/` answer: None unless it is a 401, which must carry one.
fn ping_challenge(host: &str, resp: &ureq::Response) -> Result<Option<Challenge>, TransferError> {
    if resp.status() != 401 {
        return Ok(None);
    }
    let values = resp.all("www-authenticate");
    auth::pick_challenge(&values).map(Some).ok_or_else(|| {
        TransferError::Unauthorized(format!(
            "ping {host}: 401 without a usable WWW-Authenticate challenge"
        ))
    })
}

/// Per-repository, per-scope auth state (created on first use, cached for the client's life).
struct Session {
    host: String,
    repository: String,
    actions: &'static str,
    state: Mutex<SessionState>,
}

#[derive(Default)]
struct SessionState {
    ready: bool,
    credential: Option<Credential>,
    challenge: Option<Challenge>,
    bearer: Option<(String, Instant)>,
    refresh_token: Option<String>,
    scopes: Vec<String>,
}

/// Counting semaphore (open downloads, the node-wide transfer gates).
pub struct Gate {
    open: Mutex<usize>,
    cv: Condvar,
    max: usize,
    /// Most permits ever held at once (observability for tests and logs).
    peak: Mutex<usize>,
}

impl Gate {
    fn new(max: usize) -> Arc<Gate> {
        Arc::new(Gate {
            open: Mutex::new(0),
            cv: Condvar::new(),
            max: max.max(1),
            peak: Mutex::new(0),
        })
    }

    /// Blocks until a slot is free; the slot is released when the permit drops.
    pub fn acquire(self: &Arc<Self>) -> GatePermit {
        {
            let mut n = lock(&self.open);
            while *n >= self.max {
                n = self.cv.wait(n).unwrap_or_else(|p| p.into_inner());
            }
            *n += 1;
            let mut peak = lock(&self.peak);
            *peak = (*peak).max(*n);
        }
        GatePermit { gate: self.clone() }
    }

    /// Permits held right now.
    pub fn in_use(&self) -> usize {
        *lock(&self.open)
    }

    /// Most permits held at once since the client was created.
    pub fn peak(&self) -> usize {
        *lock(&self.peak)
    }
}

/// A held download slot; released on drop.
pub struct GatePermit {
    gate: Arc<Gate>,
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        let mut n = lock(&self.gate.open);
        *n -= 1;
        self.gate.cv.notify_one();
    }
}

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
    /// A client for `base` with explicit auth settings and retry policy.
    pub fn new(base: RegistryBase, auth: AuthSettings, retry: RetryPolicy) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(30))
            // No overall timeout, but a stalled socket must not pin a worker forever.
            .timeout_read(Duration::from_secs(300))
            .timeout_write(Duration::from_secs(300))
            .max_idle_connections(100)
            .max_idle_connections_per_host(32)
            // A redirect (a blob served from storage elsewhere) never carries the registry's
            // credentials, to whatever host or scheme it points.
            .redirect_auth_headers(ureq::RedirectAuthHeaders::Never)
            .user_agent(USER_AGENT)
            .build();
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

    /// `OCI_REGISTRY` plus the environment's credentials and the spec's retry policy.
    pub fn from_env(oci_registry: &str) -> Result<Self, TransferError> {
        let base =
            RegistryBase::parse(oci_registry).map_err(|e| TransferError::Invalid(e.to_string()))?;
        Ok(Self::new(
            base,
            AuthSettings::from_env(),
            RetryPolicy::default(),
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
            .set("User-Agent", "Go-http-client/1.1")
            .call();
        let (scheme, resp) = match https {
            Ok(r) | Err(ureq::Error::Status(_, r)) => ("https", r),
            Err(e) if allows_plain_http(host) => {
                match self.agent.get(&format!("http://{host}/v2/")).call() {
                    Ok(r) | Err(ureq::Error::Status(_, r)) => ("http", r),
                    Err(e2) => {
                        return Err(TransferError::Transient(format!(
                            "ping {host}: https: {e}; http: {e2}"
                        )))
                    }
                }
            }
            Err(e) => return Err(TransferError::Transient(format!("ping {host}: {e}"))),
        };
        lock(&self.schemes).insert(host.to_string(), scheme);
        // The probe was a ping: its answer serves the sessions that follow.
        if resp.status() < 300 || resp.status() == 401 {
            if let Ok(ch) = ping_challenge(host, &resp) {
                lock(&self.pings).insert(host.to_string(), (Instant::now(), ch));
            }
        }
        Ok(scheme)
    }

    fn session(&self, host: &str, repository: &str, actions: &'static str) -> Arc<Session> {
        let mut map = lock(&self.sessions);
        let key = (format!("{host}/{repository}"), actions);
        if map.len() >= SESSION_CACHE && !map.contains_key(&key) {
            // Every VM name is a repository of its own (hibernate evidence, delete pushes): a
            // host that churns pods would grow the map forever. Sessions nobody holds go; a
            // later use authenticates again.
            map.retain(|_, s| Arc::strong_count(s) > 1);
        }
        map.entry(key)
            .or_insert_with(|| {
                Arc::new(Session {
                    host: host.to_string(),
                    repository: repository.to_string(),
                    actions,
                    state: Mutex::new(SessionState::default()),
                })
            })
            .clone()
    }

    /// Ping and token exchange for a session, once.
    fn prepare(&self, sess: &Session, st: &mut SessionState) -> Result<(), TransferError> {
        if st.ready {
            return Ok(());
        }
        let challenge = self.host_challenge(&sess.host)?;
        st.credential = Some(auth::resolve(
            &self.auth,
            &self.agent,
            &sess.host,
            &sess.repository,
        ));
        st.scopes = vec![format!("repository:{}:{}", sess.repository, sess.actions)];
        if let Some(ch) = challenge {
            if ch.scheme == "bearer" {
                self.fetch_token(sess, st, &ch)?;
            }
            st.challenge = Some(ch);
        }
        st.ready = true;
        Ok(())
    }

    /// The host's auth challenge from `GET /v2/` (None: it answered without one), pinged at
    /// most once per [`PING_TTL`]. A registry that starts asking for a token meanwhile is
    /// followed by `exchange` on its 401.
    fn host_challenge(&self, host: &str) -> Result<Option<Challenge>, TransferError> {
        if let Some((at, ch)) = lock(&self.pings).get(host) {
            if at.elapsed() < PING_TTL {
                return Ok(ch.clone());
            }
        }
        let scheme = self.scheme_for(host)?;
        let url = format!("{scheme}://{host}/v2/");
        let resp = self.with_transport_retry(|| match self.agent.get(&url).call() {
            Ok(r) => Ok(r),
            Err(ureq::Error::Status(code, r)) if code != 401 => {
                Err(HttpFailure::Status(code, Box::new(r)))
            }
            Err(ureq::Error::Status(_, r)) => Ok(r),
            Err(e) => Err(HttpFailure::Transport(e.to_string())),
        });
        let resp = resp.map_err(|f| f.into_error(&format!("ping {host}")))?;
        let challenge = ping_challenge(host, &resp)?;
        lock(&self.pings).insert(host.to_string(), (Instant::now(), challenge.clone()));
        Ok(challenge)
    }

    fn fetch_token(
        &self,
        sess: &Session,
        st: &mut SessionState,
        ch: &Challenge,
    ) -> Result<(), TransferError> {
        let cred = st.credential.clone().unwrap_or(Credential::Anonymous);
        if let Credential::RegistryToken(t) = &cred {
            st.bearer = Some((t.clone(), Instant::now() + Duration::from_secs(365 * 86400)));
            return Ok(());
        }
        let realm = ch
            .params
            .get("realm")
            .filter(|r| !r.is_empty())
            .ok_or_else(|| {
                TransferError::Unauthorized(format!(
                    "{}: bearer challenge without realm",
                    sess.host
                ))
            })?;
        self.check_realm(&sess.host, realm)?;
        let service = ch.params.get("service").cloned().unwrap_or_default();
        let what = format!("token for {}/{} from {realm}", sess.host, sess.repository);
        let refresh = match &cred {
            Credential::IdentityToken { token, .. } => Some(token.clone()),
            _ => st.refresh_token.clone(),
        };
        let mut resp = None;
        if let Some(rt) = refresh {
            let scope = st.scopes.join(" ");
            let form = [
                ("grant_type", "refresh_token"),
                ("refresh_token", rt.as_str()),
                ("service", service.as_str()),
                ("scope", scope.as_str()),
                ("client_id", "go-containerregistry"),
            ];
            match self.agent.post(realm).send_form(&form) {
                Ok(r) => resp = Some(r),
                Err(ureq::Error::Status(404, _)) => {}
                Err(ureq::Error::Status(code, r)) => {
                    return Err(HttpFailure::Status(code, Box::new(r)).into_error(&what))
                }
                Err(e) => return Err(TransferError::Transient(format!("{what}: {e}"))),
            }
        }
        let resp = match resp {
            Some(r) => r,
            None => {
                let mut req = self.agent.get(realm);
                for s in &st.scopes {
                    req = req.query("scope", s);
                }
                if !service.is_empty() {
                    req = req.query("service", &service);
                }
                if let Some(h) = cred.basic_header() {
                    req = req.set("Authorization", &h);
                }
                match req.call() {
                    Ok(r) => r,
                    Err(ureq::Error::Status(code, r)) => {
                        return Err(HttpFailure::Status(code, Box::new(r)).into_error(&what))
                    }
                    Err(e) => return Err(TransferError::Transient(format!("{what}: {e}"))),
                }
            }
        };
        let v: serde_json::Value = resp
            .into_json()
            .map_err(|e| TransferError::Unauthorized(format!("{what}: bad JSON: {e}")))?;
        let token = v
            .get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| TransferError::Unauthorized(format!("{what}: response has no token")))?;
        if let Some(rt) = v.get("refresh_token").and_then(|t| t.as_str()) {
            st.refresh_token = Some(rt.to_string());
        }
        // The token spec's default lifetime is 60 s; refresh a little early.
        let lifetime = v
            .get("expires_in")
            .and_then(|e| e.as_u64())
            .unwrap_or(60)
            .max(10);
        st.bearer = Some((
            token.to_string(),
            Instant::now() + Duration::from_secs(lifetime - 5),
        ));
        Ok(())
    }

    /// The realm gets the registry's credentials, so it must be https, and not a private IP
    /// literal unless it is the registry host itself. Plain http only where the registry itself
    /// is plain http (loopback or a private address, see `allows_plain_http`) and only to the
    /// registry's own host: credentials never cross to another host in the clear.
    fn check_realm(&self, registry_host: &str, realm: &str) -> Result<(), TransferError> {
        let insecure = lock(&self.schemes).get(registry_host).copied() == Some("http");
        let rest = if let Some(r) = realm.strip_prefix("https://") {
            r
        } else if let Some(r) = realm.strip_prefix("http://").filter(|r| {
            let host = strip_port(r.split(['/', '?']).next().unwrap_or(""));
            insecure && host.eq_ignore_ascii_case(strip_port(registry_host))
        }) {
            r
        } else {
            return Err(TransferError::Unauthorized(format!(
                "token realm {realm:?} refused: credentials go to a realm over https only (plain \
                 http only on the host of a plain-http registry)"
            )));
        };
        let host_port = rest.split(['/', '?']).next().unwrap_or("");
        let host = strip_port(host_port);
        if let Ok(ip) = host.parse::<std::net::IpAddr>() {
            let private = match ip {
                std::net::IpAddr::V4(v4) => {
                    v4.is_private() || v4.is_loopback() || v4.is_link_local()
                }
                std::net::IpAddr::V6(v6) => {
                    v6.is_loopback() || (v6.segments()[0] & 0xffc0) == 0xfe80
                }
            };
            if private && host != strip_port(registry_host) {
                return Err(TransferError::Unauthorized(format!(
                    "token realm {realm:?} refused: private address"
                )));
            }
        }
        Ok(())
    }

    fn auth_header(
        &self,
        sess: &Session,
        st: &mut SessionState,
    ) -> Result<Option<String>, TransferError> {
        let Some(ch) = st.challenge.clone() else {
            return Ok(None);
        };
        if ch.scheme == "basic" {
            return Ok(match st.credential.as_ref() {
                Some(Credential::RegistryToken(t)) => Some(format!("Bearer {t}")),
                Some(c) => c.basic_header(),
                None => None,
            });
        }
        let expired = st
            .bearer
            .as_ref()
            .is_none_or(|(_, exp)| Instant::now() >= *exp);
        if expired {
            self.fetch_token(sess, st, &ch)?;
        }
        Ok(st.bearer.as_ref().map(|(t, _)| format!("Bearer {t}")))
    }

    /// Whether a request to `url` may carry the registry's credentials (Basic or Bearer): only
    /// on the registry's own origin, the scheme it was reached on and its host and port. An
    /// upload Location on another host, or on `http://` when the registry speaks https, gets
    /// the request without them.
    fn credentials_allowed(&self, url: &str, host: &str) -> bool {
        match (self.scheme_for(host), origin(url)) {
            (Ok(scheme), Some(to)) => Some(to) == origin(&format!("{scheme}://{host}/")),
            _ => false,
        }
    }

    /// One request with session auth; a 401 carrying a bearer challenge refreshes the token
    /// (new scopes prepended) and re-sends once. A URL off the registry's origin (see
    /// [`RegistryClient::credentials_allowed`]) is requested without credentials.
    fn exchange(
        &self,
        sess: &Session,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Body<'_>,
    ) -> Result<ureq::Response, HttpFailure> {
        let mut st = lock(&sess.state);
        self.prepare(sess, &mut st).map_err(HttpFailure::Auth)?;
        let credentials = self.credentials_allowed(url, &sess.host);
        if !credentials {
            log::debug!("{method} {url}: off the registry's origin, sent without credentials");
        }
        let mut reauthed = false;
        loop {
            let authz = if credentials {
                self.auth_header(sess, &mut st).map_err(HttpFailure::Auth)?
            } else {
                None
            };
            let mut req = self.agent.request(method, url);
            for (k, v) in headers {
                req = req.set(k, v);
            }
            if let Some(a) = &authz {
                req = req.set("Authorization", a);
            }
            // The lock is released while bytes move so parallel requests share the session.
            drop(st);
            let result = match body {
                Body::Empty if method == "POST" || method == "PUT" || method == "PATCH" => {
                    req.set("Content-Length", "0").send_bytes(&[])
                }
                Body::Empty => req.call(),
                Body::Bytes(b) => req
                    .set("Content-Length", &b.len().to_string())
                    .send_bytes(b),
                Body::File { file, len } => {
                    req.set("Content-Length", &len.to_string()).send(FileBody {
                        file,
                        pos: 0,
                        end: len,
                    })
                }
            };
            st = lock(&sess.state);
            match result {
                Ok(r) => return Ok(r),
                // Without credentials a 401 is the answer: a fresh token could not be sent.
                Err(ureq::Error::Status(401, r)) if !credentials => {
                    return Err(HttpFailure::Status(401, Box::new(r)))
                }
                // A bearer challenge on a request (also when the ping asked for none) gets a
                // token with the scopes it names, once.
                Err(ureq::Error::Status(401, r)) if !reauthed => {
                    let values = r.all("www-authenticate");
                    let ch = auth::pick_challenge(&values).filter(|c| c.scheme == "bearer");
                    let Some(ch) = ch else {
                        return Err(HttpFailure::Status(401, Box::new(r)));
                    };
                    if let Some(scope) = ch.params.get("scope") {
                        for s in scope.split(' ').rev() {
                            if !s.is_empty() && !st.scopes.iter().any(|x| x == s) {
                                st.scopes.insert(0, s.to_string());
                            }
                        }
                    }
                    drop(r);
                    self.fetch_token(sess, &mut st, &ch)
                        .map_err(HttpFailure::Auth)?;
                    st.challenge = Some(ch);
                    reauthed = true;
                }
                Err(ureq::Error::Status(401, r)) if reauthed => {
                    let what = format!(
                        "{} {}: registry answered 401 after a fresh token",
                        method, url
                    );
                    drop(r);
                    return Err(HttpFailure::Auth(TransferError::Unauthorized(what)));
                }
                Err(ureq::Error::Status(code, r)) => {
                    return Err(HttpFailure::Status(code, Box::new(r)))
                }
                Err(e) => return Err(HttpFailure::Transport(e.to_string())),
            }
        }
    }

    fn with_transport_retry<T>(
        &self,
        mut op: impl FnMut() -> Result<T, HttpFailure>,
    ) -> Result<T, HttpFailure> {
        let mut attempt = 0;
        loop {
            match op() {
                Ok(v) => return Ok(v),
                Err(f) if f.is_transient_transport() && attempt < self.retry.delays.len() => {
                    if let HttpFailure::Transport(m) = &f {
                        log::info!("registry request failed ({m}), retrying");
                    }
                    self.retry.sleep(attempt);
                    attempt += 1;
                }
                Err(f) => return Err(f),
            }
        }
    }

    fn url(&self, host: &str, path: &str) -> Result<String, TransferError> {
        Ok(format!("{}://{host}{path}", self.scheme_for(host)?))
    }

    /// Pings the registry host (`GET /v2/`) through a pull session of `repository`.
    pub fn ping(&self, repository: &str) -> Result<(), TransferError> {
        let sess = self.session(&self.base.host, repository, "pull");
        let mut st = lock(&sess.state);
        self.prepare(&sess, &mut st)
    }

    /// GET a manifest by tag or digest: body (≤ 100 MiB, digest-checked when fetched by
    /// digest) and Content-Type. 404 → [`TransferError::NotFound`].
    pub fn get_manifest(&self, r: &Reference) -> Result<(Vec<u8>, String), TransferError> {
        let sess = self.session(&r.host, &r.repository, "pull");
        let url = self.url(
            &r.host,
            &format!("/v2/{}/manifests/{}", r.repository, r.target.as_str()),
        )?;
        let what = format!("get manifest {r}");
        let resp = self
            .with_transport_retry(|| {
                self.exchange(
                    &sess,
                    "GET",
                    &url,
                    &[("Accept", MANIFEST_ACCEPT)],
                    Body::Empty,
                )
            })
            .map_err(|f| match f.into_error(&what) {
                TransferError::NotFound(_) => {
                    TransferError::NotFound(format!("manifest not found: {r}"))
                }
                e => e,
            })?;
        let ctype = resp.header("content-type").unwrap_or("").to_string();
        let mut body = Vec::new();
        resp.into_reader()
            .take(MANIFEST_LIMIT + 1)
            .read_to_end(&mut body)
            .map_err(|e| TransferError::Transient(format!("{what}: reading body: {e}")))?;
        if body.len() as u64 > MANIFEST_LIMIT {
            return Err(TransferError::Format(format!(
                "{what}: manifest larger than {MANIFEST_LIMIT} bytes"
            )));
        }
        if let super::reference::Target::Digest(d) = &r.target {
            let got = sha256_digest(&body);
            if &got != d {
                return Err(TransferError::Integrity(format!(
                    "{what}: body digest {got} does not match"
                )));
            }
        }
        Ok((body, ctype))
    }

    /// HEAD a blob: present (200) or absent (404).
    pub fn has_blob(&self, repository: &str, digest: &str) -> Result<bool, TransferError> {
        let sess = self.session(&self.base.host, repository, "pull");
        self.has_blob_in(&sess, repository, digest)
    }

    fn has_blob_in(
        &self,
        sess: &Session,
        repository: &str,
        digest: &str,
    ) -> Result<bool, TransferError> {
        let url = self.url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))?;
        match self.with_transport_retry(|| self.exchange(sess, "HEAD", &url, &[], Body::Empty)) {
            Ok(_) => Ok(true),
            Err(HttpFailure::Status(404, _)) => Ok(false),
            Err(f) => Err(f.into_error(&format!("head blob {}/{repository}@{digest}", sess.host))),
        }
    }

    /// Opens a blob for reading; the reader hashes and counts while read and fails at EOF on
    /// a digest or length mismatch. Holds one of the [`MAX_DOWNLOADS`] slots until dropped.
    pub fn get_blob(
        &self,
        repository: &str,
        digest: &str,
        expected_size: u64,
    ) -> Result<BlobReader, TransferError> {
        let permit = self.acquire_download();
        let sess = self.session(&self.base.host, repository, "pull");
        let url = self.url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))?;
        let what = format!("get blob {}/{repository}@{digest}", sess.host);
        let resp = self
            .with_transport_retry(|| self.exchange(&sess, "GET", &url, &[], Body::Empty))
            .map_err(|f| f.into_error(&what))?;
        if let Some(len) = resp
            .header("content-length")
            .and_then(|l| l.parse::<u64>().ok())
        {
            if len != expected_size {
                return Err(TransferError::Integrity(format!(
                    "{what}: registry sends {len} bytes, descriptor says {expected_size}"
                )));
            }
        }
        Ok(BlobReader {
            inner: resp.into_reader(),
            hasher: Sha256::new(),
            read: 0,
            expected_size,
            digest: digest.to_string(),
            what,
            done: false,
            hash: true,
            _permit: Some(permit),
        })
    }

    /// Reads bytes `offset .. offset + len` of a blob of `blob_size` bytes into `buf` with one
    /// `Range` GET (same session, auth and download gate as [`RegistryClient::get_blob`]).
    /// The whole exchange, body included, is retried under the transport retry policy, so a
    /// connection cut mid-piece costs one piece. [`RangeAnswer::NotPartial`] when the registry
    /// ignores the range (200 with the whole blob): nothing is read, the caller falls back to
    /// a single stream. The bytes are counted, not hashed; the caller hashes the whole blob.
    pub fn get_blob_range(
        &self,
        repository: &str,
        digest: &str,
        blob_size: u64,
        offset: u64,
        len: u64,
        buf: &mut Vec<u8>,
    ) -> Result<RangeAnswer, TransferError> {
        let end = offset
            .checked_add(len)
            .filter(|e| len > 0 && *e <= blob_size)
            .ok_or_else(|| {
                TransferError::Invalid(format!(
                    "range {offset}+{len} outside blob {digest} of {blob_size} bytes"
                ))
            })?;
        let permit = self.acquire_download();
        let sess = self.session(&self.base.host, repository, "pull");
        let url = self.url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))?;
        let what = format!(
            "get blob {}/{repository}@{digest} bytes {offset}-{}",
            sess.host,
            end - 1
        );
        let range = format!("bytes={offset}-{}", end - 1);
        let answer = self
            .with_transport_retry(|| {
                let resp = self.exchange(&sess, "GET", &url, &[("Range", &range)], Body::Empty)?;
                let answer = classify_range(
                    resp.status(),
                    resp.header("content-range"),
                    resp.header("content-length"),
                    offset,
                    len,
                    blob_size,
                    &what,
                )
                .map_err(HttpFailure::Auth)?;
                if answer == RangeAnswer::NotPartial {
                    return Ok(answer);
                }
                let mut body = BlobReader {
                    inner: resp.into_reader(),
                    hasher: Sha256::new(),
                    read: 0,
                    expected_size: len,
                    digest: digest.to_string(),
                    what: what.clone(),
                    done: false,
                    hash: false,
                    _permit: None,
                };
                buf.clear();
                buf.reserve(len as usize);
                match body.read_to_end(buf) {
                    Ok(_) => Ok(answer),
                    Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                        Err(HttpFailure::Auth(TransferError::Integrity(e.to_string())))
                    }
                    Err(e) => Err(HttpFailure::Transport(e.to_string())),
                }
            })
            .map_err(|f| f.into_error(&what))?;
        drop(permit);
        if answer == RangeAnswer::Partial {
            self.ranged.fetch_add(1, Ordering::Relaxed);
        }
        Ok(answer)
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

    /// Uploads a blob unless present: HEAD, POST, PATCH (whole body), PUT ?digest=, retried
    /// as a unit on transient failures. Body must be re-readable (bytes or a file).
    pub fn put_blob(
        &self,
        repository: &str,
        digest: &str,
        body: Body<'_>,
    ) -> Result<(), TransferError> {
        let key = (repository.to_string(), digest.to_string());
        if lock(&self.uploaded).contains(&key) {
            return Ok(());
        }
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("upload blob {}/{repository}@{digest}", sess.host);
        let mut attempt = 0;
        loop {
            match self.upload_once(&sess, repository, digest, body) {
                Ok(()) => {
                    lock(&self.uploaded).insert(key);
                    return Ok(());
                }
                Err(f) if upload_failure_is_temporary(&f) && attempt < self.retry.delays.len() => {
                    log::info!("{what}: attempt {} failed, retrying", attempt + 1);
                    if let HttpFailure::Status(_, r) = f {
                        drop(r);
                    }
                    self.retry.sleep(attempt);
                    attempt += 1;
                }
                Err(f) => return Err(f.into_error(&what)),
            }
        }
    }

    fn upload_once(
        &self,
        sess: &Session,
        repository: &str,
        digest: &str,
        body: Body<'_>,
    ) -> Result<(), HttpFailure> {
        let head_url = self
            .url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))
            .map_err(HttpFailure::Auth)?;
        match self.exchange(sess, "HEAD", &head_url, &[], Body::Empty) {
            Ok(_) => return Ok(()),
            Err(HttpFailure::Status(404, _)) => {}
            Err(f) => return Err(f),
        }
        let post_url = self
            .url(&sess.host, &format!("/v2/{repository}/blobs/uploads/"))
            .map_err(HttpFailure::Auth)?;
        let resp = self.exchange(
            sess,
            "POST",
            &post_url,
            &[("Content-Type", "application/json")],
            Body::Empty,
        )?;
        if resp.status() == 201 {
            return Ok(());
        }
        let loc = self.resolve_location(&post_url, resp.header("location"))?;
        let len = body.len().to_string();
        let resp = self.exchange(
            sess,
            "PATCH",
            &loc,
            &[
                ("Content-Type", "application/octet-stream"),
                ("Content-Length", &len),
            ],
            body,
        )?;
        let loc = self.resolve_location(&loc, resp.header("location"))?;
        let sep = if loc.contains('?') { '&' } else { '?' };
        let put_url = format!("{loc}{sep}digest={}", digest.replace(':', "%3A"));
        let resp = self.exchange(
            sess,
            "PUT",
            &put_url,
            &[("Content-Type", "application/octet-stream")],
            Body::Empty,
        )?;
        if resp.status() != 201 {
            return Err(HttpFailure::Status(resp.status(), Box::new(resp)));
        }
        Ok(())
    }

    /// Opens an upload session (POST) for a streamed blob; returns its Location.
    pub fn begin_upload(&self, repository: &str) -> Result<String, TransferError> {
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("begin upload to {}/{repository}", sess.host);
        let post_url = self.url(&sess.host, &format!("/v2/{repository}/blobs/uploads/"))?;
        let resp = self
            .exchange(
                &sess,
                "POST",
                &post_url,
                &[("Content-Type", "application/json")],
                Body::Empty,
            )
            .map_err(|f| f.into_error(&what))?;
        if resp.status() != 202 {
            return Err(TransferError::Registry(format!(
                "{what}: HTTP {} instead of 202",
                resp.status()
            )));
        }
        self.resolve_location(&post_url, resp.header("location"))
            .map_err(|f| f.into_error(&what))
    }

    /// One PATCH carrying `len` bytes read from `body` (single use: sent once, no re-auth, no
    /// retry; callers fall back to [`RegistryClient::put_blob`]). Returns the next Location.
    pub fn patch_upload(
        &self,
        repository: &str,
        location: String,
        len: u64,
        body: &mut dyn Read,
    ) -> Result<String, TransferError> {
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("stream upload to {}/{repository}", sess.host);
        let authz = if self.credentials_allowed(&location, &sess.host) {
            let mut st = lock(&sess.state);
            self.prepare(&sess, &mut st)?;
            self.auth_header(&sess, &mut st)?
        } else {
            None
        };
        let mut req = self
            .agent
            .request("PATCH", &location)
            .set("Content-Type", "application/octet-stream")
            .set("Content-Length", &len.to_string());
        if let Some(a) = &authz {
            req = req.set("Authorization", a);
        }
        let resp = match req.send(body) {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                return Err(HttpFailure::Status(code, Box::new(r)).into_error(&what))
            }
            Err(e) => return Err(TransferError::Transient(format!("{what}: {e}"))),
        };
        self.resolve_location(&location, resp.header("location"))
            .map_err(|f| f.into_error(&what))
    }

    /// Completes a streamed upload: PUT `<location>?digest=`; must answer 201.
    pub fn finish_upload(
        &self,
        repository: &str,
        location: String,
        digest: &str,
    ) -> Result<(), TransferError> {
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("finish upload {}/{repository}@{digest}", sess.host);
        let sep = if location.contains('?') { '&' } else { '?' };
        let put_url = format!("{location}{sep}digest={}", digest.replace(':', "%3A"));
        let resp = self
            .exchange(
                &sess,
                "PUT",
                &put_url,
                &[("Content-Type", "application/octet-stream")],
                Body::Empty,
            )
            .map_err(|f| f.into_error(&what))?;
        if resp.status() != 201 {
            return Err(TransferError::Registry(format!(
                "{what}: HTTP {} instead of 201",
                resp.status()
            )));
        }
        lock(&self.uploaded).insert((repository.to_string(), digest.to_string()));
        Ok(())
    }

    fn resolve_location(
        &self,
        request_url: &str,
        loc: Option<&str>,
    ) -> Result<String, HttpFailure> {
        let loc = loc.filter(|l| !l.is_empty()).ok_or_else(|| {
            HttpFailure::Auth(TransferError::Registry(format!(
                "{request_url}: upload response lacks Location"
            )))
        })?;
        if loc.starts_with("http://") || loc.starts_with("https://") {
            let origin = |u: &str| u.splitn(4, '/').take(3).collect::<Vec<_>>().join("/");
            if origin(loc) != origin(request_url) {
                let host = loc.split('/').nth(2).unwrap_or("");
                let h = strip_port(host);
                let private = h.parse::<std::net::IpAddr>().map(|ip| match ip {
                    std::net::IpAddr::V4(v4) => {
                        v4.is_private() || v4.is_loopback() || v4.is_link_local()
                    }
                    std::net::IpAddr::V6(v6) => v6.is_loopback(),
                });
                if private.unwrap_or(false) {
                    return Err(HttpFailure::Auth(TransferError::Registry(format!("upload Location {loc} points at a private address on another host; refused"))));
                }
            }
            return Ok(loc.to_string());
        }
        let origin: String = request_url
            .splitn(4, '/')
            .take(3)
            .collect::<Vec<_>>()
            .join("/");
        if loc.starts_with('/') {
            Ok(format!("{origin}{loc}"))
        } else {
            let dir = request_url
                .rsplit_once('/')
                .map(|(d, _)| d)
                .unwrap_or(&origin);
            Ok(format!("{dir}/{loc}"))
        }
    }

    /// PUT a manifest under a tag (or digest), retried as a unit on temporary failures.
    pub fn put_manifest(
        &self,
        r: &Reference,
        body: &[u8],
        media_type: &str,
    ) -> Result<(), TransferError> {
        let sess = self.session(&r.host, &r.repository, "push,pull");
        let url = self.url(
            &r.host,
            &format!("/v2/{}/manifests/{}", r.repository, r.target.as_str()),
        )?;
        let what = format!("put manifest {r}");
        let mut attempt = 0;
        loop {
            match self.exchange(
                &sess,
                "PUT",
                &url,
                &[("Content-Type", media_type)],
                Body::Bytes(body),
            ) {
                Ok(_) => return Ok(()),
                Err(f) if upload_failure_is_temporary(&f) && attempt < self.retry.delays.len() => {
                    self.retry.sleep(attempt);
                    attempt += 1;
                }
                Err(f) => return Err(f.into_error(&what)),
            }
        }
    }

    /// DELETE a manifest by tag or digest with a fresh `push,pull,delete` session; 404 is
    /// success (ensure-absent). Registries that refuse tag deletes (distribution 2.x answers
    /// 400 DIGEST_INVALID, others 405) get the DELETE by the digest the tag resolves to; that
    /// removes every tag of the same manifest, which a tag delete on a registry supporting it
    /// would not, but is the only way such a registry forgets the tag.
    pub fn delete_manifest(&self, r: &Reference) -> Result<(), TransferError> {
        let Some(refused) = self.try_delete_manifest(r)? else {
            return Ok(());
        };
        if !matches!(r.target, super::reference::Target::Tag(_)) {
            return Err(refused);
        }
        let body = match self.get_manifest(r) {
            Ok((body, _)) => body,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e),
        };
        let by_digest = Reference {
            target: super::reference::Target::Digest(sha256_digest(&body)),
            ..r.clone()
        };
        log::debug!("{}; deleting {by_digest} instead", refused.message());
        match self.try_delete_manifest(&by_digest)? {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// One manifest DELETE: `Ok(None)` when gone (or absent), `Ok(Some(e))` when the registry
    /// refused it (400, 405), `Err` for any other failure.
    fn try_delete_manifest(&self, r: &Reference) -> Result<Option<TransferError>, TransferError> {
        let sess = Session {
            host: r.host.clone(),
            repository: r.repository.clone(),
            actions: "push,pull,delete",
            state: Mutex::new(SessionState::default()),
        };
        let url = self.url(
            &r.host,
            &format!("/v2/{}/manifests/{}", r.repository, r.target.as_str()),
        )?;
        let what = format!("delete manifest {r}");
        match self.with_transport_retry(|| self.exchange(&sess, "DELETE", &url, &[], Body::Empty)) {
            Ok(_) | Err(HttpFailure::Status(404, _)) => Ok(None),
            Err(f @ HttpFailure::Status(400 | 405, _)) => Ok(Some(f.into_error(&what))),
            Err(f) => Err(f.into_error(&what)),
        }
    }
}

/// Temporary for a whole-sequence upload retry: network errors, or status in
/// {408, 429, 500, 502, 503, 504} without error codes, or only retryable codes.
/// The origin of an absolute http(s) URL: scheme and authority, lower-cased, the scheme's
/// default port dropped (`https://R:443/x` and `https://r/y` are one origin). None for anything
/// else (a relative or malformed URL has no origin to trust).
fn origin(url: &str) -> Option<(&'static str, String)> {
    let (scheme, rest, default_port) = if let Some(r) = url.strip_prefix("https://") {
        ("https", r, ":443")
    } else if let Some(r) = url.strip_prefix("http://") {
        ("http", r, ":80")
    } else {
        return None;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    // Userinfo (`user@host`) would let a URL name one host and reach another in a reader's eye.
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    let authority = authority.to_ascii_lowercase();
    let authority = authority
        .strip_suffix(default_port)
        .map(str::to_string)
        .unwrap_or(authority);
    Some((scheme, authority))
}

fn upload_failure_is_temporary(f: &HttpFailure) -> bool {
    match f {
        HttpFailure::Transport(_) => true,
        HttpFailure::Auth(_) => false,
        HttpFailure::Status(code, _) => [408, 429, 500, 502, 503, 504].contains(code),
    }
}

/// How a registry answered a ranged blob GET.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeAnswer {
    /// 206 with exactly the requested range; the bytes were read.
    Partial,
    /// 200: the registry ignores ranges and sends the whole blob (not read).
    NotPartial,
}

/// Checks a ranged GET's status and headers against the request: 206 needs
/// `Content-Range: bytes <offset>-<offset+len-1>/<blob_size or *>` and, when present, a
/// `Content-Length` of `len`; 200 is [`RangeAnswer::NotPartial`]; anything else an error.
fn classify_range(
    status: u16,
    content_range: Option<&str>,
    content_length: Option<&str>,
    offset: u64,
    len: u64,
    blob_size: u64,
    what: &str,
) -> Result<RangeAnswer, TransferError> {
    match status {
        206 => {}
        200 => return Ok(RangeAnswer::NotPartial),
        other => {
            return Err(TransferError::Registry(format!(
                "{what}: HTTP {other} to a range request"
            )))
        }
    }
    let bad = |m: String| TransferError::Registry(format!("{what}: {m}"));
    let cr = content_range.ok_or_else(|| bad("206 without Content-Range".into()))?;
    let parsed = cr
        .trim()
        .strip_prefix("bytes ")
        .and_then(|r| r.split_once('/'))
        .and_then(|(span, total)| {
            let (a, b) = span.trim().split_once('-')?;
            Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?, total.trim()))
        });
    let Some((first, last, total)) = parsed else {
        return Err(bad(format!("unparsable Content-Range {cr:?}")));
    };
    if first != offset || last.checked_sub(first).map(|d| d + 1) != Some(len) {
        return Err(bad(format!(
            "Content-Range {cr:?} is not the requested bytes {offset}-{}",
            offset + len - 1
        )));
    }
    if total != "*" && total.parse::<u64>().ok() != Some(blob_size) {
        return Err(TransferError::Integrity(format!(
            "{what}: registry says the blob is {total} bytes, descriptor says {blob_size}"
        )));
    }
    if let Some(cl) = content_length {
        if cl.trim().parse::<u64>().ok() != Some(len) {
            return Err(bad(format!(
                "206 with Content-Length {cl}, range is {len} bytes"
            )));
        }
    }
    Ok(RangeAnswer::Partial)
}

/// `sha256:<hex>` of bytes.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex_lower(&Sha256::digest(data)))
}

/// A blob body being read: hashed and counted; mismatch is an `InvalidData` error at EOF
/// (or as soon as more bytes than declared arrive).
pub struct BlobReader {
    inner: Box<dyn Read + Send + Sync + 'static>,
    hasher: Sha256,
    read: u64,
    expected_size: u64,
    digest: String,
    what: String,
    done: bool,
    /// False after [`BlobReader::split`]: the [`BlobCheck`] hashes instead.
    hash: bool,
    /// The download slot, released with the reader (`None` when the caller holds it).
    _permit: Option<GatePermit>,
}

/// The digest half of a split [`BlobReader`]: fed the bytes wherever they are consumed, so
/// hashing runs on another thread than the network reads.
pub struct BlobCheck {
    hasher: Sha256,
    digest: String,
    what: String,
}

impl BlobCheck {
    /// A check of bytes fed in blob order against `digest` (`what` prefixes its error).
    pub fn new(digest: &str, what: &str) -> BlobCheck {
        BlobCheck {
            hasher: Sha256::new(),
            digest: digest.to_string(),
            what: what.to_string(),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        self.hasher.update(data);
    }

    /// `InvalidData` when the bytes fed do not hash to the descriptor's digest.
    pub fn finish(self) -> io::Result<()> {
        let got = format!("sha256:{}", hex_lower(&self.hasher.finalize()));
        if got != self.digest {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: digest mismatch: content hashes to {got}", self.what),
            ));
        }
        Ok(())
    }
}

impl BlobReader {
    /// Splits off the digest check: the reader keeps counting (length errors stay its own)
    /// but no longer hashes; every byte it returns must be fed to the check, then `finish`.
    pub fn split(mut self) -> (BlobReader, BlobCheck) {
        self.hash = false;
        let check = BlobCheck::new(&self.digest, &self.what);
        (self, check)
    }

    fn fail(&self, msg: String) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, format!("{}: {msg}", self.what))
    }
}

impl Read for BlobReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        // Ask for one byte beyond the declared size so an oversized body is noticed.
        let room = (self.expected_size - self.read + 1).min(buf.len() as u64) as usize;
        let n = self
            .inner
            .read(&mut buf[..room])
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", self.what)))?;
        if n == 0 {
            if self.read != self.expected_size {
                return Err(self.fail(format!(
                    "truncated: got {} of {} bytes",
                    self.read, self.expected_size
                )));
            }
            let got = format!("sha256:{}", hex_lower(&self.hasher.clone().finalize()));
            if self.hash && got != self.digest {
                return Err(self.fail(format!("digest mismatch: content hashes to {got}")));
            }
            self.done = true;
            return Ok(0);
        }
        self.read += n as u64;
        if self.read > self.expected_size {
            return Err(self.fail(format!("oversized: more than {} bytes", self.expected_size)));
        }
        if self.hash {
            self.hasher.update(&buf[..n]);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(status: u16, cr: Option<&str>, cl: Option<&str>) -> Result<RangeAnswer, String> {
        classify_range(status, cr, cl, 8, 4, 100, "w").map_err(|e| e.to_string())
    }

    #[test]
    fn idle_sessions_are_dropped_beyond_the_cache_bound() {
        let client = RegistryClient::new(
            RegistryBase::parse("127.0.0.1:1/vk").expect("base"),
            AuthSettings::default(),
            RetryPolicy::default(),
        );
        let held = client.session("127.0.0.1:1", "vk/held", "pull");
        for i in 0..3 * SESSION_CACHE {
            drop(client.session("127.0.0.1:1", &format!("vk/vm-{i}"), "pull"));
        }
        let n = lock(&client.sessions).len();
        assert!(n <= SESSION_CACHE, "{n} sessions cached");
        let again = client.session("127.0.0.1:1", "vk/held", "pull");
        assert!(Arc::ptr_eq(&held, &again), "a session in use is kept");
    }

    #[test]
    fn origins_compare_scheme_host_and_port() {
        let o = |u: &str| origin(u);
        assert_eq!(
            o("https://Reg.Example:443/v2/x"),
            o("https://reg.example/v2/y")
        );
        assert_eq!(o("http://r:80/a"), o("http://r"));
        assert_ne!(
            o("http://reg.example/v2/"),
            o("https://reg.example/v2/"),
            "downgrade"
        );
        assert_ne!(o("https://reg.example:5000/"), o("https://reg.example/"));
        assert_ne!(o("https://localhost:5000/"), o("https://127.0.0.1:5000/"));
        assert_ne!(o("https://other.example/"), o("https://reg.example/"));
        assert_eq!(o("https://reg.example@evil.example/"), None);
        assert_eq!(o("/v2/x/blobs/uploads/1"), None);
        assert_eq!(o("ftp://reg.example/"), None);
    }

    #[test]
    fn range_answers_are_classified() {
        let ok = Some("bytes 8-11/100");
        assert_eq!(classify(206, ok, Some("4")), Ok(RangeAnswer::Partial));
        assert_eq!(classify(206, ok, None), Ok(RangeAnswer::Partial));
        assert_eq!(
            classify(206, Some("bytes 8-11/*"), None),
            Ok(RangeAnswer::Partial)
        );
        // A registry that ignores Range answers 200 with the whole blob: fall back.
        assert_eq!(
            classify(200, None, Some("100")),
            Ok(RangeAnswer::NotPartial)
        );
        for (status, cr, cl) in [
            (206, None, None),
            (206, Some("bytes 0-3/100"), None),
            (206, Some("bytes 8-12/100"), None),
            (206, Some("bytes 8-11/100"), Some("5")),
            (206, Some("items 8-11/100"), None),
            (206, Some("bytes 8-x/100"), None),
            (206, Some("bytes 11-8/100"), None),
            (204, None, None),
        ] {
            let e = classify(status, cr, cl).expect_err("refused");
            assert!(e.starts_with("w: "), "{e}");
        }
        // The registry's idea of the blob size disagrees with the descriptor.
        let e = classify_range(206, Some("bytes 8-11/99"), None, 8, 4, 100, "w");
        assert!(matches!(e, Err(TransferError::Integrity(_))), "{e:?}");
    }
}
