//! The peer service as the daemon runs it: the listener with its node-address allowlist kept
//! fresh from the Node list, the snapshot-name resolver backed by `cocoon snapshot inspect`,
//! and the staging sweep at start and on a timer.
//!
//! One background thread lists Nodes and sweeps; the listener has its own threads.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::kube::Client;
use crate::vm::argv;

use super::server::{AllowedPeers, PeerServer, Resolver};
use super::staging;
use super::wire::plain_component;

/// How often the Node list is re-read for the allowlist and the address book.
pub const NODE_REFRESH: Duration = Duration::from_secs(30);
/// The wait before listing again after a failed list.
const NODE_RETRY: Duration = Duration::from_secs(2);

/// Node name → InternalIP, as last listed.
#[derive(Debug, Default)]
pub struct NodeBook(RwLock<HashMap<String, IpAddr>>);

impl NodeBook {
    pub fn internal_ip(&self, node: &str) -> Option<IpAddr> {
        self.0.read().ok()?.get(node).copied()
    }
    fn replace(&self, m: HashMap<String, IpAddr>) {
        if let Ok(mut g) = self.0.write() {
            *g = m;
        }
    }
}

/// What the daemon keeps of the running peer service.
pub struct PeerService {
    pub server: PeerServer,
    pub nodes: Arc<NodeBook>,
}

/// What the service needs from the configuration.
#[derive(Debug, Clone)]
pub struct PeerSettings {
    pub listen: SocketAddr,
    pub snapshot_dir: PathBuf,
    pub staging_dir: PathBuf,
    pub cocoon_bin: PathBuf,
}

/// Starts the listener and the background thread (first Node list and staging sweep at once).
pub fn start(settings: PeerSettings, kube: Arc<Client>) -> std::io::Result<PeerService> {
    let allowed = Arc::new(AllowedPeers::default());
    let nodes = Arc::new(NodeBook::default());
    let server = PeerServer::start(
        settings.listen,
        settings.snapshot_dir.clone(),
        allowed.clone(),
        cocoon_resolver(settings.cocoon_bin.clone()),
    )?;
    let book = nodes.clone();
    let staging_dir = settings.staging_dir.clone();
    std::thread::Builder::new()
        .name("vk-peer-house".into())
        .spawn(move || background(kube, allowed, book, staging_dir))?;
    Ok(PeerService { server, nodes })
}

fn background(
    kube: Arc<Client>,
    allowed: Arc<AllowedPeers>,
    book: Arc<NodeBook>,
    staging_dir: PathBuf,
) {
    let mut sweeper = staging::Sweeper::default();
    sweeper.sweep(&staging_dir, crate::wall_clock::now(), Instant::now());
    let mut next_sweep = Instant::now() + staging::SWEEP_EVERY;
    let mut logged_error = false;
    loop {
        // A failed list is retried soon: until the first one lands no peer is answered.
        let pause = match kube.list_node_addresses() {
            Ok(list) => {
                let m: HashMap<String, IpAddr> = list
                    .into_iter()
                    .filter_map(|(n, ip)| Some((n, ip?)))
                    .collect();
                allowed.replace(m.values().copied());
                book.replace(m);
                logged_error = false;
                NODE_REFRESH
            }
            // The previous allowlist stays: a flapping API server must not open the listener.
            Err(e) => {
                if !logged_error {
                    log::warn!("peer listener: listing nodes: {e}");
                    logged_error = true;
                }
                NODE_RETRY
            }
        };
        if Instant::now() >= next_sweep {
            sweeper.sweep(&staging_dir, crate::wall_clock::now(), Instant::now());
            next_sweep = Instant::now() + staging::SWEEP_EVERY;
        }
        std::thread::sleep(pause);
    }
}

/// Resolves a snapshot name to its id with `cocoon snapshot inspect NAME` (argv, no shell),
/// killed at the `query` deadline.
pub fn cocoon_resolver(bin: PathBuf) -> Resolver {
    Arc::new(move |name: &str| inspect_id(&bin, name))
}

fn inspect_id(bin: &std::path::Path, name: &str) -> Result<Option<String>, String> {
    let done = crate::snapshots::cocoon_child::run(
        bin,
        crate::vm::Verb::SnapshotInspect,
        &argv::snapshot_inspect(name),
    )?;
    if done.not_found(crate::vm::Verb::SnapshotInspect) {
        return Ok(None);
    }
    if !done.success {
        return Err(format!("snapshot inspect {name}: {}", done.error_text()));
    }
    let out = done.stdout;
    let v: serde_json::Value =
        serde_json::from_slice(&out).map_err(|e| format!("snapshot inspect {name}: {e}"))?;
    match v.get("id").and_then(|i| i.as_str()) {
        Some(id) if plain_component(id) => Ok(Some(id.to_string())),
        _ => Err(format!("snapshot inspect {name}: no usable id")),
    }
}
