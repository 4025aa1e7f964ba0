//! Kube writes: pod status and annotation patches with their retries, lifecycle records,
//! the Ready publication, and the periodic drift and lifecycle re-flush.
//!
//! The writes of one managed pod from ADDED to Running on the plain path (a fresh pod, a
//! create that is Ready within `STATUS_HOLD`), and why each exists (the kube lane merges a
//! queued annotation patch into the one before it and a newer status replaces a queued older
//! one, so under backlog fewer reach the API server):
//! 1. The Running status with Ready (status, after the first successful probe): the cluster
//!    sees only what the daemon pushes.
//! 2. `vm.cocoonstack.io/id` and `ip`, lifecycle `ready` and, after a fix-up, post-clone-state
//!    `done` (one annotation patch, only after write 1 landed): a restart never claims a Ready
//!    that the cluster did not see; the pod names its VM, which users, exec and logs address.
//!
//! The writes that went, and the durable record that stands for each:
//! - `lifecycle-state=creating` at the create's start: the ownership ledger's record of the VM
//!   for the pod's uid (`owners.json`, durable before the clone) with the VM of the pod's name
//!   in cocoon's list. A restart adopts that VM by name and resumes the create (fix-up or IP
//!   wait) instead of publishing Ready at once (`ledger_create`). A pod that carries a record
//!   (an earlier attempt's `failed`, a wake's state) still gets its `creating` written, so that
//!   record does not stand beside this attempt.
//! - The early `id` / `ip` patch: the same ledger record and the VM's name; a restart before
//!   write 2 adopts by name (and re-writes id / ip, as any adoption by name does).
//! - post-clone-state `running` before a clone's fix-up: no marker means the restart runs the
//!   fix-up the clone needs again, which only sets what it set before. It is still written
//!   for a wake (a woken guest's dropped NIC must not be cycled) and over an earlier marker.
//! - The non-final statuses (Pending, Running not Ready): held for `STATUS_HOLD`; a create not
//!   Ready by then writes its current status, so a slow one still shows progress.
//!
//! A delete writes two: the terminal status (the pod's last phase is recorded before the
//! object goes) and the DELETE with grace 0 once the VM is removed (the daemon, not the
//! kubelet, ends the object). A pod that fails writes its Failed status and its lifecycle.

use super::*;

impl Provider {
    pub(super) fn send_status(
        &mut self,
        key: &PodKey,
        uid: &str,
        st: PodStatus,
        ready_publication: bool,
    ) {
        let op = self.op_id();
        let st = Arc::new(st);
        let slot = self.slot(key);
        slot.shown = Some((uid.to_string(), st.clone()));
        // A status written ends the create's hold: what it held is older than this one.
        slot.status_hold = None;
        let effect = Effect::PatchPodStatus {
            op,
            key: key.clone(),
            uid: uid.to_string(),
            status: st,
        };
        self.waiters.insert(
            op,
            Waiter::Status {
                key: key.clone(),
                uid: uid.to_string(),
                ready_publication,
                attempt: 1,
                effect: effect.clone(),
            },
        );
        self.out.push(effect);
    }

    pub(super) fn send_annotations(
        &mut self,
        key: &PodKey,
        uid: &str,
        ann: BTreeMap<String, Option<String>>,
        lifecycle: bool,
    ) {
        let mut ann = ann;
        if let Some(slot) = self.slots.get_mut(key) {
            if let Some((owed_uid, owed)) = slot.owed_annotations.take() {
                if owed_uid == uid {
                    // The patch's own values win (a `failed` marker, a cleared key).
                    for (k, v) in owed {
                        ann.entry(k).or_insert(v);
                    }
                }
            }
        }
        let op = self.op_id();
        let effect = Effect::PatchPodAnnotations {
            op,
            key: key.clone(),
            uid: Some(uid.to_string()),
            annotations: ann,
        };
        self.waiters.insert(
            op,
            Waiter::Annotations {
                key: key.clone(),
                uid: uid.to_string(),
                lifecycle,
                attempt: 1,
                effect: effect.clone(),
            },
        );
        self.out.push(effect);
    }

    pub(super) fn reissue(&mut self, waiter: Waiter) {
        // A lifecycle flush is retried only while the intent is unchanged; a newer state
        // written meanwhile must not be overwritten by this older one.
        // Other patches that carry the triple (the id/ip write) carry the current one.
        let mut waiter = waiter;
        // A retry for an incarnation whose object we deleted (grace 0), are deleting (the
        // DELETE of a pod we never tracked is on its way: it may land before this retry) or
        // that is gone from the API has nothing left to write to: dropped.
        if let Waiter::Status { key, uid, .. } | Waiter::Annotations { key, uid, .. } = &waiter {
            let ended = self.slots.get(key).is_none_or(|s| {
                s.idle.api_deleted(uid)
                    || s.op()
                        .and_then(ApiDeleteOp::of)
                        .is_some_and(|a| a.uid == *uid)
                    || s.latest.as_ref().is_none_or(|p| pod_uid(p) != *uid)
            });
            if ended {
                return;
            }
        }
        // A status retry whose status is no longer the latest sent would overwrite a newer one
        // (a Pending retried after Running was written): the newer write carries the truth.
        if let Waiter::Status {
            key,
            effect: Effect::PatchPodStatus { status, .. },
            ..
        } = &waiter
        {
            let newer = self
                .slots
                .get(key)
                .and_then(|s| s.shown.as_ref())
                .is_some_and(|(_, shown)| !Arc::ptr_eq(shown, status));
            if newer {
                return;
            }
        }
        if let Waiter::Annotations {
            key,
            uid,
            lifecycle,
            effect,
            ..
        } = &mut waiter
        {
            if *lifecycle && !self.lifecycle_current(key, uid, effect) {
                return;
            }
            // An id / ip retry that a newer write overtook (a hibernate cleared them, another
            // VM took over) would name a VM the pod no longer has: those keys go from it.
            if let Effect::PatchPodAnnotations { annotations, .. } = effect {
                if let Some(sent) = annotations.get(ANN_VM_ID) {
                    let current = self
                        .slots
                        .get(key)
                        .and_then(|s| s.tracked.as_ref())
                        .filter(|t| t.uid == *uid)
                        .and_then(|t| t.vm.as_ref())
                        .map(|v| v.id.clone());
                    if *sent != current {
                        annotations.remove(ANN_VM_ID);
                        annotations.remove(ANN_VM_IP);
                    }
                }
            }
            let intent = self.slots.get(key).and_then(|s| s.intent.as_ref());
            if let (false, Effect::PatchPodAnnotations { annotations, .. }) = (*lifecycle, effect) {
                if annotations.contains_key(spec::ANN_LIFECYCLE_STATE) {
                    match intent.filter(|i| i.uid == *uid) {
                        Some(i) => annotations.extend(i.patch()),
                        None => {
                            for k in [
                                spec::ANN_LIFECYCLE_STATE,
                                spec::ANN_LIFECYCLE_GEN,
                                spec::ANN_LIFECYCLE_MSG,
                            ] {
                                annotations.remove(k);
                            }
                        }
                    }
                }
            }
        }
        let op = self.op_id();
        let effect = match &waiter {
            Waiter::Status { effect, .. } | Waiter::Annotations { effect, .. } => {
                with_op(effect, op)
            }
            _ => return,
        };
        self.waiters.insert(op, waiter);
        self.out.push(effect);
    }

    /// Whether a lifecycle patch still says what the pod's intent says (same incarnation).
    pub(super) fn lifecycle_current(&self, key: &PodKey, uid: &str, effect: &Effect) -> bool {
        let Effect::PatchPodAnnotations { annotations, .. } = effect else {
            return false;
        };
        self.slots
            .get(key)
            .and_then(|s| s.intent.as_ref())
            .map(|i| i.uid == uid && i.patch().iter().all(|(k, v)| annotations.get(k) == Some(v)))
            .unwrap_or(false)
    }

    // ----- lifecycle triple -----------------------------------------------------------------

    /// Set the lifecycle state and flush it. Returns whether it was accepted.
    pub(super) fn set_lifecycle(&mut self, key: &PodKey, state: State, message: &str) -> bool {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.as_ref() else {
            return false;
        };
        let uid = t.uid.clone();
        let gen = lifecycle_generation(slot, t);
        let Some(next) = lifecycle::apply(slot.intent.as_ref(), &uid, state, gen, message) else {
            return false;
        };
        let unchanged = next.flushed;
        let patch = next.patch();
        slot.intent = Some(next);
        if !unchanged {
            self.send_annotations(key, &uid, patch, true);
        }
        true
    }

    /// A create's `creating`. A fresh pod (no lifecycle record on it, none in memory for its
    /// uid) keeps it in memory only: the ownership ledger's record, durable before the clone,
    /// names the pod's uid beside its VM, and a restart takes that for the create in flight
    /// (`ledger_create`). A pod with a record (an earlier attempt's `failed`, a wake's state)
    /// has it written, so that record does not stand while this attempt runs.
    pub(super) fn begin_creating(&mut self, key: &PodKey) {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        let recorded = |p: &Pod| {
            p.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(spec::ANN_LIFECYCLE_STATE))
        };
        let fresh = slot.intent.as_ref().is_none_or(|i| i.uid != t.uid)
            && !recorded(&t.pod)
            && !slot
                .latest
                .as_deref()
                .is_some_and(|p| pod_uid(p) == t.uid && recorded(p));
        if !fresh {
            self.set_lifecycle(key, State::Creating, "");
            return;
        }
        let gen = lifecycle_generation(slot, t);
        if let Some(mut next) = lifecycle::apply(None, &t.uid, State::Creating, gen, "") {
            // Not written, and not to be: the pod shows no lifecycle until its `ready` (or
            // `failed`), and the lifecycle reconciler has nothing to re-flush.
            next.flushed = true;
            slot.intent = Some(next);
        }
    }

    /// The hold of a create's non-final statuses begins (see `STATUS_HOLD`).
    pub(super) fn hold_statuses(&mut self, key: &PodKey, uid: &str) {
        self.slot(key).status_hold = Some(uid.to_string());
        let at = self.now + STATUS_HOLD;
        let (key, uid) = (key.clone(), uid.to_string());
        self.arm(at, TimerEntry::StatusHold { key, uid });
    }

    /// The hold ended with no status written since: the pod's current one is written now
    /// (unless the incarnation went or is being deleted: its delete writes its own).
    pub(super) fn status_hold_ended(&mut self, key: &PodKey, uid: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.status_hold.as_deref() != Some(uid) {
            return;
        }
        slot.status_hold = None;
        let live = slot.tracked.as_ref().is_some_and(|t| t.uid == uid)
            && slot
                .latest
                .as_deref()
                .is_some_and(|p| pod_uid(p) == uid && !deleting(p));
        if live {
            self.push_status(key, false);
        }
    }

    /// Annotations of an incarnation that ride on its next annotation patch (merged with any
    /// already owed; the newer value of a key wins).
    pub(super) fn owe_annotations(
        &mut self,
        key: &PodKey,
        uid: &str,
        ann: BTreeMap<String, Option<String>>,
    ) {
        let slot = self.slot(key);
        match slot.owed_annotations.as_mut() {
            Some((owed_uid, owed)) if owed_uid == uid => owed.extend(ann),
            _ => slot.owed_annotations = Some((uid.to_string(), ann)),
        }
    }

    /// Whether the VM id / ip of this incarnation are owed to its next annotation patch.
    pub(super) fn vm_id_owed(&self, key: &PodKey, uid: &str) -> bool {
        self.slots
            .get(key)
            .and_then(|s| s.owed_annotations.as_ref())
            .is_some_and(|(u, owed)| u == uid && owed.contains_key(ANN_VM_ID))
    }

    /// markReadyPublished: intent `ready` in memory, status patch first, annotation after.
    pub(super) fn publish_ready(&mut self, key: &PodKey) {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.clone() else {
            return;
        };
        let gen = lifecycle_generation(slot, &t);
        match lifecycle::apply(slot.intent.as_ref(), &t.uid, State::Ready, gen, "") {
            Some(next) => {
                let already = next.flushed;
                slot.intent = Some(next);
                let st = self.compute_status(self.slots.get(key).unwrap_or(&Slot::default()), &t);
                self.slot(key).last_pushed = Some(status::summary(&st));
                if already {
                    self.send_status(key, &t.uid, st, false);
                    // No lifecycle patch follows: what is owed to it goes now.
                    let owed = self
                        .slots
                        .get(key)
                        .and_then(|s| s.owed_annotations.as_ref());
                    if owed.is_some_and(|(u, _)| *u == t.uid) {
                        self.send_annotations(key, &t.uid, BTreeMap::new(), false);
                    }
                } else {
                    self.send_status(key, &t.uid, st, true);
                }
            }
            None => self.push_status(key, false),
        }
    }

    // ----- status ---------------------------------------------------------------------------

    pub(super) fn compute_status(&self, slot: &Slot, t: &Tracked) -> PodStatus {
        if t.vm.is_none() {
            return status::pending(t.start_time.as_ref());
        }
        let lifecycle_ready = slot
            .intent
            .as_ref()
            .map(|i| i.uid == t.uid && i.state == State::Ready)
            .unwrap_or(false);
        let (probe_ready, msg) = match &t.probe {
            Some((r, m)) => (*r, Some(m.as_str())),
            None => (false, None),
        };
        status::running(
            &t.ip,
            probe_ready && lifecycle_ready,
            msg,
            t.start_time.as_ref(),
            &self.wall,
        )
    }

    /// Push the computed status if it differs from the last one pushed (or always when `force`).
    pub(super) fn push_status(&mut self, key: &PodKey, force: bool) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_ref() else {
            return;
        };
        // An eviction wrote the pod's last status (Failed): a probe answer or a drift pass
        // while its DELETE is out must not write Running over it (nor after a grace-0 one).
        if slot.op().and_then(EvictOp::of).is_some() {
            return;
        }
        let st = self.compute_status(slot, t);
        let sum = status::summary(&st);
        if !force && slot.last_pushed.as_ref() == Some(&sum) {
            return;
        }
        // Held: a create's non-final status waits for the hold's end (or its Ready).
        if slot.status_hold.as_deref() == Some(t.uid.as_str()) && !status::is_ready(&st) {
            return;
        }
        let uid = t.uid.clone();
        self.slot(key).last_pushed = Some(sum);
        self.send_status(key, &uid, st, false);
    }

    /// Status reconciler: republish drifted statuses and repair the ip annotation.
    pub(super) fn drift(&mut self) {
        let at = self.now + DRIFT_EVERY;
        self.arm(at, TimerEntry::Drift);
        let keys: Vec<PodKey> = self.slots.keys().cloned().collect();
        for key in keys {
            let slot = &self.slots[&key];
            if slot.latest.is_none() && slot.tracked.is_none() && slot.op().is_none() {
                // A slot whose pod is gone and which waits for nothing: a late answer (a
                // write acked after the pod's removal) may have re-opened it after the
                // reconcile that dropped it. The reconcile's rule drops it again.
                self.reconcile_slot(&key);
                continue;
            }
            let (Some(t), Some(api)) = (slot.tracked.as_ref(), slot.latest.as_ref()) else {
                continue;
            };
            if t.uid != pod_uid(api) || t.vm.is_none() || deleting(api) {
                continue;
            }
            if matches!(
                slot.op(),
                Some(Op::Create(_)) | Some(Op::Evict(_)) | Some(Op::Delete(_))
            ) {
                continue;
            }
            let computed = status::summary(&self.compute_status(slot, t));
            let current = api.status.as_ref().map(status::summary).unwrap_or_default();
            let ann_ip = api
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANN_VM_IP).cloned());
            let (uid, ip, managed, vm_id) = (
                t.uid.clone(),
                t.ip.clone(),
                t.spec.managed,
                t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default(),
            );
            // Owed id / ip ride on the pod's next annotation patch (its `ready`).
            let owed = self.vm_id_owed(&key, &uid);
            if managed && !owed && ann_ip.as_deref() != Some(ip.as_str()) {
                let mut ann = BTreeMap::new();
                ann.insert(ANN_VM_ID.to_string(), Some(vm_id));
                ann.insert(ANN_VM_IP.to_string(), Some(ip));
                self.send_annotations(&key, &uid, ann, false);
            }
            if let Some(vnc) = self.macos_vnc_drift(&key) {
                let ann = BTreeMap::from([(macos::ANN_VNC_PORT.to_string(), vnc)]);
                self.send_annotations(&key, &uid, ann, false);
            }
            if computed != current {
                log::info!("provider: {key}: republishing drifted status");
                self.push_status(&key, true);
            }
            self.refresh_ip(&key);
        }
    }

    /// Lifecycle reconciler: re-flush unflushed intents; `ready` redoes status first.
    /// An intent whose lifecycle patch is still queued, in flight or due for a retry is left
    /// to that write: re-flushing a `ready` would write the pod's status a second time.
    pub(super) fn lifecycle_reflush(&mut self) {
        let at = self.now + LIFECYCLE_EVERY;
        self.arm(at, TimerEntry::Lifecycle);
        let retrying = self.timers.values().filter_map(|e| match e {
            TimerEntry::Reissue { waiter } => Some(waiter),
            _ => None,
        });
        let writing: std::collections::BTreeSet<(&PodKey, &str)> = self
            .waiters
            .values()
            .chain(retrying)
            .filter_map(|w| match w {
                Waiter::Annotations {
                    key,
                    uid,
                    lifecycle: true,
                    ..
                } => Some((key, uid.as_str())),
                _ => None,
            })
            .collect();
        let keys: Vec<PodKey> = self
            .slots
            .iter()
            .filter(|(k, s)| {
                s.intent
                    .as_ref()
                    .is_some_and(|i| !i.flushed && !writing.contains(&(*k, i.uid.as_str())))
                    && s.tracked
                        .as_ref()
                        .map(|t| Some(&t.uid) == s.intent.as_ref().map(|i| &i.uid))
                        .unwrap_or(false)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let Some(i) = self.slots[&key].intent.clone() else {
                continue;
            };
            if i.state == State::Ready {
                let slot = &self.slots[&key];
                if let Some(t) = slot.tracked.clone() {
                    let st = self.compute_status(slot, &t);
                    self.send_status(&key, &i.uid, st, true);
                }
            } else {
                self.send_annotations(&key, &i.uid, i.patch(), true);
            }
        }
    }
}

/// The generation a lifecycle write observes: the newest of the tracked pod and the latest
/// object of the same incarnation. A pod edited while its create was in flight has a newer
/// latest object; `Ready` must not be refused as older than the `creating` written for it.
fn lifecycle_generation(slot: &Slot, t: &Tracked) -> i64 {
    let latest = slot
        .latest
        .as_ref()
        .filter(|p| pod_uid(p) == t.uid)
        .map(|p| spec::generation(p))
        .unwrap_or(0);
    spec::generation(&t.pod).max(latest)
}
