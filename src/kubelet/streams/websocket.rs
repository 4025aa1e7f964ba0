//! RFC 6455 framing for the streaming routes: the handshake answer, unmasked server frames, and
//! a reader of masked client frames that assembles fragments and answers pings and closes.
//!
//! Pure bytes in, messages and bytes out; what a message means is the caller's business.

use base64::Engine;

/// The largest client message accepted (a bigger one closes with 1009).
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;

const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Opcodes of data frames.
pub const TEXT: u8 = 1;
pub const BINARY: u8 = 2;
const CLOSE: u8 = 8;
const PING: u8 = 9;
const PONG: u8 = 0xA;

/// `Sec-WebSocket-Accept` for a client key.
pub fn accept_key(key: &str) -> String {
    let d = ring::digest::digest(
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        format!("{}{GUID}", key.trim()).as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(d.as_ref())
}

/// The 101 response for a WebSocket upgrade; `protocol` empty: no subprotocol header.
pub fn handshake_response(accept: &str, protocol: &str) -> Vec<u8> {
    let proto = if protocol.is_empty() {
        String::new()
    } else {
        format!("Sec-WebSocket-Protocol: {protocol}\r\n")
    };
    format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n{proto}\r\n"
    )
    .into_bytes()
}

/// Appends one unmasked server frame.
pub fn frame(opcode: u8, payload: &[u8], out: &mut Vec<u8>) {
    frame_parts(opcode, &[], payload, out);
}

/// Appends one unmasked server frame whose payload is `head` then `payload`, copied once.
pub fn frame_parts(opcode: u8, head: &[u8], payload: &[u8], out: &mut Vec<u8>) {
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

/// Appends one message on a channel of the channel.k8s.io family: the channel byte then the
/// data in a binary frame, or (base64 subprotocols) the channel digit then base64 in a text frame.
pub fn channel_message(base64: bool, channel: u8, data: &[u8], out: &mut Vec<u8>) {
    if base64 {
        let mut p = vec![b'0'.wrapping_add(channel)];
        p.extend_from_slice(
            base64::engine::general_purpose::STANDARD
                .encode(data)
                .as_bytes(),
        );
        frame(TEXT, &p, out);
    } else {
        frame_parts(BINARY, &[channel], data, out);
    }
}

/// Appends a close frame with `code`.
pub fn close_frame(code: u16, out: &mut Vec<u8>) {
    frame(CLOSE, &code.to_be_bytes(), out);
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

/// What the client sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WsInput {
    /// A complete data message: its opcode (TEXT or BINARY) and payload.
    Message(u8, Vec<u8>),
    /// The client sent a close (answered already).
    Closed,
    /// The client broke the protocol; a close went out.
    Broken(String),
}

/// Reads masked client frames.
#[derive(Default)]
pub struct WsReader {
    buf: Vec<u8>,
    /// Bytes of `buf` already parsed; dropped once per `feed`, not once per frame.
    pos: usize,
    /// Fragmented message being assembled: (opcode, data).
    partial: Option<(u8, Vec<u8>)>,
    closed: bool,
}

impl WsReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// True once a close was sent or received.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Sends a close with `code` (once).
    pub fn close(&mut self, code: u16, out: &mut Vec<u8>) {
        if !self.closed {
            close_frame(code, out);
            self.closed = true;
        }
    }

    fn fail(&mut self, code: u16, why: &str, out: &mut Vec<u8>, got: &mut Vec<WsInput>) {
        if !self.closed {
            let mut p = code.to_be_bytes().to_vec();
            p.extend_from_slice(why.as_bytes());
            frame(CLOSE, &p, out);
            self.closed = true;
        }
        got.push(WsInput::Broken(why.to_string()));
    }

    /// Parses client bytes; pongs and close answers go to `out`, messages to `got`.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, got: &mut Vec<WsInput>) {
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
                return self.fail(1002, "reserved bits set", out, got);
            }
            if b1 & 0x80 == 0 {
                return self.fail(1002, "client frames must be masked", out, got);
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
                return self.fail(1009, "message too big", out, got);
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
                CLOSE => {
                    if !self.closed {
                        frame(
                            CLOSE,
                            payload.get(..2).unwrap_or(&1000u16.to_be_bytes()),
                            out,
                        );
                        self.closed = true;
                    }
                    got.push(WsInput::Closed);
                    return;
                }
                PING => {
                    if payload.len() > 125 {
                        return self.fail(1002, "control frame too long", out, got);
                    }
                    frame(PONG, &payload, out);
                }
                PONG => {}
                0x0 => {
                    let Some((op, mut acc)) = self.partial.take() else {
                        return self.fail(1002, "continuation without a message", out, got);
                    };
                    if acc.len() + payload.len() > MAX_MESSAGE {
                        return self.fail(1009, "message too big", out, got);
                    }
                    acc.extend_from_slice(&payload);
                    if fin {
                        got.push(WsInput::Message(op, acc));
                    } else {
                        self.partial = Some((op, acc));
                    }
                }
                TEXT | BINARY => {
                    if self.partial.is_some() {
                        return self.fail(1002, "new message inside a fragmented one", out, got);
                    }
                    if fin {
                        got.push(WsInput::Message(opcode, payload));
                    } else {
                        self.partial = Some((opcode, payload));
                    }
                }
                _ => return self.fail(1002, "unknown opcode", out, got),
            }
            if self.closed {
                return;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
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

    /// A masked client frame, as a peer would send it.
    pub(crate) fn client_frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
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
    fn fragments_pings_and_close() {
        let (mut r, mut out, mut got) = (WsReader::new(), Vec::new(), Vec::new());
        let mut bytes = client_frame(BINARY, false, b"ab");
        bytes.extend(client_frame(PING, true, b"p"));
        bytes.extend(client_frame(0, true, b"c"));
        for b in &bytes {
            r.feed(std::slice::from_ref(b), &mut out, &mut got);
        }
        assert_eq!(got, vec![WsInput::Message(BINARY, b"abc".to_vec())]);
        assert_eq!(out, vec![0x8A, 1, b'p'], "pong");
        out.clear();
        r.feed(
            &client_frame(CLOSE, true, &1000u16.to_be_bytes()),
            &mut out,
            &mut got,
        );
        assert_eq!(got.last(), Some(&WsInput::Closed));
        assert_eq!(out, vec![0x88, 2, 0x03, 0xe8]);
        assert!(r.closed());
    }
}
