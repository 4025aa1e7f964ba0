//! Port forwarding over WebSocket channels (`v4.channel.k8s.io`, base64 variant, or no
//! subprotocol): the ports come from `?port=`, port i owns data channel 2i and error channel
//! 2i+1, and the first message on each starts with the port as a little-endian u16.
//!
//! One connection per port for the life of the WebSocket; it closes once every port ended.

use base64::Engine;

use super::{parse_port, Key, PfEvent, PortError};
use crate::kubelet::routes::Request;
use crate::kubelet::streams::websocket::{channel_message, WsInput, WsReader};

/// Ports one WebSocket may forward (two channels each, one byte per channel number).
pub const MAX_PORTS: usize = 64;
/// Outgoing data is split into messages of at most this size.
const OUT_FRAME: usize = 64 * 1024;

/// The `port` query values (each may be a comma-separated list), 1-65535 each.
pub fn parse_ports(req: &Request) -> Result<Vec<u16>, PortError> {
    let mut ports = Vec::new();
    for v in req.query_values("port") {
        if v.is_empty() {
            return Err(PortError::EmptyQuery);
        }
        for p in v.split(',') {
            ports.push(parse_port(p)?);
        }
    }
    if ports.is_empty() {
        return Err(PortError::NoQuery);
    }
    if ports.len() > MAX_PORTS {
        return Err(PortError::TooMany(MAX_PORTS));
    }
    Ok(ports)
}

pub struct ChannelForward {
    reader: WsReader,
    base64: bool,
    /// Per port: whether it has ended on our side.
    ended: Vec<bool>,
}

impl ChannelForward {
    /// Announces each port on its two channels and reports them opened (key = port index).
    pub fn new(protocol: &str, ports: Vec<u16>, out: &mut Vec<u8>, ev: &mut Vec<PfEvent>) -> Self {
        let s = ChannelForward {
            reader: WsReader::new(),
            base64: protocol.contains("base64"),
            ended: vec![false; ports.len()],
        };
        for (i, port) in ports.iter().enumerate() {
            let le = port.to_le_bytes();
            s.message(2 * i as u8, &le, out);
            s.message(2 * i as u8 + 1, &le, out);
            ev.push(PfEvent::Open {
                key: i as Key,
                port: Ok(*port),
            });
        }
        s
    }

    fn message(&self, channel: u8, data: &[u8], out: &mut Vec<u8>) {
        channel_message(self.base64, channel, data, out);
    }

    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<PfEvent>) {
        let mut got = Vec::new();
        self.reader.feed(data, out, &mut got);
        for g in got {
            match g {
                WsInput::Message(_, msg) => {
                    let Some((&first, rest)) = msg.split_first() else {
                        continue;
                    };
                    let (channel, data) = if self.base64 {
                        let decoded = base64::engine::general_purpose::STANDARD.decode(rest);
                        match decoded {
                            Ok(d) => (first.wrapping_sub(b'0'), d),
                            Err(_) => {
                                self.reader.close(1007, out);
                                ev.push(PfEvent::ProtocolError("bad base64 payload".into()));
                                return;
                            }
                        }
                    } else {
                        (first, rest.to_vec())
                    };
                    let key = Key::from(channel / 2);
                    // Only data channels carry client bytes; the rest is ignored.
                    if channel % 2 == 0
                        && !data.is_empty()
                        && self.ended.get(key as usize) == Some(&false)
                    {
                        ev.push(PfEvent::Data { key, data });
                    }
                }
                WsInput::Closed => ev.push(PfEvent::Closed),
                WsInput::Broken(why) => ev.push(PfEvent::ProtocolError(why)),
            }
            if self.reader.closed() {
                return;
            }
        }
    }

    pub fn send(&mut self, key: Key, data: &[u8], out: &mut Vec<u8>) {
        if self.reader.closed() || self.ended.get(key as usize) != Some(&false) {
            return;
        }
        for piece in data.chunks(OUT_FRAME) {
            self.message(2 * key as u8, piece, out);
        }
    }

    /// Ends a port (the message on its error channel); the last port closes the WebSocket.
    pub fn end(&mut self, key: Key, message: Option<&str>, out: &mut Vec<u8>) {
        if self.reader.closed() || self.ended.get(key as usize) != Some(&false) {
            return;
        }
        if let Some(m) = message {
            self.message(2 * key as u8 + 1, m.as_bytes(), out);
        }
        self.ended[key as usize] = true;
        if self.ended.iter().all(|e| *e) {
            self.reader.close(1000, out);
        }
    }

    pub fn done(&self) -> bool {
        self.reader.closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::streams::websocket::tests::client_frame;
    use crate::kubelet::streams::websocket::BINARY;

    #[test]
    fn ports_announced_data_routed_and_closed_when_all_end() {
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        let mut s = ChannelForward::new("v4.channel.k8s.io", vec![22, 80], &mut out, &mut ev);
        assert_eq!(&out[..5], &[0x82, 3, 0, 22, 0], "port 22 on data channel 0");
        assert_eq!(ev.len(), 2);
        ev.clear();
        out.clear();
        s.feed(
            &client_frame(BINARY, true, &[2, b'h', b'i']),
            &mut out,
            &mut ev,
        );
        s.feed(&client_frame(BINARY, true, &[1, b'x']), &mut out, &mut ev);
        assert_eq!(
            ev,
            vec![PfEvent::Data {
                key: 1,
                data: b"hi".to_vec()
            }]
        );
        s.send(1, b"yo", &mut out);
        assert_eq!(out, vec![0x82, 3, 2, b'y', b'o']);
        out.clear();
        s.end(0, Some("refused"), &mut out);
        assert!(!s.done());
        s.end(1, None, &mut out);
        assert!(s.done());
        assert!(out.ends_with(&[0x88, 2, 0x03, 0xe8]));
    }
}
