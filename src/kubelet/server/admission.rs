//! Connection admission of the kubelet server: accepting sockets within the caps in total, per
//! peer address and while unauthenticated, and choosing which unauthenticated one makes room.

use std::io;
use std::net::IpAddr;

use mio::{Interest, Token};
use rustls::ServerConnection;

use super::conn::{Conn, Phase};
use super::socket::STDIN_CHECK_FIRST;
use super::KubeletServer;
use crate::metrics::admission::{PeerKey, Refusal};
use crate::reactor::Reactor;

impl KubeletServer {
    pub(super) fn accept<M: Send + 'static>(&mut self, r: &mut Reactor<M>) {
        let now = r.now();
        if self.tls.maybe_reload(now) {
            self.export_cert_expiry();
        }
        loop {
            let Some((l, _)) = self.listener.as_ref() else {
                return;
            };
            match l.accept() {
                Ok((mut sock, addr)) => {
                    if let Err((why, limit)) = self.admit(r, addr.ip()) {
                        self.refusals.refused(why, addr.ip(), limit, now);
                        drop(sock);
                        continue;
                    }
                    let tls = match ServerConnection::new(self.tls.config()) {
                        Ok(t) => t,
                        Err(e) => {
                            log::warn!("kubelet: TLS session: {e}");
                            continue;
                        }
                    };
                    let token = r.token_in(super::RANGE);
                    if r.registry()
                        .register(&mut sock, token, Interest::READABLE)
                        .is_err()
                    {
                        continue;
                    }
                    let _ = sock.set_nodelay(true);
                    let peer = PeerKey::of(addr.ip());
                    self.peers.add(peer);
                    self.unauthenticated.add(peer);
                    self.unauth_order.push_back(token);
                    if self.unauth_order.len() > 2 * self.unauthenticated.total() + 64 {
                        let conns = &self.conns;
                        self.unauth_order.retain(|t| {
                            *t == token || conns.get(t).is_some_and(|c| !c.authenticated)
                        });
                    }
                    self.conns.insert(
                        token,
                        Conn {
                            sock,
                            tls,
                            inbuf: Vec::new(),
                            out: Vec::new(),
                            phase: Phase::Head,
                            deadline: Some(now + self.cfg.unauthenticated_timeout),
                            interest: Interest::READABLE,
                            keep_alive: true,
                            cert_user: None,
                            peer,
                            spoke: false,
                            authenticated: false,
                            read_paused: false,
                            child_paused: false,
                            stall_deadline: None,
                            recheck: None,
                            recheck_every: STDIN_CHECK_FIRST,
                            stdin_seen: 0,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("kubelet: accept: {e}");
                    return;
                }
            }
        }
    }

    /// Whether a new connection from `ip` may be kept, making room by closing the oldest
    /// unauthenticated connection when a global cap is reached. Err: why not, and the limit.
    fn admit<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        ip: IpAddr,
    ) -> Result<(), (Refusal, usize)> {
        let peer = PeerKey::of(ip);
        let cfg = &self.cfg;
        if self.peers.of(peer) >= cfg.max_connections_per_peer {
            return Err((Refusal::PerPeer, cfg.max_connections_per_peer));
        }
        if self.unauthenticated.of(peer) >= cfg.max_unauthenticated_per_peer {
            return Err((Refusal::PerPeer, cfg.max_unauthenticated_per_peer));
        }
        let limit = cfg.max_connections;
        if self.conns.len() < limit && self.unauthenticated.total() < cfg.max_unauthenticated {
            return Ok(());
        }
        match self.evictable() {
            Some(t) => {
                log::debug!(
                    "kubelet: connection limit reached; closing an unauthenticated connection"
                );
                self.close(r, t);
                Ok(())
            }
            None => Err((Refusal::Global, limit)),
        }
    }

    /// The unauthenticated connection to close for a newcomer: the oldest silent one (nothing
    /// read from it and nothing waiting in its socket), else the oldest. A client busy with
    /// its handshake thus survives a flood of sockets that never say anything, even when it
    /// was accepted in the same batch as thousands of them.
    fn evictable(&mut self) -> Option<Token> {
        const LOOK_AT: usize = 32;
        let mut talking = Vec::new();
        let mut victim = None;
        while talking.len() < LOOK_AT {
            let Some(t) = self.unauth_order.pop_front() else {
                break;
            };
            // Closed or authenticated since: a stale entry.
            let Some(c) = self.conns.get(&t).filter(|c| !c.authenticated) else {
                continue;
            };
            let mut probe = [0u8; 1];
            let waiting = matches!(c.sock.peek(&mut probe), Ok(n) if n > 0);
            if c.spoke || waiting {
                talking.push(t);
            } else {
                victim = Some(t);
                break;
            }
        }
        // Those that talk keep their place at the front, oldest first.
        for t in talking.iter().rev() {
            self.unauth_order.push_front(*t);
        }
        victim.or_else(|| {
            let t = *talking.first()?;
            self.unauth_order.pop_front();
            Some(t)
        })
    }

    /// The caller proved who it is: the connection leaves the unauthenticated budget.
    pub(super) fn mark_authenticated<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
    ) {
        let head_timeout = self.cfg.head_timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if c.authenticated {
            return;
        }
        c.authenticated = true;
        self.unauthenticated.remove(c.peer);
        if matches!(c.phase, Phase::Head) {
            c.deadline = Some(r.now() + head_timeout);
        }
    }
}
