//! The edge: wires the reactor, the kube client and the provider core, and performs effects.
//! The only place where decisions meet I/O.
//!
//! One thread owns everything below. The loop turns reactor events into provider inputs
//! (`routing.rs` hands each event to its owner), feeds them through [`Provider::handle`], and
//! performs the effects that come back (`effects.rs`). Effects whose answer is immediate (a
//! lease lookup) queue their answer as the next input; long ones (cocoon children, registry
//! transfers, Kubernetes writes through the kube lane of `kube_jobs.rs`) answer later through
//! `Event::ChildExit` / `Event::Work`.
//!
//! Rooms: `wiring.rs` builds the parts, `turn.rs` runs one loop turn, `routing.rs` routes,
//! `timers.rs` holds the daemon's own timers; `pod_watch.rs`, `probe_results.rs` and
//! `event_stream.rs` turn their subscriber's output into inputs; `effects.rs` dispatches the
//! effects to `cocoon_calls.rs`, `transfers.rs`, the kube lane (`kube_jobs.rs`) and the rest;
//! `startup.rs` is the startup reconcile, `view.rs` the kubelet's view, `hypervisors.rs` the
//! pidfd watch, `auth_lane.rs` the kubelet API's reviews.
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
mod cocoon_calls;
mod effects;
mod event_stream;
mod hypervisors;
mod kube_jobs;
pub mod lane;
mod ledger;
mod pod_watch;
mod probe_results;
mod routing;
mod source_checks;
mod startup;
mod timers;
mod transfers;
mod turn;
mod turn_profile;
mod view;
mod wiring;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::kube::events::EventRecorder;
use crate::kube::watch::PodWatch;
use crate::kube::Client;
use crate::kubelet::{AuthAnswer, AuthId, KubeletServer};
use crate::metrics::http::MetricsServer;
use crate::metrics::Metrics;
use crate::network::leases::LeaseFile;
use crate::network::release::LeaseReleaser;
use crate::node::NodeAgent;
use crate::probes::ProbeEngine;
use crate::provider::{Effect, Input, OpId, Provider};
use crate::reactor::{sd_notify, ChildId, Reactor, TimerId};
use crate::snapshots::{RegistryClient, TransferError};
use crate::vm::runner::EventStream;
use crate::vm::{CocoonCall, Deadlines};

use self::startup::Startup;
use self::timers::OwnTimer;

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

/// The event stream's restart timer (armed and consumed by `vm::runner::EventStream`).
const KEY_EVENT_STREAM: u64 = routing::EVENT_STREAM.timer_key(0);

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
    /// (they go ahead of creates; see `cocoon_calls::jumps_the_queue`).
    cocoon_priority_queued: usize,
    cocoon_running: usize,
    /// Registry transfer jobs waiting for a worker, and how many run (see `start_transfers`).
    transfer_queue: VecDeque<(OpId, transfers::TransferJob)>,
    transfers_running: usize,
    timers: HashMap<OwnTimer, (TimerId, Instant)>,
    watchdog: Option<Duration>,
    view_dirty: bool,
    /// pidfds of the running VMs' hypervisors, checked for the pods each turn's inputs changed.
    hypervisors: hypervisors::HypervisorWatch,
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

impl Daemon {}

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
