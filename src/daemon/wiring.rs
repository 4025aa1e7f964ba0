//! Wiring of the edge: builds the daemon's parts (loop, clients, servers, probes, lanes, core)
//! in start order and binds the listeners; nothing talks to the API server yet.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::config::Config;
use crate::kube::events::EventRecorder;
use crate::kube::watch::{PodWatch, WatchConfig};
use crate::kube::{Client, KubeOptions};
use crate::metrics::collectors::VmCollector;
use crate::metrics::http::MetricsServer;
use crate::metrics::probes::ProbeCounts;
use crate::metrics::stats::StatsHub;
use crate::metrics::Metrics;
use crate::network::icmp::Pinger;
use crate::network::leases::LeaseFile;
use crate::network::release::LeaseReleaser;
use crate::probes::{ProbeConfig, ProbeEngine, ProbeManager};
use crate::provider::{Provider, ProviderConfig};
use crate::reactor::{sd_notify, Reactor, TimerId, WorkerPool};
use crate::snapshots::RegistryClient;
use crate::vm::runner::EventStream;

use super::startup::{self, Startup};
use super::{auth_lane, kube_jobs, lane, ledger, routing};
use super::{Daemon, StartError, Work, EVENT_QUEUE, KEY_EVENT_STREAM, WORKERS, WORK_QUEUE};

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
        let registry = registry_client(&config)?;

        let stats = StatsHub::new(crate::kubelet::stats_paths(&config)).background_refresh();
        node.count_cow_of(stats.clone());
        metrics
            .add_text_source(Arc::new(VmCollector::new(stats.clone())))
            .map_err(|e| StartError::new(1, format!("metrics collectors: {e}")))?;
        let metrics_server = bind_metrics(&config, &metrics, &mut reactor)?;

        let mut kubelet =
            startup::kubelet_server(&config, &kube, node.options(), stats, &mut reactor)?;
        let probe_counts = ProbeCounts::default();
        kubelet.serve_metrics(crate::kubelet::server::ServedMetrics {
            metrics: metrics.clone(),
            probes: probe_counts.clone(),
        });
        startup::export_kube_client_expiry(&metrics, &kube);
        let peer = startup::peer_service(&config, &kube)?;
        let auth_lane = review_lane(&kube, &reactor)?;
        let probes = probe_engine(&config, &metrics, probe_counts, &mut reactor)?;

        let (owners, ledger) =
            ledger::open(&config.state_dir, reactor.notifier()).map_err(|e| {
                StartError::new(
                    1,
                    format!("VK_STATE_DIR {}: {e}", config.state_dir.display()),
                )
            })?;
        let provider = provider(&config, registry.is_some());
        let (lane_pool, node_pool) = kube_pools(&reactor)?;
        let lane_metrics = kube_jobs::LaneMetrics::register(metrics.registry())
            .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
        let watch = pod_watch(&config, &mut reactor)?;
        let events = EventRecorder::new(&config.node_name, EVENT_QUEUE);
        let releaser = Arc::new(LeaseReleaser::new(config.cocoon_net_control_socket.clone()));
        let leases = LeaseFile::new(config.leases_path.clone());
        let watchdog = sd_notify::watchdog_interval(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
        );
        let longest_turn = longest_turn_gauge(&metrics)?;
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
            view_built: None,
            stopping: false,
            longest_turn,
            profile: Default::default(),
            peer,
            ledger,
        })
    }
}

/// The OCI registry client, when OCI_REGISTRY names one.
fn registry_client(config: &Config) -> Result<Option<Arc<RegistryClient>>, StartError> {
    if config.oci_registry.is_empty() {
        return Ok(None);
    }
    let client =
        RegistryClient::from_env(&config.oci_registry, config.oci_registry_ca_file.as_deref())
            .map_err(|e| {
                StartError::new(2, format!("OCI_REGISTRY {:?}: {e}", config.oci_registry))
            })?;
    Ok(Some(Arc::new(client)))
}

/// Binds the metrics listener: `/metrics` answers from here on, startup retries included.
fn bind_metrics(
    config: &Config,
    metrics: &Metrics,
    reactor: &mut Reactor<Work>,
) -> Result<MetricsServer, StartError> {
    let server =
        MetricsServer::bind(&config.metrics_addr, metrics.clone(), reactor).map_err(|e| {
            StartError::new(
                1,
                format!("metrics listener on {}: {e}", config.metrics_addr),
            )
        })?;
    log::info!(
        "metrics listening on http://{}/metrics",
        server.local_addr()
    );
    Ok(server)
}

/// The review lane of the kubelet API: TokenReview / SubjectAccessReview on threads of its own.
fn review_lane(
    kube: &Arc<Client>,
    reactor: &Reactor<Work>,
) -> Result<auth_lane::AuthLane, StartError> {
    let review_kube = kube.clone();
    auth_lane::AuthLane::new(
        Arc::new(move |req: &crate::kubelet::AuthRequest| auth_lane::authorize(&review_kube, req)),
        reactor.notifier(),
        reactor.now(),
    )
    .map_err(|e| StartError::new(1, format!("authorisation threads: {e}")))
}

/// The probe engine: the schedules, the pinger's socket and its metrics.
fn probe_engine(
    config: &Config,
    metrics: &Metrics,
    probe_counts: ProbeCounts,
    reactor: &mut Reactor<Work>,
) -> Result<ProbeEngine<TimerId>, StartError> {
    let mut probe_manager = ProbeManager::new(
        ProbeConfig::default(),
        Some(LeaseFile::new(config.leases_path.clone())),
    );
    probe_manager.set_duration_histogram(metrics.probe_duration_seconds.clone());
    probe_manager.set_probe_counts(probe_counts);
    let pinger = Pinger::open();
    crate::network::icmp::register_mode_gauge(metrics.registry(), pinger.mode())
        .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
    ProbeEngine::new(probe_manager, pinger, reactor)
        .map_err(|e| StartError::new(1, format!("probe socket: {e}")))
}

/// The provider core, configured from the settings.
fn provider(config: &Config, registry: bool) -> Provider {
    Provider::new(ProviderConfig {
        node_name: config.node_name.clone(),
        cpu_class: config.snapshot_cpu_class.clone(),
        registry,
        orphan_policy: config.orphan_policy,
        restore_mode: config.restore_mode,
        lease_release: config.cocoon_net_control_socket.is_some(),
        macos_vnc: config.macos_vnc_password.is_some(),
        image_url_allow_hosts: config.image_url_allow_hosts.clone(),
        clone_from_dir_root: config.clone_from_dir_root.clone(),
    })
}

/// The pod watch, registered under its token; the daemon lists pods for it on a lane worker.
fn pod_watch(config: &Config, reactor: &mut Reactor<Work>) -> Result<PodWatch, StartError> {
    let mut watch = PodWatch::new(&config.node_name, WatchConfig::default());
    watch.relist_by_caller();
    let watch_token = reactor.token_in(routing::WATCH);
    watch
        .register(reactor.registry(), watch_token)
        .map_err(|e| StartError::new(1, format!("pod watch: {e}")))?;
    Ok(watch)
}

/// The kube lane's workers and the node Lease / status thread (see `kube_jobs.rs`).
fn kube_pools(reactor: &Reactor<Work>) -> Result<(WorkerPool<Work>, WorkerPool<Work>), StartError> {
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
    Ok((lane_pool, node_pool))
}

/// `vk_cocoon_loop_longest_turn_seconds`, registered.
fn longest_turn_gauge(metrics: &Metrics) -> Result<prometheus::Gauge, StartError> {
    let longest_turn = prometheus::Gauge::new(
        "vk_cocoon_loop_longest_turn_seconds",
        "Longest time one turn of the event loop took since start (a loop stall).",
    )
    .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
    metrics
        .registry()
        .register(Box::new(longest_turn.clone()))
        .map_err(|e| StartError::new(1, format!("metrics: {e}")))?;
    Ok(longest_turn)
}
