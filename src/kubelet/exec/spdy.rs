//! Exec and attach over SPDY/3.1: the client's streams typed by `streamType` (error, stdin,
//! stdout, stderr, resize), the command started once all requested ones exist, raw payloads.
//!
//! Pure bytes in, bytes and events out, on the shared SPDY connection (`streams::spdy`). Stdin
//! is acknowledged as the child consumes it (`stdin_consumed`), not as it arrives; other
//! streams' data is acknowledged on arrival (it is dropped). GOAWAY ends the session.

use std::collections::HashMap;

use super::SessionEvent;
pub use crate::kubelet::streams::spdy::dictionary;
use crate::kubelet::streams::spdy::{header, Frame, SpdyConn, PROTOCOL_ERROR};

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
    conn: SpdyConn,
    expected: Expected,
    streams: HashMap<u32, Kind>,
    ids: HashMap<&'static str, u32>,
    ready: bool,
    /// Events held back until all streams exist.
    held: Vec<SessionEvent>,
    stdin_open: bool,
    /// Stdin bytes received, and those the child consumed (as last reported).
    stdin_received: u64,
    stdin_consumed: u64,
}

impl SpdySession {
    pub fn new(version: &str, expected: Expected) -> Self {
        SpdySession {
            version: version.to_string(),
            conn: SpdyConn::new(),
            expected,
            streams: HashMap::new(),
            ids: HashMap::new(),
            ready: false,
            held: Vec::new(),
            stdin_open: expected.stdin,
            stdin_received: 0,
            stdin_consumed: 0,
        }
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// The 101 response for a SPDY upgrade.
    pub fn handshake_response(version: &str) -> Vec<u8> {
        SpdyConn::handshake_response(version)
    }

    fn emit(&mut self, e: SessionEvent, ev: &mut Vec<SessionEvent>) {
        if self.ready {
            ev.push(e);
        } else {
            self.held.push(e);
        }
    }

    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        let mut frames = Vec::new();
        self.conn.feed(data, out, &mut frames);
        for f in frames {
            match f {
                Frame::Open { id, headers, fin } => self.open(id, &headers, fin, out, ev),
                Frame::Data { id, data, fin } => {
                    let is_stdin = self.streams.get(&id) == Some(&Kind::Stdin);
                    if is_stdin && self.stdin_open {
                        // Acknowledged once the child has consumed it (after a FIN too: the
                        // stream window then tells the peer how far the child has read).
                        self.stdin_received += data.len() as u64;
                        if !data.is_empty() {
                            self.emit(SessionEvent::Stdin(data), ev);
                        }
                        if fin {
                            self.stdin_open = false;
                            self.emit(SessionEvent::StdinEof, ev);
                        }
                    } else {
                        // Resize requests are accepted and ignored (no terminal in a VM exec);
                        // data on other client streams carries nothing for us.
                        self.conn.ack(id, data.len(), fin, out);
                    }
                }
                Frame::Reset { id } => {
                    if self.streams.get(&id) == Some(&Kind::Stdin) && self.stdin_open {
                        self.stdin_open = false;
                        self.emit(SessionEvent::StdinEof, ev);
                    }
                }
                Frame::GoAway => ev.push(SessionEvent::Closed),
                Frame::Broken(why) => ev.push(SessionEvent::ProtocolError(why)),
            }
        }
    }

    fn open(
        &mut self,
        id: u32,
        headers: &[(String, String)],
        fin: bool,
        out: &mut Vec<u8>,
        ev: &mut Vec<SessionEvent>,
    ) {
        let kind = match header(headers, "streamtype").unwrap_or("") {
            "error" => Some((Kind::Error, "error")),
            "stdin" if self.expected.stdin => Some((Kind::Stdin, "stdin")),
            "stdout" if self.expected.stdout => Some((Kind::Stdout, "stdout")),
            "stderr" if self.expected.stderr => Some((Kind::Stderr, "stderr")),
            "resize" => Some((Kind::Resize, "resize")),
            _ => None,
        };
        let Some((kind, name)) = kind.filter(|(_, n)| !self.ids.contains_key(n)) else {
            // Unknown, unrequested or duplicate stream: refuse it alone.
            return self.conn.reset(id, PROTOCOL_ERROR, out);
        };
        self.streams.insert(id, kind);
        self.ids.insert(name, id);
        self.conn.reply(id, out);
        if kind == Kind::Stdin && fin {
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

    /// The child has consumed `total` stdin bytes so far: that much window goes back to the
    /// peer (stream and session), in steps of at least half a window.
    pub fn stdin_consumed(&mut self, total: u64, out: &mut Vec<u8>) {
        let total = total.min(self.stdin_received);
        let delta = total.saturating_sub(self.stdin_consumed);
        if delta == 0 || self.conn.done() {
            return;
        }
        self.stdin_consumed = total;
        let stdin = self.ids.get("stdin").copied().unwrap_or(0);
        self.conn.ack(stdin, delta as usize, false, out);
    }

    /// Stdin bytes received and not yet consumed by the child (what the peer's window holds).
    pub fn stdin_unacknowledged(&self) -> u64 {
        self.stdin_received - self.stdin_consumed
    }

    fn send_on(&mut self, name: &str, data: &[u8], out: &mut Vec<u8>) {
        if let Some(&id) = self.ids.get(name) {
            self.conn.send(id, data, false, out);
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
        self.conn.pending_output()
    }

    /// True once the session is over: closed, or finished with all output sent.
    pub fn done(&self) -> bool {
        self.conn.done()
    }

    /// Status on the error stream, FIN on every server-written stream, then GOAWAY; all of it
    /// after the output still waiting for window.
    pub fn finish(&mut self, status: Option<&str>, out: &mut Vec<u8>) {
        if let Some(s) = status {
            self.send_on("error", s.as_bytes(), out);
        }
        for name in ["error", "stdout", "stderr"] {
            if let Some(&id) = self.ids.get(name) {
                self.conn.send(id, &[], true, out);
            }
        }
        self.conn.finish(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::streams::spdy::{
        control, data_frame, FLAG_FIN, PING, SYN_REPLY, SYN_STREAM, WINDOW_UPDATE,
    };
    use flate2::{Compress, Compression, FlushCompress};

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
