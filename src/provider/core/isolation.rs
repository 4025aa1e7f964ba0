//! Tenant isolation: the VM name a pod gives must be one of its own namespace's operator names,
//! a tracked pod keeps the VM name it has, a cocoon answer to a lookup by a pod's value counts
//! only when it is that very object, and a VM or VM snapshot is read (restored, cloned,
//! pulled, forked, adopted) only for the namespace its record names, or, with no record, the
//! one its name proves. Refusals fail the pod for good and run nothing.

use super::*;
use crate::provider::naming;
use crate::vm::Snapshot;

/// `pod_lifecycle_total` reason and Warning of a pod whose VM name is not its namespace's.
pub(super) const REASON_VM_NOT_IN_NS: &str = "vm_not_in_namespace";
pub(super) const EVENT_VM_NOT_IN_NS: &str = "VMNotInNamespace";
/// A pod whose VM reference (an unmanaged pod's id) does not name its VM exactly.
pub(super) const REASON_VM_REFERENCE: &str = "vm_reference_mismatch";
pub(super) const EVENT_VM_REFERENCE: &str = "VMReferenceMismatch";
/// A pod that would read a VM snapshot of another namespace (or one no record or name ties
/// to its own).
pub(super) const REASON_SNAPSHOT_NOT_IN_NS: &str = "snapshot_not_in_namespace";
pub(super) const EVENT_SNAPSHOT_NOT_IN_NS: &str = "SnapshotNotInNamespace";
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
pub(super) fn snapshot_is(s: &Snapshot, name: &str) -> bool {
    !name.is_empty() && (s.name == name || s.id == name)
}

/// A successful `snapshot inspect <name>` answer read and held to the name: Ok(Some) for that
/// very snapshot, Ok(None) for another one (an ID-prefix match, as good as not found), Err
/// when it does not parse.
pub(super) fn inspected_snapshot(
    r: &Answer,
    name: &str,
) -> Result<Option<Snapshot>, crate::vm::ReadError> {
    r.snapshot().map(|s| snapshot_is(&s, name).then_some(s))
}

/// The ownership check of a read: a record (the ledger's, or a manifest's owner annotation)
/// must name the pod's namespace; with none (snapshots pushed by the Go daemon or before
/// owners were recorded), `name` must prove it (a hashed name, or one with a single reading).
pub(super) fn owned_by(record: Option<&str>, name: &str, key: &PodKey) -> bool {
    match record.filter(|r| !r.is_empty()) {
        Some(ns) => ns == key.namespace,
        None => naming::owner(name, &[&key.name]).proves(&key.namespace),
    }
}

/// Whether a registry repository holds VM snapshots by its name alone: an operator VM name.
/// Other repositories are base images (shared), unless their manifest says otherwise.
pub(super) fn vm_repository(repo: &str) -> bool {
    naming::owner(repo, &[]) != naming::NameOwner::Foreign
}

/// Whether a tag's manifest is a VM snapshot's: by its repository's name, or by the owner or
/// from-node annotations only daemons write.
pub(super) fn vm_snapshot_tag(repo: &str, tag: &HibernateTag) -> bool {
    vm_repository(repo) || !tag.owner_namespace.is_empty() || !tag.from_node.is_empty()
}

/// Whether a registry tag is recorded for another namespace than `key`'s: a push would
/// replace another tenant's snapshot (an unrecorded tag, an older daemon's, is replaced).
pub(super) fn tag_of_another(key: &PodKey, tag: &HibernateTag) -> bool {
    !tag.owner_namespace.is_empty() && tag.owner_namespace != key.namespace
}

/// `Provider::vm_adoptable` over the ledger and the last holders' namespaces.
fn adoptable(
    owners: &crate::provider::owners::Owners,
    last_holder_ns: &BTreeMap<String, String>,
    key: &PodKey,
    vm_id: &str,
    vm: &VmInfo,
) -> bool {
    match owners.get(Owned::Vm, &vm.name) {
        Some(o) => o.namespace == key.namespace,
        None => {
            naming::owner(&vm.name, &[&key.name]).proves(&key.namespace)
                || last_holder_ns.get(&vm.name) == Some(&key.namespace)
                || (!vm_id.is_empty() && vm.id == vm_id)
        }
    }
}

/// `Provider::vm_record_refusal` over the ledger.
fn record_refusal(
    owners: &crate::provider::owners::Owners,
    key: &PodKey,
    vm_name: &str,
) -> Option<String> {
    let o = owners.get(Owned::Vm, vm_name)?;
    (o.namespace != key.namespace).then(|| {
        format!(
            "pod {key}: vm {vm_name} is recorded for another namespace; it is neither made \
             nor taken over for namespace {}",
            key.namespace
        )
    })
}

/// The reads of the ledger a machine op's step makes for its own pod (as `Provider`'s below).
impl Cx<'_> {
    /// Whether this pod owns local snapshot `name`, made from VM `vm_name`: may read it, and
    /// may have it removed (nothing is removed on a pod's behalf that it does not own).
    pub(super) fn owns_snapshot(&self, name: &str, vm_name: &str) -> bool {
        let record = self.owners.get(Owned::Snapshot, name);
        owned_by(record.map(|o| o.namespace.as_str()), vm_name, self.key)
    }

    /// Whether the record of local snapshot `name` names another namespace than this pod's.
    pub(super) fn snapshot_of_another(&self, name: &str) -> bool {
        self.owners
            .get(Owned::Snapshot, name)
            .is_some_and(|o| o.namespace != self.key.namespace)
    }

    /// Whether this pod may read the snapshot a registry tag of repository `repo` holds.
    pub(super) fn tag_readable(&self, repo: &str, tag: &HibernateTag) -> bool {
        owned_by(Some(&tag.owner_namespace), repo, self.key)
    }

    /// Whether this pod (giving id annotation `vm_id`) may take VM `vm`, which no live pod
    /// holds (`Provider::vm_adoptable`).
    pub(super) fn vm_adoptable(&self, vm_id: &str, vm: &VmInfo) -> bool {
        adoptable(self.owners, self.last_holder_ns, self.key, vm_id, vm)
    }

    /// Why this pod may not make VM `vm_name`, if it may not (`Provider::vm_record_refusal`).
    pub(super) fn vm_record_refusal(&self, vm_name: &str) -> Option<String> {
        record_refusal(self.owners, self.key, vm_name)
    }

    /// Whether local snapshot `name` may exist on the node: always before the first listing
    /// answered.
    pub(super) fn snapshot_may_exist(&self, name: &str) -> bool {
        self.local_snapshots.may_hold(name)
    }
}

impl Provider {
    /// Whether the record of local snapshot `name` names another namespace than `key`'s.
    pub(super) fn snapshot_of_another(&self, key: &PodKey, name: &str) -> bool {
        self.owner_of(Owned::Snapshot, name)
            .is_some_and(|o| o.namespace != key.namespace)
    }

    /// Whether pod `key` (giving id annotation `vm_id`) may take VM `vm`, which no live pod
    /// holds: its record names the pod's namespace; with none, its name proves it, the last
    /// pod that held it was of that namespace, or (an earlier daemon's VM) the pod's id
    /// annotation is its exact ID.
    pub(super) fn vm_adoptable(&self, key: &PodKey, vm_id: &str, vm: &VmInfo) -> bool {
        adoptable(&self.owners, &self.last_holder_ns, key, vm_id, vm)
    }

    /// Why pod `key` may not make VM `vm_name`, if it may not: the ledger records a VM of that
    /// name for another namespace. Recording the pod's own owner over it would hand that VM
    /// to the pod at its next lookup by name (a clone that fails on the taken name, then the
    /// adoption of what the lookup finds).
    pub(super) fn vm_record_refusal(&self, key: &PodKey, vm_name: &str) -> Option<String> {
        record_refusal(&self.owners, key, vm_name)
    }

    /// Why pod `key` may not take the VM of its name that no live pod holds (kept at
    /// startup, or left by a failed create), if it may not (see `vm_adoptable`).
    pub(super) fn unheld_vm_refusal(&self, key: &PodKey, spec: &VmSpec) -> Option<String> {
        let vm = self.by_name.get(&spec.vm_name)?;
        (!self.vm_adoptable(key, &spec.vm_id, vm)).then(|| {
            format!(
                "pod {key}: vm {} exists and is not recorded for namespace {}; it is not \
                 adopted",
                spec.vm_name, key.namespace
            )
        })
    }

    /// A wake or restore refused: the snapshot it would read is not the pod's namespace's. A
    /// restore fails the pod for good; a wake keeps the pod hibernated (no VM, no fresh boot)
    /// and is looked at again on the wake's retry schedule.
    pub(super) fn wake_refused(&mut self, key: &PodKey, uid: &str, restore: bool, message: String) {
        self.metric(MetricUpdate::Wake { result: "failed" });
        if restore {
            return self.refuse_create(
                key,
                EVENT_SNAPSHOT_NOT_IN_NS,
                REASON_SNAPSHOT_NOT_IN_NS,
                message,
            );
        }
        let err = format!("wake: {message}");
        self.update_failed_as(
            key,
            uid,
            EVENT_SNAPSHOT_NOT_IN_NS,
            REASON_SNAPSHOT_NOT_IN_NS,
            &err,
        );
    }

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
            slot.clear_op();
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
