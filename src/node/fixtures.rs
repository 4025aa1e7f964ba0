//! Test fixtures shared by the node room's unit tests: options, host facts, lookups.
//! Compiled for tests only.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{HostFacts, NodeOptions};

pub(super) fn opts() -> NodeOptions {
    NodeOptions {
        name: "cocoon-pool".into(),
        ip: "10.0.0.5".parse().unwrap(),
        pool: "gpu".into(),
        snapshot_cpu_class: Some("icelake".into()),
        provider_id: Some("cocoon://h1".into()),
        kubelet_port: 10250,
        version: "dev".into(),
        root_dir: PathBuf::from("/"),
        reserve_percent: 20,
        cpu: None,
        mem: None,
        storage: None,
        hugepages: None,
        pods: "256".into(),
    }
}

pub(super) fn host() -> HostFacts {
    HostFacts {
        cpus: 16,
        mem_total_bytes: 64 << 30,
        hugepages_total: 512,
        hugepage_size_bytes: 2 << 20,
        fs_total_bytes: 1000,
        fs_avail_bytes: 500,
    }
}

pub(super) fn get(m: &BTreeMap<String, Quantity>, k: &str) -> String {
    m.get(k).map(|q| q.0.clone()).unwrap_or_default()
}
