//! Server side of the SPDY/3.1 remote-command transport: frame parsing, zlib header
//! blocks with the SPDY/3 dictionary, client-created streams typed by `streamType`, raw payloads.
//!
//! Pure bytes in, bytes and events out. Flow control (SPDY/3.1): stdin is acknowledged with
//! stream and session WINDOW_UPDATEs as the child consumes it (`stdin_consumed`), not as it
//! arrives, so a peer that honours windows never has more than one window queued; other
//! streams' data is acknowledged on arrival (it is dropped). Output honours the peer's windows.
//! spdystream (the Go peer) sends no WINDOW_UPDATE at all, so a session whose output is stalled
//! on an exhausted window before the peer ever sent one probes with a PING: a PING answer
//! without any WINDOW_UPDATE marks a peer that does no flow control, and output flows freely.
//! Client PINGs are echoed, GOAWAY ends the session.

use std::collections::HashMap;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

use super::SessionEvent;

/// Largest frame payload accepted from a client.
pub const MAX_FRAME: usize = 1024 * 1024;
/// Largest decompressed header block accepted.
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Outgoing data is split into frames of at most this size.
const OUT_FRAME: usize = 32 * 1024;

/// Initial flow-control window of every stream and of the session (the SPDY/3.1 default).
pub const INITIAL_WINDOW: i64 = 64 * 1024;
/// Received bytes acknowledged once this many are pending (half the window).
const ACK_AT: i64 = INITIAL_WINDOW / 2;
/// Largest window SPDY allows (2^31 - 1).
const MAX_WINDOW: i64 = 0x7fff_ffff;
/// SETTINGS id of SETTINGS_INITIAL_WINDOW_SIZE.
const SETTINGS_INITIAL_WINDOW_SIZE: u32 = 7;
/// Id of the server's flow-control probe PING (server PING ids are even).
const PROBE_PING: u32 = 2;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const SETTINGS: u16 = 4;
const WINDOW_UPDATE: u16 = 9;
const FLAG_FIN: u8 = 0x01;

/// The SPDY/3 header-compression dictionary (1423 bytes): length-prefixed common header names
/// and values, then a raw tail of status lines, dates and media types.
pub fn dictionary() -> Vec<u8> {
    const WORDS: [&str; 65] = [
        "options",
        "head",
        "post",
        "put",
        "delete",
        "trace",
        "accept",
        "accept-charset",
        "accept-encoding",
        "accept-language",
        "accept-ranges",
        "age",
        "allow",
        "authorization",
        "cache-control",
        "connection",
        "content-base",
        "content-encoding",
        "content-language",
        "content-length",
        "content-location",
        "content-md5",
        "content-range",
        "content-type",
        "date",
        "etag",
        "expect",
        "expires",
        "from",
        "host",
        "if-match",
        "if-modified-since",
        "if-none-match",
        "if-range",
        "if-unmodified-since",
        "last-modified",
        "location",
        "max-forwards",
        "pragma",
        "proxy-authenticate",
        "proxy-authorization",
        "range",
        "referer",
        "retry-after",
        "server",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "vary",
        "via",
        "warning",
        "www-authenticate",
        "method",
        "get",
        "status",
        "200 OK",
        "version",
        "HTTP/1.1",
        "url",
        "public",
        "set-cookie",
        "keep-alive",
        "origin",
    ];
    const TAIL: [&str; 4] = [
        "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505\
         203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized\
         403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable",
        "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00",
        " Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT",
        "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,\
         text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
    ];
    let mut d = Vec::with_capacity(1423);
    for w in WORDS {
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    for t in TAIL {
        d.extend_from_slice(t.as_bytes());
    }
    d
}

/// Appends a control frame.
fn control(kind: u16, flags: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x80, 0x03]);
    out.extend_from_slice(&kind.to_be_bytes());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.extend_from_slice(payload);
}

/// Appends a data frame.
fn data_frame(stream: u32, flags: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.extend_from_slice(payload);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Error,
    Stdin,
    Stdout,
    Stderr,
    Resize,
}

/// Which streams the request needs before the command can start.
#[derive(Clone, Copy, Debug)]
pub struct Expected {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub resize: bool,
}

pub struct SpdySession {
    version: String,
    buf: Vec<u8>,
    /// Bytes of `buf` already parsed.
    pos: usize,
    inflate: Decompress,
    deflate: Compress,
    dict: Vec<u8>,
    deflate_primed: bool,
    expected: Expected,
    streams: HashMap<u32, Kind>,
    ids: HashMap<&'static str, u32>,
    ready: bool,
    /// Events held back until all streams exist.
    held: Vec<SessionEvent>,
    stdin_open: bool,
    closed: bool,
    last_client_stream: u32,
    flow: Flow,
}

/// Whether the peer takes part in flow control (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerFlow {
    /// No WINDOW_UPDATE or window setting seen yet: windows are honoured.
    Unknown,
    /// Unknown, output stalled, probe PING sent.
    Probing,
    /// The peer sent a WINDOW_UPDATE or a window setting: windows are honoured for good.
    Windows,
    /// The probe was answered with no WINDOW_UPDATE ever seen: output is not limited.
    None,
}

/// Flow-control state of both directions.
struct Flow {
    peer: PeerFlow,
    /// The peer's SETTINGS_INITIAL_WINDOW_SIZE for new streams.
    send_initial: i64,
    /// What we may still send on the session and on each of our streams.
    send_session: i64,
    send_stream: HashMap<u32, i64>,
    /// Output waiting for window, per stream, in the order it was produced.
    pending: Vec<(u32, Vec<u8>)>,
    /// FIN frames and the GOAWAY of `finish`, sent once `pending` is empty.
    finishing: bool,
    /// Received data not yet acknowledged, per client stream and for the session.
    recv_stream: HashMap<u32, i64>,
    recv_session: i64,
    /// Stdin bytes received, and those the child consumed (as last reported).
    stdin_received: u64,
    stdin_consumed: u64,
}

impl Flow {
    fn new() -> Self {
        Flow {
            peer: PeerFlow::Unknown,
            send_initial: INITIAL_WINDOW,
            send_session: INITIAL_WINDOW,
            send_stream: HashMap::new(),
            pending: Vec::new(),
            finishing: false,
            recv_stream: HashMap::new(),
            recv_session: 0,
            stdin_received: 0,
            stdin_consumed: 0,
        }
    }

    fn pending_bytes(&self) -> usize {
        self.pending.iter().map(|(_, d)| d.len()).sum()
    }
}

fn window_update(stream: u32, delta: i64, out: &mut Vec<u8>) {
    let mut p = (stream & 0x7fff_ffff).to_be_bytes().to_vec();
    p.extend_from_slice(&((delta.clamp(1, MAX_WINDOW)) as u32).to_be_bytes());
    control(WINDOW_UPDATE, 0, &p, out);
}

impl SpdySession {
    pub fn new(version: &str, expected: Expected) -> Self {
        SpdySession {
            version: version.to_string(),
            buf: Vec::new(),
            pos: 0,
            inflate: Decompress::new(true),
            deflate: Compress::new(Compression::default(), true),
            dict: dictionary(),
            deflate_primed: false,
            expected,
            streams: HashMap::new(),
            ids: HashMap::new(),
            ready: false,
            held: Vec::new(),
            stdin_open: expected.stdin,
            closed: false,
            last_client_stream: 0,
            flow: Flow::new(),
        }
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// The 101 response for a SPDY upgrade.
    pub fn handshake_response(version: &str) -> Vec<u8> {
        format!("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {version}\r\n\r\n")
            .into_bytes()
    }

    fn inflate_block(&mut self, block: &[u8]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let mut chunk = [0u8; 4096];
        let mut input = block;
        loop {
            let before_in = self.inflate.total_in();
            let before_out = self.inflate.total_out();
            let r = self
                .inflate
                .decompress(input, &mut chunk, FlushDecompress::Sync);
            let used = (self.inflate.total_in() - before_in) as usize;
            let made = (self.inflate.total_out() - before_out) as usize;
            input = &input[used.min(input.len())..];
            out.extend_from_slice(&chunk[..made]);
            if out.len() > MAX_HEADER_BLOCK {
                return Err("header block too large".into());
            }
            match r {
                Ok(Status::StreamEnd) => return Err("header stream ended".into()),
                Ok(_) => {
                    if input.is_empty() && made < chunk.len() {
                        return Ok(out);
                    }
                    if used == 0 && made == 0 {
                        return Err("header block does not decompress".into());
                    }
                }
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate
                        .set_dictionary(&self.dict)
                        .map_err(|e| format!("header dictionary: {e}"))?;
                }
                Err(e) => return Err(format!("header block: {e}")),
            }
        }
    }

    fn deflate_block(&mut self, raw: &[u8]) -> Vec<u8> {
        if !self.deflate_primed {
            // Compression state is only ever used with this dictionary; a failure here would be
            // a zlib bug, and the reply would then simply be undecodable for the peer.
            let _ = self.deflate.set_dictionary(&self.dict);
            self.deflate_primed = true;
        }
        let mut out = Vec::with_capacity(raw.len() + 64);
        let mut input = raw;
        loop {
            out.reserve(256);
            let before = self.deflate.total_in();
            if self
                .deflate
                .compress_vec(input, &mut out, FlushCompress::Sync)
                .is_err()
            {
                return out;
            }
            let used = (self.deflate.total_in() - before) as usize;
            input = &input[used.min(input.len())..];
            if input.is_empty() && out.len() < out.capacity() {
                return out;
            }
        }
    }

    fn parse_headers(block: &[u8]) -> Option<Vec<(String, String)>> {
        let rd = |b: &[u8], at: usize| -> Option<u32> {
            Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
        };
        let n = rd(block, 0)? as usize;
        let mut at = 4;
        let mut out = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let kl = rd(block, at)? as usize;
            let k = block.get(at + 4..at + 4 + kl)?;
            at += 4 + kl;
            let vl = rd(block, at)? as usize;
            let v = block.get(at + 4..at + 4 + vl)?;
            at += 4 + vl;
            out.push((
                String::from_utf8_lossy(k).to_ascii_lowercase(),
                String::from_utf8_lossy(v).into_owned(),
            ));
        }
        Some(out)
    }

    fn fail(&mut self, why: String, out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        if !self.closed {
            let mut p = self.last_client_stream.to_be_bytes().to_vec();
            p.extend_from_slice(&1u32.to_be_bytes()); // PROTOCOL_ERROR
            control(GOAWAY, 0, &p, out);
            self.closed = true;
        }
        ev.push(SessionEvent::ProtocolError(why));
    }

    fn emit(&mut self, e: SessionEvent, ev: &mut Vec<SessionEvent>) {
        if self.ready {
            ev.push(e);
        } else {
            self.held.push(e);
        }
    }

    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        // Parsed frames are dropped once per call, not once per frame.
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(data);
        while !self.closed {
            let at = self.pos;
            if self.buf.len() - at < 8 {
                return;
            }
            let len = u32::from_be_bytes([0, self.buf[at + 5], self.buf[at + 6], self.buf[at + 7]])
                as usize;
            if len > MAX_FRAME {
                return self.fail(format!("frame of {len} bytes is too large"), out, ev);
            }
            if self.buf.len() - at < 8 + len {
                return;
            }
            let frame: Vec<u8> = self.buf[at..at + 8 + len].to_vec();
            self.pos = at + 8 + len;
            let flags = frame[4];
            let payload = &frame[8..];
            if frame[0] & 0x80 != 0 {
                let version = u16::from_be_bytes([frame[0] & 0x7f, frame[1]]);
                let kind = u16::from_be_bytes([frame[2], frame[3]]);
                if version != 3 {
                    return self.fail(format!("unsupported SPDY version {version}"), out, ev);
                }
                self.control_in(kind, flags, payload, out, ev);
            } else {
                let id = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]) & 0x7fff_ffff;
                let to_child = self.streams.get(&id) == Some(&Kind::Stdin) && self.stdin_open;
                if to_child {
                    // Acknowledged once the child has consumed it (after a FIN too: the
                    // stream window then tells the peer how far the child has read).
                    self.flow.stdin_received += payload.len() as u64;
                } else {
                    self.received(id, payload.len(), flags & FLAG_FIN != 0, out);
                }
                match self.streams.get(&id) {
                    Some(Kind::Stdin) if self.stdin_open => {
                        if !payload.is_empty() {
                            self.emit(SessionEvent::Stdin(payload.to_vec()), ev);
                        }
                        if flags & FLAG_FIN != 0 {
                            self.stdin_open = false;
                            self.emit(SessionEvent::StdinEof, ev);
                        }
                    }
                    // Resize requests are accepted and ignored (no terminal in a VM exec);
                    // data on other client streams carries nothing for us.
                    _ => {}
                }
            }
        }
    }

    fn control_in(
        &mut self,
        kind: u16,
        flags: u8,
        p: &[u8],
        out: &mut Vec<u8>,
        ev: &mut Vec<SessionEvent>,
    ) {
        match kind {
            SYN_STREAM => {
                if p.len() < 10 {
                    return self.fail("short SYN_STREAM".into(), out, ev);
                }
                let id = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                let block = match self.inflate_block(&p[10..]) {
                    Ok(b) => b,
                    Err(e) => return self.fail(e, out, ev),
                };
                let Some(headers) = Self::parse_headers(&block) else {
                    return self.fail("malformed header block".into(), out, ev);
                };
                if id == 0 || id.is_multiple_of(2) || id <= self.last_client_stream {
                    return self.fail(format!("bad client stream id {id}"), out, ev);
                }
                self.last_client_stream = id;
                let st = headers
                    .iter()
                    .find(|(k, _)| k == "streamtype")
                    .map(|(_, v)| v.as_str())
                    .unwrap_or("");
                let kind = match st {
                    "error" => Some((Kind::Error, "error")),
                    "stdin" if self.expected.stdin => Some((Kind::Stdin, "stdin")),
                    "stdout" if self.expected.stdout => Some((Kind::Stdout, "stdout")),
                    "stderr" if self.expected.stderr => Some((Kind::Stderr, "stderr")),
                    "resize" => Some((Kind::Resize, "resize")),
                    _ => None,
                };
                let Some((kind, name)) = kind.filter(|(_, n)| !self.ids.contains_key(n)) else {
                    // Unknown, unrequested or duplicate stream: refuse it alone.
                    let mut r = id.to_be_bytes().to_vec();
                    r.extend_from_slice(&1u32.to_be_bytes());
                    control(RST_STREAM, 0, &r, out);
                    return;
                };
                self.streams.insert(id, kind);
                self.ids.insert(name, id);
                self.flow.send_stream.insert(id, self.flow.send_initial);
                self.flow.recv_stream.insert(id, 0);
                let mut reply = id.to_be_bytes().to_vec();
                let block = self.deflate_block(&0u32.to_be_bytes());
                reply.extend_from_slice(&block);
                control(SYN_REPLY, 0, &reply, out);
                if kind == Kind::Stdin && flags & FLAG_FIN != 0 {
                    self.stdin_open = false;
                    self.emit(SessionEvent::StdinEof, ev);
                }
                let e = self.expected;
                let have = |n: &str| self.ids.contains_key(n);
                if !self.ready
                    && have("error")
                    && (!e.stdin || have("stdin"))
                    && (!e.stdout || have("stdout"))
                    && (!e.stderr || have("stderr"))
                    && (!e.resize || have("resize"))
                {
                    self.ready = true;
                    ev.push(SessionEvent::Ready);
                    ev.append(&mut self.held);
                }
            }
            RST_STREAM if p.len() >= 4 => {
                let id = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                if self.streams.get(&id) == Some(&Kind::Stdin) && self.stdin_open {
                    self.stdin_open = false;
                    self.emit(SessionEvent::StdinEof, ev);
                }
            }
            // Even ids are server PINGs: the answer to our probe. Odd ones are echoed.
            PING if p.len() >= 4 => {
                let id = u32::from_be_bytes([p[0], p[1], p[2], p[3]]);
                if id % 2 == 1 {
                    control(PING, 0, p, out);
                } else if id == PROBE_PING && self.flow.peer == PeerFlow::Probing {
                    self.flow.peer = PeerFlow::None;
                    self.pump(out);
                }
            }
            WINDOW_UPDATE if p.len() >= 8 => {
                let id = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                let delta = i64::from(u32::from_be_bytes([p[4], p[5], p[6], p[7]]) & 0x7fff_ffff);
                if self.flow.peer != PeerFlow::None {
                    self.flow.peer = PeerFlow::Windows;
                }
                if id == 0 {
                    self.flow.send_session = (self.flow.send_session + delta).min(MAX_WINDOW);
                } else if let Some(w) = self.flow.send_stream.get_mut(&id) {
                    *w = (*w + delta).min(MAX_WINDOW);
                }
                self.pump(out);
            }
            SETTINGS if p.len() >= 4 => {
                let n = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) as usize;
                for e in p[4..].chunks_exact(8).take(n) {
                    let id = u32::from_be_bytes([0, e[1], e[2], e[3]]);
                    let value = i64::from(u32::from_be_bytes([e[4], e[5], e[6], e[7]]));
                    if id == SETTINGS_INITIAL_WINDOW_SIZE && value <= MAX_WINDOW {
                        // A new initial window shifts every open stream's window by the change.
                        let change = value - self.flow.send_initial;
                        self.flow.send_initial = value;
                        for w in self.flow.send_stream.values_mut() {
                            *w += change;
                        }
                        if self.flow.peer != PeerFlow::None {
                            self.flow.peer = PeerFlow::Windows;
                        }
                    }
                }
                self.pump(out);
            }
            GOAWAY => {
                self.closed = true;
                ev.push(SessionEvent::Closed);
            }
            // Keep the shared decompression context in step even though HEADERS are ignored.
            HEADERS if p.len() >= 4 => {
                if let Err(e) = self.inflate_block(&p[4..]) {
                    self.fail(e, out, ev);
                }
            }
            // NOOP, CREDENTIAL and unknown types carry nothing we act on.
            _ => {}
        }
    }

    /// Counts received data against our windows and acknowledges it. Data is consumed as soon
    /// as it is parsed: stdin goes to the child's queue, other streams' data is dropped.
    fn received(&mut self, id: u32, len: usize, fin: bool, out: &mut Vec<u8>) {
        let len = len as i64;
        self.flow.recv_session += len;
        if self.flow.recv_session >= ACK_AT {
            window_update(0, self.flow.recv_session, out);
            self.flow.recv_session = 0;
        }
        if fin {
            // Half-closed by the peer: nothing more will arrive to need window.
            self.flow.recv_stream.remove(&id);
        } else if let Some(pending) = self.flow.recv_stream.get_mut(&id) {
            *pending += len;
            if *pending >= ACK_AT {
                window_update(id, *pending, out);
                *pending = 0;
            }
        }
    }

    /// The child has consumed `total` stdin bytes so far: that much window goes back to the
    /// peer (stream and session), in steps of at least half a window.
    pub fn stdin_consumed(&mut self, total: u64, out: &mut Vec<u8>) {
        let total = total.min(self.flow.stdin_received);
        let delta = total.saturating_sub(self.flow.stdin_consumed);
        if delta == 0 || self.closed {
            return;
        }
        self.flow.stdin_consumed = total;
        let stdin = self.ids.get("stdin").copied().unwrap_or(0);
        self.received(stdin, delta as usize, false, out);
    }

    /// Stdin bytes received and not yet consumed by the child (what the peer's window holds).
    pub fn stdin_unacknowledged(&self) -> u64 {
        self.flow.stdin_received - self.flow.stdin_consumed
    }

    fn send_on(&mut self, name: &str, data: &[u8], out: &mut Vec<u8>) {
        if self.closed || self.flow.finishing || data.is_empty() {
            return;
        }
        if let Some(&id) = self.ids.get(name) {
            match self.flow.pending.last_mut() {
                Some((last, d)) if *last == id => d.extend_from_slice(data),
                _ => self.flow.pending.push((id, data.to_vec())),
            }
            self.pump(out);
        }
    }

    /// Sends as much pending output as the windows allow; then, once everything is out, the
    /// FINs and GOAWAY of `finish`. Stalled with an unknown peer: sends the probe PING.
    fn pump(&mut self, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        let limited = self.flow.peer != PeerFlow::None;
        while let Some((id, data)) = self.flow.pending.first_mut() {
            let id = *id;
            let stream_window = self.flow.send_stream.get(&id).copied().unwrap_or(0);
            let room = if limited {
                stream_window.min(self.flow.send_session).max(0) as usize
            } else {
                usize::MAX
            };
            // The first stream lacking window holds back the rest: output stays in order.
            if room == 0 {
                if self.flow.peer == PeerFlow::Unknown {
                    self.flow.peer = PeerFlow::Probing;
                    control(PING, 0, &PROBE_PING.to_be_bytes(), out);
                }
                return;
            }
            let n = data.len().min(room).min(OUT_FRAME);
            data_frame(id, 0, &data[..n], out);
            if limited {
                self.flow.send_session -= n as i64;
                if let Some(w) = self.flow.send_stream.get_mut(&id) {
                    *w -= n as i64;
                }
            }
            if n == data.len() {
                self.flow.pending.remove(0);
            } else {
                data.drain(..n);
            }
        }
        if self.flow.finishing {
            for name in ["error", "stdout", "stderr"] {
                if let Some(&id) = self.ids.get(name) {
                    data_frame(id, FLAG_FIN, &[], out);
                }
            }
            let mut p = self.last_client_stream.to_be_bytes().to_vec();
            p.extend_from_slice(&0u32.to_be_bytes());
            control(GOAWAY, 0, &p, out);
            self.closed = true;
        }
    }

    pub fn send_stdout(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.send_on("stdout", data, out);
    }

    pub fn send_stderr(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.send_on("stderr", data, out);
    }

    /// Output bytes waiting for the peer to open its window.
    pub fn pending_output(&self) -> usize {
        self.flow.pending_bytes()
    }

    /// True once the session is over: closed, or finished with all output sent.
    pub fn done(&self) -> bool {
        self.closed
    }

    /// Status on the error stream, FIN on every server-written stream, then GOAWAY; all of it
    /// after the output still waiting for window.
    pub fn finish(&mut self, status: Option<&str>, out: &mut Vec<u8>) {
        if self.closed || self.flow.finishing {
            return;
        }
        if let Some(s) = status {
            self.send_on("error", s.as_bytes(), out);
        }
        self.flow.finishing = true;
        self.pump(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dictionary_is_the_spdy3_one() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        assert!(d.starts_with(b"\0\0\0\x07options\0\0\0\x04head"));
        assert!(d.ends_with(b"utf-,*,enq=0."));
    }

    /// A client-side header block compressed with the dictionary, as a peer would send it.
    fn client_block(c: &mut Compress, headers: &[(&str, &str)]) -> Vec<u8> {
        let mut raw = (headers.len() as u32).to_be_bytes().to_vec();
        for (k, v) in headers {
            raw.extend_from_slice(&(k.len() as u32).to_be_bytes());
            raw.extend_from_slice(k.as_bytes());
            raw.extend_from_slice(&(v.len() as u32).to_be_bytes());
            raw.extend_from_slice(v.as_bytes());
        }
        let mut out = Vec::with_capacity(1024);
        c.compress_vec(&raw, &mut out, FlushCompress::Sync).unwrap();
        out
    }

    fn syn(c: &mut Compress, id: u32, st: &str, flags: u8) -> Vec<u8> {
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        p.extend(client_block(c, &[("streamtype", st)]));
        let mut f = Vec::new();
        control(SYN_STREAM, flags, &p, &mut f);
        f
    }

    #[test]
    fn streams_ready_stdin_and_finish() {
        let mut c = Compress::new(Compression::default(), true);
        c.set_dictionary(&dictionary()).unwrap();
        let mut s = SpdySession::new(
            "v4.channel.k8s.io",
            Expected {
                stdin: true,
                stdout: true,
                stderr: false,
                resize: false,
            },
        );
        let mut out = Vec::new();
        let mut ev = Vec::new();
        let mut bytes = syn(&mut c, 1, "error", 0);
        bytes.extend(syn(&mut c, 3, "stdin", 0));
        data_frame(3, 0, b"early", &mut bytes);
        bytes.extend(syn(&mut c, 5, "stdout", 0));
        data_frame(3, FLAG_FIN, b"!", &mut bytes);
        control(PING, 0, &7u32.to_be_bytes(), &mut bytes);
        for b in bytes.chunks(3) {
            s.feed(b, &mut out, &mut ev);
        }
        assert_eq!(
            ev,
            vec![
                SessionEvent::Ready,
                SessionEvent::Stdin(b"early".to_vec()),
                SessionEvent::Stdin(b"!".to_vec()),
                SessionEvent::StdinEof
            ]
        );
        // Three SYN_REPLYs then the PING echo.
        let mut at = 0;
        let mut kinds = Vec::new();
        while at < out.len() {
            let len = u32::from_be_bytes([0, out[at + 5], out[at + 6], out[at + 7]]) as usize;
            kinds.push(u16::from_be_bytes([out[at + 2], out[at + 3]]));
            at += 8 + len;
        }
        assert_eq!(kinds, vec![SYN_REPLY, SYN_REPLY, SYN_REPLY, PING]);
        out.clear();
        s.send_stdout(b"hello", &mut out);
        assert_eq!(&out[..4], &5u32.to_be_bytes());
        assert_eq!(&out[8..], b"hello");
        out.clear();
        s.finish(Some("{}"), &mut out);
        assert_eq!(&out[..4], &1u32.to_be_bytes());
        assert_eq!(&out[8..10], b"{}");
    }

    /// Kinds and stream ids of the control frames in `out`.
    fn window_updates(out: &[u8]) -> Vec<(u32, u32)> {
        let mut at = 0;
        let mut ups = Vec::new();
        while at + 8 <= out.len() {
            let len = u32::from_be_bytes([0, out[at + 5], out[at + 6], out[at + 7]]) as usize;
            if out[at] & 0x80 != 0
                && u16::from_be_bytes([out[at + 2], out[at + 3]]) == WINDOW_UPDATE
            {
                let p = &out[at + 8..at + 16];
                ups.push((
                    u32::from_be_bytes([p[0], p[1], p[2], p[3]]),
                    u32::from_be_bytes([p[4], p[5], p[6], p[7]]),
                ));
            }
            at += 8 + len;
        }
        ups
    }

    #[test]
    fn stdin_window_is_granted_as_the_child_consumes_it() {
        let mut c = Compress::new(Compression::default(), true);
        c.set_dictionary(&dictionary()).unwrap();
        let mut s = SpdySession::new(
            "v4.channel.k8s.io",
            Expected {
                stdin: true,
                stdout: true,
                stderr: false,
                resize: false,
            },
        );
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        let mut bytes = syn(&mut c, 1, "error", 0);
        bytes.extend(syn(&mut c, 3, "stdin", 0));
        bytes.extend(syn(&mut c, 5, "stdout", 0));
        for _ in 0..2 {
            data_frame(3, 0, &[7u8; 30_000], &mut bytes);
        }
        s.feed(&bytes, &mut out, &mut ev);
        assert_eq!(window_updates(&out), vec![], "nothing granted on arrival");
        assert_eq!(s.stdin_unacknowledged(), 60_000);
        out.clear();
        s.stdin_consumed(20_000, &mut out);
        assert_eq!(
            window_updates(&out),
            vec![],
            "less than half a window consumed"
        );
        s.stdin_consumed(40_000, &mut out);
        assert_eq!(window_updates(&out), vec![(0, 40_000), (3, 40_000)]);
        out.clear();
        // Reports beyond what arrived are clamped; repeated reports grant nothing twice.
        s.stdin_consumed(1_000_000, &mut out);
        s.stdin_consumed(1_000_000, &mut out);
        assert_eq!(s.stdin_unacknowledged(), 0);
        assert_eq!(window_updates(&out), vec![]);
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        let mut s = SpdySession::new(
            "v4.channel.k8s.io",
            Expected {
                stdin: false,
                stdout: true,
                stderr: false,
                resize: false,
            },
        );
        let mut out = Vec::new();
        let mut ev = Vec::new();
        s.feed(&[0x80, 0x02, 0, 1, 0, 0, 0, 0], &mut out, &mut ev);
        assert!(matches!(ev[0], SessionEvent::ProtocolError(_)));
        let mut s = SpdySession::new(
            "v4.channel.k8s.io",
            Expected {
                stdin: false,
                stdout: true,
                stderr: false,
                resize: false,
            },
        );
        let mut ev = Vec::new();
        let mut f = Vec::new();
        control(
            SYN_STREAM,
            0,
            &[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef],
            &mut f,
        );
        s.feed(&f, &mut out, &mut ev);
        assert!(matches!(ev[0], SessionEvent::ProtocolError(_)));
        let mut ev = Vec::new();
        let mut s = SpdySession::new(
            "v4.channel.k8s.io",
            Expected {
                stdin: false,
                stdout: true,
                stderr: false,
                resize: false,
            },
        );
        s.feed(&[0x80, 0x03, 0, 1, 0, 0xff, 0xff, 0xff], &mut out, &mut ev);
        assert!(matches!(ev[0], SessionEvent::ProtocolError(_)));
    }
}
