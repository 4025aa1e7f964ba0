//! The probe manager plus the sockets: performs [`ProbeAction`]s on the event loop.
//! Owns the shared pinger and the TCP connects; hands the daemon only provider events.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Instant, SystemTime};

use super::manager::{ProbeAction, ProbeEvent, ProbeId, ProbeManager, TimerKey};
use super::target::{ProbeKind, ProbeTarget};
use crate::network::icmp::{PingId, PingStart, Pinger, PingerMode};
use crate::network::tcp::TcpProbes;
use crate::reactor::{Event, Reactor, TimerId};

/// High 16 bits of the reactor timer keys the engine arms, so the daemon can tell probe
/// timers from its own (`"pr"`). Probe timer keys stay below 2^48.
pub const PROBE_TIMER_TAG: u64 = 0x7072 << 48;

/// The reactor range of the engine's tokens and timer keys (the top byte of its timer tag), so
/// the daemon routes their events to the engine without asking it.
pub const PROBE_RANGE: crate::reactor::Range = crate::reactor::Range::of_timer_key(PROBE_TIMER_TAG);

/// The probe [`TimerKey`] inside a reactor timer key, if it is one of the engine's.
pub fn probe_timer_key(raw: u64) -> Option<TimerKey> {
    (raw >> 48 == PROBE_TIMER_TAG >> 48).then_some(TimerKey(raw & ((1 << 48) - 1)))
}

/// Replies handled per readable event; more wait for the next loop turn, so a burst of
/// thousands of replies never holds the loop for long.
const PINGER_BATCH: usize = 128;

/// What the engine needs from the event loop. The daemon implements it over the reactor in a
/// few lines (`registry()`, `token()`, `timer_at()`, `cancel_timer()`), with its own timer-key
/// tagging so that fired timers can be routed back to [`ProbeEngine::on_timer`].
pub trait ProbeHost {
    type TimerId: Copy;
    fn registry(&self) -> &mio::Registry;
    fn new_token(&mut self) -> mio::Token;
    fn timer_at(&mut self, at: Instant, key: TimerKey) -> Self::TimerId;
    fn cancel_timer(&mut self, id: Self::TimerId);
}

#[derive(Debug)]
enum Running {
    Ping(PingId),
    Tcp(mio::Token),
}

/// The manager plus the sockets: performs [`ProbeAction`]s on the loop. Each call does at
/// most a few non-blocking sends / connects and lease-file stats; nothing waits.
pub struct ProbeEngine<T: Copy> {
    manager: ProbeManager,
    pinger: Pinger,
    pinger_token: mio::Token,
    tcp: TcpProbes,
    running: HashMap<ProbeId, Running>,
    by_ping: HashMap<PingId, ProbeId>,
    by_token: HashMap<mio::Token, ProbeId>,
    timer_ids: HashMap<TimerKey, T>,
    /// Tokens of finished TCP probes, reused so that a steady probe load needs a fixed set.
    spare_tokens: Vec<mio::Token>,
}

impl<T: Copy> ProbeEngine<T> {
    /// Register the pinger's socket with the host and take ownership of both.
    pub fn new<H: ProbeHost<TimerId = T>>(
        manager: ProbeManager,
        pinger: Pinger,
        host: &mut H,
    ) -> std::io::Result<ProbeEngine<T>> {
        let pinger_token = host.new_token();
        pinger.register(host.registry(), pinger_token)?;
        if pinger.mode() == PingerMode::AssumeReachable {
            log::warn!(
                "no raw or datagram ICMP socket available (need CAP_NET_RAW or \
                 net.ipv4.ping_group_range): a resolved IP counts as reachable"
            );
        }
        Ok(ProbeEngine {
            manager,
            pinger,
            pinger_token,
            tcp: TcpProbes::new(),
            running: HashMap::new(),
            by_ping: HashMap::new(),
            by_token: HashMap::new(),
            timer_ids: HashMap::new(),
            spare_tokens: Vec::new(),
        })
    }

    pub fn manager(&self) -> &ProbeManager {
        &self.manager
    }

    pub fn manager_mut(&mut self) -> &mut ProbeManager {
        &mut self.manager
    }

    pub fn pinger_mode(&self) -> PingerMode {
        self.pinger.mode()
    }

    /// Timers armed on the host and not yet fired or cancelled.
    pub fn host_timers(&self) -> usize {
        self.timer_ids.len()
    }

    /// Pings and TCP connects in flight.
    pub fn sockets_in_flight(&self) -> usize {
        self.pinger.in_flight() + self.tcp.in_flight()
    }

    /// Whether an Io event with this token belongs to the engine.
    pub fn owns_token(&self, token: mio::Token) -> bool {
        token == self.pinger_token || self.by_token.contains_key(&token)
    }

    pub fn start<H: ProbeHost<TimerId = T>>(
        &mut self,
        host: &mut H,
        pod: &str,
        target: Option<ProbeTarget>,
        now: Instant,
        wall: SystemTime,
    ) -> Vec<ProbeEvent> {
        let actions = self.manager.start(pod, target, now, wall);
        self.perform(host, actions, now)
    }

    pub fn forget<H: ProbeHost<TimerId = T>>(&mut self, host: &mut H, pod: &str) {
        let actions = self.manager.forget(pod);
        // Forgetting yields only cancellations, never provider events.
        let _ = self.perform(host, actions, Instant::now());
    }

    pub fn update_target(&mut self, pod: &str, target: Option<ProbeTarget>) {
        self.manager.update_target(pod, target);
    }

    /// Route an `Event::Timer` whose key the daemon tagged as a probe timer.
    pub fn on_timer<H: ProbeHost<TimerId = T>>(
        &mut self,
        host: &mut H,
        key: TimerKey,
        now: Instant,
        wall: SystemTime,
    ) -> Vec<ProbeEvent> {
        self.timer_ids.remove(&key);
        let actions = self.manager.on_timer(key, now, wall);
        self.perform(host, actions, now)
    }

    /// Route an `Event::Io` for a token where [`ProbeEngine::owns_token`] is true.
    pub fn on_io<H: ProbeHost<TimerId = T>>(
        &mut self,
        host: &mut H,
        token: mio::Token,
        now: Instant,
    ) -> Vec<ProbeEvent> {
        let mut actions = Vec::new();
        if token == self.pinger_token {
            let replies = self.pinger.on_readable_bounded(
                now,
                PINGER_BATCH,
                host.registry(),
                self.pinger_token,
            );
            for (ping, _reply) in replies {
                if let Some(id) = self.by_ping.remove(&ping) {
                    self.running.remove(&id);
                    actions.extend(self.manager.on_result(id, Ok(()), now));
                }
            }
        } else if let Some(&id) = self.by_token.get(&token) {
            if let Some(result) = self.tcp.on_event(token, host.registry()) {
                self.by_token.remove(&token);
                self.running.remove(&id);
                self.spare_tokens.push(token);
                actions.extend(
                    self.manager
                        .on_result(id, result.map_err(|e| e.to_string()), now),
                );
            }
        }
        self.perform(host, actions, now)
    }

    fn perform<H: ProbeHost<TimerId = T>>(
        &mut self,
        host: &mut H,
        actions: Vec<ProbeAction>,
        now: Instant,
    ) -> Vec<ProbeEvent> {
        let mut events = Vec::new();
        let mut queue = std::collections::VecDeque::from(actions);
        while let Some(action) = queue.pop_front() {
            match action {
                ProbeAction::ArmTimer { key, at } => {
                    let id = host.timer_at(at, key);
                    self.timer_ids.insert(key, id);
                }
                ProbeAction::CancelTimer { key } => {
                    if let Some(id) = self.timer_ids.remove(&key) {
                        host.cancel_timer(id);
                    }
                }
                ProbeAction::StartProbe { id, kind } => {
                    // A probe that cannot even start ends now; its result feeds back in.
                    if let Err(e) = self.start_probe(host, id, kind, now) {
                        queue.extend(self.manager.on_result(id, e, now));
                    }
                }
                ProbeAction::AbortProbe { id } => match self.running.remove(&id) {
                    Some(Running::Ping(ping)) => {
                        self.by_ping.remove(&ping);
                        self.pinger.expire(ping);
                    }
                    Some(Running::Tcp(token)) => {
                        self.by_token.remove(&token);
                        self.tcp.cancel(token, host.registry());
                        self.spare_tokens.push(token);
                    }
                    None => {}
                },
                ProbeAction::Notify(event) => events.push(event),
            }
        }
        events
    }

    /// Start one network probe. `Ok(())` when it is in flight; `Err(outcome)` when it already
    /// has its outcome: `Err(Ok(()))` for the fallback pinger, `Err(Err(reason))` for a send
    /// or connect that failed on the spot.
    fn start_probe<H: ProbeHost<TimerId = T>>(
        &mut self,
        host: &mut H,
        id: ProbeId,
        kind: ProbeKind,
        now: Instant,
    ) -> Result<(), Result<(), String>> {
        match kind {
            ProbeKind::Ping(ip) => match self.pinger.send(ip, now) {
                Ok(PingStart::Pending(ping)) => {
                    self.by_ping.insert(ping, id);
                    self.running.insert(id, Running::Ping(ping));
                    Ok(())
                }
                Ok(PingStart::AssumedReachable) => Err(Ok(())),
                Err(e) => Err(Err(e.to_string())),
            },
            ProbeKind::Tcp(addr) | ProbeKind::SshBanner(addr) => {
                let token = self.spare_tokens.pop().unwrap_or_else(|| host.new_token());
                let banner = matches!(kind, ProbeKind::SshBanner(_));
                let started = if banner {
                    self.tcp
                        .start_banner(token, SocketAddr::V4(addr), host.registry())
                } else {
                    self.tcp.start(token, SocketAddr::V4(addr), host.registry())
                };
                match started {
                    Ok(()) => {
                        self.by_token.insert(token, id);
                        self.running.insert(id, Running::Tcp(token));
                        Ok(())
                    }
                    Err(e) => {
                        self.spare_tokens.push(token);
                        Err(Err(e.to_string()))
                    }
                }
            }
        }
    }
}

impl<M: Send + 'static> ProbeHost for Reactor<M> {
    type TimerId = TimerId;

    fn registry(&self) -> &mio::Registry {
        Reactor::registry(self)
    }

    fn new_token(&mut self) -> mio::Token {
        self.token_in(PROBE_RANGE)
    }

    fn timer_at(&mut self, at: Instant, key: TimerKey) -> TimerId {
        Reactor::timer_at(self, at, PROBE_TIMER_TAG | key.0)
    }

    fn cancel_timer(&mut self, id: TimerId) {
        Reactor::cancel_timer(self, id);
    }
}

impl ProbeEngine<TimerId> {
    /// Offer one reactor event to the engine: `Some(events for the provider)` when it was a
    /// probe timer or I/O on a probe socket, `None` when it belongs to someone else. The time
    /// used is the reactor's clock of this wake-up.
    pub fn handle_event<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        event: &Event<M>,
        wall: SystemTime,
    ) -> Option<Vec<ProbeEvent>> {
        let now = reactor.now();
        match event {
            Event::Timer { key, .. } => {
                let key = probe_timer_key(*key)?;
                Some(self.on_timer(reactor, key, now, wall))
            }
            Event::Io(io) if self.owns_token(io.token) => Some(self.on_io(reactor, io.token, now)),
            _ => None,
        }
    }
}
