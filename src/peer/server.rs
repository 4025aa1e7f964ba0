//! The peer snapshot listener: plain HTTP serving the plan and the byte slices of local
//! snapshots to the cluster's other nodes, one short-lived thread per connection.
//!
//! It serves VM memory images, so it answers only source addresses that are a cluster Node's
//! InternalIP, opens files only inside the snapshot directory (see `store.rs`), caps open
//! connections and slice streams (503 beyond), and cuts peers that stall reading or writing.

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::metrics::admission::{Refusal, RefusalLog};

use super::store::{build_plan, open_member, open_snapshot_dir};
use super::wire::{self, crc_hex, valid_snapshot_name, CRC_TRAILER, PLAN_PATH, SLICE_PATH};

/// Concurrent slice streams; the next one gets 503.
pub const MAX_SLICE_STREAMS: usize = 128;
/// Concurrent plan requests (each may run `cocoon snapshot inspect`); the next one gets 503.
pub const MAX_PLANS: usize = 16;
/// Open connections in all; beyond, a connection is closed at accept.
pub const MAX_CONNECTIONS: usize = MAX_SLICE_STREAMS + 2 * MAX_PLANS;
/// A request head must arrive whole within this time.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// A peer that accepts no bytes for this long is cut off.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Refused (non-node) connections being answered at once; beyond, they are closed unanswered.
const MAX_REFUSING: usize = 16;
/// A refused peer gets this long to send its request and take the 403.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest request head.
const HEAD_LIMIT: usize = 8 << 10;
/// Bytes read from the file and sent per chunk.
const CHUNK: usize = 1 << 20;

/// Maps a snapshot name to the id of its directory under the snapshot directory;
/// `Ok(None)` when no such snapshot exists.
pub type Resolver = Arc<dyn Fn(&str) -> Result<Option<String>, String> + Send + Sync>;

/// The addresses allowed to fetch: the InternalIPs of the cluster's Nodes, replaced wholesale
/// by whoever lists the Nodes.
#[derive(Debug, Default)]
pub struct AllowedPeers(RwLock<HashSet<IpAddr>>);

impl AllowedPeers {
    pub fn replace(&self, ips: impl IntoIterator<Item = IpAddr>) {
        let set = ips.into_iter().map(canonical).collect();
        if let Ok(mut g) = self.0.write() {
            *g = set;
        }
    }
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.read().is_ok_and(|g| g.contains(&canonical(ip)))
    }
    pub fn len(&self) -> usize {
        self.0.read().map(|g| g.len()).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// IPv4-mapped IPv6 addresses compare as their IPv4 form.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

struct Shared {
    root: PathBuf,
    allowed: Arc<AllowedPeers>,
    resolve: Resolver,
    connections: AtomicUsize,
    slices: AtomicUsize,
    plans: AtomicUsize,
    refusing: AtomicUsize,
    refusals: Mutex<RefusalLog>,
}

/// A running listener; it lives as long as the process.
pub struct PeerServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
}

impl PeerServer {
    /// Binds `addr` and starts accepting on a thread of its own.
    pub fn start(
        addr: SocketAddr,
        root: PathBuf,
        allowed: Arc<AllowedPeers>,
        resolve: Resolver,
    ) -> io::Result<PeerServer> {
        let listener: TcpListener = crate::metrics::admission::listen(addr)?.into();
        listener.set_nonblocking(false)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            root,
            allowed,
            resolve,
            connections: AtomicUsize::new(0),
            slices: AtomicUsize::new(0),
            plans: AtomicUsize::new(0),
            refusing: AtomicUsize::new(0),
            refusals: Mutex::new(RefusalLog::new("peer")),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("peer-accept".into())
            .spawn(move || accept_loop(listener, s))?;
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
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
        let ip = canonical(peer.ip());
        if !shared.allowed.contains(ip) {
            refuse(&shared, Refusal::NotANode, ip, shared.allowed.len());
            // Answered on a thread of its own after reading the request (closing on unread
            // bytes would reset the connection and lose the answer), within a small cap.
            if let Some(slot) = OwnedSlot::take(&shared, |s| &s.refusing, MAX_REFUSING) {
                let _ = std::thread::Builder::new()
                    .name("peer-refuse".into())
                    .spawn(move || {
                        let _slot = slot;
                        let mut sock = sock;
                        let _ = sock.set_write_timeout(Some(REFUSE_TIMEOUT));
                        if read_head(&mut sock, REFUSE_TIMEOUT).is_ok() {
                            let _ =
                                sock.write_all(&simple(403, "Forbidden", "not a cluster node\n"));
                        }
                    });
            }
            continue;
        }
        if shared.connections.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            refuse(&shared, Refusal::Global, ip, MAX_CONNECTIONS);
            continue;
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("peer-conn".into())
            .spawn(move || {
                if let Err(e) = serve(&s, sock) {
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

/// A slot of a bounded count of `Shared`, movable to another thread, released on drop.
struct OwnedSlot {
    shared: Arc<Shared>,
    count: fn(&Shared) -> &AtomicUsize,
}

impl OwnedSlot {
    fn take(
        shared: &Arc<Shared>,
        count: fn(&Shared) -> &AtomicUsize,
        max: usize,
    ) -> Option<OwnedSlot> {
        let n = count(shared);
        if n.fetch_add(1, Ordering::AcqRel) >= max {
            n.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(OwnedSlot {
            shared: shared.clone(),
            count,
        })
    }
}

impl Drop for OwnedSlot {
    fn drop(&mut self) {
        (self.count)(&self.shared).fetch_sub(1, Ordering::AcqRel);
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

/// Answers one request, then closes.
fn serve(shared: &Shared, mut sock: TcpStream) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let target = match read_head(&mut sock, HEAD_TIMEOUT)? {
        Ok(t) => t,
        Err((code, reason, msg)) => return sock.write_all(&simple(code, reason, &msg)),
    };
    let Some((path, pairs)) = wire::split_target(&target) else {
        return sock.write_all(&simple(400, "Bad Request", "bad query escape\n"));
    };
    match path {
        PLAN_PATH => serve_plan(shared, &mut sock, &pairs),
        SLICE_PATH => serve_slice(shared, &mut sock, &pairs),
        _ => sock.write_all(&simple(404, "Not Found", "not found\n")),
    }
}

type Refused = (u16, &'static str, String);

/// Reads the request head within `within`; the request target of a GET.
fn read_head(sock: &mut TcpStream, within: Duration) -> io::Result<Result<String, Refused>> {
    let deadline = Instant::now() + within;
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
        sock.set_read_timeout(Some(left))?;
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

fn serve_plan(shared: &Shared, sock: &mut TcpStream, pairs: &[(String, String)]) -> io::Result<()> {
    let name = match wire::single(pairs, "name") {
        Ok(n) if valid_snapshot_name(n) => n,
        Ok(_) => return sock.write_all(&simple(400, "Bad Request", "bad snapshot name\n")),
        Err(e) => return sock.write_all(&simple(400, "Bad Request", &format!("{e}\n"))),
    };
    let Some(_slot) = Slot::take(&shared.plans, MAX_PLANS) else {
        return sock.write_all(&busy("too many plan requests\n"));
    };
    let id = match (shared.resolve)(name) {
        Ok(Some(id)) => id,
        Ok(None) => return sock.write_all(&simple(404, "Not Found", "no such snapshot\n")),
        Err(e) => {
            log::warn!("peer listener: resolve snapshot {name}: {e}");
            return sock.write_all(&simple(500, "Internal Server Error", "resolve failed\n"));
        }
    };
    let root = shared.root.clone();
    match build_plan(&root, &id) {
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
    sock: &mut TcpStream,
    pairs: &[(String, String)],
) -> io::Result<()> {
    let q = match wire::slice_query(pairs) {
        Ok(q) => q,
        Err(e) => return sock.write_all(&simple(400, "Bad Request", &format!("{e}\n"))),
    };
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

fn response(code: u16, reason: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}
