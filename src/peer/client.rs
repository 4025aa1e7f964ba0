//! The peer restore client: fetches a snapshot's raw files from the node that pushed it into a
//! fresh staging directory, checked slice by slice, ready for `cocoon vm clone --from-dir`.
//!
//! Blocking; runs on a worker thread. It speaks TLS with the node's client certificate and
//! names the tag's manifest digest, as the listener requires; it does not authenticate the
//! peer, because every file is checked against the registry manifest's layer digests before
//! the copy is handed out. Any failure removes the staging directory, so a bad, lying or
//! interrupted transfer leaves nothing behind and the caller falls back to the registry.

use std::collections::{BTreeMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, StreamOwned};

use crate::metrics::Metrics;
use crate::snapshots::format::{envelope_for_import, import_mode, LayerRef, SnapshotConfig};

use super::verify::{self, FileCheck, VerifyError};

use super::wire::{
    self, crc_hex, plain_component, valid_manifest_digest, Plan, PlanFile, Slice, CRC_TRAILER,
    DIGEST_PARAM, ENVELOPE_NAME, MAX_SLICE_LEN, PLAN_PATH, SLICE_PATH,
};

/// Peer restores running at once on this node; more wait.
pub const MAX_CONCURRENT_RESTORES: usize = 2;
/// Slice streams one restore keeps open at once by default: one stream leaves the link idle
/// while each slice's response starts and its last write lands.
pub const SLICE_STREAMS: usize = 4;
/// Slice streams one restore may open at most (the peer answers 128 node-wide).
const MAX_SLICE_STREAMS: usize = 16;
/// Connecting to a peer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A peer that sends nothing for this long has failed.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest plan document accepted.
const PLAN_LIMIT: u64 = 4 << 20;
/// Most files a plan may list.
const MAX_FILES: usize = 4096;

/// One restore: where to fetch from and what the registry says the snapshot is.
#[derive(Debug, Clone)]
pub struct PeerRestore {
    /// The source node's InternalIP and this node's configured peer port.
    pub peer: SocketAddr,
    /// This node's InternalIP: connections leave from it, so the peer's allowlist (cluster
    /// Nodes' InternalIPs) recognises us on a multi-homed host. None = the kernel's choice.
    pub source: Option<std::net::IpAddr>,
    /// The snapshot name asked for (the VM name, as the pushing node saved it).
    pub snapshot: String,
    /// The name written into the staged `snapshot.json`.
    pub local_name: String,
    /// The registry's config of the tag being restored: its `snapshotId` must match the
    /// peer's plan, and it fills the staged envelope.
    pub expected: SnapshotConfig,
    /// The same manifest's layers: every staged byte is checked against their digests.
    pub layers: Vec<LayerRef>,
    /// That manifest's digest (`sha256:<hex>`): the peer serves only a caller naming it.
    pub manifest_digest: String,
    /// TLS with this node's client certificate (see `client_tls`).
    pub tls: Arc<ClientConfig>,
    /// `VK_STAGING_DIR`.
    pub staging_root: PathBuf,
    /// Slice streams at once (`SLICE_STREAMS` in the daemon; 1 = one after another).
    pub streams: usize,
}

/// What a finished restore produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    /// The directory to hand to `vm clone --from-dir`; the caller removes it after the clone.
    pub dir: PathBuf,
    /// Data bytes transferred.
    pub bytes: u64,
}

/// Why a peer restore failed; the caller falls back to the registry. Display is the text
/// logged and carried in the core's fallback reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreError {
    /// The request names nothing a peer could serve: a bad snapshot name or manifest digest,
    /// or a registry config without a snapshotId.
    Request(String),
    /// The registry's manifest cannot vouch for a raw copy, or a staged file is not its bytes.
    Verify(VerifyError),
    /// The peer's plan disagrees with the registry tag or breaks the plan's rules.
    Plan(String),
    /// The connection to the peer, or its answer, failed.
    Peer { peer: SocketAddr, what: String },
    /// The staging directory or a staged file could not be written.
    Staging(String),
    /// A slice stream died without saying why.
    Stream,
}

impl RestoreError {
    fn peer(peer: SocketAddr, what: impl Into<String>) -> RestoreError {
        RestoreError::Peer {
            peer,
            what: what.into(),
        }
    }
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestoreError::Request(m) | RestoreError::Plan(m) | RestoreError::Staging(m) => {
                f.write_str(m)
            }
            RestoreError::Verify(e) => e.fmt(f),
            RestoreError::Peer { peer, what } => write!(f, "{peer}: {what}"),
            RestoreError::Stream => f.write_str("a slice stream failed"),
        }
    }
}

impl std::error::Error for RestoreError {}

impl From<VerifyError> for RestoreError {
    fn from(e: VerifyError) -> RestoreError {
        RestoreError::Verify(e)
    }
}

/// Node-wide cap on concurrent restores.
static RUNNING: Mutex<usize> = Mutex::new(0);
static FREED: Condvar = Condvar::new();

struct Permit;

impl Permit {
    fn acquire() -> Permit {
        let mut n = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= MAX_CONCURRENT_RESTORES {
            n = FREED.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
        Permit
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut n = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        FREED.notify_one();
    }
}

/// Runs `req` under the node-wide gate and counts it in
/// `snapshot_peer_restore_total{result}` and `snapshot_peer_restore_duration_seconds{namespace}`.
pub fn restore_counted(
    req: &PeerRestore,
    metrics: &Metrics,
    namespace: &str,
) -> Result<Staged, RestoreError> {
    let _permit = Permit::acquire();
    let started = Instant::now();
    let out = restore(req);
    let result = if out.is_ok() { "ok" } else { "failed" };
    metrics
        .snapshot_peer_restore_total
        .with_label_values(&[result])
        .inc();
    if out.is_ok() {
        metrics
            .snapshot_peer_restore_duration_seconds
            .with_label_values(&[namespace])
            .observe(started.elapsed().as_secs_f64());
    }
    out
}

/// Fetches the plan and every slice into a new directory under the staging root.
pub fn restore(req: &PeerRestore) -> Result<Staged, RestoreError> {
    if !wire::valid_snapshot_name(&req.snapshot) {
        return Err(RestoreError::Request(format!(
            "snapshot name {:?} is not valid",
            req.snapshot
        )));
    }
    if req.expected.snapshot_id.is_empty() {
        return Err(RestoreError::Request(
            "the registry config has no snapshotId to check the peer against".into(),
        ));
    }
    if !valid_manifest_digest(&req.manifest_digest) {
        return Err(RestoreError::Request(format!(
            "manifest digest {:?} is not a sha256 digest",
            req.manifest_digest
        )));
    }
    // Before any connection: a snapshot whose files cannot be checked is not fetched.
    let checks = verify::expectations(&req.expected, &req.layers)?;
    let target = format!(
        "{PLAN_PATH}?name={}&{DIGEST_PARAM}={}",
        wire::percent_encode(&req.snapshot),
        wire::percent_encode(&req.manifest_digest)
    );
    let mut resp = get(req, &target)?;
    if resp.status != 200 {
        return Err(RestoreError::peer(
            req.peer,
            format!("plan: HTTP {}", resp.status),
        ));
    }
    let body = resp.body_to_end(PLAN_LIMIT)?;
    let plan: Plan = serde_json::from_slice(&body)
        .map_err(|e| RestoreError::peer(req.peer, format!("plan: {e}")))?;
    check_plan(&plan, &req.expected, &checks)?;

    std::fs::create_dir_all(&req.staging_root).map_err(|e| {
        RestoreError::Staging(format!("staging dir {}: {e}", req.staging_root.display()))
    })?;
    let dir = req.staging_root.join(unique_name(&req.local_name));
    std::fs::create_dir(&dir)
        .map_err(|e| RestoreError::Staging(format!("staging {}: {e}", dir.display())))?;
    match fill(req, &plan, &checks, &dir) {
        Ok(bytes) => Ok(Staged { dir, bytes }),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

/// `<local name>.<pid>-<nanos>`: never reused, and tells the sweep which process made it.
fn unique_name(local: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let base: String = local
        .chars()
        .map(|c| {
            if plain_component(&c.to_string()) && c != ':' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{base}.{}-{nanos}", std::process::id())
}

/// The plan must describe the registry's snapshot and stay inside its own files, and list
/// every file the manifest has, at the size the manifest gives.
fn check_plan(
    plan: &Plan,
    expected: &SnapshotConfig,
    checks: &BTreeMap<String, FileCheck>,
) -> Result<(), RestoreError> {
    let bad = RestoreError::Plan;
    if plan.snapshot_id != expected.snapshot_id {
        return Err(bad(format!(
            "peer holds snapshot {:?}, the registry tag is {:?}",
            plan.snapshot_id, expected.snapshot_id
        )));
    }
    if plan.files.len() > MAX_FILES {
        return Err(bad(format!("plan lists {} files", plan.files.len())));
    }
    let mut seen = HashSet::new();
    for f in &plan.files {
        if !plain_component(&f.name) || f.name == ENVELOPE_NAME || !seen.insert(f.name.as_str()) {
            return Err(bad(format!("plan file name {:?} refused", f.name)));
        }
        let mut end = 0u64;
        for s in &f.slices {
            let stop = s.offset.saturating_add(s.length);
            if s.length == 0 || s.length > MAX_SLICE_LEN || s.offset < end || stop > f.size {
                return Err(bad(format!("plan file {}: bad slice {s:?}", f.name)));
            }
            end = stop;
        }
        if let Some(check) = checks.get(&f.name) {
            if check.logical_size != f.size {
                return Err(bad(format!(
                    "plan file {}: {} bytes, the registry's layers say {}",
                    f.name, f.size, check.logical_size
                )));
            }
        }
        if let Some(meta) = expected.files.get(&f.name) {
            let logical = if meta.sparse_size > 0 {
                meta.sparse_size
            } else {
                meta.size
            };
            if logical > 0 && logical as u64 != f.size {
                return Err(bad(format!(
                    "plan file {}: {} bytes, the registry says {logical}",
                    f.name, f.size
                )));
            }
        }
    }
    if let Some(missing) = expected
        .files
        .keys()
        .chain(checks.keys())
        .find(|k| !seen.contains(k.as_str()) && k.as_str() != ENVELOPE_NAME)
    {
        return Err(bad(format!(
            "peer lacks file {missing} of the registry snapshot"
        )));
    }
    Ok(())
}

/// Writes every file of the plan that the manifest lists, each checked against its layer
/// digests, and the envelope into `dir`; returns the data bytes.
fn fill(
    req: &PeerRestore,
    plan: &Plan,
    checks: &BTreeMap<String, FileCheck>,
    dir: &Path,
) -> Result<u64, RestoreError> {
    let staging = |what: &str, path: &Path, e: io::Error| {
        RestoreError::Staging(format!("{what} {}: {e}", path.display()))
    };
    // Every file is created at its full size first; the slices then land anywhere in it.
    let mut files: Vec<(&PlanFile, &FileCheck, File)> = Vec::new();
    for f in &plan.files {
        let Some(check) = checks.get(&f.name) else {
            // Not in the export the tag was pushed from: a registry import would not have
            // it either, and nothing vouches for its bytes.
            log::info!(
                "peer restore: {} skips {}: not in the manifest",
                req.snapshot,
                f.name
            );
            continue;
        };
        let mode = import_mode(req.expected.files.get(&f.name).map(|m| m.mode).unwrap_or(0));
        let path = dir.join(&f.name);
        // Read too: the digest check reads the file back.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .map_err(|e| staging("create", &path, e))?;
        file.set_len(f.size)
            .map_err(|e| staging("size", &path, e))?;
        files.push((f, check, file));
    }
    let jobs: Vec<(usize, Slice)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, (f, _, _))| f.slices.iter().map(move |s| (i, *s)))
        .collect();
    let bytes = fetch_all(req, &plan.snapshot_id, &files, &jobs)?;
    for (f, check, file) in &files {
        verify::verify(file, check, &f.slices, &f.name)?;
    }
    let envelope = envelope_for_import(&req.expected, &req.local_name);
    let path = dir.join(ENVELOPE_NAME);
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&path)
        .map_err(|e| staging("create", &path, e))?;
    // No fsync: the clone reads the files through the page cache right after, and a crash
    // before then leaves an entry the next start's sweep removes.
    out.write_all(&envelope)
        .map_err(|e| staging("write", &path, e))?;
    Ok(bytes)
}

/// Fetches every (file, slice) job over up to `req.streams` connections at once; the first
/// failure stops the others after their current slice. Returns the data bytes.
fn fetch_all(
    req: &PeerRestore,
    snapshot_id: &str,
    files: &[(&PlanFile, &FileCheck, File)],
    jobs: &[(usize, Slice)],
) -> Result<u64, RestoreError> {
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let failed: Mutex<Option<RestoreError>> = Mutex::new(None);
    let stopped = || failed.lock().map(|f| f.is_some()).unwrap_or(true);
    let fail = |e: RestoreError| {
        if let Ok(mut f) = failed.lock() {
            f.get_or_insert(e);
        }
    };
    let worker = || {
        while !stopped() {
            let Some(&(i, slice)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            let (f, _, file) = &files[i];
            match fetch_slice(req, snapshot_id, &f.name, slice, file) {
                Ok(()) => {
                    bytes.fetch_add(slice.length, Ordering::Relaxed);
                }
                Err(e) => return fail(e),
            }
        }
    };
    let streams = req
        .streams
        .clamp(1, MAX_SLICE_STREAMS)
        .min(jobs.len().max(1));
    std::thread::scope(|scope| {
        for n in 1..streams {
            let spawned = std::thread::Builder::new()
                .name(format!("vk-peer-{n}"))
                .spawn_scoped(scope, worker);
            if let Err(e) = spawned {
                // Fewer streams, not a failure: this thread still fetches everything.
                log::warn!("peer restore: slice stream {n} not started: {e}");
                break;
            }
        }
        worker();
    });
    match failed.into_inner() {
        Ok(Some(e)) => Err(e),
        Ok(None) => Ok(bytes.into_inner()),
        Err(_) => Err(RestoreError::Stream),
    }
}

/// GETs one slice into `file` at its offset, checked against its CRC-32C trailer.
fn fetch_slice(
    req: &PeerRestore,
    snapshot_id: &str,
    name: &str,
    s: Slice,
    file: &File,
) -> Result<(), RestoreError> {
    let target = format!(
        "{SLICE_PATH}?id={}&file={}&offset={}&length={}&{DIGEST_PARAM}={}",
        wire::percent_encode(snapshot_id),
        wire::percent_encode(name),
        s.offset,
        s.length,
        wire::percent_encode(&req.manifest_digest)
    );
    let mut resp = get(req, &target)?;
    if resp.status != 200 {
        return Err(RestoreError::peer(
            req.peer,
            format!("slice {name} @{}: HTTP {}", s.offset, resp.status),
        ));
    }
    let crc = resp.body_into_file(file, s.offset, s.length)?;
    let trailer = resp.trailer(CRC_TRAILER);
    if trailer.as_deref() != Some(crc_hex(crc).as_str()) {
        return Err(RestoreError::peer(
            req.peer,
            format!(
                "slice {name} @{}+{}: CRC-32C {} but the peer says {:?}",
                s.offset,
                s.length,
                crc_hex(crc),
                trailer
            ),
        ));
    }
    Ok(())
}

/// A client configuration presenting the node's client certificate (PEM chain and key, from
/// the kubeconfig). The peer's serving certificate is not checked: its CA may be one this
/// node does not know, and what it sends is checked against the registry's digests anyway.
pub fn client_tls(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<ClientConfig>, crate::kube::tls::TlsError> {
    crate::kube::tls::unverified_client_config(cert_pem, key_pem)
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

/// A response being read: status, framing, and the trailers once the body is done.
struct Response {
    status: u16,
    chunked: bool,
    length: Option<u64>,
    reader: BufReader<Tls>,
    trailers: Vec<(String, String)>,
    peer: SocketAddr,
}

/// One GET to `req.peer` over a TLS connection of its own.
fn get(req: &PeerRestore, target: &str) -> Result<Response, RestoreError> {
    let peer = req.peer;
    let err = |e: io::Error| RestoreError::peer(peer, e.to_string());
    let sock = connect(peer, req.source).map_err(err)?;
    sock.set_read_timeout(Some(READ_TIMEOUT)).map_err(err)?;
    sock.set_write_timeout(Some(READ_TIMEOUT)).map_err(err)?;
    sock.set_nodelay(true).map_err(err)?;
    let conn = ClientConnection::new(req.tls.clone(), ServerName::IpAddress(peer.ip().into()))
        .map_err(|e| RestoreError::peer(peer, format!("TLS: {e}")))?;
    let mut sock = StreamOwned::new(conn, sock);
    let head = format!(
        "GET {target} HTTP/1.1\r\nHost: {peer}\r\nUser-Agent: vk-cocoon\r\nTE: trailers\r\nConnection: close\r\n\r\n"
    );
    // The handshake runs here, then the request goes out as one record.
    sock.write_all(head.as_bytes()).map_err(err)?;
    sock.flush().map_err(err)?;
    let mut reader = BufReader::with_capacity(1 << 20, sock);
    let mut head = Vec::new();
    loop {
        let before = head.len();
        read_line(&mut reader, &mut head, 16 << 10).map_err(err)?;
        if head.len() == before {
            return Err(RestoreError::peer(
                peer,
                "connection closed in the response head",
            ));
        }
        if head.ends_with(b"\r\n\r\n") || head == b"\r\n" {
            break;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut r = httparse::Response::new(&mut headers);
    match r.parse(&head) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return Err(RestoreError::peer(peer, "malformed response head")),
    }
    let mut chunked = false;
    let mut length = None;
    for h in r.headers.iter() {
        let v = String::from_utf8_lossy(h.value);
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.trim().eq_ignore_ascii_case("chunked");
        } else if h.name.eq_ignore_ascii_case("content-length") {
            length = v.trim().parse::<u64>().ok();
        }
    }
    Ok(Response {
        status: r.code.unwrap_or(0),
        chunked,
        length,
        reader,
        trailers: Vec::new(),
        peer,
    })
}

fn connect(peer: SocketAddr, source: Option<std::net::IpAddr>) -> io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(peer), Type::STREAM, None)?;
    if let Some(ip) = source.filter(|ip| ip.is_ipv4() == peer.is_ipv4()) {
        s.bind(&SocketAddr::new(ip, 0).into())?;
    }
    s.connect_timeout(&peer.into(), CONNECT_TIMEOUT)?;
    Ok(s.into())
}

/// Appends one line (with its `\n`) to `out`, failing past `limit` bytes in all.
fn read_line(r: &mut impl BufRead, out: &mut Vec<u8>, limit: usize) -> io::Result<()> {
    let mut limited = r.take((limit.saturating_sub(out.len())) as u64 + 1);
    limited.read_until(b'\n', out)?;
    if out.len() > limit {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
    }
    Ok(())
}

impl Response {
    fn err(&self, what: &str) -> RestoreError {
        RestoreError::peer(self.peer, what)
    }

    /// The whole body, at most `limit` bytes.
    fn body_to_end(&mut self, limit: u64) -> Result<Vec<u8>, RestoreError> {
        let mut out = Vec::new();
        if self.chunked {
            self.chunks(limit, |b| {
                out.extend_from_slice(b);
                Ok(())
            })?;
        } else {
            let n = self
                .length
                .ok_or_else(|| self.err("response without a length"))?;
            if n > limit {
                return Err(self.err("response too large"));
            }
            (&mut self.reader)
                .take(n)
                .read_to_end(&mut out)
                .map_err(|e| self.err(&e.to_string()))?;
            if out.len() as u64 != n {
                return Err(self.err("response body cut short"));
            }
        }
        Ok(out)
    }

    /// Streams exactly `length` body bytes into `file` at `offset`; returns their CRC-32C.
    fn body_into_file(
        &mut self,
        file: &File,
        offset: u64,
        length: u64,
    ) -> Result<u32, RestoreError> {
        if !self.chunked {
            return Err(self.err("slice not chunked: it carries no checksum trailer"));
        }
        let mut crc = 0u32;
        let mut at = offset;
        let got = self.chunks(length, |b| {
            crc = crc32c::crc32c_append(crc, b);
            file.write_all_at(b, at)?;
            at += b.len() as u64;
            Ok(())
        })?;
        if got != length {
            return Err(self.err(&format!("slice of {length} bytes carried {got}")));
        }
        Ok(crc)
    }

    fn trailer(&self, name: &str) -> Option<String> {
        self.trailers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }

    /// Decodes a chunked body, handing the data to `sink`, and keeps its trailers; fails past
    /// `limit` data bytes. Returns the data bytes seen.
    fn chunks(
        &mut self,
        limit: u64,
        mut sink: impl FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<u64, RestoreError> {
        let peer = self.peer;
        let e = move |e: io::Error| RestoreError::peer(peer, e.to_string());
        let mut total = 0u64;
        let mut line = Vec::new();
        loop {
            line.clear();
            read_line(&mut self.reader, &mut line, 1024).map_err(e)?;
            if !line.ends_with(b"\n") {
                return Err(self.err("body cut short"));
            }
            let text = String::from_utf8_lossy(&line);
            let hex = text.trim_end().split(';').next().unwrap_or("").trim();
            let size = u64::from_str_radix(hex, 16).map_err(|_| self.err("bad chunk size"))?;
            if size == 0 {
                break;
            }
            total = total.saturating_add(size);
            if total > limit {
                return Err(self.err("body longer than expected"));
            }
            let mut left = size;
            while left > 0 {
                let buf = self.reader.fill_buf().map_err(e)?;
                if buf.is_empty() {
                    return Err(self.err("body cut short"));
                }
                let n = buf.len().min(left as usize);
                sink(&buf[..n]).map_err(e)?;
                self.reader.consume(n);
                left -= n as u64;
            }
            let mut crlf = [0u8; 2];
            self.reader.read_exact(&mut crlf).map_err(e)?;
            if &crlf != b"\r\n" {
                return Err(self.err("bad chunk framing"));
            }
        }
        let mut trailer_bytes = 0usize;
        loop {
            line.clear();
            read_line(&mut self.reader, &mut line, 8 << 10).map_err(e)?;
            if !line.ends_with(b"\n") {
                return Err(self.err("trailers cut short"));
            }
            trailer_bytes += line.len();
            if trailer_bytes > 8 << 10 {
                return Err(self.err("trailers too long"));
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end();
            if text.is_empty() {
                break;
            }
            if let Some((k, v)) = text.split_once(':') {
                self.trailers
                    .push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        Ok(total)
    }
}
