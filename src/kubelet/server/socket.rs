//! The kubelet server's socket I/O: TLS reads within a budget, writes of queued output, and the
//! pacing that pauses reading (socket and child) while too much waits for a slow client.

use std::io::{self, Read, Write};
use std::time::Duration;

use mio::{Interest, Token};

use super::conn::{Conn, Phase};
use super::KubeletServer;
use crate::kubelet::auth;
use crate::kubelet::tls::cert_identity;
use crate::reactor::Reactor;

/// Bytes read from one connection per readiness event before yielding to others.
const READ_BUDGET: usize = 256 * 1024;
/// First and longest pause between checks of how much queued exec stdin the child consumed
/// (the reactor writes stdin on its own; the wait doubles while nothing is consumed).
pub(super) const STDIN_CHECK_FIRST: Duration = Duration::from_millis(5);
const STDIN_CHECK_MAX: Duration = Duration::from_millis(320);

impl KubeletServer {
    pub(super) fn read_conn<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let mut plain = Vec::new();
        let mut eof = false;
        let mut failed = false;
        let mut budget_hit = false;
        let mut verified = false;
        {
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            let mut total = 0usize;
            let mut buf = [0u8; 16 * 1024];
            loop {
                match c.tls.read_tls(&mut c.sock) {
                    Ok(0) => {
                        eof = true;
                        break;
                    }
                    Ok(n) => {
                        total += n;
                        c.spoke = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
                if let Err(e) = c.tls.process_new_packets() {
                    log::debug!("kubelet: TLS error: {e}");
                    let _ = c.tls.write_tls(&mut c.sock);
                    failed = true;
                    break;
                }
                loop {
                    match c.tls.reader().read(&mut buf) {
                        Ok(0) => {
                            eof = true;
                            break;
                        }
                        Ok(n) => plain.extend_from_slice(&buf[..n]),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(_) => {
                            eof = true;
                            break;
                        }
                    }
                }
                if eof {
                    break;
                }
                if total >= READ_BUDGET {
                    budget_hit = true;
                    break;
                }
            }
            if c.cert_user.is_none() && !c.tls.is_handshaking() {
                c.cert_user = Some(
                    c.tls
                        .peer_certificates()
                        .and_then(|certs| certs.first())
                        .and_then(|leaf| cert_identity(leaf))
                        .and_then(|id| auth::user_from_cert(&id)),
                );
                verified = c.cert_user.as_ref().is_some_and(Option::is_some);
            }
        }
        if verified {
            self.mark_authenticated(r, token);
        }
        if failed {
            self.close(r, token);
            return;
        }
        if !plain.is_empty() {
            self.input(r, token, &plain);
        }
        if eof {
            self.peer_closed(r, token);
            return;
        }
        // Handshake replies and anything queued.
        self.flush(r, token);
        if budget_hit {
            // Re-arming makes epoll report the socket again if it is still readable, so the
            // remainder is read on a later turn without starving other connections.
            if let Some(c) = self.conns.get_mut(&token) {
                let want = interest_of(c);
                if r.registry().reregister(&mut c.sock, token, want).is_ok() {
                    c.interest = want;
                }
            }
        }
    }

    /// The client closed its side.
    fn peer_closed<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match &mut c.phase {
            // A finished response still being flushed: let it go out.
            Phase::Closing if !c.out.is_empty() => {}
            _ => {
                self.close(r, token);
                return;
            }
        }
        self.flush(r, token);
    }

    /// Pushes queued plaintext through TLS to the socket, then re-decides what is read.
    pub(super) fn flush<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        self.ack_stdin(r, token);
        if self
            .conns
            .get(&token)
            .is_some_and(|c| matches!(c.phase, Phase::PortForward(_)))
        {
            self.expire_connects(r, token);
        }
        let mut failed = false;
        let mut delivered = false;
        {
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            // Bytes of `out` handed to TLS; removed once at the end, not after every record
            // batch (a drain per 64 KiB of a megabyte of queued output is a megabyte memmove).
            let mut taken = 0;
            loop {
                let mut accepted = 0;
                if taken < c.out.len() {
                    match c.tls.writer().write(&c.out[taken..]) {
                        Ok(n) => {
                            accepted = n;
                            taken += n;
                        }
                        Err(_) => {
                            failed = true;
                            break;
                        }
                    }
                }
                let mut blocked = false;
                let mut sent = false;
                while c.tls.wants_write() {
                    match c.tls.write_tls(&mut c.sock) {
                        Ok(0) => {
                            failed = true;
                            break;
                        }
                        Ok(_) => {
                            delivered = true;
                            sent = true;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            blocked = true;
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => {
                            failed = true;
                            break;
                        }
                    }
                }
                // Nothing taken and nothing sent (rustls' buffer is full while it waits for
                // the peer): stop; the next readiness event continues. Records sent just now
                // made room in rustls' buffer: go round again, or nothing would ever come back
                // for this output (the socket did not block, so no readiness event follows).
                if failed
                    || blocked
                    || taken == c.out.len()
                    || (accepted == 0 && !sent && !c.tls.wants_write())
                {
                    break;
                }
            }
            c.out.drain(..taken);
        }
        if failed {
            self.close(r, token);
            return;
        }
        let (resumed, guests_resumed) = self.pace(r, token, delivered);
        if resumed {
            // Requests that waited in the input buffer while the client was not reading.
            self.after_input(r, token);
        }
        if guests_resumed {
            self.read_guests(r, token);
            // What they had waiting goes out now.
            self.flush(r, token);
            return;
        }
        self.close_if_done(r, token);
    }

    /// Exec stdin: tells the session how much the child consumed (SPDY grants that much window
    /// back) and, while some still waits in the pipe, schedules another look (the reactor
    /// writes stdin on its own and reports nothing), backing off while the child reads nothing.
    fn ack_stdin<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::Exec {
            session,
            child,
            stdin_buf,
            stdin_handed,
            ..
        } = &mut c.phase
        else {
            return;
        };
        let queued = stdin_buf.iter().map(Vec::len).sum::<usize>()
            + child.map_or(0, |id| r.stdin_queued(id));
        let consumed = stdin_handed.saturating_sub(queued as u64);
        session.stdin_consumed(consumed, &mut c.out);
        if consumed > c.stdin_seen {
            c.stdin_seen = consumed;
            c.recheck_every = STDIN_CHECK_FIRST;
        }
        if queued == 0 {
            c.recheck = None;
            c.recheck_every = STDIN_CHECK_FIRST;
        } else if c.recheck.is_none() {
            c.recheck = Some(now + c.recheck_every);
            c.recheck_every = (c.recheck_every * 2).min(STDIN_CHECK_MAX);
        }
    }

    /// Decides from what is queued whether the socket and the child's output are read, and
    /// whether the client is stalling; registers the socket accordingly. `delivered`: bytes
    /// reached the socket just now. Returns whether reading the socket resumed, and whether
    /// reading a port-forward connection's guests did.
    fn pace<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        delivered: bool,
    ) -> (bool, bool) {
        let cap = self.cfg.output_pause_at;
        let stdin_cap = self.cfg.max_queued_stdin;
        let stall = self.cfg.write_stall_timeout;
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return (false, false);
        };
        let (held, child, stdin_queued) = match &c.phase {
            Phase::Exec {
                session,
                child,
                stdin_buf,
                ..
            } => (
                session.pending_output(),
                *child,
                stdin_buf.iter().map(Vec::len).sum::<usize>()
                    + child.map_or(0, |id| r.stdin_queued(id)),
            ),
            Phase::Logs { child, .. } => (0, *child, 0),
            Phase::PortForward(f) => (f.session.pending_output(), None, f.queued_to_guests()),
            _ => (0, None, 0),
        };
        let backlog = c.out.len() + held;
        let mut guests_resumed = false;
        if let Phase::PortForward(f) = &mut c.phase {
            if !f.guests_paused && backlog >= cap {
                f.guests_paused = true;
            } else if f.guests_paused && backlog <= cap / 2 {
                f.guests_paused = false;
                guests_resumed = true;
            }
        }
        if let Some(id) = child {
            if !c.child_paused && backlog >= cap {
                r.pause_output(id);
                c.child_paused = true;
            } else if c.child_paused && backlog <= cap / 2 {
                r.resume_output(id);
                c.child_paused = false;
            }
        }
        // Output held for the peer's SPDY window does not stop reading: the window update
        // that releases it arrives on this socket.
        let was_paused = c.read_paused;
        c.read_paused = if was_paused {
            c.out.len() > cap / 2 || stdin_queued > stdin_cap / 2
        } else {
            c.out.len() >= cap || stdin_queued >= stdin_cap
        };
        c.stall_deadline = match c.stall_deadline {
            _ if backlog < cap => None,
            Some(d) if !delivered => Some(d),
            _ => Some(now + stall),
        };
        let want = interest_of(c);
        if want != c.interest && r.registry().reregister(&mut c.sock, token, want).is_ok() {
            c.interest = want;
        }
        (was_paused && !c.read_paused, guests_resumed)
    }
}

/// What a connection's socket should be registered for: readable unless reading is paused,
/// writable while anything waits to be sent (mio needs one of the two: a paused, idle
/// connection waits on writable, which reports once and costs nothing).
fn interest_of(c: &Conn) -> Interest {
    let write = c.tls.wants_write() || !c.out.is_empty();
    match (c.read_paused, write) {
        (false, false) => Interest::READABLE,
        (false, true) => Interest::READABLE | Interest::WRITABLE,
        (true, _) => Interest::WRITABLE,
    }
}
