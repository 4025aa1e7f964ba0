//! Exec and attach over WebSocket (channel.k8s.io family): the channel byte (or base64 text
//! with a channel digit) on the shared RFC 6455 framing, stdin in, output and status out.
//!
//! Pure bytes in, bytes and events out.

use base64::Engine;

use super::SessionEvent;
pub use crate::kubelet::streams::websocket::{accept_key, frame, handshake_response, MAX_MESSAGE};
use crate::kubelet::streams::websocket::{channel_message, WsInput, WsReader};

/// Outgoing data is split into frames of at most this size.
const OUT_FRAME: usize = 64 * 1024;

pub struct WsSession {
    protocol: String,
    base64: bool,
    v5: bool,
    reader: WsReader,
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
            reader: WsReader::new(),
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
        channel_message(self.base64, channel, data, out);
    }

    /// Sends data on a channel (1 stdout, 2 stderr, 3 error), split into bounded frames.
    pub fn send(&mut self, channel: u8, data: &[u8], out: &mut Vec<u8>) {
        if self.reader.closed() {
            return;
        }
        for piece in data.chunks(OUT_FRAME) {
            self.message(channel, piece, out);
        }
    }

    /// Error-channel message (if any) then a normal close.
    pub fn finish(&mut self, status: Option<&str>, out: &mut Vec<u8>) {
        if self.reader.closed() {
            return;
        }
        if let Some(s) = status {
            self.message(3, s.as_bytes(), out);
        }
        self.reader.close(1000, out);
    }

    fn fail(&mut self, code: u16, why: &str, out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        if !self.reader.closed() {
            self.reader.close(code, out);
        }
        ev.push(SessionEvent::ProtocolError(why.to_string()));
    }

    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        let mut got = Vec::new();
        self.reader.feed(data, out, &mut got);
        for g in got {
            match g {
                WsInput::Message(_, msg) => self.message_in(msg, out, ev),
                WsInput::Closed => ev.push(SessionEvent::Closed),
                WsInput::Broken(why) => ev.push(SessionEvent::ProtocolError(why)),
            }
            if self.reader.closed() {
                return;
            }
        }
    }

    fn message_in(&mut self, msg: Vec<u8>, out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
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
    use crate::kubelet::streams::websocket::tests::client_frame;

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
