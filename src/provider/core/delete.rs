//! Delete: the API-first / snapshot save, push, rm / API-last steps of a pod's deletion, and
//! the DELETE of API objects the core no longer tracks.

use super::machine::Chore;
use super::*;

/// Why a delete failed: the pod's VM is kept and the delete retried on the pod's backoff.
/// `Display` is the text of the `ProviderDeleteFailed` Warning (before " (VM kept)").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum DeleteError {
    /// The look-up of the pod's VM (by `reference`, its id or name) failed.
    Lookup { reference: String, error: String },
    /// `vm inspect` before the snapshot save failed.
    Inspect { vm_id: String, error: String },
    /// The snapshot save before delete failed.
    Save { vm_name: String, error: String },
    /// The read of `<vm>:latest` in the registry before the push failed.
    ReadLatest { vm_name: String, error: String },
    /// The snapshot push before delete failed.
    Push { vm_name: String, error: String },
    /// `vm rm` failed.
    Rm { vm_id: String, error: String },
    /// `cocoon-macos vm rm` failed.
    MacosRm { vm_name: String, error: String },
    /// An answer the delete's step does not expect (the `UnexpectedAnswer` text).
    Unexpected(String),
}

impl std::fmt::Display for DeleteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeleteError::Lookup { reference, error } => {
                write!(f, "look up vm {reference} before delete: {error}")
            }
            DeleteError::Inspect { vm_id, error } => {
                write!(f, "inspect vm {vm_id} before delete: {error}")
            }
            DeleteError::Save { vm_name, error } => {
                write!(f, "snapshot save {vm_name} before delete: {error}")
            }
            DeleteError::ReadLatest { vm_name, error } => {
                write!(f, "read {vm_name}:latest before the push: {error}")
            }
            DeleteError::Push { vm_name, error } => {
                write!(f, "push snapshot {vm_name} before delete: {error}")
            }
            DeleteError::Rm { vm_id, error } => write!(f, "vm rm {vm_id}: {error}"),
            DeleteError::MacosRm { vm_name, error } => {
                write!(f, "cocoon-macos vm rm {vm_name}: {error}")
            }
            DeleteError::Unexpected(msg) => f.write_str(msg),
        }
    }
}

impl Provider {
    // ----- delete ---------------------------------------------------------------------------

    pub(super) fn start_api_delete(&mut self, key: &PodKey, uid: &str) {
        let a = ApiDeleteOp {
            uid: uid.to_string(),
            step: ApiDeleteStep::Delete,
        };
        let next = a.ask_delete(key);
        self.api_delete_next(key, a, next)
    }

    pub(super) fn start_delete(&mut self, key: &PodKey) {
        let now = self.now;
        let slot = self.slot(key);
        let Some(t) = slot.tracked.clone() else {
            return;
        };
        if let Some(at) = slot.retry_at {
            if at > now {
                return;
            }
        }
        // keep-snapshot-on-delete refreshed from the latest copy of the same incarnation.
        let latest_same = slot.latest.clone().filter(|p| pod_uid(p) == t.uid);
        let keep = latest_same
            .as_ref()
            .and_then(|p| spec::parse(p).ok())
            .map(|s| s.keep_snapshot_on_delete)
            .unwrap_or(t.spec.keep_snapshot_on_delete);
        // Departure from the framework's order (it deletes a pod with no running container
        // from the API first): the VM is removed first, always. The pod object is the only
        // record that a VM is owed removal; a crash after a force-delete and before `vm rm`
        // would leave the VM for good (with the alert orphan policy) or to an orphan sweep
        // that may not run. A terminating pod waiting for its VM costs only time.
        let d = DeleteOp {
            uid: t.uid.clone(),
            step: DeleteStep::ApiFirst,
            vm_name: t.spec.vm_name.clone(),
            keep,
            looked_up: false,
        };
        slot.start_op(d.clone());
        let next = d.route(&mut self.cx(key));
        self.delete_next(key, d, next)
    }

    /// A pod being deleted that we do not track: when it names a VM we may own, track it with
    /// no VM known so the delete looks the VM up and removes it before the object goes (a
    /// killed daemon's create may have made it, or be making it). Returns whether it did.
    /// A pod whose annotations do not parse is not tracked: no VM is removed on input we
    /// could not read.
    pub(super) fn track_for_delete(&mut self, key: &PodKey, pod: &Arc<Pod>) -> bool {
        let Ok(spec) = spec::parse(pod) else {
            return false;
        };
        if !spec.managed || isolation::vm_name_refusal(key, &spec.vm_name).is_some() {
            return false;
        }
        // A VM another live pod holds (or one not named for this namespace) is not this pod's
        // to remove: deleting a pod that was refused for naming it must never touch it.
        if self
            .vm_claimed_elsewhere(key, &pod_uid(pod), &spec)
            .is_some()
            || self.unheld_vm_refusal(key, &spec).is_some()
        {
            return false;
        }
        let vm = self.by_name.get(&spec.vm_name).cloned();
        let start_time = pod.status.as_ref().and_then(|s| s.start_time.clone());
        self.slot(key).tracked = Some(Tracked {
            uid: pod_uid(pod),
            pod: pod.clone(),
            spec,
            vm,
            ip: String::new(),
            start_time,
            probe: None,
        });
        true
    }

    /// The pod timer of a delete waiting for a VM still being created.
    pub(super) fn delete_timer(&mut self, key: &PodKey, d: DeleteOp) {
        let next = d.on_timer(&self.cx(key));
        self.delete_next(key, d, next)
    }

    /// An answer to the delete `d`.
    pub(super) fn delete_step(&mut self, key: &PodKey, mut d: DeleteOp, res: Res) {
        let next = d.on_answer(&mut self.cx(key), res);
        self.delete_next(key, d, next)
    }

    /// Carries out what a step of the delete `d` decided.
    fn delete_next(&mut self, key: &PodKey, d: DeleteOp, next: Next<DeleteStep, Deleting>) {
        let Some((d, then)) = self.apply(key, d, next) else {
            return;
        };
        let then = match then {
            Deleting::ApiAnswered(res) => return self.api_delete_result(key, d.uid, res),
            Deleting::Failed(e) => return self.delete_failed(key, e),
            Deleting::Chore(chores, next) => {
                chores.into_iter().for_each(|ch| self.chore(ch));
                return self.delete_next(key, d, *next);
            }
            then => then,
        };
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.clone()) else {
            return;
        };
        match then {
            Deleting::ApiAnswered(_) | Deleting::Failed(_) | Deleting::Chore(..) => {}
            Deleting::Found(vm) => {
                if let Some(t) = self.slot(key).tracked.as_mut() {
                    t.vm = Some(vm);
                }
                let next = d.route(&mut self.cx(key));
                self.delete_next(key, d, next)
            }
            Deleting::Route => {
                // The route reads the delete as the step left it (its lookup done).
                self.set_op(key, d.clone());
                let next = d.route(&mut self.cx(key));
                self.delete_next(key, d, next)
            }
            Deleting::Forgotten => {
                self.forget(key, true);
                self.delete_done(key, &t, &d)
            }
            Deleting::VmGone => self.delete_vm_gone(key, &t, &d),
            Deleting::Save { retried } => self.delete_save(key, &t, &d, retried),
            Deleting::VmRemoved => {
                let vm = t.vm.clone().unwrap_or_default();
                self.release_leases(&vm);
                self.forget_owner(Owned::Vm, &d.vm_name);
                if self.by_name.get(&d.vm_name).is_some_and(|v| v.id == vm.id) {
                    self.by_name.remove(&d.vm_name);
                }
                self.last_restart.remove(&vm.id);
                if d.keep {
                    return self.delete_vm_gone(key, &t, &d);
                }
                let next = d.rm_snapshots(&self.cx(key));
                self.delete_next(key, d, next)
            }
            Deleting::SnapshotRemoved { fork: false, r } => {
                self.snapshot_removed(&d.vm_name, &r);
                let next = d.rm_fork_snapshot(&self.cx(key), &t);
                self.delete_next(key, d, next)
            }
            Deleting::SnapshotRemoved { fork: true, r } => {
                self.snapshot_removed(&spec::fork_snapshot_name(&d.vm_name), &r);
                let next = DeleteOp::snapshots_gone(&t);
                self.delete_next(key, d, next)
            }
            Deleting::MacosRemoved => self.macos_removed(key, &t, &d),
        }
    }

    /// The snapshot-before-delete's save of `<vm>`, once its owner is on record.
    fn delete_save(&mut self, key: &PodKey, t: &Tracked, d: &DeleteOp, retried: bool) {
        if self.snapshot_of_another(key, &d.vm_name) {
            let msg = format!(
                "the local snapshot {} is not recorded for namespace {}; no snapshot before \
                 delete is taken",
                d.vm_name, key.namespace
            );
            let next = d.refused(&mut self.cx(key), t, &msg);
            return self.delete_next(key, d.clone(), next);
        }
        let vm_id = t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default();
        let save = CocoonCmd::SnapshotSave {
            name: d.vm_name.clone(),
            vm_id,
            deadline: None,
        };
        let owner = Owner::new(&key.namespace, &t.uid);
        let ask = Self::owned_then(Owned::Snapshot, &d.vm_name, owner, Deferred::Cocoon(save));
        let started = self.now;
        self.advance(key, DeleteStep::Save { retried, started }, ask)
    }

    /// VM removed: forget, report Succeeded, count, then delete the API object.
    pub(super) fn delete_vm_gone(&mut self, key: &PodKey, t: &Tracked, d: &DeleteOp) {
        self.forget(key, true);
        self.lifecycle_metric("delete", "ok", "");
        self.delete_done(key, t, d);
    }

    pub(super) fn delete_done(&mut self, key: &PodKey, t: &Tracked, d: &DeleteOp) {
        self.event(
            key,
            &t.uid,
            EventType::Normal,
            "ProviderDeleteSuccess",
            "Delete pod in provider successfully",
        );
        self.slot(key).failures = 0;
        self.slot(key).retry_at = None;
        let latest = self.slot(key).latest.clone();
        match latest {
            Some(p) if pod_uid(&p) == d.uid && deleting(&p) => {
                // Terminal status, then delete at once (no wait for the grace period).
                let st = status::succeeded(t.start_time.as_ref(), &self.wall);
                self.send_status(key, &d.uid, st, false);
                if self.slot(key).idle.api_deleted(&d.uid) {
                    return self.end_op(key);
                }
                self.slot(key).idle = Idle::ApiDeleted(d.uid.clone());
                // The op stays until the API answers so the slot is not re-driven meanwhile.
                let (uid, pod) = (d.uid.clone(), key.clone());
                self.set_op(key, d.clone());
                let ask = Ask::effect(move |op| Effect::DeletePod {
                    op,
                    key: pod,
                    uid,
                    grace: Some(0),
                });
                self.advance(key, DeleteStep::ApiLast, ask);
            }
            _ => self.end_op(key),
        }
    }

    /// Answer of a grace-0 DELETE of the pod object: done unless the API failed transiently,
    /// in which case it is retried with the pod's backoff.
    /// An answer to the API delete `a`: only the Kubernetes API's is expected.
    pub(super) fn api_delete_step(&mut self, key: &PodKey, a: ApiDeleteOp, res: Res) {
        let next = a.on_answer(res);
        self.api_delete_next(key, a, next)
    }

    /// Carries out what a step of the API delete `a` decided: its answer ends it.
    fn api_delete_next(&mut self, key: &PodKey, a: ApiDeleteOp, next: Next<ApiDeleteStep, Res>) {
        if let Some((a, res)) = self.apply(key, a, next) {
            self.api_delete_result(key, a.uid, res)
        }
    }

    pub(super) fn api_delete_result(&mut self, key: &PodKey, uid: String, res: Res) {
        let failed = matches!(res, Res::Kube(Err(KubeError::Other(_))));
        let now = self.now;
        let failures = {
            let slot = self.slot(key);
            slot.drop_op();
            if failed {
                slot.idle.undo_api_delete();
                slot.failures += 1;
            } else {
                slot.idle = Idle::ApiDeleted(uid);
                slot.failures = 0;
            }
            slot.failures
        };
        if failed {
            let at = now + pod_backoff(failures - 1);
            return self.set_pod_timer(key, at);
        }
        self.reconcile_slot(key);
    }

    /// "VM kept": Warning, counter, unbounded retry with backoff capped at 1000 s.
    pub(super) fn delete_failed(&mut self, key: &PodKey, err: DeleteError) {
        let uid = self
            .slot(key)
            .tracked
            .as_ref()
            .map(|t| t.uid.clone())
            .unwrap_or_default();
        let msg = format!("{err} (VM kept)");
        self.lifecycle_metric("delete", "failed", "");
        self.event(key, &uid, EventType::Warning, "ProviderDeleteFailed", &msg);
        let now = self.now;
        let failures = {
            let slot = self.slot(key);
            slot.drop_op();
            slot.failures += 1;
            slot.failures
        };
        let at = now + pod_backoff(failures - 1);
        self.slot(key).retry_at = Some(at);
        self.set_pod_timer(key, at);
    }

    pub(super) fn release_leases(&mut self, vm: &VmInfo) {
        if !self.cfg.lease_release {
            return;
        }
        let macs = vm.lease_macs();
        if !macs.is_empty() {
            self.out.push(Effect::ReleaseLeases { macs });
        }
    }
}

/// What a step of the delete leaves to the provider.
pub(super) enum Deleting {
    /// Chores, then what follows.
    Chore(Vec<Chore>, Box<Next<DeleteStep, Deleting>>),
    /// The API's answer to the pod's DELETE (`ApiLast`, or any answer once the pod's
    /// tracking vanished): the API delete's outcome.
    ApiAnswered(Res),
    /// The delete fails: the VM is kept and the delete retried on the pod's backoff.
    Failed(DeleteError),
    /// The lookup of a VM not known found the pod's own: it is tracked, then the delete is
    /// routed again (`DeleteOp::route`).
    Found(VmInfo),
    /// The delete is routed again as its step left it (its lookup done, nothing found).
    Route,
    /// Nothing (more) to remove: the pod is forgotten and its delete done (`delete_done`).
    Forgotten,
    /// The pod's VM is gone: forgotten, counted, done (`delete_vm_gone`).
    VmGone,
    /// The running VM is saved before its removal (unless its name's snapshot is another
    /// namespace's).
    Save { retried: bool },
    /// `vm rm` went through: the VM's leases and indexes go, then its snapshots unless kept.
    VmRemoved,
    /// A local snapshot's removal answered (`fork`: `fork-<vm>`, else `<vm>`).
    SnapshotRemoved { fork: bool, r: Answer },
    /// `cocoon-macos vm rm` went through (or found no VM).
    MacosRemoved,
}

impl DeleteOp {
    /// Where the delete goes from its start, or once the pod's VM is known (or known to be
    /// none): an unmanaged pod's VM is not ours to remove; a macOS guest is removed by
    /// `cocoon-macos`; a VM not known is looked up first; a running one is inspected for the
    /// snapshot before delete, else removed.
    fn route(&self, cx: &mut Cx) -> Next<DeleteStep, Deleting> {
        let Some(t) = cx.tracked else {
            return Next::Wait;
        };
        if !t.spec.managed {
            return Next::Then(Deleting::VmGone);
        }
        if macos::is_macos(&t.spec) {
            return self.macos_rm(cx, t);
        }
        let Some(vm) = t.vm.as_ref() else {
            if !self.looked_up {
                return Self::find_vm(t, false);
            }
            if self.keep {
                cx.metric(MetricUpdate::PodLifecycle {
                    op: "delete",
                    result: "skipped",
                    reason: "seat_release",
                });
                return Next::Then(Deleting::Forgotten);
            }
            cx.metric(MetricUpdate::PodLifecycle {
                op: "delete",
                result: "skipped",
                reason: "no_vm",
            });
            return self.rm_snapshots(cx);
        };
        let key = cx.key;
        let role =
            crate::provider::naming::role(&key.namespace, &t.spec.owner_cocoonset, &t.spec.vm_name);
        let id = vm.id.clone();
        if cx.cfg.registry && spec::should_snapshot(&t.spec.snapshot_policy, role) {
            let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference: id });
            return Next::Ask(DeleteStep::Inspect, ask);
        }
        Next::Ask(DeleteStep::Rm, Ask::Cocoon(CocoonCmd::VmRm { id }))
    }

    /// The answer of the lookup of a VM the delete knows none of: a VM found is removed as the
    /// tracked one would be; one still being created is looked at again shortly; none lets the
    /// delete finish.
    fn found(
        &mut self,
        cx: &Cx,
        t: &Tracked,
        by_id: bool,
        r: Answer,
    ) -> Next<DeleteStep, Deleting> {
        let found = if r.succeeded() { r.vm().ok() } else { None };
        // The pod's own VM only: of its name exactly, and by ID only with that name. An answer
        // for another VM (its ID prefixed by the value looked up) is as good as none.
        let other = found.as_ref().is_some_and(|v| {
            let exact = if by_id {
                isolation::vm_is(v, &t.spec.vm_id, &t.spec.vm_name)
            } else {
                isolation::vm_named(v, &t.spec.vm_name)
            };
            // A VM of the name recorded for another namespace is not this pod's either.
            !exact
                || cx
                    .owners
                    .get(Owned::Vm, &v.name)
                    .is_some_and(|o| o.namespace != cx.key.namespace)
        });
        if r.vm_not_found() || other {
            if !by_id && t.spec.vm_id != t.spec.vm_name && lookup_reference_ok(&t.spec.vm_id) {
                return Self::find_vm(t, true);
            }
            self.looked_up = true;
            // No VM of the pod's name: none is owned under it either.
            let chores = vec![Chore::ForgetOwner(Owned::Vm, t.spec.vm_name.clone())];
            return Next::Then(Deleting::Chore(
                chores,
                Box::new(Next::Then(Deleting::Route)),
            ));
        }
        let reference = if by_id {
            &t.spec.vm_id
        } else {
            &t.spec.vm_name
        };
        match found {
            None => Next::Then(Deleting::Failed(DeleteError::Lookup {
                reference: reference.clone(),
                error: r.error_text(),
            })),
            Some(v) if matches!(v.state, VmState::Creating) => {
                let ask = Ask::Cocoon(CocoonCmd::ReconcileStaleCreate { id: v.id });
                Next::Ask(DeleteStep::SettleCreating { by_id }, ask)
            }
            Some(v) => Next::Then(Deleting::Found(v)),
        }
    }

    /// Unless kept, the VM's local snapshots go with it: `<vm>` (its hibernate snapshot when
    /// there is no registry), then `fork-<vm>`; each removal only when that snapshot may exist.
    /// `<vm>` is removed only when the pod's namespace owns it (by record, or unrecorded and
    /// proved by the name): it may be the only copy of a hibernation, and another's, or an
    /// earlier daemon's the name does not tie to the namespace, is left to the reclaimer.
    /// `fork-<vm>` (a cache) is removed unless recorded for another namespace.
    fn rm_snapshots(&self, cx: &Cx) -> Next<DeleteStep, Deleting> {
        let Some(t) = cx.tracked else {
            return Next::Wait;
        };
        if !cx.snapshot_may_exist(&self.vm_name) || !cx.owns_snapshot(&self.vm_name, &self.vm_name)
        {
            return self.rm_fork_snapshot(cx, t);
        }
        let name = self.vm_name.clone();
        let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name });
        Next::Ask(DeleteStep::RmSnapshot, ask)
    }

    fn rm_fork_snapshot(&self, cx: &Cx, t: &Tracked) -> Next<DeleteStep, Deleting> {
        let name = spec::fork_snapshot_name(&self.vm_name);
        let next = if !cx.snapshot_may_exist(&name) || cx.snapshot_of_another(&name) {
            Self::snapshots_gone(t)
        } else {
            Next::Ask(
                DeleteStep::RmForkSnapshot,
                Ask::Cocoon(CocoonCmd::SnapshotRm { name }),
            )
        };
        // A flight saving it meanwhile must not hand out what it lands.
        let chores = vec![Chore::ForkInvalidated(self.vm_name.clone())];
        Next::Then(Deleting::Chore(chores, Box::new(next)))
    }

    /// The snapshots are dealt with: a pod with no VM is done, one whose VM was removed is
    /// counted as deleted.
    fn snapshots_gone(t: &Tracked) -> Next<DeleteStep, Deleting> {
        if t.vm.is_none() {
            return Next::Then(Deleting::Forgotten);
        }
        Next::Then(Deleting::VmGone)
    }

    /// Look up the VM of a delete that knows none (by name, else by the ID annotation).
    fn find_vm(t: &Tracked, by_id: bool) -> Next<DeleteStep, Deleting> {
        let reference = if by_id {
            t.spec.vm_id.clone()
        } else {
            t.spec.vm_name.clone()
        };
        let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
        Next::Ask(DeleteStep::FindVm { by_id }, ask)
    }

    /// The pod timer of a delete waiting for a VM still being created.
    fn on_timer(&self, cx: &Cx) -> Next<DeleteStep, Deleting> {
        let Some(t) = cx.tracked else {
            return Next::Wait;
        };
        match self.step {
            DeleteStep::FindVmWait { by_id } => Self::find_vm(t, by_id),
            _ => Next::Wait,
        }
    }

    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> Next<DeleteStep, Deleting> {
        let Some(t) = cx.tracked else {
            // Tracking vanished (forgotten): only ApiLast can remain.
            return Next::Then(Deleting::ApiAnswered(res));
        };
        let vm_id = t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default();
        match (self.step, res) {
            (DeleteStep::FindVm { by_id }, Res::Cocoon(r)) => self.found(cx, t, by_id, r),
            (DeleteStep::SettleCreating { by_id }, Res::Cocoon(r)) => {
                Self::settled_creating(cx, t, by_id, r)
            }
            (DeleteStep::Inspect, Res::Cocoon(r)) => Self::inspected(vm_id, r),
            (DeleteStep::Save { retried, started }, Res::Cocoon(r)) => {
                cx.metric(MetricUpdate::SnapshotSaveDuration {
                    namespace: cx.key.namespace.clone(),
                    seconds: cx.now.saturating_duration_since(started).as_secs_f64(),
                });
                self.saved(cx, retried, r)
            }
            (DeleteStep::RmHolder, Res::Cocoon(_)) => Next::Then(Deleting::Save { retried: true }),
            (DeleteStep::PushCheck, Res::Evidence(r)) => self.push_checked(cx, t, r),
            (DeleteStep::Push, Res::Transfer(r)) => match r {
                Ok(_) => {
                    cx.metric(MetricUpdate::SnapshotPush { result: "ok" });
                    let ask = Ask::Cocoon(CocoonCmd::VmRm { id: vm_id });
                    Next::Ask(DeleteStep::Rm, ask)
                }
                Err(e) => {
                    cx.metric(MetricUpdate::SnapshotPush { result: "failed" });
                    Next::Then(Deleting::Failed(DeleteError::Push {
                        vm_name: self.vm_name.clone(),
                        error: e.to_string(),
                    }))
                }
            },
            (DeleteStep::Rm, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    let error = r.error_text();
                    return Next::Then(Deleting::Failed(DeleteError::Rm { vm_id, error }));
                }
                Next::Then(Deleting::VmRemoved)
            }
            (DeleteStep::RmSnapshot, Res::Cocoon(r)) => {
                Next::Then(Deleting::SnapshotRemoved { fork: false, r })
            }
            (DeleteStep::RmForkSnapshot, Res::Cocoon(r)) => {
                Next::Then(Deleting::SnapshotRemoved { fork: true, r })
            }
            (DeleteStep::ApiLast, res @ Res::Kube(_)) => Next::Then(Deleting::ApiAnswered(res)),
            // `vm rm` answered: a missing VM counts as removed; anything else keeps the pod.
            (DeleteStep::MacosRm, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    let (vm_name, error) = (self.vm_name.clone(), r.error_text());
                    return Next::Then(Deleting::Failed(DeleteError::MacosRm { vm_name, error }));
                }
                Next::Then(Deleting::MacosRemoved)
            }
            (step, res) => Next::Unexpected(step, res),
        }
    }

    /// cocoon's answer to settling a VM found still being created: looked up again, or
    /// waited for while a create still runs it.
    fn settled_creating(
        cx: &Cx,
        t: &Tracked,
        by_id: bool,
        r: Answer,
    ) -> Next<DeleteStep, Deleting> {
        let outcome = if r.succeeded() {
            r.stale_outcome().ok()
        } else {
            None
        };
        match outcome {
            // The record is gone or became a VM: look again (and remove what landed).
            Some(
                StaleCreateOutcome::Collected
                | StaleCreateOutcome::NotFound
                | StaleCreateOutcome::NotCreating,
            ) => Self::find_vm(t, by_id),
            // A create still runs (or cocoon could not say): wait for it.
            _ => {
                let at = cx.now + INSPECT_RETRY;
                Next::Ask(DeleteStep::FindVmWait { by_id }, Ask::Timer(at))
            }
        }
    }

    /// The VM inspected before its delete: a running one is saved first, a stopped or gone
    /// one removed.
    fn inspected(vm_id: String, r: Answer) -> Next<DeleteStep, Deleting> {
        let rm = |id| Next::Ask(DeleteStep::Rm, Ask::Cocoon(CocoonCmd::VmRm { id }));
        if r.vm_not_found() {
            return rm(vm_id);
        }
        let parsed = if r.succeeded() { r.vm().ok() } else { None };
        match parsed {
            None => Next::Then(Deleting::Failed(DeleteError::Inspect {
                vm_id,
                error: r.error_text(),
            })),
            Some(v) if v.running() => Next::Then(Deleting::Save { retried: false }),
            Some(_) => rm(vm_id),
        }
    }

    /// The `snapshot save` before the delete answered: its push follows (after a look at
    /// whose `<vm>:latest` it replaces), the name's holder is removed once, or the delete fails.
    fn saved(&self, cx: &mut Cx, retried: bool, r: Answer) -> Next<DeleteStep, Deleting> {
        if r.succeeded() {
            cx.metric(MetricUpdate::SnapshotSave { result: "ok" });
            // Whose `<vm>:latest` the push would replace, first.
            let (repo, tag) = (self.vm_name.clone(), "latest".to_string());
            let ask = Ask::effect(|op| Effect::ReadSnapshotTag { op, repo, tag });
            return Next::Ask(DeleteStep::PushCheck, ask);
        }
        if r.name_taken() && !retried {
            let name = self.vm_name.clone();
            let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name });
            return Next::Ask(DeleteStep::RmHolder, ask);
        }
        cx.metric(MetricUpdate::SnapshotSave { result: "failed" });
        Next::Then(Deleting::Failed(DeleteError::Save {
            vm_name: self.vm_name.clone(),
            error: r.error_text(),
        }))
    }

    /// The registry's `<vm>:latest`, read before the push: another namespace's is never
    /// pushed over.
    fn push_checked(
        &self,
        cx: &mut Cx,
        t: &Tracked,
        r: Result<Option<HibernateTag>, TransferError>,
    ) -> Next<DeleteStep, Deleting> {
        let key = cx.key;
        match r {
            Ok(Some(tag)) if isolation::tag_of_another(key, &tag) => {
                let msg = format!(
                    "{}:latest in the registry is not recorded for namespace {}; the \
                         snapshot before delete is not pushed over it",
                    self.vm_name, key.namespace
                );
                self.refused(cx, t, &msg)
            }
            Ok(_) => {
                let (name, image) = (self.vm_name.clone(), t.spec.image.clone());
                let owner = Owner::new(&key.namespace, &t.uid);
                let ask = Ask::effect(|op| Effect::PushSnapshot {
                    op,
                    local_name: name.clone(),
                    repo: name,
                    tag: "latest".into(),
                    base_image: image,
                    owner,
                });
                Next::Ask(DeleteStep::Push, ask)
            }
            Err(e) => {
                cx.metric(MetricUpdate::SnapshotPush { result: "failed" });
                let (vm_name, error) = (self.vm_name.clone(), e.to_string());
                Next::Then(Deleting::Failed(DeleteError::ReadLatest { vm_name, error }))
            }
        }
    }

    /// The snapshot before delete would replace another namespace's snapshot (local or in the
    /// registry): it is not taken or not pushed (Warning, counter); the VM is removed all the
    /// same, as the pod is gone.
    fn refused(&self, cx: &mut Cx, t: &Tracked, msg: &str) -> Next<DeleteStep, Deleting> {
        cx.metric(MetricUpdate::SnapshotPush { result: "failed" });
        cx.metric(MetricUpdate::PodLifecycle {
            op: "delete",
            result: "skipped",
            reason: isolation::REASON_SNAPSHOT_NOT_IN_NS,
        });
        cx.event(
            &t.uid,
            EventType::Warning,
            isolation::EVENT_SNAPSHOT_NOT_IN_NS,
            msg,
        );
        let id = t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default();
        Next::Ask(DeleteStep::Rm, Ask::Cocoon(CocoonCmd::VmRm { id }))
    }
}

impl ApiDeleteOp {
    /// The grace-0 DELETE of the incarnation's API object.
    fn ask_delete(&self, key: &PodKey) -> Next<ApiDeleteStep, Res> {
        let (uid, key) = (self.uid.clone(), key.clone());
        let ask = Ask::effect(move |op| Effect::DeletePod {
            op,
            key,
            uid,
            grace: Some(0),
        });
        Next::Ask(ApiDeleteStep::Delete, ask)
    }

    /// Only the Kubernetes API's answer is expected; it is the op's outcome.
    fn on_answer(&self, res: Res) -> Next<ApiDeleteStep, Res> {
        match res {
            Res::Kube(_) => Next::Then(res),
            other => Next::Unexpected(self.step, other),
        }
    }
}

/// A VM reference taken from an annotation is used on cocoon's command line only when it
/// cannot read as an option or carry anything but a plain name.
pub(super) fn lookup_reference_ok(r: &str) -> bool {
    !r.is_empty()
        && !r.starts_with('-')
        && r.len() <= 253
        && r.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

#[cfg(test)]
mod tests {
    use super::DeleteError;

    #[test]
    fn delete_errors_keep_their_messages() {
        let e = |x: &str| x.to_string();
        let cases = [
            (
                DeleteError::Lookup {
                    reference: e("vk-a-b"),
                    error: e("boom"),
                },
                "look up vm vk-a-b before delete: boom",
            ),
            (
                DeleteError::Inspect {
                    vm_id: e("id1"),
                    error: e("boom"),
                },
                "inspect vm id1 before delete: boom",
            ),
            (
                DeleteError::Save {
                    vm_name: e("vk-a-b"),
                    error: e("boom"),
                },
                "snapshot save vk-a-b before delete: boom",
            ),
            (
                DeleteError::ReadLatest {
                    vm_name: e("vk-a-b"),
                    error: e("boom"),
                },
                "read vk-a-b:latest before the push: boom",
            ),
            (
                DeleteError::Push {
                    vm_name: e("vk-a-b"),
                    error: e("boom"),
                },
                "push snapshot vk-a-b before delete: boom",
            ),
            (
                DeleteError::Rm {
                    vm_id: e("id1"),
                    error: e("boom"),
                },
                "vm rm id1: boom",
            ),
            (
                DeleteError::MacosRm {
                    vm_name: e("vk-a-mac"),
                    error: e("boom"),
                },
                "cocoon-macos vm rm vk-a-mac: boom",
            ),
            (DeleteError::Unexpected(e("step X got it")), "step X got it"),
        ];
        for (err, text) in cases {
            assert_eq!(err.to_string(), text);
        }
    }
}
