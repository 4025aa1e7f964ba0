//! Answers: which op or shared waiter an effect's answer is for, the pod timers, and what
//! happens to an answer no step expects (a Warning and a retry, never a stall).

use super::*;

impl Provider {
    /// An answer the pod's op does not expect at its step (a mixed-up effect, or a bug): never
    /// a silent stall. A Warning `UnexpectedAnswer`, and the op fails the way that retries it:
    /// a create or delete on the pod's backoff, a check or eviction by a deferred recheck, a
    /// wait for Ready by its next poll.
    pub(super) fn unexpected_answer(
        &mut self,
        key: &PodKey,
        step: &dyn std::fmt::Debug,
        res: &Res,
    ) {
        let Some(op) = self.slots.get(key).and_then(|s| s.op().cloned()) else {
            return;
        };
        let msg = format!(
            "step {step:?} got an unexpected {} answer; retrying",
            res.kind()
        );
        log::warn!("provider: {key}: {msg}");
        let warn = |p: &mut Self, uid: &str| {
            p.event(key, uid, EventType::Warning, "UnexpectedAnswer", &msg);
        };
        match op {
            Op::Create(c) => self.fail_create_as(key, &c.uid, "UnexpectedAnswer", &msg, true),
            Op::Delete(d) => {
                warn(self, &d.uid);
                self.delete_failed(key, delete::DeleteError::Unexpected(msg.clone()))
            }
            Op::Evict(EvictOp { uid, .. }) | Op::Check(CheckOp { uid, .. }) => {
                warn(self, &uid);
                let vm_id = vm_id_of(self.slot(key));
                self.defer_check(key, uid, vm_id)
            }
            Op::ReadyWait(w) => {
                warn(self, &w.uid);
                self.ready_wait_poll(key, w)
            }
            Op::Hibernate(h) => {
                warn(self, &h.uid);
                self.hibernate_unexpected(key, &msg)
            }
            Op::Wake(w) => {
                warn(self, &w.uid);
                self.wake_unexpected(key, &msg)
            }
            Op::ConfirmHibernated(c) => {
                warn(self, &c.uid);
                self.confirm_hibernated_retry(key, c, &msg)
            }
            Op::PostClone(p) => {
                warn(self, &p.uid);
                self.post_clone_attempt_failed(key, *p, msg)
            }
            // The next watch round looks again.
            Op::MacosWatch(w) => {
                warn(self, &w.uid);
                self.end_op(key)
            }
            Op::Classify(c) => {
                warn(self, &c.uid);
                self.classify_lookup_failed(key, c, msg)
            }
            Op::ApiDelete(a) => {
                warn(self, &a.uid);
                let failed = Res::Kube(Err(KubeError::Other(msg.clone())));
                self.api_delete_result(key, a.uid, failed)
            }
        }
    }

    // ----- results and timers ---------------------------------------------------------------

    /// Hands a result to the op of the pod that waits on it, unless the op moved on.
    pub(super) fn pod_step_result(&mut self, key: &PodKey, op: OpId, res: Res) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.awaiting != Some(op) {
            return; // stale (op was preempted)
        }
        slot.awaiting = None;
        let Some(op) = slot.op().cloned() else {
            return;
        };
        // The one match on the op kind: each op gets the answer with its own state, and so
        // its own step type; its step checks what it needs (its incarnation, its VM).
        match op {
            Op::Create(c) => self.create_step(key, *c, res),
            Op::Delete(d) => self.delete_step(key, d, res),
            Op::Evict(e) => self.evict_step(key, e, res),
            Op::Check(c) => self.check_step(key, c, res),
            Op::Hibernate(h) => self.hibernate_step(key, *h, res),
            Op::Wake(w) => self.wake_step(key, *w, res),
            Op::ConfirmHibernated(c) => self.confirm_hibernated_step(key, c, res),
            Op::PostClone(p) => self.post_clone_step(key, &p, res),
            Op::MacosWatch(w) => self.macos_watch_step(key, w, res),
            Op::Classify(c) => self.classify_step(key, c, res),
            Op::ReadyWait(w) => self.ready_wait_step(key, w, res),
            Op::ApiDelete(a) => self.api_delete_step(key, a, res),
        }
    }

    pub(super) fn on_result(&mut self, op: OpId, res: Res) {
        let Some(waiter) = self.waiters.remove(&op) else {
            return;
        };
        match waiter {
            Waiter::Ignore => {}
            Waiter::Owners { for_, undo } => {
                let result = match res {
                    Res::Owners(r) => r,
                    other => Err(format!("unexpected {} answer", other.kind())),
                };
                self.owners_recorded(op, for_, undo, result)
            }
            Waiter::SnapshotRm { name } => {
                if let Res::Cocoon(r) = &res {
                    self.snapshot_removed(&name, r);
                }
            }
            Waiter::Reclaim(step) => self.reclaim_answer(step, res),
            Waiter::PodStep(key) => self.pod_step_result(&key, op, res),
            Waiter::Staged { key, dir } => {
                let live = self.slots.get(&key).is_some_and(|s| s.awaiting == Some(op));
                // The clone from a staged copy has answered (either way), or a copy arrived
                // that no op will clone from: it is spent.
                let spent = match (dir, &res) {
                    (Some(dir), _) => Some(dir),
                    (None, Res::Transfer(Ok(dir))) if !live => Some(dir.clone()),
                    _ => None,
                };
                if let Some(dir) = spent {
                    self.out.push(Effect::RemoveStagedDir { dir });
                }
                self.pod_step_result(&key, op, res)
            }
            Waiter::SharedRead { argv, keys } => {
                self.shared_reads.remove(&argv);
                if let Res::Cocoon(r) = res {
                    self.read_facts.read_answered(&argv, &r);
                    for key in keys {
                        self.pod_step_result(&key, op, Res::Cocoon(r.clone()));
                    }
                }
            }
            Waiter::Status {
                key,
                uid,
                ready_publication,
                attempt,
                effect,
            } => self.status_written(res, key, uid, ready_publication, attempt, effect),
            Waiter::Annotations {
                key,
                uid,
                lifecycle,
                attempt,
                effect,
            } => self.annotations_written(res, key, uid, lifecycle, attempt, effect),
            Waiter::Lease { key, uid } => {
                if let Res::Lease(Ok(Some(ip))) = res {
                    let same = self
                        .slots
                        .get(&key)
                        .and_then(|s| s.tracked.as_ref())
                        .map(|t| t.uid == uid && t.vm.is_some())
                        .unwrap_or(false);
                    if same && !ip.is_empty() {
                        self.set_ip(&key, &ip);
                        self.push_status(&key, false);
                    }
                }
            }
            Waiter::StaleCreate { vm, watcher } => self.stale_result(vm, watcher, res),
            Waiter::StaleInspect { vm, watcher } => self.stale_inspect_result(vm, watcher, res),
            Waiter::Fork { source } => self.fork_flight_step(&source, res),
        }
    }

    /// A status patch answered: a Ready publication is followed by its lifecycle annotations,
    /// a failure is retried (then left to the drift / lifecycle reconcilers).
    fn status_written(
        &mut self,
        res: Res,
        key: PodKey,
        uid: String,
        ready_publication: bool,
        attempt: u32,
        effect: Effect,
    ) {
        let r = match res {
            Res::Kube(r) => r,
            _ => return,
        };
        match r {
            Ok(()) => {
                if ready_publication {
                    let patch = {
                        let slot = self.slot(&key);
                        match slot.intent.as_ref() {
                            Some(i) if i.uid == uid && i.state == State::Ready => Some(i.patch()),
                            _ => None,
                        }
                    };
                    if let Some(p) = patch {
                        self.send_annotations(&key, &uid, p, true);
                    }
                }
            }
            Err(e) if e.superseded() => {}
            Err(_) if attempt < KUBE_ATTEMPTS => {
                let at = self.now + KUBE_RETRY;
                self.arm(
                    at,
                    TimerEntry::Reissue {
                        waiter: Waiter::Status {
                            key,
                            uid,
                            ready_publication,
                            attempt: attempt + 1,
                            effect,
                        },
                    },
                );
            }
            Err(_) => {
                // Let the drift / lifecycle reconcilers re-publish.
                if let Some(s) = self.slots.get_mut(&key) {
                    s.last_pushed = None;
                }
            }
        }
    }

    /// An annotations patch answered: a lifecycle write is marked flushed, dropped when
    /// superseded, or retried while it is still current.
    fn annotations_written(
        &mut self,
        res: Res,
        key: PodKey,
        uid: String,
        lifecycle: bool,
        attempt: u32,
        effect: Effect,
    ) {
        let r = match res {
            Res::Kube(r) => r,
            _ => return,
        };
        let still_current = |p: &Self| p.lifecycle_current(&key, &uid, &effect);
        match r {
            Ok(()) => {
                if lifecycle && still_current(self) {
                    if let Some(i) = self.slot(&key).intent.as_mut() {
                        i.flushed = true;
                    }
                }
            }
            Err(e) if e.superseded() => {
                if lifecycle && still_current(self) {
                    self.slot(&key).intent = None;
                }
            }
            Err(_) if attempt < KUBE_ATTEMPTS && (!lifecycle || still_current(self)) => {
                let at = self.now + KUBE_RETRY;
                self.arm(
                    at,
                    TimerEntry::Reissue {
                        waiter: Waiter::Annotations {
                            key,
                            uid,
                            lifecycle,
                            attempt: attempt + 1,
                            effect,
                        },
                    },
                );
            }
            Err(_) => {}
        }
    }

    pub(super) fn tick(&mut self) {
        while let Some((&(at, seq), _)) = self.timers.iter().next() {
            if at > self.now {
                break;
            }
            let Some(entry) = self.timers.remove(&(at, seq)) else {
                break;
            };
            match entry {
                TimerEntry::Pod { key, token } => self.pod_timer(&key, token),
                TimerEntry::Drift => self.drift(),
                TimerEntry::Lifecycle => self.lifecycle_reflush(),
                TimerEntry::Reclaim => self.reclaim_tick(),
                TimerEntry::MacosWatch => self.macos_watch_tick(),
                TimerEntry::Reissue { waiter } => self.reissue(waiter),
                TimerEntry::StaleWatch { vm, delay, until } => {
                    self.stale_watch_tick(vm, delay, until)
                }
                TimerEntry::Adopt => self.adopt_chunk(),
                TimerEntry::StatusHold { key, uid } => self.status_hold_ended(&key, &uid),
            }
        }
    }

    pub(super) fn pod_timer(&mut self, key: &PodKey, token: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.timer.map(|(_, t)| t) != Some(token) {
            return;
        }
        slot.timer = None;
        if slot.retry_at.map(|t| t <= self.now).unwrap_or(false) {
            slot.retry_at = None;
        }
        let Some(op) = slot.op().cloned() else {
            return self.reconcile_slot(key);
        };
        // The timers' one match on the op kind: each op's own handler, with its own state.
        match op {
            Op::ReadyWait(w) => self.ready_wait_poll(key, w),
            Op::PostClone(p) => self.post_clone_timer(key, &p),
            Op::Classify(c) => self.classify_timer(key, c),
            Op::Check(c) => self.check_timer(key, c),
            Op::Evict(e) => self.evict_timer(key, e),
            Op::Delete(d) => self.delete_timer(key, d),
            Op::Create(c) => self.create_timer(key, *c),
            Op::Hibernate(h) => self.hibernate_timer(key, *h),
            Op::ConfirmHibernated(c) => self.confirm_hibernated_timer(key, c),
            Op::Wake(_) | Op::MacosWatch(_) | Op::ApiDelete(_) => {}
        }
    }
}

#[derive(Debug)]
pub(super) enum Res {
    Cocoon(Answer),
    Lease(Result<Option<String>, LeaseError>),
    Kube(Result<(), KubeError>),
    Transfer(Result<String, TransferError>),
    Evidence(Result<Option<HibernateTag>, TransferError>),
    /// The fork-snapshot flight landed: the snapshot's hypervisor ("" unknown), or why not.
    Fork(Result<String, fork::ForkError>),
    Sac(Result<(), crate::guest::sac::SacError>),
    /// A process liveness check (macOS guests' QEMU).
    Pid(bool),
    /// A VM's hypervisor PID read from its pid file (None: no file or no such process).
    VmPid(crate::vm::PidFile),
    /// A write of the ownership ledger.
    Owners(Result<(), String>),
    /// The host's verdict on a source the pod names.
    Source(SourceVerdict),
}

impl Res {
    /// Which kind of answer this is, for messages.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Res::Cocoon(_) => "cocoon",
            Res::Lease(_) => "lease lookup",
            Res::Kube(_) => "Kubernetes API",
            Res::Transfer(_) => "registry transfer",
            Res::Evidence(_) => "hibernate evidence",
            Res::Fork(_) => "fork snapshot",
            Res::Sac(_) => "SAC pass",
            Res::Pid(_) => "process check",
            Res::VmPid(_) => "pid file",
            Res::Owners(_) => "ownership record",
            Res::Source(_) => "source check",
        }
    }

    /// For steps that accept either a cocoon `image pull` or a MaterialiseImage transfer.
    pub(super) fn transfer_or_cocoon(self) -> Result<String, String> {
        match self {
            Res::Transfer(r) => r.map_err(|e| e.to_string()),
            Res::Cocoon(r) if r.succeeded() => Ok(String::new()),
            Res::Cocoon(r) => Err(r.error_text()),
            other => Err(format!("unexpected result {other:?}")),
        }
    }
}
