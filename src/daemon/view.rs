//! The facts the kubelet API serves: every tracked pod with its VM, rebuilt from the provider
//! after a turn that changed something.

use super::Daemon;
use crate::kubelet::{KubeletView, PodInfo, PodVm};
use crate::provider::PodKey;

impl Daemon {
    pub(super) fn kubelet_view(&self) -> KubeletView {
        let mut pods: Vec<PodInfo> = self
            .provider
            .pods()
            .into_iter()
            .map(|(pod, status)| {
                let key = PodKey::of(&pod);
                let vm = self.provider.pod_vm(&key).map(|vm| PodVm {
                    id: vm.id.clone(),
                    name: vm.name.clone(),
                    pid: u32::try_from(vm.pid).unwrap_or(0),
                    tap: vm
                        .nics
                        .first()
                        .map(|n| n.tap.clone())
                        .filter(|t| !t.is_empty()),
                    backend: vm.hypervisor.clone(),
                    disk: vm.disk.clone(),
                });
                PodInfo {
                    namespace: key.namespace,
                    name: key.name,
                    uid: pod.metadata.uid.clone().unwrap_or_default(),
                    vm,
                    pod,
                    status: Some(status),
                }
            })
            .collect();
        drop_shared_vms(&mut pods);
        KubeletView { pods }
    }
}

/// Ownership, checked once more where exec and logs find their VM: a VM listed for more than
/// one pod is served to none of them (the provider refuses such pods, so this is a bug guard
/// that fails closed).
fn drop_shared_vms(pods: &mut [PodInfo]) {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    for p in pods.iter() {
        if let Some(vm) = p.vm.as_ref().filter(|v| !v.id.is_empty()) {
            *seen.entry(vm.id.clone()).or_insert(0) += 1;
        }
    }
    for p in pods.iter_mut() {
        let shared =
            p.vm.as_ref()
                .is_some_and(|vm| seen.get(&vm.id).is_some_and(|n| *n > 1));
        if shared {
            log::error!(
                "kubelet view: vm {} is listed for more than one pod; not serving it for {}/{}",
                p.vm.as_ref().map(|v| v.id.as_str()).unwrap_or(""),
                p.namespace,
                p.name
            );
            p.vm = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn pod(ns: &str, name: &str, vm_id: &str) -> PodInfo {
        PodInfo {
            namespace: ns.into(),
            name: name.into(),
            uid: name.into(),
            vm: Some(PodVm {
                id: vm_id.into(),
                name: format!("vk-{ns}-{name}"),
                pid: 0,
                tap: None,
                backend: String::new(),
                disk: String::new(),
            }),
            pod: Arc::new(Default::default()),
            status: None,
        }
    }

    #[test]
    fn a_vm_listed_for_two_pods_is_served_to_neither() {
        let mut pods = vec![
            pod("default", "victim", "VM1"),
            pod("evil", "attacker", "VM1"),
            pod("default", "other", "VM2"),
        ];
        drop_shared_vms(&mut pods);
        assert!(pods[0].vm.is_none() && pods[1].vm.is_none());
        assert_eq!(pods[2].vm.as_ref().map(|v| v.id.as_str()), Some("VM2"));
    }
}
