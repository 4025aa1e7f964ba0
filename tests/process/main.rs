//! Process tests: each module runs the real binaries (`vk-cocoon`, and `vk-cocoon-sandbox` as the
//! fake cocoon) against the fake API server, a real registry on loopback and test namespaces.
//!
//! One test binary for all of them, so the library is linked once rather than once per file;
//! each module keeps the name its file had, which prefixes its tests' names
//! (`cargo test --test process daemon_fork::` runs one file's tests).
//!
//! No limit of its own on daemons at once: libtest runs as many tests at a time as the machine
//! has cores, as it did in each file's binary before, so as many worlds (API server, registry,
//! daemon) run side by side as before; the files just no longer wait for each other.

#[path = "../support/daemon_support.rs"]
mod daemon_support;
#[path = "../support/load_support.rs"]
mod load_support;
#[path = "../support/peer_support.rs"]
mod peer_support;
#[path = "../support/registry_support.rs"]
mod registry_support;

mod binary;
mod binary_packaging;
mod check_config;
mod config_exit_codes;
mod daemon_apiserver_restart;
mod daemon_argv;
mod daemon_auth_flood;
mod daemon_clock;
mod daemon_cpu_class;
mod daemon_dhcp;
mod daemon_fork;
mod daemon_full_disk;
mod daemon_hibernate;
mod daemon_isolation;
mod daemon_kubelet_metrics;
mod daemon_macos;
mod daemon_node_labels;
mod daemon_ownership;
mod daemon_post_clone;
mod daemon_process;
mod daemon_registry_lost;
mod daemon_snapshot_paths;
mod daemon_sources;
mod daemon_transfers;
mod daemon_wedged;
mod peer_process;
mod peer_two_daemons;
mod rbac_coverage;
mod sandbox_binary;
mod sandbox_kubectl;
