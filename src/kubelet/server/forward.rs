//! Port-forward connections of the kubelet server: the upgraded session and, per forwarded
//! connection, a non-blocking TCP socket to the guest's IP registered in the same loop.
//!
//! Backpressure both ways: while the client's backlog is over `output_pause_at` the guests'
//! sockets are not read (and are drained again once half of it is delivered); bytes for a
//! guest wait in its queue, acknowledged to the client (SPDY window) only once written, and
//! while `max_queued_stdin` of them wait the client's socket is not read.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Interest, Token};

use super::conn::Phase;
use super::KubeletServer;
use crate::kubelet::portforward::{self, Key, PfEvent, PfSession, PortError};
use crate::kubelet::routes::{self, Request};
use crate::kubelet::PodInfo;
use crate::reactor::{IoReady, Reactor};

/// A guest port that neither accepts nor refuses within this time is reported as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Bytes read from one guest socket per readiness event before yielding to others.
const GUEST_READ_BUDGET: usize = 256 * 1024;

/// One upgraded port-forward connection.
pub(super) struct Forwarding {
    pub(super) session: PfSession,
    /// `namespace/name` and UID of the pod, for error messages.
    pod: String,
    uid: String,
    /// Where the guest is, or why it cannot be reached.
    guest: Result<IpAddr, GuestError>,
    pub(super) forwards: HashMap<Key, Forward>,
    /// Guests' sockets are not read: too much output waits for the client.
    pub(super) guests_paused: bool,
}

impl Forwarding {
    /// Bytes waiting to be written to the guests.
    pub(super) fn queued_to_guests(&self) -> usize {
        self.forwards.values().map(|f| f.to_guest.len()).sum()
    }
}

/// One forwarded connection's socket to the guest.
pub(super) struct Forward {
    sock: TcpStream,
    token: Token,
    addr: SocketAddr,
    connected: bool,
    /// Until this instant the connect may take.
    connect_by: Instant,
    to_guest: Vec<u8>,
    /// The client sends nothing more; the guest's write side is shut once the queue is out.
    client_eof: bool,
    shut: bool,
    guest_eof: bool,
}

/// An I/O error as Go's net package words it ("connection refused"), without Rust's
/// "(os error N)" tail: kubectl users see the kubelet's wording.
fn io_text(e: &io::Error) -> String {
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(at) => &text[..at],
        None => &text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Why a pod's guest cannot be reached (the text of every forward's error stream).
#[derive(Clone, Debug, PartialEq, Eq)]
enum GuestError {
    NoVm,
    NoIp,
    /// The pod IP of the status, as it stands there.
    Unusable(String),
}

impl std::fmt::Display for GuestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GuestError::NoVm => f.write_str("pod has no running VM"),
            GuestError::NoIp => f.write_str("the pod's VM has no IP address yet"),
            GuestError::Unusable(ip) => {
                write!(f, "the pod's VM address {ip:?} is not a usable IP address")
            }
        }
    }
}

/// The pod's VM address as the daemon reports it (the pod IP of its status).
fn guest_ip(p: &PodInfo) -> Result<IpAddr, GuestError> {
    if p.vm.is_none() {
        return Err(GuestError::NoVm);
    }
    let ip = p
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .or_else(|| p.pod.status.as_ref().and_then(|s| s.pod_ip.clone()))
        .filter(|ip| !ip.is_empty());
    let Some(ip) = ip else {
        return Err(GuestError::NoIp);
    };
    match ip.parse::<IpAddr>() {
        Ok(a) if !a.is_unspecified() && !a.is_multicast() => Ok(a),
        _ => Err(GuestError::Unusable(ip)),
    }
}

impl KubeletServer {
    pub(super) fn upgrade_port_forward<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: &Request,
        ns: &str,
        pod: &str,
    ) {
        let close = req.wants_close();
        let (guest, uid) = match self.pod_for(ns, pod, "") {
            Err(resp) => return self.respond(r, token, resp, close),
            Ok(p) => (guest_ip(p), p.uid.clone()),
        };
        let upgrade = match portforward::negotiate(req) {
            Ok(u) => u,
            Err((code, text)) => {
                return self.respond(r, token, routes::text(code, &text, false), close)
            }
        };
        let idle = self.cfg.stream_idle_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let mut events = Vec::new();
        let session = PfSession::start(upgrade, &mut c.out, &mut events);
        c.keep_alive = false;
        c.phase = Phase::PortForward(Box::new(Forwarding {
            session,
            pod: format!("{ns}/{pod}"),
            uid,
            guest,
            forwards: HashMap::new(),
            guests_paused: false,
        }));
        c.deadline = Some(r.now() + idle);
        // Bytes the client pipelined after the upgrade request belong to the session.
        let rest = std::mem::take(&mut c.inbuf);
        self.forward_events(r, token, events);
        if !rest.is_empty() {
            self.forward_input(r, token, &rest);
        }
        self.flush(r, token);
    }

    /// Client bytes of a port-forward connection.
    pub(super) fn forward_input<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        data: &[u8],
    ) {
        let idle = self.cfg.stream_idle_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::PortForward(f) = &mut c.phase else {
            return;
        };
        let mut events = Vec::new();
        f.session.feed(data, &mut c.out, &mut events);
        c.deadline = Some(r.now() + idle);
        self.forward_events(r, token, events);
        self.flush(r, token);
    }

    fn forward_events<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        events: Vec<PfEvent>,
    ) {
        for e in events {
            match e {
                PfEvent::Open { key, port } => self.open_forward(r, token, key, port),
                PfEvent::Data { key, data } => {
                    let Some((f, out)) = self.forwarding(token) else {
                        return;
                    };
                    match f.forwards.get_mut(&key) {
                        Some(fw) => fw.to_guest.extend_from_slice(&data),
                        // Its guest connection is gone: the bytes are dropped, the window kept.
                        None => f.session.consumed(key, data.len(), out),
                    }
                    self.write_guest(r, token, key);
                }
                PfEvent::Eof { key } => {
                    if let Some((f, _)) = self.forwarding(token) {
                        if let Some(fw) = f.forwards.get_mut(&key) {
                            fw.client_eof = true;
                        }
                    }
                    self.write_guest(r, token, key);
                }
                PfEvent::Reset { key } => self.drop_forward(r, token, key),
                PfEvent::Closed | PfEvent::ProtocolError(_) => {
                    if let PfEvent::ProtocolError(e) = &e {
                        log::debug!("kubelet: port-forward protocol error: {e}");
                    }
                    self.end_forwarding(r, token);
                    return;
                }
            }
        }
        if self
            .forwarding(token)
            .is_some_and(|(f, _)| f.session.done())
        {
            self.end_forwarding(r, token);
        }
    }

    /// The port-forward state of a connection and its output buffer.
    fn forwarding(&mut self, token: Token) -> Option<(&mut Forwarding, &mut Vec<u8>)> {
        let c = self.conns.get_mut(&token)?;
        match &mut c.phase {
            Phase::PortForward(f) => Some((f, &mut c.out)),
            _ => None,
        }
    }

    fn open_forward<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        key: Key,
        port: Result<u16, PortError>,
    ) {
        let total = self.guests.len();
        let limit = self.cfg.max_connections;
        let now = r.now();
        let Some((f, out)) = self.forwarding(token) else {
            return;
        };
        let fail = |f: &mut Forwarding, out: &mut Vec<u8>, port: &str, why: &str| {
            let msg = format!(
                "error forwarding port {port} to pod {}, uid {}: {why}",
                f.pod, f.uid
            );
            log::info!("kubelet: {msg}");
            f.session.fail(key, &msg, out);
        };
        let port = match port {
            Ok(p) => p,
            Err(e) => return fail(f, out, "", &e.to_string()),
        };
        let ip = match &f.guest {
            Ok(ip) => *ip,
            Err(e) => {
                let e = e.to_string();
                return fail(f, out, &port.to_string(), &e);
            }
        };
        if total >= limit {
            return fail(
                f,
                out,
                &port.to_string(),
                &format!("too many forwarded connections on this node ({limit})"),
            );
        }
        let addr = SocketAddr::new(ip, port);
        let mut sock = match TcpStream::connect(addr) {
            Ok(s) => s,
            Err(e) => {
                return fail(
                    f,
                    out,
                    &port.to_string(),
                    &format!("dial tcp {addr}: connect: {}", io_text(&e)),
                )
            }
        };
        let guest_token = r.token_in(super::RANGE);
        if let Err(e) = r.registry().register(
            &mut sock,
            guest_token,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            return fail(
                f,
                out,
                &port.to_string(),
                &format!("dial tcp {addr}: connect: {}", io_text(&e)),
            );
        }
        let _ = sock.set_nodelay(true);
        f.forwards.insert(
            key,
            Forward {
                sock,
                token: guest_token,
                addr,
                connected: false,
                connect_by: now + CONNECT_TIMEOUT,
                to_guest: Vec::new(),
                client_eof: false,
                shut: false,
                guest_eof: false,
            },
        );
        self.guests.insert(guest_token, (token, key));
        self.arm_connect_check(token);
    }

    /// Looks at pending connects again when the first of them runs out of time.
    fn arm_connect_check(&mut self, token: Token) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::PortForward(f) = &c.phase else {
            return;
        };
        c.recheck = f
            .forwards
            .values()
            .filter(|fw| !fw.connected)
            .map(|fw| fw.connect_by)
            .min();
    }

    /// Fails the connects of a port-forward connection that ran out of time.
    pub(super) fn expire_connects<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let now = r.now();
        let late: Vec<(Key, SocketAddr)> = match self.forwarding(token) {
            Some((f, _)) => f
                .forwards
                .iter()
                .filter(|(_, fw)| !fw.connected && fw.connect_by <= now)
                .map(|(k, fw)| (*k, fw.addr))
                .collect(),
            None => return,
        };
        for (key, addr) in late {
            self.fail_forward(r, token, key, &format!("dial tcp {addr}: i/o timeout"));
        }
        self.arm_connect_check(token);
    }

    /// Reports a forwarded connection's failure on its error stream and drops its socket.
    fn fail_forward<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        key: Key,
        why: &str,
    ) {
        if let Some((f, out)) = self.forwarding(token) {
            let port = f.forwards.get(&key).map(|fw| fw.addr.port()).unwrap_or(0);
            let msg = format!(
                "error forwarding port {port} to pod {}, uid {}: {why}",
                f.pod, f.uid
            );
            log::info!("kubelet: {msg}");
            f.session.fail(key, &msg, out);
        }
        self.drop_forward(r, token, key);
    }

    fn drop_forward<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token, key: Key) {
        let Some((f, _)) = self.forwarding(token) else {
            return;
        };
        if let Some(mut fw) = f.forwards.remove(&key) {
            let _ = r.registry().deregister(&mut fw.sock);
            self.guests.remove(&fw.token);
        }
    }

    /// Deregisters every guest socket of a session that ends.
    pub(super) fn drop_forwards<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        f: &mut Forwarding,
    ) {
        for (_, mut fw) in f.forwards.drain() {
            let _ = r.registry().deregister(&mut fw.sock);
            self.guests.remove(&fw.token);
        }
    }

    /// Ends a port-forward connection: its guest sockets go, what is queued is still flushed.
    fn end_forwarding<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if let Phase::PortForward(mut f) = std::mem::replace(&mut c.phase, Phase::Closing) {
            self.drop_forwards(r, &mut f);
        }
        self.flush(r, token);
    }

    /// Readiness of a guest socket.
    pub(super) fn on_guest_io<M: Send + 'static>(&mut self, r: &mut Reactor<M>, ev: IoReady) {
        let Some(&(token, key)) = self.guests.get(&ev.token) else {
            return;
        };
        let connecting = match self.forwarding(token) {
            Some((f, _)) => f.forwards.get(&key).map(|fw| !fw.connected),
            None => None,
        };
        match connecting {
            None => return,
            Some(true) => {
                let Some((f, _)) = self.forwarding(token) else {
                    return;
                };
                let Some(fw) = f.forwards.get_mut(&key) else {
                    return;
                };
                let failed = match fw.sock.take_error() {
                    Ok(Some(e)) | Err(e) => Some(e),
                    Ok(None) => match fw.sock.peer_addr() {
                        Ok(_) => None,
                        // Still connecting (a wake-up without news).
                        Err(e) if e.kind() == io::ErrorKind::NotConnected && !ev.error => return,
                        Err(e) => Some(e),
                    },
                };
                let addr = fw.addr;
                match failed {
                    Some(e) => {
                        return self.fail_forward(
                            r,
                            token,
                            key,
                            &format!("dial tcp {addr}: connect: {}", io_text(&e)),
                        )
                    }
                    None => fw.connected = true,
                }
                self.arm_connect_check(token);
            }
            Some(false) => {}
        }
        self.write_guest(r, token, key);
        self.read_guest(r, token, key);
        self.flush(r, token);
    }

    /// Writes what waits for a guest; acknowledges it to the client; shuts the guest's write
    /// side after the client's end.
    fn write_guest<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token, key: Key) {
        let Some((f, out)) = self.forwarding(token) else {
            return;
        };
        let Some(fw) = f.forwards.get_mut(&key).filter(|fw| fw.connected) else {
            return;
        };
        let mut written = 0;
        let mut failed = None;
        while written < fw.to_guest.len() {
            match fw.sock.write(&fw.to_guest[written..]) {
                Ok(0) => break,
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        fw.to_guest.drain(..written);
        if fw.client_eof && fw.to_guest.is_empty() && !fw.shut {
            let _ = fw.sock.shutdown(Shutdown::Write);
            fw.shut = true;
        }
        let finished = fw.guest_eof && fw.shut;
        f.session.consumed(key, written, out);
        if let Some(e) = failed {
            return self.fail_forward(
                r,
                token,
                key,
                &format!("writing to the guest: {}", io_text(&e)),
            );
        }
        if finished {
            self.drop_forward(r, token, key);
        }
    }

    /// Reads a guest's output into the session, unless the client's backlog pauses guests.
    fn read_guest<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token, key: Key) {
        let idle = self.cfg.stream_idle_timeout;
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::PortForward(f) = &mut c.phase else {
            return;
        };
        if f.guests_paused {
            return;
        }
        let Some(fw) = f
            .forwards
            .get_mut(&key)
            .filter(|fw| fw.connected && !fw.guest_eof)
        else {
            return;
        };
        let mut buf = [0u8; 16 * 1024];
        let mut total = 0;
        let mut failed = None;
        loop {
            match fw.sock.read(&mut buf) {
                Ok(0) => {
                    fw.guest_eof = true;
                    f.session.eof(key, &mut c.out);
                    break;
                }
                Ok(n) => {
                    total += n;
                    f.session.send(key, &buf[..n], &mut c.out);
                    if total >= GUEST_READ_BUDGET {
                        // Re-arming reports the socket again if more waits: read on a later turn.
                        let _ = r.registry().reregister(
                            &mut fw.sock,
                            fw.token,
                            Interest::READABLE | Interest::WRITABLE,
                        );
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if total > 0 {
            c.deadline = Some(now + idle);
        }
        let finished = fw.guest_eof && fw.shut;
        if let Some(e) = failed {
            return self.fail_forward(
                r,
                token,
                key,
                &format!("reading from the guest: {}", io_text(&e)),
            );
        }
        if finished {
            self.drop_forward(r, token, key);
        }
    }

    /// Reads every guest of a connection whose client caught up (edge-triggered sockets report
    /// nothing new for bytes that waited while paused).
    pub(super) fn read_guests<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let keys: Vec<Key> = match self.forwarding(token) {
            Some((f, _)) => f.forwards.keys().copied().collect(),
            None => return,
        };
        for key in keys {
            self.read_guest(r, token, key);
        }
    }

    /// Open sockets to guests (for tests and the leak checks).
    pub fn guest_connection_count(&self) -> usize {
        self.guests.len()
    }
}
