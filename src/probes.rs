//! Per-pod readiness probe schedules and their bookkeeping.
//! Decides when to probe and what a result means; the pinger and sockets live in network.
//!
//! Two layers:
//! * [`ProbeManager`] is pure: the caller feeds it starts, forgets, fired timers and probe
//!   results together with the current time, and it answers with [`ProbeAction`]s (arm or
//!   cancel a timer, start or abort a ping / TCP connect, hand a readiness change or an IP
//!   change to the provider). It reads no clock and owns no socket; the only I/O it does is
//!   the lease-file `stat` done before each probe, which is a single syscall per probe.
//! * [`ProbeEngine`] performs those actions against the loop through the small [`ProbeHost`]
//!   interface (registry, tokens, timers), owns the shared pinger and the TCP connects, and
//!   gives the daemon back only what the provider must see. The daemon routes events to it.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant, SystemTime};

use crate::metrics::probes::{ProbeCounts, ProbeOutcome};
use crate::network::icmp::{PingId, PingStart, Pinger, PingerMode};
use crate::network::leases::LeaseFile;
use crate::network::tcp::TcpProbes;
use crate::reactor::{Event, Reactor, TimerId};

/// `vk_cocoon_probe_duration_seconds` buckets.
pub const PROBE_DURATION_BUCKETS: [f64; 8] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// The histogram the probe manager observes, unregistered; the metrics room registers it.
pub fn probe_duration_histogram() -> prometheus::HistogramVec {
    let opts = prometheus::HistogramOpts::new(
        "vk_cocoon_probe_duration_seconds",
        "Duration of one readiness probe (lease lookup plus ICMP echo or TCP connect).",
    )
    .buckets(PROBE_DURATION_BUCKETS.to_vec());
    // The options are constants that are valid by construction.
    #[allow(clippy::expect_used)]
    prometheus::HistogramVec::new(opts, &["namespace"]).expect("valid histogram options")
}

/// The schedule's numbers. `Default` holds the Go daemon's timings; tests of real sockets
/// may scale them down so that a failure sequence does not take half a minute.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeConfig {
    /// Each probe's timeout (3 s).
    pub timeout: Duration,
    /// First sleep while not ready (100 ms).
    pub first_retry: Duration,
    /// Growth of the not-ready sleep per probe (×1.5).
    pub retry_growth: f64,
    /// Cap of the not-ready sleep (1 s).
    pub max_retry: Duration,
    /// Sleep between probes once ready (5 s).
    pub ready_interval: Duration,
    /// Consecutive failures that flip a ready pod back to not ready (3).
    pub failures_to_unready: u32,
}

impl Default for ProbeConfig {
    fn default() -> ProbeConfig {
        ProbeConfig {
            timeout: Duration::from_secs(3),
            first_retry: Duration::from_millis(100),
            retry_growth: 1.5,
            max_retry: Duration::from_secs(1),
            ready_interval: Duration::from_secs(5),
            failures_to_unready: 3,
        }
    }
}

/// What the provider knows about a pod's VM, as far as probing needs it.
/// The port of the SSH probe of macOS guests without a `probe-port`.
pub const SSH_PORT: u16 = 22;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub namespace: String,
    /// The pod's UID, echoed in every [`ProbeEvent`] so late events for an older
    /// incarnation can be dropped by the provider.
    pub uid: String,
    /// The VM the probe is for; echoed in [`ProbeEvent::IpChanged`] so the provider can drop
    /// the update if the pod tracks another VM by then.
    pub vm_id: String,
    /// The tracked IP (from `cocoon vm inspect`, a static NIC, or an earlier lease).
    pub ip: Option<Ipv4Addr>,
    /// The primary (first NIC's) MAC, used to look the lease up.
    pub mac: Option<String>,
    /// The first NIC has a static IP: the lease file is not consulted.
    pub static_ip: bool,
    /// The `vm.cocoonstack.io/probe-port` annotation, verbatim (validated here).
    pub probe_port: Option<String>,
    /// The port must greet with an SSH banner (`SSH-`), not only accept: the probe of a macOS
    /// guest with no probe-port (its port is then [`SSH_PORT`]).
    pub ssh_banner: bool,
}

impl ProbeTarget {
    /// From the provider's `Effect::StartProbe` fields: `ip` and `mac` empty (or, for `ip`,
    /// unparseable) mean unknown; `probe_port` is already validated there. A VM whose first
    /// NIC is static should be given with an empty `mac` (or `static_ip` set afterwards).
    pub fn from_parts(
        namespace: &str,
        uid: &str,
        vm_id: &str,
        ip: &str,
        mac: &str,
        probe_port: Option<u16>,
    ) -> ProbeTarget {
        let mac = mac.trim();
        ProbeTarget {
            namespace: namespace.to_string(),
            uid: uid.to_string(),
            vm_id: vm_id.to_string(),
            ip: ip.trim().parse().ok(),
            mac: (!mac.is_empty()).then(|| mac.to_string()),
            static_ip: false,
            probe_port: probe_port.map(|p| p.to_string()),
            ssh_banner: false,
        }
    }
}

/// The stored result of the latest probe (what GetPodStatus reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    pub ready: bool,
    pub message: String,
    pub at: Instant,
}

/// Which network probe to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    Ping(Ipv4Addr),
    Tcp(SocketAddrV4),
    /// Connect and read the greeting: ready only when it starts with `SSH-`.
    SshBanner(SocketAddrV4),
}

/// Identifies one probe attempt; results carry it back. Never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProbeId(pub u64);

/// Identifies one armed timer; never reused, so a late fire of a cancelled timer is ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerKey(pub u64);

/// What the manager asks of its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeAction {
    /// Call [`ProbeManager::on_timer`] with this key at `at`.
    ArmTimer { key: TimerKey, at: Instant },
    /// The timer is no longer wanted.
    CancelTimer { key: TimerKey },
    /// Start a probe; report its end with [`ProbeManager::on_result`].
    StartProbe { id: ProbeId, kind: ProbeKind },
    /// The probe timed out or its pod went away: drop it, its result is no longer wanted.
    AbortProbe { id: ProbeId },
    /// Something the provider must hear about.
    Notify(ProbeEvent),
}

/// What the provider must hear about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeEvent {
    /// The lease file gave the VM a different IP: update the tracked VM,
    /// unless it no longer has this `vm_id` (then the update is dropped). `ready` is the
    /// readiness last notified, not the last probe's result: a lease missing for fewer probes
    /// than flip a ready pod must not publish not-ready, since no later result would undo it.
    IpChanged {
        pod: String,
        uid: String,
        vm_id: String,
        ip: Option<Ipv4Addr>,
        ready: bool,
    },
    /// Readiness for the provider (`Input::Readiness`). `first` marks the first result after
    /// `start`, which the Go daemon never notifies because its caller publishes the status
    /// itself right after the synchronous first probe; here the first probe is asynchronous,
    /// so the provider publishes it when it arrives. `first == false` is the Go daemon's onUpdate
    /// (not-ready→ready, or the failure that flips ready→not-ready): push the pod status.
    /// `message` and `ip` are those of the probe that produced it.
    Readiness {
        pod: String,
        uid: String,
        ready: bool,
        first: bool,
        message: String,
        ip: Option<Ipv4Addr>,
    },
}

#[derive(Debug)]
struct InFlight {
    id: ProbeId,
    kind: ProbeKind,
    started: Instant,
}

#[derive(Debug)]
struct Agent {
    target: Option<ProbeTarget>,
    /// Last known readiness: drives the schedule and notifications.
    ready: bool,
    /// The first result has been produced.
    started: bool,
    failures: u32,
    /// The next not-ready sleep.
    retry: Duration,
    result: Option<ProbeResult>,
    timer: Option<TimerKey>,
    probe: Option<InFlight>,
    /// The last bad probe-port value logged, so it is logged once per change.
    logged_bad_port: Option<String>,
}

/// Per-pod probe agents. Pure apart from lease-file stats; see the module comment.
#[derive(Debug)]
pub struct ProbeManager {
    config: ProbeConfig,
    agents: HashMap<String, Agent>,
    timers: HashMap<TimerKey, String>,
    probes: HashMap<ProbeId, String>,
    next_key: u64,
    leases: Option<LeaseFile>,
    duration: Option<prometheus::HistogramVec>,
    /// `/metrics/probes` counts, when the kubelet API serves them.
    counts: Option<ProbeCounts>,
}

impl ProbeManager {
    /// `leases: None` means "no lease parser": the tracked IP is used as is.
    pub fn new(config: ProbeConfig, leases: Option<LeaseFile>) -> ProbeManager {
        ProbeManager {
            config,
            agents: HashMap::new(),
            timers: HashMap::new(),
            probes: HashMap::new(),
            next_key: 1,
            leases,
            duration: None,
            counts: None,
        }
    }

    /// Count every probe's result here (the kubelet API's `prober_probe_total`).
    pub fn set_probe_counts(&mut self, counts: ProbeCounts) {
        self.counts = Some(counts);
    }

    /// Observe every probe's duration into this histogram (label: namespace).
    pub fn set_duration_histogram(&mut self, histogram: prometheus::HistogramVec) {
        self.duration = Some(histogram);
    }

    pub fn config(&self) -> &ProbeConfig {
        &self.config
    }

    /// The lease file, for the provider's post-clone / wake IP wait.
    pub fn leases_mut(&mut self) -> Option<&mut LeaseFile> {
        self.leases.as_mut()
    }

    /// The latest stored result for GetPodStatus; `None` before the first probe finished
    /// or when no agent runs.
    pub fn result(&self, pod: &str) -> Option<&ProbeResult> {
        self.agents.get(pod)?.result.as_ref()
    }

    /// Last known readiness (the schedule's notion, changed only on notifications).
    pub fn is_ready(&self, pod: &str) -> Option<bool> {
        self.agents.get(pod).map(|a| a.ready)
    }

    pub fn is_probing(&self, pod: &str) -> bool {
        self.agents.contains_key(pod)
    }

    pub fn agents(&self) -> usize {
        self.agents.len()
    }

    /// Timers this manager expects to fire (for leak checks).
    pub fn armed_timers(&self) -> usize {
        self.timers.len()
    }

    /// Probes started and not yet finished or aborted.
    pub fn probes_in_flight(&self) -> usize {
        self.probes.len()
    }

    /// `Start(key)`: replace any agent for `pod` and run the first probe now. `target: None`
    /// is a pod without a tracked VM. The caller must not start probes for pods that carry a
    /// deletionTimestamp.
    pub fn start(
        &mut self,
        pod: &str,
        target: Option<ProbeTarget>,
        now: Instant,
        wall: SystemTime,
    ) -> Vec<ProbeAction> {
        let mut out = self.drop_agent(pod);
        let agent = Agent {
            target,
            ready: false,
            started: false,
            failures: 0,
            retry: self.config.first_retry,
            result: None,
            timer: None,
            probe: None,
            logged_bad_port: None,
        };
        self.agents.insert(pod.to_string(), agent);
        self.run_probe(pod, now, wall, &mut out);
        out
    }

    /// `Forget(key)`: cancel the agent's timer and in-flight probe and drop its result and
    /// its probe counts.
    pub fn forget(&mut self, pod: &str) -> Vec<ProbeAction> {
        if let Some(c) = &self.counts {
            let (ns, name) = split_key(pod);
            c.forget(ns, name);
        }
        self.drop_agent(pod)
    }

    /// Cancels the agent's timer and in-flight probe and drops its result.
    fn drop_agent(&mut self, pod: &str) -> Vec<ProbeAction> {
        let mut out = Vec::new();
        if let Some(agent) = self.agents.remove(pod) {
            if let Some(key) = agent.timer {
                self.timers.remove(&key);
                out.push(ProbeAction::CancelTimer { key });
            }
            if let Some(probe) = agent.probe {
                self.probes.remove(&probe.id);
                out.push(ProbeAction::AbortProbe { id: probe.id });
            }
        }
        out
    }

    /// The provider's view of the VM changed (new IP, MAC, annotation, VM gone). Takes effect
    /// at the next probe; the schedule is unchanged.
    pub fn update_target(&mut self, pod: &str, target: Option<ProbeTarget>) {
        if let Some(agent) = self.agents.get_mut(pod) {
            agent.target = target;
        }
    }

    /// A timer armed by this manager fired. Stale keys are ignored.
    pub fn on_timer(&mut self, key: TimerKey, now: Instant, wall: SystemTime) -> Vec<ProbeAction> {
        let mut out = Vec::new();
        let Some(pod) = self.timers.remove(&key) else {
            return out;
        };
        let Some(agent) = self.agents.get_mut(&pod) else {
            return out;
        };
        if agent.timer != Some(key) {
            return out;
        }
        agent.timer = None;
        match agent.probe.take() {
            // The probe's timeout.
            Some(probe) => {
                self.probes.remove(&probe.id);
                out.push(ProbeAction::AbortProbe { id: probe.id });
                let err = format!("timeout after {:?}", self.config.timeout);
                self.finish(&pod, probe, Err(err), now, &mut out);
            }
            // The sleep between probes ended.
            None => self.run_probe(&pod, now, wall, &mut out),
        }
        out
    }

    /// A probe started through [`ProbeAction::StartProbe`] ended: `Ok` reachable, `Err` with
    /// the reason. Results of aborted or unknown probes are ignored.
    pub fn on_result(
        &mut self,
        id: ProbeId,
        outcome: Result<(), String>,
        now: Instant,
    ) -> Vec<ProbeAction> {
        let mut out = Vec::new();
        let Some(pod) = self.probes.remove(&id) else {
            return out;
        };
        let Some(agent) = self.agents.get_mut(&pod) else {
            return out;
        };
        let Some(probe) = agent.probe.take_if(|p| p.id == id) else {
            return out;
        };
        if let Some(key) = agent.timer.take() {
            self.timers.remove(&key);
            out.push(ProbeAction::CancelTimer { key });
        }
        self.finish(&pod, probe, outcome, now, &mut out);
        out
    }

    /// Resolve the IP, then either settle the result at once or start a network probe.
    fn run_probe(&mut self, pod: &str, now: Instant, wall: SystemTime, out: &mut Vec<ProbeAction>) {
        let Some(agent) = self.agents.get_mut(pod) else {
            return;
        };
        let notified_ready = agent.started && agent.ready;
        let Some(target) = agent.target.as_mut() else {
            self.settle(pod, None, "vm gone".to_string(), now, now, out);
            return;
        };
        let (ip, lease_note) = resolve_ip(target, self.leases.as_mut(), wall);
        if ip != target.ip {
            target.ip = ip;
            out.push(ProbeAction::Notify(ProbeEvent::IpChanged {
                pod: pod.to_string(),
                uid: target.uid.clone(),
                vm_id: target.vm_id.clone(),
                ip,
                ready: notified_ready,
            }));
        }
        let Some(ip) = ip else {
            let message = match lease_note {
                Some(note) => format!("waiting for dhcp lease ({note})"),
                None => "waiting for dhcp lease".to_string(),
            };
            self.settle(pod, None, message, now, now, out);
            return;
        };
        let kind = match target.probe_port.as_deref() {
            None => ProbeKind::Ping(ip),
            Some(raw) => match parse_probe_port(raw) {
                Some(port) if target.ssh_banner => {
                    ProbeKind::SshBanner(SocketAddrV4::new(ip, port))
                }
                Some(port) => ProbeKind::Tcp(SocketAddrV4::new(ip, port)),
                None => {
                    if agent.logged_bad_port.as_deref() != Some(raw) {
                        log::warn!("pod {pod}: probe-port {raw:?} is not a port (1-65535)");
                        agent.logged_bad_port = Some(raw.to_string());
                    }
                    let message = format!("invalid probe-port {raw:?}");
                    self.settle(pod, None, message, now, now, out);
                    return;
                }
            },
        };
        let id = ProbeId(self.next_key);
        let key = TimerKey(self.next_key + 1);
        self.next_key += 2;
        agent.probe = Some(InFlight {
            id,
            kind,
            started: now,
        });
        agent.timer = Some(key);
        self.probes.insert(id, pod.to_string());
        self.timers.insert(key, pod.to_string());
        out.push(ProbeAction::StartProbe { id, kind });
        out.push(ProbeAction::ArmTimer {
            key,
            at: now + self.config.timeout,
        });
    }

    fn finish(
        &mut self,
        pod: &str,
        probe: InFlight,
        outcome: Result<(), String>,
        now: Instant,
        out: &mut Vec<ProbeAction>,
    ) {
        let (ready, message) = match (probe.kind, outcome) {
            (ProbeKind::Ping(_), Ok(())) => (true, "ping ok".to_string()),
            (ProbeKind::Ping(_), Err(e)) => (false, format!("ping failed: {e}")),
            (ProbeKind::Tcp(_), Ok(())) => (true, "tcp ok".to_string()),
            (ProbeKind::Tcp(addr), Err(e)) => (false, format!("tcp probe {}: {e}", addr.port())),
            (ProbeKind::SshBanner(_), Ok(())) => (true, "ssh ok".to_string()),
            (ProbeKind::SshBanner(addr), Err(e)) => {
                (false, format!("ssh probe {}: {e}", addr.port()))
            }
        };
        self.settle(pod, Some(ready), message, probe.started, now, out);
    }

    /// Store a probe's result, apply the readiness transitions and arm the next probe's timer.
    /// `ran` is the network probe's verdict, None when no probe could run (not ready).
    fn settle(
        &mut self,
        pod: &str,
        ran: Option<bool>,
        message: String,
        started: Instant,
        now: Instant,
        out: &mut Vec<ProbeAction>,
    ) {
        let config = &self.config;
        let Some(agent) = self.agents.get_mut(pod) else {
            return;
        };
        let ready = ran.unwrap_or(false);
        if let (Some(h), Some(t)) = (&self.duration, &agent.target) {
            let secs = now.saturating_duration_since(started).as_secs_f64();
            h.with_label_values(&[t.namespace.as_str()]).observe(secs);
        }
        if let Some(c) = &self.counts {
            let (ns, name) = split_key(pod);
            let uid = agent.target.as_ref().map_or("", |t| t.uid.as_str());
            let outcome = match ran {
                Some(true) => ProbeOutcome::Successful,
                Some(false) => ProbeOutcome::Failed,
                None => ProbeOutcome::Unknown,
            };
            c.record(ns, name, uid, outcome);
        }
        // Which notification, if any, this result produces.
        let notify = if !agent.started {
            agent.started = true;
            agent.ready = ready;
            Some(true)
        } else if !agent.ready && ready {
            agent.ready = true;
            agent.failures = 0;
            Some(false)
        } else if agent.ready && !ready {
            agent.failures += 1;
            if agent.failures >= config.failures_to_unready {
                agent.ready = false;
                agent.failures = 0;
                agent.retry = config.first_retry;
                Some(false)
            } else {
                None
            }
        } else {
            if ready {
                agent.failures = 0;
            }
            None
        };
        if let Some(first) = notify {
            let (uid, ip) = match &agent.target {
                Some(t) => (t.uid.clone(), t.ip),
                None => (String::new(), None),
            };
            out.push(ProbeAction::Notify(ProbeEvent::Readiness {
                pod: pod.to_string(),
                uid,
                ready: agent.ready,
                first,
                message: message.clone(),
                ip,
            }));
        }
        agent.result = Some(ProbeResult {
            ready,
            message,
            at: now,
        });
        let sleep = if agent.ready {
            config.ready_interval
        } else {
            let sleep = agent.retry;
            agent.retry = sleep.mul_f64(config.retry_growth).min(config.max_retry);
            sleep
        };
        let key = TimerKey(self.next_key);
        self.next_key += 1;
        agent.timer = Some(key);
        self.timers.insert(key, pod.to_string());
        out.push(ProbeAction::ArmTimer {
            key,
            at: now + sleep,
        });
    }
}

/// (namespace, name) of a pod key `namespace/name` (a namespace has no `/`).
fn split_key(pod: &str) -> (&str, &str) {
    pod.split_once('/').unwrap_or(("", pod))
}

/// Which IP to probe: the lease file's, else the tracked one. Returns the IP to probe and,
/// when the lease file could not answer, a short note for the not-ready message. Lease-file errors are logged once per file version.
pub fn resolve_ip(
    target: &ProbeTarget,
    leases: Option<&mut LeaseFile>,
    wall: SystemTime,
) -> (Option<Ipv4Addr>, Option<String>) {
    if target.static_ip {
        return (target.ip, None);
    }
    let (Some(mac), Some(leases)) = (target.mac.as_deref(), leases) else {
        return (target.ip, None);
    };
    if mac.trim().is_empty() {
        return (target.ip, None);
    }
    match leases.lookup(mac, wall) {
        Ok(Some(lease)) => (Some(lease.ip), None),
        Ok(None) => (None, None),
        // The Go daemon keeps the tracked IP when the file cannot be read: a guest that
        // answers on it is still up. Without a tracked IP the pod stays not ready.
        Err(e) => {
            if leases.should_log(&e) {
                log::warn!("{e}");
            }
            (target.ip, Some(e.to_string()))
        }
    }
}

/// The probe-port annotation: a decimal port 1..=65535 (surrounding spaces tolerated).
pub fn parse_probe_port(raw: &str) -> Option<u16> {
    let raw = raw.trim();
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    raw.parse::<u16>().ok().filter(|p| *p != 0)
}

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

impl fmt::Display for ProbeEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeEvent::IpChanged { pod, ip, .. } => write!(f, "{pod}: ip {ip:?}"),
            ProbeEvent::Readiness {
                pod, ready, first, ..
            } => {
                write!(f, "{pod}: ready={ready} first={first}")
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_port_parsing() {
        assert_eq!(parse_probe_port("22"), Some(22));
        assert_eq!(parse_probe_port(" 65535 "), Some(65535));
        for bad in ["", "0", "65536", "-1", "+22", "22a", "ssh", "2 2"] {
            assert_eq!(parse_probe_port(bad), None, "{bad:?}");
        }
    }
}
