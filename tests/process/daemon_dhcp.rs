//! Process tier in DHCP mode: the fake cocoon plays cocoon-net (lease file at the daemon's
//! VK_LEASES_PATH), so a clone pod's IP must come from the lease and the pod must turn Ready.

use crate::daemon_support;

use daemon_support::{annotation, World, SETTLE_LIMIT};
use vk_cocoon::network::leases::LeaseFile;

fn ready(p: &k8s_openapi::api::core::v1::Pod) -> bool {
    let st = p.status.as_ref();
    let cond = st
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let agent = st
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.name == "agent" && c.ready));
    cond && agent
}

#[test]
fn a_dhcp_clone_pod_gets_the_lease_ip_and_becomes_ready() {
    let mut w = World::dhcp();
    let leases = w.path("net/leases.json");
    let (_, id) = w.run_web_pod();
    let pod = w.wait("pod web Ready", SETTLE_LIMIT, || w.pod("web").filter(ready));
    let (ok, out) = w.cocoon(&["vm", "inspect", &id]);
    assert!(ok, "{out}");
    let vm: serde_json::Value = serde_json::from_str(&out).expect("inspect JSON");
    let mac = vm["network_configs"][0]["mac"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(vm["network_configs"][0]["network"].is_null(), "DHCP NIC");
    let lease = LeaseFile::new(&leases)
        .lookup(&mac, std::time::SystemTime::now())
        .expect("lease file parses")
        .expect("lease for the VM's MAC");
    let ip = lease.ip.to_string();
    assert!(ip.starts_with("127.88."));
    assert_eq!(
        annotation(&pod, "vm.cocoonstack.io/ip").as_deref(),
        Some(ip.as_str())
    );
    assert_eq!(
        pod.status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .as_deref(),
        Some(ip.as_str())
    );
}
