//! The kubelet HTTPS server inside the single mio loop: non-blocking accept, one rustls
//! ServerConnection per connection driven by readiness, request heads through `routes`, auth, and
//! logs / exec children run by the reactor with their streams wired to the connection.
//!
//! No thread per connection and no blocking call: slow clients only cost their own buffers, every
//! phase has a deadline, and TokenReview / SubjectAccessReview are left to the daemon.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Token};
use rustls::ServerConnection;
use serde_json::json;

use super::auth::{self, AuthAnswer, AuthCache, AuthRequest, Cached, UserInfo};
use super::exec::spdy::{Expected, SpdySession};
use super::exec::websocket::{handshake_response, WsSession};
use super::exec::{self, ExecOutcome, Session, SessionEvent, Upgrade};
use super::logs::{self, LogShaper};
use super::routes::{self, HeadError, Request, Route};
use super::stats::{build_summary, resource_metrics_text};
use super::tls::{cert_identity, TlsState};
use super::{KubeletConfig, KubeletView, PodInfo};
use crate::metrics::stats::{Sample, StatsHub, TrackedVm};
use crate::reactor::{
    ChildExit, ChildId, ChildSpec, IoReady, OutputMode, Reactor, StdinMode, Stream, TimerId,
};

/// Key of the server's single reactor timer.
pub const TIMER_KEY: u64 = 0x6b75_6265_6c65_7400;
/// Bytes read from one connection per readiness event before yielding to others.
const READ_BUDGET: usize = 256 * 1024;
/// Client bytes buffered while not expected (pipelined requests, bytes during auth).
const MAX_IDLE_INPUT: usize = 64 * 1024;
/// Stderr of a logs child kept for the error message.
const STDERR_KEEP: usize = 4096;
/// `kubectl attach` shows the VM console: the last lines of the log, then new ones.
pub const ATTACH_TAIL_LINES: u64 = 50;

/// Identifies one pending authorisation request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AuthId(pub u64);

enum Phase {
    /// Waiting for (the rest of) a request head.
    Head,
    /// Head parsed; the daemon is checking who may do what.
    WaitAuth { req: Request, id: AuthId },
    /// `/containerLogs`: streaming a `vm logs` child as a chunked body.
    Logs {
        child: Option<ChildId>,
        shaper: LogShaper,
        head_sent: bool,
        stderr: Vec<u8>,
    },
    /// Upgraded exec / attach session.
    Exec {
        session: Box<Session>,
        child: Option<ChildId>,
        argv: Vec<String>,
        stdin: bool,
        attach: bool,
        stdin_buf: Vec<Vec<u8>>,
        stdin_eof: bool,
        /// The command ended and `finish` ran, but output still waits for the peer's window.
        ended: bool,
    },
    /// Flushing the last bytes, then closing.
    Closing,
}

struct Conn {
    sock: TcpStream,
    tls: ServerConnection,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    phase: Phase,
    deadline: Option<Instant>,
    writable_interest: bool,
    /// Keep the connection for another request after the current response.
    keep_alive: bool,
    /// The peer's verified certificate user, computed once after the handshake.
    cert_user: Option<Option<UserInfo>>,
}

/// The kubelet API server. See the module documentation of `kubelet` for the wiring.
pub struct KubeletServer {
    cfg: KubeletConfig,
    tls: TlsState,
    stats: StatsHub,
    listener: Option<(TcpListener, Token)>,
    conns: HashMap<Token, Conn>,
    view: KubeletView,
    index: HashMap<(String, String), usize>,
    children: HashMap<ChildId, Token>,
    auth_pending: HashMap<AuthId, (Token, AuthRequest)>,
    auth_out: Vec<(AuthId, AuthRequest)>,
    next_auth: u64,
    cache: AuthCache,
    timer: Option<(TimerId, Instant)>,
    /// `/metrics/resource` rendered from the sample it was made of.
    resource_text: Option<(Arc<Sample>, Arc<String>)>,
}

impl KubeletServer {
    pub fn new(cfg: KubeletConfig, tls: TlsState, stats: StatsHub) -> Self {
        if !cfg.auth_enabled {
            log::warn!(
                "kubelet API authentication is OFF (VK_KUBELET_AUTH=off): anyone who can reach the kubelet port can read logs and exec into every VM"
            );
        }
        KubeletServer {
            cfg,
            tls,
            stats,
            listener: None,
            conns: HashMap::new(),
            view: KubeletView::default(),
            index: HashMap::new(),
            children: HashMap::new(),
            auth_pending: HashMap::new(),
            auth_out: Vec::new(),
            next_auth: 1,
            cache: AuthCache::default(),
            timer: None,
            resource_text: None,
        }
    }

    /// Binds and registers the listening socket; returns the bound address.
    pub fn listen<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        addr: SocketAddr,
    ) -> io::Result<SocketAddr> {
        let mut l = TcpListener::bind(addr)?;
        let token = r.token();
        r.registry().register(&mut l, token, Interest::READABLE)?;
        let local = l.local_addr()?;
        self.listener = Some((l, token));
        Ok(local)
    }

    /// Replaces the pod/VM facts and feeds the shared stats sample's VM list.
    pub fn set_view(&mut self, view: KubeletView) {
        self.index = view
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| ((p.namespace.clone(), p.name.clone()), i))
            .collect();
        let vms = view
            .pods
            .iter()
            .filter_map(|p| {
                p.vm.as_ref().map(|v| TrackedVm {
                    vm_id: v.id.clone(),
                    vm_name: v.name.clone(),
                    namespace: p.namespace.clone(),
                    pod: p.name.clone(),
                    pod_uid: p.uid.clone(),
                    pid: v.pid,
                    tap: v.tap.clone(),
                    backend: v.backend.clone(),
                })
            })
            .collect();
        self.stats.set_vms(vms);
        self.view = view;
    }

    pub fn owns_token(&self, t: Token) -> bool {
        self.conns.contains_key(&t) || self.listener.as_ref().is_some_and(|(_, lt)| *lt == t)
    }
    pub fn owns_timer(&self, id: TimerId) -> bool {
        self.timer.is_some_and(|(t, _)| t == id)
    }
    pub fn owns_child(&self, id: ChildId) -> bool {
        self.children.contains_key(&id)
    }
    /// Open client connections (for tests and the leak checks).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }
    /// Children started for requests and not yet reported as exited.
    pub fn child_count(&self) -> usize {
        self.children.len()
    }

    /// Authorisation work for the daemon: for each, resolve and call `on_auth_answer`.
    pub fn take_auth_requests(&mut self) -> Vec<(AuthId, AuthRequest)> {
        std::mem::take(&mut self.auth_out)
    }

    // ----- entry points -------------------------------------------------------------------

    pub fn on_io<M: Send + 'static>(&mut self, r: &mut Reactor<M>, ev: IoReady) {
        if self.listener.as_ref().is_some_and(|(_, t)| *t == ev.token) {
            self.accept(r);
        } else if self.conns.contains_key(&ev.token) {
            if ev.readable || ev.read_closed || ev.error {
                self.read_conn(r, ev.token);
            }
            if ev.writable {
                self.flush(r, ev.token);
            }
        }
        self.rearm(r);
    }

    pub fn on_timer<M: Send + 'static>(&mut self, r: &mut Reactor<M>, id: TimerId) {
        if !self.owns_timer(id) {
            return;
        }
        self.timer = None;
        let now = r.now();
        let due: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for t in due {
            self.expire(r, t);
        }
        self.rearm(r);
    }

    pub fn on_child_output<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        id: ChildId,
        stream: Stream,
        data: &[u8],
    ) {
        let Some(&token) = self.children.get(&id) else {
            return;
        };
        let idle = self.cfg.stream_idle_timeout;
        let limit = self.cfg.max_buffered_output;
        let now = r.now();
        let mut kill = false;
        if let Some(c) = self.conns.get_mut(&token) {
            match &mut c.phase {
                Phase::Logs {
                    shaper,
                    head_sent,
                    stderr,
                    ..
                } => match stream {
                    Stream::Stderr => {
                        stderr.extend_from_slice(data);
                        if stderr.len() > STDERR_KEEP {
                            let cut = stderr.len() - STDERR_KEEP;
                            stderr.drain(..cut);
                        }
                    }
                    Stream::Stdout => {
                        let body = shaper.shape(data, SystemTime::now());
                        if !*head_sent {
                            c.out.extend_from_slice(
                                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nTransfer-Encoding: chunked\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n",
                            );
                            *head_sent = true;
                        }
                        routes::chunk(&body, &mut c.out);
                        if shaper.exhausted() {
                            c.out.extend_from_slice(routes::LAST_CHUNK);
                            kill = true;
                            c.phase = Phase::Closing;
                        }
                    }
                },
                Phase::Exec { session, .. } => {
                    match stream {
                        Stream::Stdout => session.stdout(data, &mut c.out),
                        Stream::Stderr => session.stderr(data, &mut c.out),
                    }
                    c.deadline = Some(now + idle);
                }
                _ => {}
            }
            let held = match &c.phase {
                Phase::Exec { session, .. } => session.pending_output(),
                _ => 0,
            };
            if c.out.len() + held > limit {
                log::warn!(
                    "kubelet: client too slow to read its stream ({} bytes queued); closing",
                    c.out.len()
                );
                c.out.clear();
                c.phase = Phase::Closing;
                kill = true;
            }
        }
        if kill {
            self.children.remove(&id);
            r.kill(id);
        }
        self.flush(r, token);
        self.rearm(r);
    }

    pub fn on_child_exit<M: Send + 'static>(&mut self, r: &mut Reactor<M>, exit: &ChildExit) {
        let Some(token) = self.children.remove(&exit.id) else {
            return;
        };
        let outcome = match (exit.code(), exit.signal()) {
            (Some(c), _) => ExecOutcome::Exited(c),
            (None, Some(s)) => ExecOutcome::Failed(format!("command was terminated by signal {s}")),
            (None, None) => ExecOutcome::Failed("command status unknown".into()),
        };
        self.child_ended(r, token, outcome);
        self.rearm(r);
    }

    pub fn on_auth_answer<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        id: AuthId,
        answer: AuthAnswer,
    ) {
        let Some((token, req)) = self.auth_pending.remove(&id) else {
            return;
        };
        self.cache.record(&req, &answer, r.now());
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::WaitAuth {
            req: http,
            id: waiting,
        } = std::mem::replace(&mut c.phase, Phase::Head)
        else {
            return;
        };
        if waiting != id {
            return;
        }
        match answer {
            AuthAnswer::Decided { allowed: true, .. } => self.dispatch(r, token, http),
            AuthAnswer::Decided {
                allowed: false,
                user,
            } => {
                let msg = format!(
                    "Forbidden (user={}, verb={}, resource=nodes, subresource({}))",
                    user.name, req.attributes.verb, req.attributes.subresource
                );
                self.respond(r, token, routes::text(403, &msg, false), http.wants_close());
            }
            AuthAnswer::Unauthenticated => self.respond(
                r,
                token,
                routes::text(401, "Unauthorized", false),
                http.wants_close(),
            ),
            AuthAnswer::Error(e) => {
                log::warn!("kubelet: authorisation failed: {e}");
                self.respond(
                    r,
                    token,
                    routes::text(500, &format!("Authorization error: {e}"), true),
                    true,
                )
            }
        }
        self.after_input(r, token);
        self.rearm(r);
    }

    // ----- connections --------------------------------------------------------------------

    fn accept<M: Send + 'static>(&mut self, r: &mut Reactor<M>) {
        let now = r.now();
        self.tls.maybe_reload(now);
        loop {
            let Some((l, _)) = self.listener.as_ref() else {
                return;
            };
            match l.accept() {
                Ok((mut sock, _)) => {
                    if self.conns.len() >= self.cfg.max_connections {
                        log::warn!(
                            "kubelet: connection limit {} reached; refusing a connection",
                            self.cfg.max_connections
                        );
                        drop(sock);
                        continue;
                    }
                    let tls = match ServerConnection::new(self.tls.config()) {
                        Ok(t) => t,
                        Err(e) => {
                            log::warn!("kubelet: TLS session: {e}");
                            continue;
                        }
                    };
                    let token = r.token();
                    if r.registry()
                        .register(&mut sock, token, Interest::READABLE)
                        .is_err()
                    {
                        continue;
                    }
                    let _ = sock.set_nodelay(true);
                    self.conns.insert(
                        token,
                        Conn {
                            sock,
                            tls,
                            inbuf: Vec::new(),
                            out: Vec::new(),
                            phase: Phase::Head,
                            deadline: Some(now + self.cfg.head_timeout),
                            writable_interest: false,
                            keep_alive: true,
                            cert_user: None,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("kubelet: accept: {e}");
                    return;
                }
            }
        }
    }

    fn read_conn<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let mut plain = Vec::new();
        let mut eof = false;
        let mut failed = false;
        let mut budget_hit = false;
        {
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            let mut total = 0usize;
            let mut buf = [0u8; 16 * 1024];
            loop {
                match c.tls.read_tls(&mut c.sock) {
                    Ok(0) => {
                        eof = true;
                        break;
                    }
                    Ok(n) => total += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
                if let Err(e) = c.tls.process_new_packets() {
                    log::debug!("kubelet: TLS error: {e}");
                    let _ = c.tls.write_tls(&mut c.sock);
                    failed = true;
                    break;
                }
                loop {
                    match c.tls.reader().read(&mut buf) {
                        Ok(0) => {
                            eof = true;
                            break;
                        }
                        Ok(n) => plain.extend_from_slice(&buf[..n]),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(_) => {
                            eof = true;
                            break;
                        }
                    }
                }
                if eof {
                    break;
                }
                if total >= READ_BUDGET {
                    budget_hit = true;
                    break;
                }
            }
            if c.cert_user.is_none() && !c.tls.is_handshaking() {
                c.cert_user = Some(
                    c.tls
                        .peer_certificates()
                        .and_then(|certs| certs.first())
                        .and_then(|leaf| cert_identity(leaf))
                        .and_then(|id| auth::user_from_cert(&id)),
                );
            }
        }
        if failed {
            self.close(r, token);
            return;
        }
        if !plain.is_empty() {
            self.input(r, token, &plain);
        }
        if eof {
            self.peer_closed(r, token);
            return;
        }
        // Handshake replies and anything queued.
        self.flush(r, token);
        if budget_hit {
            // Re-arming makes epoll report the socket again if it is still readable, so the
            // remainder is read on a later turn without starving other connections.
            if let Some(c) = self.conns.get_mut(&token) {
                let interest = if c.writable_interest {
                    Interest::READABLE | Interest::WRITABLE
                } else {
                    Interest::READABLE
                };
                let _ = r.registry().reregister(&mut c.sock, token, interest);
            }
        }
    }

    /// The client closed its side.
    fn peer_closed<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match &mut c.phase {
            // A finished response still being flushed: let it go out.
            Phase::Closing if !c.out.is_empty() => {}
            _ => {
                self.close(r, token);
                return;
            }
        }
        self.flush(r, token);
    }

    fn input<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token, data: &[u8]) {
        let now = r.now();
        let idle = self.cfg.stream_idle_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match &mut c.phase {
            Phase::Exec {
                session,
                child,
                stdin_buf,
                stdin_eof,
                ended,
                ..
            } => {
                let mut events = Vec::new();
                session.feed(data, &mut c.out, &mut events);
                c.deadline = Some(now + idle);
                let child = *child;
                let mut ready = false;
                let mut close = false;
                for e in events {
                    match e {
                        SessionEvent::Ready => ready = true,
                        SessionEvent::Stdin(d) => match child {
                            Some(id) => {
                                let _ = r.write_stdin(id, &d);
                            }
                            None => stdin_buf.push(d),
                        },
                        SessionEvent::StdinEof => match child {
                            Some(id) => r.close_stdin(id),
                            None => *stdin_eof = true,
                        },
                        SessionEvent::Closed => close = true,
                        SessionEvent::ProtocolError(e) => {
                            log::debug!("kubelet: exec protocol error: {e}");
                            close = true;
                        }
                    }
                }
                // A finished session whose last output waited for window: all sent now.
                close |= *ended && session.done();
                ready &= !*ended;
                if close {
                    if let Some(id) = child {
                        r.kill(id);
                    }
                    c.phase = Phase::Closing;
                    self.flush(r, token);
                    self.close_if_done(r, token);
                    return;
                }
                if ready {
                    self.start_exec(r, token);
                }
                self.flush(r, token);
            }
            Phase::Closing => {}
            _ => {
                if c.inbuf.len() + data.len() > routes::MAX_HEAD_BYTES + MAX_IDLE_INPUT {
                    self.respond(r, token, routes::text(431, "request too large", true), true);
                    return;
                }
                c.inbuf.extend_from_slice(data);
                self.after_input(r, token);
            }
        }
    }

    /// Parses and handles complete request heads waiting in the input buffer.
    fn after_input<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        loop {
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            if !matches!(c.phase, Phase::Head) || c.inbuf.is_empty() {
                return;
            }
            match routes::parse_head(&c.inbuf) {
                Ok(None) => return,
                Ok(Some((req, used))) => {
                    c.inbuf.drain(..used);
                    self.authenticate(r, token, req);
                }
                Err(HeadError::TooLarge) => {
                    return self.respond(
                        r,
                        token,
                        routes::text(431, "request header fields too large", true),
                        true,
                    );
                }
                Err(HeadError::Malformed(e)) => {
                    return self.respond(
                        r,
                        token,
                        routes::text(400, &format!("malformed request: {e}"), true),
                        true,
                    );
                }
                Err(HeadError::Body) => {
                    return self.respond(
                        r,
                        token,
                        routes::text(413, "request bodies are not accepted", true),
                        true,
                    );
                }
            }
        }
    }

    fn authenticate<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token, req: Request) {
        if !self.cfg.auth_enabled {
            return self.dispatch(r, token, req);
        }
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let cert_user = c.cert_user.clone().flatten();
        let bearer = req
            .header("authorization")
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let attrs = auth::attributes(&req.method, &req.path, &self.cfg.node_name);
        let (token_for_review, user) = match (cert_user, bearer) {
            (Some(u), _) => (None, Some(u)),
            (None, Some(t)) => (Some(t), None),
            (None, None) => {
                let close = req.wants_close();
                return self.respond(r, token, routes::text(401, "Unauthorized", false), close);
            }
        };
        match self
            .cache
            .lookup(token_for_review.as_deref(), user.as_ref(), &attrs, r.now())
        {
            Cached::Allowed => self.dispatch(r, token, req),
            Cached::Denied => {
                let close = req.wants_close();
                self.respond(r, token, routes::text(403, "Forbidden", false), close)
            }
            Cached::Unauthenticated => {
                let close = req.wants_close();
                self.respond(r, token, routes::text(401, "Unauthorized", false), close)
            }
            Cached::Miss => {
                let id = AuthId(self.next_auth);
                self.next_auth += 1;
                let areq = AuthRequest {
                    token: token_for_review,
                    user,
                    attributes: attrs,
                };
                self.auth_pending.insert(id, (token, areq.clone()));
                self.auth_out.push((id, areq));
                let deadline = r.now() + self.cfg.auth_timeout;
                if let Some(c) = self.conns.get_mut(&token) {
                    c.phase = Phase::WaitAuth { req, id };
                    c.deadline = Some(deadline);
                }
            }
        }
    }

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
    fn pod_for(&self, ns: &str, pod: &str, _container: &str) -> Result<&PodInfo, Vec<u8>> {
        let Some(p) = self.find_pod(ns, pod) else {
            return Err(routes::text(
                404,
                &format!("pod {ns}/{pod} not found"),
                false,
            ));
        };
        Ok(p)
    }

    fn dispatch<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token, req: Request) {
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
                    SystemTime::now(),
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
            Route::PortForward => routes::text(
                501,
                "vk-cocoon: port forwarding is not supported for cocoon VMs\n",
                false,
            ),
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
        };
        self.respond(r, token, resp, close);
    }

    fn start_logs<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: &Request,
        ns: &str,
        pod: &str,
        container: &str,
    ) {
        let close = req.wants_close();
        let opts = match logs::parse_options(req) {
            Ok(o) => o,
            Err(e) => return self.respond(r, token, routes::text(400, &e, false), close),
        };
        let vm_id = match self.pod_for(ns, pod, container) {
            Err(resp) => return self.respond(r, token, resp, close),
            Ok(p) => match &p.vm {
                None => {
                    return self.respond(
                        r,
                        token,
                        routes::text(200, "vk-cocoon: pod has no live VM\n", false),
                        close,
                    )
                }
                Some(v) => v.id.clone(),
            },
        };
        if opts.tail_lines == Some(0) && !opts.follow {
            return self.respond(r, token, routes::text(200, "", false), close);
        }
        let argv = self.cocoon_argv(&logs::logs_argv("", &vm_id, &opts)[1..]);
        let spec = ChildSpec::new(argv)
            .stdin(StdinMode::Null)
            .stdout(OutputMode::Stream)
            .stderr(OutputMode::Stream);
        let spec = self.with_env(spec);
        match r.spawn(spec) {
            Ok(id) => {
                self.children.insert(id, token);
                if let Some(c) = self.conns.get_mut(&token) {
                    c.phase = Phase::Logs {
                        child: Some(id),
                        shaper: LogShaper::new(&opts),
                        head_sent: false,
                        stderr: Vec::new(),
                    };
                    // A follow stream may be quiet for a long time.
                    c.deadline = if opts.follow {
                        None
                    } else {
                        Some(r.now() + self.cfg.stream_idle_timeout)
                    };
                }
            }
            Err(e) => self.respond(
                r,
                token,
                routes::text(500, &format!("vk-cocoon: cannot run cocoon: {e}"), true),
                true,
            ),
        }
    }

    fn with_env(&self, mut spec: ChildSpec) -> ChildSpec {
        spec.env.extend(self.cfg.cocoon_env.iter().cloned());
        spec
    }

    fn cocoon_argv(&self, args: &[String]) -> Vec<String> {
        let mut a = self.cfg.cocoon.clone();
        a.extend(args.iter().cloned());
        a
    }

    #[allow(clippy::too_many_arguments)]
    fn upgrade_exec<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: &Request,
        ns: &str,
        pod: &str,
        container: &str,
        attach: bool,
    ) {
        let close = req.wants_close();
        let vm_id = match self.pod_for(ns, pod, container) {
            Err(resp) => return self.respond(r, token, resp, close),
            Ok(p) => p.vm.as_ref().map(|v| v.id.clone()),
        };
        let opts = match exec::parse_options(req, attach) {
            Ok(o) => o,
            Err(e) => return self.respond(r, token, routes::text(400, &e, false), close),
        };
        let upgrade = match exec::negotiate(req) {
            Ok(u) => u,
            Err((code, text)) => {
                return self.respond(r, token, routes::text(code, &text, false), close)
            }
        };
        let Some(vm_id) = vm_id else {
            return self.respond(
                r,
                token,
                routes::text(500, "vk-cocoon: pod has no live VM", false),
                close,
            );
        };
        let argv = if attach {
            let o = logs::LogOptions {
                tail_lines: Some(ATTACH_TAIL_LINES),
                follow: true,
                ..Default::default()
            };
            self.cocoon_argv(&logs::logs_argv("", &vm_id, &o)[1..])
        } else {
            self.cocoon_argv(&exec::exec_argv("", &vm_id, &opts)[1..])
        };
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let (session, ready) = match upgrade {
            Upgrade::WebSocket { protocol, accept } => {
                c.out
                    .extend_from_slice(&handshake_response(&accept, &protocol));
                let s = WsSession::new(&protocol, opts.stdout, opts.stderr, opts.stdin, &mut c.out);
                (Session::Ws(s), true)
            }
            Upgrade::Spdy { version } => {
                c.out
                    .extend_from_slice(&SpdySession::handshake_response(&version));
                let resize =
                    opts.tty && version != "channel.k8s.io" && version != "v2.channel.k8s.io";
                let expected = Expected {
                    stdin: opts.stdin,
                    stdout: opts.stdout,
                    stderr: opts.stderr,
                    resize,
                };
                (
                    Session::Spdy(Box::new(SpdySession::new(&version, expected))),
                    false,
                )
            }
        };
        c.keep_alive = false;
        c.phase = Phase::Exec {
            session: Box::new(session),
            child: None,
            argv,
            stdin: opts.stdin && !attach,
            attach,
            stdin_buf: Vec::new(),
            stdin_eof: false,
            ended: false,
        };
        c.deadline = Some(
            now + if ready {
                self.cfg.stream_idle_timeout
            } else {
                self.cfg.stream_setup_timeout
            },
        );
        // Bytes the client pipelined after the upgrade request belong to the session.
        let rest = std::mem::take(&mut c.inbuf);
        if ready {
            self.start_exec(r, token);
        }
        if !rest.is_empty() {
            self.input(r, token, &rest);
        }
        self.flush(r, token);
    }

    fn start_exec<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let idle = self.cfg.stream_idle_timeout;
        let env = self.cfg.cocoon_env.clone();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::Exec {
            child,
            argv,
            stdin,
            stdin_buf,
            stdin_eof,
            attach,
            session,
            ended,
        } = &mut c.phase
        else {
            return;
        };
        if child.is_some() || *ended {
            return;
        }
        let spec = ChildSpec::new(argv.clone())
            .stdin(if *stdin {
                StdinMode::Pipe
            } else {
                StdinMode::Null
            })
            .stdout(OutputMode::Stream)
            .stderr(OutputMode::Stream);
        let mut spec = spec;
        spec.env.extend(env);
        match r.spawn(spec) {
            Ok(id) => {
                *child = Some(id);
                self.children.insert(id, token);
                if *stdin {
                    for d in stdin_buf.drain(..) {
                        let _ = r.write_stdin(id, &d);
                    }
                    if *stdin_eof {
                        r.close_stdin(id);
                    }
                }
                c.deadline = Some(r.now() + idle);
            }
            Err(e) => {
                session.finish(
                    &ExecOutcome::Failed(format!("cannot run cocoon: {e}")),
                    *attach,
                    &mut c.out,
                );
                c.phase = Phase::Closing;
                self.flush(r, token);
            }
        }
    }

    fn child_ended<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        outcome: ExecOutcome,
    ) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match std::mem::replace(&mut c.phase, Phase::Closing) {
            Phase::Logs {
                head_sent, stderr, ..
            } => {
                if head_sent {
                    c.out.extend_from_slice(routes::LAST_CHUNK);
                } else if outcome == ExecOutcome::Exited(0) {
                    c.out.extend_from_slice(&routes::text(200, "", true));
                } else {
                    let msg = String::from_utf8_lossy(&stderr).trim().to_string();
                    let msg = if msg.is_empty() {
                        format!("vk-cocoon: vm logs failed: {outcome:?}")
                    } else {
                        msg
                    };
                    let code = if msg.contains("not found") { 404 } else { 500 };
                    c.out.extend_from_slice(&routes::text(code, &msg, true));
                }
            }
            Phase::Exec {
                mut session,
                attach,
                argv,
                stdin,
                ..
            } => {
                session.finish(&outcome, attach, &mut c.out);
                if !session.done() {
                    // Output waits for the peer's window: keep reading its WINDOW_UPDATEs.
                    c.phase = Phase::Exec {
                        session,
                        child: None,
                        argv,
                        stdin,
                        attach,
                        stdin_buf: Vec::new(),
                        stdin_eof: true,
                        ended: true,
                    };
                }
            }
            other => c.phase = other,
        }
        self.flush(r, token);
    }

    /// Queues a complete response; then either closes or waits for the next request.
    fn respond<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        resp: Vec<u8>,
        close: bool,
    ) {
        let head_timeout = self.cfg.head_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let resp = if close
            && !resp
                .windows(17)
                .any(|w| w.eq_ignore_ascii_case(b"Connection: close"))
        {
            // Insert the header after the status line.
            let at = resp
                .windows(2)
                .position(|w| w == b"\r\n")
                .map(|p| p + 2)
                .unwrap_or(0);
            [&resp[..at], b"Connection: close\r\n", &resp[at..]].concat()
        } else {
            resp
        };
        c.out.extend_from_slice(&resp);
        if close || !c.keep_alive {
            c.phase = Phase::Closing;
            c.inbuf.clear();
        } else {
            c.phase = Phase::Head;
            c.deadline = Some(r.now() + head_timeout);
        }
        self.flush(r, token);
    }

    fn expire<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match &c.phase {
            Phase::Head if !c.inbuf.is_empty() => {
                self.respond(r, token, routes::text(408, "request timeout", true), true);
                // Do not wait for a client that does not read either.
                if let Some(c) = self.conns.get_mut(&token) {
                    c.deadline = Some(r.now() + self.cfg.head_timeout);
                }
            }
            Phase::WaitAuth { id, .. } => {
                let id = *id;
                self.auth_pending.remove(&id);
                self.respond(
                    r,
                    token,
                    routes::text(500, "authorization timed out", true),
                    true,
                );
                if let Some(c) = self.conns.get_mut(&token) {
                    c.deadline = Some(r.now() + self.cfg.head_timeout);
                }
            }
            _ => self.close(r, token),
        }
    }

    /// Pushes queued plaintext through TLS to the socket and adjusts write interest.
    fn flush<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let mut failed = false;
        {
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            // Bytes of `out` handed to TLS; removed once at the end, not after every record
            // batch (a drain per 64 KiB of a megabyte of queued output is a megabyte memmove).
            let mut taken = 0;
            loop {
                let mut accepted = 0;
                if taken < c.out.len() {
                    match c.tls.writer().write(&c.out[taken..]) {
                        Ok(n) => {
                            accepted = n;
                            taken += n;
                        }
                        Err(_) => {
                            failed = true;
                            break;
                        }
                    }
                }
                let mut blocked = false;
                while c.tls.wants_write() {
                    match c.tls.write_tls(&mut c.sock) {
                        Ok(0) => {
                            failed = true;
                            break;
                        }
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            blocked = true;
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => {
                            failed = true;
                            break;
                        }
                    }
                }
                // Nothing taken and nothing to send (rustls' buffer is full while it waits for
                // the peer): stop; the next readiness event continues.
                if failed
                    || blocked
                    || taken == c.out.len()
                    || (accepted == 0 && !c.tls.wants_write())
                {
                    break;
                }
            }
            c.out.drain(..taken);
            if !failed {
                let want = c.tls.wants_write() || !c.out.is_empty();
                if want != c.writable_interest {
                    let interest = if want {
                        Interest::READABLE | Interest::WRITABLE
                    } else {
                        Interest::READABLE
                    };
                    if r.registry()
                        .reregister(&mut c.sock, token, interest)
                        .is_ok()
                    {
                        c.writable_interest = want;
                    }
                }
            }
        }
        if failed {
            self.close(r, token);
        } else {
            self.close_if_done(r, token);
        }
    }

    fn close_if_done<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let done = self.conns.get(&token).is_some_and(|c| {
            matches!(c.phase, Phase::Closing) && c.out.is_empty() && !c.tls.wants_write()
        });
        if done {
            if let Some(c) = self.conns.get_mut(&token) {
                c.tls.send_close_notify();
                let _ = c.tls.write_tls(&mut c.sock);
            }
            self.close(r, token);
        }
    }

    fn close<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(mut c) = self.conns.remove(&token) else {
            return;
        };
        let _ = r.registry().deregister(&mut c.sock);
        match c.phase {
            Phase::Logs {
                child: Some(id), ..
            }
            | Phase::Exec {
                child: Some(id), ..
            } if self.children.remove(&id).is_some() => r.kill(id),
            Phase::WaitAuth { id, .. } => {
                self.auth_pending.remove(&id);
            }
            _ => {}
        }
    }

    fn rearm<M: Send + 'static>(&mut self, r: &mut Reactor<M>) {
        let next = self.conns.values().filter_map(|c| c.deadline).min();
        match (next, self.timer) {
            (None, Some((id, _))) => {
                r.cancel_timer(id);
                self.timer = None;
            }
            (Some(at), Some((_, armed))) if armed <= at => {}
            (Some(at), old) => {
                if let Some((id, _)) = old {
                    r.cancel_timer(id);
                }
                self.timer = Some((r.timer_at(at, TIMER_KEY), at));
            }
            (None, None) => {}
        }
    }
}

/// Convenience for tests and the daemon: the node's TLS state plus an `Arc` of its config.
pub fn tls_config(state: &TlsState) -> Arc<rustls::ServerConfig> {
    state.config()
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
