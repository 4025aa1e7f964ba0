//! The kubelet HTTPS server inside the single mio loop: non-blocking accept, one rustls
//! ServerConnection per connection driven by readiness, request heads through `routes`, auth, and
//! logs / exec children run by the reactor with their streams wired to the connection.
//!
//! No thread per connection and no blocking call: slow clients only cost their own bounded
//! buffers, every phase has a deadline, and TokenReview / SubjectAccessReview are left to the daemon.
//!
//! Nobody exhausts the server: connections are capped in total, per peer address and while
//! unauthenticated (short deadlines; the oldest silent unauthenticated one makes room); a connection
//! with `output_pause_at` bytes queued is not read (no more requests, stdin or pings) and its
//! child's output is not read (the child blocks) until half of it is delivered; exec stdin is
//! taken (and SPDY window granted) only as fast as the child consumes it; a client that reads
//! nothing for `write_stall_timeout` is closed.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
use crate::metrics::admission::{PeerCounts, PeerKey, Refusal, RefusalLog};
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
/// Pipelined requests answered per connection and turn of the loop.
const PIPELINE_BATCH: usize = 32;
/// First and longest pause between checks of how much queued exec stdin the child consumed
/// (the reactor writes stdin on its own; the wait doubles while nothing is consumed).
const STDIN_CHECK_FIRST: Duration = Duration::from_millis(5);
const STDIN_CHECK_MAX: Duration = Duration::from_millis(320);

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
        /// Stdin bytes the client sent so far (queued, written or dropped).
        stdin_handed: u64,
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
    /// What the socket is registered for.
    interest: Interest,
    /// Keep the connection for another request after the current response.
    keep_alive: bool,
    /// The peer's verified certificate user, computed once after the handshake.
    cert_user: Option<Option<UserInfo>>,
    peer: PeerKey,
    /// The client has sent something (a TLS ClientHello at least).
    spoke: bool,
    /// A request on it proved who the caller is (or authentication is off and one was served).
    authenticated: bool,
    /// The socket is not read: too much output or exec stdin is queued.
    read_paused: bool,
    /// The child's output pipes are not read: too much output is queued.
    child_paused: bool,
    /// Output over `output_pause_at` and nothing delivered since: closed at this instant.
    stall_deadline: Option<Instant>,
    /// Exec stdin waits for the child: look again at this instant, then wait `recheck_every`.
    recheck: Option<Instant>,
    recheck_every: Duration,
    /// Stdin the child had consumed at the last check.
    stdin_seen: u64,
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
    auth_pending: HashMap<AuthId, (Token, AuthRequest, PeerKey)>,
    auth_out: Vec<(AuthId, AuthRequest, PeerKey)>,
    /// Reviews whose client left (or timed out) before the answer: the daemon drops them
    /// unrun if they are still queued.
    auth_cancelled: Vec<AuthId>,
    /// Reviews in flight per peer address (capped: each costs the API server a call).
    reviews: PeerCounts,
    next_auth: u64,
    cache: AuthCache,
    timer: Option<(TimerId, Instant)>,
    /// Open connections per peer, and those not yet authenticated.
    peers: PeerCounts,
    unauthenticated: PeerCounts,
    /// Unauthenticated connections in accept order (entries of closed or authenticated ones
    /// are skipped when met, and swept when they outnumber the live ones).
    unauth_order: std::collections::VecDeque<Token>,
    refusals: RefusalLog,
    /// When an authorisation error was last logged (they are logged once a minute).
    auth_error_logged: Option<Instant>,
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
            auth_cancelled: Vec::new(),
            reviews: PeerCounts::default(),
            next_auth: 1,
            cache: AuthCache::default(),
            timer: None,
            peers: PeerCounts::default(),
            unauthenticated: PeerCounts::default(),
            unauth_order: std::collections::VecDeque::new(),
            refusals: RefusalLog::new("kubelet"),
            auth_error_logged: None,
            resource_text: None,
        }
    }

    /// Binds and registers the listening socket; returns the bound address.
    pub fn listen<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        addr: SocketAddr,
    ) -> io::Result<SocketAddr> {
        let mut l = crate::metrics::admission::listen(addr)?;
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
                    disk: Some(&v.disk)
                        .filter(|d| !d.is_empty())
                        .map(std::path::PathBuf::from),
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
    /// Each with the caller's address (an IPv6 /64 as one), which the daemon budgets by.
    pub fn take_auth_requests(&mut self) -> Vec<(AuthId, AuthRequest, PeerKey)> {
        std::mem::take(&mut self.auth_out)
    }

    /// Authorisation requests no longer wanted (the client left or timed out): drop them if
    /// they have not run.
    pub fn take_cancelled_auth(&mut self) -> Vec<AuthId> {
        std::mem::take(&mut self.auth_cancelled)
    }

    /// Forgets a pending review; `cancelled` when nobody answered it.
    fn drop_pending(&mut self, id: AuthId, cancelled: bool) -> Option<(Token, AuthRequest)> {
        let (token, req, peer) = self.auth_pending.remove(&id)?;
        self.reviews.remove(peer);
        if cancelled {
            self.auth_cancelled.push(id);
        }
        Some((token, req))
    }

    // ----- entry points -------------------------------------------------------------------

    pub fn on_io<M: Send + 'static>(&mut self, r: &mut Reactor<M>, ev: IoReady) {
        if self.listener.as_ref().is_some_and(|(_, t)| *t == ev.token) {
            self.accept(r);
        } else if let Some(c) = self.conns.get(&ev.token) {
            if c.read_paused {
                // Not reading: only a broken socket matters now.
                if ev.error {
                    self.close(r, ev.token);
                }
            } else if ev.readable || ev.read_closed || ev.error {
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
        let stalled: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.stall_deadline.is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for t in stalled {
            log::debug!("kubelet: closing a client that reads nothing of its queued output");
            self.close(r, t);
        }
        let recheck: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.recheck.is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for t in recheck {
            if let Some(c) = self.conns.get_mut(&t) {
                c.recheck = None;
            }
            self.flush(r, t);
            // Pipelined requests left waiting by the previous batch.
            self.after_input(r, t);
        }
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
                        let body = shaper.shape(data, crate::wall_clock::now());
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
            (None, None) => match &exit.spawn_error {
                Some(e) => ExecOutcome::Failed(format!("cannot run cocoon: {e}")),
                None => ExecOutcome::Failed("command status unknown".into()),
            },
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
        let Some((token, req)) = self.drop_pending(id, false) else {
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
        if matches!(answer, AuthAnswer::Decided { .. }) {
            self.mark_authenticated(r, token);
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
            // Who failed to authenticate gets no second try on this connection.
            AuthAnswer::Unauthenticated => {
                self.respond(r, token, routes::text(401, "Unauthorized", false), true)
            }
            AuthAnswer::Busy => self.respond(r, token, too_many_reviews(), true),
            AuthAnswer::Error(e) => {
                // The API server's text may name internals: it goes to the log (once a minute,
                // callers can trigger it at will), the caller gets a generic body.
                let now = r.now();
                if self
                    .auth_error_logged
                    .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(60))
                {
                    log::warn!("kubelet: authorisation failed (logged once a minute): {e}");
                    self.auth_error_logged = Some(now);
                }
                self.respond(
                    r,
                    token,
                    routes::text(
                        500,
                        "Internal Server Error: authorization check failed",
                        true,
                    ),
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
                Ok((mut sock, addr)) => {
                    if let Err((why, limit)) = self.admit(r, addr.ip()) {
                        self.refusals.refused(why, addr.ip(), limit, now);
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
                    let peer = PeerKey::of(addr.ip());
                    self.peers.add(peer);
                    self.unauthenticated.add(peer);
                    self.unauth_order.push_back(token);
                    if self.unauth_order.len() > 2 * self.unauthenticated.total() + 64 {
                        let conns = &self.conns;
                        self.unauth_order.retain(|t| {
                            *t == token || conns.get(t).is_some_and(|c| !c.authenticated)
                        });
                    }
                    self.conns.insert(
                        token,
                        Conn {
                            sock,
                            tls,
                            inbuf: Vec::new(),
                            out: Vec::new(),
                            phase: Phase::Head,
                            deadline: Some(now + self.cfg.unauthenticated_timeout),
                            interest: Interest::READABLE,
                            keep_alive: true,
                            cert_user: None,
                            peer,
                            spoke: false,
                            authenticated: false,
                            read_paused: false,
                            child_paused: false,
                            stall_deadline: None,
                            recheck: None,
                            recheck_every: STDIN_CHECK_FIRST,
                            stdin_seen: 0,
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

    /// Whether a new connection from `ip` may be kept, making room by closing the oldest
    /// unauthenticated connection when a global cap is reached. Err: why not, and the limit.
    fn admit<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        ip: IpAddr,
    ) -> Result<(), (Refusal, usize)> {
        let peer = PeerKey::of(ip);
        let cfg = &self.cfg;
        if self.peers.of(peer) >= cfg.max_connections_per_peer {
            return Err((Refusal::PerPeer, cfg.max_connections_per_peer));
        }
        if self.unauthenticated.of(peer) >= cfg.max_unauthenticated_per_peer {
            return Err((Refusal::PerPeer, cfg.max_unauthenticated_per_peer));
        }
        let limit = cfg.max_connections;
        if self.conns.len() < limit && self.unauthenticated.total() < cfg.max_unauthenticated {
            return Ok(());
        }
        match self.evictable() {
            Some(t) => {
                log::debug!(
                    "kubelet: connection limit reached; closing an unauthenticated connection"
                );
                self.close(r, t);
                Ok(())
            }
            None => Err((Refusal::Global, limit)),
        }
    }

    /// The unauthenticated connection to close for a newcomer: the oldest silent one (nothing
    /// read from it and nothing waiting in its socket), else the oldest. A client busy with
    /// its handshake thus survives a flood of sockets that never say anything, even when it
    /// was accepted in the same batch as thousands of them.
    fn evictable(&mut self) -> Option<Token> {
        const LOOK_AT: usize = 32;
        let mut talking = Vec::new();
        let mut victim = None;
        while talking.len() < LOOK_AT {
            let Some(t) = self.unauth_order.pop_front() else {
                break;
            };
            // Closed or authenticated since: a stale entry.
            let Some(c) = self.conns.get(&t).filter(|c| !c.authenticated) else {
                continue;
            };
            let mut probe = [0u8; 1];
            let waiting = matches!(c.sock.peek(&mut probe), Ok(n) if n > 0);
            if c.spoke || waiting {
                talking.push(t);
            } else {
                victim = Some(t);
                break;
            }
        }
        // Those that talk keep their place at the front, oldest first.
        for t in talking.iter().rev() {
            self.unauth_order.push_front(*t);
        }
        victim.or_else(|| {
            let t = *talking.first()?;
            self.unauth_order.pop_front();
            Some(t)
        })
    }

    /// The caller proved who it is: the connection leaves the unauthenticated budget.
    fn mark_authenticated<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let head_timeout = self.cfg.head_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if c.authenticated {
            return;
        }
        c.authenticated = true;
        self.unauthenticated.remove(c.peer);
        if matches!(c.phase, Phase::Head) {
            c.deadline = Some(r.now() + head_timeout);
        }
    }

    fn read_conn<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let mut plain = Vec::new();
        let mut eof = false;
        let mut failed = false;
        let mut budget_hit = false;
        let mut verified = false;
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
                    Ok(n) => {
                        total += n;
                        c.spoke = true;
                    }
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
                verified = c.cert_user.as_ref().is_some_and(Option::is_some);
            }
        }
        if verified {
            self.mark_authenticated(r, token);
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
                let want = interest_of(c);
                if r.registry().reregister(&mut c.sock, token, want).is_ok() {
                    c.interest = want;
                }
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
                stdin_handed,
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
                        // Bounded by the caller: the socket is not read while too much waits.
                        SessionEvent::Stdin(d) => {
                            *stdin_handed += d.len() as u64;
                            match child {
                                Some(id) => {
                                    let _ = r.write_stdin(id, &d);
                                }
                                None => stdin_buf.push(d),
                            }
                        }
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
        for handled in 0.. {
            let now = r.now();
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            // Answers the client has not read yet: take no more requests until it does.
            if !matches!(c.phase, Phase::Head)
                || c.inbuf.is_empty()
                || c.out.len() >= self.cfg.output_pause_at
            {
                return;
            }
            // A pipelining client gets a batch per turn of the loop, then the others their turn.
            if handled == PIPELINE_BATCH {
                c.recheck = Some(now);
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
            self.mark_authenticated(r, token);
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
            // No credentials: no second try on this connection.
            (None, None) => {
                return self.respond(r, token, routes::text(401, "Unauthorized", false), true);
            }
        };
        match self
            .cache
            .lookup(token_for_review.as_deref(), user.as_ref(), &attrs, r.now())
        {
            Cached::Allowed => {
                self.mark_authenticated(r, token);
                self.dispatch(r, token, req)
            }
            Cached::Denied => {
                self.mark_authenticated(r, token);
                let close = req.wants_close();
                self.respond(r, token, routes::text(403, "Forbidden", false), close)
            }
            Cached::Unauthenticated => {
                self.respond(r, token, routes::text(401, "Unauthorized", false), true)
            }
            Cached::Miss => {
                let Some(peer) = self.conns.get(&token).map(|c| c.peer) else {
                    return;
                };
                // Each review is an API call the caller makes us pay for: a few at a time
                // per address, the rest are turned away before any call.
                if self.reviews.of(peer) >= self.cfg.max_reviews_per_peer {
                    return self.respond(r, token, too_many_reviews(), true);
                }
                let id = AuthId(self.next_auth);
                self.next_auth += 1;
                let areq = AuthRequest {
                    token: token_for_review,
                    user,
                    attributes: attrs,
                };
                self.reviews.add(peer);
                self.auth_pending.insert(id, (token, areq.clone(), peer));
                self.auth_out.push((id, areq, peer));
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
                Some(v) if is_macos(v) => {
                    return self.respond(r, token, macos_unsupported("logs"), close)
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
        let vm = match self.pod_for(ns, pod, container) {
            Err(resp) => return self.respond(r, token, resp, close),
            Ok(p) => p.vm.clone(),
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
        let vm_id = match vm {
            None => {
                return self.respond(
                    r,
                    token,
                    routes::text(500, "vk-cocoon: pod has no live VM", false),
                    close,
                )
            }
            Some(v) if is_macos(&v) => {
                let what = if attach { "attach" } else { "exec" };
                return self.respond(r, token, macos_unsupported(what), close);
            }
            Some(v) => v.id,
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
            stdin_handed: 0,
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
            ..
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
                        stdin_handed: 0,
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
        let head_timeout = if self.conns.get(&token).is_some_and(|c| c.authenticated) {
            self.cfg.head_timeout
        } else {
            self.cfg.unauthenticated_timeout
        };
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
                self.drop_pending(id, true);
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

    /// Pushes queued plaintext through TLS to the socket, then re-decides what is read.
    fn flush<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        self.ack_stdin(r, token);
        let mut failed = false;
        let mut delivered = false;
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
                        Ok(_) => delivered = true,
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
        }
        if failed {
            self.close(r, token);
            return;
        }
        let resumed = self.pace(r, token, delivered);
        if resumed {
            // Requests that waited in the input buffer while the client was not reading.
            self.after_input(r, token);
        }
        self.close_if_done(r, token);
    }

    /// Exec stdin: tells the session how much the child consumed (SPDY grants that much window
    /// back) and, while some still waits in the pipe, schedules another look (the reactor
    /// writes stdin on its own and reports nothing), backing off while the child reads nothing.
    fn ack_stdin<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::Exec {
            session,
            child,
            stdin_buf,
            stdin_handed,
            ..
        } = &mut c.phase
        else {
            return;
        };
        let queued = stdin_buf.iter().map(Vec::len).sum::<usize>()
            + child.map_or(0, |id| r.stdin_queued(id));
        let consumed = stdin_handed.saturating_sub(queued as u64);
        session.stdin_consumed(consumed, &mut c.out);
        if consumed > c.stdin_seen {
            c.stdin_seen = consumed;
            c.recheck_every = STDIN_CHECK_FIRST;
        }
        if queued == 0 {
            c.recheck = None;
            c.recheck_every = STDIN_CHECK_FIRST;
        } else if c.recheck.is_none() {
            c.recheck = Some(now + c.recheck_every);
            c.recheck_every = (c.recheck_every * 2).min(STDIN_CHECK_MAX);
        }
    }

    /// Decides from what is queued whether the socket and the child's output are read, and
    /// whether the client is stalling; registers the socket accordingly. `delivered`: bytes
    /// reached the socket just now. Returns true when reading the socket resumed.
    fn pace<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        delivered: bool,
    ) -> bool {
        let cap = self.cfg.output_pause_at;
        let stdin_cap = self.cfg.max_queued_stdin;
        let stall = self.cfg.write_stall_timeout;
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return false;
        };
        let (held, child, stdin_queued) = match &c.phase {
            Phase::Exec {
                session,
                child,
                stdin_buf,
                ..
            } => (
                session.pending_output(),
                *child,
                stdin_buf.iter().map(Vec::len).sum::<usize>()
                    + child.map_or(0, |id| r.stdin_queued(id)),
            ),
            Phase::Logs { child, .. } => (0, *child, 0),
            _ => (0, None, 0),
        };
        let backlog = c.out.len() + held;
        if let Some(id) = child {
            if !c.child_paused && backlog >= cap {
                r.pause_output(id);
                c.child_paused = true;
            } else if c.child_paused && backlog <= cap / 2 {
                r.resume_output(id);
                c.child_paused = false;
            }
        }
        // Output held for the peer's SPDY window does not stop reading: the window update
        // that releases it arrives on this socket.
        let was_paused = c.read_paused;
        c.read_paused = if was_paused {
            c.out.len() > cap / 2 || stdin_queued > stdin_cap / 2
        } else {
            c.out.len() >= cap || stdin_queued >= stdin_cap
        };
        c.stall_deadline = match c.stall_deadline {
            _ if backlog < cap => None,
            Some(d) if !delivered => Some(d),
            _ => Some(now + stall),
        };
        let want = interest_of(c);
        if want != c.interest && r.registry().reregister(&mut c.sock, token, want).is_ok() {
            c.interest = want;
        }
        was_paused && !c.read_paused
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
        self.peers.remove(c.peer);
        if !c.authenticated {
            self.unauthenticated.remove(c.peer);
        }
        let _ = r.registry().deregister(&mut c.sock);
        match c.phase {
            Phase::Logs {
                child: Some(id), ..
            }
            | Phase::Exec {
                child: Some(id), ..
            } if self.children.remove(&id).is_some() => r.kill(id),
            Phase::WaitAuth { id, .. } => {
                self.drop_pending(id, true);
            }
            _ => {}
        }
    }

    fn rearm<M: Send + 'static>(&mut self, r: &mut Reactor<M>) {
        let next = self
            .conns
            .values()
            .flat_map(|c| [c.deadline, c.stall_deadline, c.recheck])
            .flatten()
            .min();
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

/// What a connection's socket should be registered for: readable unless reading is paused,
/// writable while anything waits to be sent (mio needs one of the two: a paused, idle
/// connection waits on writable, which reports once and costs nothing).
fn interest_of(c: &Conn) -> Interest {
    let write = c.tls.wants_write() || !c.out.is_empty();
    match (c.read_paused, write) {
        (false, false) => Interest::READABLE,
        (false, true) => Interest::READABLE | Interest::WRITABLE,
        (true, _) => Interest::WRITABLE,
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

/// 429 for a caller over its review budget; the connection closes (it may retry later).
fn too_many_reviews() -> Vec<u8> {
    routes::text(
        429,
        "Too Many Requests: authentication reviews in flight",
        true,
    )
}

/// A macOS guest runs under cocoon-macos, which has no exec, attach or console-log command.
fn is_macos(vm: &super::VmInfo) -> bool {
    vm.backend == crate::guest::macos::HYPERVISOR
}

/// The answer for what a macOS guest cannot do here: said plainly, with the way in that works.
fn macos_unsupported(what: &str) -> Vec<u8> {
    let text = format!(
        "vk-cocoon: {what} is not available for macOS guests (cocoon-macos has no {what}); \
         reach the guest over SSH or VNC\n"
    );
    routes::text(400, &text, false)
}
