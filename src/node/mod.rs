//! The virtual Node object: labels, taints, capacity and allocatable, Lease heartbeat, node status.
//! Builds objects and schedules; the API calls go through kube.
//!
//! resources: quantities and capacity; object: the Node and its patches; lease: the Lease
//! heartbeat object; agent: registration, renewals and status refreshes on a schedule.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

mod agent;
#[cfg(test)]
mod fixtures;
mod lease;
mod object;
mod resources;

pub use agent::{NodeAgent, NodeAgentStats};
pub use lease::{build_lease, renew_lease};
pub use object::{
    api_micro_time, api_time, build_node, node_conditions, node_labels, node_patch, node_status,
    status_patch,
};
pub use resources::{
    binary_quantity, compute_resources, parse_quantity, storage_allocatable, CapacityError,
    HostFacts, HostFactsError, NotAQuantity, Resources,
};

pub const LEASE_NAMESPACE: &str = "kube-node-lease";
pub const LEASE_DURATION_SECONDS: i32 = 40;
pub const LEASE_RENEW: Duration = Duration::from_secs(10);
pub const STATUS_INTERVAL: Duration = Duration::from_secs(60);
/// How often the storage allocatable is recomputed from statfs(`COCOON_ROOT_DIR`).
pub const STORAGE_REFRESH: Duration = Duration::from_secs(60);
pub const TAINT_KEY: &str = "virtual-kubelet.io/provider";
pub const POOL_LABEL: &str = "cocoonstack.io/pool";
pub const CPU_CLASS_LABEL: &str = "cocoonstack.io/snapshot-cpu-class";
pub const ROLE_LABEL: &str = "node-role.kubernetes.io/cocoon-vm";

/// Node settings, already parsed and validated by config.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub name: String,
    /// VK_NODE_IP, or `node_ip::detect()` when it is `auto`.
    pub ip: IpAddr,
    pub pool: String,
    pub snapshot_cpu_class: Option<String>,
    pub provider_id: Option<String>,
    pub kubelet_port: u16,
    /// nodeInfo.kubeletVersion (build version, `dev` when not injected).
    pub version: String,
    pub root_dir: PathBuf,
    pub reserve_percent: u8,
    /// VK_NODE_* overrides as Kubernetes quantity strings.
    pub cpu: Option<String>,
    pub mem: Option<String>,
    pub storage: Option<String>,
    pub hugepages: Option<String>,
    pub pods: String,
}
