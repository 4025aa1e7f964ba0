//! vk-cocoon: a virtual kubelet that turns Kubernetes pods into cocoon MicroVMs.
//! The module map follows the design notes (one room per concern); `daemon` is where they meet.

pub mod backoff;
pub mod check;
pub mod config;
pub mod daemon;
pub mod guest;
pub mod http_client;
pub mod kube;
pub mod kubelet;
pub mod logging;
pub mod metrics;
pub mod network;
pub mod node;
pub mod node_ip;
pub mod peer;
pub mod percent;
pub mod probes;
pub mod provider;
pub mod reactor;
pub mod rfc3339;
// Tests and the vk-cocoon-sandbox binary only: the daemon build leaves it out.
#[cfg(feature = "sandbox")]
pub mod sandbox;
pub mod snapshots;
pub mod version;
pub mod vm;
pub mod wall_clock;
