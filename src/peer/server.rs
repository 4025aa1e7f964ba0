//! The peer snapshot listener: TLS serving the plan and the byte slices of local snapshots to
//! the cluster's other nodes, one short-lived thread per connection.
//!
//! It serves VM memory images, so a caller must be a cluster node and a reader of the tag: its
//! source address is a Node's InternalIP, it presents a client certificate of the cluster CA
//! naming that Node (`system:node:<name>`, group `system:nodes` or `vk-cocoon:nodes`), and it
//! names the manifest digest this node recorded when it pushed the snapshot (see `pushed.rs`).
//! Plain HTTP gets a 400 and nothing else. Files are opened only inside the snapshot directory
//! (see `store.rs`); connections and slice streams are capped (503 beyond), stalled peers cut.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::{ServerConfig, ServerConnection, StreamOwned};

use crate::kubelet::tls::{cert_identity, TlsState};
use crate::metrics::admission::{Refusal, RefusalLog};
use crate::metrics::http::response;

use super::nodes::{canonical, ClusterNodes};
use super::pushed::PushedSnapshots;
use super::store::{build_plan, open_member, open_snapshot_dir};
use super::wire::{
    self, crc_hex, valid_manifest_digest, valid_snapshot_name, CRC_TRAILER, DIGEST_PARAM,
    PLAN_PATH, SLICE_PATH,
};

/// Concurrent slice streams; the next one gets 503.
pub const MAX_SLICE_STREAMS: usize = 128;
/// Concurrent plan requests (each may run `cocoon snapshot inspect`); the next one gets 503.
pub const MAX_PLANS: usize = 16;
/// Open connections in all; beyond, a connection is closed at accept.
pub const MAX_CONNECTIONS: usize = MAX_SLICE_STREAMS + 2 * MAX_PLANS;
/// The TLS handshake, and then the request head, must each arrive whole within this time.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// A peer that accepts no bytes for this long is cut off.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// The client certificate's CN: `system:node:` and the Node's name, as kubelets have it.
pub const NODE_USER_PREFIX: &str = "system:node:";
/// The groups (O) of a node's client certificate: a kubelet's, or the one the README's
/// install steps issue to vk-cocoon hosts.
pub const NODE_GROUPS: [&str; 2] = ["system:nodes", "vk-cocoon:nodes"];
/// The first byte of a TLS connection (a handshake record).
const TLS_HANDSHAKE: u8 = 0x16;
/// Largest request head.
const HEAD_LIMIT: usize = 8 << 10;
/// Bytes read from the file and sent per chunk.
const CHUNK: usize = 1 << 20;

/// Maps a snapshot name to the id of its directory under the snapshot directory;
/// `Ok(None)` when no such snapshot exists.
pub type Resolver = Arc<dyn Fn(&str) -> Result<Option<String>, String> + Send + Sync>;

/// The Node a verified client certificate speaks for, when it is one at `ip`.
pub fn certified_node(
    cert: &[u8],
    ip: IpAddr,
    nodes: &ClusterNodes,
) -> Result<String, NotANodeCert> {
    let id = cert_identity(cert).ok_or(NotANodeCert::Unreadable)?;
    let cn = id.common_name.unwrap_or_default();
    let Some(node) = cn
        .strip_prefix(NODE_USER_PREFIX)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
    else {
        return Err(NotANodeCert::NotANode { cn });
    };
    if !id
        .organizations
        .iter()
        .any(|o| NODE_GROUPS.contains(&o.as_str()))
    {
        return Err(NotANodeCert::NoNodeGroup { cn });
    }
    match nodes.internal_ip(&node) {
        Some(at) if at == canonical(ip) => Ok(node),
        Some(at) => Err(NotANodeCert::Elsewhere { node, at, ip }),
        None => Err(NotANodeCert::NoSuchNode { node }),
    }
}

/// Why a caller's certificate does not speak for the Node at its address (logged; the caller
/// gets a 403).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotANodeCert {
    /// The handshake finished without a client certificate.
    Missing,
    Unreadable,
    /// The common name is not `system:node:<name>`.
    NotANode {
        cn: String,
    },
    /// The certificate is in none of `NODE_GROUPS`.
    NoNodeGroup {
        cn: String,
    },
    /// The Node's InternalIP is not the caller's address.
    Elsewhere {
        node: String,
        at: IpAddr,
        ip: IpAddr,
    },
    NoSuchNode {
        node: String,
    },
}

impl std::fmt::Display for NotANodeCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotANodeCert::Missing => f.write_str("no client certificate"),
            NotANodeCert::Unreadable => f.write_str("unreadable client certificate"),
            NotANodeCert::NotANode { cn } => write!(f, "certificate of {cn:?}, not of a node"),
            NotANodeCert::NoNodeGroup { cn } => {
                write!(f, "{cn:?} is in none of the groups {NODE_GROUPS:?}")
            }
            NotANodeCert::Elsewhere { node, at, ip } => {
                write!(f, "node {node} is at {at}, the caller at {ip}")
            }
            NotANodeCert::NoSuchNode { node } => write!(f, "no Node {node} in the cluster"),
        }
    }
}

impl std::error::Error for NotANodeCert {}

struct Shared {
    root: PathBuf,
    nodes: Arc<ClusterNodes>,
    resolve: Resolver,
    pushed: Arc<PushedSnapshots>,
    connections: AtomicUsize,
    slices: AtomicUsize,
    plans: AtomicUsize,
    refusals: Mutex<RefusalLog>,
}

/// A running listener; it lives as long as the process.
pub struct PeerServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
}

/// What the listener serves and to whom.
pub struct Serving {
    /// `VK_COCOON_SNAPSHOT_DIR`.
    pub root: PathBuf,
    pub resolve: Resolver,
    /// The manifest digests of this node's pushes: a caller must name the right one.
    pub pushed: Arc<PushedSnapshots>,
    pub nodes: Arc<ClusterNodes>,
    /// Serving certificate and the CA of node client certificates (required).
    pub tls: TlsState,
}

impl PeerServer {
    /// Binds `addr` and starts accepting on a thread of its own.
    pub fn start(addr: SocketAddr, serving: Serving) -> io::Result<PeerServer> {
        let listener: TcpListener = crate::metrics::admission::listen(addr)?.into();
        listener.set_nonblocking(false)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            root: serving.root,
            nodes: serving.nodes,
            resolve: serving.resolve,
            pushed: serving.pushed,
            connections: AtomicUsize::new(0),
            slices: AtomicUsize::new(0),
            plans: AtomicUsize::new(0),
            refusals: Mutex::new(RefusalLog::new("peer")),
        });
        let s = shared.clone();
        let tls = serving.tls;
        std::thread::Builder::new()
            .name("peer-accept".into())
            .spawn(move || accept_loop(listener, s, tls))?;
        Ok(PeerServer { local_addr, shared })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Slice streams being served now.
    pub fn slice_streams(&self) -> usize {
        self.shared.slices.load(Ordering::Relaxed)
    }
}

fn refuse(shared: &Shared, reason: Refusal, ip: IpAddr, limit: usize) {
    if let Ok(mut log) = shared.refusals.lock() {
        log.refused(reason, ip, limit, Instant::now());
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut tls: TlsState) {
    loop {
        let (sock, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                log::warn!("peer listener: accept: {e}");
                // EMFILE and the like: give the process a moment to release descriptors.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // Which Node an address is cannot be known before the certificate names one (Nodes
        // are looked up by name, not listed): the address is checked after the handshake.
        let ip = canonical(peer.ip());
        if shared.connections.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            refuse(&shared, Refusal::Global, ip, MAX_CONNECTIONS);
            continue;
        }
        // A renewed VK_TLS_CERT pair is picked up here (a stat every 10 s at most).
        tls.maybe_reload(Instant::now());
        let config = tls.config();
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("peer-conn".into())
            .spawn(move || {
                if let Err(e) = serve(&s, sock, ip, config) {
                    log::debug!("peer {peer}: {e}");
                }
                s.connections.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            log::warn!("peer listener: spawn: {e}");
        }
    }
}

/// A slot of a bounded count, released on drop.
struct Slot<'a>(&'a AtomicUsize);

impl<'a> Slot<'a> {
    fn take(n: &'a AtomicUsize, max: usize) -> Option<Slot<'a>> {
        if n.fetch_add(1, Ordering::AcqRel) >= max {
            n.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(n))
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A byte stream whose reads can be bounded in time: the TCP socket, or TLS over it.
trait Timed: Read + Write {
    fn set_read_timeout(&self, d: Duration) -> io::Result<()>;
}

impl Timed for TcpStream {
    fn set_read_timeout(&self, d: Duration) -> io::Result<()> {
        TcpStream::set_read_timeout(self, Some(d))
    }
}

type Tls = StreamOwned<ServerConnection, TcpStream>;

impl Timed for Tls {
    fn set_read_timeout(&self, d: Duration) -> io::Result<()> {
        self.sock.set_read_timeout(Some(d))
    }
}

/// Answers one request of a Node's address, then closes: a plain-HTTP request gets a 400
/// saying this listener speaks TLS; a TLS caller must complete the handshake with a client
/// certificate of the cluster CA, which must name the Node at its address.
fn serve(
    shared: &Shared,
    sock: TcpStream,
    ip: IpAddr,
    config: Arc<ServerConfig>,
) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_write_timeout(Some(WRITE_TIMEOUT))?;
    sock.set_read_timeout(Some(HEAD_TIMEOUT))?;
    let mut first = [0u8; 1];
    if sock.peek(&mut first)? == 0 {
        return Ok(());
    }
    if first[0] != TLS_HANDSHAKE {
        refuse(shared, Refusal::PlainHttp, ip, 0);
        let mut sock = sock;
        // The head is read first: closing on unread bytes would reset the connection and
        // lose the answer.
        let _ = read_head(&mut sock)?;
        return sock.write_all(&simple(
            400,
            "Bad Request",
            "this peer listener speaks TLS only, to node client certificates\n",
        ));
    }
    let conn = ServerConnection::new(config).map_err(io::Error::other)?;
    let mut tls = StreamOwned::new(conn, sock);
    if let Err(e) = handshake(&mut tls) {
        if e.kind() == io::ErrorKind::InvalidData {
            // rustls refused the handshake: no client certificate, or not of the cluster CA.
            refuse(shared, Refusal::NotANodeCertificate, ip, 0);
        }
        return Err(e);
    }
    let node = match tls.conn.peer_certificates().and_then(|c| c.first()) {
        Some(cert) => certified_node(cert, ip, &shared.nodes),
        None => Err(NotANodeCert::Missing),
    };
    let answered = match node {
        Ok(_) => answer(shared, &mut tls),
        Err(why) => {
            let reason = match why {
                NotANodeCert::Elsewhere { .. } | NotANodeCert::NoSuchNode { .. } => {
                    Refusal::NotANode
                }
                _ => Refusal::NotANodeCertificate,
            };
            refuse(shared, reason, ip, 0);
            log::debug!("peer {ip}: {why}");
            let _ = read_head(&mut tls)?;
            tls.write_all(&simple(
                403,
                "Forbidden",
                "the client certificate is not that of the Node at this address\n",
            ))
        }
    };
    tls.conn.send_close_notify();
    let _ = tls.flush();
    answered
}

/// Completes the TLS handshake within `HEAD_TIMEOUT` in all.
fn handshake(tls: &mut Tls) -> io::Result<()> {
    let deadline = Instant::now() + HEAD_TIMEOUT;
    while tls.conn.is_handshaking() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "handshake timeout"));
        }
        tls.sock.set_read_timeout(Some(left))?;
        let (read, wrote) = tls.conn.complete_io(&mut tls.sock)?;
        if read == 0 && wrote == 0 && tls.conn.is_handshaking() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed in the handshake",
            ));
        }
    }
    Ok(())
}

/// Reads the request and answers it.
fn answer<S: Timed>(shared: &Shared, sock: &mut S) -> io::Result<()> {
    let target = match read_head(sock)? {
        Ok(t) => t,
        Err((code, reason, msg)) => return sock.write_all(&simple(code, reason, &msg)),
    };
    let Some((path, pairs)) = wire::split_target(&target) else {
        return sock.write_all(&simple(400, "Bad Request", "bad query escape\n"));
    };
    match path {
        PLAN_PATH => serve_plan(shared, sock, &pairs),
        SLICE_PATH => serve_slice(shared, sock, &pairs),
        _ => sock.write_all(&simple(404, "Not Found", "not found\n")),
    }
}

type Refused = (u16, &'static str, String);

/// Reads the request head within `HEAD_TIMEOUT`; the request target of a GET.
fn read_head<S: Timed>(sock: &mut S) -> io::Result<Result<String, Refused>> {
    let deadline = Instant::now() + HEAD_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut tmp = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "request head timeout",
            ));
        }
        sock.set_read_timeout(left)?;
        let n = sock.read(&mut tmp)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed before a request",
            ));
        }
        buf.extend_from_slice(&tmp[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => {
                if req.method != Some("GET") {
                    return Ok(Err((405, "Method Not Allowed", "GET only\n".into())));
                }
                return Ok(Ok(req.path.unwrap_or("/").to_string()));
            }
            Ok(httparse::Status::Partial) if buf.len() < HEAD_LIMIT => {}
            Ok(httparse::Status::Partial) => {
                return Ok(Err((
                    431,
                    "Request Header Fields Too Large",
                    "head too large\n".into(),
                )))
            }
            Err(e) => return Ok(Err((400, "Bad Request", format!("{e}\n")))),
        }
    }
}

/// The manifest digest the caller names; a missing or malformed one is refused.
fn named_digest(pairs: &[(String, String)]) -> Result<&str, Vec<u8>> {
    match wire::single(pairs, DIGEST_PARAM) {
        Ok(d) if valid_manifest_digest(d) => Ok(d),
        _ => Err(simple(
            403,
            "Forbidden",
            "name the manifest digest of the registry tag being restored (digest=sha256:...)\n",
        )),
    }
}

/// The one answer for a snapshot this node did not push, or pushed under another digest.
fn not_pushed() -> Vec<u8> {
    simple(
        404,
        "Not Found",
        "no snapshot this node pushed matches that name and manifest digest\n",
    )
}

fn serve_plan(
    shared: &Shared,
    sock: &mut impl Write,
    pairs: &[(String, String)],
) -> io::Result<()> {
    let name = match wire::single(pairs, "name") {
        Ok(n) if valid_snapshot_name(n) => n,
        Ok(_) => return sock.write_all(&simple(400, "Bad Request", "bad snapshot name\n")),
        Err(e) => return sock.write_all(&simple(400, "Bad Request", &format!("{e}\n"))),
    };
    let digest = match named_digest(pairs) {
        Ok(d) => d,
        Err(answer) => return sock.write_all(&answer),
    };
    // Checked before anything is read: no inspect, no directory opened.
    let Some(pushed) = shared.pushed.find(name, digest) else {
        return sock.write_all(&not_pushed());
    };
    let Some(_slot) = Slot::take(&shared.plans, MAX_PLANS) else {
        return sock.write_all(&busy("too many plan requests\n"));
    };
    let id = match (shared.resolve)(name) {
        // The local snapshot is still the one pushed (a later save gives it another id).
        Ok(Some(id)) if id == pushed.snapshot_id => id,
        Ok(_) => return sock.write_all(&not_pushed()),
        Err(e) => {
            log::warn!("peer listener: resolve snapshot {name}: {e}");
            return sock.write_all(&simple(500, "Internal Server Error", "resolve failed\n"));
        }
    };
    match build_plan(&shared.root, &id) {
        Ok(plan) => {
            let body = serde_json::to_vec(&plan).unwrap_or_default();
            sock.write_all(&response(200, "OK", "application/json", &body))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => sock.write_all(&simple(
            404,
            "Not Found",
            "snapshot has no data directory\n",
        )),
        Err(e) => {
            log::warn!("peer listener: plan of {name} ({id}): {e}");
            sock.write_all(&simple(404, "Not Found", "snapshot not servable\n"))
        }
    }
}

fn serve_slice(
    shared: &Shared,
    sock: &mut impl Write,
    pairs: &[(String, String)],
) -> io::Result<()> {
    let q = match wire::slice_query(pairs) {
        Ok(q) => q,
        Err(e) => return sock.write_all(&simple(400, "Bad Request", &format!("{e}\n"))),
    };
    let digest = match named_digest(pairs) {
        Ok(d) => d,
        Err(answer) => return sock.write_all(&answer),
    };
    if !shared.pushed.vouches_for(&q.id, digest) {
        return sock.write_all(&not_pushed());
    }
    let Some(_slot) = Slot::take(&shared.slices, MAX_SLICE_STREAMS) else {
        return sock.write_all(&busy("too many slice streams\n"));
    };
    let file = match open_snapshot_dir(&shared.root, &q.id).and_then(|d| open_member(&d, &q.file)) {
        Ok(f) => f,
        Err(_) => return sock.write_all(&simple(404, "Not Found", "no such file\n")),
    };
    let size = file.metadata()?.len();
    if q.offset + q.length > size {
        return sock.write_all(&simple(
            416,
            "Range Not Satisfiable",
            "slice beyond end of file\n",
        ));
    }
    sock.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
             Transfer-Encoding: chunked\r\nTrailer: {CRC_TRAILER}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )?;
    let mut buf = vec![0u8; CHUNK.min(q.length as usize)];
    let mut crc = 0u32;
    let mut off = q.offset;
    let end = q.offset + q.length;
    while off < end {
        let want = ((end - off) as usize).min(buf.len());
        let n = file.read_at(&mut buf[..want], off)?;
        if n == 0 {
            // The file shrank under us: cut the stream so the client sees no valid trailer.
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank"));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        sock.write_all(format!("{n:x}\r\n").as_bytes())?;
        sock.write_all(&buf[..n])?;
        sock.write_all(b"\r\n")?;
        off += n as u64;
    }
    sock.write_all(format!("0\r\n{CRC_TRAILER}: {}\r\n\r\n", crc_hex(crc)).as_bytes())?;
    sock.flush()
}

fn busy(msg: &str) -> Vec<u8> {
    let mut r = simple(503, "Service Unavailable", msg);
    // Insert Retry-After after the status line.
    let at = r
        .iter()
        .position(|&b| b == b'\n')
        .map(|p| p + 1)
        .unwrap_or(0);
    r.splice(at..at, b"Retry-After: 1\r\n".iter().copied());
    r
}

fn simple(code: u16, reason: &str, msg: &str) -> Vec<u8> {
    response(code, reason, "text/plain; charset=utf-8", msg.as_bytes())
}
