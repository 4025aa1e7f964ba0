//! The ownership ledger in the core: recording an owner before the cocoon call that creates a
//! VM or snapshot (the call waits for the record to be durable), forgetting it when the thing
//! is gone, and trimming it to what exists at start and at each snapshot listing.

use super::*;
use crate::provider::owners::{Owned, Owner, OwnerChange};

/// The call a pod's step makes once its ownership record is on disk.
#[derive(Debug, Clone)]
pub(super) enum Deferred {
    Cocoon(CocoonCmd),
    /// A registry effect; its op is set when it is issued.
    Effect(Effect),
}

/// Who waits for a ledger write.
#[derive(Debug, Clone)]
pub(super) enum RecordFor {
    /// The pod's op: its deferred call runs once the record is on disk.
    Pod(PodKey),
    /// The fork-snapshot flight of this source: its save runs once `fork-<source>` is owned.
    Fork(String),
    /// No one (a removal, an adoption's record of a VM that already exists).
    Nobody,
}

/// `effect` with its op id set (the registry effects a step may defer).
pub(super) fn with_op_id(mut effect: Effect, id: OpId) -> Effect {
    match &mut effect {
        Effect::PullSnapshot { op, .. } | Effect::PushSnapshot { op, .. } => *op = id,
        _ => {}
    }
    effect
}

impl Provider {
    /// The owner recorded for a VM or local snapshot.
    pub(super) fn owner_of(&self, kind: Owned, name: &str) -> Option<&Owner> {
        self.owners.get(kind, name)
    }

    /// An ask that records `name`'s owner, then makes `then` (the call that creates it).
    pub(super) fn owned_then(kind: Owned, name: &str, owner: Owner, then: Deferred) -> Ask {
        let change = OwnerChange::Set {
            kind,
            name: name.to_string(),
            owner,
        };
        Ask::Recorded(vec![change], then)
    }

    /// Applies `changes` in memory and asks the edge to write them; `for_` waits for the
    /// answer. Returns the op, or None when the ledger already holds them all (nothing to
    /// write, nothing to wait for).
    pub(super) fn record(&mut self, changes: Vec<OwnerChange>, for_: RecordFor) -> Option<OpId> {
        let changes: Vec<OwnerChange> = changes
            .into_iter()
            .filter(|c| !self.owners.holds(c))
            .collect();
        if changes.is_empty() {
            return None;
        }
        let mut undo = Vec::with_capacity(changes.len());
        for c in &changes {
            undo.push(self.owners.undo_of(c));
            self.owners.apply(c);
        }
        undo.reverse();
        let op = self.op_id();
        self.waiters.insert(op, Waiter::Owners { for_, undo });
        self.out.push(Effect::RecordOwners { op, changes });
        Some(op)
    }

    /// The pod's step of `Ask::Recorded`: the record, then (once durable) the call.
    pub(super) fn pod_record_then(
        &mut self,
        key: &PodKey,
        changes: Vec<OwnerChange>,
        then: Deferred,
    ) {
        match self.record(changes, RecordFor::Pod(key.clone())) {
            None => self.issue_deferred(key, then),
            Some(op) => {
                let slot = self.slot(key);
                slot.awaiting = Some(op);
                slot.deferred = Some(then);
            }
        }
    }

    fn issue_deferred(&mut self, key: &PodKey, then: Deferred) {
        match then {
            Deferred::Cocoon(cmd) => self.pod_cocoon(key, cmd),
            Deferred::Effect(e) => self.pod_effect(key, move |op| with_op_id(e, op)),
        }
    }

    /// An adopted VM with no record (made by an earlier daemon) is recorded for the pod's
    /// namespace that holds it now (nothing waits: the VM exists already).
    pub(super) fn own_adopted(&mut self, key: &PodKey, uid: &str, vm_name: &str) {
        if self.owner_of(Owned::Vm, vm_name).is_some() {
            return;
        }
        let change = OwnerChange::Set {
            kind: Owned::Vm,
            name: vm_name.to_string(),
            owner: Owner::new(&key.namespace, uid),
        };
        self.record(vec![change], RecordFor::Nobody);
    }

    /// Forgets the owner of a VM or snapshot that is gone (no one waits for the write).
    pub(super) fn forget_owner(&mut self, kind: Owned, name: &str) {
        let change = OwnerChange::Remove {
            kind,
            name: name.to_string(),
        };
        self.record(vec![change], RecordFor::Nobody);
    }

    /// The answer to a ledger write. A failed write is undone in memory (and on the edge's
    /// copy); the pod's deferred call then fails as that call would, and is retried with it.
    pub(super) fn owners_recorded(
        &mut self,
        op: OpId,
        for_: RecordFor,
        undo: Vec<OwnerChange>,
        result: Result<(), String>,
    ) {
        if let Err(e) = &result {
            log::error!("provider: ownership ledger write failed: {e}");
            for c in &undo {
                self.owners.apply(c);
            }
            self.record_undo(undo);
        }
        match for_ {
            RecordFor::Pod(key) => {
                let Some(slot) = self.slots.get_mut(&key) else {
                    return;
                };
                if slot.awaiting != Some(op) {
                    return; // the op moved on
                }
                let Some(then) = slot.deferred.take() else {
                    return;
                };
                match result {
                    Ok(()) => {
                        slot.awaiting = None;
                        self.issue_deferred(&key, then)
                    }
                    Err(e) => {
                        let why = format!("record the owner before it is made: {e}");
                        let res = match then {
                            Deferred::Cocoon(_) => {
                                Res::Cocoon(Answer::failed(format!("Error: {why}")))
                            }
                            Deferred::Effect(_) => Res::Transfer(Err(TransferError::Io(why))),
                        };
                        self.pod_step_result(&key, op, res)
                    }
                }
            }
            RecordFor::Fork(source) => self.fork_owner_recorded(&source, result),
            RecordFor::Nobody => {}
        }
    }

    /// The edge's copy takes the undo of a failed write too (no one waits for it).
    fn record_undo(&mut self, undo: Vec<OwnerChange>) {
        if undo.is_empty() {
            return;
        }
        let op = self.op_id();
        self.waiters.insert(op, Waiter::Ignore);
        self.out.push(Effect::RecordOwners { op, changes: undo });
    }

    /// At start: VM records of VMs cocoon no longer lists go.
    pub(super) fn trim_vm_owners(&mut self, listed: &std::collections::HashSet<String>) {
        let stale = self.owners.stale(Owned::Vm, |n| listed.contains(n));
        self.record(stale, RecordFor::Nobody);
    }

    /// At a snapshot listing: records of snapshots that may no longer exist go.
    pub(super) fn trim_snapshot_owners(&mut self) {
        let may_exist = &self.local_snapshots.may_exist;
        let stale = self
            .owners
            .stale(Owned::Snapshot, |n| may_exist.contains(n));
        self.record(stale, RecordFor::Nobody);
    }
}
