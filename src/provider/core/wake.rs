//! Wake and restore: find the hibernated VM's snapshot (local copy verified against the
//! registry tag, else a pull of the tag), clone the VM back under its name, then the follow-up.

use super::hibernate::{drops_nic, HIBERNATE_TAG};
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

    /// The running wake as it stands now, while its incarnation is tracked.
    fn wake_op(&self, key: &PodKey) -> Option<WakeOp> {
        let w = self.op_of::<WakeOp>(key)?;
        self.tracked_as(key, &w.uid)?;
        Some(w.clone())
    }

    /// An answer to the wake `w`.
    pub(super) fn wake_step(&mut self, key: &PodKey, w: WakeOp, res: Res) {
        if self.tracked_as(key, &w.uid).is_none() {
            return self.end_op(key);
        }
        let superseded = self.slots.get(key).is_some_and(|s| {
            s.latest
                .as_ref()
                .is_none_or(|p| pod_uid(p) != w.uid || deleting(p))
        });
        if superseded {
            // Deleted (or replaced) meanwhile: the delete that follows looks the VM up by
            // name, so a clone this very answer reports is removed before the object goes.
            log::info!("provider: {key}: wake stopped, the pod is being deleted");
            return self.end_op(key);
        }
        let vm = w.spec.vm_name.clone();
        match (w.step.clone(), res) {
            (WakeStep::LocalInspect, Res::Cocoon(r)) => self.wake_local_inspected(key, &w, r),
            (
                WakeStep::Verify {
                    local_id,
                    local_image,
                },
                Res::Evidence(found),
            ) => self.wake_local_verified(key, &w, &local_id, &local_image, found),
            (WakeStep::RmStale, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.snapshot_not_found() {
                    log::warn!(
                        "provider: {key}: remove stale snapshot {vm}: {}",
                        r.error_text()
                    );
                }
                self.snapshot_removed(&vm, &r);
                self.fork_invalidate(&vm);
                let name = spec::fork_snapshot_name(&vm);
                let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name });
                self.advance(key, WakeStep::RmStaleFork, ask)
            }
            (WakeStep::RmStaleFork, Res::Cocoon(r)) => {
                self.snapshot_removed(&spec::fork_snapshot_name(&vm), &r);
                self.wake_from_tag(key, &w)
            }
            (WakeStep::Tag, Res::Evidence(found)) => match found {
                Ok(tag) => {
                    self.wake_set_tag(key, tag);
                    match self.wake_op(key) {
                        Some(w) => self.wake_from_tag(key, &w),
                        None => self.end_op(key),
                    }
                }
                Err(e) => {
                    let msg = format!("look up {vm}:{HIBERNATE_TAG}: {e}");
                    self.wake_failed(key, fail("WakePullFailed", msg))
                }
            },
            (WakeStep::Peer, Res::Transfer(r)) => match r {
                Ok(dir) => {
                    let label = format!("peer {}", w.tag.as_ref().map_or("", |t| &t.from_node));
                    self.wake_clone(key, &w, CloneSource::FromDir(dir.clone()), false, label);
                    self.own_staging(key, Some(dir))
                }
                Err(e) => {
                    log::warn!(
                        "provider: {key}: peer restore of {vm}: {e}; pulling from the registry"
                    );
                    self.wake_pull(key, &vm)
                }
            },
            (WakeStep::Pull, Res::Transfer(r)) => match r {
                Ok(_) => {
                    self.metric(MetricUpdate::SnapshotPull { result: "ok" });
                    let name = import_name(&vm);
                    let ask = Ask::Cocoon(CocoonCmd::SnapshotInspect { name });
                    self.advance(key, WakeStep::ImportInspect, ask)
                }
                Err(e) => {
                    self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                    let msg = format!("pull {vm}:{HIBERNATE_TAG}: {e}");
                    self.wake_failed(key, fail("WakePullFailed", msg))
                }
            },
            (WakeStep::ImportInspect, Res::Cocoon(r)) => {
                let import = import_name(&vm);
                let found = r
                    .succeeded()
                    .then(|| isolation::inspected_snapshot(&r, &import));
                match found {
                    Some(Ok(Some(snap))) => {
                        let label = format!("registry {vm}:{HIBERNATE_TAG}");
                        let from = CloneSource::Snapshot(import);
                        self.wake_clone(key, &w, from, !snap.image.is_empty(), label)
                    }
                    _ => {
                        let msg =
                            format!("snapshot {import} missing after pull: {}", r.error_text());
                        self.wake_failed(key, fail("WakePullFailed", msg))
                    }
                }
            }
            (WakeStep::Clone { source }, Res::Cocoon(r)) => self.wake_cloned(key, &w, source, r),
            (WakeStep::CloneFailedInspect { source, error }, Res::Cocoon(r)) => {
                self.wake_clone_failed_inspected(key, &w, &source, error, r)
            }
            (WakeStep::CloneFailedRm { error }, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    log::warn!(
                        "provider: {key}: remove leftover of failed wake clone: {}",
                        r.error_text()
                    );
                } else {
                    self.forget_owner(Owned::Vm, &vm);
                }
                self.wake_failed(key, fail("WakeCloneFailed", error))
            }
            (step, res) => self.unexpected_answer(key, &step, &res),
        }
    }

    /// The local snapshot named after the VM: cloned without a registry, verified against
    /// the registry's tag with one, passed over for the tag when absent or not the pod's.
    fn wake_local_inspected(&mut self, key: &PodKey, w: &WakeOp, r: Answer) {
        let vm = w.spec.vm_name.clone();
        let evidence =
            |vm_name: String| Ask::effect(move |op| Effect::CheckHibernateEvidence { op, vm_name });
        // Another snapshot than `<vm>` (an ID-prefix match) is none.
        let local = match r.succeeded() {
            true => match isolation::inspected_snapshot(&r, &vm) {
                Ok(s) => s,
                Err(e) => return self.wake_failed(key, fail("WakePullFailed", e.to_string())),
            },
            false => None,
        };
        // A local copy recorded for another namespace is never read; one that no
        // record or name ties to the pod's is passed over for the registry's tag.
        if local.is_some() && self.snapshot_of_another(key, &vm) {
            let msg = format!(
                "the local snapshot {vm} is not recorded for namespace {}",
                key.namespace
            );
            return self.wake_refused(key, &w.uid, w.restore, msg);
        }
        let owned = self.owns_snapshot(key, &vm, &vm);
        if local.is_some() && !owned && !self.cfg.registry {
            let msg = format!(
                "the local snapshot {vm} is not recorded for namespace {} and its name \
                     does not prove it",
                key.namespace
            );
            return self.wake_refused(key, &w.uid, w.restore, msg);
        }
        if let Some(snap) = local.filter(|_| owned) {
            if !self.cfg.registry {
                // Without a registry the local copy is the only one, and trusted.
                let label = format!("local snapshot {vm}");
                return self.wake_clone(
                    key,
                    w,
                    CloneSource::Snapshot(vm.clone()),
                    !snap.image.is_empty(),
                    label,
                );
            }
            let step = WakeStep::Verify {
                local_id: snap.id,
                local_image: snap.image,
            };
            return self.advance(key, step, evidence(vm));
        }
        if !r.succeeded() && !r.snapshot_not_found() {
            let msg = format!("inspect local snapshot {vm}: {}", r.error_text());
            return self.wake_failed(key, fail("WakePullFailed", msg));
        }
        if !self.cfg.registry {
            return self.no_wake_source(key, w, "no local snapshot and no registry configured");
        }
        self.advance(key, WakeStep::Tag, evidence(vm))
    }

    /// The registry's tag read to verify the local copy: the same snapshot is cloned, another
    /// (or none) makes the local copy stale.
    fn wake_local_verified(
        &mut self,
        key: &PodKey,
        w: &WakeOp,
        local_id: &str,
        local_image: &str,
        found: Result<Option<HibernateTag>, TransferError>,
    ) {
        let vm = w.spec.vm_name.clone();
        match found {
            Ok(Some(tag)) if !self.tag_readable(key, &vm, &tag) => {
                let msg = tag_refusal(&vm, &key.namespace);
                self.wake_refused(key, &w.uid, w.restore, msg)
            }
            Ok(Some(tag)) if !tag.snapshot_id.is_empty() && tag.snapshot_id == local_id => {
                self.metric(MetricUpdate::SnapshotVerify { result: "ok" });
                let label = format!("local snapshot {vm}");
                self.wake_clone(
                    key,
                    w,
                    CloneSource::Snapshot(vm.clone()),
                    !local_image.is_empty(),
                    label,
                )
            }
            Ok(tag) => {
                // The registry holds another hibernation (or none): the local copy is stale.
                self.metric(MetricUpdate::SnapshotVerify { result: "stale" });
                self.wake_set_tag(key, tag);
                let ask = Ask::Cocoon(CocoonCmd::SnapshotRm { name: vm });
                self.advance(key, WakeStep::RmStale, ask)
            }
            Err(e) => {
                // Never trust an unverified copy.
                self.metric(MetricUpdate::SnapshotVerify { result: "error" });
                let msg = format!("verify local snapshot {vm} against {vm}:{HIBERNATE_TAG}: {e}");
                self.wake_failed(key, fail("WakePullFailed", msg))
            }
        }
    }

    /// The clone of the wake answered: woken, or the leftover of a failed clone is looked for.
    fn wake_cloned(&mut self, key: &PodKey, w: &WakeOp, source: String, r: Answer) {
        let vm = w.spec.vm_name.clone();
        if source == import_name(&vm) {
            // The import served its clone (or failed it); a retry pulls afresh.
            self.remove_snapshot_detached(&source);
        }
        if !r.succeeded() {
            // A clone killed at its deadline (or failing half-way) can leave a VM
            // record under the name: the retry's clone would then fail on the taken
            // name, and a delete before it would not know of the record. Look first.
            let error = format!("vm clone {vm} from {source}: {}", r.error_text());
            let ask = Ask::Cocoon(CocoonCmd::VmInspect {
                reference: vm.clone(),
            });
            return self.advance(key, WakeStep::CloneFailedInspect { source, error }, ask);
        }
        match r.vm() {
            Ok(v) => self.woken(key, w, v, &source),
            Err(e) => self.wake_failed(key, fail("WakeCloneFailed", e.to_string())),
        }
    }

    /// What a failed wake clone left under the VM name: a running VM is the clone finished
    /// after all, a stopped one is removed before the failure is reported.
    fn wake_clone_failed_inspected(
        &mut self,
        key: &PodKey,
        w: &WakeOp,
        source: &str,
        error: String,
        r: Answer,
    ) {
        let vm = w.spec.vm_name.clone();
        // Only a VM of this very name is the clone's (not one its name ID-prefixes).
        let found = r.vm().ok();
        match found.filter(|v| r.succeeded() && isolation::vm_named(v, &vm)) {
            // The clone finished after all (a slow clone past its deadline).
            Some(v) if v.running() => self.woken(key, w, v, source),
            Some(v) => {
                let ask = Ask::Cocoon(CocoonCmd::VmRm { id: v.id });
                self.advance(key, WakeStep::CloneFailedRm { error }, ask)
            }
            None => {
                if r.vm_not_found() {
                    self.forget_owner(Owned::Vm, &vm);
                }
                self.wake_failed(key, fail("WakeCloneFailed", error))
            }
        }
    }

    fn wake_set_tag(&mut self, key: &PodKey, tag: Option<HibernateTag>) {
        if let Some(w) = self.op_of_mut::<WakeOp>(key) {
            w.tag = tag;
        }
    }

    /// No trusted local copy: the registry tag is the source.
    fn wake_from_tag(&mut self, key: &PodKey, w: &WakeOp) {
        let vm = w.spec.vm_name.clone();
        let Some(tag) = w.tag.as_ref() else {
            let why = format!("no local snapshot and no {vm}:{HIBERNATE_TAG} in the registry");
            return self.no_wake_source(key, w, &why);
        };
        // Whose hibernation the tag holds, before a peer or the registry serves any of it.
        if !self.tag_readable(key, &vm, tag) {
            let msg = tag_refusal(&vm, &key.namespace);
            return self.wake_refused(key, &w.uid, w.restore, msg);
        }
        // Peer restore first: the raw snapshot files straight from the node that pushed the
        // tag (its from-node), checked against the tag's snapshot id. Any failure falls
        // through to the registry pull.
        if !tag.from_node.is_empty() && tag.from_node != self.cfg.node_name {
            let (namespace, vm_name) = (key.namespace.clone(), vm.clone());
            let (from_node, local_name) = (tag.from_node.clone(), import_name(&vm));
            let ask = Ask::effect(move |op| Effect::PeerRestore {
                op,
                namespace,
                vm_name,
                from_node,
                local_name,
            });
            self.advance(key, WakeStep::Peer, ask);
            return self.own_staging(key, None);
        }
        self.wake_pull(key, &vm)
    }

    /// The step just asked (the peer restore, or the clone from its staged copy) answers
    /// through a waiter that removes the staged copy once it is spent.
    fn own_staging(&mut self, key: &PodKey, dir: Option<String>) {
        if let Some(op) = self.slots.get(key).and_then(|s| s.awaiting) {
            let key = key.clone();
            self.waiters.insert(op, Waiter::Staged { key, dir });
        }
    }

    /// The registry pull of the hibernate tag into the import snapshot, once the import's
    /// owner (the pod's namespace) is on record.
    fn wake_pull(&mut self, key: &PodKey, vm: &str) {
        let Some(w) = self.wake_op(key) else {
            return;
        };
        let (repo, local_name) = (vm.to_string(), import_name(vm));
        // Exactly the manifest whose owner was checked, by its digest.
        let tag = w
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
        let owner = Owner::new(&key.namespace, &w.uid);
        let ask = Self::owned_then(Owned::Snapshot, &local_name, owner, Deferred::Effect(pull));
        self.advance(key, WakeStep::Pull, ask)
    }

    fn wake_clone(
        &mut self,
        key: &PodKey,
        w: &WakeOp,
        from: CloneSource,
        pull: bool,
        label: String,
    ) {
        let source = match &from {
            CloneSource::Snapshot(s) | CloneSource::FromDir(s) => s.clone(),
        };
        let mut args = self.clone_args(&w.spec, from, pull);
        if drops_nic(&w.spec) {
            // The NIC was dropped before the save: the clone brings one back.
            args.nics = Some(1);
        }
        if let Some(w) = self.op_of_mut::<WakeOp>(key) {
            w.source_label = label;
        }
        self.advance(
            key,
            WakeStep::Clone { source },
            Ask::Cocoon(CocoonCmd::VmClone(args)),
        )
    }

    /// Nothing to wake from, authoritatively (no local snapshot, the tag absent): a restore
    /// the pod asked for fails; a wake boots the pod afresh as CreatePod would, since no
    /// retry can ever find a source (the operator deleted the tag, or the pod never ran).
    fn no_wake_source(&mut self, key: &PodKey, w: &WakeOp, why: &str) {
        let msg = format!("no wake source for vm {}: {why}", w.spec.vm_name);
        if w.restore {
            return self.wake_failed(key, fail("WakePullFailed", msg));
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
        self.wake_failed(key, fail("UnexpectedAnswer", msg.to_string()))
    }

    /// A wake or restore failed before a VM existed. A restore fails its create (retried with
    /// the pod's backoff); a wake fails the update (retried on the op schedule).
    fn wake_failed(&mut self, key: &PodKey, failure: OpFailure) {
        let Some(w) = self.wake_op(key) else {
            return;
        };
        self.metric(MetricUpdate::Wake { result: "failed" });
        if w.restore {
            return self.fail_create_as(key, &w.uid, failure.reason, &failure.message, true);
        }
        let err = format!("wake: {}", failure.message);
        self.update_failed(key, &w.uid, failure.reason, &err);
    }
}
