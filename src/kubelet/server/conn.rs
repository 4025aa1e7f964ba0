//! One client connection of the kubelet server: its socket, buffers, phase and deadlines, and
//! how it ends (close_notify when done, its child killed or its review cancelled when dropped).

use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Interest, Token};
use rustls::ServerConnection;

use super::AuthId;
use super::KubeletServer;
use crate::kubelet::auth::UserInfo;
use crate::kubelet::exec::Session;
use crate::kubelet::logs::LogShaper;
use crate::kubelet::routes::Request;
use crate::metrics::admission::PeerKey;
use crate::reactor::{ChildId, Reactor};

pub(super) enum Phase {
    /// Waiting for (the rest of) a request head.
    Head,
    /// Head parsed; the daemon is checking who may do what.
    WaitAuth { req: Request, id: AuthId },
    /// `/metrics/cadvisor` waits for its text from the render thread.
    WaitRender,
    /// `/containerLogs`: streaming a `vm logs` child as a chunked body.
    Logs {
        child: Option<ChildId>,
        shaper: LogShaper,
        head_sent: bool,
        stderr: Vec<u8>,
    },
    /// Upgraded exec / attach session.
    Exec {
        session: Box<Session>,
        child: Option<ChildId>,
        argv: Vec<String>,
        stdin: bool,
        attach: bool,
        stdin_buf: Vec<Vec<u8>>,
        stdin_eof: bool,
        /// Stdin bytes the client sent so far (queued, written or dropped).
        stdin_handed: u64,
        /// The command ended and `finish` ran, but output still waits for the peer's window.
        ended: bool,
    },
    /// Upgraded port-forward session and its connections to the guest.
    PortForward(Box<super::forward::Forwarding>),
    /// Flushing the last bytes, then closing.
    Closing,
}

pub(super) struct Conn {
    pub(super) sock: TcpStream,
    pub(super) tls: ServerConnection,
    pub(super) inbuf: Vec<u8>,
    pub(super) out: Vec<u8>,
    pub(super) phase: Phase,
    pub(super) deadline: Option<Instant>,
    /// What the socket is registered for.
    pub(super) interest: Interest,
    /// Keep the connection for another request after the current response.
    pub(super) keep_alive: bool,
    /// The peer's verified certificate user, computed once after the handshake.
    pub(super) cert_user: Option<Option<UserInfo>>,
    pub(super) peer: PeerKey,
    /// The client has sent something (a TLS ClientHello at least).
    pub(super) spoke: bool,
    /// A request on it proved who the caller is (or authentication is off and one was served).
    pub(super) authenticated: bool,
    /// The socket is not read: too much output or exec stdin is queued.
    pub(super) read_paused: bool,
    /// The child's output pipes are not read: too much output is queued.
    pub(super) child_paused: bool,
    /// Output over `output_pause_at` and nothing delivered since: closed at this instant.
    pub(super) stall_deadline: Option<Instant>,
    /// Exec stdin waits for the child: look again at this instant, then wait `recheck_every`.
    pub(super) recheck: Option<Instant>,
    pub(super) recheck_every: Duration,
    /// Stdin the child had consumed at the last check.
    pub(super) stdin_seen: u64,
}

impl KubeletServer {
    pub(super) fn close_if_done<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let done = self.conns.get(&token).is_some_and(|c| {
            matches!(c.phase, Phase::Closing) && c.out.is_empty() && !c.tls.wants_write()
        });
        if done {
            if let Some(c) = self.conns.get_mut(&token) {
                c.tls.send_close_notify();
                let _ = c.tls.write_tls(&mut c.sock);
            }
            self.close(r, token);
        }
    }

    pub(super) fn close<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(mut c) = self.conns.remove(&token) else {
            return;
        };
        self.peers.remove(c.peer);
        if !c.authenticated {
            self.unauthenticated.remove(c.peer);
        }
        let _ = r.registry().deregister(&mut c.sock);
        match c.phase {
            Phase::Logs {
                child: Some(id), ..
            }
            | Phase::Exec {
                child: Some(id), ..
            } if self.children.remove(&id).is_some() => r.kill(id),
            Phase::WaitAuth { id, .. } => {
                self.drop_pending(id, true);
            }
            Phase::WaitRender => self.render.forget(token),
            Phase::PortForward(mut f) => self.drop_forwards(r, &mut f),
            _ => {}
        }
    }
}
