//! The plain-HTTP `/metrics` endpoint (VK_METRICS_ADDR), served from the reactor loop.
//! Owns its listener and connections; it never blocks: non-blocking accept, bounded reads, timeouts.
//!
//! Each connection is a small state machine: read the request head (at most
//! `MAX_HEAD` bytes) -> write one response -> close (`Connection: close`). The head must
//! arrive within `HEAD_TIMEOUT` and the whole exchange end within `CLIENT_TIMEOUT`, so idle
//! sockets give their slot back quickly. `GET /metrics` answers the registry in the text
//! format; every other path is 404 (`/debug/pprof/` of the Go daemon is not served); other
//! methods get 405. At most `MAX_CONNECTIONS` are open at once and `MAX_PER_PEER` from one
//! address; when the listener is full, the oldest connection still waiting for its head makes
//! room, so idle sockets from many addresses cannot lock scrapers out either. Refusals are
//! counted in `vk_cocoon_connections_refused_total{listener="metrics"}` and logged once a minute.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Token};

use super::admission::{PeerCounts, PeerKey, Refusal, RefusalLog};
use super::Metrics;
use crate::config::ListenAddr;
use crate::reactor::{IoReady, Range, Reactor, TimerId};

/// The reactor range of the server's tokens and timer keys: whoever shares the reactor
/// routes their events here by range alone.
pub const RANGE: Range = Range(b'm');
/// Largest request head accepted; a longer one gets 431 and the connection is closed.
pub const MAX_HEAD: usize = 16 * 1024;
/// Time a client has to send its request and read the answer (the Go server's read-header timeout).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a client has to send its request head: a scraper sends it at once.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(3);
/// Open connections at most.
pub const MAX_CONNECTIONS: usize = 256;
/// Open connections from one address at most (a scraper holds one per scrape).
pub const MAX_PER_PEER: usize = 32;

struct Conn {
    stream: TcpStream,
    head: Vec<u8>,
    /// Some once the response is built: bytes and how many were written.
    response: Option<(Vec<u8>, usize)>,
    /// The head deadline first, then the end of `CLIENT_TIMEOUT`.
    timer: TimerId,
    peer: PeerKey,
    accepted: Instant,
}

/// The listener and its connections.
pub struct MetricsServer {
    listener: TcpListener,
    listen_token: Token,
    local_addr: SocketAddr,
    conns: HashMap<Token, Conn>,
    timers: HashMap<TimerId, Token>,
    peers: PeerCounts,
    refusals: RefusalLog,
    metrics: Metrics,
}

enum Step {
    Keep,
    Close,
}

impl MetricsServer {
    /// Binds `addr` and registers the listener with the reactor.
    pub fn bind<M: Send + 'static>(
        addr: &ListenAddr,
        metrics: Metrics,
        reactor: &mut Reactor<M>,
    ) -> io::Result<Self> {
        let mut last_err = io::Error::new(
            io::ErrorKind::AddrNotAvailable,
            format!("{addr}: no address"),
        );
        for sa in addr.socket_addrs()? {
            match super::admission::listen(sa) {
                Ok(mut listener) => {
                    let listen_token = reactor.token_in(RANGE);
                    reactor
                        .registry()
                        .register(&mut listener, listen_token, Interest::READABLE)?;
                    let local_addr = listener.local_addr()?;
                    return Ok(MetricsServer {
                        listener,
                        listen_token,
                        local_addr,
                        conns: HashMap::new(),
                        timers: HashMap::new(),
                        peers: PeerCounts::default(),
                        refusals: RefusalLog::new("metrics"),
                        metrics,
                    });
                }
                Err(e) => last_err = e,
            }
        }
        Err(last_err)
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Handles readiness if the token is ours; returns false for foreign tokens.
    pub fn handle_io<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        ready: &IoReady,
    ) -> bool {
        if ready.token == self.listen_token {
            self.accept(reactor);
            return true;
        }
        if !self.conns.contains_key(&ready.token) {
            return false;
        }
        let step = match self.conns.get_mut(&ready.token) {
            Some(conn) => drive(conn, &self.metrics),
            None => Step::Close,
        };
        if let Step::Close = step {
            self.close(reactor, ready.token);
        }
        true
    }

    /// Handles a timer if it is one of ours (a client that took too long); false otherwise.
    pub fn handle_timer<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        id: TimerId,
    ) -> bool {
        let Some(token) = self.timers.remove(&id) else {
            return false;
        };
        // Past the head deadline with the answer built: the rest of CLIENT_TIMEOUT to read it.
        if let Some(conn) = self.conns.get_mut(&token) {
            let end = conn.accepted + CLIENT_TIMEOUT;
            if conn.response.is_some() && reactor.now() < end {
                conn.timer = reactor.timer_at(end, RANGE.timer_key(0));
                self.timers.insert(conn.timer, token);
                return true;
            }
        }
        log::debug!("metrics: closing a client that did not finish in time");
        self.close(reactor, token);
        true
    }

    /// Makes room for a new connection: one still waiting for its head goes, a silent one first.
    fn evict_idle<M: Send + 'static>(&mut self, reactor: &mut Reactor<M>) -> bool {
        // Silent sockets go first, then the oldest.
        let oldest = self
            .conns
            .iter()
            .filter(|(_, c)| c.response.is_none())
            .min_by_key(|(_, c)| (!c.head.is_empty(), c.accepted))
            .map(|(t, _)| *t);
        match oldest {
            Some(t) => {
                self.close(reactor, t);
                true
            }
            None => false,
        }
    }

    fn accept<M: Send + 'static>(&mut self, reactor: &mut Reactor<M>) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer_addr)) => {
                    let now = reactor.now();
                    let peer = PeerKey::of(peer_addr.ip());
                    if self.peers.of(peer) >= MAX_PER_PEER {
                        self.refusals
                            .refused(Refusal::PerPeer, peer_addr.ip(), MAX_PER_PEER, now);
                        continue; // dropped: closed
                    }
                    if self.conns.len() >= MAX_CONNECTIONS && !self.evict_idle(reactor) {
                        self.refusals.refused(
                            Refusal::Global,
                            peer_addr.ip(),
                            MAX_CONNECTIONS,
                            now,
                        );
                        continue;
                    }
                    let token = reactor.token_in(RANGE);
                    if let Err(e) = reactor.registry().register(
                        &mut stream,
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        log::warn!("metrics: cannot register connection: {e}");
                        continue;
                    }
                    let timer = reactor.timer_after(HEAD_TIMEOUT, RANGE.timer_key(0));
                    let mut conn = Conn {
                        stream,
                        head: Vec::new(),
                        response: None,
                        timer,
                        peer,
                        accepted: now,
                    };
                    // The request may already be waiting.
                    match drive(&mut conn, &self.metrics) {
                        Step::Keep => {
                            self.timers.insert(timer, token);
                            self.peers.add(peer);
                            self.conns.insert(token, conn);
                        }
                        Step::Close => {
                            reactor.cancel_timer(timer);
                            let _ = reactor.registry().deregister(&mut conn.stream);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and friends: try again on the next readiness event.
                    log::warn!("metrics: accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn close<M: Send + 'static>(&mut self, reactor: &mut Reactor<M>, token: Token) {
        if let Some(mut conn) = self.conns.remove(&token) {
            reactor.cancel_timer(conn.timer);
            self.timers.remove(&conn.timer);
            self.peers.remove(conn.peer);
            let _ = reactor.registry().deregister(&mut conn.stream);
        }
    }

    /// Closes the listener and every connection.
    pub fn shutdown<M: Send + 'static>(mut self, reactor: &mut Reactor<M>) {
        let tokens: Vec<Token> = self.conns.keys().copied().collect();
        for t in tokens {
            self.close(reactor, t);
        }
        let _ = reactor.registry().deregister(&mut self.listener);
    }
}

/// Advances one connection as far as it goes without blocking.
fn drive(conn: &mut Conn, metrics: &Metrics) -> Step {
    if conn.response.is_none() {
        let mut buf = [0u8; 4096];
        loop {
            match conn.stream.read(&mut buf) {
                Ok(0) => return Step::Close,
                Ok(n) => {
                    conn.head.extend_from_slice(&buf[..n]);
                    if let Some(resp) = respond(&conn.head, metrics) {
                        conn.response = Some((resp, 0));
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Keep,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Step::Close,
            }
        }
    }
    let Some((resp, written)) = conn.response.as_mut() else {
        return Step::Keep;
    };
    while *written < resp.len() {
        match conn.stream.write(&resp[*written..]) {
            Ok(0) => return Step::Close,
            Ok(n) => *written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Keep,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Step::Close,
        }
    }
    let _ = conn.stream.shutdown(std::net::Shutdown::Write);
    Step::Close
}

/// The response for a request head, or None while the head is incomplete and within bounds.
pub fn respond(head: &[u8], metrics: &Metrics) -> Option<Vec<u8>> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Partial) if head.len() <= MAX_HEAD => None,
        Ok(httparse::Status::Partial) => Some(response(
            431,
            "Request Header Fields Too Large",
            "text/plain",
            b"request head too large\n",
        )),
        Err(httparse::Error::TooManyHeaders) => Some(response(
            431,
            "Request Header Fields Too Large",
            "text/plain",
            b"too many headers\n",
        )),
        Err(_) => Some(response(400, "Bad Request", "text/plain", b"bad request\n")),
        Ok(httparse::Status::Complete(_)) => {
            let path = req.path.unwrap_or("/");
            let path = path.split('?').next().unwrap_or(path);
            let method = req.method.unwrap_or("");
            Some(match (method, path) {
                ("GET" | "HEAD", "/metrics") => {
                    let body = metrics.encode();
                    let mut r = response(200, "OK", super::TEXT_CONTENT_TYPE, body.as_bytes());
                    if method == "HEAD" {
                        r.truncate(r.len() - body.len());
                    }
                    r
                }
                ("GET" | "HEAD", _) => response(404, "Not Found", "text/plain", b"not found\n"),
                _ => response(
                    405,
                    "Method Not Allowed",
                    "text/plain",
                    b"method not allowed\n",
                ),
            })
        }
    }
}

/// A whole one-shot HTTP/1.1 response (`Connection: close`); the peer listener answers with it
/// too.
pub fn response(code: u16, reason: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(r: Option<Vec<u8>>) -> String {
        String::from_utf8(r.expect("complete")).unwrap()
    }

    #[test]
    fn routes() {
        let m = Metrics::new().unwrap();
        m.orphan_vm_total.inc();
        assert!(
            respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n", &m).is_none(),
            "partial head waits"
        );
        let ok = text(respond(b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n", &m));
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Type: text/plain; version=0.0.4"));
        assert!(ok.contains("Connection: close\r\n"));
        assert!(ok.contains("\r\n\r\n# HELP vk_cocoon_"), "{ok}");
        assert!(ok.contains("vk_cocoon_orphan_vm_total 1"));
        let body_len = ok.split_once("\r\n\r\n").unwrap().1.len();
        assert!(ok.contains(&format!("Content-Length: {body_len}\r\n")));
        // HEAD: the GET's head without its body. The length is the text's at that moment (the
        // process_* families move between two renders), so it is compared loosely.
        let head = text(respond(b"HEAD /metrics HTTP/1.1\r\n\r\n", &m));
        assert!(head.ends_with("\r\n\r\n"), "{head}");
        let head_len: usize = head
            .split("Content-Length: ")
            .nth(1)
            .and_then(|rest| rest.split("\r\n").next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(head_len.abs_diff(body_len) < 64, "{head_len} vs {body_len}");
        assert!(
            text(respond(b"GET /debug/pprof/ HTTP/1.1\r\n\r\n", &m)).starts_with("HTTP/1.1 404 ")
        );
        assert!(text(respond(b"POST /metrics HTTP/1.1\r\n\r\n", &m)).starts_with("HTTP/1.1 405 "));
        assert!(text(respond(b"\x00\x01garbage\r\n\r\n", &m)).starts_with("HTTP/1.1 400 "));
        let huge = [
            b"GET /metrics HTTP/1.1\r\nX: ".as_slice(),
            &vec![b'a'; MAX_HEAD],
        ]
        .concat();
        assert!(text(respond(&huge, &m)).starts_with("HTTP/1.1 431 "));
    }
}
