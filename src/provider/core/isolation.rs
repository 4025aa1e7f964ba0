//! Tenant isolation: the VM name a pod gives must be one of its own namespace's operator names,
//! and a tracked pod keeps the VM name it has. Refusals fail the pod for good and run nothing.

use super::*;
use crate::provider::naming;

/// `pod_lifecycle_total` reason and Warning of a pod whose VM name is not its namespace's.
pub(super) const REASON_VM_NOT_IN_NS: &str = "vm_not_in_namespace";
pub(super) const EVENT_VM_NOT_IN_NS: &str = "VMNotInNamespace";
/// An update that renames a tracked pod's VM.
pub(super) const REASON_VM_NAME_CHANGED: &str = "vm_name_changed";
pub(super) const EVENT_VM_NAME_CHANGED: &str = "VMNameChangeRefused";

/// Why `vm_name` cannot be a VM of pod `key`, if it cannot: it must be a cocoon VM name and an
/// operator name that may belong to the pod's namespace (`naming::owner(..).admits(ns)`). A
/// VM name is then never a base image's snapshot name, nor another namespace's VM.
pub(super) fn vm_name_refusal(key: &PodKey, vm_name: &str) -> Option<String> {
    let ns = &key.namespace;
    if !naming::valid_vm_name(vm_name) {
        return Some(format!(
            "pod {key}: {} {vm_name:?} is not a cocoon VM name (letters, digits, '.', '_', '-', \
             at most {} characters, starting with a letter or digit)",
            spec::ANN_VM_NAME,
            naming::NAME_MAX
        ));
    }
    if !naming::owner(vm_name, &[&key.name]).admits(ns) {
        return Some(format!(
            "pod {key}: vm {vm_name} is not a VM name of namespace {ns}: a pod's VM is named \
             vk-{ns}-<pod>, vk-{ns}.<pod> or vk-{ns}-<pod>-<hash>"
        ));
    }
    None
}

impl Provider {
    /// Rule 1 at create: a pod whose VM name its namespace cannot own is refused before
    /// anything is tracked or run.
    pub(super) fn refuse_vm_name(&mut self, key: &PodKey, pod: &Arc<Pod>, message: String) {
        let e = SpecError {
            reason: REASON_VM_NOT_IN_NS,
            message,
        };
        self.reject_as(key, pod, EVENT_VM_NOT_IN_NS, e, true)
    }

    /// Rule 2 at update: the VM name stays the tracked one. A change is reported (Warning,
    /// counter) once per changed copy: the tracked copy then carries the changed annotation.
    pub(super) fn keep_vm_name(&mut self, key: &PodKey, uid: &str, tracked: &str, asked: &str) {
        if tracked == asked {
            return;
        }
        self.lifecycle_metric("update", "failed", REASON_VM_NAME_CHANGED);
        self.event(
            key,
            uid,
            EventType::Warning,
            EVENT_VM_NAME_CHANGED,
            &format!(
                "update: {} changed from {tracked} to {asked}: a pod keeps the VM it has, the \
                 change is ignored (re-create the pod to use another VM)",
                spec::ANN_VM_NAME
            ),
        );
    }
}
