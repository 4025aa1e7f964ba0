//! Wake and restore: find the hibernated VM's snapshot (local copy verified against the
//! registry tag, else a pull of the tag), clone the VM back under its name, then the follow-up.

use super::hibernate::{drops_nic, HIBERNATE_TAG};
use super::machine::Chore;
use super::*;

fn fail(reason: &'static str, message: String) -> OpFailure {
    OpFailure {
        reason,
        message,
        metric_reason: "",
    }
}

/// Why a wake does not read tag `<vm>:hibernate` (nothing of its owner is told).
fn tag_refusal(vm: &str, ns: &str) -> String {
    format!("{vm}:{HIBERNATE_TAG} is not recorded for namespace {ns}; it is not restored")
}

/// The local snapshot a registry pull of the hibernate tag lands in (removed after the clone).
pub(super) fn import_name(vm_name: &str) -> String {
    format!("{vm_name}-hibernate-import")
}

impl Provider {
    /// Start waking the tracked pod of `key` (no VM). `restore`: CreatePod's restore of a pod
    /// with hibernate evidence, whose failure fails the create; otherwise UpdatePod's wake.
    pub(super) fn start_wake(&mut self, key: &PodKey, restore: bool) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.clone()) else {
            return;
        };
        let started = self.op_of::<CreateOp>(key).map_or(self.now, |c| c.started);
        self.slot(key).replace_op(WakeOp {
            uid: t.uid.clone(),
            spec: t.spec.clone(),
            step: WakeStep::LocalInspect,
            started,
            restore,
            tag: None,
            source_label: String::new(),
        });
        self.set_lifecycle(key, State::Creating, "");
        if !restore {
            // Stale id / ip of the VM that was removed at hibernate.
            let mut ann = BTreeMap::new();
            for k in [ANN_VM_ID, ANN_VM_IP, spec::ANN_POST_CLONE_STATE] {
                ann.insert(k.to_string(), None);
            }
            self.send_annotations(key, &t.uid, ann, false);
        }
        // The VM's owner goes on record before anything of the wake runs: the clone that ends
        // it then finds it there (its staged copy's clean-up waits on the clone itself).
        let name = t.spec.vm_name.clone();
        if let Some(msg) = self.vm_record_refusal(key, &name) {
            self.metric(MetricUpdate::Wake { result: "failed" });
            let (event, reason) = (
                isolation::EVENT_VM_NOT_IN_NS,
                isolation::REASON_VM_NOT_IN_NS,
            );
            if restore {
                return self.refuse_create(key, event, reason, msg);
            }
            return self.update_failed_as(key, &t.uid, event, reason, &format!("wake: {msg}"));
        }
        let owner = Owner::new(&key.namespace, &t.uid);
        let inspect = CocoonCmd::SnapshotInspect { name: name.clone() };
        let ask = Self::owned_then(Owned::Vm, &name, owner, Deferred::Cocoon(inspect));
        self.advance(key, WakeStep::LocalInspect, ask)
    }

    /// An answer to the wake `w`.
    pub(super) fn wake_step(&mut self, key: &PodKey, mut w: WakeOp, res: Res) {
        let next = w.on_answer(&mut self.cx(key), res);
        self.wake_next(key, w, next)
    }

    /// Carries out what a step of the wake `w` decided.
    fn wake_next(&mut self, key: &PodKey, w: WakeOp, next: Next<WakeStep, WakeThen>) {
        let Some((w, then)) = self.apply(key, w, next) else {
            return;
        };
        match then {
            WakeThen::Chore(chores, next) => {
                chores.into_iter().for_each(|c| self.chore(c));
                self.wake_next(key, w, *next)
            }
            WakeThen::Staged(step, ask, dir) => {
                self.set_op(key, w);
                self.advance(key, step, ask);
                // The step just asked (the peer restore, or the clone from its staged copy)
                // answers through a waiter that removes the staged copy once it is spent.
                if let Some(op) = self.slots.get(key).and_then(|s| s.awaiting) {
                    let key = key.clone();
                    self.waiters.insert(op, Waiter::Staged { key, dir });
                }
            }
            WakeThen::Refused(msg) => self.wake_refused(key, &w.uid, w.restore, msg),
            WakeThen::Failed(failure) => self.wake_failed(key, &w, failure),
            WakeThen::NoSource(why) => self.no_wake_source(key, &w, &why),
            WakeThen::Woken(vm, source) => self.woken(key, &w, vm, &source),
        }
    }

    /// Nothing to wake from, authoritatively (no local snapshot, the tag absent): a restore
    /// the pod asked for fails; a wake boots the pod afresh as CreatePod would, since no
    /// retry can ever find a source (the operator deleted the tag, or the pod never ran).
    fn no_wake_source(&mut self, key: &PodKey, w: &WakeOp, why: &str) {
        let msg = format!("no wake source for vm {}: {why}", w.spec.vm_name);
        if w.restore {
            return self.wake_failed(key, w, fail("WakePullFailed", msg));
        }
        self.metric(MetricUpdate::Wake { result: "failed" });
        self.event(
            key,
            &w.uid,
            EventType::Warning,
            "WakePullFailed",
            &format!("update: wake: {msg}; booting it fresh"),
        );
        let latest = self.slots.get(key).and_then(|s| s.latest.clone());
        {
            let slot = self.slot(key);
            slot.clear_op();
        }
        self.forget(key, false);
        match latest {
            Some(pod) if pod_uid(&pod) == w.uid => self.start_create(key, pod),
            _ => self.reconcile_slot(key),
        }
    }

    /// The VM is back under its name: record it, write id / ip, probe, `Woken`, follow-up.
    fn woken(&mut self, key: &PodKey, w: &WakeOp, vm: VmInfo, source: &str) {
        let label = if w.source_label.is_empty() {
            source.to_string()
        } else {
            w.source_label.clone()
        };
        let secs = self.now.saturating_duration_since(w.started).as_secs_f64();
        self.metric(MetricUpdate::VmBootDuration {
            namespace: key.namespace.clone(),
            mode: "clone".into(),
            backend: w.spec.backend.clone(),
            seconds: secs,
        });
        let ip = vm.primary_ip();
        self.by_name.insert(w.spec.vm_name.clone(), vm.clone());
        let mut ann = BTreeMap::new();
        ann.insert(ANN_VM_ID.to_string(), Some(vm.id.clone()));
        ann.insert(ANN_VM_IP.to_string(), Some(ip.clone()));
        if let Some(intent) = self.slot(key).intent.as_ref().filter(|i| i.uid == w.uid) {
            ann.extend(intent.patch());
        }
        self.send_annotations(key, &w.uid, ann, false);
        {
            let slot = self.slot(key);
            slot.failures = 0;
            slot.retry_at = None;
            slot.update_retry = None;
            if let Some(t) = slot.tracked.as_mut() {
                t.vm = Some(vm.clone());
                t.ip = ip.clone();
                t.spec.vm_id = vm.id.clone();
                t.spec.vm_ip = ip.clone();
                t.spec.restore_from_hibernate = w.restore;
                t.probe = Some(initial_probe(&ip));
            }
        }
        self.out.push(Effect::StartProbe {
            key: key.clone(),
            uid: w.uid.clone(),
            vm_id: vm.id.clone(),
            ip,
            mac: vm.primary_mac(),
            probe_port: w.spec.probe_port,
        });
        self.event(
            key,
            &w.uid,
            EventType::Normal,
            "Woken",
            &format!("cloned from {label}"),
        );
        if w.restore {
            self.lifecycle_metric("create", "ok", "");
            self.event(
                key,
                &w.uid,
                EventType::Normal,
                "ProviderCreateSuccess",
                "Create pod in provider successfully",
            );
        } else {
            self.update_succeeded(key, &w.uid);
        }
        // Restore follow-up: CH + Windows waits for the IP (the hot-added NIC must not be
        // cycled by a fix-up); other guests run the post-clone fix-up in wake accounting, which
        // for a CH all-DHCP guest is the same wait for the lease, then Ready.
        if drops_nic(&w.spec) {
            return self.start_ready_wait_as(key, w.uid.clone(), vm.id, PostCloneMode::Wake);
        }
        self.post_clone_or_ready_wait(key, &vm, false, PostCloneMode::Wake);
    }

    /// An answer no wake step expects: the wake fails and is retried.
    pub(super) fn wake_unexpected(&mut self, key: &PodKey, msg: &str) {
        let Some(w) = self.op_of::<WakeOp>(key).cloned() else {
            return;
        };
        if self.tracked_as(key, &w.uid).is_some() {
            self.wake_failed(key, &w, fail("UnexpectedAnswer", msg.to_string()))
        }
    }

    /// A wake or restore failed before a VM existed. A restore fails its create (retried with
    /// the pod's backoff); a wake fails the update (retried on the op schedule).
    fn wake_failed(&mut self, key: &PodKey, w: &WakeOp, failure: OpFailure) {
        self.metric(MetricUpdate::Wake { result: "failed" });
        if w.restore {
            return self.fail_create_as(key, &w.uid, failure.reason, &failure.message, true);
        }
        let err = format!("wake: {}", failure.message);
        self.update_failed(key, &w.uid, failure.reason, &err);
    }
}

/// What a wake's step leaves to the provider: the index upkeep its answers call for, its
/// hand-overs and its endings.
pub(super) enum WakeThen {
    /// Index upkeep, then what follows.
    Chore(Vec<Chore>, Box<Next<WakeStep, WakeThen>>),
    /// Ask the step, whose answer comes through a waiter that removes the staged copy (the
    /// peer restore's directory, once it is known).
    Staged(WakeStep, Ask, Option<String>),
    /// The snapshot or tag is not the pod's namespace's: the wake is refused.
    Refused(String),
    /// The wake failed before a VM existed.
    Failed(OpFailure),
    /// Nothing to wake from, authoritatively: why.
    NoSource(String),
    /// The VM is back under its name, cloned from this source.
    Woken(VmInfo, String),
}

type WakeNext = Next<WakeStep, WakeThen>;

impl WakeOp {
    fn failed(reason: &'static str, message: String) -> WakeNext {
        Next::Then(WakeThen::Failed(fail(reason, message)))
    }

    fn chore_then(chores: Vec<Chore>, next: WakeNext) -> WakeNext {
        Next::Then(WakeThen::Chore(chores, Box::new(next)))
    }

    /// An answer to this wake.
    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> WakeNext {
        if cx.tracked.is_none_or(|t| t.uid != self.uid) {
            return Next::End;
        }
        let superseded = cx
            .latest
            .is_none_or(|p| pod_uid(p) != self.uid || deleting(p));
        if superseded {
            // Deleted (or replaced) meanwhile: the delete that follows looks the VM up by
            // name, so a clone this very answer reports is removed before the object goes.
            log::info!(
                "provider: {}: wake stopped, the pod is being deleted",
                cx.key
            );
            return Next::End;
        }
        let vm = self.spec.vm_name.clone();
        match (self.step.clone(), res) {
            (WakeStep::LocalInspect, Res::Cocoon(r)) => self.local_inspected(cx, r),
            (
                WakeStep::Verify {
                    local_id,
                    local_image,
                },
                Res::Evidence(found),
            ) => self.local_verified(cx, &local_id, &local_image, found),
            (WakeStep::RmStale, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.snapshot_not_found() {
                    let key = cx.key;
                    log::warn!(
                        "provider: {key}: remove stale snapshot {vm}: {}",
                        r.error_text()
                    );
                }
                let name = spec::fork_snapshot_name(&vm);
                let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name });
                let chores = vec![
                    Chore::SnapshotRemoved(vm.clone(), r),
                    Chore::ForkInvalidated(vm),
                ];
                Self::chore_then(chores, Next::Ask(WakeStep::RmStaleFork, ask))
            }
            (WakeStep::RmStaleFork, Res::Cocoon(r)) => {
                let chores = vec![Chore::SnapshotRemoved(spec::fork_snapshot_name(&vm), r)];
                Self::chore_then(chores, self.tag_source(cx))
            }
            (WakeStep::Tag, Res::Evidence(found)) => match found {
                Ok(tag) => {
                    self.tag = tag;
                    self.tag_source(cx)
                }
                Err(e) => {
                    let msg = format!("look up {vm}:{HIBERNATE_TAG}: {e}");
                    Self::failed("WakePullFailed", msg)
                }
            },
            (WakeStep::Peer, Res::Transfer(r)) => match r {
                Ok(dir) => {
                    let label = format!("peer {}", self.tag.as_ref().map_or("", |t| &t.from_node));
                    let from = CloneSource::FromDir(dir.clone());
                    let (step, ask) = self.clone_from(cx, from, false, label);
                    Next::Then(WakeThen::Staged(step, ask, Some(dir)))
                }
                Err(e) => {
                    let key = cx.key;
                    log::warn!(
                        "provider: {key}: peer restore of {vm}: {e}; pulling from the registry"
                    );
                    self.pull(cx)
                }
            },
            (WakeStep::Pull, Res::Transfer(r)) => match r {
                Ok(_) => {
                    cx.metric(MetricUpdate::SnapshotPull { result: "ok" });
                    let name = import_name(&vm);
                    let ask = Ask::Cocoon(CocoonCmd::SnapshotInspect { name });
                    Next::Ask(WakeStep::ImportInspect, ask)
                }
                Err(e) => {
                    cx.metric(MetricUpdate::SnapshotPull { result: "failed" });
                    let msg = format!("pull {vm}:{HIBERNATE_TAG}: {e}");
                    Self::failed("WakePullFailed", msg)
                }
            },
            (WakeStep::ImportInspect, Res::Cocoon(r)) => self.import_inspected(cx, r),
            (WakeStep::Clone { source }, Res::Cocoon(r)) => self.cloned(source, r),
            (WakeStep::CloneFailedInspect { source, error }, Res::Cocoon(r)) => {
                self.clone_failed_inspected(source, error, r)
            }
            (WakeStep::CloneFailedRm { error }, Res::Cocoon(r)) => {
                let failed = Self::failed("WakeCloneFailed", error);
                if !r.succeeded() && !r.vm_not_found() {
                    let key = cx.key;
                    log::warn!(
                        "provider: {key}: remove leftover of failed wake clone: {}",
                        r.error_text()
                    );
                    return failed;
                }
                Self::chore_then(vec![Chore::ForgetOwner(Owned::Vm, vm)], failed)
            }
            (step, res) => Next::Unexpected(step, res),
        }
    }

    /// The local snapshot named after the VM: cloned without a registry, verified against
    /// the registry's tag with one, passed over for the tag when absent or not the pod's.
    fn local_inspected(&mut self, cx: &Cx, r: Answer) -> WakeNext {
        let vm = self.spec.vm_name.clone();
        let evidence =
            |vm_name: String| Ask::effect(move |op| Effect::CheckHibernateEvidence { op, vm_name });
        // Another snapshot than `<vm>` (an ID-prefix match) is none.
        let local = match r.succeeded() {
            true => match isolation::inspected_snapshot(&r, &vm) {
                Ok(s) => s,
                Err(e) => return Self::failed("WakePullFailed", e.to_string()),
            },
            false => None,
        };
        let ns = &cx.key.namespace;
        // A local copy recorded for another namespace is never read; one that no
        // record or name ties to the pod's is passed over for the registry's tag.
        if local.is_some() && cx.snapshot_of_another(&vm) {
            let msg = format!("the local snapshot {vm} is not recorded for namespace {ns}");
            return Next::Then(WakeThen::Refused(msg));
        }
        let owned = cx.owns_snapshot(&vm, &vm);
        if local.is_some() && !owned && !cx.cfg.registry {
            let msg = format!(
                "the local snapshot {vm} is not recorded for namespace {ns} and its name \
                     does not prove it",
            );
            return Next::Then(WakeThen::Refused(msg));
        }
        if let Some(snap) = local.filter(|_| owned) {
            if !cx.cfg.registry {
                // Without a registry the local copy is the only one, and trusted.
                let label = format!("local snapshot {vm}");
                let from = CloneSource::Snapshot(vm.clone());
                let (step, ask) = self.clone_from(cx, from, !snap.image.is_empty(), label);
                return Next::Ask(step, ask);
            }
            let step = WakeStep::Verify {
                local_id: snap.id,
                local_image: snap.image,
            };
            return Next::Ask(step, evidence(vm));
        }
        if !r.succeeded() && !r.snapshot_not_found() {
            let msg = format!("inspect local snapshot {vm}: {}", r.error_text());
            return Self::failed("WakePullFailed", msg);
        }
        if !cx.cfg.registry {
            let why = "no local snapshot and no registry configured".to_string();
            return Next::Then(WakeThen::NoSource(why));
        }
        Next::Ask(WakeStep::Tag, evidence(vm))
    }

    /// The registry's tag read to verify the local copy: the same snapshot is cloned, another
    /// (or none) makes the local copy stale.
    fn local_verified(
        &mut self,
        cx: &mut Cx,
        local_id: &str,
        local_image: &str,
        found: Result<Option<HibernateTag>, TransferError>,
    ) -> WakeNext {
        let vm = self.spec.vm_name.clone();
        match found {
            Ok(Some(tag)) if !cx.tag_readable(&vm, &tag) => {
                let msg = tag_refusal(&vm, &cx.key.namespace);
                Next::Then(WakeThen::Refused(msg))
            }
            Ok(Some(tag)) if !tag.snapshot_id.is_empty() && tag.snapshot_id == local_id => {
                cx.metric(MetricUpdate::SnapshotVerify { result: "ok" });
                let label = format!("local snapshot {vm}");
                let from = CloneSource::Snapshot(vm.clone());
                let (step, ask) = self.clone_from(cx, from, !local_image.is_empty(), label);
                Next::Ask(step, ask)
            }
            Ok(tag) => {
                // The registry holds another hibernation (or none): the local copy is stale.
                cx.metric(MetricUpdate::SnapshotVerify { result: "stale" });
                self.tag = tag;
                let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name: vm });
                Next::Ask(WakeStep::RmStale, ask)
            }
            Err(e) => {
                // Never trust an unverified copy.
                cx.metric(MetricUpdate::SnapshotVerify { result: "error" });
                let msg = format!("verify local snapshot {vm} against {vm}:{HIBERNATE_TAG}: {e}");
                Self::failed("WakePullFailed", msg)
            }
        }
    }

    /// The import a registry pull landed: cloned from, its base image pulled with it.
    fn import_inspected(&mut self, cx: &Cx, r: Answer) -> WakeNext {
        let vm = self.spec.vm_name.clone();
        let import = import_name(&vm);
        let found = r
            .succeeded()
            .then(|| isolation::inspected_snapshot(&r, &import));
        match found {
            Some(Ok(Some(snap))) => {
                let label = format!("registry {vm}:{HIBERNATE_TAG}");
                let from = CloneSource::Snapshot(import);
                let (step, ask) = self.clone_from(cx, from, !snap.image.is_empty(), label);
                Next::Ask(step, ask)
            }
            _ => {
                let msg = format!("snapshot {import} missing after pull: {}", r.error_text());
                Self::failed("WakePullFailed", msg)
            }
        }
    }

    /// The clone of the wake answered: woken, or the leftover of a failed clone is looked for.
    fn cloned(&self, source: String, r: Answer) -> WakeNext {
        let vm = self.spec.vm_name.clone();
        // The import served its clone (or failed it); a retry pulls afresh.
        let chores = match source == import_name(&vm) {
            true => vec![Chore::RemoveSnapshot(source.clone())],
            false => vec![],
        };
        let next = if !r.succeeded() {
            // A clone killed at its deadline (or failing half-way) can leave a VM
            // record under the name: the retry's clone would then fail on the taken
            // name, and a delete before it would not know of the record. Look first.
            let error = format!("vm clone {vm} from {source}: {}", r.error_text());
            let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference: vm });
            Next::Ask(WakeStep::CloneFailedInspect { source, error }, ask)
        } else {
            match r.vm() {
                Ok(v) => Next::Then(WakeThen::Woken(v, source)),
                Err(e) => Self::failed("WakeCloneFailed", e.to_string()),
            }
        };
        match chores.is_empty() {
            true => next,
            false => Self::chore_then(chores, next),
        }
    }

    /// What a failed wake clone left under the VM name: a running VM is the clone finished
    /// after all, a stopped one is removed before the failure is reported.
    fn clone_failed_inspected(&self, source: String, error: String, r: Answer) -> WakeNext {
        let vm = self.spec.vm_name.clone();
        // Only a VM of this very name is the clone's (not one its name ID-prefixes).
        let found = r.vm().ok();
        match found.filter(|v| r.succeeded() && isolation::vm_named(v, &vm)) {
            // The clone finished after all (a slow clone past its deadline).
            Some(v) if v.running() => Next::Then(WakeThen::Woken(v, source)),
            Some(v) => {
                let ask = Ask::Cocoon(CocoonCmd::VmRm { id: v.id });
                Next::Ask(WakeStep::CloneFailedRm { error }, ask)
            }
            None => {
                let failed = Self::failed("WakeCloneFailed", error);
                match r.vm_not_found() {
                    true => Self::chore_then(vec![Chore::ForgetOwner(Owned::Vm, vm)], failed),
                    false => failed,
                }
            }
        }
    }

    /// No trusted local copy: the registry tag is the source.
    fn tag_source(&self, cx: &Cx) -> WakeNext {
        let vm = self.spec.vm_name.clone();
        let Some(tag) = self.tag.as_ref() else {
            let why = format!("no local snapshot and no {vm}:{HIBERNATE_TAG} in the registry");
            return Next::Then(WakeThen::NoSource(why));
        };
        // Whose hibernation the tag holds, before a peer or the registry serves any of it.
        if !cx.tag_readable(&vm, tag) {
            return Next::Then(WakeThen::Refused(tag_refusal(&vm, &cx.key.namespace)));
        }
        // Peer restore first: the raw snapshot files straight from the node that pushed the
        // tag (its from-node), checked against the tag's snapshot id. Any failure falls
        // through to the registry pull.
        if !tag.from_node.is_empty() && tag.from_node != cx.cfg.node_name {
            let (namespace, vm_name) = (cx.key.namespace.clone(), vm.clone());
            let (from_node, local_name) = (tag.from_node.clone(), import_name(&vm));
            let ask = Ask::effect(move |op| Effect::PeerRestore {
                op,
                namespace,
                vm_name,
                from_node,
                local_name,
            });
            return Next::Then(WakeThen::Staged(WakeStep::Peer, ask, None));
        }
        self.pull(cx)
    }

    /// The registry pull of the hibernate tag into the import snapshot, once the import's
    /// owner (the pod's namespace) is on record.
    fn pull(&self, cx: &Cx) -> WakeNext {
        let vm = &self.spec.vm_name;
        let (repo, local_name) = (vm.to_string(), import_name(vm));
        // Exactly the manifest whose owner was checked, by its digest.
        let tag = self
            .tag
            .as_ref()
            .map(|t| t.digest.clone())
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| HIBERNATE_TAG.into());
        let pull = Effect::PullSnapshot {
            op: 0,
            repo,
            tag,
            local_name: local_name.clone(),
        };
        let owner = Owner::new(&cx.key.namespace, &self.uid);
        let ask = Provider::owned_then(Owned::Snapshot, &local_name, owner, Deferred::Effect(pull));
        Next::Ask(WakeStep::Pull, ask)
    }

    /// The clone of the VM from `from`; `label` names the source in the `Woken` event.
    fn clone_from(
        &mut self,
        cx: &Cx,
        from: CloneSource,
        pull: bool,
        label: String,
    ) -> (WakeStep, Ask) {
        let source = match &from {
            CloneSource::Snapshot(s) | CloneSource::FromDir(s) => s.clone(),
        };
        let mut args = create::clone_args(cx.cfg, &self.spec, from, pull);
        if drops_nic(&self.spec) {
            // The NIC was dropped before the save: the clone brings one back.
            args.nics = Some(1);
        }
        self.source_label = label;
        (
            WakeStep::Clone { source },
            Ask::Cocoon(CocoonCmd::VmClone(args)),
        )
    }
}
