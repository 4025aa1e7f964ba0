//! The peer service as the daemon runs it: the TLS listener with its Node lookups, the record
//! of this node's pushes (pruned of snapshots that are gone), the snapshot-name resolver backed
//! by `cocoon snapshot inspect`, the restore client's TLS identity, and the staging sweep at
//! start and on a timer. One background thread prunes and sweeps; Nodes are looked up one at a
//! time when a peer needs one (see `nodes.rs`), never listed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::kube::Client;
use crate::kubelet::tls::{TlsError, TlsSettings, TlsState};
use crate::vm::{argv, parse_snapshot, CocoonCall, Deadlines, Verb};

use super::nodes::{api_lookup, ClusterNodes};
use super::pushed::PushedSnapshots;
use super::server::{PeerServer, Resolver, Serving, NODE_GROUPS, NODE_USER_PREFIX};
use super::staging;
use super::wire::plain_component;

/// How often the push record is pruned of snapshots that are gone.
pub const PRUNE_EVERY: Duration = Duration::from_secs(30);

/// What the daemon keeps of the running peer service.
pub struct PeerService {
    /// None: no CA to verify node client certificates, so nothing is served.
    pub server: Option<PeerServer>,
    pub nodes: Arc<ClusterNodes>,
    /// Where a finished push records its manifest digest.
    pub pushed: Arc<PushedSnapshots>,
    /// The restore client's TLS (the kubeconfig's client certificate); None: no restores.
    pub client_tls: Option<Arc<rustls::ClientConfig>>,
}

/// What the service needs from the configuration.
#[derive(Debug, Clone)]
pub struct PeerSettings {
    pub listen: SocketAddr,
    pub snapshot_dir: PathBuf,
    pub staging_dir: PathBuf,
    pub cocoon_bin: PathBuf,
    /// `VK_STATE_DIR`: the push record lives there.
    pub state_dir: PathBuf,
    /// The kubelet's serving certificate and the cluster CA (`client_ca_pem`; None: the
    /// listener is not started).
    pub tls: TlsSettings,
    /// The kubeconfig's client certificate and key (PEM).
    pub client_cert: Option<(Vec<u8>, Vec<u8>)>,
}

/// Why the peer listener did not start (the daemon exits with it).
#[derive(Debug)]
pub enum PeerStartError {
    /// The TLS settings requiring node client certificates are unusable.
    Tls(TlsError),
    /// Binding the listen address failed.
    Listen(SocketAddr, std::io::Error),
    /// The housekeeping thread could not be spawned.
    Thread(std::io::Error),
}

impl std::fmt::Display for PeerStartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerStartError::Tls(e) => write!(f, "peer listener TLS: {e}"),
            PeerStartError::Listen(addr, e) => write!(f, "peer snapshot listener on {addr}: {e}"),
            PeerStartError::Thread(e) => write!(f, "peer housekeeping thread: {e}"),
        }
    }
}

impl std::error::Error for PeerStartError {}

/// Starts the listener and the background thread (first prune and staging sweep at once),
/// logging what the listener serves to whom, or why it serves nothing, and whether this
/// node restores from peers.
pub fn start(settings: PeerSettings, kube: Arc<Client>) -> Result<PeerService, PeerStartError> {
    let nodes = Arc::new(ClusterNodes::new(api_lookup(kube)));
    let pushed = Arc::new(match PushedSnapshots::open(&settings.state_dir) {
        Ok(p) => p,
        Err(e) => {
            log::warn!(
                "VK_STATE_DIR {}: {e}; pushes are recorded in memory only, so after a restart peers get nothing until the next push",
                settings.state_dir.display()
            );
            PushedSnapshots::in_memory()
        }
    });
    let server = match settings.tls.client_ca_pem {
        None => {
            log::warn!(
                "peer snapshot listener off: no CA to verify node client certificates (the kubeconfig names none; set VK_CLIENT_CA_FILE); peers restore from the registry"
            );
            None
        }
        Some(_) => {
            let tls = TlsState::requiring_client_certs(settings.tls.clone())
                .map_err(PeerStartError::Tls)?;
            let serving = Serving {
                root: settings.snapshot_dir.clone(),
                resolve: cocoon_resolver(settings.cocoon_bin.clone()),
                pushed: pushed.clone(),
                nodes: nodes.clone(),
                tls,
            };
            let server = PeerServer::start(settings.listen, serving)
                .map_err(|e| PeerStartError::Listen(settings.listen, e))?;
            log::info!(
                "peer snapshot listener on https://{} serving {}: TLS only (plain HTTP gets 400); a caller needs a client certificate of the cluster CA with CN {NODE_USER_PREFIX}<node> and O one of {NODE_GROUPS:?}, from that Node's InternalIP, and the manifest digest this node recorded when it pushed the snapshot ({} recorded)",
                server.local_addr(),
                settings.snapshot_dir.display(),
                pushed.len()
            );
            Some(server)
        }
    };
    let client_tls = match &settings.client_cert {
        Some((cert, key)) => match super::client::client_tls(cert, key) {
            Ok(c) => Some(c),
            Err(e) => {
                log::warn!("peer restore off: {e}; wakes pull from the registry");
                None
            }
        },
        None => {
            log::warn!("peer restore off: the kubeconfig has no client certificate to present to peer listeners; wakes pull from the registry");
            None
        }
    };
    let record = pushed.clone();
    let (staging_dir, snapshot_dir) = (settings.staging_dir, settings.snapshot_dir);
    std::thread::Builder::new()
        .name("vk-peer-house".into())
        .spawn(move || background(record, staging_dir, snapshot_dir))
        .map_err(PeerStartError::Thread)?;
    Ok(PeerService {
        server,
        nodes,
        pushed,
        client_tls,
    })
}

fn background(pushed: Arc<PushedSnapshots>, staging_dir: PathBuf, snapshot_dir: PathBuf) {
    let mut sweeper = staging::Sweeper::default();
    sweeper.sweep(&staging_dir, crate::wall_clock::now(), Instant::now());
    let mut next_sweep = Instant::now() + staging::SWEEP_EVERY;
    loop {
        prune_gone(&pushed, &snapshot_dir);
        if Instant::now() >= next_sweep {
            sweeper.sweep(&staging_dir, crate::wall_clock::now(), Instant::now());
            next_sweep = Instant::now() + staging::SWEEP_EVERY;
        }
        std::thread::sleep(PRUNE_EVERY);
    }
}

/// Drops the records of snapshots whose directory is gone (removed, or replaced under a new
/// id): they can never be served again.
pub fn prune_gone(pushed: &PushedSnapshots, snapshot_dir: &Path) {
    // An unreadable snapshot directory says nothing about its entries: keep every record.
    if !snapshot_dir.is_dir() {
        return;
    }
    let r = pushed
        .retain(|p| plain_component(&p.snapshot_id) && snapshot_dir.join(&p.snapshot_id).is_dir());
    if let Err(e) = r {
        log::warn!("peer push record: {e}");
    }
}

/// Resolves a snapshot name to its id with `cocoon snapshot inspect NAME` (argv, no shell),
/// killed at the `query` deadline.
pub fn cocoon_resolver(bin: PathBuf) -> Resolver {
    Arc::new(move |name: &str| inspect_id(&bin, name))
}

fn inspect_id(bin: &std::path::Path, name: &str) -> Result<Option<String>, String> {
    let call = CocoonCall::new(
        Verb::SnapshotInspect,
        argv::snapshot_inspect(name),
        &Deadlines::configured(),
    );
    let found = crate::vm::blocking::run(bin, &call).and_then(|out| parse_snapshot(&call, &out));
    match found {
        Ok(s) if plain_component(&s.id) => Ok(Some(s.id)),
        Ok(_) => Err(format!("snapshot inspect {name}: no usable id")),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}
