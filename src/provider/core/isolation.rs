//! Tenant isolation: the VM name a pod gives must be one of its own namespace's operator names,
//! a tracked pod keeps the VM name it has, and a cocoon answer to a lookup by a pod's value
//! counts only when it is that very object. Refusals fail the pod for good and run nothing.

use super::*;
use crate::provider::cocoon::SnapshotInfo;
use crate::provider::naming;

/// `pod_lifecycle_total` reason and Warning of a pod whose VM name is not its namespace's.
pub(super) const REASON_VM_NOT_IN_NS: &str = "vm_not_in_namespace";
pub(super) const EVENT_VM_NOT_IN_NS: &str = "VMNotInNamespace";
/// A pod whose VM reference (an unmanaged pod's id) does not name its VM exactly.
pub(super) const REASON_VM_REFERENCE: &str = "vm_reference_mismatch";
pub(super) const EVENT_VM_REFERENCE: &str = "VMReferenceMismatch";
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

/// Whether a `vm inspect` answer is the VM of name `vm_name`: cocoon resolves a reference as an
/// exact ID, an exact name or an ID prefix of 3+ characters, so an answer to a lookup by name
/// may be another VM whose ID starts with that name.
pub(super) fn vm_named(vm: &VmInfo, vm_name: &str) -> bool {
    !vm_name.is_empty() && vm.name == vm_name
}

/// Whether a `vm inspect <id>` answer is VM `id` exactly and carries the pod's VM name: an ID a
/// pod gives finds a VM only when that VM is the pod's own by name.
pub(super) fn vm_is(vm: &VmInfo, id: &str, vm_name: &str) -> bool {
    !id.is_empty() && vm.id == id && vm_named(vm, vm_name)
}

/// Whether a `snapshot inspect <name>` answer is that snapshot (by exact name or exact ID).
pub(super) fn snapshot_is(s: &SnapshotInfo, name: &str) -> bool {
    !name.is_empty() && (s.name == name || s.id == name)
}

/// A successful `snapshot inspect <name>` answer read and held to the name: Ok(Some) for that
/// very snapshot, Ok(None) for another one (an ID-prefix match, as good as not found), Err
/// when it does not parse.
pub(super) fn inspected_snapshot(
    r: &CocoonResult,
    name: &str,
) -> Result<Option<SnapshotInfo>, String> {
    parse_snapshot(&r.stdout).map(|s| snapshot_is(&s, name).then_some(s))
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

    /// A create refused for good once it is under way: Warning `event`, the counter with
    /// `reason`, lifecycle and status Failed, the pod left untracked (retried only when it
    /// changes). Nothing more runs for it.
    pub(super) fn refuse_create(
        &mut self,
        key: &PodKey,
        event: &'static str,
        reason: &'static str,
        message: String,
    ) {
        let Some(pod) = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .map(|t| t.pod.clone())
        else {
            return;
        };
        self.set_lifecycle(key, State::Failed, &message);
        {
            let slot = self.slot(key);
            slot.tracked = None;
            slot.op = None;
            slot.awaiting = None;
            slot.timer = None;
        }
        let e = SpecError { reason, message };
        self.reject_as(key, &pod, event, e, true);
        self.reconcile_slot(key);
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
