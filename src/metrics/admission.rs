//! Who may hold a connection to the daemon's HTTP listeners (kubelet API, /metrics): open
//! connections counted per peer address, the refused-connection counter and its rate-limited log.
//!
//! Plain bookkeeping: each server decides with these counts; nothing here touches a socket.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, Opts};

use super::PREFIX;

/// A refusal is logged at most this often per listener; the counter has every one.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

/// Pending connections the kernel queues for a listener before it drops SYNs (the standard
/// library's 128 overflows under a connection flood and costs legitimate clients a 1 s SYN
/// retransmit; the kernel caps it at net.core.somaxconn).
pub const LISTEN_BACKLOG: i32 = 4096;

/// A non-blocking listener on `addr` with `LISTEN_BACKLOG`.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<mio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(LISTEN_BACKLOG)?;
    Ok(mio::net::TcpListener::from_std(s.into()))
}

/// The address connections are counted under: the IPv4 address, or the /64 of an IPv6 one
/// (one host commonly owns a whole /64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerKey(IpAddr);

impl PeerKey {
    pub fn of(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(_) => PeerKey(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    PeerKey(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

/// Open connections per peer and in total.
#[derive(Debug, Default)]
pub struct PeerCounts {
    per_peer: HashMap<PeerKey, usize>,
    total: usize,
}

impl PeerCounts {
    pub fn total(&self) -> usize {
        self.total
    }
    pub fn of(&self, peer: PeerKey) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }
    pub fn add(&mut self, peer: PeerKey) {
        *self.per_peer.entry(peer).or_insert(0) += 1;
        self.total += 1;
    }
    pub fn remove(&mut self, peer: PeerKey) {
        if let Some(n) = self.per_peer.get_mut(&peer) {
            *n -= 1;
            self.total = self.total.saturating_sub(1);
            if *n == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }
}

/// Why a connection was refused (the `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The listener's cap on open connections.
    Global,
    /// The cap on connections from one peer address.
    PerPeer,
    /// A node certificate whose Node is unknown or has another InternalIP than the caller's
    /// address (the peer snapshot listener answers nodes only, each from its own address).
    NotANode,
    /// No client certificate of a node (of the cluster CA, `system:node:<name>` in a node
    /// group): the peer snapshot listener.
    NotANodeCertificate,
    /// A plain-HTTP request to a TLS-only listener (the peer snapshot listener).
    PlainHttp,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Global => "global_limit",
            Refusal::PerPeer => "peer_limit",
            Refusal::NotANode => "not_a_node",
            Refusal::NotANodeCertificate => "not_a_node_certificate",
            Refusal::PlainHttp => "plain_http",
        }
    }
}

/// `vk_cocoon_connections_refused_total{listener, reason}`: one family for the whole process,
/// registered by `Metrics::new` into its registry (the listeners are built without a handle
/// on the daemon's `Metrics`).
pub fn refused_total() -> &'static IntCounterVec {
    static FAMILY: OnceLock<IntCounterVec> = OnceLock::new();
    FAMILY.get_or_init(|| {
        let opts = Opts::new(
            format!("{PREFIX}connections_refused_total"),
            "Connections closed at accept because a connection limit was reached.",
        );
        // Constant, valid name and labels: this cannot fail.
        IntCounterVec::new(opts, &["listener", "reason"]).unwrap_or_else(|e| {
            unreachable!("connections_refused_total: {e}");
        })
    })
}

/// Counts refusals and logs them at most once per `REFUSAL_LOG_EVERY`, with the number
/// refused since the last line (a flood of refused connections must not flood the log).
#[derive(Debug)]
pub struct RefusalLog {
    listener: &'static str,
    last_logged: Option<Instant>,
    unlogged: u64,
}

impl RefusalLog {
    pub fn new(listener: &'static str) -> Self {
        RefusalLog {
            listener,
            last_logged: None,
            unlogged: 0,
        }
    }

    /// Records one refusal; returns true when it was logged.
    pub fn refused(&mut self, reason: Refusal, peer: IpAddr, limit: usize, now: Instant) -> bool {
        refused_total()
            .with_label_values(&[self.listener, reason.label()])
            .inc();
        self.unlogged += 1;
        if self
            .last_logged
            .is_some_and(|t| now.saturating_duration_since(t) < REFUSAL_LOG_EVERY)
        {
            return false;
        }
        let why = match reason {
            Refusal::Global => format!("connection limit of {limit} reached"),
            Refusal::PerPeer => format!("per-address connection limit of {limit} reached"),
            Refusal::NotANode => {
                "the certificate's Node is unknown or not at that address".to_string()
            }
            Refusal::NotANodeCertificate => "no client certificate of a node".to_string(),
            Refusal::PlainHttp => "plain HTTP to a TLS-only listener".to_string(),
        };
        log::warn!(
            "{}: refused {} connection(s) in the last minute; latest from {peer}: {why}",
            self.listener,
            self.unlogged,
        );
        self.last_logged = Some(now);
        self.unlogged = 0;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_peer_and_ipv6_by_prefix() {
        let mut c = PeerCounts::default();
        let a = PeerKey::of("10.0.0.1".parse().unwrap());
        let v6a = PeerKey::of("2001:db8::1".parse().unwrap());
        let v6b = PeerKey::of("2001:db8::ffff:1".parse().unwrap());
        let mapped = PeerKey::of("::ffff:10.0.0.1".parse().unwrap());
        assert_eq!(v6a, v6b, "one /64");
        assert_eq!(a, mapped);
        c.add(a);
        c.add(mapped);
        c.add(v6a);
        assert_eq!((c.of(a), c.of(v6b), c.total()), (2, 1, 3));
        c.remove(a);
        c.remove(a);
        c.remove(a);
        assert_eq!((c.of(a), c.total()), (0, 1));
    }

    #[test]
    fn refusals_are_counted_always_and_logged_once_a_minute() {
        let mut l = RefusalLog::new("test-listener");
        let t0 = Instant::now();
        let peer: IpAddr = "127.0.0.2".parse().unwrap();
        let before = refused_total()
            .with_label_values(&["test-listener", "peer_limit"])
            .get();
        assert!(l.refused(Refusal::PerPeer, peer, 4, t0));
        let logged = (1..1000)
            .filter(|i| l.refused(Refusal::PerPeer, peer, 4, t0 + Duration::from_millis(*i)))
            .count();
        assert_eq!(logged, 0);
        assert!(l.refused(Refusal::PerPeer, peer, 4, t0 + REFUSAL_LOG_EVERY));
        let after = refused_total()
            .with_label_values(&["test-listener", "peer_limit"])
            .get();
        assert_eq!(after - before, 1001);
    }
}
