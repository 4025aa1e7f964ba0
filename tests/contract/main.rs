//! Contract tests: each module checks one room of the library in this process (the cocoon CLI
//! contract, the fake API server and fake cocoon, kube client, kubelet API, network, probes, ...).
//!
//! One test binary for all of them, so the library is linked once rather than once per file;
//! each module keeps the name its file had, which prefixes its tests' names
//! (`cargo test --test contract kube_client::` runs one file's tests).

#[path = "../support/kubelet_support.rs"]
mod kubelet_support;
#[path = "../support/load_support.rs"]
mod load_support;
#[path = "../support/peer_support.rs"]
mod peer_support;
#[path = "../support/probes_support.rs"]
mod probes_support;
#[path = "../support/registry_support.rs"]
mod registry_support;

mod apiserver;
mod apiserver_kubectl;
mod fake_cocoon;
mod fake_cocoon_dhcp;
mod guest_sac;
mod kube_client;
mod kube_watch;
mod kube_watch_fleet;
mod kubelet_api;
mod kubelet_exec;
mod kubelet_fake_cocoon;
mod kubelet_floods;
mod kubelet_metrics;
mod kubelet_portforward;
mod network_icmp;
mod network_leases;
mod network_release;
mod node_agent;
mod peer_transfer;
mod probes_engine;
mod probes_schedule;
mod reactor;
mod reactor_parent_death;
mod snapshots_registry;
mod stats_proc;
mod vm_contract;
mod vm_reactor;
