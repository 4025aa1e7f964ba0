//! Auth sessions of the registry client: ping, scheme and challenge, token exchange, and
//! one authenticated request with its transport retry. Credentials reach the registry only.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::snapshots::auth::{self, Challenge, Credential};
use crate::snapshots::reference::strip_port;
use crate::snapshots::TransferError;

use super::http::FileBody;
use super::*;
use crate::http_client::{checked, header_all, request, CallError};
use ureq::SendBody;

/// The challenge of a `GET /v2/` answer: None unless it is a 401, which must carry one.
pub(super) fn ping_challenge(
    host: &str,
    resp: &Response,
) -> Result<Option<Challenge>, TransferError> {
    if resp.status().as_u16() != 401 {
        return Ok(None);
    }
    let values = header_all(resp, "www-authenticate");
    auth::pick_challenge(&values).map(Some).ok_or_else(|| {
        TransferError::Unauthorized(format!(
            "ping {host}: 401 without a usable WWW-Authenticate challenge"
        ))
    })
}

/// Per-repository, per-scope auth state (created on first use, cached for the client's life).
pub(super) struct Session {
    pub(super) host: String,
    pub(super) repository: String,
    pub(super) actions: &'static str,
    pub(super) state: Mutex<SessionState>,
}

#[derive(Default)]
pub(super) struct SessionState {
    pub(super) ready: bool,
    pub(super) credential: Option<Credential>,
    pub(super) challenge: Option<Challenge>,
    pub(super) bearer: Option<(String, Instant)>,
    pub(super) refresh_token: Option<String>,
    pub(super) scopes: Vec<String>,
}

impl RegistryClient {
    pub(super) fn session(
        &self,
        host: &str,
        repository: &str,
        actions: &'static str,
    ) -> Arc<Session> {
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
    pub(super) fn prepare(
        &self,
        sess: &Session,
        st: &mut SessionState,
    ) -> Result<(), TransferError> {
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
        let resp = self.with_transport_retry(|| match checked(self.agent.get(&url).call()) {
            Ok(r) => Ok(r),
            Err(CallError::Status(code, r)) if code != 401 => Err(HttpFailure::Status(code, r)),
            Err(CallError::Status(_, r)) => Ok(*r),
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
            match checked(self.agent.post(realm).send_form(form)) {
                Ok(r) => resp = Some(r),
                Err(CallError::Status(404, _)) => {}
                Err(CallError::Status(code, r)) => {
                    return Err(HttpFailure::Status(code, r).into_error(&what))
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
                    req = req.header("Authorization", &h);
                }
                match checked(req.call()) {
                    Ok(r) => r,
                    Err(CallError::Status(code, r)) => {
                        return Err(HttpFailure::Status(code, r).into_error(&what))
                    }
                    Err(e) => return Err(TransferError::Transient(format!("{what}: {e}"))),
                }
            }
        };
        let v: serde_json::Value = resp
            .into_body()
            .read_json()
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

    pub(super) fn auth_header(
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
    pub(super) fn credentials_allowed(&self, url: &str, host: &str) -> bool {
        match (self.scheme_for(host), origin(url)) {
            (Ok(scheme), Some(to)) => Some(to) == origin(&format!("{scheme}://{host}/")),
            _ => false,
        }
    }

    /// One request with session auth; a 401 carrying a bearer challenge refreshes the token
    /// (new scopes prepended) and re-sends once. A URL off the registry's origin (see
    /// [`RegistryClient::credentials_allowed`]) is requested without credentials.
    pub(super) fn exchange(
        &self,
        sess: &Session,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Body<'_>,
    ) -> Result<Response, HttpFailure> {
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
            let mut all_headers = headers.to_vec();
            if let Some(a) = &authz {
                all_headers.push(("Authorization", a));
            }
            // ureq sizes a byte body itself; an empty body of a method that carries one and a
            // file body (read as a stream) say their length here.
            let len = body.len().to_string();
            let sized_here = match body {
                Body::Empty => matches!(method, "POST" | "PUT" | "PATCH"),
                Body::Bytes(_) => false,
                Body::File { .. } => true,
            };
            if sized_here {
                all_headers.push(("Content-Length", &len));
            }
            let req = request(method, url, &all_headers);
            // The lock is released while bytes move so parallel requests share the session.
            drop(st);
            let result = match body {
                Body::Empty => req.body(()).map(|r| self.send(r)),
                Body::Bytes(b) => req.body(b).map(|r| self.send(r)),
                Body::File { file, len } => {
                    let mut reader = FileBody::new(file, len);
                    req.body(SendBody::from_reader(&mut reader))
                        .map(|r| self.send(r))
                }
            };
            st = lock(&sess.state);
            let result = match result {
                Ok(r) => checked(r),
                Err(e) => return Err(HttpFailure::Transport(format!("{method} {url}: {e}"))),
            };
            match result {
                Ok(r) => return Ok(r),
                // Without credentials a 401 is the answer: a fresh token could not be sent.
                Err(CallError::Status(401, r)) if !credentials => {
                    return Err(HttpFailure::Status(401, r))
                }
                // A bearer challenge on a request (also when the ping asked for none) gets a
                // token with the scopes it names, once.
                Err(CallError::Status(401, r)) if !reauthed => {
                    let values = header_all(&r, "www-authenticate");
                    let ch = auth::pick_challenge(&values).filter(|c| c.scheme == "bearer");
                    let Some(ch) = ch else {
                        return Err(HttpFailure::Status(401, r));
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
                Err(CallError::Status(401, r)) if reauthed => {
                    let what = format!(
                        "{} {}: registry answered 401 after a fresh token",
                        method, url
                    );
                    drop(r);
                    return Err(HttpFailure::Auth(TransferError::Unauthorized(what)));
                }
                Err(CallError::Status(code, r)) => return Err(HttpFailure::Status(code, r)),
                Err(CallError::Transport(e)) => return Err(HttpFailure::Transport(e.to_string())),
            }
        }
    }

    /// Runs a request on the agent. Only requests without a body follow redirects: a 307 / 308
    /// to a request with a body is answered to the caller as it came (the body is not sent
    /// twice), and so is any redirect of a POST, PUT, PATCH or DELETE.
    pub(super) fn send<B: ureq::AsSendBody>(
        &self,
        req: ureq::http::Request<B>,
    ) -> Result<Response, ureq::Error> {
        let follows = matches!(req.method().as_str(), "GET" | "HEAD" | "OPTIONS" | "TRACE");
        if follows {
            self.agent.run(req)
        } else {
            let req = self
                .agent
                .configure_request(req)
                .max_redirects(0)
                .max_redirects_will_error(false)
                .build();
            self.agent.run(req)
        }
    }

    pub(super) fn with_transport_retry<T>(
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
}

/// The origin of an absolute http(s) URL: scheme and authority, lower-cased, the scheme's
/// default port dropped (`https://R:443/x` and `https://r/y` are one origin). None for anything
/// else (a relative or malformed URL has no origin to trust).
pub(super) fn origin(url: &str) -> Option<(&'static str, String)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
