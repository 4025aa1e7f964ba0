//! Kubelet API `/portForward`: protocol negotiation and the session that carries forwarded
//! connections, over SPDY/3.1 (`portforward.k8s.io`), SPDY tunnelled in WebSocket binary
//! messages (`SPDY/3.1+portforward.k8s.io`, kubectl's default since 1.30) or WebSocket channel
//! pairs per `?port=` (`v4.channel.k8s.io`).
//!
//! Pure bytes in, events and bytes out; the server owns the sockets to the guest.

pub mod channels;
pub mod spdy;

use super::routes::Request;
use super::streams::websocket::{self, frame, WsInput, WsReader, BINARY};

/// The SPDY subprotocol of port forwarding.
pub const PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol that tunnels the SPDY one.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// WebSocket channel subprotocols, best first (none at all means binary channels too).
pub const CHANNEL_PROTOCOLS: [&str; 2] = ["v4.channel.k8s.io", "v4.base64.channel.k8s.io"];

/// One forwarded connection within its session.
pub type Key = u32;

/// Which transport a port-forward upgrade asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Upgrade {
    Spdy,
    Tunnel {
        accept: String,
    },
    Channels {
        protocol: String,
        accept: String,
        ports: Vec<u16>,
    },
}

/// Negotiates the transport. Errors carry the HTTP status and text.
pub fn negotiate(req: &Request) -> Result<Upgrade, (u16, String)> {
    let upgrade = req.header("upgrade").unwrap_or("").to_ascii_lowercase();
    if upgrade == "websocket" {
        let key = req
            .header("sec-websocket-key")
            .ok_or((400, "missing Sec-WebSocket-Key".to_string()))?;
        let accept = websocket::accept_key(key);
        let offered = req.header_list("sec-websocket-protocol");
        if offered.iter().any(|o| o == TUNNEL_PROTOCOL) {
            return Ok(Upgrade::Tunnel { accept });
        }
        let protocol = match CHANNEL_PROTOCOLS
            .iter()
            .find(|p| offered.iter().any(|o| o == *p))
        {
            Some(p) => p.to_string(),
            None if offered.is_empty() => String::new(),
            None => {
                return Err((
                    400,
                    format!("unable to upgrade: unsupported WebSocket subprotocol(s) {offered:?}; server supports {:?}", [TUNNEL_PROTOCOL, CHANNEL_PROTOCOLS[0], CHANNEL_PROTOCOLS[1]]),
                ))
            }
        };
        let ports = channels::parse_ports(req).map_err(|e| (400, e.to_string()))?;
        return Ok(Upgrade::Channels {
            protocol,
            accept,
            ports,
        });
    }
    if upgrade.starts_with("spdy/3.1") {
        let offered = req.header_list("x-stream-protocol-version");
        if offered.is_empty() {
            return Err((
                400,
                "unable to upgrade: X-Stream-Protocol-Version is required".into(),
            ));
        }
        if !offered.iter().any(|o| o == PROTOCOL) {
            return Err((403, format!("unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server supports [\"{PROTOCOL}\"]")));
        }
        return Ok(Upgrade::Spdy);
    }
    Err((
        400,
        "unable to upgrade: an Upgrade: SPDY/3.1 or websocket request is required".into(),
    ))
}

/// Why the ports a client named cannot be forwarded (the request's 400 text, or a
/// connection's error stream).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortError {
    /// Not a number 1-65535, as the client wrote it.
    Invalid(String),
    /// A SPDY stream pair without a `port` header.
    NoHeader,
    /// `?port=` given empty.
    EmptyQuery,
    /// No `?port=` on a WebSocket request.
    NoQuery,
    /// More ports than one WebSocket may forward.
    TooMany(usize),
}

impl std::fmt::Display for PortError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PortError::Invalid(text) => write!(f, "invalid port {text:?}: a port must be 1-65535"),
            PortError::NoHeader => f.write_str("no port header"),
            PortError::EmptyQuery => f.write_str("query parameter \"port\" cannot be empty"),
            PortError::NoQuery => f.write_str("query parameter \"port\" is required"),
            PortError::TooMany(max) => write!(f, "at most {max} ports per connection"),
        }
    }
}

impl std::error::Error for PortError {}

/// A port the client named: 1-65535, or why not (reported on the connection's error stream).
pub fn parse_port(text: &str) -> Result<u16, PortError> {
    match text.trim().parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) => Ok(p as u16),
        _ => Err(PortError::Invalid(text.to_string())),
    }
}

/// What the client did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PfEvent {
    /// A forwarded connection to `port` begins (Err: the port the client named is unusable).
    Open {
        key: Key,
        port: Result<u16, PortError>,
    },
    /// Bytes for the guest; acknowledge them with `consumed` once written.
    Data { key: Key, data: Vec<u8> },
    /// The client sends nothing more on this connection.
    Eof { key: Key },
    /// The client abandoned this connection.
    Reset { key: Key },
    /// The client went away or sent a close.
    Closed,
    /// The client broke the protocol; the connection is to be closed.
    ProtocolError(String),
}

/// One upgraded port-forward connection.
pub enum PfSession {
    Spdy(Box<spdy::SpdyForward>),
    /// SPDY whose bytes travel in WebSocket binary messages.
    Tunnel {
        reader: WsReader,
        inner: Box<spdy::SpdyForward>,
    },
    Channels(channels::ChannelForward),
}

/// Runs `f` on the tunnelled SPDY session and wraps what it wrote in one binary message.
fn tunnelled(
    inner: &mut spdy::SpdyForward,
    out: &mut Vec<u8>,
    f: impl FnOnce(&mut spdy::SpdyForward, &mut Vec<u8>),
) {
    let mut raw = Vec::new();
    f(inner, &mut raw);
    if !raw.is_empty() {
        frame(BINARY, &raw, out);
    }
}

impl PfSession {
    /// The upgrade's 101 response and the session behind it (channel sessions open their
    /// ports at once: their `Open` events are in `ev`).
    pub fn start(upgrade: Upgrade, out: &mut Vec<u8>, ev: &mut Vec<PfEvent>) -> PfSession {
        match upgrade {
            Upgrade::Spdy => {
                out.extend_from_slice(&super::streams::spdy::SpdyConn::handshake_response(
                    PROTOCOL,
                ));
                PfSession::Spdy(Box::default())
            }
            Upgrade::Tunnel { accept } => {
                out.extend_from_slice(&websocket::handshake_response(&accept, TUNNEL_PROTOCOL));
                PfSession::Tunnel {
                    reader: WsReader::new(),
                    inner: Box::default(),
                }
            }
            Upgrade::Channels {
                protocol,
                accept,
                ports,
            } => {
                out.extend_from_slice(&websocket::handshake_response(&accept, &protocol));
                PfSession::Channels(channels::ChannelForward::new(&protocol, ports, out, ev))
            }
        }
    }

    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<PfEvent>) {
        match self {
            PfSession::Spdy(s) => s.feed(data, out, ev),
            PfSession::Channels(s) => s.feed(data, out, ev),
            PfSession::Tunnel { reader, inner } => {
                let mut got = Vec::new();
                reader.feed(data, out, &mut got);
                for g in got {
                    match g {
                        WsInput::Message(BINARY, bytes) => {
                            tunnelled(inner, out, |s, raw| s.feed(&bytes, raw, ev))
                        }
                        WsInput::Message(..) => {
                            reader.close(1003, out);
                            ev.push(PfEvent::ProtocolError(
                                "text message in a SPDY tunnel".into(),
                            ));
                        }
                        WsInput::Closed => ev.push(PfEvent::Closed),
                        WsInput::Broken(why) => ev.push(PfEvent::ProtocolError(why)),
                    }
                    if reader.closed() {
                        return;
                    }
                }
            }
        }
    }

    /// Bytes from the guest for the client.
    pub fn send(&mut self, key: Key, data: &[u8], out: &mut Vec<u8>) {
        match self {
            PfSession::Spdy(s) => s.send(key, data, out),
            PfSession::Tunnel { inner, .. } => {
                tunnelled(inner, out, |s, raw| s.send(key, data, raw))
            }
            PfSession::Channels(s) => s.send(key, data, out),
        }
    }

    /// The guest closed its side: the client's read side of this connection ends.
    pub fn eof(&mut self, key: Key, out: &mut Vec<u8>) {
        match self {
            PfSession::Spdy(s) => s.end(key, None, out),
            PfSession::Tunnel { inner, .. } => {
                tunnelled(inner, out, |s, raw| s.end(key, None, raw))
            }
            PfSession::Channels(s) => s.end(key, None, out),
        }
    }

    /// The connection failed: `message` on its error stream, then it ends.
    pub fn fail(&mut self, key: Key, message: &str, out: &mut Vec<u8>) {
        match self {
            PfSession::Spdy(s) => s.end(key, Some(message), out),
            PfSession::Tunnel { inner, .. } => {
                tunnelled(inner, out, |s, raw| s.end(key, Some(message), raw))
            }
            PfSession::Channels(s) => s.end(key, Some(message), out),
        }
    }

    /// `n` bytes of this connection's data reached the guest (SPDY grants window back).
    pub fn consumed(&mut self, key: Key, n: usize, out: &mut Vec<u8>) {
        match self {
            PfSession::Spdy(s) => s.consumed(key, n, out),
            PfSession::Tunnel { inner, .. } => {
                tunnelled(inner, out, |s, raw| s.consumed(key, n, raw))
            }
            PfSession::Channels(_) => {}
        }
    }

    /// Output held back by flow control (SPDY windows).
    pub fn pending_output(&self) -> usize {
        match self {
            PfSession::Spdy(s) => s.pending_output(),
            PfSession::Tunnel { inner, .. } => inner.pending_output(),
            PfSession::Channels(_) => 0,
        }
    }

    /// True once the session has ended by itself (a channel session whose ports all ended).
    pub fn done(&self) -> bool {
        match self {
            PfSession::Spdy(s) => s.done(),
            PfSession::Tunnel { inner, .. } => inner.done(),
            PfSession::Channels(s) => s.done(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::routes::parse_head;

    fn req(head: &str) -> Request {
        parse_head(head.as_bytes()).unwrap().unwrap().0
    }

    #[test]
    fn negotiation_and_ports() {
        let r = req("POST /portForward/a/b HTTP/1.1\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: portforward.k8s.io\r\n\r\n");
        assert_eq!(negotiate(&r), Ok(Upgrade::Spdy));
        let r = req("POST /portForward/a/b HTTP/1.1\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n");
        assert_eq!(negotiate(&r).unwrap_err().0, 403);
        let r = req("GET /portForward/a/b HTTP/1.1\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: SPDY/3.1+portforward.k8s.io\r\n\r\n");
        assert!(matches!(negotiate(&r), Ok(Upgrade::Tunnel { .. })));
        let r = req("GET /portForward/a/b?port=80,22&port=8080 HTTP/1.1\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n");
        match negotiate(&r) {
            Ok(Upgrade::Channels {
                ports, protocol, ..
            }) => {
                assert_eq!(ports, vec![80, 22, 8080]);
                assert_eq!(protocol, "v4.channel.k8s.io");
            }
            other => panic!("{other:?}"),
        }
        let r = req("GET /portForward/a/b?port=0 HTTP/1.1\r\nUpgrade: websocket\r\nSec-WebSocket-Key: x\r\nSec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n");
        assert_eq!(negotiate(&r).unwrap_err().0, 400);
        assert_eq!(parse_port("22"), Ok(22));
        assert!(parse_port("0").is_err());
        assert!(parse_port("65536").is_err());
        assert!(parse_port("ssh").is_err());
    }
}
