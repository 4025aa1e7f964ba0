//! The watch connection: dial (off the loop, see `dial`), TLS, send the watch request, read
//! within a budget, parse the response head and feed the body to the decoders; how it ended is
//! an `End`.

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::Interest;
use rustls::pki_types::ServerName;
use rustls::ClientConnection;

use super::dial::{Dialing, Resolver, PER_ADDRESS_TIMEOUT};
use super::{PodWatch, StreamDecoder, WatchOutput};
use crate::kube::client::{Client, WatchSession};
use crate::kube::error::{ApiStatus, KubeError};
use crate::percent;

/// Longest accepted response head.
const MAX_HEAD: usize = 64 << 10;
/// Plaintext bytes one `on_ready` call decodes at most (about 30 pods of watch events): a
/// burst of thousands of pods is spread over many short loop turns instead of one long one,
/// and the rest waits in the socket, not as decoded pods in memory.
const READ_BUDGET: usize = 128 * 1024;

pub(super) enum Transport {
    Plain,
    Tls(Box<ClientConnection>),
}

/// The connection's socket: still being dialled on the dial thread, or open.
pub(super) enum Link {
    Dialing(Dialing),
    Open(TcpStream),
}

pub(super) struct Conn {
    pub(super) link: Link,
    pub(super) transport: Transport,
    /// Request bytes not yet written (plain transport only; TLS buffers in rustls).
    pub(super) out: Vec<u8>,
    pub(super) connected: bool,
    pub(super) head: Vec<u8>,
    pub(super) body: Option<StreamDecoder>,
    pub(super) opened: Instant,
    pub(super) last_byte: Instant,
    pub(super) events: u64,
}

/// Why a connection ended.
pub(super) enum End {
    /// Clean end of stream (server timeout, EOF).
    Closed,
    /// Transport or protocol failure.
    Failed(String),
    /// 410 / too old resource version: relist.
    Gone(String),
    /// 401: refresh credentials, then retry.
    Unauthorized(String),
    /// 429 with optional retry-after.
    Throttled(Option<Duration>, String),
}

impl PodWatch {
    /// Starts a connection: the dial runs on its own thread and its end is reported as
    /// readiness of the watch's token; TLS and the request follow in `drive`.
    pub(super) fn connect(&mut self, client: &Client, now: Instant) -> Result<(), KubeError> {
        let session: WatchSession = client.watch_session()?;
        let timeout_seconds = self.draw_timeout_seconds();
        let request = self.request_bytes(&session, timeout_seconds);
        let (transport, out) = match &session.tls {
            Some(cfg) => {
                let name = ServerName::try_from(session.target.host.clone()).map_err(|e| {
                    KubeError::Transport(format!("server name {}: {e}", session.target.host))
                })?;
                let mut tls = ClientConnection::new(Arc::clone(cfg), name)
                    .map_err(|e| KubeError::Transport(format!("TLS: {e}")))?;
                // rustls holds plaintext written before the handshake and sends it after.
                tls.writer()
                    .write_all(&request)
                    .map_err(|e| KubeError::Transport(format!("TLS buffer: {e}")))?;
                (Transport::Tls(Box::new(tls)), Vec::new())
            }
            None => (Transport::Plain, request),
        };
        let per_address = PER_ADDRESS_TIMEOUT.min(self.config.connect_timeout);
        let dialing = self
            .dialer
            .start(
                &session.target.host,
                session.target.port,
                per_address,
                self.registry.as_ref(),
                self.token,
            )
            .map_err(|e| KubeError::Transport(format!("dial {}: {e}", session.target.host)))?;
        self.stats.connects += 1;
        self.conn = Some(Conn {
            link: Link::Dialing(dialing),
            transport,
            out,
            connected: false,
            head: Vec::new(),
            body: None,
            opened: now,
            last_byte: now,
            events: 0,
        });
        Ok(())
    }

    /// The function the watch resolves the API server's name with (the system resolver by
    /// default); it runs on the dial thread. Drops any address already resolved.
    pub fn set_resolver(&mut self, resolver: Resolver) {
        self.dialer.set_resolver(resolver);
    }

    fn request_bytes(&self, s: &WatchSession, timeout_seconds: u64) -> Vec<u8> {
        let mut path = format!(
            "{}/api/v1/pods?fieldSelector={}&watch=1&allowWatchBookmarks=true&timeoutSeconds={}",
            s.target.base_path,
            percent::encode(&format!("spec.nodeName={}", self.node)),
            timeout_seconds
        );
        if !self.resource_version.is_empty() {
            path.push_str("&resourceVersion=");
            path.push_str(&percent::encode(&self.resource_version));
        }
        let mut req = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nUser-Agent: vk-cocoon/{}\r\nConnection: close\r\n",
            s.target.host_header(),
            env!("CARGO_PKG_VERSION")
        );
        if let Some(a) = &s.authorization {
            req.push_str("Authorization: ");
            req.push_str(a);
            req.push_str("\r\n");
        }
        req.push_str("\r\n");
        req.into_bytes()
    }

    pub(super) fn drop_conn(&mut self) {
        if let Some(mut c) = self.conn.take() {
            // A connection that ended before the server answered may have gone to an address
            // that is no longer the server's: the name is looked up again next time.
            if c.body.is_none() {
                self.dialer.forget();
            }
            match &mut c.link {
                Link::Dialing(d) => d.deregister(self.registry.as_ref()),
                Link::Open(stream) => {
                    if let Some(reg) = &self.registry {
                        let _ = reg.deregister(stream);
                    }
                }
            }
        }
    }

    /// Move bytes: take the dial's answer, write the request, read and decode what is there.
    /// A failed connection also drops the resolved addresses (looked up again next time).
    pub(super) fn drive(
        &mut self,
        c: &mut Conn,
        now: Instant,
        out: &mut Vec<WatchOutput>,
    ) -> Result<(), End> {
        let result = self.drive_link(c, now, out);
        if let Err(End::Failed(_)) = &result {
            self.dialer.forget();
        }
        result
    }

    /// The dial's answer, once: the connected socket goes into the poll under the watch's
    /// token in place of the wake socket. Ok(false) while the dial is still under way.
    fn take_dial(&mut self, c: &mut Conn) -> Result<bool, End> {
        let Link::Dialing(dialing) = &mut c.link else {
            return Ok(true);
        };
        let Some(answer) = dialing.outcome() else {
            return Ok(false);
        };
        dialing.deregister(self.registry.as_ref());
        let std_stream = answer.map_err(End::Failed)?;
        std_stream
            .set_nonblocking(true)
            .map_err(|e| End::Failed(format!("connect: {e}")))?;
        let _ = std_stream.set_nodelay(true);
        let mut stream = TcpStream::from_std(std_stream);
        if let Some(reg) = &self.registry {
            reg.register(
                &mut stream,
                self.token,
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| End::Failed(format!("register watch socket: {e}")))?;
        }
        c.link = Link::Open(stream);
        c.connected = true;
        Ok(true)
    }

    fn drive_link(
        &mut self,
        c: &mut Conn,
        now: Instant,
        out: &mut Vec<WatchOutput>,
    ) -> Result<(), End> {
        if !self.take_dial(c)? {
            return Ok(());
        }
        let Link::Open(stream) = &mut c.link else {
            return Ok(());
        };
        let mut buf = [0u8; 32 * 1024];
        let mut plain: Vec<u8> = Vec::new();
        let mut eof = false;
        let mut more = false;
        match &mut c.transport {
            Transport::Plain => {
                while !c.out.is_empty() {
                    match stream.write(&c.out) {
                        Ok(0) => return Err(End::Failed("connection closed while sending".into())),
                        Ok(n) => {
                            c.out.drain(..n);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(End::Failed(format!("send: {e}"))),
                    }
                }
                loop {
                    if plain.len() >= READ_BUDGET {
                        more = true;
                        break;
                    }
                    match stream.read(&mut buf) {
                        Ok(0) => {
                            eof = true;
                            break;
                        }
                        Ok(n) => plain.extend_from_slice(&buf[..n]),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(End::Failed(format!("read: {e}"))),
                    }
                }
            }
            Transport::Tls(tls) => loop {
                // Flush whatever TLS wants to send (handshake, request).
                while tls.wants_write() {
                    match tls.write_tls(stream) {
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(End::Failed(format!("send: {e}"))),
                    }
                }
                let got = match tls.read_tls(stream) {
                    Ok(0) => {
                        eof = true;
                        0
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(End::Failed(format!("read: {e}"))),
                };
                let state = tls
                    .process_new_packets()
                    .map_err(|e| End::Failed(format!("TLS: {e}")))?;
                let mut avail = state.plaintext_bytes_to_read();
                while avail > 0 {
                    let n = tls
                        .reader()
                        .read(&mut buf[..avail.min(32 * 1024)])
                        .map_err(|e| End::Failed(format!("TLS read: {e}")))?;
                    if n == 0 {
                        break;
                    }
                    avail -= n;
                    plain.extend_from_slice(&buf[..n]);
                }
                if state.peer_has_closed() {
                    eof = true;
                }
                if !eof && got > 0 && plain.len() >= READ_BUDGET {
                    more = true;
                    break;
                }
                if got == 0 || eof {
                    // Flush again: processing may have queued alerts or key updates.
                    while tls.wants_write() {
                        match tls.write_tls(stream) {
                            Ok(_) => {}
                            Err(_) => break,
                        }
                    }
                    break;
                }
            },
        }
        self.read_more = more;
        if !plain.is_empty() {
            self.consume(c, &plain, now, out)?;
        }
        if eof {
            if let Some(d) = c.body.as_mut() {
                let mut lines = Vec::new();
                d.finish(&mut |l| lines.push(l.to_vec()));
                for l in lines {
                    self.apply_line(c, &l, out)?;
                }
            }
            return Err(if c.body.is_some() {
                End::Closed
            } else {
                End::Failed("connection closed before a response".into())
            });
        }
        if c.body.as_ref().is_some_and(|d| d.finished()) {
            return Err(End::Closed);
        }
        Ok(())
    }

    /// Plaintext from the server: response head first, then the body.
    fn consume(
        &mut self,
        c: &mut Conn,
        mut data: &[u8],
        now: Instant,
        out: &mut Vec<WatchOutput>,
    ) -> Result<(), End> {
        c.last_byte = now;
        if c.body.is_none() {
            c.head.extend_from_slice(data);
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            let used = match resp.parse(&c.head) {
                Ok(httparse::Status::Complete(n)) => n,
                Ok(httparse::Status::Partial) => {
                    if c.head.len() > MAX_HEAD {
                        return Err(End::Failed("response head too large".into()));
                    }
                    return Ok(());
                }
                Err(e) => return Err(End::Failed(format!("bad response head: {e}"))),
            };
            let code = resp.code.unwrap_or(0);
            let header = |name: &str| {
                resp.headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned())
            };
            let chunked = header("Transfer-Encoding")
                .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
            let retry_after =
                crate::kube::error::parse_retry_after(header("Retry-After").as_deref());
            if code != 200 {
                let body = String::from_utf8_lossy(&c.head[used..]).into_owned();
                let status = ApiStatus::from_body(code, body.as_bytes());
                return Err(match code {
                    410 => End::Gone(format!("watch answered 410: {}", status.message)),
                    401 => End::Unauthorized(format!("watch answered 401: {}", status.message)),
                    429 => End::Throttled(
                        retry_after,
                        format!("watch answered 429: {}", status.message),
                    ),
                    _ => End::Failed(format!("watch answered HTTP {code}: {}", status.message)),
                });
            }
            self.failures = 0;
            let head = std::mem::take(&mut c.head);
            c.body = Some(StreamDecoder::new(chunked));
            data = &[];
            let rest = head[used..].to_vec();
            if !rest.is_empty() {
                return self.consume_body(c, &rest, out);
            }
        }
        self.consume_body(c, data, out)
    }

    fn consume_body(
        &mut self,
        c: &mut Conn,
        data: &[u8],
        out: &mut Vec<WatchOutput>,
    ) -> Result<(), End> {
        let Some(dec) = c.body.as_mut() else {
            return Ok(());
        };
        let mut lines: Vec<Vec<u8>> = Vec::new();
        let mut end: Option<End> = None;
        let fed = dec.feed(data, &mut |l| lines.push(l.to_vec()));
        for l in lines {
            if let Err(e) = self.apply_line(c, &l, out) {
                end = Some(e);
                break;
            }
        }
        if let Some(e) = end {
            return Err(e);
        }
        fed.map_err(|e| End::Failed(format!("bad chunked body: {e}")))
    }
}
