//! One peer restore as the daemon performs it for the core: find the source node's InternalIP,
//! read the registry's description of `<vm>:hibernate` (its manifest digest is what the source
//! node serves to), and fetch from that node over TLS into staging.
//!
//! Blocking; runs on a transfer worker. The answer is the staged directory for
//! `cocoon vm clone --from-dir`, or an error after which the core falls back to the registry.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use crate::metrics::Metrics;
use crate::snapshots::{manifest_info, RegistryClient, TransferError};

use super::client::{restore_counted, PeerRestore};
use super::nodes::ClusterNodes;

/// The registry tag a peer restore stands in for.
pub const HIBERNATE_TAG: &str = "hibernate";

/// What the core asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerJob {
    /// The pod's namespace (the duration histogram's label).
    pub namespace: String,
    /// The VM name: registry repository and the snapshot name on the source node.
    pub vm_name: String,
    /// `cocoonstack.snapshot.from-node` of the hibernate manifest.
    pub from_node: String,
    /// The name written into the staged envelope.
    pub local_name: String,
}

/// What the daemon adds from its configuration.
#[derive(Debug, Clone)]
pub struct PeerSite {
    pub node_name: String,
    pub node_ip: Option<IpAddr>,
    /// The port of VK_PEER_ADDR: every node's listener is dialled on it.
    pub peer_port: u16,
    pub staging_root: PathBuf,
    /// TLS with the kubeconfig's client certificate; None (a token kubeconfig): no peer
    /// restores, every wake pulls from the registry.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// Why a node without a client certificate never restores from a peer.
pub const NO_CLIENT_CERT: &str =
    "skipped: the kubeconfig has no client certificate to present to the peer listener";

/// Runs `job`; `Ok` carries the staged directory.
pub fn run(
    job: &PeerJob,
    site: &PeerSite,
    registry: &RegistryClient,
    nodes: &ClusterNodes,
    metrics: &Metrics,
) -> Result<PathBuf, TransferError> {
    let fail =
        |m: String| TransferError::Transient(format!("peer restore of {}: {m}", job.vm_name));
    if job.from_node.is_empty() || job.from_node == site.node_name {
        return Err(fail("the snapshot was pushed by this node".into()));
    }
    let Some(tls) = site.tls.clone() else {
        return Err(fail(NO_CLIENT_CERT.into()));
    };
    // From here on it is an attempt: a failure before the transfer counts as one too.
    let req = match plan(job, site, registry, nodes, tls) {
        Ok(req) => req,
        Err(e) => {
            metrics
                .snapshot_peer_restore_total
                .with_label_values(&["failed"])
                .inc();
            return Err(e);
        }
    };
    let staged = restore_counted(&req, metrics, &job.namespace).map_err(|e| fail(e.to_string()))?;
    log::info!(
        "peer restore of {} from {} ({}): {} bytes staged in {}",
        job.vm_name,
        job.from_node,
        req.peer.ip(),
        staged.bytes,
        staged.dir.display()
    );
    Ok(staged.dir)
}

/// Where and what to fetch: the pushing node's InternalIP and the tag's manifest, whose layer
/// digests every byte is checked against.
fn plan(
    job: &PeerJob,
    site: &PeerSite,
    registry: &RegistryClient,
    nodes: &ClusterNodes,
    tls: Arc<rustls::ClientConfig>,
) -> Result<PeerRestore, TransferError> {
    let fail =
        |m: String| TransferError::Transient(format!("peer restore of {}: {m}", job.vm_name));
    let ip = nodes
        .internal_ip(&job.from_node)
        .ok_or_else(|| fail(format!("node {}: unknown or no InternalIP", job.from_node)))?;
    let info = manifest_info(registry, &job.vm_name, HIBERNATE_TAG)?
        .ok_or_else(|| TransferError::NotFound(format!("{}:{HIBERNATE_TAG}", job.vm_name)))?;
    let expected = info
        .config
        .ok_or_else(|| fail(format!("{}:{HIBERNATE_TAG} is not a snapshot", job.vm_name)))?;
    Ok(PeerRestore {
        peer: SocketAddr::new(ip, site.peer_port),
        source: site.node_ip,
        snapshot: job.vm_name.clone(),
        local_name: job.local_name.clone(),
        expected,
        layers: info.layers,
        manifest_digest: info.digest,
        tls,
        staging_root: site.staging_root.clone(),
        streams: super::client::SLICE_STREAMS,
    })
}
