//! TCP connect probes: non-blocking connects registered with the poll.
//! Only connects and reports; timeouts are armed by the caller, readiness decided in probes.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};

/// Connects in flight, keyed by the poll token each one was registered with.
#[derive(Debug, Default)]
pub struct TcpProbes {
    conns: HashMap<Token, TcpStream>,
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
        self.conns.insert(token, stream);
        Ok(())
    }

    /// Handle an event for `token`. `Some(result)` when the connect finished (the socket is
    /// then closed and deregistered); `None` for unknown tokens and spurious wake-ups.
    pub fn on_event(&mut self, token: Token, registry: &Registry) -> Option<io::Result<()>> {
        let stream = self.conns.get(&token)?;
        let result = match stream.take_error() {
            Ok(Some(e)) | Err(e) => Err(e),
            Ok(None) => match stream.peer_addr() {
                Ok(_) => Ok(()),
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
            Some(mut stream) => {
                // Dropping closes the socket, which also removes it from epoll; deregistering
                // first keeps mio's bookkeeping explicit. Failure changes nothing we can act on.
                let _ = registry.deregister(&mut stream);
                true
            }
            None => false,
        }
    }
}
