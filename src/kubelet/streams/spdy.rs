//! The SPDY/3.1 connection both streaming routes speak (exec / attach and port-forward): frame
//! parsing, zlib header blocks with the SPDY/3 dictionary, stream replies, and flow control.
//!
//! Pure bytes in, frames and bytes out; what a stream means is the caller's business. Flow
//! control: received data is acknowledged (stream and session WINDOW_UPDATEs) when the caller
//! says it was consumed (`ack`), so a peer that honours windows never has more than a window
//! queued; output honours the peer's windows. spdystream (the Go peer) sends no WINDOW_UPDATE
//! at all, so a connection whose output is stalled on an exhausted window before the peer ever
//! sent one probes with a PING: a PING answer without any WINDOW_UPDATE marks a peer that does
//! no flow control, and output flows freely. Client PINGs are echoed.

use std::collections::HashMap;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

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

pub(crate) const SYN_STREAM: u16 = 1;
pub(crate) const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
pub(crate) const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const SETTINGS: u16 = 4;
pub(crate) const WINDOW_UPDATE: u16 = 9;
pub(crate) const FLAG_FIN: u8 = 0x01;
/// RST_STREAM status codes.
pub const PROTOCOL_ERROR: u32 = 1;
pub const REFUSED_STREAM: u32 = 3;

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
pub(crate) fn control(kind: u16, flags: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x80, 0x03]);
    out.extend_from_slice(&kind.to_be_bytes());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.extend_from_slice(payload);
}

/// Appends a data frame.
pub(crate) fn data_frame(stream: u32, flags: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.extend_from_slice(payload);
}

/// What the peer did, for the caller to act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// The peer opened a stream (header names lower-cased); answer it with `reply` or `refuse`.
    Open {
        id: u32,
        headers: Vec<(String, String)>,
        fin: bool,
    },
    /// Data on a stream; the caller acknowledges it with `ack` once consumed.
    Data { id: u32, data: Vec<u8>, fin: bool },
    /// The peer reset a stream.
    Reset { id: u32 },
    /// The peer sent GOAWAY: nothing more comes.
    GoAway,
    /// The peer broke the protocol; a GOAWAY went out and the connection is closed.
    Broken(String),
}

/// The value of header `name` of an `Open` frame.
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
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

/// Output waiting for window: a stream, its bytes, and whether a FIN follows them.
struct Pending {
    id: u32,
    data: Vec<u8>,
    fin: bool,
}

/// Flow-control state of both directions.
struct Flow {
    peer: PeerFlow,
    /// The peer's SETTINGS_INITIAL_WINDOW_SIZE for new streams.
    send_initial: i64,
    /// What we may still send on the session and on each of our streams.
    send_session: i64,
    send_stream: HashMap<u32, i64>,
    /// Output waiting for window, in the order it was produced.
    pending: Vec<Pending>,
    /// `finish` ran: GOAWAY goes out once `pending` is empty.
    finishing: bool,
    /// Received data not yet acknowledged, per open peer stream and for the session.
    recv_stream: HashMap<u32, i64>,
    recv_session: i64,
}

fn window_update(stream: u32, delta: i64, out: &mut Vec<u8>) {
    let mut p = (stream & 0x7fff_ffff).to_be_bytes().to_vec();
    p.extend_from_slice(&((delta.clamp(1, MAX_WINDOW)) as u32).to_be_bytes());
    control(WINDOW_UPDATE, 0, &p, out);
}

/// The server end of one SPDY/3.1 connection.
pub struct SpdyConn {
    buf: Vec<u8>,
    /// Bytes of `buf` already parsed.
    pos: usize,
    inflate: Decompress,
    deflate: Compress,
    dict: Vec<u8>,
    deflate_primed: bool,
    closed: bool,
    last_client_stream: u32,
    flow: Flow,
}

impl Default for SpdyConn {
    fn default() -> Self {
        Self::new()
    }
}

impl SpdyConn {
    pub fn new() -> Self {
        SpdyConn {
            buf: Vec::new(),
            pos: 0,
            inflate: Decompress::new(true),
            deflate: Compress::new(Compression::default(), true),
            dict: dictionary(),
            deflate_primed: false,
            closed: false,
            last_client_stream: 0,
            flow: Flow {
                peer: PeerFlow::Unknown,
                send_initial: INITIAL_WINDOW,
                send_session: INITIAL_WINDOW,
                send_stream: HashMap::new(),
                pending: Vec::new(),
                finishing: false,
                recv_stream: HashMap::new(),
                recv_session: 0,
            },
        }
    }

    /// The 101 response for a SPDY upgrade that negotiated `protocol`.
    pub fn handshake_response(protocol: &str) -> Vec<u8> {
        format!("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {protocol}\r\n\r\n")
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

    /// Ends the connection for a protocol error: GOAWAY with PROTOCOL_ERROR.
    pub fn fail(&mut self, why: String, out: &mut Vec<u8>, frames: &mut Vec<Frame>) {
        if !self.closed {
            let mut p = self.last_client_stream.to_be_bytes().to_vec();
            p.extend_from_slice(&PROTOCOL_ERROR.to_be_bytes());
            control(GOAWAY, 0, &p, out);
            self.closed = true;
        }
        frames.push(Frame::Broken(why));
    }

    /// Parses client bytes: PINGs, windows and settings are handled here, the rest is
    /// appended to `frames`.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, frames: &mut Vec<Frame>) {
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
                return self.fail(format!("frame of {len} bytes is too large"), out, frames);
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
                    return self.fail(format!("unsupported SPDY version {version}"), out, frames);
                }
                self.control_in(kind, flags, payload, out, frames);
            } else {
                let id = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]) & 0x7fff_ffff;
                frames.push(Frame::Data {
                    id,
                    data: payload.to_vec(),
                    fin: flags & FLAG_FIN != 0,
                });
            }
        }
    }

    fn control_in(
        &mut self,
        kind: u16,
        flags: u8,
        p: &[u8],
        out: &mut Vec<u8>,
        frames: &mut Vec<Frame>,
    ) {
        match kind {
            SYN_STREAM => {
                if p.len() < 10 {
                    return self.fail("short SYN_STREAM".into(), out, frames);
                }
                let id = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                let block = match self.inflate_block(&p[10..]) {
                    Ok(b) => b,
                    Err(e) => return self.fail(e, out, frames),
                };
                let Some(headers) = Self::parse_headers(&block) else {
                    return self.fail("malformed header block".into(), out, frames);
                };
                if id == 0 || id.is_multiple_of(2) || id <= self.last_client_stream {
                    return self.fail(format!("bad client stream id {id}"), out, frames);
                }
                self.last_client_stream = id;
                frames.push(Frame::Open {
                    id,
                    headers,
                    fin: flags & FLAG_FIN != 0,
                });
            }
            RST_STREAM if p.len() >= 4 => {
                let id = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                self.forget(id);
                frames.push(Frame::Reset { id });
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
                frames.push(Frame::GoAway);
            }
            // Keep the shared decompression context in step even though HEADERS are ignored.
            HEADERS if p.len() >= 4 => {
                if let Err(e) = self.inflate_block(&p[4..]) {
                    self.fail(e, out, frames);
                }
            }
            // NOOP, CREDENTIAL and unknown types carry nothing we act on.
            _ => {}
        }
    }

    /// Accepts a stream the peer opened: SYN_REPLY, and windows in both directions.
    pub fn reply(&mut self, id: u32, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        self.flow.send_stream.insert(id, self.flow.send_initial);
        self.flow.recv_stream.insert(id, 0);
        let mut reply = id.to_be_bytes().to_vec();
        let block = self.deflate_block(&0u32.to_be_bytes());
        reply.extend_from_slice(&block);
        control(SYN_REPLY, 0, &reply, out);
    }

    /// Refuses or abandons one stream (RST_STREAM with `status`); its queued output is dropped.
    pub fn reset(&mut self, id: u32, status: u32, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        self.forget(id);
        let mut r = id.to_be_bytes().to_vec();
        r.extend_from_slice(&status.to_be_bytes());
        control(RST_STREAM, 0, &r, out);
    }

    /// Drops every trace of a stream that is over.
    fn forget(&mut self, id: u32) {
        self.flow.send_stream.remove(&id);
        self.flow.recv_stream.remove(&id);
        self.flow.pending.retain(|p| p.id != id);
    }

    /// Counts `len` bytes of stream `id` as consumed and acknowledges them, in steps of at
    /// least half a window. `fin`: the peer half-closed the stream, whose window is then dropped.
    pub fn ack(&mut self, id: u32, len: usize, fin: bool, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
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

    /// Queues output on a stream (FIN after it when `fin`) and sends what the windows allow.
    pub fn send(&mut self, id: u32, data: &[u8], fin: bool, out: &mut Vec<u8>) {
        if self.closed || self.flow.finishing || (data.is_empty() && !fin) {
            return;
        }
        match self.flow.pending.last_mut() {
            Some(last) if last.id == id && !last.fin => {
                last.data.extend_from_slice(data);
                last.fin = fin;
            }
            _ => self.flow.pending.push(Pending {
                id,
                data: data.to_vec(),
                fin,
            }),
        }
        self.pump(out);
    }

    /// Sends as much pending output as the windows allow, each stream's in order (a stream
    /// out of window holds back only its own); then, once everything is out after `finish`,
    /// the GOAWAY. Stalled with an unknown peer: sends the probe PING.
    fn pump(&mut self, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        let limited = self.flow.peer != PeerFlow::None;
        let mut blocked: Vec<u32> = Vec::new();
        let mut i = 0;
        while i < self.flow.pending.len() {
            let id = self.flow.pending[i].id;
            if blocked.contains(&id) {
                i += 1;
                continue;
            }
            let stream_window = self.flow.send_stream.get(&id).copied().unwrap_or(0);
            let room = if limited {
                stream_window.min(self.flow.send_session).max(0) as usize
            } else {
                usize::MAX
            };
            let p = &mut self.flow.pending[i];
            if room == 0 && !p.data.is_empty() {
                blocked.push(id);
                i += 1;
                continue;
            }
            let n = p.data.len().min(room).min(OUT_FRAME);
            let last = n == p.data.len();
            let flags = if last && p.fin { FLAG_FIN } else { 0 };
            data_frame(id, flags, &p.data[..n], out);
            if limited {
                self.flow.send_session -= n as i64;
                if let Some(w) = self.flow.send_stream.get_mut(&id) {
                    *w -= n as i64;
                }
            }
            if last {
                if p.fin {
                    self.flow.send_stream.remove(&id);
                }
                self.flow.pending.remove(i);
            } else {
                p.data.drain(..n);
            }
        }
        if !blocked.is_empty() {
            if self.flow.peer == PeerFlow::Unknown {
                self.flow.peer = PeerFlow::Probing;
                control(PING, 0, &PROBE_PING.to_be_bytes(), out);
            }
            return;
        }
        if self.flow.finishing && self.flow.pending.is_empty() {
            let mut p = self.last_client_stream.to_be_bytes().to_vec();
            p.extend_from_slice(&0u32.to_be_bytes());
            control(GOAWAY, 0, &p, out);
            self.closed = true;
        }
    }

    /// Output bytes waiting for the peer to open its windows.
    pub fn pending_output(&self) -> usize {
        self.flow.pending.iter().map(|p| p.data.len()).sum()
    }

    /// True once the connection is over: closed, or finished with all output sent.
    pub fn done(&self) -> bool {
        self.closed
    }

    /// Ends the connection: GOAWAY once the output still waiting for window is out.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        if self.closed || self.flow.finishing {
            return;
        }
        self.flow.finishing = true;
        self.pump(out);
    }
}
