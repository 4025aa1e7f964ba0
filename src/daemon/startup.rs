//! Start-up: building the node agent and the kubelet server from the configuration, and the
//! startup reconcile (pod list + `cocoon vm list`) that must finish before anything else runs.
//!
//! The Go daemon exits when the reconcile fails; here it is retried with backoff (1 s doubling
//! to 30 s) so a host that boots before its API server or cocoon comes up by itself, with
//! `/metrics` answering and SIGTERM honoured meanwhile.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::timers::OwnTimer;
use super::{ChildRole, Daemon, StartError, Work};
use crate::backoff::Backoff;
use crate::config::Config;
use crate::kube::watch::WatchOutput;
use crate::kube::Client;
use crate::kubelet::tls::TlsState;
use crate::kubelet::{KubeletConfig, KubeletServer};
use crate::metrics::stats::StatsHub;
use crate::node::{compute_resources, HostFacts, NodeAgent, NodeOptions};
use crate::provider::Input;
use crate::reactor::{sd_notify, ChildExit, Reactor};
use crate::vm::read_vm_list;

const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Progress of the startup reconcile.
pub(super) struct Startup {
    /// Pods listed from the API, waiting for the VM list.
    pods: Option<Vec<k8s_openapi::api::core::v1::Pod>>,
    /// The ownership ledger as read at start, handed to the provider with the lists.
    owners: Option<crate::provider::owners::Owners>,
    retry: Backoff,
    attempts: u32,
}

impl Startup {
    pub(super) fn new(owners: crate::provider::owners::Owners) -> Startup {
        Startup {
            pods: None,
            owners: Some(owners),
            retry: Backoff::new(RETRY_FIRST, RETRY_MAX),
            attempts: 0,
        }
    }
}

impl Daemon {
    /// One attempt: list the pods on a lane worker; `startup_pods_listed` goes on from there.
    pub(super) fn startup_step(&mut self) {
        let Some(startup) = self.startup.as_mut() else {
            return;
        };
        startup.attempts += 1;
        let _ = sd_notify::status(&format!(
            "startup reconcile: listing pods and VMs (attempt {})",
            startup.attempts
        ));
        self.list_pods(true);
    }

    /// The startup pod list came back: keep it and start `cocoon vm list`.
    pub(super) fn startup_pods_listed(
        &mut self,
        result: Result<crate::kube::PodList, crate::kube::KubeError>,
    ) {
        let now = self.reactor.now();
        let Some(startup) = self.startup.as_mut() else {
            return;
        };
        match self.watch.relisted(result, now) {
            Ok(out) => {
                let pods = out
                    .into_iter()
                    .filter_map(|o| match o {
                        WatchOutput::Added(p) | WatchOutput::Modified(p) => Some(*p),
                        WatchOutput::Deleted(_) => None,
                    })
                    .collect();
                startup.pods = Some(pods);
            }
            Err(e) => {
                log::warn!("startup reconcile: listing pods failed: {e}");
                return self.startup_retry();
            }
        }
        if let Err(e) = self.spawn_vm_list(ChildRole::StartupList) {
            log::warn!(
                "startup reconcile: cannot run {}: {e}",
                self.config.cocoon_bin.display()
            );
            self.startup_retry();
        }
    }

    /// The `vm list` ended: hand both lists to the provider and bring the node up.
    pub(super) fn startup_listed(&mut self, exit: ChildExit) {
        let result = crate::vm::Answer::of_exit(&super::cocoon_calls::vm_list_call(), &exit);
        let vms = if result.succeeded() {
            read_vm_list(&result.stdout).map_err(|e| e.to_string())
        } else {
            Err(result.error_text())
        };
        let vms = match vms {
            Ok(vms) => vms,
            Err(e) => {
                log::warn!("startup reconcile: cocoon vm list failed: {e}");
                return self.startup_retry();
            }
        };
        let Some(pods) = self.startup.as_mut().and_then(|s| s.pods.take()) else {
            return;
        };
        let owners = self
            .startup
            .as_mut()
            .and_then(|s| s.owners.take())
            .unwrap_or_default();
        log::info!(
            "startup reconcile: {} pods bound to {}, {} VMs on this host",
            pods.len(),
            self.config.node_name,
            vms.len()
        );
        self.startup = None;
        let (n_pods, n_vms) = (pods.len(), vms.len());
        self.pending
            .push_back(Input::StartupListed { pods, vms, owners });
        self.drain_inputs();
        // Register the node now (first NodeAgent tick, on the node thread), then watch and
        // stream events.
        self.node_tick();
        let status = sd_notify::status_line(&format!(
            "serving {} pods bound to {}, {} VMs on this host at start",
            n_pods, self.config.node_name, n_vms
        ));
        let _ = sd_notify::notify(&format!("READY=1\n{status}"));
        self.start_stream();
    }

    fn startup_retry(&mut self) {
        let now = self.reactor.now();
        let Some(startup) = self.startup.as_mut() else {
            return;
        };
        let wait = startup.retry.fail();
        startup.pods = None;
        log::info!(
            "startup reconcile attempt {} failed; retrying in {:?}",
            startup.attempts,
            wait
        );
        let _ = sd_notify::status(&format!(
            "startup reconcile attempt {} failed (see the journal); retrying in {:?}",
            startup.attempts, wait
        ));
        self.arm(OwnTimer::Startup, now + wait);
    }
}

/// VK_ORPHAN_POLICY as the provider knows it.
/// The node's options and capacity (Node object, capacity and allocatable). Errors are fatal.
pub(super) fn node_agent(config: &Config, now: Instant) -> Result<NodeAgent, StartError> {
    let ip = match config.node_ip {
        Some(ip) => ip,
        None => {
            let found = crate::node_ip::detect().ok_or_else(|| {
                StartError::new(
                    1,
                    "VK_NODE_IP is not set and no default route or non-loopback IPv4 address was found",
                )
            })?;
            log::info!("node IP {} ({})", found.ip, found.how);
            found.ip
        }
    };
    let opts = NodeOptions {
        name: config.node_name.clone(),
        ip,
        pool: config.node_pool.clone(),
        snapshot_cpu_class: config.snapshot_cpu_class.clone(),
        provider_id: config.provider_id.clone(),
        kubelet_port: config.kubelet_port,
        version: crate::version::VERSION.to_string(),
        root_dir: config.cocoon_root_dir.clone(),
        reserve_percent: config.reserve_percent,
        cpu: config.node_cpu.clone(),
        mem: config.node_mem.clone(),
        storage: config.node_storage.clone(),
        hugepages: config.node_hugepages.clone(),
        pods: config.node_pods.clone(),
    };
    let host = HostFacts::read(&config.cocoon_root_dir)
        .map_err(|e| StartError::new(1, format!("node capacity: {e}")))?;
    let resources = compute_resources(&opts, &host)
        .map_err(|e| StartError::new(1, format!("node capacity: {e}")))?;
    Ok(NodeAgent::new(opts, resources, now))
}

/// The peer snapshot listener on VK_PEER_ADDR serving VK_COCOON_SNAPSHOT_DIR over TLS (the
/// kubelet's serving certificate; node client certificates of VK_CLIENT_CA_FILE or the
/// kubeconfig's CA, whatever VK_KUBELET_AUTH says), its push record under VK_STATE_DIR, the
/// restore client's identity (the kubeconfig's client certificate) and the VK_STAGING_DIR sweep.
pub(super) fn peer_service(
    config: &Config,
    kube: &Arc<Client>,
) -> Result<crate::peer::housekeeping::PeerService, StartError> {
    let listen = config
        .peer_addr
        .socket_addrs()
        .ok()
        .and_then(|a| a.into_iter().next())
        .ok_or_else(|| {
            StartError::new(1, format!("VK_PEER_ADDR {}: no address", config.peer_addr))
        })?;
    let cluster = kube.cluster();
    let client_ca_pem =
        match &config.client_ca_file {
            Some(p) => Some(std::fs::read(p).map_err(|e| {
                StartError::new(1, format!("VK_CLIENT_CA_FILE {}: {e}", p.display()))
            })?),
            None => cluster.ca_pem.clone(),
        };
    let settings = crate::peer::housekeeping::PeerSettings {
        listen,
        snapshot_dir: config.cocoon_snapshot_dir.clone(),
        staging_dir: config.staging_dir.clone(),
        cocoon_bin: config.cocoon_bin.clone(),
        state_dir: config.state_dir.clone(),
        tls: crate::kubelet::tls::TlsSettings {
            cert_path: config.tls_cert.clone(),
            key_path: config.tls_key.clone(),
            node_name: config.node_name.clone(),
            node_ip: config.node_ip,
            client_ca_pem,
        },
        client_cert: cluster.client_cert.clone(),
    };
    crate::peer::housekeeping::start(settings, kube.clone())
        .map_err(|e| StartError::new(1, e.to_string()))
}

/// The kubelet API server, listening on VK_KUBELET_PORT (HTTPS).
pub(super) fn kubelet_server(
    config: &Config,
    kube: &Arc<Client>,
    node: &NodeOptions,
    stats: StatsHub,
    reactor: &mut Reactor<Work>,
) -> Result<KubeletServer, StartError> {
    let settings =
        crate::kubelet::tls_settings(config, Some(node.ip), kube.cluster().ca_pem.clone())
            .map_err(|e| StartError::new(1, format!("kubelet client CA: {e}")))?;
    let tls =
        TlsState::new(settings).map_err(|e| StartError::new(1, format!("kubelet TLS: {e}")))?;
    if *tls.source() == crate::kubelet::tls::CertSource::SelfSigned {
        log::warn!(
            "kubelet TLS: {} not found; serving a self-signed certificate (kubectl logs/exec through an API server that verifies kubelets will fail)",
            config.tls_cert.display()
        );
    }
    let cfg = KubeletConfig::from_config(config);
    // VK_KUBELET_AUTH=off is warned about loudly by the configuration.
    let mut server = KubeletServer::new(cfg, tls, stats);
    // A node advertised on loopback (the sandbox) is only reachable there: do not listen wider.
    let ip = match config.node_ip {
        Some(ip) if ip.is_loopback() => ip,
        _ => std::net::IpAddr::from([0, 0, 0, 0]),
    };
    let addr = SocketAddr::new(ip, config.kubelet_port);
    let bound = server
        .listen(reactor, addr)
        .map_err(|e| StartError::new(1, format!("kubelet API listener on {addr}: {e}")))?;
    log::info!("kubelet API listening on https://{bound}");
    Ok(server)
}

/// Sets `certificate_expiry_timestamp_seconds{certificate="kube-client"}` from the client
/// certificate the API client presents (none with token credentials: no series then).
pub(super) fn export_kube_client_expiry(metrics: &crate::metrics::Metrics, kube: &Client) {
    let not_after = kube.client_cert_pem().and_then(|pem| {
        use rustls::pki_types::{pem::PemObject, CertificateDer};
        let der = CertificateDer::pem_slice_iter(&pem).next()?.ok()?;
        crate::kubelet::tls::cert_not_after(&der)
    });
    if let Some(at) = not_after {
        crate::kubelet::server::set_expiry(metrics, crate::metrics::families::CERT_KUBE_CLIENT, at);
    }
}
