//! A create looks before it boots: the VM already there under its name or id (adopted), and
//! the hibernate evidence that turns a create into a restore.

use super::*;

impl CreateOp {
    /// The verdict on the hibernate evidence. No evidence: the fresh bring-up starts (with
    /// the `fork-<vm>` removal that opens it when that snapshot may exist), unless the pod
    /// itself asks for a restore. Evidence restores the VM from its hibernate snapshot; a
    /// conflicting clone source or image fails the create (retried with backoff, so removing
    /// the tag lets the pod boot): that is the user's to settle, and a fresh boot would
    /// silently lose the hibernated state. An unreadable registry fails closed.
    pub(super) fn evidence_verdict(
        &mut self,
        cx: &mut Cx,
        found: Result<Option<HibernateTag>, TransferError>,
    ) -> CreateNext {
        let vm = self.spec.vm_name.clone();
        let place = match cx.cfg.registry {
            true => format!("registry tag {vm}:hibernate"),
            false => format!("local snapshot {vm}"),
        };
        match found {
            // Asked for explicitly: the wake source resolution says what is missing.
            Ok(None) if self.spec.restore_from_hibernate => {
                Next::Then(CreateThen::Restore { mark: false })
            }
            Ok(None) => {
                let name = spec::fork_snapshot_name(&vm);
                // A fork snapshot recorded for another namespace is left (and never handed
                // out: the fork flight checks its owner); an unrecorded one is only a cache.
                let next = if !cx.snapshot_may_exist(&name) || cx.snapshot_of_another(&name) {
                    self.fresh_bring_up(cx)
                } else {
                    let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name });
                    Next::Ask(CreateStep::RmFork, ask)
                };
                Self::chore_then(vec![Chore::ForkInvalidated(vm)], next)
            }
            Err(e) => {
                cx.metric(MetricUpdate::HibernateEvidence {
                    verdict: "unavailable",
                });
                let msg = format!("hibernate evidence for vm {vm} unavailable ({place}): {e}");
                let uid = self.uid.clone();
                cx.event(
                    &uid,
                    EventType::Warning,
                    "HibernateEvidenceUnavailable",
                    &msg,
                );
                Self::failed_as("HibernateEvidenceFailed", msg, true)
            }
            Ok(Some(tag)) => self.evidence_found(cx, tag, &place),
        }
    }

    /// Hibernate evidence exists: restored when it is the pod's namespace's and nothing the
    /// pod asks for conflicts with it.
    fn evidence_found(&mut self, cx: &mut Cx, tag: HibernateTag, place: &str) -> CreateNext {
        let (key, vm) = (cx.key, self.spec.vm_name.clone());
        let remedy = match cx.cfg.registry {
            true => format!("delete the tag {vm}:hibernate"),
            false => format!("remove the local snapshot {vm}"),
        };
        let ours = match cx.cfg.registry {
            true => cx.tag_readable(&vm, &tag),
            false => cx.owns_snapshot(&vm, &vm),
        };
        let base = tag.base_image;
        let explicit_source = self.spec.clone_from_dir.is_some() || !self.spec.fork_from.is_empty();
        let (verdict, msg) = if explicit_source {
            (
                "source_conflict",
                format!(
                    "vm {vm} has a hibernate snapshot ({place}) but the pod names an explicit \
                     clone source; {remedy} to boot from that source"
                ),
            )
        } else if !base.is_empty() && base != self.spec.image {
            (
                "image_conflict",
                format!(
                    "vm {vm} has a hibernate snapshot ({place}) of image {base} but the pod asks \
                     for {}; {remedy} to boot the new image",
                    self.spec.image
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
            return Next::Then(CreateThen::Refused(
                isolation::EVENT_SNAPSHOT_NOT_IN_NS,
                isolation::REASON_SNAPSHOT_NOT_IN_NS,
                msg,
            ));
        } else {
            cx.metric(MetricUpdate::HibernateEvidence {
                verdict: "restored",
            });
            let msg =
                format!("restoring vm {vm} from its hibernate snapshot instead of fresh-booting");
            let uid = self.uid.clone();
            cx.event(&uid, EventType::Warning, "HibernateSnapshotExists", &msg);
            return Next::Then(CreateThen::Restore { mark: true });
        };
        cx.metric(MetricUpdate::HibernateEvidence { verdict });
        Self::failed_as("HibernateEvidenceFailed", msg, true)
    }

    /// A retry's lookup of a VM an earlier attempt may have left under the pod's VM name:
    /// adopted when running and the pod's namespace's, removed when stopped.
    pub(super) fn inspected_by_name(&self, cx: &mut Cx, r: Answer) -> CreateNext {
        let (key, spec) = (cx.key, &self.spec);
        // Only a VM of this very name (not one whose ID it prefixes).
        let vm = r.vm().ok().filter(|_| r.succeeded());
        let Some(vm) = vm.filter(|v| isolation::vm_named(v, &spec.vm_name)) else {
            let ask = evidence_ask(cx.cfg.registry, &spec.vm_name);
            return Next::Ask(CreateStep::Evidence, ask);
        };
        // A VM no live pod holds: only the namespace that owns it takes it (or removes it
        // as a leftover).
        if !cx.vm_adoptable(&spec.vm_id, &vm) {
            let msg = format!(
                "pod {key}: vm {} exists and is not recorded for namespace {}; it is not \
                 adopted",
                spec.vm_name, key.namespace
            );
            let (event, reason) = (
                isolation::EVENT_VM_NOT_IN_NS,
                isolation::REASON_VM_NOT_IN_NS,
            );
            return Next::Then(CreateThen::Refused(event, reason, msg));
        }
        if vm.running() {
            cx.metric(MetricUpdate::PodLifecycle {
                op: "create",
                result: "ok",
                reason: "adopted",
            });
            return Next::Then(CreateThen::Up(vm, true));
        }
        let ask = Ask::Cocoon(CocoonCmd::VmRm { id: vm.id });
        Next::Ask(CreateStep::RmStaleByName, ask)
    }

    /// The hibernate evidence without a registry: the local snapshot named after the VM.
    pub(super) fn local_evidence(&mut self, cx: &mut Cx, r: Answer) -> CreateNext {
        let vm_name = &self.spec.vm_name;
        // No registry: a local snapshot named after the VM is the evidence. A failed
        // inspect means there is none; one that hung says nothing, so fail closed.
        let found = if r.succeeded() {
            isolation::inspected_snapshot(&r, vm_name)
                .map(|s| {
                    s.map(|s| HibernateTag {
                        base_image: s.image,
                        snapshot_id: s.id,
                        ..Default::default()
                    })
                })
                .map_err(|e| TransferError::Cocoon(e.to_string()))
        } else if r.timed_out() {
            let e = r.error_text();
            Err(TransferError::Cocoon(format!(
                "snapshot inspect {vm_name}: {e}"
            )))
        } else {
            Ok(None)
        };
        self.evidence_verdict(cx, found)
    }

    /// The lookup of an unmanaged pod's VM by its id annotation: adopted only when cocoon
    /// answers with that exact ID and the pod's VM name (an ID prefix, or another VM's ID,
    /// fails the pod for good); not found, or no answer, fails the create and is retried.
    pub(super) fn unmanaged_found(&self, cx: &Cx, r: Answer) -> CreateNext {
        let (key, spec) = (cx.key, &self.spec);
        if r.vm_not_found() || !r.succeeded() {
            let msg = format!(
                "unmanaged vm {} ({}) not found: {}",
                spec.vm_name,
                spec.vm_id,
                r.error_text()
            );
            return Self::failed(msg, true);
        }
        match r.vm() {
            Ok(vm) if isolation::vm_is(&vm, &spec.vm_id, &spec.vm_name) => {
                let ip = String::new();
                Next::Then(CreateThen::Finished {
                    vm,
                    cloned: false,
                    ip,
                })
            }
            Ok(_) => {
                // Nothing of the VM found goes into the message: it may be another tenant's.
                let msg = format!(
                    "pod {key}: {ANN_VM_ID} {} does not name vm {} exactly; an unmanaged pod \
                     gives its VM's full ID",
                    spec.vm_id, spec.vm_name
                );
                Next::Then(CreateThen::Refused(
                    isolation::EVENT_VM_REFERENCE,
                    isolation::REASON_VM_REFERENCE,
                    msg,
                ))
            }
            Err(e) => Self::failed(e.to_string(), true),
        }
    }
}
