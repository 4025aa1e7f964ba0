//! The ICMPv4 echo pinger: one non-blocking socket shared by every probe, with
//! sequence matching so thousands of echoes can be in flight. It never arms timers or decides readiness.
//!
//! Socket choice, in order: a raw `SOCK_RAW`/`IPPROTO_ICMP` socket (needs CAP_NET_RAW); the
//! unprivileged ping socket `SOCK_DGRAM`/`IPPROTO_ICMP` (needs the process's group inside
//! `net.ipv4.ping_group_range` of its network namespace); else the fallback the Go daemon has
//! without CAP_NET_RAW, where a resolved IP counts as reachable (`PingerMode::AssumeReachable`).
//!
//! Matching: each echo carries a sequence number unique among those in flight and the probe's
//! id in its payload; a reply counts only if its sequence, payload and source address all match
//! the echo that was sent. On the raw socket the echo identifier must also be ours; the kernel
//! rewrites the identifier of datagram-socket echoes to the socket's port and filters replies by
//! it, so there the identifier is not checked.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

/// Payload prefix of every echo request, as the Go daemon sends.
const PAYLOAD_TAG: &[u8] = b"vk-cocoon";
const ECHO_REQUEST: u8 = 8;
const ECHO_REPLY: u8 = 0;
const ICMP_HEADER: usize = 8;
const RECV_BUFFER_BYTES: usize = 4 << 20;
const PACKET_LEN: usize = ICMP_HEADER + PAYLOAD_TAG.len() + 8;

/// Distinguishes pinger instances in one process (tests run several), so that raw sockets,
/// which all see every reply, do not take each other's replies.
static INSTANCE: AtomicU16 = AtomicU16::new(0);

/// How echoes are sent, decided once when the pinger opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PingerMode {
    /// `SOCK_RAW` with CAP_NET_RAW; replies arrive with their IP header.
    Raw,
    /// Unprivileged ICMP datagram ("ping") socket.
    Datagram,
    /// Neither socket could be opened: every ping of a valid address reports reachable.
    AssumeReachable,
}

impl fmt::Display for PingerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PingerMode::Raw => "raw",
            PingerMode::Datagram => "datagram",
            PingerMode::AssumeReachable => "assume-reachable",
        })
    }
}

/// Identifies one echo in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PingId(pub u64);

/// The outcome of `Pinger::send`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PingStart {
    /// The echo is on the wire; a reply comes back through `on_readable`, or never.
    Pending(PingId),
    /// Fallback mode: no packet was sent and the address counts as reachable now.
    AssumedReachable,
}

/// A matching echo reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub from: Ipv4Addr,
    pub rtt: Duration,
}

#[derive(Debug)]
pub enum PingError {
    /// Unspecified, broadcast or multicast addresses are never pinged.
    InvalidAddress(Ipv4Addr),
    /// All 65,536 sequence numbers are in flight.
    TooManyInFlight,
    /// The kernel refused the send (no route, buffer full, …).
    Send(io::Error),
}

impl fmt::Display for PingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PingError::InvalidAddress(ip) => write!(f, "invalid address {ip}"),
            PingError::TooManyInFlight => f.write_str("too many echoes in flight"),
            PingError::Send(e) => write!(f, "send: {e}"),
        }
    }
}

impl std::error::Error for PingError {}

#[derive(Debug)]
struct InFlight {
    id: PingId,
    ip: Ipv4Addr,
    sent: Instant,
}

/// One shared ICMP socket and the table of echoes in flight.
#[derive(Debug)]
pub struct Pinger {
    /// The ICMP socket seen through std's datagram API, which gives `recv_from` on a plain
    /// `&mut [u8]` with the source address; it is never used as UDP.
    socket: Option<UdpSocket>,
    mode: PingerMode,
    ident: u16,
    next_seq: u16,
    next_id: u64,
    by_seq: HashMap<u16, InFlight>,
    by_id: HashMap<PingId, u16>,
    buf: Vec<u8>,
}

impl Pinger {
    /// Open the best socket available: raw, then datagram, then the fallback. Never fails.
    pub fn open() -> Pinger {
        for mode in [PingerMode::Raw, PingerMode::Datagram] {
            if let Ok(p) = Pinger::with_mode(mode) {
                return p;
            }
        }
        Pinger::new(None, PingerMode::AssumeReachable)
    }

    /// Open exactly the given kind of socket (tests, and operators forcing a mode).
    pub fn with_mode(mode: PingerMode) -> io::Result<Pinger> {
        let ty = match mode {
            PingerMode::Raw => Type::RAW,
            PingerMode::Datagram => Type::DGRAM,
            PingerMode::AssumeReachable => return Ok(Pinger::new(None, mode)),
        };
        let socket = Socket::new(Domain::IPV4, ty, Some(Protocol::ICMPV4))?;
        socket.set_nonblocking(true)?;
        socket.set_cloexec(true)?;
        // Thousands of replies can arrive between two loop turns; the default buffer holds a
        // few hundred. Best effort: the kernel caps it at net.core.rmem_max.
        let _ = socket.set_recv_buffer_size(RECV_BUFFER_BYTES);
        let socket = UdpSocket::from(OwnedFd::from(socket));
        Ok(Pinger::new(Some(socket), mode))
    }

    fn new(socket: Option<UdpSocket>, mode: PingerMode) -> Pinger {
        let instance = INSTANCE.fetch_add(1, Ordering::Relaxed);
        let ident = (std::process::id() as u16).wrapping_add(instance.wrapping_mul(7919));
        Pinger {
            socket,
            mode,
            ident,
            next_seq: 1,
            next_id: 1,
            by_seq: HashMap::new(),
            by_id: HashMap::new(),
            buf: vec![0; 2048],
        }
    }

    pub fn mode(&self) -> PingerMode {
        self.mode
    }

    /// Echoes sent and neither answered nor expired.
    pub fn in_flight(&self) -> usize {
        self.by_seq.len()
    }

    /// Register the socket for readable events. A no-op in fallback mode (no socket).
    pub fn register(&self, registry: &mio::Registry, token: mio::Token) -> io::Result<()> {
        match &self.socket {
            Some(s) => registry.register(
                &mut mio::unix::SourceFd(&s.as_raw_fd()),
                token,
                mio::Interest::READABLE,
            ),
            None => Ok(()),
        }
    }

    pub fn deregister(&self, registry: &mio::Registry) -> io::Result<()> {
        match &self.socket {
            Some(s) => registry.deregister(&mut mio::unix::SourceFd(&s.as_raw_fd())),
            None => Ok(()),
        }
    }

    /// Send one echo request to `ip`. Never blocks.
    pub fn send(&mut self, ip: Ipv4Addr, now: Instant) -> Result<PingStart, PingError> {
        if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
            return Err(PingError::InvalidAddress(ip));
        }
        let Some(socket) = &self.socket else {
            return Ok(PingStart::AssumedReachable);
        };
        let seq = self.free_seq().ok_or(PingError::TooManyInFlight)?;
        let id = PingId(self.next_id);
        let packet = echo_request(self.ident, seq, id);
        match socket.send_to(&packet, SocketAddrV4::new(ip, 0)) {
            Ok(_) => {}
            Err(e) => return Err(PingError::Send(e)),
        }
        self.next_id += 1;
        self.next_seq = seq.wrapping_add(1);
        self.by_seq.insert(seq, InFlight { id, ip, sent: now });
        self.by_id.insert(id, seq);
        Ok(PingStart::Pending(id))
    }

    /// Forget an echo (its probe timed out or was cancelled); a late reply is then ignored.
    pub fn expire(&mut self, id: PingId) -> bool {
        match self.by_id.remove(&id) {
            Some(seq) => {
                self.by_seq.remove(&seq);
                true
            }
            None => false,
        }
    }

    /// Read every packet waiting on the socket and return the echoes they answer.
    /// Call on each readable event; it drains until the socket would block.
    pub fn on_readable(&mut self, now: Instant) -> Vec<(PingId, Reply)> {
        self.read_some(now, usize::MAX).0
    }

    /// Like `on_readable`, but reads at most `max_packets`, so that a burst of thousands of
    /// replies cannot stall the loop. When it stops early it re-registers the socket (same
    /// `token`), which makes the poll report it readable again on its next turn, after the
    /// other ready sources had theirs.
    pub fn on_readable_bounded(
        &mut self,
        now: Instant,
        max_packets: usize,
        registry: &mio::Registry,
        token: mio::Token,
    ) -> Vec<(PingId, Reply)> {
        let (replies, drained) = self.read_some(now, max_packets);
        if !drained {
            if let Some(s) = &self.socket {
                let fd = s.as_raw_fd();
                let source = &mut mio::unix::SourceFd(&fd);
                if let Err(e) = registry.reregister(source, token, mio::Interest::READABLE) {
                    log::warn!("pinger: re-arming the ICMP socket: {e}");
                }
            }
        }
        replies
    }

    /// Read up to `max_packets`; true in the second field when the socket would block.
    fn read_some(&mut self, now: Instant, max_packets: usize) -> (Vec<(PingId, Reply)>, bool) {
        let mut replies = Vec::new();
        let Some(socket) = &self.socket else {
            return (replies, true);
        };
        let mut packets = 0;
        loop {
            if packets >= max_packets {
                return (replies, false);
            }
            packets += 1;
            let (len, from) = match socket.recv_from(&mut self.buf) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // Datagram sockets report ICMP errors for earlier sends as a one-off socket
                // error; it carries no sequence, so the probe simply runs to its timeout.
                Err(e) => {
                    log::debug!("pinger: receive: {e}");
                    continue;
                }
            };
            let SocketAddr::V4(from) = from else { continue };
            let from = *from.ip();
            let Some((seq, id)) = parse_reply(self.mode, self.ident, &self.buf[..len]) else {
                continue;
            };
            let matches = self
                .by_seq
                .get(&seq)
                .is_some_and(|f| f.id == id && f.ip == from);
            if !matches {
                continue;
            }
            if let Some(flight) = self.by_seq.remove(&seq) {
                self.by_id.remove(&flight.id);
                let rtt = now.saturating_duration_since(flight.sent);
                replies.push((flight.id, Reply { from, rtt }));
            }
        }
        (replies, true)
    }

    fn free_seq(&self) -> Option<u16> {
        if self.by_seq.len() > usize::from(u16::MAX) {
            return None;
        }
        let mut seq = self.next_seq;
        while self.by_seq.contains_key(&seq) {
            seq = seq.wrapping_add(1);
        }
        Some(seq)
    }
}

/// Export the pinger's mode as `vk_cocoon_pinger_mode{mode="raw|datagram|assume-reachable"} 1`,
/// so that a host running in the fallback (every resolved IP counts as reachable) is visible.
pub fn register_mode_gauge(
    registry: &prometheus::Registry,
    mode: PingerMode,
) -> prometheus::Result<()> {
    let gauge = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "vk_cocoon_pinger_mode",
            "ICMP pinger mode; assume-reachable means readiness is not checked by ICMP.",
        ),
        &["mode"],
    )?;
    gauge.with_label_values(&[mode.to_string().as_str()]).set(1);
    registry.register(Box::new(gauge))
}

/// Build an echo request: header, the `vk-cocoon` tag, then the ping id (big-endian).
fn echo_request(ident: u16, seq: u16, id: PingId) -> [u8; PACKET_LEN] {
    let mut p = [0u8; PACKET_LEN];
    p[0] = ECHO_REQUEST;
    p[4..6].copy_from_slice(&ident.to_be_bytes());
    p[6..8].copy_from_slice(&seq.to_be_bytes());
    p[ICMP_HEADER..ICMP_HEADER + PAYLOAD_TAG.len()].copy_from_slice(PAYLOAD_TAG);
    p[ICMP_HEADER + PAYLOAD_TAG.len()..].copy_from_slice(&id.0.to_be_bytes());
    let sum = checksum(&p);
    p[2..4].copy_from_slice(&sum.to_be_bytes());
    p
}

/// The Internet checksum (RFC 1071): one's complement of the one's-complement sum.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// If `packet` is an echo reply to one of our requests, its sequence number and ping id.
/// Raw sockets deliver the IPv4 header first (length from IHL); datagram sockets do not.
fn parse_reply(mode: PingerMode, ident: u16, packet: &[u8]) -> Option<(u16, PingId)> {
    let icmp = match mode {
        PingerMode::Raw => {
            let first = *packet.first()?;
            if first >> 4 != 4 {
                return None;
            }
            let ihl = usize::from(first & 0x0f) * 4;
            if ihl < 20 {
                return None;
            }
            packet.get(ihl..)?
        }
        PingerMode::Datagram => packet,
        PingerMode::AssumeReachable => return None,
    };
    if icmp.len() != PACKET_LEN || icmp[0] != ECHO_REPLY || icmp[1] != 0 {
        return None;
    }
    if checksum(icmp) != 0 {
        return None;
    }
    if mode == PingerMode::Raw && u16::from_be_bytes([icmp[4], icmp[5]]) != ident {
        return None;
    }
    if &icmp[ICMP_HEADER..ICMP_HEADER + PAYLOAD_TAG.len()] != PAYLOAD_TAG {
        return None;
    }
    let seq = u16::from_be_bytes([icmp[6], icmp[7]]);
    let mut id = [0u8; 8];
    id.copy_from_slice(&icmp[ICMP_HEADER + PAYLOAD_TAG.len()..]);
    Some((seq, PingId(u64::from_be_bytes(id))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Turn a request into the reply a host would send, with an IPv4 header in front.
    fn as_raw_reply(request: &[u8], ihl_words: u8) -> Vec<u8> {
        let mut icmp = request.to_vec();
        icmp[0] = ECHO_REPLY;
        icmp[2] = 0;
        icmp[3] = 0;
        let sum = checksum(&icmp);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        let mut ip = vec![0u8; usize::from(ihl_words) * 4];
        ip[0] = 0x40 | ihl_words;
        ip.extend_from_slice(&icmp);
        ip
    }

    #[test]
    fn checksum_matches_rfc1071_example_and_validates() {
        // RFC 1071 section 3 example bytes: sum 0xddf2, checksum 0x220d.
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            0x220d
        );
        let req = echo_request(0x1234, 7, PingId(42));
        assert_eq!(checksum(&req), 0);
        assert_eq!(checksum(&[0xff]), 0x00ff);
    }

    #[test]
    fn raw_reply_parsing_skips_ihl_and_checks_everything() {
        let req = echo_request(0x1234, 7, PingId(42));
        assert_eq!(
            parse_reply(PingerMode::Raw, 0x1234, &as_raw_reply(&req, 5)),
            Some((7, PingId(42)))
        );
        // IP options present (IHL 6).
        assert_eq!(
            parse_reply(PingerMode::Raw, 0x1234, &as_raw_reply(&req, 6)),
            Some((7, PingId(42)))
        );
        // Another process's identifier.
        assert_eq!(
            parse_reply(PingerMode::Raw, 0x9999, &as_raw_reply(&req, 5)),
            None
        );
        // Our own request looped back (type 8) is not a reply.
        let mut own = vec![0x45; 1];
        own.extend_from_slice(&[0; 19]);
        own.extend_from_slice(&req);
        assert_eq!(parse_reply(PingerMode::Raw, 0x1234, &own), None);
        // Corrupted payload fails the checksum.
        let mut bad = as_raw_reply(&req, 5);
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(parse_reply(PingerMode::Raw, 0x1234, &bad), None);
        // Truncated packets and nonsense never panic.
        for n in 0..as_raw_reply(&req, 5).len() {
            assert_eq!(
                parse_reply(PingerMode::Raw, 0x1234, &as_raw_reply(&req, 5)[..n]),
                None
            );
        }
        assert_eq!(parse_reply(PingerMode::Raw, 0x1234, &[0x41, 0, 0, 0]), None);
    }

    #[test]
    fn datagram_replies_ignore_the_identifier() {
        let req = echo_request(0x1234, 9, PingId(5));
        let raw = as_raw_reply(&req, 5);
        let mut icmp = raw[20..].to_vec();
        // The kernel put its port into the identifier; fix the checksum as it would be.
        icmp[4] = 0xab;
        icmp[2] = 0;
        icmp[3] = 0;
        let sum = checksum(&icmp);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        assert_eq!(
            parse_reply(PingerMode::Datagram, 0x1234, &icmp),
            Some((9, PingId(5)))
        );
    }

    #[test]
    fn fallback_mode_assumes_reachable_but_rejects_invalid_addresses() {
        let mut p = Pinger::with_mode(PingerMode::AssumeReachable).unwrap();
        let now = Instant::now();
        assert!(matches!(
            p.send(Ipv4Addr::new(10, 1, 2, 3), now),
            Ok(PingStart::AssumedReachable)
        ));
        assert!(matches!(
            p.send(Ipv4Addr::UNSPECIFIED, now),
            Err(PingError::InvalidAddress(_))
        ));
        assert!(matches!(
            p.send(Ipv4Addr::BROADCAST, now),
            Err(PingError::InvalidAddress(_))
        ));
        assert!(p.on_readable(now).is_empty());
    }

    #[test]
    fn mode_gauge_is_exported() {
        let r = prometheus::Registry::new();
        register_mode_gauge(&r, PingerMode::AssumeReachable).unwrap();
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&r.gather())
            .unwrap();
        assert!(
            text.contains("vk_cocoon_pinger_mode{mode=\"assume-reachable\"} 1"),
            "{text}"
        );
    }
}
