//! The kubelet HTTPS server inside the single mio loop: non-blocking accept, one rustls
//! ServerConnection per connection driven by readiness, request heads through `routes`, auth, and
//! logs / exec children run by the reactor with their streams wired to the connection.
//!
//! No thread per connection and no blocking call: slow clients only cost their own bounded
//! buffers, every phase has a deadline, and TokenReview / SubjectAccessReview are left to the daemon.
//!
//! Nobody exhausts the server: connections are capped in total, per peer address and while
//! unauthenticated (short deadlines; the oldest silent unauthenticated one makes room); a connection
//! with `output_pause_at` bytes queued is not read (no more requests, stdin or pings) and its
//! child's output is not read (the child blocks) until half of it is delivered; exec stdin is
//! taken (and SPDY window granted) only as fast as the child consumes it; a client that reads
//! nothing for `write_stall_timeout` is closed.
//!
//! This file holds the server's state and its entry points from the loop; each concern has its
//! own file: `admission` (accept and the connection limits), `auth_flow` (who may do what),
//! `requests` (request framing and responses), `dispatch` (the routes answered at once),
//! `render` (`/metrics/cadvisor` rendered on a helper thread),
//! `children` (logs and exec children wired to their connection), `forward` (port-forward
//! connections and their sockets to guests), `socket` (TLS reads, writes
//! and pacing) and `conn` (one connection's state and its end).

mod admission;
mod auth_flow;
mod children;
mod conn;
mod dispatch;
mod forward;
mod metrics;
mod render;
mod requests;
mod socket;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use mio::net::TcpListener;
use mio::{Interest, Token};

use super::auth::{AuthCache, AuthRequest};
use super::tls::TlsState;
use super::{KubeletConfig, KubeletView};
use crate::metrics::admission::{PeerCounts, PeerKey, RefusalLog};
use crate::metrics::stats::{Sample, StatsHub, TrackedVm};
use crate::reactor::{ChildId, IoReady, Reactor, TimerId};

pub use children::ATTACH_TAIL_LINES;
use conn::Conn;
pub use metrics::{pod_facts, set_expiry, ServedMetrics};

/// Key of the server's single reactor timer.
pub const TIMER_KEY: u64 = 0x6b75_6265_6c65_7400;
/// The reactor range of the server's tokens and timer key: whoever shares the reactor routes
/// their events here by range alone.
pub const RANGE: crate::reactor::Range = crate::reactor::Range::of_timer_key(TIMER_KEY);

/// Identifies one pending authorisation request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AuthId(pub u64);

/// The kubelet API server. See the module documentation of `kubelet` for the wiring.
pub struct KubeletServer {
    cfg: KubeletConfig,
    tls: TlsState,
    stats: StatsHub,
    listener: Option<(TcpListener, Token)>,
    conns: HashMap<Token, Conn>,
    view: KubeletView,
    index: HashMap<(String, String), usize>,
    children: HashMap<ChildId, Token>,
    /// Sockets to guests of port-forward connections: the connection and the forward's key.
    guests: HashMap<Token, (Token, crate::kubelet::portforward::Key)>,
    auth_pending: HashMap<AuthId, (Token, AuthRequest, PeerKey)>,
    auth_out: Vec<(AuthId, AuthRequest, PeerKey)>,
    /// Reviews whose client left (or timed out) before the answer: the daemon drops them
    /// unrun if they are still queued.
    auth_cancelled: Vec<AuthId>,
    /// Reviews in flight per peer address (capped: each costs the API server a call).
    reviews: PeerCounts,
    next_auth: u64,
    cache: AuthCache,
    timer: Option<(TimerId, Instant)>,
    /// Open connections per peer, and those not yet authenticated.
    peers: PeerCounts,
    unauthenticated: PeerCounts,
    /// Unauthenticated connections in accept order (entries of closed or authenticated ones
    /// are skipped when met, and swept when they outnumber the live ones).
    unauth_order: std::collections::VecDeque<Token>,
    refusals: RefusalLog,
    /// When an authorisation error was last logged (they are logged once a minute).
    auth_error_logged: Option<Instant>,
    /// `/metrics/resource` rendered from the sample it was made of.
    resource_text: Option<(Arc<Sample>, Arc<String>)>,
    /// `/metrics/cadvisor`'s render on a helper thread and the scrapes waiting for it.
    render: render::CadvisorRender,
    /// The pods' facts for `/metrics/cadvisor`, from the view, shared with the render thread.
    facts: Arc<crate::metrics::cadvisor::PodFactsMap>,
    /// Counts the views: a rendered text is kept for the facts it was made of.
    facts_generation: u64,
    /// The daemon's registry and probe counts for `/metrics` and `/metrics/probes`.
    served: Option<ServedMetrics>,
}

impl KubeletServer {
    pub fn new(cfg: KubeletConfig, tls: TlsState, stats: StatsHub) -> Self {
        if !cfg.auth_enabled {
            log::warn!(
                "kubelet API authentication is OFF (VK_KUBELET_AUTH=off): anyone who can reach the kubelet port can read logs and exec into every VM"
            );
        }
        KubeletServer {
            cfg,
            tls,
            stats,
            listener: None,
            conns: HashMap::new(),
            view: KubeletView::default(),
            index: HashMap::new(),
            children: HashMap::new(),
            guests: HashMap::new(),
            auth_pending: HashMap::new(),
            auth_out: Vec::new(),
            auth_cancelled: Vec::new(),
            reviews: PeerCounts::default(),
            next_auth: 1,
            cache: AuthCache::default(),
            timer: None,
            peers: PeerCounts::default(),
            unauthenticated: PeerCounts::default(),
            unauth_order: std::collections::VecDeque::new(),
            refusals: RefusalLog::new("kubelet"),
            auth_error_logged: None,
            resource_text: None,
            render: Default::default(),
            facts: Default::default(),
            facts_generation: 0,
            served: None,
        }
    }

    /// Binds and registers the listening socket; returns the bound address.
    pub fn listen<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        addr: SocketAddr,
    ) -> io::Result<SocketAddr> {
        let mut l = crate::metrics::admission::listen(addr)?;
        let token = r.token_in(RANGE);
        r.registry().register(&mut l, token, Interest::READABLE)?;
        let local = l.local_addr()?;
        self.listener = Some((l, token));
        Ok(local)
    }

    /// Replaces the pod/VM facts and feeds the shared stats sample's VM list.
    pub fn set_view(&mut self, view: KubeletView) {
        self.index = view
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| ((p.namespace.clone(), p.name.clone()), i))
            .collect();
        let vms = view
            .pods
            .iter()
            .filter_map(|p| {
                p.vm.as_ref().map(|v| TrackedVm {
                    vm_id: v.id.clone(),
                    vm_name: v.name.clone(),
                    namespace: p.namespace.clone(),
                    pod: p.name.clone(),
                    pod_uid: p.uid.clone(),
                    pid: v.pid,
                    tap: v.tap.clone(),
                    backend: v.backend.clone(),
                    disk: Some(&v.disk)
                        .filter(|d| !d.is_empty())
                        .map(std::path::PathBuf::from),
                })
            })
            .collect();
        self.stats.set_vms(vms);
        self.view = view;
        self.refresh_facts();
    }

    pub fn owns_token(&self, t: Token) -> bool {
        self.conns.contains_key(&t)
            || self.guests.contains_key(&t)
            || self.render.owns_token(t)
            || self.listener.as_ref().is_some_and(|(_, lt)| *lt == t)
    }
    pub fn owns_timer(&self, id: TimerId) -> bool {
        self.timer.is_some_and(|(t, _)| t == id)
    }
    pub fn owns_child(&self, id: ChildId) -> bool {
        self.children.contains_key(&id)
    }
    /// Open client connections (for tests and the leak checks).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }
    /// Children started for requests and not yet reported as exited.
    pub fn child_count(&self) -> usize {
        self.children.len()
    }

    // ----- entry points -------------------------------------------------------------------

    pub fn on_io<M: Send + 'static>(&mut self, r: &mut Reactor<M>, ev: IoReady) {
        if self.listener.as_ref().is_some_and(|(_, t)| *t == ev.token) {
            self.accept(r);
        } else if self.guests.contains_key(&ev.token) {
            self.on_guest_io(r, ev);
        } else if self.render.owns_token(ev.token) {
            self.on_render_done(r);
        } else if let Some(c) = self.conns.get(&ev.token) {
            if c.read_paused {
                // Not reading: only a broken socket matters now.
                if ev.error {
                    self.close(r, ev.token);
                }
            } else if ev.readable || ev.read_closed || ev.error {
                self.read_conn(r, ev.token);
            }
            if ev.writable {
                self.flush(r, ev.token);
            }
        }
        self.rearm(r);
    }

    pub fn on_timer<M: Send + 'static>(&mut self, r: &mut Reactor<M>, id: TimerId) {
        if !self.owns_timer(id) {
            return;
        }
        self.timer = None;
        let now = r.now();
        for t in self.conns_due(now, |c| c.stall_deadline) {
            log::debug!("kubelet: closing a client that reads nothing of its queued output");
            self.close(r, t);
        }
        for t in self.conns_due(now, |c| c.recheck) {
            if let Some(c) = self.conns.get_mut(&t) {
                c.recheck = None;
            }
            self.flush(r, t);
            // Pipelined requests left waiting by the previous batch.
            self.after_input(r, t);
        }
        for t in self.conns_due(now, |c| c.deadline) {
            self.expire(r, t);
        }
        self.rearm(r);
    }

    /// The connections whose instant picked by `when` has come (collected: acting on one may
    /// close others).
    fn conns_due(&self, now: Instant, when: impl Fn(&Conn) -> Option<Instant>) -> Vec<Token> {
        self.conns
            .iter()
            .filter(|(_, c)| when(c).is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect()
    }

    pub(super) fn rearm<M: Send + 'static>(&mut self, r: &mut Reactor<M>) {
        let next = self
            .conns
            .values()
            .flat_map(|c| [c.deadline, c.stall_deadline, c.recheck])
            .flatten()
            .min();
        match (next, self.timer) {
            (None, Some((id, _))) => {
                r.cancel_timer(id);
                self.timer = None;
            }
            (Some(at), Some((_, armed))) if armed <= at => {}
            (Some(at), old) => {
                if let Some((id, _)) = old {
                    r.cancel_timer(id);
                }
                self.timer = Some((r.timer_at(at, TIMER_KEY), at));
            }
            (None, None) => {}
        }
    }
}

/// Convenience for tests and the daemon: the node's TLS state plus an `Arc` of its config.
pub fn tls_config(state: &TlsState) -> Arc<rustls::ServerConfig> {
    state.config()
}
