//! Watch streams: resourceVersion start points, initial events, field/label-selected
//! ADDED/MODIFIED/DELETED, BOOKMARKs, 410 on compacted history, timeouts and injected drops.

use super::faults::Fault;
use super::handlers::ResourcePath;
use super::http::{self, Request};
use super::meta::ApiError;
use super::resources::ResourceDef;
use super::select::Selector;
use super::store::{self, Change, ChangeType, WaitOutcome};
use super::table;
use super::Shared;
use serde_json::{json, Value};
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often an otherwise idle watch checks whether its peer went away.
const PEER_CHECK: Duration = Duration::from_millis(500);

/// A parsed watch request.
pub struct WatchSpec {
    pub def: &'static ResourceDef,
    pub namespace: Option<String>,
    pub selector: Selector,
    /// Start after this version; None = send the current state as ADDED first.
    pub start_rv: Option<u64>,
    pub bookmarks: bool,
    pub send_initial_events: bool,
    pub timeout: Duration,
    /// Answer with an ERROR 410 event (injected fault) instead of streaming.
    pub inject_gone_event: bool,
    /// Render objects as one-row meta.k8s.io/v1 Tables (kubectl get -w); the value is
    /// `includeObject`. Column definitions go in the first event only, as the real server does.
    pub table: Option<String>,
}

impl WatchSpec {
    pub fn from_request(
        shared: &Shared,
        req: &Request,
        rp: &ResourcePath,
    ) -> Result<WatchSpec, ApiError> {
        let mut field = req.query("fieldSelector").unwrap_or("").to_string();
        if let Some(name) = &rp.name {
            // GET .../pods/<name>?watch=1 watches one object.
            if !field.is_empty() {
                field.push(',');
            }
            field.push_str(&format!("metadata.name={name}"));
        }
        let selector = Selector::parse(Some(&field), req.query("labelSelector"))?;
        let rv = req.query("resourceVersion").unwrap_or("");
        let send_initial_events = req.query_flag("sendInitialEvents");
        let start_rv = match rv {
            "" | "0" => None,
            _ if send_initial_events => None,
            v => Some(
                v.parse::<u64>()
                    .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {v:?}")))?,
            ),
        };
        let timeout = match req.query("timeoutSeconds") {
            Some(t) => Duration::from_secs(
                t.parse::<u64>()
                    .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
            ),
            None => shared.default_watch_timeout(),
        };
        Ok(WatchSpec {
            def: rp.def,
            namespace: rp.namespace.clone(),
            selector,
            start_rv,
            bookmarks: req.query_flag("allowWatchBookmarks"),
            send_initial_events,
            timeout,
            inject_gone_event: false,
            table: table::wants_table(req.header("accept"))
                .then(|| req.query("includeObject").unwrap_or("").to_string()),
        })
    }

    fn in_scope(&self, obj: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| ns == store::obj_namespace(obj))
            && self.selector.matches(obj)
    }

    /// The event a change produces for this watch, honouring selector entry and exit.
    fn event_for(&self, c: &Change) -> Option<(&'static str, Value)> {
        let now = self.in_scope(&c.object);
        let before = c.prev.as_deref().is_some_and(|p| self.in_scope(p));
        let (ty, obj) = match (c.change, before, now) {
            (ChangeType::Added, _, true) => ("ADDED", (*c.object).clone()),
            (ChangeType::Deleted, _, true) => ("DELETED", (*c.object).clone()),
            (ChangeType::Modified, true, true) => ("MODIFIED", (*c.object).clone()),
            (ChangeType::Modified, false, true) => ("ADDED", (*c.object).clone()),
            (ChangeType::Modified, true, false) => {
                // Left the selector: DELETED with the last state that matched, at this version.
                let mut prev = c.prev.as_deref().cloned().unwrap_or(Value::Null);
                store::metadata_mut(&mut prev)
                    .insert("resourceVersion".into(), json!(c.rv.to_string()));
                ("DELETED", prev)
            }
            _ => return None,
        };
        Some((ty, obj))
    }
}

/// How a watch ended, which decides how the connection is closed.
pub enum WatchEnd {
    /// Finished the chunked body properly (timeout, 410): the connection serves on.
    Clean,
    /// Cut (drop fault, stop, peer gone): close the socket without finishing the body.
    Abrupt,
}

/// Encodes change events, turning objects into Table rows when the client asked for tables.
struct Encoder<'a> {
    def: &'static ResourceDef,
    table: Option<&'a str>,
    columns_sent: bool,
}

impl Encoder<'_> {
    fn change(&mut self, out: &mut Vec<u8>, ty: &str, obj: &Value) {
        match self.table {
            None => line(out, &json!({"type": ty, "object": obj})),
            Some(include) => {
                let rv = store::obj_rv(obj).parse().unwrap_or(0);
                let mut t = table::table(self.def, &[Arc::new(obj.clone())], rv, include);
                if self.columns_sent {
                    t["columnDefinitions"] = Value::Null;
                }
                self.columns_sent = true;
                line(out, &json!({"type": ty, "object": t}));
            }
        }
    }
}

fn line(out: &mut Vec<u8>, event: &Value) {
    let mut data = serde_json::to_vec(event).unwrap_or_default();
    data.push(b'\n');
    http::encode_chunk(out, &data);
}

fn gone_event(asked: u64, oldest: u64) -> Value {
    json!({"type": "ERROR", "object": ApiError::expired(format!(
        "too old resource version: {asked} ({oldest})"
    )).status()})
}

fn bookmark(def: &ResourceDef, rv: u64, initial_end: bool) -> Value {
    let mut md = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        md["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"type": "BOOKMARK", "object": {"kind": def.kind, "apiVersion": def.api_version(), "metadata": md}})
}

/// True when the peer has closed (or reset) the TCP connection.
fn peer_closed(sock: &TcpStream) -> bool {
    if sock.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let closed = match sock.peek(&mut b) {
        // A watch client never sends anything mid-stream: bytes here are a TLS close_notify.
        Ok(_) => true,
        Err(e) => e.kind() != io::ErrorKind::WouldBlock,
    };
    let _ = sock.set_nonblocking(false);
    closed
}

/// Streams a watch until it times out, is dropped, or the peer goes away.
pub fn serve<W: Write>(
    shared: &Shared,
    w: &mut W,
    sock: &TcpStream,
    spec: WatchSpec,
) -> io::Result<WatchEnd> {
    let _open = shared.watch_opened();
    let store = &shared.store;
    let epoch = store.watch_epoch();
    let started = Instant::now();
    let deadline = started + spec.timeout;

    let (mut cursor, initial) = match spec.start_rv {
        Some(rv) => {
            // A too-old start is answered like the watch cache does: a 200 stream whose
            // only event is an ERROR carrying a 410 Expired Status (handled in the loop below).
            (rv, Vec::new())
        }
        None => {
            let (items, rv) = store.list(spec.def, spec.namespace.as_deref());
            let items: Vec<_> = items.into_iter().filter(|o| spec.in_scope(o)).collect();
            (rv, items)
        }
    };

    http::write_stream_head(w, "application/json")?;
    let mut out = Vec::new();
    if spec.inject_gone_event {
        line(&mut out, &gone_event(cursor, store.current_rv()));
        out.extend_from_slice(http::LAST_CHUNK);
        w.write_all(&out)?;
        w.flush()?;
        return Ok(WatchEnd::Clean);
    }
    let mut enc = Encoder {
        def: spec.def,
        table: spec.table.as_deref(),
        columns_sent: false,
    };
    for obj in &initial {
        enc.change(&mut out, "ADDED", obj);
    }
    if spec.send_initial_events && spec.bookmarks {
        line(&mut out, &bookmark(spec.def, cursor, true));
    }
    if !out.is_empty() {
        w.write_all(&out)?;
        w.flush()?;
    }

    let mut next_bookmark = Instant::now() + shared.bookmark_interval();
    loop {
        let now = Instant::now();
        if now >= deadline {
            w.write_all(http::LAST_CHUNK)?;
            w.flush()?;
            return Ok(WatchEnd::Clean);
        }
        let drop_at = shared.faults.drop_watches_every().map(|d| started + d);
        if drop_at.is_some_and(|t| now >= t) {
            let _ = sock.shutdown(Shutdown::Both);
            return Ok(WatchEnd::Abrupt);
        }
        let mut wake = deadline.min(now + PEER_CHECK);
        if spec.bookmarks {
            wake = wake.min(next_bookmark);
        }
        if let Some(t) = drop_at {
            wake = wake.min(t);
        }
        let mut out = Vec::new();
        match store.wait_changes(spec.def, cursor, epoch, wake) {
            WaitOutcome::Dropped => {
                let _ = sock.shutdown(Shutdown::Both);
                return Ok(WatchEnd::Abrupt);
            }
            WaitOutcome::TooOld { oldest } => {
                line(&mut out, &gone_event(cursor, oldest));
                out.extend_from_slice(http::LAST_CHUNK);
                w.write_all(&out)?;
                w.flush()?;
                return Ok(WatchEnd::Clean);
            }
            WaitOutcome::Changes { changes, cursor: c } => {
                for ch in &changes {
                    if let Some((ty, obj)) = spec.event_for(ch) {
                        enc.change(&mut out, ty, &obj);
                    }
                }
                cursor = cursor.max(c);
            }
            WaitOutcome::Idle { cursor: c } => cursor = cursor.max(c),
        }
        if spec.bookmarks && Instant::now() >= next_bookmark {
            line(&mut out, &bookmark(spec.def, cursor, false));
            next_bookmark = Instant::now() + shared.bookmark_interval();
        }
        if !out.is_empty() {
            w.write_all(&out)?;
            w.flush()?;
        } else if peer_closed(sock) {
            return Ok(WatchEnd::Abrupt);
        }
    }
}

/// A watch answered with an injected fault.
pub fn injected(spec: &mut WatchSpec, fault: Fault) -> Option<ApiError> {
    match fault {
        Fault::GoneEvent => {
            spec.inject_gone_event = true;
            None
        }
        other => Some(other.error(spec.def.plural)),
    }
}
