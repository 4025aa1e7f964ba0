//! The facts the kubelet API serves: every tracked pod with its VM, rebuilt from the provider
//! after a turn that changed something.

use super::Daemon;
use crate::kubelet::{KubeletView, PodInfo, VmInfo};
use crate::provider::PodKey;

impl Daemon {
    pub(super) fn kubelet_view(&self) -> KubeletView {
        let pods = self
            .provider
            .pods()
            .into_iter()
            .map(|(pod, status)| {
                let key = PodKey::of(&pod);
                let vm = self.provider.pod_vm(&key).map(|vm| VmInfo {
                    id: vm.id.clone(),
                    name: vm.name.clone(),
                    pid: u32::try_from(vm.pid).unwrap_or(0),
                    tap: vm
                        .nics
                        .first()
                        .map(|n| n.tap.clone())
                        .filter(|t| !t.is_empty()),
                    backend: vm.hypervisor.clone(),
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
        KubeletView { pods }
    }
}
