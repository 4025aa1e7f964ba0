//! The edge: wires the reactor, the kube client and the provider core, and performs effects.
//! The only place where decisions meet I/O.
//!
//! One thread owns everything below. The loop turns reactor events into provider inputs
//! (`route_*`), feeds them through [`Provider::handle`], and performs the effects that come
//! back (`effects.rs`). Effects whose answer is immediate (a lease lookup) queue their answer as
//! the next input; long ones (cocoon children, registry transfers, Kubernetes writes through the
//! kube lane of `kube_jobs.rs`) answer later through `Event::ChildExit` / `Event::Work`.
//!
//! Start order: config and credentials, node capacity, the metrics endpoint,
//! the kubelet API, then the startup reconcile (pod list + `cocoon vm list`) — retried with
//! backoff while the API server or cocoon is unavailable, `/metrics` answering all the time —
//! and only after it the node registration, the pod watch and the cocoon event stream.
//!
//! Kubernetes calls are blocking `ureq` calls with short timeouts (the design card's choice),
//! made on worker threads, never on the loop: pod writes and Events by the kube lane (paced
//! by the client's token bucket, see `lane.rs`), the node Lease and status by a node thread.
//! The watch is the only long-lived connection and is driven without blocking. No turn does
//! unbounded work: watch reads and provider inputs each have a per-turn budget, and children
//! are forked by the reactor's spawner threads, so no turn waits for an exec.
//! SIGTERM / SIGINT stop the loop at once, VMs keep running. SIGHUP is logged and ignored:
//! every setting is read once at start, so a restart applies changes.

mod auth_lane;
mod effects;
mod event_stream;
mod hypervisors;
mod kube_jobs;
pub mod lane;
mod ledger;
mod routing;
mod source_checks;
mod startup;
mod turn_profile;
mod view;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::kube::events::EventRecorder;
use crate::kube::watch::{PodWatch, WatchConfig, WatchOutput};
use crate::kube::{Client, KubeOptions};
use crate::kubelet::{AuthAnswer, AuthId, KubeletServer};
use crate::metrics::collectors::VmCollector;
use crate::metrics::http::MetricsServer;
use crate::metrics::stats::StatsHub;
use crate::metrics::Metrics;
use crate::network::icmp::Pinger;
use crate::network::leases::LeaseFile;
use crate::network::release::LeaseReleaser;
use crate::node::NodeAgent;
use crate::probes::{ProbeConfig, ProbeEngine, ProbeEvent, ProbeManager};
use crate::provider::{Effect, Input, OpId, PodKey, Provider, ProviderConfig};
use crate::reactor::{sd_notify, ChildId, Event, Reactor, TimerId};
use crate::snapshots::{RegistryClient, TransferError};
use crate::vm::runner::EventStream;
use crate::vm::{argv, CocoonCall, Deadlines, Verb};

use self::startup::Startup;

/// Messages worker jobs send back to the loop.
pub enum Work {
    /// A registry transfer (pull, push, image materialisation) finished.
    Transfer {
        op: OpId,
        result: Result<String, TransferError>,
    },
    /// A Windows SAC static-IP pass finished.
    Sac {
        op: OpId,
        result: Result<(), crate::guest::sac::SacError>,
    },
    /// The hibernate-evidence lookup of a create finished.
    Evidence {
        op: OpId,
        result: Result<Option<crate::provider::HibernateTag>, TransferError>,
    },
    /// The host's check of a source a pod names finished.
    SourceChecked {
        op: OpId,
        verdict: crate::provider::SourceVerdict,
    },
    /// DHCP lease releases after a VM removal; (mac, error) per failure.
    LeasesReleased {
        released: usize,
        failed: Vec<String>,
    },
    /// TokenReview / SubjectAccessReview verdict for a kubelet API request.
    KubeletAuth { id: AuthId, answer: AuthAnswer },
    /// A kube lane write of a pod came back (its ops all get this answer).
    PodWritten {
        write: Box<lane::PodWrite>,
        result: Result<(), crate::kube::KubeError>,
    },
    /// A kube lane Event write came back.
    EventWritten {
        event: Box<crate::kube::events::QueuedEvent>,
        result: Box<Result<k8s_openapi::api::core::v1::Event, crate::kube::KubeError>>,
    },
    /// The node agent is back from its tick on the node thread.
    NodeTicked(Box<NodeAgent>),
    /// The node's pods as listed on a lane worker (startup reconcile or watch relist).
    PodsListed {
        startup: bool,
        result: Result<crate::kube::PodList, crate::kube::KubeError>,
    },
    /// The ledger writer wrote (or failed to write) these ops' ownership changes.
    OwnersRecorded {
        ops: Vec<OpId>,
        result: Result<(), String>,
    },
}

/// Worker threads for blocking jobs (blob transfers, lease releases) and their queue bound.
const WORKERS: usize = 4;
const WORK_QUEUE: usize = 1024;
/// Registry transfers running on the pool at once: one worker always stays free for lease
/// releases, even when transfers sit waiting on the node-wide gates of the snapshots room.
const MAX_TRANSFER_JOBS: usize = WORKERS - 1;
/// Kubernetes Events waiting to be written; the oldest is dropped beyond this.
const EVENT_QUEUE: usize = 1000;
/// Loop time one turn spends feeding inputs to the provider at most (see `drain_inputs`).
const INPUT_BUDGET: Duration = Duration::from_millis(20);
/// The watch reads on only while fewer provider inputs than this wait: a burst stays in the
/// socket rather than piling up here as decoded pods.
const PENDING_HIGH: usize = 256;
/// The kubelet view (pods and VMs for logs, exec, stats) trails the provider by at most this.
const VIEW_REFRESH: Duration = Duration::from_millis(200);

/// The daemon's own reactor timer keys are in its range (see `routing.rs`).
const KEY_OWN: u64 = routing::OWN.timer_key(0);
/// The event stream's restart timer (armed and consumed by `vm::runner::EventStream`).
const KEY_EVENT_STREAM: u64 = routing::EVENT_STREAM.timer_key(0);

/// The daemon's own timers (key `KEY_OWN | n`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum OwnTimer {
    Provider = 1,
    Watch = 2,
    Node = 3,
    /// The watch stopped at its read budget: read on (see `PodWatch::read_more`).
    WatchRead = 4,
    Startup = 5,
    Watchdog = 6,
    Lane = 7,
    View = 8,
    /// Queued cocoon calls start on the next turn (a slot freed up).
    Cocoon = 9,
}

impl OwnTimer {
    fn from_key(key: u64) -> Option<OwnTimer> {
        use OwnTimer::*;
        [
            Provider, Watch, Node, WatchRead, Startup, Watchdog, Lane, View, Cocoon,
        ]
        .into_iter()
        .find(|t| KEY_OWN | *t as u64 == key)
    }
}

/// What a running cocoon child is for.
enum ChildRole {
    /// A provider `Effect::Cocoon`, and the call it runs (its verb classifies the result; a
    /// cocoon-macos call's own contract reads it after).
    Op {
        op: OpId,
        call: CocoonCall,
        macos: Option<crate::guest::macos::MacosCmd>,
    },
    /// The startup `cocoon vm list -o json`.
    StartupList,
    /// The re-sync `vm list` owed after the event stream restarted.
    Resync,
    /// The event stream's `cocoon vm status --event` child (its output and exit go back to it).
    EventStream,
}

/// Everything the loop owns.
pub struct Daemon {
    config: Config,
    reactor: Reactor<Work>,
    metrics: Metrics,
    metrics_server: Option<MetricsServer>,
    kube: Arc<Client>,
    registry: Option<Arc<RegistryClient>>,
    provider: Provider,
    pending: VecDeque<Input>,
    /// Inputs handled before `pending`: a hypervisor's exit and the answers of the cocoon calls
    /// that check, restart or remove VMs, so a dead VM's pod is failed without waiting behind
    /// a burst's backlog of watch events and create answers.
    urgent_inputs: VecDeque<Input>,
    /// Effects of a handled input that the turn's budget left for the next turn (in order).
    owed_effects: VecDeque<Effect>,
    startup: Option<Startup>,
    watch: PodWatch,
    /// A pod list for the watch is running on a lane worker.
    relisting: bool,
    /// None while the agent is away ticking on the node thread.
    node: Option<Box<NodeAgent>>,
    node_registered: bool,
    /// The node Lease / status thread (see `kube_jobs.rs`).
    node_pool: crate::reactor::WorkerPool<Work>,
    /// Pod writes and Events waiting for a token and a worker, and the workers.
    lane: lane::KubeLane,
    lane_pool: crate::reactor::WorkerPool<Work>,
    /// The lane's client handle: the loop took the token before handing a call over.
    lane_kube: Arc<Client>,
    lane_metrics: kube_jobs::LaneMetrics,
    lane_gauges_at: Option<Instant>,
    events: EventRecorder,
    /// Event writes pause until then after a transient failure.
    events_hold: Option<Instant>,
    kubelet: KubeletServer,
    /// TokenReview / SubjectAccessReview calls for the kubelet API, apart from the pool.
    auth_lane: auth_lane::AuthLane,
    probes: ProbeEngine<TimerId>,
    leases: LeaseFile,
    releaser: Arc<LeaseReleaser>,
    stream: EventStream,
    children: HashMap<ChildId, ChildRole>,
    /// Provider cocoon calls waiting for a slot, and how many run (see `start_cocoon_calls`).
    cocoon_queue: VecDeque<(OpId, crate::provider::CocoonCmd)>,
    /// How many VM checks and teardowns (`vm inspect`, `vm start`, `vm rm`) lead the queue
    /// (they go ahead of creates; see `effects::jumps_the_queue`).
    cocoon_priority_queued: usize,
    cocoon_running: usize,
    /// Registry transfer jobs waiting for a worker, and how many run (see `start_transfers`).
    transfer_queue: VecDeque<(OpId, effects::TransferJob)>,
    transfers_running: usize,
    timers: HashMap<OwnTimer, (TimerId, Instant)>,
    watchdog: Option<Duration>,
    view_dirty: bool,
    /// pidfds of the running VMs' hypervisors, checked after every turn that fed the core.
    hypervisors: hypervisors::HypervisorWatch,
    hypervisors_dirty: bool,
    /// When the kubelet view was last rebuilt (see `VIEW_REFRESH`).
    view_built: Option<Instant>,
    stopping: bool,
    /// `vk_cocoon_loop_longest_turn_seconds`: the longest time one loop turn took, so a stall
    /// (a slow API call, a huge batch) shows up on the dashboard.
    longest_turn: prometheus::Gauge,
    /// Where the current turn spends its time (logged when it sets a new record).
    profile: turn_profile::TurnProfile,
    /// The peer snapshot listener and the Node address book peer restores dial from.
    peer: crate::peer::housekeeping::PeerService,
    /// The ownership ledger's writer thread (VK_STATE_DIR).
    ledger: ledger::LedgerWriter,
}

/// A fatal start-up error: the message and the process exit status.
pub struct StartError {
    pub message: String,
    pub status: i32,
}

impl StartError {
    fn new(status: i32, message: impl Into<String>) -> StartError {
        StartError {
            message: message.into(),
            status,
        }
    }
}

/// Runs the daemon until SIGTERM/SIGINT. Returns the process exit status.
pub fn run(config: Config) -> i32 {
    raise_open_file_limit();
    Deadlines::configure(config.cocoon_deadlines);
    if let Some(file) = &config.test_wall_clock_offset_file {
        crate::wall_clock::follow_offset_file(file.clone());
    }
    let mut daemon = match Daemon::new(config) {
        Ok(d) => d,
        Err(e) => {
            log::error!("{}", e.message);
            return e.status;
        }
    };
    let status = daemon.serve();
    let _ = sd_notify::notify(&format!(
        "STOPPING=1\n{}",
        sd_notify::status_line("stopped; the VMs keep running")
    ));
    log::info!("vk-cocoon stopped");
    status
}

impl Daemon {
    /// Builds every part and binds the listeners; nothing talks to the API server yet.
    pub fn new(config: Config) -> Result<Daemon, StartError> {
        let mut reactor: Reactor<Work> = Reactor::new(WORKERS, WORK_QUEUE)
            .map_err(|e| StartError::new(1, format!("event loop: {e}")))?;
        reactor
            .watch_signals(&[libc::SIGTERM, libc::SIGINT, libc::SIGHUP])
            .map_err(|e| StartError::new(1, format!("signal handling: {e}")))?;
        let metrics =
            Metrics::new().map_err(|e| StartError::new(1, format!("metrics registry: {e}")))?;

        let kube = Client::from_env(&KubeOptions::from_process_env())
            .map_err(|e| StartError::new(2, format!("kubernetes client: {e}")))?;
        let kube = Arc::new(kube);
        log::info!("kubernetes API at {}", kube.server());

        let spool = config.spool_dir();
        crate::snapshots::push::prepare_spool_dir(&spool)
            .map_err(|e| StartError::new(1, e.to_string()))?;
        let mut node = startup::node_agent(&config, reactor.now())?;
        let registry = if config.oci_registry.is_empty() {
            None
        } else {
            let client = RegistryClient::from_env(
                &config.oci_registry,
                config.oci_registry_ca_file.as_deref(),
            )
            .map_err(|e| {
                StartError::new(2, format!("OCI_REGISTRY {:?}: {e}", config.oci_registry))
            })?;
            Some(Arc::new(client))
        };

        let stats = StatsHub::new(crate::kubelet::stats_paths(&config)).background_refresh();
        node.count_cow_of(stats.clone());
        metrics
            .add_text_source(Arc::new(VmCollector::new(stats.clone())))
            .map_err(|e| StartError::new(1, format!("metrics collectors: {e}")))?;

        let metrics_server =
            MetricsServer::bind(&config.metrics_addr, metrics.clone(), &mut reactor).map_err(
                |e| {
                    StartError::new(
                        1,
                        format!("metrics listener on {}: {e}", config.metrics_addr),
                    )
                },
            )?;
        log::info!(
            "metrics listening on http://{}/metrics",
            metrics_server.local_addr()
        );

        let mut kubelet =
            startup::kubelet_server(&config, &kube, node.options(), stats, &mut reactor)?;
        let probe_counts = crate::metrics::probes::ProbeCounts::default();
        kubelet.serve_metrics(crate::kubelet::server::ServedMetrics {
            metrics: metrics.clone(),
            probes: probe_counts.clone(),
        });
        startup::export_kube_client_expiry(&metrics, &kube);
        let peer = startup::peer_service(&config, &kube)?;
        let review_kube = kube.clone();
        let auth_lane = auth_lane::AuthLane::new(
            Arc::new(move |req: &crate::kubelet::AuthRequest| {
                effects::authorize(&review_kube, req)
            }),
            reactor.notifier(),
            reactor.now(),
        )
        .map_err(|e| StartError::new(1, format!("authorisation threads: {e}")))?;

        let mut probe_manager = ProbeManager::new(
            ProbeConfig::default(),
            Some(LeaseFile::new(config.leases_path.clone())),
        );
        probe_manager.set_duration_histogram(metrics.probe_duration_seconds.clone());
        probe_manager.set_probe_counts(probe_counts);
        let pinger = Pinger::open();
        crate::network::icmp::register_mode_gauge(metrics.registry(), pinger.mode())
            .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
        let probes = ProbeEngine::new(probe_manager, pinger, &mut reactor)
            .map_err(|e| StartError::new(1, format!("probe socket: {e}")))?;

        let (owners, ledger) =
            ledger::open(&config.state_dir, reactor.notifier()).map_err(|e| {
                StartError::new(
                    1,
                    format!("VK_STATE_DIR {}: {e}", config.state_dir.display()),
                )
            })?;
        let provider = Provider::new(ProviderConfig {
            node_name: config.node_name.clone(),
            cpu_class: config.snapshot_cpu_class.clone(),
            registry: registry.is_some(),
            orphan_policy: config.orphan_policy,
            restore_mode: config.restore_mode,
            lease_release: config.cocoon_net_control_socket.is_some(),
            macos_vnc: config.macos_vnc_password.is_some(),
            image_url_allow_hosts: config.image_url_allow_hosts.clone(),
            clone_from_dir_root: config.clone_from_dir_root.clone(),
        });
        let mut watch = PodWatch::new(&config.node_name, WatchConfig::default());
        watch.relist_by_caller();
        let lane_pool = reactor
            .extra_pool(
                "vk-kube",
                kube_jobs::LANE_WORKERS,
                kube_jobs::LANE_WORKERS * 4,
            )
            .map_err(|e| StartError::new(1, format!("kube lane workers: {e}")))?;
        let node_pool = reactor
            .extra_pool("vk-node", 1, 4)
            .map_err(|e| StartError::new(1, format!("node lease thread: {e}")))?;
        let lane_metrics = kube_jobs::LaneMetrics::register(metrics.registry())
            .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
        let watch_token = reactor.token_in(routing::WATCH);
        watch
            .register(reactor.registry(), watch_token)
            .map_err(|e| StartError::new(1, format!("pod watch: {e}")))?;
        let events = EventRecorder::new(&config.node_name, EVENT_QUEUE);
        let releaser = Arc::new(LeaseReleaser::new(config.cocoon_net_control_socket.clone()));
        let leases = LeaseFile::new(config.leases_path.clone());
        let watchdog = sd_notify::watchdog_interval(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
        );
        let longest_turn = prometheus::Gauge::new(
            "vk_cocoon_loop_longest_turn_seconds",
            "Longest time one turn of the event loop took since start (a loop stall).",
        )
        .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
        metrics
            .registry()
            .register(Box::new(longest_turn.clone()))
            .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
        let now = reactor.now();
        Ok(Daemon {
            stream: EventStream::new(
                &config.cocoon_bin.to_string_lossy(),
                Vec::new(),
                KEY_EVENT_STREAM,
                now,
            ),
            startup: Some(Startup::new(owners)),
            config,
            reactor,
            metrics,
            metrics_server: Some(metrics_server),
            lane_kube: Arc::new(kube.paced_by_caller()),
            kube,
            registry,
            provider,
            pending: VecDeque::new(),
            urgent_inputs: VecDeque::new(),
            owed_effects: VecDeque::new(),
            watch,
            relisting: false,
            node: Some(Box::new(node)),
            node_registered: false,
            node_pool,
            lane: lane::KubeLane::new(lane::LaneLimits {
                slots: kube_jobs::LANE_WORKERS - 2,
                ..lane::LaneLimits::default()
            }),
            lane_pool,
            lane_metrics,
            lane_gauges_at: None,
            events,
            events_hold: None,
            kubelet,
            auth_lane,
            probes,
            leases,
            releaser,
            children: HashMap::new(),
            cocoon_queue: VecDeque::new(),
            cocoon_priority_queued: 0,
            cocoon_running: 0,
            transfer_queue: VecDeque::new(),
            transfers_running: 0,
            timers: HashMap::new(),
            watchdog,
            view_dirty: true,
            hypervisors: Default::default(),
            hypervisors_dirty: true,
            view_built: None,
            stopping: false,
            longest_turn,
            profile: Default::default(),
            peer,
            ledger,
        })
    }

    /// The loop. Returns the exit status.
    pub fn serve(&mut self) -> i32 {
        self.profile.watch_this_thread();
        // Every pool and spawner thread exists by now and keeps the default weight.
        use crate::reactor::priority;
        match priority::set_thread_nice(priority::LOOP_NICE) {
            Ok(()) => log::debug!("event loop thread at nice {}", priority::LOOP_NICE),
            Err(e) => log::info!(
                "event loop thread left at the default priority ({e}); loop turns may \
                 wait behind busy helpers on a loaded host"
            ),
        }
        if self.watchdog.is_some() {
            self.fire_own(OwnTimer::Watchdog);
        }
        self.arm(OwnTimer::Startup, self.reactor.now());
        let mut events = Vec::new();
        loop {
            events.clear();
            self.profile.clear();
            if let Err(e) = self.reactor.poll(&mut events) {
                log::error!("event loop: {e}");
                return 1;
            }
            // The turn starts when the poll returned: the reactor's own reads count too.
            let turn = self.reactor.now();
            let mut at = self.profile.lap("reactor", turn);
            let n_events = events.len();
            for event in events.drain(..) {
                let io = match &event {
                    Event::Io(ready) => routing::Owner::of_token(ready.token).profile_name(),
                    _ => "",
                };
                let kind = turn_profile::event_kind(&event, io);
                self.route(event);
                at = self.profile.lap(kind, at);
                if self.stopping {
                    self.shutdown();
                    return 0;
                }
            }
            self.drain_inputs();
            at = Instant::now();
            self.after_turn();
            self.profile.lap("after-turn", at);
            let took = turn.elapsed().as_secs_f64();
            if took > self.longest_turn.get() {
                self.longest_turn.set(took);
                if took > 0.01 {
                    log::info!(
                        "longest loop turn so far: {:.1} ms ({:.1} ms on CPU, {:.1} ms \
                         waiting for a CPU), {n_events} events; {}",
                        took * 1000.0,
                        self.profile.cpu().as_secs_f64() * 1000.0,
                        self.profile.run_wait().as_secs_f64() * 1000.0,
                        self.profile.summary()
                    );
                }
            } else if took > 0.05 {
                log::debug!(
                    "event loop turn took {:.1} ms ({:.1} ms on CPU, {:.1} ms waiting for a \
                     CPU), {n_events} events; {}",
                    took * 1000.0,
                    self.profile.cpu().as_secs_f64() * 1000.0,
                    self.profile.run_wait().as_secs_f64() * 1000.0,
                    self.profile.summary()
                );
            }
        }
    }

    /// One of the daemon's own timers fired: acted on unless it was re-armed since.
    fn own_timer_fired(&mut self, id: TimerId, key: u64) {
        let Some(which) = OwnTimer::from_key(key) else {
            return;
        };
        if self.timers.get(&which).map(|t| t.0) != Some(id) {
            return;
        }
        self.timers.remove(&which);
        self.fire_own(which);
    }

    fn fire_own(&mut self, which: OwnTimer) {
        let now = self.reactor.now();
        match which {
            OwnTimer::Provider => self.pending.push_back(Input::Tick),
            OwnTimer::Watch => {
                let out = self.watch.on_timer(&self.kube, now);
                self.watch_outputs(out);
                self.watch_relist();
            }
            OwnTimer::Node => self.node_tick(),
            OwnTimer::WatchRead if self.pending.len() >= PENDING_HIGH => {
                self.arm(OwnTimer::WatchRead, now);
            }
            OwnTimer::WatchRead => self.watch_read(now),
            OwnTimer::Cocoon => self.start_cocoon_calls(),
            OwnTimer::Startup => self.startup_step(),
            OwnTimer::Watchdog => {
                let _ = sd_notify::notify("WATCHDOG=1");
                if let Some(every) = self.watchdog {
                    self.arm(OwnTimer::Watchdog, now + every);
                }
            }
            OwnTimer::Lane => {}
            OwnTimer::View => self.refresh_view(),
        }
    }

    fn route_work(&mut self, work: Work) {
        match work {
            Work::Transfer { op, result } => {
                self.transfers_running = self.transfers_running.saturating_sub(1);
                self.pending.push_back(Input::TransferDone { op, result });
                self.start_transfers();
            }
            Work::Evidence { op, result } => self
                .pending
                .push_back(Input::HibernateEvidence { op, result }),
            Work::SourceChecked { op, verdict } => {
                self.pending.push_back(Input::SourceChecked { op, verdict })
            }
            Work::Sac { op, result } => self.pending.push_back(Input::SacDone { op, result }),
            Work::LeasesReleased { released, failed } => {
                let family = &self.metrics.lease_release_total;
                family.with_label_values(&["ok"]).inc_by(released as u64);
                family
                    .with_label_values(&["failed"])
                    .inc_by(failed.len() as u64);
                for f in failed {
                    log::warn!("lease release: {f} (cocoon-net's lease expiry is the fallback)");
                }
            }
            Work::KubeletAuth { id, answer } => {
                self.auth_lane.done(id);
                self.kubelet.on_auth_answer(&mut self.reactor, id, answer);
                self.kubelet_auth();
            }
            Work::PodWritten { write, result } => self.pod_written(*write, result),
            Work::EventWritten { event, result } => self.event_written(*event, *result),
            Work::NodeTicked(agent) => self.node_ticked(agent),
            Work::PodsListed { startup, result } => self.pods_listed(startup, result),
            Work::OwnersRecorded { ops, result } => {
                for op in ops {
                    let result = result.clone();
                    self.pending.push_back(Input::OwnersRecorded { op, result });
                }
            }
        }
    }

    /// Reads what the watch socket holds, up to the watch's budget; the rest on a later turn.
    fn watch_read(&mut self, now: Instant) {
        let out = self.watch.on_ready(&self.kube, now);
        self.watch_outputs(out);
        self.watch_relist();
        if self.watch.read_more() {
            self.arm(OwnTimer::WatchRead, now);
        }
    }

    /// Pod watch outputs become provider inputs; before the startup reconcile they are dropped
    /// (the reconcile's own list is the starting point and the watch resumes from it).
    fn watch_outputs(&mut self, out: Vec<WatchOutput>) {
        if !out.is_empty() {
            self.view_dirty = true;
        }
        for o in out {
            self.pending.push_back(match o {
                WatchOutput::Added(p) | WatchOutput::Modified(p) => Input::PodUpserted(p),
                WatchOutput::Deleted(p) => {
                    // Nothing more is recorded of a pod once it is gone.
                    self.events
                        .forget_pod(p.metadata.uid.as_deref().unwrap_or_default());
                    Input::PodDeleted(p)
                }
            });
        }
    }

    /// Readiness and IP changes from the probe engine, for the provider.
    fn probe_events(&mut self, out: Vec<ProbeEvent>) {
        for e in out {
            let (pod, uid, ready, message, ip) = match e {
                ProbeEvent::Readiness {
                    pod,
                    uid,
                    ready,
                    message,
                    ip,
                    ..
                } => (pod, uid, ready, message, ip),
                ProbeEvent::IpChanged {
                    pod,
                    uid,
                    ip,
                    ready,
                    ..
                } => {
                    let latest = self.probes.manager().result(&pod);
                    let message = latest.map(|r| r.message.clone()).unwrap_or_default();
                    (pod, uid, ready, message, ip)
                }
            };
            let Some((ns, name)) = pod.split_once('/') else {
                continue;
            };
            self.pending.push_back(Input::Readiness {
                key: PodKey::new(ns, name),
                uid,
                ready,
                message,
                ip: Some(ip.map(|i| i.to_string()).unwrap_or_default()),
            });
        }
    }

    /// Feeds queued inputs through the provider and performs the effects, for at most
    /// `INPUT_BUDGET` of loop time: the rest waits for the next turn, which comes at once
    /// (so probes, the kubelet API and /metrics get their turn in between). The budget holds
    /// inside one input's effects too (the startup reconcile of 1,000 pods answers with
    /// thousands): those left are performed first on the next turn, in order, and no later
    /// input is handled before them.
    fn drain_inputs(&mut self) {
        let started = Instant::now();
        'turn: loop {
            while let Some(effect) = self.owed_effects.pop_front() {
                let kind = turn_profile::effect_kind(&effect);
                let effect_at = Instant::now();
                self.perform(effect);
                self.profile.lap(kind, effect_at);
                if started.elapsed() >= INPUT_BUDGET {
                    break 'turn;
                }
            }
            if started.elapsed() >= INPUT_BUDGET {
                break;
            }
            let Some(input) = self
                .urgent_inputs
                .pop_front()
                .or_else(|| self.pending.pop_front())
            else {
                break;
            };
            let now = self.reactor.now();
            let kind = turn_profile::input_kind(&input);
            let core_at = Instant::now();
            let effects = self.provider.handle(input, now, crate::wall_clock::now());
            self.profile.lap(kind, core_at);
            // Any input may change a tracked VM or its PID, effects or not (an inspect that
            // learns a new PID answers with none): the watch is checked after every such turn.
            self.hypervisors_dirty = true;
            if !effects.is_empty() {
                self.view_dirty = true;
            }
            self.owed_effects.extend(effects);
        }
        if let Some(at) = self.provider.poll_timeout() {
            self.arm(OwnTimer::Provider, at);
        }
        if self.hypervisors_dirty {
            self.hypervisors_dirty = false;
            let sync_at = Instant::now();
            self.hypervisors
                .sync(&mut self.reactor, || self.provider.tracked_vms());
            self.profile.lap("hypervisor-sync", sync_at);
        }
    }

    /// Re-arms the watch, node and event timers and refreshes the kubelet view.
    fn after_turn(&mut self) {
        if self.startup.is_none() {
            if let Some(at) = self.watch.next_due() {
                self.arm(OwnTimer::Watch, at);
            }
            if let Some(node) = &self.node {
                self.arm(OwnTimer::Node, node.next_due());
            }
        }
        self.pump_lane();
        self.lane_gauges();
        if self.view_dirty && !self.timers.contains_key(&OwnTimer::View) {
            let due = self
                .view_built
                .map_or(self.reactor.now(), |at| at + VIEW_REFRESH);
            self.arm(OwnTimer::View, due);
        }
        if !self.pending.is_empty()
            || !self.urgent_inputs.is_empty()
            || !self.owed_effects.is_empty()
        {
            self.arm(OwnTimer::Provider, self.reactor.now());
        }
        if !self.cocoon_queue.is_empty() && self.cocoon_running < effects::MAX_COCOON_CALLS {
            self.arm(OwnTimer::Cocoon, self.reactor.now());
        }
    }

    /// Rebuilds the kubelet view (every pod serialised: O(pods), hence at most once per
    /// `VIEW_REFRESH` however many turns change something during a burst).
    fn refresh_view(&mut self) {
        if self.view_dirty {
            self.view_dirty = false;
            self.view_built = Some(self.reactor.now());
            self.kubelet.set_view(self.kubelet_view());
        }
    }

    /// Arms (or moves) one of the daemon's own timers.
    fn arm(&mut self, which: OwnTimer, at: Instant) {
        if let Some(&(id, when)) = self.timers.get(&which) {
            if when == at {
                return;
            }
            self.reactor.cancel_timer(id);
        }
        let id = self.reactor.timer_at(at, KEY_OWN | which as u64);
        self.timers.insert(which, (id, at));
    }

    /// Answers the kubelet server's pending TokenReview / SubjectAccessReview requests on the
    /// review lane (blocking API calls never run on the loop, nor on the shared pool), and
    /// drops those whose client left.
    fn kubelet_auth(&mut self) {
        for id in self.kubelet.take_cancelled_auth() {
            self.auth_lane.cancel(id);
        }
        let now = self.reactor.now();
        for (id, req, peer) in self.kubelet.take_auth_requests() {
            if let Err(answer) = self.auth_lane.submit(id, req, peer, now) {
                self.kubelet.on_auth_answer(&mut self.reactor, id, answer);
            }
        }
    }

    fn shutdown(&mut self) {
        // Stop accepting; in-flight cocoon calls are killed when the reactor drops; VMs live on.
        self.stream.stop(&mut self.reactor);
        if let Some(server) = self.metrics_server.take() {
            server.shutdown(&mut self.reactor);
        }
        let effects = self.provider.shutdown();
        for effect in effects {
            if let Effect::StopProbe { key } = effect {
                self.probes.forget(&mut self.reactor, &key.to_string());
            }
        }
    }

    /// Starts `cocoon vm list -o json` (startup reconcile or event-stream re-sync).
    fn spawn_vm_list(&mut self, role: ChildRole) -> std::io::Result<()> {
        let spec = vm_list_call().child_spec(&self.config.cocoon_bin.to_string_lossy());
        let id = self.reactor.spawn(spec)?;
        self.children.insert(id, role);
        Ok(())
    }

    /// The cocoon binary as an argv prefix.
    fn cocoon_bin(&self) -> PathBuf {
        self.config.cocoon_bin.clone()
    }
}

/// The `vm list` of the startup reconcile and the event-stream re-sync: a dense host's list
/// is the largest answer cocoon gives.
pub(super) fn vm_list_call() -> CocoonCall {
    CocoonCall::new(Verb::VmList, argv::vm_list(), &Deadlines::configured())
        .with_limits(64 << 20, 64 << 10)
}

/// Lifts the soft open-file limit to the hard one: the daemon holds a socket or
/// pipe per VM, probe, client and child (the unit also sets LimitNOFILE=65536).
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                log::debug!(
                    "could not raise RLIMIT_NOFILE: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}
