//! The pod watch as a non-blocking state machine for the single mio loop: its own TCP+TLS
//! connection, incremental HTTP/chunked/line decoding, reconnects, 410 relists with diffing.
//! Owns the watch socket and the known-pod set; it never decides what to do with a pod.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use rustls::pki_types::ServerName;
use rustls::ClientConnection;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

use super::client::{Client, WatchSession};
use super::error::{ApiStatus, KubeError};

/// Longest accepted watch line (one object).
const MAX_LINE: usize = 16 << 20;
/// Longest accepted response head.
const MAX_HEAD: usize = 64 << 10;

// ------------------------------------------------------------------------------------------
// Pure decoding: chunked transfer, lines, watch events.
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Reading the hex size line.
    Size,
    /// Inside chunk data with this many bytes left.
    Data(usize),
    /// After chunk data: expecting CRLF.
    DataEnd,
    /// After the zero chunk: trailer lines until an empty one.
    Trailer,
    Done,
}

/// Incremental decoder of a watch response body: de-chunks (when chunked) and splits lines.
/// Feed it any split of the byte stream; each complete line comes out exactly once.
#[derive(Debug)]
pub struct StreamDecoder {
    chunked: bool,
    state: Chunk,
    /// Partial chunk-size / trailer line.
    meta: Vec<u8>,
    /// Partial body line.
    line: Vec<u8>,
    /// Set when the current line overflowed MAX_LINE: skip until the next newline.
    skipping: bool,
}

impl StreamDecoder {
    pub fn new(chunked: bool) -> StreamDecoder {
        StreamDecoder {
            chunked,
            state: Chunk::Size,
            meta: Vec::new(),
            line: Vec::new(),
            skipping: false,
        }
    }

    /// True once the terminating zero-length chunk (and trailer) has been read.
    pub fn finished(&self) -> bool {
        self.state == Chunk::Done
    }

    /// Feed bytes; `on_line` gets every complete non-empty line (without CR/LF).
    pub fn feed(&mut self, mut data: &[u8], on_line: &mut dyn FnMut(&[u8])) -> Result<(), String> {
        if !self.chunked {
            self.split_lines(data, on_line);
            return Ok(());
        }
        while !data.is_empty() {
            match self.state {
                Chunk::Size | Chunk::Trailer => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        if self.meta.len() + data.len() > 4096 {
                            return Err("chunk size line too long".into());
                        }
                        self.meta.extend_from_slice(data);
                        return Ok(());
                    };
                    self.meta.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    let meta = std::mem::take(&mut self.meta);
                    let text = trim_cr(&meta);
                    if self.state == Chunk::Trailer {
                        if text.is_empty() {
                            self.state = Chunk::Done;
                        }
                        continue;
                    }
                    let hex = text.split(|&b| b == b';').next().unwrap_or_default();
                    let hex = std::str::from_utf8(hex)
                        .map_err(|_| "chunk size is not text".to_string())?;
                    let size = usize::from_str_radix(hex.trim(), 16)
                        .map_err(|_| format!("bad chunk size {:?}", hex.trim()))?;
                    self.state = if size == 0 {
                        Chunk::Trailer
                    } else {
                        Chunk::Data(size)
                    };
                }
                Chunk::Data(left) => {
                    let n = left.min(data.len());
                    self.split_lines(&data[..n], on_line);
                    data = &data[n..];
                    self.state = if n == left {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left - n)
                    };
                }
                Chunk::DataEnd => {
                    // Accept CRLF or a bare LF after chunk data.
                    let b = data[0];
                    data = &data[1..];
                    match b {
                        b'\r' => {}
                        b'\n' => self.state = Chunk::Size,
                        other => {
                            return Err(format!("expected CRLF after chunk data, got byte {other}"))
                        }
                    }
                }
                Chunk::Done => return Ok(()),
            }
        }
        Ok(())
    }

    /// End of stream: a final line without a newline is still delivered (non-chunked bodies).
    pub fn finish(&mut self, on_line: &mut dyn FnMut(&[u8])) {
        if !self.skipping {
            let line = std::mem::take(&mut self.line);
            let t = trim_cr(&line);
            if !t.is_empty() {
                on_line(t);
            }
        }
        self.line.clear();
        self.skipping = false;
    }

    fn split_lines(&mut self, mut data: &[u8], on_line: &mut dyn FnMut(&[u8])) {
        while let Some(nl) = data.iter().position(|&b| b == b'\n') {
            if self.skipping {
                self.skipping = false;
            } else if self.line.is_empty() {
                let t = trim_cr(&data[..nl]);
                if !t.is_empty() {
                    on_line(t);
                }
            } else {
                self.line.extend_from_slice(&data[..nl]);
                let line = std::mem::take(&mut self.line);
                let t = trim_cr(&line);
                if !t.is_empty() {
                    on_line(t);
                }
                self.line = line;
                self.line.clear();
            }
            data = &data[nl + 1..];
        }
        if self.skipping {
            return;
        }
        if self.line.len() + data.len() > MAX_LINE {
            log::error!("pod watch: dropping a line longer than {MAX_LINE} bytes");
            self.line.clear();
            self.skipping = true;
            return;
        }
        self.line.extend_from_slice(data);
    }
}

fn trim_cr(b: &[u8]) -> &[u8] {
    b.strip_suffix(b"\r").unwrap_or(b)
}

/// One decoded watch event.
#[derive(Clone, Debug, PartialEq)]
pub enum PodEvent {
    Added(Box<Pod>),
    Modified(Box<Pod>),
    Deleted(Box<Pod>),
    Bookmark { resource_version: String },
    Error(ApiStatus),
}

enum Object {
    Pod(Box<Pod>),
    Bookmark(String),
    Status(ApiStatus),
    Other(serde_json::Value),
}

#[derive(Deserialize)]
struct BookmarkObject {
    #[serde(default)]
    metadata: Option<BookmarkMeta>,
}

#[derive(Deserialize)]
struct BookmarkMeta {
    #[serde(default, rename = "resourceVersion")]
    resource_version: Option<String>,
}

#[derive(Deserialize)]
struct StatusObject {
    #[serde(default)]
    code: Option<u16>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

impl From<StatusObject> for ApiStatus {
    fn from(s: StatusObject) -> ApiStatus {
        ApiStatus {
            code: s.code.unwrap_or(0),
            reason: s.reason.unwrap_or_default(),
            message: s.message.unwrap_or_default(),
        }
    }
}

/// `{"type":..,"object":..}` decoded in one pass: the object's type is chosen by `type`,
/// which the API server always writes first.
struct Envelope {
    kind: String,
    object: Option<Object>,
}

impl<'de> Deserialize<'de> for Envelope {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Envelope;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a watch event object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Envelope, A::Error> {
                let mut kind: Option<String> = None;
                let mut object = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match &*key {
                        "type" => kind = Some(map.next_value()?),
                        "object" => {
                            object = Some(match kind.as_deref() {
                                Some("ADDED" | "MODIFIED" | "DELETED") => {
                                    Object::Pod(map.next_value()?)
                                }
                                Some("BOOKMARK") => {
                                    let b: BookmarkObject = map.next_value()?;
                                    Object::Bookmark(
                                        b.metadata
                                            .and_then(|m| m.resource_version)
                                            .unwrap_or_default(),
                                    )
                                }
                                Some("ERROR") => {
                                    Object::Status(map.next_value::<StatusObject>()?.into())
                                }
                                _ => Object::Other(map.next_value()?),
                            })
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let kind = kind.ok_or_else(|| de::Error::missing_field("type"))?;
                Ok(Envelope { kind, object })
            }
        }
        d.deserialize_map(V)
    }
}

/// Decode one watch line. Errors name what was wrong (and the pod, when it can be found).
pub fn decode_line(line: &[u8]) -> Result<PodEvent, String> {
    let env: Envelope = match serde_json::from_slice(line) {
        Ok(e) => e,
        Err(e) => return Err(describe_bad_line(line, &e.to_string())),
    };
    let object = match env.object {
        // `object` came before `type`: re-dispatch from the generic value.
        Some(Object::Other(v)) => match env.kind.as_str() {
            "ADDED" | "MODIFIED" | "DELETED" => Object::Pod(Box::new(
                Pod::deserialize(&v).map_err(|e| describe_bad_line(line, &e.to_string()))?,
            )),
            "BOOKMARK" => Object::Bookmark(
                v.pointer("/metadata/resourceVersion")
                    .and_then(|r| r.as_str())
                    .unwrap_or_default()
                    .to_string(),
            ),
            "ERROR" => Object::Status(
                StatusObject::deserialize(&v)
                    .map_err(|e| describe_bad_line(line, &e.to_string()))?
                    .into(),
            ),
            other => return Err(format!("unknown watch event type {other:?}")),
        },
        Some(o) => o,
        None => return Err(format!("watch event {:?} has no object", env.kind)),
    };
    Ok(match (env.kind.as_str(), object) {
        ("ADDED", Object::Pod(p)) => PodEvent::Added(p),
        ("MODIFIED", Object::Pod(p)) => PodEvent::Modified(p),
        ("DELETED", Object::Pod(p)) => PodEvent::Deleted(p),
        ("BOOKMARK", Object::Bookmark(rv)) => PodEvent::Bookmark {
            resource_version: rv,
        },
        ("ERROR", Object::Status(s)) => PodEvent::Error(s),
        (other, _) => return Err(format!("unknown watch event type {other:?}")),
    })
}

fn describe_bad_line(line: &[u8], err: &str) -> String {
    let v: Option<serde_json::Value> = serde_json::from_slice(line).ok();
    match v {
        None => {
            let shown = String::from_utf8_lossy(&line[..line.len().min(120)]);
            format!("watch line is not JSON ({err}): {shown:?}")
        }
        Some(v) => {
            let get = |p: &str| {
                v.pointer(p)
                    .and_then(|x| x.as_str())
                    .unwrap_or("?")
                    .to_string()
            };
            format!(
                "watch {} event for pod {}/{} (uid {}) does not decode: {err}",
                get("/type"),
                get("/object/metadata/namespace"),
                get("/object/metadata/name"),
                get("/object/metadata/uid"),
            )
        }
    }
}

/// Decode a whole captured stream given as arbitrary pieces (testing and benchmarking helper).
pub fn decode_stream(
    pieces: &[&[u8]],
    chunked: bool,
) -> Result<Vec<Result<PodEvent, String>>, String> {
    let mut dec = StreamDecoder::new(chunked);
    let mut out = Vec::new();
    for p in pieces {
        dec.feed(p, &mut |l| out.push(decode_line(l)))?;
    }
    dec.finish(&mut |l| out.push(decode_line(l)));
    Ok(out)
}

// ------------------------------------------------------------------------------------------
// Known-pod set: incarnations by UID, relist diffs.
// ------------------------------------------------------------------------------------------

/// What the watch hands to the daemon. Per pod key the sequence is consistent: Added, then
/// Modified*, then Deleted; a new UID under the same name is Deleted(old) + Added(new).
#[derive(Clone, Debug, PartialEq)]
pub enum WatchOutput {
    Added(Box<Pod>),
    Modified(Box<Pod>),
    Deleted(Box<Pod>),
}

fn key_of(p: &Pod) -> String {
    format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or(""),
        p.metadata.name.as_deref().unwrap_or("")
    )
}

fn uid_of(p: &Pod) -> &str {
    p.metadata.uid.as_deref().unwrap_or("")
}

fn rv_of(p: &Pod) -> &str {
    p.metadata.resource_version.as_deref().unwrap_or("")
}

/// The set of pods the daemon has been told about, keyed `namespace/name`. Only each pod's
/// identity is kept (namespace, name, uid, resourceVersion): the provider holds the full
/// objects, and a second full copy per pod was a large share of a dense node's memory. A
/// Deleted output synthesised from this set (relist, uid change) carries that identity only.
#[derive(Default, Debug)]
pub struct KnownPods {
    pods: HashMap<String, Identity>,
}

/// What `KnownPods` keeps of a pod: a few strings, not a 2 KiB `Pod` struct with its heap.
#[derive(Debug)]
struct Identity {
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
}

impl Identity {
    fn of(p: &Pod) -> Identity {
        Identity {
            namespace: p.metadata.namespace.clone(),
            name: p.metadata.name.clone(),
            uid: p.metadata.uid.clone(),
            resource_version: p.metadata.resource_version.clone(),
        }
    }

    fn uid(&self) -> &str {
        self.uid.as_deref().unwrap_or("")
    }

    /// The pod a synthesised Deleted carries.
    fn into_pod(self) -> Box<Pod> {
        Box::new(Pod {
            metadata: ObjectMeta {
                namespace: self.namespace,
                name: self.name,
                uid: self.uid,
                resource_version: self.resource_version,
                ..Default::default()
            },
            ..Default::default()
        })
    }
}

impl KnownPods {
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Apply an ADDED or MODIFIED object.
    pub fn upsert(&mut self, pod: Box<Pod>, out: &mut Vec<WatchOutput>) {
        let key = key_of(&pod);
        match self.pods.get(&key) {
            None => {
                self.pods.insert(key, Identity::of(&pod));
                out.push(WatchOutput::Added(pod));
            }
            Some(old) if old.uid() != uid_of(&pod) => {
                let old = self.pods.insert(key, Identity::of(&pod));
                if let Some(old) = old {
                    out.push(WatchOutput::Deleted(old.into_pod()));
                }
                out.push(WatchOutput::Added(pod));
            }
            Some(old)
                if !rv_of(&pod).is_empty()
                    && old.resource_version.as_deref() == Some(rv_of(&pod)) => {}
            Some(_) => {
                self.pods.insert(key, Identity::of(&pod));
                out.push(WatchOutput::Modified(pod));
            }
        }
    }

    /// Apply a DELETED object (carrying the pod's last state).
    pub fn remove(&mut self, pod: Box<Pod>, out: &mut Vec<WatchOutput>) {
        let key = key_of(&pod);
        match self.pods.remove(&key) {
            Some(old) if old.uid() == uid_of(&pod) => out.push(WatchOutput::Deleted(pod)),
            // We held an older incarnation: it is gone too; the deleted one was never delivered.
            Some(old) => out.push(WatchOutput::Deleted(old.into_pod())),
            None => {}
        }
    }

    /// Replace the set with a fresh list and report the difference, so pods that vanished
    /// while the watch was down come out as Deleted.
    pub fn replace(&mut self, list: Vec<Pod>, out: &mut Vec<WatchOutput>) {
        let mut fresh: HashMap<String, Pod> = HashMap::with_capacity(list.len());
        for p in list {
            fresh.insert(key_of(&p), p);
        }
        let mut gone: Vec<String> = self
            .pods
            .keys()
            .filter(|k| !fresh.contains_key(*k))
            .cloned()
            .collect();
        gone.sort();
        for k in gone {
            if let Some(old) = self.pods.remove(&k) {
                out.push(WatchOutput::Deleted(old.into_pod()));
            }
        }
        let mut keys: Vec<String> = fresh.keys().cloned().collect();
        keys.sort();
        for k in keys {
            if let Some(p) = fresh.remove(&k) {
                self.upsert(Box::new(p), out);
            }
        }
    }
}

/// Plaintext bytes one `on_ready` call decodes at most (about 30 pods of watch events): a
/// burst of thousands of pods is spread over many short loop turns instead of one long one,
/// and the rest waits in the socket, not as decoded pods in memory.
const READ_BUDGET: usize = 128 * 1024;

// ------------------------------------------------------------------------------------------
// The connection state machine.
// ------------------------------------------------------------------------------------------

/// Tunables of the watch.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    /// Server-side watch timeout asked for (timeoutSeconds).
    pub timeout_seconds: u64,
    /// No byte for this long on an established stream (bookmarks arrive about every minute) = stalled.
    pub stall_after: Duration,
    /// Connect + TLS + response head must finish within this.
    pub connect_timeout: Duration,
    /// Failure backoff: initial, cap.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            timeout_seconds: 300,
            stall_after: Duration::from_secs(300 + 60),
            connect_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(800),
            backoff_max: Duration::from_secs(30),
        }
    }
}

enum Transport {
    Plain,
    Tls(Box<ClientConnection>),
}

struct Conn {
    stream: TcpStream,
    transport: Transport,
    /// Request bytes not yet written (plain transport only; TLS buffers in rustls).
    out: Vec<u8>,
    connected: bool,
    head: Vec<u8>,
    body: Option<StreamDecoder>,
    opened: Instant,
    last_byte: Instant,
    events: u64,
}

/// Why a connection ended.
enum End {
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

/// The pod watch. Drive it with `on_ready` (socket readiness) and `on_timer` (at `next_due`).
pub struct PodWatch {
    node: String,
    config: WatchConfig,
    registry: Option<Registry>,
    token: Token,
    conn: Option<Conn>,
    known: KnownPods,
    resource_version: String,
    /// When to (re)connect or relist next; None while connected.
    retry_at: Option<Instant>,
    need_relist: bool,
    /// Relists are left to the caller (`wants_relist` / `relisted`) instead of blocking here.
    relist_by_caller: bool,
    /// A relist is due and the caller has not answered it yet.
    relist_wanted: bool,
    /// The last `on_ready` stopped at its read budget with bytes left: call it again without
    /// waiting for readiness (the socket is edge-triggered and will not report them again).
    read_more: bool,
    failures: u32,
    rng: u64,
    /// Counters for logs and tests.
    pub stats: WatchStats,
}

/// How often each thing happened (for metrics, logs and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchStats {
    pub connects: u64,
    pub relists: u64,
    pub events: u64,
    pub bad_lines: u64,
}

impl PodWatch {
    pub fn new(node: &str, config: WatchConfig) -> PodWatch {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        PodWatch {
            node: node.to_string(),
            config,
            registry: None,
            token: Token(usize::MAX),
            conn: None,
            known: KnownPods::default(),
            resource_version: String::new(),
            retry_at: None,
            need_relist: true,
            relist_by_caller: false,
            relist_wanted: false,
            read_more: false,
            failures: 0,
            rng: seed | 1,
            stats: WatchStats::default(),
        }
    }

    /// Give the watch the loop's registry and its token. Connections register themselves.
    pub fn register(&mut self, registry: &Registry, token: Token) -> io::Result<()> {
        self.registry = Some(registry.try_clone()?);
        self.token = token;
        Ok(())
    }

    pub fn token(&self) -> Token {
        self.token
    }

    /// The pods as the watch currently knows them.
    pub fn known(&self) -> &KnownPods {
        &self.known
    }

    /// The last resourceVersion seen (list, event or bookmark).
    pub fn resource_version(&self) -> &str {
        &self.resource_version
    }

    /// True while a watch connection is open.
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    /// When `on_timer` must next be called (reconnect, relist, stall or connect deadline).
    pub fn next_due(&self) -> Option<Instant> {
        match &self.conn {
            Some(c) if c.body.is_none() => Some(c.opened + self.config.connect_timeout),
            Some(c) => Some(c.last_byte + self.config.stall_after),
            None => self.retry_at,
        }
    }

    /// Blocking list of the node's pods; replaces the known set and returns the difference
    /// (every pod as Added on the first call). The watch then resumes from the list's version.
    pub fn relist(&mut self, client: &Client, now: Instant) -> Result<Vec<WatchOutput>, KubeError> {
        self.drop_conn();
        let list = client.list_pods_on_node(&self.node)?;
        Ok(self.apply_list(list, now))
    }

    /// From now on the watch never lists on the calling thread: when a relist is due,
    /// `wants_relist` says so and the caller lists elsewhere and hands the answer to
    /// `relisted` (the daemon's loop must not wait for a big list).
    pub fn relist_by_caller(&mut self) {
        self.relist_by_caller = true;
    }

    /// The node this watch lists pods of (the caller's list call needs it).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// True when `on_ready` left bytes unread (its per-call budget): call it again soon, from
    /// a timer, even though no readiness will be reported for them.
    pub fn read_more(&self) -> bool {
        self.read_more
    }

    /// True once when a relist became due (the caller then lists and calls `relisted`).
    pub fn wants_relist(&mut self) -> bool {
        std::mem::take(&mut self.relist_wanted)
    }

    /// The caller's list answer: on success like `relist` (the stream reconnects at the next
    /// `on_timer`); a failure backs off and asks again later.
    pub fn relisted(
        &mut self,
        list: Result<super::client::PodList, KubeError>,
        now: Instant,
    ) -> Result<Vec<WatchOutput>, KubeError> {
        match list {
            Ok(list) => {
                self.drop_conn();
                Ok(self.apply_list(list, now))
            }
            Err(e) => {
                self.need_relist = true;
                self.fail_backoff(now, None);
                Err(e)
            }
        }
    }

    fn apply_list(&mut self, list: super::client::PodList, now: Instant) -> Vec<WatchOutput> {
        self.stats.relists += 1;
        let mut out = Vec::new();
        self.known.replace(list.items, &mut out);
        self.resource_version = list.resource_version;
        self.need_relist = false;
        self.retry_at = Some(now);
        out
    }

    /// Timer: reconnect / relist when due, or abandon a stalled connection.
    pub fn on_timer(&mut self, client: &Client, now: Instant) -> Vec<WatchOutput> {
        let mut out = Vec::new();
        if let Some(c) = &self.conn {
            let stalled = match &c.body {
                None => now >= c.opened + self.config.connect_timeout,
                Some(_) => now >= c.last_byte + self.config.stall_after,
            };
            if stalled {
                let what = if c.body.is_none() {
                    "did not answer in time"
                } else {
                    "stalled"
                };
                log::warn!("pod watch: connection {what}; reconnecting");
                self.end(End::Failed(format!("watch {what}")), now);
            } else {
                return out;
            }
        }
        if self.retry_at.is_some_and(|t| now >= t) {
            self.retry_at = None;
            if self.need_relist && self.relist_by_caller {
                self.relist_wanted = true;
                return out;
            }
            if self.need_relist {
                match self.relist(client, now) {
                    Ok(o) => out = o,
                    Err(e) => {
                        log::warn!("pod watch: relist failed: {e}");
                        self.fail_backoff(now, None);
                        return out;
                    }
                }
            }
            if let Err(e) = self.connect(client, now) {
                log::warn!("pod watch: connect failed: {e}");
                if matches!(e, KubeError::Gone(_)) {
                    self.need_relist = true;
                }
                self.fail_backoff(now, None);
            }
        }
        out
    }

    /// Socket readiness for `token()`: read, decode and apply everything available.
    pub fn on_ready(&mut self, client: &Client, now: Instant) -> Vec<WatchOutput> {
        let mut out = Vec::new();
        self.read_more = false;
        let Some(mut conn) = self.conn.take() else {
            return out;
        };
        let result = self.drive(&mut conn, now, &mut out);
        match result {
            Ok(()) => self.conn = Some(conn),
            Err(end) => {
                if let End::Unauthorized(_) = end {
                    client.invalidate_credentials();
                }
                self.conn = Some(conn);
                self.end(end, now);
                // A 410 relists right away (short blocking call, per the design card).
                if self.need_relist && self.retry_at.is_some_and(|t| t <= now) {
                    out.extend(self.on_timer(client, now));
                }
            }
        }
        out
    }

    fn connect(&mut self, client: &Client, now: Instant) -> Result<(), KubeError> {
        let session: WatchSession = client.watch_session()?;
        let addr = resolve(&session.target.host, session.target.port)
            .map_err(|e| KubeError::Transport(format!("resolve {}: {e}", session.target.host)))?;
        let mut stream = TcpStream::connect(addr)
            .map_err(|e| KubeError::Transport(format!("connect {addr}: {e}")))?;
        let request = self.request_bytes(&session);
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
        if let Some(reg) = &self.registry {
            reg.register(
                &mut stream,
                self.token,
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| KubeError::Transport(format!("register watch socket: {e}")))?;
        }
        self.stats.connects += 1;
        self.conn = Some(Conn {
            stream,
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

    fn request_bytes(&self, s: &WatchSession) -> Vec<u8> {
        let mut path = format!(
            "{}/api/v1/pods?fieldSelector={}&watch=1&allowWatchBookmarks=true&timeoutSeconds={}",
            s.target.base_path,
            pct(&format!("spec.nodeName={}", self.node)),
            self.config.timeout_seconds
        );
        if !self.resource_version.is_empty() {
            path.push_str("&resourceVersion=");
            path.push_str(&pct(&self.resource_version));
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

    fn drop_conn(&mut self) {
        if let Some(mut c) = self.conn.take() {
            if let Some(reg) = &self.registry {
                let _ = reg.deregister(&mut c.stream);
            }
        }
    }

    fn end(&mut self, end: End, now: Instant) {
        let (lived, events) = self
            .conn
            .as_ref()
            .map(|c| (now.saturating_duration_since(c.opened), c.events))
            .unwrap_or_default();
        self.drop_conn();
        match end {
            End::Closed if events > 0 || lived >= Duration::from_secs(1) => {
                log::debug!(
                    "pod watch: stream ended after {lived:?} and {events} events; re-watching"
                );
                self.failures = 0;
                self.retry_at = Some(now);
            }
            End::Closed => {
                log::debug!("pod watch: stream ended at once with no events");
                self.fail_backoff(now, None);
            }
            End::Failed(m) => {
                log::warn!("pod watch: {m}");
                self.fail_backoff(now, None);
            }
            End::Gone(m) => {
                log::info!("pod watch: {m}; relisting");
                self.need_relist = true;
                self.retry_at = Some(now);
            }
            End::Unauthorized(m) => {
                log::warn!("pod watch: {m}; refreshing credentials");
                self.fail_backoff(now, None);
            }
            End::Throttled(after, m) => {
                log::warn!("pod watch: {m}");
                self.fail_backoff(now, after);
            }
        }
    }

    fn fail_backoff(&mut self, now: Instant, at_least: Option<Duration>) {
        self.failures = self.failures.saturating_add(1);
        let exp = self.failures.saturating_sub(1).min(16);
        let base = self
            .config
            .backoff_initial
            .saturating_mul(1u32 << exp)
            .min(self.config.backoff_max);
        // Jitter up to +100% (client-go's reflector uses jitter 1.0), capped at the maximum.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let frac = (self.rng % 1000) as f64 / 1000.0;
        let delay = base.mul_f64(1.0 + frac).min(self.config.backoff_max);
        let delay = delay.max(at_least.unwrap_or_default());
        self.retry_at = Some(now + delay);
    }

    /// Move bytes: finish connecting, write the request, read and decode what is there.
    fn drive(&mut self, c: &mut Conn, now: Instant, out: &mut Vec<WatchOutput>) -> Result<(), End> {
        if !c.connected {
            if let Ok(Some(e)) | Err(e) = c.stream.take_error() {
                return Err(End::Failed(format!("connect: {e}")));
            }
            match c.stream.peer_addr() {
                Ok(_) => c.connected = true,
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return Ok(()),
                Err(e) => return Err(End::Failed(format!("connect: {e}"))),
            }
        }
        let mut buf = [0u8; 32 * 1024];
        let mut plain: Vec<u8> = Vec::new();
        let mut eof = false;
        let mut more = false;
        match &mut c.transport {
            Transport::Plain => {
                while !c.out.is_empty() {
                    match c.stream.write(&c.out) {
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
                    match c.stream.read(&mut buf) {
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
                    match tls.write_tls(&mut c.stream) {
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(End::Failed(format!("send: {e}"))),
                    }
                }
                let got = match tls.read_tls(&mut c.stream) {
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
                        match tls.write_tls(&mut c.stream) {
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
            let retry_after = super::error::parse_retry_after(header("Retry-After").as_deref());
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

    fn apply_line(
        &mut self,
        c: &mut Conn,
        line: &[u8],
        out: &mut Vec<WatchOutput>,
    ) -> Result<(), End> {
        match decode_line(line) {
            Ok(ev) => {
                c.events += 1;
                self.stats.events += 1;
                self.apply_event(ev, out)
            }
            Err(msg) => {
                self.stats.bad_lines += 1;
                log::error!("pod watch: skipping: {msg}");
                Ok(())
            }
        }
    }

    fn apply_event(&mut self, ev: PodEvent, out: &mut Vec<WatchOutput>) -> Result<(), End> {
        let note_rv = |rv: &mut String, p: &Pod| {
            if let Some(v) = p
                .metadata
                .resource_version
                .as_deref()
                .filter(|v| !v.is_empty())
            {
                v.clone_into(rv);
            }
        };
        match ev {
            PodEvent::Added(p) | PodEvent::Modified(p) => {
                note_rv(&mut self.resource_version, &p);
                self.known.upsert(p, out);
            }
            PodEvent::Deleted(p) => {
                note_rv(&mut self.resource_version, &p);
                self.known.remove(p, out);
            }
            PodEvent::Bookmark { resource_version } => {
                if !resource_version.is_empty() {
                    self.resource_version = resource_version;
                }
            }
            PodEvent::Error(s) => {
                let too_large = s
                    .message
                    .to_ascii_lowercase()
                    .contains("too large resource version");
                if s.code == 410 || s.reason == "Expired" || s.reason == "Gone" || too_large {
                    return Err(End::Gone(format!("watch error {s}")));
                }
                return Err(End::Failed(format!("watch error {s}")));
            }
        }
        Ok(())
    }
}

fn resolve(host: &str, port: u16) -> io::Result<SocketAddr> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
}

/// Percent-encode a query value (everything but unreserved characters).
fn pct(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod_json(name: &str, uid: &str, rv: &str) -> String {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": rv,
                         "annotations": {"vm.cocoonstack.io/id": "x"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "agent", "image": "img"}]},
            "status": {"phase": "Pending"}
        })
        .to_string()
    }

    fn event(kind: &str, name: &str, uid: &str, rv: &str) -> String {
        format!(
            "{{\"type\":\"{kind}\",\"object\":{}}}\n",
            pod_json(name, uid, rv)
        )
    }

    fn chunk(body: &str) -> String {
        format!("{:x}\r\n{body}\r\n", body.len())
    }

    fn sample_stream() -> (String, usize) {
        let mut s = String::new();
        s += &chunk(&event("ADDED", "a", "u1", "10"));
        // Two events in one chunk, one event across two chunks.
        s += &chunk(&(event("MODIFIED", "a", "u1", "11") + &event("ADDED", "b", "u2", "12")));
        let e = event("DELETED", "a", "u1", "13");
        let (x, y) = e.split_at(40);
        s += &chunk(x);
        s += &format!("{:x};ext=1\r\n{y}\r\n", y.len());
        s += &chunk("not json at all\n");
        s += &chunk("{\"type\":\"BOOKMARK\",\"object\":{\"kind\":\"Pod\",\"apiVersion\":\"v1\",\"metadata\":{\"resourceVersion\":\"20\"}}}\n");
        s += &chunk("{\"type\":\"ERROR\",\"object\":{\"kind\":\"Status\",\"code\":410,\"reason\":\"Expired\",\"message\":\"too old resource version: 1 (5)\"}}\n");
        s += "0\r\n\r\n";
        (s, 7)
    }

    fn summarize(evs: &[Result<PodEvent, String>]) -> Vec<String> {
        evs.iter()
            .map(|e| match e {
                Ok(PodEvent::Added(p)) => format!("A {}", rv_of(p)),
                Ok(PodEvent::Modified(p)) => format!("M {}", rv_of(p)),
                Ok(PodEvent::Deleted(p)) => format!("D {}", rv_of(p)),
                Ok(PodEvent::Bookmark { resource_version }) => format!("B {resource_version}"),
                Ok(PodEvent::Error(s)) => format!("E {} {}", s.code, s.reason),
                Err(_) => "bad".to_string(),
            })
            .collect()
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let (stream, n) = sample_stream();
        let bytes = stream.as_bytes();
        let whole = decode_stream(&[bytes], true).unwrap();
        assert_eq!(whole.len(), n);
        let expect = vec![
            "A 10",
            "M 11",
            "A 12",
            "D 13",
            "bad",
            "B 20",
            "E 410 Expired",
        ];
        assert_eq!(summarize(&whole), expect);
        for i in 0..=bytes.len() {
            let got = decode_stream(&[&bytes[..i], &bytes[i..]], true).unwrap();
            assert_eq!(summarize(&got), expect, "split at {i}");
        }
        // Three-way splits on a coarser grid, and byte-at-a-time.
        for i in (0..bytes.len()).step_by(7) {
            for j in (i..bytes.len()).step_by(13) {
                let got = decode_stream(&[&bytes[..i], &bytes[i..j], &bytes[j..]], true).unwrap();
                assert_eq!(summarize(&got), expect, "split at {i},{j}");
            }
        }
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(summarize(&decode_stream(&singles, true).unwrap()), expect);
    }

    #[test]
    fn unchunked_stream_and_final_line_without_newline() {
        let s =
            event("ADDED", "a", "u1", "1") + "\r\n" + event("MODIFIED", "a", "u1", "2").trim_end();
        let b = s.as_bytes();
        for i in 0..=b.len() {
            let got = decode_stream(&[&b[..i], &b[i..]], false).unwrap();
            assert_eq!(summarize(&got), vec!["A 1", "M 2"], "split at {i}");
        }
    }

    #[test]
    fn bad_chunk_framing_is_an_error_not_a_panic() {
        assert!(decode_stream(&[b"zz\r\n"], true).is_err());
        assert!(decode_stream(&[b"3\r\nabcX"], true).is_err());
        assert!(decode_stream(&[&[b'1'; 5000]], true).is_err());
    }

    #[test]
    fn undecodable_pod_is_reported_by_name_and_skipped() {
        let bad = "{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"name\":\"p\",\"namespace\":\"ns\",\"uid\":\"u\"},\"spec\":{\"containers\":5}}}\n";
        let s = bad.to_string() + &event("ADDED", "q", "u9", "3");
        let got = decode_stream(&[s.as_bytes()], false).unwrap();
        let msg = got[0].as_ref().unwrap_err();
        assert!(msg.contains("ns/p") && msg.contains("uid u"), "{msg}");
        assert_eq!(summarize(&got[1..]), vec!["A 3"]);
        // `object` before `type` still decodes.
        let rev = format!(
            "{{\"object\":{},\"type\":\"MODIFIED\"}}",
            pod_json("a", "u", "7")
        );
        assert_eq!(summarize(&[decode_line(rev.as_bytes())]), vec!["M 7"]);
        assert!(decode_line(b"{\"type\":\"WEIRD\",\"object\":{}}").is_err());
        assert!(decode_line(b"{\"object\":{}}").is_err());
    }

    fn pod(name: &str, uid: &str, rv: &str) -> Box<Pod> {
        Box::new(serde_json::from_str(&pod_json(name, uid, rv)).unwrap())
    }

    fn outs(o: &[WatchOutput]) -> Vec<String> {
        o.iter()
            .map(|w| match w {
                WatchOutput::Added(p) => format!("A {} {}", key_of(p), uid_of(p)),
                WatchOutput::Modified(p) => format!("M {} {}", key_of(p), uid_of(p)),
                WatchOutput::Deleted(p) => format!("D {} {}", key_of(p), uid_of(p)),
            })
            .collect()
    }

    #[test]
    fn incarnations_and_relist_diff() {
        let mut k = KnownPods::default();
        let mut o = Vec::new();
        k.upsert(pod("a", "u1", "1"), &mut o);
        k.upsert(pod("a", "u1", "1"), &mut o); // duplicate: nothing
        k.upsert(pod("a", "u1", "2"), &mut o);
        k.upsert(pod("a", "u2", "3"), &mut o); // new incarnation
        k.upsert(pod("b", "u3", "4"), &mut o);
        k.remove(pod("c", "u4", "5"), &mut o); // never known: nothing
        assert_eq!(
            outs(&o),
            vec![
                "A ns/a u1",
                "M ns/a u1",
                "D ns/a u1",
                "A ns/a u2",
                "A ns/b u3"
            ]
        );
        o.clear();
        // Relist: b vanished while down, a recreated, c new.
        k.replace(vec![*pod("a", "u5", "9"), *pod("c", "u6", "9")], &mut o);
        assert_eq!(
            outs(&o),
            vec!["D ns/b u3", "D ns/a u2", "A ns/a u5", "A ns/c u6"]
        );
        assert_eq!(k.len(), 2);
        o.clear();
        // Deleted for a newer incarnation than we hold: the held one is reported gone.
        k.remove(pod("a", "u7", "10"), &mut o);
        assert_eq!(outs(&o), vec!["D ns/a u5"]);
    }

    #[test]
    fn percent_encoding() {
        assert_eq!(pct("spec.nodeName=a b"), "spec.nodeName%3Da%20b");
    }
}
