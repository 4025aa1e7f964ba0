//! A create looks before it boots: the VM already there under its name or id (adopted), and
//! the hibernate evidence that turns a create into a restore.

use super::*;

impl Provider {
    /// Hibernate evidence: was the VM hibernated before booting it fresh. With a registry the
    /// evidence is the tag `<vm>:hibernate`; without one, a local snapshot named after the VM.
    pub(in crate::provider::core) fn check_evidence(&mut self, key: &PodKey, vm_name: &str) {
        let vm_name = vm_name.to_string();
        let ask = if self.cfg.registry {
            Ask::effect(|op| Effect::CheckHibernateEvidence { op, vm_name })
        } else {
            Ask::Cocoon(CocoonCmd::SnapshotInspect { name: vm_name })
        };
        self.advance(key, CreateStep::Evidence, ask)
    }

    /// The verdict on the hibernate evidence. No evidence: the fresh bring-up starts (with
    /// the `fork-<vm>` removal that opens it when that snapshot may exist), unless the pod itself asks for a restore. Evidence
    /// restores the VM from its hibernate snapshot; a conflicting clone source or image fails
    /// the create (retried with backoff, so removing the tag lets the pod boot): that is the
    /// user's to settle, and a fresh boot would silently lose the hibernated state. An
    /// unreadable registry fails closed.
    pub(in crate::provider::core) fn evidence_verdict(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        found: Result<Option<HibernateTag>, TransferError>,
    ) {
        let vm = &c.spec.vm_name;
        let (place, remedy) = if self.cfg.registry {
            (
                format!("registry tag {vm}:hibernate"),
                format!("delete the tag {vm}:hibernate"),
            )
        } else {
            (
                format!("local snapshot {vm}"),
                format!("remove the local snapshot {vm}"),
            )
        };
        let tag = match found {
            Ok(None) if c.spec.restore_from_hibernate => {
                // Asked for explicitly: the wake source resolution says what is missing.
                return self.start_wake(key, true);
            }
            Ok(None) => {
                self.fork_invalidate(vm);
                let name = spec::fork_snapshot_name(vm);
                // A fork snapshot recorded for another namespace is left (and never handed
                // out: the fork flight checks its owner); an unrecorded one is only a cache.
                if !self.snapshot_may_exist(&name) || self.snapshot_of_another(key, &name) {
                    return self.fresh_bring_up(key, c);
                }
                return self.advance(
                    key,
                    CreateStep::RmFork,
                    Ask::Cocoon(CocoonCmd::SnapshotRm { name }),
                );
            }
            Err(e) => {
                self.metric(MetricUpdate::HibernateEvidence {
                    verdict: "unavailable",
                });
                let msg = format!("hibernate evidence for vm {vm} unavailable ({place}): {e}");
                self.event(
                    key,
                    &c.uid,
                    EventType::Warning,
                    "HibernateEvidenceUnavailable",
                    &msg,
                );
                return self.fail_create_as(key, &c.uid, "HibernateEvidenceFailed", &msg, true);
            }
            Ok(Some(tag)) => tag,
        };
        let ours = if self.cfg.registry {
            self.tag_readable(key, vm, &tag)
        } else {
            self.owns_snapshot(key, vm, vm)
        };
        let base = tag.base_image;
        let explicit_source = c.spec.clone_from_dir.is_some() || !c.spec.fork_from.is_empty();
        let (verdict, msg) = if explicit_source {
            (
                "source_conflict",
                format!(
                    "vm {vm} has a hibernate snapshot ({place}) but the pod names an explicit \
                     clone source; {remedy} to boot from that source"
                ),
            )
        } else if !base.is_empty() && base != c.spec.image {
            (
                "image_conflict",
                format!(
                    "vm {vm} has a hibernate snapshot ({place}) of image {base} but the pod asks \
                     for {}; {remedy} to boot the new image",
                    c.spec.image
                ),
            )
        } else if !ours {
            // Restoring would read another namespace's hibernation (or one no record or name
            // ties to this one).
            let msg = format!(
                "pod {key}: vm {vm} has a hibernate snapshot ({place}) that is not recorded \
                 for namespace {}; it is not restored",
                key.namespace
            );
            return self.refuse_create(
                key,
                isolation::EVENT_SNAPSHOT_NOT_IN_NS,
                isolation::REASON_SNAPSHOT_NOT_IN_NS,
                msg,
            );
        } else {
            self.metric(MetricUpdate::HibernateEvidence {
                verdict: "restored",
            });
            let msg =
                format!("restoring vm {vm} from its hibernate snapshot instead of fresh-booting");
            self.event(
                key,
                &c.uid,
                EventType::Warning,
                "HibernateSnapshotExists",
                &msg,
            );
            if let Some(t) = self.slot(key).tracked.as_mut() {
                t.spec.restore_from_hibernate = true;
            }
            return self.start_wake(key, true);
        };
        self.metric(MetricUpdate::HibernateEvidence { verdict });
        self.fail_create_as(key, &c.uid, "HibernateEvidenceFailed", &msg, true)
    }

    /// A retry's lookup of a VM an earlier attempt may have left under the pod's VM name:
    /// adopted when running and the pod's namespace's, removed when stopped.
    pub(super) fn create_inspected_by_name(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
        let spec = &c.spec;
        if r.succeeded() {
            // Only a VM of this very name (not one whose ID it prefixes).
            let vm = r.vm().ok();
            if let Some(vm) = vm.filter(|v| isolation::vm_named(v, &spec.vm_name)) {
                // A VM no live pod holds: only the namespace that owns it takes it
                // (or removes it as a leftover).
                if !self.vm_adoptable(key, &spec.vm_id, &vm) {
                    let msg = format!(
                        "pod {key}: vm {} exists and is not recorded for namespace {}; \
                             it is not adopted",
                        spec.vm_name, key.namespace
                    );
                    let (event, reason) = (
                        isolation::EVENT_VM_NOT_IN_NS,
                        isolation::REASON_VM_NOT_IN_NS,
                    );
                    return self.refuse_create(key, event, reason, msg);
                }
                if vm.running() {
                    self.lifecycle_metric("create", "ok", "adopted");
                    return self.vm_up(key, vm, true);
                }
                return self.advance(
                    key,
                    CreateStep::RmStaleByName,
                    Ask::Cocoon(CocoonCmd::VmRm { id: vm.id }),
                );
            }
        }
        self.check_evidence(key, &spec.vm_name)
    }

    /// The hibernate evidence without a registry: the local snapshot named after the VM.
    pub(super) fn local_evidence(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
        let spec = &c.spec;
        // No registry: a local snapshot named after the VM is the evidence. A failed
        // inspect means there is none; one that hung says nothing, so fail closed.
        let found = if r.succeeded() {
            isolation::inspected_snapshot(&r, &spec.vm_name)
                .map(|s| {
                    s.map(|s| HibernateTag {
                        base_image: s.image,
                        snapshot_id: s.id,
                        ..Default::default()
                    })
                })
                .map_err(|e| TransferError::Cocoon(e.to_string()))
        } else if r.timed_out() {
            Err(TransferError::Cocoon(format!(
                "snapshot inspect {}: {}",
                spec.vm_name,
                r.error_text()
            )))
        } else {
            Ok(None)
        };
        self.evidence_verdict(key, c, found)
    }

    /// The lookup of an unmanaged pod's VM by its id annotation: adopted only when cocoon
    /// answers with that exact ID and the pod's VM name (an ID prefix, or another VM's ID,
    /// fails the pod for good); not found, or no answer, fails the create and is retried.
    pub(super) fn unmanaged_found(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
        let spec = &c.spec;
        if r.vm_not_found() || !r.succeeded() {
            let msg = format!(
                "unmanaged vm {} ({}) not found: {}",
                spec.vm_name,
                spec.vm_id,
                r.error_text()
            );
            return self.fail_create(key, &c.uid, &msg, true);
        }
        match r.vm() {
            Ok(vm) if isolation::vm_is(&vm, &spec.vm_id, &spec.vm_name) => {
                self.finish_create(key, vm, false, "")
            }
            Ok(_) => {
                // Nothing of the VM found goes into the message: it may be another tenant's.
                let msg = format!(
                    "pod {key}: {ANN_VM_ID} {} does not name vm {} exactly; an unmanaged pod \
                     gives its VM's full ID",
                    spec.vm_id, spec.vm_name
                );
                self.refuse_create(
                    key,
                    isolation::EVENT_VM_REFERENCE,
                    isolation::REASON_VM_REFERENCE,
                    msg,
                )
            }
            Err(e) => self.fail_create(key, &c.uid, &e.to_string(), true),
        }
    }
}
