//! Create: spec checks, hibernate evidence, snapshot / image inspection and pulls, up to the
//! clone or run. The bring-up after the VM exists is in `bring_up`.

use super::*;
use crate::vm::PidFile;

/// Metric reason of a create refused because another live pod holds the VM.
const REASON_VM_OWNED: &str = "vm_owned_by_another_pod";
/// Metric reason of a pod refused by the snapshot CPU-class gate (create, update, startup).
pub(super) const REASON_CPU_CLASS: &str = "snapshot_cpu_class_mismatch";

impl Provider {
    // ----- create ---------------------------------------------------------------------------

    pub(super) fn start_create(&mut self, key: &PodKey, pod: Arc<Pod>) {
        let uid = pod_uid(&pod);
        let spec = match spec::parse(&pod) {
            Ok(s) => s,
            Err(e) => return self.reject(key, &pod, e),
        };
        if let Some(message) = isolation::vm_name_refusal(key, &spec.vm_name) {
            return self.refuse_vm_name(key, &pod, message);
        }
        if let Err(message) = self.cpu_class_gate(key, &spec) {
            let e = SpecError {
                reason: REASON_CPU_CLASS,
                message,
            };
            return self.reject(key, &pod, e);
        }
        // A macOS guest's name and image go on cocoon-macos's command line: checked first.
        if let Some(msg) = macos::is_macos(&spec)
            .then(|| self.macos_input_error(&spec))
            .flatten()
        {
            let e = SpecError {
                reason: "invalid_macos_spec",
                message: format!("pod {key}: {msg}"),
            };
            return self.reject(key, &pod, e);
        }
        if let Some(msg) = self.vm_claimed_elsewhere(key, &uid, &spec) {
            let e = SpecError {
                reason: REASON_VM_OWNED,
                message: format!("pod {key}: {msg}"),
            };
            return self.reject(key, &pod, e);
        }
        if let Some(message) = self.unheld_vm_refusal(key, &spec) {
            return self.refuse_vm_name(key, &pod, message);
        }
        self.warn_fallbacks(key, &uid, &spec);
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.clone())
            .unwrap_or_else(|| self.wall.clone());
        let failures = {
            let slot = self.slot(key);
            slot.idle.clear_rejection();
            slot.tracked = Some(Tracked {
                uid: uid.clone(),
                pod: pod.clone(),
                spec: spec.clone(),
                vm: None,
                ip: String::new(),
                start_time: Some(start_time),
                probe: None,
            });
            slot.failures
        };
        self.begin_creating(key);
        self.hold_statuses(key, &uid);
        if macos::is_macos(&spec) {
            return self.macos_create(key, uid, spec);
        }
        // Adopt an existing VM of this name.
        if let Some(vm) = self.by_name.get(&spec.vm_name).cloned() {
            let op = CreateOp::new(uid, spec, CreateStep::Boot, self.now);
            self.set_op(key, op);
            self.lifecycle_metric("create", "ok", "adopted");
            return self.vm_up(key, vm, true);
        }
        if !spec.managed {
            return self.start_unmanaged_create(key, uid, spec);
        }
        let first = if failures > 0 {
            CreateStep::InspectByName
        } else {
            CreateStep::Evidence
        };
        let mut op = CreateOp::new(uid, spec.clone(), first, self.now);
        op.local_snapshot = spec::local_snapshot_name(&spec.image);
        let first = op.step.clone();
        self.set_op(key, op);
        match first {
            // A retry after a failure: a previous attempt may have left a VM (hung clone).
            CreateStep::InspectByName => self.advance(
                key,
                CreateStep::InspectByName,
                Ask::Cocoon(CocoonCmd::VmInspect {
                    reference: spec.vm_name.clone(),
                }),
            ),
            _ => self.check_evidence(key, &spec.vm_name),
        }
    }

    /// An unmanaged pod (`managed: false`): its VM exists already, named by the pod's
    /// pre-assigned id; it is only looked up and adopted.
    fn start_unmanaged_create(&mut self, key: &PodKey, uid: String, spec: VmSpec) {
        if spec.vm_id.is_empty() || spec.vm_ip.is_empty() {
            let msg = format!(
                "unmanaged vm {} missing pre-assigned IP/VMID {}",
                spec.vm_name,
                spec::CONTRACT_HINT
            );
            self.slot(key).finish_op();
            return self.fail_create(key, &uid, &msg, false);
        }
        let op = CreateOp::new(uid, spec.clone(), CreateStep::UnmanagedInspect, self.now);
        self.set_op(key, op);
        if let Some(t) = self.slot(key).tracked.as_mut() {
            t.ip = spec.vm_ip.clone();
        }
        if !super::delete::lookup_reference_ok(&spec.vm_id) {
            let msg = format!("pod {key}: {ANN_VM_ID} {:?} is not a VM ID", spec.vm_id);
            let (event, reason) = (
                isolation::EVENT_VM_REFERENCE,
                isolation::REASON_VM_REFERENCE,
            );
            return self.refuse_create(key, event, reason, msg);
        }
        // The id must name exactly one VM by its exact ID, of the pod's VM name.
        let ask = Ask::Cocoon(CocoonCmd::VmInspect {
            reference: spec.vm_id.clone(),
        });
        self.advance(key, CreateStep::UnmanagedInspect, ask)
    }

    /// The snapshot CPU-class gate of this node for a pod (create, update and startup).
    pub(super) fn cpu_class_gate(&self, key: &PodKey, spec: &VmSpec) -> Result<(), String> {
        spec::cpu_class_gate(
            spec,
            &key.to_string(),
            &self.cfg.node_name,
            self.cfg.cpu_class.as_deref(),
        )
    }

    /// Ownership: a VM belongs to at most one live pod. Refuses a pod whose VM name, or (for
    /// an unmanaged pod) pre-assigned VM id, is held by another tracked pod, or whose id names
    /// a known VM of another name. The message names no other pod: it lands in the
    /// requester's namespace.
    pub(super) fn vm_claimed_elsewhere(
        &self,
        key: &PodKey,
        uid: &str,
        spec: &VmSpec,
    ) -> Option<String> {
        let held = self.slots.iter().any(|(k, s)| {
            let Some(t) = s.tracked.as_ref().filter(|_| k != key) else {
                return false;
            };
            if t.uid == uid && !uid.is_empty() {
                return false;
            }
            let tracked_id = t.vm.as_ref().map(|v| v.id.as_str()).unwrap_or("");
            t.spec.vm_name == spec.vm_name
                || (!spec.managed
                    && !spec.vm_id.is_empty()
                    && (tracked_id == spec.vm_id || t.spec.vm_id == spec.vm_id))
        });
        if held {
            return Some(format!(
                "vm {} is owned by another pod; a VM belongs to one pod at a time",
                spec.vm_name
            ));
        }
        if !spec.managed && !spec.vm_id.is_empty() {
            let other = self
                .by_name
                .values()
                .any(|v| v.id == spec.vm_id && v.name != spec.vm_name);
            if other {
                return Some(format!(
                    "vm id {} belongs to a vm other than {}",
                    spec.vm_id, spec.vm_name
                ));
            }
        }
        None
    }

    /// Hibernate evidence: was the VM hibernated before booting it fresh. With a registry the
    /// evidence is the tag `<vm>:hibernate`; without one, a local snapshot named after the VM.
    pub(super) fn check_evidence(&mut self, key: &PodKey, vm_name: &str) {
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
    pub(super) fn evidence_verdict(
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

    /// Asks cocoon for the VM just booted (its state, its PID); `vm` stands if it cannot say.
    fn run_inspect(&mut self, key: &PodKey, vm: VmInfo) {
        let reference = vm.id.clone();
        if let Some(c) = self.op_of_mut::<CreateOp>(key) {
            c.vm = Some(vm);
        }
        let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
        self.advance(key, CreateStep::RunInspect, ask)
    }

    /// The fresh bring-up, once the pod's source passed its rules (`source_check`).
    fn fresh_bring_up(&mut self, key: &PodKey, c: &CreateOp) {
        if self.source_gate(key, c) {
            self.bring_up_from_source(key, c)
        }
    }

    /// The bring-up from the pod's source: a directory, a fork, an image to run, or the
    /// image's local clone snapshot.
    pub(super) fn bring_up_from_source(&mut self, key: &PodKey, c: &CreateOp) {
        let spec = &c.spec;
        if let Some(dir) = spec.clone_from_dir.clone() {
            let args = self.clone_args(spec, CloneSource::FromDir(dir), true);
            self.boot(key, CocoonCmd::VmClone(args))
        } else if !spec.fork_from.is_empty() {
            self.fork_begin(key, &spec.fork_from)
        } else if spec.mode == Mode::Run {
            let ask = self.materialise(&spec.image, spec.force_pull);
            self.advance(key, CreateStep::MaterialiseRun, ask)
        } else {
            self.advance(
                key,
                CreateStep::SnapInspect { pulled: false },
                Ask::SharedRead(CocoonCmd::SnapshotInspect {
                    name: c.local_snapshot.clone(),
                }),
            )
        }
    }

    /// Bad input / unsupported request: failure status + Warning, counter; no VM touched.
    /// A Warning `AnnotationFallback` and `{create,lenient,<reason>}` for each annotation value
    /// that did not parse and was read as the Go daemon reads it.
    fn warn_fallbacks(&mut self, key: &PodKey, uid: &str, spec: &VmSpec) {
        for f in &spec.fallbacks {
            self.lifecycle_metric("create", "lenient", f.reason);
            let message = format!("pod {key}: {f}");
            self.event(key, uid, EventType::Warning, "AnnotationFallback", &message);
        }
    }

    pub(super) fn reject(&mut self, key: &PodKey, pod: &Arc<Pod>, e: SpecError) {
        // A VM held by another pod is a conflict no retry settles: the pod fails for good.
        let terminal = restart_never(pod) || e.reason == REASON_VM_OWNED;
        self.reject_as(key, pod, "ProviderCreateFailed", e, terminal)
    }

    /// A pod refused before anything is tracked: Warning `event_reason`, the counter, the
    /// failure status (phase Failed when `terminal`); retried only when the pod changes.
    pub(super) fn reject_as(
        &mut self,
        key: &PodKey,
        pod: &Arc<Pod>,
        event_reason: &'static str,
        e: SpecError,
        terminal: bool,
    ) {
        let uid = pod_uid(pod);
        let result = if e.reason == "missing_vmname" {
            "skipped"
        } else {
            "failed"
        };
        self.lifecycle_metric("create", result, e.reason);
        self.event(key, &uid, EventType::Warning, event_reason, &e.message);
        let st = status::provider_failed(terminal, &e.message);
        let sum = status::summary(&st);
        let slot = self.slot(key);
        slot.idle = Idle::Rejected(pod.clone());
        let already = slot.last_pushed.as_ref() == Some(&sum);
        slot.last_pushed = Some(sum);
        if !already {
            self.send_status(key, &uid, st, false);
        }
    }

    /// Whether another pod's pull of this local snapshot is still running (an entry whose pod
    /// no longer pulls, its op ended by a delete, is dropped).
    fn pull_running(&mut self, local: &str, key: &PodKey) -> bool {
        let Some(puller) = self.pulls.get(local) else {
            return false;
        };
        let pulling = puller != key
            && self.slots.get(puller).is_some_and(|s| {
                s.op().and_then(CreateOp::of).is_some_and(|c| {
                    matches!(c.step, CreateStep::ImageTag | CreateStep::PullSnapshot)
                        && c.local_snapshot == local
                })
            });
        if !pulling {
            self.pulls.remove(local);
        }
        pulling
    }

    /// A pull answered: the snapshot is free for the next puller.
    fn pull_done<T>(&mut self, key: &PodKey, c: &CreateOp, r: T) -> T {
        if self.pulls.get(&c.local_snapshot) == Some(key) {
            self.pulls.remove(&c.local_snapshot);
        }
        r
    }

    /// Whether pod `key` may clone the local snapshot of its image: one recorded for its
    /// namespace; with no record, a base image (its repository is no VM's name) or a VM
    /// snapshot whose name proves the namespace.
    fn image_snapshot_readable(&self, key: &PodKey, c: &CreateOp) -> bool {
        let (repo, _) = crate::snapshots::reference::split_image_ref(&c.spec.image);
        match self.owner_of(Owned::Snapshot, &c.local_snapshot) {
            Some(o) => o.namespace == key.namespace,
            None => !isolation::vm_repository(&repo) || isolation::owned_by(None, &repo, key),
        }
    }

    /// The image's manifest, read before its pull: a VM snapshot of another namespace (or of
    /// none the record or name ties to the pod's) is refused; otherwise exactly the manifest
    /// read is pulled (by its digest), a VM snapshot once its owner is on record.
    fn image_tag_read(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        r: Result<Option<HibernateTag>, TransferError>,
    ) {
        let (repo, tag) = crate::snapshots::reference::split_image_ref(&c.spec.image);
        let local = c.local_snapshot.clone();
        let found = match r {
            Ok(found) => found,
            Err(e) => {
                self.pull_done(key, c, ());
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!("read the manifest of {}: {e}", c.spec.image);
                return self.fail_create(key, &c.uid, &msg, true);
            }
        };
        let vm_snapshot = found.as_ref().map_or(isolation::vm_repository(&repo), |t| {
            isolation::vm_snapshot_tag(&repo, t)
        });
        let owner = found.as_ref().map(|t| t.owner_namespace.as_str());
        if vm_snapshot && !isolation::owned_by(owner, &repo, key) {
            self.pull_done(key, c, ());
            let msg = format!(
                "pod {key}: image {} is a VM snapshot not recorded for namespace {}; a pod \
                 clones only its own namespace's VM snapshots",
                c.spec.image, key.namespace
            );
            return self.refuse_create(
                key,
                isolation::EVENT_SNAPSHOT_NOT_IN_NS,
                isolation::REASON_SNAPSHOT_NOT_IN_NS,
                msg,
            );
        }
        let target = found
            .as_ref()
            .map(|t| t.digest.clone())
            .filter(|d| !d.is_empty())
            .unwrap_or(tag);
        let pull = Effect::PullSnapshot {
            op: 0,
            repo,
            tag: target,
            local_name: local.clone(),
        };
        let ask = match found.filter(|_| vm_snapshot) {
            Some(t) => {
                let ns = if t.owner_namespace.is_empty() {
                    key.namespace.clone()
                } else {
                    t.owner_namespace
                };
                let owner = Owner::new(&ns, &t.owner_pod_uid);
                Self::owned_then(Owned::Snapshot, &local, owner, Deferred::Effect(pull))
            }
            None => Ask::effect(move |op| ledger::with_op_id(pull, op)),
        };
        self.advance(key, CreateStep::PullSnapshot, ask)
    }

    /// The poll timer of a pod waiting for another pod's pull: look at the snapshot again.
    pub(super) fn create_timer(&mut self, key: &PodKey, c: CreateOp) {
        if !matches!(c.step, CreateStep::PullWait) {
            return;
        }
        let name = c.local_snapshot.clone();
        self.advance(
            key,
            CreateStep::SnapInspect { pulled: false },
            Ask::SharedRead(CocoonCmd::SnapshotInspect { name }),
        )
    }

    /// An answer to the running create `c` (the op as it stands in the slot).
    pub(super) fn create_step(&mut self, key: &PodKey, c: CreateOp, res: Res) {
        let spec = &c.spec;
        let superseded = self.slots.get(key).is_some_and(|s| {
            s.latest
                .as_ref()
                .is_none_or(|p| pod_uid(p) == c.uid && deleting(p))
        });
        if superseded {
            // The pod is being deleted (or gone): building its VM further only makes more to
            // undo. The delete that follows looks the VM up by name, so whatever this create
            // made (even the VM this very answer reports) is removed before the object goes.
            log::info!("provider: {key}: create stopped, the pod is being deleted");
            return self.end_op(key);
        }
        if macos::is_macos(spec) {
            return self.macos_create_step(key, c.clone(), res);
        }
        match (c.step.clone(), res) {
            (CreateStep::InspectByName, Res::Cocoon(r)) => {
                self.create_inspected_by_name(key, &c, r)
            }
            (CreateStep::UnmanagedInspect, Res::Cocoon(r)) => self.unmanaged_found(key, &c, r),
            (CreateStep::RmStaleByName, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    let msg = format!("remove leftover vm {}: {}", spec.vm_name, r.error_text());
                    return self.fail_create(key, &c.uid, &msg, true);
                }
                self.forget_owner(Owned::Vm, &spec.vm_name);
                self.check_evidence(key, &spec.vm_name)
            }
            (CreateStep::Evidence, Res::Evidence(found)) => self.evidence_verdict(key, &c, found),
            (CreateStep::Evidence, Res::Cocoon(r)) => self.local_evidence(key, &c, r),
            (CreateStep::RmFork, Res::Cocoon(r)) => {
                // Failure only logged, as the create contract says.
                let name = spec::fork_snapshot_name(&spec.vm_name);
                if !r.succeeded() && !r.snapshot_not_found() {
                    log::warn!("provider: {key}: remove {name}: {}", r.error_text());
                }
                self.snapshot_removed(&name, &r);
                self.fresh_bring_up(key, &c)
            }
            (CreateStep::SnapInspect { pulled }, Res::Cocoon(r)) => {
                self.image_snapshot_inspected(key, &c, pulled, r)
            }
            (CreateStep::ForkWait { .. }, Res::Fork(r)) => self.fork_landed(key, &c, r),
            (CreateStep::ImageTag, Res::Evidence(r)) => self.image_tag_read(key, &c, r),
            (CreateStep::SourceCheck { rule }, Res::Source(v)) => {
                self.source_checked(key, &c, rule, v)
            }
            (CreateStep::PullSnapshot, Res::Transfer(r)) => self.snapshot_pulled(key, &c, r),
            (CreateStep::ImageInspect, Res::Cocoon(r)) => {
                if r.succeeded() {
                    return self.do_clone(key);
                }
                let ask = self.materialise(&c.snapshot_image, false);
                self.advance(key, CreateStep::MaterialiseBase, ask)
            }
            (CreateStep::MaterialiseBase, res) => match res.transfer_or_cocoon() {
                Ok(_) => self.do_clone(key),
                Err(e) => {
                    let msg = format!("make base image {} available: {e}", c.snapshot_image);
                    self.fail_create(key, &c.uid, &msg, true)
                }
            },
            (CreateStep::MaterialiseRun, res) => self.run_image_ready(key, &c, res),
            (CreateStep::Boot, Res::Cocoon(r)) => self.booted(key, &c, r),
            (CreateStep::PidFile, Res::VmPid(pid)) => {
                let mut vm = c.vm.clone().unwrap_or_default();
                match pid {
                    PidFile::Live(pid) => {
                        vm.pid = pid;
                        self.by_name.insert(spec.vm_name.clone(), vm.clone());
                        self.vm_up(key, vm, false)
                    }
                    // cocoon's own `pid` comes from this very file: with the VM's run
                    // directory where we look and no file in it, an inspect would answer
                    // pid 0 too. The VM is up as the bring-up's answer says.
                    PidFile::NoFile => self.vm_up(key, vm, false),
                    // A PID that is not alive (the hypervisor may have died), or a run
                    // directory elsewhere (another cocoon layout): cocoon answers, once.
                    PidFile::Dead | PidFile::NoRunDir => self.run_inspect(key, vm),
                }
            }
            (CreateStep::BootFailedInspect { error }, Res::Cocoon(r)) => {
                self.boot_failed_inspected(key, &c, error, r)
            }
            (CreateStep::BootFailedRm { error }, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    log::warn!(
                        "provider: {key}: remove leftover of failed bring-up: {}",
                        r.error_text()
                    );
                } else {
                    self.forget_owner(Owned::Vm, &spec.vm_name);
                }
                self.fail_create(key, &c.uid, &error, true)
            }
            (CreateStep::RunInspect, Res::Cocoon(r)) => {
                let vm = match (r.succeeded(), r.vm()) {
                    (true, Ok(v)) => v,
                    _ => c.vm.clone().unwrap_or_default(),
                };
                self.vm_up(key, vm, false)
            }
            (CreateStep::Lease, Res::Lease(r)) => {
                let ip = match r {
                    Ok(Some(ip)) => ip,
                    _ => String::new(),
                };
                let vm = c.vm.clone().unwrap_or_default();
                let cloned = !spec.fresh_boot();
                self.finish_create(key, vm, cloned, &ip)
            }
            (step, res) => self.unexpected_answer(key, &step, &res),
        }
    }

    /// A retry's lookup of a VM an earlier attempt may have left under the pod's VM name:
    /// adopted when running and the pod's namespace's, removed when stopped.
    fn create_inspected_by_name(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
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
    fn local_evidence(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
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

    /// The image's local clone snapshot, inspected (before or after its pull): cloned when
    /// present, the pod's namespace's and of the hypervisor asked for; pulled when missing.
    fn image_snapshot_inspected(&mut self, key: &PodKey, c: &CreateOp, pulled: bool, r: Answer) {
        let spec = &c.spec;
        // Another snapshot than the one asked for (an ID-prefix match) is none.
        let found = match r.succeeded() {
            true => match isolation::inspected_snapshot(&r, &c.local_snapshot) {
                Ok(s) => s,
                Err(e) => return self.fail_create(key, &c.uid, &e.to_string(), true),
            },
            false => None,
        };
        // force-pull: the snapshot comes from the registry at least once after this create
        // began (a pull another pod finished meanwhile counts), as `image pull --force` does
        // for an image to run. The pull replaces the local copy.
        let stale = spec.force_pull
            && self.cfg.registry
            && !pulled
            && self
                .pulled_at
                .get(&c.local_snapshot)
                .is_none_or(|at| *at < c.started);
        let found = found.filter(|_| !stale);
        let Some(snap) = found else {
            let why = if r.succeeded() {
                "cocoon answered with another snapshot".to_string()
            } else {
                r.error_text()
            };
            if pulled {
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!(
                    "snapshot {} still missing after pull: {why}",
                    c.local_snapshot
                );
                return self.fail_create(key, &c.uid, &msg, true);
            }
            if !self.cfg.registry {
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!(
                    "snapshot {} not found locally and no registry is configured: {why}",
                    c.local_snapshot
                );
                return self.fail_create(key, &c.uid, &msg, true);
            }
            if self.pull_running(&c.local_snapshot, key) {
                let at = self.now + PULL_WAIT_POLL;
                return self.advance(key, CreateStep::PullWait, Ask::Timer(at));
            }
            // Whose snapshot the image is, before anything of it is pulled.
            self.pulls.insert(c.local_snapshot.clone(), key.clone());
            let (repo, tag) = crate::snapshots::reference::split_image_ref(&spec.image);
            let ask = Ask::effect(|op| Effect::ReadSnapshotTag { op, repo, tag });
            return self.advance(key, CreateStep::ImageTag, ask);
        };
        if !self.image_snapshot_readable(key, c) {
            let msg = format!(
                "pod {key}: image {} is a VM snapshot not recorded for namespace {}; \
                     a pod clones only its own namespace's VM snapshots",
                spec.image, key.namespace
            );
            return self.refuse_create(
                key,
                isolation::EVENT_SNAPSHOT_NOT_IN_NS,
                isolation::REASON_SNAPSHOT_NOT_IN_NS,
                msg,
            );
        }
        if !pulled {
            self.metric(MetricUpdate::SnapshotPull { result: "ok" });
        }
        let want = if spec.backend.is_empty() {
            spec::BACKEND_CH
        } else {
            spec.backend.as_str()
        };
        if !snap.hypervisor.is_empty() && !spec.backend.is_empty() && snap.hypervisor != want {
            let msg = format!(
                "snapshot {} was taken with {} but CocoonSet requests {}",
                c.local_snapshot, snap.hypervisor, spec.backend
            );
            return self.fail_create(key, &c.uid, &msg, false);
        }
        if let Some(c) = self.op_of_mut::<CreateOp>(key) {
            c.snapshot_image = snap.image.clone();
        }
        if !snap.image.is_empty()
            && !spec::is_http_url(&snap.image)
            && !snap.image_digest.is_empty()
        {
            return self.advance(
                key,
                CreateStep::ImageInspect,
                Ask::SharedRead(CocoonCmd::ImageInspect {
                    reference: snap.image_digest.clone(),
                }),
            );
        }
        self.do_clone(key)
    }

    /// The clone or run answered: the VM is up (its PID read when the answer has none), or
    /// the failure's leftover is looked for.
    fn booted(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
        let spec = &c.spec;
        if spec.clone_from_dir.is_some() {
            self.metric(MetricUpdate::CloneFromDir {
                result: if r.succeeded() { "ok" } else { "failed" },
            });
        }
        let what = if spec.fresh_boot() {
            "vm run"
        } else {
            "vm clone"
        };
        if !r.succeeded() {
            // The snapshot or image the shared facts said was there may be gone.
            self.read_facts.forget_all();
            // A clone killed at its deadline (or failing half-way) can leave a VM
            // record behind; if the pod is deleted before the retry, nothing would
            // ever remove it. Look before reporting the failure.
            let error = format!("{what} {}: {}", spec.vm_name, r.error_text());
            return self.advance(
                key,
                CreateStep::BootFailedInspect { error },
                Ask::Cocoon(CocoonCmd::VmInspect {
                    reference: spec.vm_name.clone(),
                }),
            );
        }
        let vm = match r.vm() {
            Ok(v) => v,
            // The call succeeded but its answer names no VM (no id, or unreadable): one
            // lookup by name says what it made, as after a failed bring-up (a running VM of
            // this name is the pod's; anything else is removed and the create retried).
            Err(e) => {
                let error = format!("{what} {} answered without a VM record: {e}", spec.vm_name);
                return self.advance(
                    key,
                    CreateStep::BootFailedInspect { error },
                    Ask::Cocoon(CocoonCmd::VmInspect {
                        reference: spec.vm_name.clone(),
                    }),
                );
            }
        };
        self.by_name.insert(spec.vm_name.clone(), vm.clone());
        let fresh_run = spec.fresh_boot();
        if fresh_run && !vm.running() {
            return self.run_inspect(key, vm);
        }
        // A clone answers with pid 0 (cocoon reads the PID back only later); without
        // one the VM has no stats until a restart re-adopts it (stats skip pid-0 VMs).
        // The hypervisor's pid file tells it without another cocoon process.
        if vm.pid == 0 {
            if let Some(c) = self.op_of_mut::<CreateOp>(key) {
                c.vm = Some(vm.clone());
            }
            let (vm_id, firecracker) = (vm.id.clone(), vm.hypervisor == "firecracker");
            let ask = Ask::effect(move |op| Effect::ReadVmPid {
                op,
                vm_id,
                firecracker,
            });
            return self.advance(key, CreateStep::PidFile, ask);
        }
        self.vm_up(key, vm, false)
    }

    /// What a failed bring-up left under the VM name: a running VM is the bring-up finished
    /// after all, a stopped one is removed before the failure is reported.
    fn boot_failed_inspected(&mut self, key: &PodKey, c: &CreateOp, error: String, r: Answer) {
        let spec = &c.spec;
        // Only a VM of this very name is the bring-up's: cocoon may answer a lookup by
        // name with a VM whose ID starts with it, which is left alone.
        let vm = r.vm().ok();
        match vm.filter(|v| r.succeeded() && isolation::vm_named(v, &spec.vm_name)) {
            // The bring-up finished after all (a slow clone past its deadline).
            Some(vm) if vm.running() => {
                self.by_name.insert(spec.vm_name.clone(), vm.clone());
                self.vm_up(key, vm, false)
            }
            Some(vm) => {
                let ask = Ask::Cocoon(CocoonCmd::VmRm { id: vm.id });
                self.advance(key, CreateStep::BootFailedRm { error }, ask)
            }
            None => {
                if r.vm_not_found() {
                    self.forget_owner(Owned::Vm, &spec.vm_name);
                }
                self.fail_create(key, &c.uid, &error, true)
            }
        }
    }

    /// The pull of the image's snapshot answered: inspected again, or the create fails.
    fn snapshot_pulled(&mut self, key: &PodKey, c: &CreateOp, r: Result<String, TransferError>) {
        match self.pull_done(key, c, r) {
            Ok(_) => {
                self.metric(MetricUpdate::SnapshotPull { result: "ok" });
                self.pulled_at.insert(c.local_snapshot.clone(), self.now);
                self.advance(
                    key,
                    CreateStep::SnapInspect { pulled: true },
                    Ask::Cocoon(CocoonCmd::SnapshotInspect {
                        name: c.local_snapshot.clone(),
                    }),
                )
            }
            Err(e) => {
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!("pull snapshot {}: {e}", c.spec.image);
                self.fail_create(key, &c.uid, &msg, true)
            }
        }
    }

    /// `mode=run`: the image is available (or not): `vm run` of it.
    fn run_image_ready(&mut self, key: &PodKey, c: &CreateOp, res: Res) {
        let spec = &c.spec;
        match res.transfer_or_cocoon() {
            Ok(boot) => {
                let boot = if boot.is_empty() {
                    spec.image.clone()
                } else {
                    boot
                };
                let r = &spec.resources;
                let args = RunOptions {
                    name: spec.vm_name.clone(),
                    cpu: r.vcpus(),
                    cpu_policy: r.cpu_policy(),
                    memory: r.memory_bytes().map(|b| b.to_string()).unwrap_or_default(),
                    storage: spec
                        .storage_bytes
                        .map(|b| b.to_string())
                        .unwrap_or_default(),
                    network: spec.network.clone(),
                    windows: spec.os == Os::Windows,
                    backend: spec.backend_kind(),
                    no_direct_io: spec.no_direct_io,
                    image: boot,
                };
                self.boot(key, CocoonCmd::VmRun(args))
            }
            Err(e) => {
                let msg = format!("make image {} available: {e}", spec.image);
                self.fail_create(key, &c.uid, &msg, true)
            }
        }
    }

    /// The lookup of an unmanaged pod's VM by its id annotation: adopted only when cocoon
    /// answers with that exact ID and the pod's VM name (an ID prefix, or another VM's ID,
    /// fails the pod for good); not found, or no answer, fails the create and is retried.
    fn unmanaged_found(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
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

    pub(super) fn clone_args(
        &self,
        spec: &VmSpec,
        source: CloneSource,
        pull: bool,
    ) -> CloneOptions {
        CloneOptions {
            name: spec.vm_name.clone(),
            network: spec.network.clone(),
            no_direct_io: spec.no_direct_io,
            pull,
            // Windows guests are restored by copy whatever VK_RESTORE_MODE says (the
            // contract's clone rule for them).
            restore_mode: if spec.firecracker() {
                None
            } else if spec.os == Os::Windows {
                Some(crate::vm::RestoreMode::Copy)
            } else {
                Some(self.cfg.restore_mode)
            },
            nics: None,
            cpu: spec.resources.cpu_policy(),
            backend: spec.backend_kind(),
            source,
        }
    }

    pub(super) fn do_clone(&mut self, key: &PodKey) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let (spec, local, img) = (
            c.spec.clone(),
            c.local_snapshot.clone(),
            c.snapshot_image.clone(),
        );
        let args = self.clone_args(&spec, CloneSource::Snapshot(local), !img.is_empty());
        self.boot(key, CocoonCmd::VmClone(args));
    }

    /// The bring-up call (`vm clone` / `vm run`), once the VM's owner (the pod's namespace) is
    /// on record: a crash after it leaves the VM owned, never ownerless.
    pub(super) fn boot(&mut self, key: &PodKey, cmd: CocoonCmd) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let owner = Owner::new(&key.namespace, &c.uid);
        let name = c.spec.vm_name.clone();
        if let Some(msg) = self.vm_record_refusal(key, &name) {
            let (event, reason) = (
                isolation::EVENT_VM_NOT_IN_NS,
                isolation::REASON_VM_NOT_IN_NS,
            );
            return self.refuse_create(key, event, reason, msg);
        }
        let ask = Self::owned_then(Owned::Vm, &name, owner, Deferred::Cocoon(cmd));
        self.advance(key, CreateStep::Boot, ask)
    }

    /// `mode=run` image materialisation: with a registry and an OCI ref the snapshots room
    /// decides (cloud image import, snapshot artifact refusal, pull fallback); otherwise
    /// `cocoon image pull`.
    pub(super) fn materialise(&self, image: &str, force: bool) -> Ask {
        let image = image.to_string();
        if self.cfg.registry && !spec::is_http_url(&image) {
            Ask::effect(move |op| Effect::MaterialiseImage { op, image, force })
        } else {
            Ask::Cocoon(CocoonCmd::ImagePull {
                reference: image,
                force,
            })
        }
    }
}
