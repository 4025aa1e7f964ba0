//! Requests on a kubelet connection: bytes routed to the exec session or the head buffer,
//! pipelined heads parsed in batches, responses queued with keep-alive, and phase deadlines.

use mio::Token;

use super::conn::Phase;
use super::KubeletServer;
use crate::kubelet::exec::SessionEvent;
use crate::kubelet::routes::{self, HeadError};
use crate::reactor::Reactor;

/// Client bytes buffered while not expected (pipelined requests, bytes during auth).
const MAX_IDLE_INPUT: usize = 64 * 1024;
/// Pipelined requests answered per connection and turn of the loop.
const PIPELINE_BATCH: usize = 32;

impl KubeletServer {
    pub(super) fn input<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        data: &[u8],
    ) {
        let now = r.now();
        let idle = self.cfg.stream_idle_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match &mut c.phase {
            Phase::Exec {
                session,
                child,
                stdin_buf,
                stdin_eof,
                stdin_handed,
                ended,
                ..
            } => {
                let mut events = Vec::new();
                session.feed(data, &mut c.out, &mut events);
                c.deadline = Some(now + idle);
                let child = *child;
                let mut ready = false;
                let mut close = false;
                for e in events {
                    match e {
                        SessionEvent::Ready => ready = true,
                        // Bounded by the caller: the socket is not read while too much waits.
                        SessionEvent::Stdin(d) => {
                            *stdin_handed += d.len() as u64;
                            match child {
                                Some(id) => {
                                    let _ = r.write_stdin(id, &d);
                                }
                                None => stdin_buf.push(d),
                            }
                        }
                        SessionEvent::StdinEof => match child {
                            Some(id) => r.close_stdin(id),
                            None => *stdin_eof = true,
                        },
                        SessionEvent::Closed => close = true,
                        SessionEvent::ProtocolError(e) => {
                            log::debug!("kubelet: exec protocol error: {e}");
                            close = true;
                        }
                    }
                }
                // A finished session whose last output waited for window: all sent now.
                close |= *ended && session.done();
                ready &= !*ended;
                if close {
                    if let Some(id) = child {
                        r.kill(id);
                    }
                    c.phase = Phase::Closing;
                    self.flush(r, token);
                    self.close_if_done(r, token);
                    return;
                }
                if ready {
                    self.start_exec(r, token);
                }
                self.flush(r, token);
            }
            Phase::PortForward(_) => self.forward_input(r, token, data),
            Phase::Closing => {}
            _ => {
                if c.inbuf.len() + data.len() > routes::MAX_HEAD_BYTES + MAX_IDLE_INPUT {
                    self.respond(r, token, routes::text(431, "request too large", true), true);
                    return;
                }
                c.inbuf.extend_from_slice(data);
                self.after_input(r, token);
            }
        }
    }

    /// Parses and handles complete request heads waiting in the input buffer.
    pub(super) fn after_input<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        for handled in 0.. {
            let now = r.now();
            let Some(c) = self.conns.get_mut(&token) else {
                return;
            };
            // Answers the client has not read yet: take no more requests until it does.
            if !matches!(c.phase, Phase::Head)
                || c.inbuf.is_empty()
                || c.out.len() >= self.cfg.output_pause_at
            {
                return;
            }
            // A pipelining client gets a batch per turn of the loop, then the others their turn.
            if handled == PIPELINE_BATCH {
                c.recheck = Some(now);
                return;
            }
            match routes::parse_head(&c.inbuf) {
                Ok(None) => return,
                Ok(Some((req, used))) => {
                    c.inbuf.drain(..used);
                    self.authenticate(r, token, req);
                }
                Err(HeadError::TooLarge) => {
                    return self.respond(
                        r,
                        token,
                        routes::text(431, "request header fields too large", true),
                        true,
                    );
                }
                Err(HeadError::Malformed(e)) => {
                    return self.respond(
                        r,
                        token,
                        routes::text(400, &format!("malformed request: {e}"), true),
                        true,
                    );
                }
                Err(HeadError::Body) => {
                    return self.respond(
                        r,
                        token,
                        routes::text(413, "request bodies are not accepted", true),
                        true,
                    );
                }
            }
        }
    }

    /// Queues a complete response; then either closes or waits for the next request.
    pub(super) fn respond<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        resp: Vec<u8>,
        close: bool,
    ) {
        let head_timeout = if self.conns.get(&token).is_some_and(|c| c.authenticated) {
            self.cfg.head_timeout
        } else {
            self.cfg.unauthenticated_timeout
        };
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let resp = if close
            && !resp
                .windows(17)
                .any(|w| w.eq_ignore_ascii_case(b"Connection: close"))
        {
            // Insert the header after the status line.
            let at = resp
                .windows(2)
                .position(|w| w == b"\r\n")
                .map(|p| p + 2)
                .unwrap_or(0);
            [&resp[..at], b"Connection: close\r\n", &resp[at..]].concat()
        } else {
            resp
        };
        c.out.extend_from_slice(&resp);
        if close || !c.keep_alive {
            c.phase = Phase::Closing;
            c.inbuf.clear();
        } else {
            c.phase = Phase::Head;
            c.deadline = Some(r.now() + head_timeout);
        }
        self.flush(r, token);
    }

    pub(super) fn expire<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match &c.phase {
            Phase::Head if !c.inbuf.is_empty() => {
                self.respond(r, token, routes::text(408, "request timeout", true), true);
                // Do not wait for a client that does not read either.
                if let Some(c) = self.conns.get_mut(&token) {
                    c.deadline = Some(r.now() + self.cfg.head_timeout);
                }
            }
            Phase::WaitAuth { id, .. } => {
                let id = *id;
                self.drop_pending(id, true);
                self.respond(
                    r,
                    token,
                    routes::text(500, "authorization timed out", true),
                    true,
                );
                if let Some(c) = self.conns.get_mut(&token) {
                    c.deadline = Some(r.now() + self.cfg.head_timeout);
                }
            }
            Phase::WaitRender => {
                self.render_timed_out(r, token);
                if let Some(c) = self.conns.get_mut(&token) {
                    c.deadline = Some(r.now() + self.cfg.head_timeout);
                }
            }
            _ => self.close(r, token),
        }
    }
}
