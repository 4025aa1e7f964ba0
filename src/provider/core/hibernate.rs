//! Hibernate: a pod asking `hibernate=true` with a live VM is saved, pushed as `<vm>:hibernate`
//! and its VM removed; every failure rolls back to the running VM, never losing VM or snapshot.

use super::*;
use crate::vm::ErrorKind;

/// The tag a hibernated VM's snapshot is pushed under (repository = VM name).
pub(super) const HIBERNATE_TAG: &str = "hibernate";
/// How long the holder of a taken snapshot name is retried while cocoon says it is in use.
const HOLDER_BUDGET: Duration = Duration::from_secs(30);
const HOLDER_RETRY: Duration = Duration::from_millis(500);
/// How long a guest command of the core may run (the DHCP release before a NIC drop is best
/// effort and capped at 20 s by the hibernate contract).
const GUEST_EXEC_DEADLINE: Duration = Duration::from_secs(20);

/// The guest commands around a Windows NIC drop: fixed argv, nothing from the pod.
fn ipconfig(verb: &str) -> Vec<String> {
    ["cmd", "/c", "ipconfig", verb]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// CH + Windows guests lose their NIC before the save (the exact backend string, as the
/// contract says: an empty backend does not take this path).
pub(super) fn drops_nic(spec: &VmSpec) -> bool {
    spec.backend == spec::BACKEND_CH && spec.os == Os::Windows
}

fn fail(reason: &'static str, message: String) -> OpFailure {
    OpFailure {
        reason,
        message,
        metric_reason: "",
    }
}

/// A hibernate refused: its snapshot would replace another namespace's.
fn not_in_namespace(message: String) -> OpFailure {
    OpFailure {
        reason: isolation::EVENT_SNAPSHOT_NOT_IN_NS,
        message,
        metric_reason: isolation::REASON_SNAPSHOT_NOT_IN_NS,
    }
}

/// Not a failure: the pod stopped asking for hibernate before its VM was removed.
const WITHDRAWN: &str = "";

fn withdrawn() -> OpFailure {
    fail(
        WITHDRAWN,
        "hibernate withdrawn before the VM was removed".into(),
    )
}

impl Provider {
    /// Start hibernating the tracked VM of `key`. `start_first`: the VM is not running (owed
    /// hibernate after a restart) and is started before anything else.
    pub(super) fn start_hibernate(&mut self, key: &PodKey, start_first: bool) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.clone()) else {
            return;
        };
        let Some(vm) = t.vm.clone() else {
            return;
        };
        let now = self.now;
        let slot = self.slot(key);
        slot.awaiting = None;
        slot.timer = None;
        slot.start_op(HibernateOp {
            uid: t.uid.clone(),
            vm: vm.clone(),
            step: HibernateStep::Save { retried: false },
            save_started: now,
            nic_dropped: false,
            ids_cleared: false,
            vm_event_meanwhile: false,
        });
        self.set_lifecycle(key, State::Hibernating, "");
        if start_first {
            let ask = Ask::Cocoon(CocoonCmd::VmStart { id: vm.id });
            return self.advance(key, HibernateStep::StartVm, ask);
        }
        self.hibernate_first_step(key, &t.spec, &vm);
    }

    fn hibernate_first_step(&mut self, key: &PodKey, spec: &VmSpec, vm: &VmInfo) {
        if drops_nic(spec) {
            let ask = Ask::Cocoon(CocoonCmd::VmExec {
                deadline: GUEST_EXEC_DEADLINE,
                id: vm.id.clone(),
                command: ipconfig("/release"),
            });
            return self.advance(key, HibernateStep::DhcpRelease, ask);
        }
        self.hibernate_save(key, false);
    }

    /// The running hibernate as it stands now, with the incarnation it runs for.
    fn hibernate_op(&self, key: &PodKey) -> Option<(HibernateOp, Tracked)> {
        let h = self.op_of::<HibernateOp>(key)?.clone();
        let t = self.tracked_as(key, &h.uid)?;
        Some((h, t))
    }

    fn hibernate_save(&mut self, key: &PodKey, retried: bool) {
        let Some((h, t)) = self.hibernate_op(key) else {
            return;
        };
        // A local snapshot of the name recorded for another namespace is neither replaced
        // nor re-recorded.
        if self.snapshot_of_another(key, &t.spec.vm_name) {
            let msg = format!(
                "the local snapshot {} is not recorded for namespace {}",
                t.spec.vm_name, key.namespace
            );
            return self.hibernate_failed(key, not_in_namespace(msg));
        }
        let now = self.now;
        if let Some(h) = self.op_of_mut::<HibernateOp>(key) {
            h.save_started = now;
        }
        let save = CocoonCmd::SnapshotSave {
            name: t.spec.vm_name.clone(),
            vm_id: h.vm.id.clone(),
            deadline: None,
        };
        let owner = Owner::new(&key.namespace, &t.uid);
        let ask = Self::owned_then(
            Owned::Snapshot,
            &t.spec.vm_name,
            owner,
            Deferred::Cocoon(save),
        );
        self.advance(key, HibernateStep::Save { retried }, ask)
    }

    fn phase(&mut self, key: &PodKey, phase: &'static str, ok: bool) {
        self.metric(MetricUpdate::Hibernate {
            namespace: key.namespace.clone(),
            phase,
            result: if ok { "ok" } else { "failed" },
        });
    }

    /// An answer to the hibernate `h`.
    pub(super) fn hibernate_step(&mut self, key: &PodKey, h: HibernateOp, res: Res) {
        let Some(t) = self.tracked_as(key, &h.uid) else {
            // The incarnation changed under the op: it has nothing left to say.
            return self.end_op(key);
        };
        let vm_name = t.spec.vm_name.clone();
        match (h.step.clone(), res) {
            (HibernateStep::StartVm, Res::Cocoon(r)) => {
                if !r.succeeded() {
                    let msg = format!(
                        "start vm {} to resume hibernate: {}",
                        h.vm.id,
                        r.error_text()
                    );
                    return self.hibernate_failed(key, fail("ResumeStartFailed", msg));
                }
                if let Some(vm) = self.slot(key).tracked.as_mut().and_then(|t| t.vm.as_mut()) {
                    vm.state = VmState::Running;
                }
                self.hibernate_first_step(key, &t.spec, &h.vm)
            }
            (HibernateStep::DhcpRelease, Res::Cocoon(r)) => {
                // Best effort: the guest may not answer; the NIC goes either way.
                self.phase(key, "dhcp_release", r.succeeded());
                let ask = Ask::Cocoon(CocoonCmd::VmNet {
                    id: h.vm.id.clone(),
                    nics: 0,
                });
                self.advance(key, HibernateStep::NetDrop, ask)
            }
            (HibernateStep::NetDrop, Res::Cocoon(r)) => {
                self.phase(key, "net_resize", r.succeeded());
                if !r.succeeded() {
                    // The NIC may still be there: nudge the guest to renew, detached.
                    self.fire_and_forget_cocoon(CocoonCmd::VmExec {
                        deadline: GUEST_EXEC_DEADLINE,
                        id: h.vm.id.clone(),
                        command: ipconfig("/renew"),
                    });
                    let msg = format!("vm net --nics 0 {}: {}", h.vm.id, r.error_text());
                    return self.hibernate_failed(key, fail("HibernateNetResizeFailed", msg));
                }
                if let Some(h) = self.op_of_mut::<HibernateOp>(key) {
                    h.nic_dropped = true;
                }
                self.hibernate_save(key, false)
            }
            (HibernateStep::Save { retried }, Res::Cocoon(r)) => {
                self.hibernate_saved(key, &h, &t, retried, r)
            }
            (HibernateStep::RmHolder { until }, Res::Cocoon(r)) => {
                let in_use = r.kind() == Some(&ErrorKind::SnapshotInUse);
                if in_use && self.now + HOLDER_RETRY <= until {
                    let at = self.now + HOLDER_RETRY;
                    return self.advance(
                        key,
                        HibernateStep::RmHolderWait { until },
                        Ask::Timer(at),
                    );
                }
                self.hibernate_save(key, true)
            }
            (HibernateStep::PushCheck, Res::Evidence(r)) => self.hibernate_push_checked(key, &t, r),
            (HibernateStep::Push, Res::Transfer(r)) => match r {
                Ok(_) => {
                    self.metric(MetricUpdate::SnapshotPush { result: "ok" });
                    self.phase(key, "push", true);
                    self.hibernate_clear_ids(key, &t)
                }
                Err(e) => {
                    self.metric(MetricUpdate::SnapshotPush { result: "failed" });
                    self.phase(key, "push", false);
                    let msg = format!("push {vm_name}:{HIBERNATE_TAG}: {e}");
                    self.hibernate_failed(key, fail("HibernatePushFailed", msg))
                }
            },
            (HibernateStep::ClearIds, Res::Kube(r)) => {
                if let Err(e) = &r {
                    log::warn!("provider: {key}: clear id/ip before hibernate removal: {e:?}; sent again after removal");
                } else if let Some(h) = self.op_of_mut::<HibernateOp>(key) {
                    h.ids_cleared = true;
                }
                if !self.hibernate_still_wanted(key, &h.uid) {
                    return self.hibernate_withdraw(key, &vm_name);
                }
                let ask = Ask::Cocoon(CocoonCmd::VmRm {
                    id: h.vm.id.clone(),
                });
                self.advance(key, HibernateStep::Rm, ask)
            }
            (HibernateStep::Rm, Res::Cocoon(r)) => self.hibernate_removed(key, &h, &t, r),
            (HibernateStep::DeleteTag { failure }, Res::Transfer(r)) => {
                if let Err(e) = r {
                    log::warn!("provider: {key}: delete {vm_name}:{HIBERNATE_TAG} after a failed removal: {e}");
                }
                self.hibernate_rollback(key, failure)
            }
            (HibernateStep::RestoreNic { failure }, Res::Cocoon(r)) => {
                if !r.succeeded() {
                    log::warn!(
                        "provider: {key}: give vm {} its NIC back: {}",
                        h.vm.id,
                        r.error_text()
                    );
                }
                let ask = Ask::Cocoon(CocoonCmd::VmInspect {
                    reference: h.vm.id.clone(),
                });
                self.advance(key, HibernateStep::RestoreInspect { failure }, ask)
            }
            (HibernateStep::RestoreInspect { failure }, Res::Cocoon(r)) => {
                self.hibernate_restore_inspected(key, &t, failure, r)
            }
            (step, res) => self.unexpected_answer(key, &step, &res),
        }
    }

    /// The poll timer of a holder removal waiting for cocoon to let go of the snapshot.
    /// The `snapshot save` answered: pushed (or cleared without a registry), its name's
    /// holder removed once, or the hibernate fails.
    fn hibernate_saved(
        &mut self,
        key: &PodKey,
        h: &HibernateOp,
        t: &Tracked,
        retried: bool,
        r: Answer,
    ) {
        let vm_name = t.spec.vm_name.clone();
        let secs = self.now.saturating_duration_since(h.save_started);
        self.metric(MetricUpdate::SnapshotSaveDuration {
            namespace: key.namespace.clone(),
            seconds: secs.as_secs_f64(),
        });
        if r.succeeded() {
            self.metric(MetricUpdate::SnapshotSave { result: "ok" });
            self.phase(key, "snapshot", true);
            return self.hibernate_push(key, t);
        }
        if r.name_taken() && !retried {
            // An earlier save (a failed push, or a daemon killed after its save) holds
            // the name: that copy is replaced, its registry tag is not touched.
            let holder = match r.kind() {
                Some(ErrorKind::SnapshotNameTaken { holder: Some(id) }) => id.clone(),
                _ => vm_name.clone(),
            };
            let until = self.now + HOLDER_BUDGET;
            return self.advance(
                key,
                HibernateStep::RmHolder { until },
                Ask::Cocoon(CocoonCmd::SnapshotRm { name: holder }),
            );
        }
        self.metric(MetricUpdate::SnapshotSave { result: "failed" });
        self.phase(key, "snapshot", false);
        let msg = format!("snapshot save {vm_name}: {}", r.error_text());
        self.hibernate_failed(key, fail("HibernateSnapshotFailed", msg))
    }

    /// The registry's `<vm>:hibernate`, read before the push: another namespace's is never
    /// pushed over.
    fn hibernate_push_checked(
        &mut self,
        key: &PodKey,
        t: &Tracked,
        r: Result<Option<HibernateTag>, TransferError>,
    ) {
        let vm_name = t.spec.vm_name.clone();
        match r {
            Ok(Some(tag)) if isolation::tag_of_another(key, &tag) => {
                self.metric(MetricUpdate::SnapshotPush { result: "failed" });
                self.phase(key, "push", false);
                let msg = format!(
                    "{vm_name}:{HIBERNATE_TAG} in the registry is not recorded for \
                         namespace {}; it is not replaced",
                    key.namespace
                );
                self.hibernate_failed(key, not_in_namespace(msg))
            }
            Ok(_) => self.hibernate_push_now(key, t),
            Err(e) => {
                self.metric(MetricUpdate::SnapshotPush { result: "failed" });
                self.phase(key, "push", false);
                let msg = format!("read {vm_name}:{HIBERNATE_TAG} before the push: {e}");
                self.hibernate_failed(key, fail("HibernatePushFailed", msg))
            }
        }
    }

    /// The VM's removal answered: hibernated, or the pushed tag is dropped and the VM rolled
    /// back.
    fn hibernate_removed(&mut self, key: &PodKey, h: &HibernateOp, t: &Tracked, r: Answer) {
        let vm_name = t.spec.vm_name.clone();
        if r.succeeded() || r.vm_not_found() {
            self.phase(key, "remove", true);
            return self.hibernated(key, h, t);
        }
        self.phase(key, "remove", false);
        let failure = fail(
            "HibernateRemoveFailed",
            format!("vm rm {}: {}", h.vm.id, r.error_text()),
        );
        if !self.cfg.registry {
            return self.hibernate_failed(key, failure);
        }
        // The tag claims a hibernated VM that still runs: drop it before anything else.
        let (repo, tag) = (vm_name.clone(), HIBERNATE_TAG.to_string());
        let ask = Ask::effect(|op| Effect::DeleteSnapshotTag { op, repo, tag });
        self.advance(key, HibernateStep::DeleteTag { failure }, ask)
    }

    /// The rollback's re-read of the VM after its NIC came back: its NICs (and a DHCP
    /// NIC's IP, learned again) are the VM's now.
    fn hibernate_restore_inspected(
        &mut self,
        key: &PodKey,
        t: &Tracked,
        failure: OpFailure,
        r: Answer,
    ) {
        let vm_name = t.spec.vm_name.clone();
        if let (true, Ok(fresh)) = (r.succeeded(), r.vm()) {
            // DHCP NICs come back with new leases: their IP is learned again.
            let dhcp = fresh.nics.first().is_some_and(|n| n.static_ip.is_empty());
            if let Some(t) = self.slot(key).tracked.as_mut() {
                t.vm = Some(fresh.clone());
                if dhcp {
                    t.ip.clear();
                }
            }
            self.by_name.insert(vm_name.clone(), fresh);
        }
        self.hibernate_fail_done(key, failure)
    }

    pub(super) fn hibernate_timer(&mut self, key: &PodKey, h: HibernateOp) {
        let Some(t) = self.tracked_as(key, &h.uid) else {
            return;
        };
        if let HibernateStep::RmHolderWait { until } = h.step {
            let ask = Ask::Cocoon(CocoonCmd::SnapshotRm {
                name: t.spec.vm_name.clone(),
            });
            self.advance(key, HibernateStep::RmHolder { until }, ask);
        }
    }

    fn hibernate_push(&mut self, key: &PodKey, t: &Tracked) {
        if !self.cfg.registry {
            return self.hibernate_clear_ids(key, t);
        }
        let (repo, tag) = (t.spec.vm_name.clone(), HIBERNATE_TAG.to_string());
        let ask = Ask::effect(|op| Effect::ReadSnapshotTag { op, repo, tag });
        self.advance(key, HibernateStep::PushCheck, ask)
    }

    /// The push, once the tag it replaces is known not to be another namespace's.
    fn hibernate_push_now(&mut self, key: &PodKey, t: &Tracked) {
        let (name, image) = (t.spec.vm_name.clone(), t.spec.image.clone());
        let owner = Owner::new(&key.namespace, &t.uid);
        let ask = Ask::effect(|op| Effect::PushSnapshot {
            op,
            local_name: name.clone(),
            repo: name,
            tag: HIBERNATE_TAG.into(),
            base_image: image,
            owner,
        });
        self.advance(key, HibernateStep::Push, ask)
    }

    fn ids_patch(vm_id: Option<String>, ip: Option<String>) -> BTreeMap<String, Option<String>> {
        let mut ann = BTreeMap::new();
        ann.insert(ANN_VM_ID.to_string(), vm_id.clone());
        ann.insert(ANN_VM_IP.to_string(), ip);
        if vm_id.is_none() {
            ann.insert(spec::ANN_POST_CLONE_STATE.to_string(), None);
        }
        ann
    }

    /// Whether the pod's latest copy still asks for hibernate (the op does not stop for an
    /// update; it looks before the VM goes).
    fn hibernate_still_wanted(&self, key: &PodKey, uid: &str) -> bool {
        self.slots
            .get(key)
            .and_then(|s| s.latest.as_ref())
            .filter(|p| pod_uid(p) == uid && !deleting(p))
            .and_then(|p| spec::parse(p).ok())
            .is_some_and(|s| s.hibernate)
    }

    /// The pod no longer asks for hibernate and its VM still runs: undo the tag (it would
    /// claim a hibernation that did not happen) and keep the VM, as a failed removal does.
    fn hibernate_withdraw(&mut self, key: &PodKey, vm_name: &str) {
        if !self.cfg.registry {
            return self.hibernate_rollback(key, withdrawn());
        }
        let (repo, tag) = (vm_name.to_string(), HIBERNATE_TAG.to_string());
        let ask = Ask::effect(|op| Effect::DeleteSnapshotTag { op, repo, tag });
        self.advance(
            key,
            HibernateStep::DeleteTag {
                failure: withdrawn(),
            },
            ask,
        )
    }

    fn hibernate_clear_ids(&mut self, key: &PodKey, t: &Tracked) {
        if let Some((h, _)) = self.hibernate_op(key) {
            if !self.hibernate_still_wanted(key, &h.uid) {
                return self.hibernate_withdraw(key, &t.spec.vm_name);
            }
        }
        let ann = Self::ids_patch(None, None);
        let (pod, uid) = (key.clone(), t.uid.clone());
        let ask = Ask::effect(move |op| Effect::PatchPodAnnotations {
            op,
            key: pod,
            uid: Some(uid),
            annotations: ann,
        });
        self.advance(key, HibernateStep::ClearIds, ask)
    }

    /// The VM is gone and its snapshot is safe: the pod stays tracked with no VM (Pending).
    fn hibernated(&mut self, key: &PodKey, h: &HibernateOp, t: &Tracked) {
        self.release_leases(&h.vm);
        let name = t.spec.vm_name.clone();
        self.forget_owner(Owned::Vm, &name);
        if self.by_name.get(&name).is_some_and(|v| v.id == h.vm.id) {
            self.by_name.remove(&name);
        }
        self.last_restart.remove(&h.vm.id);
        if !h.ids_cleared {
            self.send_annotations(key, &t.uid, Self::ids_patch(None, None), false);
        }
        {
            let slot = self.slot(key);
            slot.update_retry = None;
            if let Some(t) = slot.tracked.as_mut() {
                t.vm = None;
                t.ip.clear();
                t.spec.vm_id.clear();
                t.spec.vm_ip.clear();
                t.probe = None;
            }
        }
        self.out.push(Effect::StopProbe { key: key.clone() });
        self.set_lifecycle(key, State::Hibernated, "");
        let msg = if self.cfg.registry {
            "snapshot pushed to registry"
        } else {
            "snapshot saved locally (no registry pusher configured)"
        };
        self.event(key, &t.uid, EventType::Normal, "Hibernated", msg);
        self.update_succeeded(key, &t.uid);
        self.slot(key).finish_op();
        self.push_status(key, false);
        self.reconcile_slot(key);
    }

    /// A step failed with the VM still in place: roll back, then report.
    fn hibernate_failed(&mut self, key: &PodKey, failure: OpFailure) {
        self.hibernate_rollback(key, failure)
    }

    /// An answer no hibernate step expects: fail the way that keeps the VM (rollback).
    pub(super) fn hibernate_unexpected(&mut self, key: &PodKey, msg: &str) {
        self.hibernate_rollback(key, fail("UnexpectedAnswer", msg.to_string()))
    }

    fn hibernate_rollback(&mut self, key: &PodKey, failure: OpFailure) {
        let Some((h, _)) = self.hibernate_op(key) else {
            return;
        };
        if h.nic_dropped {
            let ask = Ask::Cocoon(CocoonCmd::VmNet {
                id: h.vm.id.clone(),
                nics: 1,
            });
            return self.advance(key, HibernateStep::RestoreNic { failure }, ask);
        }
        self.hibernate_fail_done(key, failure)
    }

    /// The end of a failed hibernate: the VM runs, its id / ip are written back; Warning,
    /// lifecycle `failed` with a `hibernate: ` message, counter, and the op retry.
    fn hibernate_fail_done(&mut self, key: &PodKey, failure: OpFailure) {
        let Some((h, t)) = self.hibernate_op(key) else {
            return;
        };
        let vm = t.vm.clone().unwrap_or(h.vm.clone());
        let ip = if t.ip.is_empty() {
            vm.primary_ip()
        } else {
            t.ip.clone()
        };
        self.send_annotations(
            key,
            &t.uid,
            Self::ids_patch(Some(vm.id.clone()), Some(ip)),
            false,
        );
        if h.nic_dropped && drops_nic(&t.spec) {
            self.fire_and_forget_cocoon(CocoonCmd::VmExec {
                deadline: GUEST_EXEC_DEADLINE,
                id: vm.id.clone(),
                command: ipconfig("/renew"),
            });
        }
        if failure.reason == WITHDRAWN {
            log::info!("provider: {key}: {}", failure.message);
            let slot = self.slot(key);
            slot.finish_op();
            slot.update_retry = None;
            self.set_lifecycle(key, State::Creating, "");
            self.publish_ready(key);
            self.reconcile_slot(key);
        } else {
            let err = format!("hibernate: {}", failure.message);
            self.update_failed_as(key, &t.uid, failure.reason, failure.metric_reason, &err);
        }
        if h.vm_event_meanwhile {
            // The VM may have died under the hibernate: look at it now.
            self.defer_check(key, t.uid.clone(), vm.id.clone());
        }
        if t.ip.is_empty() {
            self.refresh_ip(key);
        }
    }

    /// A VM event about the VM being hibernated: remembered for after the op.
    pub(super) fn hibernate_saw_vm_event(&mut self, key: &PodKey) -> bool {
        match self.op_of_mut::<HibernateOp>(key) {
            Some(h) => {
                h.vm_event_meanwhile = true;
                true
            }
            None => false,
        }
    }
}
