//! The pure per-pod probe schedule: agents, their timers and readiness transitions.
//! Answers starts, timers and results with [`ProbeAction`]s; reads no clock, owns no socket.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant, SystemTime};

use super::target::{parse_probe_port, resolve_ip, ProbeKind, ProbeResult, ProbeTarget};
use super::ProbeConfig;
use crate::metrics::probes::{ProbeCounts, ProbeOutcome};
use crate::network::leases::LeaseFile;

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
