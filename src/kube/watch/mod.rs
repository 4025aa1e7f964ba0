//! The pod watch as a non-blocking state machine for the single mio loop: its own TCP+TLS
//! connection, incremental HTTP/chunked/line decoding, reconnects, 410 relists with diffing.
//! Owns the watch socket and the known-pod set; it never decides what to do with a pod.
//!
//! This file holds the watch's state, its entry points and how a connection's end is handled
//! (reconnect, relist, backoff); `dial` resolves the API server's name and connects off the loop,
//! `connection` moves the bytes, `chunked` de-chunks and splits
//! lines, `event` decodes a line into a watch event, `known` turns events and relists into the
//! per-pod outputs the daemon gets.

mod chunked;
mod connection;
mod dial;
mod event;
mod known;

use std::io;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use mio::{Registry, Token};

use super::client::Client;
use super::error::KubeError;
use crate::backoff::{self, Jitter};

pub use chunked::{FramingError, StreamDecoder};
use connection::{Conn, End};
pub use dial::{system_resolver, Resolver, ADDRESS_TTL, PER_ADDRESS_TIMEOUT};
pub use event::{decode_line, decode_stream, BadEvent, PodEvent};
pub use known::{KnownPods, WatchOutput};

/// Tunables of the watch.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    /// Server-side watch timeout, T: each watch asks a timeoutSeconds drawn from [T, 2T) (as
    /// the kubelet's reflector does), so a fleet's watches, started together, do not all end
    /// and re-watch in the same second every T.
    pub timeout_seconds: u64,
    /// No byte for this long on an established stream (bookmarks arrive about every minute) = stalled.
    pub stall_after: Duration,
    /// Connect + TLS + response head must finish within this.
    pub connect_timeout: Duration,
    /// Failure backoff: initial, cap (each wait jittered, see `backoff::jittered`).
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// After a 410 Gone the relist waits a random moment of this window. An API server that
    /// lost its watch cache answers 410 to every node at once; spread this way, about
    /// `1 s / relist_spread` of the fleet relists in any one second instead of all of it.
    pub relist_spread: Duration,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            timeout_seconds: 300,
            stall_after: Duration::from_secs(300 + 60),
            connect_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(800),
            backoff_max: Duration::from_secs(30),
            relist_spread: Duration::from_secs(8),
        }
    }
}

/// `t` stretched by `unit` (a random number in [0, 1)) of itself: a point of [t, 2t).
pub fn watch_timeout_seconds(t: u64, unit: f64) -> u64 {
    let extra = (t as f64 * unit.clamp(0.0, 1.0)) as u64;
    t + extra.min(t.saturating_sub(1))
}

/// The pod watch. Drive it with `on_ready` (socket readiness) and `on_timer` (at `next_due`).
pub struct PodWatch {
    node: String,
    config: WatchConfig,
    registry: Option<Registry>,
    token: Token,
    conn: Option<Conn>,
    known: KnownPods,
    resource_version: String,
    /// When to (re)connect or relist next; None while connected.
    retry_at: Option<Instant>,
    need_relist: bool,
    /// Relists are left to the caller (`wants_relist` / `relisted`) instead of blocking here.
    relist_by_caller: bool,
    /// A relist is due and the caller has not answered it yet.
    relist_wanted: bool,
    /// The last `on_ready` stopped at its read budget with bytes left: call it again without
    /// waiting for readiness (the socket is edge-triggered and will not report them again).
    read_more: bool,
    failures: u32,
    jitter: Jitter,
    /// Resolves and connects off the loop; keeps the resolved addresses between connections.
    dialer: dial::Dialer,
    /// Counters for logs and tests.
    pub stats: WatchStats,
}

/// How often each thing happened (for metrics, logs and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchStats {
    pub connects: u64,
    pub relists: u64,
    pub events: u64,
    pub bad_lines: u64,
}

impl PodWatch {
    pub fn new(node: &str, config: WatchConfig) -> PodWatch {
        PodWatch {
            node: node.to_string(),
            config,
            registry: None,
            token: Token(usize::MAX),
            conn: None,
            known: KnownPods::default(),
            resource_version: String::new(),
            retry_at: None,
            need_relist: true,
            relist_by_caller: false,
            relist_wanted: false,
            read_more: false,
            failures: 0,
            jitter: Jitter::new(backoff::salt(node)),
            dialer: dial::Dialer::default(),
            stats: WatchStats::default(),
        }
    }

    /// The timeoutSeconds of the next watch request: drawn from [T, 2T) for T =
    /// `config.timeout_seconds` (0, no timeout, stays 0).
    fn draw_timeout_seconds(&mut self) -> u64 {
        watch_timeout_seconds(self.config.timeout_seconds, self.jitter.unit())
    }

    /// Give the watch the loop's registry and its token. Connections register themselves.
    pub fn register(&mut self, registry: &Registry, token: Token) -> io::Result<()> {
        self.registry = Some(registry.try_clone()?);
        self.token = token;
        Ok(())
    }

    pub fn token(&self) -> Token {
        self.token
    }

    /// The pods as the watch currently knows them.
    pub fn known(&self) -> &KnownPods {
        &self.known
    }

    /// The last resourceVersion seen (list, event or bookmark).
    pub fn resource_version(&self) -> &str {
        &self.resource_version
    }

    /// True while a watch connection is open.
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    /// When `on_timer` must next be called (reconnect, relist, stall or connect deadline).
    pub fn next_due(&self) -> Option<Instant> {
        match &self.conn {
            Some(c) if c.body.is_none() => Some(c.opened + self.config.connect_timeout),
            Some(c) => Some(c.last_byte + self.config.stall_after),
            None => self.retry_at,
        }
    }

    /// Blocking list of the node's pods; replaces the known set and returns the difference
    /// (every pod as Added on the first call). The watch then resumes from the list's version.
    pub fn relist(&mut self, client: &Client, now: Instant) -> Result<Vec<WatchOutput>, KubeError> {
        self.drop_conn();
        let list = client.list_pods_on_node(&self.node)?;
        Ok(self.apply_list(list, now))
    }

    /// From now on the watch never lists on the calling thread: when a relist is due,
    /// `wants_relist` says so and the caller lists elsewhere and hands the answer to
    /// `relisted` (the daemon's loop must not wait for a big list).
    pub fn relist_by_caller(&mut self) {
        self.relist_by_caller = true;
    }

    /// The node this watch lists pods of (the caller's list call needs it).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// True when `on_ready` left bytes unread (its per-call budget): call it again soon, from
    /// a timer, even though no readiness will be reported for them.
    pub fn read_more(&self) -> bool {
        self.read_more
    }

    /// True once when a relist became due (the caller then lists and calls `relisted`).
    pub fn wants_relist(&mut self) -> bool {
        std::mem::take(&mut self.relist_wanted)
    }

    /// The caller's list answer: on success like `relist` (the stream reconnects at the next
    /// `on_timer`); a failure backs off and asks again later.
    pub fn relisted(
        &mut self,
        list: Result<super::client::PodList, KubeError>,
        now: Instant,
    ) -> Result<Vec<WatchOutput>, KubeError> {
        match list {
            Ok(list) => {
                self.drop_conn();
                Ok(self.apply_list(list, now))
            }
            Err(e) => {
                self.need_relist = true;
                self.fail_backoff(now, None);
                Err(e)
            }
        }
    }

    fn apply_list(&mut self, list: super::client::PodList, now: Instant) -> Vec<WatchOutput> {
        self.stats.relists += 1;
        let mut out = Vec::new();
        self.known.replace(list.items, &mut out);
        self.resource_version = list.resource_version;
        self.need_relist = false;
        self.retry_at = Some(now);
        out
    }

    /// Timer: reconnect / relist when due, or abandon a stalled connection.
    pub fn on_timer(&mut self, client: &Client, now: Instant) -> Vec<WatchOutput> {
        let mut out = Vec::new();
        if let Some(c) = &self.conn {
            let stalled = match &c.body {
                None => now >= c.opened + self.config.connect_timeout,
                Some(_) => now >= c.last_byte + self.config.stall_after,
            };
            if stalled {
                let what = if c.body.is_none() {
                    "did not answer in time"
                } else {
                    "stalled"
                };
                log::warn!("pod watch: connection {what}; reconnecting");
                self.end(End::Failed(format!("watch {what}")), now);
            } else {
                return out;
            }
        }
        if self.retry_at.is_some_and(|t| now >= t) {
            self.retry_at = None;
            if self.need_relist && self.relist_by_caller {
                self.relist_wanted = true;
                return out;
            }
            if self.need_relist {
                match self.relist(client, now) {
                    Ok(o) => out = o,
                    Err(e) => {
                        log::warn!("pod watch: relist failed: {e}");
                        self.fail_backoff(now, None);
                        return out;
                    }
                }
            }
            if let Err(e) = self.connect(client, now) {
                log::warn!("pod watch: connect failed: {e}");
                if matches!(e, KubeError::Gone(_)) {
                    self.need_relist = true;
                }
                self.fail_backoff(now, None);
            }
        }
        out
    }

    /// Socket readiness for `token()`: read, decode and apply everything available.
    pub fn on_ready(&mut self, client: &Client, now: Instant) -> Vec<WatchOutput> {
        let mut out = Vec::new();
        self.read_more = false;
        let Some(mut conn) = self.conn.take() else {
            return out;
        };
        let result = self.drive(&mut conn, now, &mut out);
        match result {
            Ok(()) => self.conn = Some(conn),
            Err(end) => {
                if let End::Unauthorized(_) = end {
                    client.invalidate_credentials();
                }
                self.conn = Some(conn);
                self.end(end, now);
                // A relist already due (no spread configured) runs right away.
                if self.need_relist && self.retry_at.is_some_and(|t| t <= now) {
                    out.extend(self.on_timer(client, now));
                }
            }
        }
        out
    }

    fn end(&mut self, end: End, now: Instant) {
        let (lived, events) = self
            .conn
            .as_ref()
            .map(|c| (now.saturating_duration_since(c.opened), c.events))
            .unwrap_or_default();
        // A body that ended with its last chunk was ended by the server (its timeout); one that
        // stops short was cut (the server went away, a proxy dropped it).
        let finished = self
            .conn
            .as_ref()
            .and_then(|c| c.body.as_ref())
            .is_some_and(|d| d.finished());
        self.drop_conn();
        match end {
            End::Closed if finished && (events > 0 || lived >= Duration::from_secs(1)) => {
                log::debug!(
                    "pod watch: stream ended after {lived:?} and {events} events; re-watching"
                );
                self.failures = 0;
                self.retry_at = Some(now);
            }
            End::Closed if events > 0 || lived >= Duration::from_secs(1) => {
                // Every node lost its stream at this instant: reconnect at a random moment of
                // the first backoff step rather than all at once (a herd of TLS handshakes),
                // from the last resourceVersion. A refused connect then backs off as usual.
                let wait = backoff::spread(self.config.backoff_initial, self.jitter.unit());
                log::info!(
                    "pod watch: stream cut after {lived:?} and {events} events; re-watching \
                     from resourceVersion {} in {wait:?}",
                    self.resource_version
                );
                self.failures = 0;
                self.retry_at = Some(now + wait);
            }
            End::Closed => {
                log::debug!("pod watch: stream ended at once with no events");
                self.fail_backoff(now, None);
            }
            End::Failed(m) => {
                log::warn!("pod watch: {m}");
                self.fail_backoff(now, None);
            }
            End::Gone(m) => {
                let wait = backoff::spread(self.config.relist_spread, self.jitter.unit());
                log::info!("pod watch: {m}; relisting in {wait:?}");
                self.need_relist = true;
                self.retry_at = Some(now + wait);
            }
            End::Unauthorized(m) => {
                log::warn!("pod watch: {m}; refreshing credentials");
                self.fail_backoff(now, None);
            }
            End::Throttled(after, m) => {
                log::warn!("pod watch: {m}");
                self.fail_backoff(now, after);
            }
        }
    }

    fn fail_backoff(&mut self, now: Instant, at_least: Option<Duration>) {
        // Jittered like client-go's reflector (factor 1.0), so that a fleet whose API server
        // went away does not come back in step.
        let delay = backoff::jittered(
            self.config.backoff_initial,
            self.config.backoff_max,
            self.failures,
            self.jitter.unit(),
        );
        self.failures = self.failures.saturating_add(1);
        let delay = delay.max(at_least.unwrap_or_default());
        self.retry_at = Some(now + delay);
    }

    fn apply_line(
        &mut self,
        c: &mut Conn,
        line: &[u8],
        out: &mut Vec<WatchOutput>,
    ) -> Result<(), End> {
        match decode_line(line) {
            Ok(ev) => {
                c.events += 1;
                self.stats.events += 1;
                self.apply_event(ev, out)
            }
            Err(msg) => {
                self.stats.bad_lines += 1;
                log::error!("pod watch: skipping: {msg}");
                Ok(())
            }
        }
    }

    fn apply_event(&mut self, ev: PodEvent, out: &mut Vec<WatchOutput>) -> Result<(), End> {
        let note_rv = |rv: &mut String, p: &Pod| {
            if let Some(v) = p
                .metadata
                .resource_version
                .as_deref()
                .filter(|v| !v.is_empty())
            {
                v.clone_into(rv);
            }
        };
        match ev {
            PodEvent::Added(p) | PodEvent::Modified(p) => {
                note_rv(&mut self.resource_version, &p);
                self.known.upsert(p, out);
            }
            PodEvent::Deleted(p) => {
                note_rv(&mut self.resource_version, &p);
                self.known.remove(p, out);
            }
            PodEvent::Bookmark { resource_version } => {
                if !resource_version.is_empty() {
                    self.resource_version = resource_version;
                }
            }
            PodEvent::Error(s) => {
                let too_large = s
                    .message
                    .to_ascii_lowercase()
                    .contains("too large resource version");
                if s.code == 410 || s.reason == "Expired" || s.reason == "Gone" || too_large {
                    return Err(End::Gone(format!("watch error {s}")));
                }
                return Err(End::Failed(format!("watch error {s}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_watch_asks_a_timeout_of_t_to_2t_and_they_differ() {
        let mut w = PodWatch::new("node-1", WatchConfig::default());
        let t = WatchConfig::default().timeout_seconds;
        let drawn: Vec<u64> = (0..1000).map(|_| w.draw_timeout_seconds()).collect();
        assert!(drawn.iter().all(|&d| (t..2 * t).contains(&d)), "{drawn:?}");
        let distinct: std::collections::BTreeSet<u64> = drawn.iter().copied().collect();
        assert!(
            distinct.len() > 100,
            "spread over the band: {}",
            distinct.len()
        );
        let (lo, hi) = (drawn.iter().min(), drawn.iter().max());
        assert!(lo < Some(&(t + t / 10)) && hi >= Some(&(2 * t - t / 10)));
        // The band's edges, whatever the random number.
        assert_eq!(watch_timeout_seconds(300, 0.0), 300);
        assert_eq!(watch_timeout_seconds(300, 0.999_999_9), 599);
        assert_eq!(watch_timeout_seconds(300, 1.0), 599);
        assert_eq!(watch_timeout_seconds(1, 0.9), 1);
        assert_eq!(watch_timeout_seconds(0, 0.5), 0);
    }
}
