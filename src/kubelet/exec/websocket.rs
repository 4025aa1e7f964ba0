//! Server side of the WebSocket remote-command transport (channel.k8s.io family):
//! RFC 6455 framing (masked client frames, fragmentation, ping/close) and the channel byte.
//!
//! Pure bytes in, bytes and events out.

use base64::Engine;

use super::SessionEvent;

/// The largest client message accepted (a bigger one closes with 1009).
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;
/// Outgoing data is split into frames of at most this size.
const OUT_FRAME: usize = 64 * 1024;

const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// `Sec-WebSocket-Accept` for a client key.
pub fn accept_key(key: &str) -> String {
    let d = ring::digest::digest(
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        format!("{}{GUID}", key.trim()).as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(d.as_ref())
}

/// The 101 response for a WebSocket upgrade.
pub fn handshake_response(accept: &str, protocol: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {protocol}\r\n\r\n"
    )
    .into_bytes()
}

/// Appends one unmasked server frame.
pub fn frame(opcode: u8, payload: &[u8], out: &mut Vec<u8>) {
    frame_parts(opcode, &[], payload, out);
}

/// Appends one unmasked server frame whose payload is `head` then `payload`, copied once.
fn frame_parts(opcode: u8, head: &[u8], payload: &[u8], out: &mut Vec<u8>) {
    let n = head.len() + payload.len();
    out.reserve(n + 10);
    out.push(0x80 | opcode);
    if n < 126 {
        out.push(n as u8);
    } else if n <= u16::MAX as usize {
        out.push(126);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(n as u64).to_be_bytes());
    }
    out.extend_from_slice(head);
    out.extend_from_slice(payload);
}

/// XORs the client's masking key over a payload, eight bytes at a time.
fn unmask(payload: &mut [u8], mask: [u8; 4]) {
    let word = u64::from_ne_bytes([
        mask[0], mask[1], mask[2], mask[3], mask[0], mask[1], mask[2], mask[3],
    ]);
    let mut chunks = payload.chunks_exact_mut(8);
    for c in &mut chunks {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        c.copy_from_slice(&(u64::from_ne_bytes(b) ^ word).to_ne_bytes());
    }
    // The remainder starts at a multiple of eight, so the key phase is unchanged.
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= mask[i % 4];
    }
}

pub struct WsSession {
    protocol: String,
    base64: bool,
    v5: bool,
    buf: Vec<u8>,
    /// Bytes of `buf` already parsed; dropped once per `feed`, not once per frame.
    pos: usize,
    /// Fragmented message being assembled: (opcode, data).
    partial: Option<(u8, Vec<u8>)>,
    closed: bool,
    stdin_open: bool,
}

impl WsSession {
    /// `has_stdout` / `has_stderr` choose the channel of the initial empty message.
    pub fn new(
        protocol: &str,
        has_stdout: bool,
        has_stderr: bool,
        stdin: bool,
        out: &mut Vec<u8>,
    ) -> Self {
        let s = WsSession {
            protocol: protocol.to_string(),
            base64: protocol.contains("base64"),
            v5: protocol.starts_with("v5."),
            buf: Vec::new(),
            pos: 0,
            partial: None,
            closed: false,
            stdin_open: stdin,
        };
        // An empty message tells the client the connection is live.
        let ch = if has_stdout {
            1
        } else if has_stderr {
            2
        } else {
            3
        };
        s.message(ch, &[], out);
        s
    }

    pub fn protocol(&self) -> &str {
        &self.protocol
    }

    fn message(&self, channel: u8, data: &[u8], out: &mut Vec<u8>) {
        if self.base64 {
            let mut p = vec![b'0' + channel];
            p.extend_from_slice(
                base64::engine::general_purpose::STANDARD
                    .encode(data)
                    .as_bytes(),
            );
            frame(1, &p, out);
        } else {
            frame_parts(2, &[channel], data, out);
        }
    }

    /// Sends data on a channel (1 stdout, 2 stderr, 3 error), split into bounded frames.
    pub fn send(&mut self, channel: u8, data: &[u8], out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        for piece in data.chunks(OUT_FRAME) {
            self.message(channel, piece, out);
        }
    }

    /// Error-channel message (if any) then a normal close.
    pub fn finish(&mut self, status: Option<&str>, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        if let Some(s) = status {
            self.message(3, s.as_bytes(), out);
        }
        frame(8, &1000u16.to_be_bytes(), out);
        self.closed = true;
    }

    fn fail(&mut self, code: u16, why: &str, out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        if !self.closed {
            let mut p = code.to_be_bytes().to_vec();
            p.extend_from_slice(why.as_bytes());
            frame(8, &p, out);
            self.closed = true;
        }
        ev.push(SessionEvent::ProtocolError(why.to_string()));
    }

    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(data);
        loop {
            let at = self.pos;
            let avail = self.buf.len() - at;
            if avail < 2 {
                return;
            }
            let b0 = self.buf[at];
            let b1 = self.buf[at + 1];
            let fin = b0 & 0x80 != 0;
            let opcode = b0 & 0x0f;
            if b0 & 0x70 != 0 {
                return self.fail(1002, "reserved bits set", out, ev);
            }
            if b1 & 0x80 == 0 {
                return self.fail(1002, "client frames must be masked", out, ev);
            }
            let (len, mut pos) = match b1 & 0x7f {
                126 => {
                    if avail < 4 {
                        return;
                    }
                    (
                        u16::from_be_bytes([self.buf[at + 2], self.buf[at + 3]]) as u64,
                        4,
                    )
                }
                127 => {
                    if avail < 10 {
                        return;
                    }
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&self.buf[at + 2..at + 10]);
                    (u64::from_be_bytes(b), 10)
                }
                n => (n as u64, 2),
            };
            if len > MAX_MESSAGE as u64 {
                return self.fail(1009, "message too big", out, ev);
            }
            let len = len as usize;
            if avail < pos + 4 + len {
                return;
            }
            let m = at + pos;
            let mask = [
                self.buf[m],
                self.buf[m + 1],
                self.buf[m + 2],
                self.buf[m + 3],
            ];
            pos += 4;
            let mut payload: Vec<u8> = self.buf[at + pos..at + pos + len].to_vec();
            unmask(&mut payload, mask);
            self.pos = at + pos + len;
            match opcode {
                0x8 => {
                    if !self.closed {
                        frame(8, payload.get(..2).unwrap_or(&1000u16.to_be_bytes()), out);
                        self.closed = true;
                    }
                    ev.push(SessionEvent::Closed);
                    return;
                }
                0x9 => {
                    if payload.len() > 125 {
                        return self.fail(1002, "control frame too long", out, ev);
                    }
                    frame(0xA, &payload, out);
                }
                0xA => {}
                0x0 => {
                    let Some((op, mut acc)) = self.partial.take() else {
                        return self.fail(1002, "continuation without a message", out, ev);
                    };
                    if acc.len() + payload.len() > MAX_MESSAGE {
                        return self.fail(1009, "message too big", out, ev);
                    }
                    acc.extend_from_slice(&payload);
                    if fin {
                        self.message_in(op, acc, out, ev);
                    } else {
                        self.partial = Some((op, acc));
                    }
                }
                0x1 | 0x2 => {
                    if self.partial.is_some() {
                        return self.fail(1002, "new message inside a fragmented one", out, ev);
                    }
                    if fin {
                        self.message_in(opcode, payload, out, ev);
                    } else {
                        self.partial = Some((opcode, payload));
                    }
                }
                _ => return self.fail(1002, "unknown opcode", out, ev),
            }
            if self.closed {
                return;
            }
        }
    }

    fn message_in(
        &mut self,
        _opcode: u8,
        msg: Vec<u8>,
        out: &mut Vec<u8>,
        ev: &mut Vec<SessionEvent>,
    ) {
        let Some((&first, rest)) = msg.split_first() else {
            return;
        };
        let (channel, data) = if self.base64 {
            if !first.is_ascii_digit() {
                return self.fail(1003, "bad base64 channel", out, ev);
            }
            match base64::engine::general_purpose::STANDARD.decode(rest) {
                Ok(d) => (first - b'0', d),
                Err(_) => return self.fail(1007, "bad base64 payload", out, ev),
            }
        } else {
            (first, rest.to_vec())
        };
        match channel {
            0 if self.stdin_open && !data.is_empty() => ev.push(SessionEvent::Stdin(data)),
            // Resize: the VM has no terminal to resize.
            4 => {}
            255 if self.v5 && data.first() == Some(&0) && self.stdin_open => {
                self.stdin_open = false;
                ev.push(SessionEvent::StdinEof);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmask_matches_the_bytewise_definition() {
        let mask = [0x12, 0x34, 0x56, 0x78];
        for n in 0..40 {
            let data: Vec<u8> = (0..n as u8).map(|i| i.wrapping_mul(37)).collect();
            let mut fast = data.clone();
            unmask(&mut fast, mask);
            let slow: Vec<u8> = data
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ mask[i % 4])
                .collect();
            assert_eq!(fast, slow, "length {n}");
        }
    }

    fn client_frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
        let mask = [1u8, 2, 3, 4];
        if payload.len() < 126 {
            f.push(0x80 | payload.len() as u8);
        } else {
            f.push(0x80 | 126);
            f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        }
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        f
    }

    #[test]
    fn stdin_fragments_ping_and_close() {
        let mut out = Vec::new();
        let mut s = WsSession::new("v5.channel.k8s.io", true, false, true, &mut out);
        assert_eq!(out, vec![0x82, 1, 1], "initial empty stdout message");
        out.clear();
        let mut ev = Vec::new();
        let mut bytes = client_frame(2, false, &[0, b'a']);
        bytes.extend(client_frame(9, true, b"p"));
        bytes.extend(client_frame(0, true, b"bc"));
        bytes.extend(client_frame(2, true, &[255, 0]));
        // Feed one byte at a time: the parser must cope with any split.
        for b in &bytes {
            s.feed(std::slice::from_ref(b), &mut out, &mut ev);
        }
        assert_eq!(
            ev,
            vec![SessionEvent::Stdin(b"abc".to_vec()), SessionEvent::StdinEof]
        );
        assert_eq!(out, vec![0x8A, 1, b'p'], "pong");
        out.clear();
        ev.clear();
        s.feed(
            &client_frame(8, true, &1000u16.to_be_bytes()),
            &mut out,
            &mut ev,
        );
        assert_eq!(ev, vec![SessionEvent::Closed]);
        assert_eq!(out, vec![0x88, 2, 0x03, 0xe8]);
    }

    #[test]
    fn unmasked_and_oversized_frames_fail() {
        let mut out = Vec::new();
        let mut s = WsSession::new("v4.channel.k8s.io", true, false, true, &mut out);
        let mut ev = Vec::new();
        s.feed(&[0x82, 0x01, 0x00], &mut out, &mut ev);
        assert!(matches!(ev[0], SessionEvent::ProtocolError(_)));
        let mut s = WsSession::new("v4.channel.k8s.io", true, false, true, &mut out);
        let mut ev = Vec::new();
        let mut big = vec![0x82, 0xff];
        big.extend_from_slice(&(u64::MAX).to_be_bytes());
        s.feed(&big, &mut out, &mut ev);
        assert!(matches!(ev[0], SessionEvent::ProtocolError(_)));
    }

    #[test]
    fn base64_channels() {
        let mut out = Vec::new();
        let mut s = WsSession::new("v4.base64.channel.k8s.io", true, false, true, &mut out);
        assert_eq!(out, vec![0x81, 1, b'1']);
        out.clear();
        s.send(1, b"hi", &mut out);
        assert_eq!(out, [&[0x81u8, 5][..], b"1aGk="].concat());
        let mut ev = Vec::new();
        s.feed(&client_frame(1, true, b"0aGk="), &mut Vec::new(), &mut ev);
        assert_eq!(ev, vec![SessionEvent::Stdin(b"hi".to_vec())]);
    }
}
