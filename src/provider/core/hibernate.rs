//! Hibernate: a pod asking `hibernate=true` with a live VM is saved, pushed as `<vm>:hibernate`
//! and its VM removed; every failure rolls back to the running VM, never losing VM or snapshot.

use super::machine::Chore;
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

/// The annotation patch of the VM's id and IP (`None`: null them, and the post-clone marker).
fn ids_patch(vm_id: Option<String>, ip: Option<String>) -> BTreeMap<String, Option<String>> {
    let mut ann = BTreeMap::new();
    ann.insert(ANN_VM_ID.to_string(), vm_id.clone());
    ann.insert(ANN_VM_IP.to_string(), ip);
    if vm_id.is_none() {
        ann.insert(spec::ANN_POST_CLONE_STATE.to_string(), None);
    }
    ann
}

/// `hibernate_phase_total{namespace,phase,result}`.
fn phase(cx: &mut Cx, phase: &'static str, ok: bool) {
    cx.metric(MetricUpdate::Hibernate {
        namespace: cx.key.namespace.clone(),
        phase,
        result: if ok { "ok" } else { "failed" },
    });
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
        let mut h = HibernateOp {
            uid: t.uid.clone(),
            vm: vm.clone(),
            step: HibernateStep::Save { retried: false },
            save_started: self.now,
            nic_dropped: false,
            ids_cleared: false,
            vm_event_meanwhile: false,
        };
        let slot = self.slot(key);
        slot.awaiting = None;
        slot.timer = None;
        slot.start_op(h.clone());
        self.set_lifecycle(key, State::Hibernating, "");
        if start_first {
            let ask = Ask::Cocoon(CocoonCmd::VmStart { id: vm.id });
            return self.advance(key, HibernateStep::StartVm, ask);
        }
        let next = h.first_step(&self.cx(key), &t);
        self.hibernate_next(key, h, next)
    }

    /// An answer to the hibernate `h`.
    pub(super) fn hibernate_step(&mut self, key: &PodKey, mut h: HibernateOp, res: Res) {
        let next = h.on_answer(&mut self.cx(key), res);
        self.hibernate_next(key, h, next)
    }

    /// The poll timer of a holder removal waiting for cocoon to let go of the snapshot.
    pub(super) fn hibernate_timer(&mut self, key: &PodKey, h: HibernateOp) {
        let next = h.on_timer(&self.cx(key));
        self.hibernate_next(key, h, next)
    }

    /// An answer no hibernate step expects: fail the way that keeps the VM (rollback).
    pub(super) fn hibernate_unexpected(&mut self, key: &PodKey, msg: &str) {
        let Some(h) = self.op_of::<HibernateOp>(key).cloned() else {
            return;
        };
        if self.tracked_as(key, &h.uid).is_some() {
            let next = h.rollback(fail("UnexpectedAnswer", msg.to_string()));
            self.hibernate_next(key, h, next)
        }
    }

    /// Carries out what a step of the hibernate `h` decided.
    fn hibernate_next(&mut self, key: &PodKey, h: HibernateOp, next: HibernateNext) {
        let Some((h, then)) = self.apply(key, h, next) else {
            return;
        };
        match then {
            HibernateThen::Chore(chores, next) => {
                chores.into_iter().for_each(|c| self.chore(c));
                self.hibernate_next(key, h, *next)
            }
            HibernateThen::Started(next) => {
                if let Some(vm) = self.slot(key).tracked.as_mut().and_then(|t| t.vm.as_mut()) {
                    vm.state = VmState::Running;
                }
                self.hibernate_next(key, h, *next)
            }
            HibernateThen::Hibernated => self.hibernated(key, &h),
            HibernateThen::Restored(fresh, failure) => {
                if let Some(fresh) = fresh {
                    self.hibernate_restored(key, fresh);
                }
                self.hibernate_fail_done(key, &h, failure)
            }
            HibernateThen::Failed(failure) => self.hibernate_fail_done(key, &h, failure),
        }
    }

    /// The rollback re-read the VM after its NIC came back: its NICs (and a DHCP NIC's IP,
    /// learned again) are the VM's now.
    fn hibernate_restored(&mut self, key: &PodKey, fresh: VmInfo) {
        // DHCP NICs come back with new leases: their IP is learned again.
        let dhcp = fresh.nics.first().is_some_and(|n| n.static_ip.is_empty());
        let Some(t) = self.slot(key).tracked.as_mut() else {
            return;
        };
        t.vm = Some(fresh.clone());
        if dhcp {
            t.ip.clear();
        }
        let name = t.spec.vm_name.clone();
        self.by_name.insert(name, fresh);
    }

    /// The VM is gone and its snapshot is safe: the pod stays tracked with no VM (Pending).
    fn hibernated(&mut self, key: &PodKey, h: &HibernateOp) {
        let Some(t) = self.tracked_as(key, &h.uid) else {
            return;
        };
        self.release_leases(&h.vm);
        let name = t.spec.vm_name.clone();
        self.forget_owner(Owned::Vm, &name);
        if self.by_name.get(&name).is_some_and(|v| v.id == h.vm.id) {
            self.by_name.remove(&name);
        }
        self.last_restart.remove(&h.vm.id);
        if !h.ids_cleared {
            self.send_annotations(key, &t.uid, ids_patch(None, None), false);
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

    /// The end of a failed hibernate: the VM runs, its id / ip are written back; Warning,
    /// lifecycle `failed` with a `hibernate: ` message, counter, and the op retry.
    fn hibernate_fail_done(&mut self, key: &PodKey, h: &HibernateOp, failure: OpFailure) {
        let Some(t) = self.tracked_as(key, &h.uid) else {
            return;
        };
        let vm = t.vm.clone().unwrap_or(h.vm.clone());
        let ip = if t.ip.is_empty() {
            vm.primary_ip()
        } else {
            t.ip.clone()
        };
        let patch = ids_patch(Some(vm.id.clone()), Some(ip));
        self.send_annotations(key, &t.uid, patch, false);
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

/// What a hibernate's step leaves to the provider: the chores its answers call for and its
/// endings, which touch the pod's record and the shared indexes.
pub(super) enum HibernateThen {
    /// Chores, then what follows.
    Chore(Vec<Chore>, Box<HibernateNext>),
    /// The stopped VM was started (the pod's record says so), then what follows.
    Started(Box<HibernateNext>),
    /// The VM is gone and its snapshot safe.
    Hibernated,
    /// The rollback re-read the VM (its NIC back) when the inspect answered, then it fails.
    Restored(Option<VmInfo>, OpFailure),
    /// The hibernate failed with the VM in place (any NIC given back): it ends with `failure`.
    Failed(OpFailure),
}

type HibernateNext = Next<HibernateStep, HibernateThen>;

impl HibernateOp {
    /// The pod's tracked incarnation while it is this op's.
    fn tracked<'a>(&self, cx: &Cx<'a>) -> Option<&'a Tracked> {
        cx.tracked.filter(|t| t.uid == self.uid)
    }

    /// The first step on a running VM: the DHCP release before a NIC drop, or the save.
    fn first_step(&mut self, cx: &Cx, t: &Tracked) -> HibernateNext {
        if drops_nic(&t.spec) {
            let ask = Ask::Cocoon(CocoonCmd::VmExec {
                deadline: GUEST_EXEC_DEADLINE,
                id: self.vm.id.clone(),
                command: ipconfig("/release"),
            });
            return Next::Ask(HibernateStep::DhcpRelease, ask);
        }
        self.save(cx, t, false)
    }

    fn save(&mut self, cx: &Cx, t: &Tracked, retried: bool) -> HibernateNext {
        let vm_name = &t.spec.vm_name;
        // A local snapshot of the name recorded for another namespace is neither replaced
        // nor re-recorded.
        if cx.snapshot_of_another(vm_name) {
            let msg = format!(
                "the local snapshot {vm_name} is not recorded for namespace {}",
                cx.key.namespace
            );
            return self.rollback(not_in_namespace(msg));
        }
        self.save_started = cx.now;
        let save = CocoonCmd::SnapshotSave {
            name: vm_name.clone(),
            vm_id: self.vm.id.clone(),
            deadline: None,
        };
        let owner = Owner::new(&cx.key.namespace, &t.uid);
        let ask = Provider::owned_then(Owned::Snapshot, vm_name, owner, Deferred::Cocoon(save));
        Next::Ask(HibernateStep::Save { retried }, ask)
    }

    /// An answer to this hibernate.
    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> HibernateNext {
        let Some(t) = self.tracked(cx) else {
            // The incarnation changed under the op: it has nothing left to say.
            return Next::End;
        };
        let key = cx.key;
        let vm_name = t.spec.vm_name.clone();
        match (self.step.clone(), res) {
            (HibernateStep::StartVm, Res::Cocoon(r)) => {
                if !r.succeeded() {
                    let (id, e) = (&self.vm.id, r.error_text());
                    let msg = format!("start vm {id} to resume hibernate: {e}");
                    return self.rollback(fail("ResumeStartFailed", msg));
                }
                let next = self.first_step(cx, t);
                Next::Then(HibernateThen::Started(Box::new(next)))
            }
            (HibernateStep::DhcpRelease, Res::Cocoon(r)) => {
                // Best effort: the guest may not answer; the NIC goes either way.
                phase(cx, "dhcp_release", r.succeeded());
                let id = self.vm.id.clone();
                let ask = Ask::Cocoon(CocoonCmd::VmNet { id, nics: 0 });
                Next::Ask(HibernateStep::NetDrop, ask)
            }
            (HibernateStep::NetDrop, Res::Cocoon(r)) => {
                phase(cx, "net_resize", r.succeeded());
                if !r.succeeded() {
                    // The NIC may still be there: nudge the guest to renew, detached.
                    let renew = Chore::Detached(CocoonCmd::VmExec {
                        deadline: GUEST_EXEC_DEADLINE,
                        id: self.vm.id.clone(),
                        command: ipconfig("/renew"),
                    });
                    let msg = format!("vm net --nics 0 {}: {}", self.vm.id, r.error_text());
                    let failed = self.rollback(fail("HibernateNetResizeFailed", msg));
                    return Next::Then(HibernateThen::Chore(vec![renew], Box::new(failed)));
                }
                self.nic_dropped = true;
                self.save(cx, t, false)
            }
            (HibernateStep::Save { retried }, Res::Cocoon(r)) => self.saved(cx, t, retried, r),
            (HibernateStep::RmHolder { until }, Res::Cocoon(r)) => {
                let in_use = r.kind() == Some(&ErrorKind::SnapshotInUse);
                if in_use && cx.now + HOLDER_RETRY <= until {
                    let at = cx.now + HOLDER_RETRY;
                    return Next::Ask(HibernateStep::RmHolderWait { until }, Ask::Timer(at));
                }
                self.save(cx, t, true)
            }
            (HibernateStep::PushCheck, Res::Evidence(r)) => self.push_checked(cx, t, r),
            (HibernateStep::Push, Res::Transfer(r)) => {
                let ok = r.is_ok();
                let result = if ok { "ok" } else { "failed" };
                cx.metric(MetricUpdate::SnapshotPush { result });
                phase(cx, "push", ok);
                match r {
                    Ok(_) => self.clear_ids(cx, t),
                    Err(e) => {
                        let msg = format!("push {vm_name}:{HIBERNATE_TAG}: {e}");
                        self.rollback(fail("HibernatePushFailed", msg))
                    }
                }
            }
            (HibernateStep::ClearIds, Res::Kube(r)) => {
                if let Err(e) = &r {
                    log::warn!("provider: {key}: clear id/ip before hibernate removal: {e:?}; sent again after removal");
                } else {
                    self.ids_cleared = true;
                }
                if !self.still_wanted(cx) {
                    return self.withdraw(cx, &vm_name);
                }
                let ask = Ask::Cocoon(CocoonCmd::VmRm {
                    id: self.vm.id.clone(),
                });
                Next::Ask(HibernateStep::Rm, ask)
            }
            (HibernateStep::Rm, Res::Cocoon(r)) => self.removed(cx, &vm_name, r),
            (HibernateStep::DeleteTag { failure }, Res::Transfer(r)) => {
                if let Err(e) = r {
                    log::warn!("provider: {key}: delete {vm_name}:{HIBERNATE_TAG} after a failed removal: {e}");
                }
                self.rollback(failure)
            }
            (HibernateStep::RestoreNic { failure }, Res::Cocoon(r)) => {
                if !r.succeeded() {
                    let (id, e) = (&self.vm.id, r.error_text());
                    log::warn!("provider: {key}: give vm {id} its NIC back: {e}");
                }
                let reference = self.vm.id.clone();
                let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
                Next::Ask(HibernateStep::RestoreInspect { failure }, ask)
            }
            (HibernateStep::RestoreInspect { failure }, Res::Cocoon(r)) => {
                let fresh = r.vm().ok().filter(|_| r.succeeded());
                Next::Then(HibernateThen::Restored(fresh, failure))
            }
            (step, res) => Next::Unexpected(step, res),
        }
    }

    /// The `snapshot save` answered: pushed (or cleared without a registry), its name's
    /// holder removed once, or the hibernate fails.
    fn saved(&mut self, cx: &mut Cx, t: &Tracked, retried: bool, r: Answer) -> HibernateNext {
        let vm_name = t.spec.vm_name.clone();
        let secs = cx.now.saturating_duration_since(self.save_started);
        cx.metric(MetricUpdate::SnapshotSaveDuration {
            namespace: cx.key.namespace.clone(),
            seconds: secs.as_secs_f64(),
        });
        if r.succeeded() {
            cx.metric(MetricUpdate::SnapshotSave { result: "ok" });
            phase(cx, "snapshot", true);
            return self.push(cx, t);
        }
        if r.name_taken() && !retried {
            // An earlier save (a failed push, or a daemon killed after its save) holds
            // the name: that copy is replaced, its registry tag is not touched.
            let holder = match r.kind() {
                Some(ErrorKind::SnapshotNameTaken { holder: Some(id) }) => id.clone(),
                _ => vm_name.clone(),
            };
            let until = cx.now + HOLDER_BUDGET;
            let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name: holder });
            return Next::Ask(HibernateStep::RmHolder { until }, ask);
        }
        cx.metric(MetricUpdate::SnapshotSave { result: "failed" });
        phase(cx, "snapshot", false);
        let msg = format!("snapshot save {vm_name}: {}", r.error_text());
        self.rollback(fail("HibernateSnapshotFailed", msg))
    }

    /// After the save: the registry's tag is read before the push, or (no registry) the ids
    /// are cleared.
    fn push(&self, cx: &Cx, t: &Tracked) -> HibernateNext {
        if !cx.cfg.registry {
            return self.clear_ids(cx, t);
        }
        let (repo, tag) = (t.spec.vm_name.clone(), HIBERNATE_TAG.to_string());
        let ask = Ask::effect(|op| Effect::ReadSnapshotTag { op, repo, tag });
        Next::Ask(HibernateStep::PushCheck, ask)
    }

    /// The registry's `<vm>:hibernate`, read before the push: another namespace's is never
    /// pushed over.
    fn push_checked(
        &self,
        cx: &mut Cx,
        t: &Tracked,
        r: Result<Option<HibernateTag>, TransferError>,
    ) -> HibernateNext {
        let vm_name = t.spec.vm_name.clone();
        let refusal = match r {
            Ok(Some(tag)) if isolation::tag_of_another(cx.key, &tag) => not_in_namespace(format!(
                "{vm_name}:{HIBERNATE_TAG} in the registry is not recorded for namespace {}; it \
                 is not replaced",
                cx.key.namespace
            )),
            Ok(_) => return self.push_now(cx, t),
            Err(e) => fail(
                "HibernatePushFailed",
                format!("read {vm_name}:{HIBERNATE_TAG} before the push: {e}"),
            ),
        };
        cx.metric(MetricUpdate::SnapshotPush { result: "failed" });
        phase(cx, "push", false);
        self.rollback(refusal)
    }

    /// The push, once the tag it replaces is known not to be another namespace's.
    fn push_now(&self, cx: &Cx, t: &Tracked) -> HibernateNext {
        let (name, image) = (t.spec.vm_name.clone(), t.spec.image.clone());
        let owner = Owner::new(&cx.key.namespace, &t.uid);
        let ask = Ask::effect(|op| Effect::PushSnapshot {
            op,
            local_name: name.clone(),
            repo: name,
            tag: HIBERNATE_TAG.into(),
            base_image: image,
            owner,
        });
        Next::Ask(HibernateStep::Push, ask)
    }

    /// Null the VM's id / ip annotations before it goes, unless the pod stopped asking.
    fn clear_ids(&self, cx: &Cx, t: &Tracked) -> HibernateNext {
        if !self.still_wanted(cx) {
            return self.withdraw(cx, &t.spec.vm_name);
        }
        let ann = ids_patch(None, None);
        let (pod, uid) = (cx.key.clone(), t.uid.clone());
        let ask = Ask::effect(move |op| Effect::PatchPodAnnotations {
            op,
            key: pod,
            uid: Some(uid),
            annotations: ann,
        });
        Next::Ask(HibernateStep::ClearIds, ask)
    }

    /// The VM's removal answered: hibernated, or the pushed tag is dropped and the VM rolled
    /// back.
    fn removed(&self, cx: &mut Cx, vm_name: &str, r: Answer) -> HibernateNext {
        if r.succeeded() || r.vm_not_found() {
            phase(cx, "remove", true);
            return Next::Then(HibernateThen::Hibernated);
        }
        phase(cx, "remove", false);
        let failure = fail(
            "HibernateRemoveFailed",
            format!("vm rm {}: {}", self.vm.id, r.error_text()),
        );
        if !cx.cfg.registry {
            return self.rollback(failure);
        }
        // The tag claims a hibernated VM that still runs: drop it before anything else.
        let (repo, tag) = (vm_name.to_string(), HIBERNATE_TAG.to_string());
        let ask = Ask::effect(|op| Effect::DeleteSnapshotTag { op, repo, tag });
        Next::Ask(HibernateStep::DeleteTag { failure }, ask)
    }

    /// Whether the pod's latest copy still asks for hibernate (the op does not stop for an
    /// update; it looks before the VM goes).
    fn still_wanted(&self, cx: &Cx) -> bool {
        cx.latest
            .filter(|p| pod_uid(p) == self.uid && !deleting(p))
            .and_then(|p| spec::parse(p).ok())
            .is_some_and(|s| s.hibernate)
    }

    /// The pod no longer asks for hibernate and its VM still runs: undo the tag (it would
    /// claim a hibernation that did not happen) and keep the VM, as a failed removal does.
    fn withdraw(&self, cx: &Cx, vm_name: &str) -> HibernateNext {
        if !cx.cfg.registry {
            return self.rollback(withdrawn());
        }
        let (repo, tag) = (vm_name.to_string(), HIBERNATE_TAG.to_string());
        let ask = Ask::effect(|op| Effect::DeleteSnapshotTag { op, repo, tag });
        let failure = withdrawn();
        Next::Ask(HibernateStep::DeleteTag { failure }, ask)
    }

    /// A step failed with the VM still in place: give it its NIC back if it was dropped,
    /// then report.
    fn rollback(&self, failure: OpFailure) -> HibernateNext {
        if self.nic_dropped {
            let ask = Ask::Cocoon(CocoonCmd::VmNet {
                id: self.vm.id.clone(),
                nics: 1,
            });
            return Next::Ask(HibernateStep::RestoreNic { failure }, ask);
        }
        Next::Then(HibernateThen::Failed(failure))
    }

    fn on_timer(&self, cx: &Cx) -> HibernateNext {
        let Some(t) = self.tracked(cx) else {
            return Next::Wait;
        };
        let HibernateStep::RmHolderWait { until } = self.step else {
            return Next::Wait;
        };
        let name = t.spec.vm_name.clone();
        let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name });
        Next::Ask(HibernateStep::RmHolder { until }, ask)
    }
}
