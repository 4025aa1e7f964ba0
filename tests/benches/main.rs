//! Benchmarks: every test here is ignored and prints its figures; run one module at a time on a
//! quiet machine (`cargo test --release --test benches daemon_bench -- --ignored --nocapture`).
//!
//! One test binary for all of them, so the library is linked once rather than once per file;
//! each module keeps the name its file had, which prefixes its tests' names. The README's
//! benchmark table has the command of each.

#[path = "../support/daemon_support.rs"]
mod daemon_support;
#[path = "../support/fleet_support.rs"]
mod fleet_support;
#[path = "../support/kubelet_support.rs"]
mod kubelet_support;
#[path = "../support/load_support.rs"]
mod load_support;
#[path = "../support/registry_support.rs"]
mod registry_support;

mod daemon_bench;
mod fleet_bench;
mod hibernate_bench;
mod kube_bench;
mod peer_bench;
mod probes_bench;
mod snapshots_bench;
mod stats_bench;
mod vm_bench;
