//! TCP connect probes: non-blocking connects registered with the poll, and connects that
//! also read an SSH greeting. Timeouts are armed by the caller, readiness decided in probes.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};

/// Connects in flight, keyed by the poll token each one was registered with.
#[derive(Debug, Default)]
pub struct TcpProbes {
    conns: HashMap<Token, Conn>,
}

/// An SSH server's greeting starts with this (RFC 4253 identification string).
const SSH_BANNER: &[u8] = b"SSH-";

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    /// SSH mode: the greeting bytes read so far (`None` = a plain connect probe).
    banner: Option<Vec<u8>>,
}

impl TcpProbes {
    pub fn new() -> TcpProbes {
        TcpProbes::default()
    }

    pub fn in_flight(&self) -> usize {
        self.conns.len()
    }

    /// Start a non-blocking connect to `addr`, registered under `token` (which must not be in
    /// use). An immediate failure (no route, …) is returned as the probe's result.
    pub fn start(&mut self, token: Token, addr: SocketAddr, registry: &Registry) -> io::Result<()> {
        let mut stream = TcpStream::connect(addr)?;
        registry.register(&mut stream, token, Interest::WRITABLE)?;
        let banner = None;
        self.conns.insert(token, Conn { stream, banner });
        Ok(())
    }

    /// Like [`TcpProbes::start`], but the probe succeeds only once the server's first bytes
    /// are `SSH-` (a port that accepts and says something else, or nothing, is not ready).
    pub fn start_banner(
        &mut self,
        token: Token,
        addr: SocketAddr,
        registry: &Registry,
    ) -> io::Result<()> {
        let mut stream = TcpStream::connect(addr)?;
        registry.register(&mut stream, token, Interest::WRITABLE | Interest::READABLE)?;
        let banner = Some(Vec::new());
        self.conns.insert(token, Conn { stream, banner });
        Ok(())
    }

    /// Handle an event for `token`. `Some(result)` when the connect finished (the socket is
    /// then closed and deregistered); `None` for unknown tokens and spurious wake-ups.
    pub fn on_event(&mut self, token: Token, registry: &Registry) -> Option<io::Result<()>> {
        let conn = self.conns.get_mut(&token)?;
        let result = match conn.stream.take_error() {
            Ok(Some(e)) | Err(e) => Err(e),
            Ok(None) => match conn.stream.peer_addr() {
                Ok(_) => match conn.banner.as_mut() {
                    None => Ok(()),
                    Some(seen) => read_banner(&mut conn.stream, seen)?,
                },
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return None,
                Err(e) => Err(e),
            },
        };
        self.cancel(token, registry);
        Some(result)
    }

    /// Abandon a connect (timeout, pod gone). True if it was in flight.
    pub fn cancel(&mut self, token: Token, registry: &Registry) -> bool {
        match self.conns.remove(&token) {
            Some(Conn { mut stream, .. }) => {
                // Dropping closes the socket, which also removes it from epoll; deregistering
                // first keeps mio's bookkeeping explicit. Failure changes nothing we can act on.
                let _ = registry.deregister(&mut stream);
                true
            }
            None => false,
        }
    }
}

/// Reads what the server has sent (edge-triggered: until it would block). `None` while fewer
/// than four bytes came; then whether they are an SSH greeting.
fn read_banner(stream: &mut TcpStream, seen: &mut Vec<u8>) -> Option<io::Result<()>> {
    let mut buf = [0u8; 64];
    while seen.len() < SSH_BANNER.len() {
        match stream.read(&mut buf) {
            Ok(0) => {
                return Some(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before an SSH banner",
                )))
            }
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Some(Err(e)),
        }
    }
    if seen.starts_with(SSH_BANNER) {
        Some(Ok(()))
    } else {
        Some(Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "no SSH banner (the greeting does not start with SSH-)",
        )))
    }
}
